"""The on-disk output: directory names, disk checks, metadata, and the background exporter that publishes
each window's directory atomically (written under a hidden staging name, renamed when complete).

Layout of one window on one rank (torch backend):
    {save_path}/{host}_{pid}_{YYYYmmddHHMMSSmmm}_pt/
        trace/{host}_{pid}_rank{R}.pt.trace.json[.gz]   Chrome trace (Perfetto, TensorBoard, HTA)
        metadata.json                                   who, what, which steps, status
        step_summary.csv, operator_summary.csv          export_type=text
        profile.db                                      export_type=db (schema: postprocess.DB_SCHEMA)
The trace sits in its own folder because HTA reads every *.json in a folder as a trace.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .backends import Export, Identity
from .trace_save import spawn_background
from .window import Window

log = logging.getLogger(__name__)

STAGING_SUFFIX = ".partial"
METADATA_FILE = "metadata.json"
POSTPROCESS_TIMEOUT_S = 1800


def capture_dir_name(host: str, pid: int, when: _dt.datetime, suffix: str = "pt") -> str:
    """The seed's naming: {host}_{pid}_{YYYYmmddHHMMSSmmm}_{suffix} (torch_npu uses suffix ascend_pt)."""
    return f"{host}_{pid}_{when:%Y%m%d%H%M%S}{when.microsecond // 1000:03d}_{suffix}"


def staging_path(save_root: Path, final_name: str) -> Path:
    return save_root / f".{final_name}{STAGING_SUFFIX}"


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
    problem = writable_problem(save_root)
    if problem:
        return problem
    free_mb = shutil.disk_usage(existing_ancestor(save_root)).free // (1024 * 1024)
    if free_mb < min_free_mb:
        return f"only {free_mb} MB free under {save_root} (need {min_free_mb} MB, --profile-min-free-mb)"
    return None


def remove_stale_staging(save_root: Path, host: str) -> list[Path]:
    """Staging dirs left by crashed processes of this host (their pid is gone) are removed at start-up."""
    removed: list[Path] = []
    if not save_root.is_dir():
        return removed
    for entry in save_root.glob(f".{host}_*{STAGING_SUFFIX}"):
        try:
            pid = int(entry.name[len(host) + 2:].split("_", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def pid_alive(pid: int, thorough: bool = False) -> bool:
    """Whether a process runs; `thorough` also rules out a zombie (a killed rank its launcher has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if thorough:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return True  # no /proc here: trust kill()
    return True


def iso_time(t: float | None = None) -> str:
    """Local time with offset, to the millisecond, of epoch seconds `t` (now by default): every timestamp we
    write (metadata, status files, capture records) has this one form."""
    return _dt.datetime.fromtimestamp(time.time() if t is None else t).astimezone().isoformat(
        timespec="milliseconds")


@dataclass
class ExportJob:
    export: Export
    window: Window
    identity: Identity
    save_root: Path
    final_name: str
    metadata: dict[str, Any]
    recorded_steps: list[int]
    gzip: bool
    on_done: Callable[[dict[str, Any]], None] | None = None
    submitted_at: float = field(default_factory=time.monotonic)


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
    staging = staging_path(job.save_root, job.final_name)
    meta = dict(job.metadata)
    meta["window"] = dict(meta.get("window", {}), recorded_steps=job.recorded_steps)
    meta.update(status="ok", error=None)
    final = job.save_root / job.final_name
    try:
        staging.mkdir(parents=True, exist_ok=True)
        written = job.export.write(staging)
        if job.export.kind == "ascend":
            final = job.save_root / written.name
            out_dir = written
            meta["steps_in_trace"] = job.recorded_steps
        else:
            out_dir = staging
            result = run_postprocess(job, written, staging)
            meta["steps_in_trace"] = result["steps_in_trace"]
            meta["postprocess"] = {"dropped": result["dropped"], "events": result["events"]}
            meta["trace_file"] = result["trace"]
            if result["steps_in_trace"] != job.recorded_steps:
                meta["status"] = "partial"
                meta["error"] = (f"trace holds steps {result['steps_in_trace']}, "
                                 f"expected {job.recorded_steps}")
    except Exception as exc:  # noqa: BLE001 - recorded in the metadata, never raised to training
        log.error("ondemand_prof: export of window %s failed: %s", job.window.describe(), exc)
        meta.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        out_dir = staging
    meta["timings"] = dict(meta.get("timings", {}), export_s=round(time.monotonic() - started, 4),
                           queued_s=round(started - job.submitted_at, 4))
    meta["published_at"] = iso_time()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        meta["files"] = {str(p.relative_to(out_dir)): p.stat().st_size for p in sorted(out_dir.rglob("*"))
                         if p.is_file()}
        write_json_atomic(out_dir / METADATA_FILE, meta)
        os.rename(out_dir, final)
        if out_dir != staging:
            shutil.rmtree(staging, ignore_errors=True)
        meta["path"] = str(final)
        log.info("ondemand_prof: rank %s wrote %s (steps %s, %s)", job.identity.rank, final,
                 _steps_text(meta.get("steps_in_trace", [])), meta["status"])
    except OSError as exc:
        log.error("ondemand_prof: could not publish %s: %s", final, exc)
        shutil.rmtree(staging, ignore_errors=True)
        meta.update(status="failed", error=f"could not publish {final}: {exc}", path=None)
    return meta


def run_postprocess(job: ExportJob, raw: Path, out_dir: Path) -> dict[str, Any]:
    ident = job.identity
    trace_name = f"{ident.host}_{ident.pid}_rank{ident.rank}.pt.trace.json"
    spec = {
        "raw": str(raw), "out_dir": str(out_dir), "trace_name": trace_name, "keep_steps": job.recorded_steps,
        "level": job.window.options.level, "simplify": job.window.options.data_simplification, "gzip": job.gzip,
        "rank": ident.rank, "world_size": ident.world_size, "export_type": job.window.options.export_type,
        "meta": {"job_id": ident.job_id, "rank": ident.rank, "world_size": ident.world_size,
                 "capture_id": job.window.capture_id, "window": job.window.describe()},
    }
    spec_path = out_dir / ".postprocess.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = package_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # at background priority (SCHED_IDLE): on a machine whose cores training keeps busy it would stretch steps
    proc = spawn_background([sys.executable, "-m", "ondemand_prof.postprocess", str(spec_path)], env,
                            POSTPROCESS_TIMEOUT_S)
    spec_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"post-processing failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(proc.stdout)


def write_json_atomic(path: Path, data: Any, compact: bool = False) -> None:
    """Readers see the old file or the new one, never a partial one (unique temp name: several writers)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    text = json.dumps(data, separators=(",", ":"), default=str) if compact else \
        json.dumps(data, indent=2, sort_keys=True, default=str)
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    os.replace(tmp, path)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ",".join(map(str, steps))
