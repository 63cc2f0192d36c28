"""ondemand-profd's metrics endpoint, the HTTP side (`--metrics HOST:PORT`): one thread, a selector over non-blocking
sockets, the body rendered once per Snapshot (host/metrics.py builds the Snapshot and the metric families).

The thread is a selector loop over non-blocking sockets (issue 34, F4: wsgiref's server read one connection at a
time, so one client sending a byte every 4 s held every scrape until it closed). No client can hold it: each
connection has REQUEST_TIMEOUT_S to send its whole request and SEND_TIMEOUT_S to take the reply, a request is at
most MAX_REQUEST_BYTES, and at most MAX_CONNECTIONS are open at once (one more closes the oldest that has not
finished sending its request). One request per connection (`Connection: close`), as Prometheus is served fine.

A port on loopback is readable by every local user, outside the daemon's group too: --metrics-token-file FILE
makes every request present `Authorization: Bearer <the file's token>` (Prometheus: `authorization:
credentials_file:`), anything else is answered 401 with nothing of the jobs in it.

prometheus_client is an optional dependency (the `metrics` extra): it is imported only with --metrics.
"""

from __future__ import annotations

import gzip
import hmac
import logging
import os
import selectors
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..core.netaddr import port_number, split_host_port
from .hosts import is_loopback
from .metrics import (PUBLISH_EVERY_S, WAIT_FOR_LOOP_S, CaptureCounts, MetricsError, Observed, Snapshot,
                      build_snapshot, families, rank_text)

log = logging.getLogger("ondemand_prof.host.profd")

REQUEST_TIMEOUT_S = 5.0  # a connection must have sent its whole request this long after it was accepted
SEND_TIMEOUT_S = 20.0  # and taken the whole reply (1.4 MiB at 4096 ranks) this long after it was asked for
MAX_REQUEST_BYTES = 16 * 1024  # request line and headers (a scrape sends about 300 bytes)
MAX_CONNECTIONS = 64  # open at once; one more closes the oldest still sending its request
LISTEN_BACKLOG = 128
TOKEN_BYTES = (16, 4096)  # a bearer token: at least 16 bytes (openssl rand -hex 32 writes 64), at most 4 KiB


def preflight(address: str) -> tuple[str, int]:
    """Before the daemon creates anything: prometheus_client is there and the address parses."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise MetricsError("--metrics needs the prometheus_client package, which is not installed: pip install "
                           "'ondemand_prof[metrics]' (or prometheus_client), or start without --metrics") from None
    return parse_address(address)


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT, [v6]:PORT, or PORT alone (then loopback: 127.0.0.1). MetricsError says what is wrong."""
    host, port = split_host_port(text)
    alone = port is None
    if port is None:
        host, port = "", text
    host = host.strip("[]") if host.startswith("[") else host
    number = port_number(port)
    if number is None or (not alone and not host and text.startswith("[")):
        raise MetricsError(f"--metrics {text!r}: expected HOST:PORT (e.g. 127.0.0.1:9464, or 0.0.0.0:9464 for "
                           "every interface) or a port alone (loopback)")
    return host or "127.0.0.1", number


