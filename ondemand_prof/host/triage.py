"""The daemon's side of triage (ondemandctl stacks, memory, flight-recorder): requests waiting for their ranks'
answers (TriageBook), each answer kept with only its checked fields and a container's paths in this host's
terms, the native-dump fallback for ranks that cannot answer, and the pure functions that fold many ranks'
answers into something a person reads: identical stacks grouped with a rank list, and the collective sequence
numbers some ranks entered and others did not. (Each rank's step time against its job's median, for status
and the metrics, is host/stalls.py's.)

A request is answered once every target rank has answered, or at its deadline. Before the deadline, ranks that
did not answer (their agent thread cannot run: a thread holds the GIL in native code) and that registered a
native dump signal are sent that signal; faulthandler, in C, writes every thread's stack to their file, which
is read and returned marked as such.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..core.processes import ProcessIdentity, process_identity, same_process, signal_process
from ..core.rootpath import read_beneath_root, size_beneath_root
from ..core.protocol import native_dump_signal, reply_ok
from ..core.ranks import spans
from ..core.bounds import MAX_STEP, bounded_int, finite_number

if TYPE_CHECKING:
    from .registry import RankInfo

log = logging.getLogger("ondemand_prof.daemon")

NATIVE_WAIT_S = 0.5  # from sending the dump signal to reading what faulthandler wrote
# requests out at once: each answer (up to 56 KiB of stacks) is allocated by libzmq's I/O thread and freed by the
# loop, and 4096 ranks asked at once raised the daemon's peak by ~500 MiB (glibc's thread arenas), in waves by
# ~220 (docs/benchmarks.md, stop 27); each answer lets the next rank be asked. A host of 8-16 ranks is one wave
TRIAGE_WAVE = 256
SLOT_S = 1.0  # a rank silent this long frees its place in the wave (its answer is still taken when it comes)
MAX_NATIVE_BYTES = 256 * 1024


@dataclass
class Target:
    rank: int
    host: str
    pid: int
    local: bool  # same host and pid namespace as the daemon: a signal can reach it
    native: dict[str, Any] | None  # {"file": path} from the rank's registration: it listens for the dump signal
    process: ProcessIdentity | None = None  # the registered process (pid, start time, uid): the only one signalled
    uid: int | None = None  # the rank's uid (the kernel's word): the dump file must be that user's
    root: str = "/"  # where the rank's paths start for the daemon (a container's: /proc/PID/root)


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
    request: bytes = b""  # the message each target rank is sent, in waves (TRIAGE_WAVE)
    unsent: deque[bytes] = field(default_factory=deque)  # routes not asked yet, in rank order
    asked: dict[bytes, float] = field(default_factory=dict)  # routes asked and not answered -> monotonic time

    def __post_init__(self) -> None:
        if self.action == "stacks" and self.folder is None:
            self.folder = StackFolder()

    @property
    def complete(self) -> bool:
        return len(self.results) >= len(self.targets)


def target_of(info: "RankInfo", host: str) -> Target:
    native = getattr(info, "native_dump", None)
    return Target(info.rank, info.host, info.pid, is_local(info),
                  native if isinstance(native, dict) else None, getattr(info, "process", None), info.uid,
                  getattr(info, "fs_root", None) or "/")


def is_local(info: "RankInfo") -> bool:
    """Whether the rank's process is one this daemon can see and signal: its pid is the kernel's word, the very
    process that connected over the unix socket (a process of this host, in a pod with a host name of its own
    too), and exists here. A host name is a rank's word: a root pod that said this host's name had the daemon
    signal a node process of its choosing (issue 41, 1)."""
    return info.pid_visible and getattr(info, "kernel_pid", False)


def native_dump_problem(native: Any, pid: int) -> str | None:
    """Why a registration's native_dump is not taken: the signal is the daemon's own (core/protocol.py), never
    the rank's, and the file is faulthandler's file of that pid, named as rank/triage.py names it."""
    if not isinstance(native, dict):
        return "not an object"
    if native.get("signal") != native_dump_signal():
        return f"signal {native.get('signal')!r} is not the native-dump signal {native_dump_signal()}"
    path = native.get("file")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096 or "/../" in path or \
            os.path.basename(path) != f"native-stacks-{pid}.txt":
        return f"file {str(path)[:200]!r} is not an absolute native-stacks-{pid}.txt"
    return None


SILENT_KEEP_S = 600.0  # how long a rank whose heartbeats stopped (its process still there) stays reachable


class TriageBook:
    """Pending triage requests of one daemon (Service.triage), and the ranks whose heartbeats stopped while
    their process lives on: a rank hung with the GIL held is exactly the one whose stack is wanted."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.pending: dict[str, Pending] = {}
        self.silent: dict[tuple[str, int], tuple["RankInfo", float]] = {}  # (job, rank) -> (info, since)

    def registered(self, info: "RankInfo") -> None:
        """At registration: which process this is (pid, start time, uid, read now from /proc, so a pid reused
        later is told apart), and whether its native dump can be asked for."""
        local = is_local(info)
        info.process = process_identity(info.pid) if local else None
        if info.process is not None and info.uid is not None and info.process.uid != info.uid:
            # never signalled, whoever asks: pid {pid} is another user's process (registered by root for another
            # uid, or a pid taken over since the kernel recorded it)
            log.warning("ondemand-profd: rank %d of job %s: pid %d is a process of uid %d, not of the rank's uid %d: "
                        "it is never signalled", info.rank, info.job, info.pid, info.process.uid, info.uid)
            info.process = None
        if info.native_dump is not None:
            problem = native_dump_problem(info.native_dump, info.ns_pid or info.pid)
            if problem is None and info.process is None:
                problem = "its process is not visible from this daemon"
            if problem:
                log.warning("ondemand-profd: rank %d of job %s: no native dump: %s", info.rank, info.job, problem)
                info.native_dump = None
            else:
                info.native_dump = {"file": info.native_dump["file"]}

    def forget_later(self, info: "RankInfo", reason: str, now: float) -> None:
        if reason.startswith("no heartbeat") and same_process(getattr(info, "process", None)):
            self.silent[(info.job, info.rank)] = (info, now)

    def silent_ranks(self, job: str | None, now: float) -> list["RankInfo"]:
        """Ranks of `job` (any job when None) silent for less than SILENT_KEEP_S whose process is still the one
        that registered (not exited, its pid not reused)."""
        out = []
        for key, (info, since) in list(self.silent.items()):
            if now - since > SILENT_KEEP_S or not same_process(getattr(info, "process", None)):
                del self.silent[key]
            elif job in (None, info.job):
                out.append(info)
        return sorted(out, key=lambda i: i.rank)

    def add(self, pending: Pending, now: float) -> None:
        """Take a request whose `unsent` routes are to be sent `request`; the first wave leaves now."""
        self.pending[pending.triage_id] = pending
        self._ask(pending, now)

    def _ask(self, p: Pending, now: float) -> None:
        """Send the request to more ranks while fewer than TRIAGE_WAVE are waited on (all of them once the
        answers are due: a timeout too short for the ranks' number gives up the bound, not ranks)."""
        while p.unsent and (len(p.asked) < TRIAGE_WAVE or now >= p.answer_by):
            route = p.unsent.popleft()
            self.service.send(route, p.request)
            p.asked[route] = now

    def on_result(self, route: bytes, msg: dict[str, Any]) -> None:
        p = self.pending.get(msg["triage_id"])
        target = p.targets.get(route) if p else None
        if p is None or target is None or target.rank in p.results:
            return None  # late (answered at its deadline), not ours, or said twice
        result = in_host_terms(clean_result(p.action, msg["result"]), target)
        p.results[target.rank] = p.folder.add(target.rank, result) if p.folder is not None else result
        if p.complete:
            self._answer(p)
        elif p.asked.pop(route, None) is not None and p.unsent:
            self._ask(p, time.monotonic())
        return None

    def tick(self, now: float) -> None:
        for p in list(self.pending.values()):
            if p.unsent:
                for route in [r for r, at in p.asked.items() if now - at >= SLOT_S]:
                    del p.asked[route]
                self._ask(p, now)
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
            signum = native_dump_signal()
            try:
                offset = size_beneath_root(path, t.uid, root=t.root)
                why = "no native-dump signal here" if signum is None or t.process is None else \
                    signal_process(t.process, signum)
            except OSError as exc:
                why = str(exc)
            if why:
                p.results[t.rank] = {"ok": False, "method": "none", "error": f"no answer, and no native dump: {why}"}
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
                p.results[t.rank] = read_native(*p.native_sent[t.rank], t.uid, t.root)
            else:
                p.results[t.rank] = {"ok": False, "method": "none", "error": "no answer before the timeout"
                                     + ("" if p.action != "stacks" else _why_no_native(t))}
        try:
            data = p.finish(p)
        except Exception as exc:  # noqa: BLE001 - the CLI still gets an answer
            log.exception("ondemand-profd: triage %s: summarising failed", p.action)
            data = {"error": f"internal error: {exc}", "ranks": {str(k): v for k, v in p.results.items()}}
        self.service.send(p.route, reply_ok(p.request_id, data))


