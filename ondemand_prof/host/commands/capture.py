"""ondemandctl capture: the daemon resolves a request once into one aligned window for its ranks; across
hosts ondemandctl plans that window from every daemon's status (host/planning.py) and sends it to all. Then,
either way, the capture is followed until every rank is done and the result names each rank's trace
(host/commands/follow.py, one host and many alike)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO

from ...core.options import add_window_flags, window_overrides
from ...core.protocol import encode
from ...core.ranks import RankSpecError, parse_ranks, spans
from ...core.requests import CaptureRequest, RequestError, WindowDefaults, parse_request, resolve
from ...core.window import Window, busy_window
from ..alignment import late_refusal, refuse_parts
from ..client import EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, EXIT_USAGE, CtlError, OneHost, dumps
from ..multihost import give_up, launch
from ..planning import common_cap, no_window
from ..merge import capture_record
from ...core.ids import BadId, check_id
from ...core.ids import capture_id as make_capture_id
from ..records import CaptureRecord
from ..recordtypes import RecordView
from ..planning import plan_window
from ..registry import owner_text, select_ranks
from ..stalls import stalls
from ..service import BadRequest, Service, host_root, of_job
from .base import Command, add_job_flag, opt_str, window_text
from .follow import exit_for, follow, result_text, running
from .rendering import report_capture, report_paths

if TYPE_CHECKING:
    from ..fanout import Fanout
    from ..merge import Launched

log = logging.getLogger("ondemand_prof.daemon")

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
        parser.add_argument("--baseline", action="store_true", help="mark this capture as the job's healthy baseline: "
                            "what `ondemandctl report CAPTURE` and automatic captures are compared with (one a "
                            "job; the newest that records something wins)")
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
        if args.baseline:
            msg["baseline"] = True
        return msg

    # ------------------------------------------------------------------------------------------------------
    # The daemon's side

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """Resolve the request once, here: targets, one aligned window after any already planned, the ranks'
        own defaults and length cap; every target gets the same finished window."""
        try:
            request = parse_request(msg["request"])
            asker = getattr(msg.get("_peer"), "uid", None)  # the kernel's word on who asks
            job = service.registry.resolve_job(opt_str(msg, "job"), asker)  # a job id several users chose: the asker's
            live = service.registry.jobs()[job]
            if msg.get("baseline") is True and asker not in (None, live[0].uid) and not host_root(msg.get("_peer")):
                # (a member may capture another's job, not choose what its automatic captures are compared with:
                # issue 28; a root pod is not the host's root: issue 41)
                raise ValueError(f"--baseline: job {job} belongs to {owner_text(live[0].uid)}, not to you "
                                 f"({owner_text(asker)}): only its owner (or root) marks its baseline; capture it "
                                 "without --baseline and compare with: ondemandctl report NOW --baseline CAPTURE")
            targets = _targets(service, job, request.ranks, max(r.world_size for r in live))
            wall = time.time()
            stall = stalls([{"rank": t.rank, "step": t.step, "stalled_s": t.stalled_s(wall)} for t in targets], wall)
            if stall:  # a window there cannot start: say so now rather than time out later
                raise ValueError(no_window(job, stall))
            defaults = _common_defaults(targets)
            steps = min(defaults.steps if request.steps is None else request.steps, defaults.max_steps)
            planned = plan_window(targets, wall, start=request.start, start_step=request.start_step, steps=steps,
                                  delivery_s=service.delivery.estimate(live[0].key))
        except (RequestError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
        capture_id = _adopted_id(service, msg) or make_capture_id(wall=wall)
        charge = charged_to(msg)
        if isinstance(charge, int) and not host_root(msg.get("_peer")):  # per uid (root can do anything anyway; a
            # client key over TCP is an operator's, held to its share of the records)
            if service.capture_rate is None:
                service.capture_rate = CaptureRate()
            held = service.capture_rate.take(charge, time.monotonic())
            if held:
                raise BadRequest(held)
        windows = Windows(request, defaults, planned.start_step, capture_id, targets)
        first = windows.first
        plan = planned.noted(first.note)  # the plan whole (the cap's note too) before any window leaves
        # charged to the asker (issue 41, 4): its records count against its share, and push out only its own
        record = service.open_capture(capture_id, live[0].job, request.as_dict(), plan, first.options.as_dict(),
                                      targets, wall, kind="capture", owner=charge, save=False)
        late = late_refusal(plan) if msg.get("across_hosts") is True else None
        if late:  # shared with other hosts' ranks: on the same steps everywhere or not here (host/alignment.py)
            refuse_parts(record, late, wall)
            service.store.save(record)
            log.warning("ondemand-profd: capture %s: %s", capture_id, late)
            return {**record.view(), "asked_by": asker}
        unsaved = None
        if msg.get("baseline") is True:  # the job's baseline once it records something (records.py baseline_of)
            record.data["baseline"] = True
            # on disk before anyone is told it is the baseline (issue 41, 9: a full state disk lost a baseline the
            # reply had called marked); written now, not after the windows leave, so that the reply can say
            if not service.store.save(record):
                unsaved = service.store.unsaved.get(record.capture_id, "not written")
                log.error("ondemand-profd: capture %s: marked as job %s's baseline, but its record cannot be "
                          "written to %s (%s): it is not the job's baseline until it is", capture_id, job,
                          service.store.dir, unsaved)
        else:
            service.then(lambda: void(service.store.save(record)))  # on disk before the reply, after the windows
        if request.start_step is None and msg.get("across_hosts") is not True:  # (across hosts: the same steps
            # everywhere or none; an absolute start is what was asked)
            record.replan = Replanner(service, request, defaults, steps, live[0].key)
        windows.send(service, targets, plan.note if plan.after else None)
        log.info("ondemand-profd: capture %s: job %s, %d rank(s), steps [%d, %d)%s", capture_id, job, len(targets),
                 plan.start_step, plan.end_step, f" ({plan.note})" if plan.note else "")
        reply: RecordView = {**record.view(), "asked_by": asker}  # the CLI says so when the job is another user's
        if unsaved is not None:
            reply["unsaved"] = f"{unsaved} ({service.store.dir})"
        return reply

    # ------------------------------------------------------------------------------------------------------
    # ondemandctl

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """One aligned window on the target ranks, one capture id. On this host alone its daemon plans the window
        (execute); across hosts ondemandctl plans it from every daemon's status and sends it to each
        (host/planning.py). Then the same either way: followed until every rank is done (a silent host asked
        again until --timeout, then given up on, host/multihost.py), the result, and with --report the report."""
        if isinstance(fan, OneHost):  # (fan.local, said so that the type checker sees which)
            here = fan.name
            record = fan.request(self.name, self.message(args))[here].data
            run = None
            found, failed, quiet = {here: record}, {}, {}
            head = _plan_text(record)
        else:
            run = launch(fan, self.message(args)["request"], args.job, args.slurm, baseline=args.baseline)
            found, failed, quiet = run.found, run.failed, dict(run.quiet)  # (quiet: asked again until --timeout)
            head = _plan_across_text(run)
        capture_id = run.capture_id if run else record["capture_id"]
        if not args.json:
            out.write(head)
            out.flush()
        wait = waits(args)
        if not wait and run is None:
            out.write(dumps(record) + "\n" if args.json else
                      f"not waiting; follow it with: ondemandctl show {capture_id}\n")
            return EXIT_OK
        if isinstance(fan, OneHost):
            finished = not wait or follow_here(fan, found, args, None if args.json else out, capture_id)
        else:
            finished = not wait or follow(fan, found, failed, args.timeout, None if args.json else out,
                                          quiet=quiet, capture_id=capture_id)
        if quiet and not isinstance(fan, OneHost):  # (only across hosts: a OneHost that is silent raises)
            give_up(fan, capture_id, quiet, found)
        # one host: its outcome settled by the daemon, on the record (misaligned too); across: the records merged
        record = found[here] if run is None else capture_record(run, quiet)
        timed_out = not finished and any(running(d) for n, d in found.items() if n not in quiet)
        text = result_text(record, not timed_out, wait, across=run is not None) + export_hint(record, run is not None)
        self._result(record, text, args, out, self._report(fan, record, run, args, out))
        if not wait:
            return EXIT_PARTIAL if failed or quiet else EXIT_OK
        return EXIT_TIMEOUT if timed_out else exit_for(record)

    @staticmethod
    def _report(fan: Fanout | OneHost, record: RecordView, run: Launched | None, args: argparse.Namespace,
                out: TextIO) -> Callable[[], Any] | None:
        """--report: the capture's one report (rendering.report_capture: every daemon's summaries of its ranks,
        merged, on one host as across hosts); on one host the traces here are read where the summaries do not
        hold it all. None when no rank wrote a trace here."""
        if run is not None:
            return lambda: report_capture(fan, run.capture_id, args, out, hosts=list(run.found))
        paths = [p["path"] for p in record["parts"].values() if p["state"] == "done" and p.get("path")]
        if not paths:
            return None

        def here() -> None:
            try:
                merged = report_capture(fan, record["capture_id"], args, out, whole=True)
            except CtlError:  # the daemon went away since: the traces are still here
                merged = None
            if merged is None:
                report_paths(paths, args, out)

        return here

    def _result(self, record: RecordView, text: str, args: argparse.Namespace, out: TextIO,
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


def export_hint(record: RecordView, across: bool) -> str:
    """The line that makes every rank's trace one timeline (ondemandctl export, host/commands/export.py)."""
    done = [p for p in record["parts"].values() if p["state"] == "done" and str(p.get("trace") or "").endswith(
        (".pt.trace.json", ".pt.trace.json.gz"))]
    if len(done) < 2:
        return ""
    cid = record["capture_id"]
    return (f"  one timeline: ondemandctl {'--hosts ... ' if across else ''}export {cid} --perfetto {cid}.json  "
            "(every rank, clocks aligned; Perfetto UI)\n")


