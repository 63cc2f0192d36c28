"""The rank's helpers (the native saver thread, the forked saver, the post-processing child, the native build)
run beside training without slowing it, and start from nothing a job's directory can plant.

Priority: SCHED_IDLE where available (ONDEMAND_PROF_EXPORT_SCHED=nice: 10 nice levels down instead), on every CPU
but the one the training thread was last on (ONDEMAND_PROF_HELPER_CPUS=all: anywhere). A helper still at
SCHED_IDLE after RAISE_AFTER_S (every core busy at normal priority, which SCHED_IDLE yields to almost entirely) is
raised to the normal policy 10 nice levels down, so the trace is not held until the load ends.

Child processes: `python -m` puts the working directory first on sys.path, and a rank's working directory may be
writable by others (a 1777 or group project directory): a planted `json.py` or `ondemand_prof/` there would run as
the job's owner. python_child() starts them in a fixed directory with safe path handling (-P, PYTHONSAFEPATH).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ..core.processes import proc_stat_fields

log = logging.getLogger(__name__)

SCHED_ENV = "ONDEMAND_PROF_EXPORT_SCHED"
CPUS_ENV = "ONDEMAND_PROF_HELPER_CPUS"  # auto: off the training thread's core; all: anywhere
FALLBACK_NICE = 10
# A helper still at SCHED_IDLE after this long is on a host whose cores are all kept busy at normal priority (CPU
# training, data loader workers): SCHED_IDLE yields to that almost entirely, and the trace would wait for the load
# to end (minutes; `capture --wait` times out). It is then moved to the normal policy FALLBACK_NICE levels down.
RAISE_AFTER_S = 10.0
# ... and sooner for a small job: a post-processing child of a trace under SMALL_TRACE_BYTES needs about 0.1 s of
# CPU (interpreter start included), which at nice 10 takes about that much from training, once, while at SCHED_IDLE
# on busy cores it waited seconds: a 47 KB trace of tiny steps took 5-10 s to appear (issue 32)
SMALL_TRACE_BYTES = 4 << 20
SMALL_RAISE_AFTER_S = 1.0
# A rank's summaries (CSV or SQLite, summary.json) are written after its trace is published and "done" said
# (issue 44): nobody waits on them, so their child stays at SCHED_IDLE for SUMMARY_RAISE_AFTER_S and is then
# raised only to SUMMARY_NICE (about 1.5 % of a core beside one normal task), and its CPU time is capped
# (postprocess.summary_cpu_limit).
SUMMARY_RAISE_AFTER_S = 60.0
SUMMARY_NICE = 19
# ... and started only once the job leaves a CPU free (issue 44 item 7), for at most SUMMARY_DEFER_S: a job whose
# own threads keep every CPU it may use busy (CPU training with as many intra-op threads as cores) is slowed by a
# summary child even at SCHED_IDLE, since the kernel balances a CPU running an idle-class task at a busy CPU's
# interval (perf sched: the child held one core 50 ms while both training threads shared the other, one step +68
# ms). ONDEMAND_PROF_SUMMARY_DEFER_S: another bound (0: start at once, as before).
SUMMARY_DEFER_S = 30.0
SUMMARY_DEFER_ENV = "ONDEMAND_PROF_SUMMARY_DEFER_S"
SPARE_SAMPLE_S = 0.25  # how long the job's CPU use is measured each time
SPARE_CPU = 0.75  # a CPU counts as free when the job leaves this much of one unused
CHILD_CWD = "/"  # where every child starts: root's, never writable by a job's neighbours


def python_child(module: str, *args: str, site: bool = True, bare: tuple[str, ...] = ()
                 ) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `python -m module args` as a helper of this rank: nothing is
    imported from the working directory or an empty PYTHONPATH entry (-P and PYTHONSAFEPATH on Python 3.11+; the
    child's cwd is CHILD_CWD on every version, pass cwd=CHILD_CWD), and this package is found where it was loaded
    from. `site=False` (-S): a child that needs only the standard library and this package skips site-packages and
    its .pth files (the post-processing child: 15% of its CPU, which it spends at idle priority). `bare`: packages
    of ours made importable without running their __init__ (the package root's imports the whole rank side, the
    hook and the options table; report's the reading pool: 0.15 s of a post-processing child's 0.2 s of CPU on a
    small trace, issue 44): the module then runs through runpy, as -m runs it, from `python -c`."""
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[2])  # the directory holding ondemand_prof/
    # an empty entry in PYTHONPATH means the working directory: dropped
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([package_parent, *rest])
    env["PYTHONSAFEPATH"] = "1"
    flags = (["-P"] if sys.version_info >= (3, 11) else []) + ([] if site else ["-S"])
    if not bare:
        return [sys.executable, *flags, "-m", module, *args], env
    packages = {name: os.path.join(package_parent, *name.split(".")) for name in bare}
    code = (f"import sys, types, runpy\n"
            f"for name, path in {packages!r}.items():\n"
            f"    m = types.ModuleType(name); m.__path__ = [path]; m.__package__ = name; sys.modules[name] = m\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return [sys.executable, *flags, "-c", code, *args], env


def idle_priority_enabled() -> bool:
    return hasattr(os, "SCHED_IDLE") and os.environ.get(SCHED_ENV, "idle").strip().lower() != "nice"


_training_cpu: int | None = None  # the CPU the training thread was on when its last window was collected


def note_training_cpu() -> None:
    """On the training thread, at a window's end: remember its CPU, which the helpers then leave to it
    (/proc/thread-self/stat field 39; about 20 us)."""
    global _training_cpu
    try:
        _training_cpu = int(proc_stat_fields("/proc/thread-self/stat")[36])
    except (OSError, ValueError, IndexError):
        _training_cpu = None


def helper_cpus() -> list[int]:
    """The CPUs the helpers (native saver thread, post-processing child) are pinned to: every CPU this process may
    use except the one its training thread was last on; [] (no pinning) when that leaves none, when the CPU is
    unknown, or with ONDEMAND_PROF_HELPER_CPUS=all. The kernel may move the training thread later; the helpers
    run at idle priority anyway, so pinning only keeps them off its caches and its wake-ups."""
    if _training_cpu is None or os.environ.get(CPUS_ENV, "auto").strip().lower() == "all":
        return []
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return []
    rest = sorted(allowed - {_training_cpu})
    return rest if rest and len(rest) < len(allowed) else []


def summary_defer_s() -> float:
    """How long a summary waits at most for a free CPU (SUMMARY_DEFER_S, or ONDEMAND_PROF_SUMMARY_DEFER_S from 0 to
    3600; a bad value is logged and the default used)."""
    raw = os.environ.get(SUMMARY_DEFER_ENV, "").strip()
    if not raw:
        return SUMMARY_DEFER_S
    try:
        value = float(raw)
        if not 0 <= value <= 3600:
            raise ValueError("not from 0 to 3600")
    except ValueError as exc:
        log.warning("ondemand_prof: %s=%r ignored (%s): summaries wait at most %.0f s for a free CPU",
                    SUMMARY_DEFER_ENV, raw, exc, SUMMARY_DEFER_S)
        return SUMMARY_DEFER_S
    return value


def job_leaves_a_cpu(sample_s: float = SPARE_SAMPLE_S) -> bool:
    """Whether this process (the training job: every thread of it, ours included) left at least SPARE_CPU of one of
    the CPUs it may use unused over the next `sample_s` (its CPU time against the wall clock; sleeps that long).
    True on a process confined to one CPU: there SCHED_IDLE does keep a helper out of the job's way (the balancing
    that defeats it needs two CPUs)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    if allowed < 2:
        return True
    wall0, cpu0 = time.monotonic(), time.process_time()
    time.sleep(sample_s)
    used = (time.process_time() - cpu0) / max(1e-6, time.monotonic() - wall0)
    return used <= allowed - SPARE_CPU


def wait_for_a_spare_cpu(limit_s: float, stop: Callable[[], bool]) -> float:
    """Wait until the job leaves a CPU free (job_leaves_a_cpu), at most `limit_s`, or until stop() is true (the
    profiler closes). Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s and not stop():
        if job_leaves_a_cpu(min(SPARE_SAMPLE_S, max(0.01, limit_s - (time.monotonic() - started)))):
            break
    return time.monotonic() - started


def lower_priority(pid: int) -> None:
    """Make process `pid` (0: this one) run only on cores nothing else wants: SCHED_IDLE where available and
    not turned off, else 10 nice levels below where it is. Best effort."""
    try:
        if idle_priority_enabled():
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, pid) + FALLBACK_NICE))
    except (OSError, AttributeError):
        pass


