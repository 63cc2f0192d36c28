"""The rank's side of the daemon protocol: an agent extension that registers with ondemand-profd, sends
heartbeats (step, step time, state), takes capture windows and reports their progress.

Runs on the agent thread only (ZMQ sockets are not thread-safe); progress events from the training and export
threads are queued and sent from here. The socket connects whether or not a daemon is running: ZMQ keeps
retrying, so a daemon started (or restarted) later is found within a heartbeat, with no flag and no restart.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..core.version import __version__
from ..core.bounds import bounded_int
from ..core.protocol import HEARTBEAT_S, MAX_BATCHED_EVENTS, MAX_FRAME_BYTES, MAX_MESSAGE_BYTES, ProtocolError, \
    decode, default_runtime_dir, encode, endpoint, socket_path
from ..core.processes import peer_address_ids
from ..core.safedir import NOBODY_LISTENS, daemon_peer_problem, daemon_process_problem, daemon_socket_problem
from ..core.requests import WindowDefaults, window_from_wire
from .announce import refusal_fix
from .extension import AgentLike, Extension

log = logging.getLogger("ondemand_prof")

DAEMON_MESSAGES: dict[str, dict[str, tuple[type, ...]]] = {
    "capture": {"window": (dict,)},
    "cancel": {"capture_id": (str,)},
    "triage": {"triage_id": (str,), "action": (str,)},
    "register": {},
    "registered": {},
    "bye_ok": {},  # the daemon read our bye (asked for with ack: True)
    "error": {},
}
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES - 1024  # what a triage answer may take of a message (1 KiB to spare)
REFUSED_RETRY_S = 5.0  # a registration the daemon refused is tried again this often
RECENT = 16  # the last events of this many captures are replayed at registration (a restarted daemon learns them)
# How long a process that is ending (SIGTERM, exit, close) waits at most for the daemon to say it read the bye: a
# daemon that hears it answers in milliseconds; one that is stopped, hung or older (it does not answer byes) costs
# this, once, at the end. A bye not acknowledged was lost at times: the process died before ZMQ's I/O thread wrote
# it, or before the daemon read it while its pid sweep saw the death (issue 44, 1: "process exited" read for a
# rank SIGTERMed as another was SIGKILLed). torchrun and Slurm wait 30 s between SIGTERM and SIGKILL.
LAST_WORDS_S = 2.0
BYE_LINGER_MS = 300  # a bye not acknowledged in time: how long it may still take to leave the process (_let_go)
MAX_WHY = 400  # characters of a bye's why
Listener = Callable[[str, dict[str, Any]], None]  # a window's progress: (event, info)


def user_namespace_hint(problem: str) -> str:
    """What to set when the daemon's socket is refused from inside a user namespace (a rootless container, a pod
    with hostUsers: false): the kernel shows an owner the namespace does not map as the overflow uid (65534), so
    root's daemon outside looks like nobody's, and its owner-only directory cannot be entered. '' outside one."""
    try:
        with open("/proc/self/uid_map", encoding="ascii") as fh:
            rows = [line.split() for line in fh if line.strip()]
    except OSError:
        return ""
    if not rows or rows == [["0", "0", "4294967295"]]:
        return ""
    mine = next((r for r in rows if len(r) == 3 and int(r[0]) <= os.getuid() < int(r[0]) + int(r[2])), None)
    outside = str(int(mine[1]) + os.getuid() - int(mine[0])) if mine else "N"
    return (f" (this rank runs in a user namespace, uid {os.getuid()} here being uid {outside} on the host, which "
            "maps no other host user: a daemon of root's or another user's shows as uid 65534 here and cannot be "
            f"trusted; run ondemand-profd as uid {outside}, its runtime directory shared into the container "
            "(ONDEMAND_PROF_RUNTIME_DIR), or run the container with the host's users (Kubernetes: hostUsers: "
            "true))")


class DaemonLink(Extension):
    def __init__(self, agent: AgentLike, runtime_dir: Path | None = None, context: Any = None) -> None:
        import zmq

        self._zmq = zmq
        # plain ints, read once: no enum conversion on the agent's 5 ms loop
        self._events, self._pollin = int(zmq.EVENTS), int(zmq.POLLIN)
        self.agent = agent
        self.runtime_dir = runtime_dir or (Path(agent.config.runtime_dir).expanduser() if agent.config.runtime_dir
                                           else default_runtime_dir())
        self.url = endpoint(self.runtime_dir)
        ident = agent.prof.identity()
        self._own_ctx = context is None  # bench/ runs thousands of links on one context
        self._ctx = zmq.Context(io_threads=1) if context is None else context
        sock = self._ctx.socket(zmq.DEALER)
        # a stable identity: after a daemon restart the same rank is the same peer. The daemon lets a peer that
        # reconnects with it take its route over (ROUTER_HANDOVER), so it must not be guessable by another local
        # user (an object address was: host and pid are in `status`); at most 255 bytes (ZMQ's limit)
        sock.setsockopt(zmq.IDENTITY, f"r/{ident.host[:64]}/{ident.pid}/{secrets.token_hex(12)}".encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a daemon that is not there: we re-register instead
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(self.url)
        self._sock = sock
        self.registered = False
        self._distrust: str | None = "not checked yet"
        self._peer: tuple[int, int] | None = None  # (uid, pid) of the daemon whose messages were checked
        self.acknowledged = False  # the daemon answered a registration ("registered")
        self._answered_before = False  # a daemon ever answered one (a later "registered": it restarted)
        self.refused: str | None = None  # why the daemon refused our latest registration (None: it did not)
        self.untrusted: str | None = None  # why we do not register with the daemon's socket there (None: we do)
        self._last_error = ""
        self._next_beat = 0.0
        self._outbox: collections.deque[tuple[str, str, dict[str, Any]]] = collections.deque()
        self._batch = 1  # events a message: what the daemon's "registered" reply allows (an older daemon: 1)
        self._recent: collections.OrderedDict[str, tuple[str, dict[str, Any]]] = collections.OrderedDict()
        self._recent_lock = threading.Lock()
        self._opened: dict[str, dict[str, Any]] = {}  # "opened" of the captures in _recent that had one
        self._replies: collections.deque[bytes] = collections.deque()  # triage answers (rank/triage.py)
        self._last_words: tuple[str, int] | None = None  # (why, step): the process is ending (last_words)
        self._words_by = 0.0  # monotonic time the last words' acknowledgement is waited for until
        self._said = threading.Event()  # the last words left (or there was no daemon to hear them)
        self._closed = False  # the socket is closed (after the last words, or by close())
        log.debug("ondemand_prof: daemon link to %s", self.url)
        self._trusted()  # said before the start-up line, which names what is wrong with the daemon's socket

    # ------------------------------------------------------------------------------------------------------

    @property
    def socket(self) -> Any:
        return self._sock

    @property
    def connecting(self) -> bool:
        """A daemon listens at the socket (checked: ours or root's) and has not answered this rank yet: it has
        not read the registration, or has it on its way back."""
        return self._distrust is None and not self.acknowledged and self.refused is None and not self._closed

    def poll(self, now: float) -> None:
        """Called by the agent every loop (5 ms): take messages, send queued events, heartbeat once a second."""
        if self._closed:
            return  # the last words were said: the process is ending
        zmq = self._zmq
        for _ in range(100):
            if not int(self._sock.getsockopt(self._events)) & self._pollin:  # cheaper than a failed recv every 5 ms
                break
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            # nothing from a daemon we did not register with, or from a process that is not it, is acted on
            if self._distrust is None and self._from_daemon(frame):
                self._on_message(frame.bytes)
        self._flush()
        if self._last_words is not None:
            self._say_last_words()
        elif now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_S
            self._beat()

    def _flush(self) -> None:
        """Send the queued events and triage answers (while the daemon takes them)."""
        while self._outbox and self.registered:
            body, n = self._events_message(min(len(self._outbox), self._batch))
            if not self._send(body):
                break
            for _ in range(n):
                self._outbox.popleft()
        while self._replies and self.registered:
            if not self._send(self._replies[0]):
                break
            self._replies.popleft()

    def daemon_present(self) -> bool:
        """Whether a daemon's socket file exists (it may still be stale: only an answer tells). A runtime
        directory we cannot enter holds no daemon of ours: False, never an error (trigger files still work)."""
        try:
            return socket_path(self.runtime_dir).exists()
        except OSError:
            return False

    def beat_soon(self) -> None:
        """The agent thread: the next poll sends a heartbeat (the rank's state changed)."""
        self._next_beat = 0.0

    def reregister(self) -> None:
        """Register again at once (this rank's job, rank or trigger directory changed)."""
        self.registered = False
        self.acknowledged = False
        self._next_beat = 0.0

    def last_words(self, why: str, step: int, on_agent_thread: bool, wait_s: float = LAST_WORDS_S) -> None:
        """The process is ending (SIGTERM, interpreter exit): what is queued, then a bye saying why and at which
        step, until the daemon says it read it (at most `wait_s`). Said by the agent thread; another thread
        waits for that (and the socket's close) before the process goes on to die."""
        self._words_by = time.monotonic() + wait_s
        self._last_words = (why[:MAX_WHY], step)
        if on_agent_thread:
            self._say_last_words()
            return
        self.agent.wake()
        self._said.wait(wait_s + BYE_LINGER_MS / 1000 + 0.2)

    def _say_last_words(self) -> None:
        if self._last_words is None or self._said.is_set():
            return
        why, step = self._last_words
        try:
            if self.registered:
                self._flush()
                self._bye(why, step, self._words_by)
                self.registered = False
        finally:
            self._said.set()

    def _bye(self, why: str, step: int, until: float) -> None:
        """Say goodbye and close: the bye, then (it was sent) the daemon's acknowledgement waited for until
        `until`. The process may die right after (SIGTERM's default action, the end of the interpreter), and a
        bye sent is not yet a bye read: ZMQ's I/O thread writes it on its own time, and the daemon's pid sweep
        may see the death before it reads the bye. Acknowledged, the daemon has acted on it; not (a daemon
        stopped, or older), the socket is closed with a linger of BYE_LINGER_MS, so that what was sent at least
        leaves the process."""
        acked = self._send(encode("bye", why=why, step=step, ack=True)) and self._acknowledged(until)
        self._let_go(0 if acked else BYE_LINGER_MS)

    def _acknowledged(self, until: float) -> bool:
        """Whether the daemon's "bye_ok" arrives before `until` (monotonic). Anything else it sends meanwhile
        is dropped: this rank is going."""
        zmq = self._zmq
        while (left := until - time.monotonic()) > 0:
            try:
                if not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    continue
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return False
            if self._distrust is not None or not self._from_daemon(frame):
                continue
            try:
                if decode(frame.bytes, DAEMON_MESSAGES)["type"] == "bye_ok":
                    return True
            except ProtocolError:
                continue
        return False

    def _let_go(self, linger_ms: int) -> None:
        """Close the socket and end our context (waiting at most `linger_ms` for what is queued to leave)."""
        self._closed = True
        self._sock.close(linger=linger_ms)
        if self._own_ctx:
            self._ctx.term()

    def close(self) -> None:
        """The profiler is closed (its thread: the agent thread has stopped): a bye saying why, acknowledged or
        at most LAST_WORDS_S, and the socket closed."""
        if self._closed:
            return
        if not self._said.is_set() and self.registered:  # (set: the daemon heard our last words already)
            self.poll(0.0)  # results that finished while the agent was stopping
            if self.registered:
                self._bye(str(getattr(self.agent, "closing_why", "closed the profiler"))[:MAX_WHY],
                          self.agent.prof.current_step, time.monotonic() + LAST_WORDS_S)
                return
        self._let_go(0)

    # ------------------------------------------------------------------------------------------------------

    def _send(self, body: bytes) -> bool:
        if self._closed:
            return False
        try:
            self._sock.send(body, self._zmq.NOBLOCK)
            return True
        except self._zmq.Again:  # no daemon connected (IMMEDIATE), or it is not reading
            self.registered = False
            return False

    def _events_message(self, n: int) -> tuple[bytes, int]:
        """(message, how many it holds): up to the first `n` queued events ("event" for one, "events" for more)."""
        if n == 1:
            capture_id, event, info = self._outbox[0]
            return encode("event", capture_id=capture_id, event=event, info=info), 1
        # indexed, not iterated: other threads append while this one reads (only this thread pops)
        items = [{"capture_id": c, "event": e, "info": i} for c, e, i in (self._outbox[k] for k in range(n))]
        body = encode("events", events=items)
        # an event's info is small, but together they must fit one message: halve until they do
        return (body, n) if len(body) <= MAX_MESSAGE_BYTES else self._events_message(n // 2)

    def _beat(self) -> None:
        if not self.registered:
            self._register()
            return
        self._send(encode("hb", **self._progress()))

    def _progress(self) -> dict[str, Any]:
        prof = self.agent.prof
        began = self.agent.step_began()
        # the step and the time it began come from one clock sample, so the daemon can always extrapolate
        # (the training thread may have moved on since; a step behind is harmless, no "began" is not)
        out: dict[str, Any] = {"step": prof.current_step} if began is None else \
            {"step": began[0], "began": round(began[1], 6)}
        out["at"] = round(time.time(), 3)  # when sent: the daemon tells time in a step from a heartbeat's age
        out["state"] = prof.state
        since = getattr(self.agent, "rendezvous_since", None)
        if since is not None and out["state"] == "rendezvous":
            out["state_since"] = round(since, 3)  # the daemon shows "rendezvous N s"
        windows = prof.scheduler.windows() if hasattr(prof, "scheduler") else []
        if windows:  # the daemon plans new captures after these (file-triggered ones too)
            out["windows"] = windows
        st = self.agent.step_time()
        if st:
            out["step_time"] = round(st, 6)
        return out

    def _trusted(self) -> bool:
        """Whether the socket we connect to is our user's or root's daemon (checked before every registration):
        the socket and its directory, and the process listening there (its uid and pid namespace: a root pod's
        socket put in a shared runtime directory is root's too, issue 41, 2). Nobody listening: nothing is sent
        now (whoever binds next would be unchecked), and nothing is said."""
        path = socket_path(self.runtime_dir)
        problem = daemon_socket_problem(path) or daemon_peer_problem(path)
        if problem and not problem.endswith(("does not exist", NOBODY_LISTENS)):
            problem += user_namespace_hint(problem)
            if problem != self._distrust:
                log.warning("ondemand_prof: not registering with the daemon: %s", problem)
            self.untrusted = problem
        else:
            self.untrusted = None
        self._distrust = problem
        return problem is None

    def _from_daemon(self, frame: Any) -> bool:
        """Whether a message comes from the daemon checked before registering: the kernel's word on the
        process behind the connection (libzmq's Peer-Address). A daemon restarted is checked anew; a process
        that fails the check (a socket put there since) is distrusted, and we register again, checked."""
        try:
            ids = peer_address_ids(frame.get("Peer-Address"))
        except (self._zmq.ZMQError, AttributeError, TypeError):
            ids = None
        if ids is None or ids == self._peer:
            return True
        problem = daemon_process_problem(ids[0], ids[1], socket_path(self.runtime_dir))
        if problem is None:
            self._peer = ids
            return True
        if problem != self._distrust:
            log.warning("ondemand_prof: ignoring a message from the daemon's socket: %s", problem)
        self._distrust = self.untrusted = problem
        self.registered = self.acknowledged = False
        return False

    def _register(self) -> None:
        if not self._trusted():
            return
        prof = self.agent.prof
        ident = prof.identity()
        with self._recent_lock:
            # a window this rank opened itself is told again first (a daemon that did not hear it, restarted or
            # having taken us for gone, records it from that), then where it is now
            recent = [{"capture_id": cid, "event": e, "info": i} for cid, (ev, info) in self._recent.items()
                      for e, i in ((("opened", self._opened[cid]),) if cid in self._opened and ev != "opened"
                                   else ()) + ((ev, info),)]
        body = encode("register", job=ident.job_id, rank=ident.rank, world_size=ident.world_size, host=ident.host,
                      pid=ident.pid, local_rank=ident.local_rank, save_root=prof.config.save_path,
                      trigger_dir=str(self.agent.trigger_dir),
                      version=__version__, recent=recent, defaults=WindowDefaults.from_config(prof.config).to_wire(),
                      native_dump=self._native_dump(), **self._progress())
        self._batch = 1  # until this daemon's "registered" reply says what it takes (it may be an older one)
        self.registered = self._send(body)  # sent; "registered" is logged when the daemon says so
        if self.registered:
            log.debug("ondemand_prof: registration sent to ondemand-profd at %s (job %s, rank %d)", self.url,
                      ident.job_id, ident.rank)

    def _on_message(self, frame: bytes) -> None:
        try:
            msg = decode(frame, DAEMON_MESSAGES)
        except ProtocolError as exc:
            log.warning("ondemand_prof: ignoring a bad message from the daemon: %s", exc)
            return
        kind = msg["type"]
        if kind == "registered":
            if not self.acknowledged or self.refused:
                # the first registration is the agent's to say (the start-up line, or a line of its own when the
                # daemon answered after it); one after a daemon's restart is said here
                ident = self.agent.prof.identity()
                log.log(logging.INFO if self._answered_before else logging.DEBUG,
                        "ondemand_prof: registered with ondemand-profd at %s (job %s, rank %d)", self.url,
                        ident.job_id, ident.rank)
            self.acknowledged = self._answered_before = True
            self.refused = None
            self._last_error = ""
            batch = msg.get("events_batch")
            self._batch = batch if bounded_int(batch, 1, MAX_BATCHED_EVENTS) else 1
        elif kind == "bye_ok":
            pass  # (waited for by _acknowledged; one that comes late is nothing to act on)
        elif kind == "register":
            self.registered = False
            self._next_beat = 0.0  # at once, not in a second
        elif kind == "capture":
            self._on_capture(msg)
        elif kind == "cancel":
            self._on_cancel(msg["capture_id"])
        elif kind == "triage":
            self._on_triage(msg)
        elif kind == "error":
            self._on_error(str(msg.get("error")))

    def _on_error(self, error: str) -> None:
        """A refused registration (another live process holds this rank of this job) is tried again every
        REFUSED_RETRY_S, and said once per reason, not at every try: as a refusal, with the reason and the fixes."""
        if error.startswith("register:"):
            self.registered = False
            self.acknowledged = False
            self.refused = error.removeprefix("register:").strip()
            self._next_beat = time.monotonic() + REFUSED_RETRY_S
        if error != self._last_error:
            self._last_error = error
            if self.refused is not None and error.startswith("register:"):
                log.warning("ondemand_prof: ondemand-profd at %s refused to register this rank: %s%s; trying again "
                            "every %.0f s", self.url, self.refused, refusal_fix(self.refused), REFUSED_RETRY_S)
            else:
                log.warning("ondemand_prof: the daemon refused a message: %s", error)

    def _on_capture(self, msg: dict[str, Any]) -> None:
        """The daemon planned the window (steps, options, cap): take it as it is."""
        wire = msg["window"]
        capture_id = str(wire.get("capture_id") or "")
        listener = self._listener(capture_id)
        try:
            window = window_from_wire(wire)
        except ValueError as exc:
            listener("rejected", {"error": str(exc)})
            return
        listener("received", {"window": [window.start, window.end], "current_step": self.agent.prof.current_step})
        self.agent.schedule(window, listener)

    def _on_cancel(self, capture_id: str) -> None:
        prof = self.agent.prof
        prof.call_at_next_step(lambda step: prof.cancel(capture_id, step))

    def _native_dump(self) -> dict[str, Any] | None:
        return self.agent.triage.native.announce()

    def _on_triage(self, msg: dict[str, Any]) -> None:
        """stacks, memory, flight_recorder: answered with a triage_result, now or (memory) after its steps."""
        triage_id = msg["triage_id"]

        def reply(result: dict[str, Any]) -> None:  # any thread: sent from the agent thread
            body = encode("triage_result", triage_id=triage_id, result=result)
            if len(body) > MAX_REPLY_BYTES:
                body = encode("triage_result", triage_id=triage_id, result={
                    "ok": False, "error": f"the answer is {len(body)} bytes, more than a message holds"})
            self.post(body)

        self.agent.triage.request(msg["action"], msg.get("args"), reply, str(msg.get("capture_id") or triage_id))

    def post(self, body: bytes) -> None:
        """Any thread: a message for the daemon, sent from the agent thread once registered."""
        self._replies.append(body)
        self.agent.wake()

    def listener_for(self, capture_id: str) -> Any:
        """A window listener that reports progress to the daemon (automatic captures use it)."""
        return self._listener(capture_id)

    def opened(self, window: Any, listener: Listener) -> Listener:
        """Any thread: a window this rank opened itself (its trigger file, a signal). With a daemon that answered,
        it hears of it first ("opened", queued with the events, so before any progress) and records it (list,
        show); the listener returned tells both it and `listener`. Without one: `listener` alone."""
        if not self.acknowledged or self._closed:
            return listener
        to_daemon = self._listener(window.capture_id)
        to_daemon("opened", {"window": window.to_wire()})

        def both(event: str, info: dict[str, Any]) -> None:
            listener(event, info)
            to_daemon(event, info)

        return both

    def _listener(self, capture_id: str) -> Any:
        def listen(event: str, info: dict[str, Any]) -> None:
            # any thread: queue it for the agent thread, keep the latest state for re-registration
            info = {k: v for k, v in info.items() if k != "capture_id"}
            self._outbox.append((capture_id, event, info))
            with self._recent_lock:
                self._recent[capture_id] = (event, info)
                if event == "opened":
                    self._opened[capture_id] = info
                while len(self._recent) > RECENT:
                    self._opened.pop(self._recent.popitem(last=False)[0], None)
            self.agent.wake()

        return listen