def void(_: Any) -> None:
    """(A callable's result dropped: Service.then takes callables of nothing.)"""


RECONNECT_S = 0.5  # how often a capture followed on this host asks for its daemon again, while it does not answer


def follow_here(fan: OneHost, found: dict[str, RecordView], args: argparse.Namespace, out: TextIO | None,
                capture_id: str) -> bool:
    """follow() on this host's daemon, through a restart of it (issue 41, 12: a waiting capture exited 4 when its
    daemon restarted, while the ranks went on recording): a daemon that does not answer is asked again, on a new
    connection, until --timeout; the record it kept on disk is followed from there (its versions are new, so the
    first answer is the whole record). Returns what follow() returns; CtlError for anything else."""
    from ...core.protocol import default_runtime_dir
    from ..client import EXIT_NO_DAEMON, Client

    deadline = time.monotonic() + args.timeout
    said = False
    while True:
        try:
            return follow(fan, found, {}, max(0.0, deadline - time.monotonic()), out, capture_id=capture_id)
        except CtlError as exc:
            if exc.code != EXIT_NO_DAEMON or time.monotonic() >= deadline:
                raise
            if out is not None and not said:
                out.write(f"  the daemon did not answer ({exc}); asking again until --timeout {args.timeout:g} s "
                          "(a daemon restarted keeps its records)\n")
                out.flush()
                said = True
        while time.monotonic() < deadline:
            time.sleep(RECONNECT_S)
            try:
                client = Client(getattr(args, "runtime_dir", None) or default_runtime_dir(),
                                getattr(args, "connect_timeout", 5.0))
            except CtlError:
                continue
            try:
                found[fan.name] = client.request("show", capture_id=capture_id)
            except CtlError as exc:
                client.close()
                if exc.code != EXIT_NO_DAEMON:
                    raise
                continue
            fan.client.close()
            fan.client = client
            if out is not None:
                out.write("  the daemon answers again: following the capture\n")
            break


