"""ondemandctl stacks, memory and flight-recorder: one triage action sent to the target ranks, answered by
each rank's agent thread even while its training thread is blocked (rank/triage.py); the daemon replies when
all answered or at the timeout (its bookkeeping: host/triage.py; the vocabulary: core/triagedefs.py)."""

from __future__ import annotations

import argparse
import logging
import time
from collections import deque
from typing import Any

from ...core.bounds import checked_number
from ...core.protocol import encode
from ...core.ranks import RankSpecError, parse_ranks, spans
from ...core.triagedefs import DEFAULT_MAX_ENTRIES, DEFAULT_MEMORY_STEPS, MEMORY_STACKS, OWN_THREAD_PREFIX, \
    check_args, format_thread
from ..client import EXIT_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, CtlError
from ...core.ids import capture_id
from ..registry import select_ranks
from ..service import BadRequest, Service
from .base import Command, add_job_flag, opt_str

log = logging.getLogger("ondemand_prof.daemon")

MAX_TRIAGE_S = 600.0


class _TriageCommand(Command):
    """Send one triage action to the target ranks; the daemon replies when all answered or at the timeout."""

    across = False  # (the processes of this host: a native dump, py-spy)
    action = ""
    default_ranks = "-1"
    default_timeout = 5.0
    bulky: tuple[str, ...] = ()  # per-rank fields that fold() says once for all ranks: dropped from each rank

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_job_flag(parser)
        parser.add_argument("--ranks", default=self.default_ranks,
                            help=f"ranks: a list or ranges like 0-3,7; -1 = all (default {self.default_ranks})")
        parser.add_argument("--timeout", type=float, default=self.default_timeout,
                            help=f"seconds to wait for the ranks' answers (default {self.default_timeout:g})")

    def args(self, args: argparse.Namespace) -> dict[str, Any]:
        return {}

    def message(self, args: argparse.Namespace) -> dict[str, Any]:
        try:
            ranks = list(parse_ranks(args.ranks))
        except RankSpecError as exc:
            raise CtlError(f"--ranks {args.ranks!r}: {exc}", EXIT_USAGE) from None
        if not 0.5 <= args.timeout <= MAX_TRIAGE_S:
            raise CtlError(f"--timeout {args.timeout:g}: expected 0.5 to {MAX_TRIAGE_S:g} s", EXIT_USAGE)
        msg: dict[str, Any] = {"ranks": ranks, "timeout_s": args.timeout, "args": self.args(args)}
        if args.job:
            msg["job"] = args.job
        return msg

    def wait_s(self, args: argparse.Namespace, timeout_s: float) -> float | None:
        return args.timeout + timeout_s  # the daemon answers when every rank has, or at --timeout

    def execute(self, service: Service, route: bytes, msg: dict[str, Any]) -> Any:
        from ..triage import Pending, target_of

        timeout = msg.get("timeout_s", self.default_timeout)
        try:
            checked_number(timeout, 0.5, MAX_TRIAGE_S, "field 'timeout_s'")
            args = check_args(self.action, msg.get("args"))
            targets, silent = self._targets(service, opt_str(msg, "job"), msg.get("ranks", -1),
                                            getattr(msg.get("_peer"), "uid", None))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        wall, now = time.time(), time.monotonic()
        triage_id = capture_id(self.name, capture_id(wall=wall))
        job = (targets or silent)[0].job
        by_route = {t.route: target_of(t, service.host) for t in targets}
        by_route.update({b"silent/%d" % t.rank: target_of(t, service.host) for t in silent})
        request = encode("triage", triage_id=triage_id, action=self.action, args=args, capture_id=triage_id)
        service.triage.add(Pending(triage_id, self.action, route, msg.get("id"), job, by_route,
                                   answer_by=now + max(0.5, timeout - 1.0), deadline=now + timeout,
                                   finish=self.finish, request=request, unsent=deque(t.route for t in targets)),
                           now)
        log.info("ondemand-profd: %s %s: job %s, %d rank(s)", self.name, triage_id, job, len(targets))
        return None

    def _targets(self, service: Service, job: str | None, spec: Any, asker: int | None = None
                 ) -> tuple[list[Any], list[Any]]:
        """The live ranks asked for, and (stacks) those whose heartbeats stopped while their process lives on:
        they cannot answer, but a native dump can still be had. ValueError says what is wrong. `asker`: the uid
        asking (a job id several users chose means the asker's)."""
        registry = service.registry
        silent = service.triage.silent_ranks(None, time.monotonic()) if self.action == "stacks" else []
        # a silent rank's job: its name, or a unique beginning of it, as for live jobs
        silent = [r for r in silent if job is None or registry.name_of(r.uid, r.job).startswith(job) or
                  r.job.startswith(job)]
        if len({r.key for r in silent}) > 1 and job is not None:
            exact = [r for r in silent if job in (r.job, registry.name_of(r.uid, r.job))]
            silent = exact or silent
        live = registry.jobs()
        if silent and not live.get(job or registry.name_of(silent[0].uid, silent[0].job)):
            key = silent[0].key
            wanted = select_ranks(spec, max(r.world_size for r in silent))
            chosen = [r for r in silent if r.key == key and (-1 in wanted or r.rank in wanted)]
            if not chosen:
                raise ValueError(f"rank(s) {spans(wanted)} of job {job or silent[0].job!r} are not registered")
            return [], chosen
        job = registry.resolve_job(job, asker)
        world = max(r.world_size for r in live[job])
        wanted = select_ranks(spec, world)
        here = {r.rank for r in live[job]}
        key = live[job][0].key
        silent = [r for r in silent if r.key == key and r.rank not in here and (-1 in wanted or r.rank in wanted)]
        named = [r for r in wanted if r == -1 or r in here or r not in {s.rank for s in silent}]
        return (service.registry.select(job, named) if named else []), silent

    def finish(self, pending: Any) -> dict[str, Any]:
        """The reply: each rank's answer, and what the command folds them into (`fold`); the per-rank bulk
        that was folded (`bulky`) is dropped, so the reply says it once for all ranks."""
        data = {"triage_id": pending.triage_id, "job": pending.job, "action": pending.action,
                "ranks": {str(r): res for r, res in sorted(pending.results.items())}}
        data.update(self.fold(pending))
        for res in data["ranks"].values():
            for key in self.bulky:
                res.pop(key, None)
        return data

    def fold(self, pending: Any) -> dict[str, Any]:
        return {}

    def exit_code(self, data: Any) -> int:
        results = list(data["ranks"].values())
        ok = sum(1 for r in results if r.get("ok"))
        return EXIT_OK if ok == len(results) else EXIT_PARTIAL if ok else EXIT_FAILED

    @staticmethod
    def _failures(data: dict[str, Any]) -> str:
        failed: dict[str, list[int]] = {}
        for rank, res in data["ranks"].items():
            if not res.get("ok"):
                failed.setdefault(res.get("error", "?"), []).append(int(rank))
        return "".join(f"  rank(s) {spans(ranks)}: {error}\n" for error, ranks in failed.items())


