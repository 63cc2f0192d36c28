"""The daemon's view of the live ranks: registration (one process per rank of a job, conflicts shown), what
their heartbeats say, when they are gone, and the jobs they make up, by owner and id. Pure: times are passed in,
pid checks are a function the caller supplies. Window planning is host/planning.py's; stalls host/stalls.py's."""

from __future__ import annotations

import pwd
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..core.ids import match_id, safe_id
from ..core.protocol import HEARTBEAT_S, RANK_TIMEOUT_S
from ..core.bounds import MAX_STEP, bounded_int, finite_number
from ..core.ranks import MAX_RANK, RankSpecError, parse_ranks, spans
from ..core.requests import RequestError, WindowDefaults
from .stalls import stalled_for, time_in_step

MAX_WINDOWS = 16  # windows a heartbeat may list (the running one and those queued)
MIN_STEP_TIME_S, MAX_STEP_TIME_S = 1e-6, 1e6  # step times outside these are noise or an attack: ignored
MAX_WALL = 1e11  # wall-clock seconds (the year 5138): a "began" past this is ignored
MAX_EXTRAPOLATED = 10**9  # steps an estimate may add to the last reported one
MAX_NAME = 256  # a job id or host name

CONFLICT_KEEP_S = 15.0  # a refused second process for a (uid, job, rank) is shown this long after its last attempt

# A job is known to the daemon by its owner and its id: (uid, job id). Another user's job that chose the same id
# (a shared MASTER_PORT number, a squatted name) is another job, never merged with this one nor refused for it.
JobKey = tuple["int | None", str]


class RankConflict(ValueError):
    """A registration refused because another live process holds the rank; `new`: the first refusal of it."""

    def __init__(self, message: str, new: bool) -> None:
        super().__init__(message)
        self.new = new


