"""ondemandctl export ID --perfetto FILE: one file with every rank's trace of a capture, every host's, as named
process tracks in rank order, the clocks of the other hosts aligned on the collectives' ends (the alignment
`report` computes, report/waits.py; the residual skew stated in the file's metadata), for Perfetto UI,
chrome://tracing or any reader of Chrome traces (report/perfetto.py merges).

Where the traces come from: the daemons' records say where each rank wrote (the `summaries` request `report`
already sends: each part's trace path, and its summary.json with the timeline the clocks are aligned on), and the
traces are read here, as the user who runs the command, at that path: on one host, or across hosts where the save
path is on a shared filesystem. A rank whose trace is not here is named with its host; a copy of that host's
capture folder is read where `--traces DIR` holds it. No trace crosses the network through the daemons: over TCP a
daemon knows a key, not a user, so it could not hand a trace to its owner alone, and a trace (stack frames' file
names, shapes, every operator) says more than the summary `report` fetches (docs/reports.md, One timeline)."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import os
import re
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TextIO

from ...core.ranks import RankSpecError, parse_ranks, spans
from ..client import EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, Client, CtlError, OneHost, dumps
from .base import Command, capture_replies, warn

if TYPE_CHECKING:
    from ...report.perfetto import Alignment, RankStats
    from ...report.timeline import Timeline
    from ..fanout import Fanout

DEFAULT_MAX_MB = 2048  # the merged file's text, estimated from the traces: Perfetto UI holds about this in a tab
TRACE_NAME = re.compile(r"_(\d+)_rank(\d+)\.pt\.trace\.json(\.gz)?$")  # rank/layout.py: {host}_{pid}_rank{R}


@dataclass
class Part:
    """One rank of the capture, as its daemon's record (or its folder) says."""

    rank: int
    host: str | None
    daemon: str | None
    trace: str | None  # the trace's path on its host
    summary: dict[str, Any] | None
    why: str | None = None  # why it has no trace to export
    path: Path | None = None  # the trace read here


class Export(Command):
    name = "export"
    help = ("one file of every rank's trace of a capture, on one clock (--perfetto FILE: Perfetto UI, "
            "chrome://tracing)")
    needs_daemon = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("capture", help="a capture id (or any unique part of it: the daemons' records say where "
                            "its ranks wrote), or a capture folder here")
        parser.add_argument("--perfetto", metavar="FILE", required=True, help="write the merged Chrome trace here "
                            "(FILE.gz: gzipped); every rank a named process track, in rank order")
        parser.add_argument("--traces", metavar="DIR", action="append", default=[], help="also look for the ranks' "
                            "trace files here, by name (a copy of another host's capture folder); repeatable")
        parser.add_argument("--ranks", help="only these ranks (0-3,8; default: every rank of the capture)")
        parser.add_argument("--max-mb", type=int, default=DEFAULT_MAX_MB, help="refuse to write more than this many "
                            f"MB of trace text (default {DEFAULT_MAX_MB}: about what Perfetto UI holds in a browser "
                            "tab; beyond, export fewer --ranks or open it with trace_processor)")
        parser.add_argument("--runtime-dir", type=Path, default=None, help="for a capture id: the daemon's runtime "
                            "directory (env ONDEMAND_PROF_RUNTIME_DIR)")
        parser.add_argument("--connect-timeout", type=float, default=5.0, help="for a capture id: seconds to wait "
                            "for the daemon's answer (default 5)")

    def run(self, client: Client | None, args: argparse.Namespace, out: TextIO) -> int:
        """On this host: a capture folder, or a capture id through this host's daemon."""
        given = Path(args.capture)
        if not given.is_dir():
            from ...core.protocol import default_runtime_dir

            try:
                with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as daemon:
                    return self.run_on(OneHost(daemon), args, out)
            except CtlError as exc:  # no daemon, or a capture it does not know: ./profile/<id>, as report does
                local = _saved_here(args.capture)
                if local is None:
                    raise CtlError(f"{args.capture!r} is not a capture folder here, nor one under ./profile, nor a "
                                   f"capture the daemon knows: {exc}") from None
                given = local
        parts, cid, job = folder_parts(given)
        return export(parts, cid, job, args, out, {})

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """Every daemon's record of the capture (its parts' trace paths and summaries), the traces read here."""
        from ..summaries import checked

        found, failed = capture_replies(fan, "summaries", {"capture_id": args.capture})
        replies = {name: checked(r.data) for name, r in found.items()}
        first = next(iter(replies.values()))
        parts = [Part(p["rank"], p.get("host"), None if fan.local else name, p.get("trace"), p.get("summary"),
                      None if p["state"] == "done" and p.get("trace") else
                      (p.get("error") or f"no trace ({p['state']})"))
                 for name, reply in replies.items() for p in reply["parts"]]
        return export(parts, first["capture_id"], first.get("job"), args, out, failed)


