"""Publishing a finished window: disk checks, the background Exporter, the atomic rename into the capture layout
(rank/layout.py owns every path), then the summaries.

A backend's Export writes into the staging directory and says which file, if any, is a raw Chrome trace to
post-process; the publisher has no backend branches.

Publish first, summarise after (issue 44: a rank whose core was hogged took 15.5 s to post-process a 2.4 MB
trace, and `capture --wait` waited for it). A raw trace that needs no rewrite (postprocess.raw_trace_plan: no
level_none, no simplification, distributedInfo with its rank written, no step to drop) is published as it is:
renamed, its traceName set in place, compressed by a child only with --profile-gzip; one that does is rewritten
by the post-processing child first. The rank directory is then published and "done" said. Its summaries (CSV or
profile.db, summary.json) are written afterwards into the published directory by another child, at SCHED_IDLE
(raised to nice 19 after a minute, its CPU time capped), one at a time on the Summariser's thread, and
metadata.json is replaced to list them (`summary`: pending, then written or failed). An automatic capture's
summaries are written before it is said done: the daemon compares it with its baseline as it settles.
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

from ..core.files import iso_time, read_nofollow, write_json_atomic
from ..core.safedir import save_path_problem
from .backends import Export, Identity
from .layout import METADATA_FILE, RankOutput
from ..core.window import Window
from .helpers import SMALL_RAISE_AFTER_S, SMALL_TRACE_BYTES, SUMMARY_NICE, SUMMARY_RAISE_AFTER_S, python_child, \
    raise_priority, spawn_background, summary_defer_s, wait_for_a_spare_cpu

log = logging.getLogger(__name__)

POSTPROCESS_TIMEOUT_S = 1800
SUMMARY_TIMEOUT_S = 6 * 3600  # wall time; its CPU time is bounded by postprocess.summary_cpu_limit
SUMMARY_SOURCES_FIRST = frozenset({"auto"})  # compared by the daemon as they settle: summarised before "done"
CHILD_PACKAGES = ("ondemand_prof", "ondemand_prof.report")  # imported without their __init__ (helpers.python_child)


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
    """One background thread that writes and publishes finished windows in order, and one (the Summariser's) that
    then writes their summaries, in order too."""

    def __init__(self) -> None:
        self._queue: queue.Queue[ExportJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.summariser = Summariser()

    def submit(self, job: ExportJob) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ondemand-prof-export", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def pending(self) -> int:
        return self._queue.unfinished_tasks + self.summariser.pending()

    def wait(self, timeout: float) -> bool:
        """Wait until every submitted job is published and summarised; False on timeout. The summaries still to
        write are raised from idle priority meanwhile (this is close(): training no longer needs the CPU)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return self.summariser.wait(deadline - time.monotonic())

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                first = job.window.source in SUMMARY_SOURCES_FIRST
                result = publish(job)
                if first:
                    summarise(job, result, urgent=True)
                if job.on_done:
                    job.on_done(result)
                if not first:
                    self.summariser.submit(job, result)
            except Exception:  # noqa: BLE001 - the worker must survive anything one job does
                log.exception("ondemand_prof: export failed unexpectedly")
            finally:
                self._queue.task_done()


CLOSING = "the profiler closes: training no longer needs the CPU"


class Summariser:
    """Writes published windows' summaries on a thread of its own (summarise), one child at a time."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[ExportJob, dict[str, Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._child: int | None = None  # the summary child running now
        self._closing = False

    def submit(self, job: ExportJob, result: dict[str, Any]) -> None:
        if (result.get("summary") or {}).get("status") != "pending":
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ondemand-prof-summary", daemon=True)
                self._thread.start()
        self._queue.put((job, result))

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def wait(self, timeout: float) -> bool:
        with self._lock:
            self._closing = True
            child = self._child
        if child is not None and self._queue.unfinished_tasks:
            raise_priority(child, why=CLOSING)
        deadline = time.monotonic() + max(0.0, timeout)
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _started(self, pid: int) -> None:
        with self._lock:
            self._child = pid
            closing = self._closing
        if closing:
            raise_priority(pid, why=CLOSING)

    def _run(self) -> None:
        while True:
            job, result = self._queue.get()
            try:
                # nobody waits on a summary: it starts once the job leaves a CPU free (helpers.SUMMARY_DEFER_S)
                waited = wait_for_a_spare_cpu(summary_defer_s(), lambda: self._closing)
                summarise(job, result, started=self._started, waited_s=waited)
            except Exception:  # noqa: BLE001 - the worker must survive anything one job does
                log.exception("ondemand_prof: writing a summary failed unexpectedly")
            finally:
                with self._lock:
                    self._child = None
                self._queue.task_done()


def publish(job: ExportJob) -> dict[str, Any]:
    """Write one window's trace and rename it into place (its summaries come after: summarise). Returns the result
    the hook reports."""
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
            t0 = time.monotonic()
            result = final_trace(job, written.raw_trace, out_dir)
            timings["postprocess_s"] = time.monotonic() - t0
            trace = out_dir / result["trace"]
            meta["steps_in_trace"] = result["steps_in_trace"]
            meta["postprocess"] = {"dropped": result["dropped"], "events": result.get("events"),
                                   "rewritten": result["rewritten"]}
            if result.get("why"):
                meta["postprocess"]["why"] = result["why"]
            meta["trace_file"] = f"../{trace.name}"  # the capture folder holds every rank's trace (layout.py)
            meta["summary"] = {"status": "pending"}
            if result["steps_in_trace"] != job.recorded_steps:
                meta["status"] = "partial"
                meta["error"] = f"trace holds steps {result['steps_in_trace']}, expected {job.recorded_steps}"
    except Exception as exc:  # noqa: BLE001 - recorded in the metadata, never raised to training
        log.error("ondemand_prof: export of window %s failed: %s", job.window.describe(), exc)
        meta.update(status="failed", error=f"{type(exc).__name__}: {exc}", steps_in_trace=[])
        meta.pop("summary", None)
    meta["timings"] = dict(meta.get("timings", {}), export_s=round(time.monotonic() - started, 4),
                           queued_s=round(started - job.submitted_at, 4), **{k: round(v, 4) for k, v in timings.items()})
    return _rename_into_place(job, meta, out_dir, trace)


def final_trace(job: ExportJob, raw: Path, out_dir: Path) -> dict[str, Any]:
    """The raw trace made the one published, in `out_dir` (the staging directory): as it is where it needs no
    rewrite (renamed, its traceName set; gzip by a child), else rewritten by the post-processing child. Returns
    trace (its name), steps_in_trace, dropped, events (None where nothing parsed it), rewritten, why."""
    from .postprocess import raw_trace_plan, set_trace_name

    opts = job.window.options
    why, steps = raw_trace_plan(raw, keep_steps=job.recorded_steps, level=opts.level, simplify=opts.data_simplification,
                                dist_initialized=bool(getattr(job.identity, "dist_initialized", False)))
    if why is not None:
        with _paused_build():  # the native save's background build waits meanwhile (a first capture's)
            result = run_postprocess(job, raw, out_dir)
        return {**result, "rewritten": True, "why": why}
    name = job.out.trace_name
    if job.gzip:
        with _paused_build():
            result = run_postprocess(job, raw, out_dir, phase="gzip")
        name = result["trace"]
    else:
        set_trace_name(raw, name)
        os.rename(raw, out_dir / name)
    return {"trace": name, "steps_in_trace": steps, "dropped": {}, "events": None, "rewritten": False}


def _paused_build() -> Any:
    """The native save's background build stopped while a child writes the trace (native_save.SAVER.paused)."""
    from .native_save import SAVER

    return SAVER.paused()


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
        meta.pop("summary", None)
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


def run_postprocess(job: ExportJob, raw: Path, out_dir: Path, phase: str = "trace") -> dict[str, Any]:
    """The post-processing child on the raw trace: its rewrite ("trace") or its compression ("gzip") into
    `out_dir`; the summaries come after publishing (summarise)."""
    ident = job.identity
    trace_name = job.out.trace_name
    spec = {
        # absolute: the child runs in helpers.CHILD_CWD, not in the rank's working directory
        "phase": phase, "raw": os.path.abspath(raw), "out_dir": os.path.abspath(out_dir), "trace_name": trace_name, "keep_steps": job.recorded_steps,
        "level": job.window.options.level, "simplify": job.window.options.data_simplification, "gzip": job.gzip,
        "rank": ident.rank, "world_size": ident.world_size, "export_type": job.window.options.export_type,
        "meta": child_meta(job),
    }
    spec_path = out_dir / ".postprocess.json"
    small = os.path.getsize(raw) <= SMALL_TRACE_BYTES  # raised to nice 10 after a second, not ten (helpers.py)
    return _child(spec, spec_path, POSTPROCESS_TIMEOUT_S, raise_after_s=SMALL_RAISE_AFTER_S if small else None)


def _child(spec: dict[str, Any], spec_path: Path, timeout_s: float, raise_after_s: float | None,
           **spawn: Any) -> dict[str, Any]:
    """The post-processing child on `spec` (written to spec_path, a directory of ours, without following a link;
    removed after): its JSON result, or RuntimeError with the last line it wrote."""
    fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    # at background priority (SCHED_IDLE): on a machine whose cores training keeps busy it would stretch steps;
    # --parent: the child dies with its rank (PR_SET_PDEATHSIG); nothing imported from the job's cwd (helpers.py)
    cmd, env = python_child("ondemand_prof.rank.postprocess", "--parent", str(os.getpid()), str(spec_path),
                            site=False, bare=CHILD_PACKAGES)
    try:
        proc = spawn_background(cmd, env, timeout_s, raise_after_s, **spawn)
    finally:
        spec_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        raise RuntimeError(f"post-processing failed ({why}): {tail[0]}")
    return json.loads(proc.stdout)


def summarise(job: ExportJob, result: dict[str, Any], started: Callable[[int], None] | None = None,
              urgent: bool = False, waited_s: float | None = None) -> None:
    """A published window's summaries (CSV or profile.db, summary.json), written into its rank directory by the
    post-processing child at idle priority (SUMMARY_RAISE_AFTER_S, SUMMARY_NICE; its CPU time capped:
    postprocess.summary_cpu_limit), then metadata.json replaced to list them, with `summary` written or failed
    (and why). `urgent` (an automatic capture, said done once summarised): raised as a trace's child is (after
    1 s for a small trace, 10 s else, to nice 10). `result`: what publish returned; nothing is done where it has
    no summary pending. `waited_s`: how long it waited for a free CPU first (recorded as waited_for_cpu_s). Never
    raises."""
    from .postprocess import summary_cpu_limit

    if (result.get("summary") or {}).get("status") != "pending" or not result.get("path"):
        return
    rank_dir = Path(result["path"])
    trace = rank_dir.parent / Path(result["trace_file"]).name
    ident = job.identity
    t0 = time.monotonic()
    size, limit = 0, None
    try:
        size = os.stat(trace, follow_symlinks=False).st_size
        limit = summary_cpu_limit(size)
        spec = {"phase": "summary", "trace": str(trace), "out_dir": str(rank_dir), "file_mode": job.file_mode,
                "export_type": job.window.options.export_type, "rank": ident.rank, "world_size": ident.world_size,
                "cpu_limit_s": limit, "meta": child_meta(job)}
        policy: dict[str, Any] = {"raise_after_s": SMALL_RAISE_AFTER_S if size <= SMALL_TRACE_BYTES else None} \
            if urgent else {"raise_after_s": SUMMARY_RAISE_AFTER_S, "nice": SUMMARY_NICE}
        out = _child(spec, rank_dir / ".postprocess.json", SUMMARY_TIMEOUT_S, started=started, **policy)
        summary: dict[str, Any] = {"status": "written", "written_at": iso_time()}
    except Exception as exc:  # noqa: BLE001 - said in the metadata, never raised to training
        out = {}
        why = f"{type(exc).__name__}: {exc}"
        if limit is not None and ("signal 24" in why or "signal 9" in why):  # SIGXCPU (RLIMIT_CPU), then SIGKILL
            why += f" (at most {limit} s of CPU for a trace of {size >> 20} MB)"
        log.warning("ondemand_prof: rank %s: the summary of %s was not written: %s", ident.rank, trace, why)
        summary = {"status": "failed", "error": why}
    summary["seconds"] = round(time.monotonic() - t0, 3)
    if waited_s is not None:
        summary["waited_for_cpu_s"] = round(waited_s, 3)
    _update_metadata(rank_dir, job.file_mode, summary, out)
    result["summary"] = summary


def _update_metadata(rank_dir: Path, file_mode: int, summary: dict[str, Any], out: dict[str, Any]) -> None:
    """metadata.json of a published rank directory, replaced (atomically) with its summary's state and files."""
    raw = read_nofollow(rank_dir / METADATA_FILE, 1 << 20)
    try:
        meta = json.loads(raw) if raw else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        log.warning("ondemand_prof: %s is gone or unreadable: the summary's state is not recorded", rank_dir)
        return
    meta["summary"] = summary
    files = dict(meta.get("files") or {})
    for name in out.get("files", []):
        try:
            files[name] = os.stat(rank_dir / name, follow_symlinks=False).st_size
        except OSError:
            continue
    meta["files"] = files
    if out.get("events") is not None and isinstance(meta.get("postprocess"), dict):
        meta["postprocess"]["events"] = out["events"]
    meta.setdefault("timings", {})["summary_s"] = summary["seconds"]
    try:
        write_json_atomic(rank_dir / METADATA_FILE, meta, mode=file_mode)
    except OSError as exc:
        log.warning("ondemand_prof: could not record the summary's state in %s: %s", rank_dir, exc)


def child_meta(job: ExportJob) -> dict[str, Any]:
    """What summary.json and profile.db's meta table say of the rank and its window."""
    ident = job.identity
    return {"job_id": ident.job_id, "rank": ident.rank, "world_size": ident.world_size,
            "capture_id": job.window.capture_id, "window": job.window.describe(),
            "options": job.metadata.get("options"),  # as recorded (the report across hosts prints these)
            "host": ident.host, "cpu_by_step": job.metadata.get("cpu_by_step")}


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ",".join(map(str, steps))
