"""The daemon's side of triage (ondemandctl stacks, memory, flight-recorder): requests waiting for their ranks'
answers, the native-dump fallback for ranks that cannot answer, and the pure functions that fold many ranks'
answers into something a person reads: identical stacks grouped with a rank list, the collective sequence
numbers some ranks entered and others did not, each rank's distance from the job's median step time.

A request is answered once every target rank has answered, or at its deadline. Before the deadline, ranks that
did not answer (their agent thread cannot run: a thread holds the GIL in native code) and that registered a
native dump signal are sent that signal; faulthandler, in C, writes every thread's stack to their file, which
is read and returned marked as such.
"""

from __future__ import annotations

import logging
import os
import stat
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..core.protocol import reply_ok
from ..core.ranks import spans

if TYPE_CHECKING:
    from .registry import RankInfo

log = logging.getLogger("ondemand_prof.daemon")

NATIVE_WAIT_S = 0.5  # from sending the dump signal to reading what faulthandler wrote
MAX_NATIVE_BYTES = 256 * 1024
SLOW_RATIO = 1.2  # a rank this much slower than its job's median step time is marked slow in status


@dataclass
class Target:
    rank: int
    host: str
    pid: int
    local: bool  # same host and pid namespace as the daemon: a signal can reach it
    native: dict[str, Any] | None  # {"signal": N, "file": path} from the rank's registration


@dataclass
class Pending:
    triage_id: str
    action: str
    route: bytes  # the CLI's
    request_id: Any
    job: str
    targets: dict[bytes, Target]  # by the rank's route
    answer_by: float  # monotonic: after this, ranks still silent get the native dump signal (stacks)
    deadline: float  # monotonic: reply with what there is
    finish: Callable[["Pending"], dict[str, Any]]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    native_sent: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (file, offset)
    folder: "StackFolder | None" = None  # stacks: answers folded as they arrive (their frames are not kept)

    def __post_init__(self) -> None:
        if self.action == "stacks" and self.folder is None:
            self.folder = StackFolder()

    @property
    def complete(self) -> bool:
        return len(self.results) >= len(self.targets)


def target_of(info: "RankInfo", host: str) -> Target:
    native = getattr(info, "native_dump", None)
    return Target(info.rank, info.host, info.pid, info.host == host and info.pid_visible,
                  native if isinstance(native, dict) else None)


SILENT_KEEP_S = 600.0  # how long a rank whose heartbeats stopped (its process still there) stays reachable


