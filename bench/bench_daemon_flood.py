"""What one member flooding `compare` costs everyone else (issue 41, 3): a real ondemand-profd over two finished
captures of R ranks whose summaries are slow to compare (bench_compare_hostile.py's `steps`: ~7,000 steps, ~480 KB
a rank), F processes asking for compares back to back (each on a fresh connection that gives up after 5 s, as
ondemandctl does), and `status` asked every 50 ms on a fresh connection meanwhile; its latency, and what the
flooders got. Run against this checkout and, with --checkout DIR, against another (an older commit's tree: `git
archive COMMIT | tar -x -C DIR`), one after the other on the same machine.

    .venv/bin/python bench/bench_daemon_flood.py [--ranks 16] [--flooders 3] [--seconds 20] [--checkout DIR ...]
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import zmq  # noqa: E402

from bench_compare_hostile import case  # noqa: E402
from ondemand_prof.core.files import iso_time  # noqa: E402

FLOOD = r"""
import json, sys, time, zmq
run, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
said = {"ok": 0, "error": 0, "silent": 0}
end = time.monotonic() + seconds
while time.monotonic() < end:
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
    s.connect("ipc://" + run + "/profd.sock")
    s.send(json.dumps({"v": 1, "type": "compare", "id": 1, "capture_id": "now-cap", "baseline_id": "base-cap"}).encode())
    said[json.loads(s.recv())["type"] if s.poll(5000) else "silent"] += 1
    s.close()
print(json.dumps(said), flush=True)
"""


def stored_captures(state: Path, folder: Path, ranks: int) -> None:
    raw = json.dumps(case("steps"))
    (state / "captures").mkdir(mode=0o700, parents=True, exist_ok=True)
    for n, cid in enumerate(("base-cap", "now-cap")):
        parts = {}
        for r in range(ranks):
            d = folder / cid / f"rank{r}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(raw)
            parts[str(r)] = {"rank": r, "host": "h", "pid": 100 + r, "uid": os.getuid(), "state": "done",
                             "path": str(d), "history": []}
        record = {"capture_id": cid, "job": "bigjob", "created_at": iso_time(time.time() - 100 + n), "request": {},
                  "window": [10, 12], "plan": {}, "options": {}, "status": "done", "parts": parts}
        (state / "captures" / f"{cid}.json").write_text(json.dumps(record))


def ask(run: Path, msg: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, float]:
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{run}/profd.sock")
        t0 = time.monotonic()
        s.send(json.dumps({"v": 1, "id": 1, **msg}).encode())
        got = json.loads(s.recv()) if s.poll(int(timeout * 1000)) else None
        return got, time.monotonic() - t0
    finally:
        ctx.destroy(linger=0)


def one(checkout: Path, ranks: int, flooders: int, seconds: float) -> dict[str, Any]:
    run, state = Path(tempfile.mkdtemp(prefix="odpbf", dir="/tmp")), Path(tempfile.mkdtemp(prefix="odpbfs", dir="/tmp"))
    folder = Path(tempfile.mkdtemp(prefix="odpbfc"))
    os.chmod(run, 0o700)
    stored_captures(state, folder, ranks)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
    env["PYTHONPATH"] = str(checkout)
    daemon = subprocess.Popen([sys.executable, "-m", "ondemand_prof.host.profd", "--runtime-dir", str(run),
                               "--state-dir", str(state), "--log-level", "WARNING"], cwd=str(checkout), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (run / "profd.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _, alone = ask(run, {"type": "compare", "capture_id": "now-cap", "baseline_id": "base-cap"}, 120)
        procs = [subprocess.Popen([sys.executable, "-c", FLOOD, str(run), str(seconds)], stdout=subprocess.PIPE,
                                  text=True) for _ in range(flooders)]
        lat, silent = [], 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            reply, took = ask(run, {"type": "status"}, 30)
            if reply is None:
                silent += 1
            lat.append(took)
            time.sleep(0.05)
        said = {"ok": 0, "error": 0, "silent": 0}
        for p in procs:
            out = json.loads((p.communicate(timeout=60)[0] or "{}").strip().splitlines()[-1])
            for k in said:
                said[k] += out.get(k, 0)
    finally:
        daemon.kill()
        daemon.wait()
        for d in (run, state, folder):
            shutil.rmtree(d, ignore_errors=True)
    lat.sort()
    return {"asked": len(lat), "p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "max": lat[-1], "over_1s": sum(x > 1.0 for x in lat), "status_silent": silent, "alone": alone,
            "compares": said}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--flooders", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--checkout", type=Path, action="append", default=[],
                    help="another tree to run the daemon from (default: this checkout only)")
    args = ap.parse_args()
    print(f"{args.ranks} ranks a capture, {args.flooders} flooders, {args.seconds:g} s, status every 50 ms; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'daemon from':<28} {'compare':>7} {'status':>6} {'p50 s':>6} {'p99 s':>6} {'max s':>6} {'>1 s':>5} "
          f"{'silent':>6}  {'compares ok/refused/gave up':>27}")
    for checkout in [ROOT, *args.checkout]:
        r = one(checkout.resolve(), args.ranks, args.flooders, args.seconds)
        print(f"{str(checkout)[-28:]:<28} {r['alone']:>6.1f}s {r['asked']:>6} {r['p50']:>6.3f} {r['p99']:>6.2f} "
              f"{r['max']:>6.2f} {r['over_1s']:>5} {r['status_silent']:>6}  "
              f"{r['compares']['ok']:>11}/{r['compares']['error']}/{r['compares']['silent']}")


if __name__ == "__main__":
    main()
