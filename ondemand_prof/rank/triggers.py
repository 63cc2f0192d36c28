"""File triggers: the trigger directory, reading a trigger safely, its version, status files and the shared
window decision that keeps ranks aligned.

    {trigger dir}/capture                  what the user touches or writes JSON into
    {trigger dir}/capture.status/rank{R}.json   what rank R did with the latest trigger
    {trigger dir}/capture.status/.window-{version}.json   the absolute window the first rank chose

The directory is checked once at start-up (prepare_trigger_dir) and again at every use: each read of the trigger
and each write beside it opens the directory anew from `/` (core/safedir.checked_dir: every directory on the way
sound, no link followed) and the file relative to that descriptor, never by its path, so a directory swapped
after the start-up check is refused, not read or written through (issue 34, F5).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # not POSIX: no leases, the settle time decides
    fcntl = None  # type: ignore[assignment]

from ..core import safejson
from ..core.protocol import MAX_MESSAGE_BYTES
from ..core.files import write_atomic_at
from ..core.safedir import MissingDirectory, checked_dir, ensure_private_dir, open_dir, private_fallback, read_at
# default_trigger_dir: re-exported (agent.py and the tests import it from here)
from ..core.triggerfile import STATUS_DIR, TRIGGER_NAME, default_trigger_dir, job_dir_name, trigger_version

log = logging.getLogger(__name__)

MAX_TRIGGER_BYTES = MAX_MESSAGE_BYTES  # a trigger holds a request, as a message to the daemon does
NETWORK_FS = ("nfs", "nfs4", "cifs", "smbfs", "smb3", "lustre", "gpfs", "ceph", "beegfs", "glusterfs", "9p",
              "fuse.sshfs", "fuse.s3fs", "fuse.juicefs", "fuse.glusterfs", "afs", "orangefs", "virtiofs")
KEEP_DECISIONS = 32
NAME_LATE_S = 2.0  # how long threads watchdog starts once running are looked for (name_late_threads)


def prepare_trigger_dir(path: Path, job_id: str) -> Path:
    """The trigger directory to use: `path` when it is (or can be made) ours; otherwise one line says why and a
    private fallback is used, whose path the agent logs."""
    try:
        ensure_private_dir(path)
        ensure_private_dir(path / STATUS_DIR)
        return path
    except OSError as exc:
        fallback = private_fallback(job_dir_name(job_id))
        ensure_private_dir(fallback / STATUS_DIR)
        log.warning("ondemand_prof: not using trigger directory %s: %s; using %s instead", path, exc, fallback)
        return fallback


def ensure_dir(path: Path) -> None:
    """Create owner-only and check it is ours (UnsafeDirectory otherwise)."""
    ensure_private_dir(path)


def is_network_fs(path: Path) -> bool:
    """Whether path lives on a filesystem where inotify does not see other hosts' writes."""
    try:
        import psutil

        real = os.path.realpath(path)
        best, fstype = "", ""
        for part in psutil.disk_partitions(all=True):
            mp = part.mountpoint
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
                best, fstype = mp, part.fstype
        return fstype.lower() in NETWORK_FS or fstype.lower().startswith("fuse.") and fstype.lower() != "fuse.portal"
    except Exception:  # noqa: BLE001 - unknown: assume local
        return False


@dataclass(frozen=True)
class Trigger:
    version: str  # changes with every write of the file, even two within one second
    mtime: float
    data: dict[str, Any] | None  # None when error
    error: str | None
    regular: bool = True  # a regular file (not a symlink, a directory, ...): something a writer may still fill
    # False when the bytes read are not as many as the size seen just before: a writer truncated or wrote in
    # between (two writes within one clock tick leave the file's times and size unchanged, so only this shows)
    consistent: bool = True


