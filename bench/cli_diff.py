"""A differential run of ondemandctl: a fixed list of invocations, each run in-process (ctl.main) against real
daemon Services (host/service.py, every handler real) with synthetic ranks, on a fake clock, with fixed capture
ids; everything the CLI prints goes to one text. Run it on two checkouts and compare: a move of code that should
not change behaviour prints the same.

    .venv/bin/python bench/cli_diff.py > /tmp/after.txt
    git archive HEAD | tar -x -C /tmp/base && .venv/bin/python bench/cli_diff.py --package /tmp/base > /tmp/before.txt
    diff /tmp/before.txt /tmp/after.txt

Two hosts (h1: ranks 0-1 of job j, h2: ranks 2-3; world 4) and a second job on h1. One-host invocations go to
h1's Service through a stand-in for the unix-socket Client; `--hosts h1,h2` goes through a stand-in for the
fan-out. Each synthetic rank answers a window as a rank of ours does (received, scheduled, recording, writing,
done with a real trace file under its save root), or as told: late by 3 steps, failed, busy with a window the
daemon did not know of (a touched trigger file's), silent. Nothing here is timed: the clock moves only when
the harness moves it."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/odp-cli-diff")  # a fixed place: paths print the same on every run
T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - T0 + 1000.0

    def sleep(self, s: float) -> None:
        self.now += max(0.0, s)


CLOCK = Clock()


class Rank:
    """A synthetic rank: registers, beats, and answers each window it is sent, one event per tick."""

    def __init__(self, host: "Host", job: str, rank: int, world: int) -> None:
        self.host, self.job, self.rank, self.world = host, job, rank, world
        self.route = f"{host.name}/{job}/{rank}".encode()
        self.pid = 1000 + rank + (100 if job != "j" else 0)
        self.save = WORK / host.name / job / "profile"
        self.save.mkdir(parents=True, exist_ok=True)
        self.step = 100
        self.mode = "ok"
        self.todo: list[tuple[str, dict[str, Any]]] = []
        self.windows: list[dict[str, Any]] = []

    def register(self, defaults: dict[str, Any]) -> None:
        self.host.rank_msg(self, "register", job=self.job, rank=self.rank, world_size=self.world, host="node-" +
                           self.host.name, pid=self.pid, local_rank=self.rank, save_root=str(self.save),
                           trigger_dir=str(WORK / "trig"), version="x", defaults=defaults, step=self.step,
                           began=CLOCK.now, state="idle", step_time=0.1)

    def beat(self) -> None:
        self.step += 1
        self.host.rank_msg(self, "hb", step=self.step, began=CLOCK.now, at=CLOCK.now, state="idle", step_time=0.1,
                           **({"windows": self.windows} if self.windows else {}))

    def take(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "cancel":
            self.todo = [("cancelled", {"error": "cancelled before it began", "capture_id": msg["capture_id"]})]
            return
        if msg["type"] != "capture":
            return
        w = msg["window"]
        cid, start, end = w["capture_id"], w["start_step"], w["end_step"]
        win = {"window": [start, end]}
        events: list[tuple[str, dict[str, Any]]] = [("received", {**win, "current_step": self.step})]
        mode = self.mode
        if mode == "busy":
            self.mode = "ok"  # busy once: a window after the blocking one is taken
            blocking = {"capture_id": "file-0b1c2d", "start": start - 1, "end": start + 149, "source": "file",
                        "state": "recording"}
            self.windows = [blocking]
            events.append(("rejected", {**win, "error": f"busy: window [{start - 1}, {start + 149}) (file, "
                                        "file-0b1c2d) holds the profiler"}))
        elif mode == "fail":
            events += [("scheduled", {**win, "current_step": self.step}),
                       ("failed", {**win, "error": "profiler failed to start: RuntimeError: no"})]
        elif mode != "silent":
            shift = 3 if mode == "late" else 0
            folder = self.save / cid / f"rank{self.rank}"
            folder.mkdir(parents=True, exist_ok=True)
            trace = write_rank_files(folder, self.rank, self.world, list(range(start + shift, end + shift)))
            events += [("scheduled", {**win, "current_step": self.step}),
                       ("recording", {**win, "late_by": shift,
                                      **({"note": "it got the window late"} if shift else {})}),
                       ("writing", win),
                       ("done", {**win, "path": str(folder), "trace": str(trace),
                                 "steps": list(range(start + shift, end + shift))})]
        self.todo += [(e, {**i, "capture_id": cid}) for e, i in events]

    def tick(self) -> bool:
        if not self.todo:
            return False
        event, info = self.todo.pop(0)
        self.host.rank_msg(self, "event", capture_id=info.pop("capture_id"), event=event, info=info)
        return True


def write_rank_files(folder: Path, rank: int, world: int, steps: list[int]) -> Path:
    """What a rank of ours writes for a window, small and real: a Kineto-shaped trace of the recorded steps (a
    ProfilerStep and an aten::mm each; odd ranks' twice as long) and its summary.json, by the package's own
    writer (rank/postprocess.py), which `report` reads: from the traces (a folder, a baseline) or the summaries
    (a capture id, one host or many)."""
    import gzip

    from ondemand_prof.rank.postprocess import write_rank_summary

    events: list[dict[str, Any]] = []
    for i, step in enumerate(steps):
        t = 1_000_000 + 10_000 * i
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": t, "dur": 9000,
                       "pid": 1, "tid": 1})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 100, "dur": 3000 * (1 + rank % 2),
                       "pid": 1, "tid": 1})
    trace = {"traceEvents": events, "distributedInfo": {"rank": rank, "world_size": world}}
    path = folder / f"rank{rank}.pt.trace.json.gz"
    with gzip.GzipFile(path, "wb", mtime=0) as fh:  # (no time in the header: the same bytes every run)
        fh.write(json.dumps(trace).encode())
    write_rank_summary(folder, trace, {"rank": rank, "world_size": world})
    return path


class Host:
    def __init__(self, name: str) -> None:
        from ondemand_prof.host.commands import DAEMON_COMMANDS
        from ondemand_prof.host.records import RecordStore
        from ondemand_prof.host.service import Service

        self.name = name
        state = WORK / name / "state"
        state.mkdir(parents=True)
        self.service = Service(RecordStore(state), DAEMON_COMMANDS, host="node-" + name, runtime_dir=WORK / name,
                               state_dir=state, pid_check=lambda pid, thorough: True)
        self.ranks: dict[bytes, Rank] = {}
        self.cli: list[bytes] = []

    def rank_msg(self, who: Rank, kind: str, **fields: Any) -> None:
        self.ranks[who.route] = who
        self.handle(who.route, kind, fields)

    def handle(self, route: bytes, kind: str, fields: dict[str, Any]) -> bytes | None:
        from ondemand_prof.core.protocol import RANK_MESSAGES, decode, encode
        from ondemand_prof.host.commands import CLI_MESSAGES

        msg = decode(encode(kind, **fields), {**RANK_MESSAGES, **CLI_MESSAGES})
        reply = self.service.handle(route, msg)
        self.drain()
        return reply

    def drain(self) -> None:
        svc = self.service
        while svc.outbox or svc.after_send:
            out, svc.outbox = svc.outbox, []
            for route, body in out:
                if route in self.ranks:
                    self.ranks[route].take(json.loads(body))
                else:
                    self.cli.append(body)
            after, svc.after_send = svc.after_send, []
            for fn in after:
                fn()

    def tick(self) -> bool:
        """One event of each rank that has one (and a heartbeat from every rank); True when any moved."""
        moved = False
        for rank in list(self.ranks.values()):
            moved = rank.tick() or moved
        CLOCK.now += 0.1
        for rank in list(self.ranks.values()):
            rank.beat()
        self.service.housekeeping(CLOCK.monotonic())
        self.drain()
        return moved


class Client:
    """ondemandctl's Client, served by a Host in-process: a watch held by the daemon is answered once the ranks
    move (a tick at a time) or its time runs out (the clock moved there)."""

    def __init__(self, host: Host, timeout_s: float = 5.0) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.ids = itertools.count(1)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass

    def request(self, msg_type: str, wait_s: float | None = None, **fields: Any) -> Any:
        from ondemand_prof.host.client import CtlError

        rid = next(self.ids)
        self.host.cli.clear()
        reply = self.host.handle(b"cli", msg_type, {"id": rid, **fields})
        deadline = CLOCK.now + (fields.get("timeout_s") or 0)
        while reply is None:
            if self.host.cli:
                reply = self.host.cli.pop(0)
                break
            if not self.host.tick() and not self.host.cli:
                CLOCK.now = max(CLOCK.now, deadline)
                self.host.service.answer_due_watches(CLOCK.monotonic())
                self.host.drain()
        data = json.loads(reply)
        if data["type"] == "error":
            raise CtlError(data["error"])
        return data.get("data")


class Fanout:
    """The fan-out across hosts, served by Hosts in-process."""

    local = False  # (host/fanout.py Fanout: every host named, never this host's daemon alone)

    def __init__(self, targets: list[Any], keys: Any = None, timeout_s: float = 5.0) -> None:
        self.targets = targets
        self.keyed = keys is not None
        self.timeout_s = timeout_s
        self.clients = {t.name: Client(HOSTS[t.name]) for t in targets if t.name in HOSTS}

    def __enter__(self) -> "Fanout":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def request(self, msg_type: str, fields: dict[str, Any] | None = None,
                per_host: dict[str, dict[str, Any]] | None = None, wait_s: float | None = None,
                hosts: list[str] | None = None) -> dict[str, Any]:
        from ondemand_prof.host.client import CtlError, Reply

        out = {}
        for t in self.targets:
            if hosts is not None and t.name not in hosts:
                continue
            if t.name not in self.clients:
                out[t.name] = Reply("timeout", error=f"{t.name}: no answer within {self.timeout_s:g} s")
                continue
            more = {**(fields or {}), **((per_host or {}).get(t.name) or {})}
            try:
                out[t.name] = Reply("ok", self.clients[t.name].request(msg_type, **more), seconds=0.002,
                                    received_at=CLOCK.now)
            except CtlError as exc:
                out[t.name] = Reply("error", error=str(exc), seconds=0.002, received_at=CLOCK.now)
        return out


HOSTS: dict[str, Host] = {}


def setup() -> None:
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(mode=0o700)
    HOSTS.update(h1=Host("h1"), h2=Host("h2"))
    defaults = WindowDefaults.from_config(ProfileConfig(max_window_steps=20)).to_wire()
    for name, ranks in (("h1", (0, 1)), ("h2", (2, 3))):
        for r in ranks:
            Rank(HOSTS[name], "j", r, 4).register(defaults)
    Rank(HOSTS["h1"], "other", 0, 1).register(defaults)


def set_modes(modes: dict[tuple[str, int], str]) -> None:
    for host in HOSTS.values():
        for rank in host.ranks.values():
            rank.mode = modes.get((host.name, rank.rank), "ok") if rank.job == "j" else "ok"
            rank.windows = []
            rank.beat()


RUNS = itertools.count()
IDS = itertools.count(1)


def run(argv: list[str]) -> str:
    """One invocation, from a clock, steps and ids of its own: what one prints does not shift what the next do."""
    from ondemand_prof.host import ctl, fanout

    n = next(RUNS)
    CLOCK.now = T0 + 100.0 * n
    global IDS
    IDS = itertools.count(1 + 256 * n)
    for host in HOSTS.values():
        for rank in host.ranks.values():
            rank.step = 100 + 1000 * n
            rank.beat()

    ctl.Client = lambda runtime_dir, timeout=5.0: Client(HOSTS["h1"], timeout)  # type: ignore[assignment]
    from ondemand_prof.host.commands import report as report_command

    report_command.Client = ctl.Client  # type: ignore[attr-defined]  # report asks this host's daemon itself
    fanout.Fanout = Fanout  # type: ignore[assignment,misc]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = ctl.main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    for host in HOSTS.values():  # whatever a command left running finishes before the next
        while host.tick():
            pass
    return f"$ ondemandctl {' '.join(argv)}\nrc {rc}\n{out.getvalue()}" + (f"stderr:\n{err.getvalue()}" if
                                                                          err.getvalue() else "")


LOCAL: list[tuple[dict[tuple[str, int], str], list[str]]] = [
    ({}, ["status"]), ({}, ["status", "--json"]), ({}, ["status", "--job", "j"]), ({}, ["status", "--job", "nope"]),
    ({}, ["list"]), ({}, ["list", "--json"]),
    ({}, ["capture", "--job", "j", "--no-wait"]),
    ({}, ["capture", "--job", "j", "--wait"]),
    ({}, ["capture", "--job", "j", "--wait", "--json"]),
    ({}, ["capture", "--job", "j", "--ranks", "0", "--steps", "3", "--wait"]),
    ({}, ["capture", "--job", "j", "--steps", "500", "--wait", "--id", "capped"]),
    ({}, ["capture", "--job", "j", "--start", "10", "--wait", "--baseline"]),
    ({}, ["capture", "--job", "j", "--start-step", "50", "--wait"]),
    ({("h1", 1): "late"}, ["capture", "--job", "j", "--wait"]),
    ({("h1", 1): "fail"}, ["capture", "--job", "j", "--wait"]),
    ({("h1", 0): "fail", ("h1", 1): "fail"}, ["capture", "--job", "j", "--wait"]),
    ({("h1", 0): "busy"}, ["capture", "--job", "j", "--ranks", "0", "--steps", "2", "--wait"]),
    ({("h1", 1): "silent"}, ["capture", "--job", "j", "--wait", "--timeout", "3"]),
    ({}, ["capture", "--job", "j", "--ranks", "7", "--wait"]),
    ({}, ["capture", "--job", "j", "--ranks", "x"]),
    ({}, ["capture", "--job", "j", "--steps", "0"]),
    ({}, ["capture", "--job", "j", "--html", "x.html"]),
    ({}, ["capture", "--wait"]),
    ({}, ["capture", "--job", "other", "--wait"]),
    ({}, ["list"]), ({}, ["list", "--job", "j"]), ({}, ["list", "--job", "oth"]), ({}, ["list", "--limit", "0"]),
    ({}, ["list", "--limit", "3", "--json"]),
]
SHOW = ["show", "cancel"]
ACROSS: list[tuple[dict[tuple[str, int], str], list[str]]] = [
    ({}, ["--hosts", "h1,h2", "status"]), ({}, ["--hosts", "h1,h2", "status", "--json"]),
    ({}, ["--hosts", "h1,h2,h3", "status"]),
    ({}, ["--hosts", "h1,h2", "list"]),
    ({}, ["--hosts", "h1,h2", "capture", "--job", "j", "--wait"]),
    ({}, ["--hosts", "h1,h2", "capture", "--job", "j", "--wait", "--json"]),
    ({}, ["--hosts", "h1,h2", "capture", "--job", "j", "--no-wait"]),
    ({("h2", 3): "late"}, ["--hosts", "h1,h2", "capture", "--job", "j", "--wait"]),
    ({("h2", 2): "late", ("h2", 3): "late"}, ["--hosts", "h1,h2", "capture", "--job", "j", "--wait"]),
    ({("h2", 2): "fail"}, ["--hosts", "h1,h2", "capture", "--job", "j", "--wait"]),
    ({}, ["--hosts", "h1,h2,h3", "capture", "--job", "j", "--wait", "--timeout", "3"]),
    ({}, ["--hosts", "h1,h2", "list"]), ({}, ["--hosts", "h1,h2", "list", "--json"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", type=Path, help="the checkout whose ondemand_prof to run (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.package or ROOT))
    os.environ["TZ"] = "UTC"
    time.tzset()
    import secrets

    secrets.token_hex = lambda n=None: f"{next(IDS):0{2 * (n or 32)}x}"  # type: ignore[assignment]
    time.time, time.monotonic, time.sleep = CLOCK.time, CLOCK.monotonic, CLOCK.sleep  # type: ignore[assignment]
    socket.gethostname = lambda: "node-h1"  # type: ignore[assignment]
    os.getpid = lambda: 4242  # the daemon's pid, as status prints it
    import logging

    logging.disable(logging.CRITICAL)
    import ondemand_prof.report as report_package

    report_package.usable_cores = lambda: 1  # traces read in this process: no pool, nothing out of order
    setup()
    texts: list[str] = []
    for modes, argv in LOCAL:
        set_modes(modes)
        texts.append(run(argv))
    ids_made = [r.capture_id for r in HOSTS["h1"].service.store.newest(1000)]
    for cid in reversed(ids_made):
        texts.append(run(["show", cid]))
        texts.append(run(["show", cid, "--json"]))
    texts.append(run(["show", "nope"]))
    texts.append(run(["show", ""]))
    done = [r.capture_id for r in HOSTS["h1"].service.store.newest(1000) if r.status == "done" and r.data["job"] == "j"]
    for argv in (["report", done[0]], ["report", done[0], "--json"], ["report", done[0], "--summary", "--top", "3"],
                 ["report", done[0], "--top", "20"], ["report", done[0], "--baseline", done[-1]],
                 ["report", done[0], "--baseline", done[-1], "--json"], ["report", "nope"]):
        texts.append(run(argv))
    set_modes({})
    texts.append(run(["capture", "--job", "j", "--wait", "--report", "--summary"]))
    set_modes({("h1", 0): "silent", ("h1", 1): "silent"})
    texts.append(run(["capture", "--job", "j", "--no-wait"]))
    texts.append(run(["cancel", HOSTS["h1"].service.store.newest(1)[0].capture_id]))
    texts.append(run(["cancel", ids_made[-1]]))
    for modes, argv in ACROSS:
        set_modes(modes)
        texts.append(run(argv))
    across = [r.capture_id for r in HOSTS["h2"].service.store.newest(1000)]
    for cid in reversed(across):
        texts.append(run(["--hosts", "h1,h2", "show", cid]))
        texts.append(run(["--hosts", "h1,h2", "show", cid, "--json"]))
    done = [r.capture_id for r in HOSTS["h2"].service.store.newest(1000) if r.status == "done"]
    for argv in (["report", done[0]], ["report", done[0], "--json"], ["report", done[0], "--baseline", done[-1]]):
        texts.append(run(["--hosts", "h1,h2", *argv]))
    set_modes({})
    texts.append(run(["--hosts", "h1,h2", "capture", "--job", "j", "--wait", "--report", "--summary"]))
    set_modes({("h1", 0): "silent", ("h1", 1): "silent", ("h2", 2): "silent", ("h2", 3): "silent"})
    texts.append(run(["--hosts", "h1,h2", "capture", "--job", "j", "--no-wait"]))
    running = HOSTS["h2"].service.store.newest(1)[0].capture_id
    texts.append(run(["--hosts", "h1,h2", "cancel", running, "--json"]))
    texts.append(run(["--hosts", "h1,h2", "cancel", running]))
    texts.append(run(["--hosts", "h1,h2", "cancel", "nope"]))
    texts.append(run(["cancel", "nope", "--json"]))
    texts.append(run(["--hosts", "h1,h2", "stacks", "--job", "j"]))
    texts.append(run(["--hosts", "h1,h2", "status", "--job", "other"]))
    text = "\n".join(texts)
    text = text.replace(str(WORK), "<WORK>")
    sys.stdout.write(text)
    sys.stderr.write(f"{len(texts)} invocations, {text.count(chr(10))} lines\n")


if __name__ == "__main__":
    main()
