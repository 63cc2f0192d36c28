"""ondemandctl's commands, one small class each (the shape of circus's commands): its name and help, its
flags, the message it sends, and how the console shows the reply. The daemon's side is in daemon/server.py."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any, TextIO

from ..config import EXPORT_TYPES, LEVELS
from ..protocol import FINAL_STATES
from ..window import parse_rank_spec
from .client import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, Client, CtlError, dumps



class Command:
    name = ""
    help = ""
    needs_daemon = True

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


def _window(w: list[int] | None) -> str:
    return "-" if not w else f"[{w[0]}, {w[1]})"


class Status(Command):
    name = "status"
    help = "live ranks: job, rank, host, pid, current step, step time, state"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"job": args.job} if args.job else {}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        d = data["daemon"]
        text = (f"ondemand-profd {d['version']} pid {d['pid']} on {d['host']}, up {d['uptime_s']:.0f} s; "
                f"{d['captures']} capture record(s), {d['running_captures']} running\n")
        if not data["jobs"]:
            return text + "no ranks registered\n"
        for job, ranks in data["jobs"].items():
            world = max(r["world_size"] for r in ranks)
            text += f"\njob {job}: {len(ranks)} of {world} rank(s) registered\n"
            rows = [[str(r["rank"]), r["host"], str(r["pid"]), str(r["step"]), _ms(r["step_time_s"]), r["state"],
                     f"{r['last_seen_s']:.1f} s ago"] for r in ranks]
            text += _table(rows, ["RANK", "HOST", "PID", "STEP", "STEP TIME", "STATE", "HEARD"])
        return text


class Capture(Command):
    name = "capture"
    help = "profile a window of steps on some ranks, wait, and print where each rank's trace went"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="the job (needed when several are live)")
        parser.add_argument("--ranks", default="-1", help="ranks: a list or ranges like 0-3,7; -1 = all (default)")
        where = parser.add_mutually_exclusive_group()
        where.add_argument("--start", type=int, help="first step, counted from the furthest-ahead rank's current "
                           "step (default 1: as soon as every rank can; the daemon adds lead when needed)")
        where.add_argument("--start-step", type=int, help="absolute first step")
        parser.add_argument("--steps", type=int, default=2, help="number of steps to record (default 2)")
        parser.add_argument("--level", choices=LEVELS, help="collection level (default: the rank's configuration)")
        parser.add_argument("--export-type", choices=EXPORT_TYPES, help="text or db (default: the configuration)")
        for flag, what in (("with-cpu", "CPU activity"), ("with-stack", "Python stacks"),
                           ("with-memory", "memory events"), ("record-shapes", "operator input shapes"),
                           ("data-simplification", "simplified output")):
            parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                                help=f"{what} (default: the configuration)")
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
        try:
            ranks = list(parse_rank_spec(args.ranks))
        except ValueError as exc:
            raise CtlError(f"--ranks {args.ranks!r}: {exc}", 2) from None
        for flag in ("steps", "start", "start_step"):
            value = getattr(args, flag)
            if value is not None and value < (1 if flag == "steps" else 0):
                raise CtlError(f"--{flag.replace('_', '-')} {value}: expected "
                               f"{'1 or more' if flag == 'steps' else '0 or more'}", 2)
        request: dict[str, Any] = {"ranks": ranks, "steps": args.steps}
        for key in ("start", "start_step", "level", "export_type", "with_cpu", "with_stack", "with_memory",
                    "record_shapes", "data_simplification"):
            if getattr(args, key) is not None:
                request[key] = getattr(args, key)
        if args.label:
            request["id"] = args.label
        msg: dict[str, Any] = {"request": request}
        if args.job:
            msg["job"] = args.job
        return msg

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        record = client.request("capture", **self.message(args))
        wait = args.report or (sys.stdout.isatty() if args.wait is None else args.wait)
        if not args.json:
            plan = record["plan"]
            out.write(f"capture {record['capture_id']}: job {record['job']}, {len(record['parts'])} rank(s), steps "
                      f"{_window(record['window'])} (ranks were at step {min(plan['current_steps'].values())}-"
                      f"{max(plan['current_steps'].values())}; lead {plan['lead_steps']} steps)\n")
            if plan.get("late_ranks"):
                out.write(f"  warning: rank(s) {plan['late_ranks']} are already past the start step; they will "
                          "start late and record fewer steps\n")
            out.flush()
        if not wait:
            if args.json:
                out.write(dumps(record) + "\n")
            else:
                out.write(f"not waiting; follow it with: ondemandctl show {record['capture_id']}\n")
            return EXIT_OK
        record, finished = self._follow(client, record, args, out)
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
        deadline = time.monotonic() + args.timeout
        while True:
            if not args.json:
                for key, part in sorted(record["parts"].items(), key=lambda kv: int(kv[0])):
                    history = part.get("history") or [{"state": part["state"]}]
                    for entry in history[printed.get(key, 0):]:
                        out.write(f"  rank {part['rank']:<4} {progress_text({**part, 'state': entry['state']})}\n")
                    printed[key] = len(history)
                out.flush()
            if record["status"] != "running":
                return record, True
            left = deadline - time.monotonic()
            if left <= 0:
                return record, False
            hold = min(10.0, left)
            record = client.request("watch", wait_s=hold + client.timeout_s, capture_id=record["capture_id"],
                                    seen=record["version"], timeout_s=hold)


def progress_text(part: dict[str, Any]) -> str:
    state = part["state"]
    if state in ("received", "scheduled"):
        return f"{state:<10} window {_window(part.get('window'))}"
    if state == "recording":
        late = part.get("late_by") or 0
        return "recording" + (f" (late by {late} step{'s' if late != 1 else ''}: it got the window after its "
                              "start)" if late else "")
    if state == "done":
        return f"{'done':<10} {part.get('path')}"
    if state in ("failed", "rejected"):
        return f"{state:<10} {part.get('error')}"
    return state


def result_text(record: dict[str, Any], finished: bool, waited: bool = True) -> str:
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
    for p in parts:
        if p["state"] == "done":
            path = p.get("path") or "?"
            missing = p["host"] == here and not os.path.isdir(path)
            steps = p.get("steps")
            lines.append(f"  rank {p['rank']:<4} {path}" + (f"  steps {steps[0]}..{steps[-1]}" if steps else "")
                         + ("  (MISSING on disk)" if missing else "") + "\n")
        elif p["state"] in ("failed", "rejected"):
            lines.append(f"  rank {p['rank']:<4} {p['state']}: {p.get('error')}\n")
    return "".join(lines)


def exit_for(record: dict[str, Any]) -> int:
    return {"done": EXIT_OK, "partial": EXIT_PARTIAL}.get(record["status"], EXIT_FAILED if
                                                           record["status"] != "running" else EXIT_TIMEOUT)


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


class Show(Command):
    name = "show"
    help = "one capture: the request, the window, and each rank's result"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture_id", help="capture id (or a unique prefix) from ondemandctl list")

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"capture_id": args.capture_id}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = (f"capture {data['capture_id']}  job {data['job']}  created {data['created_at']}\n"
                f"  steps {_window(data['window'])}  request {data['request']}\n")
        for part in sorted(data["parts"].values(), key=lambda p: p["rank"]):
            text += f"  rank {part['rank']:<4} {progress_text(part)}\n"
        return text + result_text(data, data["status"] != "running", waited=False)

    def exit_code(self, data: Any) -> int:
        return exit_for(data) if data["status"] != "running" else EXIT_OK


COMMANDS: list[Command] = [Status(), Capture(), List(), Show()]


class Report(Command):
    name = "report"
    help = "what captures say: step times, compute vs communication, top operators, memory, slow ranks"
    needs_daemon = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("paths", nargs="+", help="a save path (every capture under it, newest first), a "
                            "capture directory, a torch_npu *_ascend_pt directory, or a trace file")
        parser.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with charts")
        parser.add_argument("--top", type=int, default=10, help="operators per table (default 10)")
        parser.add_argument("--summary", action="store_true", help="only the across-ranks tables")

    def run(self, client: Client | None, args: argparse.Namespace, out: TextIO) -> int:
        from pathlib import Path

        if args.top < 1:
            raise CtlError(f"--top {args.top}: expected 1 or more", 2)
        data = report_paths([Path(p) for p in args.paths], args, out)
        return EXIT_OK if data["ranks_read"] else EXIT_FAILED


def report_paths(paths: list[Any], args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """Build, print (text or --json) and optionally write the HTML report; shared by report and capture."""
    from ..report import build_report
    from ..report.html import render_html
    from ..report.text import render_text

    data = build_report(paths, top=max(args.top, 15))
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
    return data


COMMANDS.append(Report())
