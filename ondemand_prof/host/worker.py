"""Work the daemon's loop hands off (issue 41, 3): reading and comparing ranks' summaries (`compare`,
`summaries`, `show` of an automatic capture whose comparison is not kept yet, and an automatic capture's
comparison when it settles). One such request once held the loop 22 s (two 64-rank captures of large
summaries): every heartbeat, `status` and `capture` of every user waited behind it.

One thread runs the jobs, one at a time; the loop only queues them and, when one is done, sends its reply (the
ROUTER socket is the loop's alone). Who asked (the kernel's uid on the unix socket, the client key's name over
TCP; the owner's uid for the daemon's own automatic comparisons) has at most MAX_PER_ASKER jobs held, and all
askers together MAX_WAITING: a request over either is refused at once, saying so. Askers take turns (round
robin), so a member flooding compares delays another user's by at most the one it has running. A job whose
asker has gone (its connection closed: a CLI that gave up after its timeout) is dropped before it runs, and its
reply is not sent.

The loop learns that jobs are done from a pipe it polls with its sockets (no polling on a timer)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("ondemand_prof.daemon")

MAX_PER_ASKER = 4  # jobs of one asker held (one runs at a time): a fifth is refused at once
MAX_WAITING = 64  # jobs of all askers held


@dataclass
class Job:
    """One piece of work: `compute` runs on the worker thread (pure: it reads files and the snapshot it was
    given, never the daemon's state); `finish(result, error)` runs on the loop with what it returned or raised.
    `alive()` says whether whoever asked is still there (checked before it runs and before the reply goes)."""

    asker: Any
    kind: str
    compute: Callable[[], Any]
    finish: Callable[[Any, BaseException | None], None]
    alive: Callable[[], bool] = lambda: True
    bounded: bool = True  # False: the daemon's own (an automatic capture's comparison), outside the askers' shares
    queued: float = field(default_factory=time.monotonic)
    took_s: float = 0.0


class Worker:
    """The queue and its thread (module docstring). submit() and take_done() are the loop's; the rest its own."""

    def __init__(self, per_asker: int = MAX_PER_ASKER, waiting: int = MAX_WAITING) -> None:
        self.per_asker, self.max_waiting = per_asker, waiting
        self._cond = threading.Condition()
        self._queues: dict[Any, collections.deque[Job]] = {}
        self._turn: collections.deque[Any] = collections.deque()  # askers with jobs waiting, in turn order
        self._held: collections.Counter[Any] = collections.Counter()  # waiting + running, per asker
        self._waiting = 0
        self._done: collections.deque[tuple[Job, Any, BaseException | None]] = collections.deque()
        self._stopping = False
        self.read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.dropped = 0  # jobs of askers gone before they ran
        self.refused = 0
        self.ran = 0
        self._thread = threading.Thread(target=self._run, name="ondemand-profd-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> str:
        """Queue `job`: '' when taken, else why not (the asker's share, or the queue, is full)."""
        with self._cond:
            if self._stopping:
                return "the daemon is stopping"
            held = self._held[job.asker]
            if job.bounded and held >= self.per_asker:
                held -= self._purge(job.asker)  # its own requests whose asker has gone make room first
            if job.bounded and held >= self.per_asker:
                self.refused += 1
                return (f"the daemon is busy with {held} {job.kind} request(s) of yours (one runs at a time, at most "
                        f"{self.per_asker} are held per user): try again when one has finished")
            if job.bounded and self._waiting >= self.max_waiting:
                self.refused += 1
                return (f"the daemon is busy: {self._waiting} summary requests are waiting (at most "
                        f"{self.max_waiting}); try again shortly")
            queue = self._queues.get(job.asker)
            if queue is None:
                queue = self._queues[job.asker] = collections.deque()
                self._turn.append(job.asker)
            queue.append(job)
            self._held[job.asker] += 1
            self._waiting += 1
            self._cond.notify()
        return ""

    def _purge(self, asker: Any) -> int:
        """(Holding the lock.) Drop the waiting jobs of `asker` whose connection has closed; how many."""
        queue = self._queues.get(asker)
        if not queue:
            return 0
        gone = [j for j in queue if not j.alive()]
        for j in gone:
            queue.remove(j)
            self._waiting -= 1
            self._held[asker] -= 1
            self.dropped += 1
        if gone:
            log.info("ondemand-profd: dropped %d %s request(s) of %s: it has disconnected", len(gone), gone[0].kind,
                     asker)
        return len(gone)

    def held(self, asker: Any) -> int:
        with self._cond:
            return self._held[asker]

    @property
    def waiting(self) -> int:
        return self._waiting

    def _next(self) -> Job | None:
        """(Holding the lock.) The first job of the asker whose turn it is; that asker goes to the back."""
        while self._turn:
            asker = self._turn.popleft()
            queue = self._queues.get(asker)
            if not queue:
                self._queues.pop(asker, None)
                continue
            job = queue.popleft()
            self._waiting -= 1
            if queue:
                self._turn.append(asker)
            else:
                del self._queues[asker]
            return job
        return None

    def _release(self, job: Job) -> None:
        with self._cond:
            self._held[job.asker] -= 1
            if self._held[job.asker] <= 0:
                del self._held[job.asker]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._turn:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._next()
            if job is None:
                continue
            try:
                if not job.alive():
                    self.dropped += 1
                    log.info("ondemand-profd: dropped a %s request of %s: it has disconnected", job.kind,
                             job.asker)
                    continue
                result: Any = None
                error: BaseException | None = None
                t0 = time.monotonic()
                try:
                    result = job.compute()
                except Exception as exc:  # noqa: BLE001 - handed to the loop, which replies with it
                    error = exc
                job.took_s = time.monotonic() - t0
                self.ran += 1
                self._done.append((job, result, error))
                try:
                    os.write(self._write_fd, b"x")
                except BlockingIOError:
                    pass  # the pipe is full of wake-ups already: the loop will look
            finally:
                self._release(job)

    def take_done(self) -> list[tuple[Job, Any, BaseException | None]]:
        """(The loop.) The jobs done since the last call, with their results; the wake-up bytes read."""
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for fd in (self.read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def connection_alive(fd: int | None, ino: int | None) -> Callable[[], bool]:
    """Whether the connection a request came on is still open: its descriptor (libzmq's, SRCFD) still names the
    same socket (inode). libzmq closes a connection's descriptor as soon as its peer closes it; a number reused
    by a later connection names another socket. Always True where the message did not say (None)."""
    if fd is None or ino is None:
        return lambda: True

    def alive() -> bool:
        try:
            return os.fstat(fd).st_ino == ino
        except OSError:
            return False

    return alive


def connection_of(frame: Any, peer: Any = None) -> tuple[int | None, int | None]:
    """(descriptor, socket inode) of the connection a zmq.Frame came on (inode -1: it has closed already, or its
    descriptor is another connection's now: for a unix peer, SO_PEERCRED must still be `peer`'s); (None, None)
    where libzmq cannot say."""
    import socket
    import struct

    import zmq

    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None, None
    if not isinstance(fd, int) or fd < 0:
        return None, None
    try:
        ino = os.fstat(fd).st_ino
    except OSError:
        return fd, -1
    if peer is not None:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return fd, -1
        try:
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if (pid, uid) != (peer.pid, peer.uid):
                return fd, -1
        except OSError:
            return fd, -1
        finally:
            sock.detach()  # libzmq's descriptor: never closed by us
    return fd, ino