# ----------------------------------------------------------------------------------------------------------
# A rank's answer, rebuilt from checked fields only: the reply's folding (group_stacks, the flight-recorder
# summary) and ondemandctl's console then never meet a shape they cannot handle


def _s(value: Any, limit: int, default: str = "") -> str:
    return value[:limit] if isinstance(value, str) else default


def _i(value: Any, lo: int = 0, hi: int = 1 << 62) -> int | None:
    return value if bounded_int(value, lo, hi) else None


def _or_empty(value: Any, kind: type) -> Any:
    """`value` when it is a `kind` (dict, list), else an empty one."""
    return value if isinstance(value, kind) else kind()


class _Malformed(ValueError):
    pass


def _need(value: Any, what: str) -> Any:
    if value is None:
        raise _Malformed(what)
    return value


def _frames(frames: Any) -> list[list[Any]]:
    if not isinstance(frames, list):
        raise _Malformed("frames")
    out = []
    for f in frames[:256]:
        if not isinstance(f, list) or len(f) < 3 or not isinstance(f[0], str) or not isinstance(f[2], str):
            raise _Malformed("a frame")
        out.append([f[0][:1024], _i(f[1], 0, 1 << 31) or 0, f[2][:512], _s(f[3] if len(f) > 3 else "", 512)])
    return out


