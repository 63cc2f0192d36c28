"""ondemandctl's commands, one class each holding both ends (the shape of circus's commands): its name and
help, its flags, the message it sends and the fields that message has, what the daemon executes for it
(`execute`, run by host/service.py), and how the console shows the reply. The docstrings are the help."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..core.files import presence_note
from ..core.options import add_window_flags, window_overrides
from ..core.protocol import FINAL_STATES, encode
from ..core.ranks import RankSpecError, parse_ranks, spans
from ..core.requests import RequestError, WindowDefaults, parse_request, resolve
from .alignment import MISALIGNED, late_refusal, mark_misaligned, refuse_parts
from .client import EXIT_FAILED, EXIT_MISALIGNED, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, EXIT_USAGE, Client, CtlError, dumps
from .records import CaptureRecord, new_capture_id
from .registry import match_id, plan_window, select_ranks, stall_text, stalls
from .service import MAX_WATCH_S, BadRequest, Service

Fields = dict[str, tuple[type, ...]]
log = logging.getLogger("ondemand_prof.daemon")


class Command:
    name = ""
    help = ""
    needs_daemon = True
    cli = True  # False: a message only ondemandctl's other commands send (watch)
    fields: Fields = {}  # required message fields and their types (the transport checks them)

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """The daemon's side: the reply's data, or None when the reply comes later. BadRequest for bad input."""
        raise BadRequest(f"{self.name} is not a daemon command")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        data = client.request(self.name, **self.message(args))
        if args.json:
            out.write(dumps(data) + "\n")
        else:
            out.write(self.console(data, args))
        return self.exit_code(data)

    def console(self, data: Any, args: argparse.Namespace) -> str:
        return dumps(data) + "\n"

    def exit_code(self, data: Any) -> int:
        return EXIT_OK


# ----------------------------------------------------------------------------------------------------------

def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if not seconds else f"{seconds * 1000:.1f} ms"


def _vs_median(rank: dict[str, Any]) -> str:
    ratio = rank.get("vs_median")
    return "-" if not ratio else f"{ratio:.2f}x" + ("  SLOW" if rank.get("slow") else "")


def _silent_text(job: str, ranks: list[dict[str, Any]]) -> str:
    return "".join(f"SILENT: rank {r['rank']} (pid {r['pid']}, {r['host']}, last at step {r['step']}) sent no heartbeat "
                   f"for {r['silent_s']:.0f} s but its process is alive: native code holding the GIL? ondemandctl "
                   f"stacks --job {job} dumps its threads natively\n" for r in ranks)


def _state(rank: dict[str, Any]) -> str:
    stalled, in_step = rank.get("stalled_s"), rank.get("in_step_s") or 0.0
    if stalled is not None:
        return f"STALLED {stalled:.0f} s"
    if not rank.get("step_time_s") and in_step >= 10:  # no step finished yet (a stall once one has)
        return f"starting {in_step:.0f} s"
    return rank["state"]


def _window(w: list[int] | None) -> str:
    return "-" if not w else f"[{w[0]}, {w[1]})"


class Status(Command):
    name = "status"
    help = "live ranks: job, rank, host, pid, current step, step time, state"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"job": args.job} if args.job else {}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        now, wall = time.monotonic(), time.time()
        live = service.registry.jobs()
        job = _opt_str(msg, "job")
        if job:
            try:
                job = match_id(job, live, "live job")
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        jobs = {name: [r.as_dict(now, wall) for r in ranks] for name, ranks in live.items() if not job or name == job}
        from .triage import stragglers

        slow = {name: stragglers(ranks) for name, ranks in jobs.items()}  # adds vs_median and slow to each rank
        stalled = {name: stall for name, ranks in jobs.items() if (stall := stalls(ranks, wall)) is not None}
        conflicts = {name: c for name in jobs if (c := service.registry.conflicts_of(name, now))}
        silent: dict[str, list[dict[str, Any]]] = {}  # heartbeats stopped, process alive: the GIL held?
        for info in service.triage.silent_ranks(job or None, now):
            silent.setdefault(info.job, []).append({"rank": info.rank, "pid": info.pid, "host": info.host,
                                                    "step": info.step, "silent_s": round(now - info.last_seen, 1)})
        return {"daemon": service.daemon_info(), "jobs": jobs if not msg.get("brief") else {}, "stragglers": slow,
                "delivery_s": service.delivery.longer(jobs), "stalled": stalled, "conflicts": conflicts,
                "silent": silent}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        d = data["daemon"]
        text = (f"ondemand-profd {d['version']} pid {d['pid']} on {d['host']}, up {d['uptime_s']:.0f} s; "
                f"{d['captures']} capture record(s), {d['running_captures']} running\n")
        silent = data.get("silent") or {}
        if not data["jobs"] and not silent:
            return text + "no ranks registered\n"
        for job in sorted(set(silent) - set(data["jobs"])):
            text += f"\njob {job}: no rank answers\n" + _silent_text(job, silent[job])
        for job, ranks in data["jobs"].items():
            world = max(r["world_size"] for r in ranks)
            text += f"\njob {job}: {len(ranks)} of {world} rank(s) registered\n"
            for label, key in (("trigger dir", "trigger_dir"), ("save path", "save_root")):
                places = sorted({r.get(key) or "?" for r in ranks})
                text += f"  {label}: {', '.join(places)}\n"
            rows = [[str(r["rank"]), r["host"], str(r["pid"]), str(r["step"]), _ms(r["step_time_s"]), _state(r),
                     f"{r['last_seen_s']:.1f} s ago", _vs_median(r)] for r in ranks]
            text += _table(rows, ["RANK", "HOST", "PID", "STEP", "STEP TIME", "STATE", "HEARD", "VS MEDIAN"])
            stall = (data.get("stalled") or {}).get(job)
            if stall:
                text += stall_text(job, stall) + "\n"
            text += _silent_text(job, silent.get(job) or [])
            for c in (data.get("conflicts") or {}).get(job) or []:
                text += (f"CONFLICT: rank {c['rank']} is held by pid {c['pid']} ({c['host']}); pid {c['refused_pid']} "
                         f"({c['refused_host']}) claims it too and is refused ({c['attempts']} tries): two jobs "
                         "share this job id\n")
            delivery = (data.get("delivery_s") or {}).get(job)
            if delivery:  # learned from ranks that took windows late: captures now plan a longer lead
                text += (f"windows took up to {delivery * 1000:.0f} ms to reach this job's ranks lately; captures "
                         "start far enough ahead for that\n")
            slow = (data.get("stragglers") or {}).get(job) or {}
            if slow.get("slow_ranks"):
                text += (f"slow: rank(s) {spans(slow['slow_ranks'])} (step time over {slow['slow_ratio']:g}x the "
                         f"job's median, {_ms(slow['median_step_time_s'])})\n")
        return text


class Capture(Command):
    name = "capture"
    help = "profile a window of steps on some ranks, wait, and print where each rank's trace went"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="the job (needed when several are live)")
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

    fields = {"request": (dict,)}

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

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """Resolve the request once, here: targets, one aligned window after any already planned, the ranks'
        own defaults and length cap; every target gets the same finished window."""
        try:
            request = parse_request(msg["request"])
            job = service.registry.resolve_job(_opt_str(msg, "job"))
            live = service.registry.jobs()[job]
            targets = _targets(service, job, request.ranks, max(r.world_size for r in live))
            wall = time.time()
            stall = stalls([{"rank": t.rank, "step": t.step, "stalled_s": t.stalled_s(wall)} for t in targets], wall)
            if stall:  # a window there cannot start: say so now rather than time out later
                raise ValueError(f"{stall_text(job, stall)}. No window can start until they step again")
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
            window = resolve(request, _with_cap(d, defaults.max_steps), plan["start_step"], source="daemon",
                             capture_id=capture_id, extra={"via": "ondemand-profd"})
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

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        record = client.request("capture", **self.message(args))
        wait = args.report or (sys.stdout.isatty() if args.wait is None else args.wait)
        if not args.json:
            plan = record["plan"]
            out.write(f"capture {record['capture_id']}: job {record['job']}, {len(record['parts'])} rank(s), steps "
                      f"{_window(record['window'])} (ranks were at step {min(plan['current_steps'].values())}-"
                      f"{max(plan['current_steps'].values())}; lead {plan['lead_steps']} steps)\n")
            if plan.get("note"):
                out.write(f"  note: {plan['note']}\n")
            past = plan.get("past_ranks", plan.get("late_ranks")) or []
            close = [r for r in plan.get("late_ranks") or [] if r not in past]
            if past:
                out.write(f"  warning: rank(s) {spans(past)} are already past the start step; they will start at "
                          "once, late, and record the same number of steps from there\n")
            if close:
                out.write(f"  warning: rank(s) {spans(close)} are less than {plan['lead_steps']} steps (the lead "
                          "delivery needs) before the start step; they may get the window late, and then record "
                          "the same number of steps from there\n")
            out.flush()
        if not wait:
            if args.json:
                out.write(dumps(record) + "\n")
            else:
                out.write(f"not waiting; follow it with: ondemandctl show {record['capture_id']}\n")
            return EXIT_OK
        record, finished = self._follow(client, record, args, out)
        mark_misaligned(record)
        if args.json and not args.report:
            out.write(dumps(record) + "\n")
        elif not args.json:
            out.write(result_text(record, finished))
        if args.report:
            paths = [p["path"] for p in record["parts"].values() if p["state"] == "done" and p.get("path")]
            if paths:
                if not args.json:
                    out.write("\n")
                report_paths(paths, args, out)
        if not finished:
            return EXIT_TIMEOUT
        return exit_for(record)

    def _follow(self, client: Client, record: dict[str, Any], args: argparse.Namespace,
                out: TextIO) -> tuple[dict[str, Any], bool]:
        """Long-poll the daemon for changes and print each rank's progress as it happens."""
        printed: dict[str, int] = {}  # history entries shown per rank: every state is shown, even brief ones
        shown_step: dict[str, str] = {}
        shown_stall = ""
        deadline = time.monotonic() + args.timeout
        while True:
            if not args.json:
                for key, part in sorted(record["parts"].items(), key=lambda kv: int(kv[0])):
                    history = part.get("history") or [{"state": part["state"]}]
                    for entry in history[printed.get(key, 0):]:
                        out.write(f"  rank {part['rank']:<4} {progress_text({**part, 'state': entry['state']})}\n")
                    printed[key] = len(history)
                    step_text = recording_step(record, part)
                    if step_text and shown_step.get(key) != step_text:
                        shown_step[key] = step_text
                        out.write(f"  rank {part['rank']:<4} {step_text}\n")
                out.flush()
            if record["status"] != "running":
                return record, True
            left = deadline - time.monotonic()
            if left <= 0:
                return record, False
            hold = min(10.0, left)
            seen = record["version"]
            record = client.request("watch", wait_s=hold + client.timeout_s, capture_id=record["capture_id"],
                                    seen=seen, timeout_s=hold)
            if record["version"] == seen and not args.json:  # nothing moved for a while: is the job hung?
                stall = _stall_of(client, record)
                if stall and stall != shown_stall:
                    shown_stall = stall
                    out.write(f"  {stall}; the window cannot go on until they step again (still waiting, up to "
                              f"--timeout {args.timeout:g} s)\n")


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


