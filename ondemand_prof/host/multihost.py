"""ondemandctl across hosts (`--hosts`, `--hostfile`, `--slurm`): the flags that name the hosts, and the
fan-out's rounds that the commands' `run_on` share: every host's daemon asked in parallel over
authenticated TCP (host/fanout.py), the hosts that did not answer explained (host/diagnose.py), a capture
planned (host/planning.py, pure) and sent, and the hosts given up on sent a cancel.

A capture across hosts is aligned by steps, not clocks: every daemon is first asked for its ranks' current
steps and step times (status), one absolute window is planned from those, and the same window and one
capture id go to every host. Each host's answer is anchored at the time it arrived, so a dead or slow host
delays nobody else's window. A host that does not answer is named and the others proceed; while a capture is
followed (host/commands/follow.py), a silent host is asked again until --timeout (a partition heals, a
daemon restarts), then reported `unreachable` (apart from `failed`: it answered, and its ranks failed) and
sent a cancel. A daemon that gets the window after its start has passed refuses it (host/alignment.py), so no
host records other steps than the rest; a record whose ranks did record different steps anyway is
`misaligned` (exit 6).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..core.protocol import TCP_PORT as DEFAULT_PORT
from .client import EXIT_USAGE, CtlError
from .planning import plan_capture
from .merge import Launched, unanswered
from ..core.ids import capture_id as make_capture_id

if TYPE_CHECKING:  # the fan-out, key and host-list modules load only when a command goes across hosts
    from .client import OneHost, Reply
    from .fanout import Fanout
    from .hosts import Target

REFRESH_AFTER_S = 0.5  # a status round slower than this (hosts that did not answer) is asked again of the others
CANCEL_WAIT_S = 0.5  # how long a cancel to a host we gave up on waits for its answer (it is best effort)


# ----------------------------------------------------------------------------------------------------------
# Flags and targets

def add_global_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("many hosts (each host's ondemand-profd started with --listen)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="LIST", help="hosts: node01,node02:7400, node[01-64], gpu[1-3,7]")
    where.add_argument("--hostfile", type=Path, metavar="FILE", help="hosts, one expression per line")
    where.add_argument("--slurm", metavar="JOBID", help="the hosts of this SLURM job")
    g.add_argument("--keys", type=Path, metavar="DIR", help="CurveZMQ keys (ondemandctl keygen DIR); needed "
                   "unless every daemon listens on loopback without keys")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the daemons' TCP port (default {DEFAULT_PORT})")


def targets_from(args: argparse.Namespace) -> list[Target] | None:
    """The hosts the global flags name, or None for this host's daemon over its unix socket."""
    if args.hosts is None and args.hostfile is None and args.slurm is None:
        if args.keys is not None:
            raise CtlError("--keys is for --hosts, --hostfile or --slurm", EXIT_USAGE)
        return None
    if not 0 < args.port < 65536:
        raise CtlError(f"--port {args.port}: expected 1-65535", EXIT_USAGE)
    from .hosts import HostSpecError, parse_hosts, read_hostfile, slurm_hosts

    try:
        if args.hosts is not None:
            targets = parse_hosts(args.hosts, args.port)
        elif args.hostfile is not None:
            targets = read_hostfile(args.hostfile, args.port)
        else:
            targets = slurm_hosts(args.slurm, args.port)
    except HostSpecError as exc:
        raise CtlError(str(exc), EXIT_USAGE) from None
    if not targets:
        raise CtlError("no hosts given", EXIT_USAGE)
    return targets


# ----------------------------------------------------------------------------------------------------------
# Rounds

def ask(fan: Fanout | OneHost, msg_type: str, fields: dict[str, Any] | None = None, **kw: Any) -> dict[str, Reply]:
    """fan.request, and then, for every host that did not answer, why (host/diagnose.py). `fan` may be this
    host's daemon alone (client.OneHost: its silence and errors raise CtlError)."""
    replies = fan.request(msg_type, fields, **kw)
    if not fan.local and any(r.kind == "timeout" for r in replies.values()):  # (a OneHost never times out: it raises)
        explain(cast("Fanout", fan), replies)
    return replies