@dataclass
class RankInfo:
    route: bytes
    job: str
    rank: int
    world_size: int
    host: str
    pid: int  # in the daemon's pid namespace (the kernel's word for a local rank)
    step: int
    ns_pid: int | None = None  # the rank's own view of its pid where it differs (in a pod's pid namespace)
    step_time: float | None = None
    step_began_at: float | None = None  # wall time the reported step began (same host: same clock)
    state: str = "idle"
    state_since: float | None = None  # wall time its state began, where the rank says (rendezvous)
    local_rank: int | None = None
    save_root: str = ""
    trigger_dir: str = ""  # the rank's trigger directory (its file trigger, status files)
    version: str = ""
    registered_at: float = 0.0
    last_seen: float = 0.0
    pid_visible: bool = False  # the rank's pid exists in our pid namespace, so a vanished pid means it died
    kernel_pid: bool = False  # the pid is the kernel's (the connecting process): a process of this host, whatever
    # host name it says (a pod's own), which liveness, conflicts and native dumps act on
    fs_root: str | None = None  # where its paths start for the daemon, when it sees other files (a container's
    # mount namespace: /proc/PID/root); None: the daemon's own
    host_trigger_dir: str | None = None  # with fs_root: its trigger directory as this host has it ("": nowhere)
    host_save_root: str | None = None  # with fs_root: its save root as this host has it ("": nowhere)
    pid_seen: bool = True  # False: its process is in a pid namespace the daemon does not see (pid: the rank's word)
    observed_step_time: float | None = None  # from the steps and times of the last two heartbeats
    defaults: WindowDefaults | None = None  # what the rank's configuration fills into a request
    windows: list[dict[str, Any]] | None = None  # running and queued windows, from the last heartbeat
    uid: int | None = None  # the connecting process's uid, from the kernel (SO_PEERCRED); None: not known
    native_dump: dict[str, Any] | None = None  # {"file"}: faulthandler's stack dump, checked by host/triage.py
    process: Any = None  # core.processes.ProcessIdentity at registration (host/triage.py): pid reuse is told apart
    heard_at: float | None = None  # wall time of the rank's last heartbeat (or registration), when known
    sent_at: float | None = None  # the rank's wall time when it sent that heartbeat (same host: same clock)
    exited_seen: float | None = None  # when a sweep first found its process gone (expire: judged at the next)

    @property
    def key(self) -> JobKey:
        """The job this rank belongs to, as the daemon knows jobs: (owner uid, job id)."""
        return (self.uid, self.job)

    def in_step_s(self, wall: float) -> float | None:
        return time_in_step(self, wall)

    def stalled_s(self, wall: float) -> float | None:
        return stalled_for(self, wall)

    def estimated_step(self, wall: float) -> int:
        """The step this rank is probably running at wall time `wall`: what windows are planned from (what users
        see is the reported step).

        Extrapolated from the time its reported step began. Of the rank's own median step time and the rate
        seen between its last two heartbeats, the faster one is used: guessing a rank further ahead than it is
        only puts the window a little later, while guessing it behind (a median still weighed by slow first
        steps) makes it late. A step that runs long is not extrapolated past what the last heartbeat allows
        (the rank was still in it then), and a stalled rank is where it said it was."""
        rates = [t for t in (self.step_time, self.observed_step_time) if t]
        if not rates or self.step_began_at is None or self.stalled_s(wall) is not None:
            return self.step
        rate = min(rates)
        ahead = int((wall - self.step_began_at) / rate)
        if self.heard_at is not None:
            ahead = min(ahead, 1 + int(max(0.0, wall - self.heard_at) / rate))
        return self.step + min(MAX_EXTRAPOLATED, max(0, ahead))

    def as_dict(self, now: float, wall: float) -> dict[str, Any]:
        stalled = self.stalled_s(wall)
        in_step = self.in_step_s(wall)
        in_step = None if in_step is None else round(in_step, 3)
        return {"job": self.job, "rank": self.rank, "world_size": self.world_size, "host": self.host,
                "pid": self.pid, **({"ns_pid": self.ns_pid} if self.ns_pid is not None else {}),
                **({} if self.pid_seen else {"pid_seen": False}),
                "uid": self.uid, "owner": owner_name(self.uid),
                "step": self.step, "step_estimate": self.estimated_step(wall),
                "in_step_s": in_step, "stalled_s": None if stalled is None else round(stalled, 1),
                "step_time_s": self.step_time, "state": self.state, "local_rank": self.local_rank,
                **({"state_s": round(max(0.0, wall - self.state_since), 1)} if self.state_since is not None else {}),
                "save_root": self.save_root, "trigger_dir": self.trigger_dir, "version": self.version,
                **({"in_container": True, "trigger_dir_on_host": self.host_trigger_dir or None,
                    "save_root_on_host": self.host_save_root or None, "container_root": self.fs_root}
                   if self.fs_root else {}),
                "last_seen_s": round(now - self.last_seen, 3), "registered_at": self.registered_at,
                "windows": self.windows or [],
                "max_window_steps": self.defaults.max_steps if self.defaults is not None else None,
                "captured_by_default": self.defaults is None or self.defaults.selects(self.rank)}


