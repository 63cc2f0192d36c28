"""The daemon's listening unix socket, owned by us rather than by libzmq, and the file-descriptor gate.

Why: libzmq (4.3.x) aborts the whole process when accept() on an ipc:// listener fails with EMFILE
(src/ipc_listener.cpp:297), so more clients than descriptors used to kill the daemon, and TCP connections (which
libzmq accepts without limit; its TCP listener does survive EMFILE) could use up the descriptors the unix socket
needs. We create and bind the unix socket ourselves and lend libzmq a duplicate (ZMQ_USE_FD).

The gate is a thread of its own (DescriptorGate) that reads libzmq's connection events as they happen, so a burst
of connections is seen while the daemon's loop is busy with messages:

* unix socket: near the limit, a fresh listening socket (not lent) is renamed over profd.sock. New clients then
  wait in its backlog (ZMQ retries), and libzmq, whose listener no longer has a name, accepts nothing more; the
  ranks already connected keep their connections (nothing is unbound, so nothing is dropped). Once descriptors are
  free again the loop lends the waiting socket to libzmq and its backlog is served. The socket file keeps its
  path, mode and group throughout.
* TCP: each accepted connection is checked at once against a per-peer limit (connections from one address) and a
  budget for all TCP connections (a fraction of the descriptors); one over either is shut down on the spot, so
  TCP can never take the unix socket's descriptors. A connection that does not finish its handshake (CurveZMQ
  and the key check) within HANDSHAKE_S is closed by libzmq.

No descriptor shortage ends the daemon: every step here that needs a descriptor (dup, /proc listings) fails
softly and is retried.

The peer's credentials come from the kernel (SO_PEERCRED), which libzmq puts in every message's
"Peer-Address" property as "host:uid:gid:pid" for ipc:// connections.
"""

from __future__ import annotations

import grp
import logging
import os
import resource
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import zmq

log = logging.getLogger("ondemand_prof.host.profd")

BACKLOG = 64
REOPEN_AFTER_S = 2.0
EXACT_EVERY_S = 2.0  # how often the estimate of open descriptors is recounted from /proc/self/fd
HANDSHAKE_S = 3.0  # a connection that has not completed its ZMTP (and CurveZMQ) handshake by then is closed
TCP_PER_PEER = 32  # TCP connections one address may hold (ondemand-profd --tcp-per-peer)
TCP_SHARE = 8  # TCP connections may hold at most 1/TCP_SHARE of the descriptors (and at most TCP_MAX)
TCP_MAX = 4096
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class Peer(NamedTuple):
    uid: int
    gid: int
    pid: int  # as the kernel recorded it at connect(), in the daemon's pid namespace
    # From a pidfd of the process that called connect() (SO_PEERPIDFD, Linux 6.5+), read when asked for
    # (registrations): whether that process still exists, and its pids from the daemon's namespace down to its own
    # (NSpid: "12345 1" for pid 1 of a pod). None where the kernel cannot say.
    alive: bool | None = None
    nspids: tuple[int, ...] = ()


def raise_nofile_limit() -> tuple[int, int]:
    """Soft limit of open files up to the hard limit (1024 is a common soft default); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("ondemand-profd: could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft, hard


def open_fds(limit: int) -> int:
    """Descriptors open now; `limit` when even the listing cannot be opened (EMFILE: we are at it)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return limit


SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+ (Python 3.13 names it)


def peer_of(frame: Any, connector: bool = False) -> Peer | None:
    """The connecting process's uid, gid and pid, from a message received with copy=False. With `connector`, also
    whether the process that opened the connection is still there (Peer.alive, Peer.nspids).

    Why: the kernel records the pid at connect() and never updates it, while a connection can outlive the process
    that opened it (its descriptor passed on with SCM_RIGHTS, or inherited across a fork): once that process is
    gone, its pid number can be taken by anyone's process. A pidfd of the connector tells the two apart."""
    try:
        text = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    parts = str(text or "").rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        peer = Peer(int(parts[1]), int(parts[2]), int(parts[3]))
    except ValueError:
        return None
    return _with_connector(peer, frame) if connector else peer


