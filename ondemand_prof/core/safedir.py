"""Directories we create are ours: made owner-only, and checked at every use.

Trigger, status, runtime and state directories often live at predictable paths under /tmp. Another local user
who creates one first (world-writable, or a symlink to a place they choose) could otherwise open windows in our
job, read our status files, redirect our writes, or serve our ranks a fake daemon. check_dir() refuses such a
directory with one line naming the path and why; ensure_private_dir() creates what is missing with mode 0700 and
checks the whole chain.

The chain is walked from `/`, one directory at a time, each opened relative to the one before without following
a link (openat with O_NOFOLLOW | O_DIRECTORY) and checked before anything is looked up or created in it: every
directory on the way must be ours or root's, and writable by nobody else, a root-owned sticky directory (/tmp)
aside; a root-owned directory that others (or its group) may write and that is not sticky lets them rename what
is in it, and is refused like any other (issue 34, F5). Only root's own symbolic links on the way are followed
(/var/run -> /run), read with readlink and walked the same way. checked_dir() hands the caller the descriptor of
the checked directory, so that what it reads or writes there (trigger and status files, the native-save module)
is opened relative to that descriptor, never by a path someone could swap after the check (read_at here,
core/files.py write_atomic_at).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from .processes import listener_of, pid_namespace_problem

log = logging.getLogger("ondemand_prof")


class UnsafeDirectory(OSError):
    """A directory another user could control; the message names the path and the reason."""


class MissingDirectory(UnsafeDirectory):
    """The directory (or one above it) does not exist, and was not to be created."""


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


def ancestor_problem(path: Path | str, st: os.stat_result) -> str | None:
    """Why a directory above one of ours makes ours unsafe (None: it does not): it belongs to someone but us or
    root, or it is writable by someone else and is not a root-owned sticky directory (/tmp): whoever may write it
    can rename what is in it, ours included, and put their own in its place."""
    uid = os.getuid()
    if st.st_uid not in (uid, 0):
        return (f"{path} belongs to {_owner_name(st.st_uid)}, not to us (uid {uid}) or root: its owner could swap "
                "what is below it; refusing to use it")
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        return (f"{path} is writable by {who} (mode {st.st_mode & 0o7777:o}){' and not sticky' if st.st_uid == 0 else ''}"
                f": {who} can rename what is in it and put their own in its place; refusing to use what is below it "
                "(chmod go-w or +t it, or choose another directory)")
    return None


def _leaf_problem(path: Path | str, st: os.stat_result, group_writable: bool, allow_root: bool) -> str | None:
    """check_dir's rules for the directory itself, on its stat."""
    uid = os.getuid()
    if st.st_uid != uid and not (allow_root and st.st_uid == 0):
        return (f"{path} belongs to {_owner_name(st.st_uid)}, not to us (uid {uid}); refusing to use it (another "
                "user may have created it first)")
    bad = stat.S_IWOTH | (0 if group_writable else stat.S_IWGRP)
    if st.st_mode & bad:
        return (f"{path} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} (mode "
                f"{st.st_mode & 0o7777:o}); refusing to use it (chmod go-w it, or remove it)")
    return None


_O_PATH = getattr(os, "O_PATH", 0)  # a descriptor that only names a directory: needs no read permission
_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # root's symbolic links followed on one walk (the kernel's own limit)