def waits(args: argparse.Namespace) -> bool:
    """--wait, --no-wait, or by default: when stdout is a terminal (--report always waits)."""
    return bool(args.report or (sys.stdout.isatty() if args.wait is None else args.wait))


# ----------------------------------------------------------------------------------------------------------
# The daemon's planning helpers

class Windows:
    """The window of each target rank, resolved from the request with its defaults: ranks of one job nearly
    always share theirs, so each distinct defaults is resolved and encoded once (per rank, that was most of the
    time from request to the last rank's window at 64 ranks)."""

    def __init__(self, request: CaptureRequest, defaults: WindowDefaults, start: int, capture_id: str,
                 targets: list[Any]) -> None:
        self.distinct: list[tuple[WindowDefaults, Window]] = []
        self.of = {t.rank: self._window(request, t.defaults or defaults, defaults.max_steps, start, capture_id)
                   for t in targets}
        self.first = self.of[targets[0].rank]

    def _window(self, request: CaptureRequest, d: WindowDefaults, max_steps: int, start: int,
                capture_id: str) -> Window:
        for known, window in self.distinct:
            if known == d:
                return window
        window = resolve(request, dataclasses.replace(d, max_steps=max_steps), start, source="daemon",
                         capture_id=capture_id, extra={"via": "ondemand-profd"})
        self.distinct.append((d, window))
        return window

    def send(self, service: Service, targets: list[Any], note: str | None) -> None:
        """To every target; `note` (what the plan changed) on the wire when given."""
        bodies: dict[int, bytes] = {}  # each distinct window encoded once
        for _, window in self.distinct:
            wire = dataclasses.replace(window, note=note) if note is not None else window
            bodies[id(window)] = encode("capture", window=wire.to_wire())
        for t in targets:
            service.send(t.route, bodies[id(self.of[t.rank])])


