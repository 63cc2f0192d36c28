"""Fan-out across hosts, simulated on loopback: 64 real ondemand-profd processes, each serving TCP with
CurveZMQ keys (--listen tcp://127.0.0.1:0 --keys), each with 8 simulated ranks (512 in all). A simulated rank
is the real rank-side DaemonLink driven by bench_daemon.py's stand-in agent (a clock for a training loop; it
accepts every window at once and reports "done" right after "scheduled"), so what is measured is the fan-out,
the authenticated TCP hops, the daemons and the links, not torch.

Each capture is what `ondemandctl --hosts ... capture` does (host/multihost.py launch, then
host/commands/follow.py): status from every daemon, one planned window, the capture with one id to
every daemon, then long-polls until
  * "scheduled": every one of the 512 ranks has reported the window scheduled back to its daemon and the CLI
    has seen it;
  * "complete": every host's record is final (with the stand-in, right after scheduling: this measures the
    protocol round trips, not a profiler).

    .venv/bin/python bench/bench_fanout.py [--daemons 64] [--ranks-per 8] [--captures 100]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_daemon import pct, print_table, run_links  # noqa: E402
from ondemand_prof.host.client import CtlError  # noqa: E402
from ondemand_prof.host.fanout import Fanout  # noqa: E402
from ondemand_prof.host.hosts import Target  # noqa: E402
from ondemand_prof.host.keys import keygen  # noqa: E402
from ondemand_prof.host.commands.follow import follow  # noqa: E402
from ondemand_prof.host.multihost import launch  # noqa: E402

SCHEDULED = ("scheduled", "recording", "writing", "done")


def start_daemons(n: int, keys: Path, tmp: Path, out: list[tuple[subprocess.Popen, Path, int]]
                  ) -> list[tuple[subprocess.Popen, Path, int]]:
    """Start n daemons (appended to `out` at once, so that the caller stops them whatever happens)."""
    for i in range(n):
        run_dir = Path(tempfile.mkdtemp(prefix=f"odf{i}-", dir="/tmp"))
        proc = subprocess.Popen([str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run_dir), "--state-dir",
                                 str(tmp / f"state{i}"), "--listen", "tcp://127.0.0.1:0", "--keys", str(keys),
                                 "--log-level", "ERROR"])
        out.append((proc, run_dir, 0))
    ready = []
    for proc, run_dir, _ in list(out):
        while not (run_dir / "profd.tcp").exists():
            if proc.poll() is not None:
                raise SystemExit(f"a daemon exited with {proc.returncode}")
            time.sleep(0.05)
        ready.append((proc, run_dir, int((run_dir / "profd.tcp").read_text().strip().rsplit(":", 1)[1])))
    return ready


def all_scheduled(data: dict[str, Any]) -> bool:
    """Pending while some part of this host's record is not yet scheduled (or further)."""
    return data["status"] == "running" and any(p["state"] not in SCHEDULED for p in data["parts"].values())


def one_capture(fan: Fanout) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    run = launch(fan, {"ranks": [-1], "steps": 1}, "bench")
    sent = time.perf_counter() - t0
    if run.failed:
        raise RuntimeError(f"hosts failed: {run.failed}")
    if not follow(fan, run.found, run.failed, 30, None, all_scheduled):
        raise RuntimeError("not scheduled everywhere within 30 s")
    scheduled = time.perf_counter() - t0
    if not follow(fan, run.found, run.failed, 30, None):
        raise RuntimeError("not complete everywhere within 30 s")
    return sent, scheduled, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemons", type=int, default=64)
    ap.add_argument("--ranks-per", type=int, default=8)
    ap.add_argument("--captures", type=int, default=100)
    ap.add_argument("--procs", type=int, default=4, help="processes the simulated ranks are spread over")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="odpfan"))
    keys = tmp / "keys"
    keygen(keys)
    daemons: list[tuple[subprocess.Popen, Path, int]] = []
    world = args.daemons * args.ranks_per
    stop = mp.Event()
    workers = []
    rows = []
    try:
        daemons = start_daemons(args.daemons, keys, tmp, daemons)
        assign = [(str(run_dir), range(i * args.ranks_per, (i + 1) * args.ranks_per))
                  for i, (_, run_dir, _) in enumerate(daemons)]
        per = -(-len(assign) // args.procs)
        for k in range(args.procs):
            ready = mp.Event()
            w = mp.Process(target=run_links, args=(assign[k * per:(k + 1) * per], world, stop, ready), daemon=True)
            w.start()
            ready.wait(120)
            workers.append(w)
        targets = [Target(f"127.0.0.1:{port}", "127.0.0.1", port) for _, _, port in daemons]
        with Fanout(targets, keys, timeout_s=10) as fan:
            deadline = time.monotonic() + 120
            while True:
                replies = fan.request("status")
                n = sum(len(r.data["jobs"].get("bench", [])) for r in replies.values() if r.ok)
                if n >= world:
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {n} of {world} ranks registered")
                time.sleep(0.2)
            t0 = time.perf_counter()
            fan.request("status")
            status_s = time.perf_counter() - t0
            one_capture(fan)  # warm: the first CurveZMQ handshakes are done by the status above
            results, failures = [], []
            for _ in range(args.captures):
                try:
                    results.append(one_capture(fan))
                except (RuntimeError, CtlError) as exc:  # counted, not hidden: an overloaded machine drops ranks
                    failures.append(str(exc))
        if not results:
            raise SystemExit(f"every capture failed, e.g. {failures[0]}")
        sent = [r[0] for r in results]
        sched = [r[1] for r in results]
        done = [r[2] for r in results]
        label = f"{args.daemons} daemons x {args.ranks_per} ranks"
        rows += [(f"status from {args.daemons} daemons (one fan-out round)", f"{status_s * 1000:.1f} ms"),
                 (f"capture sent to every daemon ({label}), p50 / p99",
                  f"{statistics.median(sent) * 1000:.1f} / {pct(sent, 99) * 1000:.1f} ms"),
                 (f"capture -> scheduled on all {world} ranks, p50 / p99",
                  f"{statistics.median(sched) * 1000:.1f} / {pct(sched, 99) * 1000:.1f} ms"),
                 (f"capture -> complete on every host, p50 / p99",
                  f"{statistics.median(done) * 1000:.1f} / {pct(done, 99) * 1000:.1f} ms"),
                 ("captures that failed (a host or rank missing)", f"{len(failures)} of {args.captures}"
                  + (f": {failures[0][:80]}" if failures else ""))]
    finally:
        stop.set()
        for w in workers:
            w.join(10)
        for proc, run_dir, _ in daemons:
            proc.terminate()
        for proc, run_dir, _ in daemons:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, f"value   ({args.captures} captures, CurveZMQ on loopback)")


if __name__ == "__main__":
    main()
