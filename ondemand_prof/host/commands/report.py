"""ondemandctl report: what captures say (report/), read from files here, or, for a capture id, from the
folders the daemon's record names; across hosts from each daemon's per-rank summaries (`summaries`,
host/summaries.py), merged, so that no trace crosses the network."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from ...core.config import ProfileConfig
from ...core.ids import valid_id
from ..client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Client, CtlError, OneHost
from ...core.ids import match_id
from ..service import BadRequest, Service
from .base import Command, capture_replies, warned_exit
from .rendering import render_comparison, report_capture, report_paths

if TYPE_CHECKING:
    from ...report.model import Report as ReportData
    from ..fanout import Fanout


class Report(Command):
    name = "report"
    help = "what captures say: step times, compute vs communication, top operators, memory, slow ranks"
    needs_daemon = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("paths", nargs="+", help="a capture id (or any unique part of it, from ondemandctl "
                            "list), a save path (every capture under it, newest first), a capture directory, a "
                            "torch_npu *_ascend_pt directory, or a trace file")
        parser.add_argument("--baseline", metavar="BASE", help="compare with this capture (an id, a unique part of "
                            "one, or a folder, as the capture is given): what changed, on which rank, and the rank "
                            "that caused a slowdown against those that only waited for it")
        parser.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with charts")
        parser.add_argument("--top", type=int, default=10, help="operators per table (default 10)")
        parser.add_argument("--summary", action="store_true", help="only the across-ranks tables")
        parser.add_argument("--runtime-dir", type=Path, default=None, help="for a capture id: the daemon's runtime "
                            "directory (env ONDEMAND_PROF_RUNTIME_DIR)")
        parser.add_argument("--connect-timeout", type=float, default=5.0, help="for a capture id: seconds to wait "
                            "for the daemon's answer (default 5)")

    def run(self, client: Client | None, args: argparse.Namespace, out: TextIO) -> int:
        """On this host: a capture id, its daemon's summaries of the ranks (report_capture, as across hosts);
        files and folders given, or a capture whose ranks' summaries do not hold the report, read here."""
        _check_top(args)
        if args.baseline is None and len(args.paths) == 1:
            args.baseline, stored = automatic_baseline(args.paths[0], args)
            if stored is not None:  # the daemon compared it once, when it settled: that comparison
                render_comparison(stored, args, out)
                return EXIT_OK if compared(stored) else EXIT_FAILED
        if args.baseline is not None:
            return compare_here(args, out)
        if len(args.paths) == 1 and not _is_path(args.paths[0]):
            from ...core.protocol import default_runtime_dir

            try:
                with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as daemon:
                    merged = report_capture(OneHost(daemon), args.paths[0], args, out, whole=True)
            except CtlError:
                merged = None  # no daemon, or a capture it does not know: its folder here (local_paths says why not)
            if merged is not None:
                return merged
        paths = [p for given in args.paths for p in local_paths(given, args)]
        data = report_paths(paths, args, out)
        return EXIT_OK if data["ranks_read"] else EXIT_FAILED

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """Across hosts (--hosts ...): one capture id, every daemon's summaries of its ranks, merged."""
        if len(args.paths) != 1:
            raise CtlError("across hosts, report takes one capture id (the traces stay on their hosts; each daemon "
                           "returns its ranks' summaries)", EXIT_USAGE)
        _check_top(args)
        if args.baseline is not None:
            return compare_across(fan, args, out)
        code = report_capture(fan, args.paths[0], args, out)
        assert code is not None  # (whole=False never declines)
        return code


def _check_top(args: argparse.Namespace) -> None:
    if args.top < 1:
        raise CtlError(f"--top {args.top}: expected 1 or more", EXIT_USAGE)