def _stall_of(client: Client, record: dict[str, Any]) -> str:
    """What status says of a stall among a capture's unfinished ranks ('' when none, or when it cannot say)."""
    waiting = {p["rank"] for p in record["parts"].values() if p["state"] not in FINAL_STATES}
    try:
        stall = client.request("status", job=record["job"], brief=True).get("stalled", {}).get(record["job"])
    except CtlError:
        return ""
    if not stall or not waiting.intersection(stall["ranks"]):
        return ""
    return stall_text(record["job"], stall)


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
        return f"{state:<10} window {_window(part.get('window'))}"
    if state == "recording":
        late = part.get("late_by") or 0
        why = part.get("note") or "it got the window after its start"  # the rank's note says which, and where to
        return "recording" + (f" (late by {late} step{'s' if late != 1 else ''}: {why})" if late else "")
    if state == "done":
        return f"{'done':<10} {part.get('trace') or part.get('path')}"
    if state in ("failed", "rejected"):
        return f"{state:<10} {part.get('error')}"
    return state


def result_text(record: dict[str, Any], finished: bool, waited: bool = True) -> str:
    """The outcome, the capture folder (what HTA, TensorBoard and `ondemandctl report` open), and each rank's
    trace file with its steps, or why it has none."""
    parts = sorted(record["parts"].values(), key=lambda p: p["rank"])
    done = [p for p in parts if p["state"] == "done"]
    here = socket.gethostname()
    if not finished:
        pending = ", ".join(str(p["rank"]) for p in parts if p["state"] not in FINAL_STATES)
        head = (f"timed out waiting; still running on rank(s) {pending} (ondemandctl show {record['capture_id']})\n"
                if waited else f"running: rank(s) {pending} still working\n")
    else:
        head = f"{record['status']}: {len(done)} of {len(parts)} rank(s) wrote a trace\n"
    lines = [head]
    folders = sorted({os.path.dirname(p["path"]) for p in done if p.get("path")})
    if folders:
        lines.append(f"  capture folder{'s' if len(folders) > 1 else ''}: {', '.join(folders)}  (ondemandctl report "
                     f"{record['capture_id']})\n")
    for p in parts:
        if p["state"] == "done":
            path = p.get("trace") or p.get("path") or "?"  # torch_npu writes a directory, not one trace file
            steps = p.get("steps")
            lines.append(f"  rank {p['rank']:<4} {path}" + (f"  steps {steps[0]}..{steps[-1]}" if steps else "")
                         + (presence_note(path) if p["host"] == here else "") + "\n")
        elif p["state"] in ("failed", "rejected"):
            lines.append(f"  rank {p['rank']:<4} {p['state']}: {p.get('error')}\n")
    if record.get("misaligned"):
        lines.append(f"  MISALIGNED: {record['misaligned']['text']}\n")
    return "".join(lines)


