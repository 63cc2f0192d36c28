"""JSON from people and peers we do not trust: bounded size, bounded nesting, finite numbers only.

Python's json module recurses once per nesting level (60 KB of "[" raises RecursionError, which is not a
ValueError), accepts NaN and Infinity, turns 1e400 into inf, and raises a plain ValueError for integers of more
than 4300 digits. Every decode path (daemon, rank link, CLI, trigger file) goes through loads() here, which turns
all of these into UnsafeJSON with a message a person can act on.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

MAX_DEPTH = 64  # no message or trigger of ours nests more than a few levels
MAX_INT_DIGITS = 30  # larger than any step, pid or byte count; smaller than anything slow to convert
# a JSON string: the unrolled form of "(?:[^"\\]|\\.)*", the same strings, matched without one alternation a character
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class UnsafeJSON(ValueError):
    """Text that is not JSON we accept; the message says why."""


def _constant(name: str) -> Any:
    raise UnsafeJSON(f"non-finite number {name} is not accepted")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UnsafeJSON(f"number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise UnsafeJSON(f"integer of {len(text)} digits is out of range")
    return int(text)


_DECODER = json.JSONDecoder(parse_constant=_constant, parse_float=_float, parse_int=_int)
# Text with no run of more than MAX_INT_DIGITS digits and no exponent of three digits holds no number the hooks
# above refuse: every integer is short and every float below 1e130, finite. Such text (every message of ours) is
# parsed by json's C number parsers, which give the same values; the Python hooks were a call per number.
_PLAIN = json.JSONDecoder(parse_constant=_constant)
# (both forms start at a digit: a JSON exponent always follows one; the regex then tries only at digits)
_LONG_NUMBER = re.compile(r"[0-9](?:[0-9]{%d}|[eE][+-]?[0-9]{3})" % MAX_INT_DIGITS)
# a \uD800-\uDFFF escape: half of a surrogate pair (json joins a valid pair into one character) or a lone one,
# which no UTF-8 output can hold: stored, it made every ondemandctl that printed it fail, for every user
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def nesting_depth(raw: bytes, stop_at: int = MAX_DEPTH) -> int:
    """How deeply arrays and objects nest in `raw` (strings skipped); 0 when it has too few brackets to nest
    deeper than stop_at.

    Cheap: a message with fewer brackets than the limit is not scanned at all; otherwise strings are removed
    and the running depth of the brackets left is summed in C (a Python loop over them was most of the cost of
    a 56 KiB stacks answer)."""
    if raw.count(b"[") + raw.count(b"{") <= stop_at:
        return 0
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def holds_lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value (bounded depth) holds a string with a lone surrogate, which no UTF-8 output
    can print (json joins a valid pair into one character, so any surrogate left in a str is lone)."""
    if isinstance(value, str):
        return not value.isascii() and any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(holds_lone_surrogate(k) or holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(holds_lone_surrogate(v) for v in value)
    return False


def loads(raw: bytes | str, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse untrusted JSON; UnsafeJSON (a ValueError) for anything we do not take. Only UTF-8 is taken (what
    every writer of ours sends; the depth scan reads UTF-8: in UTF-16 an escaped quote hid brackets from it), and
    no string may hold a lone surrogate."""
    try:
        data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
        if data.startswith(b"\xef\xbb\xbf"):  # a byte-order mark, as some editors write a trigger file
            data = data[3:]
        text = data.decode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:
        raise UnsafeJSON(f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    if len(data) > max_bytes:
        raise UnsafeJSON(f"{len(data)} bytes is over the limit of {max_bytes}")
    if nesting_depth(data, max_depth) > max_depth:
        raise UnsafeJSON(f"nested deeper than {max_depth} levels")
    try:
        # json.loads(data, **hooks) would build a decoder per call: a third of the daemon's cost of an event
        value = (_DECODER if _LONG_NUMBER.search(text) else _PLAIN).decode(text)
    except UnsafeJSON:
        raise
    except RecursionError:  # the depth scan makes this unreachable; kept so nothing escapes as a crash
        raise UnsafeJSON("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise UnsafeJSON(f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:
        raise UnsafeJSON(f"not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text) and holds_lone_surrogate(value):
        raise UnsafeJSON("a string holds a lone UTF-16 surrogate (\\uD800-\\uDFFF without its pair), which no text "
                         "output can print")
    return value
