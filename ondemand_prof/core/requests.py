"""Capture requests: what a trigger file, a signal or `ondemandctl capture` may ask for, checked once, and
resolved once into a Window where the window is planned (the daemon for ondemandctl, the rank itself for a
trigger file or a signal).

    parse_request(data)          shape and bounds of what was asked (no configuration needed)
    WindowDefaults               what a rank's configuration fills in: options, default length, length cap
    resolve(request, defaults, start, ...)   -> Window with absolute steps, full options, the cap applied and said

The window options a request may set are the table's (core/options.py: Option.window), never a path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .ids import check_id
from .bounds import MAX_STEP, bounded_int
from .options import OPTIONS, ConfigError, Option, WindowOptions, window_options
from .ranks import RankSpecError, parse_ranks, selects
from .triagedefs import ACTIONS as TRIAGE_ACTIONS
from .window import Window, _step

MAX_START_OFFSET = 1_000_000
MAX_REQUEST_STEPS = 1_000_000_000
MAX_ID_CHARS = 128
ACTIONS = ("capture", *TRIAGE_ACTIONS)  # what a trigger file may ask for


class RequestError(ValueError):
    """A request that cannot be taken; the message is for the person who sent it."""


@dataclass(frozen=True)
class CaptureRequest:
    """A window relative to now (start steps from the current step) or absolute (start_step), as asked."""

    steps: int | None = None  # None: the rank's default on-demand length
    start: int | None = None  # steps from now; None with start_step
    start_step: int | None = None
    ranks: tuple[int, ...] | None = None  # None: the configuration's ranks
    options: Mapping[str, Any] = field(default_factory=dict)  # overrides of the configuration's window options
    request_id: str = ""
    action: str = "capture"

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("steps", self.steps), ("start", self.start),
                                                 ("start_step", self.start_step)) if v is not None}
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        out.update(self.options)
        if self.request_id:
            out["id"] = self.request_id
        if self.action != "capture":
            out["action"] = self.action
        return out


def request_fields(options: tuple[Option, ...] = OPTIONS) -> tuple[str, ...]:
    return ("start", "steps", "start_step", "ranks", "id", "action", *(o.name for o in window_options(options)))


def _int(data: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_STEP:
        value = int(value)
    if not bounded_int(value, lo, hi):  # two wordings: the wrong type, or out of range
        if type(value) is not int:
            raise RequestError(f"field {key!r} must be an integer, got {value!r}")
        raise RequestError(f"field {key!r} must be between {lo} and {hi}, got {value}")
    return value


def check_options(data: Mapping[str, Any], *, complete: bool = False,
                  options: tuple[Option, ...] = OPTIONS) -> dict[str, Any]:
    """The window options in `data`, each checked strictly (JSON types); `complete`: every one must be there."""
    out: dict[str, Any] = {}
    for opt in window_options(options):
        if data.get(opt.name) is None:
            if complete:
                raise RequestError(f"window options lack {opt.name!r}")
            continue
        try:
            out[opt.name] = opt.value(data[opt.name], f"field {opt.name!r}", strict=True)
        except ConfigError as exc:
            accepted = str(exc).split(": expected ", 1)[-1]
            raise RequestError(f"field {opt.name!r} must be {accepted}, got {data[opt.name]!r}") from None
    return out


def parse_request(data: Mapping[str, Any] | None, options: tuple[Option, ...] = OPTIONS) -> CaptureRequest:
    """Check what was asked; an empty request is the configuration's default on-demand window."""
    data = dict(data or {})
    accepted = request_fields(options)
    unknown = sorted(set(data) - set(accepted), key=str)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(accepted)}")
    steps = _int(data, "steps", 1, MAX_REQUEST_STEPS)
    start = _int(data, "start", 0, MAX_START_OFFSET)
    start_step = _int(data, "start_step", 0, MAX_STEP)
    if start is not None and start_step is not None:
        raise RequestError("give either 'start' (steps from now) or 'start_step' (absolute), not both")
    if start is None and start_step is None:
        start = 1
    ranks = None
    if data.get("ranks") is not None:
        try:
            ranks = parse_ranks(data["ranks"])
        except RankSpecError as exc:
            raise RequestError(f"field 'ranks': {exc}") from None
    request_id = data.get("id") or ""
    if not isinstance(request_id, str) or len(request_id) > MAX_ID_CHARS:
        raise RequestError(f"field 'id' must be a string of at most {MAX_ID_CHARS} characters")
    action = data.get("action") or "capture"
    if action not in ACTIONS:
        raise RequestError(f"field 'action' must be one of {', '.join(ACTIONS)}, got {action!r}")
    return CaptureRequest(steps=steps, start=start, start_step=start_step, ranks=ranks,
                          options=check_options(data, options=options), request_id=request_id, action=action)


