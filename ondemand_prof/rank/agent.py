"""The agent thread of a rank: samples the step clock, watches the trigger file, writes status files, and
(when a daemon is running) talks to it. It never starts or stops the profiler itself: it hands windows to the
training thread through OnDemandProfiler.call_at_next_step().
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..core.files import iso_time, write_json_atomic
from ..core.ranks import selects
from ..core.safedir import check_dir
from .terminate import FINAL, TermFinalizer, settle_dead_ranks
from ..core.requests import RequestError, WindowDefaults, absolute_start, parse_request, resolve
from ..core.window import StepClock, Window
from .announce import say, startup_line
from .extension import AgentExtension
from .settle import SETTLE_POLL_S, JobAgreement, dist_rank
from .triggers import STATUS_DIR, TRIGGER_NAME, DirWatcher, Trigger, claim_decision, default_trigger_dir, \
    WriterTracker, ensure_dir, writer_holds, prepare_trigger_dir, prune_decisions, read_trigger, stat_key

if TYPE_CHECKING:
    from .daemon_link import DaemonLink

log = logging.getLogger("ondemand_prof.rank.agent")

SAMPLE_S = 0.005  # step-clock resolution; also the agent's idle wake-up period
SETTLE_S = 0.02  # let a writer finish ("echo > capture" truncates, then writes) before reading
# An empty file is either "touch capture" or a writer caught between truncating and writing: a read lease tells
# them apart (triggers.writer_holds). Where leases cannot answer, it is taken once it stayed empty, with no
# writer seen by inotify, for EMPTY_SETTLE_S.
EMPTY_SETTLE_S = 0.25
WRITER_STALL_S = 10.0  # a trigger a writer holds open longer than this is taken as it is
RECHECK_S = 0.5  # stat the trigger even without an inotify event, in case one was missed
INOTIFY_SPREAD_S = 0.05  # how much later than the first rank another rank may see an inotify event
LEAD_MARGIN_S = 0.05  # scheduling slack (a loaded host delays agent threads)
ANNOUNCE_WAIT_S = 2.0  # the start-up line waits this long at most for the daemon's answer
# Rejected and failed triggers are logged, but a script rewriting the trigger in a loop must not flood the
# training job's log (or fill a pipe nobody reads): at most LOG_BURST lines per LOG_PERIOD_S, the rest counted.
LOG_BURST = 5
LOG_PERIOD_S = 60.0


class LogBudget:
    """At most `burst` lines per `period_s`. take() says whether to log now and how many lines were held back
    since the last one logged, so that the next line (or a final summary) can say so."""

    def __init__(self, burst: int = LOG_BURST, period_s: float = LOG_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.period_s, self._clock = burst, period_s, clock
        self._began = -math.inf
        self._used = 0
        self.held = 0

    def take(self) -> tuple[bool, int]:
        now = self._clock()
        if now - self._began >= self.period_s:
            self._began, self._used = now, 0
        if self._used >= self.burst:
            self.held += 1
            return False, 0
        self._used += 1
        held, self.held = self.held, 0
        return True, held

    def due(self) -> bool:
        """Lines were held back and their period is over: time to say how many (the flood may have stopped)."""
        return self.held > 0 and self._clock() - self._began >= self.period_s


class Agent:
    def __init__(self, prof: Any) -> None:
        """`prof`: the OnDemandProfiler this agent serves (rank/hook.py creates the agent)."""
        self.prof = prof
        self.config = prof.config
        self.clock = StepClock()
        wanted = Path(self.config.trigger_dir).expanduser() if self.config.trigger_dir else \
            default_trigger_dir(prof.job_id)
        self._status_lock = threading.RLock()
        self._empty_since: dict[str, float] = {}  # empty trigger versions -> when first seen
        self.terminator = TermFinalizer(self.finalize)
        self._event = threading.Event()
        self._stopping = threading.Event()
        self._status_q: collections.deque[tuple[dict[str, Any], str, dict[str, Any]]] = collections.deque()
        self._recent: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._log_budget = LogBudget()
        self.tracker: WriterTracker | None = None
        self._watch(wanted)
        self._agreement = JobAgreement(self.config.job_id)
        self._told = prof.identity()  # who we said we are (start-up line, registration) before settling
        self._settled = False
        self._settle_at = 0.0
        self._announce_at: float | None = None  # when the start-up line is due; None once said
        self._moved = False  # the job settled after the start-up line: the next line says where it is now
        self._thread = threading.Thread(target=self._run, name="ondemand-prof-agent", daemon=True)
        self.extensions: list[AgentExtension] = []  # each polled every loop, closed at stop()
        self.link: DaemonLink | None = None  # the extension that talks to ondemand-profd (config.daemon)
        from .triage import Triage

        self.triage = Triage(prof, self.status_dir)  # stacks, memory, flight recorder on request
        self.triage.install()
        self.extensions.append(self.triage)
        if self.config.daemon:
            self._link_daemon()

    # ------------------------------------------------------------------------------------------------------

    def _watch(self, wanted: Path) -> None:
        """Watch this trigger directory (at start, and again when the job settles on another one): checked as
        ours (or a private fallback), old status settled, writers tracked where inotify works."""
        trigger_dir = prepare_trigger_dir(wanted, self.prof.job_id)
        status_dir = trigger_dir / STATUS_DIR
        ensure_dir(status_dir)
        try:
            settle_dead_ranks(status_dir)  # what ranks killed earlier left "recording" now reads failed
        except OSError as exc:
            log.debug("ondemand_prof: cannot settle old status files: %s", exc)
        watcher = DirWatcher(trigger_dir, self._event, self.config.trigger_poll_s)
        old, old_tracker = getattr(self, "watcher", None), self.tracker
        self.trigger_dir, self.status_dir, self.trigger_path = trigger_dir, status_dir, trigger_dir / TRIGGER_NAME
        existing = read_trigger(self.trigger_path)
        self._last_version = existing.version if existing else None  # written before we started: not replayed
        self.watcher = watcher
        self.tracker = None
        if watcher.mode == "inotify":
            try:
                self.tracker = WriterTracker(trigger_dir)
            except (OSError, AttributeError) as exc:
                log.debug("ondemand_prof: no exact writer tracking (%s); using the watcher's events", exc)
        if getattr(self, "triage", None) is not None:
            self.triage.status_dir = status_dir
        if old is not None:
            old.stop()
        if old_tracker is not None:
            old_tracker.close()

    def start(self) -> None:
        self.terminator.install()
        # the start-up line waits for the daemon's answer only where a daemon's socket exists
        wait = ANNOUNCE_WAIT_S if any(ext.daemon_present() for ext in self.extensions) else 0.0
        self._announce_at = time.monotonic() + wait
        self._thread.start()
        log.debug("ondemand_prof: trigger %s, status in %s/ [%s]", self.trigger_path, self.status_dir,
                  self.watcher.mode)

    def stop(self) -> None:
        self._stopping.set()
        self._event.set()
        self._thread.join(timeout=5)
        self.watcher.stop()
        if self.tracker is not None:
            self.tracker.close()
        self.terminator.uninstall()
        if self._thread.is_alive():
            # status files and the daemon socket belong to the agent thread: never touch them beside it
            log.warning("ondemand_prof: the agent thread did not stop within 5 s; its last status updates are "
                        "not written")
            return
        self._flush_status()
        self._log_held_back()
        if self._announce_at is not None:  # a run shorter than the wait for the daemon: still say where things were
            self._announce()
        for ext in self.extensions:
            try:
                ext.close()
            except Exception:  # noqa: BLE001
                log.debug("extension close failed", exc_info=True)

    def wake(self) -> None:
        self._event.set()

    # ------------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        check_at = 0.0
        while not self._stopping.is_set():
            fired = self._event.wait(SAMPLE_S)
            now = time.monotonic()
            poll = self.watcher.poll_s if self.watcher.mode == "poll" else RECHECK_S
            try:
                self._sample_clock()
                if not self._settled and now >= self._settle_at:
                    self._settle_at = now + SETTLE_POLL_S
                    self._settle()
                if self._announce_at is not None and (now >= self._announce_at or self._daemon_answered()):
                    self._announce()
                if fired:
                    self._event.clear()
                    # inotify says when a writer is done (its close): look at once; polling cannot, so settle
                    check_at = min(check_at, now if self.watcher.mode == "inotify" else now + SETTLE_S)
                if now >= check_at:
                    check_at = now + poll
                    retry = self._check_trigger()
                    if retry:
                        check_at = now + SETTLE_S
                self.terminator.poll()
                for ext in self.extensions:
                    ext.poll(now)
                self._flush_status()
                if self._log_budget.due():
                    self._log_held_back()
            except Exception:  # noqa: BLE001 - the agent must outlive any one bad event
                log.exception("ondemand_prof: agent error")
                time.sleep(0.1)

    def _sample_clock(self) -> None:
        self.clock.record(self.prof.current_step, time.time())

    def step_time(self) -> float | None:
        return self.clock.mean_step_time()

    def step_began(self) -> tuple[int, float] | None:
        """The newest (step, wall time it began) sample."""
        try:
            return self.clock.steps[-1], self.clock.times[-1]
        except IndexError:
            return None

    # ------------------------------------------------------------------------------------------------------
    # Identity settling and the start-up line

    def _settle(self) -> None:
        """Once torch.distributed is up: agree the job, move to its trigger directory, register again."""
        rank = dist_rank()
        if rank is None:
            return
        job = self._agreement.poll(rank)
        if job is None:
            return  # rank 0's id is not in the store yet: ask again at the next poll
        before = self._told
        after = self.prof.settle_identity(job)
        self._settled = True
        if (after.rank, after.world_size, after.job_id) == (before.rank, before.world_size, before.job_id):
            return
        log.info("ondemand_prof: torch.distributed is up: rank %d of %d, job %s (was rank %d of %d, job %s)",
                 after.rank, after.world_size, after.job_id, before.rank, before.world_size, before.job_id)
        if not self.config.trigger_dir and after.job_id != before.job_id:
            self._watch(default_trigger_dir(after.job_id))
        for ext in self.extensions:
            ext.reregister()
        if self._announce_at is None:  # the user was told the old place: tell the new one
            self._announce_at = time.monotonic() + ANNOUNCE_WAIT_S
            self._moved = True

    def _daemon_answered(self) -> bool:
        return any(ext.acknowledged for ext in self.extensions)

    def _announce(self) -> None:
        self._announce_at = None
        link = self.link
        daemon = link.url if link is not None and link.acknowledged else None
        say(log, self.config.quiet, startup_line(self.prof.identity(), self.trigger_path,
                                                 Path(self.config.save_path), daemon,
                                                 link.url if link is not None else None, moved=self._moved,
                                                 default_ranks=self.config.ondemand_ranks))

    def _link_daemon(self) -> None:
        try:
            from .daemon_link import DaemonLink

            self.link = DaemonLink(self)
            self.extensions.append(self.link)
        except Exception as exc:  # noqa: BLE001 - no daemon link is not a reason to stop training
            log.warning("ondemand_prof: not connecting to ondemand-profd: %s", exc)

    # ------------------------------------------------------------------------------------------------------
    # File trigger

    def _check_trigger(self) -> bool:
        """Act on a new version of the trigger file; True when it should be looked at again shortly."""
        before = stat_key(self.trigger_path)
        if before is None:
            return False
        trig = read_trigger(self.trigger_path)
        if trig is None or trig.version == self._last_version:
            return False
        if not trig.consistent:
            return True  # torn read: a writer was at work
        done = self._writer_done(trig)
        if stat_key(self.trigger_path) != before:
            return True  # being written right now (checked after the writer state: nothing slips in between)
        if not done:
            return True  # a writer is between truncating and writing, or its events are still on the way
        self._last_version = trig.version
        self._handle_trigger(trig)
        return False

    def _writer_done(self, trig: Trigger) -> bool:
        """Whether whoever wrote this version of the trigger is done with it.

        An empty file is a touch, or a writer caught between truncating and writing (however long it stalls):
        the kernel tells them apart (writer_holds: a read lease is refused while anyone holds the file open for
        writing). Otherwise, with inotify: no writer holds the file (a truncate or write not yet followed by its
        close), read from our own inotify queue after reading the file (WriterTracker: exact, whatever the load).
        Where the lease cannot answer, an empty file counts once it stayed empty, no writer seen, EMPTY_SETTLE_S
        (inotify alone does not always report a truncate: the kernel can skip the event for a file whose
        directory was watched anew).
        """
        age = time.time() - trig.mtime
        if not trig.regular or age < 0:
            return True  # nothing a writer fills, or a clock skewed into the future
        empty = trig.data == {}
        if empty:
            holds = writer_holds(self.trigger_path)
            if holds is not None:
                return not holds
        if age >= WRITER_STALL_S:
            return True  # a writer that never finishes: take what it wrote
        if self.tracker is not None:
            if self.tracker.writer_open():
                return False  # truncated or written, not yet closed (queued before our read: exact)
        elif self.watcher.mode == "inotify" and (self.watcher.writer_open or self.watcher.last_event_at < trig.mtime):
            return False
        if not empty:
            return True
        now = time.monotonic()
        first = self._empty_since.setdefault(trig.version, now)
        if len(self._empty_since) > 64:
            self._empty_since = {trig.version: first}
        return now - first >= EMPTY_SETTLE_S

    def _handle_trigger(self, trig: Trigger) -> None:
        prof = self.prof
        ident = prof.identity()
        now_step = prof.current_step
        latency = max(0.0, time.time() - trig.mtime)
        base = {"trigger": trig.version, "rank": ident.rank, "host": ident.host, "pid": ident.pid,
                "written_at": iso_time(trig.mtime), "seen_at": iso_time(), "seen_at_step": now_step,
                "detect_latency_ms": round(latency * 1000, 1), "watch": self.watcher.mode}
        listener = self.status_listener(base)
        if trig.error:
            listener("rejected", {"error": trig.error})
            return
        try:
            request = parse_request(trig.data)
        except RequestError as exc:
            listener("rejected", {"error": str(exc), "request": trig.data})
            return
        base["request"] = request.as_dict()
        if request.action != "capture":
            self._trigger_triage(request, trig, ident.rank, listener)
            return
        anchor = self.clock.step_at(trig.mtime)
        if anchor is None or trig.mtime > time.time() + 1.0:
            anchor = now_step  # written before our oldest sample, or a clock skewed into the future
        start = absolute_start(request, anchor)
        if request.start_step is None:
            start = max(start, now_step + self.lead_steps())
        # the first rank to see this version decides the window for all (ranks see the file at different steps)
        decision = claim_decision(self.status_dir, trig.version, {
            "start_step": start, "anchor_step": anchor, "decided_by_rank": ident.rank, "decided_at": iso_time()})
        prune_decisions(self.status_dir)
        ranks = request.ranks if request.ranks is not None else self.config.ondemand_ranks
        if not selects(ranks, ident.rank):
            listener("rejected", {"error": f"rank {ident.rank} not selected (ranks {list(ranks)})"})
            return
        window = resolve(request, WindowDefaults.from_config(self.config), decision["start_step"], source="file",
                         capture_id=f"file-{trig.version}",
                         extra={"anchor_step": decision["anchor_step"], "decided_by_rank": decision["decided_by_rank"]})
        if window.note:
            base["note"] = window.note
        self.schedule(window, listener)

    def _trigger_triage(self, request: Any, trig: Trigger, rank: int,
                        listener: Callable[[str, dict[str, Any]], None]) -> None:
        """{"action": "stacks" | "memory" | "flight_recorder"} in the trigger file: the answer goes to the status
        file (stacks: capture.status/stacks-rank{R}.txt beside it)."""
        ranks = request.ranks if request.ranks is not None else (-1,)
        if not selects(ranks, rank):
            listener("rejected", {"error": f"rank {rank} not selected (ranks {list(ranks)})"})
            return

        def reply(result: dict[str, Any]) -> None:
            if request.action == "stacks" and result.get("ok"):
                from .triage import stacks_text, write_private

                path = self.status_dir / f"stacks-rank{rank}.txt"
                head = f"# rank {rank}, pid {os.getpid()}, step {result.get('current_step')}, collected in-process"
                try:
                    write_private(path, f"{head} ({result['method']})\n\n{stacks_text(result['threads'])}".encode())
                    result = {"ok": True, "method": result["method"], "path": str(path),
                              "threads": len(result["threads"])}
                except OSError as exc:
                    result = {"ok": False, "error": f"cannot write {path}: {exc.strerror}"}
            result.pop("entries", None)  # the flight recorder's digest: the dump file has it all
            listener("done" if result.get("ok") else "failed", result)

        args = {"steps": request.steps} if request.action == "memory" and request.steps else {}
        self.triage.request(request.action, args, reply, f"file-{trig.version}")

    def status_listener(self, base: dict[str, Any]) -> Callable[[str, dict[str, Any]], None]:
        """A window listener that records what happens to a trigger in this rank's status file."""
        return lambda event, info: self._status(base, event, info)

    def lead_steps(self) -> int:
        """How far ahead the first rank to see a trigger schedules it, so that later ranks are in time."""
        spread = self.watcher.poll_s if self.watcher.mode == "poll" else INOTIFY_SPREAD_S
        step_time = self.step_time()
        if not step_time:
            return 1
        # one more step than the arithmetic asks for: step times jitter, and a late rank costs a whole step
        return max(1, math.ceil((spread + SETTLE_S + LEAD_MARGIN_S) / step_time) + 1)

    def schedule(self, window: Window, listener: Callable[[str, dict[str, Any]], None]) -> None:
        """Hand a window to the training thread; the listener hears 'scheduled' or 'rejected', then progress."""

        def submit(step: int) -> None:
            ok, reason = self.prof.submit(window, listener)
            if ok:
                listener("scheduled", {"capture_id": window.capture_id, "window": [window.start, window.end],
                                       "current_step": step})
            else:
                listener("rejected", {"capture_id": window.capture_id, "window": [window.start, window.end],
                                      "error": reason})

        self.prof.call_at_next_step(submit)

    # ------------------------------------------------------------------------------------------------------
    # Status files (written here, on the agent thread, never on the training thread)

    def _status(self, base: dict[str, Any], event: str, info: dict[str, Any]) -> None:
        self._status_q.append((base, event, info))
        if threading.current_thread() is not self._thread:
            self._event.set()

    def finalize(self, reason: str) -> None:
        """Any trigger of ours not in a final state fails with `reason` (the process is being terminated)."""
        for entry in list(self._recent.values()):
            if entry.get("state") not in FINAL:
                self._status_q.append((entry, "failed", {"error": reason}))
        self._flush_status()
        self._log_held_back()

    def _flush_status(self) -> None:
        # Lines are logged after the lock is released: a log write can block (stderr a full pipe), and the
        # SIGTERM handler on the main thread takes this lock to settle the status files.
        with self._status_lock:  # the agent thread, and a SIGTERM handler on the main thread
            lines = self._flush_status_locked()
        for line in lines:
            log.warning("%s", line)

    def _trigger_end_line(self, base: dict[str, Any], event: str, error: Any) -> str | None:
        say, held = self._log_budget.take()
        if not say:
            return None
        more = f" ({held} more rejected or failed since, not logged; see {self.status_dir}/rank{base['rank']}.json)" \
            if held else ""
        return f"ondemand_prof: trigger {base['trigger']} {event} on rank {base['rank']}: {error}{more}"

    def _log_held_back(self) -> None:
        with self._status_lock:  # the agent thread, stop() and finalize()
            held, self._log_budget.held = self._log_budget.held, 0
        if held:
            log.warning("ondemand_prof: %d more trigger(s) rejected or failed, not logged (at most %d lines per "
                        "%.0f s); the latest are in %s", held, LOG_BURST, LOG_PERIOD_S, self.status_dir)

    def _flush_status_locked(self) -> list[str]:
        """rank{R}.json: this rank's recent triggers, newest first, each with its state and history, so a
        trigger's late progress ("done") never hides the answer to a newer one ("rejected"). Returns the
        warning lines to log (once the lock is released)."""
        lines: list[str] = []
        if not self._status_q:
            return lines
        rank = None
        while self._status_q:
            base, event, info = self._status_q.popleft()
            rank = base["rank"]
            entry = self._recent.get(base["trigger"])
            if entry is None:
                entry = self._recent[base["trigger"]] = {**base, "history": []}
                while len(self._recent) > 8:
                    self._recent.popitem(last=False)
            entry["history"].append({"state": event, "at": iso_time(),
                                     **{k: v for k, v in info.items() if k != "capture_id"}})
            entry.update({k: v for k, v in info.items() if k != "capture_id"}, state=event, updated_at=iso_time())
            if event in ("rejected", "failed"):
                line = self._trigger_end_line(base, event, info.get("error"))
                if line:
                    lines.append(line)
        triggers = sorted(self._recent.values(), key=lambda e: e.get("written_at") or e.get("seen_at", ""),
                          reverse=True)
        ident = self.prof.identity()
        status = {"rank": rank, "host": ident.host, "pid": ident.pid, "latest": triggers[0], "triggers": triggers}
        try:
            check_dir(self.status_dir)  # at every use: refused (one warning) if someone swapped it
            write_json_atomic(self.status_dir / f"rank{rank}.json", status)
        except OSError as exc:
            lines.append(f"ondemand_prof: cannot write trigger status in {self.status_dir}: {exc}")
        return lines

