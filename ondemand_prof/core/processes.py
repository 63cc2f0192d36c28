"""Processes, as the kernel names them: a pid checked to run (not a zombie), how one that is gone ended, its
/proc stat fields, its identity (pid, start time, uid: a pid the kernel reuses is told apart) and signals sent to
that process and no other; which namespaces it shares with us (pid, mount) and where its files start
(/proc/PID/root); the process behind a unix socket (SO_PEERCRED, libzmq's Peer-Address). The one home of these
for every process (issue 41): policy on top of them (which daemon socket we trust) lives with that policy
(core/safedir.py)."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path


def proc_stat_fields(path: str) -> list[bytes]:
    """The fields of a /proc/<pid>[/task/<tid>]/stat file after the command name (which may hold spaces and
    parentheses), so [0] is the state (field 3 of proc(5)), [19] the start time (22), [36] the CPU it last ran on
    (39). OSError when it cannot be read; [] when it has no command name."""
    with open(path, "rb") as fh:
        _, paren, rest = fh.read().rpartition(b")")
    return rest.split() if paren else []


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
            return proc_stat_fields(f"/proc/{pid}/stat")[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return True  # no /proc here: trust kill()
    return True


def exit_status_text(pid: int) -> str:
    """How a process that is gone ended, as far as anyone but its parent can tell: while it is a zombie (its
    launcher has not reaped it yet) /proc/<pid>/stat's exit_code (field 52, waitpid's status) says "killed by
    SIGKILL" or "with status 1"; '' once it was reaped (or /proc cannot say)."""
    import signal

    try:
        fields = proc_stat_fields(f"/proc/{pid}/stat")
        if fields[0] != b"Z" or len(fields) < 50:
            return ""
        status = int(fields[49])
    except (OSError, ValueError, IndexError):
        return ""
    if status & 0x7F:
        try:
            name = signal.Signals(status & 0x7F).name
        except ValueError:
            name = f"signal {status & 0x7F}"
        return f"killed by {name}" + (" (core dumped)" if status & 0x80 else "")
    return f"with status {(status >> 8) & 0xFF}"


# ----------------------------------------------------------------------------------------------------------
# A pid is a number the kernel reuses; (pid, start time, uid) names one process


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22): differs for every process that had this pid
    uid: int


def process_identity(pid: int) -> ProcessIdentity | None:
    """Who holds `pid` now; None when nobody does (or /proc cannot say)."""
    try:
        fields = proc_stat_fields(f"/proc/{pid}/stat")
        uid = os.stat(f"/proc/{pid}").st_uid
        return ProcessIdentity(pid, int(fields[19]), uid)
    except (OSError, IndexError, ValueError):
        return None


def same_process(ident: ProcessIdentity | None) -> bool:
    """Whether the process `ident` named is still the one holding its pid (not exited, not a zombie)."""
    if ident is None:
        return False
    return process_identity(ident.pid) == ident and pid_alive(ident.pid, thorough=True)


def signal_process(ident: ProcessIdentity, signum: int) -> str | None:
    """Send `signum` to the process `ident` names, and to no other: a pidfd is taken first, then the holder of
    the pid is checked against `ident` (start time and uid); a process that exits after that leaves the pidfd
    pointing at it, so a reused pid is never signalled. None when sent, else why not."""
    import signal as _signal

    try:
        pidfd = os.pidfd_open(ident.pid)
    except ProcessLookupError:
        return f"process {ident.pid} is gone"
    except (AttributeError, OSError):
        pidfd = None  # no pidfd (kernel before 5.3): the check below and kill() leave a window of microseconds
    try:
        if process_identity(ident.pid) != ident:
            return f"pid {ident.pid} is no longer the process that registered (it exited; the pid was reused)"
        if pidfd is not None:
            _signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(ident.pid, signum)
        return None
    except ProcessLookupError:
        return f"process {ident.pid} is gone"
    except OSError as exc:
        return f"cannot signal process {ident.pid}: {exc.strerror}"
    finally:
        if pidfd is not None:
            os.close(pidfd)


