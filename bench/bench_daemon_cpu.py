"""The daemon's CPU time per capture, in one process: the real Daemon object (transport dispatch, service,
records) fed the frames N ranks send for one capture (received, scheduled, done) and a CLI's watch, without
sockets or other processes. It is the figure least moved by the machine's load (bench_daemon.py measures the
whole round trip with real sockets and processes).

    python bench/bench_daemon_cpu.py [--ranks 64] [--captures 100] [--profile tottime]

ODP_ROOT=/path/to/another/checkout measures that checkout's daemon instead (for a before/after pair).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("ODP_ROOT") or str(Path(__file__).resolve().parent.parent))

from ondemand_prof.core.options import ProfileConfig  # noqa: E402
from ondemand_prof.core.protocol import encode  # noqa: E402
from ondemand_prof.core.requests import WindowDefaults  # noqa: E402
from ondemand_prof.host.daemon import Daemon  # noqa: E402


class Carrier:
    """Stands for the zmq.Frame a unix-socket message arrives in: its Peer-Address (this process's credentials)."""

    def get(self, name: str) -> str:
        return f"bench:{os.getuid()}:{os.getgid()}:{os.getpid()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--captures", type=int, default=100)
    ap.add_argument("--profile", help="also print a cProfile of 20 captures, sorted by this key")
    args = ap.parse_args()
    dirs = [Path(tempfile.mkdtemp(prefix=p, dir="/tmp")) for p in ("odpc-run", "odpc-state", "odpc-save")]
    run, state, save = dirs
    (save / "cap").mkdir()
    daemon = Daemon(run, state)
    daemon.open()
    sent: list[tuple[bytes, bytes]] = []
    daemon._send = lambda route, body: sent.append((route, body))  # type: ignore[method-assign]  # noqa: SLF001
    carrier = Carrier()
    defaults = WindowDefaults.from_config(ProfileConfig(save_path=str(save))).to_wire()
    routes = [b"r/%d" % r for r in range(args.ranks)]
    for r, route in enumerate(routes):
        sent.clear()
        daemon.dispatch(route, encode("register", job="bench", rank=r, world_size=args.ranks, host="bench",
                                      pid=os.getpid(), local_rank=r, save_root=str(save), trigger_dir="/tmp/t",
                                      version="0", recent=[], defaults=defaults, native_dump=None, step=100,
                                      began=round(time.time(), 6), state="idle", step_time=0.01), carrier)
    reports = [("received", {"window": [1, 2], "current_step": 100}),
               ("scheduled", {"window": [1, 2], "current_step": 101}),
               ("done", {"path": str(save / "cap"), "status": "ok"})]
    # what a rank sends: "received" and "scheduled" leave together, in one "events" message where the daemon's
    # registration reply allows it (an older daemon: each in its own "event" message); "done" comes later
    batched = any(b'"events_batch"' in body for _, body in sent)
    events = [encode("event", capture_id="CAPTUREID", event=ev, info=info) for ev, info in reports]
    if batched:
        events[:2] = [encode("events", events=[{"capture_id": "CAPTUREID", "event": ev, "info": info}
                                               for ev, info in reports[:2]])]

    def one() -> None:
        sent.clear()
        daemon.dispatch(b"cli", encode("capture", id=1, job="bench", request={"ranks": [-1], "steps": 1}), carrier)
        reply: dict[str, Any] = json.loads(next(b for r, b in sent if r == b"cli"))
        if "data" not in reply:
            raise SystemExit(f"capture refused: {reply}")
        capture_id = reply["data"]["capture_id"]
        daemon.dispatch(b"cli", encode("watch", id=2, capture_id=capture_id, seen=reply["data"]["version"],
                                       timeout_s=10), carrier)
        for template in events:
            frame = template.replace(b"CAPTUREID", capture_id.encode())
            for route in routes:
                daemon.dispatch(route, frame, carrier)
            daemon.service.answer_due_watches()
            daemon._flush_outbox()  # noqa: SLF001
            daemon.dispatch(b"cli", encode("watch", id=2, capture_id=capture_id, seen=0, timeout_s=10), carrier)
        for info in daemon.service.registry.by_route.values():  # the ranks stay live (no heartbeats here)
            info.last_seen, info.step_began_at = time.monotonic(), time.time()
        daemon.service.housekeeping(time.monotonic())

    try:
        for _ in range(5):
            one()
        t0 = time.process_time()
        for _ in range(args.captures):
            one()
        cpu_ms = (time.process_time() - t0) / args.captures * 1000
        print(f"| ranks | captures | messages a rank | daemon CPU per capture ms | per rank event us | load avg |\n"
              f"|---|---|---|---|---|---|\n"
              f"| {args.ranks} | {args.captures} | {len(events)} | {cpu_ms:.2f} | {cpu_ms * 1000 / (3 * args.ranks):.1f} | "
              f"{os.getloadavg()[0]:.1f} |")
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile(time.process_time)
            prof.enable()
            for _ in range(20):
                one()
            prof.disable()
            pstats.Stats(prof).sort_stats(args.profile).print_stats(25)
    finally:
        daemon.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
