"""How ondemandctl prints a report or a comparison (text, or --json) and writes --html, and the one report of a
capture id (report_capture, from the daemons' summaries): shared by report and capture (its --report)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from ..client import CtlError, OneHost, dumps
from .base import capture_replies, warned_exit

if TYPE_CHECKING:
    from ...report.model import Report as ReportData
    from ..fanout import Fanout


def write_html(args: argparse.Namespace, render: Any, data: Any) -> None:
    """--html FILE, when given: `render(data)` written there; CtlError says why it cannot be."""
    if not getattr(args, "html", None):
        return
    try:
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(render(data))
    except OSError as exc:
        raise CtlError(f"--html {args.html}: cannot write: {exc.strerror}") from None


def html_written(args: argparse.Namespace, out: TextIO) -> None:
    if getattr(args, "html", None):
        out.write(f"HTML report: {os.path.abspath(args.html)}\n")


def render_comparison(comparison: Mapping[str, Any], args: argparse.Namespace, out: TextIO) -> None:
    """Print a comparison (text or --json, under "comparison") and write --html."""
    from ...report.html import render_comparison_html
    from ...report.text import render_comparison as text

    write_html(args, render_comparison_html, comparison)
    if args.json:
        out.write(dumps({"comparison": comparison}) + "\n")
    else:
        out.write(text(comparison, top=args.top))
        html_written(args, out)


def report_paths(paths: list[Any], args: argparse.Namespace, out: TextIO) -> ReportData:
    """Build, print (text or --json) and optionally write the HTML report; shared by report and capture."""
    from ...report import build_report

    data = build_report(paths, top=max(args.top, 15))
    render_report(data, args, out)
    return data


def render_report(data: ReportData, args: argparse.Namespace, out: TextIO) -> None:
    """Print a report's data (text or --json) and write --html; also ondemandctl's report across hosts."""
    from ...report.html import render_html
    from ...report.text import render_text

    write_html(args, render_html, data)
    if args.json:
        out.write(dumps(data) + "\n")
    else:
        out.write(render_text(data, top=args.top, per_rank=not getattr(args, "summary", False)))
        html_written(args, out)


def report_capture(fan: Fanout | OneHost, capture_id: str, args: argparse.Namespace, out: TextIO, *,
                   hosts: list[str] | None = None, whole: bool = False) -> int | None:
    """The one report of a capture id, on one host or many (`report ID`, `capture --report`): every daemon's
    summaries of its ranks (the summary.json each rank wrote beside its trace; host/summaries.py), merged, printed
    and written as --html; the exit status. No trace is read or crosses the network; a summary that cannot stand
    for its trace (summaries.checked) makes that rank failed, saying why. `whole`: None instead where the traces
    here give more than the summaries hold (a rank that wrote a trace here and no usable summary, said on
    stderr; --top above the rows a summary keeps; no rank done): the caller reads the traces here."""
    from ...core.tracedefs import SUMMARY_TOP
    from ..summaries import checked, merge_summaries

    found, failed = capture_replies(fan, "summaries", {"capture_id": capture_id}, **({"hosts": hosts} if hosts else {}))
    replies = {n: checked(r.data) for n, r in found.items()}
    if whole:
        done = [p for r in replies.values() for p in r["parts"] if p["state"] == "done"]
        traces_only = [p for p in done if p.get("summary") is None and p.get("path") and os.path.isdir(p["path"])]
        for p in traces_only:
            sys.stderr.write(f"rank {p['rank']}: {p.get('error') or 'no summary'}: its trace is read here\n")
        if not done or args.top > SUMMARY_TOP or traces_only:
            return None
    data = merge_summaries(replies.items(), already_checked=True)
    data["failed_hosts"] = failed
    render_report(data, args, out)
    return warned_exit(failed, bool(data["ranks_read"]))
