"""How ondemandctl prints a report or a comparison (text, or --json) and writes --html: shared by report and
capture (its --report), whether the data came from traces read here or from the daemons' summaries."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, TextIO

from ..client import CtlError, dumps

if TYPE_CHECKING:
    from ...report.model import Report as ReportData


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


def render_comparison(comparison: dict[str, Any], args: argparse.Namespace, out: TextIO) -> None:
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
