"""What a capture costs the training loop: the window-end step and the steps after it, where that time goes,
and memory.

    python bench/bench_window_cost.py [--repeat 3] [--threads 1,2] [--variants torch,ours,ours-inprocess]
                                      [--models linear512,linear256,large,small,deep]

Each run is one fresh process per variant (so no variant inherits another's threads, children, allocator state or
kineto warm-up), started in turn: torch, ours, ... then again, `--repeat` times, for each training shape;
medians over the runs. In each process: a warm-up capture of the same kind (kineto's first-use costs are not the
export's), then idle steps (their median is the baseline), a 20-step window with_stack + record_shapes, and
`--tail` steps after it.

Training shapes (`--threads`): 1 = one intra-op thread, the other core idle (a GPU node's shape: the training
thread waits on the device and most cores are free); 2 (= every core of this 2-core VM) = every core busy.
Models (`--models`, bench/bench_models.py; default linear512, bench_hook's model): what a window costs follows the
events it records, so the ratio to torch.profiler differs by model: few large operators (large), many small ones
(small), deep stacks (deep), issue 44's 8 Linear(256) (linear256). Each (model, shape) gets its own table rows and
ratios; the last line names the worst model.

    window-end stall   the step() call that ends the window (collection; torch.profiler also exports in it)
    +10 steps          stall + sum over the 10 steps after it of (step time - idle median): the issue's measure
    + torch's freeing  stall + 10 steps, plus (torch only) the training thread freeing torch.profiler's result when
                       the profile is let go of after the tail: torch never frees it within the steps measured, ours
                       frees it beside them, within them; this is the whole cost a user of either pays
    +tail steps        the same over all `--tail` steps after the window: is the cost only moved later?
    published after    ms from the window end until our capture is published (torch: 0, it exports in the stall)
    peak extra RSS     this process's RSS plus its children's unique memory (Private_* of smaps_rollup), sampled
                       every 5 ms by this (parent) process from /proc, minus the process's RSS before the window

Where the time goes (second table), on the training thread over the window-end step and the 10 after it, each
against the idle median of the same quantity: its own CPU time (collection, then anything else of ours and
slower training code), time runnable but waiting for its core (/proc/thread-self/schedstat: another task, a
helper of ours or not, had the core), and time asleep (waiting for the GIL, mostly: a save holding it);
beside them the collection (stop_trace) and, off the training thread, the raw save and the post-processing.

Variants: torch = torch.profiler with schedule + tensorboard_trace_handler; ours = OnDemandProfiler with a static
window and default settings (the GIL-free native save when built, which this script builds first; helpers at
SCHED_IDLE); ours-inprocess = ONDEMAND_PROF_TRACE_SAVE=in-process (kineto's save on the export thread, holding
the GIL: the default before issue 20); ours-fork = ONDEMAND_PROF_TRACE_SAVE=fork; ours-nice =
ONDEMAND_PROF_EXPORT_SCHED=nice (helpers 10 nice levels down instead of SCHED_IDLE); ours-anycpu =
ONDEMAND_PROF_HELPER_CPUS=all (helpers not kept off the training thread's core); ours-nodefer =
ONDEMAND_PROF_SUMMARY_DEFER_S=0 (the summary child started at once, not once the job leaves a CPU free); ours-accessors and ours-keep =
the native save freeing less of the result (bench/native_variants.py: the rest is freed under the GIL); ours-atonce =
the native save freeing the result in one burst, as before 2026-12-07, not paced; ours-agent =
ours with on-demand listening on (the agent's and the trigger-file watcher's threads; no daemon).
Numbers are CPU only (torch's CPU activity) unless `--device cuda`: then the model trains on the GPU (each step
ends with its loss read back, so its kernels are done) and torch.profiler records CUDA activity too, as ours does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    "ours-inprocess": {"ONDEMAND_PROF_TRACE_SAVE": "in-process"},
    "ours-fork": {"ONDEMAND_PROF_TRACE_SAVE": "fork"},
    "ours-nice": {"ONDEMAND_PROF_EXPORT_SCHED": "nice"},
    "ours-anycpu": {"ONDEMAND_PROF_HELPER_CPUS": "all"},
    "ours-nodefer": {"ONDEMAND_PROF_SUMMARY_DEFER_S": "0"},
    # bench/native_variants.py: how the native save frees the result (issue 31)
    "ours-accessors": {"ODP_BENCH_NATIVE_VARIANT": "accessors"},
    "ours-keep": {"ODP_BENCH_NATIVE_VARIANT": "keep"},
    "ours-atonce": {"ODP_BENCH_NATIVE_VARIANT": "atonce"},
    # a rank as the zero-config hook runs: its agent and trigger-file watcher threads (no daemon asked)
    "ours-agent": {"ODP_BENCH_AGENT": "1"},
}
IDLE_STEPS = 30
WINDOW_START = IDLE_STEPS + 5
AFTER = 10  # the measure: the window-end step and the 10 after it
DEVICE = "cpu"  # --device
MODEL = "linear512"  # the child's --models (one)
Shape = tuple[str, int]  # (model, intra-op threads)
Runs = dict[Shape, dict[str, list[dict[str, Any]]]]


# ----------------------------------------------------------------------------------------------------------
# One run (in a child process)


def runqueue_ns() -> int:
    """Nanoseconds this thread has been runnable but not running (another task had its core)."""
    with open("/proc/thread-self/schedstat") as fh:
        return int(fh.read().split()[1])


def minor_faults() -> int:
    """Page faults this thread took without I/O (fresh memory: a page first touched, zeroed by the kernel)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def drive(step: Callable[[], None], end: int, tail: int) -> dict[str, Any]:
    """Train steps 0 .. end+tail-1, calling step() after each; times every step (wall, this thread's CPU, run
    queue wait, minor page faults) and the call ending the window."""
    model, opt, train_step = device_model()
    durations, cpu, rq, faults, stall, stall_cpu, stall_rq, marks = [], [], [], [], 0.0, 0.0, 0.0, {}
    for i in range(end + tail):
        if i == WINDOW_START - 1:
            marks["window_begin"] = time.monotonic()
        t0, c0, r0, f0 = time.perf_counter(), time.thread_time(), runqueue_ns(), minor_faults()
        train_step(model, opt)
        t1, c1, r1 = time.perf_counter(), time.thread_time(), runqueue_ns()
        step()
        t2 = time.perf_counter()
        durations.append(t2 - t0)
        cpu.append(time.thread_time() - c0)
        rq.append((runqueue_ns() - r0) / 1e9)
        faults.append(minor_faults() - f0)
        if i == end - 1:
            stall, stall_cpu, stall_rq = t2 - t1, time.thread_time() - c1, (runqueue_ns() - r1) / 1e9
            marks["window_end"] = time.monotonic()
    marks["tail_end"] = time.monotonic()
    return {"durations": durations, "cpu": cpu, "rq": rq, "faults": faults, "stall": stall, "stall_cpu": stall_cpu,
            "stall_rq": stall_rq, "marks": marks}


