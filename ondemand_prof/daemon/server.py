"""ondemand-profd: the host daemon. One ROUTER socket in the runtime directory serves both the ranks' agents
(register, heartbeats, progress events) and ondemandctl (one reply per request). Single-threaded: every
handler is a few dictionary operations, and disk writes are batched on a timer."""

from __future__ import annotations

import grp
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import zmq

from .. import __version__
from ..config import ProfileConfig
from ..output import iso_time, pid_alive
from ..protocol import (CLI_MESSAGES, FINAL_STATES, HEARTBEAT_S, PROTOCOL_VERSION, RANK_MESSAGES, RANK_TIMEOUT_S,
                        ProtocolError, decode, encode, endpoint, reply_error, reply_ok, socket_path)
from ..requests import RequestError, parse_request
from .records import CaptureRecord, RecordStore, new_capture_id
from .registry import RankInfo, Registry, plan_window
from .sdnotify import notify, watchdog_interval

log = logging.getLogger("ondemand_prof.daemon")

SCHEMA = {**RANK_MESSAGES, **CLI_MESSAGES}
TICK_S = 0.2  # housekeeping: expire ranks, write changed records, answer watches that timed out
MAX_WATCH_S = 30.0
BATCH_S = 0.01
BATCH_ABOVE_RATE = 1000  # heartbeats per second
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
PID_CHECK_S = 0.5  # how often the pids of local ranks are checked (a SIGKILLed rank leaves within this)
# the daemon checks requests only for shape; each rank applies its own configuration's cap on window length
_PERMISSIVE = ProfileConfig(max_window_steps=1_000_000)


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def _daemon_pid(pid_file: Path) -> int | None:
    """The pid in a pid file when that process is alive and is an ondemand-profd."""
    pid = _read_pid(pid_file)
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline()) if pid is not None else ""
    except psutil.Error:
        return None
    return pid if "ondemand" in cmdline and "daemon" in cmdline or "ondemand-profd" in cmdline else None


class DaemonError(RuntimeError):
    pass


