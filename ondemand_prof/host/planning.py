"""Planning a capture's window, pure. On one host (the daemon, host/commands/capture.py): plan_window, one
absolute window every target rank can begin on time, after the windows already on them, with the lead that
delivery to those ranks has been measured to need (DeliveryBook). Across hosts (ondemandctl): which job and
ranks a capture means and one window for all of them. Replies in, plans out: no sockets, no printing (the
fan-out is host/multihost.py, the answers merged host/merge.py's, the console each command's own). Two rules
are shared by one host and many: every rank of a capture gets the same length cap, and a stalled job gets no
window.

A capture across hosts is aligned by steps, not clocks: every daemon's status gives its ranks' current steps
and step times, each anchored at the time that host's answer arrived (our clock only), and one absolute
window is planned from those with the daemon's own planner (plan_window), the fan-out's round trip
counted as delivery."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from ..core.ranks import spans
from ..core.bounds import finite_number
from .client import EXIT_FAILED, EXIT_USAGE, CtlError
from .records import Plan
from .registry import MAX_STEP_TIME_S, MIN_STEP_TIME_S, RankInfo
from .stalls import stall_text, stalls
from ..core.ids import match_id

if TYPE_CHECKING:
    from .client import Reply

Replies = dict[str, "Reply"]


# ----------------------------------------------------------------------------------------------------------
# One host: the daemon's window

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
        self.jobs: dict[Any, DeliveryTimes] = {}  # by JobKey (uid, job id), least recently learned first

    def of(self, job: Any) -> DeliveryTimes:
        times = self.jobs.pop(job, None) or DeliveryTimes()
        self.jobs[job] = times
        while len(self.jobs) > self.max_jobs:
            del self.jobs[next(iter(self.jobs))]
        return times

    def keep_only(self, live_jobs: Iterable[Any]) -> None:
        """Forget the jobs that have no live rank left."""
        live = set(live_jobs)
        for job in [j for j in self.jobs if j not in live]:
            del self.jobs[job]

    def estimate(self, job: Any) -> float:
        times = self.jobs.get(job)
        return times.estimate() if times is not None else DELIVERY_S

    def longer(self, jobs: dict[str, Any]) -> dict[str, float]:
        """Of `jobs` (name shown -> JobKey), those whose learned delivery is longer than DELIVERY_S, and how long."""
        out = {name: round(self.estimate(key), 4) for name, key in jobs.items()}
        return {name: seconds for name, seconds in out.items() if seconds > DELIVERY_S}


def plan_window(targets: Iterable[RankInfo], wall: float, *, start: int | None, start_step: int | None,
                steps: int, delivery_s: float = DELIVERY_S) -> Plan:
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
    # only windows that share a step with [first, first + steps) are in the way: one planned far ahead (a capture
    # with --start 100000) leaves the steps before it free
    blocking = _overlapping(targets, first, steps)
    while blocking and start_step is None and all(w["end"] is not None for _, w in blocking):
        more = [x for x in _overlapping(targets, max(w["end"] for _, w in blocking), steps) if x not in blocking]
        if not more:
            break
        blocking += more  # moved after these, the window meets the next ones
    after: dict[str, Any] | None = None
    note = ""
    if blocking and start_step is None:
        open_ended = [(r, w) for r, w in blocking if w["end"] is None]
        if open_ended:
            rank, w = open_ended[0]
            raise ValueError(f"rank {rank} records an open-ended window [{w['start']}, close) "
                             f"({w['source']}, {w['capture_id']}); cancel it first")
        last = max(w["end"] for _, w in blocking)
        if last > first:
            ids = sorted({w["capture_id"] for _, w in blocking})
            after = {"capture_ids": ids, "ranks": sorted({r for r, _ in blocking}), "moved_from": first}
            note = (f"planned after window(s) {', '.join(ids)} already scheduled or running on rank(s) "
                    f"{spans(r for r, _ in blocking)} (from step {first} to {last})")
            first = last
    return Plan(first, first + steps, current, lead, tuple(late), tuple(past), after, note)


def _overlapping(targets: list[RankInfo], first: int, steps: int) -> list[tuple[int, dict[str, Any]]]:
    """(rank, window) of the targets' windows that share a step with [first, first + steps)."""
    return [(t.rank, w) for t in targets for w in t.windows or []
            if (w["end"] is None or w["end"] > first) and w["start"] < first + steps]


# ----------------------------------------------------------------------------------------------------------
# Rules shared with the daemon

def common_cap(caps: Iterable[int | None]) -> int | None:
    """The one length cap of ranks that must record the same steps: the smallest of theirs (None: none known)."""
    known = [c for c in caps if c]
    return min(known) if known else None


def no_window(job: str, stall: dict[str, Any]) -> str:
    """Why a capture on a stalled job is refused at once (it would time out later)."""
    return f"{stall_text(job, stall)}. No window can start until they step again"


# ----------------------------------------------------------------------------------------------------------
# The job and its ranks

