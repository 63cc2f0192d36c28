"""Many daemons' answers made one (ondemandctl across hosts, and one host as a fan-out of one): which hosts
failed or never answered, one exit status, the one capture a partial id names, `list`s merged, one capture's
records merged into one record with one outcome (records.py's rule over every host's ranks), and the record of
a capture launched across hosts as it is followed. Pure: replies in, merged values out; no sockets, no printing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, cast

from ..core.files import iso_epoch
from ..core.protocol import FINAL_STATES
from .alignment import MISALIGNED, mark_misaligned, merge_recorded
from .client import EXIT_FAILED, EXIT_NO_DAEMON, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, CtlError
from .records import Plan
from .recordtypes import HostOutcome, Part, RecordSummary, RecordView
from .registry import RankInfo

if TYPE_CHECKING:
    from .client import Reply

Replies = dict[str, "Reply"]



def failures(replies: Replies, absent: Callable[["Reply"], bool] = lambda r: False) -> dict[str, str]:
    """The hosts that did not give an answer, and why (`absent`: errors that only mean "nothing here")."""
    return {n: r.error for n, r in replies.items() if not r.ok and not absent(r)}


def unanswered(replies: Replies) -> dict[str, str]:
    """The hosts that gave no answer (as opposed to an error reply): unreachable."""
    return {n: r.error for n, r in replies.items() if not r.ok and r.kind != "error"}


def no_capture(reply: "Reply") -> bool:
    return reply.kind == "error" and reply.error.startswith("no capture")


def no_live_job(reply: "Reply") -> bool:
    return reply.kind == "error" and reply.error.startswith("no live job")


def exit_across(failed: dict[str, str], replies: Replies) -> int:
    """Exit status: 3 when some hosts failed, 4 when none answered."""
    if not failed:
        return EXIT_OK
    return EXIT_NO_DAEMON if len(failed) == len(replies) else EXIT_PARTIAL


def one_capture(replies: Replies) -> Replies:
    """The hosts that have the capture (none, maybe); CtlError when a partial id means different captures on
    different hosts."""
    found = {n: r for n, r in replies.items() if r.ok}
    ids = {r.data["capture_id"] for r in found.values()}
    if len(ids) > 1:
        raise CtlError(f"the id matches different captures on different hosts ({', '.join(sorted(ids))}); give more "
                       "of it", EXIT_USAGE)
    return found


def nothing_found(replies: Replies) -> CtlError:
    """No host could act: what the daemons said, once each ("no capture ...", "already cancelled"). When some
    hosts did not answer, the exit status is partial: the capture may be on those (the caller names them)."""
    said = {r.error for r in replies.values() if r.kind == "error" and not no_capture(r)} or \
        {r.error for r in replies.values() if r.kind == "error"}
    quiet = any(r.kind != "error" for r in replies.values())
    return CtlError("; ".join(sorted(said)) or "no host answered", EXIT_PARTIAL if quiet else EXIT_FAILED)


def merge_status(statuses: list[str]) -> str:
    """One status from the hosts' (unreachable: a host that never answered counts as not done), before the
    alignment of all their ranks is judged (misaligned counts as done here: every rank of it wrote)."""
    if "running" in statuses:
        return "running"
    if all(s in ("done", MISALIGNED) for s in statuses):  # every rank wrote; whether alike is checked after
        return "done"
    if all(s == "cancelled" for s in statuses):
        return "cancelled"
    return "partial" if any(s in ("done", "partial", MISALIGNED) for s in statuses) else "failed"


def merged_status(statuses: list[str], misaligned: bool) -> str:
    """The status of one capture's records on several hosts: merge_status, then misaligned when some host's
    record is, or (`misaligned`) their ranks together recorded different steps: the rule of a record's own
    outcome (records.py CaptureRecord._settle, alignment.mark_misaligned), over every host's ranks."""
    status = merge_status(statuses)
    if status in ("done", "partial") and (MISALIGNED in statuses or misaligned):
        return MISALIGNED
    return status


def merge_lists(replies: Replies, limit: int) -> list[RecordSummary]:
    """`list` replies of several hosts -> one list, newest first: a capture across hosts (one id, a record on
    every host involved) once, with its ranks and states summed, its hosts, and one status (misaligned where
    the steps its hosts' ranks recorded differ, as `show` says)."""
    merged: dict[str, dict[str, Any]] = {}
    for name, reply in replies.items():
        for c in reply.data["captures"] if reply.ok else []:
            m = merged.setdefault(c["capture_id"], {**c, "ranks": 0, "states": {}, "hosts": [], "statuses": [],
                                                    "recorded": []})
            m["ranks"] += c["ranks"]
            m["hosts"].append(name)
            m["statuses"].append(c["status"])
            if isinstance(c.get("recorded"), list):
                m["recorded"].append(c["recorded"])
            for state, n in c["states"].items():
                m["states"][state] = m["states"].get(state, 0) + n
    for m in merged.values():
        m["recorded"] = merge_recorded(m["recorded"])
        m["status"] = merged_status(m.pop("statuses"), len(m["recorded"]) > 1)
    # (built as plain dicts: `statuses` is a key of the merge's own, gone by now)
    return cast(list[RecordSummary],
                sorted(merged.values(), key=lambda c: iso_epoch(c["created_at"]), reverse=True)[:limit])


