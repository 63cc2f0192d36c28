"""The trigger file: `touch capture` (or a JSON request written into it) in the rank's trigger directory opens
a window, or asks for stacks, memory or the flight recorder. An agent extension: it watches the directory
(inotify, or polling where inotify cannot), reads each new version of the file once its writer is done with it,
lets the first rank to see it decide the window for all, and records what happened in capture.status/.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..core.files import iso_time
from ..core.ids import capture_id as make_capture_id
from ..core.ranks import selects
from ..core.requests import RequestError, WindowDefaults, absolute_start, parse_request, resolve
from .extension import AgentLike, Extension
from .terminate import settle_dead_ranks
from .trigger_status import TriggerStatus
from .triggers import STATUS_DIR, TRIGGER_NAME, DirWatcher, Trigger, WriterTracker, claim_decision, ensure_dir, \
    prepare_trigger_dir, prune_decisions, read_trigger, stat_key, writer_holds

log = logging.getLogger("ondemand_prof.rank.agent")

SETTLE_S = 0.02  # let a writer finish ("echo > capture" truncates, then writes) before reading
# An empty file is either "touch capture" or a writer caught between truncating and writing: a read lease tells
# them apart (triggers.writer_holds). Where leases cannot answer, it is taken once it stayed empty, with no
# writer seen by inotify, for EMPTY_SETTLE_S.
EMPTY_SETTLE_S = 0.25
WRITER_STALL_S = 10.0  # a trigger a writer holds open longer than this is taken as it is
RECHECK_S = 0.5  # stat the trigger even without an inotify event, in case one was missed
INOTIFY_SPREAD_S = 0.05  # how much later than the first rank another rank may see an inotify event
LEAD_MARGIN_S = 0.05  # scheduling slack (a loaded host delays agent threads)


class FileTrigger(Extension):
    """The trigger file of one rank, polled on the agent thread. `status` writes capture.status/rank{R}.json
    (also for signals); trigger_dir, trigger_path and status_dir say where things are (the start-up line, the
    daemon registration)."""

    def __init__(self, agent: AgentLike, wanted: Path, thread: threading.Thread) -> None:
        self.agent = agent
        self.prof = agent.prof
        self.config = agent.config
        self._fired = threading.Event()  # the watcher saw the trigger change
        self._check_at = 0.0
        self._empty_since: dict[str, float] = {}  # empty trigger versions -> when first seen
        self._claim_fd: int | None = None  # our lock on capture.status/.rank{R}.lock (see _claim)
        self._claimed: tuple[Path, int] | None = None  # (the directory wanted, the rank claimed in it)
        self._open(wanted)
        self.status = TriggerStatus(self.prof, self.status_dir, thread, agent.wake)

    def _changed(self) -> None:
        """The watcher's callback (a watchdog thread)."""
        self._fired.set()
        self.agent.wake()

    def _open(self, wanted: Path) -> None:
        """Watch this trigger directory: checked as ours (or a private fallback), old status settled, writers
        tracked where inotify works; a trigger written before we came is not replayed."""
        trigger_dir = self._claim(wanted, prepare_trigger_dir(wanted, self.prof.job_id))
        status_dir = trigger_dir / STATUS_DIR
        ensure_dir(status_dir)
        try:
            settle_dead_ranks(status_dir)  # what ranks killed earlier left "recording" now reads failed
        except OSError as exc:
            log.debug("ondemand_prof: cannot settle old status files: %s", exc)
        self.watcher = DirWatcher(trigger_dir, self._changed, self.config.trigger_poll_s)
        self.trigger_dir, self.status_dir, self.trigger_path = trigger_dir, status_dir, trigger_dir / TRIGGER_NAME
        existing = read_trigger(self.trigger_path)
        self._last_version = existing.version if existing else None
        self.tracker: WriterTracker | None = None
        if self.watcher.mode == "inotify":
            try:
                self.tracker = WriterTracker(trigger_dir)
            except (OSError, AttributeError) as exc:
                log.debug("ondemand_prof: no exact writer tracking (%s); using the watcher's events", exc)

    def _claim(self, wanted: Path, trigger_dir: Path, again: bool = True) -> Path:
        """One live process per rank of a job in a trigger directory: a second one (two jobs given one job id,
        where they share /tmp) would take the other's triggers, into the same capture folder. The claim is an
        flock on capture.status/.rank{R}.lock, held for the process's life; where another live process holds it,
        this one watches a directory of its own ({dir}.pid{pid}) and says why. Returns the directory to use."""
        import fcntl

        rank = self.prof.identity().rank
        lock = trigger_dir / STATUS_DIR / f".rank{rank}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("ondemand_prof: cannot claim rank %d in %s: %s", rank, trigger_dir, exc)
            return trigger_dir
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            own = trigger_dir.with_name(f"{trigger_dir.name}.pid{os.getpid()}")
            log.warning("ondemand_prof: another live process is rank %d of job %s in %s (two jobs with one job id?): "
                        "this one watches %s instead; give each job its own: --profile-job-id NAME or "
                        "ONDEMAND_PROF_JOB_ID=NAME", rank, self.prof.job_id, trigger_dir, own)
            return self._claim(wanted, prepare_trigger_dir(own, self.prof.job_id), False) if again else trigger_dir
        if self._claim_fd is not None:
            os.close(self._claim_fd)  # the directory (or rank) we held before
        self._claim_fd, self._claimed = fd, (wanted, rank)
        return trigger_dir

    def reregister(self) -> None:
        """The identity settled: a rank that guessed its number before (rank 0 until the group is up) claims
        its real one, in the directory it wanted."""
        if self._claimed is not None and self._claimed[1] != self.prof.identity().rank:
            self.watch(self._claimed[0])

    def watch(self, wanted: Path) -> None:
        """The job settled on another trigger directory: watch that one instead."""
        old_watcher, old_tracker = self.watcher, self.tracker
        self._open(wanted)
        self.status.status_dir = self.status_dir
        old_watcher.stop()
        if old_tracker is not None:
            old_tracker.close()

    def poll(self, now: float) -> None:
        """Check the trigger when the watcher saw it change, and every RECHECK_S (or the poll period) anyway;
        then write what happened to this rank's triggers."""
        self.watcher.name_late_threads()
        if self._fired.is_set():
            self._fired.clear()
            # inotify says when a writer is done (its close): look at once; polling cannot, so settle
            self._check_at = min(self._check_at, now if self.watcher.mode == "inotify" else now + SETTLE_S)
        if now >= self._check_at:
            self._check_at = now + (self.watcher.poll_s if self.watcher.mode == "poll" else RECHECK_S)
            if self._check_trigger():
                self._check_at = now + SETTLE_S
        self.status.flush()

    def stop_watching(self) -> None:
        self.watcher.stop()
        if self.tracker is not None:
            self.tracker.close()

    def close(self) -> None:
        """The agent stopped: write what is left (the watcher was stopped before)."""
        self.status.flush()
        self.status.log_held_back()

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
        listener = self.status.listener(base)
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
        anchor = self.agent.clock.step_at(trig.mtime)
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
                         capture_id=make_capture_id("file", trig.version),
                         extra={"anchor_step": decision["anchor_step"], "decided_by_rank": decision["decided_by_rank"]})
        if window.note:
            base["note"] = window.note
        link = self.agent.link
        self.agent.schedule(window, listener if link is None else link.opened(window, listener))

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
                from .triage import stacks_text

                path = self.status_dir / f"stacks-rank{rank}.txt"
                head = f"# rank {rank}, pid {os.getpid()}, step {result.get('current_step')}, collected in-process"
                try:  # relative to the status directory, checked now (trigger_status.py)
                    self.status.write_beside(path.name, f"{head} ({result['method']})\n\n"
                                             f"{stacks_text(result['threads'])}".encode())
                    result = {"ok": True, "method": result["method"], "path": str(path),
                              "threads": len(result["threads"])}
                except OSError as exc:
                    result = {"ok": False, "error": f"cannot write {path}: {exc.strerror or exc}"}
            result.pop("entries", None)  # the flight recorder's digest: the dump file has it all
            listener("done" if result.get("ok") else "failed", result)

        args = {"steps": request.steps} if request.action == "memory" and request.steps else {}
        self.agent.triage.request(request.action, args, reply, make_capture_id("file", trig.version))

    def lead_steps(self) -> int:
        """How far ahead the first rank to see a trigger schedules it, so that later ranks are in time."""
        spread = self.watcher.poll_s if self.watcher.mode == "poll" else INOTIFY_SPREAD_S
        step_time = self.agent.step_time()
        if not step_time:
            return 1
        # one more step than the arithmetic asks for: step times jitter, and a late rank costs a whole step
        return max(1, math.ceil((spread + SETTLE_S + LEAD_MARGIN_S) / step_time) + 1)