def device_model() -> tuple[Any, Any, Callable[[Any, Any], None]]:
    """The --models model and its step (bench_models.py; linear512 is bench_hook's model and step) on --device (a
    CUDA step ends when its kernels are done)."""
    from bench_models import model_and_step

    return model_and_step(MODEL, DEVICE)


class Phases:
    """Where our export's time goes, recorded by wrapping the hook's collect, the backend's write and the
    post-processing (no change to the code measured)."""

    def __init__(self) -> None:
        self.data: dict[str, float] = {}

    def install(self) -> None:
        from ondemand_prof.rank import hook, output
        from ondemand_prof.rank.backends import torch_backend

        phases = self.data
        collect, finish, postprocess = hook.OnDemandProfiler.collect, torch_backend.TorchSession.finish, \
            output.run_postprocess

        def timed_collect(prof: Any, active: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return collect(prof, active)
            finally:
                phases.update(collect_s=time.perf_counter() - t0, collect_cpu_s=time.thread_time() - c0)

        def timed_finish(session: Any) -> Any:
            export = finish(session)
            write = export.write

            def timed_write(staging: Path) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return write(staging)
                finally:
                    phases.update(save_s=time.perf_counter() - t0, save_thread_cpu_s=time.thread_time() - c0)

            export.write = timed_write
            return export

        def timed_postprocess(*args: Any) -> Any:
            t0, ru = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            try:
                return postprocess(*args)
            finally:
                ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                phases.update(postprocess_s=time.perf_counter() - t0,
                              postprocess_cpu_s=ru1.ru_utime + ru1.ru_stime - ru.ru_utime - ru.ru_stime)

        hook.OnDemandProfiler.collect = timed_collect  # type: ignore[method-assign]
        torch_backend.TorchSession.finish = timed_finish  # type: ignore[method-assign]
        output.run_postprocess = timed_postprocess  # type: ignore[assignment]


def run_ours(active: int, tail: int, phases: Phases | None = None) -> dict[str, Any]:
    from ondemand_prof import OnDemandProfiler, ProfileConfig
    from ondemand_prof.core.window import Window
    from ondemand_prof.core.options import WindowOptions

    def profiler(start: int, steps: int, on_event: Callable[[str, dict[str, Any]], None]) -> OnDemandProfiler:
        agent = os.environ.get("ODP_BENCH_AGENT") == "1"
        save = tempfile.mkdtemp()
        prof = OnDemandProfiler(ProfileConfig(ondemand=agent, daemon=False, trigger_dir=save + "/trigger" if agent
                                              else "", quiet=True, save_path=save, min_free_mb=0))
        prof.submit(Window(start, start + steps, WindowOptions(with_stack=True, record_shapes=True),
                           source="bench", capture_id="bench"), listener=on_event)
        return prof

    from native_variants import use_variant

    use_variant(os.environ.get("ODP_BENCH_NATIVE_VARIANT") or "inplace")
    if phases is None:  # a process of its own: warm kineto up first (in --same-process, warm_up() did)
        warm = profiler(2, 2, lambda e, i: None)
        drive(lambda: warm.step(), 4, 2)
        warm.close()
        phases = Phases()
        phases.install()
    phases.data.clear()
    results: list[dict[str, Any]] = []
    prof = profiler(WINDOW_START, active,
                    lambda event, info: results.append(dict(info, event=event, t=time.monotonic())))
    out = drive(lambda: prof.step(), WINDOW_START + active, tail)  # not the bound method: see README
    prof.close()
    done = [r for r in results if r["event"] in ("done", "failed")]
    out["capture"] = {"status": done[0].get("status"), "steps": done[0].get("steps")} if done else \
        {"status": None, "events": [r["event"] for r in results]}  # never done: what the listener heard
    out["published_s"] = done[0]["t"] - out["marks"]["window_end"] if done else None
    out["phases"] = dict(phases.data)  # phases.data is refilled by the next window
    if done and done[0].get("path"):
        meta = json.loads((Path(done[0]["path"]) / "metadata.json").read_text())
        out["phases"]["way"] = meta["backend"].get("trace_save")
    return out


def run_torch(active: int, tail: int, warm_up: bool = True) -> dict[str, Any]:
    import torch

    phases: dict[str, Any] = {"way": "in the step"}

    def profile(start: int, steps: int) -> Any:
        sched = torch.profiler.schedule(wait=start - 1, warmup=1, active=steps, repeat=1)
        handler = torch.profiler.tensorboard_trace_handler(tempfile.mkdtemp())

        def timed_handler(prof: Any) -> None:  # the save; the rest of the stall is collection
            t0, c0 = time.perf_counter(), time.thread_time()
            handler(prof)
            phases.update(save_s=time.perf_counter() - t0, save_thread_cpu_s=time.thread_time() - c0)

        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                              if DEVICE == "cuda" else [])
        return torch.profiler.profile(activities=activities, schedule=sched,
                                      with_stack=True, record_shapes=True, on_trace_ready=timed_handler)

    if warm_up:
        with profile(2, 2) as warm:
            drive(warm.step, 4, 2)
    with profile(WINDOW_START, active) as p:
        out = drive(p.step, WINDOW_START + active, tail)
    out["release_s"] = release_torch_result(p)
    phases["collect_s"] = out["stall"] - phases.get("save_s", 0.0)
    phases["collect_cpu_s"] = out["stall_cpu"] - phases.get("save_thread_cpu_s", 0.0)
    out["published_s"] = 0.0
    out["phases"] = phases
    return out


