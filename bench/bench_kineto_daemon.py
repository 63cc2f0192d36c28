"""Issue 14's "kineto's own asynchronous path", evaluated: what a window costs the training loop when libkineto
runs it from its own thread (KINETO_USE_DAEMON=1, on-demand config served over libkineto's IPC fabric, the
protocol dynolog speaks), against torch.profiler with tensorboard_trace_handler and against no profiler.

Each run is a fresh process training the same CPU model for --steps steps; a profiled run records one 20-step
window with stacks and shapes. A run's cost is the extra wall time (over its median step) of the steps from 2
before the window (located from the trace's own timestamps) to 200 after it, where the trace is processed and
written; an idle run gives the same sum over as many steps, the noise floor. Variants are interleaved,
--repeat runs each. What the kineto trace holds is checked too.

    python bench/bench_kineto_daemon.py [--steps 3000] [--repeat 3]

The IPC stand-in answers libkineto's "req" datagrams (struct Metadata {size_t size; char type[32];} then the
body) on a path socket in a private directory (KINETO_IPC_SOCKET_DIR), never on the global abstract name.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TRAIN = r"""
import sys, time, torch
steps, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 256)
prof = None
if mode == "torch":
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=steps // 2, warmup=1, active=20, repeat=1),
                                  on_trace_ready=torch.profiler.tensorboard_trace_handler(out),
                                  record_shapes=True, with_stack=True)
    prof.start()
times, starts = [], []
for i in range(steps):
    starts.append(time.time())
    t = time.perf_counter()
    loss = model(x).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if prof is not None:
        prof.step()
    times.append((time.perf_counter() - t) * 1000)
if prof is not None:
    prof.stop()
print(" ".join(f"{v:.3f}" for v in times))
print(" ".join(f"{v:.6f}" for v in starts))
"""

CONFIG = """PROFILE_START_ITERATION=0
PROFILE_START_ITERATION_ROUNDUP=1
ACTIVITIES_WARMUP_ITERATIONS=1
ACTIVITIES_ITERATIONS=20
ACTIVITIES_LOG_FILE={out}/kineto_trace.json
PROFILE_REPORT_INPUT_SHAPES=true
PROFILE_WITH_STACK=true
"""
META = struct.Struct("=Q32s")  # dynolog ipcfabric Metadata: size_t size; char type[32]


def serve_config(sock: socket.socket, config: bytes, arm_at: float, stop: threading.Event) -> None:
    """Answer every 'req' with nothing until arm_at, then once with the config."""
    sent = False
    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            data, addr = sock.recvfrom(65536)
        except socket.timeout:
            continue
        if len(data) < META.size:
            continue
        kind = META.unpack_from(data)[1].split(b"\0")[0]
        body = b""
        if kind == b"ctxt":
            body = struct.pack("=i", 1)
        elif kind == b"req" and not sent and time.monotonic() >= arm_at:
            body, sent = config, True
        try:
            sock.sendto(META.pack(len(body), kind) + body, addr)
        except OSError:
            pass


def run(mode: str, steps: int, arm_s: float) -> tuple[list[float], Path]:
    out = Path(tempfile.mkdtemp(prefix=f"bkd-{mode}-"))
    env = dict(os.environ)
    stop = threading.Event()
    server = None
    if mode == "kineto":
        sockdir = Path(tempfile.mkdtemp(prefix="bkd-sock-"))  # 0700: nobody else can reach or spoof it
        base = sockdir / "base.cfg"
        base.write_text("ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS=1\n")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sockdir / "dynolog"))
        server = threading.Thread(target=serve_config, args=(sock, CONFIG.format(out=out).encode(),
                                                             time.monotonic() + arm_s, stop), daemon=True)
        server.start()
        env.update(KINETO_USE_DAEMON="1", KINETO_IPC_SOCKET_DIR=str(sockdir), KINETO_CONFIG=str(base))
    res = subprocess.run([sys.executable, "-c", TRAIN, str(steps), mode, str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    stop.set()
    if res.returncode != 0:
        raise SystemExit(f"{mode} run failed: {res.stderr[-2000:]}")
    times, starts = res.stdout.splitlines()[-2:]
    return [float(v) for v in times.split()], [float(v) for v in starts.split()], out


AFTER = 200  # steps after the window counted too: the trace is processed and written while they run


def window_steps(out: Path, starts: list[float]) -> tuple[int, int] | None:
    """The first and last step the trace's events fall in (absolute times: the trace's base + its ts)."""
    files = [*out.rglob("*.json")]
    if not files:
        return None
    data = json.loads(files[0].read_text())
    base_us = data.get("baseTimeNanoseconds", 0) / 1000
    ts = [base_us + e["ts"] for e in data["traceEvents"] if e.get("cat") == "cpu_op" and "ts" in e]
    if not ts:
        return None
    first, last = min(ts) / 1e6, max(ts) / 1e6
    i0 = max(0, next((i for i, s in enumerate(starts) if s > first), len(starts)) - 1)
    i1 = max(i0, next((i for i, s in enumerate(starts) if s > last), len(starts)) - 1)
    return i0, i1


def excess(times: list[float], lo: int, hi: int) -> float:
    """Extra wall time of steps [lo, hi) over the run's median step."""
    med = statistics.median(times[20:])
    return sum(t - med for t in times[lo:hi])


