"""What a rank tells its user on stderr: where to trigger a capture, whether a daemon answered, where traces go,
and where each capture was written.

These lines are INFO logs of the "ondemand_prof" logger. A script that never configured logging would not see
them (Python prints only warnings then), yet they are what a user needs to find the trigger file; so when the
logger would not show them they are printed on stderr instead, once each. `profile_quiet` keeps them in the
log only.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from ..core.ranks import ALL, selects, spans

from .backends import Identity
from .layout import trace_path


def say(logger: logging.Logger, quiet: bool, text: str, logged: bool = False) -> None:
    """Log one INFO line for the user (unless `logged`: the caller's module did), and print it on stderr when
    logging would not show it and the user did not ask for quiet."""
    if not logged:
        logger.info("%s", text)
    if quiet or (logger.isEnabledFor(logging.INFO) and logger.hasHandlers()):
        return
    try:  # one write: print() writes the newline apart, and two ranks' lines ran together in a shared log
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stderr must not reach the training loop
        pass


def trigger_command(rank: int, trigger_path: Path, default_ranks: Sequence[int]) -> tuple[str, str]:
    """A command that captures this rank through the trigger file, and what it captures: a bare touch where
    the default ranks (--profile-ondemand-ranks) include this one, else a request that names it."""
    path = shlex.quote(str(trigger_path))
    if selects(default_ranks, rank):
        which = "all ranks" if ALL in default_ranks else f"ranks {spans(default_ranks)}"
        return f"touch {path}", f"{which} of the job that watch it"
    body = shlex.quote(json.dumps({"ranks": [rank]}))
    return f"echo {body} > {path}", f"a bare touch captures ranks {spans(default_ranks)}: --profile-ondemand-ranks"


def refusal_fix(reason: str) -> str:
    """What to do about a refused registration, unless the daemon's reason says it already: both ways to name
    the job (the flag, for a script that takes add_profile_args; the environment, for any other)."""
    if "--profile-job-id" in reason and "ONDEMAND_PROF_JOB_ID" in reason:
        return ""
    return " (two jobs with one job id? give this one its own: --profile-job-id NAME or ONDEMAND_PROF_JOB_ID=NAME)"


def startup_line(ident: Identity, trigger_path: Path, save_root: Path, daemon: str | None,
                 daemon_url: str | None, moved: bool = False, default_ranks: Sequence[int] = (ALL,),
                 refused: str | None = None, untrusted: str | None = None, notes: Sequence[str] = (),
                 connecting: bool = False) -> str:
    """rank, job, how to trigger (daemon or file: a command that captures this rank), where traces go; one
    line, commands between backquotes. daemon: the daemon's address when it registered this rank; daemon_url:
    where it was looked for (None: the daemon link is off); refused: why the daemon there refused this rank;
    untrusted: why this rank does not register with the daemon's socket there; connecting: a daemon listens
    there but has not answered yet (registered_line() follows when it does); notes: what the agent's
    extensions add (automatic captures and their baseline)."""
    who = f"rank {ident.rank} of {ident.world_size}, job {ident.job_id}"
    touch, which = trigger_command(ident.rank, trigger_path, default_ranks)
    if daemon:
        how = f"capture with `{daemon_command(ident)}` (registered with ondemand-profd) or `{touch}` ({which})"
    elif refused and daemon_url:
        how = (f"ondemand-profd at {daemon_url} REFUSED this rank: {refused}{refusal_fix(refused)}; until it takes "
               f"the rank (asked again every few seconds), capture with `{touch}` ({which})")
    elif untrusted and daemon_url:
        how = f"not registering with ondemand-profd at {daemon_url}: {untrusted}; capture with `{touch}` ({which})"
    elif connecting and daemon_url:
        how = (f"capture with `{touch}` ({which}); still connecting to ondemand-profd at {daemon_url}: a line says "
               "so when it registers this rank")
    elif daemon_url:
        how = f"capture with `{touch}` ({which}; no ondemand-profd answered at {daemon_url}: start one for ondemandctl)"
    else:
        how = f"capture with `{touch}` ({which})"
    extra = "".join(f"; {note}" for note in notes)
    return f"ondemand_prof: {'now ' if moved else ''}{who}: {how}; traces go to {save_root.absolute()}{extra}"


def daemon_command(ident: Identity) -> str:
    return f"ondemandctl capture --job {shlex.quote(ident.job_id)} --ranks {ident.rank}"


def registered_line(ident: Identity, daemon: str) -> str:
    """The daemon answered after the start-up line said it had not (still connecting, or none there then)."""
    return (f"ondemand_prof: rank {ident.rank} of {ident.world_size}, job {ident.job_id}: registered with "
            f"ondemand-profd at {daemon}: capture with `{daemon_command(ident)}`")


def written_line(ident: Identity | Any, result: dict[str, Any]) -> str:
    """Where the trace is (the file HTA, TensorBoard and Perfetto open), its steps, and the rank's directory."""
    steps = result.get("steps_in_trace") or []
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
    trace = trace_path(result)
    if trace is None:  # torch_npu: its own directory is the output
        return f"ondemand_prof: rank {ident.rank} wrote {result.get('path')} ({span}, {result.get('status')})"
    return (f"ondemand_prof: rank {ident.rank} wrote {trace} ({span}, {result.get('status')}; metadata and "
            f"summaries in {result.get('path')})")