class Registry:
    def __init__(self) -> None:
        self.by_route: dict[bytes, RankInfo] = {}
        self._route_of: dict[tuple[int | None, str, int], bytes] = {}  # (uid, job, rank) -> route
        # (uid, job, rank) -> a second live process that claimed a rank already held (refused; shown by status)
        self.conflicts: dict[tuple[int | None, str, int], dict[str, Any]] = {}

    def register(self, route: bytes, msg: dict[str, Any], now: float, wall: float,
                 pid_alive: Callable[[int, bool], bool], uid: int | None = None) -> RankInfo:
        """`uid`: the connecting process's, from the kernel (None: not known); the job is (uid, msg's job id)."""
        for name in ("job", "host"):
            if not 0 < len(msg[name]) <= MAX_NAME:
                raise ValueError(f"register: {name} must be 1 to {MAX_NAME} characters")
        local_rank = msg.get("local_rank")
        info = RankInfo(route=route, job=msg["job"], rank=msg["rank"], world_size=msg["world_size"], host=msg["host"],
                        pid=msg["pid"], step=msg["step"],
                        local_rank=local_rank if bounded_int(local_rank, 0, MAX_RANK) else None,
                        save_root=str(msg.get("save_root", ""))[:4096], trigger_dir=str(msg.get("trigger_dir", ""))[:4096],
                        version=str(msg.get("version", ""))[:64],
                        registered_at=wall, last_seen=now, uid=uid)
        if msg.get("defaults") is not None:
            try:
                info.defaults = WindowDefaults.from_wire(msg["defaults"])
            except RequestError as exc:
                raise ValueError(f"register: bad window defaults: {exc}") from None
        native = msg.get("native_dump")
        if isinstance(native, dict) and type(native.get("signal")) is int and isinstance(native.get("file"), str):
            info.native_dump = {"signal": native["signal"], "file": native["file"][:4096]}
        self._update(info, msg)
        info.heard_at = wall
        info.pid_visible = pid_alive(info.pid, False)
        key = (info.uid, info.job, info.rank)
        old_route = self._route_of.get(key)
        if old_route is not None and old_route != route:
            old = self.by_route.get(old_route)
            if old is not None and old.pid != info.pid and self._alive(old, now, pid_alive):
                self._refuse(old, info, now, wall)
            # a restarted rank (same job and rank, its old process gone) or a reconnected one replaces the entry
            self.by_route.pop(old_route, None)
        if self.conflicts.get(key, {}).get("refused_pid") == info.pid:  # the holder is gone: the claimant has it
            del self.conflicts[key]
        previous = self.by_route.get(route)
        if previous is not None and (previous.uid, previous.job, previous.rank) != key:  # it settled
            self._route_of.pop((previous.uid, previous.job, previous.rank), None)
        self._route_of[key] = route
        self.by_route[route] = info
        return info

    @staticmethod
    def _alive(info: RankInfo, now: float, pid_alive: Callable[[int, bool], bool]) -> bool:
        """Whether the process holding a rank is still there: its pid where we can see it, else its heartbeats."""
        if info.pid_visible:
            return pid_alive(info.pid, True)
        return now - info.last_seen <= RANK_TIMEOUT_S

    def _refuse(self, holder: RankInfo, claimant: RankInfo, now: float, wall: float) -> None:
        """A second live process claims a rank that is held: the first keeps it (nothing flaps), the claim is
        refused with the reason and kept for status. ValueError."""
        key = (holder.uid, holder.job, holder.rank)
        conflict = self.conflicts.get(key)
        new = conflict is None or conflict["refused_pid"] != claimant.pid
        if new:
            conflict = {"job": holder.job, "uid": holder.uid, "rank": holder.rank, "pid": holder.pid,
                        "host": holder.host, "refused_pid": claimant.pid, "refused_host": claimant.host,
                        "since": wall, "attempts": 0}
            self.conflicts[key] = conflict
        assert conflict is not None
        conflict["attempts"] += 1
        conflict["last_attempt"] = now
        raise RankConflict(
            f"register: rank {holder.rank} of job {holder.job!r} is held by pid {holder.pid} on {holder.host}, "
            f"which is alive; pid {claimant.pid} on {claimant.host} cannot take it too (two jobs with one job id: "
            "a shared MASTER_PORT or launcher id? give each its own: --profile-job-id or ONDEMAND_PROF_JOB_ID)",
            new=new)

    def conflicts_of(self, job: str, now: float, uid: Any = ...) -> list[dict[str, Any]]:
        """The refused second processes of `job` (of owner `uid`, when given) that tried lately (older ones are
        forgotten)."""
        for key in [k for k, c in self.conflicts.items() if now - c["last_attempt"] > CONFLICT_KEEP_S]:
            del self.conflicts[key]
        return [{k: v for k, v in c.items() if k != "last_attempt"}
                for (u, j, _), c in sorted(self.conflicts.items(), key=lambda kv: (str(kv[0][0]), kv[0][1:]))
                if j == job and (uid is ... or u == uid)]

    def heartbeat(self, route: bytes, msg: dict[str, Any], now: float, wall: float | None = None) -> RankInfo | None:
        info = self.by_route.get(route)
        if info is not None:
            info.last_seen = now
            info.heard_at = wall
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
        sent = msg.get("at")
        info.sent_at = float(sent) if finite_number(sent, 0.0, MAX_WALL) else None
        if prev_began is not None and info.step_began_at is not None and info.step > prev_step and \
                info.step_began_at > prev_began:
            observed = (info.step_began_at - prev_began) / (info.step - prev_step)
            info.observed_step_time = observed if MIN_STEP_TIME_S <= observed <= MAX_STEP_TIME_S else None
        state = msg.get("state")
        if isinstance(state, str) and len(state) <= 32:
            info.state = state
        since = msg.get("state_since")
        info.state_since = float(since) if finite_number(since, 0.0, MAX_WALL) else None
        info.windows = _windows(msg.get("windows"))

    def remove(self, route: bytes) -> RankInfo | None:
        info = self.by_route.pop(route, None)
        if info is not None and self._route_of.get((info.uid, info.job, info.rank)) == route:
            del self._route_of[(info.uid, info.job, info.rank)]
        return info

    def expire(self, now: float, pid_alive: Callable[[int, bool], bool],
               timeout: float = RANK_TIMEOUT_S) -> list[tuple[RankInfo, str]]:
        """Drop ranks whose heartbeats stopped or whose process is gone; returns them with the reason.

        pid_alive(pid, thorough): a cheap existence check, or (thorough, for a rank already late with its
        heartbeat) one that also sees a zombie nobody has reaped yet."""
        gone = []
        late = now - 1.5 * HEARTBEAT_S
        alive: dict[tuple[int, bool], bool] = {}  # one look per process and sweep (ranks may share a process)
        for route, info in list(self.by_route.items()):
            if now - info.last_seen > timeout:
                reason = f"no heartbeat for {now - info.last_seen:.1f} s"
            elif info.pid_visible:
                key = (info.pid, info.last_seen < late)
                ok = alive.get(key)
                if ok is None:
                    ok = alive[key] = pid_alive(*key)
                if ok:
                    info.exited_seen = None
                    continue
                # A process that ends on SIGTERM or at exit says why (a bye) as it goes, but its death can be
                # seen before the bye is read (a sweep prompted by another rank's death, both signalled at
                # once): judged at the next sweep, once every message sent before that death has been read
                if info.exited_seen is None or now <= info.exited_seen:
                    info.exited_seen = now if info.exited_seen is None else info.exited_seen
                    continue
                reason = f"process {info.pid} on {info.host} exited"
            else:
                continue
            self.remove(route)
            gone.append((info, reason))
        return gone

    def jobs(self) -> dict[str, list[RankInfo]]:
        """The live jobs by the name they are shown and asked for: the job id, or, where ranks of more than one
        uid chose that id, `owner:id` for each of them (owner: the user name, or the uid where it has none)."""
        by_key: dict[JobKey, list[RankInfo]] = {}
        for info in self.by_route.values():
            by_key.setdefault(info.key, []).append(info)
        labels = _Labels(by_key)
        out: dict[str, list[RankInfo]] = {}
        for (uid, job), ranks in by_key.items():
            ranks.sort(key=lambda r: r.rank)
            out[labels.of(uid, job)] = ranks
        return dict(sorted(out.items()))

    def job_keys(self) -> dict[str, JobKey]:
        """Each live job's name (as jobs() shows it) -> its JobKey."""
        return {name: ranks[0].key for name, ranks in self.jobs().items()}

    def name_of(self, uid: int | None, job: str) -> str:
        """How the job (uid, job) is shown and asked for now (as in jobs())."""
        return _Labels({info.key for info in self.by_route.values()} | {(uid, job)}).of(uid, job)

    def resolve_job(self, job: str | None, asker: int | None = None) -> str:
        """The job a request means, as jobs() names it: the name given; a job id (where several users chose it,
        the one of `asker`, the uid asking); `owner:id`; a unique beginning of a name or of an id (likewise). Else
        the only live job. ValueError says why not."""
        jobs = self.jobs()
        if job:
            if job in jobs:
                return job
            keys = {name: ranks[0].key for name, ranks in jobs.items()}
            same = [name for name, (_, j) in keys.items() if j == job]
            if not same and ":" in job:  # owner:id, the owner a user name or a uid
                owner, _, wanted = job.partition(":")
                same = [name for name, (u, j) in keys.items() if j == wanted and owner in (owner_name(u), str(u))]
            if not same:
                begun = [name for name in keys if name.startswith(job)]
                ids = {keys[name][1] for name in keys if keys[name][1].startswith(job)}
                same = begun if len(begun) == 1 else [n for n in keys if keys[n][1] in ids] if len(ids) == 1 else []
            mine = [name for name in same if keys[name][0] == asker]
            if len(same) == 1 or len(mine) == 1:
                return (mine or same)[0]
            if same:
                raise ValueError(f"job {job!r} is run by {len(same)} users on this host: "
                                 f"{', '.join(f'{name} ({owner_text(keys[name][0])})' for name in same)}; "
                                 "name one as shown")
            return match_id(job, jobs, "live job")
        if not jobs:
            raise ValueError("no ranks are registered with this daemon (is the training job running with the "
                             "ondemand_prof hook, and ONDEMAND_PROF_RUNTIME_DIR the same on both sides?)")
        if len(jobs) > 1:
            raise ValueError(f"{len(jobs)} jobs are live ({', '.join(jobs)}): choose one with --job")
        return next(iter(jobs))

    def select(self, job: str, ranks: Sequence[int]) -> list[RankInfo]:
        """The live ranks of `job` (a name as jobs() has it) that `ranks` names (-1: all). ValueError names ranks
        that are not live."""
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


