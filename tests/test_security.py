"""Hardening on one host (issue 9): hostile input, squatted directories, spoofed peers, leftovers.

Everything runs for real: a real ondemand-profd on a real socket, real clients, real rank processes, and, where
the suite runs as root, a real second user (created with useradd and removed after) for the cross-user cases.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from conftest import ROOT, base_env, ctl, ctl_json, published, register_msg, request, short_dir, start_daemon, \
    status_lines, status_ok, stop, train, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="unix sockets, SO_PEERCRED and /proc: Linux only")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# ----------------------------------------------------------------------------------------------------------
# 3. No input kills or stalls anything


HOSTILE: list[bytes] = [
    b"[" * 60_000,  # deeply nested: RecursionError in json, which once killed the daemon
    b"{\"a\":" * 20_000 + b"1" + b"}" * 20_000,
    b'{"v":1,"type":"status","id":' + b"[" * 500 + b"]" * 500 + b"}",
    b"x" * 70_000,  # over the message limit
    b"\xff\xfe\x00garbage",
    b'{"v":1,"type":"register","job":"j","rank":0,"world_size":1,"host":"h","pid":1,"step":0,"began":NaN}',
    b'{"v":1,"type":"register","job":"j","rank":0,"world_size":1,"host":"h","pid":' + b"9" * 31 + b',"step":0}',
    b'{"v":1,"type":"register","job":"j","rank":0,"world_size":1,"host":"h","pid":1' + b"0" * 29 + b',"step":0}',
    b'{"v":1,"type":"register","job":"j","rank":0,"world_size":1,"host":"h","pid":1,"step":1e400}',
    b'{"v":1,"type":"hb","step":Infinity}',
    b'{"v":1,"type":"hb","step":' + b"1" * 5000 + b"}",
    b'{"v":1,"type":"capture","id":1,"request":{"ranks":"0-20000000","steps":1}}',
    b'{"v":1,"type":"status","id":1,"job":["x"]}',
    b'{"v":1,"type":"show","id":1,"capture_id":' + b"[" * 100 + b"]" * 100 + b"}",
    b'{"v":1,"type":"capture","id":1',  # truncated
    b"",
]


def test_hostile_messages_never_kill_the_daemon_and_memory_stays_bounded(dirs: dict[str, Path]) -> None:
    proc = start_daemon(dirs["run"], dirs["state"])
    try:
        assert status_ok(dirs["run"])
        before = rss_kb(proc.pid)
        for round_ in range(3):
            for body in HOSTILE:
                reply = request(dirs["run"], body, timeout_ms=2000)
                # each bad message is answered with an error (or dropped when over the frame limit), never served
                assert reply is None or reply["type"] == "error", (body[:80], reply)
                assert proc.poll() is None, f"the daemon died on {body[:80]!r}"
            assert status_ok(dirs["run"]), "the next good request was not answered"
        # a registration with numbers that used to break every status request
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(f"ipc://{dirs['run']}/profd.sock")
        reg = {"v": 1, "type": "register", "job": "evil", "rank": 0, "world_size": 1, "host": "h", "pid": os.getpid(),
               "step": 0, "began": -1e308, "step_time": 1e-300, "local_rank": [[[]]], "recent": "abc"}
        s.send(json.dumps(reg).encode())
        s.send(json.dumps({"v": 1, "type": "hb", "step": 3, "began": 1e300, "step_time": 1e-300}).encode())
        time.sleep(0.3)
        res = ctl(dirs["run"], "status", "--json")
        assert res.returncode == 0, res.stderr
        ranks = json.loads(res.stdout)["jobs"].get("evil", [])
        assert all(r["step_time_s"] is None for r in ranks)
        ctx.destroy(linger=0)
        assert rss_kb(proc.pid) - before < 64 * 1024, "the daemon's memory grew by more than 64 MB"
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_ctl_rank_range_is_bounded_before_it_is_expanded(dirs: dict[str, Path]) -> None:
    proc = start_daemon(dirs["run"], dirs["state"])
    try:
        res = ctl(dirs["run"], "capture", "--ranks", "0-20000000", "--steps", "1")
        assert res.returncode != 0 and "out of range" in res.stderr and "Traceback" not in res.stderr
        # sent straight to the daemon, past the CLI's own check
        reply = request(dirs["run"], {"v": 1, "type": "capture", "id": 3, "request": {"ranks": "0-20000000",
                                                                                       "steps": 1}})
        assert reply is not None and reply["type"] == "error"
        assert status_ok(dirs["run"])
    finally:
        stop(proc)


def test_ctl_reports_a_hostile_reply_without_a_traceback(tmp_path: Path) -> None:
    """A fake daemon (our own user's, so it passes the owner check) answers with 60 KB of nesting."""
    run_dir = short_dir("odpfake")
    try:
        ctx = zmq.Context()
        srv = ctx.socket(zmq.ROUTER)
        srv.bind(f"ipc://{run_dir}/profd.sock")
        proc = subprocess.Popen([str(ROOT / "bin" / "ondemandctl"), "status"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=base_env(ONDEMAND_PROF_RUNTIME_DIR=str(run_dir)))
        assert srv.poll(20_000)
        route, _ = srv.recv_multipart()
        srv.send_multipart([route, b"[" * 60_000])
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "bad reply from the daemon" in err and "Traceback" not in err, err
        ctx.destroy(linger=0)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


FLOOD = r"""
import sys, time, zmq, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ctx = zmq.Context(io_threads=2)
ctx.set(zmq.MAX_SOCKETS, 2000)
socks = []
for i in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(sys.argv[1]); socks.append(s)
time.sleep(3)
for s in socks:
    s.close()
ctx.term()
print("done")
"""


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_more_clients_than_file_descriptors_do_not_abort_the_daemon(dirs: dict[str, Path]) -> None:
    """libzmq aborts on EMFILE in accept(); the daemon stops accepting before that and serves again after."""
    if (resource_hard := _hard_nofile()) < 4096:
        pytest.skip(f"the flood client needs 4096 descriptors (hard limit {resource_hard})")
    proc = subprocess.Popen(["prlimit", "--nofile=1024", str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir",
                             str(dirs["run"]), "--state-dir", str(dirs["state"])], env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (dirs["run"] / "profd.sock").exists() or proc.poll() is not None, 30, "the socket")
        flood = subprocess.run([sys.executable, "-c", FLOOD, f"ipc://{dirs['run']}/profd.sock", "1100"],
                               capture_output=True, text=True, timeout=120)
        assert flood.returncode == 0, flood.stderr
        assert proc.poll() is None, "the daemon died under 1100 connections with 1024 descriptors"
        wait_for(lambda: status_ok(dirs["run"]), 300, "a good request to succeed after the flood")
        res = ctl(dirs["run"], "status")
        assert res.returncode == 0, res.stderr
    finally:
        out, err = stop(proc)
    assert "Too many open files" not in err and proc.returncode == 0, err[-3000:]
    assert "not accepting new connections" in err  # it said what happened and what to do


def _hard_nofile() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


# ----------------------------------------------------------------------------------------------------------
# A throwaway second user, for the cross-user cases (root only)


@pytest.fixture(scope="module")
def other_user() -> Iterator[dict[str, Any]]:
    if os.getuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("cross-user cases need root and useradd (they create a throwaway user); running as uid "
                    f"{os.getuid()}")
    tag = f"{os.getpid() % 100000}"
    name, group = f"odpt{tag}", f"odptg{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    subprocess.run(["useradd", "-M", "-N", "-g", group, "-s", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        pw = pwd.getpwnam(name)
        yield {"name": name, "group": group, "uid": pw.pw_uid, "gid": pw.pw_gid}
    finally:
        _end_processes_of(name)  # userdel refuses a user who still has processes (and the user would stay)
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _end_processes_of(name: str) -> None:
    import psutil

    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    procs = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def as_user(user: dict[str, Any], code: str, *args: str) -> subprocess.Popen:
    """Python `code` run as `user`. The interpreter here may live where only root can read (a venv under
    /root): the child imports as root, then drops to the user before it does anything (`drop()`)."""
    prelude = (f"import os\ndef drop():\n    os.setgroups([{user['gid']}]); os.setgid({user['gid']}); "
               f"os.setuid({user['uid']})\n")
    return subprocess.Popen([sys.executable, "-c", prelude + code, *args], cwd="/tmp", env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ----------------------------------------------------------------------------------------------------------
# 1. Directories we create are ours


def _squat_and_trigger(tmp_path: Path, prepare: Any, job: str) -> tuple[str, Path]:
    """Prepare the default trigger dir's location with `prepare(path)`, start a rank, trigger it through the
    fallback directory it chose, and return its log and the fallback."""
    tmpdir, xdg = tmp_path / "tmp", tmp_path / "xdg"
    tmpdir.mkdir()
    xdg.mkdir(mode=0o700)
    squatted = tmpdir / f"ondemand_prof-{os.getuid()}" / job
    prepare(squatted)
    steps = tmp_path / "steps.jsonl"
    proc = train(tmp_path, job, "--status-file", str(steps), env={"TMPDIR": str(tmpdir), "XDG_RUNTIME_DIR": str(xdg)})
    fallback = xdg / "ondemand_prof" / job
    try:
        # a step taken: the trigger was opened before the loop (one written earlier is, rightly, not acted on)
        wait_for(lambda: status_lines(steps) or proc.poll() is not None, 300, "training to start")
        (fallback / "capture").write_text('{"steps": 1}')
        wait_for(lambda: published(tmp_path / "profile") or proc.poll() is not None, 300, "a capture")
    finally:
        _, err = stop(proc)
    assert published(tmp_path / "profile"), err[-3000:]
    assert (fallback.stat().st_mode & 0o777) == 0o700
    return err, squatted


def test_world_writable_trigger_dir_is_refused_and_a_private_one_used(tmp_path: Path) -> None:
    def prepare(d: Path) -> None:
        d.mkdir(parents=True)
        (d / "capture.status").mkdir()
        for p in (d.parent, d, d / "capture.status"):
            os.chmod(p, 0o777)

    err, squatted = _squat_and_trigger(tmp_path, prepare, "squat")
    assert "not using trigger directory" in err and "writable by others" in err, err[-3000:]
    assert list((squatted / "capture.status").iterdir()) == []  # nothing of ours was written there


def test_symlinked_status_dir_and_file_in_the_way_are_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def link(d: Path) -> None:
        d.mkdir(parents=True, mode=0o700)
        d.parent.chmod(0o700)
        (d / "capture.status").symlink_to(elsewhere)

    err, _ = _squat_and_trigger(tmp_path, link, "linked")
    assert "symbolic link" in err and list(elsewhere.iterdir()) == [], err[-3000:]

    def blocker(d: Path) -> None:
        d.parent.write_text("a regular file where our directory goes")

    sub = tmp_path / "b"
    sub.mkdir()
    err, _ = _squat_and_trigger(sub, blocker, "blocked")
    assert "not using trigger directory" in err


def test_trigger_dir_owned_by_another_user_is_refused(tmp_path: Path, other_user: dict[str, Any]) -> None:
    def prepare(d: Path) -> None:
        d.mkdir(parents=True, mode=0o700)
        for p in (d.parent, d):
            os.chown(p, other_user["uid"], other_user["gid"])

    err, squatted = _squat_and_trigger(tmp_path, prepare, "owned")
    assert f"belongs to uid {other_user['uid']}" in err, err[-3000:]


@pytest.mark.quick
def test_job_ids_cannot_leave_the_trigger_base() -> None:
    from ondemand_prof.rank.triggers import default_trigger_dir, job_dir_name

    for bad in ("..", ".", "../../etc", "a/b", "/abs", "...", ""):
        name = job_dir_name(bad)
        assert name not in (".", "..") and "/" not in name and name
        assert default_trigger_dir(bad).parent.name == f"ondemand_prof-{os.getuid()}"


@pytest.mark.quick
def test_atomic_writes_never_follow_a_planted_link(tmp_path: Path) -> None:
    from ondemand_prof.core.files import write_json_atomic
    from ondemand_prof.rank.triggers import claim_decision

    victim = tmp_path / "victim"
    victim.write_text("precious")
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    (d / "rank0.json").symlink_to(victim)
    write_json_atomic(d / "rank0.json", {"a": 1})
    assert victim.read_text() == "precious" and not (d / "rank0.json").is_symlink()
    (d / ".window-v1.json").symlink_to(victim)  # a decision that is a link is not read, nor written through
    assert claim_decision(d, "v1", {"start_step": 5, "anchor_step": 4})["start_step"] == 5
    assert victim.read_text() == "precious"
    assert [p.name for p in d.iterdir() if p.name.endswith(".tmp")] == []


def test_daemon_refuses_a_runtime_dir_it_does_not_own(dirs: dict[str, Path]) -> None:
    run = dirs["run"]
    run.chmod(0o777)
    proc = subprocess.run([str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run), "--state-dir",
                           str(dirs["state"])], env=base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "writable by others" in proc.stderr and str(run) in proc.stderr
    assert "Traceback" not in proc.stderr and not (run / "profd.sock").exists()


# ----------------------------------------------------------------------------------------------------------
# 2. The daemon knows who is talking


FAKE_DAEMON = r"""
import sys, zmq
drop()
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("ipc://" + sys.argv[1] + "/profd.sock")
print("ready", flush=True)
while True:
    route, body = s.recv_multipart()
    print(body[:200].decode(errors="replace"), flush=True)
    s.send_multipart([route, b'{"v":1,"type":"register"}'])
"""


def test_ranks_and_ctl_do_not_trust_another_users_daemon(tmp_path: Path, other_user: dict[str, Any]) -> None:
    run = Path(f"/tmp/odpfake{os.getpid()}")
    run.mkdir(mode=0o755)
    os.chown(run, other_user["uid"], other_user["gid"])
    fake = as_user(other_user, FAKE_DAEMON, str(run))
    try:
        assert fake.stdout.readline().strip() == "ready"
        res = ctl(run, "status")
        assert res.returncode == 4 and f"belongs to uid {other_user['uid']}" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        rank = train(tmp_path, "victim", env={"ONDEMAND_PROF_RUNTIME_DIR": str(run)}, steps=150)
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == 0 and "not registering with the daemon" in err, err[-3000:]
    finally:
        fake.kill()
        out, _ = fake.communicate()
        shutil.rmtree(run, ignore_errors=True)
    assert '"register"' not in out and "victim" not in out, out  # nothing about the job reached the fake daemon


SPOOF = r"""
import json, os, sys, time, zmq
from ondemand_prof.core.options import make_config_class
from ondemand_prof.core.requests import WindowDefaults
drop()
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.connect("ipc://" + sys.argv[1] + "/profd.sock")
def ask(**m):
    s.send(json.dumps({"v": 1, **m}).encode())
    return json.loads(s.recv()) if s.poll(5000) else None
base = {"type": "register", "rank": 0, "world_size": 1, "host": os.uname().nodename, "step": 5}
print(json.dumps(ask(**base, job="theirs", pid=int(sys.argv[2]))), flush=True)   # a root process's pid
print(json.dumps(ask(**base, job=sys.argv[3], pid=os.getpid())), flush=True)     # root's job, our pid
defaults = WindowDefaults.from_config(make_config_class()()).to_wire()
print(json.dumps(ask(**base, job="mine", pid=os.getpid(), save_root="/etc", defaults=defaults)), flush=True)
deadline = time.time() + 60
while time.time() < deadline:
    s.send(json.dumps({"v": 1, "type": "hb", "step": 5}).encode())
    if s.poll(300):
        msg = json.loads(s.recv())
        if msg["type"] == "capture":
            cid = msg["window"]["capture_id"]
            s.send(json.dumps({"v": 1, "type": "event", "capture_id": cid, "event": "done",
                               "info": {"path": "/etc/shadow"}}).encode())
"""


OUTSIDER = r"""
import sys
from pathlib import Path
from ondemand_prof.host import ctl
drop()
sys.exit(ctl.main(["status", "--runtime-dir", sys.argv[1]]))
"""


def test_spoofed_ranks_are_refused(tmp_path: Path, other_user: dict[str, Any]) -> None:
    run, state = short_dir("odpgrp"), short_dir("odpgrps")
    daemon = start_daemon(run, state, "--group", other_user["group"])
    victim = train(tmp_path, "rootjob", env={"ONDEMAND_PROF_RUNTIME_DIR": str(run)}, steps=3000)
    spoof = None
    try:
        wait_for(lambda: "rootjob" in ctl(run, "status").stdout, 300, "the root rank to register")
        spoof = as_user(other_user, SPOOF, str(run), str(os.getpid()), "rootjob")
        replies = [json.loads(spoof.stdout.readline()) for _ in range(3)]
        assert replies[0]["type"] == "error" and "is not the connecting process" in replies[0]["error"], replies
        # root's job id, the member's process: a job of the member's own (jobs are (uid, id)), root's untouched
        assert replies[1]["type"] == "registered", replies
        assert replies[2]["type"] == "registered", replies
        rows = ctl_json(run, "status")["jobs"]["rootjob"]
        assert [(r["uid"], r["pid"]) for r in rows] == [(0, victim.pid)], rows
        res = ctl(run, "capture", "--job", "mine", "--steps", "1", "--wait", "--timeout", "30")
        assert res.returncode != 0 and "/etc/shadow" in res.stdout + res.stderr, res.stdout + res.stderr
        assert "reported output refused" in res.stdout + res.stderr
        # a user outside the group gets a clear refusal, not a traceback
        outsider = as_user({"uid": 65534, "gid": 65534}, OUTSIDER, str(run))
        out, err = outsider.communicate(timeout=60)
        assert outsider.returncode == 4 and "Traceback" not in err and "permission denied" in err, err
    finally:
        if spoof is not None:
            spoof.kill()
            spoof.communicate()
        stop(victim)
        stop(daemon)
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# 5. Nothing left behind


PLANTED = """
import os
with open(os.environ["ODP_PLANTED_MARKER"], "a") as fh:
    fh.write(__name__ + " imported in pid " + str(os.getpid()) + "\\n")
raise ImportError("planted")
"""


def test_helper_children_never_import_from_the_jobs_working_directory(tmp_path: Path) -> None:
    """Issue 34, F2: a job launched from a directory others can write (1777) holds a planted `json.py` and
    `ondemand_prof/`; the rank's post-processing child and its native-save build must import neither (before:
    `python -m` put the cwd first on sys.path, and both ran as the job's owner on a single capture)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    marker = tmp_path / "planted.log"
    for rel in ("json.py", "ondemand_prof/__init__.py", "ondemand_prof/rank/__init__.py"):
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        (shared / rel).write_text(PLANTED)
    env = base_env(ODP_PLANTED_MARKER=str(marker), XDG_CACHE_HOME=str(tmp_path / "cache"), CXX="false")
    env["PYTHONPATH"] = str(ROOT) + ":" + env.get("PYTHONPATH", "")  # (the rank itself is started with -P below)
    # the default relative save path (./profile, in the shared directory) and a static window: one capture
    proc = subprocess.run([sys.executable, "-P", "-m", "ondemand_prof.demo.toy_train", "--no-dist", "--steps", "12",
                           "--step-sleep", "0.02", "--profile-min-free-mb", "0", "--profile", "--profile-step-start",
                           "3", "--profile-step-end", "5", "--profile-ranks", "-1"],
                          cwd=shared, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = list((shared / "profile").rglob("*.pt.trace.json*"))
    assert traces, proc.stderr[-3000:]
    # the build ran (CXX=false: it fails, after importing its module), or a planted module ran instead
    wait_for(lambda: marker.exists() or list((tmp_path / "cache").rglob("*.failed")) or
             list((tmp_path / "cache").rglob("*.so")), 120, "the native-save build to end")
    assert not marker.exists(), marker.read_text()


@pytest.mark.parametrize("mode,files,dirs_", [(None, 0o640, 0o750), ("0600", 0o600, 0o700)])
def test_output_is_not_world_readable(tmp_path: Path, mode: str | None, files: int, dirs_: int) -> None:
    extra = ["--profile", "--profile-step-start", "3", "--profile-step-end", "5", "--no-profile-ondemand"]
    if mode:
        extra += ["--profile-file-mode", mode]
    proc = train(tmp_path, "modes", *extra, steps=12)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    folders = [p for p in (tmp_path / "profile").iterdir()]
    assert folders
    for folder in folders:
        assert folder.stat().st_mode & 0o777 == dirs_, oct(folder.stat().st_mode)
        for p in folder.rglob("*"):
            want = dirs_ if p.is_dir() else files
            assert p.stat().st_mode & 0o777 == want, (p, oct(p.stat().st_mode))


# ----------------------------------------------------------------------------------------------------------
# Round 2 (issue 18): a member of a --group root daemon, and anyone who reaches its TCP port


USER_RANK = r"""
import json, os, select, shutil, subprocess, sys, time, zmq
drop()  # what the commands below use is imported before (the interpreter may be readable by root only)
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
s.connect("ipc://" + sys.argv[1] + "/profd.sock")
beat, next_beat = False, 0.0
env = {"os": os, "json": json, "time": time, "subprocess": subprocess, "shutil": shutil}
def out(**kw):
    print(json.dumps(kw), flush=True)
pending = b""
def commands():
    global pending
    if not select.select([0], [], [], 0.05)[0]:
        return []
    chunk = os.read(0, 1 << 20)
    if not chunk:
        sys.exit(0)
    pending += chunk
    *lines, pending = pending.split(b"\n")
    return [json.loads(line) for line in lines if line.strip()]
while True:
    for cmd in commands():
        if "send" in cmd:
            s.send(json.dumps({"v": 1, **cmd["send"]}).encode())
        if "beat" in cmd:
            beat = cmd["beat"]
        if "run" in cmd:
            try:
                exec(cmd["run"], env)
                out(ran=cmd.get("tag"), value=env.get("value"))
            except Exception as exc:
                out(ran=cmd.get("tag"), error=f"{type(exc).__name__}: {exc}")
    while s.poll(0):
        out(got=json.loads(s.recv()))
    if beat and time.monotonic() >= next_beat:
        s.send(json.dumps({"v": 1, "type": "hb", "step": 5}).encode())
        next_beat = time.monotonic() + 0.5
"""


class UserRank:
    """A process of another user talking to the daemon as a rank would, one JSON command a line."""

    def __init__(self, user: dict[str, Any], run: Path) -> None:
        prelude = (f"import os\ndef drop():\n    os.setgroups([{user['gid']}]); os.setgid({user['gid']}); "
                   f"os.setuid({user['uid']})\n")
        self.proc = subprocess.Popen([sys.executable, "-c", prelude + USER_RANK, str(run)], cwd="/tmp",
                                     env=base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.seen: list[dict[str, Any]] = []
        self._partial = b""

    def send(self, **msg: Any) -> None:
        self._cmd({"send": msg})

    def beat(self, on: bool) -> None:
        self._cmd({"beat": on})

    def run(self, code: str) -> Any:
        tag = f"t{len(self.seen)}-{time.monotonic()}"
        self._cmd({"run": code, "tag": tag})
        line = self.expect(lambda m: m.get("ran") == tag)
        assert "error" not in line, line
        return line.get("value")

    def _cmd(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, pred: Any, timeout: float = 20) -> dict[str, Any]:
        import select

        deadline = time.monotonic() + timeout
        for line in self.seen:
            if pred(line):
                self.seen.remove(line)
                return line
        fd = self.proc.stdout.fileno()  # read raw: a buffered readline would hide a second line from select
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                chunk = os.read(fd, 1 << 20)
                assert chunk, f"the user's process ended; seen {self.seen[-5:]}"
                *lines, self._partial = (self._partial + chunk).split(b"\n")
                self.seen += [json.loads(x) for x in lines if x.strip()]
                for line in self.seen:
                    if pred(line):
                        self.seen.remove(line)
                        return line
        raise AssertionError(f"timed out; seen {self.seen[-5:]}")

    def reply(self, timeout: float = 20) -> dict[str, Any]:
        return self.expect(lambda m: "got" in m, timeout)["got"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _register(rank: UserRank, job: str, pid: int, **extra: Any) -> dict[str, Any]:
    from ondemand_prof.core.options import make_config_class
    from ondemand_prof.core.requests import WindowDefaults

    msg = register_msg(job=job, pid=pid, step=5, host=socket.gethostname(),
                       defaults=WindowDefaults.from_config(make_config_class()()).to_wire(), **extra)
    del msg["began"]  # (this rank says no step time)
    rank.send(**msg)
    return rank.reply()


@pytest.fixture
def group_daemon(other_user: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A root daemon shared with the throwaway user's group (the documented team setup)."""
    run, state, shared = short_dir("odpg2"), short_dir("odpg2s"), short_dir("odpg2u")
    os.chown(shared, other_user["uid"], other_user["gid"])  # the member's own directory (tmp_path is root's, 0700)
    proc = start_daemon(run, state, "--group", other_user["group"])
    ranks: list[UserRank] = []
    yield {"run": run, "state": state, "proc": proc, "ranks": ranks, "user": other_user, "shared": shared}
    for r in ranks:
        r.close()
    _, err = stop(proc)
    for d in (run, state, shared):
        shutil.rmtree(d, ignore_errors=True)
    assert "Traceback" not in err, err[-3000:]


def _user_rank(env: dict[str, Any]) -> UserRank:
    rank = UserRank(env["user"], env["run"])
    env["ranks"].append(rank)
    return rank


def _reuse_pid(pid: int) -> subprocess.Popen | None:
    """A root process holding `pid` (free again): the kernel's next pid is set with ns_last_pid, as CRIU does."""
    for _ in range(50):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(["sleep", "120"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


RAW_RANK = r"""
import json, os, select, socket, sys
drop()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1] + "/profd.sock")  # the kernel records this process's pid, now and for good
connector = os.getpid()
r, w = os.pipe()
if os.fork() != 0:  # the connector: waits until it is told to exit, then leaves its connection to its child
    s.close()
    os.read(r, 1)
    os._exit(0)
def recvn(n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise SystemExit("the daemon closed the connection")
        b += c
    return b
def frame():
    flags = recvn(1)[0]
    return flags, recvn(int.from_bytes(recvn(8), "big") if flags & 2 else recvn(1)[0])
def send(msg):
    data = json.dumps({"v": 1, **msg}).encode()
    s.sendall((b"\x02" + len(data).to_bytes(8, "big") if len(data) > 255 else b"\x00" + bytes([len(data)])) + data)
def out(**kw):
    print(json.dumps(kw), flush=True)
# ZMTP 3.0 with the NULL mechanism, spoken by hand on the inherited connection (libzmq cannot be forked)
s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31))
recvn(64)
ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
s.sendall(b"\x04" + bytes([len(ready)]) + ready)
while not frame()[0] & 4:
    pass
out(connector=connector, holder=os.getpid())
beat, pending = False, b""
while True:
    ready_fds = select.select([0, s], [], [], 0.5)[0]
    if s in ready_fds:
        flags, body = frame()
        if not flags & 4:
            out(got=json.loads(body))
    if 0 in ready_fds:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            sys.exit(0)
        *lines, pending = (pending + chunk).split(b"\n")
        for cmd in [json.loads(x) for x in lines if x.strip()]:
            if "send" in cmd:
                send(cmd["send"])
            if "beat" in cmd:
                beat = cmd["beat"]
            if "touch" in cmd:
                open(cmd["touch"], "w").close()
            if cmd.get("connector_exits"):
                os.write(w, b"x")
    if beat:
        send({"type": "hb", "step": 5})
"""


class RawRank(UserRank):
    """A process of another user that opens a connection to the daemon and forks: its child holds the connection
    and speaks for it (ZMTP by hand), so the process the kernel recorded at connect() can exit while its
    connection lives on (issue 34, F1: what an fd passed with SCM_RIGHTS, or a fork, allows)."""

    def __init__(self, user: dict[str, Any], run: Path) -> None:
        prelude = (f"import os\ndef drop():\n    os.setgroups([{user['gid']}]); os.setgid({user['gid']}); "
                   f"os.setuid({user['uid']})\n")
        self.proc = subprocess.Popen([sys.executable, "-c", prelude + RAW_RANK, str(run)], cwd="/tmp",
                                     env=base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.seen: list[dict[str, Any]] = []
        self._partial = b""
        first = self.expect(lambda m: "connector" in m)
        self.connector, self.holder = first["connector"], first["holder"]

    def touch(self, path: Path) -> None:
        self._cmd({"touch": str(path)})

    def connector_exits(self) -> None:
        """The process that connected exits (and is reaped: its pid is free); its child keeps the connection."""
        self._cmd({"connector_exits": True})
        self.proc.wait(timeout=20)

    def close(self) -> None:
        super().close()
        try:
            os.kill(self.holder, 9)
        except OSError:
            pass


def _raw_rank(env: dict[str, Any]) -> RawRank:
    rank = RawRank(env["user"], env["run"])
    env["ranks"].append(rank)
    return rank


def test_the_native_dump_signal_is_the_daemons_and_never_reaches_a_reused_pid(
        group_daemon: dict[str, Any], tmp_path: Path) -> None:
    """Issue 18, 1: a member registers with native_dump {"signal": 9}; `ondemandctl stacks` must not send it. Then
    a rank registered and beating whose process exits, its connection held on by a child, and its pid reused by a
    root process: stacks must signal nobody."""
    env = group_daemon
    rank = _user_rank(env)
    status = env["shared"]
    me = rank.run("value = os.getpid()")
    dump = status / f"native-stacks-{me}.txt"
    rank.run(f"open({str(dump)!r}, 'w').close()")
    reply = _register(rank, "sig9", me, native_dump={"signal": 9, "file": str(dump)})
    assert reply["type"] == "registered", reply
    res = ctl(env["run"], "stacks", "--job", "sig9", "--timeout", "1.5")
    assert "registered no native dump signal" in res.stdout + res.stderr, res.stdout + res.stderr
    assert rank.proc.poll() is None  # signal 9 was never sent

    # the daemon's own signal, then the pid reused by root while the rank is still registered and beating
    from ondemand_prof.core.protocol import native_dump_signal

    raw = _raw_rank(env)
    dump2 = status / f"native-stacks-{raw.connector}.txt"
    raw.touch(dump2)
    assert _register(raw, "reuse", raw.connector, native_dump={"signal": native_dump_signal(),
                                                                "file": str(dump2)})["type"] == "registered"
    raw.beat(True)
    raw.connector_exits()  # the registered process exits; its pid is free, its connection still beats
    victim = _reuse_pid(raw.connector)
    if victim is None:
        pytest.skip("could not place a process at a chosen pid (ns_last_pid)")
    try:
        res = ctl(env["run"], "stacks", "--job", "reuse", "--timeout", "1.5")
        out = res.stdout + res.stderr
        time.sleep(0.3)
        assert victim.poll() is None, f"the daemon signalled root's process holding the reused pid: {out}"
        assert "NATIVE DUMP" not in out
        # either the daemon saw the process go, or it refused to signal the new holder of its pid
        assert "no longer the process that registered" in out or "not registered" in out or \
            "exited" in out or "no live job" in out, out
    finally:
        victim.kill()
        victim.wait()


def test_a_connection_outliving_its_connector_registers_nobody(group_daemon: dict[str, Any]) -> None:
    """Issue 34, F1: a member opens a connection, hands it to a child and exits; a root process takes the pid the
    kernel recorded for that connection. Registering that pid through the connection is refused, and stacks on
    the job signals nothing (before: registered, then the native-dump signal killed root's process)."""
    from ondemand_prof.core.protocol import native_dump_signal

    env = group_daemon
    raw = _raw_rank(env)
    dump = env["shared"] / f"native-stacks-{raw.connector}.txt"
    raw.touch(dump)
    raw.connector_exits()
    victim = _reuse_pid(raw.connector)
    if victim is None:
        pytest.skip("could not place a process at a chosen pid (ns_last_pid)")
    try:
        reply = _register(raw, "stale", raw.connector, native_dump={"signal": native_dump_signal(),
                                                                     "file": str(dump)})
        assert reply["type"] == "error", reply
        assert "has exited" in reply["error"] or "is not a process of uid" in reply["error"], reply
        # its own pid (the holder) is not the connecting process either
        reply = _register(raw, "stale", raw.holder)
        assert reply["type"] == "error" and ("has exited" in reply["error"] or
                                             "is not the connecting process" in reply["error"]), reply
        raw.beat(True)
        res = ctl(env["run"], "stacks", "--job", "stale", "--timeout", "1.5")
        time.sleep(0.3)
        assert victim.poll() is None, res.stdout + res.stderr
        assert "no live job 'stale'" in res.stderr, res.stdout + res.stderr
    finally:
        victim.kill()
        victim.wait()


def test_a_silent_rank_whose_process_is_gone_is_forgotten(group_daemon: dict[str, Any], tmp_path: Path) -> None:
    """A rank whose heartbeats stopped is kept reachable for a native dump only while its process is the one
    that registered: once it exits (its pid reused by root here), stacks has nobody to signal."""
    from ondemand_prof.core.protocol import native_dump_signal

    env = group_daemon
    rank = _raw_rank(env)
    helper = rank.connector
    dump = env["shared"] / f"native-stacks-{helper}.txt"
    rank.touch(dump)
    assert _register(rank, "silent", helper, native_dump={"signal": native_dump_signal(),
                                                           "file": str(dump)})["type"] == "registered"
    # its heartbeats stop: no longer live (status lists it as SILENT, its process alive, until it exits)
    wait_for(lambda: "silent" not in json.loads(ctl(env["run"], "status", "--json").stdout)["jobs"], 30,
             "the rank to go silent")
    assert "SILENT: rank 0" in ctl(env["run"], "status").stdout
    rank.connector_exits()
    victim = _reuse_pid(helper)
    if victim is None:
        pytest.skip("could not place a process at a chosen pid (ns_last_pid)")
    try:
        res = ctl(env["run"], "stacks", "--job", "silent", "--timeout", "1")
        assert res.returncode != 0 and "no live job 'silent'" in res.stderr, res.stdout + res.stderr
        time.sleep(0.3)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


MEMBER_CTL = r"""
import sys
from ondemand_prof.host import ctl
drop()
sys.exit(ctl.main([sys.argv[2], "--runtime-dir", sys.argv[1], *sys.argv[3:]]))
"""


def test_a_squatted_job_id_is_another_users_job(group_daemon: dict[str, Any], tmp_path: Path) -> None:
    """Issue 34, F3: a member registers the job id another user's job will take, first. Before: the owner's rank
    was refused ("belongs to uid N"), its log said "registered" and then "no ondemand-profd answered", and the
    owner's `capture --job` went to the squatter's rank. Now a job is (uid, id): both are registered, status
    names each one's owner, the owner's capture takes its own rank, and the member's capture of the owner's job
    says whose it is."""
    env = group_daemon
    user = env["user"]
    squat = _user_rank(env)
    assert _register(squat, "sq", squat.run("value = os.getpid()"),
                     save_root=str(env["shared"]))["type"] == "registered"
    squat.beat(True)
    log = tmp_path / "owner.log"
    owner = train(tmp_path, "sq", env={"ONDEMAND_PROF_RUNTIME_DIR": str(env["run"])}, steps=100000, log=log)
    try:
        names = {"root:sq", f"{user['name']}:sq"}
        wait_for(lambda: set(ctl_json(env["run"], "status")["jobs"]) == names, 120, "both jobs to register")
        jobs = ctl_json(env["run"], "status")["jobs"]
        assert [(r["uid"], r["pid"]) for r in jobs["root:sq"]] == [(0, owner.pid)], jobs
        assert [r["uid"] for r in jobs[f"{user['name']}:sq"]] == [user["uid"]], jobs
        text = ctl(env["run"], "status").stdout
        assert "job root:sq: 1 of 1 rank(s) registered, owner uid 0 (root)" in text, text
        assert f"job {user['name']}:sq: 1 of 1 rank(s) registered, owner uid {user['uid']} ({user['name']})" in text
        wait_for(lambda: "registered with ondemand-profd" in log.read_text(), 60, "the owner's start-up line")
        said = log.read_text()
        assert "REFUSED" not in said and "refused" not in said and "no ondemand-profd answered" not in said, said
        # the owner's `--job sq` is its own job: its own rank records, into its own save path
        res = ctl(env["run"], "capture", "--job", "sq", "--steps", "1", "--wait", "--timeout", "120")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "done: 1 of 1 rank(s) wrote a trace" in res.stdout and str(tmp_path / "profile") in res.stdout
        assert "note: job" not in res.stdout, res.stdout
        # the member asks for the owner's job by the name status shows: told whose job it is
        member = as_user(user, MEMBER_CTL, str(env["run"]), "capture", "--job", "root:sq", "--steps", "1",
                         "--no-wait")
        out, err = member.communicate(timeout=60)
        assert member.returncode == 0, out + err
        assert f"note: job sq belongs to uid 0 (root), not to you (uid {user['uid']} ({user['name']}))" in out, out
        # the bare id, asked by the member, is the member's own job
        member = as_user(user, MEMBER_CTL, str(env["run"]), "status", "--job", "sq", "--json")
        out, err = member.communicate(timeout=60)
        assert member.returncode == 0 and list(json.loads(out)["jobs"]) == [f"{user['name']}:sq"], out + err
    finally:
        stop(owner)


def test_wire_ids_cannot_name_paths_or_replace_or_flood_out_records(
        group_daemon: dict[str, Any], tmp_path: Path) -> None:
    """Issue 18, 2: auto_capture's capture id is a file name in root's state directory."""
    env = group_daemon
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    # root's own records first (a job of root's: its captures are what the member must not touch)
    root_rank = train(tmp_path, "rootjob", env={"ONDEMAND_PROF_RUNTIME_DIR": str(env["run"])}, steps=5000)
    try:
        wait_for(lambda: "rootjob" in ctl(env["run"], "status").stdout, 300, "root's rank")
        mine = [json.loads(ctl(env["run"], "capture", "--job", "rootjob", "--steps", "1", "--start", "100000",
                               "--no-wait", "--json").stdout)["capture_id"] for _ in range(2)]
        rank = _user_rank(env)
        pid = rank.run("value = os.getpid()")
        assert _register(rank, "member", pid)["type"] == "registered"
        rank.beat(True)
        from ondemand_prof.core.options import WindowOptions, make_config_class
        from ondemand_prof.core.window import Window

        window = Window(10, 12, WindowOptions.from_config(make_config_class()()), source="auto",
                        requested={"auto": {"why": "slow"}}).to_wire()
        depth = "../" * 12
        for bad in (f"{depth}{victim_dir}/settings".replace("//", "/"), mine[0], "auto-x-r0-1", ".hidden",
                    "a/b", "x" * 200):
            rank.send(type="auto_capture", window={**window, "capture_id": bad})
        # 1,100 well-formed ones: the daemon's budget records a few, and nobody's records are pushed out
        for i in range(1100):
            rank.send(type="auto_capture", window={**window, "capture_id": f"auto-20260101-{i:06d}-r0-{pid}"})
        rank.send(type="hb", step=6)
        wait_for(lambda: len(json.loads(ctl(env["run"], "list", "--json", "--limit", "1000").stdout)["captures"])
                 >= 2, 30, "the list")
        time.sleep(1.0)
        caps = json.loads(ctl(env["run"], "list", "--json", "--limit", "1000").stdout)["captures"]
    finally:
        stop(root_rank)
    ids = {c["capture_id"]: c for c in caps}
    assert not list(victim_dir.iterdir()), "a capture id named a file outside the state directory"
    assert all(m in ids and ids[m]["job"] == "rootjob" for m in mine), ids.keys()  # neither replaced nor evicted
    autos = [c for c in caps if c["job"] == "member"]
    from ondemand_prof.host.rank_captures import AUTO_PER_JOB_HOUR

    assert 0 < len(autos) <= AUTO_PER_JOB_HOUR, len(autos)
    assert all(c["capture_id"].endswith(f"-r0-{pid}") for c in autos)
    files = list((env["state"] / "captures").glob("*.json"))
    assert len(files) == len(caps) and all(f.resolve().parent == (env["state"] / "captures").resolve()
                                           for f in files)
    log = stop(env["proc"])[1]
    # said, and once a minute per kind, not 1,100 times
    assert log.count("bad automatic window: capture id") == 1, log[-3000:]
    # (the first well-formed one runs; since 9d42847 the others are covered by it, before the budget: said once a
    # minute as the budget's refusals are, not a line each, which filled a stderr nobody read and hung the daemon)
    assert log.count("not recorded: the daemon's budget of") + log.count("that one covers it") == 1, log[-3000:]


@pytest.mark.quick
def test_the_record_store_stays_within_its_cap_and_only_evicts_the_flooders_records(tmp_path: Path) -> None:
    from ondemand_prof.host.records import KEEP_PER_UID, KEEP_RECORDS, CaptureRecord, RecordRefused, RecordStore

    store = RecordStore(tmp_path)
    plan = {"start_step": 1, "end_step": 2}

    def record(cid: str, wall: float, done: bool = True) -> CaptureRecord:
        r = CaptureRecord.new(cid, "j", {}, plan, {}, [{"rank": 0, "host": "h", "pid": 1}], wall)
        if done:
            r.update(0, "done", {"path": "/x"}, wall)
        return r

    for i in range(KEEP_RECORDS - 10):  # another user's (or ondemandctl's) records, nearly filling the store
        store.add(record(f"other-{i:05d}", 1000.0 + i))
    with pytest.raises(RecordRefused, match="already exists"):
        store.add(record("other-00000", 5000.0))
    for i in range(5000):  # a flood from uid 1234's ranks
        try:
            store.add(record(f"auto-{i:05d}-r0-1", 10_000.0 + i, done=i % 2 == 0), owner=1234)
        except RecordRefused:
            pass
        assert len(store.records) <= KEEP_RECORDS
    assert sum(1 for k in store.records if k.startswith("other-")) == KEEP_RECORDS - 10
    assert sum(1 for r in store.records.values() if r.data.get("owner_uid") == 1234) <= KEEP_PER_UID
    assert len(list((tmp_path / "captures").glob("*.json"))) == len(store.records)
    # read back from disk: the same, and a malformed or misnamed file is skipped, not served
    (tmp_path / "captures" / "auto-bad.json").write_text(json.dumps({"capture_id": "other-00001", "job": "j"}))
    (tmp_path / "captures" / "broken.json").write_text('{"capture_id": "broken", "window": {"x": 1}}')
    again = RecordStore(tmp_path)
    assert set(again.records) == set(store.records)
    # hand-edited (or older) records missing what list and show print, or holding text no terminal prints, are
    # skipped (and left on disk); a good one beside them is served
    (tmp_path / "edited" / "captures").mkdir(parents=True, mode=0o700)
    good = record("x", 1.0).data
    for name, edit in [("no-window", lambda d: d.pop("window")), ("no-request", lambda d: d.pop("request")),
                       ("misaligned", lambda d: d.update(misaligned="x")),
                       ("surrogate", lambda d: d["parts"]["0"].update(error="\ud800")), ("good", lambda d: None)]:
        data = json.loads(json.dumps(good))
        edit(data)
        data["capture_id"] = f"edited-{name}"
        (tmp_path / "edited" / "captures" / f"edited-{name}.json").write_text(json.dumps(data))
    assert list(RecordStore(tmp_path / "edited").records) == ["edited-good"]
    assert len(list((tmp_path / "edited" / "captures").glob("*.json"))) == 5
    # and still oldest first, whatever order the files are listed in: the next eviction takes the oldest "other-"
    again.add(record("late", 20_000.0))
    assert "other-00000" not in again.records and "other-00001" in again.records
    # one uid's records: its oldest finished one makes room, a running one stays
    own = RecordStore(tmp_path / "own")
    own.add(record("u-0000", 1.0, done=False), owner=7)
    for i in range(1, KEEP_PER_UID + 5):
        own.add(record(f"u-{i:04d}", 1.0 + i), owner=7)
    assert sorted(own.records)[:2] == ["u-0000", "u-0006"] and len(own.records) == KEEP_PER_UID


def test_a_summary_is_read_only_through_real_directories_of_the_ranks_user(
        group_daemon: dict[str, Any], tmp_path: Path) -> None:
    """Issue 18, 3: report a directory of one's own as done, then swap it (or a parent) for a symlink to a
    directory of root's; the daemon must not return root's summary.json."""
    env = group_daemon
    user = env["user"]
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    (secret / "summary.json").write_text(json.dumps({"rank": 0, "secret": "root's"}))
    above = tmp_path / "above"  # root's too: above/r0/summary.json, for a swapped parent
    (above / "r0").mkdir(parents=True)
    (above / "r0" / "summary.json").write_text(json.dumps({"rank": 0, "secret": "root's"}))
    save = env["shared"] / "save"
    os.mkdir(save)
    os.chown(save, user["uid"], user["gid"])
    try:
        rank = _user_rank(env)
        pid = rank.run("value = os.getpid()")
        assert _register(rank, "swap", pid, save_root=str(save))["type"] == "registered"
        rank.beat(True)
        ids = []
        for n in range(2):
            res = ctl(env["run"], "capture", "--job", "swap", "--steps", "1", "--no-wait", "--json")
            cid = json.loads(res.stdout)["capture_id"]
            ids.append(cid)
            d = save / cid / "r0"
            rank.run(f"os.makedirs({str(d)!r}); open({str(d / 'summary.json')!r}, 'w').write('{{\"rank\": 0}}')")
            for event in ("received", "scheduled", "recording", "writing"):
                rank.send(type="event", capture_id=cid, event=event, info={})
            rank.send(type="event", capture_id=cid, event="done", info={"path": str(d)})
        wait_for(lambda: all(json.loads(ctl(env["run"], "show", c, "--json").stdout)["status"] == "done"
                             for c in ids), 30, "both parts done")
        # swapped after the report: the rank directory itself, and a parent of it
        rank.run(f"shutil.rmtree({str(save / ids[0] / 'r0')!r}); "
                 f"os.symlink({str(secret)!r}, {str(save / ids[0] / 'r0')!r})")
        rank.run(f"shutil.rmtree({str(save / ids[1])!r}); os.symlink({str(above)!r}, {str(save / ids[1])!r})")
        for cid in ids:
            reply = request(env["run"], {"v": 1, "type": "summaries", "id": 1, "capture_id": cid})
            assert reply is not None and reply["type"] == "ok", reply
            part = reply["data"]["parts"][0]
            assert "summary" not in part and "secret" not in json.dumps(reply), reply
            assert "symbolic link" in part["error"] or "not a directory" in part["error"], part
    finally:
        shutil.rmtree(save, ignore_errors=True)


def test_a_squatted_save_path_is_refused_and_a_private_one_used(tmp_path: Path, other_user: dict[str, Any]) -> None:
    """Issue 18, 4: a setgid 2777 directory made first by another user would hand its group our traces."""
    base = Path(tempfile.mkdtemp(prefix="odpsq", dir="/tmp"))
    try:
        squat = base / "profile"
        squat.mkdir()
        os.chown(squat, other_user["uid"], other_user["gid"])
        squat.chmod(0o2777)
        data = tmp_path / "data"
        data.mkdir(mode=0o700)
        proc = subprocess.Popen([sys.executable, "-m", "ondemand_prof.demo.toy_train", "--no-dist", "--steps", "12",
                                 "--step-sleep", "0.01", "--profile-min-free-mb", "0", "--profile", "--profile-step-start",
                                 "3", "--profile-step-end", "5", "--no-profile-ondemand", "--profile-save-path",
                                 str(squat)], env=base_env(XDG_DATA_HOME=str(data)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert f"not saving traces under {squat}" in err and f"belongs to uid {other_user['uid']}" in err, err[-3000:]
        assert list(squat.iterdir()) == []  # nothing of ours went there
        fallback = data / "ondemand_prof" / "profile"
        assert published(fallback), err[-3000:]
        assert fallback.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_directories_we_create_ignore_the_umask(tmp_path: Path) -> None:
    save = tmp_path / "deep" / "profile"
    proc = subprocess.Popen([sys.executable, "-c", "import os, runpy, sys; os.umask(0); sys.argv = sys.argv[1:]; "
                             "runpy.run_module('ondemand_prof.demo.toy_train', run_name='__main__')", "toy",
                             "--no-dist", "--steps", "12", "--step-sleep", "0.01", "--profile-min-free-mb", "0",
                             "--profile", "--profile-step-start", "3", "--profile-step-end", "5",
                             "--no-profile-ondemand", "--profile-save-path", str(save)],
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    for d in (save.parent, save, *[p for p in save.rglob("*") if p.is_dir()]):
        assert d.stat().st_mode & 0o777 == 0o750, (d, oct(d.stat().st_mode))
    assert published(save)


BURST = r"""
import json, os, sys, time, zmq, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ctx = zmq.Context(io_threads=2)
ctx.set(zmq.MAX_SOCKETS, 2000)
recent = [{"capture_id": f"20260101-000000-{i:06x}", "event": "done", "info": {"path": "/tmp/x"}} for i in range(64)]
socks = []
for i in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(sys.argv[1]); socks.append(s)
for i, s in enumerate(socks):  # what ranks send after a daemon restart: register with their recent events
    s.send(json.dumps({"v": 1, "type": "register", "job": "burst", "rank": i, "world_size": len(socks), "host": "h",
                       "pid": os.getpid(), "step": 0, "recent": recent}).encode(), zmq.NOBLOCK)
time.sleep(4)
print(sum(1 for s in socks if s.poll(0)), flush=True)
for s in socks:
    s.close()
ctx.term()
"""

TCP_FLOOD = r"""
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
socks = []
for _ in range(int(sys.argv[2])):  # raw connects, no key, no greeting
    s = socket.socket(); s.setblocking(False)
    try:
        s.connect(("127.0.0.1", int(sys.argv[1])))
    except BlockingIOError:
        pass
    socks.append(s)
print("connected", flush=True)
time.sleep(6)
"""


def _prlimit_daemon(dirs: dict[str, Path], *extra: str) -> subprocess.Popen:
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux)")
    if _hard_nofile() < 4096:
        pytest.skip(f"the flood clients need 4096 descriptors (hard limit {_hard_nofile()})")
    log = (dirs["state"] / "daemon.log").open("w")  # a file: 1,100 registrations would fill a pipe nobody reads
    proc = subprocess.Popen(["prlimit", "--nofile=1024", str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir",
                             str(dirs["run"]), "--state-dir", str(dirs["state"]), *extra], env=base_env(),
                            stdout=log, stderr=log, text=True)
    wait_for(lambda: (dirs["run"] / "profd.sock").exists() or proc.poll() is not None, 30, "the socket")
    return proc


def _daemon_log(dirs: dict[str, Path], proc: subprocess.Popen) -> str:
    stop(proc)
    return (dirs["state"] / "daemon.log").read_text()


def test_a_register_burst_with_recent_items_does_not_abort_the_daemon(dirs: dict[str, Path]) -> None:
    """Issue 18, 5: 1,100 registrations carrying `recent` items (ranks after a daemon restart) at 1,024
    descriptors aborted libzmq (ipc_listener.cpp:297) 3 of 3 times."""
    proc = _prlimit_daemon(dirs)
    try:
        burst = subprocess.run([sys.executable, "-c", BURST, f"ipc://{dirs['run']}/profd.sock", "1100"],
                               capture_output=True, text=True, timeout=120)
        assert burst.returncode == 0, burst.stderr
        assert proc.poll() is None, "the daemon died under the burst"
        assert int(burst.stdout) > 0  # those that got in were answered
        wait_for(lambda: status_ok(dirs["run"]), 300, "a good request after the burst")
    finally:
        err = _daemon_log(dirs, proc)
    assert "Too many open files" not in err and proc.returncode == 0, err[-3000:]


def test_tcp_connections_without_a_key_cannot_take_the_unix_sockets_descriptors(dirs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """Issue 18, 5: ~1,000 raw TCP connects took every descriptor, withdrew the unix listener (local ranks
    dropped) and the next request killed the daemon. Now each address is held to --tcp-per-peer connections;
    a rank connected over the unix socket stays connected and registered throughout."""
    proc = _prlimit_daemon(dirs, "--listen", "tcp://127.0.0.1:0")
    rank = None
    try:
        wait_for(lambda: (dirs["run"] / "profd.tcp").exists(), 30, "the TCP endpoint")
        port = (dirs["run"] / "profd.tcp").read_text().strip().rsplit(":", 1)[1]
        rank = train(tmp_path, "local", env={"ONDEMAND_PROF_RUNTIME_DIR": str(dirs["run"])}, steps=5000,
                     log=tmp_path / "rank.log")
        wait_for(lambda: "local" in ctl(dirs["run"], "status").stdout, 300, "the local rank")
        before = json.loads(ctl(dirs["run"], "status", "--json").stdout)["jobs"]["local"][0]["registered_at"]
        flood = subprocess.Popen([sys.executable, "-c", TCP_FLOOD, port, "1000"], stdout=subprocess.PIPE, text=True)
        assert flood.stdout.readline().strip() == "connected"
        fds = len(os.listdir(f"/proc/{proc.pid}/fd")) if Path(f"/proc/{proc.pid}/fd").exists() else 0
        res = ctl(dirs["run"], "status", "--json")  # over the unix socket, during the flood
        flood.wait(timeout=60)
        assert proc.poll() is None and res.returncode == 0, res.stderr
        ranks = json.loads(res.stdout)["jobs"]["local"]
        assert ranks[0]["registered_at"] == before, "the local rank was dropped and registered again"
        assert status_ok(dirs["run"])
    finally:
        if rank is not None:
            stop(rank)
        err = _daemon_log(dirs, proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "closing TCP connections over the limits" in err, err[-3000:]
    assert "not accepting new connections" not in err  # the unix socket was never closed to local ranks
    assert fds < 512, fds


# ----------------------------------------------------------------------------------------------------------
# Round 2, the smaller items


@pytest.mark.quick
def test_triage_files_are_written_by_the_one_atomic_writer(tmp_path: Path) -> None:
    """write_private used a predictable temporary name opened with O_TRUNC: a link planted there was followed."""
    from ondemand_prof.rank.triage import write_private

    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "out" / "x.pickle"
    target.parent.mkdir()
    (target.parent / f".{target.name}.{os.getpid()}.tmp").symlink_to(victim)  # the old temporary name
    write_private(target, b"data")
    assert victim.read_text() == "precious" and target.read_bytes() == b"data"
    assert target.stat().st_mode & 0o777 == 0o600


def test_keygen_never_changes_a_directory_it_does_not_own(tmp_path: Path, other_user: dict[str, Any]) -> None:
    squat = Path(tempfile.mkdtemp(prefix="odpkeys", dir="/tmp"))
    try:
        os.chown(squat, other_user["uid"], other_user["gid"])
        squat.chmod(0o777)
        res = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "keygen", str(squat)], env=base_env(),
                             capture_output=True, text=True)
        assert res.returncode == 1 and f"belongs to uid {other_user['uid']}" in res.stderr, res.stderr
        assert squat.stat().st_mode & 0o777 == 0o777 and list(squat.iterdir()) == []  # not chmodded, nothing written
        link = tmp_path / "link"
        link.symlink_to(squat)
        res = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "keygen", str(link)], env=base_env(),
                             capture_output=True, text=True)
        assert res.returncode == 1 and "symlinks are refused" in res.stderr, res.stderr
    finally:
        shutil.rmtree(squat, ignore_errors=True)


PRESENCE = r"""
import sys
from ondemand_prof.core.files import presence_note
drop()
print(repr(presence_note(sys.argv[1])) + "|" + repr(presence_note(sys.argv[2])))
"""


def test_a_trace_a_member_cannot_read_is_not_called_missing(tmp_path: Path, other_user: dict[str, Any]) -> None:
    hidden = Path(tempfile.mkdtemp(prefix="odphid", dir="/tmp"))  # root's, 0700
    try:
        (hidden / "trace").mkdir()
        proc = as_user(other_user, PRESENCE, str(hidden / "trace"), "/tmp/odp-no-such-dir")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        unreadable, missing = out.strip().split("|")
        assert "not visible to uid" in unreadable and "MISSING" not in unreadable, out
        assert "MISSING on disk" in missing, out
    finally:
        shutil.rmtree(hidden, ignore_errors=True)
