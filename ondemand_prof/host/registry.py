"""The daemon's view of the live ranks, and the choice of one absolute window for a set of them. Pure:
times are passed in, pid checks are a function the caller supplies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..core.ids import safe_id
from ..core.protocol import HEARTBEAT_S, RANK_TIMEOUT_S
from ..core.safejson import bounded_int, finite_number
from ..core.ranks import RankSpecError, parse_ranks, spans
from ..core.requests import RequestError, WindowDefaults

MAX_WINDOWS = 16  # windows a heartbeat may list (the running one and those queued)
MIN_STEP_TIME_S, MAX_STEP_TIME_S = 1e-6, 1e6  # step times outside these are noise or an attack: ignored
MAX_WALL = 1e11  # wall-clock seconds (the year 5138): a "began" past this is ignored
MAX_EXTRAPOLATED = 10**9  # steps an estimate may add to the last reported one
MAX_STEP_VALUE = 10**12
MAX_NAME = 256  # a job id or host name

# Time from the daemon sending a window to the rank's training thread holding it: ZMQ delivery (< 1 ms),
# the agent's 5 ms poll, and slack for a loaded host. The step running then must end before the window starts.
DELIVERY_S = 0.05
MAX_DELIVERY_S = 5.0  # what a learned delivery time may grow to (a stalled rank must not push windows far out)


class DeliveryTimes:
    """How long windows took to reach this host's ranks, learned from their answers, so that the next plan's
    lead covers a loaded host (whose agent threads wait for the GIL or a core) and the ranks begin on time.

    A rank answers "scheduled" with the step its training thread took the window at. The plan had it running
    step c then; taking it at c + 1 is on time, and every step beyond that is delivery the lead must cover.
    The estimate is the slowest delivery of the last `keep` captures, at least DELIVERY_S and at most
    MAX_DELIVERY_S: one loaded moment lengthens the lead of the next few captures, not of every one after."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self.slowest: dict[str, float] = {}  # capture id -> its slowest delivery (insertion order: oldest first)

    def learn(self, capture_id: str, planned_step: int, taken_step: int, step_time: float | None) -> None:
        if not step_time or not (MIN_STEP_TIME_S <= step_time <= MAX_STEP_TIME_S):
            return
        took = max(0, taken_step - planned_step - 1) * step_time
        self.slowest[capture_id] = max(took, self.slowest.get(capture_id, 0.0))
        while len(self.slowest) > self.keep:
            del self.slowest[next(iter(self.slowest))]

    def estimate(self) -> float:
        return min(MAX_DELIVERY_S, max([DELIVERY_S, *self.slowest.values()]))


class DeliveryBook:
    """DeliveryTimes per job: one job's ranks (another user's, perhaps) never lengthen another job's lead."""

    def __init__(self, max_jobs: int = 256) -> None:
        self.max_jobs = max_jobs
        self.jobs: dict[str, DeliveryTimes] = {}  # least recently learned first

    def of(self, job: str) -> DeliveryTimes:
        times = self.jobs.pop(job, None) or DeliveryTimes()
        self.jobs[job] = times
        while len(self.jobs) > self.max_jobs:
            del self.jobs[next(iter(self.jobs))]
        return times

    def keep_only(self, live_jobs: Iterable[str]) -> None:
        """Forget the jobs that have no live rank left."""
        live = set(live_jobs)
        for job in [j for j in self.jobs if j not in live]:
            del self.jobs[job]

    def estimate(self, job: str) -> float:
        times = self.jobs.get(job)
        return times.estimate() if times is not None else DELIVERY_S

    def longer(self, jobs: Iterable[str]) -> dict[str, float]:
        """The jobs among `jobs` whose learned delivery is longer than DELIVERY_S, and how long."""
        out = {job: round(self.estimate(job), 4) for job in jobs}
        return {job: seconds for job, seconds in out.items() if seconds > DELIVERY_S}


