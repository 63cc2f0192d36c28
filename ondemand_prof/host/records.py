"""Capture records: what was asked, of which ranks, and what each rank did. Kept on disk in the state
directory (one JSON file per capture, written atomically) so a daemon restart loses none of them.

A record holds only values of the shape ondemandctl prints: what a rank reports is checked field by field as it
comes in (update), and a file read back from disk is checked whole (record_problem); so `show`, `list` and
`status` never meet a record they cannot print. The store never holds more than KEEP_RECORDS: a record made on a
rank's behalf (an automatic capture) can only push out older records of the same uid, never another user's.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, cast

from ..core.files import iso_epoch, iso_time, write_json_atomic
from ..core.ids import valid_id
from ..core.safejson import holds_lone_surrogate
from ..core.safedir import ensure_private_dir
from ..core.protocol import FINAL_STATES, PID_MAX
from ..core.ranks import MAX_RANK
from ..core.bounds import MAX_STEP, bounded_int
from ..core.window import busy_window
from .alignment import MISALIGNED, mark_misaligned, recorded
from .recordtypes import Part, RecordData, RecordSummary, RecordView, StoredPlan

log = logging.getLogger("ondemand_prof.host.profd")

# a rank's part of a capture moves through these; the last three are final (FINAL_STATES)
PART_STATES = ("sent", "received", "scheduled", "recording", "writing", "done", "failed", "rejected", "cancelled")
# a capture's outcome, settled once on its record when its last part is final (CaptureRecord._settle): what list,
# show, --json and the metrics read; misaligned: every part finished, some recorded, not all the same steps
RECORD_STATUSES = ("running", "done", "partial", "failed", "cancelled", MISALIGNED)
RECORDED_SOMETHING = ("done", "partial", MISALIGNED)
KEEP_RECORDS = 1000  # the most records the store holds, whoever floods it
KEEP_PER_UID = 200  # the most records made on behalf of one uid's ranks (automatic captures)
MAX_TEXT = 2048  # an error or a note a rank reports


class RecordRefused(ValueError):
    """A record the store will not take (its id exists, or the store is full of records it may not drop)."""


def _text(limit: int) -> Any:
    return lambda v: v[:limit] if isinstance(v, str) else None


def _step_list(v: Any) -> Any:
    if isinstance(v, list) and len(v) <= 65536 and all(bounded_int(x, -1, MAX_STEP) for x in v):
        return v
    return None


def _window(v: Any) -> Any:
    if isinstance(v, list) and len(v) == 2 and bounded_int(v[0], -1, MAX_STEP) and \
            (v[1] is None or bounded_int(v[1], -1, MAX_STEP)):
        return v
    return None


# what a rank's event may set on its part, each with the check that keeps the part printable (None: dropped)
PART_FIELDS: dict[str, Any] = {
    "path": _text(4096), "trace": _text(4096), "error": _text(MAX_TEXT), "note": _text(MAX_TEXT), "status": _text(32),
    "late_by": lambda v: v if bounded_int(v, 0, MAX_STEP) else None,
    "current_step": lambda v: v if bounded_int(v, -1, MAX_STEP) else None,
    "steps": _step_list, "window": _window,
    "cancelled": lambda v: v if isinstance(v, bool) else None,
    # a rank in a container (host/podpath.py): its own name of `path` where this host names it otherwise, or
    # that this host cannot see it at all
    "pod_path": _text(4096), "pod_only": lambda v: v if isinstance(v, bool) else None,
}


def _fresh_version() -> int:
    """A first version for a record read back: 2**52 to 2**53 (an exact JSON number anywhere), random, so the
    chance that it lands within the few thousand versions of a watch an earlier daemon answered is ~1e-12."""
    return (1 << 52) + secrets.randbelow(1 << 51)


@dataclass(frozen=True)
class Plan:
    """A capture's window as planned, complete before any window is sent: the steps, where the target ranks were
    (`current_steps`, rank -> step) and the lead delivery needed, the ranks that will begin it late (`late_ranks`:
    too close to its start; `past_ranks`: already past it), the windows it was moved after (`after`) and what the
    console says of it (`note`). The record keeps it as its `plan` (as_dict), which list, show and capture print."""

    start_step: int
    end_step: int
    current_steps: Mapping[int, int] = field(default_factory=dict)
    lead_steps: int = 0
    late_ranks: tuple[int, ...] = ()
    past_ranks: tuple[int, ...] = ()
    after: Mapping[str, Any] | None = None
    note: str = ""

    def noted(self, *notes: str) -> "Plan":
        """The same plan with `notes` said before its own (a length cap's, a replan's reason)."""
        return replace(self, note="; ".join(filter(None, [*notes, self.note])))

    def as_dict(self) -> StoredPlan:
        """The record's `plan` (ranks as text keys: what JSON makes of them anyway); `after` only when moved."""
        # (a cast: `after`, where it is, sits before `note`, which a TypedDict literal cannot say conditionally)
        return cast(StoredPlan, {
            "current_steps": {str(k): v for k, v in self.current_steps.items()}, "lead_steps": self.lead_steps,
            "late_ranks": list(self.late_ranks), "past_ranks": list(self.past_ranks),
            **({"after": dict(self.after)} if self.after is not None else {}), "note": self.note,
            "start_step": self.start_step, "end_step": self.end_step})


