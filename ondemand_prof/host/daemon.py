"""ondemand-profd, the process: its runtime directory (owner-only, checked), the pid file (one daemon a
directory), the metrics endpoint's wiring, and the loop: one ROUTER socket on the unix socket serves both the
ranks' agents (register, heartbeats, progress events) and ondemandctl (one reply per request), beside the TCP
listener of host/transport.py. Single-threaded: frames are decoded here and handed to the Service
(host/service.py), which holds every handler; disk writes are batched on a timer. Reading and comparing
ranks' summaries runs on a worker thread (host/worker.py): the loop queues it and sends its reply once done."""

from __future__ import annotations

import gc
import grp
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import zmq

from ..core.version import __version__
from ..core.protocol import MAX_FRAME_BYTES, ProtocolError, decode, encode, endpoint, reply_error, request_id_of, \
    socket_path
from ..core.files import write_atomic
from ..core.safedir import UnsafeDirectory, ensure_private_dir
from .commands import CLI_MESSAGES, DAEMON_COMMANDS
from .listener import TCP_PER_PEER, Listener, group_gid, peer_of, raise_nofile_limit, \
    remove_if_same
from .records import RecordStore
from .sdnotify import notify, watchdog_interval
from .service import Service
from .transport import SCHEMA, TCP_FILE, TCP_ROUTE, DaemonError, TcpListener, heartbeat
from .worker import Worker, connection_of

log = logging.getLogger("ondemand_prof.host.profd")

TICK_S = 0.2  # housekeeping: expire ranks, write changed records, answer watches that timed out
BATCH_S = 0.01
BATCH_ABOVE_RATE = 1000  # heartbeats per second
_NOBLOCK, _SNDMORE, _RCVMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.RCVMORE)
# requests that may be served off the loop (service.offload): whose connection is noted, so that a reply to an
# asker who has gone is not computed
OFFLOADED = frozenset(("compare", "summaries", "show"))


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


def write_pid_file(path: Path) -> tuple[int, int]:
    """Write our pid (replacing a stale file, never following a link); returns the file's (device, inode)."""
    st = write_atomic(path, f"{os.getpid()}\n", 0o644)
    return st.st_dev, st.st_ino


