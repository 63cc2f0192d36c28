"""Ids that come over the wire (capture ids, job ids, triage ids): one rule, checked in one place.

A capture id becomes a file name in the daemon's state directory ({id}.json) and a folder under a rank's save
path; a job id keys records and registrations. Whatever a peer sends, an id is 1 to 128 characters of letters,
digits and `_ . - + @ :`, and does not start with `.` or `-` (so it is never `.`, `..`, a hidden file or an
option), so it can never name a path outside the directory it is put in. What ondemand_prof makes itself
(`20261129-200514-a618f2`, `auto-...-<random>-r0-4242`, `file-...`, SLURM's `123.4`, torchrun's UUIDs, `port29500`)
passes as it is.
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets
import time
from typing import Any, Iterable

MAX_ID = 128
_ID = re.compile(r"[A-Za-z0-9_@+:][A-Za-z0-9_.@+:-]{0,127}")
_NOT_ID = re.compile(r"[^A-Za-z0-9_.@+:-]")


class BadId(ValueError):
    """An id that breaks the rule; the text names what and why."""


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def check_id(value: Any, what: str = "id") -> str:
    """`value` when it is a well-formed id; BadId (a ValueError) saying what is wrong otherwise."""
    if valid_id(value):
        return value
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise BadId(f"{what} {shown}: expected 1-{MAX_ID} letters, digits, '_', '.', '-', '+', '@' or ':', not "
                "starting with '.' or '-'")


def safe_id(text: Any) -> str:
    """An id made from any text for display only (a window another part of the rank named): characters outside
    the rule become '_', cut to MAX_ID; never empty."""
    name = _NOT_ID.sub("_", str(text))[:MAX_ID].lstrip(".-")
    return name or "_"


def id_stamp(wall: float | None = None) -> str:
    """The local time of `wall` (now when None) to the second, as capture ids start: 20261129-200514."""
    return _dt.datetime.fromtimestamp(time.time() if wall is None else wall).strftime("%Y%m%d-%H%M%S")


def capture_id(source: str = "", *parts: object, wall: float | None = None) -> str:
    """The one maker of capture ids. The daemon's (no source): the second of `wall` and 6 random hex digits,
    `20261129-200514-a618f2`. A rank's own, where no daemon named it: the source, then its parts, joined by '-'
    (`file-<trigger version>`, `signal-<pid>-<ms>`, `auto-<stamp>-r<rank>-<pid>`, `static-<job>-<start>-<end>`),
    kept to the id rule (safe_id: a part that breaks it is never a path)."""
    if not source:
        return f"{id_stamp(wall)}-{secrets.token_hex(3)}"
    return safe_id("-".join([source, *(str(p) for p in parts)]))


def automatic_id(kind: str, rank: object, pid: int, wall: float | None = None) -> str:
    """A rank's automatic capture id (`auto`: a slowdown; `baseline`: the job's baseline): the second, 12 random
    hex digits, the rank and its pid, `baseline-20261129-200514-3fa9c1d2e4b7-r0-4242`. The random part makes it
    unpredictable: `baseline-<second>-r0-<pid>` (the pid is public in status) was taken first by another user's
    capture of that id, and the job got no baseline (issue 41, 5)."""
    return capture_id(kind, id_stamp(wall), secrets.token_hex(6), f"r{rank}", pid)


def match_id(given: str, known: Iterable[str], what: str, plural: str | None = None) -> str:
    """`given`, or the one id of `known` it begins (torchrun's job ids are whole UUIDs: their first characters
    are enough). ValueError names the candidates (`plural`: what several are called, `what` + "s" by default)."""
    known = sorted(set(known))
    many = plural or f"{what}s"
    if given in known:
        return given
    matches = [k for k in known if k.startswith(given)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"{given!r} begins {len(matches)} {many} ({', '.join(matches[:8])}"
                         f"{', ...' if len(matches) > 8 else ''}): give more of it")
    raise ValueError(f"no {what} {given!r}; {many}: {', '.join(known[:20]) or 'none'}"
                     f"{', ...' if len(known) > 20 else ''}")