@dataclass
class RankInfo:
    route: bytes
    job: str
    rank: int
    world_size: int
    host: str
    pid: int
    step: int
    step_time: float | None = None
    step_began_at: float | None = None  # wall time the reported step began (same host: same clock)
    state: str = "idle"
    local_rank: int | None = None
    save_root: str = ""
    trigger_dir: str = ""  # the rank's trigger directory (its file trigger, status files)
    version: str = ""
    registered_at: float = 0.0
    last_seen: float = 0.0
    pid_visible: bool = False  # the rank's pid exists in our pid namespace, so a vanished pid means it died
    observed_step_time: float | None = None  # from the steps and times of the last two heartbeats
    defaults: WindowDefaults | None = None  # what the rank's configuration fills into a request
    windows: list[dict[str, Any]] | None = None  # running and queued windows, from the last heartbeat
    uid: int | None = None  # the connecting process's uid, from the kernel (SO_PEERCRED); None: not known
    native_dump: dict[str, Any] | None = None  # {"file"}: faulthandler's stack dump, checked by host/triage.py
    process: Any = None  # core.files.ProcessIdentity at registration (host/triage.py): pid reuse is told apart

    def estimated_step(self, wall: float) -> int:
        """The step this rank is probably running at wall time `wall` (extrapolated from its last heartbeat).

        Of the rank's own median step time and the rate seen between its last two heartbeats, the faster
        one is used: guessing a rank further ahead than it is only puts the window a little later, while
        guessing it behind (a median still weighed by slow first steps) makes it late."""
        rates = [t for t in (self.step_time, self.observed_step_time) if t]
        if not rates or self.step_began_at is None:
            return self.step
        return self.step + min(MAX_EXTRAPOLATED, max(0, int((wall - self.step_began_at) / min(rates))))

    def as_dict(self, now: float, wall: float) -> dict[str, Any]:
        return {"job": self.job, "rank": self.rank, "world_size": self.world_size, "host": self.host,
                "pid": self.pid, "step": self.estimated_step(wall), "reported_step": self.step,
                "step_time_s": self.step_time, "state": self.state, "local_rank": self.local_rank,
                "save_root": self.save_root, "trigger_dir": self.trigger_dir, "version": self.version, "last_seen_s": round(now - self.last_seen, 3),
                "registered_at": self.registered_at, "windows": self.windows or [],
                "max_window_steps": self.defaults.max_steps if self.defaults is not None else None}