def merged_record(found: dict[str, RecordView], failed: dict[str, str],
                  unreachable: dict[str, str] | None = None,
                  targets: dict[str, list[RankInfo]] | None = None) -> RecordView:
    """Records of one capture from several hosts -> one record (parts keyed by rank, each naming its daemon).

    `failed`: hosts that answered with an error (their ranks record nothing); `unreachable`: hosts that gave no
    answer (never, or not since some point: their ranks' last known state is kept, unfinished parts become
    `unreachable`). `targets` names the ranks of hosts with no record here, so that those ranks are listed."""
    unreachable = unreachable or {}
    first: Any = next(iter(found.values()), {})
    parts: dict[str, Part] = {}
    for name, data in found.items():
        for key, part in data["parts"].items():
            parts[key] = {**part, "daemon": name}
            if name in unreachable and part["state"] not in FINAL_STATES:
                lost = parts[key]  # (in this order: the keys' order in the record)
                lost["state"], lost["last_state"] = "unreachable", part["state"]
                lost["error"] = f"host {name} stopped answering: {unreachable[name]}"
    for name, ranks in (targets or {}).items():
        if name not in found and (name in failed or name in unreachable):
            for i in ranks:
                parts[str(i.rank)] = _lost_part(i, name, failed.get(name) or unreachable[name], name in failed)
    hosts: dict[str, HostOutcome] = {n: {"status": d["status"]} for n, d in found.items()}
    hosts.update({n: {"status": "failed", "error": e} for n, e in failed.items() if n not in found})
    hosts.update({n: {"status": "unreachable", "error": e} for n, e in unreachable.items()})
    # (no host's record at all: only these; capture_record adds the id, the job and the window)
    record = cast(RecordView, {**first, "parts": parts, "status": merge_status([h["status"] for h in hosts.values()]),
                               "hosts": hosts})
    record.pop("version", None)
    record.pop("misaligned", None)  # judged again over every host's ranks, by the record's own rule
    mark_misaligned(record)
    return record


def _lost_part(info: RankInfo, daemon: str, error: str, failed: bool) -> Part:
    state = "failed" if failed else "unreachable"
    return {"rank": info.rank, "host": info.host, "pid": info.pid, "daemon": daemon, "state": state,
            "error": f"host {daemon}: {error}", "history": [{"state": state}]}


def fail_host(data: RecordView, error: str) -> None:
    """A host's record whose daemon now refuses to talk about the capture: its unfinished ranks failed."""
    data["status"] = "failed"
    for part in data["parts"].values():
        if part["state"] not in FINAL_STATES:
            part["state"], part["error"] = "failed", error


@dataclass
class Launched:
    """A capture sent to every host: what each accepted (`found`: host -> record), which hosts answered with
    an error (`failed`) and which did not answer (`quiet`: the capture may have reached them or not), the
    plan, and how long sending took; `unanswered`: hosts that did not answer the status round (their ranks, if
    any, are not in the capture), `missing`: ranks of the job that no host that answered has."""

    capture_id: str
    job: str
    targets: dict[str, list[RankInfo]]
    plan: Plan
    found: dict[str, RecordView]
    failed: dict[str, str]
    sent_s: float
    quiet: dict[str, str] = field(default_factory=dict)
    unanswered: dict[str, str] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)


def capture_record(run: Launched, quiet: dict[str, str]) -> RecordView:
    """The one record of a capture across hosts, as followed: every host's parts, the hosts given up on
    (`quiet`), those that did not answer the status round and the ranks no host had, and the plan."""
    record = merged_record(run.found, run.failed, quiet, run.targets)
    record["capture_id"], record["job"] = run.capture_id, run.job
    record.setdefault("window", [run.plan.start_step, run.plan.end_step])
    if run.unanswered:  # hosts that did not answer the status round: their ranks (if any) are not in it
        record["unanswered"] = run.unanswered
        record["missing_ranks"] = run.missing
        if run.missing and record["status"] == "done":
            record["status"] = "partial"
    record["plan"] = {**run.plan.as_dict(), "sent_s": round(run.sent_s, 4)}
    return record
