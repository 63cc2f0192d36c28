"""Triage on demand, in the rank: Python stacks of every thread, the allocator's history and snapshot, and the
collective flight recorder, each collected on the agent thread (or at a step boundary where it must be), so
that a rank answers while its training thread is blocked in a collective.

    collect_stacks()          every thread's Python stack, from sys._current_frames() (needs the GIL)
    NativeDump                faulthandler registered on a spare signal at start: the daemon sends that signal
                              when a rank does not answer (a thread holds the GIL in native code), and the
                              dump is written by C code that needs no GIL
    MemoryRecording           allocator history for N steps, then a snapshot file (CUDA, or torch_npu's mirror)
    dump_flight_recorder()    the process group's flight recorder, pickled as torch writes it, plus a summary
    Triage                    what the agent and the daemon link call: request(action, args, reply)

Nothing here is enabled before a request, and everything a request switches on is switched off after it.
"""

from __future__ import annotations

import collections
import faulthandler
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from ..core.files import write_atomic
from ..core.protocol import MAX_MESSAGE_BYTES, native_dump_signal
from ..core.safedir import make_dirs
from ..core.triagedefs import OWN_THREAD_PREFIX, check_args, format_thread
from .extension import Extension

log = logging.getLogger("ondemand_prof.rank.triage")

MAX_RESULT_BYTES = MAX_MESSAGE_BYTES - 8 * 1024  # stacks leave room in a message for the reply's other fields
MAX_THREADS = 64
MAX_FRAMES = 48  # innermost frames kept per thread
FR_SUMMARY_ENTRIES = 256  # newest flight-recorder entries a rank sends for the cross-rank comparison
FR_ENV_HINT = ("set TORCH_FR_BUFFER_SIZE=2000 (TORCH_NCCL_TRACE_BUFFER_SIZE=2000 for NCCL on older torch) in the "
               "job's environment before it starts")

Reply = Callable[[dict[str, Any]], None]


# ----------------------------------------------------------------------------------------------------------
# Stacks

def collect_stacks(max_frames: int = MAX_FRAMES) -> list[dict[str, Any]]:
    """Every thread's Python stack, innermost frame last; the main thread first. Needs the GIL, not the
    training thread: a thread blocked in a collective that released the GIL shows the frame it waits in."""
    frames = sys._current_frames()
    by_ident = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    main = threading.main_thread().ident
    threads = []
    for ident, frame in frames.items():
        thread = by_ident.get(ident)
        stack = traceback.extract_stack(frame)
        name = thread.name if thread else f"<thread {ident}>"
        threads.append({
            "name": name, "own": name.startswith(OWN_THREAD_PREFIX),  # ondemand_prof's (folded unless asked)
            "main": ident == main, "daemon": bool(thread.daemon) if thread else None, "collector": ident == me,
            "depth": len(stack),
            "frames": [[fs.filename, fs.lineno, fs.name, (fs.line or "")[:160]] for fs in stack[-max_frames:]],
        })
    del frames
    threads.sort(key=lambda t: (not t["main"], t["collector"], t["name"]))
    return threads[:MAX_THREADS]


def fit_stacks(threads: list[dict[str, Any]], limit: int = MAX_RESULT_BYTES) -> tuple[list[dict[str, Any]], bool]:
    """Trim frames (outermost first) until the JSON fits `limit` bytes; says whether anything was cut."""
    cut = False
    keep = MAX_FRAMES
    while len(json.dumps(threads, default=str)) > limit and keep > 2:
        keep //= 2
        cut = True
        threads = [{**t, "frames": t["frames"][-keep:]} for t in threads]
    return threads, cut


def stacks_text(threads: list[dict[str, Any]]) -> str:
    return "\n".join(format_thread(t) for t in threads)