def exit_for(record: dict[str, Any]) -> int:
    return {"done": EXIT_OK, "partial": EXIT_PARTIAL, MISALIGNED: EXIT_MISALIGNED}.get(
        record["status"], EXIT_FAILED if record["status"] != "running" else EXIT_TIMEOUT)


class List(Command):
    name = "list"
    help = "past captures, newest first"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job")
        parser.add_argument("--limit", type=int, default=20, help="how many (default 20)")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        msg: dict[str, Any] = {"limit": args.limit}
        if args.job:
            msg["job"] = args.job
        return msg

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        limit = msg.get("limit", 20)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 1000:
            raise BadRequest(f"field 'limit' must be an integer from 1 to 1000, got {limit!r}")
        job = _opt_str(msg, "job") or None
        if job:
            try:
                job = match_id(job, (r.data["job"] for r in service.store.records.values()), "job with captures")
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        return {"captures": [r.summary() for r in service.store.newest(limit, job)]}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        caps = data["captures"]
        if not caps:
            return "no captures yet\n"
        rows = []
        for c in caps:
            done = c["states"].get("done", 0)
            rows.append([c["capture_id"], c["created_at"][:19].replace("T", " "), c["job"], _window(c["window"]),
                         f"{done}/{c['ranks']}", c["status"]])
        return _table(rows, ["ID", "CREATED", "JOB", "STEPS", "DONE", "STATUS"])