def stat_key(path: Path) -> tuple[int, int, int, int] | None:
    """The trigger's times, inode and size: only a change detector (nothing is opened or acted on by path; what
    is read is read_trigger's)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return (-1, -1, -1, -1)
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size)


def read_trigger(path: Path) -> Trigger | None:
    """Read the trigger file without following links or reading unbounded data; None when absent. The file is
    opened relative to its directory, checked now (a directory refused: a Trigger with that error, once per
    reason, so that the refusal is said and nothing there is acted on)."""
    try:
        dir_fd = open_dir(path.parent)
    except MissingDirectory:
        return None
    except OSError as exc:
        why = f"the trigger directory is refused: {exc}"
        return Trigger("refused-" + hashlib.sha1(why.encode()).hexdigest()[:8], time.time(), None, why,
                       regular=False)
    try:
        return _read_trigger_at(dir_fd, path)
    finally:
        os.close(dir_fd)


def _read_trigger_at(dir_fd: int, path: Path) -> Trigger | None:
    name = path.name
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Trigger(f"err-{exc.errno}", time.time(), None, f"cannot stat {path}: {exc.strerror}")
    # the version follows what a writer changes (time of modification, inode, size, content), never the inode
    # change time alone (core/triggerfile.py)
    version = trigger_version(st, None)
    if stat.S_ISLNK(st.st_mode):
        return Trigger(version, st.st_mtime, None, f"{path} is a symbolic link; write a regular file", regular=False)
    if stat.S_ISDIR(st.st_mode):
        return Trigger(version, st.st_mtime, None, f"{path} is a directory; write a regular file", regular=False)
    if not stat.S_ISREG(st.st_mode):
        return Trigger(version, st.st_mtime, None, f"{path} is not a regular file", regular=False)
    if st.st_size > MAX_TRIGGER_BYTES:
        return Trigger(version, st.st_mtime, None,
                       f"{path} is {st.st_size} bytes; a trigger holds at most {MAX_TRIGGER_BYTES} bytes of JSON")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except PermissionError:
        return Trigger(version, st.st_mtime, None, f"{path} is not readable by uid {os.getuid()}")
    except OSError as exc:
        return Trigger(version, st.st_mtime, None, f"cannot open {path}: {exc.strerror}")
    try:
        raw = os.read(fd, MAX_TRIGGER_BYTES + 1)
    finally:
        os.close(fd)
    version = trigger_version(st, raw)
    if len(raw) != st.st_size:
        return Trigger(version, st.st_mtime, None, "changed while being read", consistent=False)
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return Trigger(version, st.st_mtime, {}, None)
    try:
        data = safejson.loads(text, MAX_TRIGGER_BYTES + 1)
    except safejson.UnsafeJSON as exc:  # deep nesting, NaN, huge numbers included: rejected, never a traceback
        return Trigger(version, st.st_mtime, None, str(exc))
    if not isinstance(data, dict):
        return Trigger(version, st.st_mtime, None, f"expected a JSON object, got {type(data).__name__}")
    return Trigger(version, st.st_mtime, data, None)


def writer_holds(path: Path) -> bool | None:
    """Whether any process has the trigger open for writing right now, asked of the kernel: True, False, or None
    when it cannot tell (no leases here, a file we neither own nor may lease, a network filesystem).

    A read lease (F_SETLEASE F_RDLCK) is granted only while nobody holds the file open for writing, so an empty
    trigger nobody holds is a finished "touch", and one a writer holds is a writer stalled between truncating and
    writing, however long it stalls. The lease is held for microseconds; a writer opening in that moment waits
    for our close. A lease break is signalled to the holder (SIGIO, whose default action ends the process), so
    the descriptor is set to SIGURG first, which is ignored by default; a program with its own SIGURG handler
    skips the check.
    """
    setlease = getattr(fcntl, "F_SETLEASE", None)  # None without fcntl (not POSIX) or without leases
    if setlease is None or signal.getsignal(signal.SIGURG) not in (signal.SIG_DFL, signal.SIG_IGN):
        return None
    try:
        with checked_dir(path.parent) as dir_fd:  # checked at this use, the file opened relative to it
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, setlease, fcntl.F_RDLCK)
        return False
    except OSError as exc:
        return True if exc.errno == errno.EAGAIN else None
    finally:
        os.close(fd)  # releases the lease


class WriterTracker:
    """Whether a writer holds the trigger open, known exactly: our own inotify queue, read synchronously.

    The kernel queues an inotify event inside the system call that causes it, so events read after we read the
    trigger include every truncate, write and close that happened before. Watchdog's events (which wake the
    agent) reach us later, from another thread, and file times are too coarse to order against them: a writer
    that truncated within a jiffy of the previous close looked finished, and its empty file was taken for a
    "touch" (39 of 86 windows nobody asked for, in one test). None of that applies here.
    """

    IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x8, 0x40, 0x80
    IN_CREATE, IN_DELETE, IN_Q_OVERFLOW = 0x100, 0x200, 0x4000
    IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000

    def __init__(self, directory: Path, name: str = TRIGGER_NAME) -> None:
        import ctypes

        self.name = name.encode()
        self.open = False
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = self.IN_MODIFY | self.IN_CLOSE_WRITE | self.IN_MOVED_FROM | self.IN_MOVED_TO | self.IN_CREATE | \
            self.IN_DELETE
        if libc.inotify_add_watch(fd, os.fsencode(str(directory)), mask) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {directory} failed")
        self.fd = fd

    def writer_open(self) -> bool:
        """Read every queued event; whether the trigger was modified or created and not yet closed since."""
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return self.open
            except OSError:
                return False
            off = 0
            while off + 16 <= len(buf):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", buf, off)
                name = buf[off + 16:off + 16 + length].rstrip(b"\0")
                off += 16 + length
                if mask & self.IN_Q_OVERFLOW:
                    self.open = False  # lost track: the settle time and the next close decide
                elif name != self.name:
                    continue
                elif mask & (self.IN_MODIFY | self.IN_CREATE):
                    self.open = True
                elif mask & (self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_MOVED_FROM | self.IN_DELETE):
                    self.open = False

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def claim_decision(status_dir: Path, version: str, decision: dict[str, Any]) -> dict[str, Any]:
    """Publish our window for this trigger version unless another rank did first; return the one that holds.

    write_atomic_at(replace=False) links a complete file and fails if the name exists, on local filesystems and
    NFS alike, so exactly one rank's decision wins and nobody reads a half-written one. Both relative to the
    status directory, checked at this use (UnsafeDirectory otherwise).
    """
    name = f".window-{version}.json"
    with checked_dir(status_dir) as dir_fd:
        held = _read_decision(dir_fd, name)
        if held is not None:
            return held
        try:  # published whole, and only if no other rank's decision holds the name
            write_atomic_at(dir_fd, name, json.dumps(decision), replace=False)
            return decision
        except FileExistsError:
            return _read_decision(dir_fd, name) or decision


def _read_decision(dir_fd: int, name: str) -> dict[str, Any] | None:
    """Another rank's decision, read without following links; None when absent or not a decision."""
    raw = read_at(dir_fd, name, 4096)
    if raw is None:
        return None
    try:
        data = safejson.loads(raw, 4096)
    except ValueError:
        return None
    ok = isinstance(data, dict) and all(type(data.get(k)) is int for k in ("start_step", "anchor_step"))
    return data if ok else None


