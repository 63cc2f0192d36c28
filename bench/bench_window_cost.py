"""What a capture costs the training loop: the window-end step and the steps after it, and memory.

    python bench/bench_window_cost.py [--repeat 5] [--variants torch,ours,ours-inprocess]

Each run is one fresh process per variant (so no variant inherits another's threads, children, allocator state or
kineto warm-up), started in turn: torch, ours, ... then again, `--repeat` times; medians over the runs.
In each process: a warm-up capture of the same kind (kineto's first-use costs are not the export's), then
idle steps (their median is the baseline), a 20-step window with_stack + record_shapes, and `--tail` steps after it.

    window-end stall   the step() call that ends the window (collection; torch.profiler also exports in it)
    +10 steps          stall + sum over the 10 steps after it of (step time - idle median): the issue's measure
    +tail steps        the same over all `--tail` steps after the window: is the cost only moved later?
    published after    ms from the window end until our capture is published (torch: 0, it exports in the stall)
    peak extra RSS     this process's RSS plus its children's unique memory (Private_* of smaps_rollup), sampled
                       every 5 ms by this (parent) process from /proc, minus the process's RSS before the window

Variants: torch = torch.profiler with schedule + tensorboard_trace_handler; ours = OnDemandProfiler with a static
window and default settings (trace written by a forked child, helpers at SCHED_IDLE); ours-inprocess =
ONDEMAND_PROF_FORK_SAVE=0 (trace written on the export thread); ours-fork-nice = ONDEMAND_PROF_EXPORT_SCHED=nice
(helpers 10 nice levels down instead of SCHED_IDLE); ours-before = both (what ondemand_prof did before issue 14).
Numbers are CPU only (torch's CPU activity).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
VARIANT_ENV = {
    "torch": {},
    "ours": {},
    "ours-inprocess": {"ONDEMAND_PROF_FORK_SAVE": "0"},
    "ours-fork-nice": {"ONDEMAND_PROF_EXPORT_SCHED": "nice"},
    "ours-before": {"ONDEMAND_PROF_FORK_SAVE": "0", "ONDEMAND_PROF_EXPORT_SCHED": "nice"},
}
IDLE_STEPS = 30
WINDOW_START = IDLE_STEPS + 5


# ----------------------------------------------------------------------------------------------------------
# One run (in a child process)


def drive(step: Callable[[], None], end: int, tail: int) -> dict[str, Any]:
    """Train steps 0 .. end+tail-1, calling step() after each; times every step and the call ending the window."""
    from bench_hook import make_model, train_step  # the model of bench_hook's window-end benchmark

    model, opt = make_model()
    durations, stall, marks = [], 0.0, {}
    for i in range(end + tail):
        if i == WINDOW_START - 1:
            marks["window_begin"] = time.monotonic()
        t0 = time.perf_counter()
        train_step(model, opt)
        t1 = time.perf_counter()
        step()
        t2 = time.perf_counter()
        durations.append(t2 - t0)
        if i == end - 1:
            stall = t2 - t1
            marks["window_end"] = time.monotonic()
    marks["tail_end"] = time.monotonic()
    return {"durations": durations, "stall": stall, "marks": marks}


def run_ours(active: int, tail: int) -> dict[str, Any]:
    from ondemand_prof import OnDemandProfiler, ProfileConfig
    from ondemand_prof.core.window import Window
    from ondemand_prof.core.options import WindowOptions

    def profiler(start: int, steps: int, on_event: Callable[[str, dict[str, Any]], None]) -> OnDemandProfiler:
        prof = OnDemandProfiler(ProfileConfig(ondemand=False, save_path=tempfile.mkdtemp(), min_free_mb=0))
        prof.submit(Window(start, start + steps, WindowOptions(with_stack=True, record_shapes=True),
                           source="bench", capture_id="bench"), listener=on_event)
        return prof

    warm = profiler(2, 2, lambda e, i: None)
    drive(lambda: warm.step(), 4, 2)
    warm.close()
    results: list[dict[str, Any]] = []
    prof = profiler(WINDOW_START, active,
                    lambda event, info: results.append(dict(info, event=event, t=time.monotonic())))
    out = drive(lambda: prof.step(), WINDOW_START + active, tail)  # not the bound method: see README
    prof.close()
    done = [r for r in results if r["event"] in ("done", "failed")]
    out["capture"] = {"status": done[0].get("status"), "steps": done[0].get("steps")} if done else None
    out["published_s"] = done[0]["t"] - out["marks"]["window_end"] if done else None
    return out


def run_torch(active: int, tail: int) -> dict[str, Any]:
    import torch

    def profile(start: int, steps: int) -> Any:
        sched = torch.profiler.schedule(wait=start - 1, warmup=1, active=steps, repeat=1)
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched,
                                      with_stack=True, record_shapes=True,
                                      on_trace_ready=torch.profiler.tensorboard_trace_handler(tempfile.mkdtemp()))

    with profile(2, 2) as warm:
        drive(warm.step, 4, 2)
    with profile(WINDOW_START, active) as p:
        out = drive(p.step, WINDOW_START + active, tail)
    out["published_s"] = 0.0
    return out


def child_main(variant: str, active: int, tail: int) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    out = run_torch(active, tail) if variant == "torch" else run_ours(active, tail)
    print("RESULT " + json.dumps(out))


# ----------------------------------------------------------------------------------------------------------
# Memory, sampled from outside the training process


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def unique_kb(pid: int) -> int:
    """Memory only this process maps (a forked child: pages it or its parent has written since the fork)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return sum(int(line.split()[1]) for line in fh if line.startswith("Private_"))
    except OSError:
        return 0