# planning a capture again (host/commands/capture.py): the record, its ranks' busy refusals (rank -> the event's
# info), the wall clock; True when the capture was planned again and its windows sent
Replan = Callable[["CaptureRecord", dict[int, dict[str, Any]], float], bool]
UNANSWERED = ("sent", "received")  # a part whose rank has not yet said whether it takes its window


def new_part(target: Mapping[str, Any], wall: float) -> Part:
    """A target rank's part of a new capture: sent its window at `wall`."""
    return {"rank": target["rank"], "host": target["host"], "pid": target["pid"], "uid": target.get("uid"),
            "state": "sent", "history": [{"state": "sent", "at": iso_time(wall)}]}


# What a capture is, set once when the daemon makes it (Service.open_capture): ondemandctl capture (--baseline or
# not: the record's `baseline` says), a rank's automatic capture of a slowdown, its job's automatic baseline, a
# rank's trigger file, a signal
CAPTURE_KINDS = ("capture", "auto", "auto_baseline", "file", "signal")
SOURCE_OF_KIND = {"capture": "daemon", "auto": "auto", "auto_baseline": "auto", "file": "file", "signal": "signal"}


def record_source(data: Mapping[str, Any]) -> str:
    """What opened a capture, as its ranks name their window's source (their metadata's `source`): `file` or
    `signal` (a rank's trigger file or signal, recorded from its "opened" event), `auto` (--profile-auto: a
    slowdown, or the job's automatic baseline) or `daemon` (ondemandctl capture, on this host or across hosts).
    From the record's kind; a record written before kinds were kept, from what it holds."""
    kind = data.get("kind")
    if kind in SOURCE_OF_KIND:
        return SOURCE_OF_KIND[kind]
    source = data.get("source")
    if source in ("file", "signal"):
        return str(source)
    request = data.get("request")
    return "auto" if isinstance(request, dict) and ("auto" in request or "auto_baseline" in request) else "daemon"


