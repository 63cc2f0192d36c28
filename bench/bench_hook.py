"""Benchmarks for the in-rank hook. Prints a table; the README keeps the latest numbers.

    python bench/bench_hook.py            # both benchmarks
(a) idle step(): cost per call against an empty Python method call, in the same process.
(b) the step that ends a 20-step window recorded with stacks and shapes: ours (collection only; the export runs
    in the background) against torch.profiler with a schedule and tensorboard_trace_handler (collection and
    export inside step()). Also the step after it, which is where a background export could still be felt.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ondemand_prof import OnDemandProfiler, ProfileConfig  # noqa: E402
from ondemand_prof.core.window import Window, WindowOptions  # noqa: E402


class Empty:
    def step(self) -> None:
        pass


def bench_idle(n: int) -> tuple[float, float]:
    prof = OnDemandProfiler(ProfileConfig(ondemand=False, save_path=tempfile.mkdtemp()))
    empty = Empty()
    # statements as a training loop writes them: attribute lookup + call
    g = {"prof": prof, "empty": empty}
    ours = min(timeit.repeat("prof.step()", globals=g, number=n, repeat=7)) / n
    base = min(timeit.repeat("empty.step()", globals=g, number=n, repeat=7)) / n
    prof.close()
    return ours * 1e9, base * 1e9


def bench_idle_auto(n: int) -> tuple[float, float]:
    """The idle step() with on-demand listening, without and with --profile-auto (a Python function around the
    counter that times each step; a ratio it never reaches, so no window opens). Thread CPU time, not wall
    time: on a loaded host, preemption would swamp a few hundred nanoseconds."""
    out = []
    for ratio in (0.0, 1000.0):
        tmp = tempfile.mkdtemp()
        prof = OnDemandProfiler(ProfileConfig(save_path=tmp, trigger_dir=tmp + "/t", daemon=False, auto_ratio=ratio))
        g = {"prof": prof}
        out.append(min(timeit.repeat("prof.step()", globals=g, number=n, repeat=9, timer=time.thread_time)) / n)
        prof.close()
    return out[0] * 1e9, out[1] * 1e9


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(8)])
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(32, 512)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def time_window_end(step: Callable[[], None], window_end: int) -> tuple[float, float]:
    """Train through steps 0 .. window_end-1, calling step() after each; return the seconds of the step() call
    that ends the window (after step window_end-1) and of the whole step that follows it."""
    model, opt = make_model()
    for _ in range(window_end - 1):
        train_step(model, opt)
        step()
    train_step(model, opt)
    t0 = time.perf_counter()
    step()
    end_call = time.perf_counter() - t0
    t1 = time.perf_counter()
    train_step(model, opt)
    step()
    return end_call, time.perf_counter() - t1


WINDOW_START = 3


def run_ours(active: int) -> tuple[float, float]:
    prof = OnDemandProfiler(ProfileConfig(ondemand=False, save_path=tempfile.mkdtemp(), min_free_mb=0))
    prof.submit(Window(WINDOW_START, WINDOW_START + active, WindowOptions(with_stack=True, record_shapes=True),
                       source="bench", capture_id="bench"))
    result = time_window_end(lambda: prof.step(), WINDOW_START + active)  # not the bound method: see README
    prof.close()
    return result


def run_torch(active: int) -> tuple[float, float]:
    sched = torch.profiler.schedule(wait=WINDOW_START - 1, warmup=1, active=active, repeat=1)
    handler = torch.profiler.tensorboard_trace_handler(tempfile.mkdtemp())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched, with_stack=True,
                                record_shapes=True, on_trace_ready=handler) as p:
        return time_window_end(p.step, WINDOW_START + active)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--active", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ours_ns, base_ns = bench_idle(1_000_000)
    plain_cpu, auto_cpu = bench_idle_auto(300_000)
    print("(a) idle step()")
    print(f"| call | ns/call |\n|---|---|\n| empty method | {base_ns:.1f} |\n| OnDemandProfiler.step() | {ours_ns:.1f} |")
    print(f"ratio: {ours_ns / base_ns:.2f}x (goal <= 2x)\n")
    print("(a2) idle step() with on-demand listening, thread CPU time")
    print(f"| call | CPU ns/call |\n|---|---|\n| OnDemandProfiler.step() | {plain_cpu:.1f} |\n"
          f"| OnDemandProfiler.step() with --profile-auto | {auto_cpu:.1f} |")
    print(f"--profile-auto adds {auto_cpu - plain_cpu:.0f} ns per step (goal <= 1000 ns)\n")
    run_ours(2), run_torch(2)  # warm both paths up
    ours = [run_ours(args.active) for _ in range(args.repeat)]
    theirs = [run_torch(args.active) for _ in range(args.repeat)]
    o_end, t_end = statistics.median(x[0] for x in ours), statistics.median(x[0] for x in theirs)
    o_after, t_after = statistics.median(x[1] for x in ours), statistics.median(x[1] for x in theirs)
    print(f"(b) step that ends a {args.active}-step window, with_stack + record_shapes, CPU, median of {args.repeat}")
    print("| profiler | window-end step() ms | next step ms |\n|---|---|---|")
    print(f"| torch.profiler + tensorboard_trace_handler | {t_end * 1e3:.1f} | {t_after * 1e3:.1f} |")
    print(f"| ondemand_prof | {o_end * 1e3:.1f} | {o_after * 1e3:.1f} |")
    print(f"ratio (ours / torch) at window end: {o_end / t_end:.2f} (goal <= 0.8)")


if __name__ == "__main__":
    main()
