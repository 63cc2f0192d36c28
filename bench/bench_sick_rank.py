"""How long `capture --wait` waits on a rank whose core is hogged (issue 44, 4: a 2.4 MB trace's post-processing
took 15.5 s on the sick rank, 0.46 s on the other, and `capture --wait` answered 25 s after the window).

    python bench/bench_sick_rank.py [--repeat 3] [--ops 600] [--steps 2] [--package DIR]

A real daemon and two gloo ranks of the toy training loop: rank 0 pinned to CPU 0, rank 1 pinned to CPU 1 beside
two `yes` loops pinned there too (the sick rank: a third of its core). Each rank runs --ops extra tiny additions
a step (the trace's size). Each capture (`ondemandctl capture --steps N --wait`) is timed from each rank's window
end (its metadata's window_ended_at) to: its rank directory published (published_at, when it says "done"), the
capture's answer (`capture --wait` returned), and its summary.json written (polled). --package runs another
checkout's ondemand_prof/ (`git archive OLD ondemand_prof | tar -x -C DIR`) for the daemon, the ranks and the CLI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def env_for(pkg: Path, run: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
    env.update(PYTHONPATH=str(pkg), OMP_NUM_THREADS="1", ONDEMAND_PROF_RUNTIME_DIR=str(run), **extra)
    return env


def ctl(pkg: Path, run: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ondemand_prof.host.ctl", *args], env=env_for(pkg, run),
                          capture_output=True, text=True, timeout=timeout, cwd="/")


def epoch(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()


def rank_dirs(save: Path, capture_id: str) -> list[Path]:
    folder = save / capture_id
    return sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")) if folder.is_dir() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ops", type=int, default=600, help="extra tiny additions a step (the trace's size)")
    parser.add_argument("--hogs", type=int, default=2, help="`yes` loops on the sick rank's CPU")
    parser.add_argument("--package", type=Path, default=ROOT, help="the checkout whose ondemand_prof/ runs")
    parser.add_argument("--summary-wait", type=float, default=300.0, help="seconds to wait for summary.json")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs two CPUs")
    healthy, sick = cpus[0], cpus[1]
    tmp = Path(tempfile.mkdtemp(prefix="odp-sick-", dir="/tmp"))
    run, state, save = tmp / "run", tmp / "state", tmp / "save"
    pkg = args.package.resolve()
    (tmp / "inject.json").write_text(json.dumps({"kind": "small_ops", "amount": args.ops}))
    procs: list[subprocess.Popen] = []
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; package {pkg}; rank 1 and {args.hogs} `yes` "
          f"on CPU {sick}, rank 0 on CPU {healthy}")
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "ondemand_prof.host.profd", "--runtime-dir", str(run),
                                       "--state-dir", str(state)], env=env_for(pkg, run), cwd="/",
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not (run / "profd.sock").exists():
            if time.monotonic() > deadline:
                sys.exit("the daemon did not start")
            time.sleep(0.05)
        for _ in range(args.hogs):
            procs.append(subprocess.Popen(["taskset", "-c", str(sick), "yes"], stdout=subprocess.DEVNULL))
        port = str(20000 + os.getpid() % 20000)
        for rank, cpu in ((0, healthy), (1, sick)):
            env = env_for(pkg, run, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port)
            procs.append(subprocess.Popen(
                ["taskset", "-c", str(cpu), sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps",
                 "100000000", "--inject-file", str(tmp / "inject.json"), "--profile-save-path", str(save),
                 "--profile-min-free-mb", "0"], env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                stderr=open(tmp / f"err{rank}.log", "w")))
        deadline = time.monotonic() + 300
        while True:
            res = ctl(pkg, run, "status", "--json")
            ranks = [r for rs in json.loads(res.stdout)["jobs"].values() for r in rs] if res.returncode == 0 else []
            if len(ranks) == 2 and all(r.get("step_time_s") for r in ranks):
                break
            if time.monotonic() > deadline:
                sys.exit("the ranks did not start stepping")
            time.sleep(1.0)
        print(f"{'cap':>3} {'rank':>4} {'MB':>6} {'end->done':>10} {'end->answer':>12} {'end->summary':>13} "
              f"{'trace way':>10} {'write':>7} {'rewrite':>8}")
        rows: list[dict[str, Any]] = []
        for i in range(args.repeat):
            t0 = time.time()
            res = ctl(pkg, run, "capture", "--steps", str(args.steps), "--wait", "--json")
            answered = time.time()
            if res.returncode != 0:
                print(f"capture {i + 1} exited {res.returncode}: {res.stdout[-500:]} {res.stderr[-500:]}")
                continue
            cid = json.loads(res.stdout)["capture_id"]
            dirs = rank_dirs(save, cid)
            waited = time.monotonic() + args.summary_wait
            while not all((d / "summary.json").exists() for d in dirs) and time.monotonic() < waited:
                time.sleep(0.05)
            for d in dirs:
                meta = json.loads((d / "metadata.json").read_text())
                end = epoch(meta["timings"]["window_ended_at"])
                summary = d / "summary.json"
                trace = d / meta["trace_file"]
                row = {"capture": i + 1, "rank": meta["rank"], "mb": trace.stat().st_size / 1e6,
                       "done_s": epoch(meta["published_at"]) - end, "answer_s": answered - end,
                       "summary_s": summary.stat().st_mtime - end if summary.exists() else None,
                       "way": "rewritten" if (meta.get("postprocess") or {}).get("rewritten", True) else "as is",
                       "asked_s": end - t0, "write_s": meta["timings"].get("write_s", 0.0),
                       "post_s": meta["timings"].get("postprocess_s", 0.0)}
                rows.append(row)
                summ = f"{row['summary_s']:>12.2f}s" if row["summary_s"] is not None else f"{'not yet':>13}"
                print(f"{i + 1:>3} {row['rank']:>4} {row['mb']:>6.2f} {row['done_s']:>9.2f}s {row['answer_s']:>11.2f}s "
                      f"{summ} {row['way']:>10} {row['write_s']:>6.2f}s {row['post_s']:>7.2f}s", flush=True)
        for rank in (0, 1):
            mine = [r for r in rows if r["rank"] == rank]
            if mine:
                print(f"rank {rank} medians: end->done {statistics.median(r['done_s'] for r in mine):.2f} s, "
                      f"end->answer {statistics.median(r['answer_s'] for r in mine):.2f} s, end->summary "
                      f"{statistics.median(r['summary_s'] for r in mine if r['summary_s'] is not None) if any(r['summary_s'] is not None for r in mine) else float('nan'):.2f} s")
        print(f"load {os.getloadavg()[0]:.1f} at the end")
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
