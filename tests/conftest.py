"""Shared helpers: real training processes (one or several gloo ranks) and readers for what they wrote."""

from __future__ import annotations

import ctypes
import gzip
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAND_INS = Path(__file__).resolve().parent / "stand_ins"

# The quick tier (`bash scripts/test.sh --quick`, `pytest -m quick`): the tests that run in this process (pure
# policy, parsers, planning, the daemon's service driven directly, reports on stored traces), with a few short
# subprocesses at most, marked where they are: `pytestmark = pytest.mark.quick` in a module of them only, or
# @pytest.mark.quick on one test (tests/test_quick_tier.py checks that a module starting no process is marked, and
# that a test naming nothing that starts a process, in its code, fixtures and helpers, is marked). The full suite
# (no flag) is what CI runs.


def pytest_configure(config: pytest.Config) -> None:
    _become_subreaper()
    config.addinivalue_line("markers", "quick: the quick tier, in-process tests (scripts/test.sh --quick)")


# ----------------------------------------------------------------------------------------------------------
# No test leaves processes behind. A launcher killed by a fixture (torchrun, an example that starts workers in
# sessions of their own) orphans its ranks, and each orphan then trains for the rest of the run: two of them took
# 70% of a core for the next 20 minutes, which slowed every later test and made timing-sensitive ones fail.
# pytest is made a child subreaper, so orphans of every depth come back to it, and whatever a test module started
# is gone when the module ends (its module-scoped fixtures first).

PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: leftovers of a killed launcher are then the OS's
        pass


def kill_tree(proc: subprocess.Popen) -> None:
    """End a process and every process under it, then reap it (its descendants may be in other sessions)."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    for p in [proc, *tree]:
        try:
            os.kill(p.pid, 9)
        except OSError:
            pass
    proc.wait()
    _reap([p.pid for p in tree])


def end_test_env(procs: list[subprocess.Popen], *dirs: Path) -> None:
    """The end of a test's environment: its processes with everything under them, then its directories."""
    for p in procs:
        kill_tree(p)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)  # an orphan that came back to us (subreaper): nobody else waits for it
        except ChildProcessError:
            pass


@pytest.fixture(scope="module", autouse=True)
def _no_processes_outlive_their_module() -> Any:
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    left = [p for p in me.children(recursive=True) if p.pid not in before and not _native_build(p)]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    _reap([p.pid for p in left])


def _native_build(proc: Any) -> bool:
    """The native save's background build (rank/native_save.py) outlives its rank on purpose: it fills the user's
    cache once for every later process (and its compiler's children)."""
    import psutil

    try:
        chain = [proc, *proc.parents()]
        return any("ondemand_prof.rank.native_save" in " ".join(p.cmdline()) for p in chain)
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def _cpu_log(request: pytest.FixtureRequest) -> Any:
    """ODP_TEST_CPU_LOG=FILE: each test's CPU (this process and the children reaped meanwhile, seconds) appended to
    FILE, to find what makes the suite slow on 2 cores (module fixtures' processes count where they are reaped)."""
    path = os.environ.get("ODP_TEST_CPU_LOG")
    if not path:
        yield
        return
    import resource

    def used() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    before, wall = used(), time.monotonic()
    yield
    with open(path, "a") as fh:
        fh.write(f"{used() - before:.1f} {time.monotonic() - wall:.1f} {request.node.nodeid}\n")


def _bind_low(s: socket.socket) -> int:
    """Bind `s` to a free loopback port below the kernel's ephemeral range (32768 up); the port."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port in 20000-32767")


def free_port() -> int:
    """A port nothing holds now, chosen below the ephemeral range: a port the kernel picks (bind 0) can be handed
    to any process's outgoing connection before the test's own process binds it."""
    with socket.socket() as s:
        return _bind_low(s)


@pytest.fixture
def down_port() -> Iterator[int]:
    """A port held bound and never listened on while the test runs: connecting is refused, as on a host whose
    daemon is down, and no other process can start listening there meanwhile."""
    with socket.socket() as s:
        yield _bind_low(s)


# ranks started by tests never find a daemon the developer runs; daemon tests pass their own runtime dir
NO_DAEMON_DIR = tempfile.mkdtemp(prefix="odp-nodaemon-")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """This process's NO_DAEMON_DIR goes with it (each xdist worker made its own)."""
    shutil.rmtree(NO_DAEMON_DIR, ignore_errors=True)


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
    env["ONDEMAND_PROF_RUNTIME_DIR"] = NO_DAEMON_DIR
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def start_ranks(args: list[str], world: int = 1, env: dict[str, str] | None = None, cwd: Path | None = None,
                module: str = "ondemand_prof.demo.toy_train", prefix: list[str] | None = None
                ) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        penv = base_env(**(env or {}))
        if world > 1:
            penv.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port)
        procs.append(subprocess.Popen([*(prefix or []), sys.executable, "-m", module, *args], env=penv, cwd=cwd,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str, str]]:
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append((p.returncode, out, err))
    return results


