"""ondemandctl across hosts (`--hosts`, `--hostfile`, `--slurm`): the single-host commands (host/commands.py)
fanned out in parallel to every host's daemon over authenticated TCP (host/fanout.py), their replies merged.

A capture across hosts is aligned by steps, not clocks: every daemon is first asked for its ranks' current
steps and step times (status), one absolute window is planned from those (registry.plan_window, the
daemon's own planner, with the fan-out's round trip as extra delivery time), and the same window and one
capture id go to every host. Each host's answer is anchored at the time it arrived, so a dead or slow host
delays nobody else's window. A host that does not answer is named and the others proceed; while a capture is
followed, a silent host is asked again until --timeout (a partition heals, a daemon restarts), then reported
`unreachable` (apart from `failed`: it answered, and its ranks failed) and sent a cancel. A daemon that gets
the window after its start has passed refuses it (host/alignment.py), so no host records other steps than
the rest; a record whose ranks did record different steps anyway is `misaligned` (exit 6).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TextIO

from ..core.protocol import FINAL_STATES, TCP_PORT as DEFAULT_PORT
from ..core.ranks import spans
from ..core.safejson import finite_number
from .alignment import MISALIGNED, mark_misaligned
from .client import (EXIT_FAILED, EXIT_MISALIGNED, EXIT_NO_DAEMON, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, EXIT_USAGE,
                     CtlError, dumps)
from .commands import Capture, Command, Show, Status, _table, _window, progress_text, render_report
from .records import new_capture_id
from .registry import DELIVERY_S, MAX_DELIVERY_S, RankInfo, match_id, plan_window, stall_text, stalls
from .summaries import merge_summaries

if TYPE_CHECKING:  # the fan-out, key and host-list modules load only when a command goes across hosts
    from .fanout import Fanout, Reply
    from .hosts import Target

WATCH_HOLD_S = 1.0  # each round of watches waits at most this long for a change on any host
REFRESH_AFTER_S = 0.5  # a status round slower than this (hosts that did not answer) is asked again of the others
CANCEL_WAIT_S = 0.5  # how long a cancel to a host we gave up on waits for its answer (it is best effort)


# ----------------------------------------------------------------------------------------------------------
# Flags and targets

def add_global_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("many hosts (each host's ondemand-profd started with --listen)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="LIST", help="hosts: node01,node02:7400, node[01-64], gpu[1-3,7]")
    where.add_argument("--hostfile", type=Path, metavar="FILE", help="hosts, one expression per line")
    where.add_argument("--slurm", metavar="JOBID", help="the hosts of this SLURM job")
    g.add_argument("--keys", type=Path, metavar="DIR", help="CurveZMQ keys (ondemandctl keygen DIR); needed "
                   "unless every daemon listens on loopback without keys")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the daemons' TCP port (default {DEFAULT_PORT})")


def targets_from(args: argparse.Namespace) -> list[Target] | None:
    """The hosts the global flags name, or None for this host's daemon over its unix socket."""
    if args.hosts is None and args.hostfile is None and args.slurm is None:
        if args.keys is not None:
            raise CtlError("--keys is for --hosts, --hostfile or --slurm", EXIT_USAGE)
        return None
    if not 0 < args.port < 65536:
        raise CtlError(f"--port {args.port}: expected 1-65535", EXIT_USAGE)
    from .hosts import HostSpecError, parse_hosts, read_hostfile, slurm_hosts

    try:
        if args.hosts is not None:
            targets = parse_hosts(args.hosts, args.port)
        elif args.hostfile is not None:
            targets = read_hostfile(args.hostfile, args.port)
        else:
            targets = slurm_hosts(args.slurm, args.port)
    except HostSpecError as exc:
        raise CtlError(str(exc), EXIT_USAGE) from None
    if not targets:
        raise CtlError("no hosts given", EXIT_USAGE)
    return targets