class Stacks(_TriageCommand):
    name = "stacks"
    action = "stacks"
    help = ("the Python stack of every thread of each rank, collected in-process (no ptrace), identical stacks "
            "grouped across ranks; a rank that cannot answer gets a native dump (faulthandler)")

    bulky = ("threads", "text")  # grouped across ranks; per rank only how it answered

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--all-threads", action="store_true",
                            help="also print ondemand_prof's own threads (the trigger watcher's, the exporter, "
                                 "timers), folded into one line by default; --json always has them")

    def fold(self, pending: Any) -> dict[str, Any]:
        from ..triage import group_stacks

        return group_stacks(pending.results, pending.folder)

    def console(self, data: Any, args: argparse.Namespace) -> str:
        ranks = data["ranks"]
        py, native = data["answered_python"], sorted(int(r) for r in data["native"])
        silent = sorted(int(r) for r, res in ranks.items() if not res.get("ok"))
        text = (f"stacks {data['triage_id']}: job {data['job']}, {len(ranks)} rank(s): {len(py)} answered in-process "
                f"(Python), {len(native)} by native dump (faulthandler), {len(silent)} did not answer\n")
        own = [t for t in data["threads"] if t.get("own")]
        for t in data["threads"]:
            if t.get("own") and not getattr(args, "all_threads", False):
                continue
            many = len(t["stacks"]) > 1
            text += f"\n=== thread {t['thread']}: " + (f"{len(t['stacks'])} different stacks\n" if many else
                                                       "the same stack on every rank that has it\n")
            for s in t["stacks"]:
                mark = "  <-- differs from the majority" if s["odd"] else ""
                text += f"--- rank(s) {s['rank_spans']} ({len(s['ranks'])}){mark}\n"
                body = format_thread({"name": t["thread"], "frames": s["frames"]}).split("\n", 1)[1]
                text += body
        if own and not getattr(args, "all_threads", False):
            ranks_with = sorted({r for t in own for st in t["stacks"] for r in st["ranks"]})
            differ = [t["thread"] for t in own if len(t["stacks"]) > 1]
            text += (f"\n=== {len(own)} thread(s) of ondemand_prof itself on rank(s) {spans(ranks_with)}, not shown: "
                     + ", ".join(t["thread"].removeprefix(OWN_THREAD_PREFIX) for t in own)
                     + (f" ({', '.join(differ)}: different stacks on different ranks)" if differ else "")
                     + "; --all-threads shows them\n")
        for rank, res in data["native"].items():
            if res.get("ok"):
                text += f"\n=== rank {rank}: NATIVE DUMP. {res['note']}\n{res['text']}"
        if data["trimmed"]:
            text += f"\nnote: outer frames were cut on rank(s) {spans(data['trimmed'])} to fit a message\n"
        fails = self._failures(data)
        return text + (f"\nno stacks from:\n{fails}" if fails else "")


