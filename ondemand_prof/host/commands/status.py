"""ondemandctl status: the live ranks of each job, with what is wrong with them (stalled, silent, claimed
twice, slow) and what to run next."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ...core.ranks import spans
from ..merge import no_live_job
from ..registry import owner_name, owner_text
from ..stalls import stall_text, stalls
from ..service import BadRequest, Service
from .base import Command, add_job_flag, ms, opt_str, table


class Status(Command):
    name = "status"
    help = "live ranks: job, rank, host, pid, current step, step time, state"
    absent = staticmethod(no_live_job)  # across hosts: a host without the job is not a failure

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_job_flag(parser, only=True)

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"job": args.job} if args.job else {}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        now, wall = time.monotonic(), time.time()
        registry = service.registry
        live = registry.jobs()  # by name: the job id, or owner:id where several users chose that id
        keys = {name: ranks[0].key for name, ranks in live.items()}
        job = opt_str(msg, "job")
        if job:
            peer = msg.get("_peer")
            try:
                job = registry.resolve_job(job, getattr(peer, "uid", None))
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        jobs = {name: [r.as_dict(now, wall) for r in ranks] for name, ranks in live.items() if not job or name == job}
        from ..stalls import stragglers

        slow = {name: stragglers(ranks) for name, ranks in jobs.items()}  # adds vs_median and slow to each rank
        stalled = {name: stall for name, ranks in jobs.items() if (stall := stalls(ranks, wall)) is not None}
        conflicts = {name: c for name in jobs if (c := registry.conflicts_of(keys[name][1], now, keys[name][0]))}
        silent: dict[str, list[dict[str, Any]]] = {}  # heartbeats stopped, process alive: the GIL held?
        for info in service.triage.silent_ranks(None, now):
            name = registry.name_of(info.uid, info.job)
            if not job or name == job:
                silent.setdefault(name, []).append({
                    "rank": info.rank, "pid": info.pid, **({"ns_pid": info.ns_pid} if info.ns_pid else {}),
                    "host": info.host, "step": info.step, "uid": info.uid, "owner": owner_name(info.uid),
                    "silent_s": round(now - info.last_seen, 1)})
        return {"daemon": service.daemon_info(), "jobs": jobs if not msg.get("brief") else {}, "stragglers": slow,
                "delivery_s": service.delivery.longer({name: keys[name] for name in jobs}), "stalled": stalled,
                "conflicts": conflicts, "silent": silent}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        d = data["daemon"]
        text = (f"ondemand-profd {d['version']} pid {d['pid']} on {d['host']}, up {d['uptime_s']:.0f} s; "
                f"{d['captures']} capture record(s), {d['running_captures']} running\n")
        for limit in d.get("limits") or []:  # (issue 41, 11: no CAP_SYS_PTRACE)
            text += f"WARNING: {limit}\n"
        if d.get("unsaved_records"):  # (issue 41, 9: a full state disk)
            text += (f"WARNING: {d['unsaved_records']} capture record(s) cannot be written to {d['state_dir']}: "
                     f"{d.get('unsaved_error')}; they are lost at a restart, and a baseline among them is not the "
                     "job's baseline until it is written (the daemon tries again)\n")
        silent = data.get("silent") or {}
        if not data["jobs"] and not silent:
            return text + "no ranks registered\n"
        for job in sorted(set(silent) - set(data["jobs"])):
            text += f"\njob {job}: no rank answers\n" + _silent_text(job, silent[job])
        for job, ranks in data["jobs"].items():
            text += _job_text(job, ranks, data, silent.get(job) or [])
        return text


def _job_text(job: str, ranks: list[dict[str, Any]], data: dict[str, Any], silent: list[dict[str, Any]]) -> str:
    world = max(r["world_size"] for r in ranks)
    text = f"\njob {job}: {len(ranks)} of {world} rank(s) registered{_owner(ranks)}\n"
    for label, key in (("trigger dir", "trigger_dir"), ("save path", "save_root")):
        places = sorted({(r.get(key) or "?") + _on_host(r, key) for r in ranks})
        text += f"  {label}: {', '.join(places)}\n"
    # PID: the process as this host sees it (what kill, py-spy and the native dump act on); POD PID: the rank's
    # own view, shown where it lives in a pid namespace of its own (a container)
    unseen = [r["rank"] for r in ranks if r.get("pid_seen") is False]
    pod = unseen or any(r.get("ns_pid") is not None for r in ranks)
    rows = [[str(r["rank"]), r["host"], "?" if r.get("pid_seen") is False else str(r["pid"]),
             *([str(r["pid"] if r.get("pid_seen") is False else r.get("ns_pid") or "-")] if pod else []),
             str(r["step"]), ms(r["step_time_s"]), _state(r), f"{r['last_seen_s']:.1f} s ago", _vs_median(r)]
            for r in ranks]
    text += table(rows, ["RANK", "HOST", "PID", *(["POD PID"] if pod else []), "STEP", "STEP TIME", "STATE", "HEARD",
                         "VS MEDIAN"])
    if unseen:
        text += (f"rank(s) {spans(unseen)}: their processes are in a pid namespace this daemon does not see (PID ?, "
                 "POD PID their own word): no native dump, no exit noticed before their heartbeats stop; run "
                 "ondemand-profd in the host's pid namespace for those (Kubernetes: hostPID: true, "
                 "docs/containers.md)\n")
    stall = (data.get("stalled") or {}).get(job)
    if stall:
        text += stall_text(job, stall) + "\n"
    text += _rendezvous_text(job, ranks, world)
    text += _silent_text(job, silent)
    for c in (data.get("conflicts") or {}).get(job) or []:
        text += (f"CONFLICT: rank {c['rank']} is held by pid {c['pid']} ({c['host']}); pid {c['refused_pid']} "
                 f"({c['refused_host']}) claims it too and is refused ({c['attempts']} tries): two jobs "
                 "share this job id (give each its own: --profile-job-id or ONDEMAND_PROF_JOB_ID)\n")
    delivery = (data.get("delivery_s") or {}).get(job)
    if delivery:  # learned from ranks that took windows late: captures now plan a longer lead
        text += (f"windows took up to {delivery * 1000:.0f} ms to reach this job's ranks lately; captures "
                 "start far enough ahead for that\n")
    slow = (data.get("stragglers") or {}).get(job) or {}
    if slow.get("slow_ranks"):
        text += (f"slow: rank(s) {spans(slow['slow_ranks'])} (step time over {slow['slow_ratio']:g}x the "
                 f"job's median, {ms(slow['median_step_time_s'])})\n")
    return text


RENDEZVOUS_NOTE_S = 10.0  # a rank this long in its rendezvous gets a line under its job (docs/daemon.md)


def _rendezvous_text(job: str, ranks: list[dict[str, Any]], world: int) -> str:
    """A line when ranks have waited RENDEZVOUS_NOTE_S or more in init_process_group: which, how long, how many
    of the job's ranks the daemon knows, and what to run."""
    waiting = [r for r in ranks if r["state"] == "rendezvous" and (r.get("state_s") or 0) >= RENDEZVOUS_NOTE_S]
    if not waiting:
        return ""
    longest = max(r.get("state_s") or 0 for r in waiting)
    return (f"job {job}: rank(s) {spans(r['rank'] for r in waiting)} have waited {longest:.0f} s in the rendezvous "
            f"(init_process_group) for the job's other ranks ({len(ranks)} of {world} registered here); see where "
            f"they wait: ondemandctl stacks --job {job}\n")


