"""Capture requests: the fields a trigger file, a daemon message or a CLI flag may carry, and their checks.

Pure: validates a mapping and returns a CaptureRequest, or raises RequestError with a message a person can
act on. Shared by the file trigger, the signal trigger and the daemon protocol so the three accept exactly
the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .config import EXPORT_TYPES, LEVELS, ProfileConfig
from .window import OPTION_FIELDS, WindowOptions, parse_rank_spec

BOOL_OPTIONS = ("with_cpu", "with_stack", "with_memory", "record_shapes", "data_simplification")
REQUEST_FIELDS = ("start", "steps", "start_step", "ranks", "id", *OPTION_FIELDS)
MAX_START_OFFSET = 1_000_000


class RequestError(ValueError):
    pass


@dataclass(frozen=True)
class CaptureRequest:
    """A window relative to now (start steps from the current step) or absolute (start_step)."""

    steps: int
    start: int | None = None  # steps from now; None with start_step
    start_step: int | None = None
    ranks: tuple[int, ...] | None = None  # None: the configuration's ranks
    options: Mapping[str, Any] = field(default_factory=dict)  # overrides of the configuration's options
    request_id: str = ""
    capped_from: int | None = None

    def window_options(self, config: ProfileConfig) -> WindowOptions:
        return WindowOptions.from_config(config, **self.options)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.steps}
        if self.start is not None:
            out["start"] = self.start
        if self.start_step is not None:
            out["start_step"] = self.start_step
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        out.update(self.options)
        if self.request_id:
            out["id"] = self.request_id
        if self.capped_from is not None:
            out["capped_from"] = self.capped_from
        return out


def _int(data: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    if key not in data or data[key] is None:
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        else:
            raise RequestError(f"field {key!r} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(f"field {key!r} must be between {lo} and {hi}, got {value}")
    return value


def parse_request(data: Mapping[str, Any] | None, config: ProfileConfig) -> CaptureRequest:
    """Validate a request; an empty one is the configuration's default on-demand window."""
    data = dict(data or {})
    unknown = sorted(set(data) - set(REQUEST_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(REQUEST_FIELDS)}")
    steps = _int(data, "steps", 1, 10**9)
    start = _int(data, "start", 0, MAX_START_OFFSET)
    start_step = _int(data, "start_step", 0, 10**12)
    if start is not None and start_step is not None:
        raise RequestError("give either 'start' (steps from now) or 'start_step' (absolute), not both")
    if start is None and start_step is None:
        start = 1
    steps = config.ondemand_steps if steps is None else steps
    capped_from = None
    if steps > config.max_window_steps:
        capped_from, steps = steps, config.max_window_steps
    ranks = None
    if data.get("ranks") is not None:
        try:
            ranks = parse_rank_spec(data["ranks"])
        except ValueError as exc:
            raise RequestError(f"field 'ranks': {exc}") from None
    options: dict[str, Any] = {}
    for key in BOOL_OPTIONS:
        if key in data and data[key] is not None:
            if not isinstance(data[key], bool):
                raise RequestError(f"field {key!r} must be true or false, got {data[key]!r}")
            options[key] = data[key]
    for key, choices in (("level", LEVELS), ("export_type", EXPORT_TYPES)):
        if key in data and data[key] is not None:
            if data[key] not in choices:
                raise RequestError(f"field {key!r} must be one of {', '.join(choices)}, got {data[key]!r}")
            options[key] = data[key]
    request_id = data.get("id") or ""
    if not isinstance(request_id, str) or len(request_id) > 128:
        raise RequestError("field 'id' must be a string of at most 128 characters")
    return CaptureRequest(steps=steps, start=start, start_step=start_step, ranks=ranks, options=options,
                          request_id=request_id, capped_from=capped_from)


def absolute_start(request: CaptureRequest, anchor_step: int) -> int:
    """The absolute first step of a request, `anchor_step` being the step running when it was made."""
    if request.start_step is not None:
        return request.start_step
    assert request.start is not None
    return anchor_step + request.start
