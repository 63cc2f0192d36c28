"""What an ondemandctl command is: one class holding both ends (the shape of circus's commands), registered
once (host/commands/__init__.py). Its name and help (the docstrings are the help), its flags, the message it
sends and the fields that message has (`fields`, checked by the transport), what the daemon executes for it
(`execute`, run by host/service.py), how it runs against this host's daemon (`run`, over host/client.py)
and across hosts (`run_across`, over host/fanout.py), and how the console shows the reply (`console`).
Below it, the console's small shared pieces."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from ..client import EXIT_OK, EXIT_USAGE, Client, CtlError, Reply, dumps
from ..planning import nothing_found
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

    def run(self, client: Client, args: argparse.Namespace, out: TextIO) -> int:
        """Against this host's daemon (client is None when needs_daemon is False)."""
        data = client.request(self.name, **self.message(args))
        out.write(dumps(data) + "\n" if args.json else self.console(data, args))
        return self.exit_code(data)

    def run_across(self, fan: Fanout, args: argparse.Namespace, out: TextIO) -> int:
        """Against every host's daemon at once (`fan`: host/fanout.py)."""
        raise CtlError(f"{self.name} does not work across hosts; run it on the host", EXIT_USAGE)

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


def window_text(w: list[int] | None) -> str:
    return "-" if not w else f"[{w[0]}, {w[1]})"


def who(part: dict[str, Any], daemon: str | None = None) -> str:
    """The start of a line about one rank's part: its rank, and across hosts the daemon that has it."""
    return f"  rank {part['rank']:<4} " + (f"{daemon:<16} " if daemon is not None else "")


def warn(failed: dict[str, str], out: TextIO) -> None:
    """Across hosts: the hosts that did not answer, or refused, one line each."""
    for name, error in failed.items():
        out.write(f"host {name}: {error}\n")


def nothing_found_here(replies: dict[str, Reply]) -> CtlError:
    """Across hosts, no host could act on a capture (planning.nothing_found), once the hosts that did not
    answer are named: the capture may be there."""
    warn({n: r.error for n, r in replies.items() if r.kind != "error"}, sys.stderr)
    return nothing_found(replies)
