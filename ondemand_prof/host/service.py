"""The daemon's service: the registry of live ranks, capture records, and every handler, with no sockets.

The daemon (host/daemon.py) hands each decoded message to Service.handle(route, msg) and sends what
comes back, plus whatever the service queued in `outbox` (windows for ranks, delayed watch replies). Handlers
of ondemandctl's commands live with their command (host/commands/, one class per command: both ends); a bad
request raises BadRequest, whose text goes back to the sender; anything else is a bug, logged with its traceback.
Tested without sockets (tests/test_daemon_logic.py).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..core.version import __version__
from ..core.bounds import MAX_STEP, bounded_int
from ..core.files import iso_time
from ..core.processes import exit_status_text, in_our_namespaces, own_mount_namespace, pid_alive, root_of
from ..core.rootpath import stat_in_root
from ..core.protocol import FINAL_STATES, HEARTBEAT_S, MAX_BATCHED_EVENTS, RANK_TIMEOUT_S, encode, reply_error, \
    reply_ok
from ..core.ids import valid_id
from ..core.safejson import holds_lone_surrogate
from ..core.text import printable
from .records import CAPTURE_KINDS, KEEP_RECORDS, CaptureRecord, RecordRefused, RecordStore
from .recordtypes import Part
from .podpath import host_path
from .planning import DeliveryBook
from .registry import RankConflict, RankInfo, Registry
from .rank_captures import RankCaptures
from .records import Plan
from .triage import TriageBook
from .worker import Job, Worker, connection_alive

log = logging.getLogger("ondemand_prof.daemon")

PID_CHECK_S = 0.5  # how often the pids of local ranks are checked (a SIGKILLed rank leaves within this)
MAX_WATCH_S = 30.0
# a rank's process gone with no bye: no exit, close() or SIGTERM of it ran (ours says why it goes at each), and it
# was reaped before the daemon could read its exit status
NO_WORD = (" without a word: killed by a signal it cannot catch (SIGKILL, the OOM killer) or crashed (SIGSEGV, "
           "SIGABRT); its launcher's log has the exit status")


class BadRequest(Exception):
    """A request that cannot be served as asked; the message is for the person who sent it."""


class Service:
    def __init__(self, store: RecordStore, commands: Mapping[str, Any], *, host: str, runtime_dir: Path,
                 state_dir: Path, pid_check: Callable[[int, bool], bool] = pid_alive) -> None:
        """`commands`: message type -> an object whose execute(service, route, msg) serves it (host/commands/)."""
        self.store = store
        self.host = host
        self.runtime_dir = runtime_dir
        self.state_dir = state_dir
        self.registry = Registry()
        self.delivery = DeliveryBook()  # per job: the lead of the next plan covers what recent windows took to arrive
        self.pid_check = pid_check
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.outbox: list[tuple[bytes, bytes]] = []  # (route, frame) for the transport to send
        # work done once the outbox has left and before the request's own reply (a new capture's record is written
        # after its windows are sent: the file write was an eighth of the way from request to windows)
        self.after_send: list[Callable[[], None]] = []
        self.refused: dict[str, int] = {}  # error replies by message type, for the metrics (host/metrics.py)
        self.caught_up = float("inf")  # monotonic time the transport last found no message waiting (inf: always)
        # (route, request id, capture id, deadline, the version for a changes-only answer or None)
        self.watches: list[tuple[bytes, Any, str, float, int | None]] = []
        self._watch_due: set[str] = set()
        self._next_pid_check = 0.0
        self._last_housekeeping: float | None = None
        self.commands = commands
        # reading and comparing summaries, off the loop (host/worker.py); None: inline (a service driven directly)
        self.worker: Worker | None = None
        self.capture_rate: Any = None  # captures asked per asker a minute (host/commands/capture.py CaptureRate)
        self.limits: list[str] | None = None  # what the daemon cannot do where it runs (daemon_info, once)
        self.triage = TriageBook(self)  # stacks, memory, flight-recorder requests waiting for their ranks
        self.rank_captures = RankCaptures(self)  # automatic, trigger-file and signal captures (host/rank_captures.py)
        self.rank_handlers: dict[str, Callable[[bytes, dict[str, Any]], bytes | None]] = {
            "register": self.on_register, "hb": self.on_heartbeat, "event": self.on_event, "events": self.on_events,
            "bye": self.on_bye,
            "triage_result": self.triage.on_result, "auto_capture": self.rank_captures.on_auto_capture}

    # ------------------------------------------------------------------------------------------------------

    def handle(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        """One decoded message -> its reply (None: no reply now). Never raises."""
        kind = msg["type"]
        try:
            if kind in self.rank_handlers:
                return self.rank_handlers[kind](route, msg)
            data = self.commands[kind].execute(self, route, msg)
            return None if data is None else reply_ok(msg.get("id"), data)
        except (BadRequest, RecordRefused) as exc:
            self.refused[kind] = self.refused.get(kind, 0) + 1
            return reply_error(msg.get("id"), str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request never takes the daemon down
            log.exception("ondemand-profd: error handling %s", kind)
            return reply_error(msg.get("id"), f"internal error: {type(exc).__name__}: {exc}")

    def send(self, route: bytes, body: bytes) -> None:
        self.outbox.append((route, body))

    def offload(self, route: bytes, msg: dict[str, Any], kind: str, compute: Callable[[], Any],
                finish: Callable[[Any], Any] | None = None) -> Any:
        """A request's slow part (reading and comparing summaries) run off the loop (issue 41, 3): `compute` on
        the worker thread (it reads files and the snapshot it closes over, never this service's state), then
        `finish(result)` here on the loop for the reply's data. Returns None (the reply follows once done, or not
        at all when the asker has disconnected meanwhile); BadRequest when the asker holds its share of the queue
        already. Without a worker (the service driven directly, in tests) both run now and the data is returned."""
        if self.worker is None:
            result = compute()
            return finish(result) if finish is not None else result
        rid, peer = msg.get("id"), msg.get("_peer")
        asker = f"uid {peer.uid}" if peer is not None else f"key {msg.get('_key') or '?'}"
        alive = connection_alive(*(msg.get("_conn") or (None, None)))

        def done(result: Any, error: BaseException | None) -> None:
            if not alive():
                log.info("ondemand-profd: %s of %s done; not replied: it has disconnected", kind, asker)
                return
            try:
                if error is not None:
                    raise error
                data = finish(result) if finish is not None else result
                reply = reply_ok(rid, data)
            except (BadRequest, RecordRefused) as exc:
                self.refused[kind] = self.refused.get(kind, 0) + 1
                reply = reply_error(rid, str(exc))
            except Exception as exc:  # noqa: BLE001 - one bad request never takes the daemon down
                log.error("ondemand-profd: error handling %s", kind, exc_info=exc)
                reply = reply_error(rid, f"internal error: {type(exc).__name__}: {exc}")
            self.send(route, reply)

        why = self.worker.submit(Job(asker, kind, compute, done, alive))
        if why:
            raise BadRequest(why)
        return None

    def collect_offloaded(self) -> None:
        """(The loop, when the worker says so.) Each job done: its finish, which queues its reply in `outbox`."""
        if self.worker is None:
            return
        for job, result, error in self.worker.take_done():
            try:
                job.finish(result, error)
            except Exception:  # noqa: BLE001
                log.exception("ondemand-profd: unexpected error finishing a %s request; carrying on", job.kind)

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` once what is in the outbox now has been sent, before the reply to the request being served."""
        self.after_send.append(fn)

    def daemon_info(self) -> dict[str, Any]:
        now = time.monotonic()
        if self.limits is None:
            self.limits = [note for note in (ptrace_note(),) if note]
        return {"pid": os.getpid(), "version": __version__, "host": self.host,
                "started_at": iso_time(self.started_wall), "uptime_s": round(now - self.started, 1),
                "runtime_dir": str(self.runtime_dir), "state_dir": str(self.state_dir),
                "captures": len(self.store.records), "running_captures": len(self.store.running()),
                # records that could not be written (a full state disk): none of them is a baseline yet
                **({"unsaved_records": len(self.store.unsaved),
                    "unsaved_error": next(iter(self.store.unsaved.values()))} if self.store.unsaved else {}),
                # what this daemon cannot do where it runs (no CAP_SYS_PTRACE: issue 41, 11)
                **({"limits": self.limits} if self.limits else {})}

    def find(self, capture_id: str) -> CaptureRecord:
        try:
            return self.store.find(capture_id)
        except KeyError as exc:
            raise BadRequest(exc.args[0]) from None

    # ------------------------------------------------------------------------------------------------------
    # From ranks

    def on_register(self, route: bytes, msg: dict[str, Any]) -> bytes:
        peer = msg.get("_peer")
        if peer is not None:
            peer = with_nspids(peer)
            check_registration(peer, msg, self.registry)
        msg, ns_pid = with_kernel_pid(peer, msg)
        # a connector in a pid namespace this daemon does not see (the kernel gives pid 0: a daemon in a pod of
        # its own without hostPID): its pid is the rank's word, a number of another namespace, never looked up
        unseen = peer is not None and peer.pid == 0
        try:
            # the job is (the kernel's uid, the job id): another user's job of the same id is another job
            info = self.registry.register(route, msg, time.monotonic(), time.time(),
                                          (lambda pid, thorough: False) if unseen else self.pid_check,
                                          uid=peer.uid if peer is not None else None)
        except RankConflict as exc:
            if exc.new:  # once per claimant, not at every retry
                log.warning("ondemand-profd: %s", exc)
            raise BadRequest(str(exc)) from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        info.ns_pid = ns_pid
        info.pid_seen = not unseen
        # the connector itself (check_registration): a process of this host, whatever host name it says
        info.kernel_pid = peer is not None and not unseen and info.pid == peer.pid
        # a container's files (or a process whose namespace /proc does not show us): reached through its root,
        # never on this host's `/` where a pod could name a node file as its own
        if info.kernel_pid and not own_mount_namespace(info.pid):
            info.fs_root = root_of(info.pid)
            info.host_trigger_dir = (host_path(info.pid, info.trigger_dir) or "") if info.trigger_dir else ""
            info.host_save_root = (host_path(info.pid, info.save_root) or "") if info.save_root else ""
        self.triage.registered(info)  # the process's identity (pid reuse), its native dump checked
        log.info("ondemand-profd: rank %d/%d of job %s (uid %s) registered (host %s, pid %d%s, step %d)", info.rank,
                 info.world_size, info.job, info.uid, info.host, info.pid,
                 f", {ns_pid} in its pid namespace" if ns_pid is not None else "", info.step)
        recent = msg.get("recent")
        for item in recent[:64] if isinstance(recent, list) else []:  # what happened while we could not hear it
            if isinstance(item, dict) and valid_id(item.get("capture_id")):
                self._apply_event(info, item["capture_id"], str(item.get("event")), item.get("info") or {})
        # events_batch: this daemon takes several events in one message (protocol.py "events")
        return encode("registered", daemon_pid=os.getpid(), heartbeat_s=HEARTBEAT_S, events_batch=MAX_BATCHED_EVENTS)

    def on_heartbeat(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        info = self.registry.heartbeat(route, msg, time.monotonic(), time.time())
        if info is None:
            return encode("register")  # we restarted, or expired this rank: tell it to register again
        if info.state == "recording" and info.windows:
            self._progress(info)
        return None

    def _progress(self, info: RankInfo) -> None:
        """While a window records, its part shows the step reached (the CLI prints "recording step k of N")."""
        running = info.windows[0] if info.windows else None
        record = self.store.records.get(running["capture_id"]) if running else None
        part = record.part(info.rank) if record is not None and of_job(record, info) else None
        if record is not None and part is not None and part["state"] == "recording" and \
                part.get("at_step") != info.step:
            part["at_step"] = info.step
            record.part_changed(info.rank)
            self.changed(record)

    def on_event(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        info = self.registry.by_route.get(route)
        if info is None:
            return encode("register")
        if self._believed(info, msg):
            self._apply_event(info, msg["capture_id"], msg["event"], msg["info"])
        return None

    def on_events(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        """Several events of one rank in one message; each item is checked as an "event" message is, and the
        message is refused whole (nothing applied) when one is not."""
        items = msg["events"]
        if not 0 < len(items) <= MAX_BATCHED_EVENTS:
            raise BadRequest(f"events: 1 to {MAX_BATCHED_EVENTS} events a message, got {len(items)}")
        for i, item in enumerate(items):
            if not (isinstance(item, dict) and valid_id(item.get("capture_id")) and
                    isinstance(item.get("event"), str) and isinstance(item.get("info"), dict)):
                raise BadRequest(f"events: item {i} is not {{capture_id, event, info}} with a valid capture id")
        info = self.registry.by_route.get(route)
        if info is None:
            return encode("register")
        if self._believed(info, msg):
            for item in items:
                self._apply_event(info, item["capture_id"], item["event"], item["info"])
        return None

    def _believed(self, info: RankInfo, msg: dict[str, Any]) -> bool:
        """An event comes from the rank's own uid (or this host's root): the kernel's word on the sender
        (`_peer`)."""
        peer = msg.get("_peer")
        if peer is not None and info.uid is not None and peer.uid != info.uid and not host_root(peer):
            log.warning("ondemand-profd: ignoring an event for rank %d of job %s from uid %d (the rank is uid %d)",
                        info.rank, info.job, peer.uid, info.uid)
            return False
        return True

    def _apply_event(self, info: RankInfo, capture_id: str, event: str, data: Any) -> None:
        if event == "opened":  # a window the rank opened itself (trigger file, signal): recorded
            self.rank_captures.on_opened(info, capture_id, data, time.time())
            return
        record = self.store.records.get(capture_id)
        if record is None or not of_job(record, info):
            return
        if event == "started":
            return  # the warmup step began: the part is "scheduled" until recording
        data = data if isinstance(data, dict) else {}
        if event == "scheduled":
            self._learn_delivery(info, record, data)
        # what a container's paths are on this host is the daemon's to say, never the rank's
        data = {k: v for k, v in data.items() if k not in ("pod_path", "pod_only", "save_root")}
        root = info.save_root
        if info.fs_root is not None and event == "done":
            data, root = self._pod_paths(info, data)
        elif not info.pid_seen and event == "done":  # its files are where this daemon cannot look (no pid)
            data = {**data, "pod_only": True}
        for key in ("path", "trace"):
            if data.get(key) is None:
                problem = None
            elif data.get("pod_only"):  # only the container sees it: checked as it sees it (host/podpath.py)
                problem = pod_output_problem(info, data[key])
            else:
                problem = output_path_problem(data[key], root, info.uid)
            if problem:
                log.warning("ondemand-profd: capture %s: rank %d of job %s reported %s, refused: %s", capture_id,
                            info.rank, info.job, event, problem)
                event, data = "failed", {"error": f"reported output refused: {problem}"}
                break
        if record.update(info.rank, event, data, time.time(), pid=info.pid):  # only from the process it was sent to
            self.changed(record)

    @staticmethod
    def _pod_paths(info: RankInfo, data: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """A rank in a container reports its paths as it sees them: where this host sees the same files (a
        hostPath, a volume), this host's paths are kept, with the rank's own name of the trace beside them
        (`pod_path`); where it does not, the rank's paths are kept and marked as the container's only. Returns the
        event's data and the save root to check its paths against."""
        out = dict(data)
        for key in ("path", "trace"):
            value = data.get(key)
            if not isinstance(value, str) or not value.startswith("/"):
                continue
            host = host_path(info.pid, value)
            if host is None:
                return {**data, "pod_only": True}, info.save_root
            out[key] = host
            if host != value and (key == "trace" or "pod_path" not in out):
                out["pod_path"] = value
        if "pod_path" not in out:
            return out, info.save_root
        return out, host_path(info.pid, info.save_root) or "(the save root, not on this host)"

    def _learn_delivery(self, info: RankInfo, record: CaptureRecord, data: dict[str, Any]) -> None:
        """Only from the process the window was sent to (a record read back from disk may hold anything)."""
        part = record.part(info.rank)
        plan = record.data.get("plan")
        planned: Any = plan.get("current_steps") if isinstance(plan, dict) else None  # (read back: any shape)
        if not isinstance(part, dict) or part.get("pid") != info.pid or not isinstance(planned, dict):
            return
        planned_step = planned.get(info.rank, planned.get(str(info.rank)))
        taken = data.get("current_step")
        if type(planned_step) is int and type(taken) is int and 0 <= taken - planned_step <= 10**6:
            self.delivery.of(info.key).learn(record.capture_id, planned_step, taken,
                                             info.step_time or info.observed_step_time)

    def on_bye(self, route: bytes, msg: dict[str, Any]) -> None:
        info = self.registry.remove(route)
        if info is not None:
            # why the rank goes, in its words (rank/daemon_link.py last_words): terminated by SIGTERM, exited
            # normally or after an exception, closed the profiler; and at which step
            said = msg.get("why")
            why = printable(said[:400] if isinstance(said, str) else "closed the profiler")
            step = msg.get("step") if bounded_int(msg.get("step"), -1, MAX_STEP) else None
            log.info("ondemand-profd: rank %d of job %s %s", info.rank, info.job, why)
            self._fail_parts(info, f"rank {info.rank} {why}", time.time(), step)
        return None

    # ------------------------------------------------------------------------------------------------------
    # Records and watches

    def open_capture(self, capture_id: str, job: str, request: dict[str, Any], plan: Plan, options: dict[str, Any],
                     targets: list[RankInfo], wall: float, *, kind: str, owner: int | str | None = None,
                     save: bool = True, baseline: bool | None = None,
                     compare_with: str | None = None) -> CaptureRecord:
        """The one place a capture is made on the daemon (ondemandctl capture, a rank's automatic, trigger-file
        or signal window): its record, a part per target rank, taken into the store (RecordRefused: it cannot
        be). `kind` says what it is, set here once (records.CAPTURE_KINDS: capture, auto, auto_baseline, file,
        signal); the marks `baseline` and `compare_with` go on the record when given; `save`: False when the caller
        writes it once the windows are sent."""
        if kind not in CAPTURE_KINDS:
            raise ValueError(f"a capture's kind is one of {', '.join(CAPTURE_KINDS)}, not {kind!r}")
        record = CaptureRecord.new(capture_id, job, request, plan, options,
                                   [{"rank": t.rank, "host": t.host, "pid": t.pid, "uid": t.uid} for t in targets],
                                   wall)
        record.data["kind"] = kind
        if baseline is not None:
            record.data["baseline"] = baseline
        if compare_with is not None:
            record.data["compare_with"] = compare_with
        self.store.add(record, owner=owner, save=save)
        return record

    def changed(self, record: CaptureRecord) -> None:
        self.store.mark(record)
        if record.status != "running":
            if record.data.get("compare_with") and "cause" not in record.data:
                self._conclude_automatic(record)
            if self.store.save(record):  # results are written at once; progress is batched (and a failed write
                self.store.dirty.discard(record.capture_id)  # is tried again at each flush)
        if self.watches:
            self._watch_due.add(record.capture_id)  # answered after this batch of messages: one reply, not 4096

    def _conclude_automatic(self, record: CaptureRecord) -> None:
        """An automatic capture, once done, against the baseline it was taken to be compared with (this host's
        ranks, from their summaries), computed once: the comparison is kept on the record (show and report AUTO
        print that one, bounded: records.stored_comparison) and its cause line logged and listed. Computed off the
        loop (issue 41, 3: a large job's comparison held every user's requests), on snapshots of both records;
        a baseline of another job or owner (an id taken over once the baseline's record was dropped) is not
        compared with (issue 41, 5)."""
        from .records import MAX_TEXT, stored_comparison
        from .summaries import compare_records, conclude_replies, snapshot

        if record.concluding:
            return
        record.concluding = True
        base = self.store.records.get(record.data["compare_with"])
        now_snap = snapshot(record, self.registry)
        base_snap = snapshot(base, self.registry) if base is not None else None
        mismatch = baseline_mismatch(record, base) if base is not None else None

        def compute() -> dict[str, Any]:
            if base_snap is None:
                raise ValueError(f"the baseline's record {record.data['compare_with']} was dropped")
            if mismatch:
                raise ValueError(mismatch)
            return dict(conclude_replies([(self.host, compare_records(now_snap, base_snap))]))

        def finish(comparison: Any, error: BaseException | None) -> None:
            record.concluding = False
            if "cause" in record.data or self.store.records.get(record.capture_id) is not record:
                return
            if error is None:
                cause = comparison["cause"]
                record.data["comparison"] = stored_comparison(comparison)
            else:  # a summary we cannot read: said, and the record still settles
                if not isinstance(error, (ValueError, OSError, KeyError)):
                    log.error("ondemand-profd: comparing automatic capture %s", record.capture_id, exc_info=error)
                cause = f"not compared: {error}"
                record.data["comparison"] = {"error": cause[:MAX_TEXT]}
            record.data["cause"] = cause[:MAX_TEXT]
            log.warning("ondemand-profd: automatic capture %s of job %s against baseline %s: %s",
                        record.capture_id, record.data["job"], record.data["compare_with"], record.data["cause"])
            self.changed(record)

        if self.worker is None:
            try:
                result, error = compute(), None
            except Exception as exc:  # noqa: BLE001
                result, error = None, exc
            finish(result, error)
            return
        owner = record.owner
        why = self.worker.submit(Job(f"uid {owner} (automatic)", "comparison", compute, finish, bounded=False))
        if why:
            finish(None, ValueError(why))

    def watch(self, route: bytes, rid: Any, record: CaptureRecord, timeout: float, since: int | None = None) -> None:
        self.watches.append((route, rid, record.capture_id, time.monotonic() + timeout, since))

    def answer_due_watches(self, now: float | None = None) -> None:
        """Reply to watches whose capture changed (or whose time ran out, given `now`)."""
        due, self._watch_due = self._watch_due, set()
        keep = []
        for watch in self.watches:
            route, rid, capture_id, deadline, since = watch
            if capture_id in due or (now is not None and now >= deadline):
                record = self.store.records.get(capture_id)
                self.send(route, reply_ok(rid, record.view(since)) if record is not None else reply_error(
                    rid, f"capture {capture_id} was dropped: the daemon keeps its newest {KEEP_RECORDS} records"))
            else:
                keep.append(watch)
        self.watches = keep

    @property
    def watches_due(self) -> bool:
        return bool(self._watch_due)

    def housekeeping(self, now: float) -> None:
        wall = time.time()
        # After a pause of our own (SIGSTOP, a VM or GC pause) the ranks' heartbeats wait in our queue: judge
        # their silence only once those are read, or every rank of this host "leaves" and captures fail
        paused = self._last_housekeeping is not None and now - self._last_housekeeping > HEARTBEAT_S
        self._last_housekeeping = now
        if now >= self._next_pid_check and not paused:  # every rank is looked at twice a second, not every tick
            self._next_pid_check = now + PID_CHECK_S
            # silence is counted up to when the transport last had every message read (`caught_up`): a daemon
            # seconds behind its queue (a starved CPU) otherwise expired ranks whose heartbeats were waiting in it,
            # and their registrations again put it further behind
            for info, reason in self.registry.expire(min(now, self.caught_up), self.pid_check):
                log.warning("ondemand-profd: rank %d of job %s left: %s", info.rank, info.job, reason)
                self.triage.forget_later(info, reason, now)  # a hung rank stays reachable for a native dump
                if reason.startswith("process "):  # it exited without a word (a bye says why it goes)
                    how = exit_status_text(info.pid) if info.pid_visible else ""
                    reason += f", {how}" if how else NO_WORD
                self._fail_parts(info, f"rank {info.rank} is gone: {reason}", wall)
            if self.delivery.jobs:  # job names are reused (port29500, pidN): a later run starts afresh
                self.delivery.keep_only(r.key for r in self.registry.by_route.values())
            if now - self.started > RANK_TIMEOUT_S + HEARTBEAT_S and self.store.running():
                self._fail_orphans(wall)
        self.store.flush()
        self.triage.tick(now)
        if self.watches:
            self.answer_due_watches(now)

    def _fail_parts(self, info: RankInfo, error: str, wall: float, step: int | None = None) -> None:
        """The rank's parts of running captures fail with `error` and where the rank was: at which step (its
        last word, else its last heartbeat), before or during its window."""
        for record in self.store.running():
            part = record.part(info.rank)
            if of_job(record, info) and part and part["pid"] == info.pid and record.fail_rank(
                    info.rank, error + window_position(record, part, step, info.step), wall):
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


# ----------------------------------------------------------------------------------------------------------
# Who may say what (the peer's uid and pid come from the kernel: host/listener.py)


def _proc_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


CAP_SYS_PTRACE = 19


def ptrace_note() -> str:
    """A line when this daemon runs as root without CAP_SYS_PTRACE (a container's default, or a DaemonSet that
    dropped it): the processes of other users, ranks in pods that do not run as root among them, cannot be looked
    into (/proc/PID/ns, /proc/PID/root, mountinfo), so where their files are and which namespaces they are in is
    not known; said in status rather than left to each capture's failure (issue 41, 11). '' otherwise."""
    if os.geteuid() != 0:
        return ""  # (a daemon of an ordinary user serves that user's ranks alone)
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            line = next((x for x in fh if x.startswith("CapEff:")), "")
        effective = int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return ""
    if effective >> CAP_SYS_PTRACE & 1:
        return ""
    return ("this daemon runs without CAP_SYS_PTRACE: it cannot look into processes of other users (ranks that do "
            "not run as root, in pods or not): their mount and pid namespaces are unknown and their files in "
            "containers (/proc/PID/root) unreachable, so their trigger directories and traces are taken as their "
            "containers' own and may read as missing; give it SYS_PTRACE (deploy/kubernetes/ondemand-profd.yaml)")


def host_root(peer: Any) -> bool:
    """Whether the kernel's word on a connection makes it this host's root, for every ownership rule: uid 0 in
    the daemon's own pid and mount namespaces. A root pod (issue 41, 1) is root of its pod only: its uid 0 is
    the node's, but it sees neither the node's processes nor its files, so it is taken as any other uid."""
    return peer is not None and peer.uid == 0 and peer.pid != 0 and in_our_namespaces(peer.pid)


def check_registration(peer: Any, msg: dict[str, Any], registry: Registry) -> None:
    """A rank registers only itself, seen by the kernel: the process that opened the connection, still there (a
    connection handed on, or inherited, by a process that then exited carries a pid anyone's process may hold
    now), named by its pid in the daemon's pid namespace or in one of its own (NSpid: a pod's pid 1), a process
    of the connecting uid. Root too: a root pod named a node process it cannot see and had the daemon signal it
    (issue 41, 1), and no rank needs another to register it. BadRequest says why not."""
    if peer.alive is False:
        raise BadRequest(f"register: the process that opened this connection (pid {peer.pid}) has exited; a "
                         "connection passed on to another process does not make it a rank")
    if peer.pid == 0:  # not in this daemon's pid namespace: its pid is never looked up nor signalled (on_register)
        return
    pid = msg["pid"]
    if pid != peer.pid and pid not in peer.nspids[1:]:
        raise BadRequest(f"register: pid {pid} is not the connecting process (pid {peer.pid}, uid {peer.uid}); "
                         "a rank registers itself")
    # the uid is checked even for the connector's own pid: the kernel's pid is the one at connect(), and a
    # process of another uid may hold that number now (pidfd-less kernels cannot tell)
    if _proc_uid(peer.pid) != peer.uid:
        raise BadRequest(f"register: pid {peer.pid} is not a process of uid {peer.uid}, which is connecting")
    # no check of the job id: a job is (uid, job id), so a job of another user with this id is another job (issue
    # 34 F3: whoever registered an id first used to own it, and the owner's own ranks were refused)


def with_nspids(peer: Any) -> Any:
    """`peer` with its pids in each pid namespace (NSpid) read from /proc where the kernel gave no pidfd to read
    them from (before Linux 6.5): a rank in a pod says its own pid (1), and the daemon must know it is the
    connector's. Only for a connector not known to have exited; unchanged where /proc cannot say."""
    if peer.alive is False or peer.nspids or not hasattr(peer, "_replace"):
        return peer
    try:
        with open(f"/proc/{peer.pid}/status", encoding="ascii", errors="replace") as fh:
            line = next((x for x in fh if x.startswith("NSpid:")), "")
        nspids = tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        return peer
    return peer._replace(nspids=nspids) if nspids and nspids[0] == peer.pid else peer


def window_position(record: Any, part: Part, step: int | None, heard: int | None = None) -> str:
    """ (at step 262, before the window [300, 302) began) / (at step 301, during the window [300, 302)): `step`
    as the rank said it at the end, else the step of its last heartbeat (`heard`)."""
    window = part.get("window") or record.data.get("window")
    at = f"at step {step}" if step is not None else f"last heard at step {heard}"
    step = heard if step is None else step
    if step is None or not (isinstance(window, list) and len(window) == 2 and type(window[0]) is int):
        return ""
    span = f"[{window[0]}, {window[1]})" if type(window[1]) is int else f"from step {window[0]}"
    if step < window[0]:
        return f" ({at}, before the window {span} began)"
    if type(window[1]) is int and step >= window[1]:
        return f" ({at}, after the window {span}, before its trace was written)"
    return f" ({at}, during the window {span})"


def baseline_mismatch(record: Any, base: Any) -> str | None:
    """Why `base` is not a baseline `record` may be compared with by id (None: it may): another job's, or another
    owner's (issue 41, 5: an id squatted by another user's capture was compared with as the job's baseline)."""
    if base.data["job"] != record.data["job"]:
        return (f"the baseline {base.capture_id} is a capture of job {base.data['job']}, not of job "
                f"{record.data['job']} ({record.capture_id}'s)")
    if base.owner != record.owner:
        return (f"the baseline {base.capture_id} is of a job of uid {base.owner}, not of uid {record.owner}, which "
                f"owns {record.capture_id}'s")
    return None


def of_job(record: Any, info: RankInfo) -> bool:
    """Whether a capture record is of this rank's job: its job id, and the uid its parts were sent to."""
    if record.data["job"] != info.job:
        return False
    part = record.part(info.rank)
    return part is None or part.get("uid") in (None, info.uid)


def with_kernel_pid(peer: Any, msg: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The registration as the daemon keeps it, and the rank's own view of its pid where that differs (a pod's
    pid 1; None otherwise): `pid` becomes the connector's in the daemon's pid namespace, what liveness,
    conflicts and signals act on (check_registration refused any other pid)."""
    claimed = msg["pid"]
    if peer is None or peer.pid == 0 or claimed == peer.pid:
        return msg, None  # (pid 0: the connector is in a pid namespace this daemon does not see)
    return {**msg, "pid": peer.pid}, claimed


def pod_output_problem(info: RankInfo, path: Any) -> str | None:
    """output_path_problem for a path only the rank's container sees: a plain absolute path under the save root
    it registered, that exists there and is the rank's uid's (looked at through /proc/PID/root, never read; where
    the daemon cannot see the rank's process at all, the path alone is checked)."""
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096 or "\0" in path or \
            holds_lone_surrogate(path) or os.path.normpath(path) != path:
        return "not a plain absolute path"
    if not info.save_root or not path.startswith(info.save_root.rstrip("/") + "/"):
        return f"{path} is not under the rank's save root {info.save_root}"
    if info.fs_root is None:  # a rank in a pid namespace this daemon does not see: its files cannot be looked at
        return None
    try:  # resolved within the container's root: its absolute links are its own, never this host's (issue 41, 8)
        st = stat_in_root(info.fs_root, path)
    except OSError as exc:
        return f"{path} (in its container): {exc.strerror or exc}"
    if info.uid is not None and st.st_uid != info.uid:
        return f"{path} is owned by uid {st.st_uid}, not by the rank's uid {info.uid}"
    return None


def output_path_problem(path: Any, save_root: str, uid: int | None) -> str | None:
    """Why a path a rank reports as its output is not believed: outside its save root, missing, or not owned
    by the rank's uid (a rank saying 'done path=/etc/shadow'). None when it is fine."""
    if not isinstance(path, str) or not path or len(path) > 4096 or "\0" in path or holds_lone_surrogate(path):
        return "not a path"  # (a lone surrogate: os.open cannot encode it; the decoder refuses them already)
    if not save_root:
        return f"{path} cannot be checked: the rank registered no save root"
    st: os.stat_result | None = None
    try:
        real, st = resolved(path)
    except OSError as exc:
        real, missing = os.path.realpath(path), exc.strerror
    try:
        root = resolved(save_root)[0]
    except OSError:
        root = os.path.realpath(save_root)
    if not real.startswith(root.rstrip("/") + "/"):
        return f"{path} is not under the rank's save root {save_root}"
    if st is None:
        return f"{path}: {missing}"
    if uid is not None and st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by the rank's uid {uid}"
    return None


def resolved(path: str) -> tuple[str, os.stat_result]:
    """`path` with every symbolic link resolved, and what it names: resolved by the kernel in one open (a done
    event is checked on every rank: os.path.realpath's stat per path component was a third of its cost).
    OSError when it does not exist; realpath where /proc is not mounted."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(path)
        return real, os.fstat(fd)
    finally:
        os.close(fd)
