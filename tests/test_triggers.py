"""On-demand windows from trigger files and signals: real gloo ranks, real files, real inotify."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import assert_ok, captures, published, start_ranks, status_lines, stop, trace_steps, train, wait_all, \
    wait_for


def last_step(status_file: Path) -> int:
    lines = status_lines(status_file)
    return lines[-1]["step"] if lines else -1


def rank_status(trigger_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads((trigger_dir / "capture.status" / f"rank{rank}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def trigger_args(save: Path, trig: Path, *extra: str) -> list[str]:
    return ["--profile-save-path", str(save), "--profile-trigger-dir", str(trig), "--profile-min-free-mb", "0",
            "--profile-ranks", "-1", *extra]


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    return tmp_path / "profile", tmp_path / "trigger", tmp_path / "steps.jsonl"


def test_touch_opens_the_default_window(dirs) -> None:
    save, trig, steps = dirs
    procs = start_ranks(["--steps", "200", "--step-sleep", "0.02", "--status-file", str(steps),
                         *trigger_args(save, trig)])
    wait_for(lambda: last_step(steps) >= 5, 120, "training to start")
    (trig / "capture").touch()
    status = wait_for(lambda: (s := rank_status(trig, 0)) and s["latest"]["state"] == "done" and s, what="done")
    assert_ok(wait_all(procs))
    (cap,) = captures(save)
    latest = status["latest"]
    start, end = latest["window"]
    assert end - start == 2  # the default on-demand window: --profile-ondemand-steps 2
    assert trace_steps(cap) == list(range(start, end))
    assert latest["path"] == str(cap["dir"])
    assert latest["seen_at_step"] < start  # scheduled ahead of time, not late
    # from the touch to the agent's read: inotify, not a poll (the bound is loose: a loaded CI host starves threads)
    assert latest["watch"] == "inotify" and latest["detect_latency_ms"] < 10_000
    assert [h["state"] for h in latest["history"]] == ["scheduled", "started", "recording", "writing", "done"]
    assert cap["trigger"]["source"] == "file"


def test_json_request_on_two_ranks_selects_rank_and_options(dirs) -> None:
    save, trig, steps = dirs
    procs = start_ranks(["--steps", "150", "--step-sleep", "0.02", "--status-file", str(steps),
                         *trigger_args(save, trig)], world=2)
    wait_for(lambda: last_step(steps) >= 5, 120, "training to start")
    (trig / "capture").write_text('{"ranks": [1], "steps": 3, "level": "level1", "with_stack": true}')
    wait_for(lambda: (s := rank_status(trig, 1)) and s["latest"]["state"] == "done", what="rank 1 done")
    assert_ok(wait_all(procs))
    (cap,) = captures(save)
    assert cap["rank"] == 1
    assert cap["options"]["level"] == "level1" and cap["options"]["with_stack"] is True
    assert len(trace_steps(cap)) == 3
    r0 = rank_status(trig, 0)["latest"]
    assert r0["state"] == "rejected" and r0["error"] == "rank 0 not selected (ranks [1])"


def test_each_write_acts_once_and_old_triggers_are_not_replayed(dirs) -> None:
    save, trig, steps = dirs
    trig.mkdir(parents=True)
    (trig / "capture").write_text('{"steps": 1}')  # written before the job: must not be replayed
    procs = start_ranks(["--steps", "250", "--step-sleep", "0.02", "--status-file", str(steps),
                         *trigger_args(save, trig)], world=2)
    wait_for(lambda: last_step(steps) >= 5, 120, "training to start")
    time.sleep(0.3)
    assert captures(save) == [] and rank_status(trig, 0) is None
    # the same content twice within one second: two requests
    (trig / "capture").write_text('{"steps": 1}')
    wait_for(lambda: all((s := rank_status(trig, r)) and len(s["triggers"]) == 1 for r in (0, 1)),
             what="both ranks to read the first write")
    # a writer that stalls between truncating and writing (a loaded host does this to "echo > capture"):
    # the empty file in between is not a request of its own, however long the stall
    with open(trig / "capture", "w") as f:
        time.sleep(0.4)
        f.write('{"steps": 1}')
    wait_for(lambda: len(captures(save)) == 4, what="two captures on each of two ranks")
    assert_ok(wait_all(procs))
    caps = captures(save)
    assert sorted(c["rank"] for c in caps) == [0, 0, 1, 1]
    for rank in (0, 1):
        status = rank_status(trig, rank)
        assert [t["state"] for t in status["triggers"]] == ["done", "done"], json.dumps(status, indent=1)
    by_rank = {r: sorted(trace_steps(c)[0] for c in caps if c["rank"] == r) for r in (0, 1)}
    assert by_rank[0] == by_rank[1] and by_rank[0][0] != by_rank[0][1]


@pytest.mark.parametrize("poll", ["0", "0.25"], ids=["inotify", "staggered-polling"])
def test_four_ranks_record_the_same_steps(dirs, poll: str) -> None:
    # with polling at 0.25 s each rank sees the file up to 0.25 s (several steps) after the others
    save, trig, steps = dirs
    procs = start_ranks(["--steps", "220", "--step-sleep", "0.02", "--status-file", str(steps),
                         *trigger_args(save, trig, "--profile-trigger-poll", poll)], world=4)
    wait_for(lambda: last_step(steps) >= 10, 120, "training to start")
    (trig / "capture").write_text('{"steps": 3}')
    wait_for(lambda: len(captures(save)) == 4, timeout=90, what="four captures")
    assert_ok(wait_all(procs))
    caps = captures(save)
    sets = {c["rank"]: trace_steps(c) for c in caps}
    assert sorted(sets) == [0, 1, 2, 3]
    assert len({tuple(s) for s in sets.values()}) == 1, sets
    assert len(sets[0]) == 3
    seen = [rank_status(trig, r)["latest"]["seen_at_step"] for r in range(4)]
    assert all(c["window"]["late_by"] == 0 for c in caps), seen


BAD_TRIGGERS = [
    ("malformed", lambda p: p.write_text('{"steps": 3'), "not valid JSON"),
    ("unknown key", lambda p: p.write_text('{"stesp": 3}'), "unknown field(s) 'stesp'"),
    ("wrong type", lambda p: p.write_text('{"steps": "three"}'), "field 'steps' must be an integer, got 'three'"),
    ("out of range", lambda p: p.write_text('{"steps": 0}'), "field 'steps' must be between 1 and"),
    ("bad level", lambda p: p.write_text('{"level": "max"}'), "field 'level' must be one of level_none, level0"),
    ("not an object", lambda p: p.write_text('[1, 2]'), "expected a JSON object, got list"),
    ("oversized", lambda p: p.write_text('{"id": "' + "x" * 70000 + '"}'), "a trigger holds at most 65536 bytes"),
    ("symlink", lambda p: p.symlink_to("/etc/hostname"), "is a symbolic link; write a regular file"),
    ("directory", lambda p: p.mkdir(), "is a directory; write a regular file"),
]


def test_bad_triggers_get_a_clear_status_and_nothing_else(dirs) -> None:
    save, trig, steps = dirs
    stop = save.parent / "stop"  # the run lasts as long as the checks take, however loaded the host
    procs = start_ranks(["--steps", "100000", "--step-sleep", "0.01", "--status-file", str(steps),
                         "--stop-file", str(stop), *trigger_args(save, trig)])
    wait_for(lambda: last_step(steps) >= 5, 120, "training to start")
    path = trig / "capture"
    for name, write, message in BAD_TRIGGERS:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
        write(path)
        status = wait_for(lambda: (s := rank_status(trig, 0)) and s["latest"]["state"] == "rejected"
                          and message in s["latest"]["error"] and s, timeout=20, what=name)
        assert status["latest"]["error"], name
    stop.touch()
    assert_ok(wait_all(procs))
    assert captures(save) == []


def test_unreadable_trigger(dirs) -> None:
    save, trig, steps = dirs
    prefix = None
    if os.geteuid() == 0:  # root reads anything: run the training run as nobody
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        base = steps.parent
        base.chmod(0o755)
        for d in base.parents:  # every level pytest made 0700 (pytest-of-root, the run's, xdist's per worker)
            if d.stat().st_mode & 0o005 != 0o005:
                d.chmod(d.stat().st_mode | 0o005)
        # nobody's own directory: a world-writable parent would (rightly) make the rank refuse its trigger
        # directory and fall back to a private one
        own = base / "nobody"
        own.mkdir(mode=0o755)
        os.chown(own, 65534, 65534)
        save, trig, steps = own / "profile", own / "trigger", own / "steps.jsonl"
    procs = start_ranks(["--steps", "300", "--step-sleep", "0.01", "--status-file", str(steps),
                         *trigger_args(save, trig)], prefix=prefix)
    def started() -> bool:  # (a rank that ended says why now, not after the wait; its imports as nobody at load 10
        # took over 120 s in a loaded fresh-clone run)
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank ended before step 5 (rc {p.returncode}): {p.communicate()[1][-3000:]}")
        return last_step(steps) >= 5

    wait_for(started, 300, "training to start")
    # made unreadable before it takes the trigger's name (a rank could read "{}" between a write and a chmod)
    staged = trig / "capture.tmp"
    staged.write_text("{}")
    staged.chmod(0)
    staged.rename(trig / "capture")
    status = wait_for(lambda: (s := rank_status(trig, 0)) and s["latest"]["state"] == "rejected" and s,
                      timeout=20, what="rejection")
    assert "is not readable by uid" in status["latest"]["error"]
    assert_ok(wait_all(procs))
    assert captures(save) == []


def test_overlapping_request_is_busy_and_static_window_yields(dirs) -> None:
    save, trig, steps = dirs
    # a static window far ahead, and a long on-demand window that will cover it (the trigger, written at step 40,
    # may be seen up to 60 steps later, 1.2 s on a loaded machine; the second is seen within its 2 s of recording)
    procs = start_ranks(["--steps", "240", "--step-sleep", "0.02", "--status-file", str(steps),
                         "--profile", "--profile-step-start", "100", "--profile-step-end", "102",
                         *trigger_args(save, trig)])
    wait_for(lambda: last_step(steps) >= 40, what="training to reach step 40")
    (trig / "capture").write_text('{"steps": 100}')
    wait_for(lambda: (s := rank_status(trig, 0)) and s["latest"]["state"] == "recording", what="recording")
    (trig / "capture").write_text('{"steps": 2}')
    busy = wait_for(lambda: (s := rank_status(trig, 0)) and s["latest"]["state"] == "rejected" and s, what="busy")
    results = wait_all(procs)
    assert_ok(results)
    assert busy["latest"]["error"].startswith("busy: window [")
    assert "holds the profiler" in busy["latest"]["error"]
    caps = captures(save)
    assert [c["trigger"]["source"] for c in caps] == ["file"]
    assert len(trace_steps(caps[0])) == 100
    assert "static window [100, 102) skipped: on-demand window" in results[0][2]


def test_signal_storm_opens_one_window(dirs) -> None:
    save, trig, steps = dirs
    procs = start_ranks(["--steps", "150", "--step-sleep", "0.02", "--status-file", str(steps),
                         "--profile-signal", "SIGUSR2", *trigger_args(save, trig)])
    wait_for(lambda: last_step(steps) >= 5, 120, "training to start")
    pid = procs[0].pid
    t0 = time.monotonic()
    for _ in range(1000):
        os.kill(pid, signal.SIGUSR2)
    assert time.monotonic() - t0 < 1.0
    assert_ok(wait_all(procs))
    (cap,) = captures(save)
    assert cap["trigger"]["source"] == "signal"
    assert len(trace_steps(cap)) == 2


@pytest.mark.quick
def test_default_trigger_dirs_differ_between_jobs() -> None:
    from ondemand_prof.rank.triggers import default_trigger_dir

    a, b = default_trigger_dir("port29500"), default_trigger_dir("port29501")
    assert a != b and a.parent == b.parent and a.parent.name == f"ondemand_prof-{os.getuid()}"


def test_hook_logs_the_command_to_touch(dirs) -> None:
    save, trig, steps = dirs
    ((rc, out, err),) = wait_all(start_ranks(["--steps", "2", *trigger_args(save, trig)]))
    assert rc == 0
    # the start-up line, even for a 2-step run
    assert f"capture with `touch {trig / 'capture'}` (all ranks of the job that watch it" in err
    assert (trig.stat().st_mode & 0o777) == 0o700


@pytest.mark.quick
def test_log_budget_says_how_many_lines_it_held_back() -> None:
    """A loop rewriting the trigger gets five warning lines a minute, then one that counts the rest."""
    from ondemand_prof.rank.trigger_status import LogBudget

    now = [0.0]
    budget = LogBudget(burst=5, period_s=60.0, clock=lambda: now[0])
    said = [budget.take() for _ in range(12)]
    assert said[:5] == [(True, 0)] * 5 and said[5:] == [(False, 0)] * 7
    assert not budget.due()
    now[0] = 61.0
    assert budget.due() and budget.held == 7
    assert budget.take() == (True, 7) and not budget.due()  # the next line says how many were held back


@pytest.mark.quick
def test_trigger_wait_prints_each_ranks_final_line_once(tmp_path: Path) -> None:
    """Issue 44, 6: `ondemandctl trigger --wait` printed `rank 0 done <path>` twice, as progress and again in the
    result. Progress shows the states a rank passes through; its final line is the result's, once."""
    import io
    import socket

    from ondemand_prof.host.commands.trigger import Trigger, result_text

    directory = tmp_path / "trig"
    (directory / "capture.status").mkdir(parents=True, mode=0o700)
    directory.chmod(0o700)
    entry = {"trigger": "v1", "state": "recording", "window": [3, 5]}
    status = directory / "capture.status" / "rank0.json"

    def write(**change: Any) -> None:
        entry.update(change)
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "triggers": [entry],
                                   "latest": entry}))
        tmp.rename(status)

    write()
    out = io.StringIO()
    import threading

    later = threading.Timer(0.5, write, kwargs={"state": "done", "trace": "/p/c/rank0.pt.trace.json",
                                                "steps": [3, 4]})
    later.start()
    answers, finished = Trigger().wait(directory, "v1", {0}, 30.0, out)
    later.join()
    printed = out.getvalue() + result_text(answers, finished, directory)
    done = "  rank 0    done  /p/c/rank0.pt.trace.json  steps 3..4"
    assert printed.count(done) == 1 and printed.count("rank 0 ") == 2, printed
    assert printed.startswith("  rank 0    recording  steps [3, 5)\n"), printed
    assert "done: 1 of 1 rank(s) wrote a trace\n" + done in printed, printed


