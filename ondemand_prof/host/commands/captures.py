"""ondemandctl list, show and cancel: the capture records, on this host or merged across hosts (one capture
across hosts has one id and a record on every host involved)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ...core.bounds import checked_int
from ...core.protocol import FINAL_STATES, encode
from ...core.ranks import spans
from ..alignment import MISALIGNED
from ..client import EXIT_MISALIGNED, EXIT_OK, EXIT_PARTIAL, OneHost, dumps
from ..multihost import ask
from ..merge import (exit_across, failures, merge_lists, merged_record, no_capture, one_capture,
                     unanswered)
from ...core.ids import match_id
from ..service import BadRequest, Service
from .base import Command, add_job_flag, alone, nothing_found_here, opt_str, table, warn, who, window_text
from .follow import exit_for, progress_text, result_text

if TYPE_CHECKING:
    from ..fanout import Fanout


class List(Command):
    name = "list"
    help = "past captures, newest first"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_job_flag(parser, only=True)
        parser.add_argument("--limit", type=int, default=20, help="how many (default 20)")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        msg: dict[str, Any] = {"limit": args.limit}
        if args.job:
            msg["job"] = args.job
        return msg

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        limit = msg.get("limit", 20)
        try:
            checked_int(limit, 1, 1000, "field 'limit'")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        job = opt_str(msg, "job") or None
        if job:
            try:
                job = match_id(job, (r.data["job"] for r in service.store.records.values()), "job with captures",
                               "jobs with captures")
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        baselines = {r.capture_id for r in service.store.baselines().values()}
        return {"captures": [{**r.summary(), "baseline": r.capture_id in baselines}
                             for r in service.store.newest(limit, job)]}

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """This host's captures, or every host's merged by id, with the hosts that have each."""
        replies = ask(fan, self.name, self.message(args))
        failed = failures(replies)
        data = alone(replies) if fan.local else \
            {"captures": merge_lists(replies, args.limit), "failed_hosts": failed}
        if args.json:
            out.write(dumps(data) + "\n")
        else:
            out.write(self.console(data, args))
            warn(failed, sys.stderr)
        return exit_across(failed, replies)

    def console(self, data: Any, args: argparse.Namespace) -> str:
        """A table of captures; merged across hosts (each names its hosts), with a HOSTS column."""
        caps = data["captures"]
        if not caps:
            return "no captures yet\n"
        across = "hosts" in caps[0]
        rows = [[c["capture_id"], c["created_at"][:19].replace("T", " "), c["job"], window_text(c["window"]),
                 f"{c['states'].get('done', 0)}/{c['ranks']}", *([str(len(c["hosts"]))] if across else []),
                 c["status"], _marks(c)] for c in caps]
        return table(rows, ["ID", "CREATED", "JOB", "STEPS", "DONE", *(["HOSTS"] if across else []), "STATUS", ""])


def _marks(c: dict[str, Any]) -> str:
    """BASELINE for the job's baseline; vs <id> for a capture compared with one (an automatic capture)."""
    if c.get("baseline"):
        return "BASELINE"
    return f"vs {c['compare_with']}" if c.get("compare_with") else ""


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
        shown = record.view()  # its outcome (misaligned too) settled on the record, as list and the metrics have it
        baseline = service.store.baseline_of(record.data["job"], record.owner)
        shown["is_job_baseline"] = baseline is record
        if record.data.get("compare_with") and record.status != "running":
            # computed once, when the capture settled (service._conclude_automatic); a record from before (or
            # one still being compared): computed now, off the loop, and kept
            stored = record.data.get("comparison")
            if stored:
                shown["comparison"] = stored
            else:
                compute = comparison_of(service, record)

                def finish(comparison: dict[str, Any]) -> dict[str, Any]:
                    if "comparison" not in record.data and "error" not in comparison:
                        from ..records import stored_comparison

                        record.data["comparison"] = stored_comparison(comparison)
                        service.changed(record)
                    return {**shown, "comparison": comparison}

                return service.offload(route, msg, "show", compute, finish)
        return shown

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """This host's record of the capture, or those of every host that has it merged into one
        (host/merge.py)."""
        replies = ask(fan, self.name, self.message(args))
        found = one_capture(replies)
        if not found:
            raise nothing_found_here(replies)
        failed = {n: r.error for n, r in replies.items() if r.kind == "error" and not no_capture(r)}
        quiet = unanswered(replies)
        record = alone(replies) if fan.local else merged_record({n: r.data for n, r in found.items()}, failed,
                                                                       quiet)
        out.write(dumps(record) + "\n" if args.json else self.console(record, args))
        if record["status"] == MISALIGNED:
            return EXIT_MISALIGNED
        if failed or quiet:
            return EXIT_PARTIAL
        return self.exit_code(record)

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = (f"capture {data['capture_id']}  job {data['job']}  created {data['created_at']}"
                + ("  (the job's BASELINE)" if data.get("is_job_baseline") else "") + "\n"
                f"  steps {window_text(data['window'])}  request {data['request']}\n")
        if data.get("options"):
            text += "  options " + ", ".join(f"{k}={v}" + (" (NPU only: torch records CPU activity always)"
                                                          if k == "with_cpu" and v is False else "")
                                             for k, v in sorted(data["options"].items())) + "\n"
        if (data.get("plan") or {}).get("note"):
            text += f"  note: {data['plan']['note']}\n"
        for part in sorted(data["parts"].values(), key=lambda p: p["rank"]):
            text += who(part) + progress_text(part) + "\n"
        text += result_text(data, data["status"] != "running", waited=False)
        comparison = data.get("comparison")
        if isinstance(comparison, dict) and comparison.get("ranks") is not None:
            from ...report.text import render_comparison

            text += "\n" + render_comparison(comparison, top=5)
        elif isinstance(comparison, dict):
            text += f"\ncompared with baseline {data.get('compare_with')}: {comparison.get('error')}\n"
        return text

    def exit_code(self, data: Any) -> int:
        return exit_for(data) if data["status"] != "running" else EXIT_OK


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

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """On this host, or on every host that has the capture running."""
        replies = ask(fan, self.name, self.message(args))
        if fan.local:
            return self.print_alone(replies, args, out)
        sent = {n: r.data["ranks"] for n, r in replies.items() if r.ok}
        failed = failures(replies, no_capture)
        if not sent:  # nothing to cancel anywhere
            raise nothing_found_here(replies)
        if args.json:
            out.write(dumps({"hosts": {n: r.as_dict() for n, r in replies.items()}}) + "\n")
        else:
            for name, ranks in sent.items():
                out.write(f"{name}: cancel sent to rank(s) {spans(ranks) or 'none'}\n")
            warn(failed, sys.stderr)
        return exit_across(failed, replies)

    def console(self, data: Any, args: argparse.Namespace) -> str:
        ranks = spans(data["ranks"]) or "none"
        return (f"cancel sent to rank(s) {ranks} of capture {data['capture_id']}; "
                f"follow it with: ondemandctl show {data['capture_id']}\n")



def comparison_of(service: Service, record: Any) -> Any:
    """What compares an automatic capture with the baseline it was taken to be compared with, from this host's
    summaries, on snapshots of both records taken now (it runs off the daemon's loop: service.offload); it returns
    {"error"} when that cannot be done (the baseline's record was dropped, or is now another job's or owner's: an
    id taken over; no summary)."""
    from ..service import baseline_mismatch
    from ..summaries import compare_records, conclude_replies, snapshot

    try:
        base = service.store.find(record.data["compare_with"])
        mismatch = baseline_mismatch(record, base)
    except KeyError as exc:
        base, mismatch = None, str(exc.args[0] if exc.args else exc)
    now_snap = snapshot(record, service.registry)
    base_snap = snapshot(base, service.registry) if base is not None and not mismatch else None

    def compute() -> dict[str, Any]:
        if base_snap is None:
            return {"error": mismatch}
        try:
            return dict(conclude_replies([(service.host, compare_records(now_snap, base_snap))]))
        except (KeyError, ValueError, OSError) as exc:
            return {"error": str(exc.args[0] if exc.args else exc)}

    return compute
