"""Paths beneath a root, reached without following a link out of it: a file at an absolute path a peer gave,
every directory on the way opened relative to the one before with O_NOFOLLOW (open_beneath_root, and the reads
on it), and a path as a process whose root is another directory names it (open_in_root: openat2 RESOLVE_IN_ROOT
where the kernel has it, a walk following no link where not). The daemon, often root, reads what a rank wrote
through these, and a pod's paths are resolved within its root (/proc/PID/root). The one home of these walkers
(issue 41); directories we create and check are core/safedir.py's."""

from __future__ import annotations

import os
import stat



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
        return read_fd(fd, limit)
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes from an open descriptor's position, read a MiB at a time (never more than asked)."""
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def size_beneath_root(path: str, owner: int | None, root: str = "/") -> int:
    """The size of the file open_beneath_root() opens; OSError says why not."""
    fd = open_beneath_root(path, owner, root=root)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
