"""How long each way of writing a trace keeps the GIL from the training thread (issues 14 and 20).

    python bench/bench_gil_probe.py [--repeat 5]

One process records a 20-step CPU profile (with_stack + record_shapes) of the benchmark model, then writes it
`--repeat` times each way while a watcher thread spins on the GIL and records its longest gap:
    in-process   export_chrome_trace on this thread (kineto's save holds the GIL throughout), then dropping the
                 result (its destructor runs under the GIL too)
    fork         trace_save.save_trace with ONDEMAND_PROF_TRACE_SAVE=fork: the gap is the fork itself (page-table
                 copy); the child writes
    native       rank/native_save.py's module (built here first, as `python -m ondemand_prof.rank.native_save
                 build` does): ProfilerResult::save with the GIL released, and the result's contents freed on the
                 saver thread; then dropping the (now empty) result
Each save of a kineto result can happen once per process, so every measured save runs in a fork of the
profiled process made before the watcher starts. Also prints the RSS and the fork's copy-on-write cost: the page
faults and time of the next training step after a fork whose child is still alive.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.autograd.profiler import record_function  # noqa: E402

from bench_hook import make_model, train_step  # noqa: E402  (the same model as the other benchmarks)
from ondemand_prof.rank import native_save, trace_save  # noqa: E402


def record(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                  record_shapes=True)
    prof.prepare_trace()
    prof.start_trace()
    for step in range(20):
        with record_function(f"ProfilerStep#{step}"):
            train_step(model, opt)
    prof.stop_trace()
    return prof


def longest_gil_gap(work: Callable[[], None]) -> tuple[float, float]:
    """(longest gap of a spinning watcher thread, duration of work) in ms, work run on this thread."""
    stop, gap = threading.Event(), [0.0]

    def watch() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gap[0] = max(gap[0], now - last)
            last = now

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    work()
    took = time.perf_counter() - t0
    time.sleep(0.05)
    stop.set()
    watcher.join()
    return gap[0] * 1e3, took * 1e3


def in_fork(fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Run fn in a fresh fork (a kineto result saves once per process) and return its result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, ("%f %f" % fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 100).decode().split()
    os.close(r)
    os.waitpid(pid, 0)
    return float(data[0]), float(data[1])


def cow_cost(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float, int]:
    """Step time without a fork, and the first step after a fork whose child lives on: ms, ms, page faults."""
    t0 = time.perf_counter()
    train_step(model, opt)
    plain = (time.perf_counter() - t0) * 1e3
    pid = os.fork()
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    train_step(model, opt)
    after = (time.perf_counter() - t0) * 1e3
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    os.waitpid(pid, 0)
    return plain, after, faults


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    t0 = time.perf_counter()
    ok, message = native_save.build()
    native, why = native_save.load()
    if native is None:
        sys.exit(f"the native save cannot be built here: {message}; {why}")
    build_s = time.perf_counter() - t0
    model, opt = make_model()
    for _ in range(10):
        train_step(model, opt)
    prof = record(model, opt)
    out = Path(tempfile.mkdtemp())
    os.environ[trace_save.SAVE_ENV] = "fork"

    def then_drop(save: Callable[[], Any]) -> Callable[[], None]:
        def work() -> None:
            save()
            prof.profiler.kineto_results = None  # what the exporter's last reference does, under the GIL
        return work

    ways = {
        "in-process, then drop the result": then_drop(lambda: prof.export_chrome_trace(str(out / "a.json"))),
        "fork": lambda: trace_save.save_trace(prof.export_chrome_trace, out / "b.json"),
        "native (GIL released, result freed there), then drop": then_drop(
            lambda: native.save(prof.profiler.kineto_results, str(out / "c.json"), True, 0, [])),
    }
    rows = {name: [in_fork(lambda w=w: longest_gil_gap(w)) for _ in range(args.repeat)] for name, w in ways.items()}
    cow = [cow_cost(model, opt) for _ in range(args.repeat)]
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
    size = (out / "a.json").stat().st_size / 2**20
    print(f"trace {size:.1f} MB, process RSS {rss:.0f} MB, CPU only, {os.cpu_count()} cores; "
          f"median of {args.repeat}; native module: {message} ({build_s:.0f} s)")
    print("| way | longest GIL gap ms | save ms (this thread) |\n|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(v[0] for v in vals):.1f} | {statistics.median(v[1] for v in vals):.1f} |")
    print(f"fork copy-on-write: the next step took {statistics.median(c[1] for c in cow):.1f} ms "
          f"({statistics.median(c[2] for c in cow):.0f} page faults) against {statistics.median(c[0] for c in cow):.1f} "
          f"ms without a fork")


if __name__ == "__main__":
    main()