def _saved_here(capture_id: str) -> Path | None:
    """The one folder under ./profile (the default save path, from here) that `capture_id` names or begins."""
    save = Path("profile")
    if not save.is_dir() or "/" in capture_id:
        return None
    names = [d for d in save.iterdir() if d.is_dir() and d.name.startswith(capture_id)]
    return names[0] if len(names) == 1 else None


def folder_parts(folder: Path) -> tuple[list[Part], str, str | None]:
    """A capture folder's ranks (their metadata.json and summary.json beside their traces), no daemon asked."""
    from ...core.summaryfile import read_summary
    from ...report.sources import read_metadata

    parts, ids, jobs = [], set(), set()
    for rank_dir in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            meta = read_metadata(rank_dir)
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict) or type(meta.get("rank")) is not int:
            continue
        ids.add(str(meta.get("capture_id") or folder.name))
        jobs.add(meta.get("job_id"))
        trace = meta.get("trace_file")
        try:
            summary: dict[str, Any] | None = read_summary(str(rank_dir.resolve()))
        except (OSError, ValueError):
            summary = None
        parts.append(Part(meta["rank"], meta.get("host"), None,
                          os.path.normpath(rank_dir / trace) if isinstance(trace, str) and trace else None, summary,
                          None if trace else "its metadata names no trace file"))
    if not parts:
        raise CtlError(f"{folder} holds no rank directory of ours (metadata.json): give a capture folder")
    if len(ids) > 1:
        raise CtlError(f"{folder} holds ranks of {len(ids)} captures ({', '.join(sorted(ids)[:4])}): give one")
    return parts, ids.pop(), jobs.pop() if len(jobs) == 1 else None


# ----------------------------------------------------------------------------------------------------------
# The export, wherever the parts came from


def export(parts: list[Part], capture_id: str, job: str | None, args: argparse.Namespace, out: TextIO,
           failed_hosts: dict[str, str]) -> int:
    """Find each rank's trace here, align the clocks, merge, write; print what went in and what did not."""
    parts = _selected(parts, args.ranks)
    for p in parts:
        if p.why is None:
            p.path, p.why = _found(p, [Path(d) for d in args.traces])
    usable = [p for p in parts if p.path is not None]
    missing = {p.rank: p for p in parts if p.path is None}
    if not usable:
        warn(failed_hosts, sys.stderr)
        raise CtlError(f"no trace of capture {capture_id} is readable here: " + _missing_text(missing))
    _check_size(usable, args.max_mb)
    t0 = time.monotonic()
    written, stats, alignment = _write(usable, capture_id, job, Path(args.perfetto))
    seconds = time.monotonic() - t0
    size = os.path.getsize(written)
    if args.json:
        out.write(dumps({"file": str(written), "bytes": size, "seconds": round(seconds, 3), "capture_id": capture_id,
                         "clock": alignment.clock, "clock_text": alignment.text(), "notes": alignment.notes,
                         "unaligned": alignment.unaligned, "ranks": [s.as_dict() for s in stats],
                         "missing": {str(r): p.why for r, p in sorted(missing.items())},
                         "failed_hosts": failed_hosts}) + "\n")
    else:
        out.write(_text(written, size, seconds, capture_id, stats, usable, alignment, missing))
    warn(failed_hosts, sys.stderr)
    return EXIT_PARTIAL if missing or failed_hosts else EXIT_OK


