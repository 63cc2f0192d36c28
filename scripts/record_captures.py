"""Record real captures once, for the tests that replay them (tests/fixtures/recorded/, README.md there).

A real daemon and a real gloo job (ondemand_prof.demo.toy_train, 20 ms of sleep a step), a baseline captured while
healthy, then a slowdown switched on while it runs (toy_train --inject-file) and a capture; each rank's summary.json
and metadata.json of both captures are kept (what a comparison reads), not the traces. The host's load is changed
on purpose where a scenario says so (`yes` processes, pinned to a core where it says which).

    .venv/bin/python scripts/record_captures.py [--out tests/fixtures/recorded] [SCENARIO ...]
    .venv/bin/python scripts/record_captures.py --list

Each scenario writes OUT/<name>/{baseline,now}/<rank folder>/{summary.json,metadata.json} and OUT/<name>/how.json
(what was done, the machine's load, when). Recording is slow (real steps) and its numbers depend on the machine:
the tests assert what the comparison concludes from these files, which no later load can change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import (base_env, ctl, end_test_env, free_port, short_dir, start_daemon,  # noqa: E402
                      status_lines, summaries_written, wait_for)

STEP_SLEEP = "0.02"


class Job:
    """A daemon and a gloo job of `world` ranks reading a slowdown switch, each rank pinned to `cpus[rank]`."""

    def __init__(self, world: int, cpus: list[int] | None = None, extra: list[str] | None = None) -> None:
        self.run, self.state = short_dir("odprec"), short_dir("odprecs")
        self.work = short_dir("odprecw")
        self.inject_file = self.work / "inject.json"
        self.inject_file.write_text("{}")
        self.daemon = start_daemon(self.run, self.state)
        port = str(free_port())
        self.procs = []
        for rank in range(world):
            env = base_env(ONDEMAND_PROF_RUNTIME_DIR=str(self.run), RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            prefix = ["taskset", "-c", str(cpus[rank])] if cpus else []
            self.procs.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", "1000000", "--step-sleep",
                 STEP_SLEEP, "--status-file", str(self.work / "steps.jsonl"), "--inject-file", str(self.inject_file),
                 *(extra or [])], env=env, cwd=self.work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True))
        wait_for(lambda: self.steps_done() > 40 * world or any(p.poll() is not None for p in self.procs), 300,
                 "the job to warm up")
        if any(p.poll() is not None for p in self.procs):
            raise RuntimeError("a rank ended: " + " | ".join(p.communicate()[1][-1500:] for p in self.procs))

    def steps_done(self) -> int:
        return len(status_lines(self.work / "steps.jsonl"))

    def inject(self, spec: dict[str, Any]) -> None:
        """At a step every rank agrees on (10 after the latest one finished), as a whole file."""
        done = [s["step"] for s in status_lines(self.work / "steps.jsonl") if "step" in s]
        tmp = self.inject_file.with_name("inject.new")
        tmp.write_text(json.dumps({**spec, "at_step": max(done, default=0) + 10}))
        tmp.replace(self.inject_file)

    def let_run(self, steps: int) -> None:
        n = self.steps_done()
        wait_for(lambda: self.steps_done() > n + steps * len(self.procs), 300, f"{steps} more steps")

    def capture(self, steps: int) -> str:
        res = ctl(self.run, "capture", "--steps", str(steps), "--wait", "--timeout", "120", "--json")
        if res.returncode != 0:
            raise RuntimeError(f"capture exited {res.returncode}: {res.stderr[-2000:]}")
        return json.loads(res.stdout)["capture_id"]

    def keep(self, capture_id: str, dest: Path) -> None:
        shown = json.loads(ctl(self.run, "show", capture_id, "--json").stdout)
        summaries_written(Path(p["path"]) for p in shown["parts"].values())  # (written after "done", at idle priority)
        for part in shown["parts"].values():
            src = Path(part["path"])
            out = dest / src.name
            out.mkdir(parents=True, exist_ok=True)
            for name in ("summary.json", "metadata.json"):
                shutil.copy(src / name, out / name)

    def close(self) -> None:
        end_test_env([*self.procs, self.daemon], self.run, self.state, self.work)


@contextlib.contextmanager
def job(world: int = 2, **kw: Any) -> Iterator[Job]:
    j = Job(world, **kw)
    try:
        yield j
    finally:
        j.close()


@contextlib.contextmanager
def hogs(n: int, cpu: int | None = None) -> Iterator[None]:
    """`n` busy loops (`yes > /dev/null`), on core `cpu` when given."""
    prefix = ["taskset", "-c", str(cpu)] if cpu is not None else []
    procs = [subprocess.Popen([*prefix, "yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        time.sleep(1.0)  # the scheduler has spread them
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def pair(j: Job, out: Path, steps: int, spec: dict[str, Any] | None, base_load: Callable[[], Any] | None = None,
         now_load: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Baseline, then the slowdown `spec` (None: nothing changes), then the capture; both kept under `out`."""
    with (base_load or contextlib.nullcontext)():
        j.let_run(5)
        base = j.capture(steps)
    if spec:
        j.inject(spec)
    with (now_load or contextlib.nullcontext)():
        j.let_run(25)
        now = j.capture(steps)
    if spec:
        j.inject({})
    shutil.rmtree(out, ignore_errors=True)
    j.keep(base, out / "baseline")
    j.keep(now, out / "now")
    return {"baseline": base, "now": now, "steps": steps, "slowdown": spec, "load": os.getloadavg()}