# ----------------------------------------------------------------------------------------------------------
# From test_security.py: a window's final status when its rank is ended; exactly the requested windows (issue 9)


def _rank_with_open_window(tmp_path: Path, job: str) -> tuple[subprocess.Popen, Path]:
    trig = tmp_path / "trig"
    steps = tmp_path / "steps.jsonl"
    proc = train(tmp_path, job, "--profile-trigger-dir", str(trig), "--status-file", str(steps), steps=5000)
    wait_for(lambda: status_lines(steps) or proc.poll() is not None, 300, "training to start")
    (trig / "capture").write_text('{"steps": 2000}')
    status = trig / "capture.status" / "rank0.json"
    wait_for(lambda: status.exists() and json.loads(status.read_text())["latest"]["state"] == "recording", 300,
             "the window to record")
    return proc, status


def test_sigterm_mid_window_leaves_a_final_status(tmp_path: Path) -> None:
    proc, status = _rank_with_open_window(tmp_path, "termed")
    proc.send_signal(15)
    proc.communicate(timeout=60)
    assert proc.returncode == -15  # it still dies of SIGTERM, as before
    latest = json.loads(status.read_text())["latest"]
    assert latest["state"] == "failed" and "SIGTERM" in latest["error"], latest


def test_kill_9_mid_window_reads_as_failed_and_is_settled_by_the_next_rank(tmp_path: Path) -> None:
    from ondemand_prof.rank.terminate import read_status

    proc, status = _rank_with_open_window(tmp_path, "killed")
    proc.kill()
    proc.communicate(timeout=60)
    assert json.loads(status.read_text())["latest"]["state"] == "recording"  # nobody could write it
    seen = read_status(status)
    assert seen is not None and seen["latest"]["state"] == "failed" and "is gone" in seen["latest"]["error"]
    again = train(tmp_path, "killed", "--profile-trigger-dir", str(tmp_path / "trig"), steps=20)
    again.communicate(timeout=120)
    assert json.loads(status.read_text())["latest"]["state"] == "failed"