def _selected(parts: list[Part], spec: str | None) -> list[Part]:
    parts = sorted(parts, key=lambda p: p.rank)
    if spec is None:
        return parts
    try:
        wanted = set(parse_ranks(spec))
    except RankSpecError as exc:
        raise CtlError(f"--ranks {spec}: {exc}", EXIT_USAGE) from None
    chosen = [p for p in parts if p.rank in wanted or -1 in wanted]
    if not chosen:
        raise CtlError(f"--ranks {spec}: the capture has rank(s) {spans(p.rank for p in parts)}", EXIT_USAGE)
    return chosen


def _found(part: Part, dirs: list[Path]) -> tuple[Path | None, str | None]:
    """Where this rank's trace is readable here: its own path (one host, a shared filesystem), else a file of its
    name under a --traces directory (or that directory's copy of the capture folder); a regular file either way."""
    assert part.trace is not None
    name = os.path.basename(part.trace)
    folder = os.path.basename(os.path.dirname(part.trace))
    inside = [name] + ([os.path.join(folder, name)] if folder not in ("", ".", "..") else [])
    for candidate in [Path(part.trace), *(d / c for d in dirs for c in inside)]:
        if _regular(candidate):
            return candidate, None
    where = f" on {part.daemon}" if part.daemon else ""
    return None, (f"its trace {part.trace}{where} is not readable here (a save path on another host's disk: run "
                  "export where it is shared, or copy that host's capture folder here and pass --traces DIR)")


def _regular(path: Path) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and os.access(path, os.R_OK)
    except OSError:
        return False


def _text_size(path: Path) -> int:
    """The trace's text, in bytes: a gzip file's own record of it (ISIZE, modulo 4 GiB), else its size."""
    size = path.stat().st_size
    if path.name.endswith(".gz") and size >= 18:
        with open(path, "rb") as fh:
            fh.seek(-4, os.SEEK_END)
            return max(size, struct.unpack("<I", fh.read(4))[0])
    return size


def _check_size(parts: list[Part], max_mb: int) -> None:
    total = sum(_text_size(p.path) for p in parts if p.path is not None)
    if total > max_mb * 1_000_000:
        raise CtlError(f"the {len(parts)} trace(s) hold {total / 1e6:,.0f} MB of text, over --max-mb {max_mb}: export "
                       "fewer ranks (--ranks), or raise --max-mb and open the file with trace_processor (Perfetto's "
                       "native loader: `trace_processor server http FILE`, then Perfetto UI)", EXIT_USAGE)


# ----------------------------------------------------------------------------------------------------------
# Reading, aligning, writing


def _timeline(part: Part) -> Timeline | None:
    from ...report.timeline import Unreadable, decode

    data = (part.summary or {}).get("timeline")
    try:
        return decode(data) if data else None
    except Unreadable:
        return None


def _header(part: Part) -> dict[str, Any]:
    """The trace's top-level keys before its events (baseTimeNanoseconds, distributedInfo), read by opening it and
    taking its first event; CtlError when it is not a trace of that rank."""
    from ...report.tracefile import TraceError, TraceReader

    reader = TraceReader(part.path)  # type: ignore[arg-type]
    events = reader.events()
    try:
        next(events, None)
    except TraceError as exc:
        raise CtlError(f"rank {part.rank}: {exc}") from None
    finally:
        getattr(events, "close")()  # (a generator: its file closed now)
    info = reader.header.get("distributedInfo")
    said = info.get("rank") if isinstance(info, dict) else None
    if type(said) is int and said != part.rank:
        raise CtlError(f"rank {part.rank}: {part.path} is rank {said}'s trace (its distributedInfo), not rank "
                       f"{part.rank}'s")
    return reader.header


