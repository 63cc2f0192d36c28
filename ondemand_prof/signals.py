"""The opt-in POSIX signal trigger: parsing the configured name and installing a debounced handler."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable

from .config import ConfigError

log = logging.getLogger(__name__)

# Signals a training job relies on for its own life; we refuse to take them over.
_RESERVED = {"SIGINT", "SIGTERM", "SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT",
             "SIGCHLD", "SIGPIPE"}


def parse_signal(value: str, label: str = "--profile-signal") -> signal.Signals:
    name = value.strip().upper()
    if name.isdigit():
        try:
            sig = signal.Signals(int(name))
        except ValueError:
            raise ConfigError(f"invalid {label} {value!r}: expected a signal name such as SIGUSR2") from None
    else:
        if not name.startswith("SIG"):
            name = "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is None:
            raise ConfigError(f"invalid {label} {value!r}: expected a signal name such as SIGUSR2 or SIGUSR1")
    if sig.name in _RESERVED:
        raise ConfigError(f"invalid {label} {value!r}: {sig.name} is reserved; use SIGUSR1, SIGUSR2 or a SIGRTMIN+n")
    return sig