@dataclass(frozen=True)
class WindowDefaults:
    """What a rank's configuration fills into a request: its window options, default length and length cap.
    Ranks send these at registration, so the daemon resolves a request exactly as the rank would."""

    options: Any
    steps: int
    max_steps: int
    ranks: tuple[int, ...] = (-1,)  # the ranks a request naming none captures (--profile-ondemand-ranks)

    @classmethod
    def from_config(cls, config: Any) -> "WindowDefaults":
        return cls(WindowOptions.from_config(config), config.ondemand_steps, config.max_window_steps,
                   tuple(config.ondemand_ranks))

    def selects(self, rank: int) -> bool:
        """Whether a request that names no ranks captures `rank` (a touch, or ondemandctl without --ranks)."""
        return selects(self.ranks, rank)

    def to_wire(self) -> dict[str, Any]:
        return {"options": asdict(self.options), "steps": self.steps, "max_steps": self.max_steps,
                "ranks": list(self.ranks)}

    @classmethod
    def from_wire(cls, data: Any) -> "WindowDefaults":
        """RequestError when malformed."""
        if not isinstance(data, Mapping):
            raise RequestError("window defaults must be an object")
        steps = _int(data, "steps", 1, 1_000_000)
        max_steps = _int(data, "max_steps", 1, 1_000_000)
        if steps is None or max_steps is None:
            raise RequestError("window defaults need 'steps' and 'max_steps'")
        options = data.get("options")
        try:  # a rank of an older version sends none: all ranks, as ondemandctl always took
            ranks = parse_ranks(data["ranks"]) if data.get("ranks") is not None else (-1,)
        except RankSpecError as exc:
            raise RequestError(f"window defaults: ranks: {exc}") from None
        return cls(WindowOptions(**check_options(options if isinstance(options, Mapping) else {}, complete=True)),
                   steps, max_steps, ranks)


def resolve(request: CaptureRequest, defaults: WindowDefaults, start: int, *, source: str, capture_id: str,
            extra: Mapping[str, Any] | None = None, configured: bool = False) -> Window:
    """The one place a request becomes a window: the default length, the cap (said in the note), the options.
    `configured`: the configuration's own static window (--profile-step-start/--profile-step-end): the length set
    there is kept (the cap is for windows asked at run time), steps None is a window with no end (until close()),
    and what was asked is `extra` alone (the two flags)."""
    options = WindowOptions(**{**asdict(defaults.options), **request.options})
    if configured:
        end = None if request.steps is None else start + request.steps
        return Window(start, end, options, source=source, capture_id=capture_id, requested=dict(extra or {}))
    asked = defaults.steps if request.steps is None else request.steps
    steps = min(asked, defaults.max_steps)
    note = f"steps capped from {asked} to {steps} (--profile-max-window-steps)" if steps < asked else ""
    return Window(start, start + steps, options, source=source, capture_id=capture_id,
                  requested={**request.as_dict(), **(extra or {})}, note=note)


def absolute_start(request: CaptureRequest, anchor_step: int) -> int:
    """The absolute first step of a request, `anchor_step` being the step running when it was made."""
    if request.start_step is not None:
        return request.start_step
    assert request.start is not None
    return anchor_step + request.start


MAX_WIRE_STEPS = 1_000_000  # a planned window's length (the options' own caps are lower: bounded here too)


def window_from_wire(data: Mapping[str, Any]) -> Window:
    """A window planned elsewhere (the daemon): checked for shape and bounds, not planned again.
    ValueError says what is wrong."""
    start, end = data.get("start_step"), data.get("end_step")
    if not _step(start) or not _step(end) or end <= start or end - start > MAX_WIRE_STEPS:
        raise ValueError(f"bad window steps [{str(start)[:30]}, {str(end)[:30]})")
    capture_id = check_id(data.get("capture_id"), "capture id")  # a folder under the save root, a record's file
    try:
        options = check_options(data.get("options") or {}, complete=True)
    except RequestError as exc:
        raise ValueError(str(exc)) from None
    requested = data.get("requested") or {}
    note = data.get("note") or ""
    if not isinstance(requested, Mapping) or not isinstance(note, str):
        raise ValueError("bad window: 'requested' must be an object and 'note' a string")
    return Window(start, end, WindowOptions(**options), source=str(data.get("source") or "daemon")[:32],
                  capture_id=capture_id, requested=dict(requested), note=note[:512])