def pick_job(live: Iterable[str], job: str | None, slurm: str | None = None) -> str:
    """The job meant: `job` (an id or a unique prefix of one), else under --slurm JOBID the live job that is
    that SLURM job or one of its steps (`JOBID.STEP`: ranks name their job so), else the only live job.
    CtlError says why not."""
    names = sorted(set(live))
    if job is not None:
        try:
            return match_id(job, names, "live job")
        except ValueError as exc:
            raise CtlError(f"--job: {exc} (on the hosts that answered)",
                           EXIT_USAGE if any(n.startswith(job) for n in names) else EXIT_FAILED) from None
    if not names:
        raise CtlError("no ranks are registered with any of the daemons that answered")
    if slurm is not None:
        steps = [j for j in names if j == slurm or j.startswith(slurm + ".")]
        if len(steps) == 1:
            return steps[0]
        if steps:
            raise CtlError(f"SLURM job {slurm} has {len(steps)} live steps ({', '.join(steps)}): choose one with "
                           "--job", EXIT_USAGE)
    if len(names) > 1:
        raise CtlError(f"{len(names)} jobs are live ({', '.join(names)}): choose one with --job", EXIT_USAGE)
    return names[0]


def rank_infos(statuses: Replies, job: str | None, slurm: str | None = None, now: float | None = None
               ) -> tuple[str, dict[str, list[RankInfo]]]:
    """The job meant and its live ranks per host, from status replies; CtlError when the job is unclear."""
    jobs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, reply in statuses.items():
        if reply.ok:
            for j, ranks in reply.data["jobs"].items():
                jobs.setdefault(j, {})[name] = ranks
    job = pick_job(jobs, job, slurm)
    now = time.time() if now is None else now
    # Each daemon's estimate of its ranks' steps is anchored at the time its own reply arrived (our clock
    # only: the hosts' clocks need not agree), so plan_window extrapolates every host from its own answer: a
    # host that answered at once is not made to look 5 s behind by one that timed out in the same round.
    infos = {name: [_rank_info(r, job, statuses[name].received_at or now) for r in ranks]
             for name, ranks in jobs[job].items()}
    return job, infos


def _rank_info(r: dict[str, Any], job: str, anchor: float) -> RankInfo:
    """One rank of a daemon's status reply. `step_estimate` is the daemon's estimate of the step running as
    it replied (`step` is the last one the rank reported; older daemons sent only `step`, their estimate)."""
    step = r.get("step_estimate", r["step"])
    return RankInfo(route=b"", job=job, rank=r["rank"], world_size=r["world_size"], host=r["host"], pid=r["pid"],
                    step=step if type(step) is int else r["step"], step_time=r["step_time_s"], step_began_at=anchor,
                    windows=r.get("windows") or [])


def _rows(statuses: Replies, job: str) -> Iterable[tuple[str, dict[str, Any]]]:
    """(host, rank row) of `job` in the status replies that came."""
    return ((name, r) for name, reply in statuses.items() if reply.ok for r in reply.data["jobs"].get(job, []))


def _keys(targets: dict[str, list[RankInfo]]) -> set[tuple[str, int]]:
    return {(name, i.rank) for name, infos in targets.items() for i in infos}


def choose_targets(infos: dict[str, list[RankInfo]], wanted: list[int] | None,
                   by_default: set[tuple[str, int]] | None = None) -> dict[str, list[RankInfo]]:
    """The ranks `wanted` names (-1: all), per host; or, naming none (None), those `by_default` holds: what a
    touched trigger file captures on each host (--profile-ondemand-ranks). CtlError names ranks no host has."""
    if wanted is None:
        chosen = {name: [i for i in ranks if by_default is None or (name, i.rank) in by_default]
                  for name, ranks in infos.items()}
        return {name: ranks for name, ranks in chosen.items() if ranks}
    everywhere = {i.rank for ranks in infos.values() for i in ranks}
    if -1 not in wanted:
        missing = sorted(set(wanted) - everywhere)
        if missing:
            raise CtlError(f"rank(s) {spans(missing)} are not registered with any daemon that answered; live "
                           f"ranks: {spans(sorted(everywhere)) or 'none'}")
    chosen = {name: [i for i in ranks if -1 in wanted or i.rank in wanted] for name, ranks in infos.items()}
    return {name: ranks for name, ranks in chosen.items() if ranks}


def missing_ranks(infos: dict[str, list[RankInfo]], wanted: list[int] | None) -> list[int]:
    """With all ranks wanted (-1, or the default): the job's ranks (by its world size) that no daemon that
    answered has."""
    if wanted is not None and -1 not in wanted:
        return []
    world = max((i.world_size for ranks in infos.values() for i in ranks), default=0)
    return sorted(set(range(world)) - {i.rank for ranks in infos.values() for i in ranks})


