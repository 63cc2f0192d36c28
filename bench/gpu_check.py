"""The GPU check (issue 33): every CUDA path of the product in one run, on a lent GPU in one go, and on the CPU here.

    bash scripts/gpu_check.sh [--device auto|cuda|cpu] [--out DIR] [--quick] [--budget-s S]

(scripts/gpu_check.sh finds a Python with torch, installs carried pyzmq/watchdog wheels where they are missing,
then runs this file). It writes, under --out (default $OUT/gpu_check where $OUT is set, else build/gpu_check):
table.md (a row per check: PASS / FAIL / SKIP, the figure, seconds), results.json (the same, with the
environment) and logs.tar.gz (every command with its exit status and output, the daemon's and the rank's logs,
the captures). Nothing needs the network; every command has a timeout and the whole run a budget (--budget-s,
default 420 s), so it never hangs: what the budget leaves no time for is a SKIP row saying so.

The rows:
  torch and device     torch imports, the device is the one asked for (CUDA: name, capability, CUDA version)
  native save          `python -m ondemand_prof.rank.native_save build` against the installed torch; the module
                       loads and frees the saved result (frees_result, and no events left after the save: what
                       issue 20's size check guarded, an in-place destroy since 8cf4a72); a profile of the model
                       on the device saved by it is byte for byte the file export_chrome_trace writes; the
                       daemon's captures below were written by it
  training loop        a small transformer (200 steps at least; --quick: 20) with prof.step(), registered with a
                       real ondemand-profd, in a 1-rank NCCL group (CPU: gloo)
  capture kernels      `ondemandctl capture --steps 2`: the trace's device kernels (CPU: the training thread's
                       CPU ops) all fall inside the two ProfilerStep# ranges
  level ...            level_none, level0, level1, level2 and level0 with --with-stack --with-memory
                       --record-shapes: each trace has what docs/levels-and-output.md promises, and nothing more
  report               `ondemandctl report <id> --json` on the level0 capture: the split is on the device, with
                       kernels (CPU: on the CPU, no kernels)
  memory               `ondemandctl memory --steps 2`: a snapshot that `python -m torch.cuda._memory_viz` reads
                       (stats, trace_plot); CPU: the "not available on this backend (CPU)" answer
  flight-recorder      TORCH_NCCL_TRACE_BUFFER_SIZE (and TORCH_FR_BUFFER_SIZE) set: `ondemandctl
                       flight-recorder` dumps the NCCL group's recorder, and torch's analyzer
                       (torch.distributed.flight_recorder.fr_trace) reads it; CPU: the gloo group's
  window cost          bench/bench_window_cost.py --device D: ours vs torch.profiler, window-end stall and stall +
                       10 steps, with each one's trace size
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
JOB = f"gpucheck-{os.getpid()}"
TOLERANCE_US = 20.0  # kineto's device timestamps are converted to the host clock: a little slack at the edges
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
FR_BUFFER = "2000"
LOG_BYTES = 12 << 20  # what logs.tar.gz may hold uncompressed beyond the logs themselves (captures)


# ----------------------------------------------------------------------------------------------------------
# The training rank: a small transformer with the hook (python bench/gpu_check.py --train ...)


def train_main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from torch.autograd.profiler import record_function

    from ondemand_prof import OnDemandProfiler, add_profile_args

    parser = argparse.ArgumentParser(prog="gpu_check.py --train", description="the GPU check's training rank")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200, help="steps at least; then until --stop-file exists")
    parser.add_argument("--max-steps", type=int, default=1_000_000)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--status-file", required=True)
    parser.add_argument("--dist", choices=["none", "gloo", "nccl"], default="none")
    parser.add_argument("--size", choices=["quick", "cpu", "cuda"], default="cpu")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds of sleep a step (--quick: a lighter load)")
    add_profile_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ONDEMAND_PROF_LOG", "INFO"), format="%(asctime)s %(name)s: %(message)s")
    prof = OnDemandProfiler.from_args(args, parser)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.dist != "none":
        dist.init_process_group(args.dist, rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{os.environ['ODP_GPU_CHECK_PORT']}")
    torch.manual_seed(0)
    model, batch = tiny_lm(args.size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    status = open(args.status_file, "a", buffering=1)
    it = 0
    while it < args.max_steps and (it < args.steps or not os.path.exists(args.stop_file)):
        t0 = time.perf_counter()
        x, y = batch()
        with record_function("forward"):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        with record_function("backward"):
            for p in params:
                p.grad = None
            loss.backward()
        if args.dist != "none":
            with record_function("allreduce_grads"):
                for p in params:
                    dist.all_reduce(p.grad)  # type: ignore[arg-type]
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.05)  # type: ignore[arg-type]
        value = loss.item()  # the step's end: its kernels are done (a loop that logs its loss waits here too)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        status.write(json.dumps({"step": it, "loss": round(value, 4), "ms": round((time.perf_counter() - t0) * 1e3, 3),
                                 "t": time.time()}) + "\n")
        prof.step()
        it += 1
    prof.close()
    if args.dist != "none":
        dist.destroy_process_group()
    return 0


def tiny_lm(size: str, device: Any) -> tuple[Any, Callable[[], tuple[Any, Any]]]:
    """A small causal transformer and a learnable task (each token follows from the one before it)."""
    import torch

    vocab, d, layers, heads, seq, bs = {"quick": (64, 64, 2, 4, 32, 8), "cpu": (128, 128, 2, 4, 64, 16),
                                         "cuda": (512, 512, 4, 8, 256, 32)}[size]

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.zeros(seq, d))
            layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, vocab)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x: Any) -> Any:
            return self.head(self.body(self.emb(x) + self.pos, mask=self.mask, is_causal=True))

    model = TinyLM().to(device)
    steps = torch.arange(seq, device=device)

    def batch() -> tuple[Any, Any]:
        start = torch.randint(0, vocab, (bs, 1), device=device)
        tokens = (start * 5 + steps * 3) % vocab  # next = this + 3 (mod vocab): learnable from one token back
        return tokens, (tokens + 3) % vocab

    return model, batch


# ----------------------------------------------------------------------------------------------------------
# The native save against the installed torch (python bench/gpu_check.py --native-child DEVICE DIR)


def native_child(device_name: str, work: Path) -> int:
    """Build the module (or find it built) and load it, profile the model on the device, and save the profile
    twice: the reference with export_chrome_trace in a forked child (kineto saves a result once per process;
    tests/test_trace_save.py does the same), then with trace_save.save_trace, which must take the native way.
    Prints one RESULT line."""
    import torch
    from torch.autograd.profiler import record_function

    from ondemand_prof.rank import native_save, trace_save

    out: dict[str, Any] = {}
    out["built"], out["build"] = native_save.build()  # what `python -m ondemand_prof.rank.native_save build` does
    mod, why = native_save.load()
    out.update(loaded=mod is not None, why=why, frees_result=getattr(mod, "frees_result", None),
               torch_version=getattr(mod, "torch_version", None))
    if mod is None:
        print("RESULT " + json.dumps(out), flush=True)
        return 1
    device = torch.device(device_name)
    torch.manual_seed(0)
    model, batch = tiny_lm("quick" if device.type == "cpu" else "cuda", device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def steps(prof: Any, n: int) -> None:
        prof.prepare_trace()
        prof.start_trace()
        for i in range(n):
            with record_function(f"ProfilerStep#{i}"):
                x, y = batch()
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                loss.item()
        prof.stop_trace()

    # a first, thrown-away profile and save in this process: whatever kineto computes once per process at its
    # first save (device properties) is then computed here, before the fork, not in the child
    warm = torch.profiler.profile(activities=activities)
    steps(warm, 1)
    warm.export_chrome_trace(str(work / "warm.pt.trace.json"))
    prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True)
    steps(prof, 3)
    ref, nat = work / "reference.pt.trace.json", work / "native.pt.trace.json"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            signal.alarm(120)
            prof.export_chrome_trace(str(ref))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    out["reference_exit"] = os.waitstatus_to_exitcode(status)
    os.environ.pop(trace_save.SAVE_ENV, None)
    os.environ.pop(trace_save.FORK_ENV, None)
    started = time.perf_counter()
    out["way"] = trace_save.save_trace(prof.export_chrome_trace, nat,
                                       kineto_result=lambda: prof.profiler.kineto_results)  # type: ignore[union-attr]
    out["save_ms"] = round((time.perf_counter() - started) * 1e3, 1)
    out["frees_waited"] = trace_save.wait_for_native_frees(120)  # freed after the save, paced
    if hasattr(mod, "last_free"):
        cpu, wall, out["free_rests"] = mod.last_free()
        out["free_cpu_ms"], out["free_wall_ms"] = round(cpu * 1e3, 1), round(wall * 1e3, 1)
    out["events_left"] = len(prof.profiler.kineto_results.events())  # type: ignore[union-attr]
    if out["reference_exit"] == 0 and nat.exists():
        a = ref.read_bytes().replace(str(ref).encode(), b"<path>")
        b = nat.read_bytes().replace(str(nat).encode(), b"<path>")
        out.update(identical=a == b, bytes=len(b))
        events = json.loads(b)["traceEvents"]
        out["device_events"] = sum(1 for e in events if e.get("cat") in DEVICE_CATS)
        out["cpu_ops"] = sum(1 for e in events if e.get("cat") == "cpu_op")
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------------
# What a trace holds, and what each check expects of it (pure: tests/test_gpu_check.py feeds synthetic CUDA traces)


def read_trace(path: Path) -> dict[str, Any]:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def step_ranges(trace: dict[str, Any]) -> list[tuple[int, float, float, Any]]:
    """(step, start, end, tid) of each ProfilerStep# range on the host, in step order (a CUDA trace repeats each on
    the device's timeline as a gpu_user_annotation: not a step of its own)."""
    out = []
    for e in trace.get("traceEvents", []):
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and name.startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation":
            out.append((int(name.split("#", 1)[1]), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                        e.get("tid")))
    return sorted(out)


