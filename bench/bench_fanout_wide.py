"""`ondemandctl --hosts` at thousands of hosts with CurveZMQ keys, on loopback.

Thousands of machines are not at hand, so each real ondemand-profd (the Daemon class of host/daemon.py, with
its keys and its TCP listener) also serves ondemandctl on extra ports: D daemons x P ports = the host count,
every "host" a host:port pair with its own TCP connection and its own CurveZMQ handshake. The CLI is the real one
(`ondemandctl --hostfile FILE --keys DIR status`, a subprocess), timed end to end, plus one in-process Fanout
timed per round (the first round includes every handshake).

    .venv/bin/python bench/bench_fanout_wide.py [--hosts 4096] [--daemons 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand_prof.host.hosts import Target  # noqa: E402
from ondemand_prof.host.keys import keygen  # noqa: E402

SERVE = r"""
import logging, sys, zmq
from pathlib import Path
from ondemand_prof.host.daemon import Daemon
logging.basicConfig(level=logging.ERROR)
run, state, keys, ports = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
d = Daemon(run, state, listen="tcp://127.0.0.1:0", keys=keys, tcp_per_peer=65536)
d.open()
# hundreds of "hosts" share this daemon's one core here: their handshakes queue up far past the 3 s a real host's
# daemon gives one (on a cluster each host's daemon does its own handshake); the bench gives them time
d.tcp.sock.setsockopt(zmq.HANDSHAKE_IVL, 60_000)
bound = [d.tcp.endpoint]
for _ in range(ports - 1):
    d.tcp.sock.bind("tcp://127.0.0.1:0")  # extra ports on the same TCP ROUTER socket: more "hosts"
    bound.append(d.tcp.sock.getsockopt(zmq.LAST_ENDPOINT).decode())
print(" ".join(bound), flush=True)
try:
    d.serve()
finally:
    d.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=4096)
    ap.add_argument("--daemons", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="odpwide"))
    keys = tmp / "keys"
    keygen(keys)
    per = -(-args.hosts // args.daemons)
    procs: list[subprocess.Popen] = []
    endpoints: list[str] = []
    try:
        for i in range(args.daemons):
            run = Path(tempfile.mkdtemp(prefix=f"odw{i}-", dir="/tmp"))
            n = min(per, args.hosts - i * per)
            p = subprocess.Popen([sys.executable, "-c", SERVE, str(run), str(tmp / f"state{i}"), str(keys), str(n)],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(p)
            endpoints += p.stdout.readline().split()
        hostfile = tmp / "hosts"
        hostfile.write_text("".join(e[len("tcp://"):] + "\n" for e in endpoints))
        print(f"{len(endpoints)} hosts on {args.daemons} daemons, CurveZMQ keys; 2 cores shared with the daemons")
        rows = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            res = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "--hostfile", str(hostfile), "--keys", str(keys),
                                  "status", "--json", "--connect-timeout", "60"], capture_output=True, text=True)
            took = time.perf_counter() - t0
            hosts = json.loads(res.stdout)["hosts"].values() if res.stdout else []
            ok = sum(1 for h in hosts if h["ok"])
            kinds = sorted({h["error"][:90] for h in hosts if not h["ok"]})[:2]
            rows.append((f"ondemandctl --hostfile ({len(endpoints)} hosts) --keys status, run {r + 1}",
                         f"{took:.2f} s", f"{ok} of {len(endpoints)} answered, exit {res.returncode} {kinds or ''}"))
        from ondemand_prof.host.fanout import Fanout

        targets = [Target(e[len("tcp://"):], "127.0.0.1", int(e.rsplit(":", 1)[1])) for e in endpoints]
        t0 = time.perf_counter()
        with Fanout(targets, keys, timeout_s=60) as fan:
            opened = time.perf_counter() - t0
            for r in range(args.rounds):
                t0 = time.perf_counter()
                replies = fan.request("status")
                took = time.perf_counter() - t0
                ok = sum(1 for x in replies.values() if x.ok)
                if ok < len(replies):
                    print(sorted({x.error[:90] for x in replies.values() if not x.ok})[:3])
                rows.append((f"in-process Fanout, status round {r + 1}" + (" (with the handshakes)" if r == 0 else ""),
                             f"{took:.2f} s", f"{ok} of {len(endpoints)} answered"))
        rows.insert(len(rows) - args.rounds, ("in-process Fanout: connect calls for every host", f"{opened:.2f} s", ""))
        width = max(len(r[0]) for r in rows)
        for name, value, note in rows:
            print(f"| {name.ljust(width)} | {value:>8} | {note} |")
        print(f"open descriptors of this process now: {len(os.listdir('/proc/self/fd'))}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