WRITER = r"""
import json, os, random, sys, time
path, n = sys.argv[1], int(sys.argv[2])
random.seed(9)
for i in range(n):
    with open(path, "w") as fh:  # truncates, then (after a stall) writes: the trigger is empty in between
        # every 40th stall is longer than any settle time a reader could wait for (file_trigger.EMPTY_SETTLE_S is 0.25)
        time.sleep(0.4 if i % 40 == 39 else random.choice((0, 0, 0.001, 0.005, 0.02)))
        fh.write(json.dumps({"steps": 1, "start_step": 10**9, "id": f"req{i}"}))
    time.sleep(random.choice((0, 0.001, 0.003)))
"""


def _stepping_rank(tmp_path: Path, job: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    trig, steps = tmp_path / "trig", tmp_path / "steps.log"
    # a rejected trigger is logged (a line each): 1000 of them would fill a pipe, so the log goes to a file
    proc = train(tmp_path, job, "--profile-trigger-dir", str(trig), "--status-file", str(steps), *extra,
                 steps=100_000, log=tmp_path / "rank.log")
    wait_for(lambda: (steps.exists() and len(steps.read_text().splitlines()) >= 3) or proc.poll() is not None,
             180, "the rank to step")
    return proc, trig


def _handled(status: Path, request_id: str) -> Any:
    entries = json.loads(status.read_text())["triggers"] if status.exists() else []
    return next((e for e in entries if (e.get("request") or {}).get("id") == request_id), None)


def test_metadata_only_changes_of_a_handled_trigger_open_nothing(tmp_path: Path) -> None:
    proc, trig = _stepping_rank(tmp_path, "meta")
    status = trig / "capture.status" / "rank0.json"
    try:
        (trig / "capture").write_text(json.dumps({"steps": 1, "start_step": 10**9, "id": "only"}))
        wait_for(lambda: _handled(status, "only"), 180, "the request to be handled")
        before = json.loads(status.read_text())["triggers"]
        os.chmod(trig / "capture", 0o600)  # chmod
        st = os.stat(trig / "capture")
        os.utime(trig / "capture", ns=(time.time_ns(), st.st_mtime_ns))  # touch -a
        os.link(trig / "capture", tmp_path / "hardlink")  # a hard link
        time.sleep(2.0)
        after = json.loads(status.read_text())["triggers"]
    finally:
        stop(proc)
    assert [e["trigger"] for e in after] == [e["trigger"] for e in before], after


def test_the_kernel_says_whether_a_writer_holds_the_trigger(tmp_path: Path) -> None:
    """An empty trigger is a touch only when nobody holds it open for writing (a read lease is refused then)."""
    from ondemand_prof.rank.triggers import writer_holds

    path = tmp_path / "capture"
    path.touch()
    assert writer_holds(path) is False
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(path)!r}, 'w'); print(1, flush=True); "
                               "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        assert writer_holds(path) is True  # truncated, not yet written: not a touch, however long it stalls
    finally:
        holder.kill()
        holder.wait()
    assert writer_holds(path) is False
    os.symlink(path, tmp_path / "link")
    assert writer_holds(tmp_path / "link") is None  # never follows a link