class Replanner:
    """A capture planned again, once, after windows its ranks refused it for and the daemon had not heard of: a
    trigger file's window (or a signal's, an automatic one) begun before the rank's next heartbeat said so. The
    record (records.py CaptureRecord.replan) holds the ranks' busy refusals until every rank has answered; then
    the capture is planned with what the daemon knows now plus the windows refused for, and the same window goes
    to every target (a rank drops the window it had queued for this capture: rank/scheduler.py)."""

    def __init__(self, service: Service, request: CaptureRequest, defaults: WindowDefaults, steps: int,
                 job_key: Any) -> None:
        self.service, self.request, self.defaults, self.steps, self.job_key = \
            service, request, defaults, steps, job_key

    def __call__(self, record: CaptureRecord, busy: dict[int, dict[str, Any]], wall: float) -> bool:
        parts = record.data["parts"]
        if record.data.get("cancel_requested") or any(
                p["state"] != "scheduled" for k, p in parts.items() if int(k) not in busy):
            return False  # a rank began the window or ended: the steps could no longer be the same everywhere
        live = {(r.rank, r.pid): r for r in self.service.registry.by_route.values() if of_job(record, r)}
        targets = [live.get((p["rank"], p["pid"])) for p in parts.values()]
        if any(t is None for t in targets):
            return False
        blocking = {rank: busy_window(info.get("busy")) for rank, info in busy.items()}
        cid = record.capture_id
        known = [dataclasses.replace(t, windows=[w for w in t.windows or [] if w["capture_id"] != cid] + [
            w for w in [blocking.get(t.rank)] if w is not None and w["capture_id"] not in
            {x["capture_id"] for x in t.windows or []}]) for t in targets if t is not None]
        try:
            planned = plan_window(known, wall, start=self.request.start, start_step=None, steps=self.steps,
                                  delivery_s=self.service.delivery.estimate(self.job_key))
        except ValueError:  # an open-ended window in the way: the refusal stands
            return False
        old = record.data["window"]
        if planned.start_step <= old[0]:
            return False  # nothing to move it after (the window refused for has ended)
        named = sorted({(w["start"], w["end"], w["source"], w["capture_id"]) for w in blocking.values() if w})
        why = (f"replanned after window{'s' if len(named) > 1 else ''} " +
               ", ".join(f"[{a}, {'close' if b is None else b}) ({src}, {c})" for a, b, src, c in named) +
               f", which held rank(s) {spans(sorted(busy))} and the daemon had not heard of (from step {old[0]} to "
               f"{planned.start_step})")
        windows = Windows(self.request, self.defaults, planned.start_step, cid, known)
        plan = dataclasses.replace(planned, note="; ".join(filter(None, [windows.first.note, why])))
        record.planned_again(plan, why)
        windows.send(self.service, known, plan.note)
        log.info("ondemand-profd: capture %s: %s", cid, why)
        return True


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


CAPTURES_PER_MINUTE = 60  # captures one uid may ask of a daemon a minute (root: any; a client key over TCP: any)


class CaptureRate:
    """How many captures each uid asked for in the last minute (issue 41, 4: one member asked for 1,000 in 2 s)."""

    def __init__(self, per_minute: int = CAPTURES_PER_MINUTE) -> None:
        self.per_minute = per_minute
        self.asked: dict[Any, list[float]] = {}

    def take(self, asker: Any, now: float) -> str:
        """'' and the capture is counted, or why not."""
        times = [t for t in self.asked.get(asker, []) if now - t < 60.0]
        if len(times) >= self.per_minute:
            self.asked[asker] = times
            return (f"{_asker_text(asker)} asked for {len(times)} captures in the last minute, the most this daemon "
                    f"takes of one asker (at most {self.per_minute} a minute); try again in "
                    f"{60.0 - (now - times[0]):.0f} s")
        times.append(now)
        self.asked[asker] = times
        if len(self.asked) > 4096:
            self.asked = {k: v for k, v in self.asked.items() if v and now - v[-1] < 60.0}
        return ""



