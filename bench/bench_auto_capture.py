"""Automatic captures that do not cry wolf (issue 43 item 6): a real 2-rank gloo job with --profile-auto 1.5 and a
real daemon on a host kept loaded (two `yes` loops beside it, and whatever else runs), for --minutes with no
slowdown: how many automatic captures it opened (the goal: none in 30 minutes); then a slowdown switched on (rank 1
sleeps --slow-ms more a step before its forward): how long until an automatic capture of it (the goal: within a
minute), and what its comparison with the automatic baseline says.

    .venv/bin/python bench/bench_auto_capture.py [--minutes 30] [--hogs 2] [--slow-ms 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import ctl, end_test_env, short_dir, start_daemon, start_ranks, status_lines, wait_for  # noqa: E402


def listed(run: Path) -> list[dict[str, Any]]:
    res = ctl(run, "list", "--json")
    return json.loads(res.stdout)["captures"] if res.returncode == 0 else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--slow-ms", type=int, default=30)
    args = ap.parse_args()
    run, state, work = short_dir("odpba"), short_dir("odpbas"), Path(short_dir("odpbaw"))
    inject = work / "inject.json"
    inject.write_text("{}")
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.hogs)]
    daemon = start_daemon(run, state)
    procs = start_ranks(["--steps", "100000000", "--step-sleep", "0.02", "--status-file", str(work / "steps.jsonl"),
                         "--inject-file", str(inject), "--profile-auto", "1.5"], world=2,
                        env={"ONDEMAND_PROF_RUNTIME_DIR": str(run)}, cwd=work)
    try:
        t0 = time.monotonic()
        base = wait_for(lambda: next((c for c in listed(run) if c.get("baseline")), None), 1800, "the baseline",
                        pause=2.0)
        base_s = time.monotonic() - t0
        quiet_until = time.monotonic() + args.minutes * 60
        false: list[str] = []
        seen: dict[str, float] = {}
        while time.monotonic() < quiet_until:
            false = [c["capture_id"] for c in listed(run) if c["capture_id"].startswith("auto-")]
            for cid in false:
                seen.setdefault(cid, time.monotonic() - t0)
            time.sleep(10)
        causes = {c["capture_id"]: c.get("cause", "") for c in listed(run) if c["capture_id"] in seen}
        steps_quiet = len(status_lines(work / "steps.jsonl")) // 2
        done = [s["step"] for s in status_lines(work / "steps.jsonl") if "step" in s]
        tmp = inject.with_name("inject.new")
        tmp.write_text(json.dumps({"kind": "input", "rank": 1, "amount": args.slow_ms, "at_step": max(done) + 10}))
        tmp.replace(inject)
        t1 = time.monotonic()
        auto = wait_for(lambda: next((c for c in listed(run) if c["capture_id"].startswith("auto-") and
                                      c["capture_id"] not in false), None), 600, "an automatic capture", pause=1.0)
        caught_s = time.monotonic() - t1
        settled = wait_for(lambda: next((c for c in listed(run) if c["capture_id"] == auto["capture_id"] and
                                         c.get("cause")), None), 300, "its comparison", pause=1.0)
    finally:
        end_test_env([*procs, daemon], run, state, work)
        for h in hogs:
            h.kill()
            h.wait()
    print(f"a 2-rank gloo job, --profile-auto 1.5, {args.hogs} yes loops beside it")
    print(f"{'what':<64} {'value':>12}")
    print(f"{'the automatic baseline taken after (s)':<64} {base_s:>12.0f}")
    print(f"{f'automatic captures with no slowdown, {args.minutes:g} min ({steps_quiet} steps)':<64} {len(false):>12}")
    print(f"{f'rank 1 {args.slow_ms} ms slower a step: automatic capture after (s)':<64} {caught_s:>12.1f}")
    print(f"its comparison: {settled.get('cause', '')[:300]}")
    for cid, at in seen.items():
        print(f"with no slowdown, at {at:.0f} s: {cid}: {causes.get(cid, '')[:200]}")


if __name__ == "__main__":
    main()
