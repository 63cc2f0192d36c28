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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ondemand_prof import OnDemandProfiler, ProfileConfig  # noqa: E402
from ondemand_prof.window import Window, WindowOptions  # noqa: E402


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


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(8)])
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(32, 512)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def run_ours(active: int) -> tuple[float, float]:
    out = tempfile.mkdtemp()
    prof = OnDemandProfiler(ProfileConfig(ondemand=False, save_path=out, min_free_mb=0))
    model, opt = make_model()
    start = 3
    prof.submit(Window(start, start + active, WindowOptions(with_stack=True, record_shapes=True), source="bench",
                       capture_id="bench"))
    end_call = after = 0.0
    for i in range(start + active + 2):
        train_step(model, opt)
        t0 = time.perf_counter()
        prof.step()
        dt = time.perf_counter() - t0
        if i == start + active - 1:
            end_call = dt
            t1 = time.perf_counter()
            train_step(model, opt)
            prof.step()
            after = time.perf_counter() - t1
            break
    prof.close()
    return end_call, after


def run_torch(active: int) -> tuple[float, float]:
    out = tempfile.mkdtemp()
    model, opt = make_model()
    start = 3
    sched = torch.profiler.schedule(wait=start - 1, warmup=1, active=active, repeat=1)
    end_call = after = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched, with_stack=True,
                                record_shapes=True, on_trace_ready=torch.profiler.tensorboard_trace_handler(out)) as p:
        for i in range(start + active + 2):
            train_step(model, opt)
            t0 = time.perf_counter()
            p.step()
            dt = time.perf_counter() - t0
            if i == start + active - 1:
                end_call = dt
                t1 = time.perf_counter()
                train_step(model, opt)
                p.step()
                after = time.perf_counter() - t1
                break
    return end_call, after


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--active", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ours_ns, base_ns = bench_idle(1_000_000)
    print("(a) idle step()")
    print(f"| call | ns/call |\n|---|---|\n| empty method | {base_ns:.1f} |\n| OnDemandProfiler.step() | {ours_ns:.1f} |")
    print(f"ratio: {ours_ns / base_ns:.2f}x (goal <= 2x)\n")
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
