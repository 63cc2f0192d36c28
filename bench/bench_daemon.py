"""Daemon latency and scale, against dynolog's 5 s polling.

A real ondemand-profd (bin/ondemand-profd) and simulated ranks: each is the real rank-side DaemonLink (the code a
training rank runs) driven by a stand-in agent whose training loop is a clock (10 ms steps) and whose hook
accepts every window at once, so what is measured is the protocol, the daemon and the link, not torch.

  1. 64 ranks: the CLI's capture request until every rank has reported the window "scheduled" back to the
     daemon and the CLI has seen it (the whole round trip a user waits for), p50 / p99 over N captures.
  2. 4096 ranks heart-beating once a second: the daemon's CPU share over 10 s, and the time from a capture
     request until all 4096 ranks have acknowledged it.

    .venv/bin/python bench/bench_daemon.py [--captures 100] [--big 4096]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
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
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import zmq  # noqa: E402

from ondemand_prof.rank.backends import Identity  # noqa: E402
from ondemand_prof.core.options import ProfileConfig  # noqa: E402
from ondemand_prof.host.client import Client  # noqa: E402
from ondemand_prof.rank.daemon_link import DaemonLink  # noqa: E402

STEP_S = 0.01
DONE_DIR = "/tmp/ondemand_prof-bench/capture"


class SimProf:
    def __init__(self, rank: int, world: int, job: str, t0: float) -> None:
        os.makedirs(DONE_DIR, mode=0o700, exist_ok=True)
        self.config = ProfileConfig(save_path="/tmp/ondemand_prof-bench")
        self._ident = Identity(rank=rank, world_size=world, local_rank=rank, host="bench", pid=os.getpid(),
                               job_id=job, dist_initialized=True)
        self.t0 = t0
        self.state = "idle"

    def identity(self) -> Identity:
        return self._ident

    @property
    def current_step(self) -> int:
        return int((time.time() - self.t0) / STEP_S)


class SimAgent:
    """The agent's interface to the link; schedule() is the hook accepting the window at its next step."""

    def __init__(self, prof: SimProf) -> None:
        self.prof = prof
        self.config = prof.config

    def schedule(self, window: Any, listener: Any) -> None:
        listener("scheduled", {"window": [window.start, window.end], "current_step": self.prof.current_step})
        # a real rank reports "done" some steps later; reporting it now keeps the daemon's set of running
        # captures as small as a real host's (a stand-in that never finishes would grow it with every capture)
        # (a folder that exists under the save root and is ours: the daemon refuses any other "done" path)
        listener("done", {"path": DONE_DIR, "status": "ok"})

    def wake(self) -> None:
        pass

    def step_time(self) -> float:
        return STEP_S

    def step_began(self) -> tuple[int, float]:
        step = self.prof.current_step
        return step, self.prof.t0 + step * STEP_S


def ranks_process(run_dir: str, ranks: range, world: int, stop: Any, ready: Any) -> None:
    run_links([(run_dir, ranks)], world, stop, ready)


def run_links(assign: list[tuple[str, range]], world: int, stop: Any, ready: Any) -> None:
    """Simulated ranks until `stop`: for each (runtime dir, ranks) pair, those ranks linked to that daemon."""
    ctx = zmq.Context(io_threads=1)
    ctx.setsockopt(zmq.MAX_SOCKETS, sum(len(r) for _, r in assign) + 64)
    t0 = time.time()
    links = []
    for run_dir, ranks in assign:
        for r in ranks:
            agent = SimAgent(SimProf(r, world, "bench", t0))
            links.append((DaemonLink(agent, Path(run_dir), context=ctx), agent))  # type: ignore[arg-type]
    poller = zmq.Poller()
    for link, _ in links:
        poller.register(link.socket, zmq.POLLIN)
    # spread the heartbeats over the second, as independent ranks would be
    for i, (link, _) in enumerate(links):
        link._next_beat = time.monotonic() + i / len(links)  # noqa: SLF001 - bench drives the link directly
    ready.set()
    while not stop.is_set():
        events = dict(poller.poll(20))
        now = time.monotonic()
        for link, agent in links:
            if link.socket in events or now >= link._next_beat or link._outbox:  # noqa: SLF001
                link.poll(now)
    for link, _ in links:
        link.close()
    ctx.term()