def _on_host(rank: dict[str, Any], key: str) -> str:
    """Where a rank in a container has its trigger directory or save path on this host (its paths are its
    container's)."""
    if not rank.get("in_container") or not rank.get(key):
        return ""
    seen = rank.get(f"{key}_on_host")
    if seen == rank.get(key):
        return ""
    if seen:
        return f" (in its container; on this host {seen})"
    return (f" (in its container only: reach it from inside the container, kubectl exec or nsenter -t "
            f"{rank.get('pid')} -m; a /proc/PID/root path follows the container's links from this host's root)")


def _owner(ranks: list[dict[str, Any]]) -> str:
    """Whose job it is: the uid the kernel gave for its ranks (a daemon that serves several users tells their
    jobs apart by it)."""
    uids = sorted({r["uid"] for r in ranks if r.get("uid") is not None})
    return f", owner {', '.join(owner_text(u) for u in uids)}" if uids else ""


def _vs_median(rank: dict[str, Any]) -> str:
    ratio = rank.get("vs_median")
    return "-" if not ratio else f"{ratio:.2f}x" + ("  SLOW" if rank.get("slow") else "")


def _silent_text(job: str, ranks: list[dict[str, Any]]) -> str:
    return "".join(f"SILENT: rank {r['rank']} (pid {r['pid']}{_pod_pid(r)}, {r['host']}, last at step {r['step']}) "
                   "sent no "
                   f"heartbeat for {r['silent_s']:.0f} s but its process is alive: native code holding the GIL? "
                   f"ondemandctl stacks --job {job} dumps its threads natively\n" for r in ranks)


def _pod_pid(rank: dict[str, Any]) -> str:
    return f", {rank['ns_pid']} in its pod" if rank.get("ns_pid") else ""


def _state(rank: dict[str, Any]) -> str:
    stalled, in_step = rank.get("stalled_s"), rank.get("in_step_s") or 0.0
    if stalled is not None:
        return f"STALLED {stalled:.0f} s"
    if rank["state"] == "rendezvous":  # in init_process_group before its first step (rank/agent.py)
        return f"rendezvous {rank.get('state_s') or 0:.0f} s"
    if not rank.get("step_time_s"):  # no step finished yet: never STALLED (no step time to compare with)
        state = rank["state"]
        return f"starting {in_step:.0f} s" + ("" if state == "idle" else f" ({state})")
    return rank["state"]
