"""Daemon latency and scale, against dynolog's 5 s polling.

A real ondemand-profd (bin/ondemand-profd) and simulated ranks: each is the real rank-side DaemonLink (the code a
training rank runs) driven by a stand-in agent whose training loop is a clock (10 ms steps) and whose hook
accepts every window at once, so what is measured is the protocol, the daemon and the link, not torch.

  small   64 ranks: the CLI's capture request until every rank has reported the window "scheduled" back to the
          daemon and the CLI has seen it (the whole round trip a user waits for), p50 / p99 over N captures.
  big     4096 ranks heart-beating once a second: the daemon's CPU share over a window, the time from a
          capture request until all 4096 ranks have acknowledged it, and (the daemon runs with --metrics)
          the same CPU window while a scraper reads /metrics every second, with the control loop's answer
          time (a cheap request every 0.1 s) in both windows: scraping must not slow the loop.
  stacks  `ondemandctl stacks` of all 4096 ranks: the daemon's extra peak memory (VmHWM, reset before the
          request) while the answers arrive. Each simulated rank answers with a SYNTHETIC stack set sized like
          a busy real rank's (16 threads of 48 frames, trimmed by the rank's own fit_stacks to its 56 KiB cap);
          every 512th rank's main thread differs, as a stuck rank's would.

    .venv/bin/python bench/bench_daemon.py [--captures 100] [--big 4096] [--phases small,big,stacks]

BENCH_DAEMON_CMD runs another daemon command instead (a profiler wrapper, or an older checkout:
"env PYTHONPATH=/tmp/old .venv/bin/python -m ondemand_prof.host.profd"); --no-metrics for one without --metrics.
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
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import zmq  # noqa: E402

from ondemand_prof.rank.backends import Identity  # noqa: E402
from ondemand_prof.core.options import ProfileConfig  # noqa: E402
from ondemand_prof.host.client import Client, CtlError  # noqa: E402
from ondemand_prof.host.commands.follow import merge_watched  # noqa: E402
from ondemand_prof.rank.daemon_link import DaemonLink  # noqa: E402
from ondemand_prof.rank.triage import collect_stacks, fit_stacks  # noqa: E402

STEP_S = 0.01
DONE_DIR = "/tmp/ondemand_prof-bench/capture"
RANK_GONE_S = 4.0


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


def synthetic_stacks(rank: int, threads: int = 16) -> list[dict[str, Any]]:
    """A busy rank's answer (SYNTHETIC): the simulator's own real frames, repeated to 48 per thread, 16 threads,
    then trimmed by the rank's real fit_stacks; every 512th rank's main thread stands elsewhere."""
    real = [f for t in collect_stacks() for f in t["frames"]] or [["bench.py", 1, "main", ""]]
    frames = (real * (48 // len(real) + 1))[:48]
    out = []
    for i in range(threads):
        fr = [list(f) for f in frames]
        if i == 0 and rank % 512 == 511:
            fr[-1] = ["train.py", 97, "all_reduce_stuck", "dist.all_reduce(p.grad)"]
        out.append({"name": "MainThread" if i == 0 else f"worker-{i}", "main": i == 0, "daemon": i > 0,
                    "collector": False, "depth": 60, "frames": fr})
    return fit_stacks(out)[0]


class SimTriage:
    def __init__(self, prof: SimProf) -> None:
        self.prof = prof
        self.native = self

    def announce(self) -> None:
        return None

    def request(self, action: str, args: Any, reply: Any, capture_id: str) -> None:
        if action != "stacks":
            reply({"ok": False, "error": "the simulator answers stacks only"})
            return
        reply({"ok": True, "method": "python", "threads": synthetic_stacks(self.prof.identity().rank),
               "trimmed": True, "current_step": self.prof.current_step})


class SimAgent:
    """The agent's interface to the link; schedule() is the hook accepting the window at its next step."""

    def __init__(self, prof: SimProf) -> None:
        self.prof = prof
        self.config = prof.config
        self.triage = SimTriage(prof)
        self.trigger_dir = ""  # no trigger file: the daemon is told none

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
            if link.socket in events or now >= link._next_beat or link._outbox or link._replies:  # noqa: SLF001
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


def stop_sim(workers: list[mp.Process], stop: Any) -> None:
    stop.set()
    for w in workers:
        w.join(10)


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
    while any(p["state"] not in states for p in rec["parts"].values()):  # as ondemandctl capture --wait asks
        rec = merge_watched(rec, client.request("watch", capture_id=rec["capture_id"], seen=rec["version"],
                                                timeout_s=10, changed_only=True, wait_s=30))
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


def load() -> str:
    return "load %.1f" % os.getloadavg()[0]


