"""Directories we create are ours: made owner-only, and checked at every use.

Trigger, status, runtime and state directories often live at predictable paths under /tmp. Another local user
who creates one first (world-writable, or a symlink to a place they choose) could otherwise open windows in our
job, read our status files, redirect our writes, or serve our ranks a fake daemon. check_dir() refuses such a
directory with one line naming the path and why; ensure_private_dir() creates what is missing with mode 0700 and
then checks the whole chain.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("ondemand_prof")


class UnsafeDirectory(OSError):
    """A directory another user could control; the message names the path and the reason."""


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_dir(path: Path, *, group_writable: bool = False, allow_root: bool = False) -> os.stat_result:
    """The directory's lstat when it is safe for us: a real directory (no symlink), owned by us (or root when
    allow_root), writable by nobody else (group members too when group_writable). UnsafeDirectory otherwise."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeDirectory(f"{path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{path} is a symbolic link; refusing to use it (remove it, or choose another "
                              "directory)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} exists and is not a directory")
    uid = os.getuid()
    if st.st_uid != uid and not (allow_root and st.st_uid == 0):
        raise UnsafeDirectory(f"{path} belongs to {_owner_name(st.st_uid)}, not to us (uid {uid}); refusing to "
                              "use it (another user may have created it first)")
    bad = stat.S_IWOTH | (0 if group_writable else stat.S_IWGRP)
    if st.st_mode & bad:
        raise UnsafeDirectory(f"{path} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                              f"(mode {st.st_mode & 0o7777:o}); refusing to use it (chmod go-w it, or remove it)")
    return st


def _check_ancestors(path: Path) -> None:
    """Up to the first root-owned ancestor, every parent must be ours too (else its owner could swap ours)."""
    for parent in path.absolute().parents:
        try:
            st = os.lstat(parent)
        except OSError:
            return
        if st.st_uid == 0 and not stat.S_ISLNK(st.st_mode):
            return  # /, /tmp (sticky), /run, a home's parent: root decides who renames in there
        check_dir(parent)


def ensure_private_dir(path: Path, *, group_writable: bool = False) -> Path:
    """Create `path` (and missing parents) with mode 0700 and check it and its parents; UnsafeDirectory when a
    directory on the way is not ours."""
    path = make_dirs(Path(path).expanduser(), 0o700)  # one made in between by someone else is checked below
    check_dir(path, group_writable=group_writable)
    _check_ancestors(path)
    return path


def private_fallback(name: str) -> Path:
    """A place only we can use, for when the expected one is not safe: $XDG_RUNTIME_DIR (per user, made by the
    login manager) when set and sound, else a fresh directory with an unpredictable name in the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            check_dir(Path(xdg))
            return ensure_private_dir(Path(xdg) / "ondemand_prof" / name)
        except OSError as exc:
            log.warning("ondemand_prof: not using $XDG_RUNTIME_DIR: %s", exc)
    base = Path(tempfile.mkdtemp(prefix=f"ondemand_prof-{os.getuid()}-"))
    return ensure_private_dir(base / name)


def daemon_socket_problem(sock: Path) -> str | None:
    """Why a daemon socket should not be trusted (None: trust it). Ours or root's only, in a directory of ours or
    root's that nobody else can write: otherwise another user could have put a fake daemon there, to which our
    ranks would register (leaking job, pid and save root) and from which they would take windows."""
    uid = os.getuid()
    for path, what in ((sock.parent, "directory"), (sock, "socket")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return f"{path} does not exist"
        except OSError as exc:
            return f"cannot look at {path}: {exc.strerror}"
        if what == "directory" and not stat.S_ISDIR(st.st_mode):
            return f"the runtime directory {path} is not a directory (a symbolic link?)"
        if what == "socket" and not stat.S_ISSOCK(st.st_mode):
            return f"{path} is not a socket"
        if st.st_uid not in (uid, 0):
            return (f"the daemon's {what} {path} belongs to {_owner_name(st.st_uid)}, not to us (uid {uid}) or root: "
                    "refusing to trust it (another user may have started a fake daemon there)")
        if what == "directory" and st.st_mode & stat.S_IWOTH:
            return f"the runtime directory {path} is writable by others (mode {st.st_mode & 0o7777:o}): refusing to trust it"
    return None


# ----------------------------------------------------------------------------------------------------------
# The save path: traces may hold code, names and shapes; whoever controls a directory on the way to them can
# read them (a setgid directory hands its group every file made in it) or swap the directory under us


def save_path_problem(path: Path) -> str | None:
    """Why traces must not go under `path` (None: they may). `path` and every existing directory above it,
    before and after resolving symbolic links, must belong to us or root and be writable by nobody else, a
    root-owned sticky directory (/tmp) aside; a symbolic link on the way must be ours or root's."""
    uid = os.getuid()
    path = Path(path).expanduser().absolute()
    seen: set[Path] = set()
    for chain in (path, Path(os.path.realpath(path))):
        for p in (chain, *chain.parents):
            if p in seen:
                continue
            seen.add(p)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue  # made by us later (make_dirs), with our modes
            except OSError as exc:
                return f"cannot look at {p}: {exc.strerror}"
            if st.st_uid not in (uid, 0):
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "it"
                return (f"{p} belongs to {_owner_name(st.st_uid)}, not to us (uid {uid}) or root: {what} could be "
                        "swapped, or its group could read the traces")
            if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and not (
                    st.st_mode & stat.S_ISVTX and st.st_uid == 0):
                return f"{p} is writable by others (mode {st.st_mode & 0o7777:o})"
    return None


def make_dirs(path: Path, mode: int = 0o750) -> Path:
    """Create `path` and its missing parents with exactly `mode`, whatever the umask (mkdir's mode is masked by
    it: under umask 000 a save root came out 0777). Directories that exist are left as they are."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode & 0o700)  # owner-only until chmod: never, even briefly, open to others
        except FileExistsError:
            continue  # someone made it in between: left as it is, like any directory that exists
        os.chmod(d, mode)
    return path


def private_save_root(name: str = "profile") -> Path:
    """Where traces go when the configured save path is not safe: ~/.local/share/ondemand_prof/<name> (or under
    $XDG_DATA_HOME) when that is sound, else a fresh directory with an unpredictable name in the temp dir."""
    try:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ondemand_prof"
        ensure_private_dir(base)
        if save_path_problem(base) is None:
            return make_dirs(base / name, 0o700)
    except (OSError, RuntimeError, KeyError) as exc:  # RuntimeError: no home directory to be found
        log.info("ondemand_prof: no private save path under the data home: %s", exc)
    return Path(tempfile.mkdtemp(prefix=f"ondemand_prof-{os.getuid()}-{name}-"))


def safe_save_root(path: Path, dir_mode: int) -> tuple[Path, str | None]:
    """The directory traces go under: `path`, created now with `dir_mode` when missing (so nobody can create it
    first between this check and the first capture), or, when the way to it is not safe, a private fallback
    and the one line that says why."""
    path = Path(path).expanduser().absolute()
    problem = save_path_problem(path)
    if problem is None:
        try:
            make_dirs(path, dir_mode)
            problem = save_path_problem(path)  # someone may have made it first, between the check and mkdir
        except OSError as exc:
            problem = f"cannot create {path}: {exc.strerror}"
    if problem is None:
        return path, None
    fallback = private_save_root()
    return fallback, (f"ondemand_prof: not saving traces under {path}: {problem}; saving them under {fallback} "
                      "instead (owner-only)")