class OneCapture(Command):
    """A command about one capture, named by its id or any unique part of it."""

    fields = {"capture_id": (str,)}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture_id", help="capture id, or any unique part of it, from ondemandctl list")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"capture_id": args.capture_id}


class Show(OneCapture):
    name = "show"
    help = "one capture: the request, the window, and each rank's result"

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        record = service.find(msg["capture_id"])
        shown = {**record.data, "version": record.version}
        mark_misaligned(shown)  # what is shown says so; the stored record keeps what happened
        return shown

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = (f"capture {data['capture_id']}  job {data['job']}  created {data['created_at']}\n"
                f"  steps {_window(data['window'])}  request {data['request']}\n")
        if data.get("options"):
            text += "  options " + ", ".join(f"{k}={v}" for k, v in sorted(data["options"].items())) + "\n"
        if (data.get("plan") or {}).get("note"):
            text += f"  note: {data['plan']['note']}\n"
        for part in sorted(data["parts"].values(), key=lambda p: p["rank"]):
            text += f"  rank {part['rank']:<4} {progress_text(part)}\n"
        return text + result_text(data, data["status"] != "running", waited=False)

    def exit_code(self, data: Any) -> int:
        return exit_for(data) if data["status"] != "running" else EXIT_OK


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


class Cancel(OneCapture):
    name = "cancel"
    help = "stop a scheduled or running capture on every rank (what was recorded so far is written, marked cancelled)"

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        record = service.find(msg["capture_id"])
        if record.status != "running":
            raise BadRequest(f"capture {record.capture_id} is already {record.status}")
        routes = {(r.job, r.rank, r.pid): r.route for r in service.registry.by_route.values()}
        sent = []
        for part in record.data["parts"].values():
            route_ = routes.get((record.data["job"], part["rank"], part["pid"]))
            if part["state"] not in FINAL_STATES and route_ is not None:
                service.send(route_, encode("cancel", capture_id=record.capture_id))
                sent.append(part["rank"])
        record.data["cancel_requested"] = True
        service.changed(record)
        return {"capture_id": record.capture_id, "ranks": sent}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        ranks = spans(data["ranks"]) or "none"
        return (f"cancel sent to rank(s) {ranks} of capture {data['capture_id']}; "
                f"follow it with: ondemandctl show {data['capture_id']}\n")