class CaptureRecord:
    """One capture: the request, the window, and a part per target rank."""

    def __init__(self, data: RecordData, first_version: int = 0) -> None:
        self.data = data
        self.version = first_version  # bumped on every change; "watch" replies when it moves
        # the version that last changed each part (absent: first_version), so that a watch can answer with only
        # the parts changed since the version its caller holds: a 64-rank capture is watched about seven times,
        # and the whole record each time was most of what the daemon and the CLI spent on it
        self._first_version = first_version
        self._part_changed: dict[str, int] = {}
        # counted once here and kept up to date, so an event costs O(1) however many ranks a capture has
        self.open_parts = sum(p["state"] not in FINAL_STATES for p in data["parts"].values())
        self.created = iso_epoch(data["created_at"])  # (its text misorders across a DST fold)
        # A capture the daemon may plan again once (Capture.execute gives it `replan`): a rank's refusal as busy
        # with a window the daemon had not heard of (a trigger file's, begun before its heartbeat said so) is
        # held until every rank has answered the window, then the capture is planned after the windows named,
        # and the refusals are applied only when it cannot be. Answers to a window planned again are dropped.
        self.replan: Replan | None = None
        self._busy: dict[int, dict[str, Any]] = {}
        self._superseded: list[list[int]] = []
        self.concluding = False  # an automatic capture's comparison being computed off the loop (service.py)

    @classmethod
    def new(cls, capture_id: str, job: str, request: dict[str, Any], plan: Plan | Mapping[str, Any],
            options: dict[str, Any], targets: Iterable[dict[str, Any]], wall: float) -> "CaptureRecord":
        """`plan` is the window as resolved (capped, moved after busy windows), which list and show report. Made
        by Service.open_capture, the one place a capture is made on the daemon."""
        stored = plan.as_dict() if isinstance(plan, Plan) else cast(StoredPlan, dict(plan))
        parts = {str(t["rank"]): new_part(t, wall) for t in targets}
        return cls({"capture_id": capture_id, "job": job, "created_at": iso_time(wall), "request": request,
                    "window": [stored["start_step"], stored["end_step"]], "plan": stored, "options": options,
                    "status": "running",
                    "parts": parts})

    @property
    def capture_id(self) -> str:
        return self.data["capture_id"]

    @property
    def status(self) -> str:
        return self.data["status"]

    @property
    def owner(self) -> int | None:
        """The uid whose job this is: its ranks' (the kernel's word, kept on each part); None when not known."""
        for part in self.data["parts"].values():
            uid = part.get("uid")
            if type(uid) is int:
                return uid
        return None

    @property
    def is_baseline(self) -> bool:
        """Marked as its job's baseline (capture --baseline, or a rank's automatic baseline window)."""
        return self.data.get("baseline") is True

    def part(self, rank: int) -> Part | None:
        return self.data["parts"].get(str(rank))

    def add_part(self, target: Mapping[str, Any], wall: float, step: int | None = None) -> None:
        """Another rank of a capture a rank opened itself (every rank of a job reads its trigger file): a part
        for it, its step then in the plan's current_steps. Only while running (a settled record never moves)."""
        rank = int(target["rank"])
        assert self.status == "running" and self.part(rank) is None
        self.data["parts"][str(rank)] = new_part(target, wall)
        if step is not None:
            self.data["plan"].setdefault("current_steps", {})[str(rank)] = step
        self.open_parts += 1
        self.part_changed(rank)

    def update(self, rank: int, state: str, info: dict[str, Any], wall: float, pid: int | None = None) -> bool:
        """Apply one event from a rank (from the process `pid`, when given: the one the part was sent to); events
        that arrive out of order never move a part backwards; each reported value is checked (PART_FIELDS)."""
        part = self.part(rank)
        if part is None or state not in PART_STATES or (pid is not None and part.get("pid") != pid):
            return False
        if part["state"] in FINAL_STATES or PART_STATES.index(state) <= PART_STATES.index(part["state"]):
            return False  # late, repeated or out of order: a part only moves forward
        if isinstance(info, dict) and info.get("window") in self._superseded:
            return False  # about a window this capture was planned again from
        if state == "rejected" and self.replan is not None and isinstance(info, dict) and \
                busy_window(info.get("busy")) is not None:
            self._busy[rank] = dict(info)
            return self._answered(wall)
        moved = self._move(rank, part, state, info, wall)
        if self._busy:
            self._answered(wall)
        return moved

    def _move(self, rank: int, part: Part, state: str, info: Any, wall: float) -> bool:
        if state in FINAL_STATES:
            self.open_parts -= 1
        part["state"] = state
        part["history"].append({"state": state, "at": iso_time(wall)})
        if isinstance(info, dict):
            fields = cast(dict[str, Any], part)  # (keys from PART_FIELDS, each one of Part's: a loop mypy cannot key)
            for key, check in PART_FIELDS.items():  # in this order (the record's key order), only those given
                if key in info:
                    value = check(info[key])
                    if value is not None:
                        fields[key] = value
        if self.open_parts == 0:
            self._settle()
        self.part_changed(rank)
        return True

    def _answered(self, wall: float) -> bool:
        """Busy refusals are held: once every other rank has answered the window, the capture is planned again
        (once), or else the refusals are applied. True when the record changed."""
        if any(p["state"] in UNANSWERED for k, p in self.data["parts"].items() if int(k) not in self._busy):
            return False
        busy, self._busy = self._busy, {}
        replan, self.replan = self.replan, None
        if replan is not None and replan(self, busy, wall):
            return True
        for rank, info in busy.items():
            part = self.part(rank)
            if part is not None and part["state"] not in FINAL_STATES:
                self._move(rank, part, "rejected", info, wall)
        return True

    def planned_again(self, plan: Plan, why: str) -> None:
        """The capture planned again (its windows are being sent): the record's window, plan and every part's
        window are the new ones, `plan.replanned` says from where and why; answers to the old window are dropped."""
        old = list(self.data["window"])
        self._superseded.append(old)
        self.data["window"] = [plan.start_step, plan.end_step]
        self.data["plan"] = {**plan.as_dict(), "replanned": {"from": old, "why": why}}
        for key, part in self.data["parts"].items():
            part["window"] = list(self.data["window"])
            self.part_changed(int(key))

    def part_changed(self, rank: int) -> None:
        """A part of this record changed (in place): a new version, and the part is in the next changes-only view."""
        self.version += 1
        self._part_changed[str(rank)] = self.version

    def view(self, since: int | None = None) -> RecordView:
        """The record as the CLI gets it, with its version; given `since` (a version the caller holds, of this
        daemon's numbering), only the parts changed after it, marked changed_only (the caller merges them)."""
        shown: RecordView = {**self.data, "source": record_source(self.data)}  # (what opened it, from its kind)
        if since is None or not self._first_version <= since <= self.version:
            return {**shown, "version": self.version}
        first, changed = self._first_version, self._part_changed
        parts = {k: p for k, p in self.data["parts"].items() if changed.get(k, first) > since}
        return {**shown, "parts": parts, "version": self.version, "changed_only": True}

    def fail_rank(self, rank: int, error: str, wall: float) -> bool:
        part = self.part(rank)
        if part is None or part["state"] in FINAL_STATES:
            return False
        return self.update(rank, "failed", {"error": error}, wall)

    def _settle(self) -> None:
        """The outcome, once every part is final: the one place a record's status is decided (host/merge.py
        merges the statuses of one capture's records on several hosts, by the same alignment rule)."""
        states = [p["state"] for p in self.data["parts"].values()]
        done = states.count("done")
        if self.data.get("cancel_requested"):
            self.data["status"] = "cancelled"
        else:
            self.data["status"] = "done" if done == len(states) else ("partial" if done else "failed")
            mark_misaligned(self.data)  # recorded, but not the same steps on every rank that finished
        self.data.setdefault("finished_at", iso_time())

    def resettle(self) -> bool:
        """A finished record read back from disk, settled by a daemon from before a rule: settled again (a record
        of an older daemon whose ranks recorded different steps says `done`). True when its status changed."""
        return self.status in ("done", "partial") and mark_misaligned(self.data)

    def summary(self) -> RecordSummary:
        """The record as `list` shows it (its keys in this order: --json prints them so)."""
        data = self.data
        parts = data["parts"].values()
        counts: dict[str, int] = {}
        for p in parts:
            counts[p["state"]] = counts.get(p["state"], 0) + 1
        # recorded: the distinct steps the finished ranks recorded ([first, last, count] each), so that a capture
        # across hosts is misaligned in `list` where its ranks on different hosts recorded different steps
        out: RecordSummary = {
            "capture_id": data["capture_id"], "job": data["job"], "created_at": data["created_at"],
            "window": data["window"], "status": data["status"], "ranks": len(data["parts"]), "states": counts,
            "request": data["request"], "baseline": self.is_baseline, "recorded": recorded(parts)}
        if "compare_with" in data:
            out["compare_with"] = data["compare_with"]
        if "cause" in data:
            out["cause"] = data["cause"]
        return out



