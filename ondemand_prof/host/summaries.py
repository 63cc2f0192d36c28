"""Reports that scale with the cluster: each rank's post-processing writes summary.json beside its trace
(rank/postprocess.py); the daemon command `summaries` (host/commands/report.py) returns those of one
capture's parts on its host, read here from the paths in its record (bounded in size); ondemandctl merges them
across hosts (`merge_summaries`) without ever reading a trace over the network."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, cast

from ..core import safejson
from ..core.processes import same_process
from ..core.rootpath import open_beneath_root, read_beneath_root, read_fd
from ..core.text import printable
from ..core.summaryfile import MAX_SUMMARY_BYTES, read_summary
from ..core.tracedefs import SUMMARY_FILE

if TYPE_CHECKING:  # the report package is imported where it is used (the daemon never loads it)
    from ..report.model import Comparison, RankResult, Report

log = logging.getLogger("ondemand_prof.daemon")

__all__ = ["MAX_SUMMARY_BYTES", "read_summary", "part_summaries", "checked", "merge_summaries", "compare_records",
           "conclude_replies", "snapshot", "cached_summary"]

# what the daemon parsed, by the file's identity (issue 41, 3): the same captures compared again (each host of a
# report across hosts, `show` and `report AUTO` after an automatic capture settled) are not read again
METADATA_FILE = "metadata.json"  # beside summary.json in a rank's directory (rank/layout.py)
MAX_METADATA_BYTES = 1 << 20
CACHE_BYTES = 24 << 20  # the summaries' sizes on disk, together (parsed, a 512 KB one of steps is ~2 MB)
CACHE_ENTRIES = 512
_cache: collections.OrderedDict[tuple[int, ...], tuple[dict[str, Any], int]] = collections.OrderedDict()
_cache_bytes = 0
_cache_lock = threading.Lock()
cache_stats = {"hits": 0, "misses": 0}

# what a part of a record is read by, copied for the worker (snapshot)
PART_KEYS = ("rank", "host", "pid", "uid", "state", "path", "late_by", "trace", "steps", "window", "status", "error",
             "pod_only")
RECORD_KEYS = ("capture_id", "job", "window", "status", "options", "request", "source")


def snapshot(record: Any, registry: Any = None) -> dict[str, Any]:
    """What reading a record's summaries needs, copied on the daemon's loop for its worker (host/worker.py), which
    must not read the live record while the loop changes it: the record's fields and a copy of each part. A part
    only the rank's container sees (pod_only) is read through the root of its live process (`_root`: the root and
    the process's identity, from the registry), never on this host's `/` (issue 41, 6); none when its rank is no
    longer registered."""
    data = record.data if hasattr(record, "data") else record
    live: dict[tuple[int, Any], Any] = {}
    if registry is not None and any(p.get("pod_only") for p in data["parts"].values()):
        live = {(r.pid, r.uid): r for r in registry.by_route.values() if r.job == data["job"]}
    parts = {}
    for key, part in data["parts"].items():
        copy = {k: part.get(k) for k in PART_KEYS if k in part}
        if part.get("pod_only"):
            info = live.get((part.get("pid"), part.get("uid")))
            copy["_root"] = (info.fs_root, info.process) if info is not None and info.fs_root and \
                info.process is not None else None
        parts[key] = copy
    return {**{k: data.get(k) for k in RECORD_KEYS}, "parts": parts}


def cached_summary(rank_dir: str, owner: int | None, root: str = "/", process: Any = None) -> dict[str, Any]:
    """read_summary, remembered by the file's identity (device, inode, mtime, ctime, size: a file rewritten is
    another entry; ctime cannot be set back by its owner) within CACHE_BYTES. The file is opened as read_summary
    opens it (no link followed, a regular file of `owner`) every time; `root`: where the rank's paths start
    (/proc/PID/root of a rank in a container, checked to be still that `process` once the file is open). The
    dict returned is shared: never change it."""
    global _cache_bytes
    if not os.path.isabs(rank_dir):
        raise ValueError(f"not an absolute path: {rank_dir!r}")
    fd = open_beneath_root(os.path.join(rank_dir, SUMMARY_FILE), owner, root=root)
    try:
        if process is not None and not same_process(process):
            raise ValueError(f"its process (pid {process.pid}) has exited: the container's files are no longer "
                             "reachable from this host")
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                cache_stats["hits"] += 1
                return hit[0]
        if st.st_size > MAX_SUMMARY_BYTES:
            raise ValueError(f"{SUMMARY_FILE} is over {MAX_SUMMARY_BYTES} bytes, the limit")
        raw = read_fd(fd, MAX_SUMMARY_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_SUMMARY_BYTES:
        raise ValueError(f"{SUMMARY_FILE} is over {MAX_SUMMARY_BYTES} bytes, the limit")
    data = safejson.loads(raw, MAX_SUMMARY_BYTES)
    if not isinstance(data, dict):
        raise ValueError(f"{SUMMARY_FILE} does not hold a JSON object")
    with _cache_lock:
        cache_stats["misses"] += 1
        if key not in _cache:
            _cache[key] = (data, len(raw))
            _cache_bytes += len(raw)
        while _cache and (_cache_bytes > CACHE_BYTES or len(_cache) > CACHE_ENTRIES):
            _, (_, size) = _cache.popitem(last=False)
            _cache_bytes -= size
    return data


def _owner(part: dict[str, Any]) -> int | None:
    """Whose summary.json a part's must be: the uid its rank connected with (None: not known, a record from
    before uids were kept; links are refused all the same)."""
    uid = part.get("uid")
    return uid if isinstance(uid, int) and not isinstance(uid, bool) else None


def part_summaries(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per part of a capture record: its summary, or why there is none."""
    parts = []
    for part in sorted(record["parts"].values(), key=lambda p: p["rank"]):
        entry: dict[str, Any] = {"rank": part["rank"], "host": part["host"], "pid": part["pid"],
                                 "state": part["state"], "path": part.get("path"), "late_by": part.get("late_by"),
                                 "trace": part.get("trace"), "steps": part.get("steps"), "window": part.get("window"),
                                 "status": part.get("status")}
        entry.update(_summary_of(part))
        parts.append(entry)
    return parts


