"""Where a capture goes: the one owner of output paths (staging and final, per backend).

    {save_path}/{capture}/                                 one folder per capture, shared by all its ranks:
        {host}_{pid}_rank{R}.pt.trace.json[.gz]            each rank's trace side by side, so the folder is one
                                                           HTA trace_dir, one TensorBoard run (a worker per
                                                           rank) and one MindStudio Insight cluster
        {host}_{pid}_{YYYYmmddHHMMSSmmm}_pt/               each rank's directory (the seed's name): metadata.json,
                                                           step/operator summaries or profile.db
        {host}_{pid}_{YYYYmmddHHMMSSmmm}_ascend_pt/        torch_npu: its own directory, as torch_npu names it
        .{rank directory}.partial/                         staging, renamed when complete
        {host}_{pid}_rank{R}.memory.pickle                 triage files (ondemandctl memory, flight-recorder):
        fr_trace_rank_{R}                                  {capture} is then the triage request's id (the
                                                           flight recorder's as torch's analyzer reads them)

{capture} is the capture id (ondemandctl's, `file-<version>` for a trigger file, `static-<job>-<start>-<end>`
for the configured window). HTA reads every *.json directly in a folder as a rank's trace, which is why the
rank directories (with metadata.json) sit one level down and the traces do not.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.files import path_component
from ..core.processes import pid_alive

STAGING_SUFFIX = ".partial"
METADATA_FILE = "metadata.json"


def safe_name(text: str) -> str:
    """A single path component from an id (files.path_component): no separators, no '.'/'..', bounded."""
    return path_component(text, "capture")


def trace_path(result: dict[str, Any]) -> str | None:
    """The trace file a published window wrote (absolute), from its metadata: its rank directory `path` and
    `trace_file` (relative to it, in the capture folder). None where the backend wrote no single trace file."""
    path, trace = result.get("path"), result.get("trace_file")
    if not path or not trace:
        return None
    return os.path.normpath(os.path.join(path, trace))


@dataclass(frozen=True)
class RankOutput:
    """The paths of one rank's window."""

    folder: Path  # the capture folder
    name: str  # the rank directory's planned name
    trace_name: str  # the trace file's name in the capture folder (without .gz)

    @property
    def staging(self) -> Path:
        return self.folder / f".{self.name}{STAGING_SUFFIX}"

    def final(self, written: Path) -> Path:
        """A backend that wrote a directory of its own (torch_npu) keeps its name; otherwise ours."""
        return self.folder / (written.name if written != self.staging else self.name)


class CaptureLayout:
    """Paths for one process's captures under its save root."""

    def __init__(self, save_root: Path, host: str, pid: int) -> None:
        self.save_root = save_root
        self.host = host
        self.pid = pid

    def plan(self, capture_id: str, rank: int, when: _dt.datetime, suffix: str = "pt") -> RankOutput:
        stamp = f"{when:%Y%m%d%H%M%S}{when.microsecond // 1000:03d}"
        return RankOutput(self.save_root / safe_name(capture_id), f"{self.host}_{self.pid}_{stamp}_{suffix}",
                          f"{self.host}_{self.pid}_rank{rank}.pt.trace.json")

    def triage_path(self, capture_id: str, rank: int, kind: str) -> Path:
        """A triage file (memory snapshot, flight-recorder dump) beside the traces of its capture folder:
        {save}/{capture}/{host}_{pid}_rank{R}.{kind}"""
        return self.save_root / safe_name(capture_id) / safe_name(f"{self.host}_{self.pid}_rank{rank}.{kind}")

    def flight_recorder_path(self, capture_id: str, rank: int) -> Path:
        """A rank's flight-recorder dump: {save}/{capture}/fr_trace_rank_{R}, the names torch's analyzer
        (torchfrtrace, torch.distributed.flight_recorder) reads a folder of: a common prefix, then the rank."""
        return self.save_root / safe_name(capture_id) / f"fr_trace_rank_{rank}"

    def remove_stale_staging(self) -> list[Path]:
        """Staging dirs left by crashed processes of this host (their pid is gone) are removed at start-up."""
        removed: list[Path] = []
        if not self.save_root.is_dir():
            return removed
        for entry in self.save_root.glob(f"*/.{self.host}_*{STAGING_SUFFIX}"):
            try:
                pid = int(entry.name[len(self.host) + 2:].split("_", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not pid_alive(pid):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        return removed