COMMANDS: list[Command] = [Status(), Capture(), List(), Show(), Cancel()]


class Report(Command):
    name = "report"
    help = "what captures say: step times, compute vs communication, top operators, memory, slow ranks"
    needs_daemon = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("paths", nargs="+", help="a capture id (or any unique part of it, from ondemandctl "
                            "list), a save path (every capture under it, newest first), a capture directory, a "
                            "torch_npu *_ascend_pt directory, or a trace file")
        parser.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with charts")
        parser.add_argument("--top", type=int, default=10, help="operators per table (default 10)")
        parser.add_argument("--summary", action="store_true", help="only the across-ranks tables")
        parser.add_argument("--runtime-dir", type=Path, default=None, help="for a capture id: the daemon's runtime "
                            "directory (env ONDEMAND_PROF_RUNTIME_DIR)")
        parser.add_argument("--connect-timeout", type=float, default=5.0, help="for a capture id: seconds to wait "
                            "for the daemon's answer (default 5)")

    def run(self, client: Client | None, args: argparse.Namespace, out: TextIO) -> int:
        if args.top < 1:
            raise CtlError(f"--top {args.top}: expected 1 or more", 2)
        paths: list[Path] = []
        for given in args.paths:  # a path that exists, or names a folder, is a path; else a capture id
            is_path = os.path.lexists(given) or os.sep in given or given.startswith((".", "~"))
            paths.extend([Path(given)] if is_path else capture_folders(given, args))
        data = report_paths(paths, args, out)
        return EXIT_OK if data["ranks_read"] else EXIT_FAILED


def capture_folders(capture_id: str, args: argparse.Namespace) -> list[Path]:
    """The capture folders (one per save path) holding what the capture's ranks on this host wrote, from the
    daemon's record. CtlError when it is not a path and the daemon knows no such capture."""
    from ..core.protocol import default_runtime_dir

    try:
        with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as client:
            record = client.request("show", capture_id=capture_id)
    except CtlError as exc:
        raise CtlError(f"{capture_id!r} is not a file or directory here, and not a capture the daemon knows: "
                       f"{exc}") from None
    folders = sorted({str(Path(p["path"]).parent) for p in record["parts"].values()
                      if p["state"] == "done" and p.get("path")})
    if not folders:
        raise CtlError(f"capture {record['capture_id']} wrote no trace here (status {record['status']}; ondemandctl "
                       f"show {record['capture_id']})")
    return [Path(f) for f in folders]