def charged_to(msg: dict[str, Any]) -> int | str | None:
    """Whom a capture asked for with `msg` is charged to: the asker's uid (the kernel's word), over TCP its client
    key (`key:NAME`, the ZAP handler's User-Id); None when neither is known (a service driven directly)."""
    peer = msg.get("_peer")
    if peer is not None:
        return int(peer.uid)
    key = msg.get("_key")
    return f"key:{key}" if isinstance(key, str) and key else None


def _asker_text(asker: Any) -> str:
    return f"uid {asker}" if isinstance(asker, int) else (f"client {asker}" if asker else "this asker")


# ids a rank makes itself (core/ids.capture_id): a caller's chosen id never takes one first (issue 41, 5: a
# member's capture named an automatic baseline's predictable id, and the job got no baseline)
RANK_ID_PREFIXES = ("auto-", "baseline-", "file-", "signal-", "static-")


def _adopted_id(service: Service, msg: dict[str, Any]) -> str | None:
    """A capture id chosen by the caller (ondemandctl across hosts: one id on every host), when well-formed and
    not of a kind the ranks name themselves."""
    value = msg.get("capture_id")
    if value is None:
        return None
    try:
        check_id(value, "capture_id")  # the one id rule (core/ids.py)
    except BadId as exc:
        raise BadRequest(str(exc)) from None
    if value.startswith(RANK_ID_PREFIXES):
        raise BadRequest(f"capture_id {value[:80]!r}: ids beginning {', '.join(RANK_ID_PREFIXES)} are the ranks' "
                         "own (automatic, trigger-file, signal and static windows); choose another")
    if value in service.store.records:
        raise BadRequest(f"capture {value} already exists on this host")
    return value


# ----------------------------------------------------------------------------------------------------------
# What the console says of a capture

def _plan_text(record: RecordView) -> str:
    plan = record["plan"]
    text = (f"capture {record['capture_id']}: job {record['job']}, {len(record['parts'])} rank(s), steps "
            f"{window_text(record['window'])} (ranks were at step {min(plan['current_steps'].values())}-"
            f"{max(plan['current_steps'].values())}; lead {plan['lead_steps']} steps)\n")
    text += owner_note(record)
    if plan.get("note"):
        text += f"  note: {plan['note']}\n"
    if record.get("baseline") and record.get("unsaved"):
        text += (f"  NOT yet job {record['job']}'s baseline: its record cannot be written to the daemon's state "
                 f"directory: {record['unsaved']}; it becomes the baseline once it is (the daemon tries again; "
                 "ondemandctl status says while records are not written)\n")
    elif record.get("baseline"):
        text += f"  marked as job {record['job']}'s baseline: later captures compare with it " \
                f"(ondemandctl report <capture> --baseline {record['capture_id']}, or automatically)\n"
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


def owner_note(record: RecordView) -> str:
    """A line when the job captured is not the asker's (the kernel's uids, as the daemon saw them): the traces are
    another user's, and a job of the asker's own with this id, if any, is not registered here."""
    from ..registry import owner_text

    owners = sorted({uid for p in record["parts"].values() if isinstance(uid := p.get("uid"), int)})
    asker = record.get("asked_by")
    if not isinstance(asker, int) or not owners or owners == [asker]:
        return ""
    whose = " and ".join(owner_text(u) for u in owners)
    text = f"  note: job {record['job']} belongs to {whose}, not to you ({owner_text(asker)})"
    if asker != 0:
        text += ("; a job of yours with this id has no rank registered with this daemon (see ondemandctl "
                 "status)")
    return text + "\n"


def _plan_across_text(run: Launched) -> str:
    plan = run.plan
    n = sum(len(r) for r in run.targets.values())
    steps = plan.current_steps.values()
    text = (f"capture {run.capture_id}: job {run.job}, {n} rank(s) on {len(run.targets)} host(s), steps "
            f"[{plan.start_step}, {plan.end_step}) (ranks were at step {min(steps)}-{max(steps)}; lead "
            f"{plan.lead_steps} steps; sent to every host in {run.sent_s * 1000:.0f} ms)\n")
    if plan.note:
        text += f"  note: {plan.note}\n"
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
