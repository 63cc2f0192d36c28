"""End-to-end demo: a real 2-rank gloo training run, profiled by a static window and by a touched trigger.

    python -m ondemand_prof.demo [--out demo_out] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (FileNotFoundError, json.JSONDecodeError, IndexError):
        return -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="where the demo writes (replaced)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    save, trig, progress = out / "profile", out / "trigger", out / "steps.jsonl"
    out.mkdir(parents=True)
    port = str(_free_port())
    train = [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", str(args.steps), "--step-sleep", "0.03",
             "--profile", "--profile-step-start", "5", "--profile-step-end", "8", "--profile-ranks", "-1",
             "--profile-save-path", str(save), "--profile-trigger-dir", str(trig), "--profile-min-free-mb", "0"]
    print(f"[demo] starting {args.ranks} gloo ranks: static window [5, 8) on every rank; trigger dir {trig}")
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", ONDEMAND_PROF_LOG="WARNING")
        extra = ["--status-file", str(progress)] if rank == 0 else []
        procs.append(subprocess.Popen([*train, *extra], env=env))
    deadline = time.monotonic() + 120
    while _last_step(progress) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    request = {"steps": 3, "ranks": -1, "level": "level1"}
    print(f"[demo] training is at step {_last_step(progress)}: writing {json.dumps(request)} to {trig / 'capture'}")
    (trig / "capture").write_text(json.dumps(request))
    rc = max(p.wait() for p in procs)
    print(f"[demo] training finished (exit {rc}). Captures under {save}:")
    rows = []
    for d in sorted(p for p in save.iterdir() if not p.name.startswith(".")):
        meta = json.loads((d / "metadata.json").read_text())
        rows.append((meta["rank"], meta["trigger"]["source"], meta["steps_in_trace"], meta["status"], d))
    for rank, source, steps, status, d in sorted(rows, key=lambda r: (r[1] != "static", r[0])):
        print(f"  rank {rank}  {source:<6}  steps {steps}  {status:<7} {d}")
    for rank in range(args.ranks):
        status = json.loads((trig / "capture.status" / f"rank{rank}.json").read_text())["latest"]
        print(f"[demo] {trig / 'capture.status' / f'rank{rank}.json'}: {status['state']}, window "
              f"{status.get('window')}, seen {status['detect_latency_ms']} ms after the write")
    print("[demo] open a trace in https://ui.perfetto.dev, or: tensorboard --logdir", save)
    return rc


if __name__ == "__main__":
    sys.exit(main())
