"""ondemandctl trigger: write a request into a job's trigger file, and print what each rank that watches it did
with it, as the ranks write it back in capture.status/rank<R>.json (no daemon needed).

The documented `echo '{...}' > /tmp/ondemand_prof-<uid>/<job>/capture` wrote wherever that path led: through a
symbolic link another user planted there, into a directory the rank itself had refused (it watched a private
fallback, named in its start-up line), and `cat .../capture.status/rank0.json` then showed that user's fake
"done" (issue 34, F6). This command writes only into a directory it checked: ours, owner-only, every directory
above it sound, no link followed (core/safedir.checked_dir), and the file is published whole and relative to that
descriptor; the status files are read the same way.

Which directory: --dir (the one the rank's start-up line names); else the job's, as its ranks told the daemon
(`ondemandctl status` shows it), where a daemon answers; else where the rank puts it by default for that job id
($ONDEMAND_PROF_TRIGGER_DIR, or $TMPDIR/ondemand_prof-<uid>/<job>: the same environment as the job's gives the
same path). Each rank names every trigger by its version (core/triggerfile.trigger_version), which is computed
here for the file written, so only answers to this very trigger are shown.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ...core import safejson
from ...core.processes import pid_alive
from ...core.options import add_window_flags, window_overrides
from ...core.protocol import RUNTIME_ENV, default_runtime_dir
from ...core.ranks import RankSpecError, parse_ranks, spans
from ...core.requests import ACTIONS, RequestError, parse_request
from ...core.files import write_atomic_at
from ...core.safedir import MissingDirectory, UnsafeDirectory, checked_dir, read_at
from ...core.triggerfile import STATUS_DIR, TRIGGER_DIR_ENV, TRIGGER_NAME, default_trigger_dir, trigger_version
from ..client import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, EXIT_USAGE, Client, CtlError, dumps
from .base import Command

FINAL = ("done", "failed", "rejected", "cancelled")  # rank/terminate.py's final states
POLL_S = 0.1  # how often the status files are read while waiting
GATHER_S = 2.0  # without a daemon to say which ranks watch: ranks answering this soon after the first are waited for
MAX_STATUS_BYTES = 4 << 20  # one rank's status file (8 recent triggers with their histories)


class Trigger(Command):
    name = "trigger"
    help = ("write a request into a job's trigger file (in a directory checked as ours), wait, and print what each "
            "rank did with it; no daemon needed")
    needs_daemon = False  # the daemon, where one answers, only says where the job's trigger directory is
    takes_hosts = False  # the files of this host (or of a shared filesystem it sees)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="the job (its id, or a unique beginning of it, as ondemandctl status shows "
                            "it); needed without --dir unless the daemon has exactly one job of yours")
        parser.add_argument("--dir", type=Path, help="the trigger directory the rank's start-up line names (default: "
                            "the job's, from the daemon's status, else $ONDEMAND_PROF_TRIGGER_DIR or "
                            "$TMPDIR/ondemand_prof-<uid>/<job>)")
        parser.add_argument("--action", choices=ACTIONS, default="capture",
                            help="what to ask for (default capture: a window of steps)")
        parser.add_argument("--ranks", help="ranks: a list or ranges like 0-3,7; -1 = all (default: the ranks a "
                            "touched trigger file captures, --profile-ondemand-ranks)")
        where = parser.add_mutually_exclusive_group()
        where.add_argument("--start", type=int, help="first step, counted from the step each rank was running when "
                           "the file was written (default 1)")
        where.add_argument("--start-step", type=int, help="absolute first step")
        parser.add_argument("--steps", type=int, help="steps to record (default: the job's --profile-ondemand-steps)")
        add_window_flags(parser)
        parser.add_argument("--id", dest="label", help="your label for this trigger (in each rank's status)")
        parser.add_argument("--wait", action=argparse.BooleanOptionalAction, default=None,
                            help="wait until every rank that watches the file is done with it (default: when "
                            "output is a terminal)")
        parser.add_argument("--timeout", type=float, default=300.0, help="how long --wait waits, s (default 300)")
        parser.add_argument("--runtime-dir", type=Path, default=None,
                            help=f"the daemon's runtime directory, asked where the job's trigger directory is (env "
                            f"{RUNTIME_ENV}; default {default_runtime_dir()})")
        parser.add_argument("--connect-timeout", type=float, default=2.0,
                            help="seconds to wait for the daemon's answer (default 2; no answer: the default path)")

    # ------------------------------------------------------------------------------------------------------

    def request(self, args: argparse.Namespace) -> dict[str, Any]:
        """The trigger's JSON from the flags, checked as a rank checks it (RequestError: exit 2)."""
        req: dict[str, Any] = dict(window_overrides(args))
        if args.action != "capture":
            req["action"] = args.action
        if args.ranks is not None:
            try:
                req["ranks"] = list(parse_ranks(args.ranks))
            except RankSpecError as exc:
                raise CtlError(f"--ranks {args.ranks!r}: {exc}", EXIT_USAGE) from None
        for key in ("steps", "start", "start_step"):
            if getattr(args, key) is not None:
                req[key] = getattr(args, key)
        if args.label:
            req["id"] = args.label
        try:
            parse_request(req)
        except RequestError as exc:
            raise CtlError(str(exc), EXIT_USAGE) from None
        return req

    def run(self, client: Any, args: argparse.Namespace, out: TextIO) -> int:
        req = self.request(args)
        directory, expected = self.find_dir(args)
        raw = (json.dumps(req, separators=(", ", ": ")) + "\n").encode()
        try:
            with checked_dir(directory) as dir_fd:
                with checked_dir(directory / STATUS_DIR):
                    pass  # every rank that watches the directory made it: none there, no rank watches it
                st = write_atomic_at(dir_fd, TRIGGER_NAME, raw)  # whole at once: never half a request
        except MissingDirectory as exc:
            raise CtlError(f"{exc}: no rank watches {directory} (each rank's start-up line names its trigger "
                           "directory: --dir)") from None
        except UnsafeDirectory as exc:
            raise CtlError(f"not writing a trigger there: {exc}") from None
        except OSError as exc:
            raise CtlError(f"cannot write {directory / TRIGGER_NAME}: {exc.strerror or exc}") from None
        version = trigger_version(st, raw)
        path = directory / TRIGGER_NAME
        if not args.json:
            out.write(f"trigger {version}: wrote {raw.decode().strip()} to {path}\n")
            out.flush()
        if not (sys.stdout.isatty() if args.wait is None else args.wait):  # as capture decides
            answers = read_answers(directory, version)
            if args.json:
                out.write(dumps({"trigger": version, "path": str(path), "request": req, "ranks": answers}) + "\n")
            else:
                out.write(f"not waiting; what each rank did: {directory / STATUS_DIR}/rank<R>.json (trigger "
                          f"{version})\n")
            return EXIT_OK
        answers, finished = self.wait(directory, version, expected, args.timeout, None if args.json else out)
        code = outcome(answers, finished)
        if args.json:
            out.write(dumps({"trigger": version, "path": str(path), "request": req, "ranks": answers,
                             "finished": finished}) + "\n")
        else:
            out.write(result_text(answers, finished, directory, args.action))
        return code

    # ------------------------------------------------------------------------------------------------------

    def find_dir(self, args: argparse.Namespace) -> tuple[Path, set[int]]:
        """The trigger directory to write into, and the ranks known to watch it (from the daemon; else empty)."""
        if args.dir is not None:
            directory = Path(os.path.abspath(args.dir.expanduser()))
            return directory, self._daemon_ranks(args, directory)
        found = self._from_daemon(args)
        if found is not None:
            return found
        if os.environ.get(TRIGGER_DIR_ENV):
            directory = Path(os.environ[TRIGGER_DIR_ENV]).expanduser()
            return Path(os.path.abspath(directory)), set()
        if not args.job:
            raise CtlError("which job? --job JOB (its id, as the rank's start-up line says), or --dir DIR (the "
                           "trigger directory it names); no daemon answered to say", EXIT_USAGE)
        return default_trigger_dir(args.job), set()

    def _status(self, args: argparse.Namespace) -> dict[str, Any] | None:
        """The daemon's status, or None where no daemon answers (then the files alone are used)."""
        try:
            with Client(args.runtime_dir or default_runtime_dir(), args.connect_timeout) as c:
                data = c.request("status")
        except CtlError:
            return None
        return data if isinstance(data, dict) and isinstance(data.get("jobs"), dict) else None

    def _mine(self, status: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """The daemon's live jobs of this user (a rank of another uid never names our directory), by name."""
        me = os.getuid()
        out: dict[str, list[dict[str, Any]]] = {}
        for name, ranks in status["jobs"].items():
            for r in ranks if isinstance(ranks, list) else []:
                if isinstance(r, dict) and r.get("uid", me) in (me, None) and r.get("trigger_dir"):
                    out.setdefault(str(r.get("job", name)), []).append(r)
        return out

    def _from_daemon(self, args: argparse.Namespace) -> tuple[Path, set[int]] | None:
        status = self._status(args)
        if status is None:
            return None
        jobs = self._mine(status)
        if args.job:
            names = [n for n in jobs if n == args.job] or [n for n in jobs if n.startswith(args.job)]
            if len(names) > 1:
                raise CtlError(f"--job {args.job!r} begins several of your jobs: {', '.join(sorted(names))}",
                               EXIT_USAGE)
            if not names:
                return None  # not registered (no daemon link, or a daemon of another runtime dir): the default path
        elif len(jobs) == 1:
            names = list(jobs)
        else:
            raise CtlError("which job? --job JOB: " + (f"your jobs here are {', '.join(sorted(jobs))}" if jobs else
                           "the daemon has no job of yours (--job JOB uses the default path, --dir DIR any)"),
                           EXIT_USAGE)
        ranks = jobs[names[0]]
        dirs = sorted({_host_dir(r) for r in ranks})
        if len(dirs) > 1:
            raise CtlError(f"the ranks of job {names[0]} watch {len(dirs)} trigger directories ({', '.join(dirs)}): "
                           "--dir DIR", EXIT_USAGE)
        return Path(dirs[0]), {int(r["rank"]) for r in ranks if isinstance(r.get("rank"), int)}

    def _daemon_ranks(self, args: argparse.Namespace, directory: Path) -> set[int]:
        status = self._status(args)
        if status is None:
            return set()
        return {int(r["rank"]) for ranks in self._mine(status).values() for r in ranks
                if os.path.abspath(_host_dir(r)) == str(directory) and isinstance(r.get("rank"), int)}

    # ------------------------------------------------------------------------------------------------------

    def wait(self, directory: Path, version: str, expected: set[int], timeout: float,
             out: TextIO | None) -> tuple[dict[int, dict[str, Any]], bool]:
        """Read the status files until every rank that watches the file is done with this trigger: the ranks the
        daemon named, those whose status files belong to a live process of this host, and any other that answers
        within GATHER_S of the first. Each change of a rank's state is printed to `out` until its final one, which
        the result says (result_text: it was printed twice, once here)."""
        expected = set(expected) | live_ranks(directory)
        deadline = time.monotonic() + timeout
        first_at: float | None = None
        shown: dict[int, str] = {}
        answers: dict[int, dict[str, Any]] = {}
        while True:
            answers = read_answers(directory, version)
            now = time.monotonic()
            if answers and first_at is None:
                first_at = now
            for rank in sorted(answers):
                state = answers[rank].get("state", "?")
                if out is not None and shown.get(rank) != state and state not in FINAL:
                    shown[rank] = state
                    out.write(f"  rank {rank:<4} {state}{_detail(answers[rank])}\n")
                    out.flush()
            waiting = (expected | set(answers)) - {r for r, a in answers.items() if a.get("state") in FINAL}
            if first_at is not None and not waiting and (expected or now - first_at >= GATHER_S):
                return answers, True
            if now >= deadline:
                for rank in sorted(expected - set(answers)):
                    answers[rank] = {"rank": rank, "state": "no answer"}
                return answers, False
            time.sleep(POLL_S)


def live_ranks(directory: Path) -> set[int]:
    """Ranks whose status file in `directory` was written by a process of this host that is still alive."""
    here = socket.gethostname()
    ranks = set()
    for rank, data in read_status_files(directory).items():
        pid = data.get("pid")
        if data.get("host") == here and isinstance(pid, int) and pid > 0 and pid_alive(pid, thorough=True):
            ranks.add(rank)
    return ranks


def read_status_files(directory: Path) -> dict[int, dict[str, Any]]:
    """Every rank<R>.json in the status directory, read relative to it, checked at this use (none when it is
    refused: a directory swapped since the trigger was written is nobody's answer)."""
    found: dict[int, dict[str, Any]] = {}
    try:
        with checked_dir(directory / STATUS_DIR) as fd:
            for name in os.listdir(fd):
                if not (name.startswith("rank") and name.endswith(".json") and name[4:-5].isdigit()):
                    continue
                raw = read_at(fd, name, MAX_STATUS_BYTES)
                try:
                    data = safejson.loads(raw, MAX_STATUS_BYTES) if raw else None
                except ValueError:
                    continue  # half a file cannot be: they are published whole; someone else's bytes are nothing
                if isinstance(data, dict):
                    found[int(name[4:-5])] = data
    except OSError:
        return {}
    return found


def read_answers(directory: Path, version: str) -> dict[int, dict[str, Any]]:
    """Each rank's entry for trigger `version` (its latest state, window, path or error)."""
    out = {}
    for rank, data in read_status_files(directory).items():
        triggers = data.get("triggers")
        for entry in triggers if isinstance(triggers, list) else []:
            if isinstance(entry, dict) and entry.get("trigger") == version:
                out[rank] = {k: v for k, v in entry.items() if k != "history"}
                break
    return out


def not_selected(answer: dict[str, Any]) -> bool:
    return answer.get("state") == "rejected" and " not selected" in str(answer.get("error", ""))


def outcome(answers: dict[int, dict[str, Any]], finished: bool) -> int:
    """0: every rank that took the trigger is done; 3: some are, some failed; 1: none is; 5: timed out."""
    if not finished:
        return EXIT_TIMEOUT
    taken = [a for a in answers.values() if not not_selected(a)]
    done = [a for a in taken if a.get("state") == "done"]
    if taken and len(done) == len(taken):
        return EXIT_OK
    return EXIT_PARTIAL if done else EXIT_FAILED


def _detail(answer: dict[str, Any]) -> str:
    window = answer.get("window")
    if answer.get("state") in ("rejected", "failed", "cancelled") and answer.get("error"):
        return f"  {answer['error']}"
    if answer.get("state") == "done":
        where = answer.get("trace") or answer.get("path")
        steps = answer.get("steps")
        return (f"  {where}" if where else "") + (f"  steps {steps[0]}..{steps[-1]}" if isinstance(steps, list)
                                                    and steps else "")
    if isinstance(window, list) and len(window) == 2:
        return f"  steps [{window[0]}, {window[1]})"
    return ""


WROTE = {"capture": "wrote a trace", "stacks": "wrote its stacks", "memory": "wrote a memory snapshot",
         "flight_recorder": "wrote its flight recorder"}


def result_text(answers: dict[int, dict[str, Any]], finished: bool, directory: Path, action: str = "capture") -> str:
    """What each rank did with the trigger, as capture's result says it: the outcome, then one line a rank."""
    taken = {r: a for r, a in answers.items() if not not_selected(a)}
    done = [r for r, a in taken.items() if a.get("state") == "done"]
    if not answers:
        return (f"timed out: no rank answered in {directory / STATUS_DIR} (is the job watching {directory}? its "
                "start-up line names the directory it watches)\n")
    if not finished:
        pending = [r for r, a in answers.items() if a.get("state") not in FINAL]
        head = f"timed out waiting; rank(s) {spans(pending)} not done\n"
    elif not taken:
        head = f"failed: no rank took it: rank(s) {spans(answers)} are not selected (--ranks)\n"
    else:
        word = "done" if len(done) == len(taken) else "failed" if not done else "partial"
        head = f"{word}: {len(done)} of {len(taken)} rank(s) {WROTE.get(action, 'did it')}\n"
    lines = [head]
    for rank in sorted(answers):
        a = answers[rank]
        lines.append(f"  rank {rank:<4} {a.get('state', '?')}{_detail(a)}\n")
    return "".join(lines)


def _host_dir(rank: dict[str, Any]) -> str:
    """A rank's trigger directory as this host has it: a rank in a container names its own, which the daemon
    found again on this host (status's trigger_dir_on_host), or which only the container sees (an error that
    says how to reach it)."""
    if not rank.get("in_container") or rank.get("trigger_dir_on_host"):
        return str(rank.get("trigger_dir_on_host") or rank["trigger_dir"])
    pid = rank.get("pid")
    raise CtlError(f"rank {rank.get('rank')}'s trigger directory {rank['trigger_dir']} is in its container's own "
                   f"filesystem, not on this host: write the trigger from inside the container (kubectl exec, or "
                   f"nsenter -t {pid} -m -p as root), e.g. ondemandctl trigger --dir {rank['trigger_dir']} there "
                   "(docs/containers.md)", EXIT_USAGE)
