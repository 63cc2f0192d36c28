"""capture.status/rank{R}.json: what happened to each recent trigger of this rank (file triggers, signals,
triage asked through the file), newest first with its history, written on the agent thread and never on the
training thread; rejected and failed triggers also logged, within a budget."""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..core.files import iso_time, write_atomic_at
from ..core.safedir import checked_dir
from .terminate import FINAL

log = logging.getLogger("ondemand_prof.rank.agent")

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


Listener = Callable[[str, dict[str, Any]], None]


class TriggerStatus:
    """The status file of one rank. Events arrive from any thread (listener(), finalize() from a SIGTERM
    handler); the file is written by flush() on the agent thread (`thread`), which `wake` rouses."""

    def __init__(self, prof: Any, status_dir: Path, thread: threading.Thread, wake: Callable[[], None]) -> None:
        self.prof = prof
        self.status_dir = status_dir
        self._thread, self._wake = thread, wake
        self._lock = threading.RLock()
        self._q: collections.deque[tuple[dict[str, Any], str, dict[str, Any]]] = collections.deque()
        self._recent: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._log_budget = LogBudget()

    def listener(self, base: dict[str, Any]) -> Listener:
        """A window listener that records what happens to a trigger in this rank's status file."""
        return lambda event, info: self._record(base, event, info)

    def _record(self, base: dict[str, Any], event: str, info: dict[str, Any]) -> None:
        self._q.append((base, event, info))
        if threading.current_thread() is not self._thread:
            self._wake()

    def finalize(self, reason: str) -> None:
        """Any trigger of ours not in a final state fails with `reason` (the process is being terminated)."""
        for entry in list(self._recent.values()):
            if entry.get("state") not in FINAL:
                self._q.append((entry, "failed", {"error": reason}))
        self.flush()
        self.log_held_back()

    def flush(self) -> None:
        # Lines are logged after the lock is released: a log write can block (stderr a full pipe), and the
        # SIGTERM handler on the main thread takes this lock to settle the status files.
        with self._lock:  # the agent thread, and a SIGTERM handler on the main thread
            lines = self._flush_locked()
        for line in lines:
            log.warning("%s", line)
        if self._log_budget.due():
            self.log_held_back()

    def _end_line(self, base: dict[str, Any], event: str, error: Any) -> str | None:
        say, held = self._log_budget.take()
        if not say:
            return None
        more = f" ({held} more rejected or failed since, not logged; see {self.status_dir}/rank{base['rank']}.json)" \
            if held else ""
        return f"ondemand_prof: trigger {base['trigger']} {event} on rank {base['rank']}: {error}{more}"

    def write_beside(self, name: str, data: bytes) -> Path:
        """A file of ours beside the status files (the stacks a trigger asked for: stacks-rank{R}.txt), owner-only
        and published whole, relative to the status directory checked at this use (never by path: a directory
        swapped since, or anything above it, is refused with UnsafeDirectory)."""
        with checked_dir(self.status_dir) as dir_fd:
            write_atomic_at(dir_fd, name, data)
        return self.status_dir / name

    def log_held_back(self) -> None:
        with self._lock:  # the agent thread, stop() and finalize()
            held, self._log_budget.held = self._log_budget.held, 0
        if held:
            log.warning("ondemand_prof: %d more trigger(s) rejected or failed, not logged (at most %d lines per "
                        "%.0f s); the latest are in %s", held, LOG_BURST, LOG_PERIOD_S, self.status_dir)

    def _flush_locked(self) -> list[str]:
        """rank{R}.json: this rank's recent triggers, newest first, each with its state and history, so a
        trigger's late progress ("done") never hides the answer to a newer one ("rejected"). Returns the
        warning lines to log (once the lock is released)."""
        lines: list[str] = []
        if not self._q:
            return lines
        rank = None
        while self._q:
            base, event, info = self._q.popleft()
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
                line = self._end_line(base, event, info.get("error"))
                if line:
                    lines.append(line)
        triggers = sorted(self._recent.values(), key=lambda e: e.get("written_at") or e.get("seen_at", ""),
                          reverse=True)
        ident = self.prof.identity()
        status = {"rank": rank, "host": ident.host, "pid": ident.pid, "latest": triggers[0], "triggers": triggers}
        text = json.dumps(status, indent=2, sort_keys=True, default=str) + "\n"
        try:
            # at every use: the directory opened anew from / and checked (refused, one warning, if someone swapped
            # it or anything above it), the file published relative to that descriptor, never by path
            with checked_dir(self.status_dir) as dir_fd:
                write_atomic_at(dir_fd, f"rank{rank}.json", text)
        except OSError as exc:
            lines.append(f"ondemand_prof: cannot write trigger status in {self.status_dir}: {exc}")
        return lines

