"""The rank's CPU over a window (rank/cpuclock.py). Issue 44 item 7: its reads at each boundary of a recorded window
are inside the profiler, and with with_stack torch's Python tracer records each Python call and each built-in
called from Python code as an event, which the window's end collects on the training thread and the save writes.
The clock parsed its reads there, 20-40 events a boundary with 4 threads and more with each thread: 5-9 % of the
window-end stall on a small model. Now a boundary reads only (one traced call) and the reads are parsed after the
window, to the same figures."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ondemand_prof.core.options import WindowOptions
from ondemand_prof.core.window import Window
from ondemand_prof.rank import cpuclock
from ondemand_prof.rank.backends.base import Identity
from ondemand_prof.rank.backends.torch_backend import TorchBackend
from ondemand_prof.rank.cpuclock import ClockedSession, ThreadClock

pytestmark = pytest.mark.quick


def schedstat(cpu: int, wait: int) -> bytes:
    return f"{cpu} {wait} 7\n".encode()


def test_the_reads_give_the_figures_the_clock_computed_at_each_boundary() -> None:
    """Per step: the training thread's CPU and wait, every thread's CPU added (one that ended took its counts with
    it, one that began counts from zero), the longest wait one other thread added."""
    clock = ThreadClock()
    me = clock._me
    clock.close()
    clock._raw = [
        (4, (me, "a"), (schedstat(1_000_000, 0), schedstat(5_000_000, 100_000))),  # primes the threads' counts
        (5, (me, "a"), (schedstat(3_000_000, 500_000), schedstat(6_000_000, 2_100_000))),
        (6, (me, "a", "b"), (schedstat(4_000_000, 500_000), schedstat(6_500_000, 2_100_000),
                             schedstat(2_000_000, 3_000_000))),  # b began: all its counts in step 5
        (7, (me, "b"), (schedstat(7_000_000, 1_500_000), schedstat(2_250_000, 3_400_000))),  # a ended
    ]
    assert clock.samples == [(4, 1_000_000, 0, 6_000_000, 0), (5, 3_000_000, 500_000, 9_000_000, 2_000_000),
                             (6, 4_000_000, 500_000, 12_500_000, 2_000_000),
                             (7, 7_000_000, 1_500_000, 15_750_000, 2_400_000)]
    assert clock.per_step([5, 6]) == {"steps": [5, 6], "cpu_ms": [1.0, 3.0], "wait_ms": [0.0, 1.0],
                                      "proc_cpu_ms": [3.5, 3.25], "proc_wait_ms": [0.0, 0.4]}
    assert clock.per_step([4]) == {"steps": [4], "cpu_ms": [2.0], "wait_ms": [0.5], "proc_cpu_ms": [3.0],
                                   "proc_wait_ms": [2.0]}
    clock._raw.append((8, (me,), (b"garbage",)))  # a read that does not parse ends the samples there
    assert [s[0] for s in clock.samples] == [4, 5, 6, 7]


def reference(me: str, reads: list[tuple[int, dict[str, tuple[int, int]]]]) -> list[tuple[int, int, int, int, int]]:
    """The clock's figures as it computed them at each boundary before issue 44 item 7 (ThreadClock._process)."""
    out, prev, last = [], {}, (0, 0, 0, 0, 0)  # type: ignore[var-annotated]
    for step, now in reads:
        dcpu = sum(c - prev.get(t, (0, 0))[0] for t, (c, _) in now.items())
        dwait = max((w - prev.get(t, (0, 0))[1] for t, (_, w) in now.items() if t != me and t in prev), default=0)
        prev = now
        last = (step, now[me][0], now[me][1], last[3] + dcpu, last[4] + dwait)
        out.append(last)
    return out