MAX_COMPARISON_BYTES = 256 * 1024  # an automatic capture's comparison kept on its record (records are kept 1,000)


def stored_comparison(comparison: dict[str, Any]) -> dict[str, Any]:
    """An automatic capture's comparison as its record keeps it: whole where it fits MAX_COMPARISON_BYTES, else
    without the per-rank tables of changes and the wait matrices (said in `trimmed`), else the verdict alone."""
    if len(json.dumps(comparison, default=str)) <= MAX_COMPARISON_BYTES:
        return comparison
    trimmed = {**comparison, "ranks": [{k: v for k, v in r.items() if k not in ("changes", "step_ms_by_step")}
                                       for r in comparison.get("ranks") or []],
               "collectives": {side: {k: v for k, v in (w or {}).items() if k != "matrix"} if w else None
                               for side, w in (comparison.get("collectives") or {}).items()},
               "trimmed": "per-rank changes and the wait matrices left out (ondemandctl report AUTO --baseline BASE "
                          "computes them)"}
    if len(json.dumps(trimmed, default=str)) <= MAX_COMPARISON_BYTES:
        return trimmed
    return {k: comparison.get(k) for k in ("baseline", "capture", "job", "step_ms", "cause", "category", "verdict",
                                           "kind", "culprits", "waiting", "notes", "rule")} | {
        "ranks": [], "trimmed": "only the verdict kept: the comparison is over the record's bound"}


class RecordStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "captures"
        ensure_private_dir(self.dir)  # owner-only; an existing one not ours is refused (UnsafeDirectory)
        # oldest first (created_at): eviction takes the first finished record it meets, not a scan and a min() of
        # all 1000 (a tenth of a long-lived daemon's time per capture)
        self.records: dict[str, CaptureRecord] = {}
        self.dirty: set[str] = set()
        self._running: set[str] = set()
        self._owned: dict[int | str | None, int] = {}  # records per whom they are charged to (add), kept up to date
        self.unsaved: dict[str, str] = {}  # capture id -> why its last write failed (a full disk), until one works
        self._load()

    def _load(self) -> None:
        for path in sorted(self.dir.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                problem = record_problem(data)
                if problem is None and path.name != f"{data['capture_id']}.json":
                    problem = f"its capture id {data['capture_id']!r} is not its file name"
                if problem:
                    raise ValueError(problem)
                # versions of a record read back start at a random place far from any an earlier daemon gave out
                # (not a clock, which can be stepped back between two restarts), so a CLI still holding one of
                # those gets every part, never only some
                record = CaptureRecord(data, first_version=_fresh_version())
                self.records[data["capture_id"]] = record
                if record.resettle():
                    self.save(record)
                if data.get("status") == "running":
                    self._running.add(data["capture_id"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ondemand-profd: skipping unreadable capture record %s: %s", path, exc)
        self.records = dict(sorted(self.records.items(), key=lambda kv: kv[1].created))
        for record in self.records.values():
            self._own(record, 1)
        if self.records:
            log.info("ondemand-profd: loaded %d capture records from %s", len(self.records), self.dir)
        while len(self.records) > KEEP_RECORDS and self._evict_oldest():
            pass

    def add(self, record: CaptureRecord, owner: int | str | None = None, save: bool = True) -> None:
        """Take a new record; RecordRefused when its id exists (a record is never replaced) or no room can be
        made. `owner`: whom the record is charged to: the uid whose rank asked for it (automatic, trigger-file and
        signal captures), the uid that asked ondemandctl for it (its connection's, the kernel's word), or over TCP
        `key:NAME` (the client key). Each holds at most KEEP_PER_UID records, and room is made only by pushing out
        its own oldest finished record (never a running record, never a job's current baseline): one asker's
        flood pushes out only its own (issue 41, 4: 1,000 refused captures of one member once evicted every
        user's records and another's baseline; records of nobody, from before charges, make room for records of
        nobody). `save`: False when the caller writes it (save()) once its windows are sent."""
        if not valid_id(record.capture_id):
            raise RecordRefused(f"capture id {record.capture_id[:80]!r} is not a valid id")
        if record.capture_id in self.records:
            raise RecordRefused(f"capture {record.capture_id} already exists")
        if isinstance(owner, int):
            record.data["owner_uid"] = owner
        elif owner is not None:
            record.data["owner_key"] = owner
        mine = self._owned.get(owner, 0)
        if owner is not None and mine >= KEEP_PER_UID and not self._evict(owner):
            raise RecordRefused(f"{_whose(owner)} holds {mine} capture records (at most {KEEP_PER_UID}), none of "
                                "them finished")
        while len(self.records) >= KEEP_RECORDS:
            if not self._evict(owner):
                raise RecordRefused(f"the daemon holds {len(self.records)} capture records (its limit) and none "
                                    f"it may drop for {_whose(owner)}")
        self.records[record.capture_id] = record
        self._own(record, 1)
        if record.status == "running":
            self._running.add(record.capture_id)
        if save:
            self.save(record)

    def _own(self, record: CaptureRecord, n: int) -> None:
        owner = charged(record.data)
        self._owned[owner] = self._owned.get(owner, 0) + n
        if self._owned[owner] <= 0:
            del self._owned[owner]

    def mark(self, record: CaptureRecord) -> None:
        self.dirty.add(record.capture_id)

    def flush(self) -> None:
        """Write the records that changed (batched: thousands of rank events become one write per record); those
        that could not be written stay to be tried again."""
        dirty, self.dirty = self.dirty, set()
        for capture_id in dirty:
            record = self.records.get(capture_id)
            if record is not None:
                self.save(record)

    def save(self, record: CaptureRecord) -> bool:
        """Write the record (atomically); False when it could not be (a full disk): the record stays in `unsaved`
        with why, is written again at the next flush, and is nobody's baseline until it is on disk (issue 41, 9:
        a baseline reported as marked was lost at the next restart)."""
        try:
            write_json_atomic(self.dir / f"{record.capture_id}.json", record.data, compact=True)
        except OSError as exc:
            if record.capture_id not in self.unsaved:
                log.error("ondemand-profd: cannot save capture record %s: %s", record.capture_id, exc)
            self.unsaved[record.capture_id] = f"{exc.strerror or exc}"
            self.dirty.add(record.capture_id)
            return False
        if self.unsaved.pop(record.capture_id, None) is not None:
            log.warning("ondemand-profd: capture record %s saved at last", record.capture_id)
        return True

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

    def baseline_of(self, job: str, owner: int | None) -> CaptureRecord | None:
        """The job's baseline: of its records marked so (capture --baseline, an automatic baseline), the newest
        that recorded something (done, partial or misaligned); one a job, the newest wins, and a baseline that
        failed leaves the one before it in place. A job is its id and its owner's uid, as the registry keys it:
        another user's job of the same id has a baseline of its own."""
        return self.baselines().get((owner, job))

    def baselines(self) -> dict[tuple[int | None, str], CaptureRecord]:
        """Every job's baseline (baseline_of), in one pass over the records (oldest first: the newest wins)."""
        out: dict[tuple[int | None, str], CaptureRecord] = {}
        for record in self.records.values():
            if record.is_baseline and record.status in RECORDED_SOMETHING and record.capture_id not in self.unsaved:
                out[(record.owner, record.data["job"])] = record  # (one not on disk is not the baseline yet)
        return out

    def newest(self, limit: int, job: str | None = None) -> list[CaptureRecord]:
        records = [r for r in self.records.values() if job is None or r.data["job"] == job]
        records.sort(key=lambda r: r.created, reverse=True)
        return records[:limit]

    def _evict(self, owner: int | str | None) -> bool:
        """Drop the oldest finished record charged to `owner` (None: to nobody, records from before charges),
        never a job's current baseline; False when there is none."""
        keep: set[str] | None = None  # the current baselines, looked up only when a candidate is marked so
        for r in self.records.values():
            if r.status == "running" or charged(r.data) != owner:
                continue
            if r.is_baseline:
                if keep is None:
                    keep = {b.capture_id for b in self.baselines().values()}
                if r.capture_id in keep:
                    continue
            self._drop(r)
            return True
        return False

    def _evict_oldest(self) -> bool:
        """(Loading more records than the store holds.) Drop the oldest finished record, whoever's."""
        record = next((r for r in self.records.values() if r.status != "running"), None)
        if record is not None:
            self._drop(record)
        return record is not None

    def _drop(self, record: CaptureRecord) -> None:
        self.records.pop(record.capture_id, None)
        self._own(record, -1)
        self.dirty.discard(record.capture_id)
        self.unsaved.pop(record.capture_id, None)
        try:
            (self.dir / f"{record.capture_id}.json").unlink()
        except OSError:
            pass


def charged(data: Mapping[str, Any]) -> int | str | None:
    """Whom a record is charged to (RecordStore.add): a uid, `key:NAME` over TCP, or None (a record from before)."""
    uid = data.get("owner_uid")
    if type(uid) is int:  # (not a bool from a hand-edited file)
        return uid
    key = data.get("owner_key")
    return key if isinstance(key, str) else None


def _whose(owner: int | str | None) -> str:
    return f"uid {owner}" if isinstance(owner, int) else (str(owner) if owner is not None else "records of nobody")


def record_problem(data: Any) -> str | None:
    """Why a record read back from disk cannot be served as it is (None: it can): every field ondemandctl prints
    must have its shape, so a record a rank shaped (or a file edited by hand) never makes show or list fail."""
    if not isinstance(data, dict):
        return "not an object"
    if not valid_id(data.get("capture_id")):
        return "no valid capture_id"
    for key in ("job", "created_at"):
        if not isinstance(data.get(key), str):
            return f"{key} is not a string"
    if iso_epoch(data["created_at"]) == -math.inf:
        return f"created_at {data['created_at'][:40]!r} is not a time"
    if data.get("status") not in RECORD_STATUSES:
        return f"status {str(data.get('status'))[:40]!r} is not one of {', '.join(RECORD_STATUSES)}"
    if "window" not in data or (data["window"] is not None and _window(data["window"]) is None):
        return "window is not [start, end] or null"
    if not isinstance(data.get("request"), dict):
        return "request is not an object"
    for key in ("plan", "options"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return f"{key} is not an object"
    if data.get("baseline") is not None and not isinstance(data["baseline"], bool):
        return "baseline is not true or false"
    if data.get("compare_with") is not None and not valid_id(data["compare_with"]):
        return "compare_with is not a capture id"
    if data.get("cause") is not None and not isinstance(data["cause"], str):
        return "cause is not a text"
    if data.get("comparison") is not None and not isinstance(data["comparison"], dict):
        return "comparison is not an object"
    if data.get("kind") is not None and data["kind"] not in CAPTURE_KINDS:
        return "kind is not a capture's kind"
    misaligned = data.get("misaligned")
    if misaligned is not None and not (isinstance(misaligned, dict) and isinstance(misaligned.get("text"), str)):
        return "misaligned is not an object with a text"
    if holds_lone_surrogate(data):  # what no terminal prints: it made every ondemandctl that printed it fail
        return "a string holds a lone UTF-16 surrogate"
    parts = data.get("parts")
    if not isinstance(parts, dict):
        return "parts is not an object"
    for key, part in parts.items():
        if not isinstance(part, dict) or not bounded_int(part.get("rank"), 0, MAX_RANK) or key != str(part["rank"]):
            return f"part {str(key)[:20]!r} is not a rank's part"
        if part.get("state") not in PART_STATES or not isinstance(part.get("host"), str) or \
                not bounded_int(part.get("pid"), 0, PID_MAX) or not isinstance(part.get("history", []), list) or \
                not all(isinstance(h, dict) and h.get("state") in PART_STATES for h in part.get("history", [])):
            return f"part {key}: state, host, pid or history malformed"
        for name, check in PART_FIELDS.items():
            if part.get(name) is not None and check(part[name]) is None:
                return f"part {key}: {name} malformed"
    return None
