"""The rank's CPU over a window: at each step boundary of a recorded window, the CPU time and the run-queue wait (the
time a thread was runnable but waited for a CPU) of the training thread, the CPU of all the process's threads, and
the longest run-queue wait of any one of its other threads (gloo's workers, data loading, OpenMP: the most starved
helper, whose wait stretches a transfer as the training thread's stretches the step; a sum over threads would count
threads waiting side by side many times), from /proc/self/task/TID/schedstat.

A comparison reads these per step (report/compare.py): a rank whose step grew while its threads waited longer for
a CPU, with the same operator calls, was starved (other work on its cores, a CPU quota), not given more work; a
training thread that sleeps most of its step hardly waits, while its collectives' worker threads do.

Cost. A boundary of a recorded window is inside the profiler, and with with_stack torch's Python tracer records
every Python call and every call of a built-in from Python code, each an event that the window's end collects
(stop_trace, on the training thread) and the save writes. So a boundary only reads: one pread of each thread's
file, kept open (at most MAX_THREADS; the thread list read again every RESCAN boundaries), made by map() inside a
tuple() (calls made from C are not traced), the bytes kept as read; they are parsed after the window (per_step).
That is one traced call a boundary (sample), two at a rescan, where the parse at each boundary was 20-40 calls
with 4 threads and more with each thread (issue 44 item 7: 5-9 % of the window-end stall on a small model).
Nothing is read while idle.
"""

from __future__ import annotations

import logging
import os
import threading
from itertools import repeat
from operator import sub
from typing import Any

log = logging.getLogger(__name__)

MAX_SAMPLES = 100_000  # boundaries a window keeps (a window is capped far below this; a bound all the same)
MAX_THREADS = 256  # threads of the process read at a boundary
RESCAN = 8  # boundaries between two reads of the process's thread list (a thread started meanwhile counts from then)
_READ = 128  # bytes of a schedstat file read (three numbers)