class Keygen(Command):
    name = "keygen"
    help = "create CurveZMQ keys for TCP across hosts: the daemons' pair, a client pair, its authorisation"
    needs_daemon = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", type=Path, help="the key directory (created 0700, files 0600)")
        parser.add_argument("--client-only", action="store_true", help="only a client key pair (a user's own "
                            "keys: copy its client.key into the daemons' authorized/ directory, and the daemons' "
                            "server.key into DIR)")

    def run(self, client: Any, args: argparse.Namespace, out: TextIO) -> int:
        from .keys import KeyFileError, keygen

        try:
            created = keygen(args.dir, args.client_only)
        except KeyFileError as exc:
            raise CtlError(f"keygen {args.dir}: {exc}") from None
        except OSError as exc:
            raise CtlError(f"keygen {args.dir}: {exc}") from None
        if args.json:
            out.write(dumps({"dir": str(args.dir), "created": [str(p) for p in created]}) + "\n")
        elif not created:
            out.write(f"{args.dir}: every key exists already; nothing changed\n")
        else:
            out.write("".join(f"created {p}\n" for p in created))
            if args.client_only:
                out.write(f"to be let in: add {args.dir}/client.key to each daemon's authorized/ directory (under a "
                          f"name of yours), and copy the daemons' server.key into {args.dir}\n")
            else:
                out.write(f"on every host: server.key, server.key_secret and authorized/ (owner-only), and "
                          f"ondemand-profd --listen tcp://0.0.0.0:7355 --keys DIR; here: ondemandctl --keys {args.dir}"
                          "\n")
        return EXIT_OK


EXTRA_COMMANDS: list[Command] = [Keygen()]


# ----------------------------------------------------------------------------------------------------------
# Running a command across hosts

def run_multi(cmd: Command, args: argparse.Namespace, targets: list[Target], out: TextIO) -> int:
    runner = RUNNERS.get(cmd.name)
    if runner is None:
        raise CtlError(f"{cmd.name} does not work across hosts; run it on the host", EXIT_USAGE)
    from .fanout import Fanout

    with Fanout(targets, args.keys, getattr(args, "connect_timeout", 5.0)) as fan:
        return runner(fan, cmd, args, out)


def ask(fan: Fanout, msg_type: str, fields: dict[str, Any] | None = None, **kw: Any) -> dict[str, Reply]:
    """fan.request, and then, for every host that did not answer, why (host/diagnose.py)."""
    replies = fan.request(msg_type, fields, **kw)
    explain(fan, replies)
    return replies


def explain(fan: Fanout, replies: dict[str, Reply]) -> None:
    """Replace "did not answer" by what is known about the hosts that did not: a name that does not resolve,
    a daemon that requires keys we did not pass, nothing listening, no route, a daemon that does not respond."""
    from .diagnose import explain as probe_all

    by_name = {t.name: t for t in fan.targets}
    silent = [by_name[n] for n, r in replies.items() if r.kind == "timeout"]
    for name, (kind, message) in probe_all(silent, fan.keyed).items():
        replies[name].kind, replies[name].error = kind, message


def _failures(replies: dict[str, Reply], absent: Callable[[Reply], bool] = lambda r: False) -> dict[str, str]:
    return {n: r.error for n, r in replies.items() if not r.ok and not absent(r)}


def _unanswered(replies: dict[str, Reply]) -> dict[str, str]:
    """The hosts that gave no answer (as opposed to an error reply): unreachable."""
    return {n: r.error for n, r in replies.items() if not r.ok and r.kind != "error"}


def _warn(failed: dict[str, str], out: TextIO) -> None:
    for name, error in failed.items():
        out.write(f"host {name}: {error}\n")


def _partial(failed: dict[str, str], replies: dict[str, Reply]) -> int:
    """Exit status: 3 when some hosts failed, 4 when none answered."""
    if not failed:
        return EXIT_OK
    return EXIT_NO_DAEMON if len(failed) == len(replies) else EXIT_PARTIAL


def _no_capture(reply: Reply) -> bool:
    return reply.kind == "error" and reply.error.startswith("no capture")


