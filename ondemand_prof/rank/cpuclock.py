"""The rank's CPU over a window: at each step boundary of a recorded window, the CPU time and the run-queue wait (the
time a thread was runnable but waited for a CPU) of the training thread, the CPU of all the process's threads, and
the longest run-queue wait of any one of its other threads (gloo's workers, data loading, OpenMP: the most starved
helper, whose wait stretches a transfer as the training thread's stretches the step; a sum over threads would count
threads waiting side by side many times), from /proc/self/task/TID/schedstat.

A comparison reads these per step (report/compare.py): a rank whose step grew while its threads waited longer for
a CPU, with the same operator calls, was starved (other work on its cores, a CPU quota), not given more work; a
training thread that sleeps most of its step hardly waits, while its collectives' worker threads do.
Cost, at each boundary of a recorded window only (nothing while idle): one pread of a file kept open per thread of
the process (at most MAX_THREADS), the thread list read again every RESCAN boundaries: about 10 us with a few
threads.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

MAX_SAMPLES = 100_000  # boundaries a window keeps (a window is capped far below this; a bound all the same)
MAX_THREADS = 256  # threads of the process read at a boundary
RESCAN = 8  # boundaries between two reads of the process's thread list (a thread started meanwhile counts from then)


def _read(path: str) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as fh:
            fields = fh.read(128).split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None  # a thread that ended meanwhile


class ThreadClock:
    """Per step: the training thread's CPU and run-queue wait, the process's CPU and its other threads' longest
    wait (ns), labelled by the step that begins at each boundary."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tasks = f"/proc/{os.getpid()}/task"
        self.samples: list[tuple[int, int, int, int, int]] = []  # (step, cpu, wait, process cpu, helper wait)
        self._me = str(threading.get_native_id())
        self._threads: dict[str, tuple[int, int]] = {}  # tid -> (cpu, wait) at the last boundary
        self._fds: dict[str, int] = {}  # tid -> its schedstat, open
        try:
            self._fd = os.open(f"{self._tasks}/{threading.get_native_id()}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:  # not Linux, or /proc not mounted: the comparison says it has no CPU figures
            log.debug("no schedstat for the training thread: %s", exc)

    def sample(self, step: int) -> None:
        """At the boundary before `step` (the training thread). Never raises."""
        if self._fd is None or len(self.samples) >= MAX_SAMPLES:
            return
        try:
            fields = os.pread(self._fd, 128, 0).split()
            cpu, wait = int(fields[0]), int(fields[1])
            pcpu, pwait = self._process()
            self.samples.append((step, cpu, wait, pcpu, pwait))
        except (OSError, ValueError, IndexError):
            self.close()

    def _process(self) -> tuple[int, int]:
        """The CPU all threads added since the last boundary (a thread's own delta: one that ended took its counts
        with it, one that began counts from zero), accumulated; and the longest wait any other thread added, also
        accumulated (so that per_step's differences give it per step). The threads' files stay open between
        boundaries (a pread each); the thread list is read again every RESCAN boundaries."""
        if not self._fds or len(self.samples) % RESCAN == 0:
            self._rescan()
        now: dict[str, tuple[int, int]] = {}
        for tid, fd in list(self._fds.items()):
            try:
                fields = os.pread(fd, 128, 0).split()
                now[tid] = (int(fields[0]), int(fields[1]))
            except (OSError, ValueError, IndexError):  # the thread ended
                os.close(self._fds.pop(tid))
        prev = self._threads
        dcpu = sum(c - prev.get(t, (0, 0))[0] for t, (c, _) in now.items())
        dwait = max((w - prev.get(t, (0, 0))[1] for t, (_, w) in now.items() if t != self._me and t in prev),
                    default=0)
        self._threads = now
        last = self.samples[-1] if self.samples else (0, 0, 0, 0, 0)
        return last[3] + dcpu, last[4] + dwait

    def _rescan(self) -> None:
        with os.scandir(self._tasks) as it:
            tids = [entry.name for _, entry in zip(range(MAX_THREADS), it)]
        for tid in tids:
            if tid not in self._fds:
                try:
                    self._fds[tid] = os.open(f"{self._tasks}/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue

    def close(self) -> None:
        for fd in [self._fd, *self._fds.values()]:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd, self._fds = None, {}

    def per_step(self, recorded: list[int]) -> dict[str, Any] | None:
        """{"steps", "cpu_ms", "wait_ms", "proc_cpu_ms", "proc_wait_ms"} for each recorded step whose start and end
        were sampled (the sample after it labels the next step, or the window's end); None without samples.
        proc_wait_ms is the longest run-queue wait of one other thread of the process in the step."""
        self.close()
        at = {}
        for i, cur in enumerate(self.samples[:-1]):
            nxt = self.samples[i + 1]
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