class Daemon:
    def __init__(self, runtime_dir: Path, state_dir: Path, *, group: str | None = None, listen: str | None = None,
                 keys: Path | None = None, tcp_per_peer: int = TCP_PER_PEER, metrics: str | None = None,
                 metrics_token_file: Path | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.listen = listen
        self.tcp_per_peer = tcp_per_peer
        self.keys = keys
        self.tcp: TcpListener | None = None
        self.state_dir = state_dir
        self.group = group
        self.host = socket.gethostname()
        self.service: Service | None = None
        self._stop = False
        self._bound = False
        self._beats = 0
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._listener: Listener | None = None
        self._pid_identity: tuple[int, int] | None = None
        self.metrics_address = metrics
        self.metrics_token_file = metrics_token_file  # --metrics-token-file: scrapes must present its token
        self.metrics: Any = None  # metrics.MetricsServer (--metrics HOST:PORT)
        self.version = __version__
        # counted for the metrics: plain integer adds, the heartbeats' only at each tick (from _beats)
        self.heartbeats_total = 0
        self.messages: dict[str, int] = {}
        self.invalid_messages = 0

    # ------------------------------------------------------------------------------------------------------
    # Setup

    def open(self) -> None:
        if self.metrics_address:  # before anything is created: a missing package or a bad address is one line
            from .metrics import MetricsError
            from .metrics_http import preflight, read_token

            try:
                preflight(self.metrics_address)
                if self.metrics_token_file is not None:
                    read_token(self.metrics_token_file)
            except MetricsError as exc:
                raise DaemonError(str(exc)) from None
        self._prepare_runtime_dir()
        self.service = Service(RecordStore(self.state_dir), DAEMON_COMMANDS, host=self.host, runtime_dir=self.runtime_dir,
                               state_dir=self.state_dir)
        self.service.worker = Worker()
        self.service.worker.start()
        path = socket_path(self.runtime_dir)
        url = endpoint(self.runtime_dir)
        self._refuse_if_running(url, path)
        soft, hard = raise_nofile_limit()
        log.debug("ondemand-profd: open-file limit %d (hard %d)", soft, hard)
        self._ctx = zmq.Context(io_threads=1)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a rank reconnecting with its identity takes over its route
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger frames drop the connection before reaching us
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        self._listener = Listener(path, group_gid=group_gid(self.group))
        self._sock = sock
        self._bound = True
        if self.listen:
            self.tcp = TcpListener(self._ctx, self.listen, self.keys, per_peer=self.tcp_per_peer)
        self._listener.attach(sock, self.tcp)  # the descriptor gate watches both sockets' connections
        self._pid_identity = write_pid_file(self.runtime_dir / "profd.pid")
        log.info("ondemand-profd %s listening on %s (state in %s)", __version__, url, self.state_dir)
        if self.tcp is not None:
            write_atomic(self.runtime_dir / TCP_FILE, self.tcp.endpoint + "\n", 0o644)  # never seen half-written
        if self.metrics_address:
            self._open_metrics(self.metrics_address)

    def _open_metrics(self, address: str) -> None:
        from .metrics import METRICS_FILE, MetricsError
        from .metrics_http import MetricsServer

        try:
            self.metrics = MetricsServer(address, self, self.metrics_token_file)
        except MetricsError as exc:
            raise DaemonError(str(exc)) from None
        write_atomic(self.runtime_dir / METRICS_FILE, self.metrics.address + "\n", 0o644)

    @property
    def listener(self) -> Listener | None:
        return self._listener

    def _prepare_runtime_dir(self) -> None:
        d = self.runtime_dir
        gid = None
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise DaemonError(f"--group {self.group!r}: no such group") from None
        try:
            # created owner-only; one that exists must be ours (not a symlink, not writable by others), or we
            # refuse: another user who made it first could otherwise serve our ranks a fake daemon
            ensure_private_dir(d)
        except UnsafeDirectory as exc:
            raise DaemonError(str(exc)) from None
        if gid is not None:
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
        if self.service is not None:
            if self.service.worker is not None:
                self.service.worker.stop()
                self.service.worker = None
            self.service.store.flush()
        if self._listener is not None:
            self._listener.close()  # the gate thread first: it watches the sockets closed below
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._bound:  # never remove the socket or pid file of another daemon: checked by device and inode
            self._bound = False
            if self._listener is not None:
                self._listener.remove()
            if self._pid_identity is not None:
                remove_if_same(self.runtime_dir / "profd.pid", self._pid_identity)
            for name in (TCP_FILE, "profd.metrics"):
                try:
                    (self.runtime_dir / name).unlink()
                except OSError:
                    pass

    # ------------------------------------------------------------------------------------------------------
    # Loop

    def stop(self, *_: Any) -> None:
        self._stop = True

    def serve(self) -> None:
        assert self._sock is not None and self.service is not None
        sock = self._sock
        service = self.service
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        listener = self._listener
        assert listener is not None
        tcp = self.tcp
        if tcp is not None:
            for extra in tcp.sockets():
                poller.register(extra, zmq.POLLIN)
        worker = service.worker
        if worker is not None:
            poller.register(worker.read_fd, zmq.POLLIN)  # a job done: its reply is sent from here
        recv, getopt = sock.recv, sock.getsockopt
        rate = 0.0  # heartbeats per second over the last tick (requests and events do not count: they want speed)
        next_tick = time.monotonic() + TICK_S
        wd = watchdog_interval()
        next_wd = time.monotonic()
        notify("READY=1\nSTATUS=serving " + str(socket_path(self.runtime_dir)))
        service.caught_up = time.monotonic()
        while not self._stop:
            timeout = max(0.0, next_tick - time.monotonic())
            ready = poller.poll(int(timeout * 1000))
            if not ready:
                service.caught_up = time.monotonic()  # nothing waits
            else:
                woke = time.monotonic()
                self._guarded(listener.check)  # the gate thread closes it; the loop opens it again
                if worker is not None and any(r[0] == worker.read_fd for r in ready):
                    self._guarded(service.collect_offloaded)
                if tcp is not None and any(r[0] is not sock and r[0] != getattr(worker, "read_fd", None)
                                           for r in ready):
                    self._serve_tcp()
                for n in range(10_000):  # drain, but let housekeeping run under a flood
                    try:
                        # two plain recv() calls: a quarter of recv_multipart's cost, which matters at 4096
                        # heartbeats a second; the body as a Frame, which carries the peer's credentials
                        route = recv(_NOBLOCK)
                        frame = recv(_NOBLOCK, copy=False)
                    except zmq.Again:
                        service.caught_up = time.monotonic()  # every message sent before this is read
                        break
                    if frame.more:  # a multi-frame message from a peer: not ours; drop the rest (frame.more, not
                        # getsockopt(RCVMORE): that converted the option to an enum, 1-3 us of every message)
                        while getopt(_RCVMORE):
                            recv(_NOBLOCK)
                        self.invalid_messages += 1
                        self._send(route, reply_error(None, "expected a single-frame message"))
                        continue
                    try:
                        self.dispatch(route, frame.bytes, frame)
                    except Exception:  # noqa: BLE001 - a bug met by one message never takes the daemon down
                        log.exception("ondemand-profd: unexpected error on a message; carrying on")
                if service.watches_due:
                    self._guarded(service.answer_due_watches)
                # Thousands of ranks heart-beating spread over the second would wake us once per message; when
                # heartbeats are that frequent, a short pause lets them arrive in batches (a request then waits
                # at most BATCH_S more). Hosts with fewer than a thousand ranks never pause.
                if rate > BATCH_ABOVE_RATE:
                    pause = BATCH_S - (time.monotonic() - woke)
                    if pause > 0:
                        time.sleep(pause)
            now = time.monotonic()
            if now >= next_tick:
                self.heartbeats_total += self._beats
                rate, self._beats = self._beats / max(TICK_S, now - next_tick + TICK_S), 0
                next_tick = now + TICK_S
                self._guarded(listener.check, True)
                self._guarded(service.housekeeping, now)
                # what lives now (ranks, capture records: 4096 parts each at 4096 ranks) is left out of the cyclic
                # collector's scans from here on: a full collection walks every record's parts (46 ms of CPU with
                # six 4096-rank captures kept, about 12k objects more with each), and runs whenever the heap grew
                # by a quarter. Refcounting still frees what the daemon drops; its steady state makes no reference
                # cycles (none found over captures, heartbeats and registrations)
                gc.freeze()
                if self.metrics is not None:
                    self._guarded(self.metrics.tick, time.time())
                if wd and now >= next_wd:
                    notify("WATCHDOG=1")
                    next_wd = now + wd
        notify("STOPPING=1")

    def _guarded(self, fn: Any, *args: Any) -> None:
        """Housekeeping and delayed replies: an unexpected error is logged and the loop goes on."""
        try:
            fn(*args)
            self._flush_outbox()
        except Exception:  # noqa: BLE001
            log.exception("ondemand-profd: unexpected error in %s; carrying on", getattr(fn, "__name__", fn))

    def dispatch(self, route: bytes, frame: bytes, carrier: Any = None) -> None:
        """One message; `carrier` is the zmq.Frame it came in, whose properties say who sent it."""
        service = self.service
        assert service is not None
        # the common case, a heartbeat, is read without the general decoder (transport.heartbeat); anything else
        # is parsed once, by that decoder
        msg = heartbeat(frame)
        if msg is not None:
            self._beats += 1
            out = service.on_heartbeat(route, msg)
            if out is not None:
                self._send(route, out)
            return
        self._request(route, frame, SCHEMA, carrier)  # (it sends what the request queued, then the reply)

    def _request(self, route: bytes, frame: bytes, schema: dict[str, Any], carrier: Any = None,
                 tcp_frame: Any = None) -> None:
        """Decode one message against `schema` and send the service's reply (or the decoder's error).
        `carrier`: the zmq.Frame of a unix-socket message (its peer credentials); over TCP, `tcp_frame` is the
        message's zmq.Frame (the client key's name, its connection)."""
        service = self.service
        assert service is not None
        try:
            msg = decode(frame, schema)
        except ProtocolError as exc:
            log.warning("ondemand-profd: bad message (%d bytes): %s", len(frame), exc)
            self.invalid_messages += 1
            self._send(route, reply_error(request_id_of(frame), str(exc)))
            return
        self.messages[msg["type"]] = self.messages.get(msg["type"], 0) + 1  # types: the schema's, bounded
        # the kernel's word, not the sender's (and, for a registration, whether the connector is still there)
        msg["_peer"] = peer_of(carrier, connector=msg["type"] == "register") if tcp_frame is None and \
            carrier is not None else None
        msg["_key"] = _user_id(tcp_frame) if tcp_frame is not None else None  # over TCP: the client key's name
        # the connection it came on, for a request served off the loop: not computed for an asker who has gone
        msg["_conn"] = connection_of(tcp_frame if tcp_frame is not None else carrier, msg["_peer"]) \
            if msg["type"] in OFFLOADED and (carrier is not None or tcp_frame is not None) else None
        out = service.handle(route, msg)
        self._flush_outbox()  # what the request sends to ranks leaves before its reply (a new capture's windows)
        if out is not None:
            self._send(route, out)
        elif msg["type"] == "bye" and msg.get("ack") is True:
            # read and acted on: a rank that is ending waits for this before it dies (rank/daemon_link.py _bye)
            self._send(route, encode("bye_ok"))

    def _flush_outbox(self) -> None:
        service = self.service
        assert service is not None
        if service.outbox:
            out, service.outbox = service.outbox, []
            for route, body in out:
                self._send(route, body)
        while service.after_send:
            service.after_send.pop(0)()

    def _serve_tcp(self) -> None:
        """Authenticate new TCP peers, then serve their requests (ondemandctl's messages only: a rank never
        registers over TCP, and no message names a path)."""
        tcp = self.tcp
        assert tcp is not None and self.service is not None
        tcp.answer_zap()
        for route, frame in tcp.receive():
            self._request(route, frame.bytes, CLI_MESSAGES, tcp_frame=frame)

    def _send(self, route: bytes, body: bytes) -> None:
        assert self._sock is not None
        sock = self._sock
        if route.startswith(TCP_ROUTE) and self.tcp is not None:
            sock, route = self.tcp.sock, route[len(TCP_ROUTE):]
        try:
            sock.send(route, _NOBLOCK | _SNDMORE)
            sock.send(body, _NOBLOCK)
        except zmq.Again:
            log.debug("ondemand-profd: peer not keeping up; reply dropped")


def _user_id(frame: Any) -> str | None:
    """The name of the client key a TCP message was authenticated with (the ZAP handler's User-Id)."""
    try:
        value = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    return str(value)[:64] if value else None


def run(runtime_dir: Path, state_dir: Path, *, group: str | None = None, listen: str | None = None,
        keys: Path | None = None, tcp_per_peer: int = TCP_PER_PEER, metrics: str | None = None,
        metrics_token_file: Path | None = None) -> int:
    daemon = Daemon(runtime_dir, state_dir, group=group, listen=listen, keys=keys, tcp_per_peer=tcp_per_peer,
                    metrics=metrics, metrics_token_file=metrics_token_file)
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