def raise_priority(pid: int, after_s: float | None = None, nice: int = FALLBACK_NICE, why: str | None = None) -> None:
    """A helper process left at SCHED_IDLE too long (RAISE_AFTER_S): each of its threads to the normal policy,
    `nice` levels down (FALLBACK_NICE; a summary, which nobody waits on, SUMMARY_NICE). Best effort; nothing to
    do when it was lowered by nice levels only. `why`: what the log line says instead (another reason)."""
    if not idle_priority_enabled():
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (OSError, AttributeError):
            pass
    if why is not None:
        log.debug("ondemand_prof: a trace helper (pid %d) raised to nice %d: %s", pid, nice, why)
        return
    log.info("ondemand_prof: a trace helper (pid %d) still running after %.0f s at idle priority (every core is "
             "busy): raised to nice %d", pid, RAISE_AFTER_S if after_s is None else after_s, nice)


def system_tool(name: str) -> str | None:
    """/usr/bin/NAME or /bin/NAME where it is a regular file owned by root that nobody else can write (never a
    PATH lookup: a job's PATH or working directory is not ours to trust); None otherwise."""
    import stat

    for folder in ("/usr/bin", "/bin"):
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022 and os.access(path, os.X_OK):
            return path
    return None


_idle_launcher: list[str] | None = None


