"""ondemandctl keygen: the CurveZMQ keys for TCP across hosts (host/keys.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from ..client import EXIT_OK, CtlError, dumps
from .base import Command


class Keygen(Command):
    name = "keygen"
    help = "create CurveZMQ keys for TCP across hosts: the daemons' pair, a client pair, its authorisation"
    needs_daemon = False
    takes_hosts = False

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", type=Path, help="the key directory (created 0700, files 0600)")
        parser.add_argument("--client-only", action="store_true", help="only a client key pair (a user's own "
                            "keys: copy its client.key into the daemons' authorized/ directory, and the daemons' "
                            "server.key into DIR)")

    def run(self, client: Any, args: argparse.Namespace, out: TextIO) -> int:
        from ..keys import KeyFileError, keygen

        try:
            created = keygen(args.dir, args.client_only)
        except KeyFileError as exc:
            raise CtlError(f"keygen {args.dir}: {exc}") from None
        except OSError as exc:
            raise CtlError(f"keygen {args.dir}: {exc}") from None
        if args.json:
            out.write(dumps({"dir": str(args.dir), "created": [str(p) for p in created]}) + "\n")
        elif not created:
            out.write(f"{args.dir}: every key exists already; nothing changed\n")
        else:
            out.write("".join(f"created {p}\n" for p in created))
            if args.client_only:
                out.write(f"to be let in: add {args.dir}/client.key to each daemon's authorized/ directory (under a "
                          f"name of yours), and copy the daemons' server.key into {args.dir}\n")
            else:
                out.write(f"on every host: server.key, server.key_secret and authorized/ (owner-only), and "
                          f"ondemand-profd --listen tcp://0.0.0.0:7355 --keys DIR; here: ondemandctl --keys {args.dir}"
                          "\n")
        return EXIT_OK
