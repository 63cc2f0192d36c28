"""systemd readiness and watchdog notifications (the sd_notify datagram protocol; no libsystemd needed)."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ondemand_prof.host.profd")


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to systemd when it started us with Type=notify; False otherwise."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("ondemand-profd: cannot notify systemd (%s): %s", address, exc)
        return False


def watchdog_interval() -> float:
    """Half of systemd's WatchdogSec for this process, or 0 when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return 0.0
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return 0.0