def stalled_refusal(statuses: Replies, job: str, targets: dict[str, list[RankInfo]],
                    now: float | None = None) -> str | None:
    """Why no window can be planned: target ranks that have not finished a step for a while (their daemon
    says `stalled_s`); a window on a stalled job would never start. None when none is stalled."""
    wanted = _keys(targets)
    rows = [{"rank": r["rank"], "step": r["step"], "daemon": name, "stalled_s": r.get("stalled_s")}
            for name, r in _rows(statuses, job)
            if (name, r["rank"]) in wanted and finite_number(r.get("stalled_s"), 0.0, 1e9)]
    stall = stalls(rows, time.time() if now is None else now)
    return None if stall is None else no_window(job, stall)


def cap_steps_across(statuses: Replies, job: str, targets: dict[str, list[RankInfo]],
                     request: dict[str, Any]) -> str:
    """Cap the request's length at the smallest --profile-max-window-steps of the target ranks on every host,
    so that each daemon (which caps by its own ranks only) records the same steps; the note says so."""
    wanted = _keys(targets)
    cap = common_cap(r.get("max_window_steps") for name, r in _rows(statuses, job) if (name, r["rank"]) in wanted)
    asked = request.get("steps")
    if cap is None or not isinstance(asked, int) or asked <= cap:
        return ""
    request["steps"] = cap
    return f"steps capped from {asked} to {cap} (the smallest --profile-max-window-steps of the target ranks)"


def slowest_delivery(statuses: Replies, job: str, targets: dict[str, list[RankInfo]]) -> float:
    """The slowest target host's own delivery to its ranks, as its daemon learned it (a number a host sends:
    bounded; DELIVERY_S when none is known)."""
    learned = [(r.data.get("delivery_s") or {}).get(job) for name, r in statuses.items() if r.ok and name in targets]
    return max([DELIVERY_S, *(d for d in learned if d is not None and finite_number(d, 0.0, MAX_DELIVERY_S))])


def plan_across(targets: dict[str, list[RankInfo]], request: dict[str, Any], round_trip_s: float,
                local_delivery_s: float = DELIVERY_S, now: float | None = None, note: str = "") -> Plan:
    """One absolute window for every target rank. Delivery covers the status round trip (the steps are that
    old) and the capture's way out, plus one step for the daemons' own extrapolation, plus the slowest host's
    own delivery to its ranks (what each daemon learned from its ranks' answers; DELIVERY_S by default).
    `note`: said before the planner's own (a length cap)."""
    ranks = [i for infos in targets.values() for i in infos]
    slowest = max((i.step_time or 0.0) for i in ranks)
    try:
        return plan_window(ranks, time.time() if now is None else now, start=request.get("start"),
                           start_step=request.get("start_step"), steps=request["steps"],
                           delivery_s=local_delivery_s + 2 * round_trip_s + slowest).noted(note)
    except ValueError as exc:
        raise CtlError(str(exc)) from None


@dataclass
class CapturePlan:
    """What a capture across hosts sends: the job, the target ranks per host, the plan (one absolute window),
    the request every host gets (absolute start; each host's own ranks added by `per_host`), and the ranks of
    the job that no host that answered has (`missing`)."""

    job: str
    targets: dict[str, list[RankInfo]]
    plan: Plan
    request: dict[str, Any]
    missing: list[int]

    def per_host(self) -> dict[str, dict[str, Any]]:
        return {name: {"request": {**self.request, "ranks": [i.rank for i in ranks]}}
                for name, ranks in self.targets.items()}


def plan_capture(statuses: Replies, request: dict[str, Any], job: str | None, slurm: str | None = None,
                 now: float | None = None) -> CapturePlan:
    """From every host's status and the request (`Capture.message`'s): the targets and one window for all of
    them. CtlError when no window can be planned (no such job or ranks, a stalled job, a start some rank has
    passed: across hosts a window starts on the same step on every rank or not at all). `now`: the wall
    clock (default: read where each step needs it)."""
    request = dict(request)
    round_trip = max((r.seconds for r in statuses.values() if r.ok), default=0.0)
    job, infos = rank_infos(statuses, job, slurm, now)
    wanted = request.pop("ranks", None)
    by_default = {(name, r["rank"]) for name, r in _rows(statuses, job) if r.get("captured_by_default", True)}
    targets = choose_targets(infos, wanted, by_default)
    if not targets:
        raise CtlError("no target ranks on the hosts that answered")
    stalled = stalled_refusal(statuses, job, targets, now)
    if stalled:
        raise CtlError(stalled)
    cap_note = cap_steps_across(statuses, job, targets, request)
    plan = plan_across(targets, request, round_trip, slowest_delivery(statuses, job, targets), now, cap_note)
    if request.get("start_step") is not None and plan.past_ranks:
        steps = plan.current_steps.values()
        raise CtlError(f"--start-step {request['start_step']}: rank(s) {spans(plan.past_ranks)} are already past "
                       f"it (the ranks are at steps {min(steps)}-{max(steps)}); across hosts a window starts on the "
                       "same step on every rank or not at all: give a later step, or --start N")
    request.pop("start", None)
    request["start_step"] = plan.start_step
    return CapturePlan(job, targets, plan, request, missing_ranks(infos, wanted))
