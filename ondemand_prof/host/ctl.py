"""ondemandctl: talk to the host daemon (ondemand-profd) from a shell."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..core.version import __version__
from ..core.protocol import RUNTIME_ENV, default_runtime_dir
from ..core.text import printable_streams
from .client import EXIT_FAILED, EXIT_USAGE, Client, CtlError
from .commands import CLI_COMMANDS
from .multihost import add_global_flags, targets_from


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ondemandctl", description="Profile a running training job on demand.")
    parser.add_argument("--version", action="version", version=f"ondemandctl {__version__}")
    add_global_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in CLI_COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if cmd.needs_daemon:
            p.add_argument("--runtime-dir", type=Path, default=None,
                           help=f"the daemon's runtime directory (env {RUNTIME_ENV}; default {default_runtime_dir()})")
            p.add_argument("--connect-timeout", type=float, default=5.0,
                           help="seconds to wait for the daemon's answer (default 5)")
        p.set_defaults(cmd=cmd, subparser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """ondemandctl: what it prints passes through printable_streams (names, errors and paths come from ranks)."""
    with printable_streams():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # the command's own usage, not the top-level one, says what it takes
        args.subparser.error(f"unrecognized arguments: {' '.join(extra)}")
    cmd = args.cmd
    try:
        targets = targets_from(args) if cmd.takes_hosts else None
        if targets is not None:  # across hosts: every host's daemon over TCP, in parallel, one fan-out kept
            from .fanout import Fanout  # (loaded only across hosts)

            with Fanout(targets, args.keys, getattr(args, "connect_timeout", 5.0)) as fan:
                return cmd.run_on(fan, args, sys.stdout)
        if not cmd.needs_daemon:
            return cmd.run(None, args, sys.stdout)
        with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as client:
            return cmd.run(client, args, sys.stdout)  # (Command.run: this daemon as a fan-out of one)
    except CtlError as exc:
        sys.stderr.write(f"ondemandctl {cmd.name}: error: {exc}\n")
        return exc.code
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:  # a reply we could not print
        sys.stderr.write(f"ondemandctl {cmd.name}: error: the daemon's reply is malformed "
                         f"({type(exc).__name__}: {str(exc)[:200]})\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def run_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run_main()


__all__ = ["main", "EXIT_USAGE"]
