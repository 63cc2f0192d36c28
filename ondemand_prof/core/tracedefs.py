"""What a Kineto trace's events mean, shared by the exporter (rank/postprocess.py) and the reports (report/):
the step label, the categories of the CPU operator tree and of device work, and the self-time algorithm."""

from __future__ import annotations

import re
from array import array
from typing import Sequence

STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
CPU_TREE_CATS = frozenset({"cpu_op", "user_annotation"})
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# each rank's report, written beside its trace (rank/postprocess.py) and read back by its host's daemon
# (host/summaries.py): with the SUMMARY_TOP operators and kernels that took most time
SUMMARY_FILE = "summary.json"
SUMMARY_TOP = 15


def thread_self_times(ts: Sequence[float], dur: Sequence[float]) -> array:
    """Self time of each event of one thread, in the given order: its duration minus its direct children's.

    The definition of torch's key_averages() self CPU time; shared by this exporter and the reports."""
    selfs = array("d", dur)
    stack: list[tuple[int, float]] = []  # (index, end) of the enclosing events
    for i in sorted(range(len(ts)), key=lambda i: (ts[i], -dur[i])):
        start = ts[i]
        while stack and stack[-1][1] <= start:
            stack.pop()
        if stack:
            selfs[stack[-1][0]] -= dur[i]
        stack.append((i, start + dur[i]))
    return selfs