class Scraper(threading.Thread):
    """GET /metrics every `period` s (Prometheus scrapes every 15-60 s: this is far more often), with curl in its
    own process: reading 1.4 MiB in this process held its GIL and slowed the probe that times the daemon."""

    def __init__(self, url: str, period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.times: list[float] = []
        self.size = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            t0 = time.perf_counter()
            out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{size_download}", self.url],
                                 capture_output=True, text=True, timeout=30).stdout
            self.size = int(out or 0)
            self.times.append(time.perf_counter() - t0)
            self.done.wait(max(0.0, self.period - (time.perf_counter() - t0)))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per kind of thread: the main loop, libzmq's I/O and reaper threads ("ZMQbg/..."), others."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = "main" if task.name == str(pid) else "zmq" if name.startswith("ZMQbg") else "other"
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_window(dproc: psutil.Process, client: Client, seconds: float) -> tuple[float, list[float], str]:
    """The daemon's CPU share over `seconds`, the answer times of a cheap request sent every 0.1 s, and the
    share per kind of thread."""
    probe: list[float] = []
    c0, w0, t0 = dproc.cpu_times(), time.monotonic(), thread_cpu(dproc.pid)
    while time.monotonic() - w0 < seconds:
        t = time.perf_counter()
        client.request("list", limit=1, wait_s=30)
        probe.append(time.perf_counter() - t)
        time.sleep(0.1)
    c1, w1, t1 = dproc.cpu_times(), time.monotonic(), thread_cpu(dproc.pid)
    split = ", ".join(f"{k} {(t1[k] - t0.get(k, 0.0)) / (w1 - w0) * 100:.1f}" for k in sorted(t1))
    return ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0), probe, split


def peak_extra_rss(pid: int, action: Any) -> tuple[float, Any]:
    """MiB the process's peak RSS rose above its RSS while `action()` ran (VmHWM reset through clear_refs)."""
    def status(key: str) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        return 0
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the peak to the current RSS
    before = status("VmRSS")
    result = action()
    return (status("VmHWM") - before) / 1024, result


def small_phase(args: argparse.Namespace, run_dir: Path, client: Client, dproc: psutil.Process,
                rows: list[tuple[str, str]]) -> None:
    workers, stop = start_sim(run_dir, args.small, args.procs)
    try:
        wait_registered(client, args.small)
        ld = load()
        c0, t0 = dproc.cpu_times(), thread_cpu(dproc.pid)
        lat = [capture_until(client, ("scheduled", "recording", "writing", "done")) for _ in range(args.captures)]
        c1, t1 = dproc.cpu_times(), thread_cpu(dproc.pid)
        rows.append((f"capture -> scheduled on all {args.small} ranks, p50 ({ld})",
                     f"{statistics.median(lat) * 1000:.1f} ms"))
        rows.append((f"capture -> scheduled on all {args.small} ranks, p99", f"{pct(lat, 99) * 1000:.1f} ms"))
        # what a loaded machine does not inflate much: the daemon's own CPU time per capture (its 64 ranks'
        # heartbeats included, about 1% of it)
        per = ((c1.user + c1.system) - (c0.user + c0.system)) / args.captures
        split = ", ".join(f"{k} {(t1[k] - t0.get(k, 0.0)) / args.captures * 1000:.1f}" for k in sorted(t1))
        rows.append(("daemon CPU per capture (request, 3 events a rank, answers)", f"{per * 1000:.1f} ms ({split})"))
    finally:
        stop_sim(workers, stop)
    time.sleep(RANK_GONE_S)


