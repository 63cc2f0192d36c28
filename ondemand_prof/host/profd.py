"""ondemand-profd [--runtime-dir DIR] [--state-dir DIR] [--group NAME] [--listen tcp://HOST:PORT --keys DIR]
[--tcp-per-peer N] [--metrics HOST:PORT [--metrics-token-file FILE]] [--log-level LEVEL]"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..core.version import __version__
from ..core.protocol import RUNTIME_ENV, STATE_ENV, default_runtime_dir, default_state_dir


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ondemand-profd", description="Host daemon for ondemand_prof: knows every "
                                "live rank on this host and schedules aligned profiling windows for ondemandctl.")
    p.add_argument("--runtime-dir", type=Path, default=None,
                   help=f"where the socket lives (env {RUNTIME_ENV}; default {default_runtime_dir()})")
    p.add_argument("--state-dir", type=Path, default=None,
                   help=f"where capture records are kept (env {STATE_ENV}; default {default_state_dir()})")
    p.add_argument("--group", default=None, help="share the socket with this group (default: owner only)")
    p.add_argument("--listen", metavar="tcp://HOST:PORT", default=None,
                   help="also serve ondemandctl over TCP (for other hosts); beyond loopback this needs --keys")
    p.add_argument("--keys", type=Path, default=None, metavar="DIR",
                   help="CurveZMQ keys for --listen (ondemandctl keygen DIR): the server key pair and "
                   "DIR/authorized/*.key, the clients allowed in")
    p.add_argument("--tcp-per-peer", type=int, default=32, metavar="N",
                   help="TCP connections one address may hold at once; more are closed at once (default 32)")
    p.add_argument("--metrics", metavar="HOST:PORT", default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (off by default; a port alone binds "
                   "127.0.0.1; 0.0.0.0:9464 serves every interface, unauthenticated); needs prometheus_client "
                   "(pip install 'ondemand_prof[metrics]')")
    p.add_argument("--metrics-token-file", type=Path, default=None, metavar="FILE",
                   help="with --metrics: answer only requests that send 'Authorization: Bearer TOKEN', TOKEN the "
                   "contents of FILE (a port on loopback is readable by every local user otherwise; Prometheus: "
                   "authorization.credentials_file)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging level (default INFO)")
    p.add_argument("--version", action="version", version=f"ondemand-profd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.tcp_per_peer <= 65536:
        parser.error(f"argument --tcp-per-peer: expected 1 to 65536, got {args.tcp_per_peer}")
    if args.metrics_token_file is not None and args.metrics is None:
        parser.error("argument --metrics-token-file: needs --metrics HOST:PORT")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    from .daemon import run

    return run(args.runtime_dir or default_runtime_dir(), args.state_dir or default_state_dir(), group=args.group,
               listen=args.listen, keys=args.keys, tcp_per_peer=args.tcp_per_peer, metrics=args.metrics,
               metrics_token_file=args.metrics_token_file)


if __name__ == "__main__":
    sys.exit(main())
