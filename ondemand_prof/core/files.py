"""Small file helpers every process uses: one timestamp form, the atomic writers, a read that follows no link,
an id as one file name (path_component). Paths beneath a root (another user's files, a pod's paths) are
core/rootpath.py's; processes (pid checks, identities, namespaces) core/processes.py's."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


_iso_second: tuple[Any, str, str] = (None, "", "")  # (epoch second, its local text, its UTC offset): the last one asked


def iso_time(t: float | None = None) -> str:
    """Local time with offset, to the millisecond, of epoch seconds `t` (now by default): every timestamp we
    write (metadata, status files, capture records) has this one form. The local text of a whole second is made
    once (the daemon stamps every event of every rank: the zone lookup, then building a datetime per stamp, were
    most of the cost); the fraction is rounded to the microsecond as datetime.fromtimestamp rounds it."""
    global _iso_second
    t = time.time() if t is None else t
    second = math.floor(t)
    micro = round((t - second) * 1e6)
    if micro >= 1_000_000:  # rounded up into the next second
        second, micro = second + 1, 0
    cached = _iso_second  # read once: another thread may replace it
    if cached[0] != second:
        text = _dt.datetime.fromtimestamp(second).astimezone().isoformat()
        cached = _iso_second = (second, text[:19], text[19:])
    return f"{cached[1]}.{micro // 1000:03d}{cached[2]}"


def iso_epoch(text: Any) -> float:
    """Epoch seconds of an iso_time text: what orders records. Their text does not: the hour repeated when clocks
    go back reads earlier than the hour before it, and hosts in other zones merge into one list. A text that is
    not a time (a record edited by hand, a reply from an odd daemon) sorts first, as the oldest."""
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError, OverflowError, OSError):
        return -math.inf


def write_atomic(path: Path, data: bytes | str, mode: int = 0o600, *, replace: bool = True) -> os.stat_result:
    """The one way we publish a file: readers see the old file or the new one, never a partial one. The
    temporary file has an unpredictable name and is created exclusively (mkstemp: O_EXCL, so a planted symlink
    is never written through), gets `mode` before any byte is written, and is renamed over the final name,
    which is replaced, never opened: a symlink there is replaced, not followed.

    `replace=False` publishes only if nothing holds the name (os.link: atomic, and refused with FileExistsError
    when the name exists, on local filesystems and NFS alike), so the first of several writers wins. Returns the
    published file's stat (its device and inode name this very file later)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return _fill_and_publish(fd, raw, mode, replace, lambda: os.replace(tmp, path), lambda: os.link(tmp, path),
                             lambda: os.unlink(tmp))


def write_atomic_at(dir_fd: int, name: str, data: bytes | str, mode: int = 0o600, *,
                    replace: bool = True) -> os.stat_result:
    """write_atomic relative to a checked directory's descriptor (core/safedir.py checked_dir): a temporary file
    with an unpredictable name created exclusively (O_EXCL | O_NOFOLLOW) there, `mode` before any byte, renamed
    over `name` (replace) or linked to it only if nothing holds the name (replace=False: FileExistsError)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    return _fill_and_publish(fd, raw, mode, replace,
                             lambda: os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd),
                             lambda: os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False),
                             lambda: os.unlink(tmp, dir_fd=dir_fd))


def _fill_and_publish(fd: int, raw: bytes, mode: int, replace: bool, rename: Callable[[], None],
                      link: Callable[[], None], unlink: Callable[[], None]) -> os.stat_result:
    """The two writers' common part: `raw` into the new temporary file `fd` (given `mode` first), then published
    by `rename` (replace) or `link`; the temporary name is removed unless it became the published file."""
    published = False
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode != 0o600:
                os.fchmod(fh.fileno(), mode)
            fh.write(raw)
            fh.flush()
            st = os.fstat(fh.fileno())
        if replace:
            rename()
            published = True
        else:
            link()
    finally:
        if not published:
            try:
                unlink()
            except OSError:
                pass
    return st


def write_json_atomic(path: Path, data: Any, compact: bool = False, mode: int = 0o600) -> None:
    """JSON through write_atomic."""
    text = json.dumps(data, separators=(",", ":"), default=str) if compact else \
        json.dumps(data, indent=2, sort_keys=True, default=str)
    write_atomic(path, text + "\n", mode)


_COMPONENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def path_component(text: str, fallback: str) -> str:
    """An id (a job's, a capture's) as one file name: every character but ASCII letters, digits, '-', '_' and '.'
    made '_' (no separator, nothing a terminal or a shell reads), at most 128 of them, no '.' at either end (never
    '.' or '..', nor hidden); `fallback` when nothing is left."""
    name = "".join(c if c in _COMPONENT_CHARS else "_" for c in text)[:128].strip(".")
    return name or fallback


def read_nofollow(path: Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of a file, never through a symbolic link; None when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def presence_note(path: str) -> str:
    """What ondemandctl adds after a reported trace or directory on this host: nothing when it is there, that
    it is missing, or that this user cannot look (a group member may not read another member's save path)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "  (MISSING on disk)"
    except PermissionError:
        return f"  (not visible to uid {os.getuid()}: permission denied)"
    except OSError as exc:
        return f"  (cannot be checked: {exc.strerror})"
    return ""