class Memory(_TriageCommand):
    name = "memory"
    action = "memory"
    default_ranks = "0"
    default_timeout = 120.0
    help = ("record the accelerator allocator's history for some steps, then write a snapshot for PyTorch's "
            "memory visualiser (CUDA; Ascend with torch_npu)")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--steps", type=int, default=DEFAULT_MEMORY_STEPS,
                            help=f"steps to record (default {DEFAULT_MEMORY_STEPS})")
        parser.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                            help=f"allocator events kept (default {DEFAULT_MAX_ENTRIES}: bounded memory and file size)")
        parser.add_argument("--cpp-stacks", action="store_true",
                            help="C++ stacks too (slow: dumps can take minutes; default: Python stacks only)")

    def args(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"steps": args.steps, "max_entries": args.max_entries,
                "stacks": MEMORY_STACKS[1] if args.cpp_stacks else MEMORY_STACKS[0]}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = f"memory {data['triage_id']}: job {data['job']}\n"
        for rank, res in data["ranks"].items():
            if res.get("ok"):
                s = res["summary"]
                text += (f"  rank {rank:<4} {res['path']}  ({res['bytes']} bytes, steps {res['steps'][0]}.."
                         f"{res['steps'][1]}, {res['device']}: {s['reserved_bytes'] / 2**20:.1f} MiB reserved, "
                         f"{s['allocated_bytes'] / 2**20:.1f} MiB allocated, {s['history_entries']} events)\n")
        fails = self._failures(data)
        text += fails
        if any(r.get("ok") for r in data["ranks"].values()):
            text += "open a snapshot at https://pytorch.org/memory_viz (drag the file in)\n"
        return text


class FlightRecorder(_TriageCommand):
    name = "flight-recorder"
    action = "flight_recorder"
    help = ("dump the collective flight recorder of each rank into a capture folder, and say which collectives "
            "some ranks entered and others did not")

    bulky = ("entries",)  # compared across ranks in the summary

    def fold(self, pending: Any) -> dict[str, Any]:
        from ..triage import summarize_flight_recorder

        return {"summary": summarize_flight_recorder({r: res for r, res in pending.results.items() if res.get("ok")})}

    def console(self, data: Any, args: argparse.Namespace) -> str:
        text = f"flight-recorder {data['triage_id']}: job {data['job']}\n"
        for rank, res in data["ranks"].items():
            if res.get("ok"):
                text += f"  rank {rank:<4} {res['path']}  ({res['total_entries']} entries)\n"
        text += self._failures(data)
        for g in data["summary"]["process_groups"]:
            text += (f"process group {g['pg']} ({g['desc'] or '-'}), rank(s) {spans(g['ranks'])}: last collective "
                     f"sequence number {g['min_seq']}" + (f" to {g['max_seq']}" if g["max_seq"] != g["min_seq"]
                                                          else " on every rank") + "\n")
            for m in g["mismatches"]:
                text += (f"  seq {m['seq']} ({m['collective']}): entered by rank(s) {m['entered_spans']}, NOT by "
                         f"rank(s) {m['missing_spans']}\n")
        if data["summary"]["process_groups"] and data["summary"]["in_step"]:
            text += "every rank entered the same collectives\n"
        elif not data["summary"]["process_groups"] and any(r.get("ok") for r in data["ranks"].values()):
            text += "no collective recorded yet\n"
        return text