def events_in_steps(trace: dict[str, Any], cuda: bool, tolerance_us: float = TOLERANCE_US) -> dict[str, Any]:
    """The device's events (kernels, copies, sets; CPU: the CPU ops of the thread the steps are on), and those not
    inside any ProfilerStep# range (beyond `tolerance_us` at either edge)."""
    ranges = step_ranges(trace)
    tids = {tid for _, _, _, tid in ranges}
    if cuda:
        events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    else:
        events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                  and e.get("tid") in tids]
    outside, worst = [], 0.0
    for e in events:
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        miss = min((max(s - start, end - t, 0.0) for _, s, t, _ in ranges), default=float("inf"))
        if miss > tolerance_us:
            outside.append(e)
        worst = max(worst, miss)
    return {"steps": [s for s, _, _, _ in ranges], "events": len(events), "outside": len(outside),
            "worst_outside_us": worst if events else 0.0,
            "first_outside": [f"{e.get('name')} at {e.get('ts')}" for e in outside[:3]],
            "kernels": sum(1 for e in events if e.get("cat") == "kernel")}


def trace_facts(trace: dict[str, Any]) -> dict[str, int]:
    """What a trace recorded, counted the way docs/levels-and-output.md promises it."""
    facts = dict.fromkeys(("cpu_op", "device", "shapes", "flops", "flops_ops", "memory", "stacks", "annotations"), 0)
    # with_flops: torch marks the trace ("with_flops": 1 beside traceEvents, as it does record_shapes, profile_memory
    # and with_stack); a per-operator "flops" argument is counted too (torch 2.13's Chrome trace has none: the
    # counts reach only key_averages())
    facts["flops"] = int(bool(trace.get("with_flops")))
    for e in trace.get("traceEvents", []):
        cat, args = e.get("cat"), e.get("args") or {}
        if cat == "cpu_op":
            facts["cpu_op"] += 1
            facts["shapes"] += "Input Dims" in args
            facts["flops_ops"] += "flops" in args
        elif cat in DEVICE_CATS:
            facts["device"] += 1
        elif cat == "python_function":
            facts["stacks"] += 1
        elif cat == "user_annotation":
            facts["annotations"] += 1
        if e.get("name") == "[memory]":
            facts["memory"] += 1
    facts["steps"] = len(step_ranges(trace))
    return facts