class Registry:
    def __init__(self) -> None:
        self.by_route: dict[bytes, RankInfo] = {}
        self._route_of: dict[tuple[str, str, int], bytes] = {}  # (job, host, rank) -> route

    def register(self, route: bytes, msg: dict[str, Any], now: float, wall: float,
                 pid_alive: Callable[[int, bool], bool]) -> RankInfo:
        for name in ("job", "host"):
            if not 0 < len(msg[name]) <= MAX_NAME:
                raise ValueError(f"register: {name} must be 1 to {MAX_NAME} characters")
        local_rank = msg.get("local_rank")
        info = RankInfo(route=route, job=msg["job"], rank=msg["rank"], world_size=msg["world_size"], host=msg["host"],
                        pid=msg["pid"], step=msg["step"],
                        local_rank=local_rank if bounded_int(local_rank, 0, 1 << 20) else None,
                        save_root=str(msg.get("save_root", ""))[:4096], trigger_dir=str(msg.get("trigger_dir", ""))[:4096],
                        version=str(msg.get("version", ""))[:64],
                        registered_at=wall, last_seen=now)
        if msg.get("defaults") is not None:
            try:
                info.defaults = WindowDefaults.from_wire(msg["defaults"])
            except RequestError as exc:
                raise ValueError(f"register: bad window defaults: {exc}") from None
        native = msg.get("native_dump")
        if isinstance(native, dict) and type(native.get("signal")) is int and isinstance(native.get("file"), str):
            info.native_dump = {"signal": native["signal"], "file": native["file"][:4096]}
        self._update(info, msg)
        info.pid_visible = pid_alive(info.pid, False)
        # a restarted rank (same job and rank, new process) replaces the old entry
        key = (info.job, info.host, info.rank)
        old_route = self._route_of.get(key)
        if old_route is not None and old_route != route:
            self.by_route.pop(old_route, None)
        previous = self.by_route.get(route)
        if previous is not None and (previous.job, previous.rank) != (info.job, info.rank):  # it settled
            self._route_of.pop((previous.job, previous.host, previous.rank), None)
        self._route_of[key] = route
        self.by_route[route] = info
        return info

    def heartbeat(self, route: bytes, msg: dict[str, Any], now: float) -> RankInfo | None:
        info = self.by_route.get(route)
        if info is not None:
            info.last_seen = now
            self._update(info, msg)
        return info

    @staticmethod
    def _update(info: RankInfo, msg: dict[str, Any]) -> None:
        prev_step, prev_began = info.step, info.step_began_at
        info.step = msg["step"]
        # numbers from the wire are bounded before any arithmetic: a NaN or 1e-300 here once made every status
        # request fail (estimated_step divides by the step time)
        st = msg.get("step_time")
        info.step_time = float(st) if finite_number(st, MIN_STEP_TIME_S, MAX_STEP_TIME_S) else None
        began = msg.get("began")
        info.step_began_at = float(began) if finite_number(began, 0.0, MAX_WALL) else None
        if prev_began is not None and info.step_began_at is not None and info.step > prev_step and \
                info.step_began_at > prev_began:
            observed = (info.step_began_at - prev_began) / (info.step - prev_step)
            info.observed_step_time = observed if MIN_STEP_TIME_S <= observed <= MAX_STEP_TIME_S else None
        state = msg.get("state")
        if isinstance(state, str) and len(state) <= 32:
            info.state = state
        info.windows = _windows(msg.get("windows"))

    def remove(self, route: bytes) -> RankInfo | None:
        info = self.by_route.pop(route, None)
        if info is not None and self._route_of.get((info.job, info.host, info.rank)) == route:
            del self._route_of[(info.job, info.host, info.rank)]
        return info

    def expire(self, now: float, pid_alive: Callable[[int, bool], bool],
               timeout: float = RANK_TIMEOUT_S) -> list[tuple[RankInfo, str]]:
        """Drop ranks whose heartbeats stopped or whose process is gone; returns them with the reason.

        pid_alive(pid, thorough): a cheap existence check, or (thorough, for a rank already late with its
        heartbeat) one that also sees a zombie nobody has reaped yet."""
        gone = []
        for route, info in list(self.by_route.items()):
            silent = now - info.last_seen
            if silent > timeout:
                reason = f"no heartbeat for {silent:.1f} s"
            elif info.pid_visible and not pid_alive(info.pid, silent > 1.5 * HEARTBEAT_S):
                reason = f"process {info.pid} on {info.host} exited"
            else:
                continue
            self.remove(route)
            gone.append((info, reason))
        return gone

    def jobs(self) -> dict[str, list[RankInfo]]:
        out: dict[str, list[RankInfo]] = {}
        for info in self.by_route.values():
            out.setdefault(info.job, []).append(info)
        for ranks in out.values():
            ranks.sort(key=lambda r: r.rank)
        return dict(sorted(out.items()))

    def resolve_job(self, job: str | None) -> str:
        """The job a request means: the one given, or the only live one. ValueError says why not."""
        jobs = self.jobs()
        if job:
            if job not in jobs:
                raise ValueError(f"no live job {job!r}; live jobs: {', '.join(jobs) or 'none'}")
            return job
        if not jobs:
            raise ValueError("no ranks are registered with this daemon (is the training job running with the "
                             "ondemand_prof hook, and ONDEMAND_PROF_RUNTIME_DIR the same on both sides?)")
        if len(jobs) > 1:
            raise ValueError(f"{len(jobs)} jobs are live ({', '.join(jobs)}): choose one with --job")
        return next(iter(jobs))

    def select(self, job: str, ranks: Sequence[int]) -> list[RankInfo]:
        """The live ranks of `job` that `ranks` names (-1: all). ValueError names ranks that are not live."""
        live = {r.rank: r for r in self.jobs().get(job, [])}
        if -1 in ranks:
            return [live[r] for r in sorted(live)]
        missing = [r for r in ranks if r not in live]
        if missing:
            world = max((r.world_size for r in live.values()), default=0)
            hint = ""
            if any(r < world for r in missing):
                hint = "; ranks on other hosts register with their own host's ondemand-profd"
            raise ValueError(f"rank(s) {spans(missing)} of job {job!r} are not registered; live ranks: "
                             f"{spans(sorted(live)) or 'none'} (world size {world}){hint}")
        return [live[r] for r in ranks]