class MemorySampler:
    def __init__(self, pid: int, period: float = 0.005) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int, int]] = []  # (monotonic time, process RSS kB, children unique kB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            kids = sum(unique_kb(k) for k in descendants(self.pid))
            self.samples.append((time.monotonic(), rss_kb(self.pid), kids))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak_extra_mb(self, marks: dict[str, float]) -> tuple[float, float, float]:
        """(total, process, children) peak extra MB from the window's begin to the end of the tail."""
        before = [rss for t, rss, _ in self.samples if t < marks["window_begin"]]
        base = before[-1] if before else 0
        during = [(rss - base, kids) for t, rss, kids in self.samples
                  if marks["window_begin"] <= t <= marks["tail_end"]]
        if not during:
            return 0.0, 0.0, 0.0
        return (max(r + k for r, k in during) / 1024, max(r for r, _ in during) / 1024,
                max(k for _, k in during) / 1024)


# ----------------------------------------------------------------------------------------------------------
# Other load on the machine (this 2-core box is shared): wait for quiet, and measure what others used


def busy_cpu_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds used by this process and its waited-for descendants (the training process and its children)."""
    import resource

    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def wait_for_quiet(max_wait_s: float, limit_cores: float = 0.15) -> float:
    """Wait until the machine is nearly idle (others' load below limit_cores over 1 s); returns the last load."""
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, o0 = busy_cpu_s(), own_cpu_s()
        time.sleep(1.0)
        load = busy_cpu_s() - b0 - (own_cpu_s() - o0)
        if load < limit_cores or time.monotonic() >= deadline:
            return load


def run_variant(variant: str, active: int, tail: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **VARIANT_ENV[variant])
    t0, b0, o0 = time.monotonic(), busy_cpu_s(), own_cpu_s()
    proc = subprocess.Popen([sys.executable, __file__, "--child", variant, "--active", str(active), "--tail",
                             str(tail)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = MemorySampler(proc.pid)
    out, err = proc.communicate(timeout=600)
    sampler.stop()
    foreign = (busy_cpu_s() - b0 - (own_cpu_s() - o0)) / (time.monotonic() - t0)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} run failed (exit {proc.returncode}):\n{err[-2000:]}")
    res = json.loads(lines[0][len("RESULT "):])
    return dict(summarize(res, sampler, active), foreign_cores=foreign)


def summarize(res: dict[str, Any], sampler: MemorySampler, active: int) -> dict[str, Any]:
    d = res["durations"]
    end = WINDOW_START + active
    idle = statistics.median(d[5:WINDOW_START - 2])  # steps 5.. before the warmup step
    extra = [x - idle for x in d[end:]]
    total, own, kids = sampler.peak_extra_mb(res["marks"])
    return {"stall_ms": res["stall"] * 1e3, "after10_ms": (res["stall"] + sum(extra[:10])) * 1e3,
            "tail_ms": (res["stall"] + sum(extra)) * 1e3, "idle_ms": idle * 1e3,
            "published_ms": None if res["published_s"] is None else res["published_s"] * 1e3,
            "rss_mb": total, "rss_proc_mb": own, "rss_kids_mb": kids,
            "capture": res.get("capture")}


# ----------------------------------------------------------------------------------------------------------


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else float("nan")


def span(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows if r[key] is not None]
    return f"{median_of(rows, key):.1f} ({min(vals):.0f}-{max(vals):.0f})" if vals else "-"


def print_table(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"\n{args.active}-step window, with_stack + record_shapes, CPU only, {os.cpu_count()} cores; "
          f"median (min-max) of {args.repeat} runs, each variant in its own process")
    print(f"| variant | idle step ms | window-end stall ms | 10 steps after: extra ms | stall + 10 steps ms | "
          f"stall + {args.tail} steps ms | published after ms | peak extra RSS MB (process + children) | "
          f"others' load, cores |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in runs.items():
        for r in rows:
            r["next10_ms"] = r["after10_ms"] - r["stall_ms"]
        print(f"| {name} | {median_of(rows, 'idle_ms'):.2f} | {span(rows, 'stall_ms')} | {span(rows, 'next10_ms')} | "
              f"{span(rows, 'after10_ms')} | {span(rows, 'tail_ms')} | {median_of(rows, 'published_ms'):.0f} | "
              f"{median_of(rows, 'rss_mb'):.0f} ({median_of(rows, 'rss_proc_mb'):.0f} + "
              f"{median_of(rows, 'rss_kids_mb'):.0f}) | {median_of(rows, 'foreign_cores'):.2f} |")
    if "torch" in runs:
        print_ratios(runs)


def print_ratios(runs: dict[str, list[dict[str, Any]]]) -> None:
    t = runs["torch"]
    for name, rows in runs.items():
        if name == "torch":
            continue
        ratios = [o["after10_ms"] / th["after10_ms"] for o, th in zip(rows, t)]
        print(f"{name} / torch: stall {median_of(rows, 'stall_ms') / median_of(t, 'stall_ms'):.2f} (goal <= 0.8), "
              f"stall + 10 steps {median_of(rows, 'after10_ms') / median_of(t, 'after10_ms'):.2f} "
              f"(goal <= 0.3; per run {', '.join(f'{r:.2f}' for r in ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--active", type=int, default=20)
    parser.add_argument("--tail", type=int, default=60)
    parser.add_argument("--variants", default="torch,ours,ours-inprocess")
    parser.add_argument("--retries", type=int, default=3, help="repeat a run disturbed by other load")
    parser.add_argument("--max-foreign", type=float, default=0.1, help="cores others may use during a run")
    parser.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for a quiet machine")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, args.active, args.tail)
        return
    runs, retried = run_all(args)
    print_table(runs, args)
    print(f"{retried} run(s) were repeated because other processes used more than {args.max_foreign} cores")


def run_all(args: argparse.Namespace) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Every variant `repeat` times, interleaved so that a slow spell of the machine hits every variant; a run
    during which other processes used more than --max-foreign cores is repeated (up to --retries times)."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants.split(",")}
    retried = 0
    for i in range(args.repeat):
        for v in runs:
            for _ in range(args.retries + 1):
                wait_for_quiet(args.quiet_wait)
                r = run_variant(v, args.active, args.tail)
                if r["foreign_cores"] <= args.max_foreign:
                    break
                retried += 1
                print(f"run {i + 1} {v}: other processes used {r['foreign_cores']:.2f} cores; again", flush=True)
            runs[v].append(r)
            print(f"run {i + 1} {v} (others {r['foreign_cores']:.2f} cores): stall {r['stall_ms']:.1f} ms, "
                  f"+10 {r['after10_ms']:.1f} ms, +{args.tail} {r['tail_ms']:.1f} ms, "
                  f"published after {r['published_ms']:.0f} ms, rss +{r['rss_mb']:.0f} MB, "
                  f"capture {r.get('capture')}", flush=True)
    return runs, retried

if __name__ == "__main__":
    main()