def _threads(threads: Any) -> list[dict[str, Any]]:
    if not isinstance(threads, list):
        raise _Malformed("threads")
    out = []
    for t in threads[:MAX_THREADS_KEPT]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _Malformed("a thread")
        frames = _frames(t.get("frames"))
        out.append({"name": t["name"][:200], "main": t.get("main") is True, "collector": t.get("collector") is True,
                    "own": t.get("own") is True,
                    "daemon": t.get("daemon") if isinstance(t.get("daemon"), bool) else None,
                    "depth": max(_i(t.get("depth"), 0, 1 << 31) or 0, len(frames)), "frames": frames})
    return out


def _memory(res: dict[str, Any]) -> dict[str, Any]:
    summary = _or_empty(res.get("summary"), dict)
    steps = res.get("steps")
    if not (isinstance(steps, list) and len(steps) == 2 and all(_i(x, -1, MAX_STEP) is not None for x in steps)):
        raise _Malformed("steps")
    clean = {k: _need(_i(summary.get(k)), k) for k in ("reserved_bytes", "allocated_bytes", "history_entries")}
    clean["segments"] = _i(summary.get("segments")) or 0
    actions = _or_empty(summary.get("actions"), dict)
    clean["actions"] = {str(k)[:64]: v for k, v in list(actions.items())[:32] if _i(v) is not None}
    blocks = _or_empty(summary.get("largest_blocks"), list)
    clean["largest_blocks"] = [{"bytes": _i(b.get("bytes")) or 0, "where": _s(b.get("where"), 512)}
                               for b in blocks[:5] if isinstance(b, dict)]
    return {"path": _need(_s(res.get("path"), 4096) or None, "path"), "bytes": _need(_i(res.get("bytes")), "bytes"),
            "steps": steps, "device": _s(res.get("device"), 64), "summary": clean,
            "max_entries": _i(res.get("max_entries")), "stacks": _s(res.get("stacks"), 16),
            "open_with": _s(res.get("open_with"), 200)}


def _flight_recorder(res: dict[str, Any]) -> dict[str, Any]:
    entries = res.get("entries")
    if not isinstance(entries, list):
        raise _Malformed("entries")
    clean = []
    for e in entries[:FR_ENTRIES_KEPT]:
        if not isinstance(e, dict) or _i(e.get("seq"), -1) is None:
            raise _Malformed("an entry")
        clean.append({"pg": _s(e.get("pg"), 128, "?"), "pg_desc": _s(e.get("pg_desc"), 256), "seq": e["seq"],
                      "p2p_seq": _i(e.get("p2p_seq"), -1) if _i(e.get("p2p_seq"), -1) is not None else -1,
                      "is_p2p": e.get("is_p2p") is True, "name": _s(e.get("name"), 256),
                      "state": _s(e.get("state"), 32)})
    status = _or_empty(res.get("pg_status"), dict)
    return {"path": _need(_s(res.get("path"), 4096) or None, "path"), "bytes": _i(res.get("bytes")) or 0,
            "version": _s(res.get("version"), 32), "entries": clean,
            "total_entries": _i(res.get("total_entries")) or len(clean),
            "pg_status": {str(k)[:128]: {str(kk)[:64]: vv for kk, vv in list(v.items())[:16] if _i(vv, -1) is not None}
                          for k, v in list(status.items())[:64] if isinstance(v, dict)}}