def _status(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    replies = ask(fan, "status", cmd.message(args))
    failed = _failures(replies, lambda r: r.kind == "error" and r.error.startswith("no live job"))
    if args.json:
        out.write(dumps({"hosts": {n: r.as_dict() for n, r in replies.items()}}) + "\n")
    else:
        for name, reply in replies.items():
            if reply.ok:
                out.write(f"== {name}\n" + Status().console(reply.data, args))
        _warn(failed, sys.stderr)
    return _partial(failed, replies)


def _list(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    replies = ask(fan, "list", cmd.message(args))
    merged: dict[str, dict[str, Any]] = {}
    for name, reply in replies.items():
        for c in reply.data["captures"] if reply.ok else []:
            m = merged.setdefault(c["capture_id"], {**c, "ranks": 0, "states": {}, "hosts": [], "statuses": []})
            m["ranks"] += c["ranks"]
            m["hosts"].append(name)
            m["statuses"].append(c["status"])
            for state, n in c["states"].items():
                m["states"][state] = m["states"].get(state, 0) + n
    for m in merged.values():
        m["status"] = merge_status(m.pop("statuses"))
    caps = sorted(merged.values(), key=lambda c: c["created_at"], reverse=True)[:args.limit]
    failed = _failures(replies)
    if args.json:
        out.write(dumps({"captures": caps, "failed_hosts": failed}) + "\n")
    else:
        rows = [[c["capture_id"], c["created_at"][:19].replace("T", " "), c["job"], _window(c["window"]),
                 f"{c['states'].get('done', 0)}/{c['ranks']}", str(len(c["hosts"])), c["status"]] for c in caps]
        out.write(_table(rows, ["ID", "CREATED", "JOB", "STEPS", "DONE", "HOSTS", "STATUS"]) if rows else
                  "no captures yet\n")
        _warn(failed, sys.stderr)
    return _partial(failed, replies)


def merge_status(statuses: list[str]) -> str:
    """One status from the hosts' (unreachable: a host that never answered counts as not done)."""
    if "running" in statuses:
        return "running"
    if all(s in ("done", MISALIGNED) for s in statuses):  # every rank wrote; whether alike is checked after
        return "done"
    if all(s == "cancelled" for s in statuses):
        return "cancelled"
    return "partial" if any(s in ("done", "partial", MISALIGNED) for s in statuses) else "failed"


def _one_capture(replies: dict[str, Reply]) -> dict[str, Reply]:
    """The hosts that have the capture; CtlError when none has it or a partial id means different captures."""
    found = {n: r for n, r in replies.items() if r.ok}
    ids = {r.data["capture_id"] for r in found.values()}
    if len(ids) > 1:
        raise CtlError(f"the id matches different captures on different hosts ({', '.join(sorted(ids))}); give more "
                       "of it", EXIT_USAGE)
    if not found:
        raise _none_found(replies)
    return found


def _none_found(replies: dict[str, Reply]) -> CtlError:
    """No host could act: what the daemons said, once each ("no capture ...", "already cancelled"), after naming
    the hosts that did not answer (then the exit status is partial: the capture may be on those)."""
    _warn({n: r.error for n, r in replies.items() if r.kind != "error"}, sys.stderr)
    said = {r.error for r in replies.values() if r.kind == "error" and not _no_capture(r)} or \
        {r.error for r in replies.values() if r.kind == "error"}
    unreachable = any(r.kind != "error" for r in replies.values())
    return CtlError("; ".join(sorted(said)) or "no host answered", EXIT_PARTIAL if unreachable else EXIT_FAILED)


def merged_record(found: dict[str, dict[str, Any]], failed: dict[str, str],
                  unreachable: dict[str, str] | None = None,
                  targets: dict[str, list[RankInfo]] | None = None) -> dict[str, Any]:
    """Records of one capture from several hosts -> one record (parts keyed by rank, each naming its daemon).

    `failed`: hosts that answered with an error (their ranks record nothing); `unreachable`: hosts that gave no
    answer (never, or not since some point: their ranks' last known state is kept, unfinished parts become
    `unreachable`). `targets` names the ranks of hosts with no record here, so that those ranks are listed."""
    unreachable = unreachable or {}
    first = next(iter(found.values()), {})
    parts: dict[str, Any] = {}
    for name, data in found.items():
        for key, part in data["parts"].items():
            parts[key] = {**part, "daemon": name}
            if name in unreachable and part["state"] not in FINAL_STATES:
                parts[key].update(state="unreachable", last_state=part["state"],
                                  error=f"host {name} stopped answering: {unreachable[name]}")
    for name, ranks in (targets or {}).items():
        if name not in found and (name in failed or name in unreachable):
            for i in ranks:
                parts[str(i.rank)] = _lost_part(i, name, failed.get(name) or unreachable[name], name in failed)
    hosts: dict[str, dict[str, Any]] = {n: {"status": d["status"]} for n, d in found.items()}
    hosts.update({n: {"status": "failed", "error": e} for n, e in failed.items() if n not in found})
    hosts.update({n: {"status": "unreachable", "error": e} for n, e in unreachable.items()})
    record = {**first, "parts": parts, "status": merge_status([h["status"] for h in hosts.values()]),
              "hosts": hosts}
    record.pop("version", None)
    mark_misaligned(record)
    return record


def _show(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    replies = ask(fan, "show", cmd.message(args))
    found = _one_capture(replies)
    failed = {n: r.error for n, r in replies.items() if r.kind == "error" and not _no_capture(r)}
    unreachable = _unanswered(replies)
    record = merged_record({n: r.data for n, r in found.items()}, failed, unreachable)
    if args.json:
        out.write(dumps(record) + "\n")
    else:
        text = Show().console(record, args)
        out.write(text + _host_lines(record, text))
    if record["status"] == MISALIGNED:
        return EXIT_MISALIGNED
    if failed or unreachable:
        return EXIT_PARTIAL
    return Show().exit_code(record)


def _cancel(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    replies = ask(fan, "cancel", cmd.message(args))
    sent = {n: r.data["ranks"] for n, r in replies.items() if r.ok}
    failed = _failures(replies, _no_capture)
    if not sent:  # nothing to cancel anywhere
        raise _none_found(replies)
    if args.json:
        out.write(dumps({"hosts": {n: r.as_dict() for n, r in replies.items()}}) + "\n")
    else:
        for name, ranks in sent.items():
            out.write(f"{name}: cancel sent to rank(s) {spans(ranks) or 'none'}\n")
        _warn(failed, sys.stderr)
    return _partial(failed, replies)


def _report(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    if len(args.paths) != 1:
        raise CtlError("across hosts, report takes one capture id (the traces stay on their hosts; each daemon "
                       "returns its ranks' summaries)", EXIT_USAGE)
    if args.top < 1:
        raise CtlError(f"--top {args.top}: expected 1 or more", EXIT_USAGE)
    replies = ask(fan, "summaries", {"capture_id": args.paths[0]})
    found = _one_capture(replies)
    failed = _failures(replies, _no_capture)
    data = merge_summaries((n, r.data) for n, r in found.items())
    data["failed_hosts"] = failed
    render_report(data, args, out)
    _warn(failed, sys.stderr)
    if failed:
        return EXIT_PARTIAL
    return EXIT_OK if data["ranks_read"] else EXIT_FAILED


# ----------------------------------------------------------------------------------------------------------
# Capture across hosts

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


def rank_infos(statuses: dict[str, Reply], job: str | None, slurm: str | None = None
               ) -> tuple[str, dict[str, list[RankInfo]]]:
    """The job meant and its live ranks per host, from status replies; CtlError when the job is unclear."""
    jobs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name, reply in statuses.items():
        if reply.ok:
            for j, ranks in reply.data["jobs"].items():
                jobs.setdefault(j, {})[name] = ranks
    job = pick_job(jobs, job, slurm)
    # Each daemon's estimate of its ranks' steps is anchored at the time its own reply arrived (our clock
    # only: the hosts' clocks need not agree), so plan_window extrapolates every host from its own answer: a
    # host that answered at once is not made to look 5 s behind by one that timed out in the same round.
    infos = {name: [_rank_info(r, job, statuses[name].received_at or time.time()) for r in ranks]
             for name, ranks in jobs[job].items()}
    return job, infos


def _rank_info(r: dict[str, Any], job: str, anchor: float) -> RankInfo:
    """One rank of a daemon's status reply. `step_estimate` is the daemon's estimate of the step running as
    it replied (`step` is the last one the rank reported; older daemons sent only `step`, their estimate)."""
    step = r.get("step_estimate", r["step"])
    return RankInfo(route=b"", job=job, rank=r["rank"], world_size=r["world_size"], host=r["host"], pid=r["pid"],
                    step=step if type(step) is int else r["step"], step_time=r["step_time_s"], step_began_at=anchor,
                    windows=r.get("windows") or [])


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


def stalled_refusal(statuses: dict[str, Reply], job: str, targets: dict[str, list[RankInfo]]) -> str | None:
    """Why no window can be planned: target ranks that have not finished a step for a while (their daemon
    says `stalled_s`); a window on a stalled job would never start. None when none is stalled."""
    wanted = {(name, i.rank) for name, infos in targets.items() for i in infos}
    rows = [{"rank": r["rank"], "step": r["step"], "daemon": name, "stalled_s": r.get("stalled_s")}
            for name, reply in statuses.items() if reply.ok for r in reply.data["jobs"].get(job, [])
            if (name, r["rank"]) in wanted and finite_number(r.get("stalled_s"), 0.0, 1e9)]
    stall = stalls(rows, time.time())
    return None if stall is None else f"{stall_text(job, stall)}. No window can start until they step again"


def plan_across(targets: dict[str, list[RankInfo]], request: dict[str, Any], round_trip_s: float,
                local_delivery_s: float = DELIVERY_S) -> dict[str, Any]:
    """One absolute window for every target rank. Delivery covers the status round trip (the steps are that
    old) and the capture's way out, plus one step for the daemons' own extrapolation, plus the slowest host's
    own delivery to its ranks (what each daemon learned from its ranks' answers; DELIVERY_S by default)."""
    ranks = [i for infos in targets.values() for i in infos]
    slowest = max((i.step_time or 0.0) for i in ranks)
    try:
        return plan_window(ranks, time.time(), start=request.get("start"), start_step=request.get("start_step"),
                           steps=request["steps"], delivery_s=local_delivery_s + 2 * round_trip_s + slowest)
    except ValueError as exc:
        raise CtlError(str(exc)) from None


def cap_steps_across(statuses: dict[str, Reply], job: str, targets: dict[str, list[RankInfo]],
                     request: dict[str, Any]) -> str:
    """Cap the request's length at the smallest --profile-max-window-steps of the target ranks on every host,
    so that each daemon (which caps by its own ranks only) records the same steps; the note says so."""
    wanted = {(name, i.rank) for name, infos in targets.items() for i in infos}
    caps = [r["max_window_steps"] for name, reply in statuses.items() if reply.ok
            for r in reply.data["jobs"].get(job, []) if (name, r["rank"]) in wanted and r.get("max_window_steps")]
    asked = request.get("steps")
    if not caps or not isinstance(asked, int) or asked <= min(caps):
        return ""
    request["steps"] = min(caps)
    return f"steps capped from {asked} to {min(caps)} (the smallest --profile-max-window-steps of the target ranks)"


@dataclass
class Launched:
    """A capture sent to every host: what each accepted (`found`: host -> record), which hosts answered with
    an error (`failed`) and which did not answer (`quiet`: the capture may have reached them or not), the
    plan, and how long sending took; `unanswered`: hosts that did not answer the status round (their ranks, if
    any, are not in the capture), `missing`: ranks of the job that no host that answered has."""

    capture_id: str
    job: str
    targets: dict[str, list[RankInfo]]
    plan: dict[str, Any]
    found: dict[str, dict[str, Any]]
    failed: dict[str, str]
    sent_s: float
    quiet: dict[str, str] = field(default_factory=dict)
    unanswered: dict[str, str] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)


def launch(fan: Fanout, request: dict[str, Any], job: str | None, slurm: str | None = None) -> Launched:
    """Ask every daemon for its ranks' steps, plan one window, send it with one capture id to every host."""
    request = dict(request)
    t0 = time.monotonic()
    statuses = fresh_statuses(fan)
    round_trip = max((r.seconds for r in statuses.values() if r.ok), default=0.0)
    job, infos = rank_infos(statuses, job, slurm)
    wanted = request.pop("ranks", None)
    by_default = {(name, r["rank"]) for name, reply in statuses.items() if reply.ok
                  for r in reply.data["jobs"].get(job, []) if r.get("captured_by_default", True)}
    targets = choose_targets(infos, wanted, by_default)
    if not targets:
        raise CtlError("no target ranks on the hosts that answered")
    stalled = stalled_refusal(statuses, job, targets)
    if stalled:
        raise CtlError(stalled)
    cap_note = cap_steps_across(statuses, job, targets, request)
    # the slowest host's own delivery to its ranks, as its daemon learned it (a number a host sends: bounded)
    learned = [(r.data.get("delivery_s") or {}).get(job) for name, r in statuses.items() if r.ok and name in targets]
    local = max([DELIVERY_S, *(d for d in learned if finite_number(d, 0.0, MAX_DELIVERY_S))])
    plan = plan_across(targets, request, round_trip, local)
    if request.get("start_step") is not None and plan["past_ranks"]:
        steps = plan["current_steps"].values()
        raise CtlError(f"--start-step {request['start_step']}: rank(s) {spans(plan['past_ranks'])} are already past "
                       f"it (the ranks are at steps {min(steps)}-{max(steps)}); across hosts a window starts on the "
                       "same step on every rank or not at all: give a later step, or --start N")
    plan["note"] = "; ".join(filter(None, [cap_note, plan.get("note", "")]))
    request.pop("start", None)
    request["start_step"] = plan["start_step"]
    capture_id = new_capture_id(time.time())
    per_host = {name: {"request": {**request, "ranks": [i.rank for i in ranks]}} for name, ranks in targets.items()}
    # across_hosts: a daemon that gets this after its start has passed on its ranks refuses it (alignment.py)
    replies = fan.request("capture", {"job": job, "capture_id": capture_id, "across_hosts": True},
                          per_host=per_host, hosts=list(targets))
    sent_s = time.monotonic() - t0
    found = {n: r.data for n, r in replies.items() if r.ok}
    failed = {n: r.error for n, r in replies.items() if r.kind == "error"}
    quiet = _unanswered(replies)
    explain(fan, statuses)
    if not found and not quiet:
        raise CtlError("no host accepted the capture: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
    return Launched(capture_id, job, targets, plan, found, failed, sent_s, quiet, _unanswered(statuses),
                    missing_ranks(infos, wanted))


def fresh_statuses(fan: Fanout) -> dict[str, Reply]:
    """Every host's status, for planning. When the round waited long for hosts that did not answer, those
    that did are asked once more (milliseconds), so that the plan extrapolates each rank over milliseconds
    rather than over a dead host's whole timeout (with a step rate that may have changed meanwhile); a host
    that answered only the first time keeps its first answer, anchored at its own receipt time."""
    t0 = time.monotonic()
    statuses = fan.request("status")  # the hosts that did not answer are explained after the capture is sent
    answered = [n for n, r in statuses.items() if r.ok]
    if answered and len(answered) < len(statuses) and time.monotonic() - t0 > REFRESH_AFTER_S:
        statuses.update({n: r for n, r in fan.request("status", hosts=answered).items() if r.ok})
    return statuses


def _capture(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    run = launch(fan, Capture().message(args)["request"], args.job, args.slurm)
    if not args.json:
        _print_plan(run, out)
    wait = args.report or (sys.stdout.isatty() if args.wait is None else args.wait)
    finished = True
    quiet = dict(run.quiet)  # hosts that did not answer: asked again until --timeout when waiting
    if wait:
        finished = follow(fan, run.found, run.failed, args.timeout, None if args.json else out, quiet=quiet,
                          capture_id=run.capture_id)
    if quiet:
        give_up(fan, run.capture_id, quiet, run.found)
    record = merged_record(run.found, run.failed, quiet, run.targets)
    record.update(capture_id=run.capture_id, job=run.job)
    record.setdefault("window", [run.plan["start_step"], run.plan["end_step"]])
    if run.unanswered:  # hosts that did not answer the status round: their ranks (if any) are not in it
        record["unanswered"] = run.unanswered
        record["missing_ranks"] = run.missing
        if run.missing and record["status"] == "done":
            record["status"] = "partial"
    record["plan"] = {**run.plan, "current_steps": {str(k): v for k, v in run.plan["current_steps"].items()},
                      "sent_s": round(run.sent_s, 4)}
    timed_out = not finished and any(_running(d) for n, d in run.found.items() if n not in quiet)
    if args.json and not args.report:
        out.write(dumps(record) + "\n")
    elif not args.json:
        out.write(result_lines(record, not timed_out, wait))
    if args.report:
        if not args.json:
            out.write("\n")
        summaries = fan.request("summaries", {"capture_id": run.capture_id}, hosts=list(run.found))
        render_report(merge_summaries((n, r.data) for n, r in summaries.items() if r.ok), args, out)
    if not wait:
        return EXIT_PARTIAL if run.failed or quiet else EXIT_OK
    if timed_out:
        return EXIT_TIMEOUT
    return exit_code(record["status"])


def exit_code(status: str) -> int:
    return {"done": EXIT_OK, "partial": EXIT_PARTIAL, MISALIGNED: EXIT_MISALIGNED}.get(status, EXIT_FAILED)


def give_up(fan: Fanout, capture_id: str, quiet: dict[str, str], found: dict[str, dict[str, Any]]) -> None:
    """The hosts still silent when we stop asking. Those that never confirmed the capture are sent a cancel
    (best effort: it follows the capture on the same connection, so a daemon that comes back finds both; if
    it never gets there, the daemon refuses the window anyway once its start has passed, host/alignment.py).
    Those that had confirmed it are left alone: their ranks took the window in time and record the planned
    steps. Then each is said why it is silent (host/diagnose.py)."""
    unconfirmed = [n for n in quiet if n not in found]
    if unconfirmed:
        fan.request("cancel", {"capture_id": capture_id}, hosts=unconfirmed, wait_s=CANCEL_WAIT_S)
    from .diagnose import explain as probe_all

    by_name = {t.name: t for t in fan.targets}
    verdicts = probe_all([by_name[n] for n in quiet], fan.keyed)
    for name in quiet:
        why = verdicts.get(name, ("", quiet[name]))[1]
        quiet[name] = why + ("; gave up on it (a cancel was sent)" if name not in found else
                             f"; gave up waiting (its ranks had the window: ondemandctl show {capture_id} tells what "
                             "they did)")


def _lost_part(info: RankInfo, daemon: str, error: str, failed: bool) -> dict[str, Any]:
    state = "failed" if failed else "unreachable"
    return {"rank": info.rank, "host": info.host, "pid": info.pid, "daemon": daemon, "state": state,
            "error": f"host {daemon}: {error}", "history": [{"state": state}]}


def _print_plan(run: Launched, out: TextIO) -> None:
    plan = run.plan
    n = sum(len(r) for r in run.targets.values())
    steps = plan["current_steps"].values()
    out.write(f"capture {run.capture_id}: job {run.job}, {n} rank(s) on {len(run.targets)} host(s), steps "
              f"[{plan['start_step']}, {plan['end_step']}) (ranks were at step {min(steps)}-{max(steps)}; lead "
              f"{plan['lead_steps']} steps; sent to every host in {run.sent_s * 1000:.0f} ms)\n")
    if plan.get("note"):
        out.write(f"  note: {plan['note']}\n")
    for name, error in run.unanswered.items():
        out.write(f"  host {name} did not answer the status round: {error}\n")
    if run.unanswered and run.missing:
        out.write(f"  rank(s) {spans(run.missing)} of the job were found on no host that answered: not in this "
                  "capture\n")
    for name, error in run.failed.items():
        out.write(f"  host {name} FAILED: {error}\n")
    for name, error in run.quiet.items():
        out.write(f"  host {name} did not confirm the capture: {error}\n")
    out.flush()


def _running(data: dict[str, Any]) -> bool:
    return data["status"] == "running"


def follow(fan: Fanout, found: dict[str, dict[str, Any]], failed: dict[str, str], timeout: float,
           out: TextIO | None, pending: Callable[[dict[str, Any]], bool] = _running,
           quiet: dict[str, str] | None = None, capture_id: str | None = None) -> bool:
    """Long-poll every host whose record is `pending` (default: still running), printing each rank's progress
    to `out`. A host that does not answer goes into `quiet` (host -> why; hosts the capture was sent to
    without an answer start there) and is asked again every round until `timeout`: a partition heals, a
    daemon restarts, and the ranks there may be writing all along. A host that answers with an error is
    `failed`. True when no host is left waiting; False when `timeout` ran out first (then the hosts still in
    `quiet` are unreachable, and any other still pending timed out)."""
    quiet = {} if quiet is None else quiet
    capture_id = capture_id or next(iter(found.values()))["capture_id"]
    printed: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while True:
        if out is not None:
            _print_progress(found, printed, out)
        waiting = [n for n, d in found.items() if n not in failed and pending(d)] + \
            [n for n in quiet if n not in found]
        if not waiting:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        hold = min(WATCH_HOLD_S, left)
        # a host whose record we lack is asked for it at once (timeout_s 0), the others hold for a change
        per_host = {n: {"capture_id": capture_id, "seen": found[n]["version"], "timeout_s": hold} if n in found
                    else {"capture_id": capture_id, "seen": 0, "timeout_s": 0} for n in waiting}
        began = time.monotonic()
        replies = fan.request("watch", per_host=per_host, wait_s=hold + fan.timeout_s, hosts=waiting)
        for name, reply in replies.items():
            if reply.ok:
                found[name] = reply.data
                quiet.pop(name, None)
            elif reply.kind == "error":
                quiet.pop(name, None)
                known = name in found
                failed[name] = reply.error if known or not _no_capture(reply) else (
                    f"its daemon has no record of this capture (lost on the way, or refused: its log says which; "
                    f"{reply.error})")
                if known:
                    _fail_host(found[name], f"host {name}: {reply.error}")
            else:
                quiet[name] = reply.error
        if not any(r.ok or r.kind == "error" for r in replies.values()):  # nobody answered: do not spin
            time.sleep(max(0.0, min(hold, deadline - time.monotonic()) - (time.monotonic() - began)))


def _print_progress(found: dict[str, dict[str, Any]], printed: dict[str, int], out: TextIO) -> None:
    for name, data in found.items():
        for key, part in sorted(data["parts"].items(), key=lambda kv: int(kv[0])):
            history = part.get("history") or [{"state": part["state"]}]
            for entry in history[printed.get(key, 0):]:
                out.write(f"  rank {part['rank']:<4} {name:<16} {progress_text({**part, 'state': entry['state']})}\n")
            printed[key] = len(history)
    out.flush()


def _fail_host(data: dict[str, Any], error: str) -> None:
    data["status"] = "failed"
    for part in data["parts"].values():
        if part["state"] not in FINAL_STATES:
            part["state"], part["error"] = "failed", error


def result_lines(record: dict[str, Any], finished: bool, waited: bool) -> str:
    parts = sorted(record["parts"].values(), key=lambda p: p["rank"])
    done = [p for p in parts if p["state"] == "done"]
    if not waited:
        head = f"sent; follow it with: ondemandctl --hosts ... show {record['capture_id']}\n"
    elif not finished:
        head = "timed out waiting; still running on rank(s) " + (
            spans(p["rank"] for p in parts if p["state"] not in (*FINAL_STATES, "unreachable")) or "none") + "\n"
    else:
        head = f"{record['status']}: {len(done)} of {len(parts)} rank(s) on {len(record['hosts'])} host(s) wrote a trace\n"
    lines = [head]
    for p in parts:
        late = f"  late by {p['late_by']} step(s)" if p.get("late_by") else ""
        if p["state"] == "done":
            steps = p.get("steps")
            lines.append(f"  rank {p['rank']:<4} {p['daemon']:<16} {p.get('path')}" +
                         (f"  steps {steps[0]}..{steps[-1]}" if steps else "") + late + "\n")
        elif p["state"] in ("failed", "rejected", "cancelled"):
            lines.append(f"  rank {p['rank']:<4} {p['daemon']:<16} {p['state']}: {p.get('error')}{late}\n")
        elif p["state"] == "unreachable":
            last = f" (last known: {p['last_state']})" if p.get("last_state") else ""
            lines.append(f"  rank {p['rank']:<4} {p['daemon']:<16} unreachable{last}\n")
    return "".join(lines) + _host_lines(record)


def _host_lines(record: dict[str, Any], shown: str = "") -> str:
    """What is wrong with hosts, and whether ranks recorded different steps (unless `shown` says it)."""
    lines = []
    for name, host in record["hosts"].items():
        if host["status"] in ("unreachable", "failed") and host.get("error"):
            lines.append(f"  host {name} {host['status'].upper()}: {host['error']}\n")
    for name, error in (record.get("unanswered") or {}).items():
        lines.append(f"  host {name} did not answer the status round: {error}\n")
    if record.get("unanswered") and record.get("missing_ranks"):
        lines.append(f"  rank(s) {spans(record['missing_ranks'])} of the job were found on no host that answered\n")
    bad = record.get("misaligned")
    if bad and bad["text"] not in shown:
        lines.append(f"  MISALIGNED: {bad['text']}\n")
    return "".join(lines)


RUNNERS: dict[str, Callable[[Fanout, Command, argparse.Namespace, TextIO], int]] = {
    "status": _status, "list": _list, "show": _show, "cancel": _cancel, "report": _report, "capture": _capture}
