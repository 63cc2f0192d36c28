"""`watch`, the daemon's long poll that `follow` (host/commands/follow.py) asks: not a console command."""

from __future__ import annotations

from typing import Any

from ...core.bounds import checked_number
from ..service import MAX_WATCH_S, BadRequest, Service
from .base import Command


class Watch(Command):
    """Long poll: reply when the capture changes from the version the caller has seen, or after timeout_s.
    With changed_only (true), the reply holds only the parts changed since that version, marked changed_only,
    when the daemon can tell which (else the whole record, unmarked); the caller merges them into its copy."""

    name = "watch"
    cli = False
    fields = {"capture_id": (str,), "seen": (int,)}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        record = service.find(msg["capture_id"])
        timeout = msg.get("timeout_s", 5.0)
        try:
            checked_number(timeout, 0, MAX_WATCH_S, "field 'timeout_s'")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        since = msg["seen"] if msg.get("changed_only") is True else None
        if record.version != msg["seen"] or record.status != "running" or timeout == 0:
            return record.view(since)
        service.watch(route, msg.get("id"), record, timeout, since)
        return None