def report_paths(paths: list[Any], args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """Build, print (text or --json) and optionally write the HTML report; shared by report and capture."""
    from ..report import build_report

    data = build_report(paths, top=max(args.top, 15))
    render_report(data, args, out)
    return data


def render_report(data: dict[str, Any], args: argparse.Namespace, out: TextIO) -> None:
    """Print a report's data (text or --json) and write --html; also ondemandctl's report across hosts."""
    from ..report.html import render_html
    from ..report.text import render_text

    if getattr(args, "html", None):
        try:
            with open(args.html, "w", encoding="utf-8") as fh:
                fh.write(render_html(data))
        except OSError as exc:
            raise CtlError(f"--html {args.html}: cannot write: {exc.strerror}") from None
    if args.json:
        out.write(dumps(data) + "\n")
    else:
        out.write(render_text(data, top=args.top, per_rank=not getattr(args, "summary", False)))
        if getattr(args, "html", None):
            out.write(f"HTML report: {os.path.abspath(args.html)}\n")


COMMANDS.append(Report())


class Summaries(Command):
    """The summaries (summary.json) of a capture's parts on this host: ondemandctl's report across hosts merges
    these instead of reading traces (host/summaries.py)."""

    name = "summaries"
    cli = False
    fields = {"capture_id": (str,)}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        from .summaries import part_summaries

        record = service.find(msg["capture_id"])
        return {**{k: record.data.get(k) for k in ("capture_id", "job", "window", "status", "options")},
                "parts": part_summaries(record.data)}


DAEMON_COMMANDS: dict[str, Command] = {c.name: c for c in [*COMMANDS, Watch(), Summaries()] if c.needs_daemon}
CLI_MESSAGES: dict[str, Fields] = {name: c.fields for name, c in DAEMON_COMMANDS.items()}


def _raise(exc: Exception) -> Any:
    raise exc


def _opt_str(msg: dict[str, Any], key: str) -> str | None:
    value = msg.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"field {key!r} must be a string")
    return value


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


def _common_defaults(targets: list[Any]) -> WindowDefaults:
    """One length cap for all targets (the smallest), so that every rank records the same steps."""
    known = [t.defaults for t in targets if t.defaults is not None]
    if not known:
        raise ValueError("the target ranks did not say their window defaults (an older ondemand_prof?)")
    return dataclasses.replace(known[0], max_steps=min(d.max_steps for d in known))


def _with_cap(defaults: WindowDefaults, max_steps: int) -> WindowDefaults:
    return dataclasses.replace(defaults, max_steps=max_steps)


# ----------------------------------------------------------------------------------------------------------
# Triage: stacks, memory, flight-recorder (the daemon's bookkeeping: host/triage.py; the rank's: rank/triage.py)

MAX_TRIAGE_S = 600.0