# what each capture promises (docs/levels-and-output.md); None: present only on a device with kernels
LEVELS: dict[str, dict[str, Any]] = {
    "level_none": {"flags": [], "has": ["annotations"], "lacks": ["cpu_op", "shapes", "flops", "memory", "stacks"],
                   "cuda_activity": False},
    "level0": {"flags": [], "has": ["cpu_op"], "lacks": ["shapes", "flops", "memory", "stacks"],
               "cuda_activity": True},
    "level1": {"flags": [], "has": ["cpu_op", "shapes", "flops"], "lacks": ["memory", "stacks"],
               "cuda_activity": True},
    "level2": {"flags": [], "has": ["cpu_op", "shapes", "flops", "memory"], "lacks": ["stacks"],
               "cuda_activity": True},
    "level0 +stack +memory +shapes": {"flags": ["--with-stack", "--with-memory", "--record-shapes"],
                                      "has": ["cpu_op", "stacks", "memory", "shapes"], "lacks": ["flops"],
                                      "cuda_activity": True},
}


def level_findings(level: str, facts: dict[str, int], activities: list[str], cuda: bool) -> list[str]:
    """What a level's trace lacks of its promise, or has beyond it ([] = as promised)."""
    want = LEVELS[level]
    problems = [f"no {k}" + (" (the trace's with_flops mark)" if k == "flops" else "") for k in want["has"]
                if not facts.get(k)]
    problems += [f"{k} recorded ({facts[k]}; not promised)" for k in want["lacks"] if facts.get(k)]
    if facts.get("steps") != 2:
        problems.append(f"{facts.get('steps')} ProfilerStep# ranges, not 2")
    device_expected = cuda and want["cuda_activity"]
    expected_acts = ["CPU", "CUDA"] if device_expected else ["CPU"]
    if activities != expected_acts:
        problems.append(f"activities {activities}, not {expected_acts}")
    if device_expected and not facts.get("device"):
        problems.append("no device kernels")
    if not device_expected and facts.get("device"):
        problems.append(f"{facts['device']} device events (none promised)")
    return problems


def describe_facts(facts: dict[str, int], activities: list[str]) -> str:
    return (f"activities {'+'.join(activities) or '?'}; cpu_op {facts['cpu_op']}, device {facts['device']}, "
            f"shapes {facts['shapes']}, with_flops {facts['flops']} (ops with a count {facts['flops_ops']}), memory "
            f"{facts['memory']}, stacks {facts['stacks']}, "
            f"annotations {facts['annotations']}")


# ----------------------------------------------------------------------------------------------------------
# The run: rows, commands with timeouts and logs, the budget


@dataclass
class Row:
    key: str
    check: str
    result: str = "SKIP"
    figure: str = "not run"
    seconds: float = 0.0
    log: str = ""


class Failed(Exception):
    """A check's FAIL, with the figure that says why."""


class OutOfTime(Exception):
    pass


