"""Hardening, round 3 (issue 34): F4 (the metrics endpoint), F5 (directory checks), F6 (ondemandctl trigger).

Each reproduction of the issue, for real: a real daemon serving real connections, real ranks, the real CLI, and,
where the suite runs as root, a real second user (test_security's throwaway user, removed after) playing the
attacker. F1 and F2 are in test_security.py (test_a_connection_outliving_its_connector_registers_nobody,
test_helper_children_never_import_from_the_jobs_working_directory), F3 too
(test_a_squatted_job_id_is_another_users_job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT, base_env, ctl, start_daemon, status_lines, wait_for
from test_security import as_user, other_user, published, stop, train  # noqa: F401 - other_user is a fixture

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="openat, SO_PEERCRED and /proc: Linux only")

SCRAPE_TIMEOUT_S = 10.0  # Prometheus's default scrape_timeout: what "served within its timeout" means


@pytest.fixture
def world_writable() -> Iterator[Path]:
    """A root-owned directory anyone may write and that is not sticky (mode 0777): a TMPDIR others can swap."""
    d = Path(tempfile.mkdtemp(prefix="odpww", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _metrics_daemon(dirs: dict[str, Path], *extra: str) -> tuple[subprocess.Popen, str]:
    pytest.importorskip("prometheus_client")
    proc = start_daemon(dirs["run"], dirs["state"], "--metrics", "127.0.0.1:0", *extra)
    address = wait_for(lambda: (dirs["run"] / "profd.metrics").exists() and
                       (dirs["run"] / "profd.metrics").read_text().strip(), 30, "the metrics address")
    return proc, address


def _get(address: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """One scrape as Prometheus does it, with its default timeout: (status, body)."""
    req = urllib.request.Request(f"http://{address}/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=SCRAPE_TIMEOUT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ----------------------------------------------------------------------------------------------------------
# F4: the metrics endpoint


def test_every_scrape_is_served_while_slow_and_idle_connections_are_held(dirs: dict[str, Path]) -> None:
    """Issue 34, F4: one client sending a byte of its request every half second and 20 idle connections (before:
    wsgiref's one-at-a-time server made every scrape time out while they were held; its 5 s timeout was per
    read), then more idle connections than the endpoint takes at once: every scrape is answered within
    Prometheus's 10 s timeout, and the slow client is dropped once its request has taken 5 s, however it drips."""
    from prometheus_client.parser import text_string_to_metric_families

    proc, address = _metrics_daemon(dirs)
    host, port = address.rsplit(":", 1)
    held: list[socket.socket] = []
    stop_drip = threading.Event()
    dropped = threading.Event()

    def drip(sock: socket.socket) -> None:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        while not stop_drip.wait(0.5):
            try:
                sock.sendall(b"X")
            except OSError:
                dropped.set()
                return
            if _closed_by_server(sock):
                dropped.set()
                return

    try:
        for _ in range(20):
            held.append(socket.create_connection((host, int(port))))
        slow = socket.create_connection((host, int(port)))
        held.append(slow)
        dripper = threading.Thread(target=drip, args=(slow,), daemon=True)
        dripper.start()
        for _ in range(3):
            status, body = _get(address)
            assert status == 200
            assert any(f.name == "ondemand_prof_captures_running" for f in text_string_to_metric_families(body))
        # the slow client's request is capped in time, not each of its reads
        assert dropped.wait(30), "the endpoint kept a client that never finished its request"

        # more idle connections than it holds at once (64): the oldest are closed, scrapes still answered
        for _ in range(100):
            held.append(socket.create_connection((host, int(port))))
        status, _ = _get(address)
        assert status == 200
        wait_for(lambda: all(_closed_by_server(s) for s in held), 30, "every idle connection dropped", pause=0.2)
        assert _get(address)[0] == 200
    finally:
        stop_drip.set()
        for s in held:
            s.close()
        _, err = stop(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]