def checked(reply: dict[str, Any]) -> dict[str, Any]:
    """A `summaries` reply with each part's summary checked as the report reads it (report/checks.py): one that
    cannot stand for its trace (of another version, rank or capture; a field no report of ours writes) is
    dropped, and its part's error says why. The rank wrote it: the CLI checks what the daemon passed on."""
    from ..report.checks import summary_problem

    parts = []
    for part in reply["parts"]:
        if part.get("summary") is not None:
            why = summary_problem(part["summary"], rank=part["rank"], capture_id=reply["capture_id"],
                                  job_id=reply["job"])
            if why:
                part = {**{k: v for k, v in part.items() if k != "summary"}, "error": f"{SUMMARY_FILE}: {why}"}
        parts.append(part)
    return {**reply, "parts": parts}


def merge_summaries(replies: Iterable[tuple[str, dict[str, Any]]], *, already_checked: bool = False) -> Report:
    """(daemon name, `summaries` reply) pairs -> the report's data (what report/text.py renders): one capture
    group with a member per rank, the across-ranks figures computed by the report's own summarize_group; its
    header as the report from traces has it (the source, the steps recorded, each rank's folder found), so that
    both print the same but for where the capture id was read ("the daemon's record", not metadata.json)."""
    from ..report import summarize_group
    from ..report.grouping import by_capture_id

    t0 = time.monotonic()
    replies = [(daemon, reply if already_checked else checked(reply)) for daemon, reply in replies]
    members: list[dict[str, Any]] = []
    sources: list[dict[str, Any]] = []
    ran: list[tuple[int, Any, Any]] = []  # (rank, the window it ran as it said: moved where it began late, steps)
    first: dict[str, Any] | None = None
    for daemon, reply in replies:
        first = first or reply
        for part in reply["parts"]:
            member = {"kind": "capture", "rank": part["rank"], "host": part["host"], "daemon": daemon,
                      "pid": part["pid"], "path": part.get("path") or "", "capture_id": reply["capture_id"],
                      "job_id": reply["job"], "status": part.get("status") or part["state"],
                      "late_by": part.get("late_by"), "trace": part.get("trace"), "source": reply.get("source"),
                      "window": _rank_window(part.get("window"), part.get("steps")), "warnings": []}
            if part.get("summary") is not None:
                member.update({k: v for k, v in part["summary"].items() if k not in member or member[k] is None})
                where = f"{daemon}:{member['path']}" if len(replies) > 1 else member["path"]
                sources.append({"path": where, "format": SUMMARY_FILE, "status": "found", "capture": 1})
                ran.append((part["rank"], part.get("window"), part.get("steps")))
            else:
                member["error"] = part.get("error") or "no summary"
            members.append(member)
    if first is None:
        return {"captures": [], "problems": [], "ranks_read": 0, "seconds": 0.0}
    # each member is a RankResult: our fields, then the rank's summary.json (written by rank/postprocess.py)
    job, cid = first["job"], first["capture_id"]
    group = summarize_group((job, cid), cast("list[RankResult]", members),
                            by_capture_id(job, cid, "the daemon's record"))
    # the window as the lowest rank ran it (its part's; the report from traces reads its metadata): where every rank
    # began late, one moved the record's planned window
    _, window, recorded = min(ran, key=lambda r: r[0], default=(0, None, None))
    start, end = window if isinstance(window, list) and len(window) == 2 else first["window"]
    group["window"] = {"start": start, "end": end}
    if recorded:
        group["window"]["recorded_steps"] = recorded
    group["source"] = first.get("source")
    group["options"] = recorded_options(members, first.get("options"))
    sources.sort(key=lambda e: e["path"])
    return {"captures": [group], "problems": [], "sources": sources, "ranks_read": len(group["ranks"]),
            "seconds": round(time.monotonic() - t0, 3)}


