"""Captures the ranks open themselves, as the daemon records them: automatic ones (a rank's slowdown, opened
again on the reference rank of its job, the one whose step time is closest to the job's median, for comparison;
a job's baseline, on every rank of it on this host), within the daemon's own budget (AutoBudget); and windows a
rank opened from its trigger file or a signal, recorded from the rank's "opened" event so that `ondemandctl
list` and `show` have them with their outcome. (The straggler figures of status are host/stalls.py's.)

A rank names these captures itself, so its word is checked: the id is of its kind and, for automatic ones, its
own rank and pid; a record is never replaced and belongs to the job (owner uid, job id) that opened it.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from typing import TYPE_CHECKING, Any

from ..core.bounds import MAX_STEP, bounded_int, finite_number
from ..core.protocol import encode
from ..core.requests import request_fields, window_from_wire
from ..core.text import printable
from .records import Plan, RecordRefused, record_source

if TYPE_CHECKING:
    from .registry import RankInfo

log = logging.getLogger("ondemand_prof.daemon")

OPENED_KINDS = ("file", "signal")  # windows a rank opens itself that the daemon records from its "opened" event
OPENED_PER_JOB_HOUR = 120  # records of such windows a job may add an hour (parts of one record count once)
OPENED_PER_UID_HOUR = 360  # ... and a uid, over all its jobs
# the ids a rank gives them (core/ids.capture_id): a trigger version (core/triggerfile.trigger_version), or the
# signalled process's pid and the millisecond
FILE_ID = re.compile(r"file-[0-9a-f]{16}")
SIGNAL_ID = re.compile(r"signal-(\d{1,10})-\d{1,16}")
SIGNAL_NAME = re.compile(r"SIG[A-Z0-9+]{1,12}")
OPENED_EXTRA = ("anchor_step", "decided_by_rank", "signal")  # what the rank adds to the request (resolve's extra)
MAX_NOTE = 200


AUTO_PER_JOB_HOUR = 20  # automatic captures the daemon records per job per hour (a rank's own default is 4)
AUTO_PER_UID_HOUR = 60  # ... and per uid, over all its jobs
REFUSAL_LOG_S = 60.0  # refused automatic captures are logged once a minute per uid, then counted


class AutoBudget:
    """The daemon's own bound on automatic captures, whatever a rank's configuration says: per job and per uid,
    over the last hour. A flood of auto_capture messages costs a counter, not records or log lines."""

    def __init__(self, per_job: int = AUTO_PER_JOB_HOUR, per_uid: int = AUTO_PER_UID_HOUR,
                 what: str = "automatic captures") -> None:
        self.per_job, self.per_uid, self.what = per_job, per_uid, what
        self.jobs: dict[str, list[float]] = {}
        self.uids: dict[Any, list[float]] = {}
        self._logged: dict[Any, tuple[float, int]] = {}  # (uid, kind) -> (last logged, refused since)

    def take(self, info: "RankInfo", now: float) -> str:
        """'' and the capture is counted, or why it is over budget."""
        key: Any  # a job (str), then a uid (int or None)
        for book, key, limit, what in ((self.jobs, info.job, self.per_job, f"job {info.job}"),
                                       (self.uids, info.uid, self.per_uid, f"uid {info.uid}")):
            times = [t for t in book.get(key, []) if now - t < 3600.0]
            book[key] = times
            if len(times) >= limit:
                return f"the daemon's budget of {limit} {self.what} an hour for {what} is spent"
        self.jobs[info.job].append(now)
        self.uids[info.uid].append(now)
        if len(self.jobs) > 4096:  # forget jobs with nothing in the last hour
            self.jobs = {k: v for k, v in self.jobs.items() if v and now - v[-1] < 3600.0}
        return ""

    def refused(self, info: "RankInfo", kind: str, why: str) -> None:
        """Log a refusal: once a minute per uid and kind (bad, budget, store), then how many were not logged."""
        now = time.monotonic()
        key = (info.uid, kind)
        last, count = self._logged.get(key, (-REFUSAL_LOG_S, 0))
        if now - last >= REFUSAL_LOG_S:
            more = f" ({count} more refused since, not logged)" if count else ""
            log.warning("ondemand-profd: rank %d of job %s (uid %s): %s%s", info.rank, info.job, info.uid, why, more)
            self._logged[key] = (now, 0)
        else:
            self._logged[key] = (last, count + 1)


def auto_reason(value: Any) -> dict[str, Any] | None:
    """The why of an automatic capture (rank/autocapture.py), kept to its known fields and sizes."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {}
    if isinstance(value.get("why"), str):
        out["why"] = value["why"][:200]
    for key in ("ratio", "median_step_s"):
        if finite_number(value.get(key), 0.0, 1e9):
            out[key] = float(value[key])
    slow = value.get("slow_steps_s")
    if isinstance(slow, list):
        out["slow_steps_s"] = [float(x) for x in slow[:32] if finite_number(x, 0.0, 1e9)]
    if bounded_int(value.get("detected_at_step"), -1, MAX_STEP):
        out["detected_at_step"] = value["detected_at_step"]
    return out


