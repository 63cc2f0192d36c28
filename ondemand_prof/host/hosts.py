"""Host lists as users have them: `node01,node02`, `node01:7355`, bracket ranges (`node[01-64]`,
`gpu[1-3,7]`, `a[1-2],b[01-03,7]`, `rack[1-2]-n[1-4]`), a host file, and a SLURM job's nodelist, expanded as
`scontrol show hostnames` does (zero padding follows the lower bound). Pure apart from `slurm_nodelist`."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..core.netaddr import port_number, split_host_port
from ..core.protocol import TCP_PORT as DEFAULT_PORT

MAX_HOSTS = 100_000  # a mistyped range must not expand into millions of names
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostSpecError(ValueError):
    """A host list that cannot be read; the text says which part and why."""


@dataclass(frozen=True)
class Target:
    """One daemon to reach: its name as the user wrote it (without the default port), host and port."""

    name: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def is_loopback(host: str) -> bool:
    """Whether a host as given names this host only (a name or an interface: treated as reaching beyond it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostSpecError(f"{text!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostSpecError(f"{text!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise HostSpecError(f"{whole!r}: [{body}]: expected numbers and ranges like 01-64 or 1-3,7")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise HostSpecError(f"{whole!r}: range {item} runs backwards")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise HostSpecError(f"{whole!r}: more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand(expr: str) -> list[str]:
    """One host expression (no top-level commas) -> host names; every bracket group multiplies."""
    m = re.search(r"\[([^\[\]]*)\]", expr)
    if m is None:
        if "[" in expr or "]" in expr:
            raise HostSpecError(f"{expr!r}: unbalanced brackets")
        return [expr]
    head, tail = expr[:m.start()], expr[m.end():]
    names: list[str] = []
    for value in _range(m.group(1), expr):
        names.extend(expand(head + value + tail))
        if len(names) > MAX_HOSTS:
            raise HostSpecError(f"{expr!r}: more than {MAX_HOSTS} hosts")
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """A SLURM nodelist (`a[1-2],b[01-03,7]`) -> host names, as `scontrol show hostnames` prints them."""
    names: list[str] = []
    for part in split_top(nodelist):
        names.extend(expand(part))
    for name in names:
        if not _NAME.match(name):
            raise HostSpecError(f"{name!r} is not a host name")
    return names


def _target(text: str, default_port: int) -> list[Target]:
    """One comma-free item, maybe with :PORT, maybe an IPv6 literal in brackets."""
    if text.startswith("[") and ":" in text.split("]", 1)[0]:  # [::1]:7355 or [fe80::1]
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise HostSpecError(f"{text!r}: expected [IPv6]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise HostSpecError(f"{text!r}: {host!r} is not an IPv6 address") from None
        return [Target(text, host, _port(port, text, default_port))]
    base, split = split_host_port(text, brackets=True)  # node[01-04]:7355: a ':' after the last ']'
    port = split or ""
    p = _port(port, text, default_port)
    out = []
    for host in expand(base):
        if not _NAME.match(host):
            raise HostSpecError(f"{host!r} (from {text!r}) is not a host name")
        out.append(Target(host if not port else f"{host}:{p}", host, p))
    return out


def _port(text: str, whole: str, default_port: int) -> int:
    if not text:
        return default_port
    number = port_number(text, lowest=1)
    if number is None:
        raise HostSpecError(f"{whole!r}: port {text!r} is not a number from 1 to 65535")
    return number


def parse_hosts(spec: str, default_port: int = DEFAULT_PORT) -> list[Target]:
    """`--hosts` text -> targets, in order, duplicates dropped."""
    targets: list[Target] = []
    for item in split_top(spec):
        targets.extend(_target(item, default_port))
    return dedupe(targets)


def dedupe(targets: list[Target]) -> list[Target]:
    seen: set[tuple[str, int]] = set()
    out = []
    for t in targets:
        if (t.host, t.port) not in seen:
            seen.add((t.host, t.port))
            out.append(t)
    if len(out) > MAX_HOSTS:
        raise HostSpecError(f"{len(out)} hosts; at most {MAX_HOSTS}")
    return out


def read_hostfile(path: Path, default_port: int = DEFAULT_PORT) -> list[Target]:
    """One host expression per line (or several, comma-separated); '#' starts a comment; MPI-style
    `host slots=8` lines are read as their first word."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostSpecError(f"--hostfile {path}: {exc.strerror}") from None
    targets: list[Target] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            targets.extend(parse_hosts(line.split()[0], default_port))
        except HostSpecError as exc:
            raise HostSpecError(f"--hostfile {path} line {n}: {exc}") from None
    if not targets:
        raise HostSpecError(f"--hostfile {path}: no hosts in it")
    return dedupe(targets)


Runner = Callable[[list[str]], str]


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def slurm_nodelist(job_id: str, environ: Mapping[str, str] | None = None, run: Runner = _run,
                   which: Callable[[str], str | None] = shutil.which) -> str:
    """The compressed nodelist of SLURM job `job_id`: from the environment inside that job, else squeue,
    else scontrol show job."""
    environ = os.environ if environ is None else environ
    if not job_id.replace("_", "").isdigit():
        raise HostSpecError(f"--slurm {job_id!r}: expected a job id like 12345")
    if environ.get("SLURM_JOB_ID") == job_id:
        nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if nodes:
            return nodes
    try:
        if which("squeue"):
            nodes = run(["squeue", "-h", "-j", job_id, "-o", "%N"]).strip()
        elif which("scontrol"):
            found = re.search(r"(?<![A-Za-z])NodeList=(\S+)", run(["scontrol", "show", "job", job_id]))
            nodes = found.group(1) if found else ""
        else:
            raise HostSpecError(f"--slurm {job_id}: not inside that job (SLURM_JOB_ID is "
                                f"{environ.get('SLURM_JOB_ID') or 'unset'}) and neither squeue nor scontrol is "
                                "installed here; use --hosts or --hostfile")
    except (OSError, subprocess.SubprocessError) as exc:
        raise HostSpecError(f"--slurm {job_id}: cannot ask SLURM: {exc}") from None
    if not nodes or nodes in ("(null)", "None"):
        raise HostSpecError(f"--slurm {job_id}: SLURM lists no nodes for it (pending, or finished?)")
    return nodes


def slurm_hosts(job_id: str, default_port: int = DEFAULT_PORT, **kw: object) -> list[Target]:
    names = expand_nodelist(slurm_nodelist(job_id, **kw))  # type: ignore[arg-type]
    return dedupe([Target(n, n, default_port) for n in names])
