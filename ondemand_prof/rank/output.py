"""Publishing a finished window: disk checks, the background Exporter, post-processing in a child process, and
the atomic rename into the capture layout (rank/layout.py owns every path).

A backend's Export writes into the staging directory and says which file, if any, is a raw Chrome trace to
post-process; the publisher has no backend branches.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.files import iso_time, write_json_atomic
from ..core.safedir import save_path_problem
from .backends import Export, Identity
from .layout import METADATA_FILE, RankOutput
from ..core.window import Window
from .helpers import SMALL_RAISE_AFTER_S, SMALL_TRACE_BYTES, python_child, spawn_background

log = logging.getLogger(__name__)

POSTPROCESS_TIMEOUT_S = 1800


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not _exists(path) and path != path.parent:
        path = path.parent
    return path


def _exists(path: Path) -> bool:
    try:
        path.lstat()
        return True
    except OSError:
        return False


def writable_problem(save_path: str | os.PathLike[str]) -> str | None:
    """Why save_path cannot be written (without creating it), or None."""
    path = Path(save_path)
    try:
        if path.exists() and not path.is_dir():
            return f"{path} exists and is not a directory"
    except PermissionError:
        return f"{path} cannot be reached by uid {os.getuid()} (permission denied)"
    anchor = existing_ancestor(path)
    if not anchor.is_dir():
        return f"{anchor} is not a directory"
    if not os.access(anchor, os.W_OK | os.X_OK):
        return f"{anchor} is not writable by uid {os.getuid()}"
    return None


def disk_problem(save_root: Path, min_free_mb: int) -> str | None:
    problem = writable_problem(save_root) or save_path_problem(save_root)  # chain owned by us or root
    if problem:
        return problem
    free_mb = shutil.disk_usage(existing_ancestor(save_root)).free // (1024 * 1024)
    if free_mb < min_free_mb:
        return f"only {free_mb} MB free under {save_root} (need {min_free_mb} MB, --profile-min-free-mb)"
    return None


@dataclass
class ExportJob:
    export: Export
    window: Window
    identity: Identity
    out: RankOutput
    metadata: dict[str, Any]
    recorded_steps: list[int]
    gzip: bool
    on_done: Callable[[dict[str, Any]], None] | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    file_mode: int = 0o640  # --profile-file-mode; directories get the matching search bits


class Exporter:
    """One background thread that writes, post-processes and publishes finished windows in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[ExportJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: ExportJob) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ondemand-prof-export", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def wait(self, timeout: float) -> bool:
        """Wait until every submitted job is published; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                result = publish(job)
                if job.on_done:
                    job.on_done(result)
            except Exception:  # noqa: BLE001 - the worker must survive anything one job does
                log.exception("ondemand_prof: export failed unexpectedly")
            finally:
                self._queue.task_done()


def publish(job: ExportJob) -> dict[str, Any]:
    """Write one window's files and rename them into place. Returns the result the hook reports."""
    started = time.monotonic()
    staging = job.out.staging
    meta = dict(job.metadata)
    meta["window"] = dict(meta.get("window", {}), recorded_steps=job.recorded_steps)
    meta.update(status="ok", error=None, steps_in_trace=job.recorded_steps)
    out_dir, trace = staging, None
    timings: dict[str, float] = {}
    try:
        staging.mkdir(parents=True, exist_ok=True)
        written = job.export.write(staging)
        timings["write_s"] = time.monotonic() - started
        # what the backend learned while writing (torch: which way the trace was saved)
        meta["backend"] = dict(meta.get("backend", {}), **job.export.info)
        out_dir = written.directory
        if written.raw_trace is not None:
            from .native_save import SAVER

            t0 = time.monotonic()
            with SAVER.paused():  # the native save's background build waits meanwhile (a first capture's)
                result = run_postprocess(job, written.raw_trace, out_dir)
            timings["postprocess_s"] = time.monotonic() - t0
            trace = out_dir / result["trace"]
            meta["steps_in_trace"] = result["steps_in_trace"]
            meta["postprocess"] = {"dropped": result["dropped"], "events": result["events"]}
            meta["trace_file"] = f"../{trace.name}"  # the capture folder holds every rank's trace (layout.py)
            if result["steps_in_trace"] != job.recorded_steps:
                meta["status"] = "partial"
                meta["error"] = f"trace holds steps {result['steps_in_trace']}, expected {job.recorded_steps}"
    except Exception as exc:  # noqa: BLE001 - recorded in the metadata, never raised to training
        log.error("ondemand_prof: export of window %s failed: %s", job.window.describe(), exc)
        meta.update(status="failed", error=f"{type(exc).__name__}: {exc}", steps_in_trace=[])
    meta["timings"] = dict(meta.get("timings", {}), export_s=round(time.monotonic() - started, 4),
                           queued_s=round(started - job.submitted_at, 4), **{k: round(v, 4) for k, v in timings.items()})
    return _rename_into_place(job, meta, out_dir, trace)