class NativeDump:
    """faulthandler on a spare signal, so that a rank whose agent cannot run (a thread holds the GIL in native
    code) can still be made to write every thread's stack: the handler is C code and needs no GIL.

    Registered at agent start only if the signal has no handler at all (a program's own handler, Python's or
    a library's, is never replaced) and never with chain: the default action of this signal would end the
    process, so the daemon sends it only to a rank that said it registered one."""

    def __init__(self, directory: Path, signum: int | None = None) -> None:
        self.signum = signum if signum is not None else _spare_signal()
        self.path = directory / f"native-stacks-{os.getpid()}.txt"
        self._file: Any = None

    def install(self) -> bool:
        self._remove_stale()
        if self.signum is None:
            return False
        try:
            if signal.getsignal(self.signum) != signal.SIG_DFL:
                log.info("ondemand_prof: signal %d has a handler; no native stack dump on it", self.signum)
                return False
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "w")
            faulthandler.register(self.signum, file=self._file, all_threads=True, chain=False)
            return True
        except (OSError, ValueError, RuntimeError) as exc:
            log.info("ondemand_prof: no native stack dump: %s", exc)
            self._file = None
            return False

    def _remove_stale(self) -> None:
        """Dump files of processes that are gone (this directory is per job and owner-only)."""
        from ..core.processes import pid_alive

        for old in self.path.parent.glob("native-stacks-*.txt"):
            pid = old.stem.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                old.unlink(missing_ok=True)

    def announce(self) -> dict[str, Any] | None:
        """What the daemon needs to ask for a native dump (sent at registration)."""
        if self._file is None:
            return None
        return {"signal": self.signum, "file": str(self.path)}


def _spare_signal() -> int | None:
    """The native-dump signal the daemon sends (core/protocol.py: the daemon never takes one from a rank)."""
    return native_dump_signal()


# ----------------------------------------------------------------------------------------------------------
# Memory: the allocator's history over N steps, then a snapshot for PyTorch's memory visualiser

