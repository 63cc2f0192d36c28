"""Leave final trigger states behind when a rank is terminated, and read the ones a killed rank left.

SIGTERM (torchrun and Slurm stop workers with it) used to leave a trigger's status at "recording" forever. When
the program has no SIGTERM handler of its own, we install one that writes a final state ("failed: terminated by
SIGTERM") and then dies of SIGTERM exactly as before. The main thread may be stuck in a C call (a collective)
where Python cannot run a handler, so the agent thread also watches the signal's wake-up descriptor and does the
same from there. Before it dies it also tells the daemon (the agent's last words), so that a window this rank
never reached says it was terminated, not that training ended. kill -9 cannot be caught: status files name the rank's pid, and read_status() (used by the next
agent on the same trigger directory) reports a non-final state of a pid that is gone as failed.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from ..core import safejson
from ..core.files import read_nofollow, write_json_atomic
from ..core.processes import pid_alive

log = logging.getLogger(__name__)

FINAL = ("done", "failed", "rejected", "cancelled")


class TermFinalizer:
    def __init__(self, on_term: Callable[[str], None]) -> None:
        self.on_term = on_term
        self._installed = False
        self._rfd = self._wfd = -1
        self._lock = threading.Lock()
        self._fired = False

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False  # the program handles SIGTERM itself (and then closes the profiler)
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        try:
            old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = None
        if old is None or old != -1:  # someone else (asyncio) uses the wake-up descriptor: handler only
            if old not in (None, -1):
                signal.set_wakeup_fd(old)
            os.close(rfd)
            os.close(wfd)
        else:
            self._rfd, self._wfd = rfd, wfd
        signal.signal(signal.SIGTERM, self._handler)
        self._installed = True
        return True

    def uninstall(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._wfd != -1:
            try:
                if signal.set_wakeup_fd(-1) != self._wfd:
                    pass
            except ValueError:
                pass
            os.close(self._rfd)
            os.close(self._wfd)
            self._rfd = self._wfd = -1
        self._installed = False

    def poll(self) -> None:
        """From the agent thread: a SIGTERM the main thread has not handled yet (it may be blocked in C)."""
        if self._rfd == -1:
            return
        try:
            data = os.read(self._rfd, 64)
        except (BlockingIOError, OSError):
            return
        if int(signal.SIGTERM) in data:
            self._die()

    def _handler(self, signum: int, frame: Any) -> None:
        self._die()

    def _die(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        try:
            self.on_term("terminated by SIGTERM")
        except Exception:  # noqa: BLE001 - dying as asked matters more than the status file
            log.debug("final status on SIGTERM failed", exc_info=True)
        # back to the default action from any thread (Python's signal.signal works only on the main thread),
        # then die of SIGTERM as if we had never been here
        try:
            ctypes.CDLL(None).signal(int(signal.SIGTERM), 0)  # SIG_DFL
        except (OSError, AttributeError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)


def exit_reason(at_exit: bool = False) -> str:
    """Why training is ending, as far as Python can tell here: the exception propagating now (close() in a
    `finally` or `with` block) or, `at_exit`, the one that ended the program (sys.last_value, set once the uncaught
    exception was printed; an interactive session sets it for every failed command); '' when there is none."""
    exc = sys.exc_info()[1]
    if exc is None and at_exit:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        return ""
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt (Ctrl-C or SIGINT)"
    text = " ".join(str(exc).split())
    return f"after {type(exc).__name__}" + (f": {text[:157]}..." if len(text) > 160 else f": {text}" if text else "")


def read_status(path: Path) -> dict[str, Any] | None:
    """A rank's status file; a trigger left in a non-final state by a process that is gone reads as failed."""
    raw = read_nofollow(path, 1 << 20)
    if raw is None:
        return None
    try:
        status = safejson.loads(raw, 1 << 20)
    except ValueError:
        return None
    if not isinstance(status, dict) or type(status.get("pid")) is not int:
        return None
    pid = status["pid"]
    if pid == os.getpid() or (0 < pid < (1 << 22) and pid_alive(pid, thorough=True)):
        return status
    changed = False
    for entry in status.get("triggers") or []:
        if isinstance(entry, dict) and entry.get("state") not in FINAL:
            entry.update(state="failed", error=f"process {pid} is gone (killed before the window finished)")
            changed = True
    if changed:
        status["latest"] = (status.get("triggers") or [None])[0]
    return status


def settle_dead_ranks(status_dir: Path) -> int:
    """Rewrite the status files of ranks that died mid-trigger (kill -9); returns how many were settled."""
    settled = 0
    for path in sorted(status_dir.glob("rank*.json")):
        before = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        status = read_status(path)
        if status is not None and json.dumps(status, indent=2, sort_keys=True, default=str).encode() + b"\n" != before:
            try:
                write_json_atomic(path, status)
                settled += 1
            except OSError as exc:
                log.debug("cannot settle %s: %s", path, exc)
    return settled