def run_ranks(args: list[str], world: int = 1, **kw: Any) -> list[tuple[int, str, str]]:
    timeout = kw.pop("timeout", 180)
    return wait_all(start_ranks(args, world, **kw), timeout)


def assert_ok(results: list[tuple[int, str, str]]) -> None:
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"


def captures(save_path: Path) -> list[dict[str, Any]]:
    """Published rank directories ({save}/{capture}/{rank dir}/, hidden staging dirs excluded), each metadata
    plus its 'dir' and its capture 'folder'."""
    out = []
    if not save_path.is_dir():
        return out
    for d in sorted(p for folder in save_path.iterdir() if folder.is_dir() for p in folder.iterdir()):
        if d.name.startswith(".") or not d.is_dir():
            continue
        meta = json.loads((d / "metadata.json").read_text())
        meta.update(dir=d, folder=d.parent)
        out.append(meta)
    return out


def load_trace(capture: dict[str, Any]) -> dict[str, Any]:
    path = capture["dir"] / capture["trace_file"]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def trace_steps(capture: dict[str, Any]) -> list[int]:
    trace = load_trace(capture)
    steps = []
    for ev in trace["traceEvents"]:
        name = str(ev.get("name", ""))
        if name.startswith("ProfilerStep#") and ev.get("ph") == "X":
            steps.append(int(name.split("#")[1]))
    return sorted(steps)


def recorded_steps(stdout: str, start: int, end: int) -> tuple[int, int]:
    """The first and last step every rank recorded, from `capture --wait`'s trace lines ("  rank N  PATH  steps
    A..B"): the same on every rank and as many as planned in [start, end); the planned ones, or (a window that
    reached the ranks after its start: a job's first capture plans with the default delivery time, which a loaded
    host can exceed) later, which the output must say ("late by K steps")."""
    recorded = {(int(a), int(b)) for a, b in re.findall(r"^  rank \d+\s+/\S+\s+steps (\d+)\.\.(\d+)$", stdout, re.M)}
    assert len(recorded) == 1, stdout
    ((first, last),) = recorded
    assert last - first == end - start - 1 and (first == start or f"late by {first - start} steps" in stdout), stdout
    return first, last


@pytest.fixture
def save_path(tmp_path: Path) -> Path:
    return tmp_path / "profile"


def wait_for(pred: Callable[[], Any], timeout: float = 60, what: str = "condition", pause: float = 0.02) -> Any:
    """Until pred() is true. A longer `pause` where pred starts a CLI process and the test measures steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(pause)
    raise AssertionError(f"timed out waiting for {what}")


def summaries_written(rank_dirs: Any, timeout: float = 300) -> None:
    """Until every published rank directory's summaries are written (issue 44: a rank says "done" once its trace is
    published, and writes its CSV or profile.db and summary.json after, at idle priority): its metadata.json's
    summary no longer pending (written or failed)."""
    dirs = [Path(d) for d in rank_dirs]

    def written(d: Path) -> bool:
        try:
            meta = json.loads((d / "metadata.json").read_text())
        except (OSError, ValueError):
            return False
        return (meta.get("summary") or {}).get("status") != "pending"

    wait_for(lambda: all(written(d) for d in dirs), timeout, f"the summaries of {len(dirs)} rank(s)", pause=0.05)


# ----------------------------------------------------------------------------------------------------------
# The daemon and the CLI, as real processes (bin/ scripts, as a user runs them from a checkout)

def short_dir(prefix: str) -> Path:
    """A directory with a short path: a unix socket path holds at most 107 bytes (pytest's tmp_path is long)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_daemon(run_dir: Path, state_dir: Path, *extra: str, env: dict[str, str] | None = None
                 ) -> subprocess.Popen:
    proc = subprocess.Popen([str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run_dir), "--state-dir",
                             str(state_dir), *extra], env=base_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (run_dir / "profd.sock").exists() or proc.poll() is not None, 30, "the daemon's socket")
    return proc