def explain(fan: Fanout, replies: dict[str, Reply]) -> None:
    """Replace "did not answer" by what is known about the hosts that did not: a name that does not resolve,
    a daemon that requires keys we did not pass, nothing listening, no route, a daemon that does not respond."""
    from .diagnose import explain as probe_all

    by_name = {t.name: t for t in fan.targets}
    silent = [by_name[n] for n, r in replies.items() if r.kind == "timeout"]
    for name, (kind, message) in probe_all(silent, fan.keyed).items():
        replies[name].kind, replies[name].error = kind, message


def launch(fan: Fanout, request: dict[str, Any], job: str | None, slurm: str | None = None,
           baseline: bool = False) -> Launched:
    """Ask every daemon for its ranks' steps, plan one window, send it with one capture id to every host
    (`baseline`: each host marks it as the job's baseline, ondemandctl capture --baseline)."""
    t0 = time.monotonic()
    statuses = fresh_statuses(fan)
    plan = plan_capture(statuses, request, job, slurm)
    capture_id = make_capture_id(wall=time.time())
    # across_hosts: a daemon that gets this after its start has passed on its ranks refuses it (alignment.py)
    replies = fan.request("capture", {"job": plan.job, "capture_id": capture_id, "across_hosts": True,
                                      **({"baseline": True} if baseline else {})},
                          per_host=plan.per_host(), hosts=list(plan.targets))
    sent_s = time.monotonic() - t0
    found = {n: r.data for n, r in replies.items() if r.ok}
    failed = {n: r.error for n, r in replies.items() if r.kind == "error"}
    quiet = unanswered(replies)
    explain(fan, statuses)
    if not found and not quiet:
        raise CtlError("no host accepted the capture: " + "; ".join(f"{n}: {e}" for n, e in failed.items()))
    return Launched(capture_id, plan.job, plan.targets, plan.plan, found, failed, sent_s, quiet,
                    unanswered(statuses), plan.missing)


def fresh_statuses(fan: Fanout) -> dict[str, Reply]:
    """Every host's status, for planning. When the round waited long for hosts that did not answer, those
    that did are asked once more (milliseconds), so that the plan extrapolates each rank over milliseconds
    rather than over a dead host's whole timeout (with a step rate that may have changed meanwhile); a host
    that answered only the first time keeps its first answer, anchored at its own receipt time."""
    t0 = time.monotonic()
    statuses = fan.request("status")  # the hosts that did not answer are explained after the capture is sent
    answered = [n for n, r in statuses.items() if r.ok]
    if answered and len(answered) < len(statuses) and time.monotonic() - t0 > REFRESH_AFTER_S:
        statuses.update({n: r for n, r in fan.request("status", hosts=answered).items() if r.ok})
    return statuses


def give_up(fan: Fanout, capture_id: str, quiet: dict[str, str], found: dict[str, dict[str, Any]]) -> None:
    """The hosts still silent when we stop asking. Those that never confirmed the capture are sent a cancel
    (best effort: it follows the capture on the same connection, so a daemon that comes back finds both; if
    it never gets there, the daemon refuses the window anyway once its start has passed, host/alignment.py).
    Those that had confirmed it are left alone: their ranks took the window in time and record the planned
    steps. Then each is said why it is silent (host/diagnose.py)."""
    unconfirmed = [n for n in quiet if n not in found]
    if unconfirmed:
        fan.request("cancel", {"capture_id": capture_id}, hosts=unconfirmed, wait_s=CANCEL_WAIT_S)
    from .diagnose import explain as probe_all

    by_name = {t.name: t for t in fan.targets}
    verdicts = probe_all([by_name[n] for n in quiet], fan.keyed)
    for name in quiet:
        why = verdicts.get(name, ("", quiet[name]))[1]
        quiet[name] = why + ("; gave up on it (a cancel was sent)" if name not in found else
                             f"; gave up waiting (its ranks had the window: ondemandctl show {capture_id} tells what "
                             "they did)")