def memory_module() -> tuple[Any, str] | tuple[None, str]:
    """(module with _record_memory_history/_snapshot, device name) or (None, why not)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "not available on this backend (no torch imported)"
    npu = sys.modules.get("torch_npu")  # never imported by us: only where the program already did
    if npu is not None:
        mod = getattr(getattr(torch, "npu", None), "memory", None)
        if mod is not None and hasattr(mod, "_record_memory_history") and hasattr(mod, "_snapshot"):
            return mod, "npu"
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.memory, "cuda"
    except Exception:  # noqa: BLE001
        pass
    return None, ("not available on this backend (CPU): the allocator history needs a CUDA device (torch.cuda."
                  "memory._record_memory_history) or an Ascend NPU with torch_npu; for host memory use a "
                  "capture with --profile-with-memory")


class MemoryRecording:
    """One recording: begins at a step boundary, ends `steps` steps later at another, then the snapshot is
    pickled off the training thread. Only one per process (the allocator's history is process-wide)."""

    def __init__(self, mod: Any, device: str, steps: int, max_entries: int, stacks: str, path: Path,
                 reply: Reply) -> None:
        self.mod, self.device, self.steps, self.max_entries, self.stacks = mod, device, steps, max_entries, stacks
        self.path, self.reply = path, reply
        self.first: int | None = None
        self.last: int | None = None
        self.snapshot: Any = None
        self.error = ""
        self.finishing = False
        self.done = False

    def begin(self, step: int) -> None:  # training thread
        try:
            self.mod._record_memory_history(max_entries=self.max_entries, stacks=self.stacks)
            self.first = step
        except Exception as exc:  # noqa: BLE001
            self.error = f"could not start the allocator history: {type(exc).__name__}: {exc}"
            self.done = True

    def end(self, step: int) -> None:  # training thread: the snapshot is taken here, written elsewhere
        try:
            self.snapshot = self.mod._snapshot()
        except Exception as exc:  # noqa: BLE001
            self.error = f"could not take the snapshot: {type(exc).__name__}: {exc}"
        finally:
            try:
                self.mod._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                log.exception("ondemand_prof: could not switch the allocator history off")
            self.last = step
            self.done = True

    def write(self) -> dict[str, Any]:  # agent thread
        if self.error:
            return {"ok": False, "error": self.error, "device": self.device}
        data = pickle.dumps(self.snapshot)
        summary = summarize_memory_snapshot(self.snapshot)
        self.snapshot = None
        write_private(self.path, data)
        return {"ok": True, "device": self.device, "path": str(self.path), "bytes": len(data),
                "steps": [self.first, self.last], "max_entries": self.max_entries, "stacks": self.stacks,
                "summary": summary, "open_with": "https://pytorch.org/memory_viz (drag the file in)"}


def summarize_memory_snapshot(snap: Any) -> dict[str, Any]:
    """What a snapshot holds, in a few numbers: reserved and allocated bytes, segments, history entries, and the
    largest live blocks with the innermost Python frame that allocated them."""
    segments = snap.get("segments", []) if isinstance(snap, dict) else []
    reserved = sum(int(s.get("total_size", 0)) for s in segments)
    allocated = sum(int(s.get("allocated_size", 0)) for s in segments)
    blocks = [b for s in segments for b in s.get("blocks", []) if b.get("state") == "active_allocated"]
    blocks.sort(key=lambda b: -int(b.get("size", 0)))
    traces = snap.get("device_traces", []) if isinstance(snap, dict) else []
    actions = collections.Counter(e.get("action") for t in traces for e in t)
    top = []
    for b in blocks[:5]:
        frames = [f for f in b.get("frames", []) if str(f.get("filename", "")).endswith(".py")]
        where = f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"
        top.append({"bytes": int(b.get("size", 0)), "where": where})
    return {"segments": len(segments), "reserved_bytes": reserved, "allocated_bytes": allocated,
            "history_entries": sum(actions.values()), "actions": dict(actions), "largest_blocks": top}


# ----------------------------------------------------------------------------------------------------------
# Collective flight recorder

def dump_flight_recorder() -> tuple[bytes | None, str]:
    """The pickled flight-recorder dump of this process's process groups, or (None, how to turn it on)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None, "no process group in this rank (torch.distributed is not initialised)"
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None, "this torch has no distributed support"
    backend = str(dist.get_backend())
    dumpers = [getattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)]
    hint = FR_ENV_HINT
    if backend == "hccl":  # torch_npu's recorder: torch_npu._C._distributed_c10d._dump_hccl_trace (pickle)
        npu_c10d = getattr(getattr(sys.modules.get("torch_npu"), "_C", None), "_distributed_c10d", None)
        dump_hccl = getattr(npu_c10d, "_dump_hccl_trace", None)
        if dump_hccl is not None:
            dumpers.insert(0, dump_hccl)
        hint = "set TORCH_HCCL_TRACE_BUFFER_SIZE=2000 in the job's environment before it starts (torch_npu)"
    for dump in dumpers:
        try:
            raw = dump()
        except Exception as exc:  # noqa: BLE001 - e.g. built without this backend's recorder
            log.debug("flight recorder dump %s failed: %s", getattr(dump, "__name__", dump), exc)
            continue
        if raw:
            return bytes(raw), ""
    return None, f"the {backend} process group keeps no flight recorder here; to turn it on, {hint}"


def flight_recorder_digest(dump: dict[str, Any], limit: int = FR_SUMMARY_ENTRIES) -> dict[str, Any]:
    """A rank's dump, reduced to what the cross-rank comparison needs: per process group, the newest entries'
    collective sequence numbers, names and states, and the group's last enqueued/started/completed numbers."""
    entries = []
    for e in dump.get("entries", [])[-limit:]:
        pg = e.get("process_group") or ("?", "")
        entries.append({"pg": str(pg[0]), "pg_desc": str(pg[1]) if len(pg) > 1 else "",
                        "seq": int(e.get("collective_seq_id", -1)), "p2p_seq": int(e.get("p2p_seq_id", -1)),
                        "is_p2p": bool(e.get("is_p2p", False)), "name": str(e.get("profiling_name", "")),
                        "state": str(e.get("state", "")), "sizes": e.get("input_sizes")})
    status = {str(k): {kk: vv for kk, vv in v.items() if isinstance(vv, int)}
              for k, v in (dump.get("pg_status") or {}).items() if isinstance(v, dict)}
    return {"version": str(dump.get("version", "")), "entries": entries, "pg_status": status,
            "total_entries": len(dump.get("entries", []))}


# ----------------------------------------------------------------------------------------------------------

def write_private(path: Path, data: bytes) -> None:
    """Owner-only, never through a symlink, published whole: the one atomic writer (core/files.py), into
    directories made without the umask's say."""
    make_dirs(path.parent, 0o700)
    write_atomic(path, data)


class Triage(Extension):
    """The rank's triage requests. request() runs on the agent thread; memory recordings are advanced by
    poll() on the agent thread and begin and end at step boundaries on the training thread."""

    def __init__(self, prof: Any, status_dir: Path) -> None:
        self.prof = prof
        self.native = NativeDump(status_dir)  # its file stays where it was made, even if the job moves
        self.recording: MemoryRecording | None = None

    def install(self) -> None:
        self.native.install()

    def request(self, action: str, args: Any, reply: Reply, capture_id: str) -> None:
        """Answer through `reply` (now, or for memory after the steps); never raises."""
        t0 = time.monotonic()
        try:
            args = check_args(action, args)
            if action == "stacks":
                result = self._stacks()
            elif action == "flight_recorder":
                result = self._flight_recorder(capture_id)
            else:
                self._memory(args, reply, capture_id)
                return
        except Exception as exc:  # noqa: BLE001 - a failed triage is an answer, never an exception in training
            log.warning("ondemand_prof: triage %s failed: %s", action, exc)
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result.setdefault("took_ms", round((time.monotonic() - t0) * 1000, 1))
        reply(result)

    def _stacks(self) -> dict[str, Any]:
        threads, cut = fit_stacks(collect_stacks())
        return {"ok": True, "method": "python", "threads": threads, "trimmed": cut,
                "current_step": self.prof.current_step}

    def _flight_recorder(self, capture_id: str) -> dict[str, Any]:
        raw, why = dump_flight_recorder()
        if raw is None:
            return {"ok": False, "unavailable": True, "error": why}
        dump = pickle.loads(raw)  # noqa: S301 - bytes our own process's torch produced just now
        path = self.prof.layout.flight_recorder_path(capture_id, self.prof.identity().rank)
        write_private(path, raw)
        return {"ok": True, "path": str(path), "bytes": len(raw), **flight_recorder_digest(dump)}

    def _memory(self, args: dict[str, Any], reply: Reply, capture_id: str) -> None:
        mod, device = memory_module()
        if mod is None:
            reply({"ok": False, "unavailable": True, "error": device})
            return
        if self.recording is not None:
            reply({"ok": False, "error": "a memory recording is already running in this rank"})
            return
        rec = MemoryRecording(mod, device, args["steps"], args["max_entries"], args["stacks"],
                              self._path(capture_id, "memory.pickle"), reply)
        self.recording = rec
        self.prof.call_at_next_step(rec.begin)

    def poll(self, now: float = 0.0) -> None:
        """Agent thread: end a recording once its steps are done; write and answer once it has ended."""
        rec = self.recording
        if rec is None:
            return
        if rec.done:
            self.recording = None
            try:
                result = rec.write()
            except Exception as exc:  # noqa: BLE001
                result = {"ok": False, "error": f"could not write the snapshot: {type(exc).__name__}: {exc}"}
            rec.reply(result)
        elif rec.first is not None and not rec.finishing and self.prof.current_step >= rec.first + rec.steps:
            rec.finishing = True
            self.prof.call_at_next_step(rec.end)

    def close(self) -> None:
        """The process is closing the profiler: a recording still running is switched off."""
        rec, self.recording = self.recording, None
        if rec is not None and rec.first is not None and not rec.done:
            try:
                rec.mod._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass
            rec.reply({"ok": False, "error": "the profiler closed before the recording's steps were done"})

    def _path(self, capture_id: str, kind: str) -> Path:
        return self.prof.layout.triage_path(capture_id, self.prof.identity().rank, kind)