class RankCaptures:
    """The captures of one daemon (Service.rank_captures) that its ranks opened: the auto_capture intake and
    the "opened" event of trigger-file and signal windows."""

    def __init__(self, service: Any) -> None:  # host/service.py Service (which imports this module)
        self.service = service
        self.budget = AutoBudget()
        self.opened_budget = AutoBudget(OPENED_PER_JOB_HOUR, OPENED_PER_UID_HOUR, "trigger-file and signal captures")

    def on_auto_capture(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        """A rank opened an automatic window on itself: open the same one on the rank of its job whose step
        time is closest to the job's median, and keep a capture record of both (ondemandctl list, show).
        The rank names the capture, so the id must be its own (`auto-...-r{rank}-{pid}`), new, and within the
        daemon's budget for its job and its uid (AutoBudget): a rank cannot replace, pre-empt or flood out
        anyone's records."""
        info = self.service.registry.by_route.get(route)
        if info is None:
            return encode("register")
        try:
            window = window_from_wire(msg["window"])
            baseline = isinstance(window.requested.get("auto_baseline"), dict)
            kind = "baseline" if baseline else "auto"
            pids = own_pids(info)
            if not window.capture_id.startswith(f"{kind}-") or not any(
                    window.capture_id.endswith(f"-r{info.rank}-{pid}") for pid in pids):
                raise ValueError(f"capture id {window.capture_id!r} is not {kind}-...-r{info.rank}-{info.pid}")
        except ValueError as exc:
            self.budget.refused(info, "bad", f"bad automatic window: {exc}")
            return None
        wall, now = time.time(), time.monotonic()
        running = None if baseline else self._running_automatic(info)
        if running is not None:  # another rank of the job slowed down at the same time: one capture, not one each
            # (logged once a minute per uid, then counted: one line per request let a rank's flood of them fill
            # the daemon's log, and a stderr nobody read blocked the daemon)
            self.budget.refused(info, "covered", f"asked for an automatic capture; {running.capture_id} of the job "
                                f"is running (steps {running.data.get('window')}): that one covers it")
            return None
        held = self.budget.take(info, now)
        if held:
            self.budget.refused(info, "budget", f"automatic capture {window.capture_id} not recorded: {held}")
            return None
        # the rank's own job, (uid, id): jobs() names it owner:id where another user's job has the same id, and
        # jobs().get(info.job) then found no rank (the baseline was of the asking rank alone, no reference rank)
        ranks = sorted((r for r in self.service.registry.by_route.values() if r.key == info.key), key=lambda r: r.rank)
        if baseline:  # the job's baseline on this host: the same window on every rank of it registered here
            ref = None
            others = sorted((r for r in ranks if r is not info), key=lambda r: r.rank)
            targets = [info, *others]
            request: dict[str, Any] = {"auto_baseline": auto_reason(window.requested.get("auto_baseline")),
                                       "asked_by_rank": info.rank}
        else:  # every rank of the job here: who made whom wait needs them all; the asker waits for the daemon's
            ref = reference_rank(info, ranks)
            others = sorted((r for r in ranks if r is not info), key=lambda r: r.rank)
            targets = [info, *others]
            request = {"auto": auto_reason(window.requested.get("auto")), "slow_rank": info.rank,
                       "reference_rank": ref.rank if ref is not None else None}
        assert window.end is not None  # window_from_wire checked it
        plan = Plan(window.start, window.end, {t.rank: t.estimated_step(wall) for t in targets}, note=(
            f"automatic baseline of job {info.job}, asked by rank {info.rank}" if baseline else
            f"automatic: rank {info.rank} slowed down; reference rank {ref.rank}" if ref is not None
            else f"automatic: rank {info.rank} slowed down; no other rank to compare with"))
        marks: dict[str, Any] = {"baseline": True}  # the job's baseline once it records something (records.py)
        if not baseline:
            known = self.service.store.baseline_of(info.job, info.uid)
            # compared with it once done (show, report, and the daemon's log line)
            marks = {"compare_with": known.capture_id} if known is not None else {}
        try:
            record = self.service.open_capture(window.capture_id, info.job, request, plan, window.options.as_dict(),
                                               targets, wall, kind="auto_baseline" if baseline else "auto",
                                               owner=info.uid if info.uid is not None else -1, **marks)
        except RecordRefused as exc:
            self.budget.refused(info, "store", f"automatic capture {window.capture_id} not recorded: {exc}")
            return None
        steps = window.end - window.start
        for other in others if baseline else targets:  # (a baseline's asker scheduled its own window already)
            requested = {"auto_baseline": request["auto_baseline"], "steps": steps, "asked_by_rank": info.rank} \
                if baseline else {"auto": request["auto"], "steps": steps, "slow_rank": info.rank} | (
                    {"reference_for_rank": info.rank} if other is ref else {})
            self.service.send(other.route, encode("capture", window={**window.to_wire(), "requested": requested}))
        if baseline:
            log.info("ondemand-profd: automatic baseline %s of job %s: %d rank(s), steps [%d, %d), asked by rank %d",
                     window.capture_id, info.job, len(targets), window.start, window.end, info.rank)
        else:
            log.info("ondemand-profd: automatic capture %s: rank %d of job %s slowed down; on %d rank(s) here, "
                     "reference rank %s%s", window.capture_id, info.rank, info.job, len(targets),
                     ref.rank if ref is not None else "none",
                     f"; compared with baseline {record.data['compare_with']} once done"
                     if record.data.get("compare_with") else "; no baseline to compare with yet")
        return None

    def _running_automatic(self, info: "RankInfo") -> Any:
        """A running automatic capture (not a baseline) of this rank's job and owner, if any."""
        for record in self.service.store.records.values():
            d = record.data
            if record.status == "running" and d["job"] == info.job and record.owner == info.uid and \
                    str(record.capture_id).startswith("auto-"):
                return record
        return None

    def on_opened(self, info: "RankInfo", capture_id: str, data: Any, wall: float) -> None:
        """A rank opened a window from its trigger file or a signal (its "opened" event, sent before the
        window's first progress): recorded, with a part for each rank of the job on this host that says it
        opened the same capture (every rank reads the same trigger file: one record, `file-<version>`). The
        events that follow move the parts as for the daemon's own windows.

        What the rank says is checked (issue 30's attack review): the id of its kind (a signal's names this
        rank's pid); the request kept to its known fields as plain values (a nested one made `list`'s reply
        too deep for the CLI, for every user); the note printable on one line; a part joins only a running
        record of its own job and owner, for the same steps; new records within a per-job and per-uid hourly
        budget. Refusals are logged once a minute per uid and kind; the window itself goes on on the rank."""
        try:
            window, source = self._opened_window(info, capture_id, data)
        except ValueError as exc:
            self.opened_budget.refused(info, "bad", f"opened window {capture_id[:80]} not recorded: {exc}")
            return
        record = self.service.store.records.get(capture_id)
        if record is not None:
            self._join(info, record, window, source, wall)
            return
        held = self.opened_budget.take(info, time.monotonic())
        if held:
            self.opened_budget.refused(info, "budget", f"opened window {capture_id} not recorded: {held}")
            return
        assert window.end is not None  # window_from_wire checked it
        requested = opened_request(window.requested)
        what = "trigger file" if source == "file" else f"signal {requested.get('signal', '')}".rstrip()
        note = " ".join(printable(window.note).split())[:MAX_NOTE]
        plan = Plan(window.start, window.end, {info.rank: info.estimated_step(wall)},
                    note=f"opened by rank {info.rank}'s {what}" + (f"; {note}" if note else ""))
        try:
            self.service.open_capture(capture_id, info.job, requested, plan, window.options.as_dict(), [info], wall,
                                      kind=source, owner=info.uid if info.uid is not None else -1)
        except RecordRefused as exc:
            self.opened_budget.refused(info, "store", f"{what} capture {capture_id} not recorded: {exc}")
            return
        log.info("ondemand-profd: capture %s: opened by rank %d of job %s (%s), steps [%d, %d)", capture_id,
                 info.rank, info.job, what, window.start, window.end)

    @staticmethod
    def _opened_window(info: "RankInfo", capture_id: str, data: Any) -> tuple[Any, str]:
        """The window of an "opened" event and its kind; ValueError says what is wrong with it."""
        wire = data.get("window") if isinstance(data, dict) else None
        if not isinstance(wire, dict):
            raise ValueError("no window")
        window = window_from_wire(wire)
        source = window.source
        if source not in OPENED_KINDS or window.capture_id != capture_id:
            raise ValueError(f"capture id {capture_id[:80]!r} is not a trigger file's or a signal's")
        if source == "file" and not FILE_ID.fullmatch(capture_id):
            raise ValueError("a trigger file's id is file-<16 hex digits>")
        if source == "signal":
            m = SIGNAL_ID.fullmatch(capture_id)
            pids = own_pids(info)
            if m is None or int(m.group(1)) not in pids:
                raise ValueError(f"a signal's id is signal-<pid>-<ms> with this rank's pid ({info.pid})")
        return window, source

    def _join(self, info: "RankInfo", record: Any, window: Any, source: str, wall: float) -> None:
        """Another rank of the job opened the same capture: its part, if the record is of this kind, job and
        owner, still running, for the same steps, and has no part of this rank yet."""
        if record_source(record.data) != source or record.data["job"] != info.job or record.owner != info.uid:
            self.opened_budget.refused(info, "another", f"opened window {record.capture_id} not recorded: that "
                                       "id is another job's or owner's record")
            return
        if record.status != "running" or record.part(info.rank) is not None or \
                record.data["window"] != [window.start, window.end]:
            log.debug("ondemand-profd: rank %d of job %s: opened %s not joined (settled, joined already, or other "
                      "steps)", info.rank, info.job, record.capture_id)
            return
        record.add_part({"rank": info.rank, "host": info.host, "pid": info.pid, "uid": info.uid}, wall,
                        info.estimated_step(wall))
        self.service.changed(record)


def own_pids(info: "RankInfo") -> set[int]:
    """The pids a rank names its own captures with: the daemon's view of it and, in a pod, its own."""
    return {info.pid, getattr(info, "ns_pid", None) or info.pid}


def opened_request(requested: Any) -> dict[str, Any]:
    """What a rank says it was asked for (a trigger file's request, a signal's name), kept to the request's
    known fields as plain values: ints and booleans, short printable one-line strings, a list of ranks; a
    signal name that is one. Anything else is dropped."""
    out: dict[str, Any] = {}
    if not isinstance(requested, dict):
        return out
    known = set(request_fields()) | set(OPENED_EXTRA)
    for key, value in list(requested.items())[:64]:
        if key not in known:
            continue
        if key == "signal":
            if isinstance(value, str) and SIGNAL_NAME.fullmatch(value):
                out[key] = value
        elif key == "ranks":
            if isinstance(value, list) and len(value) <= 1024 and all(bounded_int(r, -1, 1 << 30) for r in value):
                out[key] = value
        elif isinstance(value, bool) or bounded_int(value, -(1 << 62), 1 << 62):
            out[key] = value
        elif isinstance(value, str) and len(value) <= 128 and value.isprintable():
            out[key] = value
    return out


def reference_rank(slow: "RankInfo", ranks: list["RankInfo"]) -> "RankInfo | None":
    """The rank whose recent step time is closest to the job's median (the slow rank itself excluded)."""
    others = [r for r in ranks if r.route != slow.route]
    timed = [(r, r.step_time) for r in others if r.step_time]
    if not timed:
        return others[0] if others else None
    median = statistics.median(r.step_time for r in ranks if r.step_time)
    return min(timed, key=lambda rt: (abs(rt[1] - median), rt[0].rank))[0]