def compare_across(fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
    """report NOW --baseline BASE --hosts ...: each daemon compares its ranks' summaries of the two captures
    (`compare`), and the ranks of every host are concluded on here (no trace crosses the network)."""
    from ..summaries import conclude_replies

    found, failed = capture_replies(fan, "compare", {"capture_id": args.paths[0], "baseline_id": args.baseline})
    comparison = conclude_replies((n, r.data) for n, r in found.items())
    comparison["failed_hosts"] = failed
    render_comparison(comparison, args, out)
    return warned_exit(failed, compared(comparison))


def compared(comparison: Mapping[str, Any]) -> bool:
    """Whether anything was compared: a rank with timed steps on both sides (else the cause line says nothing
    was, and the exit status says so too)."""
    return comparison["step_ms"].get("delta") is not None


class Compare(Command):
    """This host's ranks of a capture compared with the same ranks of a baseline capture, from their summaries
    (host/summaries.py compare_records): what ondemandctl report --baseline concludes on across hosts."""

    name = "compare"
    cli = False
    fields = {"capture_id": (str,), "baseline_id": (str,)}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """Off the daemon's loop (service.offload: issue 41, 3), on snapshots of both records taken here. A
        baseline of another job or owner is refused (issue 41, 5: an automatic baseline's id taken first by
        another user's capture was compared with as the job's baseline)."""
        from ..service import baseline_mismatch
        from ..summaries import compare_records, snapshot

        now, base = service.find(msg["capture_id"]), service.find(msg["baseline_id"])
        if now is base:
            raise BadRequest(f"the baseline is the capture itself ({now.capture_id}): give a capture taken when the "
                             "job was healthy")
        mismatch = baseline_mismatch(now, base)
        if mismatch:
            raise BadRequest(f"{mismatch}: not compared (a capture is compared with a baseline of its own job; "
                             "to compare captures of two jobs, give their folders: ondemandctl report NOW_DIR "
                             "--baseline BASE_DIR)")
        now_snap, base_snap = snapshot(now, service.registry), snapshot(base, service.registry)
        return service.offload(route, msg, "compare", lambda: compare_records(now_snap, base_snap))


class Summaries(Command):
    """The summaries (summary.json) of a capture's parts on this host: ondemandctl's report across hosts merges
    these instead of reading traces (host/summaries.py)."""

    name = "summaries"
    cli = False
    fields = {"capture_id": (str,)}

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """Read off the daemon's loop (service.offload), from a snapshot of the record taken here."""
        from ..records import record_source
        from ..summaries import part_summaries, snapshot

        record = service.find(msg["capture_id"])
        head = {**{k: record.data.get(k) for k in ("capture_id", "job", "window", "status", "options")},
                "source": record_source(record.data)}
        snap = snapshot(record, service.registry)
        return service.offload(route, msg, "summaries", lambda: {**head, "parts": part_summaries(snap)})


DEFAULT_SAVE = Path(ProfileConfig.save_path)  # ./profile: where a rank started from this directory saves


def saved_here(capture_id: str) -> Path | None:
    """The capture folder under the default save path, relative to here, that `capture_id` names or uniquely
    begins (match_id, as --job takes ids); None when there is none. CtlError when several match."""
    if not valid_id(capture_id) or not DEFAULT_SAVE.is_dir():
        return None
    names = [d.name for d in DEFAULT_SAVE.iterdir() if d.name.startswith(capture_id) and d.is_dir()]
    if not names:
        return None
    try:
        return DEFAULT_SAVE / match_id(capture_id, names, f"capture folder under {DEFAULT_SAVE}",
                                       f"capture folders under {DEFAULT_SAVE}")
    except ValueError as exc:
        raise CtlError(str(exc)) from None


def capture_folders(capture_id: str, args: argparse.Namespace) -> list[Path]:
    """The capture folders (one per save path) holding what the capture's ranks on this host wrote, from the
    daemon's record. CtlError when it is not a path and the daemon knows no such capture."""
    from ...core.protocol import default_runtime_dir

    try:
        with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as client:
            record = client.request("show", capture_id=capture_id)
    except CtlError as exc:
        local = saved_here(capture_id)  # the daemon is gone (or never saw it): the default save path, from here
        if local is not None:
            return [local]
        raise CtlError(f"{capture_id!r} is not a file or directory here, not a folder under {DEFAULT_SAVE}, and not a "
                       f"capture the daemon knows: {exc}") from None
    folders = sorted({str(Path(p["path"]).parent) for p in record["parts"].values()
                      if p["state"] == "done" and p.get("path")})
    if not folders:
        raise CtlError(f"capture {record['capture_id']} wrote no trace here (status {record['status']}; ondemandctl "
                       f"show {record['capture_id']})")
    return [Path(f) for f in folders]


def automatic_baseline(given: str, args: argparse.Namespace) -> tuple[str | None, dict[str, Any] | None]:
    """The baseline an automatic capture was taken to be compared with (the daemon's record: compare_with; or,
    without a daemon, what its ranks' metadata say), so that `report AUTO` compares without --baseline; and the
    comparison the daemon computed once it settled, where its record holds one."""
    if _is_path(given) and not Path(given).is_dir():
        return None, None
    if not _is_path(given):
        from ...core.protocol import default_runtime_dir

        try:
            with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as client:
                record = client.request("show", capture_id=given)
            value = record.get("compare_with")
            stored = record.get("comparison")
            stored = stored if isinstance(stored, dict) and isinstance(stored.get("ranks"), list) and \
                stored.get("step_ms") is not None else None
            return (value if isinstance(value, str) and valid_id(value) else None), stored
        except CtlError:
            pass
    folder = Path(given) if _is_path(given) else saved_here(given)
    return (baseline_in_metadata(folder) if folder is not None else None), None


def baseline_in_metadata(folder: Path) -> str | None:
    """What the ranks of a capture folder recorded as the baseline to compare with (an automatic capture's
    window: requested.compare_with, before issue 42 requested.baseline), when they agree."""
    from ...report.sources import read_metadata

    found = set()
    for meta in sorted(folder.glob("*/metadata.json"))[:64]:
        try:
            data = read_metadata(meta.parent)
            requested = (data.get("window") or {}).get("requested") or {}
            value = requested.get("compare_with", requested.get("baseline"))  # (the key before issue 42)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str) and valid_id(value):
            found.add(value)
    return found.pop() if len(found) == 1 else None


def _is_path(given: str) -> bool:
    return os.path.lexists(given) or os.sep in given or given.startswith((".", "~"))


def local_paths(given: str, args: argparse.Namespace) -> list[Path]:
    """What `given` names here: a path that exists, or names a folder, is a path; else a capture id (the daemon's
    record says where its ranks wrote, or ./profile/<id> without a daemon)."""
    return [Path(given)] if _is_path(given) else capture_folders(given, args)


def compare_here(args: argparse.Namespace, out: TextIO) -> int:
    """report NOW --baseline BASE on this host: both captures' traces read here (in one pool), the newest capture
    of each side compared (report/compare.py)."""
    from ...report import build_reports, compare_groups

    if len(args.paths) != 1:
        raise CtlError("report --baseline compares one capture with one baseline: give one capture", EXIT_USAGE)
    if not _is_path(args.paths[0]) and not _is_path(args.baseline):
        _one_job(args.paths[0], args.baseline, args)
    base_paths = local_paths(args.baseline, args)
    if not base_paths or not any(p.exists() for p in base_paths):
        raise CtlError(f"the baseline {args.baseline} is not here: " + ", ".join(map(str, base_paths)))
    now_paths = local_paths(args.paths[0], args)
    if {p.resolve() for p in now_paths} == {p.resolve() for p in base_paths}:
        raise CtlError(f"the baseline is the capture itself ({', '.join(map(str, now_paths))}): give a capture taken "
                       "when the job was healthy", EXIT_USAGE)
    now_report, base_report = build_reports([now_paths, base_paths], top=max(args.top, 15), summaries=True)
    now, base = _one_capture(now_report, args.paths[0]), _one_capture(base_report, args.baseline)
    comparison = compare_groups(base, now)
    for given, report in ((args.paths[0], now_report), (args.baseline, base_report)):
        if len(report["captures"]) > 1:
            comparison["notes"].insert(0, f"{given} holds {len(report['captures'])} captures: compared its newest, "
                                          f"{report['captures'][0].get('capture_id') or report['captures'][0]['title_path']}")
    render_comparison(comparison, args, out)
    return EXIT_OK if compared(comparison) else EXIT_FAILED


def _one_job(now_id: str, base_id: str, args: argparse.Namespace) -> None:
    """Two capture ids the daemon knows are compared only when they are of one job and one owner (issue 41, 5: a
    job's automatic baseline id, taken first by another user's capture, was compared with as its baseline).
    CtlError says why not; nothing is checked without a daemon (the folders under ./profile are the user's own)."""
    from ...core.protocol import default_runtime_dir

    try:
        with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as client:
            now = client.request("show", capture_id=now_id)
            base = client.request("show", capture_id=base_id)
    except CtlError:
        return

    def owners(record: dict[str, Any]) -> list[int]:
        return sorted({p["uid"] for p in record["parts"].values() if isinstance(p.get("uid"), int)})

    why = f"of job {base['job']}, not of job {now['job']}" if base["job"] != now["job"] else \
        f"of uid {', '.join(map(str, owners(base)))}'s job, not of uid {', '.join(map(str, owners(now)))}'s" \
        if owners(base) != owners(now) else ""
    if why:
        raise CtlError(f"the baseline {base['capture_id']} is a capture {why} (as {now['capture_id']} is): not "
                       "compared; a capture is compared with a baseline of its own job (to compare two jobs' "
                       "captures, give their folders)", EXIT_USAGE)


def _one_capture(report: ReportData, given: str) -> Any:
    """The newest capture a report found (captures are newest first); CtlError when it found none."""
    if not report["captures"] or not report["captures"][0]["ranks"]:
        failed = report["captures"][0]["failed"][:3] if report["captures"] else []  # (each rank's why, not a bare
        # "no rank's trace was read")
        problems = "; ".join(f"{p['path']}: {p['error']}" for p in [*report["problems"], *failed]) or \
            "no rank's trace was read"
        raise CtlError(f"nothing to compare in {given}: {problems}")
    return report["captures"][0]


