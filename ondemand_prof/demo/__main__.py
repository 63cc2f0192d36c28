"""End-to-end demo: a host daemon and a real 2-rank gloo training run, profiled by a static window, by
`ondemandctl capture`, and by a trigger file.

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
import tempfile
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


def _fmt_window(window: list[int] | None) -> str:
    return f"[{window[0]}, {window[1]})" if window else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="where the demo writes (replaced)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=260)
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    shutil.rmtree(out, ignore_errors=True)
    save, trig, progress = out / "profile", out / "trigger", out / "steps.jsonl"
    out.mkdir(parents=True)
    port = str(_free_port())
    # the socket path must stay short (unix sockets hold 107 bytes), so the runtime dir is in /tmp
    run_dir = Path(tempfile.mkdtemp(prefix="ondemand_prof-demo-", dir="/tmp"))
    base_env = dict(os.environ, ONDEMAND_PROF_RUNTIME_DIR=str(run_dir), OMP_NUM_THREADS="1",
                    ONDEMAND_PROF_LOG="WARNING")
    print(f"[demo] $ ondemand-profd --runtime-dir {run_dir} --state-dir {out / 'state'}")
    # the daemon runs in / (as under systemd) and the ranks in the demo's folder with the default save path,
    # ./profile: paths a rank reports are its own, made absolute, whatever the daemon's working directory
    daemon = subprocess.Popen([sys.executable, "-m", "ondemand_prof.host.profd", "--runtime-dir", str(run_dir),
                               "--state-dir", str(out / "state"), "--log-level", "WARNING"], env=base_env, cwd="/")
    ctl = [sys.executable, "-m", "ondemand_prof.host.ctl"]
    train = [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", str(args.steps), "--step-sleep", "0.03",
             "--profile", "--profile-step-start", "5", "--profile-step-end", "8", "--profile-ranks", "-1",
             "--profile-trigger-dir", str(trig), "--profile-min-free-mb", "0"]
    print(f"[demo] starting {args.ranks} gloo ranks in {out} (traces: ./profile): static window [5, 8) on every "
          f"rank; trigger dir {trig}")
    procs = []
    for rank in range(args.ranks):
        env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        extra = ["--status-file", str(progress)] if rank == 0 else []
        procs.append(subprocess.Popen([*train, *extra], env=env, cwd=out))
    try:
        deadline = time.monotonic() + 120
        while _last_step(progress) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.2)  # a heartbeat, so that every rank has registered
        print("[demo] $ ondemandctl status")
        subprocess.run([*ctl, "status"], env=base_env)
        print("[demo] $ ondemandctl capture --steps 2 --with-stack --wait")
        subprocess.run([*ctl, "capture", "--steps", "2", "--with-stack", "--wait"], env=base_env)
        request = {"steps": 3, "ranks": -1, "level": "level1"}
        print(f"[demo] training is at step {_last_step(progress)}: writing {json.dumps(request)} to "
              f"{trig / 'capture'}")
        (trig / "capture").write_text(json.dumps(request))
        rc = max(p.wait() for p in procs)
        print("[demo] $ ondemandctl list")
        subprocess.run([*ctl, "list"], env=base_env)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"[demo] training finished (exit {rc}). Captures under {save}:")
    rows = []
    for d in sorted(save.glob("*/*/metadata.json")):  # {save}/{capture}/{rank directory}/ (docs/levels-and-output.md)
        meta = json.loads(d.read_text())
        d = d.parent
        rows.append((meta["rank"], meta["trigger"]["source"], meta["steps_in_trace"], meta["status"], d))
    order = {"static": 0, "daemon": 1, "file": 2}
    for rank, source, steps, status, d in sorted(rows, key=lambda r: (order.get(r[1], 3), r[0])):
        print(f"  rank {rank}  {source:<6}  steps {steps}  {status:<7} {d}")
    for rank in range(args.ranks):
        status = json.loads((trig / "capture.status" / f"rank{rank}.json").read_text())["latest"]
        print(f"[demo] {trig / 'capture.status' / f'rank{rank}.json'}: {status['state']}, window "
              f"{_fmt_window(status.get('window'))}, seen {status['detect_latency_ms']} ms after the write")
    html = out / "report.html"
    print(f"[demo] $ ondemandctl report {save} --summary --html {html}")
    subprocess.run([sys.executable, "-m", "ondemand_prof.host.ctl", "report", str(save), "--summary", "--html",
                    str(html)])
    folders = {source: d.parent for _, source, _, _, d in rows}
    if "static" in folders and "daemon" in folders:  # what changed between two captures, and on which rank
        now, base = folders["daemon"], folders["static"]
        print(f"[demo] $ ondemandctl report {now} --baseline {base}")
        subprocess.run([sys.executable, "-m", "ondemand_prof.host.ctl", "report", str(now), "--baseline", str(base),
                        "--top", "3"])
    print("[demo] each capture folder under", save, "is one HTA trace_dir (TraceAnalysis(trace_dir=..., "
          "include_last_profiler_step=True): HTA leaves out the last captured step without it) and one TensorBoard "
          "run (a worker per rank); traces open in https://ui.perfetto.dev too")
    return rc


if __name__ == "__main__":
    sys.exit(main())
