"""Capture records: what was asked, of which ranks, and what each rank did. Kept on disk in the state
directory (one JSON file per capture, written atomically) so a daemon restart loses none of them."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import secrets
from pathlib import Path
from typing import Any, Iterable

from ..core.files import iso_time, write_json_atomic
from ..core.safedir import ensure_private_dir
from ..core.protocol import FINAL_STATES

log = logging.getLogger("ondemand_prof.host.profd")

# a rank's part of a capture moves through these; the last three are final (FINAL_STATES)
PART_STATES = ("sent", "received", "scheduled", "recording", "writing", "done", "failed", "rejected", "cancelled")
KEEP_RECORDS = 1000


def new_capture_id(wall: float) -> str:
    stamp = _dt.datetime.fromtimestamp(wall).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"


class CaptureRecord:
    """One capture: the request, the window, and a part per target rank."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.version = 0  # bumped on every change; "watch" replies when it moves
        # counted once here and kept up to date, so an event costs O(1) however many ranks a capture has
        self.open_parts = sum(p["state"] not in FINAL_STATES for p in data["parts"].values())

    @classmethod
    def new(cls, capture_id: str, job: str, request: dict[str, Any], plan: dict[str, Any], options: dict[str, Any],
            targets: Iterable[dict[str, Any]], wall: float) -> "CaptureRecord":
        """`plan` is the window as resolved (capped, moved after busy windows), which list and show report."""
        parts = {str(t["rank"]): {"rank": t["rank"], "host": t["host"], "pid": t["pid"], "state": "sent",
                                  "history": [{"state": "sent", "at": iso_time(wall)}]} for t in targets}
        return cls({"capture_id": capture_id, "job": job, "created_at": iso_time(wall), "request": request,
                    "window": [plan["start_step"], plan["end_step"]], "plan": plan, "options": options,
                    "status": "running",
                    "parts": parts})

    @property
    def capture_id(self) -> str:
        return self.data["capture_id"]

    @property
    def status(self) -> str:
        return self.data["status"]

    def part(self, rank: int) -> dict[str, Any] | None:
        return self.data["parts"].get(str(rank))

    def update(self, rank: int, state: str, info: dict[str, Any], wall: float) -> bool:
        """Apply one event from a rank; events that arrive out of order never move a part backwards."""
        part = self.part(rank)
        if part is None or state not in PART_STATES:
            return False
        if part["state"] in FINAL_STATES or PART_STATES.index(state) <= PART_STATES.index(part["state"]):
            return False  # late, repeated or out of order: a part only moves forward
        if state in FINAL_STATES:
            self.open_parts -= 1
        part["state"] = state
        part["history"].append({"state": state, "at": iso_time(wall)})
        for key in ("path", "trace", "error", "late_by", "steps", "window", "status", "current_step", "note", "cancelled"):
            if info.get(key) is not None:
                part[key] = info[key]
        if self.open_parts == 0:
            self._settle()
        self.version += 1
        return True

    def fail_rank(self, rank: int, error: str, wall: float) -> bool:
        part = self.part(rank)
        if part is None or part["state"] in FINAL_STATES:
            return False
        return self.update(rank, "failed", {"error": error}, wall)

    def _settle(self) -> None:
        states = [p["state"] for p in self.data["parts"].values()]
        done = states.count("done")
        if self.data.get("cancel_requested"):
            self.data["status"] = "cancelled"
        else:
            self.data["status"] = "done" if done == len(states) else ("partial" if done else "failed")
        self.data.setdefault("finished_at", iso_time())

    def summary(self) -> dict[str, Any]:
        parts = self.data["parts"].values()
        counts: dict[str, int] = {}
        for p in parts:
            counts[p["state"]] = counts.get(p["state"], 0) + 1
        return {k: self.data[k] for k in ("capture_id", "job", "created_at", "window", "status")} | {
            "ranks": len(self.data["parts"]), "states": counts, "request": self.data["request"]}


class RecordStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "captures"
        ensure_private_dir(self.dir)  # owner-only; an existing one not ours is refused (UnsafeDirectory)
        self.records: dict[str, CaptureRecord] = {}
        self.dirty: set[str] = set()
        self._running: set[str] = set()
        self._load()

    def _load(self) -> None:
        for path in sorted(self.dir.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                self.records[data["capture_id"]] = CaptureRecord(data)
                if data.get("status") == "running":
                    self._running.add(data["capture_id"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ondemand-profd: skipping unreadable capture record %s: %s", path, exc)
        if self.records:
            log.info("ondemand-profd: loaded %d capture records from %s", len(self.records), self.dir)

    def add(self, record: CaptureRecord) -> None:
        self.records[record.capture_id] = record
        if record.status == "running":
            self._running.add(record.capture_id)
        self.save(record)
        self._prune()

    def mark(self, record: CaptureRecord) -> None:
        self.dirty.add(record.capture_id)

    def flush(self) -> None:
        """Write the records that changed (batched: thousands of rank events become one write per record)."""
        for capture_id in list(self.dirty):
            record = self.records.get(capture_id)
            if record is not None:
                self.save(record)
        self.dirty.clear()

    def save(self, record: CaptureRecord) -> None:
        try:
            write_json_atomic(self.dir / f"{record.capture_id}.json", record.data, compact=True)
        except OSError as exc:
            log.error("ondemand-profd: cannot save capture record %s: %s", record.capture_id, exc)

    def running(self) -> list[CaptureRecord]:
        """Captures still in progress (kept as a set: the daemon asks twice a second, records may be 1000)."""
        done = [cid for cid in self._running if self.records.get(cid) is None or
                self.records[cid].status != "running"]
        self._running.difference_update(done)
        return [self.records[cid] for cid in self._running]

    def find(self, capture_id: str) -> CaptureRecord:
        """By id or any unique part of it; KeyError says why not."""
        if capture_id in self.records:
            return self.records[capture_id]
        matches = [r for k, r in self.records.items() if capture_id in k] if capture_id else []
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise KeyError(f"no capture {capture_id!r} (ondemandctl list shows them)")
        raise KeyError(f"{capture_id!r} matches {len(matches)} captures; give more of the id")

    def newest(self, limit: int, job: str | None = None) -> list[CaptureRecord]:
        records = [r for r in self.records.values() if job is None or r.data["job"] == job]
        records.sort(key=lambda r: r.data["created_at"], reverse=True)
        return records[:limit]

    def _prune(self) -> None:
        if len(self.records) <= KEEP_RECORDS:
            return
        for record in sorted(self.records.values(), key=lambda r: r.data["created_at"])[:-KEEP_RECORDS]:
            if record.status == "running":
                continue
            self.records.pop(record.capture_id, None)
            try:
                (self.dir / f"{record.capture_id}.json").unlink()
            except OSError:
                pass