class TriageBook:
    """Pending triage requests of one daemon (Service.triage), and the ranks whose heartbeats stopped while
    their process lives on: a rank hung with the GIL held is exactly the one whose stack is wanted."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.pending: dict[str, Pending] = {}
        self.silent: dict[tuple[str, int], tuple["RankInfo", float]] = {}  # (job, rank) -> (info, since)

    def forget_later(self, info: "RankInfo", reason: str, now: float) -> None:
        if reason.startswith("no heartbeat") and info.pid_visible and info.host == self.service.host:
            self.silent[(info.job, info.rank)] = (info, now)

    def silent_ranks(self, job: str | None, now: float) -> list["RankInfo"]:
        """Ranks of `job` (any job when None) silent for less than SILENT_KEEP_S whose process still exists."""
        out = []
        for key, (info, since) in list(self.silent.items()):
            if now - since > SILENT_KEEP_S or not self.service.pid_check(info.pid, True):
                del self.silent[key]
            elif job in (None, info.job):
                out.append(info)
        return sorted(out, key=lambda i: i.rank)

    def add(self, pending: Pending) -> None:
        self.pending[pending.triage_id] = pending

    def on_auto_capture(self, route: bytes, msg: dict[str, Any]) -> bytes | None:
        """A rank opened an automatic window on itself: open the same one on the rank of its job whose step
        time is closest to the job's median, and keep a capture record of both (ondemandctl list, show)."""
        from ..core.protocol import encode
        from ..core.requests import window_from_wire
        from .records import CaptureRecord

        info = self.service.registry.by_route.get(route)
        if info is None:
            return encode("register")
        try:
            window = window_from_wire(msg["window"])
        except ValueError as exc:
            log.warning("ondemand-profd: bad automatic window from rank %d: %s", info.rank, exc)
            return None
        ranks = self.service.registry.jobs().get(info.job, [])
        ref = reference_rank(info, ranks)
        targets = [info] + ([ref] if ref is not None else [])
        wall = time.time()
        request = {"auto": window.requested.get("auto"), "slow_rank": info.rank,
                   "reference_rank": ref.rank if ref is not None else None}
        plan = {"start_step": window.start, "end_step": window.end, "lead_steps": 0, "late_ranks": [],
                "current_steps": {t.rank: t.estimated_step(wall) for t in targets},
                "note": (f"automatic: rank {info.rank} slowed down; reference rank {ref.rank}" if ref is not None
                         else f"automatic: rank {info.rank} slowed down; no other rank to compare with")}
        record = CaptureRecord.new(window.capture_id, info.job, request, plan, window.options.as_dict(),
                                   [{"rank": t.rank, "host": t.host, "pid": t.pid} for t in targets], wall)
        self.service.store.add(record)
        if ref is not None:
            self.service.send(ref.route, encode("capture", window={**window.to_wire(), "requested": {
                **window.requested, "reference_for_rank": info.rank}}))
        log.info("ondemand-profd: automatic capture %s: rank %d of job %s slowed down; reference rank %s",
                 window.capture_id, info.rank, info.job, ref.rank if ref is not None else "none")
        return None

    def on_result(self, route: bytes, msg: dict[str, Any]) -> None:
        p = self.pending.get(msg["triage_id"])
        target = p.targets.get(route) if p else None
        if p is None or target is None or target.rank in p.results:
            return None  # late (answered at its deadline), not ours, or said twice
        result = msg["result"]
        p.results[target.rank] = p.folder.add(target.rank, result) if p.folder is not None else result
        if p.complete:
            self._answer(p)
        return None

    def tick(self, now: float) -> None:
        for p in list(self.pending.values()):
            if now >= p.deadline:
                self._answer(p)
            elif now >= p.answer_by and p.action == "stacks" and not p.native_sent:
                self._signal_silent(p, now)

    def _signal_silent(self, p: Pending, now: float) -> None:
        """The dump signal goes only to a rank still registered (or silent, its process there) with the pid it
        registered: a rank that said bye may have unregistered nothing, but it is not ours to signal any more."""
        reachable = {(r.job, r.rank, r.pid) for r in self.service.registry.by_route.values()}
        reachable |= {(i.job, i.rank, i.pid) for i, _ in self.silent.values()}
        for t in p.targets.values():
            if t.rank in p.results or not t.native or not t.local or (p.job, t.rank, t.pid) not in reachable:
                continue
            path = str(t.native.get("file", ""))
            try:
                offset = os.stat(path).st_size
                os.kill(t.pid, int(t.native["signal"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                p.results[t.rank] = {"ok": False, "method": "none",
                                     "error": f"no answer, and no native dump: {exc}"}
                continue
            p.native_sent[t.rank] = (path, offset)
        if p.native_sent:
            p.deadline = min(p.deadline, now + NATIVE_WAIT_S)

    def _answer(self, p: Pending) -> None:
        self.pending.pop(p.triage_id, None)
        for t in p.targets.values():
            if t.rank in p.results:
                continue
            if t.rank in p.native_sent:
                p.results[t.rank] = read_native(*p.native_sent[t.rank], t.pid)
            else:
                p.results[t.rank] = {"ok": False, "method": "none", "error": "no answer before the timeout"
                                     + ("" if p.action != "stacks" else _why_no_native(t))}
        try:
            data = p.finish(p)
        except Exception as exc:  # noqa: BLE001 - the CLI still gets an answer
            log.exception("ondemand-profd: triage %s: summarising failed", p.action)
            data = {"error": f"internal error: {exc}", "ranks": {str(k): v for k, v in p.results.items()}}
        self.service.send(p.route, reply_ok(p.request_id, data))


def _why_no_native(t: Target) -> str:
    if not t.native:
        return " (the rank registered no native dump signal: its signal was taken, or no faulthandler)"
    if not t.local:
        return " (the rank is not in this daemon's pid namespace: no signal can reach it)"
    return ""


def read_native(path: str, offset: int, pid: int) -> dict[str, Any]:
    """What faulthandler appended to the rank's file since `offset`: only a regular file, not a link, owned by
    the rank's own user (the path came from the rank; the daemon may run as root)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return {"ok": False, "method": "native", "error": f"cannot open the native dump {path}: {exc.strerror}"}
    try:
        st = os.fstat(fd)
        owner = os.stat(f"/proc/{pid}").st_uid if os.path.isdir(f"/proc/{pid}") else st.st_uid
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
            return {"ok": False, "method": "native", "error": f"{path} is not the rank's own regular file"}
        os.lseek(fd, offset, os.SEEK_SET)
        text = os.read(fd, MAX_NATIVE_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    if not text.strip():
        return {"ok": False, "method": "native", "error": "no answer, and the native dump wrote nothing"}
    return {"ok": True, "method": "native", "text": text, "path": path,
            "note": "the rank's Python threads did not answer (a thread probably holds the GIL in native code): "
                    "this is faulthandler's dump of every thread, written without the GIL"}


# ----------------------------------------------------------------------------------------------------------
# Folding many ranks' answers (pure)

class StackFolder:
    """Identical thread stacks across ranks, folded as the ranks' answers arrive: the frames of a stack are kept
    once, with the ranks that have it, so a request's memory grows with the distinct stacks, not with the ranks
    (4096 answers of up to 56 KiB each were all held until the last one came)."""

    def __init__(self) -> None:
        self.by_thread: dict[str, dict[tuple[Any, ...], list[int]]] = {}
        self.frames_of: dict[tuple[Any, ...], list[Any]] = {}

    def add(self, rank: int, res: dict[str, Any]) -> dict[str, Any]:
        """Fold one rank's answer; returns what is kept of it per rank (how it answered, not its frames)."""
        if not res.get("ok") or res.get("method") != "python":
            return res
        for t in res.get("threads", []):
            if t.get("collector"):  # the collecting agent thread: the same everywhere, it says nothing
                continue
            key = tuple(tuple(f[:3]) for f in t["frames"])  # file, line, function: code text adds nothing
            self.frames_of.setdefault(key, t["frames"])
            name = t["name"] + (" (main)" if t.get("main") else "")
            self.by_thread.setdefault(name, {}).setdefault(key, []).append(rank)
        return {k: v for k, v in res.items() if k != "threads"}

    def threads(self) -> list[dict[str, Any]]:
        """Per thread name, the stack most ranks share first, the odd ones after it."""
        out = []
        for name, stacks in sorted(self.by_thread.items(), key=lambda kv: (not kv[0].endswith("(main)"), kv[0])):
            ordered = sorted(((key, sorted(ranks)) for key, ranks in stacks.items()),
                             key=lambda kv: (-len(kv[1]), kv[1][0]))
            top = len(ordered[0][1])
            out.append({"thread": name, "stacks": [  # odd: fewer ranks than the most common stack
                {"ranks": ranks, "rank_spans": spans(ranks), "odd": len(ranks) < top, "frames": self.frames_of[key]}
                for key, ranks in ordered]})
        return out


def group_stacks(results: dict[int, dict[str, Any]], folder: StackFolder | None = None) -> dict[str, Any]:
    """Identical thread stacks across ranks printed once, with their ranks (folded by `folder` as they arrived,
    or here from the full answers); per thread name, the stack most ranks share first, the odd ones after it."""
    if folder is None:
        folder = StackFolder()
        for rank, res in sorted(results.items()):
            folder.add(rank, res)
    threads = folder.threads()
    native = {r: dict(res) for r, res in results.items() if res.get("method") == "native"}
    failed = {r: res.get("error", "") for r, res in results.items() if not res.get("ok")}
    return {"threads": threads, "native": {str(r): v for r, v in sorted(native.items())},
            "failed": {str(r): v for r, v in sorted(failed.items())},
            "answered_python": sorted(r for r, res in results.items() if res.get("ok") and
                                      res.get("method") == "python"),
            "trimmed": sorted(r for r, res in results.items() if res.get("trimmed"))}


def summarize_flight_recorder(digests: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Across ranks, per process group: the collective sequence numbers some ranks entered and others did not
    (the usual picture of a hang: the laggards' last number is the one the others wait in), and each rank's
    last entered and completed numbers. Input: each rank's flight_recorder_digest (rank/triage.py)."""
    groups: dict[str, dict[str, Any]] = {}
    for rank, d in sorted(digests.items()):
        for e in d.get("entries", []):
            if e.get("is_p2p") or e.get("seq", -1) < 0:
                continue
            g = groups.setdefault(e["pg"], {"desc": e.get("pg_desc", ""), "seqs": {}, "ranks": set()})
            g["ranks"].add(rank)
            g["seqs"].setdefault(e["seq"], {})[rank] = (e["name"], e["state"])
    out = []
    for pg, g in sorted(groups.items()):
        ranks = sorted(g["ranks"])
        last = {r: max((s for s, by in g["seqs"].items() if r in by), default=-1) for r in ranks}
        low = min(min(g["seqs"]), min(_oldest(digests[r], pg) for r in ranks))  # before this, no rank has history
        mismatches = []
        for seq in sorted(g["seqs"]):
            by = g["seqs"][seq]
            missing = [r for r in ranks if r not in by and seq >= _oldest(digests[r], pg)]
            if missing:
                names = sorted({n for n, _ in by.values()})
                mismatches.append({"seq": seq, "collective": ", ".join(names), "entered": sorted(by),
                                   "entered_spans": spans(sorted(by)), "missing": missing,
                                   "missing_spans": spans(missing)})
        not_done = sorted({r for by in g["seqs"].values() for r, (_, st) in by.items() if st != "completed"})
        out.append({"pg": pg, "desc": g["desc"], "ranks": ranks, "last_seq": {str(r): s for r, s in last.items()},
                    "max_seq": max(last.values()), "min_seq": min(last.values()), "mismatches": mismatches[-32:],
                    "history_from_seq": low, "not_completed_on": spans(not_done)})
    return {"process_groups": out, "in_step": all(not g["mismatches"] for g in out)}


def _oldest(digest: dict[str, Any], pg: str) -> int:
    """The oldest sequence number a rank's (bounded) history still holds for a group: older ones say nothing."""
    seqs = [e["seq"] for e in digest.get("entries", []) if e.get("pg") == pg and not e.get("is_p2p")]
    return min(seqs) if seqs else 1 << 62


def reference_rank(slow: "RankInfo", ranks: list["RankInfo"]) -> "RankInfo | None":
    """The rank whose recent step time is closest to the job's median (the slow rank itself excluded)."""
    others = [r for r in ranks if r.route != slow.route]
    timed = [r for r in others if r.step_time]
    if not timed:
        return others[0] if others else None
    median = statistics.median(r.step_time for r in ranks if r.step_time)
    return min(timed, key=lambda r: (abs(r.step_time - median), r.rank))


def stragglers(ranks: list[dict[str, Any]], ratio: float = SLOW_RATIO) -> dict[str, Any]:
    """Each rank's step time against its job's median (adds vs_median and slow to each rank dict)."""
    times = [r["step_time_s"] for r in ranks if r.get("step_time_s")]
    median = statistics.median(times) if times else None
    for r in ranks:
        st = r.get("step_time_s")
        r["vs_median"] = round(st / median, 3) if st and median else None
        r["slow"] = bool(st and median and st > ratio * median)
    return {"median_step_time_s": median, "slow_ranks": [r["rank"] for r in ranks if r["slow"]],
            "slow_ratio": ratio}