def release_torch_result(p: Any) -> float:
    """Seconds the training thread spends freeing torch.profiler's result once the profile is let go of (the next
    cycle's start, or the `with` block's end): torch never frees it within the steps measured, ours frees it on a
    thread of its own within them, so the whole cost a user pays adds this to torch's figure."""
    holder = p.profiler
    result = getattr(holder, "kineto_results", None)
    if result is None:
        return 0.0
    holder.kineto_results = None
    t0 = time.perf_counter()
    del result  # the last reference: the C++ result is destroyed here
    return time.perf_counter() - t0


def child_main(variant: str, active: int, tail: int, threads: int, repeat: int = 1,
               variants: list[str] | None = None) -> None:
    import logging

    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    if variant == "same-process":
        print("RESULT " + json.dumps(same_process(active, tail, repeat, variants)))
        return
    out = run_torch(active, tail) if variant == "torch" else run_ours(active, tail)
    print("RESULT " + json.dumps(out))


def same_process(active: int, tail: int, repeat: int, variants: list[str]) -> list[dict[str, Any]]:
    """Every variant's window in this one process, in turn, `repeat` rounds (the order rotates each round), so that
    all of them meet the same spell of load. Between windows (not measured): our capture is published, and a
    full garbage collection frees the previous window's profile for everyone alike."""
    import gc

    run_torch(2, 2)  # kineto's and our first-use costs, before anything is measured
    phases = Phases()
    phases.install()
    run_ours(2, 2, phases)
    out: list[dict[str, Any]] = []
    for i in range(repeat):
        for variant in variants[i % len(variants):] + variants[:i % len(variants)]:
            os.environ.pop("ONDEMAND_PROF_TRACE_SAVE", None)
            os.environ.pop("ONDEMAND_PROF_EXPORT_SCHED", None)
            os.environ.pop("ONDEMAND_PROF_HELPER_CPUS", None)
            os.environ.pop("ODP_BENCH_NATIVE_VARIANT", None)
            os.environ.pop("ODP_BENCH_AGENT", None)
            os.environ.update(VARIANT_ENV[variant])
            gc.collect()
            load = os.getloadavg()[0]
            res = run_torch(active, tail, warm_up=False) if variant == "torch" else run_ours(active, tail, phases)
            out.append(dict(res, variant=variant, round=i, load=load))
    return out


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