def open_dir(path: Path | str, *, create: bool = False, mode: int = 0o700, group_writable: bool = False,
             allow_root: bool = False, as_parent: bool = False) -> int:
    """A descriptor of directory `path`, reached from `/` without following any link but root's: each directory
    on the way opened relative to the one before (O_NOFOLLOW | O_DIRECTORY) and checked (ancestor_problem)
    before anything is looked up in it; `path` itself checked as check_dir checks it (with `as_parent`: as an
    ancestor, for a directory we only create in, such as /tmp). With `create`, what is missing is made there
    and then, relative to its checked parent, with exactly `mode`. UnsafeDirectory (an OSError) says why not;
    the caller closes the descriptor (checked_dir() does)."""
    shown = os.path.abspath(os.fspath(Path(path).expanduser()))  # for messages; the walk itself is physical
    todo = [n for n in Path(path).expanduser().absolute().parts[1:]]
    if not todo:
        raise UnsafeDirectory("/ is not a directory of ours")
    fd = os.open("/", (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = ancestor_problem("/", os.fstat(fd))
        if problem:
            raise UnsafeDirectory(problem)
        here, links = "/", 0
        while todo:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            last = not any(n not in ("", ".") for n in todo)
            where = os.path.join(here, name) if name != ".." else os.path.dirname(here.rstrip("/")) or "/"
            made = False
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise MissingDirectory(f"{where} does not exist") from None
                try:
                    os.mkdir(name, mode & 0o700, dir_fd=fd)  # owner-only until chmod: never, even briefly, open
                    made = True
                except FileExistsError:
                    pass  # someone made it in between: checked below like any directory that exists
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if last or st.st_uid != 0:
                    raise UnsafeDirectory(f"{where} is a symbolic link; refusing to use it (remove it, or choose "
                                          "another directory)")
                if _on_procfs(fd):  # /proc/PID/root, /proc/PID/cwd: what readlink says is not where they lead
                    raise UnsafeDirectory(f"{where} is a link of /proc (a process's root or directory), whose text "
                                          "is not where it leads: not followed (a container's /proc/PID/root/... "
                                          "path followed the container's absolute links from this host's root); "
                                          "reach a container's files from inside it (kubectl exec, nsenter -m)")
                links += 1
                if links > MAX_LINKS:
                    raise UnsafeDirectory(f"{shown}: too many symbolic links on the way")
                target = os.readlink(name, dir_fd=fd)  # root's link in a directory checked above: walked as well
                if target.startswith("/"):
                    os.close(fd)
                    fd = -1
                    fd = os.open("/", (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
                    here = "/"
                todo[:0] = target.split("/")
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeDirectory(f"{where} exists and is not a directory")
            try:
                nxt = os.open(name, (_O_PATH or os.O_RDONLY) | _DIR_FLAGS, dir_fd=fd)
            except (NotADirectoryError, OSError) as exc:
                if isinstance(exc, PermissionError):
                    raise
                # swapped for a link (ELOOP, ENOTDIR) between the look and the open
                raise UnsafeDirectory(f"{where} changed while being checked (a symbolic link now?); refusing "
                                      "to use it") from None
            os.close(fd)
            fd = nxt
            if made:
                _chmod_dir(fd, mode)
            st = os.fstat(fd)
            problem = _leaf_problem(where, st, group_writable, allow_root) if last and not as_parent else \
                ancestor_problem(where, st)
            if problem:
                raise UnsafeDirectory(problem)
            here = where
        try:  # the checked directory itself ("." of it), readable where we may read it (listing it)
            readable = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return fd
        os.close(fd)
        return readable
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _on_procfs(fd: int) -> bool:
    """Whether the directory `fd` is on /proc's filesystem (its links are the kernel's "magic" links)."""
    try:
        return os.fstat(fd).st_dev == os.stat("/proc").st_dev
    except OSError:
        return False


def _chmod_dir(fd: int, mode: int) -> None:
    """chmod a directory we just made, through its descriptor (an O_PATH one cannot be fchmod'ed: "." under it,
    opened without following a link, is the same directory)."""
    try:
        os.chmod(fd, mode)
    except OSError:
        rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            os.chmod(rfd, mode)
        finally:
            os.close(rfd)


@contextlib.contextmanager
def checked_dir(path: Path | str, **kw: bool | int) -> Iterator[int]:
    """open_dir() as a context: the checked directory's descriptor, closed at the end."""
    fd = open_dir(path, **kw)  # type: ignore[arg-type]
    try:
        yield fd
    finally:
        os.close(fd)


def read_at(dir_fd: int, name: str, limit: int) -> bytes | None:
    """Up to `limit` bytes of file `name` in the directory `dir_fd`, never through a symbolic link; None when it
    cannot be opened or is not a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def ensure_private_dir(path: Path, *, group_writable: bool = False) -> Path:
    """Create `path` (and missing parents) with mode 0700 and check it and every directory above it (open_dir:
    created relative to a checked parent, no link followed); UnsafeDirectory when a directory on the way is not
    ours or is one others could swap."""
    path = Path(path).expanduser()
    os.close(open_dir(path, create=True, mode=0o700, group_writable=group_writable))
    return path


def private_fallback(name: str) -> Path:
    """A place only we can use, for when the expected one is not safe: $XDG_RUNTIME_DIR (per user, made by the
    login manager) when set and sound, else a fresh directory with an unpredictable name in the first temp dir
    whose chain is sound ($TMPDIR, /tmp, /var/tmp, /dev/shm: a $TMPDIR others can swap is passed over)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            check_dir(Path(xdg))
            return ensure_private_dir(Path(xdg) / "ondemand_prof" / name)
        except OSError as exc:
            log.warning("ondemand_prof: not using $XDG_RUNTIME_DIR: %s", exc)
    problems = []
    for base in dict.fromkeys([tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"]):
        try:
            with checked_dir(base, as_parent=True):
                pass
            made = Path(tempfile.mkdtemp(prefix=f"ondemand_prof-{os.getuid()}-", dir=base))
            return ensure_private_dir(made / name)
        except OSError as exc:
            problems.append(str(exc))
    raise UnsafeDirectory("no temporary directory is safe for a private one: " + "; ".join(problems))


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
# The process behind the daemon's socket (issue 41, 2): a root pod with the runtime directory mounted read-write
# moved profd.sock aside and bound its own, root's and owned by root like the real one; the ranks on the node
# registered with it and root's ondemandctl printed its answers. The socket's owner cannot tell the two apart;
# the kernel's word on the process that listens can (SO_PEERCRED: its uid, and its pid in our pid namespace)

NOBODY_LISTENS = "nobody accepts connections there now"


def daemon_process_problem(uid: int, pid: int, sock: Path) -> str | None:
    """Why the process listening on the daemon's socket `sock` (the kernel's word: uid, and pid in our pid
    namespace) is not a daemon we trust: another user's, or in a container's pid namespace (a root pod that took
    a shared runtime directory over). Its pid is 0 where we are in a container and it is not: we cannot see
    it, and nothing more can be told (the pods mount the runtime directory read-only for that). None: trusted."""
    me = os.getuid()
    if uid not in (me, 0):
        return (f"the process behind {sock} (pid {pid}) runs as {_owner_name(uid)}, not as us (uid {me}) or root: "
                "refusing to trust it (another user may have started a fake daemon there)")
    where = pid_namespace_problem(pid) if pid > 0 else None
    if where:
        return (f"the process behind {sock} (pid {pid}, {_owner_name(uid)}) {where}, not this host's "
                "ondemand-profd: refusing to trust it (a container that can write the runtime directory may have "
                "put its own socket there: mount it read-only in pods; to use a daemon in a container, run "
                "ondemandctl in that container: kubectl exec, nsenter)")
    return None


def daemon_peer_problem(sock: Path, timeout: float = 0.0) -> str | None:
    """daemon_process_problem of whoever listens on `sock` now; a line ending in NOBODY_LISTENS when nothing
    accepts a connection (then nothing may be sent there either: whoever binds next is unchecked)."""
    who = listener_of(sock, timeout)
    if who is None:
        return f"{sock}: {NOBODY_LISTENS}"
    return daemon_process_problem(who[0], who[1], sock)


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
    it: under umask 000 a save root came out 0777). Directories that exist are left as they are. What is missing
    is made relative to its parent's descriptor and opened without following a link (mkdirat, then openat with
    O_NOFOLLOW | O_DIRECTORY), so a link swapped in on the way is refused (OSError), never created through; the
    part that exists is the caller's to have checked (save_path_problem: links of ours or root's are allowed)."""
    path = Path(path)
    missing: list[str] = []
    p = path.absolute()
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p.name)
        p = p.parent
    if not missing:
        return path
    fd = os.open(p, (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in reversed(missing):
            made = False
            try:
                os.mkdir(name, mode & 0o700, dir_fd=fd)  # owner-only until chmod: never, even briefly, open to others
                made = True
            except FileExistsError:
                pass  # someone made it in between: left as it is, like any directory that exists
            try:
                nxt = os.open(name, (_O_PATH or os.O_RDONLY) | _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if isinstance(exc, PermissionError):
                    raise
                raise UnsafeDirectory(f"{p / name} is a symbolic link or not a directory; refusing to create "
                                      "through it") from None
            os.close(fd)
            fd = nxt
            p = p / name
            if made:
                _chmod_dir(fd, mode)
    finally:
        os.close(fd)
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
