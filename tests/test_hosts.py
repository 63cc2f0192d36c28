"""Many hosts, simulated on loopback: 16 real ondemand-profd processes (each its own runtime and state
directory and TCP port on 127.0.0.1, all with CurveZMQ keys), the 4 ranks of one real gloo job split among
the first four of them (one rank each; the other 12 daemons have no ranks of the job), and the real
ondemandctl fanning out over TCP, under faults: a dead host in the list, a daemon stopped (SIGSTOP) right
after the status round or mid-capture, a daemon killed and restarted. Plus the pure parts: host lists, SLURM
nodelists, key files, the alignment checks, summaries (the planning across hosts: tests/test_planning.py). The
same faults in real network namespaces, with a link taken down: tests/test_netns.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT, base_env, captures, free_port, short_dir, summaries_written, trace_steps, \
    wait_for
from ondemand_prof.host import ctl as ctl_main
from ondemand_prof.host import fanout
from ondemand_prof.host.alignment import late_refusal, mark_misaligned, misalignment
from ondemand_prof.host.hosts import HostSpecError, expand_nodelist, parse_hosts, read_hostfile, slurm_nodelist
from ondemand_prof.host.keys import KeyFileError, authorized_keys, keygen, load_pair
from ondemand_prof.host.records import Plan
from ondemand_prof.host.summaries import MAX_SUMMARY_BYTES, merge_summaries, part_summaries, read_summary

DAEMONS = 16
RANKS = 4  # rank i registers with daemon i
LAST_RANK_CAP = 160  # --profile-max-window-steps of the last rank (the others keep the default, 200)


# ----------------------------------------------------------------------------------------------------------
# Host lists

@pytest.mark.quick
def test_nodelists_expand_as_scontrol_show_hostnames() -> None:
    assert expand_nodelist("a[1-2],b[01-03,7]") == ["a1", "a2", "b01", "b02", "b03", "b7"]
    assert expand_nodelist("node[01-64]")[0] == "node01" and expand_nodelist("node[01-64]")[-1] == "node64"
    assert len(expand_nodelist("node[01-64]")) == 64
    assert expand_nodelist("gpu[1-3,7]") == ["gpu1", "gpu2", "gpu3", "gpu7"]
    assert expand_nodelist("rack[1-2]-n[8-10]") == ["rack1-n8", "rack1-n9", "rack1-n10", "rack2-n8", "rack2-n9",
                                                    "rack2-n10"]
    assert expand_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]
    assert expand_nodelist("solo,pair[1-2]") == ["solo", "pair1", "pair2"]
    for bad in ("node[01-", "node]1[", "node[3-1]", "node[a-b]", "node[1-2000000]", "bad/name"):
        with pytest.raises(HostSpecError):
            expand_nodelist(bad)


@pytest.mark.quick
def test_host_lists_with_ports_ranges_and_files(tmp_path: Path) -> None:
    targets = parse_hosts("node[01-02]:7400,gpu[1-2],[::1]:9,gpu1", 7355)
    assert [(t.host, t.port) for t in targets] == [("node01", 7400), ("node02", 7400), ("gpu1", 7355),
                                                  ("gpu2", 7355), ("::1", 9)]  # the second gpu1 is dropped
    assert targets[0].name == "node01:7400" and targets[2].name == "gpu1" and targets[4].url == "tcp://[::1]:9"
    with pytest.raises(HostSpecError, match="port"):
        parse_hosts("node1:99999")
    with pytest.raises(HostSpecError, match="not an IPv6 address"):
        parse_hosts("[::/../x]:1")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's hosts\nnode[1-2] slots=8\n\nnode3:7000  # spare\n")
    assert [t.name for t in read_hostfile(hostfile)] == ["node1", "node2", "node3:7000"]
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(HostSpecError, match="no hosts"):
        read_hostfile(tmp_path / "empty")


@pytest.mark.quick
def test_slurm_nodelist_from_the_job_environment_or_squeue() -> None:
    env = {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "gpu[1-2],cpu7"}
    never = lambda argv: pytest.fail(f"ran {argv}")  # noqa: E731
    assert slurm_nodelist("123", env, run=never, which=lambda _: None) == "gpu[1-2],cpu7"
    asked: list[list[str]] = []
    out = slurm_nodelist("456", env, run=lambda argv: asked.append(argv) or "n[01-02]\n",
                         which=lambda name: "/usr/bin/" + name)
    assert out == "n[01-02]" and asked == [["squeue", "-h", "-j", "456", "-o", "%N"]]
    scontrol = "JobId=456 JobName=x\n   NodeList=n[3-4] BatchHost=n3\n   ReqNodeList=(null)\n"
    assert slurm_nodelist("456", {}, run=lambda argv: scontrol,
                          which=lambda name: "/bin/scontrol" if name == "scontrol" else None) == "n[3-4]"
    with pytest.raises(HostSpecError, match="neither squeue nor scontrol"):
        slurm_nodelist("456", env, run=never, which=lambda _: None)
    with pytest.raises(HostSpecError, match="job id"):
        slurm_nodelist("12; rm -rf /", env, run=never, which=lambda _: None)


@pytest.mark.quick
def test_a_daemon_that_was_paused_reads_its_queue_before_it_expires_ranks(service: Any) -> None:
    """A host paused right after a status round (SIGSTOP, a VM pause) must not drop its ranks as silent when
    it resumes: their heartbeats wait in its own queue; the capture that waited with them would find no rank."""
    svc = service
    svc.registry.register(b"r0", {"job": "j", "rank": 0, "world_size": 1, "host": "h", "pid": 1, "step": 5}, 0.0,
                          time.time(), lambda pid, thorough: True)
    svc.housekeeping(0.0)
    svc.housekeeping(6.0)  # the daemon did not run for 6 s
    assert [i.rank for i in svc.registry.by_route.values()] == [0]
    svc.housekeeping(6.2)  # it ran, and still nothing from the rank: gone
    assert not svc.registry.by_route


@pytest.mark.quick
def test_late_and_misaligned_captures_are_named() -> None:
    plan = Plan(300, 302, {0: 290, 1: 640}, past_ranks=(1,))
    text = late_refusal(plan)
    assert text is not None and "rank(s) 1 were already past step 300 (at step 640)" in text
    assert late_refusal(dataclasses.replace(plan, past_ranks=())) is None
    # a synthetic record, as the issue found it: one id, two ranks, different steps
    part = {"state": "done", "path": "/p"}
    record = {"status": "done", "parts": {"0": {**part, "rank": 0, "steps": list(range(302, 322))},
                                          "1": {**part, "rank": 1, "steps": list(range(622, 642))},
                                          "2": {**part, "rank": 2, "steps": list(range(302, 322))},
                                          "3": {**part, "rank": 3, "steps": [302], "cancelled": True}}}
    found = misalignment(record)
    assert found is not None and found["text"] == ("ranks recorded different steps: rank(s) 0,2 recorded steps "
                                                   "302..321; rank(s) 1 recorded steps 622..641"), found
    assert mark_misaligned(record) and record["status"] == "misaligned"
    record["parts"]["1"]["steps"] = list(range(302, 322))
    assert misalignment(record) is None  # the cancelled part stopped early on purpose: not misaligned


# ----------------------------------------------------------------------------------------------------------
# Summaries and merged states

def write_summary(folder: Path, rank: int, steps: list[int], mm_us: float = 3000.0, **meta: Any) -> dict[str, Any]:
    """A rank's summary.json as its post-processing writes it (rank/postprocess.py's writer), of a small trace
    built here (SYNTHETIC: a ProfilerStep of 9 ms and an aten::mm of `mm_us` each step); `meta`: the metadata
    fields a rank adds (capture_id, job_id, options)."""
    from ondemand_prof.rank.postprocess import write_rank_summary

    events = []
    for i, step in enumerate(steps):
        t = 1_000_000 + 10_000 * i
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": t, "dur": 9000,
                    "pid": 1, "tid": 1},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 100, "dur": mm_us, "pid": 1, "tid": 1}]
    folder.mkdir(parents=True, exist_ok=True)
    write_rank_summary(folder, {"traceEvents": events}, {"rank": rank, "world_size": 2, "meta": meta})
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.quick
def test_summaries_are_read_safely_and_merged_with_the_failed_parts(tmp_path: Path) -> None:
    ok = tmp_path / "r0"
    write_summary(ok, 0, [5])
    linked = tmp_path / "r1"
    linked.mkdir()
    (linked / "summary.json").symlink_to(ok / "summary.json")
    big = tmp_path / "r2"
    big.mkdir()
    (big / "summary.json").write_text(" " * (MAX_SUMMARY_BYTES + 1))
    assert read_summary(str(ok))["step_ms_mean"] == 9.0
    with pytest.raises(OSError):
        read_summary(str(linked))  # never followed: a rank cannot point the daemon at another file
    with pytest.raises(ValueError, match="limit"):
        read_summary(str(big))
    record = {"parts": {str(r): {"rank": r, "host": "h", "pid": r, "state": "done", "path": str(d)}
                        for r, d in enumerate([ok, linked, big])}}
    record["parts"]["3"] = {"rank": 3, "host": "h", "pid": 3, "state": "failed", "error": "rank 3 is gone"}
    parts = part_summaries(record)
    assert [("summary" in p, p.get("error", "")[:10]) for p in parts] == [
        (True, ""), (False, "no summary"), (False, "no summary"), (False, "rank 3 is ")]
    reply = {"capture_id": "c1", "job": "j", "window": [5, 6], "status": "partial", "options": {"level": "asked"},
             "parts": parts}
    merged = merge_summaries([("node1", reply)])
    group = merged["captures"][0]
    assert merged["ranks_read"] == 1 and [r["rank"] for r in group["ranks"]] == [0]
    assert sorted(f["rank"] for f in group["failed"]) == [1, 2, 3]
    assert group["options"] == {"level": "asked"}  # no summary holds options: those asked for (the record's)
    parts[0]["summary"]["options"] = {"with_cpu": True, "level": "Level1"}  # as the rank recorded them
    assert list(merge_summaries([("node1", reply)])["captures"][0]["options"].items()) == [
        ("level", "Level1"), ("with_cpu", True)]


@pytest.mark.quick
def test_a_summary_that_cannot_stand_for_its_trace_fails_its_rank_alone(tmp_path: Path) -> None:
    """A rank's summary.json is its own word (and a file that can be damaged): each way a helper broke one, as a
    user would (valid JSON all), fails that rank with the field named, never the report (it raised TypeError,
    KeyError or ValueError for every rank, blamed on the daemon's reply) and never shows another capture's or
    rank's figures or absurd numbers as this rank's. The text and the HTML render what is left."""
    from ondemand_prof.report.html import render_html
    from ondemand_prof.report.text import render_text

    good = write_summary(tmp_path / "r0", 0, [5, 6], capture_id="c1", job_id="j")
    other = write_summary(tmp_path / "other", 1, [7, 8], mm_us=6000.0, capture_id="c2", job_id="j")
    broken = {
        "steps is 'x'": {"steps": "x"}, "steps[0] is 1": {"steps": [1, 2]}, "steps is missing": {"steps": None},
        "top_self[0].name is None": {"top_self": [{"x": 1}]},
        "steps[0].dur_ms is 'abc'": {"steps": [{**good["steps"][0], "dur_ms": "abc"}]},
        "step_ms_mean is 1e+300": {"step_ms_mean": 1e300}, "compute_pct is 1e+300": {"compute_pct": 1e300},
        "capture_id is 'c2'": other, "rank is 0": {"rank": 0}, "summary_version is None": {},
        "collectives[0].via is [[1]]": {"collectives": [{"kind": "all_reduce", "via": [[1]]}]},
        "memory.devices is 'x'": {"memory": {"devices": "x"}},
    }
    for said, change in broken.items():
        summary = dict(other) if change is other else {**good, "rank": 1, **change}
        if said == "steps is missing":
            del summary["steps"]
        if said == "summary_version is None":
            summary = {}
        parts = [{"rank": 0, "host": "h", "pid": 1, "state": "done", "path": "/p/r0", "summary": good},
                 {"rank": 1, "host": "h", "pid": 2, "state": "done", "path": "/p/r1", "summary": summary}]
        reply = {"capture_id": "c1", "job": "j", "window": [5, 7], "status": "done", "options": {}, "parts": parts}
        merged = merge_summaries([("node1", reply)])
        group = merged["captures"][0]
        assert [r["rank"] for r in group["ranks"]] == [0], said
        (failed,) = group["failed"]
        assert failed["rank"] == 1 and failed["error"].startswith(f"summary.json: {said}"), (said, failed)
        assert "rank 0" in render_text(merged) and "summary.json: " in render_text(merged), said
        assert "rank 0" in render_html(merged), said


# ----------------------------------------------------------------------------------------------------------
# Keys

@pytest.mark.quick
def test_keygen_makes_owner_only_keys_and_unsafe_ones_are_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    res = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "keygen", str(keys)], env=base_env(),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700 and stat.S_IMODE((keys / "authorized").stat().st_mode) == 0o700
    for f in [*keys.iterdir(), *(keys / "authorized").iterdir()]:
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    server = load_pair(keys, "server")
    assert list(authorized_keys(keys)) == [load_pair(keys, "client").public] != [server.public]
    again = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "keygen", str(keys)], env=base_env(),
                           capture_output=True, text=True)
    assert again.returncode == 0 and "nothing changed" in again.stdout
    assert load_pair(keys, "server") == server  # a second run never replaces a key hosts trust

    os.chmod(keys / "server.key_secret", 0o640)
    with pytest.raises(KeyFileError, match="readable by others"):
        load_pair(keys, "server")
    os.chmod(keys / "server.key_secret", 0o600)
    os.chmod(keys / "authorized", 0o777)
    with pytest.raises(KeyFileError, match="writable by group or others"):
        authorized_keys(keys)
    os.chmod(keys / "authorized", 0o700)
    (keys / "link.key_secret").symlink_to(keys / "server.key_secret")
    with pytest.raises(KeyFileError, match="symlinks"):
        load_pair(keys, "link")


def test_daemon_refuses_tcp_beyond_loopback_without_keys_and_with_unsafe_keys(tmp_path: Path) -> None:
    run_dir, state = short_dir("odph"), short_dir("odphs")
    try:
        base = [str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run_dir), "--state-dir", str(state)]
        res = subprocess.run([*base, "--listen", "tcp://0.0.0.0:0"], env=base_env(), capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 1 and "reaches beyond this host: give --keys" in res.stderr
        keygen(tmp_path / "k")
        os.chmod(tmp_path / "k" / "server.key_secret", 0o644)
        res = subprocess.run([*base, "--listen", "tcp://0.0.0.0:0", "--keys", str(tmp_path / "k")], env=base_env(),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 1 and "readable by others" in res.stderr
        assert not (run_dir / "profd.sock").exists()
        # loopback without keys is served (with a warning), and ondemandctl needs no keys for it
        proc = subprocess.Popen([*base, "--listen", "tcp://127.0.0.1:0"], env=base_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: (run_dir / "profd.tcp").exists() or proc.poll() is not None, 60, "the daemon")
            port = (run_dir / "profd.tcp").read_text().strip().rsplit(":", 1)[1]
            res = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "--hosts", f"127.0.0.1:{port}", "status"],
                                 env=base_env(), capture_output=True, text=True, timeout=120)
            assert res.returncode == 0 and "no ranks registered" in res.stdout, res.stderr
        finally:
            proc.terminate()
            assert "without keys: any local user can reach this daemon" in proc.communicate(timeout=60)[1]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# A simulated cluster

class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.keys = root / "keys"
        keygen(self.keys)
        self.save = root / "profile"
        self.daemons: list[dict[str, Any]] = []
        self.ranks: list[subprocess.Popen] = []

    def start_daemon(self, i: int, port: int = 0, again: dict[str, Any] | None = None) -> dict[str, Any]:
        """Daemon i; `again`: a stopped one, restarted on its directories (and, given `port`, its port)."""
        d = {"run": short_dir(f"odh{i}-"), "state": short_dir(f"odhs{i}-"), "log": self.root / f"profd{i}.log"} \
            if again is None else {k: again[k] for k in ("run", "state", "log")}
        (d["run"] / "profd.tcp").unlink(missing_ok=True)
        d["proc"] = subprocess.Popen(
            [str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(d["run"]), "--state-dir", str(d["state"]),
             "--listen", f"tcp://127.0.0.1:{port}", "--keys", str(self.keys)],
            env=base_env(), stdout=subprocess.DEVNULL, stderr=open(d["log"], "a"))
        wait_for(lambda: (d["run"] / "profd.tcp").exists() or d["proc"].poll() is not None, 60, "a daemon")
        assert d["proc"].poll() is None, d["log"].read_text()
        d["port"] = int((d["run"] / "profd.tcp").read_text().strip().rsplit(":", 1)[1])
        return d

    def start_ranks(self, steps: int) -> None:
        port = str(free_port())
        for rank in range(RANKS):
            env = base_env(RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, ONDEMAND_PROF_RUNTIME_DIR=str(self.daemons[rank]["run"]))
            self.ranks.append(subprocess.Popen(
                [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", str(steps), "--step-sleep", "0.02",
                 "--profile-min-free-mb", "0", "--profile-save-path", str(self.save),
                 # the last host's rank allows shorter windows than the others
                 *(["--profile-max-window-steps", str(LAST_RANK_CAP)] if rank == RANKS - 1 else [])],
                env=env, stdout=subprocess.DEVNULL, stderr=open(self.root / f"rank{rank}.log", "w")))

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{d['port']}" for d in self.daemons)

    def ctl(self, *args: str, keys: Path | None = None, hosts: str | None = None, timeout: float = 180
            ) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "bin" / "ondemandctl"), "--hosts", hosts or self.hosts, "--keys",
                               str(keys or self.keys), *args], env=base_env(), capture_output=True, text=True,
                              timeout=timeout)

    def stop(self) -> None:
        for p in [*self.ranks, *(d["proc"] for d in self.daemons)]:
            if p.poll() is None:
                p.kill()
                p.wait()
        for d in self.daemons:
            shutil.rmtree(d["run"], ignore_errors=True)
            shutil.rmtree(d["state"], ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.daemons = [c.start_daemon(i) for i in range(DAEMONS)]
        c.start_ranks(100_000)

        def stepping() -> bool:
            res = c.ctl("status", "--json")
            if res.returncode != 0:
                return False
            ranks = [r for h in json.loads(res.stdout)["hosts"].values() for rs in h["data"]["jobs"].values()
                     for r in rs]
            return len(ranks) == RANKS and all(r["step_time_s"] for r in ranks)

        wait_for(stepping, 300, "4 ranks registered with 4 of the 16 daemons and stepping")
        yield c
    finally:
        c.stop()


def test_status_across_16_daemons_lists_every_rank_by_host(cluster: Cluster) -> None:
    res = cluster.ctl("status", "--json")
    assert res.returncode == 0, res.stderr
    hosts = json.loads(res.stdout)["hosts"]
    assert len(hosts) == DAEMONS and all(h["ok"] for h in hosts.values())
    ranks = {r["rank"]: name for name, h in hosts.items() for rs in h["data"]["jobs"].values() for r in rs}
    assert ranks == {i: f"127.0.0.1:{cluster.daemons[i]['port']}" for i in range(RANKS)}
    text = cluster.ctl("status")
    assert text.returncode == 0 and text.stdout.count("== 127.0.0.1:") == DAEMONS


def test_hostfile_and_slurm_name_the_same_daemons(cluster: Cluster, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"127.0.0.1:{d['port']}  # daemon {i}\n" for i, d in enumerate(cluster.daemons[:2])))
    cmd = [str(ROOT / "bin" / "ondemandctl"), "--keys", str(cluster.keys)]
    res = subprocess.run([*cmd, "--hostfile", str(hostfile), "status", "--json"], env=base_env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["hosts"]) == 2
    # inside SLURM job 77 whose nodelist is this host: --slurm reads the job's environment (no SLURM installed)
    port = cluster.daemons[1]["port"]
    res = subprocess.run([*cmd, "--slurm", "77", "--port", str(port), "status", "--json"], capture_output=True,
                         env=base_env(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="127.0.0.[1]"), text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    hosts = json.loads(res.stdout)["hosts"]
    assert list(hosts) == ["127.0.0.1"] and [r["rank"] for r in hosts["127.0.0.1"]["data"]["jobs"].popitem()[1]] == [1]


def test_one_aligned_capture_across_hosts_with_one_id_and_summaries_merged(cluster: Cluster) -> None:
    res = cluster.ctl("capture", "--steps", "3", "--wait", "--json", "--timeout", "120")
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads(res.stdout)
    assert record["status"] == "done" and len(record["parts"]) == RANKS
    start, end = record["window"]
    assert end - start == 3
    for part in record["parts"].values():
        assert part["state"] == "done" and part["daemon"] == f"127.0.0.1:{cluster.daemons[part['rank']]['port']}"
    capture_id = record["capture_id"]
    summaries_written(p["path"] for p in record["parts"].values())  # written after "done", at idle priority
    # every rank recorded the same ProfilerStep# set, the window asked for
    for part in record["parts"].values():
        meta = json.loads((Path(part["path"]) / "metadata.json").read_text())
        assert meta["capture_id"] == capture_id
        assert trace_steps({**meta, "dir": Path(part["path"])}) == list(range(start, end)), part["rank"]
    # one id, and a record on each daemon that had ranks (and on no other)
    for i, d in enumerate(cluster.daemons):
        assert (d["state"] / "captures" / f"{capture_id}.json").exists() == (i < RANKS)
    listed = json.loads(cluster.ctl("list", "--json").stdout)["captures"]
    assert listed[0]["capture_id"] == capture_id and len(listed[0]["hosts"]) == RANKS and listed[0]["ranks"] == RANKS
    shown = cluster.ctl("show", capture_id[-6:], "--json")
    assert shown.returncode == 0 and len(json.loads(shown.stdout)["parts"]) == RANKS
    # the report merges the summaries written beside the traces: it works with the traces gone
    for part in record["parts"].values():
        for f in Path(part["path"]).iterdir():
            if f.name not in ("metadata.json", "summary.json"):
                f.unlink()
    rep = cluster.ctl("report", capture_id, "--json")
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    group = report["captures"][0]
    assert report["ranks_read"] == RANKS and [r["rank"] for r in group["ranks"]] == list(range(RANKS))
    for r in group["ranks"]:
        assert [s["step"] for s in r["steps"]] == list(range(start, end)) and r["step_ms_mean"] > 0 and r["top_self"]
    assert group["slowest"]["rank"] in range(RANKS)
    # the options as each rank recorded them, as the report from traces prints them (the record has with_cpu False)
    assert group["options"]["with_cpu"] is True and list(group["options"]) == sorted(group["options"])
    text = cluster.ctl("report", capture_id)
    assert text.returncode == 0 and "rank" in text.stdout, text.stdout + text.stderr


def test_a_capture_compared_with_a_baseline_across_hosts_from_summaries_alone(cluster: Cluster) -> None:
    """Issue 28, 5: `capture --baseline` across hosts marks one id as the baseline on every host; `report NOW
    --baseline BASE --hosts ...` has each daemon compare its ranks' summaries and the CLI conclude over every
    host's ranks, with the traces gone (nothing but summary.json is read); a host that is down is named."""
    ids = []
    for extra in (["--baseline"], []):
        res = cluster.ctl("capture", "--steps", "3", "--wait", "--json", "--timeout", "120", *extra)
        assert res.returncode == 0, res.stdout + res.stderr
        record = json.loads(res.stdout)
        ids.append(record["capture_id"])
        summaries_written(p["path"] for p in record["parts"].values())  # written after "done", at idle priority
        for part in record["parts"].values():
            for f in Path(part["path"]).iterdir():
                if f.name not in ("metadata.json", "summary.json"):
                    f.unlink()
    base, now = ids
    listed = json.loads(cluster.ctl("list", "--json").stdout)["captures"]
    assert next(c for c in listed if c["capture_id"] == base)["baseline"] is True
    res = cluster.ctl("report", now, "--baseline", base, "--json")
    assert res.returncode == 0, res.stderr
    c = json.loads(res.stdout)["comparison"]
    assert (c["capture"], c["baseline"]) == (now, base) and [r["rank"] for r in c["ranks"]] == list(range(RANKS))
    assert c["cause"] and c["step_ms"]["baseline"] > 0 and not c["notes"], c["notes"]  # one job, same model
    for r in c["ranks"]:
        assert r["steps"] == {"baseline": 3, "now": 3} and r["split"]["compute"]["now"] is not None
    text = cluster.ctl("report", now, "--baseline", base)
    assert text.returncode == 0 and f"capture {now}" in text.stdout and f"against baseline {base}" in text.stdout


def test_the_smallest_length_cap_of_any_host_holds_for_every_rank(cluster: Cluster) -> None:
    """Each daemon caps a window by its own ranks' --profile-max-window-steps; the CLI caps the request at the
    smallest over every target host first, so that all ranks record the same steps, and says so."""
    res = cluster.ctl("capture", "--steps", str(LAST_RANK_CAP + 20), "--wait", "--json", "--timeout", "120")
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads(res.stdout)
    start, end = record["window"]
    assert end - start == LAST_RANK_CAP, record["window"]
    assert f"steps capped from {LAST_RANK_CAP + 20} to {LAST_RANK_CAP}" in record["plan"]["note"], record["plan"]
    for part in record["parts"].values():
        meta = json.loads((Path(part["path"]) / "metadata.json").read_text())
        assert trace_steps({**meta, "dir": Path(part["path"])}) == list(range(start, end)), part["rank"]
    status = json.loads(cluster.ctl("status", "--json").stdout)["hosts"]
    caps = {r["rank"]: r["max_window_steps"] for h in status.values() for rs in h["data"]["jobs"].values() for r in rs}
    assert caps == {0: 200, 1: 200, 2: 200, 3: LAST_RANK_CAP}, caps  # what the CLI capped by, per rank


def test_unauthorised_client_is_refused_and_logged(cluster: Cluster, tmp_path: Path) -> None:
    other = tmp_path / "other"
    keygen(other)
    shutil.copy(cluster.keys / "server.key", other / "server.key")  # knows the daemons, is not known by them
    one = f"127.0.0.1:{cluster.daemons[0]['port']}"
    res = cluster.ctl("status", keys=other, hosts=one)
    assert res.returncode == 4 and "refused this client's key" in res.stderr
    log = cluster.daemons[0]["log"]
    wait_for(lambda: "refused a client from 127.0.0.1" in log.read_text(), 10, "the refusal in the daemon's log")
    # and without keys at all, a daemon that has keys does not answer: the CLI says what is missing
    plain = subprocess.run([str(ROOT / "bin" / "ondemandctl"), "--hosts", one, "status", "--connect-timeout", "1"],
                           env=base_env(), capture_output=True, text=True, timeout=60)
    assert plain.returncode == 4, plain.stderr
    assert f"the daemon at {one} requires CurveZMQ keys: pass --keys DIR" in plain.stderr, plain.stderr


def test_host_that_does_not_answer_is_named_and_the_rest_proceed(cluster: Cluster, down_port: int) -> None:
    dead, port = f"127.0.0.1:{down_port}", free_port()
    res = cluster.ctl("status", "--json", "--connect-timeout", "3", hosts=f"{cluster.hosts},{dead},no-such-host.invalid")
    assert res.returncode == 3
    hosts = json.loads(res.stdout)["hosts"]
    assert sum(h["ok"] for h in hosts.values()) == DAEMONS
    assert hosts[dead]["kind"] == "timeout" and "nothing listens on port" in hosts[dead]["error"], hosts[dead]
    assert hosts["no-such-host.invalid"] == {"ok": False, "kind": "unresolved",
                                             "error": hosts["no-such-host.invalid"]["error"]}
    text = cluster.ctl("status", "--connect-timeout", "1", hosts=f"no-such-host.invalid:{port}")
    assert text.returncode == 4 and "cannot resolve host no-such-host.invalid" in text.stderr, text.stderr


def test_a_dead_host_in_the_list_makes_no_rank_late(cluster: Cluster, down_port: int) -> None:
    """The status round waits the dead host's whole --connect-timeout (5 s, 250 steps here); each live host's
    steps are anchored at its own answer, so the window still lands ahead of every live rank."""
    dead = f"127.0.0.1:{down_port}"
    res = cluster.ctl("capture", "--steps", "3", "--wait", "--json", "--timeout", "120",
                      hosts=f"{dead},{cluster.hosts}")
    assert res.returncode == 0, res.stdout + res.stderr  # every rank of the job answered: the capture is whole
    record = json.loads(res.stdout)
    start, end = record["window"]
    assert {int(k): (p["state"], p.get("late_by") or 0) for k, p in record["parts"].items()} == \
        {r: ("done", 0) for r in range(RANKS)}, record["parts"]
    for part in record["parts"].values():
        meta = json.loads((Path(part["path"]) / "metadata.json").read_text())
        assert trace_steps({**meta, "dir": Path(part["path"])}) == list(range(start, end)), part["rank"]
    assert "nothing listens on port" in record["unanswered"][dead] and record["missing_ranks"] == []
    text = cluster.ctl("capture", "--steps", "2", "--wait", "--timeout", "120", "--connect-timeout", "3",
                       hosts=f"{dead},{cluster.hosts}")
    assert text.returncode == 0 and f"host {dead} did not answer the status round: {dead}: nothing listens" in \
        text.stdout, text.stdout


def test_capture_without_waiting_then_cancel_across_hosts(cluster: Cluster) -> None:
    # planned 3000 steps ahead: the window cannot end (a capped rank's 160 steps are 3-6 s) before the cancel,
    # a fan-out to every host that takes seconds on a loaded machine, reaches every rank
    res = cluster.ctl("capture", "--steps", "400", "--start", "3000", "--no-wait")
    assert res.returncode == 0, res.stderr
    head = res.stdout.splitlines()[0]
    assert f"{RANKS} rank(s) on {RANKS} host(s), steps [" in head, res.stdout
    capture_id = head.split()[1].rstrip(":")
    cancel = cluster.ctl("cancel", capture_id, "--json")
    assert cancel.returncode == 0, cancel.stderr
    hosts = json.loads(cancel.stdout)["hosts"]
    assert sorted(r for h in hosts.values() if h["ok"] for r in h["data"]["ranks"]) == list(range(RANKS))
    shown = wait_for(lambda: (lambda r: r if r["status"] != "running" else None)(
        json.loads(cluster.ctl("show", capture_id, "--json").stdout)), 120, "the cancelled capture to settle")
    assert shown["status"] == "cancelled" and len(shown["hosts"]) == RANKS
    again = cluster.ctl("cancel", capture_id)
    assert again.returncode == 1 and "already cancelled" in again.stderr


# ----------------------------------------------------------------------------------------------------------
# A host that stalls (SIGSTOP: a pause, a partition) or whose daemon is killed, during a capture

def _stop_after_status(monkeypatch: pytest.MonkeyPatch, proc: subprocess.Popen,
                       resume_after: float | None = None) -> list[threading.Timer]:
    """The fault, injected where it hurts: the victim daemon stops right after it answered the status round
    (the CLI's own fan-out, in this process, does everything else as ondemandctl does); with `resume_after`, it
    goes on that many seconds after it stopped (the timers returned, to join)."""
    real = fanout.Fanout.request
    timers: list[threading.Timer] = []

    def request(self: Any, msg_type: str, *args: Any, **kw: Any) -> Any:
        replies = real(self, msg_type, *args, **kw)
        if msg_type == "status" and proc.poll() is None and not getattr(proc, "stopped", False):
            proc.send_signal(signal.SIGSTOP)
            proc.stopped = True  # type: ignore[attr-defined]
            if resume_after is not None:
                timers.append(threading.Timer(resume_after, _resume, [proc]))
                timers[-1].start()
        return replies

    monkeypatch.setattr(fanout.Fanout, "request", request)
    return timers


def _resume(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
    proc.stopped = False  # type: ignore[attr-defined]


def _no_rank_lists_a_window(cluster: Cluster) -> bool:
    res = cluster.ctl("status", "--json")
    if res.returncode != 0:
        return False
    ranks = [r for h in json.loads(res.stdout)["hosts"].values() for rs in h["data"]["jobs"].values() for r in rs]
    return len(ranks) == RANKS and not any(r["windows"] for r in ranks)


@pytest.fixture
def restored(cluster: Cluster) -> Iterator[Cluster]:
    """For a test that stops or kills daemons of the shared cluster: afterwards, however the test ended, every
    daemon runs again (resumed, or restarted on its port and directories), every rank is registered and none
    lists a window, so that no later test depends on what this one did."""
    try:
        yield cluster
    finally:
        for i, d in enumerate(cluster.daemons):
            if d["proc"].poll() is None:
                _resume(d["proc"])
            else:
                cluster.daemons[i] = {**cluster.start_daemon(i, d["port"], d), "port": d["port"]}
        # windows planned far ahead are still listed: the next tests would plan after them (heartbeats, 1 s)
        wait_for(lambda: _no_rank_lists_a_window(cluster), 120, "every rank registered and listing no window",
                 pause=0.5)


def _ctl_here(cluster: Cluster, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = ctl_main.main(["--hosts", cluster.hosts, "--keys", str(cluster.keys), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.usefixtures("restored")
def test_a_host_that_stalls_after_the_status_round_refuses_the_late_window(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Its daemon gets the capture 8 s (400 steps) after it answered the status round, well after the planned start
    (the lead is at most a few seconds): it refuses it, says why in its record, and its rank records nothing,
    instead of recording other steps than the rest under the same id. (The 8 s count from the stop itself: a
    timer started before the CLI left a loaded machine's status round eat into them.)"""
    victim = cluster.daemons[RANKS - 1]
    timers = _stop_after_status(monkeypatch, victim["proc"], resume_after=8.0)
    try:
        code, out, err = _ctl_here(cluster, capsys, "capture", "--steps", "3", "--wait", "--json", "--timeout",
                                   "120", "--connect-timeout", "2")
    finally:
        for timer in timers:
            timer.join()
        _resume(victim["proc"])
    assert code == 3, out + err
    record = json.loads(out)
    start, end = record["window"]
    states = {int(k): p["state"] for k, p in record["parts"].items()}
    assert states == {0: "done", 1: "done", 2: "done", 3: "rejected"}, record["parts"]
    refusal = record["parts"]["3"]["error"]
    assert "reached this host after its start: rank(s) 3 were already past step" in refusal, refusal
    name = f"127.0.0.1:{victim['port']}"
    assert record["hosts"][name]["status"] == "failed" and record["status"] == "partial"  # it answered: not unreachable
    on_disk = {m["rank"]: m for m in captures(cluster.save) if m["capture_id"] == record["capture_id"]}
    assert sorted(on_disk) == [0, 1, 2]  # nothing recorded late on the stalled host
    for m in on_disk.values():
        assert trace_steps(m) == list(range(start, end)), m["rank"]
    # the refusal is in the victim's own record: show says it, there and across hosts
    shown = cluster.ctl("show", record["capture_id"], hosts=name)
    assert shown.returncode == 1 and "rejected" in shown.stdout and "after its start" in shown.stdout, shown.stdout
    assert "refused: this window is shared" in victim["log"].read_text()
    both = cluster.ctl("show", record["capture_id"])
    assert both.returncode == 3 and "rank 3" in both.stdout and "after its start" in both.stdout, both.stdout


@pytest.mark.usefixtures("restored")
def test_a_host_given_up_on_is_sent_a_cancel(cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Not waiting, the CLI gives up on a host that did not confirm the capture at once: it sends it a cancel,
    which the daemon finds right after the capture when it comes back."""
    victim = cluster.daemons[RANKS - 1]
    name = f"127.0.0.1:{victim['port']}"
    _stop_after_status(monkeypatch, victim["proc"])
    try:  # far ahead (3000 steps, 60 s): the window is not late when the daemon resumes; only the cancel stops it
        code, out, err = _ctl_here(cluster, capsys, "capture", "--steps", "3", "--start", "3000", "--no-wait",
                                   "--connect-timeout", "1")
    finally:
        _resume(victim["proc"])
    assert code == 3, out + err
    capture_id = out.split()[1].rstrip(":")
    assert f"host {name} UNREACHABLE: {name} accepts connections on port {victim['port']} but its daemon does not " \
           "respond (stopped, or overloaded?); gave up on it (a cancel was sent)" in out, out

    def settled() -> dict[str, Any] | None:
        res = cluster.ctl("show", capture_id, "--json", hosts=name)
        data = json.loads(res.stdout) if res.returncode in (0, 1, 3) and res.stdout else None
        return data if data and data["status"] != "running" else None

    shown = wait_for(settled, 60, "the victim's record to settle", pause=0.5)
    assert shown["status"] == "cancelled" and shown["parts"]["3"]["state"] == "cancelled", shown
    rest = cluster.ctl("cancel", capture_id, "--json")  # the other hosts' windows, 3000 steps ahead
    sent = sorted(r for h in json.loads(rest.stdout)["hosts"].values() if h["ok"] for r in h["data"]["ranks"])
    assert rest.returncode == 3 and sent == [0, 1, 2], rest.stdout  # 3: the victim's is already cancelled


@pytest.mark.usefixtures("restored")
def test_a_daemon_killed_mid_capture_and_restarted_is_waited_for(cluster: Cluster) -> None:
    """The CLI keeps asking a host that stopped answering: its rank goes on recording, re-registers with the
    restarted daemon and replays what it did, and the capture ends done on every rank."""
    victim = cluster.daemons[RANKS - 1]
    records = victim["state"] / "captures"
    before = set(records.glob("*.json"))
    proc = subprocess.Popen([str(ROOT / "bin" / "ondemandctl"), "--hosts", cluster.hosts, "--keys", str(cluster.keys),
                             "capture", "--steps", "150", "--wait", "--json", "--timeout", "120",
                             "--connect-timeout", "2"], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any('"recording"' in p.read_text() for p in set(records.glob("*.json")) - before), 60,
                 "the capture recording on the victim's rank")
        victim["proc"].send_signal(signal.SIGKILL)
        victim["proc"].wait()
        time.sleep(3)  # at least one round of watches goes unanswered
        assert proc.poll() is None  # still asking
        cluster.daemons[RANKS - 1] = victim = {**cluster.start_daemon(RANKS - 1, victim["port"], victim),
                                               "port": victim["port"]}
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    record = json.loads(out)
    assert {int(k): p["state"] for k, p in record["parts"].items()} == {r: "done" for r in range(RANKS)}
    start, end = record["window"]
    for part in record["parts"].values():
        meta = json.loads((Path(part["path"]) / "metadata.json").read_text())
        assert trace_steps({**meta, "dir": Path(part["path"])}) == list(range(start, end)), part["rank"]


@pytest.mark.usefixtures("restored")
def test_a_silent_host_is_unreachable_not_failed_and_show_tells_the_truth_later(cluster: Cluster) -> None:
    """Stopped mid-capture until after --timeout: its host is unreachable and its rank's part too (with its
    last known state), not failed; the rank goes on and writes, and show says so once the daemon is back."""
    victim = cluster.daemons[RANKS - 1]
    name = f"127.0.0.1:{victim['port']}"
    records = victim["state"] / "captures"
    before = set(records.glob("*.json"))
    proc = subprocess.Popen([str(ROOT / "bin" / "ondemandctl"), "--hosts", cluster.hosts, "--keys", str(cluster.keys),
                             "capture", "--steps", "3", "--wait", "--json", "--timeout", "10",
                             "--connect-timeout", "1"], env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any('"scheduled"' in p.read_text() for p in set(records.glob("*.json")) - before), 60,
                 "the capture scheduled on the victim's rank")
        victim["proc"].send_signal(signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        _resume(victim["proc"])
        if proc.poll() is None:
            proc.kill()
    record = json.loads(out)
    states = {int(k): p["state"] for k, p in record["parts"].items()}
    # (its last known state: what the CLI last heard, which on a loaded machine may be from before "scheduled")
    assert states[3] == "unreachable" and record["parts"]["3"]["last_state"] in (
        "sent", "received", "scheduled", "recording", "writing")
    # the others finish (exit 3: partial), or on a loaded machine may still be writing at --timeout (exit 5)
    assert all(states[r] in ("scheduled", "recording", "writing", "done") for r in range(3)), states
    assert proc.returncode == (3 if all(states[r] == "done" for r in range(3)) else 5), out + err
    assert record["hosts"][name]["status"] == "unreachable" and "does not respond" in record["hosts"][name]["error"]

    def done() -> dict[str, Any] | None:
        res = cluster.ctl("show", record["capture_id"], "--json")
        data = json.loads(res.stdout) if res.stdout else None
        return data if res.returncode == 0 and data["status"] == "done" else None

    shown = wait_for(done, 180, "the capture, done on every rank once the daemon answers again", pause=0.5)
    assert shown["parts"]["3"]["state"] == "done" and shown["hosts"][name]["status"] == "done"


def test_show_marks_a_capture_whose_ranks_recorded_different_steps(cluster: Cluster) -> None:
    """A synthetic record (what the issue saw: one id, rank 0 at steps 302-321, rank 1 at 622-641) loaded by a
    real daemon: show across hosts says misaligned and exits 6. The daemon is one of its own, with the cluster's
    keys: a record left on one of the cluster's daemons would be listed by every later test."""
    spare = cluster.start_daemon(DAEMONS)  # started once to make its directories, again to load the record
    procs = [spare["proc"]]
    try:
        spare["proc"].kill()
        spare["proc"].wait()
        parts = {str(r): {"rank": r, "host": "h", "pid": 100 + r, "state": "done", "path": f"/nowhere/{r}",
                          "steps": list(range(first, first + 20)), "history": [{"state": "done"}]}
                 for r, first in ((0, 302), (1, 622))}
        record = {"capture_id": "20261201-000000-abcdef", "job": "j", "created_at": "2026-12-01T00:00:00.000+00:00",
                  "request": {"steps": 20}, "window": [302, 322], "plan": {}, "options": {}, "status": "done",
                  "parts": parts}
        (spare["state"] / "captures" / f"{record['capture_id']}.json").write_text(json.dumps(record))
        procs.append(cluster.start_daemon(DAEMONS, spare["port"], spare)["proc"])
        res = cluster.ctl("show", "abcdef", hosts=f"127.0.0.1:{spare['port']}")
        assert res.returncode == 6, res.stdout + res.stderr
        assert "MISALIGNED: ranks recorded different steps: rank(s) 0 recorded steps 302..321; rank(s) 1 " \
               "recorded steps 622..641" in res.stdout, res.stdout
        # a record an older daemon settled `done` is settled again when read back: list says what show says
        listed = cluster.ctl("list", hosts=f"127.0.0.1:{spare['port']}")
        assert re.search(r"^20261201-000000-abcdef\s.*\smisaligned\b", listed.stdout, re.M), listed.stdout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(spare["run"], ignore_errors=True)
        shutil.rmtree(spare["state"], ignore_errors=True)
