"""Paths of a rank that lives in a container, as this host sees them.

A rank in a pod names its files as its own mount namespace has them: `/workspace/profile/...` may be a hostPath
volume (on this host at `/data/odp/profile/...`), a volume the kubelet mounted (`/var/lib/kubelet/pods/...`), or
the container's own writable layer. The daemon reads such a rank's files through `/proc/PID/root` (the root of
that process, through its mounts), and tells users where a trace is on this host: the mount of the pod that
holds the path, found again among this host's own mounts (the same filesystem, the same directory in it), and
checked to be the very file the rank wrote (device and inode). Where no mount of this host shows it, the path
is the pod's alone, and is said so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from ..core.processes import root_of
from ..core.rootpath import stat_in_root


@dataclass(frozen=True)
class Mount:
    dev: str  # major:minor of the filesystem
    root: str  # the directory of that filesystem mounted here
    point: str  # where it is mounted


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\040, \\011, \\012, \\134."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts(path: str) -> list[Mount]:
    """The mounts a mountinfo file lists (`/proc/self/mountinfo`, `/proc/PID/mountinfo`); [] when unreadable."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            lines = fh.read(4 << 20).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) >= 5:
            out.append(Mount(fields[2], _unescape(fields[3]), _unescape(fields[4])))
    return out


def _under(path: str, top: str) -> bool:
    top = top.rstrip("/")
    return path == top or path.startswith(top + "/") or top == ""


def host_path(pid: int, path: str, here: Iterable[Mount] | None = None) -> str | None:
    """`path`, as process `pid` names it, as this host names the same file: None where no mount of this host
    holds it (the container's own layer, a tmpfs of the pod), or it cannot be checked to be the same file."""
    if not path.startswith("/") or "\0" in path:
        return None
    theirs = mounts(f"/proc/{pid}/mountinfo")
    holding = [m for m in theirs if _under(path, m.point)]
    if not holding:
        return None
    mount = holding[-1]  # of several at one point, the last mounted is the one seen (and the longest point wins)
    for m in holding:
        if len(m.point.rstrip("/")) > len(mount.point.rstrip("/")):
            mount = m
    inner = mount.root.rstrip("/") + path[len(mount.point.rstrip("/")):]  # the path within that filesystem
    best: Mount | None = None
    for m in here if here is not None else mounts("/proc/self/mountinfo"):
        if m.dev == mount.dev and _under(inner, m.root) and (best is None or len(m.root) > len(best.root)):
            best = m
    if best is None:
        return None
    candidate = best.point.rstrip("/") + inner[len(best.root.rstrip("/")):]
    try:
        # the pod's path resolved within its root (its absolute links are the pod's, never this host's: issue 41,
        # 8), this host's without following any link (one the pod put in a shared volume could lead anywhere)
        a, b = stat_in_root("/", candidate, links=False), stat_in_root(root_of(pid), path)
    except OSError:
        return None
    return candidate if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) else None