@dataclass
class Run:
    device: str
    quick: bool
    work: Path
    out: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    rows: dict[str, Row] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    env_info: dict[str, Any] = field(default_factory=dict)
    check_deadline: float = 0.0
    current_log: Path | None = None

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def row(self, key: str, check: str) -> Row:
        self.rows[key] = Row(key, check)
        return self.rows[key]

    # a check: a row, a log, a deadline
    def check(self, key: str, limit_s: float, fn: Callable[[], str], needs: float = 5.0) -> bool:
        row = self.rows[key]
        row.log = f"logs/{key}.log"
        self.current_log = self.logs / f"{key}.log"
        if self.remaining() < needs:
            row.figure = f"not run: the run's budget ({self.budget_s:.0f} s) left {max(self.remaining(), 0):.0f} s"
            return False
        self.check_deadline = time.monotonic() + min(limit_s, self.remaining())
        t0 = time.monotonic()
        try:
            row.figure = fn()
            row.result = "PASS"
        except Failed as exc:
            row.result, row.figure = "FAIL", str(exc)
        except OutOfTime as exc:
            row.result, row.figure = "FAIL", f"timed out: {exc}"
        except Exception as exc:  # noqa: BLE001 - a check's own error is its FAIL, the run goes on
            row.result, row.figure = "FAIL", f"{type(exc).__name__}: {exc}"
        row.seconds = round(time.monotonic() - t0, 1)
        self.note(f"== {row.result} ({row.seconds} s): {row.figure}")
        print(f"{row.result:4} {row.check}: {row.figure}", flush=True)
        return row.result == "PASS"

    def time_left(self, cap: float) -> float:
        left = min(cap, self.check_deadline - time.monotonic())
        if left <= 1:
            raise OutOfTime("the check's time ran out")
        return left

    def note(self, text: str) -> None:
        if self.current_log is not None:
            with open(self.current_log, "a") as fh:
                fh.write(text.rstrip("\n") + "\n")

    def cmd(self, argv: list[str], timeout: float = 120, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a command within the check's time; its line, exit status and output go to the check's log."""
        limit = self.time_left(timeout)
        t0, cpu0 = time.monotonic(), children_cpu_s()
        # a session of its own: at the timeout its whole process group goes (a benchmark's children too)
        proc = subprocess.Popen(argv, env=env or self.env(), cwd=cwd or self.work, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=limit)
            res = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            res = subprocess.CompletedProcess(argv, 124, out, err + f"\n[gpu_check: killed after {limit:.0f} s]")
        finally:
            kill_group(proc)  # whatever it left behind
            if proc in self.procs:
                self.procs.remove(proc)
        self.note(f"$ {' '.join(argv)}\n[exit {res.returncode}, {time.monotonic() - t0:.1f} s, CPU "
                  f"{children_cpu_s() - cpu0:.1f} s]\n--- stdout\n"
                  f"{res.stdout}\n--- stderr\n{res.stderr}\n")
        return res

    def quick_env(self) -> dict[str, str]:
        """--quick (the test suite, on 2 loaded cores): the rank's helpers at nice 10, not SCHED_IDLE, which a
        host whose cores are all busy starves for 10 s per capture before raising them (docs: Levels and output)."""
        return {"ONDEMAND_PROF_EXPORT_SCHED": "nice"} if self.quick else {}

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        env["ONDEMAND_PROF_RUNTIME_DIR"] = str(self.run_dir)
        env["PYTHONUNBUFFERED"] = "1"
        if not self.cuda:
            env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra)
        return env

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    def ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.cmd([sys.executable, "-m", "ondemand_prof.host.ctl", *args], timeout=timeout)

    def ctl_json(self, *args: str, timeout: float = 120, ok: tuple[int, ...] = (0,)) -> tuple[int, Any]:
        res = self.ctl(*args, "--json", timeout=timeout)
        if res.returncode not in ok:
            raise Failed(f"ondemandctl {' '.join(args)}: exit {res.returncode}: {last_line(res.stderr or res.stdout)}")
        try:
            return res.returncode, json.loads(res.stdout)
        except ValueError:
            raise Failed(f"ondemandctl {' '.join(args)} --json printed no JSON: {last_line(res.stdout)}")

    def wait_for(self, pred: Callable[[], Any], what: str, cap: float = 120, pause: float = 0.1) -> Any:
        deadline = time.monotonic() + self.time_left(cap)
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            time.sleep(pause)
        raise OutOfTime(f"waiting for {what}")

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(argv, env=env, cwd=self.work, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        log.close()
        self.procs.append(proc)
        self.note(f"started {name} (pid {proc.pid}): {' '.join(argv)}")
        return proc

    def stop_all(self) -> None:
        """Every process this run started, and whatever they started."""
        import psutil  # a dependency of the package

        for proc in self.procs:
            pids = [proc.pid]
            try:
                pids += [k.pid for k in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


def children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # gone, and its group with it
        pass
    if proc.poll() is None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def last_line(text: str) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


# ----------------------------------------------------------------------------------------------------------
# The checks


ENV_PROBE = """
import json, sys, torch
c = torch.cuda.is_available()
d = {'torch': torch.__version__, 'python': sys.version.split()[0], 'cuda_available': c, 'cuda': torch.version.cuda}
if c:
    p = torch.cuda.get_device_properties(0)
    d.update(name=p.name, capability=f'{p.major}.{p.minor}', memory_gib=round(p.total_memory / 2**30, 1))
    try:
        v = torch.cuda.nccl.version()
        d['nccl'] = '.'.join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        d['nccl'] = f'? ({type(exc).__name__})'
print(json.dumps(d))
"""


def check_environment(run: Run, asked: str) -> str:
    """torch imports and the device is there; --device auto becomes cuda where torch.cuda.is_available()."""
    res = run.cmd([sys.executable, "-c", ENV_PROBE], timeout=180)
    if res.returncode != 0:
        raise Failed(f"torch does not import: {last_line(res.stderr)}")
    info = json.loads(res.stdout.strip().splitlines()[-1])
    run.env_info.update(info)
    if asked == "auto":
        run.device = "cuda" if info["cuda_available"] else "cpu"
    if run.cuda and not info["cuda_available"]:
        raise Failed(f"--device cuda, but torch {info['torch']} sees no CUDA device")
    if run.cuda:
        return (f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info.get('nccl')}, {info['name']} (sm "
                f"{info['capability']}, {info['memory_gib']} GiB), Python {info['python']}")
    return (f"--device {asked}: torch {info['torch']} on the CPU (CUDA available: {info['cuda_available']}), "
            f"Python {info['python']}")


def check_native(run: Run) -> str:
    child = run.work / "native"
    child.mkdir()
    res = run.cmd([sys.executable, str(HERE), "--native-child", run.device, str(child)], timeout=480)
    result = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if not result:
        raise Failed(f"the native-save child gave no result (exit {res.returncode}): {last_line(res.stderr)}")
    r = json.loads(result[-1][len("RESULT "):])
    run.env_info["native"] = r
    built = r.get("build", "")
    if not r.get("built"):
        raise Failed(f"the build failed: {built}")
    if not r["loaded"]:
        raise Failed(f"built ({built}) but does not load: {r['why']}")
    problems = []
    if r.get("frees_result") is not True:
        problems.append(f"the module does not say it frees the result (frees_result {r.get('frees_result')})")
    if r.get("reference_exit") != 0:
        problems.append(f"the export_chrome_trace reference failed (exit {r.get('reference_exit')})")
    if r.get("way") != "native":
        problems.append(f"save_trace took the {r.get('way')} way")
    if r.get("identical") is not True:
        problems.append("the native trace differs from export_chrome_trace's")
    if r.get("frees_result") and r.get("events_left"):
        problems.append(f"{r['events_left']} events left in the result after the save")
    if run.cuda and not r.get("device_events"):
        problems.append("the profile holds no device kernels")
    figure = (f"{built}; frees_result {r.get('frees_result')}, {r.get('events_left')} events left in the result "
              f"after the save; {r.get('bytes', 0) / 1e6:.2f} MB trace "
              f"({r.get('device_events', 0)} device events, {r.get('cpu_ops', 0)} CPU ops), byte-identical to "
              f"export_chrome_trace: {r.get('identical')}, saved in {r.get('save_ms')} ms")
    if problems:
        raise Failed("; ".join(problems) + f" ({figure})")
    return figure


class Job:
    """The daemon and the training rank the daemon checks share."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.save = run.work / "profile"
        self.status = run.work / "steps.jsonl"
        self.stop = run.work / "stop"
        self.rank: subprocess.Popen | None = None
        self.captures: dict[str, dict[str, Any]] = {}  # label -> capture record part (trace, path, id)

    def start(self) -> str:
        run = self.run
        run.run_dir.mkdir(mode=0o700)
        state = run.work / "state"
        daemon = run.spawn("daemon", [sys.executable, "-m", "ondemand_prof.host.profd", "--runtime-dir",
                                      str(run.run_dir), "--state-dir", str(state)], run.env())
        run.wait_for(lambda: (run.run_dir / "profd.sock").exists() or daemon.poll() is not None, "the daemon's socket",
                     60)
        if daemon.poll() is not None:
            raise Failed(f"ondemand-profd exited {daemon.returncode} (logs/daemon.log: "
                         f"{last_line((run.logs / 'daemon.log').read_text())})")
        env = run.env(ODP_GPU_CHECK_PORT=str(free_port()), TORCH_NCCL_TRACE_BUFFER_SIZE=FR_BUFFER,
                      TORCH_FR_BUFFER_SIZE=FR_BUFFER, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", **run.quick_env())
        steps = "20" if run.quick else "200"
        size = "cuda" if run.cuda else "quick" if run.quick else "cpu"
        sleep = ["--step-sleep", "0.02"] if run.quick else []  # 2 loaded cores: the rank need not take one whole
        argv = [sys.executable, str(HERE), "--train", "--device", run.device, "--steps", steps, *sleep, "--size", size,
                "--dist", "nccl" if run.cuda else "gloo", "--stop-file", str(self.stop), "--status-file",
                str(self.status), "--profile-save-path", str(self.save), "--profile-job-id", JOB,
                "--profile-min-free-mb", "0"]
        self.rank = run.spawn("rank", argv, env)

        def registered() -> Any:
            if self.rank is not None and self.rank.poll() is not None:
                raise Failed(f"the rank exited {self.rank.returncode} before registering (logs/rank.log: "
                             f"{last_line((run.logs / 'rank.log').read_text())})")
            res = run.ctl("status", "--json", timeout=30)
            if res.returncode != 0:
                return None
            ranks = json.loads(res.stdout).get("jobs", {}).get(JOB, [])
            return ranks if ranks and ranks[0].get("step_time_s") else None

        # its first steps in the status file (a read), then the daemon's view (a CLI process a poll)
        run.wait_for(lambda: fail_if_rank_exited(self) or len(status_lines(self.status)) >= 3,
                     "the rank's first steps", 240, pause=0.2)
        ranks = run.wait_for(registered, "the rank to register and step", 120, pause=0.5)
        return f"rank registered, at step {ranks[0]['step']}, {ranks[0]['step_time_s'] * 1e3:.1f} ms a step"

    def capture(self, label: str, *flags: str) -> dict[str, Any]:
        _, rec = self.run.ctl_json("capture", "--job", JOB, "--ranks", "0", "--steps", "2", *flags, "--wait",
                                   "--timeout", "150", timeout=180)
        if rec.get("status") != "done":
            raise Failed(f"capture {rec.get('capture_id')}: {rec.get('status')}")
        part = rec["parts"]["0"]
        meta = json.loads((Path(part["path"]) / "metadata.json").read_text())
        cap = {"id": rec["capture_id"], "trace": Path(part["trace"]), "meta": meta, "window": rec["window"]}
        self.captures[label] = cap
        return cap

    def finish(self) -> str:
        """Stop the rank (the stop file, once it is past its steps) and say what it trained."""
        run = self.run
        self.stop.touch()
        assert self.rank is not None
        try:
            rc = self.rank.wait(timeout=run.time_left(120))
        except subprocess.TimeoutExpired:
            raise Failed("the rank did not end within 120 s of the stop file")
        lines = status_lines(self.status)
        if rc != 0:
            raise Failed(f"the rank exited {rc} after {len(lines)} steps (logs/rank.log: "
                         f"{last_line((run.logs / 'rank.log').read_text())})")
        want = 20 if run.quick else 200
        if len(lines) < want:
            raise Failed(f"{len(lines)} steps, not {want}")
        losses = [x["loss"] for x in lines]
        if not all(v == v and abs(v) < 1e6 for v in losses):
            raise Failed(f"the loss is not finite: {losses[-5:]}")
        ms = statistics.median(x["ms"] for x in lines[len(lines) // 2:])
        return (f"{len(lines)} steps, median {ms:.2f} ms a step, loss {statistics.mean(losses[:10]):.3f} (first 10) "
                f"-> {statistics.mean(losses[-10:]):.3f} (last 10); exit 0 after the stop file")


def fail_if_rank_exited(job: Job) -> bool:
    if job.rank is not None and job.rank.poll() is not None:
        raise Failed(f"the rank exited {job.rank.returncode} before its first steps (logs/rank.log: "
                     f"{last_line((job.run.logs / 'rank.log').read_text())})")
    return False


def status_lines(path: Path) -> list[dict[str, Any]]:
    """The rank's --status-file: a JSON line a step ([] before the first; a half-written last line is left out)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def free_port() -> int:
    import random
    import socket

    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def check_kernels(run: Run, job: Job) -> str:
    cap = job.capture("level0", "--level", "level0")
    found = events_in_steps(read_trace(cap["trace"]), run.cuda)
    what = "device events" if run.cuda else "CPU ops on the training thread"
    window = list(range(*cap["window"]))
    figure = (f"capture {cap['id']}: {found['events']} {what} ({found['kernels']} kernels) in steps "
              f"{found['steps']}; {found['outside']} outside the ProfilerStep# ranges (worst "
              f"{found['worst_outside_us']:.1f} us beyond an edge)")
    if found["steps"] != window:
        raise Failed(f"the trace's steps {found['steps']} are not the window's {window}; " + figure)
    if not found["events"] or (run.cuda and not found["kernels"]):
        raise Failed(f"no {what}; " + figure)
    if found["outside"]:
        raise Failed(figure + f"; e.g. {found['first_outside']}")
    return figure


def check_level(run: Run, job: Job, level: str) -> str:
    want = LEVELS[level]
    cap = job.captures.get(level) or job.capture(level, "--level", level.split()[0], *want["flags"])
    facts = trace_facts(read_trace(cap["trace"]))
    acts = cap["meta"].get("backend", {}).get("torch_profile_kwargs", {}).get("activities", [])
    problems = level_findings(level, facts, acts, run.cuda)
    figure = describe_facts(facts, acts)
    if problems:
        raise Failed("; ".join(problems) + f" ({figure})")
    return figure


def check_report(run: Run, job: Job) -> str:
    cap = job.captures.get("level0")
    if cap is None:
        raise Failed("no level0 capture to report on")
    _, rep = run.ctl_json("report", cap["id"], "--top", "5", timeout=120)
    run.ctl("report", cap["id"], "--top", "5", timeout=120)  # the text, for the log
    ranks = [r for g in rep.get("captures", []) for r in g.get("ranks", [])]
    if len(ranks) != 1 or ranks[0].get("error"):
        raise Failed(f"{len(ranks)} rank(s) read: {[r.get('error') for r in ranks]}")
    r = ranks[0]
    kernels = r.get("top_kernels") or []
    libs = ", ".join(f"{x.get('library', x.get('name', '?'))}" for x in r.get("comm_libraries") or []) or "none"
    figure = (f"basis {r.get('basis')}: compute {r.get('compute_pct', 0):.0f}%, communication "
              f"{r.get('comm_pct', 0):.0f}% ({libs}), overlap {r.get('overlap_pct', 0):.0f}%, idle "
              f"{r.get('idle_pct', 0):.0f}%; {len(r.get('steps') or [])} steps, {r.get('step_ms_mean', 0):.2f} ms "
              "mean; "
              + (f"top kernel {kernels[0].get('name', '?')[:60]} ({kernels[0].get('total_us', 0):.0f} us)" if kernels
                 else "no kernels"))
    if run.cuda and (r.get("basis") != "device" or not kernels):
        raise Failed("the split is not on the device, or no kernels: " + figure)
    if not run.cuda and (r.get("basis") != "cpu" or kernels):
        raise Failed("a CPU capture reported as on a device: " + figure)
    if len(r.get("steps") or []) != 2:
        raise Failed("not the 2 steps recorded: " + figure)
    return figure


def check_memory(run: Run, job: Job) -> str:
    res = run.ctl("memory", "--job", JOB, "--ranks", "0", "--steps", "2", "--timeout", "90", timeout=120)
    files = sorted(job.save.glob("memory-*/*.memory.pickle"))
    if not run.cuda:
        said = "rank(s) 0: not available on this backend (CPU)"
        if res.returncode != 1 or said not in res.stdout:
            raise Failed(f"exit {res.returncode}, not the CPU answer: {last_line(res.stdout + res.stderr)}")
        if files:
            raise Failed(f"a snapshot was written on the CPU: {files}")
        return f"exit 1, '{said}' (the allocator history needs CUDA), no file written: as documented"
    if res.returncode != 0 or len(files) != 1:
        raise Failed(f"exit {res.returncode}, {len(files)} snapshot(s): {last_line(res.stdout + res.stderr)}")
    snap = files[0]
    line = next((x.strip() for x in res.stdout.splitlines() if str(snap) in x), "")
    said = line.split("  (", 1)[-1].rstrip(")") if "  (" in line else "?"
    return f"{snap.name}: {said}; " + memory_viz_reads(run, snap)


def memory_viz_reads(run: Run, snap: Path) -> str:
    """torch's own reader of allocator snapshots, as its command line runs it: stats, then trace_plot's HTML."""
    stats = run.cmd([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(snap)], timeout=120)
    if stats.returncode != 0 or not stats.stdout.strip():
        raise Failed(f"_memory_viz stats: exit {stats.returncode}: {last_line(stats.stderr)}")
    html = run.work / "memory_trace_plot.html"
    plot = run.cmd([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snap), "-o", str(html)],
                   timeout=120)
    if plot.returncode != 0 or not html.exists():
        raise Failed(f"_memory_viz trace_plot: exit {plot.returncode}: {last_line(plot.stderr)}")
    return (f"_memory_viz stats ({len(stats.stdout.splitlines())} lines) and trace_plot "
            f"({html.stat().st_size / 1e3:.0f} kB of HTML) read it")


def check_flight_recorder(run: Run, job: Job) -> str:
    import pickle

    rc, data = run.ctl_json("flight-recorder", "--job", JOB, "--timeout", "60", timeout=90)
    files = sorted(job.save.glob("flight-recorder-*/fr_trace_rank_*"))
    if len(files) != 1:
        raise Failed(f"{len(files)} dump(s) written (exit {rc})")
    dump = pickle.loads(files[0].read_bytes())
    lib = "nccl" if run.cuda else "gloo"
    names = sorted({e.get("profiling_name") for e in dump.get("entries", [])})
    if f"{lib}:all_reduce" not in names:
        raise Failed(f"no {lib}:all_reduce among the dump's {len(dump.get('entries', []))} entries ({names[:5]})")
    groups = data.get("summary", {}).get("process_groups", [])
    # torch's analyzer on the folder as we write it (fr_trace_rank_{R}: its prefix, then the rank)
    folder = files[0].parent
    res = run.cmd([sys.executable, str(HERE), "--fr-child", str(folder), str(run.work)], timeout=180)
    result = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if not result:
        raise Failed(f"the analyzer child gave no result (exit {res.returncode}): {last_line(res.stderr)}")
    fr = json.loads(result[-1][len("RESULT "):])
    written = "the folder read as written"
    figure = (f"{len(dump['entries'])} entries (version {dump.get('version')}; "
              f"{', '.join(n for n in names if n)[:60]}), "
              f"{len(groups)} process group(s) summarised; torch's analyzer: ")
    if not fr["loader"]["ok"]:  # the loader is what reads the names: a refusal here is about how we write them
        raise Failed(figure + f"its loader refuses the folder as written: {fr['loader']['error'][:90]}")
    figure += f"its loader reads {fr['loader']['value']['entries']} entries"
    if run.cuda:
        if not fr["full"]["ok"]:
            raise Failed(figure + f", fr_trace fails: {fr['full']['error']}; {written}")
        return figure + f", fr_trace builds its database ({fr['full']['value']} bytes); {written}"
    figure += ", fr_trace's matching " + ("works too" if fr["full"]["ok"] else
                                          f"does not take gloo's dump ({fr['full']['error'][:40]}: gloo's pg_config "
                                          "names the group '')")
    return figure + f"; {written}"


def fr_child(written: Path, work: Path) -> int:
    """torch's flight-recorder analyzer (what `torchfrtrace DIR` runs), in one process, on the folder as written:
    its loader (which infers the prefix and the rank from the names), then its whole analysis (fr_trace.main, which
    builds its database; gloo's dump has no NCCL group names, so on the CPU only the loader must pass)."""
    import contextlib
    import io
    import traceback

    from torch.distributed.flight_recorder import fr_trace
    from torch.distributed.flight_recorder.components.loader import read_dir

    out: dict[str, Any] = {}

    def analyze(folder: Path, db: Path) -> int:
        try:
            fr_trace.main([str(folder), "-o", str(db)])
        except TypeError:  # an older main() that reads sys.argv only
            sys.argv = ["fr_trace", str(folder), "-o", str(db)]
            fr_trace.main()  # type: ignore[call-arg]
        return db.stat().st_size

    def loader() -> dict[str, Any]:
        details, version = read_dir(argparse.Namespace(trace_dir=str(written), prefix=None))
        return {"version": version, "entries": sum(len(d["entries"]) for d in details.values()),
                "ranks": sorted(d["rank"] for d in details.values())}

    for name, fn in (("loader", loader), ("full", lambda: analyze(written, work / "fr_db.pickle"))):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                out[name] = {"ok": True, "value": fn()}
        except BaseException as exc:  # noqa: BLE001 - argparse exits, assertions, key errors: the analyzer's answer
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            traceback.print_exc()
        print(f"--- {name}: {len(buf.getvalue().splitlines())} lines of output\n{buf.getvalue()[-4000:]}",
              file=sys.stderr)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def check_window_cost(run: Run) -> str:
    """bench_window_cost.py on the device, ours against torch.profiler; --quick: every window in one process
    (--same-process: one torch start instead of one a variant, on the suite's 2 cores)."""
    tmp = run.work / "bench_tmp"
    tmp.mkdir(mode=0o700)
    argv = [sys.executable, str(ROOT / "bench" / "bench_window_cost.py"), "--device", run.device, "--variants",
            "torch,ours", "--threads", "1", "--quiet-wait", "0" if run.quick else "10", "--retries", "0"]
    argv += ["--repeat", "1", "--active", "5", "--tail", "10", "--same-process"] if run.quick else ["--repeat", "3"]
    res = run.cmd(argv, timeout=150 if run.quick else 300, env=run.env(TMPDIR=str(tmp), **run.quick_env()))
    if res.returncode != 0:
        raise Failed(f"exit {res.returncode}: {last_line(res.stderr)}")
    got = parse_bench(res.stdout)
    sizes = bench_trace_sizes(tmp, len(got["ours"]))
    med = {v: (statistics.median(s for s, _ in rows), statistics.median(t for _, t in rows)) for v, rows in got.items()}
    return (f"window-end stall ours {med['ours'][0]:.1f} ms vs torch {med['torch'][0]:.1f} ms "
            f"({med['ours'][0] / med['torch'][0]:.2f}x); stall + 10 steps {med['ours'][1]:.1f} vs "
            f"{med['torch'][1]:.1f} ms ({med['ours'][1] / med['torch'][1]:.2f}x); trace ours {sizes['ours']} vs torch "
            f"{sizes['torch']} (medians of {len(got['ours'])} run(s), "
            + ("5" if run.quick else "20") + "-step window with stacks and shapes)")


BENCH_RUN = re.compile(r"^(?:run|round) \d+ threads \d+ (torch|ours) \(.*?\): stall (-?[\d.]+) ms, \+10 (-?[\d.]+) ms"
                       r".*?save -?\d+ ([^,]+),(?:.*?capture (.*)|.*)$", re.M)


def parse_bench(stdout: str) -> dict[str, list[tuple[float, float]]]:
    """Each run's window-end stall and stall + 10 steps (ms), by variant, from bench_window_cost.py's progress lines
    (a process a run: 'run N ...', --same-process: 'round N ...'); our window must have been written, and where the
    line says (a process a run), published ok."""
    got: dict[str, list[tuple[float, float]]] = {"torch": [], "ours": []}
    for m in BENCH_RUN.finditer(stdout):
        variant, stall, total, way, capture = m.groups()
        got[variant].append((float(stall), float(total)))
        if variant == "ours" and (way not in ("native", "in-process", "fork") or
                                  (capture is not None and "'ok'" not in capture)):
            raise Failed(f"our window in the benchmark: written {way}, capture {capture}")
    if not got["torch"] or not got["ours"]:
        raise Failed(f"no per-run lines in the benchmark's output ({last_line(stdout)})")
    return got


def bench_trace_sizes(tmp: Path, runs: int) -> dict[str, str]:
    """The traces the benchmark wrote under its TMPDIR, a directory a window: ours beside a rank directory with
    metadata.json, torch's (tensorboard_trace_handler) alone. Warm-up windows are shorter: per variant, the median
    of the `runs` largest."""
    ours: list[int] = []
    torch_: list[int] = []
    for d in tmp.iterdir():
        traces = [p for p in d.rglob("*.pt.trace.json*") if p.is_file()]
        if traces:
            (ours if any(d.rglob("metadata.json")) else torch_).append(max(p.stat().st_size for p in traces))

    def fmt(sizes: list[int]) -> str:
        largest = sorted(sizes)[-runs:] if runs > 0 else []
        return f"{statistics.median(largest) / 1e6:.2f} MB" if largest else "?"

    return {"ours": fmt(ours), "torch": fmt(torch_)}


# ----------------------------------------------------------------------------------------------------------
# The table


def table(run: Run) -> str:
    info = run.env_info
    head = (f"GPU check, {time.strftime('%Y-%m-%d %H:%M %Z')}, --device {run.device}"
            f"{' --quick' if run.quick else ''}: torch {info.get('torch', '?')}"
            + (f", CUDA {info.get('cuda')}, {info.get('name')}" if run.cuda else ", CPU only")
            + f", Python {info.get('python', '?')}, {os.cpu_count()} cores, commit "
            f"{os.environ.get('ODP_GPU_CHECK_COMMIT') or git_commit()}; "
            f"{time.monotonic() - run.started:.0f} s")
    lines = [head, "", "| check | result | figure | s |", "|---|---|---|---|"]
    for row in run.rows.values():
        figure = row.figure.replace("|", "/").replace("\n", " ")
        lines.append(f"| {row.check} | {row.result} | {figure} | {row.seconds:.0f} |")
    passed = sum(r.result == "PASS" for r in run.rows.values())
    lines += ["", f"{passed} of {len(run.rows)} passed; raw logs: logs.tar.gz (logs/<check>.log: each command, its "
              "exit status and output)"]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (res.stdout.strip() + ("+changes" if dirty else "")) if res.returncode == 0 else "unknown (no .git)"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_outputs(run: Run) -> None:
    run.out.mkdir(parents=True, exist_ok=True)
    text = table(run)
    (run.out / "table.md").write_text(text)
    results = {"environment": run.env_info, "device": run.device, "quick": run.quick,
               "rows": [asdict(r) for r in run.rows.values()]}
    (run.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    with tarfile.open(run.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(run.logs, arcname="logs")
        budget = LOG_BYTES
        for path in sorted(iter_files(run.work), key=lambda p: p.stat().st_size):
            if run.logs in path.parents:
                continue
            size = path.stat().st_size
            if size <= budget:
                tar.add(path, arcname=str(path.relative_to(run.work)))
                budget -= size
    print(text, end="")
    print(f"written: {run.out}/table.md, results.json, logs.tar.gz", flush=True)


README_BEGIN = "<!-- gpu-check:begin"
README_END = "<!-- gpu-check:end -->"


def fill_readme(table_md: Path, readme: Path) -> int:
    """Put a GPU run's table.md into README.md's "Measured on a GPU" section (between its two markers)."""
    text, table_text = readme.read_text(), table_md.read_text()
    if "--device cuda" not in table_text.splitlines()[0]:
        print(f"{table_md} is not a CUDA run's table (its first line: {table_text.splitlines()[0][:100]})",
              file=sys.stderr)
        return 2
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        print(f"{readme} has no {README_BEGIN} ... {README_END} section", file=sys.stderr)
        return 2
    begin = text.index("\n", begin) + 1
    readme.write_text(text[:begin] + table_text.rstrip("\n") + "\n" + text[end:])
    print(f"{readme}: the Measured on a GPU section now holds {table_md}")
    return 0


def iter_files(root: Path) -> Iterator[Path]:
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and not p.name.endswith(".sock"):
            yield p


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train"]:
        return train_main(argv[1:])
    if argv[:1] == ["--native-child"]:
        return native_child(argv[1], Path(argv[2]))
    if argv[:1] == ["--fr-child"]:
        return fr_child(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["--fill-readme"] and len(argv) == 2:
        return fill_readme(Path(argv[1]), ROOT / "README.md")
    parser = argparse.ArgumentParser(description="The GPU check: every CUDA path of ondemand_prof in one run.")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="cuda, cpu, or auto: cuda where torch.cuda.is_available() (default)")
    parser.add_argument("--out", help="where table.md, results.json and logs.tar.gz go (default $OUT/gpu_check "
                        "where $OUT is set, else build/gpu_check)")
    parser.add_argument("--quick", action="store_true", help="the test suite's wiring: a few steps each")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time (default 420 s)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (traces, logs)")
    args = parser.parse_args(argv)
    default_out = Path(os.environ["OUT"]) / "gpu_check" if os.environ.get("OUT") else ROOT / "build" / "gpu_check"
    out = Path(args.out).resolve() if args.out else default_out
    work = Path(tempfile.mkdtemp(prefix="odpgc-", dir="/tmp"))  # short: the daemon's socket lives in it
    (work / "logs").mkdir()
    run = Run(device=args.device, quick=args.quick, work=work, out=out, budget_s=args.budget_s)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    print(f"GPU check, --device {args.device}{' (quick)' if args.quick else ''}: work {work}, out {out}", flush=True)
    try:
        run_checks(run, args.device)
    finally:
        run.stop_all()
        write_outputs(run)
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.result == "PASS" for r in run.rows.values()) else 1


def run_checks(run: Run, asked: str) -> None:
    run.row("env", "torch and device")
    env_ok = run.check("env", 200, lambda: check_environment(run, asked))
    if run.device == "auto":  # the probe did not get as far as the device: name the rows for the CPU
        run.device = "cpu"
    lib = "NCCL" if run.cuda else "gloo"
    run.row("native", "native save: built against this torch, frees the result, byte-identical to "
            "export_chrome_trace")
    run.row("train", f"training loop: small transformer, prof.step(), ondemand-profd, 1-rank {lib} group")
    run.row("kernels", "capture --steps 2: " + ("device kernels" if run.cuda else "CPU ops (no device)")
            + " inside the two ProfilerStep# ranges")
    for level in LEVELS:
        run.row(f"level:{level}", f"level mapping: {level}")
    run.row("report", "report on the capture: " + ("device split, kernels" if run.cuda else "CPU split, no kernels"))
    run.row("memory", "memory --steps 2: " + ("snapshot read by torch.cuda._memory_viz" if run.cuda
                                              else "'not available' on the CPU"))
    run.row("fr", f"flight-recorder ({lib}): dump read by torch's analyzer")
    run.row("bench", "window cost: ours vs torch.profiler (bench_window_cost.py), trace size")
    if not env_ok:
        for row in list(run.rows.values())[1:]:
            row.figure = "not run: torch and the device are not as asked (see the first row)"
        return
    run.check("native", 500, lambda: check_native(run), needs=30)
    job = Job(run)
    if run.check("train", 260, job.start, needs=30):
        run.rows["train"].result, run.rows["train"].figure = "SKIP", "running: " + run.rows["train"].figure
        run.check("kernels", 200, lambda: check_kernels(run, job))
        for level in LEVELS:
            run.check(f"level:{level}", 200, lambda: check_level(run, job, level))
        run.check("report", 150, lambda: check_report(run, job))
        run.check("memory", 150, lambda: check_memory(run, job))
        run.check("fr", 300, lambda: check_flight_recorder(run, job))
        started = run.rows["train"].figure
        run.check("train", 150, job.finish, needs=5)
        if run.rows["train"].result == "PASS":
            run.rows["train"].figure = started.replace("running: ", "") + "; " + run.rows["train"].figure
        native_ways(run, job)
    else:
        for key in DAEMON_ROWS:
            run.rows[key].figure = "not run: the training rank did not start (see its row)"
    run.stop_all()
    run.check("bench", 320, lambda: check_window_cost(run), needs=40)


DAEMON_ROWS = ["kernels", *(f"level:{level}" for level in LEVELS), "report", "memory", "fr"]


def native_ways(run: Run, job: Job) -> None:
    """The native-save row also says how the daemon's captures were written (the rank loads the module built)."""
    row = run.rows["native"]
    ways = [c["meta"].get("backend", {}).get("trace_save") for c in job.captures.values()]
    if row.result != "PASS" or not ways:
        return
    native = sum(w == "native" for w in ways)
    row.figure += f"; the daemon's captures: {native} of {len(ways)} written by it"
    if native != len(ways):
        row.result = "FAIL"
        why = [x.split(": ", 1)[-1] for x in (run.logs / "rank.log").read_text(errors="replace").splitlines()
               if "GIL-free trace save" in x]
        row.figure += (f" (others: {sorted(set(str(w) for w in ways if w != 'native'))}; the rank said: "
                       f"{why[0][:200] if why else 'nothing'})")


if __name__ == "__main__":
    sys.exit(main())