def start_sim(run_dir: Path, n: int, procs: int) -> tuple[list[mp.Process], Any]:
    stop = mp.Event()
    workers = []
    per = -(-n // procs)
    for i in range(procs):
        ready = mp.Event()
        p = mp.Process(target=ranks_process, args=(str(run_dir), range(i * per, min(n, (i + 1) * per)), n, stop,
                                                   ready), daemon=True)
        p.start()
        ready.wait(120)
        workers.append(p)
    return workers, stop


def wait_registered(client: Client, n: int, timeout: float = 120) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if len(client.request("status", wait_s=30)["jobs"].get("bench", [])) >= n:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"not all of {n} ranks registered within {timeout:.0f} s")


def capture_until(client: Client, states: tuple[str, ...], ranks: Any = -1) -> float:
    """Seconds from sending a capture until every part reached one of `states` (as the CLI sees it)."""
    t0 = time.perf_counter()
    rec = client.request("capture", job="bench", request={"ranks": [ranks] if isinstance(ranks, int) else ranks,
                                                          "steps": 1}, wait_s=30)
    while any(p["state"] not in states for p in rec["parts"].values()):
        rec = client.request("watch", capture_id=rec["capture_id"], seen=rec["version"], timeout_s=10, wait_s=30)
    return time.perf_counter() - t0


def print_table(rows: list[tuple[str, str]], header: str = "value") -> None:
    """The benches' "measure  value" table, names padded to one column."""
    width = max(len(r[0]) for r in rows)
    print(f"{'measure'.ljust(width)}  {header}")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--captures", type=int, default=100)
    ap.add_argument("--small", type=int, default=64)
    ap.add_argument("--big", type=int, default=4096)
    ap.add_argument("--cpu-window", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=4, help="processes the small run's ranks are spread over")
    args = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="odpb", dir="/tmp"))
    state_dir = Path(tempfile.mkdtemp(prefix="odpbs", dir="/tmp"))
    cmd = os.environ.get("BENCH_DAEMON_CMD")  # e.g. a profiling wrapper: "python /tmp/profd_prof.py"
    daemon = subprocess.Popen([*(cmd.split() if cmd else [str(ROOT / "bin" / "ondemand-profd")]), "--runtime-dir",
                               str(run_dir), "--state-dir", str(state_dir), "--log-level", "WARNING"])
    rows = []
    try:
        while not (run_dir / "profd.sock").exists():
            if daemon.poll() is not None:
                raise SystemExit(f"the daemon exited with {daemon.returncode}")
            time.sleep(0.05)
        client = Client(run_dir, timeout_s=30)
        dproc = psutil.Process(daemon.pid)

        workers, stop = start_sim(run_dir, args.small, args.procs)
        wait_registered(client, args.small)
        lat = [capture_until(client, ("scheduled", "recording", "writing", "done")) for _ in range(args.captures)]
        rows.append((f"capture -> scheduled on all {args.small} ranks, p50", f"{statistics.median(lat) * 1000:.1f} ms"))
        rows.append((f"capture -> scheduled on all {args.small} ranks, p99", f"{pct(lat, 99) * 1000:.1f} ms"))
        stop.set()
        for w in workers:
            w.join(10)
        time.sleep(RANK_GONE_S)

        t_reg = time.monotonic()
        workers, stop = start_sim(run_dir, args.big, 8)
        wait_registered(client, args.big, timeout=300)
        rows.append((f"{args.big} ranks registered after", f"{time.monotonic() - t_reg:.1f} s"))
        time.sleep(2.0)  # steady state
        c0, w0, t0 = dproc.cpu_times(), time.monotonic(), {t.id: t for t in dproc.threads()}
        time.sleep(args.cpu_window)
        c1, w1, t1 = dproc.cpu_times(), time.monotonic(), {t.id: t for t in dproc.threads()}
        if os.environ.get("BENCH_THREADS"):
            for tid, t in t1.items():
                if tid in t0:
                    print(f"thread {tid}: {(t.user_time + t.system_time - t0[tid].user_time - t0[tid].system_time) / (w1 - w0) * 100:.1f} %")
        share = ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0)
        rows.append((f"daemon CPU, {args.big} ranks heart-beating at 1 Hz", f"{share * 100:.1f} % of a core"))
        acks = [capture_until(client, ("received", "scheduled", "recording", "writing", "done")) for _ in range(3)]
        rows.append((f"capture -> acknowledged by all {args.big} ranks (best/worst of 3)",
                     f"{min(acks) * 1000:.0f} / {max(acks) * 1000:.0f} ms"))
        rows.append(("daemon RSS", f"{dproc.memory_info().rss / 2**20:.0f} MiB"))
        stop.set()
        for w in workers:
            w.join(10)
        client.close()
    finally:
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)
    print_table(rows)
    print("(dynolog: ranks poll the daemon every 5 s, so a request waits up to 5 s before any rank sees it)")


RANK_GONE_S = 4.0

if __name__ == "__main__":
    main()
