"""A capture's outcome is settled once, on its record, and every reader says the same: `capture --wait`, `list`
(table and --json), `show` (text, --json, exit status), the Prometheus counters and the merge across hosts. A real
daemon (its unix socket, TCP on loopback, --metrics), two real ranks of one job and the real CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from typing import Any

import pytest

from conftest import ROOT, base_env, ctl, ctl_json, daemon, free_port, start_ranks, status_lines, wait_for
from test_daemon import wait_stepping

pytest.importorskip("prometheus_client")
from test_metrics import metrics_url, scrape  # noqa: E402


def test_a_misaligned_capture_is_misaligned_in_list_show_json_metrics_and_across_hosts(env: dict[str, Any]) -> None:
    """Two ranks of one job, not in lockstep (no process group): rank 0 resumed at step 5000, rank 1 from 0, and
    rank 1 stopped (SIGSTOP) while the capture is asked for, so that its start step S is still ahead of rank 1
    however loaded the host (and long past for rank 0). Rank 1 records S and S+1; rank 0 starts at once, late,
    and records two steps from there. Before, `show` and `capture --wait` said misaligned while `list`, its --json
    and the metrics said done (each reader judged it, or not, itself), and `list` across hosts said done."""
    port = free_port()
    daemon(env, "--metrics", "127.0.0.1:0", "--listen", f"tcp://127.0.0.1:{port}")
    url = metrics_url(env["run"])
    procs = []
    steps = env["save"].parent / "rank1.jsonl"  # rank 1's steps as it finishes them (its heartbeats lag)
    for rank, first in ((0, 5000), (1, 0)):
        procs += start_ranks(
            ["--steps", "1000000", "--step-sleep", "0.01", "--first-step", str(first), "--no-dist",
             "--profile-save-path", str(env["save"]), "--profile-min-free-mb", "0", "--profile-ranks", "-1",
             *(["--status-file", str(steps)] if rank == 1 else [])],
            env={"ONDEMAND_PROF_RUNTIME_DIR": str(env["run"]), "ONDEMAND_PROF_JOB_ID": "mis", "RANK": str(rank),
                 "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    env["procs"] += procs
    wait_stepping(env, 2)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        start = status_lines(steps)[-1]["step"] + 30
        wait = subprocess.Popen([str(ROOT / "bin" / "ondemandctl"), "capture", "--start-step", str(start),
                                 "--steps", "2", "--wait", "--timeout", "120"], stdout=subprocess.PIPE, text=True,
                                env=base_env(ONDEMAND_PROF_RUNTIME_DIR=str(env["run"])))
        env["procs"].append(wait)
        first_line = wait.stdout.readline()  # type: ignore[union-attr]
        assert first_line.startswith("capture "), first_line
    finally:
        procs[1].send_signal(signal.SIGCONT)
    out, _ = wait.communicate(timeout=150)
    res = first_line + out
    assert wait.returncode == 6, res
    assert "misaligned: 2 of 2 rank(s) wrote a trace" in res, res
    m = re.search(r"MISALIGNED: ranks recorded different steps: (.*)", res)
    assert m and f"rank(s) 1 recorded steps {start}..{start + 1}" in m.group(1), res
    text = m.group(0)

    (listed,) = ctl_json(env["run"], "list")["captures"]
    assert listed["status"] == "misaligned" and len(listed["recorded"]) == 2, listed
    table = ctl(env["run"], "list")
    assert re.search(rf"^{listed['capture_id']}\s.*\s2/2\s+misaligned\b", table.stdout, re.M), table.stdout
    shown = ctl(env["run"], "show", listed["capture_id"])
    assert shown.returncode == 6 and text in shown.stdout, shown.stdout
    as_json = ctl(env["run"], "show", listed["capture_id"], "--json")
    record = json.loads(as_json.stdout)
    assert as_json.returncode == 6 and record["status"] == "misaligned" and record["misaligned"]["text"] in text

    # the counters: one misaligned capture, none done
    outcome = {("ondemandctl", o): ("ondemand_prof_captures_total", frozenset({("source", "ondemandctl"),
                                                                             ("outcome", o)}))
               for o in ("misaligned", "done")}
    samples = wait_for(lambda: (lambda s: s.get(outcome["ondemandctl", "misaligned"]) == 1.0 and s)(scrape(url)[0]),
                       30, "the misaligned capture counted", pause=0.5)
    assert samples.get(outcome["ondemandctl", "done"]) is None, samples

    # across hosts (this daemon over TCP on loopback): the merged list and show say the same
    hosts = f"127.0.0.1:{port}"
    across = ctl(env["run"], "--hosts", hosts, "list", "--json")
    assert across.returncode == 0, across.stderr
    (merged,) = json.loads(across.stdout)["captures"]
    assert merged["status"] == "misaligned", merged
    shown_across = ctl(env["run"], "--hosts", hosts, "show", listed["capture_id"])
    assert shown_across.returncode == 6 and text in shown_across.stdout, shown_across.stdout


@pytest.mark.quick
def test_the_capture_counter_says_who_asked_for_every_kind_of_capture() -> None:
    """ondemand_prof_captures_total's source label, read from the record: a trigger file's and a signal's captures
    (recorded by the daemon since issue 30) were counted as `ondemandctl`, and an automatic baseline too; the
    automatic-capture counter counts slowdowns, not baselines."""
    from types import SimpleNamespace

    from ondemand_prof.host.metrics import CaptureCounts
    from ondemand_prof.host.records import CaptureRecord, Plan

    def record(cid: str, request: dict[str, Any], **marks: Any) -> CaptureRecord:
        r = CaptureRecord.new(cid, "job", request, Plan(10, 12), {}, [{"rank": 0, "host": "h", "pid": 1}], 0.0)
        r.data.update(marks)
        return r

    store = SimpleNamespace(records={})
    counts = CaptureCounts(store)  # type: ignore[arg-type]
    kinds = {"cli": record("20261206-000000-aaaaaa", {"steps": 2}),
             "file": record("file-3", {"steps": 2}, source="file"),
             "signal": record("signal-1-2", {"signal": "SIGUSR2"}, source="signal"),
             "auto": record("auto-1-r0-1", {"auto": "slower", "slow_rank": 0}),
             "baseline": record("baseline-1-r0-1", {"auto_baseline": "at step 40"}, baseline=True)}
    store.records = {r.capture_id: r for r in kinds.values()}
    counts.update(store)  # type: ignore[arg-type]
    assert counts.auto == {"job": 1}
    for r in kinds.values():
        r.data["status"] = "done"
    counts.update(store)  # type: ignore[arg-type]
    assert counts.outcomes == {("ondemandctl", "done"): 1, ("file", "done"): 1, ("signal", "done"): 1,
                               ("auto", "done"): 2}