def python_path() -> str:
    """The children's PYTHONPATH: the checkout, then what was there (packages carried beside an installed torch)."""
    return os.pathsep.join([str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])


def run_variant(variant: str, active: int, tail: int, shape: Shape) -> dict[str, Any]:
    model, threads = shape
    env = dict(os.environ, PYTHONPATH=python_path(), **VARIANT_ENV[variant])
    t0, b0, o0, load = time.monotonic(), busy_cpu_s(), own_cpu_s(), os.getloadavg()[0]
    proc = subprocess.Popen([sys.executable, __file__, "--child", variant, "--active", str(active), "--tail",
                             str(tail), "--threads", str(threads), "--device", DEVICE, "--models", model], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sampler = MemorySampler(proc.pid)
    out, err = proc.communicate(timeout=600)
    sampler.stop()
    foreign = (busy_cpu_s() - b0 - (own_cpu_s() - o0)) / (time.monotonic() - t0)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} run failed (exit {proc.returncode}):\n{err[-2000:]}")
    res = json.loads(lines[0][len("RESULT "):])
    return dict(summarize(res, sampler, active), foreign_cores=foreign, load=max(load, os.getloadavg()[0]))


def summarize(res: dict[str, Any], sampler: MemorySampler, active: int) -> dict[str, Any]:
    end = WINDOW_START + active
    base = {k: statistics.median(res[k][5:WINDOW_START - 2]) for k in ("durations", "cpu", "rq")}  # idle steps
    extra = [x - base["durations"] for x in res["durations"][end:]]
    # the training thread over the window-end step and the AFTER steps after it, against the idle medians
    span_ = slice(end - 1, end + AFTER)
    wall, cpu, rq = (sum(x - base[k] for x in res[k][span_]) for k in ("durations", "cpu", "rq"))
    ph = res.get("phases", {})
    total, own, kids = sampler.peak_extra_mb(res["marks"])
    after10_ms = (res["stall"] + sum(extra[:AFTER])) * 1e3
    release_ms = res.get("release_s", 0.0) * 1e3  # torch.profiler's result freed (ours is, within the steps)
    return {"stall_ms": res["stall"] * 1e3, "after10_ms": after10_ms,
            "release_ms": release_ms, "whole_ms": after10_ms + release_ms,
            "tail_ms": (res["stall"] + sum(extra)) * 1e3, "idle_ms": base["durations"] * 1e3,
            "published_ms": None if res["published_s"] is None else res["published_s"] * 1e3,
            "rss_mb": total, "rss_proc_mb": own, "rss_kids_mb": kids, "capture": res.get("capture"),
            # where the time goes (ms)
            "collect_ms": ph.get("collect_s", 0.0) * 1e3, "rest_of_stall_ms": (res["stall"] - ph.get("collect_s", 0.0)) * 1e3,
            "thread_cpu_ms": (cpu - ph.get("collect_cpu_s", 0.0)) * 1e3,
            "runqueue_ms": rq * 1e3, "asleep_ms": (wall - cpu - rq) * 1e3,
            # the same without the time the thread was runnable but another task had its core: on this shared
            # machine mostly other people's processes, so a load-robust view (helpers of ours at SCHED_IDLE never
            # keep a runnable training thread waiting)
            "stall_own_ms": (res["stall"] - res["stall_rq"]) * 1e3,
            "after10_own_ms": (res["stall"] - res["stall_rq"] + sum(extra[:AFTER])
                               - (rq - (res["rq"][end - 1] - base["rq"]))) * 1e3,
            "save_ms": ph.get("save_s", 0.0) * 1e3, "save_cpu_ms": ph.get("save_thread_cpu_s", 0.0) * 1e3,
            "postprocess_ms": ph.get("postprocess_s", 0.0) * 1e3,
            "postprocess_cpu_ms": ph.get("postprocess_cpu_s", 0.0) * 1e3, "way": ph.get("way"),
            # page faults of the training thread over the same span, against the idle median: a model that frees
            # and allocates large tensors each step (grads set to None) faults more or less as the heap's layout
            # changes, which moves its step time both ways (bench/bench_models.py large)
            "faults": sum(x - statistics.median(res["faults"][5:WINDOW_START - 2]) for x in res["faults"][span_])
            if "faults" in res else float("nan")}


