"""Stress: thousands of capture windows back to back, each saved while the next one records, on 2-rank gloo jobs
beside CPU hogs, with glibc's malloc checking on (auto and in-process; the fork mode without it: below). Any crash
is read from its core and attributed.

    python bench/bench_save_stress.py --modes auto,in-process,fork --windows 300 [--jobs 1] [--hogs 1]

Each job is two gloo DDP ranks (a small model, one intra-op thread). A rank drives ondemand_prof's torch backend
as a capture does (rank/backends/torch_backend.py: TorchSession record/finish, the gloo settle wait before each
stop, then the export's write, which is trace_save.save_trace in the mode ONDEMAND_PROF_TRACE_SAVE names) on an
export thread of its own, so that each window's save overlaps the next window: a window records `--window` steps
(with_stack and record_shapes), and the next starts `--gap` steps after it ends (a window's end waits while two
saves are ahead of it). A saver still at SCHED_IDLE after `--raise-after` seconds (a rank: 10) is raised, so that
saves on cores kept busy by the hogs finish in bench time (the raise needs CAP_SYS_NICE: run as root). Post-processing, the daemon and
the CLI are not in the loop (they are separate processes, tested elsewhere); every trace is checked (it parses as
JSON and holds its ProfilerStep# ranges) and deleted.

The ranks run with GLIBC_TUNABLES=glibc.malloc.check=3:glibc.malloc.perturb=165:glibc.malloc.mmap_threshold=65536
and libc_malloc_debug.so preloaded (`--no-malloc-check`: glibc's defaults): a heap inconsistency aborts at once,
freed memory is overwritten, and a late write into a freed block of 64 KiB or more faults at the write. The fork
mode runs without the debug library (its arena locks survive a fork held: the child hangs), with glibc's own
checks, perturb (which skips blocks kept in the per-thread cache) and the mmap threshold. A rank that dies
leaves a core (RLIMIT_CORE raised; core_pattern `core`); gdb's stack of the faulting thread is printed and
attributed: to torch's gloo race when a gloo worker faulted in the profiler's end callback, to us when a
frame of odp_save or trace_save is on it, else to be read.

Prints a row per job and mode (windows per rank, traces checked, how it ended) and the totals; docs/faults.md
keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_gloo_race import free_port, rank_env, stack_of_core, start_rank, wait_ranks  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# A rank


def check_trace(path: Path, steps: list[int]) -> str | None:
    """None when `path` is a whole trace holding exactly these steps; else what is wrong."""
    try:
        events = json.loads(path.read_bytes())["traceEvents"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{path.name}: {type(exc).__name__}: {exc}"
    found = sorted(int(e["name"].split("#")[1]) for e in events
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"))
    return None if found == steps else f"{path.name}: steps {found}, expected {steps}"


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT))
    from ondemand_prof.rank import trace_save
    from ondemand_prof.core.options import WindowOptions
    from ondemand_prof.core.window import Window
    from ondemand_prof.rank.backends.base import Identity
    from ondemand_prof.rank.backends.torch_backend import TorchSession

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trace_save.RAISE_AFTER_S = args.raise_after  # a starved idle saver gets its share sooner (where allowed)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ident = Identity(rank=rank, world_size=2, local_rank=rank, host="localhost", pid=os.getpid(), job_id="stress",
                     dist_initialized=True)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(), torch.nn.Linear(args.width, 8)), bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, args.width)
    out = Path(args.dir)
    jobs: queue.Queue[Any] = queue.Queue(maxsize=1)  # a window waits at its end while two saves are ahead of it
    stats: dict[str, Any] = {"saved": 0, "checked": 0, "bad": [], "errors": [], "ways": {}, "unsettled": 0}

    def exporter() -> None:  # what rank/output.py's Exporter does with a window, less post-processing
        while (item := jobs.get()) is not None:
            export, index, steps = item
            staging = out / f"w{index}"
            staging.mkdir()
            try:
                written = export.write(staging)
                way = export.info.get("trace_save", "?")
                stats["ways"][way] = stats["ways"].get(way, 0) + 1
                stats["unsettled"] += export.info.get("gloo_settled") is False
                problem = check_trace(written.raw_trace, steps)
                stats["checked"] += 1
                if problem:
                    stats["bad"].append(problem)
                stats["saved"] += 1
            except Exception as exc:  # noqa: BLE001 - counted: a save that raised is a failure of the stress
                stats["errors"].append(f"window {index}: {type(exc).__name__}: {exc}"[:300])
            finally:
                for f in staging.iterdir():
                    f.unlink()
                staging.rmdir()

    worker = threading.Thread(target=exporter, name="stress-export", daemon=True)
    worker.start()
    options = WindowOptions(with_stack=True, record_shapes=True)
    step, windows, session, first = 0, 0, None, 0
    period = args.window + args.gap
    while windows < args.windows:
        phase = step % period
        if phase == 0:
            session = TorchSession(Window(step, step + args.window, options, source="stress", capture_id="s"),
                                   ident, cuda=False)
            first = step
        if session is not None and phase < args.window:
            session.record(step)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if session is not None and phase == args.window - 1:
            jobs.put((session.finish(), windows, list(range(first, first + args.window))))
            session = None
            windows += 1
            if windows % 10 == 0:
                print(f"rank {rank}: {windows} windows", file=sys.stderr, flush=True)
        step += 1
    jobs.put(None)
    worker.join()
    dist.barrier()
    print("RESULT " + json.dumps(dict(stats, rank=rank, windows=windows, bad=stats["bad"][:5],
                                      nbad=len(stats["bad"]), errors=stats["errors"][:5],
                                      nerrors=len(stats["errors"]))), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Jobs


def attribute(entry: dict[str, Any]) -> str:
    stack = " ".join(entry.get("stack", []))
    if re.search(r"odp_save|trace_save|native_save|ondemand", stack):
        return "ours"
    if "gloo worker" in entry.get("thread", "") and re.search(r"RecordFunction|profiler|onFunctionExit|finish", stack):
        return "torch's gloo race"
    return "to be read"


def one_job(args: argparse.Namespace, mode: str, index: int, base: Path) -> dict[str, Any]:
    job_dir = base / f"{mode}-{index}"
    job_dir.mkdir()
    port = free_port()
    procs = []
    race = argparse.Namespace(mmap_threshold=65536 if args.malloc_check else 0, malloc_check=args.malloc_check)
    for rank in range(2):
        cwd = job_dir / f"rank{rank}"
        (cwd / "traces").mkdir(parents=True)
        env = rank_env(race, rank, port)
        if mode == "fork":
            # libc_malloc_debug.so's heap has its own arena locks, which glibc's fork handlers do not reset: a
            # child forked while another thread allocated waits on them forever (seen: 1 save in 20, then the
            # 300 s fork timeout). The fork mode runs with glibc's own checks, perturb and the mmap threshold.
            env.pop("LD_PRELOAD", None)
            env["GLIBC_TUNABLES"] = ":".join(t for t in env["GLIBC_TUNABLES"].split(":")
                                             if not t.startswith("glibc.malloc.check"))
        env.update(ONDEMAND_PROF_TRACE_SAVE=mode, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, __file__, "--rank-child", "--raise-after", str(args.raise_after), "--windows",
               str(args.windows), "--window",
               str(args.window), "--gap", str(args.gap), "--width", str(args.width), "--dir", str(cwd / "traces")]
        procs.append(start_rank(cmd + ["--cwd", str(cwd)], cwd, env))
    return {"procs": procs, "dir": job_dir, "mode": mode, "index": index}


def finish_job(args: argparse.Namespace, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    results, timed_out = wait_ranks(job["procs"], timeout)
    row: dict[str, Any] = {"mode": job["mode"], "job": job["index"], "ranks": [], "timed_out": timed_out}
    for rank, code, out, err in results:
        res = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        entry: dict[str, Any] = {"rank": rank, "exit": code}
        if res:
            entry.update({k: res[k] for k in ("windows", "saved", "checked", "nbad", "bad", "nerrors", "errors",
                                             "ways", "unsettled")})
        else:
            entry["windows"] = max([int(m) for m in re.findall(r"rank \d+: (\d+) windows", err)] or [0])
            glibc = [line for line in err.splitlines()
                     if re.search(r"malloc|free\(\)|corrupt|double|bad_alloc|abort|Error", line, re.I)]
            if glibc:
                entry["message"] = glibc[-1][:200]
        core = next(iter(sorted((job["dir"] / f"rank{rank}").glob("core*"))), None)
        if code is not None and code < 0 and core is not None:
            entry.update(stack_of_core(core, job["dir"] / f"rank{rank}.gdb.txt"))
            entry["attributed"] = attribute(entry)
            core.unlink()
        row["ranks"].append(entry)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="auto,in-process,fork")
    parser.add_argument("--windows", type=int, default=300, help="windows per rank in each job")
    parser.add_argument("--jobs", type=int, default=1, help="jobs per mode (run one after the other)")
    parser.add_argument("--window", type=int, default=2, help="steps a window records")
    parser.add_argument("--gap", type=int, default=1, help="steps between a window's end and the next start")
    parser.add_argument("--hogs", type=int, default=1)
    parser.add_argument("--raise-after", type=float, default=1.0,
                        help="seconds before a saver still at SCHED_IDLE is raised (ranks: 10; needs CAP_SYS_NICE)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--no-malloc-check", dest="malloc_check", action="store_false")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    parser.add_argument("--out", default="")
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cwd", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        rank_main(args)
        return
    if "auto" in args.modes.split(","):
        from ondemand_prof.rank import native_save

        ok, message = native_save.build()
        print(f"native save: {message}", flush=True)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="save_stress_"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"logs under {base}", flush=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    rows = []
    started = time.monotonic()
    try:
        for i in range(args.jobs):
            for mode in args.modes.split(","):
                job = one_job(args, mode, i + 1, base)
                row = finish_job(args, job, args.timeout)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print(f"\n{len(rows)} job(s), {args.window}-step windows every {args.window + args.gap} steps, with_stack + "
          f"record_shapes, {args.hogs} hog(s), malloc check {'on' if args.malloc_check else 'off'}, "
          f"{time.monotonic() - started:.0f} s")
    print("| mode | job | windows (rank 0 / 1) | traces checked | bad traces | save errors | saved as | unsettled "
          "stops | how it ended |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals: dict[str, dict[str, int]] = {}
    for row in rows:
        ranks = row["ranks"]
        t = totals.setdefault(row["mode"], {"windows": 0, "checked": 0, "bad": 0, "errors": 0, "crashes": 0,
                                             "ours": 0})
        t["windows"] += min(r.get("windows", 0) for r in ranks)
        t["checked"] += sum(r.get("checked", 0) for r in ranks)
        t["bad"] += sum(r.get("nbad", 0) for r in ranks)
        t["errors"] += sum(r.get("nerrors", 0) for r in ranks)
        ended = ["timed out (killed by this script)"] if row["timed_out"] else []
        for r in ranks:
            if r["exit"] != 0 and not row["timed_out"]:
                t["crashes"] += 1
                t["ours"] += r.get("attributed") == "ours"
                ended.append(f"rank {r['rank']}: exit {r['exit']} {r.get('message', '')} {r.get('attributed', '')} "
                             f"{'; '.join(r.get('stack', [])[:4])}")
        ways = {}
        for r in ranks:
            for k, v in (r.get("ways") or {}).items():
                ways[k] = ways.get(k, 0) + v
        print(f"| {row['mode']} | {row['job']} | {' / '.join(str(r.get('windows', 0)) for r in ranks)} | "
              f"{sum(r.get('checked', 0) for r in ranks)} | {sum(r.get('nbad', 0) for r in ranks)} | "
              f"{sum(r.get('nerrors', 0) for r in ranks)} | {', '.join(f'{k} {v}' for k, v in sorted(ways.items()))} | "
              f"{sum(r.get('unsettled') or 0 for r in ranks)} | {'; '.join(ended) or 'ok'} |")
    print("\ntotals (windows: both ranks of a job; traces: per rank):")
    for mode, t in totals.items():
        print(f"  {mode}: {t['windows']} windows, {t['checked']} traces checked, {t['bad']} bad, {t['errors']} save "
              f"errors, {t['crashes']} rank(s) ended abnormally ({t['ours']} attributed to us)")


if __name__ == "__main__":
    main()
