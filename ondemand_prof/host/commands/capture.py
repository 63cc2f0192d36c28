"""ondemandctl capture: the daemon resolves a request once into one aligned window for its ranks; across
hosts ondemandctl plans that window from every daemon's status (host/planning.py) and sends it to all. Then,
either way, the capture is followed by long polls (`watch`) until every rank is done, and the result names
each rank's trace. What follows a capture, and prints progress and results, serves one host (through
client.OneHost) and many alike; `show` prints its results too."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO

from ...core.files import presence_note
from ...core.options import add_window_flags, window_overrides
from ...core.protocol import FINAL_STATES, encode
from ...core.ranks import RankSpecError, parse_ranks, spans
from ...core.requests import RequestError, WindowDefaults, parse_request, resolve
from ..alignment import MISALIGNED, late_refusal, mark_misaligned, refuse_parts
from ..client import (EXIT_FAILED, EXIT_MISALIGNED, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, EXIT_USAGE, Client, CtlError,
                      OneHost, dumps)
from ..multihost import give_up, launch
from ..planning import capture_record, common_cap, fail_host, no_capture, no_window
from ..records import CaptureRecord, new_capture_id
from ..registry import plan_window, select_ranks, stall_text, stalls
from ..service import MAX_WATCH_S, BadRequest, Service
from .base import Command, add_job_flag, opt_str, who, window_text
from ..summaries import merge_summaries
from .report import render_report, report_paths

if TYPE_CHECKING:
    from ..fanout import Fanout
    from ..planning import Launched

log = logging.getLogger("ondemand_prof.daemon")

HOLD_ONE_S = 10.0  # one host: each watch waits this long at most for a change
WATCH_HOLD_S = 1.0  # across hosts: each round of watches waits at most this long for a change on any host


class Capture(Command):
    name = "capture"
    help = "profile a window of steps on some ranks, wait, and print where each rank's trace went"
    fields = {"request": (dict,)}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_job_flag(parser)
        parser.add_argument("--ranks", help="ranks: a list or ranges like 0-3,7; -1 = all (default: the ranks a "
                            "touched trigger file captures, --profile-ondemand-ranks, all unless the job set it)")
        where = parser.add_mutually_exclusive_group()
        where.add_argument("--start", type=int, help="first step, counted from the furthest-ahead rank's current "
                           "step (default 1: as soon as every rank can; the daemon adds lead when needed)")
        where.add_argument("--start-step", type=int, help="absolute first step")
        parser.add_argument("--steps", type=int, default=2, help="number of steps to record (default 2)")
        add_window_flags(parser)
        parser.add_argument("--id", dest="label", help="your label for this capture")
        parser.add_argument("--wait", action=argparse.BooleanOptionalAction, default=None,
                            help="follow progress until every rank is done (default: when output is a terminal)")
        parser.add_argument("--timeout", type=float, default=300.0, help="how long --wait waits, s (default 300)")
        parser.add_argument("--report", action="store_true", help="when done, report on what was captured "
                            "(implies --wait)")
        parser.add_argument("--html", metavar="FILE", help="with --report: also write the HTML report here")
        parser.add_argument("--top", type=int, default=10, help="with --report: operators per table (default 10)")
        parser.add_argument("--summary", action="store_true", help="with --report: only the across-ranks table")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        if args.html and not args.report:
            raise CtlError("--html needs --report (it writes the report of what was captured)", EXIT_USAGE)
        try:
            ranks = None if args.ranks is None else list(parse_ranks(args.ranks))
        except RankSpecError as exc:
            raise CtlError(f"--ranks {args.ranks!r}: {exc}", EXIT_USAGE) from None
        for flag in ("steps", "start", "start_step"):
            value = getattr(args, flag)
            if value is not None and value < (1 if flag == "steps" else 0):
                raise CtlError(f"--{flag.replace('_', '-')} {value}: expected "
                               f"{'1 or more' if flag == 'steps' else '0 or more'}", EXIT_USAGE)
        request: dict[str, Any] = {"steps": args.steps, **window_overrides(args)}
        if ranks is not None:
            request["ranks"] = ranks
        for key in ("start", "start_step"):
            if getattr(args, key) is not None:
                request[key] = getattr(args, key)
        if args.label:
            request["id"] = args.label
        msg: dict[str, Any] = {"request": request}
        if args.job:
            msg["job"] = args.job
        return msg

    # ------------------------------------------------------------------------------------------------------
    # The daemon's side

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """Resolve the request once, here: targets, one aligned window after any already planned, the ranks'
        own defaults and length cap; every target gets the same finished window."""
        try:
            request = parse_request(msg["request"])
            job = service.registry.resolve_job(opt_str(msg, "job"))
            live = service.registry.jobs()[job]
            targets = _targets(service, job, request.ranks, max(r.world_size for r in live))
            wall = time.time()
            stall = stalls([{"rank": t.rank, "step": t.step, "stalled_s": t.stalled_s(wall)} for t in targets], wall)
            if stall:  # a window there cannot start: say so now rather than time out later
                raise ValueError(no_window(job, stall))
            defaults = _common_defaults(targets)
            steps = min(defaults.steps if request.steps is None else request.steps, defaults.max_steps)
            plan = plan_window(targets, wall, start=request.start, start_step=request.start_step, steps=steps,
                               delivery_s=service.delivery.estimate(job))
        except (RequestError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
        capture_id = _adopted_id(service, msg) or new_capture_id(wall)
        # ranks of one job nearly always share their defaults: resolve and encode once per distinct defaults
        # (per rank, that was most of the time from request to the last rank's window at 64 ranks)
        distinct: list[tuple[WindowDefaults, Any]] = []

        def window_for(d: WindowDefaults) -> Any:
            for known, window in distinct:
                if known == d:
                    return window
            window = resolve(request, dataclasses.replace(d, max_steps=defaults.max_steps), plan["start_step"],
                             source="daemon", capture_id=capture_id, extra={"via": "ondemand-profd"})
            distinct.append((d, window))
            return window

        windows = {t.rank: window_for(t.defaults or defaults) for t in targets}
        first = windows[targets[0].rank]
        plan["note"] = "; ".join(filter(None, [first.note, plan.get("note", "")]))
        record = CaptureRecord.new(capture_id, job, request.as_dict(), plan, first.options.as_dict(),
                                   [{"rank": t.rank, "host": t.host, "pid": t.pid, "uid": t.uid} for t in targets],
                                   wall)
        late = late_refusal(plan) if msg.get("across_hosts") is True else None
        if late:  # shared with other hosts' ranks: on the same steps everywhere or not here (host/alignment.py)
            refuse_parts(record, late, wall)
            service.store.add(record)
            log.warning("ondemand-profd: capture %s: %s", capture_id, late)
            return {**record.data, "version": record.version}
        service.store.add(record)
        bodies: dict[int, bytes] = {}  # each distinct window encoded once, now that the plan's note is known
        for _, window in distinct:
            wire = dataclasses.replace(window, note=plan["note"]) if plan.get("after") else window
            bodies[id(window)] = encode("capture", window=wire.to_wire())
        for t in targets:
            service.send(t.route, bodies[id(windows[t.rank])])
        log.info("ondemand-profd: capture %s: job %s, %d rank(s), steps [%d, %d)%s", capture_id, job, len(targets),
                 plan["start_step"], plan["end_step"], f" ({plan['note']})" if plan["note"] else "")
        return {**record.data, "version": record.version}

    # ------------------------------------------------------------------------------------------------------
    # ondemandctl: one host

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        record = client.request("capture", **self.message(args))
        wait = waits(args)
        if not args.json:
            out.write(_plan_text(record))
            out.flush()
        if not wait:
            out.write(dumps(record) + "\n" if args.json else
                      f"not waiting; follow it with: ondemandctl show {record['capture_id']}\n")
            return EXIT_OK
        one = OneHost(client)
        found = {one.name: record}
        finished = follow(one, found, {}, args.timeout, None if args.json else out)
        record = found[one.name]
        mark_misaligned(record)
        paths = [p["path"] for p in record["parts"].values() if p["state"] == "done" and p.get("path")]
        self._result(record, result_text(record, finished), args, out,
                     (lambda: report_paths(paths, args, out)) if paths else None)
        return exit_for(record) if finished else EXIT_TIMEOUT

    # ------------------------------------------------------------------------------------------------------
    # ondemandctl: across hosts

    def run_across(self, fan: Fanout, args: argparse.Namespace, out: TextIO) -> int:
        """One aligned window on the target ranks of every host, one capture id (host/planning.py); followed
        on every host, a silent host asked again until --timeout, then given up on (host/multihost.py)."""
        run = launch(fan, self.message(args)["request"], args.job, args.slurm)
        if not args.json:
            out.write(_plan_across_text(run))
            out.flush()
        wait = waits(args)
        finished = True
        quiet = dict(run.quiet)  # hosts that did not answer: asked again until --timeout when waiting
        if wait:
            finished = follow(fan, run.found, run.failed, args.timeout, None if args.json else out, quiet=quiet,
                              capture_id=run.capture_id)
        if quiet:
            give_up(fan, run.capture_id, quiet, run.found)
        record = capture_record(run, quiet)
        timed_out = not finished and any(_running(d) for n, d in run.found.items() if n not in quiet)

        def report() -> None:  # each daemon's summaries of its ranks' traces, merged (no trace crosses the network)
            summaries = fan.request("summaries", {"capture_id": run.capture_id}, hosts=list(run.found))
            render_report(merge_summaries((n, r.data) for n, r in summaries.items() if r.ok), args, out)

        self._result(record, result_text(record, not timed_out, wait, across=True), args, out, report)
        if not wait:
            return EXIT_PARTIAL if run.failed or quiet else EXIT_OK
        return EXIT_TIMEOUT if timed_out else exit_for(record)

    def _result(self, record: dict[str, Any], text: str, args: argparse.Namespace, out: TextIO,
                report: Callable[[], Any] | None) -> None:
        """The record (--json) or the result text; then, with --report and something to report on, the report."""
        if args.json and not args.report:
            out.write(dumps(record) + "\n")
        elif not args.json:
            out.write(text)
        if args.report and report is not None:
            if not args.json:
                out.write("\n")
            report()


def waits(args: argparse.Namespace) -> bool:
    """--wait, --no-wait, or by default: when stdout is a terminal (--report always waits)."""
    return bool(args.report or (sys.stdout.isatty() if args.wait is None else args.wait))


class Watch(Command):
    """Long poll: reply when the capture changes from the version the caller has seen, or after timeout_s."""

    name = "watch"
    cli = False
    fields = {"capture_id": (str,), "seen": (int,)}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        record = service.find(msg["capture_id"])
        timeout = msg.get("timeout_s", 5.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_WATCH_S:
            raise BadRequest(f"field 'timeout_s' must be a number from 0 to {MAX_WATCH_S:g}, got {timeout!r}")
        if record.version != msg["seen"] or record.status != "running" or timeout == 0:
            return {**record.data, "version": record.version}
        service.watch(route, msg.get("id"), record, timeout)
        return None


# ----------------------------------------------------------------------------------------------------------
# The daemon's planning helpers

def _targets(service: Service, job: str, ranks: tuple[int, ...] | None, world: int) -> list[Any]:
    """The ranks a request names, or, naming none, those a touched trigger file would capture (each rank's
    --profile-ondemand-ranks, sent at registration): one default for the file and ondemandctl."""
    if ranks is not None:
        return service.registry.select(job, select_ranks(list(ranks), world))
    targets = [r for r in service.registry.select(job, [-1]) if r.defaults is None or r.defaults.selects(r.rank)]
    if not targets:
        raise ValueError(f"no rank of job {job!r} takes a capture that names no ranks (--profile-ondemand-ranks); "
                         "name them with --ranks")
    return targets


def _common_defaults(targets: list[Any]) -> WindowDefaults:
    """The targets' defaults with one length cap for all (host/planning.py common_cap), so that every rank
    records the same steps."""
    known = [t.defaults for t in targets if t.defaults is not None]
    if not known:
        raise ValueError("the target ranks did not say their window defaults (an older ondemand_prof?)")
    return dataclasses.replace(known[0], max_steps=common_cap(d.max_steps for d in known))


_CAPTURE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _adopted_id(service: Service, msg: dict[str, Any]) -> str | None:
    """A capture id chosen by the caller (ondemandctl across hosts: one id on every host), when well-formed."""
    value = msg.get("capture_id")
    if value is None:
        return None
    if not isinstance(value, str) or not _CAPTURE_ID.match(value):
        raise BadRequest(f"capture_id {value!r}: expected 1-64 letters, digits, '.', '_' or '-'")
    if value in service.store.records:
        raise BadRequest(f"capture {value} already exists on this host")
    return value


# ----------------------------------------------------------------------------------------------------------
# Following a capture: one host or many

def _running(data: dict[str, Any]) -> bool:
    return data["status"] == "running"


def follow(fan: Fanout | OneHost, found: dict[str, dict[str, Any]], failed: dict[str, str], timeout: float,
           out: TextIO | None, pending: Callable[[dict[str, Any]], bool] = _running,
           quiet: dict[str, str] | None = None, capture_id: str | None = None) -> bool:
    """Long-poll every host whose record is `pending` (default: still running), printing each rank's progress
    to `out`. `fan`: the fan-out across hosts (each rank's line names its daemon), or this host's daemon
    (client.OneHost, whose errors raise): then each watch holds longer, a recording rank's step is shown, and
    when nothing moved in a round, what status says of a stall among the ranks still working (once per change).

    A host that does not answer goes into `quiet` (host -> why; hosts the capture was sent to without an
    answer start there) and is asked again every round until `timeout`: a partition heals, a daemon
    restarts, and the ranks there may be writing all along. A host that answers with an error is `failed`.
    True when no host is left waiting; False when `timeout` ran out first
    (then the hosts still in `quiet` are unreachable, and any other still pending timed out)."""
    quiet = {} if quiet is None else quiet
    capture_id = capture_id or next(iter(found.values()))["capture_id"]
    one_host = isinstance(fan, OneHost)
    progress = None if out is None else Progress(out, one_host)
    shown_stall = ""
    deadline = time.monotonic() + timeout
    while True:
        if progress is not None:
            progress.show(found)
        waiting = [n for n, d in found.items() if n not in failed and pending(d)] + \
            [n for n in quiet if n not in found]
        if not waiting:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        hold = min(HOLD_ONE_S if one_host else WATCH_HOLD_S, left)
        seen = {n: d["version"] for n, d in found.items()}
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
                failed[name] = reply.error if known or not no_capture(reply) else (
                    f"its daemon has no record of this capture (lost on the way, or refused: its log says which; "
                    f"{reply.error})")
                if known:
                    fail_host(found[name], f"host {name}: {reply.error}")
            else:
                quiet[name] = reply.error
        if not any(r.ok or r.kind == "error" for r in replies.values()):  # nobody answered: do not spin
            time.sleep(max(0.0, min(hold, deadline - time.monotonic()) - (time.monotonic() - began)))
        elif one_host and out is not None and all(found[n]["version"] == seen.get(n) for n in waiting):
            for data in found.values():  # nothing moved for a while: is the job hung?
                stall = _stall_of(fan, data)
                if stall and stall != shown_stall:
                    shown_stall = stall
                    out.write(f"  {stall}; the window cannot go on until they step again (still waiting, up to "
                              f"--timeout {timeout:g} s)\n")


def _stall_of(fan: Fanout | OneHost, record: dict[str, Any]) -> str:
    """What status says of a stall among a capture's unfinished ranks ('' when none, or when it cannot say)."""
    waiting = {p["rank"] for p in record["parts"].values() if p["state"] not in FINAL_STATES}
    try:
        reply = next(iter(fan.request("status", {"job": record["job"], "brief": True}).values()))
    except CtlError:
        return ""
    stall = reply.data.get("stalled", {}).get(record["job"]) if reply.ok else None
    if not stall or not waiting.intersection(stall["ranks"]):
        return ""
    return stall_text(record["job"], stall)


class Progress:
    """Each rank's progress as it happens: every state its part went through, even brief ones; across hosts
    with the daemon that has it, on one host with the step a recording rank reached."""

    def __init__(self, out: TextIO, one_host: bool) -> None:
        self.out = out
        self.one_host = one_host
        self.printed: dict[str, int] = {}  # history entries shown per rank
        self.shown_step: dict[str, str] = {}

    def show(self, found: dict[str, dict[str, Any]]) -> None:
        for name, record in found.items():
            daemon = None if self.one_host else name
            for key, part in sorted(record["parts"].items(), key=lambda kv: int(kv[0])):
                history = part.get("history") or [{"state": part["state"]}]
                for entry in history[self.printed.get(key, 0):]:
                    self.out.write(who(part, daemon) + progress_text({**part, "state": entry["state"]}) + "\n")
                self.printed[key] = len(history)
                step_text = recording_step(record, part) if self.one_host else ""
                if step_text and self.shown_step.get(key) != step_text:
                    self.shown_step[key] = step_text
                    self.out.write(who(part) + step_text + "\n")
        self.out.flush()


def recording_step(record: dict[str, Any], part: dict[str, Any]) -> str:
    """'recording step k of N' from the step a recording rank last reported (heartbeats, once a second)."""
    at, window = part.get("at_step"), record.get("window")
    if part["state"] != "recording" or at is None or not window:
        return ""
    total = window[1] - window[0]
    return f"recording step {min(max(at - window[0] + 1, 1), total)} of {total}"


def progress_text(part: dict[str, Any]) -> str:
    state = part["state"]
    if state in ("received", "scheduled"):
        return f"{state:<10} window {window_text(part.get('window'))}"
    if state == "recording":
        late = part.get("late_by") or 0
        why = part.get("note") or "it got the window after its start"  # the rank's note says which, and where to
        return "recording" + (f" (late by {late} step{'s' if late != 1 else ''}: {why})" if late else "")
    if state == "done":
        return f"{'done':<10} {part.get('trace') or part.get('path')}"
    if state in ("failed", "rejected"):
        return f"{state:<10} {part.get('error')}"
    return state


# ----------------------------------------------------------------------------------------------------------
# What the console says of a capture

def _plan_text(record: dict[str, Any]) -> str:
    plan = record["plan"]
    text = (f"capture {record['capture_id']}: job {record['job']}, {len(record['parts'])} rank(s), steps "
            f"{window_text(record['window'])} (ranks were at step {min(plan['current_steps'].values())}-"
            f"{max(plan['current_steps'].values())}; lead {plan['lead_steps']} steps)\n")
    if plan.get("note"):
        text += f"  note: {plan['note']}\n"
    past = plan.get("past_ranks", plan.get("late_ranks")) or []
    close = [r for r in plan.get("late_ranks") or [] if r not in past]
    if past:
        text += (f"  warning: rank(s) {spans(past)} are already past the start step; they will start at "
                 "once, late, and record the same number of steps from there\n")
    if close:
        text += (f"  warning: rank(s) {spans(close)} are less than {plan['lead_steps']} steps (the lead "
                 "delivery needs) before the start step; they may get the window late, and then record "
                 "the same number of steps from there\n")
    return text


def _plan_across_text(run: Launched) -> str:
    plan = run.plan
    n = sum(len(r) for r in run.targets.values())
    steps = plan["current_steps"].values()
    text = (f"capture {run.capture_id}: job {run.job}, {n} rank(s) on {len(run.targets)} host(s), steps "
            f"[{plan['start_step']}, {plan['end_step']}) (ranks were at step {min(steps)}-{max(steps)}; lead "
            f"{plan['lead_steps']} steps; sent to every host in {run.sent_s * 1000:.0f} ms)\n")
    if plan.get("note"):
        text += f"  note: {plan['note']}\n"
    for name, error in run.unanswered.items():
        text += f"  host {name} did not answer the status round: {error}\n"
    if run.unanswered and run.missing:
        text += (f"  rank(s) {spans(run.missing)} of the job were found on no host that answered: not in this "
                 "capture\n")
    for name, error in run.failed.items():
        text += f"  host {name} FAILED: {error}\n"
    for name, error in run.quiet.items():
        text += f"  host {name} did not confirm the capture: {error}\n"
    return text


def result_text(record: dict[str, Any], finished: bool, waited: bool = True, across: bool = False) -> str:
    """The outcome and each rank's result, or why it has none. On one host (and `show`, across hosts too):
    the capture folder (what HTA, TensorBoard and `ondemandctl report` open) and each rank's trace file, checked
    on disk; a capture across hosts (`across`): each rank's folder with the daemon that has it, how late it
    began, and what became of ranks whose host was given up on. Then what is wrong with hosts, and whether
    the ranks recorded different steps."""
    parts = sorted(record["parts"].values(), key=lambda p: p["rank"])
    done = [p for p in parts if p["state"] == "done"]
    lines = [_head(record, parts, len(done), finished, waited, across)]
    folders = [] if across else sorted({os.path.dirname(p["path"]) for p in done if p.get("path")})
    if folders:
        lines.append(f"  capture folder{'s' if len(folders) > 1 else ''}: {', '.join(folders)}  (ondemandctl report "
                     f"{record['capture_id']})\n")
    here = socket.gethostname()
    lines += [line for p in parts if (line := _part_result(p, here, across))]
    hosts, misaligned = _host_lines(record), record.get("misaligned")
    tail = [f"  MISALIGNED: {misaligned['text']}\n"] if misaligned else []
    return "".join(lines + (hosts + tail if across else tail + hosts))


def _head(record: dict[str, Any], parts: list[dict[str, Any]], done: int, finished: bool, waited: bool,
          across: bool) -> str:
    if across and not waited:
        return f"sent; follow it with: ondemandctl --hosts ... show {record['capture_id']}\n"
    if not finished and across:
        return "timed out waiting; still running on rank(s) " + (
            spans(p["rank"] for p in parts if p["state"] not in (*FINAL_STATES, "unreachable")) or "none") + "\n"
    if not finished:
        pending = ", ".join(str(p["rank"]) for p in parts if p["state"] not in FINAL_STATES)
        return (f"timed out waiting; still running on rank(s) {pending} (ondemandctl show {record['capture_id']})\n"
                if waited else f"running: rank(s) {pending} still working\n")
    on = f" on {len(record['hosts'])} host(s)" if across else ""
    return f"{record['status']}: {done} of {len(parts)} rank(s){on} wrote a trace\n"


def _part_result(p: dict[str, Any], here: str, across: bool) -> str:
    """One rank's line of the result ('' for a rank still on its way)."""
    start = who(p, p["daemon"] if across else None)
    late = f"  late by {p['late_by']} step(s)" if across and p.get("late_by") else ""
    if p["state"] == "done":
        steps = p.get("steps")
        if across:  # the rank's folder, on its host
            path, note = p.get("path"), ""
        else:  # the trace file (torch_npu writes a directory), checked when it is on this host
            path = p.get("trace") or p.get("path") or "?"
            note = presence_note(path) if p["host"] == here else ""
        return start + f"{path}" + (f"  steps {steps[0]}..{steps[-1]}" if steps else "") + note + late + "\n"
    if p["state"] in ("failed", "rejected") or (across and p["state"] == "cancelled"):
        return start + f"{p['state']}: {p.get('error')}{late}\n"
    if across and p["state"] == "unreachable":
        last = f" (last known: {p['last_state']})" if p.get("last_state") else ""
        return start + f"unreachable{last}\n"
    return ""


def _host_lines(record: dict[str, Any]) -> list[str]:
    """What is wrong with hosts (a record merged from several, host/planning.py)."""
    lines = []
    for name, host in (record.get("hosts") or {}).items():
        if host["status"] in ("unreachable", "failed") and host.get("error"):
            lines.append(f"  host {name} {host['status'].upper()}: {host['error']}\n")
    for name, error in (record.get("unanswered") or {}).items():
        lines.append(f"  host {name} did not answer the status round: {error}\n")
    if record.get("unanswered") and record.get("missing_ranks"):
        lines.append(f"  rank(s) {spans(record['missing_ranks'])} of the job were found on no host that answered\n")
    return lines


def exit_for(record: dict[str, Any]) -> int:
    return {"done": EXIT_OK, "partial": EXIT_PARTIAL, MISALIGNED: EXIT_MISALIGNED}.get(
        record["status"], EXIT_FAILED if record["status"] != "running" else EXIT_TIMEOUT)
