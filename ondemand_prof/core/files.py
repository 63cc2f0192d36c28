"""Small file helpers every process uses: one timestamp form, the one atomic writer, reads that follow no link on
another user's behalf. Processes (pid checks, identities, namespaces) are core/processes.py's."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any


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
    keep_tmp = False  # the temporary name goes in the end, unless it became the published file
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode != 0o600:
                os.fchmod(fh.fileno(), mode)
            fh.write(raw)
            fh.flush()
            st = os.fstat(fh.fileno())
        if replace:
            os.replace(tmp, path)
            keep_tmp = True
        else:
            os.link(tmp, path)
    finally:
        if not keep_tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return st


def write_json_atomic(path: Path, data: Any, compact: bool = False, mode: int = 0o600) -> None:
    """JSON through write_atomic."""
    text = json.dumps(data, separators=(",", ":"), default=str) if compact else \
        json.dumps(data, indent=2, sort_keys=True, default=str)
    write_atomic(path, text + "\n", mode)


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


# ----------------------------------------------------------------------------------------------------------
# Reading a file on another user's behalf (the daemon, often root, reads what a rank wrote)

class UnsafePath(OSError):
    """A path a peer gave that we will not open: relative, with '..', a symlink on the way, not a regular
    file, or not owned by the user it should belong to."""


def open_beneath_root(path: str, owner: int | None, flags: int = os.O_RDONLY, root: str = "/") -> int:
    """An open descriptor of the regular file at absolute `path`, reached without following any symbolic link:
    every directory on the way is opened relative to the one before with O_NOFOLLOW (so a component swapped for
    a link after a check is refused, not followed), and the file itself too. With `owner`, the file must belong
    to that uid. `root`: where `path` starts (/proc/PID/root: the root of a process in a container, its path as
    that process sees it). UnsafePath (an OSError) or another OSError says why not."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise UnsafePath(f"not an absolute path: {path[:200]!r}" if isinstance(path, str) else "not a path")
    names = [n for n in path.split("/") if n and n != "."]
    if not names or ".." in names:
        raise UnsafePath(f"{path}: '..' or no file name")
    dir_flags = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", dir_flags) if root == "/" else \
        os.open(root, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)  # (a magic link)
    try:
        for name in names[:-1]:
            try:
                nxt = os.open(name, dir_flags, dir_fd=fd)
            except NotADirectoryError:  # a symlink opened with O_NOFOLLOW|O_DIRECTORY, or a file on the way
                raise UnsafePath(f"{path}: {name} is a symbolic link or not a directory") from None
            os.close(fd)
            fd = nxt
        try:
            file_fd = os.open(names[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                              dir_fd=fd)
        except OSError as exc:
            if exc.errno == 40:  # ELOOP: the last component is a symbolic link
                raise UnsafePath(f"{path} is a symbolic link") from None
            raise
    finally:
        os.close(fd)
    try:
        st = os.fstat(file_fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file")
        if owner is not None and st.st_uid != owner:
            raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to uid {owner}")
    except BaseException:
        os.close(file_fd)
        raise
    return file_fd


# openat2(2) (Linux 5.6+): a path resolved as a process whose root is the directory given would resolve it
_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_IN_ROOT = 0x10
_openat2_missing = False


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(dir_fd, path, {flags, 0, resolve}); OSError (ENOSYS where the kernel lacks it, EPERM where a
    seccomp filter refuses it) as the kernel says."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    how = struct.pack("QQQ", flags, 0, resolve)
    fd = libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
                      ctypes.c_char_p(how), ctypes.c_size_t(len(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def open_in_root(root: str, path: str, flags: int = getattr(os, "O_PATH", os.O_RDONLY), links: bool = True) -> int:
    """A descriptor of absolute `path` as a process whose root is `root` (/proc/PID/root: a rank in a container)
    names it: resolved by the kernel within `root` (openat2 RESOLVE_IN_ROOT: its absolute links and '..' stay in
    it; no /proc magic link), never out of it onto this host's files (issue 41, 8: a pod's absolute link, followed
    from the node, told the pod which node paths exist and led root's trigger into a node directory). Where the
    kernel has no openat2, the path is walked one directory at a time following no link at all (a link on the way
    is refused). `links=False`: no link is followed at all, openat2 or not. OSError says why not."""
    global _openat2_missing
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise UnsafePath(f"not an absolute path: {str(path)[:200]!r}")
    root_fd = os.open(root, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)  # (a magic link)
    try:
        if not _openat2_missing:
            try:
                return openat2(root_fd, path, flags | os.O_CLOEXEC, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
                               (0 if links else RESOLVE_NO_SYMLINKS))
            except OSError as exc:
                if exc.errno not in (38, 1):  # ENOSYS, EPERM (seccomp): the walk below
                    raise
                _openat2_missing = True
        names = [n for n in path.split("/") if n and n != "."]
        if ".." in names:
            raise UnsafePath(f"{path}: '..' on the way")
        fd = os.dup(root_fd)
        try:
            for i, name in enumerate(names):
                last = i == len(names) - 1
                nxt = os.open(name, (flags if last else getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)
                              | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return os.dup(fd)
        except OSError as exc:
            if isinstance(exc, NotADirectoryError) or exc.errno == 40:  # ENOTDIR, ELOOP: a link on the way
                raise UnsafePath(f"{path}: a symbolic link or a file on the way (not followed)") from None
            raise
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)


def stat_in_root(root: str, path: str, links: bool = True) -> os.stat_result:
    """What `path` names as a process whose root is `root` names it (open_in_root; a last link is not followed)."""
    fd = open_in_root(root, path, getattr(os, "O_PATH", os.O_RDONLY) | os.O_NOFOLLOW, links)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_beneath_root(path: str, owner: int | None, limit: int, offset: int = 0, root: str = "/") -> bytes:
    """Up to `limit` bytes from `offset` of the file open_beneath_root() opens; OSError says why not."""
    fd = open_beneath_root(path, owner, root=root)
    try:
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def size_beneath_root(path: str, owner: int | None, root: str = "/") -> int:
    fd = open_beneath_root(path, owner, root=root)
    try:
        return os.fstat(fd).st_size
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
