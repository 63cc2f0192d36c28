"""The agent thread of a rank: samples the step clock, settles the rank's identity once torch.distributed is up,
says the start-up line, and polls its extensions (rank/extension.py): the trigger file (rank/file_trigger.py),
triage (rank/triage.py), the daemon link (rank/daemon_link.py), automatic captures (rank/autocapture.py). It never
starts or stops the profiler itself: it hands windows to the training thread through
OnDemandProfiler.call_at_next_step().
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..core.window import StepClock, Window
from .announce import registered_line, say, startup_line
from .extension import AgentExtension
from .file_trigger import FileTrigger
from .settle import SETTLE_POLL_S, JobAgreement, dist_rank
from .terminate import TermFinalizer
from .triggers import default_trigger_dir

if TYPE_CHECKING:
    from .daemon_link import DaemonLink

log = logging.getLogger("ondemand_prof.rank.agent")

SAMPLE_S = 0.005  # step-clock resolution; also the agent's idle wake-up period
ANNOUNCE_WAIT_S = 2.0  # the start-up line waits this long at most for the daemon's answer


# torch.distributed's calls that wait for every rank of a group to arrive (where a job whose peer never comes hangs)
RENDEZVOUS_CALLS = frozenset({"init_process_group", "new_group", "new_subgroups", "init_device_mesh",
                              "_store_based_barrier"})


def in_rendezvous(thread_ident: int) -> bool:
    """Whether that thread is inside one of RENDEZVOUS_CALLS of torch.distributed now (its Python stack)."""
    frame = sys._current_frames().get(thread_ident)
    depth = 0
    while frame is not None and depth < 256:
        code = frame.f_code
        if code.co_name in RENDEZVOUS_CALLS and f"torch{os.sep}distributed" in code.co_filename:
            return True
        frame, depth = frame.f_back, depth + 1
    return False


class Agent:
    def __init__(self, prof: Any) -> None:
        """`prof`: the OnDemandProfiler this agent serves (rank/hook.py creates the agent)."""
        self.prof = prof
        self.config = prof.config
        self.clock = StepClock()
        wanted = Path(self.config.trigger_dir).expanduser() if self.config.trigger_dir else \
            default_trigger_dir(prof.job_id)
        self._event = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ondemand-prof-agent", daemon=True)
        self.files = FileTrigger(self, wanted, self._thread)  # the trigger file, and the status files
        self.terminator = TermFinalizer(self.ending)
        self.closing_why = "closed the profiler"  # the bye's words at a close() (rank/hook.py says why)
        self._agreement = JobAgreement(self.config.job_id)
        self._told = prof.identity()  # who we said we are (start-up line, registration) before settling
        self._settled = False
        self._settle_at = 0.0
        self._announce_at: float | None = None  # when the start-up line is due; None once said
        self._moved = False  # the job settled after the start-up line: the next line says where it is now
        self._registration_owed = False  # the start-up line said the daemon had not answered: say when it does
        # wall time the training thread was first seen in init_process_group (or new_group, init_device_mesh)
        # before its first step; None when it is not there (heartbeats: state "rendezvous", since when)
        self.rendezvous_since: float | None = None
        self._pid = os.getpid()  # a forked child (a DataLoader worker) has this agent's object, not its thread
        self._first_step = prof.current_step  # the rendezvous is watched until this step has ended
        self._rendezvous_at = 0.0
        from .triage import Triage

        self.triage = Triage(prof, self.files.status_dir)  # stacks, memory, flight recorder on request
        self.triage.install()
        # each polled every loop (in this order), closed at stop(); the file trigger first: its close writes
        # the last status
        self.extensions: list[AgentExtension] = [self.files, self.triage]
        self.link: DaemonLink | None = None  # the extension that talks to ondemand-profd (config.daemon)
        if self.config.daemon:
            self._link_daemon()

    # ------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.terminator.install()
        # the start-up line waits for the daemon's answer only where a daemon's socket exists
        wait = ANNOUNCE_WAIT_S if any(ext.daemon_present() for ext in self.extensions) else 0.0
        self._announce_at = time.monotonic() + wait
        self._thread.start()
        log.debug("ondemand_prof: trigger %s, status in %s/ [%s]", self.files.trigger_path, self.files.status_dir,
                  self.files.watcher.mode)

    def stop(self) -> None:
        self._stopping.set()
        self._event.set()
        self._thread.join(timeout=5)
        self.files.stop_watching()
        self.terminator.uninstall()
        if self._thread.is_alive():
            # status files and the daemon socket belong to the agent thread: never touch them beside it
            log.warning("ondemand_prof: the agent thread did not stop within 5 s; its last status updates are "
                        "not written")
            return
        if self._announce_at is not None:  # a run shorter than the wait for the daemon: still say where things were
            self._announce()
        for ext in self.extensions:
            try:
                ext.close()
            except Exception:  # noqa: BLE001
                log.debug("extension close failed", exc_info=True)

    def wake(self) -> None:
        self._event.set()

    def ending(self, why: str) -> None:
        """Any thread, the process is ending without close() (SIGTERM, interpreter exit): trigger statuses get
        their final state, and the daemon hears why and at which step (waited for, briefly), so that a window
        this rank never reached says so instead of a rank that vanished. Nothing in a forked child (a DataLoader
        worker inherits the handler, not the agent: its socket and status files are the rank's)."""
        if os.getpid() != self._pid:
            return
        try:
            self.files.status.finalize(why)
        finally:
            if self.link is not None:
                self.link.last_words(why, self.prof.current_step,
                                     on_agent_thread=threading.current_thread() is self._thread)

    @property
    def trigger_dir(self) -> Path:
        """Where the file trigger watches now (said at registration: daemon_link.AgentLike)."""
        return self.files.trigger_dir

    # ------------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self._event.wait(SAMPLE_S):
                self._event.clear()
            now = time.monotonic()
            try:
                self._sample_clock()
                if not self._settled and now >= self._settle_at:
                    self._settle_at = now + SETTLE_POLL_S
                    self._settle()
                if now >= self._rendezvous_at and (self.rendezvous_since is not None or
                                                   self.prof.current_step == self._first_step):
                    self._rendezvous_at = now + SETTLE_POLL_S
                    self._watch_rendezvous()
                if self._announce_at is not None and (now >= self._announce_at or self._daemon_answered()):
                    self._announce()
                elif self._registration_owed and self._daemon_answered():
                    self._registration_owed = False
                    link = self.link
                    say(log, self.config.quiet, registered_line(self.prof.identity(), link.url if link else "?"))
                self.terminator.poll()
                for ext in self.extensions:
                    ext.poll(now)
            except Exception:  # noqa: BLE001 - the agent must outlive any one bad event
                log.exception("ondemand_prof: agent error")
                time.sleep(0.1)

    def _watch_rendezvous(self) -> None:
        """Whether the training thread waits in the process group's rendezvous (its stack, read every
        SETTLE_POLL_S until its first step ends): status then says `rendezvous N s`, not `starting`."""
        if in_rendezvous(self.prof.training_thread) and self.prof.current_step == self._first_step:
            if self.rendezvous_since is None:
                self.rendezvous_since = time.time()
                self._next_heartbeat_now()
        elif self.rendezvous_since is not None:
            self.rendezvous_since = None
            self._next_heartbeat_now()

    def _next_heartbeat_now(self) -> None:
        if self.link is not None:
            self.link.beat_soon()

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
            self.files.watch(default_trigger_dir(after.job_id))
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
        # a daemon that answers later (it registered this rank just after the wait, or was started since): said
        self._registration_owed = link is not None and daemon is None and link.untrusted is None
        say(log, self.config.quiet, startup_line(self.prof.identity(), self.files.trigger_path,
                                                 Path(self.config.save_path), daemon,
                                                 link.url if link is not None else None, moved=self._moved,
                                                 default_ranks=self.config.ondemand_ranks,
                                                 refused=link.refused if link is not None else None,
                                                 untrusted=link.untrusted if link is not None else None,
                                                 notes=[n for ext in self.extensions if (n := ext.startup_note())],
                                                 connecting=link is not None and link.connecting))

    def _link_daemon(self) -> None:
        try:
            from .daemon_link import DaemonLink

            self.link = DaemonLink(self)
            self.extensions.append(self.link)
        except Exception as exc:  # noqa: BLE001 - no daemon link is not a reason to stop training
            log.warning("ondemand_prof: not connecting to ondemand-profd: %s", exc)

    def add_extension(self, extension: AgentExtension) -> None:
        """One more extension polled by this agent (automatic captures attach so)."""
        self.extensions.append(extension)

    def lead_steps(self) -> int:
        """How far ahead a window this rank opens itself starts (the trigger file's lead: later ranks in time)."""
        return self.files.lead_steps()

    def schedule(self, window: Window, listener: Callable[[str, dict[str, Any]], None]) -> None:
        """Hand a window to the training thread; the listener hears 'scheduled' or 'rejected', then progress."""
        self.prof.call_at_next_step(lambda step: self.submit_now(window, listener, step))

    def submit_now(self, window: Window, listener: Callable[[str, dict[str, Any]], None] | None,
                   step: int) -> tuple[bool, str]:
        """On the training thread (at `step`): the window to the scheduler, and the listener told 'scheduled' or
        'rejected' (why); what every entry's window goes through (schedule; a signal's, already on that thread)."""
        ok, reason, busy = self.prof.place(window, listener)
        if listener is not None:
            info = {"capture_id": window.capture_id, "window": [window.start, window.end], "current_step": step}
            if ok:
                listener("scheduled", info)
            else:
                listener("rejected", {**info, "error": reason, **({"busy": busy.listed("busy")} if busy else {})})
        return ok, reason
