"""The daemon's listening unix socket, owned by us rather than by libzmq, and the file-descriptor gate.

Why we own it: libzmq (4.3.x) aborts the whole process when accept() on an ipc:// listener fails with EMFILE
(src/ipc_listener.cpp), so 1100 clients against a limit of 1024 descriptors used to kill the daemon. We create
and bind the socket ourselves and lend libzmq a duplicate of it (ZMQ_USE_FD). When the open descriptors near the
limit we take the duplicate back (unbind): our own copy keeps the socket file and its listening queue, so new
clients wait in the kernel's backlog (or retry) instead of being accepted, and are served once descriptors are
free again. Owning the socket also lets us remove exactly the file we created (by device and inode) and never
another daemon's.

The peer's credentials come from the kernel (SO_PEERCRED), which libzmq puts in every message's
"Peer-Address" property as "host:uid:gid:pid" for ipc:// connections.
"""

from __future__ import annotations

import grp
import logging
import os
import resource
import socket
import stat
import time
from pathlib import Path
from typing import Any, NamedTuple

import zmq

log = logging.getLogger("ondemand_prof.host.profd")

BACKLOG = 128
REOPEN_AFTER_S = 2.0
EXACT_EVERY_S = 2.0  # how often the estimate of open descriptors is recounted from /proc/self/fd


class Peer(NamedTuple):
    uid: int
    gid: int
    pid: int


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


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return 0


def peer_of(frame: Any) -> Peer | None:
    """The connecting process's uid, gid and pid, from a message received with copy=False."""
    try:
        text = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    parts = str(text or "").rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return Peer(int(parts[1]), int(parts[2]), int(parts[3]))
    except ValueError:
        return None


class Listener:
    """A bound, listening unix socket at `path`, lent to a ZMQ socket while descriptors allow."""

    def __init__(self, path: Path, *, group_gid: int | None) -> None:
        self.path = path
        self.url = "ipc://" + str(path.absolute())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077 if group_gid is None else 0o007)  # never, even briefly, world-accessible
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if group_gid is not None:
            os.chown(path, -1, group_gid)
        os.chmod(path, 0o660 if group_gid is not None else 0o600)
        sock.listen(BACKLOG)
        st = os.lstat(path)
        self.identity = (st.st_dev, st.st_ino)  # what close() removes: this file, not one with the same name
        self._sock = sock
        self._zsock: zmq.Socket | None = None
        self.lent = False
        self.limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # stop accepting at `high` open descriptors, start again below `low`: room for state files, /proc reads
        # and the connections libzmq accepts before we react
        margin = max(64, self.limit // 4)
        self.high = max(16, self.limit - margin)
        self.low = max(8, self.limit - 2 * margin)
        self._monitor: zmq.Socket | None = None
        self.estimate = 0
        self._closed_until = 0.0
        self._next_exact = 0.0

    def attach(self, zsock: zmq.Socket) -> None:
        self._zsock = zsock
        # pyzmq's get_monitor_socket leaves the event pipe at the default high-water mark (1000): when more
        # connections than that come or go between two reads (4096 ranks exiting together), libzmq's I/O thread
        # blocks sending the event while holding the monitor's lock, and the daemon's own disable_monitor at exit
        # then waits forever (seen in bench_daemon). A receive high-water mark of 0 makes the pipe unbounded; the
        # loop drains it at every wake-up.
        addr = f"inproc://ondemand-profd-monitor-{os.getpid()}-{id(zsock)}"
        zsock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        mon = zsock.context.socket(zmq.PAIR)
        mon.setsockopt(zmq.RCVHWM, 0)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)
        self._monitor = mon
        self._lend()
        self.estimate = open_fds()

    @property
    def monitor(self) -> zmq.Socket | None:
        return self._monitor

    def _lend(self) -> None:
        assert self._zsock is not None
        self._zsock.setsockopt(zmq.USE_FD, os.dup(self._sock.fileno()))
        self._zsock.bind(self.url)
        self._zsock.setsockopt(zmq.USE_FD, -1)
        self.lent = True

    def _withdraw(self) -> None:
        assert self._zsock is not None
        try:
            self._zsock.unbind(self.url)
        except zmq.ZMQError as exc:
            log.warning("ondemand-profd: could not stop accepting on %s: %s", self.path, exc)
        self.lent = False

    def check(self, exact: bool = False) -> None:
        """Count connections from the monitor's events (cheap); close or reopen the gate as needed."""
        mon = self._monitor
        if mon is not None:
            while True:
                try:
                    frames = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = int.from_bytes(frames[0][:2], "little") if frames and len(frames[0]) >= 2 else 0
                if event == zmq.EVENT_ACCEPTED:
                    self.estimate += 1
                elif event == zmq.EVENT_DISCONNECTED:
                    self.estimate -= 1
        now = time.monotonic()
        if exact and self.lent and self.estimate < self.high and now < self._next_exact:
            exact = False  # listing /proc/self/fd costs ~3 ms at 4096 ranks: the drift check runs every 2 s
        if exact or not self.lent or self.estimate >= self.high:
            self.estimate = open_fds()
            self._next_exact = now + EXACT_EVERY_S
        if self.lent and self.estimate >= self.high:
            # libzmq drops the connections it accepted through a listener it unbinds: the ranks reconnect and
            # register again on their own; a pause keeps that from repeating several times a second
            self._withdraw()
            self._closed_until = now + REOPEN_AFTER_S
            log.warning("ondemand-profd: %d of %d file descriptors open; not accepting new connections until "
                        "some close (raise the limit: LimitNOFILE= in the unit, or ulimit -n)", self.estimate,
                        self.limit)
        elif not self.lent and self.estimate < self.low and now >= self._closed_until:
            self._lend()
            log.warning("ondemand-profd: %d file descriptors open; accepting connections again", self.estimate)

    def close(self) -> None:
        if self._monitor is not None and self._zsock is not None:
            try:
                self._zsock.monitor(None, 0)  # stop monitoring (what disable_monitor does for its own socket)
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close()

    def remove(self) -> None:
        """Unlink the socket file if it is still the one we bound (a second daemon may have replaced it)."""
        remove_if_same(self.path, self.identity)


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


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
