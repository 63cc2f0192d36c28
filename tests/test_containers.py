"""Ranks in containers, with real namespaces (issue 29; root only, as CI runs): "pods" without Docker, made by
unshare: their own pid namespace (the rank is pid 1), host name, network (a loopback only) and mounts, with a /tmp
of their own, the host daemon's runtime directory bound in at /srv/run (a hostPath) and a host directory at
/srv/data (the save volume). One daemon on the host serves the module. A rootless pod is also a user namespace
(the throwaway user of test_security mapped to root) in a root filesystem of its own.

Checked: two pods whose ranks are both pid 1 with the same MASTER_PORT are two jobs, never one that flaps; status
shows the host's pid and the pod's; a torchrun job in a pod; a pod killed mid-capture; the native dump of a rank
holding the GIL, its file in the pod's own /tmp; a mapped uid, refused with what to set by root's daemon and
served by its own user's. The pure parts (default job ids, paths across mounts, the start-up line) run anywhere.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT, base_env, ctl, ctl_json, short_dir, start_daemon, status_lines, wait_for
from ondemand_prof.core.options import default_job_id, local_scope

# the throwaway user (created and removed by test_security's fixture, reused: one copy of that code)
from test_security import other_user  # noqa: F401


def _readable_prefixes() -> list[str]:
    """The directories a rank's interpreter needs (the checkout, the venv, the Python it was made from)."""
    return sorted({os.path.realpath(p) for p in (str(ROOT), sys.prefix, sys.base_prefix)})


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (pid, mount, UTS and network namespaces); CI runs as root"
    hidden = [p for p in _readable_prefixes() if p == "/tmp" or p.startswith("/tmp/")]
    if hidden:  # a pod mounts a tmpfs of its own over /tmp: its rank could not start from there
        return f"the checkout or interpreter is under /tmp ({hidden[0]}), which a pod's own /tmp hides"
    for tool in ("unshare", "ip", "setpriv"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux / iproute2)"
    res = subprocess.run(["unshare", "--pid", "--uts", "--net", "--mount", "--fork", "--mount-proc", "true"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create namespaces here: {res.stderr.strip()}"
    return None


WHY_NOT = _why_not()
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
STEP_S = "0.05"


# ----------------------------------------------------------------------------------------------------------
# The pure parts


@pytest.mark.quick
def test_default_job_ids_name_where_the_job_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single process (no RANK, or a world of 1) is named by its pid and where it runs, never by a
    MASTER_PORT alone; a distributed launch by its port and its master (this host for a loopback one), the same
    on every rank and node; torchrun's agent makes a launch distributed whatever the world size, so the id
    survives its workers' restarts."""
    here = local_scope()
    assert default_job_id({}) == f"pid{os.getpid()}@{here}"
    assert default_job_id({"MASTER_PORT": "29500"}) == f"pid{os.getpid()}@{here}"  # accelerate's one process
    assert default_job_id({"MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1"}) == f"pid{os.getpid()}@{here}"
    dist = {"MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "2"}
    assert default_job_id({"MASTER_PORT": "29500", "WORLD_SIZE": "2"}) == f"port29500@{here}"  # Lightning's rank 0
    assert default_job_id({**dist, "MASTER_ADDR": "127.0.0.1"}) == f"port29500@{here}"
    assert default_job_id({**dist, "MASTER_ADDR": "trainer-master-0"}) == "port29500@trainer-master-0"
    agent = {"TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "29400", "RANK": "0", "WORLD_SIZE": "1"}
    assert default_job_id(agent) == f"port29400@{here}"
    assert default_job_id({**agent, "TORCHELASTIC_RUN_ID": "a1b2"}) == "a1b2"
    assert default_job_id({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", **dist}) == "42.3"
    assert default_job_id({"RANK": "3", "WORLD_SIZE": "4"}) == f"pid{os.getppid()}@{here}"  # the launcher's


@pytest.mark.quick
def test_a_refused_rank_says_so_and_both_fixes() -> None:
    from pathlib import Path as P

    from ondemand_prof.rank.announce import startup_line
    from ondemand_prof.rank.backends import Identity

    ident = Identity(rank=0, world_size=1, local_rank=0, host="h", pid=1, job_id="j", dist_initialized=False)
    line = startup_line(ident, P("/t/capture"), P("/s"), None, "ipc:///r/profd.sock",
                        refused="rank 0 of job 'j' is held by pid 7 on h, which is alive")
    assert "ondemand-profd at ipc:///r/profd.sock REFUSED this rank: rank 0 of job 'j' is held by pid 7" in line
    assert "--profile-job-id NAME or ONDEMAND_PROF_JOB_ID=NAME" in line and "no ondemand-profd answered" not in line
    line = startup_line(ident, P("/t/capture"), P("/s"), None, "ipc:///r/profd.sock", untrusted="it is nobody's")
    assert "not registering with ondemand-profd at ipc:///r/profd.sock: it is nobody's" in line


@pytest.mark.quick
def test_a_path_is_found_again_through_the_hosts_own_mounts(tmp_path: Path) -> None:
    """podpath: a mount point with a space (mountinfo's escapes), and this process's own files (the same mount
    namespace: the same path)."""
    from ondemand_prof.host.podpath import Mount, _unescape, host_path

    assert _unescape(r"/a\040b\134c") == "/a b\\c"
    f = tmp_path / "trace.json"
    f.write_text("{}")
    assert host_path(os.getpid(), str(f)) == str(f)
    assert host_path(os.getpid(), str(f), here=[Mount("0:0", "/", "/")]) is None  # no mount of that filesystem


# ----------------------------------------------------------------------------------------------------------
# Pods


class Pod:
    """A pod: pid 1 is the rank (or its launcher), with the namespaces and mounts the module docstring says.
    `user`: a rootless pod, the user mapped to root in a user namespace of its own, in a root filesystem of its
    own (tmpfs) into which the host's /usr, /etc, /dev and the interpreter's directories are bound. The runtime
    directory is bound read-only, as deploy/kubernetes/training-pod.yaml mounts it (a socket connects on a
    read-only mount); `run_writable`: read-write, as it was before issue 41 (a root pod could swap the socket)."""

    def __init__(self, name: str, argv: list[str], run_dir: Path, base: Path, env: dict[str, str] | None = None,
                 user: dict[str, Any] | None = None, run_writable: bool = False) -> None:
        self.name = name
        self.data = base / f"{name}-data"  # the pod's save volume, as the host sees it
        self.data.mkdir(mode=0o755)
        self.log = base / f"{name}.log"
        penv = base_env(ONDEMAND_PROF_RUNTIME_DIR="/srv/run", **(env or {}))
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in penv.items() if k.startswith(("ONDEMAND_PROF_",
                                                                                           "MASTER_", "RANK", "WORLD")))
        cmd = " ".join(shlex.quote(a) for a in argv)
        inside = (f"hostname {name} && ip link set lo up && cd /srv/data && export {exports} && exec {cmd}")
        read_only = "" if run_writable else "mount -o remount,bind,ro {} && "
        if user is None:
            setup = (f"mount -t tmpfs tmpfs /srv && mkdir /srv/run /srv/data && mount --bind {run_dir} /srv/run && "
                     + read_only.format("/srv/run") +
                     f"mount --bind {self.data} /srv/data && mount -t tmpfs tmpfs /tmp && {inside}")
            outer = ["unshare", "--pid", "--uts", "--net", "--mount", "--fork", "--mount-proc", "sh", "-c", setup]
        else:
            os.chown(self.data, user["uid"], user["gid"])
            root = base / f"{name}-root"
            root.mkdir()
            binds = [("/usr", "usr"), ("/etc", "etc"), ("/dev", "dev"), (str(run_dir), "srv/run"),
                     (str(self.data), "srv/data")] + [(p, p.lstrip("/")) for p in _readable_prefixes()]
            build = [f"mount -t tmpfs -o uid={user['uid']},gid={user['gid']},mode=755 tmpfs {root}", f"cd {root}",
                     "mkdir -p proc tmp " + " ".join(shlex.quote(d) for _, d in binds),
                     "ln -s usr/bin bin && ln -s usr/lib lib && ln -s usr/lib64 lib64 && ln -s usr/sbin sbin",
                     f"chown -hR {user['uid']}:{user['gid']} ."]  # its own: root's inside the pod
            build += [f"mount --rbind {shlex.quote(src)} {shlex.quote(dst)}" for src, dst in binds]
            if read_only:
                build.append(read_only.format("srv/run").removesuffix(" && "))
            rootless = ["setpriv", f"--reuid={user['uid']}", f"--regid={user['gid']}", "--clear-groups",
                        "unshare", "--user", "--map-root-user", "--pid", "--uts", "--net", "--mount", "--fork",
                        f"--root={root}", "--mount-proc", "sh", "-c", inside]
            build.append("exec " + " ".join(shlex.quote(a) for a in rootless))
            outer = ["unshare", "--mount", "--fork", "sh", "-c", " && ".join(build)]
        self.proc = subprocess.Popen(outer, env=penv, stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
                                     start_new_session=True)

    def pid(self) -> int | None:
        """The host's pid of the pod's pid 1 (unshare's child)."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children()
            while kids and kids[0].name() in ("unshare", "setpriv"):  # the rootless pod's second unshare
                kids = kids[0].children()
            return kids[0].pid if kids else None
        except psutil.Error:
            return None

    def kill(self) -> None:
        """The pod goes: its pid 1 killed, which takes every process of its pid namespace with it."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(timeout=30)

    def said(self) -> str:
        return self.log.read_text(errors="replace")


def toy(*extra: str) -> list[str]:
    return [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", "100000", "--step-sleep", STEP_S,
            "--profile-min-free-mb", "0", "--profile-save-path", "/srv/data/profile", "--status-file",
            "/srv/data/steps.jsonl", *extra]


@pytest.fixture(scope="module")
def host() -> Iterator[dict[str, Any]]:
    """One daemon on the host for the module; each test's pods are ended by the test."""
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    run, state, base = short_dir("odpc"), short_dir("odpcs"), short_dir("odpcp")
    os.chmod(base, 0o711)  # a rootless pod's user reaches its root filesystem and volume below it
    proc = start_daemon(run, state)
    yield {"run": run, "state": state, "proc": proc, "base": base}
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    for d in (run, state, base):
        shutil.rmtree(d, ignore_errors=True)
    assert "Traceback" not in err, err[-3000:]


@pytest.fixture
def pods(host: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[list[Pod]]:
    made: list[Pod] = []
    yield made
    for pod in made:
        pod.kill()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for pod in made:
            print(f"--- {pod.name}\n{pod.said()[-3000:]}")


def _pod(host: dict[str, Any], pods: list[Pod], name: str, argv: list[str], **kw: Any) -> Pod:
    pod = Pod(name, argv, kw.pop("run_dir", host["run"]), host["base"], **kw)
    pods.append(pod)
    return pod


def jobs_of(run: Path, prefix: str) -> dict[str, list[dict[str, Any]]]:
    res = ctl(run, "status", "--json")
    if res.returncode != 0:
        return {}
    return {name: rows for name, rows in json.loads(res.stdout)["jobs"].items() if name.startswith(prefix)}


def wait_job(run: Path, prefix: str, ranks: int = 1, timeout: float = 180) -> tuple[str, list[dict[str, Any]]]:
    found = wait_for(lambda: next(((n, r) for n, r in jobs_of(run, prefix).items() if len(r) == ranks), None),
                     timeout, f"a job {prefix}... with {ranks} rank(s)", pause=0.2)
    return found


@needs_namespaces
def test_two_pods_whose_ranks_are_both_pid_1_are_two_jobs(host: dict[str, Any], pods: list[Pod]) -> None:
    """Both pods' ranks are pid 1 with MASTER_PORT=29500 and no RANK (a single process). Before: both were job
    `pid1`, and the daemon took each one's registration for the other's (81 registrations in 45 s), or refused
    one as a second pid 1. Now: two jobs named by their pods, each at its host pid, each captured on its own."""
    a = _pod(host, pods, "pod-a", toy(), env={"MASTER_PORT": "29500"})
    # pod-b's trigger directory is on its volume: the host reaches it where the host has it
    b = _pod(host, pods, "pod-b", toy("--profile-trigger-dir", "/srv/data/trig"), env={"MASTER_PORT": "29500"})
    (job_a, (ra,)), (job_b, (rb,)) = wait_job(host["run"], "pid1@pod-a."), wait_job(host["run"], "pid1@pod-b.")
    assert (ra["pid"], ra["ns_pid"], ra["host"]) == (a.pid(), 1, "pod-a"), ra
    assert (rb["pid"], rb["ns_pid"], rb["host"]) == (b.pid(), 1, "pod-b"), rb
    for _ in range(4):  # nothing flaps: each stays registered once, at its own pid
        now = ctl_json(host["run"], "status")
        assert [(r["pid"], r["registered_at"]) for r in now["jobs"][job_a]] == [(ra["pid"], ra["registered_at"])]
        assert [(r["pid"], r["registered_at"]) for r in now["jobs"][job_b]] == [(rb["pid"], rb["registered_at"])]
        assert not now["conflicts"], now["conflicts"]
        time.sleep(0.5)
    text = ctl(host["run"], "status").stdout
    assert "PID    POD PID" in text or "POD PID" in text.split(job_a, 1)[1].split("\n")[3], text
    row = next(ln for ln in text.split(f"job {job_a}:", 1)[1].splitlines() if ln.startswith("0 "))
    assert row.split()[:4] == ["0", "pod-a", str(a.pid()), "1"], row  # RANK HOST PID POD PID
    for pod, job in ((a, job_a), (b, job_b)):
        res = ctl(host["run"], "capture", "--job", job, "--steps", "2", "--wait", "--timeout", "120")
        assert res.returncode == 0 and "done: 1 of 1 rank(s) wrote a trace" in res.stdout, res.stdout + res.stderr
        # the trace is on the host's volume, and the line says the rank's own name of it
        assert str(pod.data / "profile") in res.stdout and "(in its container: /srv/data/profile/" in res.stdout
        assert list((pod.data / "profile").glob("*/*.pt.trace.json")), res.stdout
        assert "registered with ondemand-profd" in pod.said() and "REFUSED" not in pod.said()
    # the trigger file through the shared directory, from the host (ondemandctl trigger finds it from status)
    assert f"trigger dir: /srv/data/trig (in its container; on this host {b.data / 'trig'})" in text, text
    before = set((b.data / "profile").glob("*/*.pt.trace.json"))
    res = ctl(host["run"], "trigger", "--job", job_b, "--steps", "2", "--wait", "--timeout", "120")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(set((b.data / "profile").glob("*/*.pt.trace.json")) - before) == 1, res.stdout


@needs_namespaces
def test_a_torchrun_job_in_a_pod(host: dict[str, Any], pods: list[Pod]) -> None:
    """torchrun's workers in a pod: one job named by its port and its pod, each rank at its host pid (the pod's
    pid beside it), both captured in one window."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29500",
              "-m", "ondemand_prof.demo.toy_train", "--steps", "100000", "--step-sleep", STEP_S,
              "--profile-min-free-mb", "0", "--profile-save-path", "/srv/data/profile"]
    pod = _pod(host, pods, "pod-t", launch)
    job, rows = wait_job(host["run"], "port29500@pod-t.", ranks=2)
    import psutil

    workers = {p.pid for p in psutil.Process(pod.pid()).children(recursive=True)}
    assert {r["pid"] for r in rows} <= workers and all(r["ns_pid"] not in (None, r["pid"]) for r in rows), rows
    res = ctl(host["run"], "capture", "--job", job, "--ranks", "-1", "--steps", "2", "--wait", "--timeout", "150")
    assert res.returncode == 0 and "done: 2 of 2 rank(s) wrote a trace" in res.stdout, res.stdout + res.stderr
    assert len(list((pod.data / "profile").glob("*/*.pt.trace.json"))) == 2
    # the flight recorder and memory reach inside the pod too; the dumps are named where the host has them
    res = ctl(host["run"], "flight-recorder", "--job", job, "--timeout", "60", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    paths = [r["path"] for r in json.loads(res.stdout)["ranks"].values()]
    assert len(paths) == 2 and all(p.startswith(str(pod.data / "profile")) and os.path.exists(p) for p in paths), paths
    res = ctl(host["run"], "memory", "--job", job, "--ranks", "0", "--steps", "1", "--timeout", "60")
    assert "rank(s) 0: not available on this backend (CPU)" in res.stdout, res.stdout + res.stderr


@needs_namespaces
def test_a_pod_killed_mid_capture(host: dict[str, Any], pods: list[Pod]) -> None:
    """The pod goes while its rank records: the capture says the rank is gone (its host pid exited) at once,
    and the job leaves status."""
    pod = _pod(host, pods, "pod-k", toy())
    job, (row,) = wait_job(host["run"], "pid1@pod-k.")
    res = ctl(host["run"], "capture", "--job", job, "--steps", "5000", "--no-wait", "--json")
    assert res.returncode == 0, res.stderr
    capture_id = json.loads(res.stdout)["capture_id"]
    part = lambda: json.loads(ctl(host["run"], "show", capture_id, "--json").stdout)["parts"]["0"]  # noqa: E731
    wait_for(lambda: part()["state"] == "recording", 120, "the window to record", pause=0.2)
    pod.kill()
    gone = wait_for(lambda: (lambda p: p if p["state"] == "failed" else None)(part()), 30, "the part to fail",
                    pause=0.2)
    assert f"process {row['pid']} on pod-k exited" in gone["error"], gone
    assert not jobs_of(host["run"], "pid1@pod-k.")


@needs_namespaces
def test_a_rank_holding_the_gil_in_a_pod_gets_its_native_dump(host: dict[str, Any], pods: list[Pod]) -> None:
    """The rank's Python threads cannot run; its native-stacks file is in the pod's own /tmp, named with its
    own pid (1). Before: no native dump ("its process is not visible from this daemon": the pod's host name),
    and the file was looked for on the host's /tmp. Now it is signalled at its host pid and its file read
    through the pod's root."""
    pod = _pod(host, pods, "pod-g", toy("--stall-rank", "0", "--stall-at-step", "20", "--stall-s", "60",
                                        "--stall-holding-gil"))
    job, _ = wait_job(host["run"], "pid1@pod-g.")
    wait_for(lambda: any("stall" in line for line in status_lines(pod.data / "steps.jsonl")), 120, "the stall")
    wait_for(lambda: job in ctl_json(host["run"], "status")["silent"], 30, "the rank to go silent", pause=0.3)
    res = ctl(host["run"], "stacks", "--job", job, "--timeout", "3")
    assert "1 by native dump (faulthandler)" in res.stdout and "NATIVE DUMP" in res.stdout, res.stdout + res.stderr
    assert "_hold_gil" in res.stdout or "toy_train.py" in res.stdout, res.stdout


@needs_namespaces
def test_a_rank_with_a_mapped_uid(host: dict[str, Any], pods: list[Pod], other_user: dict[str, Any],  # noqa: F811
                                  tmp_path: Path) -> None:
    """A rootless pod: the throwaway user is root in its own user namespace. Root's daemon is refused, and the
    start-up line says why and what to set; the user's own daemon (its runtime directory shared into the pod)
    serves it: status names the kernel's uid as the owner and both pids, and its capture lands on the host's
    volume owned by that user."""
    user = other_user
    refused = _pod(host, pods, "pod-u1", toy(), user=user)
    wait_for(lambda: "not registering with ondemand-profd at ipc:///srv/run/profd.sock" in refused.said(), 120,
             "the rootless rank's start-up line")
    said = refused.said()
    assert f"uid 0 here being uid {user['uid']} on the host" in said and f"run ondemand-profd as uid {user['uid']}" \
        in said and "hostUsers: true" in said, said
    assert not jobs_of(host["run"], "pid1@pod-u1.")
    # the user's own daemon, started as that user (in a mount namespace where its interpreter is reachable)
    run, state = short_dir("odpcu"), short_dir("odpcus")
    for d in (run, state):
        os.chown(d, user["uid"], user["gid"])
    daemon = _as_user(user, [str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run), "--state-dir",
                             str(state)], tmp_path / "profd.log")
    try:
        wait_for(lambda: (run / "profd.sock").exists(), 60, "the user's daemon")
        pod = _pod(host, pods, "pod-u2", toy(), user=user, run_dir=run)
        out = wait_for(lambda: (lambda r: r.stdout if r.returncode == 0 and "pid1@pod-u2." in r.stdout else None)(
            _ctl_as(user, run, "status", "--json")), 120, "the rootless rank to register", pause=0.3)
        (job, rows), = json.loads(out)["jobs"].items()
        assert [(r["uid"], r["ns_pid"], r["pid"]) for r in rows] == [(user["uid"], 1, pod.pid())], rows
        text = _ctl_as(user, run, "status").stdout
        assert f"owner uid {user['uid']} ({user['name']})" in text, text
        res = _ctl_as(user, run, "capture", "--job", job, "--steps", "2", "--wait", "--timeout", "120")
        assert res.returncode == 0 and "done: 1 of 1 rank(s) wrote a trace" in res.stdout, res.stdout + res.stderr
        (trace,) = (pod.data / "profile").glob("*/*.pt.trace.json")
        assert trace.stat().st_uid == user["uid"] and str(trace) in res.stdout, res.stdout
    finally:
        import psutil

        for proc in psutil.Process(daemon.pid).children(recursive=True):  # the daemon, under unshare
            proc.terminate()
        daemon.wait(timeout=30)
        for d in (run, state):
            shutil.rmtree(d, ignore_errors=True)


def _reach_python() -> str:
    """Shell commands that let another user reach this interpreter in a mount namespace of its own: an
    owner-only directory above one it needs (a venv under /root) is covered with a tmpfs, the needed one bound
    back into it."""
    cmds, stash = [], short_dir("odpcr")
    for i, need in enumerate(_readable_prefixes()):
        parts = Path(need).parts
        for depth in range(2, len(parts) + 1):
            top = Path(*parts[:depth])
            if not os.stat(top).st_mode & 0o001:
                keep = stash / str(i)
                keep.mkdir()
                cmds += [f"mount --bind {shlex.quote(need)} {keep}", f"mount -t tmpfs -o mode=755 tmpfs {top}",
                         f"mkdir -p {shlex.quote(need)}", f"mount --bind {keep} {shlex.quote(need)}"]
                break
    return " && ".join(cmds) or "true"


def _as_user(user: dict[str, Any], argv: list[str], log: Path | None = None) -> subprocess.Popen:
    drop = ["setpriv", f"--reuid={user['uid']}", f"--regid={user['gid']}", "--clear-groups", *argv]
    return subprocess.Popen(["unshare", "--mount", "--fork", "sh", "-c",
                             _reach_python() + " && cd /tmp && exec " + " ".join(shlex.quote(a) for a in drop)],
                            env=base_env(), stdout=subprocess.PIPE if log is None else subprocess.DEVNULL,
                            stderr=subprocess.PIPE if log is None else log.open("w"), text=True)


def _ctl_as(user: dict[str, Any], run: Path, *args: str) -> subprocess.CompletedProcess:
    proc = _as_user(user, [str(ROOT / "bin" / "ondemandctl"), args[0], "--runtime-dir", str(run), *args[1:]])
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _daemon_pid(launcher: subprocess.Popen) -> int | None:
    """The daemon's pid (on the host) under an `unshare --fork` launcher: its child."""
    import psutil

    try:
        kids = psutil.Process(launcher.pid).children()
    except psutil.Error:
        return None
    return kids[0].pid if kids else None


def _ctl_in(pid: int, run: Path, *args: str) -> subprocess.CompletedProcess:
    """ondemandctl in the pid and mount namespaces of process `pid`, as `kubectl exec` into a daemon's pod runs
    it (from the host, a daemon in a container's pid namespace is not trusted: issue 41, 2)."""
    return subprocess.run(["nsenter", "-t", str(pid), "-p", "-m", "--", str(ROOT / "bin" / "ondemandctl"), *args],
                          env=base_env(ONDEMAND_PROF_RUNTIME_DIR=str(run)), capture_output=True, text=True,
                          timeout=120)


@needs_namespaces
def test_a_daemon_that_cannot_see_the_pods_pids(host: dict[str, Any], pods: list[Pod]) -> None:
    """The daemon in a pid namespace of its own (a DaemonSet without hostPID): the kernel gives it pid 0 for a
    pod's rank. Before: refused as "the process that opened this connection (pid 0) has exited", with a fix
    about job ids. Now it registers by its uid and its word, status says what it cannot do and what to set,
    and capture and in-process stacks work, from ondemandctl in the daemon's namespaces (from the host, the CLI
    says that the process behind the socket is a container's)."""
    run, state = short_dir("odpcn"), short_dir("odpcns")
    daemon = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", str(ROOT / "bin" / "ondemand-profd"),
                               "--runtime-dir", str(run), "--state-dir", str(state)], env=base_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (run / "profd.sock").exists(), 60, "the daemon in its own pid namespace")
        inner = wait_for(lambda: _daemon_pid(daemon), 30, "the daemon's pid")
        inside = functools.partial(_ctl_in, inner, run)
        res = ctl(run, "status")
        assert res.returncode == 4 and "runs in a pid namespace below ours" in res.stderr, res.stdout + res.stderr
        pod = _pod(host, pods, "pod-n", toy(), run_dir=run)
        found = wait_for(lambda: [(n, r) for n, r in json.loads(inside("status", "--json").stdout or "{}").get(
            "jobs", {}).items() if n.startswith("pid1@pod-n.")], 180, "the pod's rank", pause=0.2)
        (job, (row,)), = found
        assert row["pid_seen"] is False and row["pid"] == 1, row
        text = inside("status").stdout
        assert "in a pid namespace this daemon does not see" in text and "hostPID: true" in text, text
        assert "REFUSED" not in pod.said() and "registered with ondemand-profd" in pod.said()
        res = inside("capture", "--job", job, "--steps", "2", "--wait", "--timeout", "120")
        assert res.returncode == 0 and "done: 1 of 1 rank(s) wrote a trace" in res.stdout, res.stdout + res.stderr
        assert "(in its container's own filesystem" in res.stdout, res.stdout
        assert list((pod.data / "profile").glob("*/*.pt.trace.json"))
        res = inside("stacks", "--job", job, "--timeout", "5")
        assert res.returncode == 0 and "1 answered in-process" in res.stdout, res.stdout + res.stderr
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait(timeout=30)
        for d in (run, state):
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# The Kubernetes deployment (deploy/kubernetes/), checked against Kubernetes' own schemas


@pytest.mark.quick
def test_the_kubernetes_manifests_are_valid() -> None:
    """Every resource in deploy/kubernetes/ passes kubernetes-validate (the API's OpenAPI schemas, bundled:
    no cluster), strictly (an unknown field is an error); the DaemonSet and the training pod share the runtime
    directory, and the validator does catch a wrong field."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
    import yaml

    docs = {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
            for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))}
    assert set(docs) == {"ondemand-profd.yaml", "training-pod.yaml"}, docs
    version = kv.latest_version()
    for name, resources in docs.items():
        for resource in resources:
            kv.validate(resource, version, strict=True)  # raises ValidationError, naming the field
    daemonset = next(d for d in docs["ondemand-profd.yaml"] if d["kind"] == "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    pod = docs["training-pod.yaml"][0]["spec"]
    runtime = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}["runtime"]
    assert runtime in [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
    # read-only in the pods (issue 41, 2): a root pod that can write there can put its own socket in the daemon's
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[runtime].get("readOnly") is True, mounts[runtime]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["ONDEMAND_PROF_RUNTIME_DIR"] == runtime
    command = spec["containers"][0]["command"]
    assert command[command.index("--runtime-dir") + 1] == runtime and spec["hostPID"] is True
    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["hostPid"] = True  # a misspelt field
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, version, strict=True)
