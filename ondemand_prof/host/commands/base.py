"""What an ondemandctl command is: one class holding both ends (the shape of circus's commands), registered
once (host/commands/__init__.py). Its name and help (the docstrings are the help), its flags, the message it
sends and the fields that message has (`fields`, checked by the transport), what the daemon executes for it
(`execute`, run by host/service.py), how it runs against the daemons (`run_on`, written once: every host's
over host/fanout.py, or this host's alone as a fan-out of one, client.OneHost), and how the console shows the
reply (`console`).
Below it, the console's small shared pieces."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TextIO

from ..client import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, Client, CtlError, OneHost, Reply, dumps
from ..merge import exit_across, failures, no_capture, nothing_found, one_capture
from ..multihost import ask
from ..service import BadRequest, Service

if TYPE_CHECKING:
    from ..fanout import Fanout

Fields = dict[str, tuple[type, ...]]


class Command:
    name = ""
    help = ""
    needs_daemon = True  # False: runs without this host's daemon (report reads files, keygen writes keys)
    cli = True  # False: a message only ondemandctl's other commands send (watch, summaries)
    takes_hosts = True  # --hosts, --hostfile and --slurm apply (keygen: no)
    fields: Fields = {}  # required message fields and their types (the transport checks them)

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        """The daemon's side: the reply's data, or None when the reply comes later. BadRequest for bad input."""
        raise BadRequest(f"{self.name} is not a daemon command")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        """The request's fields from the flags; CtlError (exit 2) for a bad flag value."""
        return {}

    across = True  # False: this host's daemon only (the triage commands act on this host's processes)
    absent: Callable[[Reply], bool] = staticmethod(lambda reply: False)  # across hosts, an error meaning "nothing
    # here" rather than a failure (status: no live job on that host)

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        """Against this host's daemon: a fan-out of one (client.OneHost), so that each command is written once,
        in run_on. (Commands that need no daemon, report and keygen and trigger, replace this; client is None.)"""
        return self.run_on(OneHost(client), args, out)

    def run_on(self, fan: Fanout | OneHost, args: argparse.Namespace, out: TextIO) -> int:
        """Against the daemons of `fan`: every host's at once (host/fanout.py), or this host's alone. The request
        on each; one host's reply printed as it is, several hosts' each under an `== host` header, and the hosts
        that failed named on stderr."""
        if not self.across and not fan.local:
            raise CtlError(f"{self.name} does not work across hosts; run it on the host", EXIT_USAGE)
        from ..multihost import ask

        replies = ask(fan, self.name, self.message(args), wait_s=self.wait_s(args, fan.timeout_s))
        if fan.local:
            return self.print_alone(replies, args, out)
        failed = failures(replies, self.absent)
        if args.json:
            out.write(dumps({"hosts": {n: r.as_dict() for n, r in replies.items()}}) + "\n")
        else:
            for name, reply in replies.items():
                if reply.ok:
                    out.write(f"== {name}\n" + self.console(reply.data, args))
            warn(failed, sys.stderr)
        return exit_across(failed, replies)

    def print_alone(self, replies: dict[str, Reply], args: argparse.Namespace, out: TextIO) -> int:
        """This host's daemon's reply, printed as one host's commands always printed it (no host header)."""
        data = alone(replies)
        out.write(dumps(data) + "\n" if args.json else self.console(data, args))
        return self.exit_code(data)

    def wait_s(self, args: argparse.Namespace, timeout_s: float) -> float | None:
        """How long a host has to answer (None: the connection's timeout, --connect-timeout)."""
        return None

    def console(self, data: Any, args: argparse.Namespace) -> str:
        return dumps(data) + "\n"

    def exit_code(self, data: Any) -> int:
        return EXIT_OK


def add_job_flag(parser: argparse.ArgumentParser, only: bool = False) -> None:
    """--job: a job id or any unique part of it (the first characters of torchrun's UUID do); a filter
    (`only`), or the job a command acts on when several are live."""
    parser.add_argument("--job", help="only this job" if only else "the job (needed when several are live)")


def opt_str(msg: dict[str, Any], key: str) -> str | None:
    """An optional string field of a request; BadRequest when it is there and not a string."""
    value = msg.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"field {key!r} must be a string")
    return value


# ----------------------------------------------------------------------------------------------------------
# The console's pieces

def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines) + "\n"


def ms(seconds: float | None) -> str:
    return "-" if not seconds else f"{seconds * 1000:.1f} ms"


def window_text(w: Sequence[int | None] | None) -> str:
    return "-" if not w else f"[{w[0]}, {w[1]})"


def who(part: Mapping[str, Any], daemon: str | None = None) -> str:
    """The start of a line about one rank's part: its rank, and across hosts the daemon that has it."""
    return f"  rank {part['rank']:<4} " + (f"{daemon:<16} " if daemon is not None else "")


def alone(replies: dict[str, Reply]) -> Any:
    """The data of the one reply a fan-out of one (client.OneHost) gets: this host's daemon's, taken as it is (no
    host column, no merge; its errors and silence raised CtlError already)."""
    return next(iter(replies.values())).data


def warn(failed: dict[str, str], out: TextIO) -> None:
    """Across hosts: the hosts that did not answer, or refused, one line each."""
    for name, error in failed.items():
        out.write(f"host {name}: {error}\n")


def nothing_found_here(replies: dict[str, Reply]) -> CtlError:
    """Across hosts, no host could act on a capture (merge.nothing_found), once the hosts that did not
    answer are named: the capture may be there."""
    warn({n: r.error for n, r in replies.items() if r.kind != "error"}, sys.stderr)
    return nothing_found(replies)


def capture_replies(fan: Fanout | OneHost, msg_type: str, fields: dict[str, Any],
                    **kw: Any) -> tuple[dict[str, Reply], dict[str, str]]:
    """Ask every daemon about one capture: the replies of the hosts that have it (one capture, however partial
    its id), and the hosts that failed, which the caller warns of once it has printed (CtlError: none has it)."""
    replies = ask(fan, msg_type, fields, **kw)
    found = one_capture(replies)
    if not found:
        raise nothing_found_here(replies)
    return found, failures(replies, no_capture)


def warned_exit(failed: dict[str, str], succeeded: bool) -> int:
    """After a report or comparison printed: the failed hosts said on stderr; partial when there are some, else
    whether anything was reported."""
    warn(failed, sys.stderr)
    if failed:
        return EXIT_PARTIAL
    return EXIT_OK if succeeded else EXIT_FAILED
