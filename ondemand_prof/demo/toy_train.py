"""A small, real training run with the hook in it: used by the demo, the tests and the benchmarks.

    python -m ondemand_prof.demo.toy_train --steps 20 --profile --profile-step-start 5 --profile-step-end 8
    torchrun-style: set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and it joins a gloo process group.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ondemand_prof import ConfigError, OnDemandProfiler, add_profile_args, config_from_args, config_from_mapping


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (slow loops)")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--config", help="a training YAML whose training: section configures profiling")
    parser.add_argument("--first-step", type=int, default=0, help="number of the first step (resumed runs)")
    parser.add_argument("--pass-step", action="store_true", help="pass the loop counter to prof.step(n)")
    parser.add_argument("--kill-at-step", type=int, default=-1, help="SIGKILL this process at that step")
    parser.add_argument("--no-dist", action="store_true", help="do not join a process group even if WORLD_SIZE>1")
    parser.add_argument("--status-file", help="write a JSON line per step here (tests follow progress)")
    parser.add_argument("--stop-file", help="end the loop once this file exists (one process; ranks in a "
                        "process group would stop at different steps)")
    parser.add_argument("--stall-rank", type=int, default=-1, help="this rank stalls before its all_reduce...")
    parser.add_argument("--stall-at-step", type=int, default=-1, help="...at this step...")
    parser.add_argument("--stall-s", type=float, default=0.0, help="...for this long (the others wait in it)")
    parser.add_argument("--stall-holding-gil", action="store_true",
                        help="stall in native code that holds the GIL (no Python thread of the rank can run)")
    parser.add_argument("--slow-from", type=int, default=-1, help="from this step on, --step-sleep is...")
    parser.add_argument("--slow-factor", type=float, default=1.0, help="...this many times longer...")
    parser.add_argument("--slow-rank", type=int, default=-1, help="...on this rank only (-1: every rank)")
    parser.add_argument("--inject-file", help="a JSON file read while the loop runs (its changes take effect at "
                        "the next step): slowdowns switched on and off, for comparisons with a baseline "
                        '({"kind": "straggler"|"comm"|"input"|"sync"|"small_ops"|"hiccup", "rank": R, "amount": N}; '
                        '{} is none)')
    add_profile_args(parser)
    return parser


class Injection:
    """The slowdown --inject-file asks for, re-read when the file changes (one stat a step):
    straggler  rank R does N extra 384x384 matmuls a step (its compute grows; the others wait in the all_reduce)
    comm       every rank all_reduces an extra N MB a step
    input      rank R sleeps N ms before its forward (slow input: host time outside any operator)
    sync       every rank adds N barriers a step (an extra synchronisation)
    small_ops  every rank runs N extra tiny additions a step (more small operators)
    hiccup     rank R spends N ms more every "every"-th step (10 by default) after its update, outside operators
               (a synchronous checkpoint)