class Daemon:
    def __init__(self, runtime_dir: Path, state_dir: Path, *, group: str | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.state_dir = state_dir
        self.group = group
        self.host = socket.gethostname()
        self.registry = Registry()
        self.store: RecordStore | None = None
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._stop = False
        self._bound = False
        self._next_pid_check = 0.0
        self._watch_due: set[str] = set()
        self._beats = 0
        self._watches: list[tuple[bytes, Any, str, float]] = []  # (route, request id, capture id, deadline)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self.handlers: dict[str, Callable[[bytes, dict[str, Any]], bytes | None]] = {
            "register": self.on_register, "hb": self.on_heartbeat, "event": self.on_event, "bye": self.on_bye,
            "status": self.on_status, "capture": self.on_capture, "list": self.on_list, "show": self.on_show,
            "watch": self.on_watch,
        }

    # ------------------------------------------------------------------------------------------------------
    # Setup

    def open(self) -> None:
        self._prepare_runtime_dir()
        self.store = RecordStore(self.state_dir)
        path = socket_path(self.runtime_dir)
        url = endpoint(self.runtime_dir)
        self._refuse_if_running(url, path)
        self._ctx = zmq.Context(io_threads=1)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a rank reconnecting with its identity takes over its route
        sock.setsockopt(zmq.MAXMSGSIZE, 1024 * 1024)  # frames over this drop the connection before reaching us
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        old = os.umask(0o077 if not self.group else 0o007)  # the socket is never, even briefly, world-accessible
        try:
            sock.bind(url)
        finally:
            os.umask(old)
        mode = 0o660 if self.group else 0o600
        os.chmod(path, mode)
        if self.group:
            os.chown(path, -1, grp.getgrnam(self.group).gr_gid)
        self._sock = sock
        self._bound = True
        (self.runtime_dir / "profd.pid").write_text(f"{os.getpid()}\n")
        log.info("ondemand-profd %s listening on %s (state in %s)", __version__, url, self.state_dir)

    def _prepare_runtime_dir(self) -> None:
        d = self.runtime_dir
        d.mkdir(parents=True, exist_ok=True)
        st = d.stat()
        if st.st_uid != os.getuid():
            raise DaemonError(f"runtime directory {d} belongs to uid {st.st_uid}, not to us (uid {os.getuid()})")
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise DaemonError(f"--group {self.group!r}: no such group") from None
            os.chown(d, -1, gid)
            os.chmod(d, 0o710)  # group members may reach the socket, not list or create files
        else:
            os.chmod(d, 0o700)

    def _refuse_if_running(self, url: str, path: Path) -> None:
        if not path.exists():
            return
        ctx = zmq.Context()
        try:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(url)
            s.send(encode("status", id="probe", brief=True))
            if s.poll(500):
                pid = _read_pid(self.runtime_dir / "profd.pid")
                raise DaemonError(f"another ondemand-profd (pid {pid if pid is not None else '?'}) is serving {path}")
        finally:
            ctx.destroy(linger=0)
        holder = _daemon_pid(self.runtime_dir / "profd.pid")
        if holder is not None and holder != os.getpid():
            raise DaemonError(f"ondemand-profd pid {holder} holds {path} but did not answer within 0.5 s; stop it "
                              "first")
        path.unlink()  # a stale socket from a daemon that died

    def close(self) -> None:
        if self.store is not None:
            self.store.flush()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._bound:  # never remove the socket or pid file of another daemon
            self._bound = False
            for name in ("profd.sock", "profd.pid"):
                try:
                    (self.runtime_dir / name).unlink()
                except OSError:
                    pass

    # ------------------------------------------------------------------------------------------------------
    # Loop

    def stop(self, *_: Any) -> None:
        self._stop = True

    def serve(self) -> None:
        assert self._sock is not None and self.store is not None
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        recv, getopt = sock.recv, sock.getsockopt
        rate = 0.0  # heartbeats per second over the last tick (requests and events do not count: they want speed)
        next_tick = time.monotonic() + TICK_S
        wd = watchdog_interval()
        next_wd = time.monotonic()
        notify("READY=1\nSTATUS=serving " + str(socket_path(self.runtime_dir)))
        while not self._stop:
            timeout = max(0.0, next_tick - time.monotonic())
            if poller.poll(int(timeout * 1000)):
                woke = time.monotonic()
                for _ in range(10_000):  # drain, but let housekeeping run under a flood
                    try:
                        # two plain recv() calls: a quarter of recv_multipart's cost, which matters at 4096
                        # heartbeats a second
                        route = recv(_NOBLOCK)
                        frame = recv(_NOBLOCK)
                    except zmq.Again:
                        break
                    if getopt(_RCVMORE):  # a multi-frame message from a peer: not ours; drop the rest
                        while getopt(_RCVMORE):
                            recv(_NOBLOCK)
                        self._send(route, reply_error(None, "expected a single-frame message"))
                        continue
                    self.dispatch(route, frame)
                if self._watch_due:
                    self._answer_due_watches()
                # Thousands of ranks heart-beating spread over the second would wake us once per message; when
                # heartbeats are that frequent, a short pause lets them arrive in batches (a request then waits
                # at most BATCH_S more). Hosts with fewer than a thousand ranks never pause.
                if rate > BATCH_ABOVE_RATE:
                    pause = BATCH_S - (time.monotonic() - woke)
                    if pause > 0:
                        time.sleep(pause)
            now = time.monotonic()
            if now >= next_tick:
                rate, self._beats = self._beats / max(TICK_S, now - next_tick + TICK_S), 0
                next_tick = now + TICK_S
                self.housekeeping(now)
                if wd and now >= next_wd:
                    notify("WATCHDOG=1")
                    next_wd = now + wd
        notify("STOPPING=1")

    def dispatch(self, route: bytes, frame: bytes) -> None:
        if len(frame) < 512:  # the common case, a heartbeat: checked here without the general decoder
            try:
                msg = json.loads(frame)
            except ValueError:
                msg = None
            if type(msg) is dict and msg.get("type") == "hb" and msg.get("v") == PROTOCOL_VERSION and \
                    type(msg.get("step")) is int:
                self._beats += 1
                out = self.on_heartbeat(route, msg)
                if out is not None:
                    self._send(route, out)
                return
        try:
            msg = decode(frame, SCHEMA)
        except ProtocolError as exc:
            log.warning("ondemand-profd: bad message (%d bytes): %s", len(frame), exc)
            self._send(route, reply_error(None, str(exc)))
            return
        try:
            out = self.handlers[msg["type"]](route, msg)
        except (ValueError, KeyError, RequestError) as exc:
            out = reply_error(msg.get("id"), exc.args[0] if exc.args else str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request never takes the daemon down
            log.exception("ondemand-profd: error handling %s", msg.get("type"))
            out = reply_error(msg.get("id"), f"internal error: {type(exc).__name__}: {exc}")
        if out is not None:
            self._send(route, out)

    def _send(self, route: bytes, body: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send(route, _NOBLOCK | _SNDMORE)
            self._sock.send(body, _NOBLOCK)
        except zmq.Again:
            log.debug("ondemand-profd: peer not keeping up; reply dropped")

    def housekeeping(self, now: float) -> None:
        assert self.store is not None
        wall = time.time()
        if now >= self._next_pid_check:  # every rank is looked at twice a second, not at every tick
            self._next_pid_check = now + PID_CHECK_S
            for info, reason in self.registry.expire(now, pid_alive):
                log.warning("ondemand-profd: rank %d of job %s left: %s", info.rank, info.job, reason)
                self._fail_parts(info, f"rank {info.rank} is gone: {reason}", wall)
            if now - self.started > RANK_TIMEOUT_S + HEARTBEAT_S and self.store.running():
                self._fail_orphans(wall)
        self.store.flush()
        if self._watches:
            keep = []
            for route, rid, capture_id, deadline in self._watches:
                if now >= deadline:
                    self._reply_watch(route, rid, capture_id)
                else:
                    keep.append((route, rid, capture_id, deadline))
            self._watches = keep

    def _fail_parts(self, info: RankInfo, error: str, wall: float) -> None:
        assert self.store is not None
        for record in self.store.running():
            part = record.part(info.rank)
            if record.data["job"] == info.job and part and part["pid"] == info.pid and record.fail_rank(
                    info.rank, error, wall):
                self._changed(record)

    def _fail_orphans(self, wall: float) -> None:
        """Parts whose rank is not registered (it died while the daemon was down, or never came back)."""
        assert self.store is not None
        live = {(r.job, r.rank, r.pid) for r in self.registry.by_route.values()}
        for record in self.store.running():
            for part in record.data["parts"].values():
                if part["state"] not in FINAL_STATES and (record.data["job"], part["rank"], part["pid"]) not in live:
                    if record.fail_rank(part["rank"], f"rank {part['rank']} (pid {part['pid']}) is no longer "
                                                      "registered", wall):
                        self._changed(record)

    def _changed(self, record: CaptureRecord) -> None:
        assert self.store is not None
        self.store.mark(record)
        if record.status != "running":
            self.store.save(record)  # results are written at once; progress is batched
            self.store.dirty.discard(record.capture_id)
        if self._watches:
            self._watch_due.add(record.capture_id)  # answered after this batch of messages: one reply, not 4096

    def _answer_due_watches(self) -> None:
        due, self._watch_due = self._watch_due, set()
        keep = []
        for route, rid, capture_id, deadline in self._watches:
            if capture_id in due:
                self._reply_watch(route, rid, capture_id)
            else:
                keep.append((route, rid, capture_id, deadline))
        self._watches = keep

    # ------------------------------------------------------------------------------------------------------
    # From ranks

    def on_register(self, route: bytes, msg: dict[str, Any]) -> bytes:
        info = self.registry.register(route, msg, time.monotonic(), time.time(), pid_alive)
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

    def _apply_event(self, info: RankInfo, capture_id: str, event: str, data: dict[str, Any]) -> None:
        assert self.store is not None
        record = self.store.records.get(capture_id)
        if record is None or record.data["job"] != info.job:
            return
        if event == "started":
            return  # the warmup step began: the part is "scheduled" until recording
        if record.update(info.rank, event, data if isinstance(data, dict) else {}, time.time()):
            self._changed(record)

    def on_bye(self, route: bytes, msg: dict[str, Any]) -> None:
        info = self.registry.remove(route)
        if info is not None:
            log.info("ondemand-profd: rank %d of job %s closed", info.rank, info.job)
            self._fail_parts(info, f"rank {info.rank} closed the profiler before the window ended", time.time())
        return None

    # ------------------------------------------------------------------------------------------------------
    # From ondemandctl

    def on_status(self, route: bytes, msg: dict[str, Any]) -> bytes:
        assert self.store is not None
        now = time.monotonic()
        job = msg.get("job")
        wall = time.time()
        jobs = {name: [r.as_dict(now, wall) for r in ranks] for name, ranks in self.registry.jobs().items()
                if not job or name == job}
        if job and not jobs:
            raise ValueError(f"no live job {job!r}; live jobs: {', '.join(self.registry.jobs()) or 'none'}")
        daemon = {"pid": os.getpid(), "version": __version__, "host": self.host, "started_at": iso_time(self.started_wall),
                  "uptime_s": round(now - self.started, 1), "runtime_dir": str(self.runtime_dir),
                  "state_dir": str(self.state_dir), "captures": len(self.store.records),
                  "running_captures": len(self.store.running())}
        return reply_ok(msg.get("id"), {"daemon": daemon, "jobs": jobs if not msg.get("brief") else {}})

    def on_capture(self, route: bytes, msg: dict[str, Any]) -> bytes:
        assert self.store is not None and self._sock is not None
        job = msg.get("job")
        if job is not None and not isinstance(job, str):
            raise ValueError("field 'job' must be a string")
        request = parse_request(msg["request"], _PERMISSIVE)
        job = self.registry.resolve_job(job)
        targets = self.registry.select(job, request.ranks if request.ranks is not None else (-1,))
        wall = time.time()
        plan = plan_window(targets, wall, start=request.start, start_step=request.start_step, steps=request.steps)
        capture_id = new_capture_id(wall)
        req = request.as_dict()
        record = CaptureRecord.new(capture_id, job, req, plan, [{"rank": t.rank, "host": t.host, "pid": t.pid}
                                                               for t in targets], wall)
        self.store.add(record)
        body = encode("capture", capture_id=capture_id, start_step=plan["start_step"], end_step=plan["end_step"],
                      request={k: v for k, v in req.items() if k not in ("start", "start_step", "ranks")})
        for t in targets:
            self._send(t.route, body)
        log.info("ondemand-profd: capture %s: job %s, %d rank(s), steps [%d, %d)", capture_id, job, len(targets),
                 plan["start_step"], plan["end_step"])
        return reply_ok(msg.get("id"), {**record.data, "version": record.version})

    def on_list(self, route: bytes, msg: dict[str, Any]) -> bytes:
        assert self.store is not None
        limit = msg.get("limit", 20)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise ValueError(f"field 'limit' must be an integer from 1 to 1000, got {limit!r}")
        job = msg.get("job") or None
        return reply_ok(msg.get("id"), {"captures": [r.summary() for r in self.store.newest(limit, job)]})

    def on_show(self, route: bytes, msg: dict[str, Any]) -> bytes:
        assert self.store is not None
        record = self.store.find(msg["capture_id"])
        return reply_ok(msg.get("id"), {**record.data, "version": record.version})

    def on_watch(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        """Reply when the capture changes from the version the caller has seen, or after `timeout_s`."""
        assert self.store is not None
        record = self.store.find(msg["capture_id"])
        timeout = msg.get("timeout_s", 5.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_WATCH_S:
            raise ValueError(f"field 'timeout_s' must be a number from 0 to {MAX_WATCH_S:g}, got {timeout!r}")
        if record.version != msg["seen"] or record.status != "running" or timeout == 0:
            return reply_ok(msg.get("id"), {**record.data, "version": record.version})
        self._watches.append((route, msg.get("id"), record.capture_id, time.monotonic() + timeout))
        return None

    def _reply_watch(self, route: bytes, rid: Any, capture_id: str) -> None:
        assert self.store is not None
        record = self.store.records[capture_id]
        self._send(route, reply_ok(rid, {**record.data, "version": record.version}))


def run(runtime_dir: Path, state_dir: Path, *, group: str | None = None) -> int:
    daemon = Daemon(runtime_dir, state_dir, group=group)
    try:
        daemon.open()
    except (DaemonError, ProtocolError, OSError, zmq.ZMQError) as exc:
        log.error("ondemand-profd: cannot start: %s", exc)
        daemon.close()
        return 1
    signal.signal(signal.SIGTERM, daemon.stop)
    signal.signal(signal.SIGINT, daemon.stop)
    try:
        daemon.serve()
    finally:
        daemon.close()
    log.info("ondemand-profd: stopped")
    return 0
