"""ondemandctl across hosts (`--hosts`, `--hostfile`, `--slurm`): the single-host commands (host/commands.py)
fanned out in parallel to every host's daemon over authenticated TCP (host/fanout.py), their replies merged.

A capture across hosts is aligned by steps, not clocks: every daemon is first asked for its ranks' current
steps and step times (status), one absolute window is planned from those (registry.plan_window, the
daemon's own planner, with the fan-out's round trip as extra delivery time), and the same window and one
capture id go to every host. A host that does not answer is named, the others proceed, and the exit status
says partial (3).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from ..core.protocol import FINAL_STATES, TCP_PORT as DEFAULT_PORT
from ..core.ranks import spans
from ..core.safejson import finite_number
from .client import EXIT_FAILED, EXIT_NO_DAEMON, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, EXIT_USAGE, CtlError, dumps
from .commands import Capture, Command, Show, Status, _table, _window, progress_text, render_report
from .records import new_capture_id
from .registry import DELIVERY_S, MAX_DELIVERY_S, RankInfo, plan_window
from .summaries import merge_summaries

if TYPE_CHECKING:  # the fan-out, key and host-list modules load only when a command goes across hosts
    from .fanout import Fanout, Reply
    from .hosts import Target

WATCH_HOLD_S = 1.0  # each round of watches waits at most this long for a change on any host


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


def _failures(replies: dict[str, Reply], absent: Callable[[Reply], bool] = lambda r: False) -> dict[str, str]:
    return {n: r.error for n, r in replies.items() if not r.ok and not absent(r)}


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
    replies = fan.request("status", cmd.message(args))
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
    replies = fan.request("list", cmd.message(args))
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
    if "running" in statuses:
        return "running"
    if all(s == "done" for s in statuses):
        return "done"
    if all(s == "cancelled" for s in statuses):
        return "cancelled"
    return "partial" if any(s in ("done", "partial") for s in statuses) else "failed"


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


def merged_record(found: dict[str, dict[str, Any]], failed: dict[str, str]) -> dict[str, Any]:
    """Records of one capture from several hosts -> one record (parts keyed by rank, each naming its daemon)."""
    first = next(iter(found.values()))
    parts: dict[str, Any] = {}
    for name, data in found.items():
        for key, part in data["parts"].items():
            parts[key] = {**part, "daemon": name}
    statuses = [d["status"] for d in found.values()] + ["failed"] * len(failed)
    record = {**first, "parts": parts, "status": merge_status(statuses),
              "hosts": {**{n: {"status": d["status"]} for n, d in found.items()},
                        **{n: {"status": "unreachable", "error": e} for n, e in failed.items()}}}
    record.pop("version", None)
    return record


def _show(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    replies = fan.request("show", cmd.message(args))
    found = _one_capture(replies)
    failed = _failures(replies, _no_capture)
    record = merged_record({n: r.data for n, r in found.items()}, failed)
    if args.json:
        out.write(dumps(record) + "\n")
    else:
        out.write(Show().console(record, args))
        _warn(failed, sys.stderr)
    if failed:
        return EXIT_PARTIAL
    return Show().exit_code(record)


def _cancel(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    replies = fan.request("cancel", cmd.message(args))
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
    replies = fan.request("summaries", {"capture_id": args.paths[0]})
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

def rank_infos(statuses: dict[str, Reply], job: str | None) -> tuple[str, dict[str, list[RankInfo]]]:
    """The job meant and its live ranks per host, from status replies; CtlError when the job is unclear."""
    jobs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    received = time.time()
    for name, reply in statuses.items():
        if reply.ok:
            for j, ranks in reply.data["jobs"].items():
                jobs.setdefault(j, {})[name] = ranks
    if job is None:
        if not jobs:
            raise CtlError("no ranks are registered with any of the daemons that answered")
        if len(jobs) > 1:
            raise CtlError(f"{len(jobs)} jobs are live ({', '.join(sorted(jobs))}): choose one with --job",
                           EXIT_USAGE)
        job = next(iter(jobs))
    elif job not in jobs:
        raise CtlError(f"no live job {job!r} on the hosts that answered; live jobs: {', '.join(sorted(jobs)) or 'none'}")
    # Each daemon's step is its extrapolation at its reply; anchoring it to our clock at receipt (one clock,
    # ours) lets plan_window extrapolate further without assuming the hosts' clocks agree.
    infos = {name: [RankInfo(route=b"", job=job, rank=r["rank"], world_size=r["world_size"], host=r["host"],
                             pid=r["pid"], step=r["step"], step_time=r["step_time_s"], step_began_at=received,
                             windows=r.get("windows") or []) for r in ranks]
             for name, ranks in jobs[job].items()}
    return job, infos


def choose_targets(infos: dict[str, list[RankInfo]], wanted: list[int]) -> dict[str, list[RankInfo]]:
    """The ranks `wanted` names (-1: all), per host; CtlError names ranks no host has."""
    everywhere = {i.rank for ranks in infos.values() for i in ranks}
    if -1 not in wanted:
        missing = sorted(set(wanted) - everywhere)
        if missing:
            raise CtlError(f"rank(s) {spans(missing)} are not registered with any daemon that answered; live "
                           f"ranks: {spans(sorted(everywhere)) or 'none'}")
    chosen = {name: [i for i in ranks if -1 in wanted or i.rank in wanted] for name, ranks in infos.items()}
    return {name: ranks for name, ranks in chosen.items() if ranks}


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
    """A capture sent to every host: what each accepted (`found`: host -> record), which hosts failed and
    why, the parts of ranks on failed hosts (`lost`), the plan, and how long sending took."""

    capture_id: str
    job: str
    targets: dict[str, list[RankInfo]]
    plan: dict[str, Any]
    found: dict[str, dict[str, Any]]
    failed: dict[str, str]
    lost: dict[str, dict[str, Any]]
    sent_s: float


def launch(fan: Fanout, request: dict[str, Any], job: str | None) -> Launched:
    """Ask every daemon for its ranks' steps, plan one window, send it with one capture id to every host."""
    request = dict(request)
    t0 = time.monotonic()
    statuses = fan.request("status")
    round_trip = max((r.seconds for r in statuses.values() if r.ok), default=0.0)
    failed = _failures(statuses)
    job, infos = rank_infos(statuses, job)
    targets = choose_targets(infos, request.pop("ranks"))
    if not targets:
        raise CtlError("no target ranks on the hosts that answered")
    cap_note = cap_steps_across(statuses, job, targets, request)
    # the slowest host's own delivery to its ranks, as its daemon learned it (a number a host sends: bounded)
    learned = [(r.data.get("delivery_s") or {}).get(job) for name, r in statuses.items() if r.ok and name in targets]
    local = max([DELIVERY_S, *(d for d in learned if finite_number(d, 0.0, MAX_DELIVERY_S))])
    plan = plan_across(targets, request, round_trip, local)
    plan["note"] = "; ".join(filter(None, [cap_note, plan.get("note", "")]))
    request.pop("start", None)
    request["start_step"] = plan["start_step"]
    capture_id = new_capture_id(time.time())
    per_host = {name: {"request": {**request, "ranks": [i.rank for i in ranks]}} for name, ranks in targets.items()}
    replies = fan.request("capture", {"job": job, "capture_id": capture_id}, per_host=per_host,
                          hosts=list(targets))
    sent_s = time.monotonic() - t0
    found = {n: r.data for n, r in replies.items() if r.ok}
    failed.update(_failures(replies))
    lost = {str(i.rank): _lost_part(i, name, failed[name]) for name, ranks in targets.items() if name in failed
            for i in ranks}
    if not found:
        raise CtlError("no host accepted the capture: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
    return Launched(capture_id, job, targets, plan, found, failed, lost, sent_s)


def _capture(fan: Fanout, cmd: Command, args: argparse.Namespace, out: TextIO) -> int:
    run = launch(fan, Capture().message(args)["request"], args.job)
    found, failed, plan = run.found, run.failed, run.plan
    if not args.json:
        _print_plan(run, out)
    wait = args.report or (sys.stdout.isatty() if args.wait is None else args.wait)
    finished = True
    if wait:
        finished = follow(fan, found, failed, args.timeout, None if args.json else out)
    record = merged_record(found, failed)
    record["parts"].update(run.lost)
    record["plan"] = {**plan, "current_steps": {str(k): v for k, v in plan["current_steps"].items()},
                      "sent_s": round(run.sent_s, 4)}
    if args.json and not args.report:
        out.write(dumps(record) + "\n")
    elif not args.json:
        out.write(result_lines(record, finished, wait))
    if args.report:
        if not args.json:
            out.write("\n")
        summaries = fan.request("summaries", {"capture_id": run.capture_id}, hosts=list(found))
        render_report(merge_summaries((n, r.data) for n, r in summaries.items() if r.ok), args, out)
    if not wait:
        return EXIT_PARTIAL if failed else EXIT_OK
    if not finished:
        return EXIT_TIMEOUT
    return {"done": EXIT_OK, "partial": EXIT_PARTIAL}.get(record["status"], EXIT_FAILED)


def _lost_part(info: RankInfo, daemon: str, error: str) -> dict[str, Any]:
    return {"rank": info.rank, "host": info.host, "pid": info.pid, "daemon": daemon, "state": "failed",
            "error": f"host {daemon}: {error}", "history": [{"state": "failed"}]}


def _print_plan(run: Launched, out: TextIO) -> None:
    plan = run.plan
    n = sum(len(r) for r in run.targets.values())
    steps = plan["current_steps"].values()
    out.write(f"capture {run.capture_id}: job {run.job}, {n} rank(s) on {len(run.targets)} host(s), steps "
              f"[{plan['start_step']}, {plan['end_step']}) (ranks were at step {min(steps)}-{max(steps)}; lead "
              f"{plan['lead_steps']} steps; sent to every host in {run.sent_s * 1000:.0f} ms)\n")
    if plan.get("note"):
        out.write(f"  note: {plan['note']}\n")
    for name, error in run.failed.items():
        out.write(f"  host {name} FAILED: {error}\n")
    out.flush()


def _running(data: dict[str, Any]) -> bool:
    return data["status"] == "running"


def follow(fan: Fanout, found: dict[str, dict[str, Any]], failed: dict[str, str], timeout: float,
           out: TextIO | None, pending: Callable[[dict[str, Any]], bool] = _running) -> bool:
    """Long-poll every host whose record is `pending` (default: still running), printing each rank's progress
    to `out`; a host that stops answering is failed. False when `timeout` ran out first."""
    printed: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while True:
        if out is not None:
            for name, data in found.items():
                for key, part in sorted(data["parts"].items(), key=lambda kv: int(kv[0])):
                    history = part.get("history") or [{"state": part["state"]}]
                    for entry in history[printed.get(key, 0):]:
                        out.write(f"  rank {part['rank']:<4} {name:<16} "
                                  f"{progress_text({**part, 'state': entry['state']})}\n")
                    printed[key] = len(history)
            out.flush()
        waiting = [n for n, d in found.items() if pending(d)]
        if not waiting:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        hold = min(WATCH_HOLD_S, left)
        per_host = {n: {"capture_id": found[n]["capture_id"], "seen": found[n]["version"], "timeout_s": hold}
                    for n in waiting}
        replies = fan.request("watch", per_host=per_host, wait_s=hold + fan.timeout_s, hosts=waiting)
        for name, reply in replies.items():
            if reply.ok:
                found[name] = reply.data
            else:
                failed[name] = f"stopped answering during the capture: {reply.error}"
                _fail_host(found[name], failed[name])


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
            spans(p["rank"] for p in parts if p["state"] not in FINAL_STATES) or "none") + "\n"
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
    for name, host in record["hosts"].items():
        if host["status"] == "unreachable":
            lines.append(f"  host {name} FAILED: {host['error']}\n")
    return "".join(lines)


RUNNERS: dict[str, Callable[[Fanout, Command, argparse.Namespace, TextIO], int]] = {
    "status": _status, "list": _list, "show": _show, "cancel": _cancel, "report": _report, "capture": _capture}
