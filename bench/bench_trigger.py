"""Touch-to-window-scheduled latency of the file trigger, inotify and polling, in a real training process.

    python bench/bench_trigger.py [--n 20]
A real toy training run (20 ms steps) with the hook; this script writes the trigger file N times and reads the
rank's status file: detect_latency_ms (file mtime -> agent saw it) and the time until the status says
"scheduled" (the training thread accepted the window). torch_npu's dynamic profiling polls every 2 s or more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status(trig: Path) -> dict | None:
    try:
        return json.loads((trig / "capture.status" / "rank0.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def measure(poll: str, n: int) -> tuple[list[float], list[float]]:
    tmp = Path(tempfile.mkdtemp())
    trig, save = tmp / "trig", tmp / "save"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", ONDEMAND_PROF_LOG="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", "100000",
                             "--step-sleep", "0.02", "--profile-save-path", str(save), "--profile-trigger-dir",
                             str(trig), "--profile-trigger-poll", poll, "--profile-min-free-mb", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    detect, scheduled = [], []
    try:
        while not (trig / "capture.status").exists():
            time.sleep(0.05)
        time.sleep(1.0)
        for i in range(n):
            t0 = time.time()
            (trig / "capture").write_text(json.dumps({"steps": 1, "id": f"b{i}"}))
            while True:
                s = status(trig)
                latest = s and s["latest"]
                if latest and latest.get("request", {}).get("id") == f"b{i}" and latest["history"]:
                    first = latest["history"][0]
                    if first["state"] in ("scheduled", "rejected"):
                        break
                time.sleep(0.002)
            scheduled.append((time.time() - t0) * 1000)
            detect.append(latest["detect_latency_ms"])
            time.sleep(0.4)  # let the 1-step window finish before the next trigger
    finally:
        proc.kill()
        proc.wait()
    return detect, scheduled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20)
    args = parser.parse_args()
    print(f"trigger latency, {args.n} triggers each, toy training with 20 ms steps")
    print("| watcher | detect p50 ms | detect max ms | to scheduled p50 ms | to scheduled max ms |")
    print("|---|---|---|---|---|")
    for name, poll in (("inotify (watchdog)", "0"), ("polling 0.5 s", "0.5")):
        d, s = measure(poll, args.n)
        print(f"| {name} | {statistics.median(d):.1f} | {max(d):.1f} | {statistics.median(s):.1f} | {max(s):.1f} |")
    print("| torch_npu dynamic_profile (documented) | 2000 poll interval | | | |")


if __name__ == "__main__":
    main()
