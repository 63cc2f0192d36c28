"""The one rank grammar, for flags, YAML, env vars, trigger files, daemon requests and the CLI.

    3   "3"   "0-3,8"   "0 1"   [0, "2-3"]   -1   "-1"   "0,-1"

-1 anywhere means every rank (MindSpeed compares the whole list to [-1]; we do not make users learn that).
Ranges are bounded before they are expanded, so "0-20000000" is an error, not 5 GB of integers.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

ALL = -1
MAX_RANK = 1 << 20  # larger than any job (the biggest run today is ~10^5 ranks)
MAX_LISTED = 1 << 16  # ranks one spec may list or expand to; -1 says "all" in one item


class RankSpecError(ValueError):
    """A rank list that cannot be used; the message names the bad part."""


def parse_ranks(spec: Any, world_size: int | None = None) -> tuple[int, ...]:
    """'0-3,7' / [0, 1] / -1 -> sorted-as-given unique ranks; (-1,) means all.

    `world_size`, when known, bounds the ranks (a rank at or beyond it names nothing)."""
    items = _items(spec)
    if not items:
        raise RankSpecError("no ranks given")
    limit = MAX_RANK if world_size is None else world_size
    ranks: list[int] = []
    for item in items:
        lo, hi = _span(item)
        if lo == ALL:
            return (ALL,)
        if hi >= limit:
            where = f"world size {world_size}" if world_size is not None else f"the limit {MAX_RANK}"
            raise RankSpecError(f"rank {hi} is out of range (ranks are 0 to {limit - 1}; {where})")
        if len(ranks) + hi - lo + 1 > MAX_LISTED:
            raise RankSpecError(f"too many ranks listed (at most {MAX_LISTED}; use -1 for all)")
        ranks.extend(range(lo, hi + 1))
    return tuple(dict.fromkeys(ranks))


def _items(spec: Any) -> list[Any]:
    if isinstance(spec, bool):
        raise RankSpecError(f"bad rank {spec!r}")
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, str):
        return [p for p in spec.replace(" ", ",").split(",") if p.strip()]
    if isinstance(spec, (list, tuple)):
        out: list[Any] = []
        for item in spec:
            out.extend(_items(item) if isinstance(item, str) else [item])
        return out
    raise RankSpecError(f"bad rank list {spec!r}: expected a list, a string like 0-3,7, or -1 for all")


def _span(item: Any) -> tuple[int, int]:
    if isinstance(item, bool) or not isinstance(item, (int, str)):
        raise RankSpecError(f"bad rank {item!r}")
    if isinstance(item, int):
        return _check(item), item
    text = item.strip()
    if "-" in text[1:]:
        lo, _, hi = text.partition("-") if not text.startswith("-") else (text, "", "")
        if not (lo.isdigit() and hi.isdigit()) or len(lo) > 9 or len(hi) > 9 or int(hi) < int(lo):
            raise RankSpecError(f"bad rank range {text!r}: expected LOW-HIGH with 0 <= LOW <= HIGH")
        return int(lo), int(hi)
    if not text.lstrip("-").isdigit() or len(text) > 10:
        raise RankSpecError(f"bad rank {text!r}: expected an integer, a range like 0-7, or -1 for all")
    value = int(text)
    return _check(value), value


def _check(rank: int) -> int:
    if rank < ALL:
        raise RankSpecError(f"bad rank {rank}: expected >= 0, or -1 for all")
    return rank


def selects(ranks: Sequence[int], rank: int) -> bool:
    return ALL in ranks or rank in ranks


def spans(ranks: Iterable[int]) -> str:
    """[0,1,2,5] -> '0-2,5'; (-1,) -> 'all'."""
    values = sorted(set(ranks))
    if ALL in values:
        return "all"
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)