def test_the_figures_are_those_the_clock_computed_at_each_boundary_whatever_the_threads_do() -> None:
    rng = random.Random(44)
    clock = ThreadClock()
    me = clock._me
    clock.close()
    for _ in range(50):
        counts = {me: [0, 0], **{str(t): [rng.randrange(10**9), rng.randrange(10**9)] for t in range(5)}}
        reads, tids = [], (me, *[t for t in counts if t != me])
        clock._raw = []
        for step in range(rng.randrange(1, 30)):
            if rng.random() < 0.2:  # a thread ends, another begins: the list read again
                counts.pop(rng.choice([t for t in counts if t != me] or [me]), None)
                counts.setdefault(me, [0, 0])
                counts[str(rng.randrange(100, 10**6))] = [rng.randrange(10**6), rng.randrange(10**6)]
                tids = (me, *[t for t in counts if t != me])
            for c in counts.values():
                c[0] += rng.randrange(10**7)
                c[1] += rng.randrange(10**6)
            now = {t: (counts[t][0], counts[t][1]) for t in tids}
            reads.append((step, now))
            clock._raw.append((step, tids, tuple(schedstat(*now[t]) for t in tids)))
        assert clock.samples == reference(me, reads)


def test_a_thread_that_ends_between_boundaries_is_left_out_and_sampling_goes_on() -> None:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    clock = ThreadClock()
    assert str(helper.native_id) in clock._tids
    clock.sample(0)
    stop.set()
    helper.join()
    gone = Path(f"/proc/self/task/{helper.native_id}")
    deadline = time.monotonic() + 10
    while gone.exists() and time.monotonic() < deadline:  # (join returns a moment before the kernel lets it go)
        time.sleep(0.001)
    clock.sample(1)  # the helper's file reads ESRCH: read one by one, without it
    assert str(helper.native_id) not in clock._tids
    clock.sample(2)
    out = clock.per_step([0, 1])
    assert out is not None and out["steps"] == [0, 1] and all(x >= 0 for x in out["proc_cpu_ms"])


def identity() -> Identity:
    return Identity(rank=0, world_size=1, local_rank=0, host="h", pid=1, job_id="j")


def python_events_in(trace: Path, where: list[tuple[float, float]]) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "python_function"
            and any(t0 <= e["ts"] and e["ts"] + e.get("dur", 0) <= t1 for t0, t1 in where)]


def test_a_boundary_of_a_window_with_stacks_adds_one_traced_call(tmp_path: Path) -> None:
    """A real window with with_stack: what the trace holds inside the clock's samples is the sample calls, the
    thread list read again every RESCAN boundaries, and nothing else (the old clock: 20-40 events a boundary)."""
    stop = threading.Event()
    helpers = [threading.Thread(target=stop.wait) for _ in range(4)]  # a rank's other threads, read each boundary
    for t in helpers:
        t.start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
    square = torch.randn(128, 128)
    window = Window(0, 12, WindowOptions(with_stack=True, record_shapes=True), source="test", capture_id="t")
    session = ClockedSession(TorchBackend().open(window, identity()))
    try:
        for step in range(12):
            session.record(step)
            model(torch.randn(4, 32)).sum().backward()
            busy = time.thread_time() + 0.005  # CPU of its own: schedstat's run time moves at the scheduler's ticks
            while time.thread_time() < busy:
                torch.mm(square, square)
        session.finish()
    finally:
        stop.set()
        for t in helpers:
            t.join()
    trace = tmp_path / "t.json"
    session.session._prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    samples = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "python_function" and e["name"].endswith(": sample")]
    assert len(samples) == 12 + 2  # each boundary, the priming one and the window's end
    inside = python_events_in(trace, samples)
    rescans = [n for n in inside if n.endswith(": _rescan")]
    assert len(rescans) == 2  # the first sample and the ninth (the files were opened before the profiler started)
    # at a rescan: the list read, and a thread started since (kineto's, at start_trace) has its file opened
    others = [n for n in inside if not n.endswith((": sample", ": _rescan", ": <listcomp>", ": _set_order"))
              and "listdir" not in n and "function open>" not in n]
    assert others == [], f"{len(others)} calls traced inside the clock's samples: {others[:12]} ..."
    opened = sum("function open>" in n for n in inside)
    assert opened <= 2 and len(inside) <= len(samples) + 4 * len(rescans) + opened, inside[:40]
    figures: Any = session.clock.per_step(list(range(12)))
    assert figures["steps"] == list(range(12)) and sum(figures["cpu_ms"]) >= 30
    assert all(p >= c >= 0 for p, c in zip(figures["proc_cpu_ms"], figures["cpu_ms"]))
    assert cpuclock.RESCAN == 8