def _with_connector(peer: Peer, frame: Any) -> Peer:
    """`peer` with what a pidfd of its connection's connector says (unchanged where the kernel cannot say)."""
    try:
        fd = frame.get(zmq.SRCFD)  # the connection the message was read from (libzmq 4.x)
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return peer
    if not isinstance(fd, int) or fd < 0:
        return peer
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return peer
    pidfd = -1
    try:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        if tuple(int.from_bytes(cred[i:i + 4], sys.byteorder, signed=True) for i in (0, 4, 8)) != \
                (peer.pid, peer.uid, peer.gid):
            return peer._replace(alive=False)  # the descriptor is another connection's now: not this peer's word
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        return _pidfd_view(peer, pidfd)
    except OSError:
        return peer  # no SO_PEERPIDFD (a kernel before 6.5), or the connection just closed
    finally:
        sock.detach()  # libzmq's descriptor: never closed by us
        if pidfd >= 0:
            os.close(pidfd)


def _pidfd_view(peer: Peer, pidfd: int) -> Peer:
    """The pidfd's fdinfo: "Pid: -1" once its process has exited; NSpid lists its pid in each namespace."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as fh:
            lines = dict(line.split(":", 1) for line in fh.read().splitlines() if ":" in line)
        pid = int(lines["Pid"])
        nspids = tuple(int(x) for x in lines.get("NSpid", "").split())
    except (OSError, KeyError, ValueError):
        return peer
    if pid == 0:  # alive, in a pid namespace this daemon does not see (a daemon in a pod without hostPID)
        return peer
    if pid < 0:  # -1: it exited
        return peer._replace(alive=False)
    return peer._replace(alive=pid == peer.pid, nspids=nspids or (pid,))


def _event(frames: list[bytes]) -> tuple[int, int]:
    """(event, value) of a monitor message; value is the connection's descriptor for ACCEPTED/DISCONNECTED."""
    head = frames[0] if frames else b""
    if len(head) < 6:
        return 0, 0
    return int.from_bytes(head[:2], "little"), int.from_bytes(head[2:6], "little")


def tcp_peer(fd: int) -> tuple[str, int] | None:
    """(peer address, our port) of a TCP connection libzmq accepted, from its descriptor; None when the
    descriptor is not (or no longer) a TCP connection."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return s.getpeername()[0], s.getsockname()[1]
    except OSError:
        return None
    finally:
        s.detach()  # libzmq's descriptor: never closed by us


def shut_down(fd: int) -> None:
    """End a connection libzmq owns without closing its descriptor (libzmq closes it on the EOF it then reads)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()