# ----------------------------------------------------------------------------------------------------------
# Namespaces: whether a process sees what we see (a rank or a daemon in a container does not)


def same_namespace(pid: int, kind: str) -> bool:
    """Whether process `pid` is in this process's namespace of `kind` ("pid", "mnt"); False where /proc cannot
    say (a process we may not look at is taken to be elsewhere: nothing is granted on a guess)."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/ns/{kind}"), os.stat(f"/proc/self/ns/{kind}")
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def own_mount_namespace(pid: int) -> bool:
    """Whether process `pid` sees the files this daemon sees (the same mount namespace). False where /proc
    cannot say: its files are then read through its root (/proc/PID/root), which is right either way, rather
    than on this host's `/` (a pod naming a node file as its own)."""
    return same_namespace(pid, "mnt")


def in_our_namespaces(pid: int) -> bool:
    """Whether process `pid` shares this daemon's pid and mount namespaces: the only processes whose uid 0 is
    this host's root for the daemon's ownership rules (a root pod is root of its pod, not of the node)."""
    return same_namespace(pid, "pid") and same_namespace(pid, "mnt")


def root_of(pid: int) -> str:
    """Where a path of process `pid` starts, for a reader here: its root through its own mounts."""
    return f"/proc/{pid}/root"


def _nspid_depth(pid: int | str) -> int | None:
    """How many pid namespaces, from /proc's down, number process `pid` (its NSpid line: everyone may read it)."""
    try:  # (bytes: no codec to look up, in a process that may no longer reach the standard library's)
        with open(f"/proc/{pid}/status", "rb") as fh:
            line = next((x for x in fh if x.startswith(b"NSpid:")), b"")
    except OSError:
        return None
    return len(line.split()) - 1 or None


def pid_namespace_problem(pid: int) -> str | None:
    """Why process `pid` (seen in our pid namespace) is not in our pid namespace itself but below it, in a
    container's; None when it is ours, or /proc cannot say (not mounted, hidepid: the socket's owner and
    directory were checked, as before)."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/ns/pid"), os.stat("/proc/self/ns/pid")
        same = (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
    except PermissionError:  # another user's process (root's daemon): its NSpid line is everyone's to read
        depth, own = _nspid_depth(pid), _nspid_depth("self")
        same = depth is None or own is None or depth == own
    except OSError:
        return None
    return None if same else "runs in a pid namespace below ours (a container's)"


# ----------------------------------------------------------------------------------------------------------
# The process behind a unix socket: the kernel's word (SO_PEERCRED), not the socket file's owner


def listener_of(sock: Path, timeout: float = 0.0) -> tuple[int, int] | None:
    """(uid, pid) of the process listening on the unix socket `sock`, as the kernel recorded it at listen(): a
    connection is opened, its SO_PEERCRED read, and it is closed at once (nothing is sent). None when nothing
    accepts it within `timeout` seconds (0: not at all now): no daemon, or its backlog full."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        if timeout > 0:  # a unix connect waits in a full backlog for up to the send timeout (Python's own
            # timeout makes the socket non-blocking, and a unix connect then fails at once with EAGAIN)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                         struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
        else:
            s.setblocking(False)
        s.connect(str(sock))
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        return uid, pid
    except OSError:  # (refused, missing, EAGAIN, timed out, a path too long for a socket)
        return None
    finally:
        s.close()


def peer_address_ids(text: object) -> tuple[int, int] | None:
    """(uid, pid) from libzmq's "Peer-Address" of a message over ipc:// ("host:uid:gid:pid", SO_PEERCRED of
    its connection); None when it is not of that form."""
    parts = str(text or "").rsplit(":", 3)
    try:
        return (int(parts[1]), int(parts[3])) if len(parts) == 4 else None
    except ValueError:
        return None