def kineto_trace_facts(out: Path) -> str:
    files = list(out.glob("kineto_trace*.json"))
    if not files:
        return "no trace written"
    ev = json.loads(files[0].read_text())["traceEvents"]
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    py = sum(1 for e in ev if e.get("cat") == "python_function")
    shapes = sum(1 for e in ops if "Input Dims" in e.get("args", {}))
    steps = sum(1 for e in ev if str(e.get("name", "")).startswith("ProfilerStep#"))
    return (f"{files[0].stat().st_size / 2**20:.1f} MiB, {len(ops)} cpu ops ({shapes} with shapes), {py} python "
            f"stack events, {steps} ProfilerStep# annotations")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--arm-s", type=float, default=6.0, help="when the stand-in hands out the window")
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {"idle": [], "torch": [], "kineto": []}
    facts, spans = "", []
    for _ in range(args.repeat):
        for mode in rows:
            times, starts, out = run(mode, args.steps, args.arm_s)
            if mode == "idle":  # the same span as a profiled run, in the middle of the run
                n = (spans[-1] if spans else 21) + AFTER
                lo = len(times) // 2
                rows[mode].append((excess(times, lo, lo + n), max(times[lo:lo + n])))
                continue
            found = window_steps(out, starts)
            if found is None:
                raise SystemExit(f"{mode}: no trace written")
            lo, hi = found[0] - 2, found[1] + 1 + AFTER
            spans.append(found[1] - found[0] + 3)
            rows[mode].append((excess(times, lo, hi), max(times[lo:hi])))
            if mode == "kineto":
                facts = kineto_trace_facts(out)
    print(f"{args.steps} steps per run, {args.repeat} runs per variant, interleaved; CPU only; each profiled run's "
          f"cost is its extra wall time from 2 steps before the window to {AFTER} steps after it")
    print("| variant | extra wall time, ms (median, range) | longest step ms (median) |")
    print("|---|---|---|")
    for mode, vals in rows.items():
        extra = [e for e, _ in vals]
        print(f"| {mode} | {statistics.median(extra):.0f} ({min(extra):.0f} to {max(extra):.0f}) | "
              f"{statistics.median(m for _, m in vals):.1f} |")
    k, t = statistics.median(e for e, _ in rows["kineto"]), statistics.median(e for e, _ in rows["torch"])
    print(f"kineto daemon path / torch.profiler: {k / t:.2f}x" if t > 0 else "torch.profiler cost not positive")
    print(f"kineto daemon-path trace: {facts}")


if __name__ == "__main__":
    main()
