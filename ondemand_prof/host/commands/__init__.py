"""ondemandctl's commands, registered here and nowhere else: one class each, holding both ends (base.py says
what a command owns). The order is the order of `ondemandctl --help`; the daemon serves those that need it,
and its transport checks their messages against each command's `fields`."""

from __future__ import annotations

from .base import Command, Fields
from .capture import Capture
from .captures import Cancel, List, Show
from .export import Export
from .keygen import Keygen
from .report import Compare, Report, Summaries
from .status import Status
from .triage import FlightRecorder, Memory, Stacks
from .trigger import Trigger
from .watch import Watch

COMMANDS: list[Command] = [Status(), Capture(), Trigger(), List(), Show(), Cancel(), Report(), Export(), Stacks(),
                           Memory(), FlightRecorder(), Keygen(), Watch(), Summaries(), Compare()]
CLI_COMMANDS: list[Command] = [c for c in COMMANDS if c.cli]  # ondemandctl's subcommands
DAEMON_COMMANDS: dict[str, Command] = {c.name: c for c in COMMANDS if c.needs_daemon}  # what the daemon serves
CLI_MESSAGES: dict[str, Fields] = {name: c.fields for name, c in DAEMON_COMMANDS.items()}  # their messages' fields

__all__ = ["COMMANDS", "CLI_COMMANDS", "DAEMON_COMMANDS", "CLI_MESSAGES", "Command"]
