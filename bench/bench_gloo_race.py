"""torch's gloo race at a profiler stop, reproduced with plain torch.profiler (no ondemand_prof in the loop).

    python bench/bench_gloo_race.py [--runs 4] [--windows 500] [--hogs 1] [--settle ours|none]

Two gloo DDP ranks on this host train a small model; each starts torch.profiler every `--every` steps and stops it
`--window` steps later, beside `--hogs` CPU hogs at normal priority. The ranks run with
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=65536 (`--mmap-threshold`): every allocation of 64 KiB or more, the
profiler's event blocks among them, is its own mapping, unmapped when freed, so a write into storage the stop has
freed faults at the write itself instead of corrupting the heap for a later malloc to find. A rank that dies
leaves a core file (RLIMIT_CORE raised for the ranks; the kernel's core_pattern must name a file, as the default
`core` does): gdb reads it and the script prints which thread faulted (a gloo worker, the main thread) and its
stack (the full dump of every thread goes to the run's directory).

--settle ours waits before each stop as ondemand_prof does (rank/backends/torch_backend.py settle_gloo_threads:
until every gloo worker waits for its next work item, at most 200 ms); --settle none is torch's own behaviour.
--malloc-check adds glibc's heap checking (glibc.malloc.check=3 with libc_malloc_debug.so preloaded, and
glibc.malloc.perturb) for the corruption the faults do not catch.

The table: per run, the windows each rank completed, how it ended (exit status, signal, glibc's message), and for
a crash the faulting thread and its top frames. docs/faults.md ("torch's gloo race") has what it showed and the
report for torch's issue tracker.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


# ----------------------------------------------------------------------------------------------------------
# A rank


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    settle = None
    if args.settle == "ours":
        sys.path.insert(0, str(ROOT))
        from ondemand_prof.rank.backends.torch_backend import settle_gloo_threads

        settle = settle_gloo_threads
    width = args.width
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 8)), bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, width)
    windows, step, prof, unsettled = 0, 0, None, 0
    activities = [torch.profiler.ProfilerActivity.CPU]
    while windows < args.windows:
        if step % args.every == 0:
            prof = torch.profiler.profile(activities=activities, record_shapes=args.shapes, with_stack=args.stack)
            prof.start()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if prof is not None and step % args.every == args.window - 1:
            if settle is not None:
                _, settled = settle()
                unsettled += not settled
            prof.stop()
            prof = None  # the window's results are freed here (where `free(): invalid pointer` was seen)
            windows += 1
            if windows % 10 == 0:
                print(f"rank {rank}: {windows} windows", file=sys.stderr, flush=True)
        step += 1
    print("RESULT " + json.dumps({"rank": rank, "windows": windows, "steps": step, "unsettled": unsettled}),
          flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# The runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(args: argparse.Namespace, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
    tunables = [f"glibc.malloc.mmap_threshold={args.mmap_threshold}"] if args.mmap_threshold else []
    if args.malloc_check:
        tunables += ["glibc.malloc.check=3", "glibc.malloc.perturb=165"]
        env["LD_PRELOAD"] = MALLOC_DEBUG
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", GLIBC_TUNABLES=":".join(tunables), PYTHONFAULTHANDLER="1")
    return env


def allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def start_rank(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """A rank whose output goes to files in `cwd` (out.txt, err.txt): kineto writes two lines to stderr per window,
    and a rank blocked on a full pipe would hold its peer in the next collective."""
    with open(cwd / "out.txt", "wb") as out, open(cwd / "err.txt", "wb") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, preexec_fn=allow_cores)


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> tuple[list[tuple[int, int, str, str]], bool]:
    """[(rank, exit status, stdout, stderr)] and whether the run was stopped at `timeout` with every rank alive
    (the survivor of a crash, waiting for its dead peer, is killed too but is no timeout)."""
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = timed_out or all(p.poll() is None for p in procs)
            for p in procs:
                p.kill()
            proc.wait()
    results = []
    for rank, proc in enumerate(procs):
        cwd = Path(proc.args[proc.args.index("--cwd") + 1]) if "--cwd" in proc.args else None
        assert cwd is not None
        results.append((rank, proc.returncode, (cwd / "out.txt").read_text(errors="replace"),
                        (cwd / "err.txt").read_text(errors="replace")))
    return results, timed_out


def stack_of_core(core: Path, out: Path) -> dict[str, Any]:
    """Which thread faulted (a gloo worker, the main thread) and its top frames, from gdb on the core (gdb's whole
    output into `out`)."""
    if not shutil.which("gdb"):
        return {"stack": ["(no gdb to read the core)"]}
    cmd = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "info threads", "-ex", "bt 40",
           "-ex", "thread apply all bt 12", sys.executable, str(core)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out.write_text(proc.stdout + proc.stderr)
    text = proc.stdout
    current = re.search(r"^\*\s+\d+\s+Thread \S+ \(LWP (\d+)\)", text, re.M)
    after_table = text[text.find("Target Id"):]  # gdb prints frame #0 once on loading the core: skip to "bt"
    frames = [line.strip() for line in after_table.splitlines() if re.match(r"#\d+ ", line)]
    bt: list[str] = []
    for line in frames:  # the first backtrace ("bt 40") is the faulting thread's
        if line.startswith("#0 ") and bt:
            break
        bt.append(re.sub(r"\s+", " ", line)[:160])
    handler = next((i for i, f in enumerate(bt) if "<signal handler called>" in f), None)
    if handler is not None:  # faulthandler's re-raise and the handler: the fault is the frame after
        bt = bt[handler + 1:]
    whole = " ".join(bt)
    kind = "gloo worker" if "ProcessGroupGloo::runLoop" in whole else "main thread" if re.search(
        r"Py_RunMain|pymain_run|in main \(", whole) else "another thread"
    return {"thread": f"{kind} (LWP {current.group(1)})" if current else "?",
            "signal": (re.search(r"Program terminated with signal (\w+)", text) or [None, "?"])[1], "stack": bt}


def one_run(args: argparse.Namespace, index: int, base: Path) -> dict[str, Any]:
    port = free_port()
    run_dir = base / f"run{index}"
    run_dir.mkdir()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    procs = []
    try:
        for rank in range(2):
            cwd = run_dir / f"rank{rank}"
            cwd.mkdir()
            cmd = [sys.executable, __file__, "--rank-child", "--windows", str(args.windows), "--every",
                   str(args.every), "--window", str(args.window), "--settle", args.settle, "--width", str(args.width)]
            cmd += ["--stack"] if args.stack else []
            cmd += ["--shapes"] if args.shapes else []
            procs.append(start_rank(cmd + ["--cwd", str(cwd)], cwd, rank_env(args, rank, port)))
        results, timed_out = wait_ranks(procs, args.timeout)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    row: dict[str, Any] = {"run": index, "ranks": [], "timed_out": timed_out}
    for rank, code, out, err in results:
        res = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        entry: dict[str, Any] = {"rank": rank, "exit": code, "windows": res["windows"] if res else
                                 max([int(m) for m in re.findall(r"rank \d+: (\d+) windows", err)] or [0]),
                                 "unsettled": res["unsettled"] if res else None}
        glibc = [line for line in err.splitlines() if re.search(r"malloc|free\(\)|corrupt|double|bad_alloc|abort",
                                                                line, re.I)]
        if glibc:
            entry["message"] = glibc[-1][:200]
        core = next(iter(sorted((run_dir / f"rank{rank}").glob("core*"))), None)
        if code is not None and code < 0 and core is not None:
            entry.update(stack_of_core(core, run_dir / f"rank{rank}.gdb.txt"))
            if not args.keep_cores:
                core.unlink()
        row["ranks"].append(entry)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--windows", type=int, default=500, help="windows per rank and run")
    parser.add_argument("--every", type=int, default=3, help="a window starts every this many steps")
    parser.add_argument("--window", type=int, default=2, help="steps in a window")
    parser.add_argument("--hogs", type=int, default=1, help="CPU hogs at normal priority beside the ranks")
    parser.add_argument("--settle", choices=["none", "ours"], default="none")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--stack", action="store_true", help="with_stack (more profiler storage per step)")
    parser.add_argument("--shapes", action="store_true", help="record_shapes")
    parser.add_argument("--mmap-threshold", type=int, default=65536, help="0: glibc's default")
    parser.add_argument("--malloc-check", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    parser.add_argument("--keep-cores", action="store_true")
    parser.add_argument("--out", default="", help="where the runs' logs go (default: a new temporary directory)")
    parser.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cwd", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        rank_main(args)
        return
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gloo_race_"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"logs (rank*/err.txt), cores and gdb output under {base}; core_pattern: "
          f"{Path('/proc/sys/kernel/core_pattern').read_text().strip()}", flush=True)
    rows = []
    started = time.monotonic()
    for i in range(args.runs):
        row = one_run(args, i + 1, base)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.runs} runs of {args.windows} windows per rank ({args.window} of every {args.every} steps), "
          f"settle {args.settle}, {args.hogs} hog(s), mmap_threshold {args.mmap_threshold or 'default'}, "
          f"malloc check {'on' if args.malloc_check else 'off'}, {time.monotonic() - started:.0f} s")
    print("| run | rank | windows | exit | glibc's message | faulting thread | top frames |")
    print("|---|---|---|---|---|---|---|")
    crashed = 0
    for row in rows:
        for r in row["ranks"]:
            died = r["exit"] is not None and r["exit"] < 0 and not row["timed_out"] and r["exit"] != -signal.SIGKILL
            crashed += died
            frames = "; ".join(f.split(" in ", 1)[-1].split(" (")[0] for f in r.get("stack", [])[:6])
            print(f"| {row['run']} | {r['rank']} | {r['windows']} | "
                  f"{'signal ' + signal.Signals(-r['exit']).name if died else 'timed out' if row['timed_out'] else r['exit']}"
                  f" | {r.get('message', '')} | "
                  f"{r.get('thread', '')} | {frames} |")
    print(f"{crashed} rank(s) crashed in {args.runs} runs; windows completed per rank: "
          f"{sum(min(r['windows'] for r in row['ranks']) for row in rows)}")


if __name__ == "__main__":
    main()