def _base_us(header: dict[str, Any]) -> float:
    base = header.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and not isinstance(base, bool) and 0 < base < 1e20:
        return base / 1000
    return 0.0


def _write(parts: list[Part], capture_id: str, job: str | None, dest: Path
           ) -> tuple[Path, list[RankStats], Alignment]:
    """The merged trace written beside `dest` under a temporary name and renamed onto it once complete."""
    from ...report.perfetto import Merger, align, metadata, origin_us
    from ...report.tracefile import TraceError, TraceReader

    alignment = align([(p.rank, p.host, _timeline(p)) for p in parts])
    shifts = {p.rank: _base_us(_header(p)) + alignment.offsets_us.get(p.rank, 0.0) for p in parts}
    origin = origin_us(shifts.values())
    hosts = list(dict.fromkeys(p.host or "?" for p in parts))
    head = metadata(capture_id, job, [p.rank for p in parts], hosts, alignment, origin * 1000)
    stats: list[RankStats] = []
    dest = dest.expanduser()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent.resolve())
    except OSError as exc:
        raise CtlError(f"--perfetto {dest}: cannot write there: {exc.strerror}") from None
    try:
        with _opened(fd, dest.name.endswith(".gz")) as fh:
            merger = Merger(fh, head)
            for p in parts:
                reader = TraceReader(p.path)  # type: ignore[arg-type]
                main = TRACE_NAME.search(p.path.name) if p.path else None
                try:
                    stats.append(merger.add(p.rank, p.host, reader.events(), shifts[p.rank] - origin,
                                            int(main.group(1)) if main else None))
                except TraceError as exc:  # cut short: what it held is in, and said
                    alignment.notes.append(f"rank {p.rank}: {exc}")
            merger.close({"ondemandProfRanks": [s.as_dict() for s in stats]})
        os.replace(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    return dest, stats, alignment


@contextlib.contextmanager
def _opened(fd: int, gz: bool) -> Iterator[TextIO]:
    """The temporary file as text (gzipped for a .gz name), on disk when the block ends."""
    with os.fdopen(fd, "wb") as raw:
        with contextlib.ExitStack() as stack:
            binary = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6)) if gz else raw
            text = io.TextIOWrapper(binary, encoding="utf-8", write_through=False)
            yield text
            text.flush()
            text.detach()
        raw.flush()
        os.fsync(raw.fileno())


# ----------------------------------------------------------------------------------------------------------
# The console


def _text(written: Path, size: int, seconds: float, capture_id: str, stats: list[RankStats], parts: list[Part],
          alignment: Alignment, missing: dict[int, Part]) -> str:
    hosts = {p.host for p in parts}
    lines = [f"capture {capture_id}: {len(stats)} rank(s) on {len(hosts)} host(s) in one trace: {written.resolve()} "
             f"({size / 1e6:.1f} MB, {sum(s.events for s in stats):,} events, {seconds:.2f} s)\n",
             f"  clock: {alignment.text()}\n"]
    lines += [f"  note: {n}\n" for n in alignment.notes]
    by_rank = {p.rank: p for p in parts}
    for s in stats:
        moved = alignment.offsets_us.get(s.rank, 0.0)
        own = "  (its own clock)" if s.rank in alignment.unaligned else ""
        lines.append(f"  rank {s.rank:<4} {s.host or '?':<16} {moved:+10.1f} us  {s.events:>9,} events  "
                     f"{by_rank[s.rank].path}{own}\n")
    for rank, p in sorted(missing.items()):
        lines.append(f"  rank {rank:<4} {p.host or '?':<16} not in it: {p.why}\n")
    lines.append("  open it in Perfetto UI (Open trace file: read in the browser, nothing is uploaded) or "
                 "chrome://tracing\n")
    return "".join(lines)


def _missing_text(missing: dict[int, Part]) -> str:
    return "; ".join(f"rank {r}: {p.why}" for r, p in sorted(missing.items())[:8]) + (
        f"; and {len(missing) - 8} more" if len(missing) > 8 else "")