def idle_launcher() -> list[str]:
    """The words that start a helper already at SCHED_IDLE: util-linux's `chrt --idle 0`, which lowers itself and
    execs the helper, so that not one instruction of the helper's interpreter start runs at normal priority (set
    from here after exec, it ran until this thread had the GIL back and the CPU to lower it: 0.2-2.4 ms of a
    post-processing child's CPU measured on a quiet machine, and on cores that training keeps busy, the start-up's
    tens of ms, issue 44 item 7). Checked once a process (`chrt --idle 0 true` must work: a seccomp profile may
    refuse sched_setscheduler); [] where there is no such chrt, or in nice mode (SCHED_ENV)."""
    global _idle_launcher
    if not idle_priority_enabled():
        return []
    if _idle_launcher is None:
        chrt, true = system_tool("chrt"), system_tool("true")
        words: list[str] = []
        if chrt is not None and true is not None:
            try:
                done = subprocess.run([chrt, "--idle", "0", true], cwd=CHILD_CWD, capture_output=True, timeout=10)
                words = [chrt, "--idle", "0"] if done.returncode == 0 else []
            except (OSError, subprocess.SubprocessError):
                pass
        _idle_launcher = words
    return list(_idle_launcher)


def spawn_background(cmd: list[str], env: dict[str, str], timeout_s: float,
                     raise_after_s: float | None = None, *, nice: int = FALLBACK_NICE,
                     started: Callable[[int], None] | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) with the child at background priority, off the training
    thread's core (helper_cpus). The child starts at SCHED_IDLE where idle_launcher() can (never preexec_fn, which
    runs Python between fork and exec in a process with other threads); its priority and CPUs are (also) set from
    here right after exec. Still at SCHED_IDLE after `raise_after_s` (default RAISE_AFTER_S), it is raised to
    `nice` (raise_priority). `started(pid)`: told the child's pid once it runs (a caller that may raise it sooner:
    raise_priority)."""
    raise_after_s = RAISE_AFTER_S if raise_after_s is None else raise_after_s
    with subprocess.Popen([*idle_launcher(), *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=CHILD_CWD) as proc:
        lower_priority(proc.pid)
        cpus = helper_cpus()
        if cpus:
            try:
                os.sched_setaffinity(proc.pid, cpus)
            except OSError:
                pass
        if started is not None:
            started(proc.pid)
        try:
            try:
                out, err = proc.communicate(timeout=min(raise_after_s, timeout_s))
            except subprocess.TimeoutExpired:
                if timeout_s <= raise_after_s:
                    raise
                raise_priority(proc.pid, raise_after_s, nice)
                out, err = proc.communicate(timeout=timeout_s - raise_after_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