def prune_decisions(status_dir: Path, keep: int = KEEP_DECISIONS) -> None:
    try:
        with checked_dir(status_dir) as dir_fd:
            names = [n for n in os.listdir(dir_fd) if n.startswith(".window-") and n.endswith(".json")]
            if len(names) <= keep:
                return
            mtimes = {}
            for n in names:
                try:
                    mtimes[n] = os.stat(n, dir_fd=dir_fd, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
            for old in sorted(mtimes, key=mtimes.__getitem__)[:-keep]:
                try:
                    os.unlink(old, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
    except OSError:
        return


def name_watchdog_threads(observer: Any, before: set[int | None]) -> None:
    """Name the threads watchdog started for `observer` (its dispatcher, the emitter that waits in watchdog's
    delayed queue, the inotify reader, and, since watchdog 7.1.1, the reader's own dispatcher thread, a plain
    Thread it starts once running) as ondemand_prof's own, so that stacks tell them from the program's threads
    (they were Thread-1..3, InotifyFD-Dispatcher) and fold them. Called again while that last one may still be
    starting (DirWatcher.name_late_threads)."""
    from ..core.triagedefs import OWN_THREAD_PREFIX

    for t in threading.enumerate():
        if t.ident in before or t.name.startswith(OWN_THREAD_PREFIX):
            continue
        started_for = type(getattr(getattr(t, "_target", None), "__self__", None)).__module__  # a bound method's
        if type(t).__module__.startswith("watchdog"):
            role = ("trigger-observer" if t is observer else
                    "trigger-emitter" if t in getattr(observer, "emitters", ()) else "trigger-inotify")
        elif started_for.startswith("watchdog"):
            role = "trigger-dispatcher"
        else:
            continue
        t.name = OWN_THREAD_PREFIX + role


class DirWatcher:
    """Calls `on_change` (from watchdog's thread) when something changes in the trigger directory: inotify
    through watchdog, or nothing (the agent polls) when inotify is unavailable or the directory is on a network
    filesystem."""

    def __init__(self, directory: Path, on_change: Callable[[], None], poll_s: float) -> None:
        self.directory = directory
        self.on_change = on_change
        self.mode = "poll"
        self.poll_s = poll_s
        self._observer: Any = None
        self._before: set[int | None] = set()  # the threads before watchdog's (name_watchdog_threads)
        self._name_until = 0.0  # watchdog's threads started late are named until then (name_late_threads)
        # whether a writer has the trigger open: a modification (a truncate, a write) not yet followed by its
        # close, so that an empty file is told apart from one a writer has truncated and not yet written
        # ("echo ... > capture" is open(O_TRUNC), write, close; a loaded host can stall it in between)
        self.writer_open = False
        self.last_event_at = 0.0  # wall time the last event on the trigger (other than our own reads) arrived
        if poll_s > 0:
            return
        if is_network_fs(directory):
            self.poll_s = 0.5
            log.info("ondemand_prof: %s is on a network filesystem; polling it every %.1f s", directory,
                     self.poll_s)
            return
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer

            watcher = self

            class Handler(FileSystemEventHandler):
                def on_any_event(self, ev: Any) -> None:  # noqa: D401 - watchdog callback
                    if os.path.basename(str(getattr(ev, "dest_path", "") or ev.src_path)) == TRIGGER_NAME or \
                            os.path.basename(str(ev.src_path)) == TRIGGER_NAME:
                        watcher.note_event(ev.event_type)

            before = {t.ident for t in threading.enumerate()}
            observer = Observer()
            observer.daemon = True
            observer.schedule(Handler(), str(directory), recursive=False)
            observer.start()
            self._observer = observer
            name_watchdog_threads(observer, before)
            self._before, self._name_until = before, time.monotonic() + NAME_LATE_S
            self.mode = "inotify"
        except Exception as exc:  # noqa: BLE001 - e.g. inotify watch limit reached
            self.poll_s = 0.5
            log.warning("ondemand_prof: inotify unavailable for %s (%s); polling every %.1f s", directory, exc,
                        self.poll_s)

    def note_event(self, event_type: str) -> None:
        if event_type in ("opened", "closed_no_write"):
            return  # readers, such as our own agent: they neither change the trigger nor finish a write
        if event_type in ("modified", "created"):
            self.writer_open = True
        elif event_type in ("closed", "deleted", "moved"):
            self.writer_open = False
        self.last_event_at = time.time()
        self.on_change()

    def name_late_threads(self) -> None:
        """The agent's poll, for NAME_LATE_S after the watcher started: name the threads watchdog's own threads
        started after it returned (its reader's dispatcher)."""
        if self._name_until and time.monotonic() < self._name_until:
            name_watchdog_threads(self._observer, self._before)
        else:
            self._name_until = 0.0

    def stop(self) -> None:
        if self._observer is not None:
            try:
                self._observer.stop()
                self._observer.join(timeout=2)
            except Exception:  # noqa: BLE001
                pass