@pytest.mark.parametrize("watch", [[], ["--profile-trigger-poll", "0.1"]], ids=["inotify", "polling"])
def test_rewrites_with_stalls_open_no_unrequested_window(tmp_path: Path, watch: list[str]) -> None:
    """Every request here is for step 10**9 (never reached): any window that records is one nobody asked for
    (an empty, half-written trigger taken for a "touch"), and so is any handled trigger without our id. Polling
    sees no writers at all: there only the kernel's answer (a read lease) tells a 0.4 s stall from a touch."""
    proc, trig = _stepping_rank(tmp_path, "exact", *watch)
    status = trig / "capture.status" / "rank0.json"
    try:
        # the 1000 rewrites with inotify; 400 (10 stalls of 0.4 s) show the polling case, keeping time down
        count = "400" if watch else "1000"
        began = time.monotonic()
        writer = subprocess.run([sys.executable, "-c", WRITER, str(trig / "capture"), count], timeout=600)
        assert writer.returncode == 0
        last = json.loads((trig / "capture").read_text())["id"]
        wait_for(lambda: _handled(status, last), 180, "the last request to be handled")
        latest = json.loads(status.read_text())
    finally:
        stop(proc)
    took = time.monotonic() - began
    unrequested = [t for t in latest["triggers"] if "id" not in (t.get("request") or {})]
    assert unrequested == [], unrequested
    assert published(tmp_path / "profile") == [], "a window nobody asked for was recorded"
    # every request after the first is rejected (busy): the rank's log gets a few lines a minute, not one each
    log_lines = (tmp_path / "rank.log").read_text().splitlines()
    rejected = [line for line in log_lines if " rejected on rank 0: busy" in line]
    held = [line for line in log_lines if "more trigger(s) rejected or failed, not logged" in line or
            "more rejected or failed since, not logged" in line]
    assert 1 <= len(rejected) <= 5 * (1 + int(took // 60)) and held, log_lines[-20:]


@pytest.mark.quick
def test_one_rule_names_a_jobs_trigger_directory_and_a_capture_folder() -> None:
    """Issue 41: job_dir_name (the trigger directory) and the rank's safe_name (a capture folder) are one
    function, core/files.py path_component, each with its own fallback: for an ASCII id both give what they gave
    before (the two rules, written out here); a non-ASCII letter is '_' in both now (job_dir_name kept it)."""
    from ondemand_prof.core.files import path_component
    from ondemand_prof.rank.layout import safe_name
    from ondemand_prof.rank.triggers import job_dir_name

    def old_job_dir_name(job_id: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)[:128].strip(".") or "job"

    def old_safe_name(text: str) -> str:
        ok = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
        return "".join(c if c in ok else "_" for c in text)[:128].strip(".") or "capture"

    ascii_ids = ["", ".", "..", "...", "a/b", "/abs", "../../etc", "job-1_2.3", ".hidden.", "a b\tc\n", "x" * 300,
                 "." + "y" * 200, "tab\x00nul", "$(rm -rf ~)", "A:B@C", "".join(map(chr, range(128)))]
    for text in ascii_ids:
        assert job_dir_name(text) == old_job_dir_name(text), text
        assert safe_name(text) == old_safe_name(text), text
        assert path_component(text, "capture") == old_safe_name(text), text
    assert job_dir_name("jöb-€²") == safe_name("jöb-€²") == "j_b-__"
    assert job_dir_name("日本") == "__" and job_dir_name("..") == "job" and safe_name("..") == "capture"
    assert path_component("", "fallback") == "fallback"
