"""The opt-in POSIX signal trigger: parsing the configured name and installing a debounced handler."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from ..core.ranks import selects
from ..core.ids import capture_id as make_capture_id
from ..core.requests import CaptureRequest, WindowDefaults, resolve

log = logging.getLogger(__name__)


class SignalTrigger:
    """Opens the default on-demand window when the configured signal arrives.

    Installed from the main thread only, never over a handler the program already has, and debounced: the
    handler does no I/O, takes no lock (it appends to a deque) and ignores repeats within `debounce_s`, so
    a storm of signals opens one window and costs the training run next to nothing.
    """

    def __init__(self, prof: Any, name: str, debounce_s: float = 1.0) -> None:
        self.prof = prof
        self.sig = signal.Signals[name]  # checked by the options table (core/options.py parse_signal)
        self.debounce_s = debounce_s
        self.received = 0
        self.suppressed = 0
        self._last = -1e18
        self._installed = False

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            log.warning("ondemand_prof: %s trigger not installed: the profiler was created outside the main "
                        "thread (Python allows signal handlers only there)", self.sig.name)
            return False
        current = signal.getsignal(self.sig)
        if current is not signal.SIG_DFL:
            log.warning("ondemand_prof: %s trigger not installed: the program already handles %s (%r); "
                        "choose another with --profile-signal", self.sig.name, self.sig.name, current)
            return False
        signal.signal(self.sig, self._handler)
        self._installed = True
        log.info("ondemand_prof: on-demand capture: kill -%s %d", self.sig.name.removeprefix("SIG"), os.getpid())
        return True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(self.sig) == self._handler:
                signal.signal(self.sig, signal.SIG_DFL)
            self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.received += 1
        now = time.monotonic()
        if now - self._last < self.debounce_s:
            self.suppressed += 1
            return
        self._last = now
        self.prof.call_at_next_step(self._open_window)

    def _open_window(self, step: int) -> None:
        """On the training thread: the default window from the next step, on the configured ranks."""
        prof = self.prof
        ident = prof.identity()
        if not selects(prof.config.ondemand_ranks, ident.rank):
            log.info("ondemand_prof: %s ignored on rank %d (not in --profile-ondemand-ranks %s)", self.sig.name,
                     ident.rank, list(prof.config.ondemand_ranks))
            return
        window = resolve(CaptureRequest(), WindowDefaults.from_config(prof.config), step + 1, source="signal",
                         capture_id=make_capture_id("signal", os.getpid(), int(time.time() * 1000)),
                         extra={"signal": self.sig.name})
        agent = getattr(prof, "agent", None)
        listener: Callable[[str, dict[str, Any]], None] | None = None
        if agent is not None:
            listener = agent.files.status.listener({"trigger": window.capture_id, "rank": ident.rank, "host": ident.host,
                                              "pid": os.getpid(), "seen_at_step": step,
                                              "request": dict(window.requested)})
        link = getattr(agent, "link", None)
        if link is not None and listener is not None:  # the daemon records it (list, show)
            listener = link.opened(window, listener)
        ok, reason = agent.submit_now(window, listener, step) if agent is not None else prof.submit(window)
        if ok:
            log.info("ondemand_prof: %s: window %s scheduled", self.sig.name, window.describe())
        else:
            log.info("ondemand_prof: %s ignored: %s", self.sig.name, reason)