def _two_hogs() -> Any:
    return hogs(2)


def healthy(out: Path, pairs: int = 10) -> list[dict[str, Any]]:
    """Pairs of healthy captures of one unchanged job, the host's load different between the two: two busy loops
    during the capture (odd pairs) or during the baseline (even pairs)."""
    done = []
    with job() as j:
        for i in range(1, pairs + 1):
            loaded = {"now_load": _two_hogs} if i % 2 else {"base_load": _two_hogs}
            how = pair(j, out.parent / f"{out.name}_{i:02d}", 5, None, **loaded)
            how["what"] = "healthy pair, 2 yes loops during the " + ("capture" if i % 2 else "baseline")
            _write_how(out.parent / f"{out.name}_{i:02d}", how)
            done.append(how)
    return done


SCENARIOS: dict[str, tuple[str, Callable[[Path], Any]]] = {}


def scenario(name: str, what: str) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    def register(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        SCENARIOS[name] = (what, fn)
        return fn
    return register


def simple(name: str, what: str, spec: dict[str, Any], steps: int = 6, world: int = 2, loaded: bool = False,
           cpus: list[int] | None = None, now_load: Callable[[], Any] | None = None,
           extra: list[str] | None = None) -> None:
    def record(out: Path) -> Any:
        with job(world, cpus=cpus, extra=extra) as j:
            return pair(j, out, steps, spec, base_load=_two_hogs if loaded else None,
                        now_load=now_load or (_two_hogs if loaded else None))
    scenario(name, what)(record)


simple("straggler", "rank 1 does 12 extra 384x384 matmuls a step", {"kind": "straggler", "rank": 1, "amount": 12})
simple("input", "rank 1 sleeps 30 ms before its forward (slow input)", {"kind": "input", "rank": 1, "amount": 30})
simple("comm_loaded", "every rank all_reduces an extra 8 MB a step; two yes loops during both captures",
       {"kind": "comm", "amount": 8}, loaded=True)
simple("sync", "every rank adds 20 barriers a step", {"kind": "sync", "amount": 20})
simple("small_ops", "every rank runs 3000 extra tiny additions a step", {"kind": "small_ops", "amount": 3000})
simple("hiccup", "rank 0 spends 100 ms more every 10th step (a synchronous checkpoint); 20-step captures",
       {"kind": "hiccup", "rank": 0, "amount": 100, "every": 10}, steps=20)
simple("straggler_4ranks", "4 ranks, rank 2 does 12 extra matmuls a step",
       {"kind": "straggler", "rank": 2, "amount": 12}, world=4)
simple("cpu_starved", "a compute-bound job (no sleep, width 768), rank 0 pinned to core 0, rank 1 to core 1; two yes "
       "loops pinned to core 1 during the capture", {}, cpus=[0, 1], now_load=lambda: hogs(2, cpu=1),
       extra=["--step-sleep", "0", "--hidden", "768"])
scenario("healthy", "10 healthy pairs (healthy_01 .. healthy_10), the load different between the two captures")(
    healthy)


@scenario("network", "2 hosts in network namespaces, a rank on each (gloo over their veths); the capture with both "
          "hosts' links capped at 50 Mbit/s (tc tbf)")
def network(out: Path) -> Any:
    """Two 'hosts' (network namespaces, their own names and addresses, a bridge), a daemon and a rank on each, the
    CLI across hosts with CurveZMQ keys (tests/test_netns.py's Net); root only."""
    import tempfile

    from ondemand_prof.host.keys import keygen
    from test_netns import RANK_HOSTS, Net

    root = Path(tempfile.mkdtemp(prefix="odprecnet"))
    net = Net(root)
    try:
        net.up()
        keygen(net.keys)
        for host in RANK_HOSTS:
            net.start_daemon(host)
        inject = root / "inject.json"
        inject.write_text("{}")
        for rank, host in enumerate(RANK_HOSTS):
            env = base_env(RANK=str(rank), WORLD_SIZE=str(len(RANK_HOSTS)), LOCAL_RANK="0",
                           MASTER_ADDR=net.addr(RANK_HOSTS[0]), MASTER_PORT="29519", GLOO_SOCKET_IFNAME="eth0",
                           ONDEMAND_PROF_RUNTIME_DIR=str(net.daemons[host]["run"]))
            net.ranks.append(net.spawn(host, [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", "1000000",
                                              "--step-sleep", STEP_SLEEP, "--profile-min-free-mb", "0",
                                              "--profile-save-path", str(net.save(rank))],
                                       env, root / f"rank{rank}.log"))
        hosts = ",".join(RANK_HOSTS)

        def stepping() -> bool:
            res = net.ctl("status", "--json", "--connect-timeout", "2", hosts=hosts)
            if res.returncode != 0:
                return False
            ranks = [r for h in json.loads(res.stdout)["hosts"].values() for rs in h["data"]["jobs"].values()
                     for r in rs]
            return len(ranks) == 2 and all(r["step_time_s"] for r in ranks)

        wait_for(stepping, 180, "2 ranks on h1 and h2 stepping", pause=0.5)
        time.sleep(3)

        def capture() -> str:
            res = net.ctl("capture", "--steps", "6", "--wait", "--timeout", "120", "--json", hosts=hosts)
            if res.returncode != 0:
                raise RuntimeError(f"capture exited {res.returncode}: {res.stderr[-2000:]}")
            return json.loads(res.stdout)["capture_id"]

        def keep(capture_id: str, dest: Path) -> None:
            shown = json.loads(net.ctl("show", capture_id, "--json", hosts=hosts).stdout)
            summaries_written(Path(p["path"]) for p in shown["parts"].values())
            for part in shown["parts"].values():
                src = Path(part["path"])
                (dest / src.name).mkdir(parents=True, exist_ok=True)
                for name in ("summary.json", "metadata.json"):
                    shutil.copy(src / name, dest / src.name / name)

        base = capture()
        for host in RANK_HOSTS:  # both directions of the link between the two hosts
            subprocess.run(["ip", "netns", "exec", net.ns[host], "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                            "rate", "50mbit", "burst", "32kbit", "latency", "400ms"], check=True)
        time.sleep(3)
        now = capture()
        shutil.rmtree(out, ignore_errors=True)
        keep(base, out / "baseline")
        keep(now, out / "now")
        return {"baseline": base, "now": now, "steps": 6, "slowdown": "tc tbf rate 50mbit on h1's and h2's eth0",
                "load": os.getloadavg()}
    finally:
        net.down()
        shutil.rmtree(root, ignore_errors=True)


def _write_how(out: Path, how: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "how.json").write_text(json.dumps({**how, "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                              "cores": os.cpu_count()}, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", help="which (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "recorded")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for name, (what, _) in SCENARIOS.items():
            print(f"{name:18} {what}")
        return 0
    for name in args.scenarios or list(SCENARIOS):
        what, record = SCENARIOS[name]
        print(f"recording {name}: {what}", flush=True)
        t0 = time.monotonic()
        how = record(args.out / name)
        if name != "healthy":
            _write_how(args.out / name, {**how, "what": what})
        print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