def test_a_local_user_reads_the_metrics_only_with_the_token(dirs: dict[str, Path], tmp_path: Path,
                                                            other_user: dict[str, Any]) -> None:
    """Issue 34, F4: over 127.0.0.1 any local user, outside the daemon's group too, read every job id, rank and
    step. With --metrics-token-file, a request without the token (or with another) gets 401 and nothing of the
    jobs; Prometheus's `authorization: credentials_file:` sends it."""
    token = "3b0f5c0d1e7a4b29a6c8d2f4e1b7a9c3"
    token_file = tmp_path / "metrics.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    proc, address = _metrics_daemon(dirs, "--metrics-token-file", str(token_file))
    rank = train(tmp_path, "secretjob", env={"ONDEMAND_PROF_RUNTIME_DIR": str(dirs["run"])}, steps=100000,
                 log=tmp_path / "rank.log")
    reader = r"""
import encodings.idna, sys, urllib.error, urllib.request
drop()  # what the request needs is imported before (the interpreter may be readable by root only)
for headers in ({}, {"Authorization": "Bearer wrong-token-of-sixteen"}):
    try:
        with urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers=headers), timeout=10) as r:
            print(r.status, "secretjob" in r.read().decode(), flush=True)
    except urllib.error.HTTPError as exc:
        print(exc.code, "secretjob" in exc.read().decode(), flush=True)
"""
    try:
        wait_for(lambda: "secretjob" in ctl(dirs["run"], "status").stdout, 120, "the rank to register", pause=0.5)
        status, body = wait_for(lambda: (lambda r: r[0] == 200 and "secretjob" in r[1] and r)(
            _get(address, {"Authorization": f"Bearer {token}"})), 30, "the job on /metrics", pause=0.5)
        assert 'job="secretjob"' in body
        user = as_user(other_user, reader, f"http://{address}/metrics")
        out, err = user.communicate(timeout=60)
        assert out.split("\n")[:2] == ["401 False", "401 False"], out + err
        status, body = _get(address)  # root without the token: the same
        assert status == 401 and "secretjob" not in body and "a bearer token is needed" in body
    finally:
        stop(rank)
        _, err = stop(proc)
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("flaw,says", [
    ("group-writable", "writable by others (mode 620)"),
    ("symlink", "a symbolic link?"),
    ("short", "expected one token of 16 to 4096 printable characters"),
    ("missing", "cannot open it: No such file or directory"),
])
def test_a_bad_token_file_is_refused_in_one_line_before_anything_is_created(tmp_path: Path, flaw: str,
                                                                           says: str) -> None:
    pytest.importorskip("prometheus_client")
    token = tmp_path / "token"
    real = tmp_path / "real"
    real.write_text("x" * 32)
    real.chmod(0o600)
    if flaw == "group-writable":
        token.write_text("x" * 32)
        token.chmod(0o620)
    elif flaw == "symlink":
        token.symlink_to(real)
    elif flaw == "short":
        token.write_text("abc\n")
    run = tmp_path / "run"
    res = subprocess.run([str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run), "--state-dir",
                          str(tmp_path / "state"), "--metrics", "127.0.0.1:0", "--metrics-token-file", str(token)],
                         env=base_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and says in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not run.exists()
    res = subprocess.run([str(ROOT / "bin" / "ondemand-profd"), "--metrics-token-file", str(real)], env=base_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "needs --metrics" in res.stderr


# ----------------------------------------------------------------------------------------------------------
# F5: directory checks


def test_a_tmpdir_others_can_swap_is_refused_and_the_private_fallback_is_elsewhere(
        tmp_path: Path, world_writable: Path, other_user: dict[str, Any]) -> None:
    """Issue 34, F5: TMPDIR in a root-owned directory others may write and that is not sticky (before: the check
    stopped at the first root-owned directory without looking at its mode, and the rank used
    TMPDIR/ondemand_prof-<uid>/<job>, which another user swapped after the start-up check). The rank refuses it
    and says why, its fallback is outside TMPDIR, and a trigger another user plants there is never acted on."""
    log = tmp_path / "rank.log"
    steps = tmp_path / "steps.jsonl"
    rank = train(tmp_path, "swapjob", "--status-file", str(steps), env={"TMPDIR": str(world_writable),
                                                                       "XDG_RUNTIME_DIR": ""}, steps=100000, log=log)
    try:
        wait_for(lambda: status_lines(steps) or rank.poll() is not None, 300, "training to start")
        text = wait_for(lambda: "capture with" in log.read_text() and log.read_text(), 60, "the start-up line")
        assert f"not using trigger directory {world_writable}/ondemand_prof-{os.getuid()}/swapjob" in text, text
        assert f"{world_writable} is writable by others (mode 777) and not sticky" in text, text
        fallback = Path(re.search(r"touch (\S+)/capture", text).group(1))  # type: ignore[union-attr]
        assert not str(fallback).startswith(str(world_writable)) and fallback.stat().st_mode & 0o777 == 0o700
        assert list(world_writable.iterdir()) == []  # nothing of ours was made there
        # the attacker's own directory where ours would have been, with a trigger asking for our stacks
        planted = world_writable / f"ondemand_prof-{os.getuid()}" / "swapjob"
        plant = as_user(other_user, f"""
import os, sys
drop()
os.makedirs({str(planted / "capture.status")!r}, mode=0o777)
for d in ({str(planted.parent)!r}, {str(planted)!r}, {str(planted / "capture.status")!r}):
    os.chmod(d, 0o777)
open({str(planted / "capture")!r}, "w").write('{{"action": "stacks"}}')
""")
        assert plant.wait(30) == 0, plant.stderr.read() if plant.stderr else ""
        # our own trigger, through the directory the start-up line names: answered (the rank is watching)
        (fallback / "capture").write_text('{"action": "stacks"}')
        wait_for(lambda: (fallback / "capture.status" / "stacks-rank0.txt").exists(), 60, "our stacks")
    finally:
        stop(rank)
    assert sorted(p.name for p in (planted / "capture.status").iterdir()) == [], "the rank wrote into the swap"


def test_a_trigger_dir_whose_parent_became_swappable_is_refused_at_every_use(
        tmp_path: Path, other_user: dict[str, Any]) -> None:
    """Issue 34, F5: the per-use checks looked at the leaf only, and the stacks write had none. A trigger directory
    checked at start-up whose parent is made world-writable later (an admin's chmod) and swapped by another user
    for their own, holding a stacks request: the rank refuses the directory (it walks from / at every read) and
    writes nothing into the swap (before: it read the trigger and wrote stacks-rank0.txt there)."""
    base = Path(tempfile.mkdtemp(prefix="odpsw", dir="/tmp"))
    base.chmod(0o755)
    trig = base / "a" / "job"
    log = tmp_path / "rank.log"
    steps = tmp_path / "steps.jsonl"
    rank = train(tmp_path, "perusejob", "--status-file", str(steps), "--profile-trigger-dir", str(trig),
                 steps=100000, log=log)
    try:
        wait_for(lambda: status_lines(steps) or rank.poll() is not None, 300, "training to start")
        wait_for(lambda: "capture with" in log.read_text(), 60, "the start-up line")
        assert f"touch {trig}/capture" in log.read_text()
        base.chmod(0o777)
        swap = as_user(other_user, f"""
import os
drop()
os.rename({str(base / "a")!r}, {str(base / "a.ours")!r})
os.makedirs({str(trig / "capture.status")!r})
for d in ({str(base / "a")!r}, {str(trig)!r}, {str(trig / "capture.status")!r}):
    os.chmod(d, 0o777)
open({str(trig / "capture")!r}, "w").write('{{"action": "stacks"}}')
""")
        assert swap.wait(30) == 0, swap.stderr.read() if swap.stderr else ""
        wait_for(lambda: "the trigger directory is refused" in log.read_text(), 60, "the refusal in the log")
        assert f"{base} is writable by others (mode 777) and not sticky" in log.read_text()
    finally:
        stop(rank)
        status_dir = trig / "capture.status"
        listing = sorted(p.name for p in status_dir.iterdir()) if status_dir.is_dir() else []
        shutil.rmtree(base, ignore_errors=True)
    assert listing == [], f"the rank wrote into the swapped directory: {listing}"


def test_directories_are_never_created_through_a_planted_link(tmp_path: Path, other_user: dict[str, Any]) -> None:
    """Issue 34, F5: `make_dirs` created the trigger directory through a symlinked parent before refusing it. In a
    sticky TMPDIR another user plants ondemand_prof-<uid> as a link to a directory of theirs that anyone may
    write: the rank refuses the link before making anything, and the attacker's directory stays empty."""
    sticky = Path(tempfile.mkdtemp(prefix="odpst", dir="/tmp"))
    sticky.chmod(0o1777)
    theirs = sticky / "theirs"
    try:
        plant = as_user(other_user, f"""
import os
drop()
os.mkdir({str(theirs)!r}); os.chmod({str(theirs)!r}, 0o777)
os.symlink({str(theirs)!r}, {str(sticky / f"ondemand_prof-{os.getuid()}")!r})
""")
        assert plant.wait(30) == 0, plant.stderr.read() if plant.stderr else ""
        log = tmp_path / "rank.log"
        steps = tmp_path / "steps.jsonl"
        rank = train(tmp_path, "linkjob", "--status-file", str(steps), env={"TMPDIR": str(sticky),
                                                                            "XDG_RUNTIME_DIR": ""}, log=log)
        try:
            wait_for(lambda: status_lines(steps) or rank.poll() is not None, 300, "training to start")
            wait_for(lambda: "capture with" in log.read_text(), 60, "the start-up line")
        finally:
            stop(rank)
        text = log.read_text()
        assert f"{sticky}/ondemand_prof-{os.getuid()} is a symbolic link" in text, text
        assert list(theirs.iterdir()) == []  # before: linkjob/ and linkjob/capture.status/ were made in there
    finally:
        shutil.rmtree(sticky, ignore_errors=True)


def test_the_native_save_cache_under_a_swappable_directory_is_never_loaded(tmp_path: Path,
                                                                           world_writable: Path) -> None:
    """Issue 34, F5: the .so cache under a directory others can swap was checked up to the first root-owned
    directory and then opened by path. Now its chain is refused before anything there is opened; a cache in a
    sound place that holds a module is still looked at (here a file that is no module: refused on loading)."""
    code = ("import sys; from pathlib import Path; from ondemand_prof.rank import native_save; "
            "root = Path(sys.argv[1]); root.mkdir(parents=True, mode=0o700, exist_ok=True); "
            "native_save.module_path(root, native_save.build_key()).write_bytes(b'not a module'); "
            "native_save.module_path(root, native_save.build_key()).chmod(0o700); "
            "print(native_save.load(root)[1])")
    for base, expect in ((world_writable, f"{world_writable} is writable by others (mode 777) and not sticky"),
                         (tmp_path, "ImportError")):
        res = subprocess.run([sys.executable, "-c", code, str(base / "cache" / "native")], env=base_env(),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and expect in res.stdout, res.stdout + res.stderr


# ----------------------------------------------------------------------------------------------------------
# F6: ondemandctl trigger


def test_ondemandctl_trigger_writes_only_where_it_checked_and_prints_what_the_rank_did(
        tmp_path: Path, dirs: dict[str, Path], other_user: dict[str, Any]) -> None:
    """Issue 34, F6: the documented `echo '{"steps": 2}' > /tmp/ondemand_prof-<uid>/<job>/capture` wrote through a
    link another user planted there (the rank had refused that directory for a private one), and the status
    file read back was the attacker's fake "done". `ondemandctl trigger` refuses that path, writes nothing
    through it, and through the directory the rank watches (--dir from its start-up line, or the daemon's
    status) captures and prints each rank's trace."""
    sticky = Path(tempfile.mkdtemp(prefix="odptg", dir="/tmp"))
    sticky.chmod(0o1777)
    theirs = sticky / "theirs" / "tgjob"  # where /tmp/ondemand_prof-<uid> leads: the attacker's, open to all
    fake_done = {"rank": 0, "latest": {"state": "done", "trace": "/home/attacker/fake_trace.json"}}
    try:
        plant = as_user(other_user, f"""
import json, os
drop()
os.makedirs({str(theirs / "capture.status")!r})
for d in ({str(theirs.parent)!r}, {str(theirs)!r}, {str(theirs / "capture.status")!r}):
    os.chmod(d, 0o777)
open({str(theirs / "capture.status" / "rank0.json")!r}, "w").write({json.dumps(json.dumps(fake_done))})
os.symlink({str(theirs.parent)!r}, {str(sticky / f"ondemand_prof-{os.getuid()}")!r})
""")
        assert plant.wait(30) == 0, plant.stderr.read() if plant.stderr else ""
        daemon = start_daemon(dirs["run"], dirs["state"])
        log = tmp_path / "rank.log"
        env = {"TMPDIR": str(sticky), "XDG_RUNTIME_DIR": ""}
        rank = train(tmp_path, "tgjob", env={**env, "ONDEMAND_PROF_RUNTIME_DIR": str(dirs["run"])}, steps=100000,
                     log=log)
        try:
            text = wait_for(lambda: "capture with" in log.read_text() and log.read_text(), 300, "the start-up line")
            fallback = Path(re.search(r"touch (\S+)/capture", text).group(1))  # type: ignore[union-attr]
            assert sticky / f"ondemand_prof-{os.getuid()}" not in fallback.parents

            # the default path for the job id is the planted link: refused, nothing written
            res = ctl(Path("/nonexistent"), "trigger", "--job", "tgjob", "--steps", "2", "--wait", env=env)
            assert res.returncode == 1 and "not writing a trigger there" in res.stderr, res.stdout + res.stderr
            assert "is a symbolic link" in res.stderr and "fake_trace" not in res.stdout + res.stderr
            assert sorted(p.name for p in theirs.iterdir()) == ["capture.status"]

            # the directory the start-up line names
            res = ctl(dirs["run"], "trigger", "--dir", str(fallback), "--steps", "2", "--ranks", "0", "--wait",
                      "--timeout", "120", env=env)
            assert res.returncode == 0, res.stdout + res.stderr
            assert "done: 1 of 1 rank(s) wrote a trace" in res.stdout, res.stdout
            traces = list((tmp_path / "profile").rglob("*.pt.trace.json*"))
            assert traces and str(traces[0]) in res.stdout, res.stdout

            # with the daemon: the job's directory is the one its rank registered (the fallback, not the link)
            res = ctl(dirs["run"], "trigger", "--job", "tgjob", "--action", "stacks", "--wait", "--timeout", "120",
                      env=env)
            assert res.returncode == 0, res.stdout + res.stderr
            assert f"wrote {{\"action\": \"stacks\"}} to {fallback}/capture" in res.stdout, res.stdout
            assert f"{fallback}/capture.status/stacks-rank0.txt" in res.stdout
            assert "done: 1 of 1 rank(s) wrote its stacks" in res.stdout
            assert sorted(p.name for p in theirs.iterdir()) == ["capture.status"]
        finally:
            stop(rank)
            stop(daemon)
    finally:
        shutil.rmtree(sticky, ignore_errors=True)


def test_ondemandctl_trigger_says_what_is_wrong_and_writes_nothing(tmp_path: Path) -> None:
    """Bad input gets a clear error and loses nothing: a bad request is refused before anything is written (as a
    rank would refuse it), a directory no rank watches says so, another's or a world-writable one is refused."""
    env = {"TMPDIR": str(tmp_path)}
    nowhere = Path("/nonexistent")
    res = ctl(nowhere, "trigger", "--job", "j", "--steps", "0", env=env)
    assert res.returncode == 2 and "field 'steps' must be between 1" in res.stderr, res.stderr
    res = ctl(nowhere, "trigger", "--steps", "1", env=env)
    assert res.returncode == 2 and "which job?" in res.stderr, res.stderr
    res = ctl(nowhere, "trigger", "--job", "j", env=env)
    assert res.returncode == 1 and "no rank watches" in res.stderr, res.stderr
    open_dir = tmp_path / "open"
    (open_dir / "capture.status").mkdir(parents=True)
    open_dir.chmod(0o777)
    res = ctl(nowhere, "trigger", "--dir", str(open_dir), env=env)
    assert res.returncode == 1 and "writable by others" in res.stderr and not (open_dir / "capture").exists()
    assert "Traceback" not in res.stderr