class ThreadClock:
    """Per step: the training thread's CPU and run-queue wait, the process's CPU and its other threads' longest
    wait (ns), labelled by the step that begins at each boundary."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tasks = f"/proc/{os.getpid()}/task"
        # per boundary, as read: (step, thread ids, their schedstat bytes); the training thread first in both
        self._raw: list[tuple[int, tuple[str, ...], tuple[bytes, ...]]] = []
        self._me = str(threading.get_native_id())
        self._fds: dict[str, int] = {}  # tid -> its schedstat, open (the training thread's too)
        self._tids: tuple[str, ...] = ()  # the order read, the training thread first
        self._order: tuple[int, ...] = ()  # their descriptors, in that order
        self._countdown = 0  # boundaries until the thread list is read again
        self._left = MAX_SAMPLES  # (counted down: len() would be one more traced call a boundary)
        try:
            self._fd = os.open(f"{self._tasks}/{self._me}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:  # not Linux, or /proc not mounted: the comparison says it has no CPU figures
            log.debug("no schedstat for the training thread: %s", exc)
            return
        self._fds[self._me] = self._fd
        self._tids, self._order = (self._me,), (self._fd,)
        self._rescan()  # the threads' files opened now, before the profiler records (the first boundary looks again)
        self._countdown = 0

    @property
    def samples(self) -> list[tuple[int, int, int, int, int]]:
        """(step, cpu, wait, process cpu, helper wait) at each boundary, accumulated (ns): parsed from the reads."""
        return self._parse()

    def sample(self, step: int) -> None:
        """At the boundary before `step` (the training thread). Never raises. Traced calls: this one, and at a
        rescan _rescan (module docstring)."""
        if self._fd is None or self._left <= 0:
            return
        self._left -= 1
        if self._countdown <= 0:
            self._rescan()
        self._countdown -= 1
        try:
            self._raw += ((step, self._tids, tuple(map(os.pread, self._order, repeat(_READ), repeat(0)))),)
        except OSError:  # a thread ended: read one by one, without it
            self._sample_slowly(step)

    def _sample_slowly(self, step: int) -> None:
        raws = []
        for tid in self._tids:
            try:
                raws.append(os.pread(self._fds[tid], _READ, 0))
            except OSError:
                if tid == self._me:  # the training thread's own file: no more samples
                    self.close()
                    return
                os.close(self._fds.pop(tid))
        self._set_order()
        self._raw.append((step, self._tids, tuple(raws)))

    def _rescan(self) -> None:
        self._countdown = RESCAN
        try:
            tids = os.listdir(self._tasks)[:MAX_THREADS]
        except OSError:
            return
        new = [tid for tid in tids if tid not in self._fds]
        if not new:
            return
        for tid in new:
            try:
                self._fds[tid] = os.open(f"{self._tasks}/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
        self._set_order()

    def _set_order(self) -> None:
        others = tuple(filter(self._me.__ne__, self._fds))  # (map and filter: no traced call a thread)
        self._tids = (self._me, *others) if self._me in self._fds else others
        self._order = tuple(map(self._fds.__getitem__, self._tids))

    def _parse(self) -> list[tuple[int, int, int, int, int]]:
        """The reads as (step, cpu, wait, process cpu, helper wait): the process's CPU is what all threads added
        since the previous boundary (a thread's own delta: one that ended took its counts with it, one that began
        counts from zero), accumulated; the helper wait is the longest wait any other thread added, also
        accumulated (so that per_step's differences give both per step). A read that does not parse ends the
        samples there. Parsed by C loops (join, split, map) where the threads are those of the boundary before:
        this runs in the window-end step, after collection, and a node's process can have a hundred threads."""
        out: list[tuple[int, int, int, int, int]] = []
        prev: tuple[str, ...] = ()
        prev_cpu: list[int] = []
        prev_wait: list[int] = []
        pcpu = pwait = 0
        for step, tids, raws in self._raw:
            fields = b" ".join(raws).split()
            if not tids or tids[0] != self._me or len(fields) != 3 * len(tids):  # schedstat: three numbers
                break
            try:
                cpus, waits = list(map(int, fields[0::3])), list(map(int, fields[1::3]))
            except ValueError:
                break
            if tids == prev:  # the same threads as at the boundary before (the common case)
                pcpu += sum(map(sub, cpus, prev_cpu))
                pwait += max(map(sub, waits[1:], prev_wait[1:]), default=0)
            else:
                before = dict(zip(prev, zip(prev_cpu, prev_wait)))
                pcpu += sum(c - before.get(t, (0, 0))[0] for t, c in zip(tids, cpus))
                pwait += max((w - before[t][1] for t, w in zip(tids[1:], waits[1:]) if t in before), default=0)
            prev, prev_cpu, prev_wait = tids, cpus, waits
            out.append((step, cpus[0], waits[0], pcpu, pwait))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd, self._fds, self._tids, self._order = None, {}, (), ()

    def per_step(self, recorded: list[int]) -> dict[str, Any] | None:
        """{"steps", "cpu_ms", "wait_ms", "proc_cpu_ms", "proc_wait_ms"} for each recorded step whose start and end
        were sampled (the sample after it labels the next step, or the window's end); None without samples.
        proc_wait_ms is the longest run-queue wait of one other thread of the process in the step."""
        self.close()
        samples = self._parse()
        at = {}
        for i, cur in enumerate(samples[:-1]):
            nxt = samples[i + 1]
            at[cur[0]] = tuple((nxt[j] - cur[j]) / 1e6 for j in range(1, 5))
        steps = [s for s in recorded if s in at]
        if not steps:
            return None
        out: dict[str, Any] = {"steps": steps}
        for j, key in enumerate(("cpu_ms", "wait_ms", "proc_cpu_ms", "proc_wait_ms")):
            out[key] = [round(max(0.0, at[s][j]), 3) for s in steps]
        return out


class ClockedSession:
    """A backend's session (rank/backends/base.py) with the rank's clock sampled at each recorded boundary and at
    the end of the window."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.clock = ThreadClock()
        self._last = -1

    def warmup(self, step: int) -> None:
        self.session.warmup(step)

    def record(self, step: int) -> None:
        self.session.record(step)
        if self._last < 0:
            self.clock.sample(step - 1)  # (primes the threads' counts: the first step's own sample follows)
        self.clock.sample(step)
        self._last = step

    def finish(self) -> Any:
        self.clock.sample(self._last + 1)  # the end of the last recorded step
        return self.session.finish()

    def abort(self) -> None:
        self.clock.close()
        self.session.abort()