def big_phase(args: argparse.Namespace, run_dir: Path, client: Client, dproc: psutil.Process,
              rows: list[tuple[str, str]], phases: set[str]) -> None:
    t_reg = time.monotonic()
    workers, stop = start_sim(run_dir, args.big, 8)
    try:
        wait_registered(client, args.big, timeout=300)
        rows.append((f"{args.big} ranks registered after", f"{time.monotonic() - t_reg:.1f} s"))
        time.sleep(2.0)  # steady state
        metrics = run_dir / "profd.metrics"
        if "big" in phases:
            for i in range(args.cpu_runs):
                ld = load()
                spy = None
                if os.environ.get("BENCH_PYSPY") and i == 0:  # where the main thread's time goes (sampled)
                    spy = subprocess.Popen(["py-spy", "record", "--pid", str(dproc.pid), "--duration",
                                            str(int(args.cpu_window)), "--format", "raw", "--nonblocking",
                                            "--output", os.environ["BENCH_PYSPY"]], stdout=subprocess.DEVNULL)
                share, probe, split = cpu_window(dproc, client, args.cpu_window)
                if spy is not None:
                    spy.wait(60)
                rows.append((f"daemon CPU, {args.big} ranks at 1 Hz, window {i + 1} ({ld})",
                             f"{share * 100:.1f} % of a core ({split}); loop answers p50 "
                             f"{statistics.median(probe) * 1000:.1f} / max {max(probe) * 1000:.1f} ms"))
                if metrics.exists():
                    scraper = Scraper(f"http://{metrics.read_text().strip()}/metrics")
                    scraper.start()
                    ld = load()
                    share, probe, split = cpu_window(dproc, client, args.cpu_window)
                    scraper.done.set()
                    scraper.join(30)
                    rows.append((f"  same, scraped every 1 s ({ld})",
                                 f"{share * 100:.1f} % of a core ({split}); loop answers p50 "
                                 f"{statistics.median(probe) * 1000:.1f} / max {max(probe) * 1000:.1f} ms; scrape "
                                 f"p50 {statistics.median(scraper.times) * 1000:.0f} ms, {scraper.size / 1024:.0f} KiB"))
            try:
                acks = [capture_until(client, ("received", "scheduled", "recording", "writing", "done"))
                        for _ in range(3)]
                rows.append((f"capture -> acknowledged by all {args.big} ranks (best/worst of 3)",
                             f"{min(acks) * 1000:.0f} / {max(acks) * 1000:.0f} ms"))
            except CtlError as exc:  # e.g. STALLED: simulated ranks starved of CPU on a loaded machine
                rows.append((f"capture -> acknowledged by all {args.big} ranks", f"FAILED: {str(exc)[:160]}"))
        if "stacks" in phases:
            rss = dproc.memory_info().rss / 2**20
            t0 = time.perf_counter()
            try:
                extra, data = peak_extra_rss(dproc.pid, lambda: client.request(
                    "stacks", ranks=[-1], timeout_s=60, args={}, wait_s=90))
            except CtlError as exc:
                extra, data = float("nan"), {"error": str(exc)}
            took = time.perf_counter() - t0
            answered = len(data.get("answered_python", []))
            groups = sum(len(t["stacks"]) for t in data.get("threads", []))
            rows.append((f"stacks of {args.big} ranks: daemon peak RSS over its {rss:.0f} MiB",
                         f"+{extra:.0f} MiB ({answered} answered, {groups} distinct stacks, {took:.1f} s)"))
        rows.append(("daemon RSS", f"{dproc.memory_info().rss / 2**20:.0f} MiB"))
    finally:
        stop_sim(workers, stop)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--captures", type=int, default=100)
    ap.add_argument("--small", type=int, default=64)
    ap.add_argument("--big", type=int, default=4096)
    ap.add_argument("--cpu-window", type=float, default=10.0)
    ap.add_argument("--cpu-runs", type=int, default=2, help="CPU windows measured (each also scraped)")
    ap.add_argument("--procs", type=int, default=4, help="processes the small run's ranks are spread over")
    ap.add_argument("--phases", default="small,big,stacks", help="any of small, big, stacks")
    ap.add_argument("--no-metrics", action="store_true", help="start the daemon without --metrics")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    run_dir = Path(tempfile.mkdtemp(prefix="odpb", dir="/tmp"))
    state_dir = Path(tempfile.mkdtemp(prefix="odpbs", dir="/tmp"))
    log_path = Path(tempfile.mkstemp(prefix="odpb-daemon-", suffix=".log", dir="/tmp")[1])
    cmd = os.environ.get("BENCH_DAEMON_CMD")  # e.g. a profiling wrapper: "python /tmp/profd_prof.py"
    extra = [] if args.no_metrics else ["--metrics", "127.0.0.1:0"]
    with open(log_path, "w") as log_file:  # thousands of "rank left" lines when a simulation stops
        daemon = subprocess.Popen([*(cmd.split() if cmd else [str(ROOT / "bin" / "ondemand-profd")]),
                                   "--runtime-dir", str(run_dir), "--state-dir", str(state_dir), "--log-level",
                                   "WARNING", *extra], stderr=log_file)
    rows: list[tuple[str, str]] = []
    try:
        while not (run_dir / "profd.sock").exists():
            if daemon.poll() is not None:
                raise SystemExit(f"the daemon exited with {daemon.returncode}; see {log_path}")
            time.sleep(0.05)
        client = Client(run_dir, timeout_s=30)
        dproc = psutil.Process(daemon.pid)
        if "small" in phases:
            small_phase(args, run_dir, client, dproc, rows)
        if phases & {"big", "stacks"}:
            big_phase(args, run_dir, client, dproc, rows, phases)
        client.close()
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)
        print_table(rows or [("(nothing measured)", "")])
    print(f"(daemon log: {log_path}; {load()} at the end, {os.cpu_count()} cores)")
    print("(dynolog: ranks poll the daemon every 5 s, so a request waits up to 5 s before any rank sees it)")


if __name__ == "__main__":
    main()
