"""Numbers from outside (requests, messages, trigger files, records read back from disk) within the range we
accept: one predicate for integers and one for numbers, and their checking forms, which say what is wrong in
one wording ("field 'limit' must be an integer from 1 to 1000, got -3").

JSON has no bool/int distinction we would want: True is refused where an integer is expected (Python's bool is
an int), and so are NaN and the infinities where a number is."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

MAX_STEP = 10**12  # bounds every step number we accept, so arithmetic on it stays exact and small


def bounded_int(value: Any, lo: int, hi: int) -> TypeGuard[int]:
    """A JSON integer (not a bool) within [lo, hi]."""
    return type(value) is int and lo <= value <= hi


def finite_number(value: Any, lo: float, hi: float) -> TypeGuard[float]:
    """A JSON number (not a bool) that is finite and within [lo, hi]."""
    return type(value) in (int, float) and math.isfinite(value) and lo <= value <= hi


def checked_int(value: Any, lo: int, hi: int, what: str) -> int:
    """`value` when bounded_int(value, lo, hi); else ValueError naming `what` (e.g. "field 'limit'")."""
    if not bounded_int(value, lo, hi):
        raise ValueError(f"{what} must be an integer from {lo} to {hi}, got {value!r}")
    return value


def checked_number(value: Any, lo: float, hi: float, what: str) -> float:
    """`value` when finite_number(value, lo, hi); else ValueError naming `what`."""
    if not finite_number(value, lo, hi):
        raise ValueError(f"{what} must be a number from {lo:g} to {hi:g}, got {value!r}")
    return value
