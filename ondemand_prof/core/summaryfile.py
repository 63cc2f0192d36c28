"""A rank's summary.json, read as every reader must: the daemon for `summaries` and `compare`, and a comparison of
capture folders on this host (report/sources.py), which reads summaries rather than traces where they hold it."""

from __future__ import annotations

import os
from typing import Any

from . import safejson
from .rootpath import read_beneath_root
from .tracedefs import SUMMARY_FILE

MAX_SUMMARY_BYTES = 512 * 1024


def read_summary(rank_dir: str, owner: int | None = None) -> dict[str, Any]:
    """A rank's summary.json: reached without following a symbolic link anywhere on the way (a directory the
    rank reported can be swapped for a link after the report), a regular file of the rank's uid (`owner`), at
    most MAX_SUMMARY_BYTES, a JSON object read by the bounded reader (nesting, numbers: core/safejson.py; the
    rank wrote it, and json.loads recursed on "[[[..." and took NaN). OSError/ValueError say why not."""
    if not os.path.isabs(rank_dir):
        raise ValueError(f"not an absolute path: {rank_dir!r}")
    raw = read_beneath_root(os.path.join(rank_dir, SUMMARY_FILE), owner, MAX_SUMMARY_BYTES + 1)
    if len(raw) > MAX_SUMMARY_BYTES:
        raise ValueError(f"{SUMMARY_FILE} is over {MAX_SUMMARY_BYTES} bytes, the limit")
    data = safejson.loads(raw, MAX_SUMMARY_BYTES)
    if not isinstance(data, dict):
        raise ValueError(f"{SUMMARY_FILE} does not hold a JSON object")
    return data