def read_token(path: Path) -> bytes:
    """The bearer token in `path`: a regular file (no link followed) that nobody but its owner may write, owned by
    us or root, holding TOKEN_BYTES of printable text (surrounding whitespace dropped). MetricsError says why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise MetricsError(f"--metrics-token-file {path}: cannot open it: {exc.strerror}"
                           f"{' (a symbolic link?)' if exc.errno == 40 else ''}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MetricsError(f"--metrics-token-file {path}: not a regular file")
        if st.st_uid not in (os.getuid(), 0):
            raise MetricsError(f"--metrics-token-file {path}: belongs to uid {st.st_uid}, not to us or root")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise MetricsError(f"--metrics-token-file {path}: writable by others (mode {st.st_mode & 0o7777:o}); "
                               "whoever can write it chooses the token: chmod go-w it")
        raw = os.read(fd, TOKEN_BYTES[1] + 1)
    finally:
        os.close(fd)
    token = raw.strip()
    if not TOKEN_BYTES[0] <= len(token) <= TOKEN_BYTES[1] or not all(0x21 <= b < 0x7f for b in token):
        raise MetricsError(f"--metrics-token-file {path}: expected one token of {TOKEN_BYTES[0]} to {TOKEN_BYTES[1]} "
                           "printable characters without spaces (e.g. openssl rand -hex 32 > FILE)")
    return token


@dataclass
class _Conn:
    """One client connection of the endpoint: what it sent so far, what is left to send it, and its deadline."""
    sock: socket.socket
    accepted: float
    deadline: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: memoryview | None = None  # the reply, once the request is complete
    closed: bool = False


class Endpoint:
    """The HTTP side of the metrics: one thread, a selector over non-blocking sockets, so that no client holds
    another's scrape (see the module's docstring for the caps). `serve(method, path, headers)` gives the status
    line, headers and body of a complete request."""

    def __init__(self, sock: socket.socket, serve: Any) -> None:
        self.sock = sock
        self.serve = serve
        self.conns: dict[int, _Conn] = {}
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (sock, self._wake_r, self._wake_w):
            s.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, "accept")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = threading.Event()
        self.served = 0  # replies sent whole
        self.dropped = 0  # connections closed for a deadline or the cap

    @property
    def server_address(self) -> Any:
        return self.sock.getsockname()

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            soonest = min((c.deadline for c in self.conns.values()), default=now + 1.0)
            for key, events in self.selector.select(max(0.0, min(1.0, soonest - now))):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                else:
                    self._io(key.data, events)
            now = time.monotonic()
            for conn in [c for c in self.conns.values() if c.deadline <= now]:
                log.debug("ondemand-profd metrics: a client took more than its deadline (%s); dropped",
                          "reply" if conn.outbox is not None else "request")
                self.dropped += 1
                self._close(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the next select tries again
                log.debug("ondemand-profd metrics: accept failed: %s", exc)
                return
            if len(self.conns) >= MAX_CONNECTIONS:
                waiting = [c for c in self.conns.values() if c.outbox is None] or list(self.conns.values())
                self.dropped += 1
                self._close(min(waiting, key=lambda c: c.accepted))
            sock.setblocking(False)
            now = time.monotonic()
            conn = _Conn(sock, now, now + REQUEST_TIMEOUT_S)
            self.conns[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _io(self, conn: _Conn, events: int) -> None:
        try:
            if conn.outbox is None and events & selectors.EVENT_READ:
                chunk = conn.sock.recv(65536)
                if not chunk:
                    self._close(conn)
                    return
                conn.inbox += chunk
                self._maybe_request(conn)  # and, once complete, replies (as much as the socket takes now)
            elif conn.outbox is not None and events & selectors.EVENT_WRITE:
                self._send(conn)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(conn)

    def _maybe_request(self, conn: _Conn) -> None:
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            end = conn.inbox.find(b"\n\n")
        if end < 0:
            if len(conn.inbox) > MAX_REQUEST_BYTES:
                self._reply(conn, "431 Request Header Fields Too Large", [], b"request too large\n")
            return
        head = bytes(conn.inbox[:end]).decode("latin-1")
        lines = head.replace("\r\n", "\n").split("\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._reply(conn, "400 Bad Request", [], b"bad request\n")
            return
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            status, extra, body = self.serve(parts[0], parts[1].split("?", 1)[0], headers)
        except Exception:  # noqa: BLE001 - one bad scrape is a 500, never the end of the endpoint
            log.warning("ondemand-profd metrics: a scrape failed", exc_info=True)
            status, extra, body = "500 Internal Server Error", [], b"the metrics could not be rendered\n"
        self._reply(conn, status, extra, b"" if parts[0] == "HEAD" else body, len(body))

    def _reply(self, conn: _Conn, status: str, headers: list[tuple[str, str]], body: bytes,
               length: int | None = None) -> None:
        head = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers),
                f"Content-Length: {len(body) if length is None else length}", "Connection: close"]
        if not any(k.lower() == "content-type" for k, _ in headers):
            head.append("Content-Type: text/plain; charset=utf-8")
        conn.outbox = memoryview(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        conn.deadline = time.monotonic() + SEND_TIMEOUT_S
        self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        if conn.closed or conn.outbox is None:
            return
        while conn.outbox:
            try:
                n = conn.sock.send(conn.outbox[:1 << 20])
            except (BlockingIOError, InterruptedError):
                return
            conn.outbox = conn.outbox[n:]
        self.served += 1
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        fd = conn.sock.fileno()
        if self.conns.get(fd) is conn:
            del self.conns[fd]
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def server_close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        self.selector.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()


class MetricsServer:
    """The Prometheus endpoint of one daemon. tick() runs on the daemon's loop; everything else on the server
    thread."""

    def __init__(self, address: str, daemon: Observed, token_file: Path | None = None) -> None:
        host, port = preflight(address)
        from prometheus_client import CollectorRegistry, ProcessCollector

        self.token = read_token(token_file) if token_file is not None else None
        self.daemon = daemon
        assert daemon.service is not None  # (made by an open daemon: Observed)
        self.counts = CaptureCounts(daemon.service.store)
        self._snapshot: Snapshot | None = None
        self._wanted = threading.Event()
        self._fresh = threading.Condition()
        self._last_publish = 0.0
        self.published = 0  # Snapshots the loop built
        self._cache: tuple[int, bytes, bytes | None] | None = None  # (serial, text, gzipped text)
        self._render_lock = threading.Lock()
        self.rendering: Snapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, _resident_memory_bytes, _open_fds
        self.registry.register(_Collector(self))
        self.server = Endpoint(self._bind(host, port), self._serve)
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="ondemand-profd-metrics", daemon=True)
        self.thread.start()
        if self.token is not None:
            log.info("ondemand-profd: metrics need the bearer token in %s", token_file)
        elif not is_loopback(host):
            log.warning("ondemand-profd: metrics on %s are readable by anyone who can reach that address (job ids, "
                        "host names, steps); keep it to the monitoring network, or --metrics-token-file", self.address)
        log.info("ondemand-profd: Prometheus metrics at http://%s/metrics", self.address)

    def _bind(self, host: str, port: int) -> socket.socket:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror as exc:
            raise MetricsError(f"--metrics {host}:{port}: cannot resolve {host!r}: {exc.strerror}") from None
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does: a restart rebinds
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise MetricsError(f"--metrics {host}:{port}: cannot listen: {exc.strerror or exc}") from None
        return sock

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    # the daemon's loop ---------------------------------------------------------------------------------------

    def tick(self, wall: float) -> None:
        """Publish a Snapshot when a scrape wants one and the last is a second old. Cheap otherwise."""
        if not self._wanted.is_set() or wall - self._last_publish < PUBLISH_EVERY_S:
            return
        self._wanted.clear()
        self.published += 1
        snap = build_snapshot(self.daemon, self.counts, wall, self.published)
        self._last_publish = wall
        with self._fresh:
            self._snapshot = snap
            self._fresh.notify_all()

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)  # the loop wakes at once (and waits at most WAIT_FOR_LOOP_S in a scrape)
        self.server.server_close()

    # the server thread ---------------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot | None:
        """The newest Snapshot; asks the loop for a new one when it is a second old and waits a little for it."""
        snap = self._snapshot
        if snap is not None and time.time() - snap.wall < PUBLISH_EVERY_S:
            return snap
        self._wanted.set()
        with self._fresh:
            self._fresh.wait_for(lambda: self._snapshot is not snap, WAIT_FOR_LOOP_S)
            return self._snapshot

    def body(self, gzipped: bool) -> bytes:
        from prometheus_client import generate_latest

        with self._render_lock:  # one render at a time; every scrape of the same Snapshot reuses it
            snap = self.snapshot()
            serial = snap.serial if snap is not None else -1
            if self._cache is None or self._cache[0] != serial:
                self.rendering = snap  # what _Collector shows: the same Snapshot as the per-rank text
                ranks = rank_text(snap, time.time()).encode() if snap is not None else b""
                self._cache = (serial, generate_latest(self.registry) + ranks, None)
            if gzipped and self._cache[2] is None:
                self._cache = (serial, self._cache[1], gzip.compress(self._cache[1], 6))
            return self._cache[2] if gzipped else self._cache[1]  # type: ignore[return-value]

    def authorized(self, headers: dict[str, str]) -> bool:
        if self.token is None:
            return True
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode("latin-1"), self.token)

    def _serve(self, method: str, path: str, headers: dict[str, str]) -> tuple[str, list[tuple[str, str]], bytes]:
        from prometheus_client import exposition

        if not self.authorized(headers):  # before anything else: an unauthorised client learns nothing
            return "401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="ondemand-profd metrics"')], \
                b"a bearer token is needed (--metrics-token-file)\n"
        # the classic text format (0.0.4), which is what this endpoint writes (our names need no UTF-8 escaping)
        content_type = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)
        if path not in ("/metrics", "/"):
            return "404 Not Found", [], b"not found: the metrics are at /metrics\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", [("Allow", "GET, HEAD")], b""
        gzipped = "gzip" in headers.get("accept-encoding", "")
        data = self.body(gzipped)
        extra = [("Content-Type", content_type)]
        if gzipped:
            extra.append(("Content-Encoding", "gzip"))
        return "200 OK", extra, data


class _Collector:
    """prometheus_client's collector interface over the server's newest Snapshot."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        snap = self.server.rendering
        if snap is not None:
            yield from families(snap, time.time())