def _rename_into_place(job: ExportJob, meta: dict[str, Any], out_dir: Path, trace: Path | None) -> dict[str, Any]:
    """The trace first, then the rank directory: a rank directory with a final name is always complete."""
    final = job.out.final(out_dir)
    meta["published_at"] = iso_time()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {str(p.relative_to(out_dir)): p.stat().st_size for p in sorted(out_dir.rglob("*")) if p.is_file()}
        if trace is not None:
            files = {name: size for name, size in files.items() if name != trace.name}
            files[meta["trace_file"]] = trace.stat().st_size
            os.rename(trace, job.out.folder / trace.name)
        meta["files"] = files
        write_json_atomic(out_dir / METADATA_FILE, meta, mode=job.file_mode)
        restrict_tree(out_dir, job.out.folder, trace and job.out.folder / trace.name, job.file_mode)
        os.rename(out_dir, final)
        if out_dir != job.out.staging:
            shutil.rmtree(job.out.staging, ignore_errors=True)
        meta["path"] = str(final)
        log.debug("ondemand_prof: rank %s published %s (steps %s, %s)", job.identity.rank, final,
                 _steps_text(meta.get("steps_in_trace", [])), meta["status"])
    except OSError as exc:
        log.error("ondemand_prof: could not publish %s: %s", final, exc)
        shutil.rmtree(job.out.staging, ignore_errors=True)
        meta.update(status="failed", error=f"could not publish {final}: {exc}", path=None)
    return meta


def dir_mode(file_mode: int) -> int:
    """0640 -> 0750: a directory is searchable by whoever may read its files."""
    return 0o700 | file_mode | ((file_mode & 0o044) >> 2)


def restrict_tree(out_dir: Path, folder: Path, trace: Path | None, file_mode: int) -> None:
    """Give what a window wrote (backends and torch create files with the process umask, often 0644) the
    configured modes: files file_mode, directories dir_mode. The capture folder is changed only if ours."""
    dmode = dir_mode(file_mode)
    for root, dirnames, filenames in os.walk(out_dir):
        os.chmod(root, dmode)
        for name in filenames:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)
    if trace is not None and trace.exists():
        os.chmod(trace, file_mode)
    try:
        if folder.stat().st_uid == os.getuid():
            os.chmod(folder, dmode)
    except OSError:
        pass


def run_postprocess(job: ExportJob, raw: Path, out_dir: Path) -> dict[str, Any]:
    ident = job.identity
    trace_name = job.out.trace_name
    spec = {
        # absolute: the child runs in helpers.CHILD_CWD, not in the rank's working directory
        "raw": os.path.abspath(raw), "out_dir": os.path.abspath(out_dir), "trace_name": trace_name, "keep_steps": job.recorded_steps,
        "level": job.window.options.level, "simplify": job.window.options.data_simplification, "gzip": job.gzip,
        "rank": ident.rank, "world_size": ident.world_size, "export_type": job.window.options.export_type,
        "meta": {"job_id": ident.job_id, "rank": ident.rank, "world_size": ident.world_size,
                 "capture_id": job.window.capture_id, "window": job.window.describe(),
                 "options": job.metadata.get("options"),  # as recorded (the report across hosts prints these)
                 "host": ident.host, "cpu_by_step": job.metadata.get("cpu_by_step")},
    }
    spec_path = out_dir / ".postprocess.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    # at background priority (SCHED_IDLE): on a machine whose cores training keeps busy it would stretch steps;
    # --parent: the child dies with its rank (PR_SET_PDEATHSIG); nothing imported from the job's cwd (helpers.py)
    cmd, env = python_child("ondemand_prof.rank.postprocess", "--parent", str(os.getpid()), str(spec_path),
                            site=False)
    small = os.path.getsize(raw) <= SMALL_TRACE_BYTES  # raised to nice 10 after a second, not ten (helpers.py)
    proc = spawn_background(cmd, env, POSTPROCESS_TIMEOUT_S, SMALL_RAISE_AFTER_S if small else None)
    spec_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"post-processing failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(proc.stdout)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ",".join(map(str, steps))