class _TriageCommand(Command):
    """Send one triage action to the target ranks; the daemon replies when all answered or at the timeout."""

    action = ""
    default_ranks = "-1"
    default_timeout = 5.0

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="the job (needed when several are live)")
        parser.add_argument("--ranks", default=self.default_ranks,
                            help=f"ranks: a list or ranges like 0-3,7; -1 = all (default {self.default_ranks})")
        parser.add_argument("--timeout", type=float, default=self.default_timeout,
                            help=f"seconds to wait for the ranks' answers (default {self.default_timeout:g})")

    def args(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        try:
            ranks = list(parse_ranks(args.ranks))
        except RankSpecError as exc:
            raise CtlError(f"--ranks {args.ranks!r}: {exc}", EXIT_USAGE) from None
        if not 0.5 <= args.timeout <= MAX_TRIAGE_S:
            raise CtlError(f"--timeout {args.timeout:g}: expected 0.5 to {MAX_TRIAGE_S:g} s", EXIT_USAGE)
        msg: dict[str, Any] = {"ranks": ranks, "timeout_s": args.timeout, "args": self.args(args)}
        if args.job:
            msg["job"] = args.job
        return msg

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        msg = self.message(args)
        data = client.request(self.name, wait_s=args.timeout + client.timeout_s, **msg)
        out.write(dumps(data) + "\n" if args.json else self.console(data, args))
        return self.exit_code(data)

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        from ..rank.triage import check_args
        from .triage import Pending, target_of

        timeout = msg.get("timeout_s", self.default_timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.5 <= timeout <= MAX_TRIAGE_S:
            raise BadRequest(f"field 'timeout_s' must be a number from 0.5 to {MAX_TRIAGE_S:g}, got {timeout!r}")
        try:
            args = check_args(self.action, msg.get("args"))
            targets, silent = self._targets(service, _opt_str(msg, "job"), msg.get("ranks", -1))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        wall, now = time.time(), time.monotonic()
        triage_id = f"{self.name}-{new_capture_id(wall)}"
        for t in targets:
            service.send(t.route, encode("triage", triage_id=triage_id, action=self.action, args=args,
                                         capture_id=triage_id))
        job = (targets or silent)[0].job
        by_route = {t.route: target_of(t, service.host) for t in targets}
        by_route.update({b"silent/%d" % t.rank: target_of(t, service.host) for t in silent})
        service.triage.add(Pending(triage_id, self.action, route, msg.get("id"), job, by_route,
                                   answer_by=now + max(0.5, timeout - 1.0), deadline=now + timeout,
                                   finish=self.finish))
        log.info("ondemand-profd: %s %s: job %s, %d rank(s)", self.name, triage_id, job, len(targets))
        return None

    def _targets(self, service: Service, job: str | None, spec: Any) -> tuple[list[Any], list[Any]]:
        """The live ranks asked for, and (stacks) those whose heartbeats stopped while their process lives on:
        they cannot answer, but a native dump can still be had. ValueError says what is wrong."""
        silent = service.triage.silent_ranks(job, time.monotonic()) if self.action == "stacks" else []
        live = service.registry.jobs()
        if silent and not live.get(job or silent[0].job):
            job = job or silent[0].job
            wanted = select_ranks(spec, max(r.world_size for r in silent))
            return [], [r for r in silent if r.job == job and (-1 in wanted or r.rank in wanted)] or \
                _raise(ValueError(f"rank(s) {spans(wanted)} of job {job!r} are not registered"))
        job = service.registry.resolve_job(job)
        world = max(r.world_size for r in live[job])
        wanted = select_ranks(spec, world)
        here = {r.rank for r in live[job]}
        silent = [r for r in silent if r.job == job and r.rank not in here and (-1 in wanted or r.rank in wanted)]
        named = [r for r in wanted if r == -1 or r in here or r not in {s.rank for s in silent}]
        return (service.registry.select(job, named) if named else []), silent

    def finish(self, pending: Any) -> dict[str, Any]:
        return {"triage_id": pending.triage_id, "job": pending.job, "action": pending.action,
                "ranks": {str(r): res for r, res in sorted(pending.results.items())}}

    def exit_code(self, data: Any) -> int:
        results = list(data["ranks"].values())
        ok = sum(1 for r in results if r.get("ok"))
        return EXIT_OK if ok == len(results) else EXIT_PARTIAL if ok else EXIT_FAILED

    @staticmethod
    def _failures(data: dict[str, Any]) -> str:
        failed: dict[str, list[int]] = {}
        for rank, res in data["ranks"].items():
            if not res.get("ok"):
                failed.setdefault(res.get("error", "?"), []).append(int(rank))
        return "".join(f"  rank(s) {spans(ranks)}: {error}\n" for error, ranks in failed.items())


class Stacks(_TriageCommand):
    name = "stacks"
    action = "stacks"
    help = ("the Python stack of every thread of each rank, collected in-process (no ptrace), identical stacks "
            "grouped across ranks; a rank that cannot answer gets a native dump (faulthandler)")

    def finish(self, pending: Any) -> dict[str, Any]:
        from .triage import group_stacks

        data = super().finish(pending)
        data.update(group_stacks(pending.results, pending.folder))
        for res in data["ranks"].values():  # grouped above; per rank only how it answered
            res.pop("threads", None)
            res.pop("text", None)
        return data

    def console(self, data: Any, args: argparse.Namespace) -> str:
        from ..rank.triage import format_thread

        ranks = data["ranks"]
        py, native = data["answered_python"], sorted(int(r) for r in data["native"])
        silent = sorted(int(r) for r, res in ranks.items() if not res.get("ok"))
        text = (f"stacks {data['triage_id']}: job {data['job']}, {len(ranks)} rank(s): {len(py)} answered in-process "
                f"(Python), {len(native)} by native dump (faulthandler), {len(silent)} did not answer\n")
        for t in data["threads"]:
            many = len(t["stacks"]) > 1
            text += f"\n=== thread {t['thread']}: " + (f"{len(t['stacks'])} different stacks\n" if many else
                                                       "the same stack on every rank that has it\n")
            for s in t["stacks"]:
                mark = "  <-- differs from the majority" if s["odd"] else ""
                text += f"--- rank(s) {s['rank_spans']} ({len(s['ranks'])}){mark}\n"
                body = format_thread({"name": t["thread"], "frames": s["frames"]}).split("\n", 1)[1]
                text += body
        for rank, res in data["native"].items():
            if res.get("ok"):
                text += f"\n=== rank {rank}: NATIVE DUMP. {res['note']}\n{res['text']}"
        if data["trimmed"]:
            text += f"\nnote: outer frames were cut on rank(s) {spans(data['trimmed'])} to fit a message\n"
        fails = self._failures(data)
        return text + (f"\nno stacks from:\n{fails}" if fails else "")


class Memory(_TriageCommand):
    name = "memory"
    action = "memory"
    default_ranks = "0"
    default_timeout = 120.0
    help = ("record the accelerator allocator's history for some steps, then write a snapshot for PyTorch's "
            "memory visualiser (CUDA; Ascend with torch_npu)")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--steps", type=int, default=3, help="steps to record (default 3)")
        parser.add_argument("--max-entries", type=int, default=100_000,
                            help="allocator events kept (default 100000: bounded memory and file size)")
        parser.add_argument("--cpp-stacks", action="store_true",
                            help="C++ stacks too (slow: dumps can take minutes; default: Python stacks only)")

    def args(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"steps": args.steps, "max_entries": args.max_entries,
                "stacks": "all" if args.cpp_stacks else "python"}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = f"memory {data['triage_id']}: job {data['job']}\n"
        for rank, res in data["ranks"].items():
            if res.get("ok"):
                s = res["summary"]
                text += (f"  rank {rank:<4} {res['path']}  ({res['bytes']} bytes, steps {res['steps'][0]}.."
                         f"{res['steps'][1]}, {res['device']}: {s['reserved_bytes'] / 2**20:.1f} MiB reserved, "
                         f"{s['allocated_bytes'] / 2**20:.1f} MiB allocated, {s['history_entries']} events)\n")
        fails = self._failures(data)
        text += fails
        if any(r.get("ok") for r in data["ranks"].values()):
            text += "open a snapshot at https://pytorch.org/memory_viz (drag the file in)\n"
        return text


class FlightRecorder(_TriageCommand):
    name = "flight-recorder"
    action = "flight_recorder"
    help = ("dump the collective flight recorder of each rank into a capture folder, and say which collectives "
            "some ranks entered and others did not")

    def finish(self, pending: Any) -> dict[str, Any]:
        from .triage import summarize_flight_recorder

        data = super().finish(pending)
        data["summary"] = summarize_flight_recorder({r: res for r, res in pending.results.items() if res.get("ok")})
        for res in data["ranks"].values():
            res.pop("entries", None)
        return data

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = f"flight-recorder {data['triage_id']}: job {data['job']}\n"
        for rank, res in data["ranks"].items():
            if res.get("ok"):
                text += f"  rank {rank:<4} {res['path']}  ({res['total_entries']} entries)\n"
        text += self._failures(data)
        for g in data["summary"]["process_groups"]:
            text += (f"process group {g['pg']} ({g['desc'] or '-'}), rank(s) {spans(g['ranks'])}: last collective "
                     f"sequence number {g['min_seq']}" + (f" to {g['max_seq']}" if g["max_seq"] != g["min_seq"]
                                                          else " on every rank") + "\n")
            for m in g["mismatches"]:
                text += (f"  seq {m['seq']} ({m['collective']}): entered by rank(s) {m['entered_spans']}, NOT by "
                         f"rank(s) {m['missing_spans']}\n")
        if data["summary"]["process_groups"] and data["summary"]["in_step"]:
            text += "every rank entered the same collectives\n"
        elif not data["summary"]["process_groups"] and any(r.get("ok") for r in data["ranks"].values()):
            text += "no collective recorded yet\n"
        return text


for _cmd in (Stacks(), Memory(), FlightRecorder()):
    COMMANDS.append(_cmd)
    DAEMON_COMMANDS[_cmd.name] = _cmd
    CLI_MESSAGES[_cmd.name] = _cmd.fields