class _Labels:
    """Names for jobs: the job id where one uid alone chose it, `owner:id` where several did (and for a job id
    that reads like another job's `owner:id`)."""

    def __init__(self, keys: Iterable[JobKey]) -> None:
        self.count: dict[str, int] = {}
        keys = list(keys)
        for _, job in keys:
            self.count[job] = self.count.get(job, 0) + 1
        self.qualified = {f"{owner_name(u)}:{j}" for u, j in keys if self.count[j] > 1}

    def of(self, uid: int | None, job: str) -> str:
        if self.count.get(job, 0) > 1 or job in self.qualified:
            return f"{owner_name(uid)}:{job}"
        return job


_OWNER_NAMES: dict[int, str] = {}


def owner_name(uid: int | None) -> str:
    """A uid as a user name (the uid's digits where the host has no name for it: a container's mapped uid);
    "unknown" for None."""
    if uid is None:
        return "unknown"
    name = _OWNER_NAMES.get(uid)
    if name is None:
        try:
            name = pwd.getpwuid(uid).pw_name
        except (KeyError, OverflowError):
            name = str(uid)
        if len(_OWNER_NAMES) < 4096:
            _OWNER_NAMES[uid] = name
    return name


def owner_text(uid: int | None) -> str:
    """'uid 1000 (alice)', or 'uid 100000' where the host has no name for it."""
    if uid is None:
        return "an unknown uid"
    name = owner_name(uid)
    return f"uid {uid}" + ("" if name == str(uid) else f" ({name})")


def _windows(value: Any) -> list[dict[str, Any]] | None:
    """The windows a heartbeat lists, checked for shape; anything malformed is dropped."""
    if not isinstance(value, list):
        return None
    out = []
    for w in value[:MAX_WINDOWS]:
        if not isinstance(w, dict):
            continue
        start, end = w.get("start"), w.get("end")
        if not bounded_int(start, -1, MAX_STEP) or not (end is None or bounded_int(end, -1, MAX_STEP)):
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
