"""The daemon's service: the registry of live ranks, capture records, and every handler, with no sockets.

The transport (host/transport.py) hands each decoded message to Service.handle(route, msg) and sends what
comes back, plus whatever the service queued in `outbox` (windows for ranks, delayed watch replies). Handlers
of ondemandctl's commands live with their command (host/commands.py, one class per command: both ends); a bad
request raises BadRequest, whose text goes back to the sender; anything else is a bug, logged with its traceback.
Tested without sockets (tests/test_daemon_logic.py).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..core.files import iso_time, pid_alive
from ..core.protocol import FINAL_STATES, HEARTBEAT_S, RANK_TIMEOUT_S, encode, reply_error, reply_ok
from .records import CaptureRecord, RecordStore
from .registry import RankInfo, Registry

log = logging.getLogger("ondemand_prof.daemon")

PID_CHECK_S = 0.5  # how often the pids of local ranks are checked (a SIGKILLed rank leaves within this)
MAX_WATCH_S = 30.0


class BadRequest(Exception):
    """A request that cannot be served as asked; the message is for the person who sent it."""


class Service:
    def __init__(self, store: RecordStore, *, host: str, runtime_dir: Path, state_dir: Path,
                 pid_check: Callable[[int, bool], bool] = pid_alive) -> None:
        self.store = store
        self.host = host
        self.runtime_dir = runtime_dir
        self.state_dir = state_dir
        self.registry = Registry()
        self.pid_check = pid_check
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.outbox: list[tuple[bytes, bytes]] = []  # (route, frame) for the transport to send
        self.watches: list[tuple[bytes, Any, str, float]] = []  # (route, request id, capture id, deadline)
        self._watch_due: set[str] = set()
        self._next_pid_check = 0.0
        from .commands import DAEMON_COMMANDS  # the commands' daemon ends; commands import this module

        self.commands = DAEMON_COMMANDS
        from .triage import TriageBook

        self.triage = TriageBook(self)  # stacks, memory, flight-recorder requests waiting for their ranks
        self.rank_handlers: dict[str, Callable[[bytes, dict[str, Any]], bytes | None]] = {
            "register": self.on_register, "hb": self.on_heartbeat, "event": self.on_event, "bye": self.on_bye,
            "triage_result": self.triage.on_result, "auto_capture": self.triage.on_auto_capture}

    # ------------------------------------------------------------------------------------------------------

    def handle(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        """One decoded message -> its reply (None: no reply now). Never raises."""
        kind = msg["type"]
        try:
            if kind in self.rank_handlers:
                return self.rank_handlers[kind](route, msg)
            data = self.commands[kind].execute(self, route, msg)
            return None if data is None else reply_ok(msg.get("id"), data)
        except BadRequest as exc:
            return reply_error(msg.get("id"), str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request never takes the daemon down
            log.exception("ondemand-profd: error handling %s", kind)
            return reply_error(msg.get("id"), f"internal error: {type(exc).__name__}: {exc}")

    def send(self, route: bytes, body: bytes) -> None:
        self.outbox.append((route, body))

    def daemon_info(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"pid": os.getpid(), "version": __version__, "host": self.host,
                "started_at": iso_time(self.started_wall), "uptime_s": round(now - self.started, 1),
                "runtime_dir": str(self.runtime_dir), "state_dir": str(self.state_dir),
                "captures": len(self.store.records), "running_captures": len(self.store.running())}

    def find(self, capture_id: str) -> CaptureRecord:
        try:
            return self.store.find(capture_id)
        except KeyError as exc:
            raise BadRequest(exc.args[0]) from None

    # ------------------------------------------------------------------------------------------------------
    # From ranks

    def on_register(self, route: bytes, msg: dict[str, Any]) -> bytes:
        info = self.registry.register(route, msg, time.monotonic(), time.time(), self.pid_check)
        log.info("ondemand-profd: rank %d/%d of job %s registered (host %s, pid %d, step %d)", info.rank,
                 info.world_size, info.job, info.host, info.pid, info.step)
        for item in msg.get("recent") or []:  # what happened to our captures while we could not hear it
            if isinstance(item, dict) and isinstance(item.get("capture_id"), str):
                self._apply_event(info, item["capture_id"], str(item.get("event")), item.get("info") or {})
        return encode("registered", daemon_pid=os.getpid(), heartbeat_s=HEARTBEAT_S)

    def on_heartbeat(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        if self.registry.heartbeat(route, msg, time.monotonic()) is None:
            return encode("register")  # we restarted, or expired this rank: tell it to register again
        return None

    def on_event(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        info = self.registry.by_route.get(route)
        if info is None:
            return encode("register")
        self._apply_event(info, msg["capture_id"], msg["event"], msg["info"])
        return None

    def _apply_event(self, info: RankInfo, capture_id: str, event: str, data: Any) -> None:
        record = self.store.records.get(capture_id)
        if record is None or record.data["job"] != info.job:
            return
        if event == "started":
            return  # the warmup step began: the part is "scheduled" until recording
        if record.update(info.rank, event, data if isinstance(data, dict) else {}, time.time()):
            self.changed(record)

    def on_bye(self, route: bytes, msg: dict[str, Any]) -> None:
        info = self.registry.remove(route)
        if info is not None:
            log.info("ondemand-profd: rank %d of job %s closed", info.rank, info.job)
            self._fail_parts(info, f"rank {info.rank} closed the profiler before the window ended", time.time())
        return None

    # ------------------------------------------------------------------------------------------------------
    # Records and watches

    def changed(self, record: CaptureRecord) -> None:
        self.store.mark(record)
        if record.status != "running":
            self.store.save(record)  # results are written at once; progress is batched
            self.store.dirty.discard(record.capture_id)
        if self.watches:
            self._watch_due.add(record.capture_id)  # answered after this batch of messages: one reply, not 4096

    def watch(self, route: bytes, rid: Any, record: CaptureRecord, timeout: float) -> None:
        self.watches.append((route, rid, record.capture_id, time.monotonic() + timeout))

    def answer_due_watches(self, now: float | None = None) -> None:
        """Reply to watches whose capture changed (or whose time ran out, given `now`)."""
        due, self._watch_due = self._watch_due, set()
        keep = []
        for route, rid, capture_id, deadline in self.watches:
            if capture_id in due or (now is not None and now >= deadline):
                record = self.store.records[capture_id]
                self.send(route, reply_ok(rid, {**record.data, "version": record.version}))
            else:
                keep.append((route, rid, capture_id, deadline))
        self.watches = keep

    @property
    def watches_due(self) -> bool:
        return bool(self._watch_due)

    def housekeeping(self, now: float) -> None:
        wall = time.time()
        if now >= self._next_pid_check:  # every rank is looked at twice a second, not at every tick
            self._next_pid_check = now + PID_CHECK_S
            for info, reason in self.registry.expire(now, self.pid_check):
                log.warning("ondemand-profd: rank %d of job %s left: %s", info.rank, info.job, reason)
                self.triage.forget_later(info, reason, now)  # a hung rank stays reachable for a native dump
                self._fail_parts(info, f"rank {info.rank} is gone: {reason}", wall)
            if now - self.started > RANK_TIMEOUT_S + HEARTBEAT_S and self.store.running():
                self._fail_orphans(wall)
        self.store.flush()
        self.triage.tick(now)
        if self.watches:
            self.answer_due_watches(now)

    def _fail_parts(self, info: RankInfo, error: str, wall: float) -> None:
        for record in self.store.running():
            part = record.part(info.rank)
            if record.data["job"] == info.job and part and part["pid"] == info.pid and record.fail_rank(
                    info.rank, error, wall):
                self.changed(record)

    def _fail_orphans(self, wall: float) -> None:
        """Parts whose rank is not registered (it died while the daemon was down, or never came back)."""
        live = {(r.job, r.rank, r.pid) for r in self.registry.by_route.values()}
        for record in self.store.running():
            for part in record.data["parts"].values():
                if part["state"] not in FINAL_STATES and (record.data["job"], part["rank"], part["pid"]) not in live:
                    if record.fail_rank(part["rank"], f"rank {part['rank']} (pid {part['pid']}) is no longer "
                                                      "registered", wall):
                        self.changed(record)