class Listener:
    """A listening unix socket at `path`, lent to a ZMQ socket; the gate (DescriptorGate) swaps in a socket that
    is not lent when descriptors run low, and the loop's check() lends it once they are free."""

    def __init__(self, path: Path, *, group_gid: int | None) -> None:
        self.path = path
        self.url = "ipc://" + str(path.absolute())
        self.group_gid = group_gid
        self._sock = self._bind(path)
        st = os.lstat(path)
        self.identity = (st.st_dev, st.st_ino)  # what close() removes: this file, not one with the same name
        self._lent: list[socket.socket] = []  # listeners libzmq has (our copies, closed at the end)
        self._waiting: socket.socket | None = None  # at `path`, not lent: the gate is closed
        self._zsock: zmq.Socket | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self.limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # close the gate at `high` open descriptors, open it again below `low`: room for what libzmq accepts from
        # the old listener's backlog, for what arrives before the gate thread runs, and for our own files
        margin = max(2 * BACKLOG + 64, self.limit // 4)
        self.high = max(16, self.limit - margin)
        self.low = max(8, self.limit - 2 * margin)
        self.estimate = 0
        self._closed_until = 0.0
        self._next_exact = 0.0
        self.gate: DescriptorGate | None = None

    @property
    def lent(self) -> bool:
        return self._waiting is None

    def _bind(self, path: Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077 if self.group_gid is None else 0o007)  # never, even briefly, world-accessible
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if self.group_gid is not None:
            os.chown(path, -1, self.group_gid)
        os.chmod(path, 0o660 if self.group_gid is not None else 0o600)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        return sock

    def attach(self, zsock: zmq.Socket, tcp: Any = None) -> None:
        """Lend the socket to `zsock` and start the gate thread (with `tcp`, a TcpListener, it watches that too)."""
        self._zsock = zsock
        self._lend(self._sock)
        self.estimate = open_fds(self.limit)
        self.gate = DescriptorGate(self, zsock, tcp)
        self.gate.start()

    @property
    def monitor(self) -> None:
        return None  # the gate thread reads the connection events (kept for callers that poll it)

    def _lend(self, sock: socket.socket) -> None:
        assert self._zsock is not None
        fd = os.dup(sock.fileno())  # OSError (EMFILE) reaches check(), which tries again later
        try:
            self._zsock.setsockopt(zmq.USE_FD, fd)
            self._zsock.bind(self.url)
        except zmq.ZMQError:
            os.close(fd)
            raise
        finally:
            self._zsock.setsockopt(zmq.USE_FD, -1)
        self._lent.append(sock)

    def close_gate(self) -> bool:
        """(The gate thread.) Put a socket that is not lent at `path`: new clients wait in its backlog; those
        connected keep their connections. False when it could not be done (it is retried)."""
        with self._lock:
            if self._waiting is not None:
                return True
            self._generation += 1
            temp = self.path.with_name(f".p{self._generation}")
            try:
                try:
                    os.unlink(temp)
                except FileNotFoundError:
                    pass
                sock = self._bind(temp)
                os.rename(temp, self.path)
            except OSError as exc:
                log.error("ondemand-profd: could not close the gate on %s: %s", self.path, exc)
                return False
            st = os.lstat(self.path)
            self.identity = (st.st_dev, st.st_ino)
            self._waiting = sock
            self._closed_until = time.monotonic() + REOPEN_AFTER_S
        log.warning("ondemand-profd: %d of %d file descriptors open; not accepting new connections until some "
                    "close (connected ranks stay connected; raise the limit: LimitNOFILE= in the unit, or ulimit -n)",
                    self.estimate, self.limit)
        return True

    def count(self, delta: int) -> int:
        with self._lock:
            self.estimate += delta
            return self.estimate

    def check(self, exact: bool = False) -> None:
        """(The daemon's loop.) Recount the descriptors now and then; open the gate again when they allow."""
        now = time.monotonic()
        if exact and self.lent and now < self._next_exact:
            exact = False  # listing /proc/self/fd costs ~3 ms at 4096 ranks: the drift check runs every 2 s
        if exact or not self.lent:
            with self._lock:
                self.estimate = open_fds(self.limit)
            self._next_exact = now + EXACT_EVERY_S
        if self.lent and self.estimate >= self.high and self.gate is not None:
            self.close_gate()  # the recount found it (connections the events did not show)
        waiting = self._waiting
        if waiting is not None and self.estimate < self.low and now >= self._closed_until:
            try:
                self._lend(waiting)
            except (OSError, zmq.ZMQError) as exc:
                log.warning("ondemand-profd: cannot accept connections again yet: %s", exc)
                self._closed_until = now + REOPEN_AFTER_S
                return
            with self._lock:
                self._waiting = None
            log.warning("ondemand-profd: %d file descriptors open; accepting connections again", self.estimate)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.stop()
            self.gate = None
        for sock in [self._sock, *self._lent, *([self._waiting] if self._waiting is not None else [])]:
            sock.close()

    def remove(self) -> None:
        """Unlink the socket file if it is still the one we bound (a second daemon may have replaced it)."""
        remove_if_same(self.path, self.identity)


class DescriptorGate(threading.Thread):
    """Reads libzmq's connection events as they come (the unix ROUTER's and the TCP ROUTER's monitors), keeps the
    estimate of open descriptors, closes the unix gate near the limit, and holds TCP to its per-peer limit and
    budget. Owns its monitor sockets; touches no other ZMQ socket (they are not thread-safe)."""

    def __init__(self, listener: Listener, zsock: zmq.Socket, tcp: Any = None) -> None:
        super().__init__(name="ondemand-profd-gate", daemon=True)
        self.listener = listener
        self._stopping = threading.Event()
        self._monitored = [zsock] + ([tcp.sock] if tcp is not None else [])
        self._monitors = [self._monitor(s) for s in self._monitored]
        self.tcp_monitor = self._monitors[1] if tcp is not None else None
        self.per_peer = getattr(tcp, "per_peer", TCP_PER_PEER)
        self.tcp_budget = min(TCP_MAX, max(16, listener.limit // TCP_SHARE))
        self.tcp_port = getattr(tcp, "port", None)
        self.tcp_fds: dict[int, str] = {}  # descriptor -> peer address, of the TCP connections we let stay
        self.per_ip: Counter[str] = Counter()
        self.refused = 0
        self._refusal_logged = 0.0
        # the GIL: while the loop handles a burst of messages, this thread waits for it at most this long
        sys.setswitchinterval(0.001)

    @staticmethod
    def _monitor(zsock: zmq.Socket) -> zmq.Socket:
        # pyzmq's get_monitor_socket leaves the event pipe at the default high-water mark (1000): when more
        # connections than that come or go between two reads, libzmq's I/O thread blocks sending the event while
        # holding the monitor's lock, and disabling the monitor at exit then waits forever (seen in bench_daemon).
        # A receive high-water mark of 0 makes the pipe unbounded.
        addr = f"inproc://ondemand-profd-monitor-{os.getpid()}-{id(zsock)}"
        zsock.monitor(addr, _EVENTS)
        mon = zsock.context.socket(zmq.PAIR)
        mon.setsockopt(zmq.RCVHWM, 0)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)
        return mon

    def run(self) -> None:
        poller = zmq.Poller()
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                ready = poller.poll(100)
                for mon, _ in ready:
                    self._drain(mon)
            except Exception:  # noqa: BLE001 - the gate never dies of one bad event
                log.exception("ondemand-profd: descriptor gate: unexpected error; carrying on")
                time.sleep(0.01)

    def _drain(self, mon: zmq.Socket) -> None:
        listener = self.listener
        for _ in range(10_000):
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = _event(frames)
            if event == zmq.EVENT_ACCEPTED:
                if mon is self.tcp_monitor and not self._tcp_accepted(fd):
                    continue  # shut down at once: counted when libzmq reports it disconnected
                if listener.count(1) >= listener.high and listener.lent:
                    listener.close_gate()
            elif event == zmq.EVENT_DISCONNECTED:
                if mon is self.tcp_monitor:
                    ip = self.tcp_fds.pop(fd, None)
                    if ip is None:
                        continue  # one we shut down (never counted)
                    self.per_ip[ip] -= 1
                    if self.per_ip[ip] <= 0:
                        del self.per_ip[ip]
                listener.count(-1)

    def _tcp_accepted(self, fd: int) -> bool:
        """Whether a new TCP connection may stay: its peer's connections and all TCP connections within bounds."""
        peer = tcp_peer(fd)
        if peer is None or (self.tcp_port is not None and peer[1] != self.tcp_port):
            return False  # gone already (its disconnect follows)
        ip = peer[0]
        if self.per_ip[ip] >= self.per_peer or len(self.tcp_fds) >= self.tcp_budget:
            shut_down(fd)
            self.refused += 1
            now = time.monotonic()
            if now - self._refusal_logged >= 60.0:
                self._refusal_logged = now
                log.warning("ondemand-profd: closing TCP connections over the limits (%d from %s, at most %d per "
                            "address; %d of %d for all TCP clients); %d closed so far", self.per_ip[ip], ip,
                            self.per_peer, len(self.tcp_fds), self.tcp_budget, self.refused)
            return False
        self.tcp_fds[fd] = ip
        self.per_ip[ip] += 1
        return True

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
        for zsock, mon in zip(self._monitored, self._monitors):
            try:
                zsock.monitor(None, 0)  # what disable_monitor does for its own socket
            except zmq.ZMQError:
                pass
            mon.close(linger=0)


def remove_if_same(path: Path, identity: tuple[int, int]) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) != identity:
        log.info("ondemand-profd: %s is no longer ours (replaced); leaving it", path)
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def group_gid(name: str | None) -> int | None:
    if not name:
        return None
    return grp.getgrnam(name).gr_gid