MAX_THREADS_KEPT = 64
FR_ENTRIES_KEPT = 256


def clean_result(action: str, res: Any) -> dict[str, Any]:
    """A rank's triage answer with only checked fields (strings cut, numbers bounded); an answer that claims
    success but lacks what it needs becomes a failure that says so."""
    if not isinstance(res, dict):
        return {"ok": False, "method": "none", "error": "malformed answer from the rank: not an object"}
    base: dict[str, Any] = {"ok": res.get("ok") is True, "method": "python" if action == "stacks" else "none"}
    if isinstance(res.get("took_ms"), (int, float)) and finite_number(res["took_ms"], 0, 1e9):
        base["took_ms"] = res["took_ms"]
    if _i(res.get("current_step"), -1, MAX_STEP) is not None:
        base["current_step"] = res["current_step"]
    if not base["ok"]:
        base.update(method="none", error=_s(res.get("error"), 2000, "the rank gave no reason"))
        if res.get("unavailable") is True:
            base["unavailable"] = True
        return base
    try:
        if action == "stacks":
            base.update(threads=_threads(res.get("threads")), trimmed=res.get("trimmed") is True)
        elif action == "memory":
            base.update(_memory(res))
        else:
            base.update(_flight_recorder(res))
    except _Malformed as exc:
        return {"ok": False, "method": "none", "error": f"malformed answer from the rank: {exc} missing or malformed"}
    return base


def _why_no_native(t: Target) -> str:
    if not t.native:
        return " (the rank registered no native dump signal: its signal was taken, or no faulthandler)"
    if not t.local:
        return " (the rank is not in this daemon's pid namespace: no signal can reach it)"
    return ""


def in_host_terms(result: dict[str, Any], target: Target) -> dict[str, Any]:
    """A rank in a container names the file it wrote (a memory snapshot, a flight-recorder dump) as its own
    mount namespace has it: the path this host has it at, where a mount of this host holds the same file (the
    rank's own name kept as pod_path), else the path marked as the container's only."""
    path = result.get("path")
    if target.root == "/" or not isinstance(path, str) or not result.get("ok"):
        return result
    from .podpath import host_path

    seen = host_path(target.pid, path)
    if seen is None:
        return {**result, "path": f"{path} (in its container only)", "pod_only": True}
    return {**result, "path": seen, **({"pod_path": path} if seen != path else {})}


def read_native(path: str, offset: int, uid: int | None, root: str = "/") -> dict[str, Any]:
    """What faulthandler appended to the rank's file since `offset`: reached without following any link on the
    way, a regular file owned by the rank's own user (the path came from the rank; the daemon may run as root);
    `root`: where the rank's paths start (a container's root, its file as the rank names it)."""
    try:
        raw = read_beneath_root(path, uid, MAX_NATIVE_BYTES, offset, root=root)
    except OSError as exc:
        return {"ok": False, "method": "native", "error": f"cannot read the native dump {path}: "
                                                          f"{exc.strerror or exc}"}
    text = raw.decode("utf-8", errors="replace")
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
        self.own: set[str] = set()  # names of ondemand_prof's own threads (printed folded unless asked)

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
            if t.get("own"):
                self.own.add(name)
            self.by_thread.setdefault(name, {}).setdefault(key, []).append(rank)
        return {k: v for k, v in res.items() if k != "threads"}

    def threads(self) -> list[dict[str, Any]]:
        """Per thread name (the main thread first, ondemand_prof's own last), the stack most ranks share first,
        the odd ones after it."""
        out = []
        for name, stacks in sorted(self.by_thread.items(),
                                   key=lambda kv: (not kv[0].endswith("(main)"), kv[0] in self.own, kv[0])):
            ordered = sorted(((key, sorted(ranks)) for key, ranks in stacks.items()),
                             key=lambda kv: (-len(kv[1]), kv[1][0]))
            top = len(ordered[0][1])
            out.append({"thread": name, "own": name in self.own, "stacks": [  # odd: fewer than the most common
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