def status_lines(path: Path) -> list[dict[str, Any]]:
    """The toy rank's --status-file: a JSON line per step it finished ([] before the first, or mid-write)."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def ctl(run_dir: Path, *args: str, timeout: float = 120, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real CLI against the daemon of `run_dir`; `env`: more of the environment (TMPDIR, as the job's)."""
    return subprocess.run([str(ROOT / "bin" / "ondemandctl"), *args],
                          env=base_env(ONDEMAND_PROF_RUNTIME_DIR=str(run_dir), **(env or {})),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def ctl_json(run_dir: Path, *args: str) -> Any:
    res = ctl(run_dir, *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def live_ranks(run_dir: Path, job: str | None = None) -> list[dict[str, Any]]:
    res = ctl(run_dir, "status", "--json")
    if res.returncode != 0:
        return []
    jobs = json.loads(res.stdout)["jobs"]
    return [r for name, ranks in jobs.items() if job in (None, name) for r in ranks]


# ----------------------------------------------------------------------------------------------------------
# A daemon's test environment: its runtime and state directories (short paths: a unix socket path holds 107
# bytes), where ranks save, and the processes to end (ranks first, then daemons: examples start children)

@pytest.fixture
def dirs() -> Iterator[dict[str, Path]]:
    """A daemon's runtime and state directories alone (short paths), removed after: for a test that starts and
    ends its daemon itself (test_security, test_hardening3)."""
    run_dir, state_dir = short_dir("odpd"), short_dir("odpds")
    yield {"run": run_dir, "state": state_dir}
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    run_dir, state_dir = short_dir("odp"), short_dir("odps")
    procs: list[subprocess.Popen] = []
    daemons: list[subprocess.Popen] = []
    yield {"run": run_dir, "state": state_dir, "save": tmp_path / "profile", "tmp": tmp_path, "procs": procs,
           "daemons": daemons}
    end_test_env([*procs, *daemons], run_dir, state_dir)


def daemon(env: dict[str, Any], *extra: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """The real ondemand-profd of `env`, ended with it."""
    proc = start_daemon(env["run"], env["state"], *extra, env=extra_env)
    env["daemons"].append(proc)
    return proc


# ----------------------------------------------------------------------------------------------------------
# The daemon in this process: its Service driven directly (no sockets), or the Daemon object without its loop

def register_msg(rank: int = 0, world: int = 1, *, job: str = "j", pid: int | None = None, step: int = 100,
                 began: float | None = None, **more: Any) -> dict[str, Any]:
    """A rank's registration as the service takes it (decoded): `pid` 10 + rank unless given; `more` adds or
    replaces fields (defaults: WindowDefaults.to_wire(), step_time, host ...)."""
    return {"type": "register", "job": job, "rank": rank, "world_size": world, "host": "h",
            "pid": 10 + rank if pid is None else pid, "step": step, "began": time.time() if began is None else began,
            **more}


def make_service(state: Path, host: str = "h") -> Any:
    """The daemon's Service over a record store in `state`, every pid alive (the ranks are synthetic)."""
    from ondemand_prof.host.commands import DAEMON_COMMANDS
    from ondemand_prof.host.records import RecordStore
    from ondemand_prof.host.service import Service

    return Service(RecordStore(state), DAEMON_COMMANDS, host=host, runtime_dir=state, state_dir=state,
                   pid_check=lambda pid, thorough: True)


@pytest.fixture
def service(tmp_path: Path) -> Any:
    return make_service(tmp_path)


def inprocess_daemon(tmp_path: Path, ranks: int = 1, **daemon_kw: Any) -> tuple[Any, list[tuple[bytes, bytes]]]:
    """A real Daemon object (its sockets, not its loop), open, with `ranks` SYNTHETIC ranks registered through
    dispatch (routes r/0, r/1, ...); what it sends is kept in the list returned. Close it (d.close())."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.protocol import encode
    from ondemand_prof.core.requests import WindowDefaults
    from ondemand_prof.host.daemon import Daemon

    (tmp_path / "run").mkdir(mode=0o700)
    d = Daemon(tmp_path / "run", tmp_path / "state", **daemon_kw)
    d.open()
    sent: list[tuple[bytes, bytes]] = []
    d._send = lambda route, body: sent.append((route, body))  # noqa: SLF001
    defaults = WindowDefaults.from_config(ProfileConfig(save_path=str(tmp_path))).to_wire()
    for r in range(ranks):
        d.dispatch(b"r/%d" % r, encode("register", job="j", rank=r, world_size=ranks, host="h", pid=os.getpid(),
                                       local_rank=r, save_root=str(tmp_path), defaults=defaults, step=0,
                                       began=time.time(), state="idle", step_time=0.01))
    return d, sent


# ----------------------------------------------------------------------------------------------------------
# The toy rank as one process (--no-dist), and stopping a process (test_security and the modules after it)


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def train(tmp: Path, job: str, *extra: str, env: dict[str, str] | None = None, steps: int = 400,
          log: Path | None = None) -> subprocess.Popen:
    """The toy rank; its output piped, or into `log` for a long run (a full pipe nobody reads blocks its logging)."""
    out = log.open("w") if log is not None else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "ondemand_prof.demo.toy_train", "--no-dist", "--steps", str(steps),
                             "--step-sleep", "0.02", "--profile-min-free-mb", "0", "--profile-job-id", job,
                             "--profile-save-path", str(tmp / "profile"), *extra],
                            env=base_env(**(env or {})), stdout=out, stderr=out, text=True)


def published(save: Path) -> list[Path]:
    return [d for d in save.glob("*/*") if d.is_dir() and not d.name.startswith(".")] if save.is_dir() else []


# ----------------------------------------------------------------------------------------------------------
# One request to a daemon's socket, from a fresh DEALER (test_security, test_daemon)


def request(run_dir: Path, msg: dict[str, Any] | bytes, timeout_ms: int = 10_000) -> dict[str, Any] | None:
    """Send one message from a fresh DEALER; the decoded reply, or None when none came."""
    import zmq

    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{run_dir}/profd.sock")
        s.send(msg if isinstance(msg, bytes) else json.dumps(msg).encode())
        if not s.poll(timeout_ms):
            return None
        return json.loads(s.recv())
    finally:
        ctx.destroy(linger=0)


def status_ok(run_dir: Path) -> bool:
    reply = request(run_dir, {"v": 1, "type": "status", "id": 7})
    return bool(reply) and reply["type"] == "ok" and reply["id"] == 7


# ----------------------------------------------------------------------------------------------------------
# A live job for a whole module: a real daemon and gloo ranks of the toy model, training until the module ends

LIVE_JOB_DEFAULTS: dict[str, Any] = {"world": 2, "args": [], "files": {}, "warm_steps": 40}


@pytest.fixture(scope="module")
def live_job(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A daemon and `world` ranks (`--steps 1000000 --step-sleep 0.02`, a status file) started in a job directory
    of their own (their cwd: the default save path is its ./profile), past `warm_steps` status lines before any
    test; all ended and removed when the module ends. Set by the module's LIVE_JOB dict, or by parametrizing the
    fixture indirectly with one: world, args (more rank arguments, "{work}" in one is the job directory), files
    (name -> text, written in the job directory before the ranks start), warm_steps. What it gives: run, state,
    work, procs, daemon. Its tests share the job: none may rely on another's captures, or the lack of them."""
    spec = {**LIVE_JOB_DEFAULTS, **getattr(request.module, "LIVE_JOB", {}), **getattr(request, "param", {})}
    run, state, work = short_dir("odplj"), short_dir("odpljs"), Path(short_dir("odpljw"))
    for name, text in spec["files"].items():
        (work / name).write_text(text)
    daemon = start_daemon(run, state)
    procs = start_ranks(["--steps", "1000000", "--step-sleep", "0.02", "--status-file", str(work / "steps.jsonl"),
                         *(a.replace("{work}", str(work)) for a in spec["args"])], world=spec["world"],
                        env={"ONDEMAND_PROF_RUNTIME_DIR": str(run)}, cwd=work)
    try:
        wait_for(lambda: len(status_lines(work / "steps.jsonl")) > spec["warm_steps"]
                 or any(p.poll() is not None for p in procs), 180, "the job to warm up")
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        yield {"run": run, "state": state, "work": work, "procs": procs, "daemon": daemon}
    finally:
        end_test_env([*procs, daemon], run, state, work)
