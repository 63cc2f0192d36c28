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
# the tree of a thread's events (thread_tree): a root's parent, and an event left out of the tree (asynchronous)
NO_PARENT, ASYNC = -1, -2
# how far past the event it began in an event may end and still be its child (us): older Kineto traces hold whole
# microseconds, start and duration rounded apart, so a child can end up to 1 us after its parent
NEST_SLACK_US = 1.0


def thread_tree(ts: Sequence[float], dur: Sequence[float]) -> tuple[array, array]:
    """The tree of one thread's events and their self times, in the given order: (parents, selfs).

    parents[i]: the index of the innermost event that encloses event i, NO_PARENT (-1) for a root, or ASYNC (-2) for
    an event left out of the tree. An event that starts inside another and ends after it (a partial overlap, by more
    than NEST_SLACK_US) is not that event's child, nor anyone's parent: it is taken as asynchronous. Operators and
    ranges that run on the thread nest; what overlaps them partly was begun on the thread and ended later, from
    elsewhere: gloo's send/recv work (`gloo:send`, `gloo:recv`) begins at the end of its `c10d::send` / `c10d::recv_`
    and ends at the wait for it, often after the next microbatch's forward on the same thread. torch marks such
    ranges asynchronous and its key_averages() leaves them out of the tree (and never makes a range whose interval
    is only partly inside another its child); a Kineto trace does not say which ranges were asynchronous, so the
    overlap does. Counted as a child, such a range took its whole duration from the operator it began in (issue 44:
    `c10d::send` -2.7 s of self time) and adopted the next microbatch's operators as its own.

    selfs[i]: its duration minus its direct children's (each child's part inside it: a child may end up to
    NEST_SLACK_US past it), the definition of torch's key_averages() self CPU time; an asynchronous event has no
    children, its self time is its duration, as in key_averages(). Children of one event never overlap one
    another, so no self time is negative."""
    n = len(ts)
    parents = array("i", [NO_PARENT]) * n
    selfs = array("d", dur)
    stack: list[tuple[int, float]] = []  # (index, end) of the enclosing events, innermost last
    for i in sorted(range(n), key=lambda i: (ts[i], -dur[i])):
        start = ts[i]
        end = start + dur[i]
        while stack and stack[-1][1] <= start:
            stack.pop()
        if stack:
            p, p_end = stack[-1]
            if end > p_end + NEST_SLACK_US:
                parents[i] = ASYNC
                continue
            parents[i] = p
            selfs[p] -= (end if end < p_end else p_end) - start
        stack.append((i, end))
    return parents, selfs


def thread_parents(ts: Sequence[float], dur: Sequence[float]) -> array:
    """The parent of each event of one thread (thread_tree): an index, NO_PARENT or ASYNC."""
    return thread_tree(ts, dur)[0]


def thread_self_times(ts: Sequence[float], dur: Sequence[float]) -> array:
    """Self time of each event of one thread, in the given order (thread_tree): its duration minus its direct
    children's; shared by the exporter (rank/postprocess.py) and the reports."""
    return thread_tree(ts, dur)[1]