With "at_step": S the change takes effect at step S on every rank (the one before goes on until then): a change
read by two ranks at different steps would have one rank issue collectives the other does not (a hang)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.seen: tuple[int, int, int] | None = None
        self.spec: dict[str, Any] = {}
        self.pending: dict[str, Any] | None = None  # read, to take effect at its at_step
        self._buffers: dict[str, torch.Tensor] = {}

    def refresh(self, step: int = 0) -> None:
        self._read()
        at = self.pending.get("at_step") if self.pending is not None else None
        if self.pending is not None and step >= (at if isinstance(at, int) else 0):
            self.spec, self.pending = self.pending, None

    def _read(self) -> None:
        if not self.path:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            self.pending = {}
            return
        # The size too, not only the time: a write stamps the time before its bytes land, so a read in between
        # finds the file empty under the final time (both ranks, in step after the all_reduce, lost a slowdown so)
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self.seen:
            try:
                spec = json.loads(open(self.path).read() or "{}")
            except (OSError, ValueError):
                return  # half written: the next step reads it again
            self.seen = seen
            self.pending = spec if isinstance(spec, dict) else {}

    def applies(self, kind: str, rank: int) -> int:
        spec = self.spec
        if spec.get("kind") != kind or spec.get("rank", rank) not in (rank, -1):
            return 0
        return int(spec.get("amount", 0))

    def after_update(self, rank: int, step: int) -> None:
        if (n := self.applies("hiccup", rank)) and step % int(self.spec.get("every", 10) or 10) == 0:
            time.sleep(n / 1000)

    def before_forward(self, rank: int) -> None:
        if n := self.applies("input", rank):
            time.sleep(n / 1000)

    def in_forward(self, rank: int) -> None:
        if n := self.applies("straggler", rank):
            a = self._buffers.setdefault("mm", torch.randn(384, 384))
            for _ in range(n):
                torch.mm(a, a)
        if n := self.applies("small_ops", rank):
            t = self._buffers.setdefault("small", torch.ones(4))
            for _ in range(n):
                t = t + 1

    def after_allreduce(self, rank: int, world: int) -> None:
        if world <= 1:
            return
        if n := self.applies("comm", rank):
            buf = self._buffers.get(f"comm{n}")
            if buf is None:
                buf = self._buffers[f"comm{n}"] = torch.zeros(n * (1 << 20) // 4)
            dist.all_reduce(buf)
        for _ in range(self.applies("sync", rank)):
            dist.barrier()


def _hold_gil(seconds: float) -> None:
    """Spin in C code that keeps the GIL and that no signal cuts short: a backtracking regular expression
    (each extra character about doubles its time; measured on a short one, sized to about `seconds`)."""
    import math
    import re

    pattern = re.compile(r"(a+)+$")
    t0 = time.perf_counter()
    pattern.match("a" * 16 + "b")
    base = max(time.perf_counter() - t0, 1e-4)
    n = 16 + max(0, math.ceil(math.log(max(seconds / base, 1.0), 1.9)))
    pattern.match("a" * n + "b")


def _stall(args: argparse.Namespace, it: int, status: object) -> None:
    """Triage demos: one rank stalls while the others wait in a collective."""
    if it != args.stall_at_step or int(os.environ.get("RANK", "0")) != args.stall_rank:
        return
    if status:
        status.write(json.dumps({"stall": it}) + "\n")  # type: ignore[attr-defined]
    if args.stall_holding_gil:
        _hold_gil(args.stall_s)
    else:
        time.sleep(args.stall_s)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ONDEMAND_PROF_LOG", "INFO"),
                        format="%(asctime)s rank" + os.environ.get("RANK", "0") + " %(name)s: %(message)s")
    world = 1 if args.no_dist else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = config_from_mapping(args.config) if args.config else config_from_args(args, parser)
        prof = OnDemandProfiler(config, first_step=args.first_step)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    # plain SGD by hand: torch.optim's first use imports torch._dynamo (2.3 s of CPU in torch 2.13), which every rank
    # of the test suite would pay; the optimizer paths (zero-code, Lightning, Trainer) run the examples/ scripts
    params = list(model.parameters())
    status = open(args.status_file, "a", buffering=1) if args.status_file else None
    inject, rank = Injection(args.inject_file), int(os.environ.get("RANK", "0"))
    for it in range(args.first_step, args.first_step + args.steps):
        if it == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.stop_file and os.path.exists(args.stop_file):
            break
        t0 = time.time()
        inject.refresh(it)
        inject.before_forward(rank)
        with record_function("forward"):
            x = torch.randn(64, args.hidden)
            loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (64,)))
            inject.in_forward(rank)
        with record_function("backward"):
            for p in params:
                p.grad = None
            loss.backward()
        _stall(args, it, status)
        if world > 1:
            with record_function("allreduce_grads"):
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            inject.after_allreduce(rank, world)
        with torch.no_grad():
            for p in params:
                assert p.grad is not None  # backward() set it
                p.add_(p.grad, alpha=-0.01)
        inject.after_update(rank, it)
        if args.step_sleep:
            slow = args.slow_factor if 0 <= args.slow_from <= it and args.slow_rank in (
                -1, int(os.environ.get("RANK", "0"))) else 1.0
            time.sleep(args.step_sleep * slow)
        if status:
            status.write(json.dumps({"step": it, "t": t0}) + "\n")
        prof.step(it) if args.pass_step else prof.step()
    prof.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