def plan_window(targets: Iterable[RankInfo], wall: float, *, start: int | None, start_step: int | None,
                steps: int, delivery_s: float = DELIVERY_S) -> dict[str, Any]:
    """One absolute window [first, first + steps) that every target can begin on time.

    A relative start is counted from the furthest-ahead target's current step; the window is put at least
    far enough ahead to cover delivery plus the step in flight, from each rank's measured step time, and after
    any window already running or scheduled on a target (a trigger file's too), which the plan says.
    ValueError when a target records an open-ended window.
    """
    targets = list(targets)
    current = {t.rank: t.estimated_step(wall) for t in targets}
    furthest = max(current.values())
    lead = 2  # the step now running ends, then the boundary where the window can begin
    for t in targets:
        if t.step_time:
            lead = max(lead, math.ceil(delivery_s / t.step_time - 1e-9) + 2)  # (0.3 / 0.1 is 3.0000000000000004)
    earliest = furthest + lead
    if start_step is not None:
        first = start_step
        late = sorted(r for r, s in current.items() if s + lead > start_step)  # past it, or too close to it
        past = sorted(r for r, s in current.items() if s >= start_step)
    else:
        first = max(furthest + (start or 1), earliest)
        late, past = [], []
    plan: dict[str, Any] = {"current_steps": current, "lead_steps": lead, "late_ranks": late, "past_ranks": past}
    # only windows that share a step with [first, first + steps) are in the way: one planned far ahead (a capture
    # with --start 100000) leaves the steps before it free
    blocking = _overlapping(targets, first, steps)
    while blocking and start_step is None and all(w["end"] is not None for _, w in blocking):
        more = [x for x in _overlapping(targets, max(w["end"] for _, w in blocking), steps) if x not in blocking]
        if not more:
            break
        blocking += more  # moved after these, the window meets the next ones
    if blocking and start_step is None:
        open_ended = [(r, w) for r, w in blocking if w["end"] is None]
        if open_ended:
            rank, w = open_ended[0]
            raise ValueError(f"rank {rank} records an open-ended window [{w['start']}, close) "
                             f"({w['source']}, {w['capture_id']}); cancel it first")
        after = max(w["end"] for _, w in blocking)
        if after > first:
            ids = sorted({w["capture_id"] for _, w in blocking})
            plan["after"] = {"capture_ids": ids, "ranks": sorted({r for r, _ in blocking}), "moved_from": first}
            plan["note"] = (f"planned after window(s) {', '.join(ids)} already scheduled or running on rank(s) "
                            f"{spans(r for r, _ in blocking)} (from step {first} to {after})")
            first = after
    plan.update(start_step=first, end_step=first + steps)
    return plan


def _overlapping(targets: list[RankInfo], first: int, steps: int) -> list[tuple[int, dict[str, Any]]]:
    """(rank, window) of the targets' windows that share a step with [first, first + steps)."""
    return [(t.rank, w) for t in targets for w in t.windows or []
            if (w["end"] is None or w["end"] > first) and w["start"] < first + steps]


def _windows(value: Any) -> list[dict[str, Any]] | None:
    """The windows a heartbeat lists, checked for shape; anything malformed is dropped."""
    if not isinstance(value, list):
        return None
    out = []
    for w in value[:MAX_WINDOWS]:
        if not isinstance(w, dict):
            continue
        start, end = w.get("start"), w.get("end")
        if not bounded_int(start, -1, MAX_STEP_VALUE) or not (end is None or bounded_int(end, -1, MAX_STEP_VALUE)):
            continue
        out.append({"capture_id": safe_id(w.get("capture_id", "")), "start": start, "end": end,
                    "source": str(w.get("source", ""))[:32], "state": str(w.get("state", ""))[:32]})
    return out


def select_ranks(spec: Any, world_size: int) -> tuple[int, ...]:
    """A request's rank list, bounded by the job's world size before anything is expanded."""
    try:
        return parse_ranks(spec, world_size=max(1, world_size))
    except RankSpecError as exc:
        raise ValueError(f"ranks: {exc}") from None