def _rank_window(window: Any, steps: Any) -> dict[str, Any] | None:
    """A rank's window as its metadata says it (start, end, the steps recorded), from its part."""
    if not isinstance(window, list) or len(window) != 2:
        return None
    return {"start": window[0], "end": window[1], **({"recorded_steps": steps} if steps else {})}


def recorded_options(members: list[dict[str, Any]], asked: Any) -> Any:
    """The options a rank recorded with (its summary's, as a trace's metadata holds them: with_cpu is True on a CPU
    capture, whatever was asked), in the metadata's key order, so that the report from summaries prints what the
    report from traces prints; the options asked for (the daemon's record) where no summary holds them."""
    recorded = next((m["options"] for m in members if isinstance(m.get("options"), dict)), None)
    return dict(sorted(recorded.items())) if recorded is not None else asked


def compare_records(now: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """This host's part of a comparison (the daemon's `compare`, and an automatic capture's log line): each rank
    of `now` that wrote a summary here against the same rank of `base` (report/compare.py compare_rank), the
    ranks found on one side only, and why a rank could not be compared. Summaries are read as `summaries` reads
    them, one rank's two at a time (a host's 64 ranks of 512 KB each were all held at once); no trace is read. A
    rank is the record's part, whatever its summary says (a summary claiming another rank's number took that
    rank's place); a summary that does not hold what a comparison reads is that rank's problem, not the host's."""
    from ..report.compare import Unusable, compare_rank

    def by_rank(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {p["rank"]: p for p in record["parts"].values()}

    n, b = by_rank(now), by_rank(base)
    ranks, problems = [], {}
    for rank, part in sorted(n.items()):
        other = b.get(rank)
        if other is None:
            continue
        mine, theirs = (_summary_of(p) for p in (part, other))
        if "summary" not in mine or "summary" not in theirs:
            problems[str(rank)] = _not_compared(part, mine, "capture") if "summary" not in mine else \
                _not_compared(other, theirs, "baseline")
            continue
        try:
            row = compare_rank(theirs["summary"], mine["summary"])
        except Unusable as exc:
            problems[str(rank)] = f"{SUMMARY_FILE}: {exc}"
            continue
        row["rank"] = rank
        ranks.append(row)
    return {"capture_id": now["capture_id"], "baseline_id": base["capture_id"], "job": now["job"],
            "baseline_job": base["job"], "ranks": ranks, "problems": problems,
            "unmatched": {"baseline": sorted(r for r in b if r not in n), "now": sorted(r for r in n if r not in b)}}


def _not_compared(part: dict[str, Any], got: dict[str, Any], side: str) -> str:
    """Why a rank's side has no summary: a part that recorded nothing says so and why (issue 41, 12: a partial
    baseline's rank read as if it were another rank's problem, or missing from the job)."""
    if part["state"] != "done":
        why = part.get("error")
        return f"recorded nothing in the {side} ({part['state']}" + (f": {why})" if why else ")")
    return str(got.get("error")) if side == "capture" else f"baseline: {got.get('error')}"


def _summary_of(part: dict[str, Any]) -> dict[str, Any]:
    """{"summary"} of one part, or {"error"}: why it has none. A part only its rank's container sees is read
    through that container's root while its process lives (snapshot's `_root`), else it is unreadable here: its
    path names a file of the container, never one of this host (issue 41, 6: a root pod's part read the node's
    root-only files)."""
    if part["state"] != "done" or not part.get("path"):
        return {"error": part.get("error") or f"no trace ({part['state']})"}
    root, process = "/", None
    if part.get("pod_only"):
        if not part.get("_root"):
            return {"error": "no summary: it is in the rank's container's own filesystem, which this host reaches "
                             "only through the rank's live process (gone, or not seen by this daemon)"}
        root, process = part["_root"]
    try:
        return {"summary": cached_summary(part["path"], _owner(part), root, process)}
    except FileNotFoundError as exc:
        return {"error": _not_written(part["path"], _owner(part), root) or f"no summary: {exc}"}
    except (OSError, ValueError) as exc:
        return {"error": f"no summary: {exc}"}


NOT_WRITTEN_YET = "summary not written yet (its rank writes it after publishing the trace, at idle priority)"


def _not_written(rank_dir: str, owner: int | None, root: str) -> str | None:
    """Why a published part has no summary.json, from its metadata.json (issue 44: a rank publishes its trace and
    says "done" first, then writes the summary): not written yet, or not written and why; None when its metadata
    does not say (a rank of before, or a directory gone)."""
    try:
        raw = read_beneath_root(os.path.join(rank_dir, METADATA_FILE), owner, MAX_METADATA_BYTES + 1, root=root)
        meta = safejson.loads(raw, MAX_METADATA_BYTES)
    except (OSError, ValueError):
        return None
    state = meta.get("summary") if isinstance(meta, dict) else None
    if not isinstance(state, dict):
        return None
    if state.get("status") == "pending":
        return NOT_WRITTEN_YET
    if state.get("status") == "failed":
        return f"no summary: the rank could not write it ({printable(str(state.get('error'))[:300])})"
    return None


def conclude_replies(replies: Iterable[tuple[str, dict[str, Any]]]) -> "Comparison":
    """(daemon name, compare_records reply) pairs -> the comparison (report/compare.py conclude) of the ranks of
    every host. A rank whose baseline and capture were written on different hosts is said so, not compared."""
    from ..report.compare import conclude

    ranks: dict[Any, dict[str, Any]] = {}
    only: dict[str, set[int]] = {"baseline": set(), "now": set()}
    notes: list[str] = []
    first: dict[str, Any] | None = None
    for daemon, reply in replies:
        first = first or reply
        for r in reply["ranks"]:
            ranks[r["rank"]] = r
        for side in only:
            only[side].update(reply["unmatched"][side])
        notes += [f"rank {k} ({daemon}): not compared: {why}" for k, why in sorted(reply.get("problems", {}).items())]
    if first is None:
        raise ValueError("no host has both captures")
    moved = only["baseline"] & only["now"]
    if moved:
        notes.append(f"{len(moved)} rank(s) ({', '.join(map(str, sorted(moved)[:8]))}) wrote the baseline and the "
                     "capture on different hosts: not compared")
    unmatched = {side: sorted(only[side] - moved - set(ranks)) for side in only}
    result = conclude(list(ranks.values()), first["baseline_id"], first["capture_id"], unmatched=unmatched,
                      jobs=(first["baseline_job"], first["job"]))
    result["notes"] += notes
    return result