# ----------------------------------------------------------------------------------------------------------


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def span(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return f"{median_of(rows, key):.1f} ({min(vals):.0f}-{max(vals):.0f})" if vals else "-"


def shape_name(threads: int) -> str:
    idle = (os.cpu_count() or threads) - threads
    return f"{threads} intra-op thread{'s' if threads > 1 else ''}, " + \
        (f"{idle} core{'s' if idle > 1 else ''} idle" if idle > 0 else "every core busy")


def training_name(shape: Shape) -> str:
    from bench_models import MODELS

    model, threads = shape
    return f"{MODELS[model]} ({model}), {shape_name(threads)}"


def print_table(runs: Runs, args: argparse.Namespace) -> None:
    print(f"\n{args.active}-step window, with_stack + record_shapes, "
          f"{'CPU only' if DEVICE == 'cpu' else DEVICE + ' model, CPU + CUDA activity'}, {os.cpu_count()} cores; "
          f"median (min-max) of {args.repeat} runs, " + ("every variant's windows in turn in one process per shape"
          if args.same_process else "each variant in its own process, interleaved"))
    print(f"| training | variant | idle step ms | window-end stall ms | stall + {AFTER} steps ms | same without "
          f"run-queue waits ms | the same + freeing torch.profiler's result ms | stall + {args.tail} steps ms | published after ms | peak extra RSS MB (process + "
          f"children) | load avg | others' load, cores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, variants in runs.items():
        for name, rows in variants.items():
            print(f"| {training_name(shape)} | {name} | {median_of(rows, 'idle_ms'):.2f} | {span(rows, 'stall_ms')} | "
                  f"{span(rows, 'after10_ms')} | {span(rows, 'after10_own_ms')} | {span(rows, 'whole_ms')} | "
                  f"{span(rows, 'tail_ms')} | {median_of(rows, 'published_ms'):.0f} | "
                  f"{median_of(rows, 'rss_mb'):.0f} ({median_of(rows, 'rss_proc_mb'):.0f} + "
                  f"{median_of(rows, 'rss_kids_mb'):.0f}) | {span(rows, 'load')} | "
                  f"{median_of(rows, 'foreign_cores'):.2f} |")
    print(f"\nWhere the time goes (ms, medians; training thread over the window-end step + {AFTER} steps, each "
          "against the idle median):")
    print("| training | variant | total | collection (stop_trace) | rest of the stall | other CPU of the training "
          "thread | runnable, core taken | asleep (GIL) | raw save (way), CPU | post-processing, CPU | page faults of the "
          "training thread |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, variants in runs.items():
        for name, rows in variants.items():
            ways = sorted({str(r.get("way")) for r in rows})
            print(f"| {training_name(shape)} | {name} | {median_of(rows, 'after10_ms'):.0f} | "
                  f"{median_of(rows, 'collect_ms'):.0f} | {median_of(rows, 'rest_of_stall_ms'):.1f} | "
                  f"{median_of(rows, 'thread_cpu_ms'):.0f} | {median_of(rows, 'runqueue_ms'):.0f} | "
                  f"{median_of(rows, 'asleep_ms'):.0f} | {median_of(rows, 'save_ms'):.0f} ({'/'.join(ways)}), "
                  f"{median_of(rows, 'save_cpu_ms'):.0f} | {median_of(rows, 'postprocess_ms'):.0f}, "
                  f"{median_of(rows, 'postprocess_cpu_ms'):.0f} | {median_of(rows, 'faults'):+.0f} |")
    ratios = [(shape, name, r) for shape, variants in runs.items() if "torch" in variants
              for name, r in ratios_of(variants).items()]
    for shape, name, r in ratios:
        print_ratios(shape, name, r)
    if ratios:
        print_by_model(ratios)


def ratios_of(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """Per variant but torch: each run's ratio to the torch run of the same round, for the stall, stall + AFTER
    steps and the same without run-queue waits."""
    t = runs["torch"]
    return {name: {"stall": [o["stall_ms"] / th["stall_ms"] for o, th in zip(rows, t)],
                   "total": [o["after10_ms"] / th["after10_ms"] for o, th in zip(rows, t)],
                   "own": [o["after10_own_ms"] / th["after10_own_ms"] for o, th in zip(rows, t)],
                   "whole": [o["whole_ms"] / th["whole_ms"] for o, th in zip(rows, t)],
                   "load": [max(o["load"], th["load"]) for o, th in zip(rows, t)]}
            for name, rows in runs.items() if name != "torch"}


def goal_of(threads: int) -> float:
    return 0.8 if threads < (os.cpu_count() or 1) else 1.0


def print_ratios(shape: Shape, name: str, r: dict[str, list[float]]) -> None:
    stall, total, own = r["stall"], r["total"], r["own"]
    print(f"{training_name(shape)}: {name} / torch: stall {statistics.median(stall):.2f} (goal <= 0.8; per run "
          f"{', '.join(f'{x:.2f}' for x in stall)}), stall + {AFTER} steps {statistics.median(total):.2f} (goal <= "
          f"{goal_of(shape[1])}; per run {', '.join(f'{x:.2f}' for x in total)}); without run-queue waits "
          f"{statistics.median(own):.2f} (per run {', '.join(f'{x:.2f}' for x in own)}); with torch.profiler's "
          f"freeing of its result {statistics.median(r['whole']):.2f} (per run "
          f"{', '.join(f'{x:.2f}' for x in r['whole'])})")


def print_by_model(ratios: list[tuple[Shape, str, dict[str, list[float]]]]) -> None:
    """One row a model and variant: the medians of the per-run ratios for each training shape, and the worst model
    of each measure (the highest median ratio of the stall, and of the stall + AFTER steps), which the README shows."""
    shapes = sorted({shape[1] for shape, _, _ in ratios})
    print(f"\nours / torch.profiler by model, medians of the per-run ratios (stall; stall + {AFTER} steps), load "
          "average during the runs:")
    print("| model | variant | " + " | ".join(f"{shape_name(t)}: stall (goal 0.8) | stall + {AFTER} (goal "
                                              f"{goal_of(t)}) | + torch's freeing" for t in shapes) + " | load avg |")
    print("|---|---|" + "---|---|---|" * len(shapes) + "---|")
    from bench_models import MODELS

    rows: dict[tuple[str, str], dict[int, dict[str, list[float]]]] = {}
    for (model, threads), name, r in ratios:
        rows.setdefault((model, name), {})[threads] = r
    for (model, name), by in rows.items():
        cells = []
        for t in shapes:
            got = by.get(t)
            cells += [f"{statistics.median(got['stall']):.2f}", f"{statistics.median(got['total']):.2f}",
                      f"{statistics.median(got['whole']):.2f}"] if got else ["-", "-", "-"]
        loads = [x for got in by.values() for x in got["load"]]
        print(f"| {MODELS[model]} ({model}) | {name} | " + " | ".join(cells) +
              f" | {min(loads):.1f}-{max(loads):.1f} |")
    for name in sorted({n for _, n, _ in ratios}):  # the worst of each measure (what the README shows)
        for key, what in (("stall", "stall"), ("total", f"stall + {AFTER} steps"),
                          ("whole", f"stall + {AFTER} steps with torch.profiler's freeing of its result")):
            worst, shape = max(((statistics.median(r[key]), shape) for shape, n, r in ratios if n == name),
                               key=lambda x: x[0])
            goal = 0.8 if key == "stall" else goal_of(shape[1])
            print(f"worst model for {name}, {what}: {training_name(shape)}: {worst:.2f} (goal {goal})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--active", type=int, default=20)
    parser.add_argument("--tail", type=int, default=60)
    parser.add_argument("--threads", default="1,2", help="training shapes: intra-op threads (comma list)")
    parser.add_argument("--models", default="linear512",
                        help="models (comma list) of bench/bench_models.py: linear512 (bench_hook's), linear256, "
                             "large, small, deep")
    parser.add_argument("--variants", default="torch,ours,ours-inprocess")
    parser.add_argument("--retries", type=int, default=1, help="repeat a run disturbed by other load")
    parser.add_argument("--max-foreign", type=float, default=0.1, help="cores others may use during a run")
    parser.add_argument("--quiet-wait", type=float, default=30, help="seconds to wait for a quiet machine")
    parser.add_argument("--same-process", action="store_true",
                        help="all variants' windows in turn in one process per shape (no memory figures)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model trains (cuda: torch.profiler records CUDA activity too)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE, MODEL
    DEVICE = args.device
    from bench_models import MODELS

    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    if args.child:
        MODEL = models[0]
        child_main(args.child, args.active, args.tail, int(args.threads), args.repeat, args.variants.split(","))
        return
    if any(v.startswith("ours") for v in args.variants.split(",")):
        from ondemand_prof.rank import native_save

        ok, message = native_save.build()  # what `python -m ondemand_prof.rank.native_save build` does
        from native_variants import build_variants

        build_variants([VARIANT_ENV[v]["ODP_BENCH_NATIVE_VARIANT"] for v in args.variants.split(",")
                        if "ODP_BENCH_NATIVE_VARIANT" in VARIANT_ENV.get(v, {})])
        print(f"native save: {message}", flush=True)
    runs, retried = run_same_process(args) if args.same_process else run_all(args)
    print_table(runs, args)
    print(f"{retried} run(s) were repeated because other processes used more than {args.max_foreign} cores")


def shapes_of(args: argparse.Namespace) -> list[Shape]:
    return [(m, int(t)) for m in args.models.split(",") for t in args.threads.split(",")]


def shape_label(shape: Shape) -> str:
    """The progress lines' 'threads N' (bench/gpu_check.py reads them) and, beside bench_hook's model, which one."""
    model, threads = shape
    return f"threads {threads}" + ("" if model == "linear512" else f" model {model}")


class NoSampler:
    def peak_extra_mb(self, marks: dict[str, float]) -> tuple[float, float, float]:
        return float("nan"), float("nan"), float("nan")


def run_same_process(args: argparse.Namespace) -> tuple[Runs, int]:
    """One process per shape runs every variant's window in turn (same_process()); rows per variant, in rounds."""
    runs: Runs = {}
    for shape in shapes_of(args):
        model, threads = shape
        wait_for_quiet(args.quiet_wait)
        env = dict(os.environ, PYTHONPATH=python_path())
        t0, b0, o0 = time.monotonic(), busy_cpu_s(), own_cpu_s()
        proc = subprocess.run([sys.executable, __file__, "--child", "same-process", "--active", str(args.active),
                               "--tail", str(args.tail), "--threads", str(threads), "--repeat", str(args.repeat),
                               "--variants", args.variants, "--device", DEVICE, "--models", model], env=env,
                              capture_output=True, text=True, timeout=3600)
        foreign = (busy_cpu_s() - b0 - (own_cpu_s() - o0)) / (time.monotonic() - t0)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"same-process run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        runs[shape] = {v: [] for v in args.variants.split(",")}
        for res in json.loads(lines[0][len("RESULT "):]):
            r = dict(summarize(res, NoSampler(), args.active), foreign_cores=foreign, load=res["load"])
            runs[shape][res["variant"]].append(r)
            print(f"round {res['round'] + 1} {shape_label(shape)} {res['variant']} (load {r['load']:.1f}): stall "
                  f"{r['stall_ms']:.1f} ms, +{AFTER} {r['after10_ms']:.1f} ms, own {r['after10_own_ms']:.1f} ms "
                  f"(collect {r['collect_ms']:.0f}, cpu {r['thread_cpu_ms']:.0f}, runqueue {r['runqueue_ms']:.0f}, "
                  f"asleep {r['asleep_ms']:.0f}; save {r['save_ms']:.0f} {r['way']}, post {r['postprocess_ms']:.0f})",
                  flush=True)
        print(f"{shape_label(shape)}: others used {foreign:.2f} cores on average", flush=True)
    return runs, 0


def run_all(args: argparse.Namespace) -> tuple[Runs, int]:
    """Every variant `repeat` times for each shape (model and threads), interleaved so that a slow spell of the
    machine hits every variant; a run during which other processes used more than --max-foreign cores is repeated
    (up to --retries times; the table gives the load average and others' load beside the numbers)."""
    shapes = shapes_of(args)
    runs: Runs = {s: {v: [] for v in args.variants.split(",")} for s in shapes}
    retried = 0
    for i in range(args.repeat):
        for shape in shapes:
            for v in runs[shape]:
                for attempt in range(args.retries + 1):
                    wait_for_quiet(args.quiet_wait)
                    r = run_variant(v, args.active, args.tail, shape)
                    if r["foreign_cores"] <= args.max_foreign or attempt == args.retries:
                        break
                    retried += 1
                    print(f"run {i + 1} {v}: other processes used {r['foreign_cores']:.2f} cores; again", flush=True)
                runs[shape][v].append(r)
                print(f"run {i + 1} {shape_label(shape)} {v} (load {r['load']:.1f}, others {r['foreign_cores']:.2f} "
                      f"cores): stall {r['stall_ms']:.1f} ms, +{AFTER} {r['after10_ms']:.1f} ms (collect "
                      f"{r['collect_ms']:.0f}, cpu {r['thread_cpu_ms']:.0f}, runqueue {r['runqueue_ms']:.0f}, asleep "
                      f"{r['asleep_ms']:.0f}; save {r['save_ms']:.0f} {r['way']}, post {r['postprocess_ms']:.0f}), "
                      f"own {r['after10_own_ms']:.1f} ms, faults {r['faults']:+.0f}, +{args.tail} {r['tail_ms']:.1f} ms, published after {fmt_ms(r['published_ms'])} ms, rss "
                      f"+{r['rss_mb']:.0f} MB, capture {r.get('capture')}", flush=True)
    return runs, retried


if __name__ == "__main__":
    main()
