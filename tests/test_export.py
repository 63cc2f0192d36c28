"""Issue 44 item 2: one timeline. `ondemandctl export ID --perfetto FILE` writes every rank's trace of a capture as
one Chrome trace: each rank's processes named tracks in rank order, the other hosts' clocks moved by the alignment
on collective ends (report/waits.py), the residual skew in the metadata.

Checked in process on synthetic Kineto traces with a known clock skew between hosts (the quick tier), live on one
host through the CLI (a daemon, two gloo ranks, a capture), and on three hosts in network namespaces whose ranks'
clocks are really skewed (an LD_PRELOAD shim moves CLOCK_REALTIME, which torch's profiler stamps its events with,
by a few milliseconds per host): the merged file parses as a Chrome trace, every rank's events are in it, and the
collectives' ends of the ranks line up within the skew the file states."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ctl, summaries_written, wait_for

from ondemand_prof.report.perfetto import Merger, align, metadata
from ondemand_prof.report.timeline import decode, encode


# ----------------------------------------------------------------------------------------------------------
# What every test reads back from a merged file


def tracks(merged: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """pid -> (its process_name, its process_sort_index)."""
    names: dict[int, str] = {}
    order: dict[int, int] = {}
    for ev in merged["traceEvents"]:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            names[ev["pid"]] = ev["args"]["name"]
        if ev.get("ph") == "M" and ev.get("name") == "process_sort_index":
            order[ev["pid"]] = ev["args"]["sort_index"]
    return {pid: (names[pid], order[pid]) for pid in names}


def rank_of_pid(merged: dict[str, Any]) -> dict[int, int]:
    return {pid: int(name.split(" · ")[0].split()[1]) for pid, (name, _) in tracks(merged).items()}


def collective_ends(merged: dict[str, Any], name: str = "gloo:all_reduce") -> dict[int, list[float]]:
    """Each rank's collectives' ends, in order, from the merged file: the backend's ranges (outermost per thread)
    that begin inside the steps every rank recorded."""
    ranks = rank_of_pid(merged)
    steps: dict[int, dict[int, tuple[float, float]]] = {}
    ranges: dict[int, list[tuple[float, float, Any]]] = {}
    for ev in merged["traceEvents"]:
        if ev.get("ph") != "X" or ev["pid"] not in ranks:
            continue
        r = ranks[ev["pid"]]
        if str(ev.get("name", "")).startswith("ProfilerStep#"):
            steps.setdefault(r, {})[int(ev["name"].split("#")[1])] = (ev["ts"], ev["ts"] + ev["dur"])
        elif ev.get("name") == name:
            ranges.setdefault(r, []).append((ev["ts"], ev["ts"] + ev["dur"], ev["tid"]))
    common = set.intersection(*(set(s) for s in steps.values()))
    out = {}
    for r, found in ranges.items():
        lo, hi = min(steps[r][s][0] for s in common), max(steps[r][s][1] for s in common)
        outer, last_end = [], {}
        for ts, end, tid in sorted(found):
            if ts >= last_end.get(tid, -1e300):
                outer.append((ts, end))
                last_end[tid] = end
        out[r] = [end for ts, end in outer if lo <= ts < hi]
    return out


def p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def residuals(ends: dict[int, list[float]], ranks: list[int]) -> list[float]:
    """How far each rank's collectives end from the lowest rank's, collective by collective."""
    ref = min(ranks)
    n = min(len(ends[r]) for r in ranks)
    assert n >= 8, {r: len(e) for r, e in ends.items()}
    return [ends[r][k] - ends[ref][k] for r in ranks if r != ref for k in range(n)]


# ----------------------------------------------------------------------------------------------------------
# Synthetic Kineto traces: two hosts, one clock ahead of the other by a known amount


BASE_NS = 1_790_000_000_000_000_000


def kineto_rank(rank: int, pid: int, skew_us: float, steps: int = 6, calls: int = 3) -> tuple[dict[str, Any], dict]:
    """A rank's trace (as Kineto writes it: ts relative to baseTimeNanoseconds, a CPU process, a GPU, flows, a
    global instant) and its summary's timeline, every time read off a clock `skew_us` ahead. Every rank's
    collectives end together (within 3 us): the truth the alignment must find again."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "ts": 0, "args": {"labels": "CPU"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "ts": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "ts": 0, "args": {"labels": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "ts": 0, "args": {"name": "thread (python)"}},
    ]
    rows = []
    t0 = 1_000_000.0
    for s in range(steps):
        start = t0 + s * 10_000 + skew_us
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{100 + s}", "pid": pid,
                       "tid": pid, "ts": start, "dur": 9_000})
        colls = []
        for k in range(calls):
            arrival = start + 1_000 + k * 2_000 + rank * 150  # rank 1 arrives later: the others wait for it
            end = t0 + s * 10_000 + 1_800 + k * 2_000 + 300 + (rank % 3)  # every rank ends together, on true time
            end += skew_us
            events.append({"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": pid, "tid": pid,
                           "ts": arrival, "dur": 50})
            events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": pid,
                           "tid": pid + 1, "ts": arrival + 60, "dur": end - arrival - 60})
            events.append({"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": arrival + 5,
                           "dur": 10})
            events.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": s * 10 + k, "pid": pid, "tid": pid,
                           "ts": arrival})
            events.append({"ph": "f", "cat": "ac2g", "name": "ac2g", "id": s * 10 + k, "pid": 0, "tid": 7,
                           "ts": arrival + 5, "bp": "e"})
            colls.append(("all_reduce", "0", arrival + BASE_NS / 1000, end + BASE_NS / 1000))
        rows.append((100 + s, start + BASE_NS / 1000, 9_000.0, colls))
    events.append({"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": "Traces",
                   "tid": "Trace PyTorch Profiler", "ts": t0 + skew_us})
    trace = {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 3}, "baseTimeNanoseconds": BASE_NS,
             "traceEvents": events}
    return trace, encode("cpu", rows, {"0": [0, 1, 2]})


HOSTS = {0: ("a", 0.0), 1: ("b", 2_500.0), 2: ("c", -1_700.0)}  # rank -> (host, its clock ahead by, us)


def merged_in_process(ranks: dict[int, tuple[str, float]]) -> tuple[dict[str, Any], Any]:
    traces = {r: kineto_rank(r, 4000 + r, skew) for r, (_, skew) in ranks.items()}
    alignment = align([(r, ranks[r][0], decode(tl)) for r, (_, tl) in traces.items()])
    out = io.StringIO()
    merger = Merger(out, metadata("cap", "job", sorted(ranks), [h for h, _ in ranks.values()], alignment, BASE_NS))
    for r in sorted(ranks):
        merger.add(r, ranks[r][0], traces[r][0]["traceEvents"], alignment.offsets_us[r], main_pid=4000 + r)
    merger.close()
    return json.loads(out.getvalue()), alignment


@pytest.mark.quick
def test_three_hosts_skewed_clocks_are_one_timeline_within_the_stated_skew() -> None:
    merged, alignment = merged_in_process(HOSTS)
    assert alignment.clock["hosts"] == 3 and alignment.clock["aligned_on"] == 2 * 6 * 3
    assert alignment.offsets_us[1] == pytest.approx(-2_500, abs=3) and alignment.offsets_us[2] == pytest.approx(
        1_700, abs=3)
    skew = merged["metadata"]["ondemand_prof.clock_skew_us"]
    assert skew == merged["ondemandProf"]["skew_us"] and skew <= 3
    ends = collective_ends(merged)
    assert max(abs(d) for d in residuals(ends, [0, 1, 2])) <= skew + 0.01
    raw = {r: [e["ts"] + e["dur"] for e in kineto_rank(r, 1, s)[0]["traceEvents"] if e.get("name") ==
               "gloo:all_reduce"] for r, (_, s) in HOSTS.items()}
    assert statistics.median(residuals(raw, [0, 1])) == pytest.approx(2_500, abs=3)  # before: 2.5 ms apart


@pytest.mark.quick
def test_every_rank_is_a_named_track_in_rank_order_and_its_events_stay_its_own() -> None:
    merged, _ = merged_in_process(HOSTS)
    names = sorted(tracks(merged).values(), key=lambda t: t[1])
    assert [n for n, _ in names] == ["rank 0 · a · CPU (pid 4000)", "rank 0 · a · GPU 0",
                                     "rank 1 · b · CPU (pid 4001)", "rank 1 · b · GPU 0",
                                     "rank 2 · c · CPU (pid 4002)", "rank 2 · c · GPU 0"]
    events = [e for e in merged["traceEvents"] if e.get("ph") != "M"]
    of_pid = rank_of_pid(merged)
    per_rank = {r: sum(1 for e in events if of_pid[e["pid"]] == r) for r in HOSTS}
    source = {r: sum(1 for e in kineto_rank(r, 1, 0)[0]["traceEvents"] if e["ph"] != "M") for r in HOSTS}
    assert per_rank == source
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert {e["id"].split(":")[0] for e in flows} == {"0", "1", "2"}  # no arrow joins two ranks
    assert all(of_pid[e["pid"]] == int(e["id"].split(":")[0]) for e in flows)
    instants = [e for e in events if e["ph"] == "i"]
    assert len(instants) == 3 and all(e["s"] == "p" for e in instants)  # each on its own rank's track
    assert all(type(e["pid"]) is int for e in merged["traceEvents"])


@pytest.mark.quick
def test_a_rank_without_a_timeline_keeps_its_hosts_offset_or_its_own_clock() -> None:
    a = decode(kineto_rank(0, 1, 0)[1])
    b = decode(kineto_rank(1, 2, 900)[1])
    al = align([(0, "a", a), (1, "b", b), (2, "b", None), (3, "d", None)])
    assert al.offsets_us[2] == al.offsets_us[1] == pytest.approx(-900, abs=3)
    assert al.offsets_us[3] == 0.0 and al.unaligned == [3] and "rank(s) 3 kept their own clock" in al.notes[-1]
    one = align([(0, "a", a), (1, "a", None)])
    assert one.offsets_us == {0: 0.0, 1: 0.0} and one.text() == "one host: one clock, nothing to align"
    none = align([(0, "a", None), (1, "b", None)])
    assert none.unaligned == [0, 1] and "not aligned" in none.text()


# ----------------------------------------------------------------------------------------------------------
# The export itself (host/commands/export.py) on files: what it finds, refuses and writes


def write_capture(folder: Path, ranks: dict[int, tuple[str, float]], gz: bool = False) -> list[Any]:
    """Synthetic traces as ranks write them (the capture folder, a rank directory each with its summary), and the
    parts a daemon's record would give."""
    from ondemand_prof.host.commands.export import Part

    folder.mkdir(parents=True)
    parts = []
    for r, (host, skew) in ranks.items():
        trace, timeline = kineto_rank(r, 4000 + r, skew)
        name = f"{host}_{4000 + r}_rank{r}.pt.trace.json" + (".gz" if gz else "")
        text = json.dumps(trace)
        (folder / name).write_bytes(gzip.compress(text.encode()) if gz else text.encode())
        summary = {"rank": r, "host": host, "timeline": timeline}
        parts.append(Part(r, host, host, str(folder / name), summary))
    return parts


def run_export(parts: list[Any], dest: Path, **flags: Any) -> tuple[int, str, dict[str, Any] | None]:
    from ondemand_prof.host.commands.export import export

    args = argparse.Namespace(ranks=None, traces=[], max_mb=2048, perfetto=str(dest), json=False)
    vars(args).update(flags)
    out = io.StringIO()
    code = export(parts, "cap-1", "job", args, out, {})
    merged = None
    if dest.exists():
        opener = gzip.open if dest.name.endswith(".gz") else open
        with opener(dest, "rt") as fh:
            merged = json.load(fh)
    return code, out.getvalue(), merged


@pytest.mark.quick
def test_the_export_writes_every_rank_and_says_how_the_clocks_were_aligned(tmp_path: Path) -> None:
    parts = write_capture(tmp_path / "cap-1", HOSTS, gz=True)
    code, text, merged = run_export(parts, tmp_path / "one.json.gz")
    assert code == 0 and merged is not None, text
    assert "3 rank(s) on 3 host(s) in one trace" in text and "aligned on 36 collective ends" in text, text
    assert re.search(r"^  rank 1    b +-250[01]\.0 us +98 events  .*/b_4001_rank1\.pt\.trace\.json\.gz$", text, re.M), text
    assert merged["ondemandProf"]["ranks"] == [0, 1, 2] and merged["baseTimeNanoseconds"] % 1000 == 0
    assert max(abs(d) for d in residuals(collective_ends(merged), [0, 1, 2])) <= merged["ondemandProf"]["skew_us"]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # written under a temporary name, renamed
    assert (tmp_path / "one.json.gz").stat().st_mode & 0o077 == 0  # every rank's trace in it: owner-only


@pytest.mark.quick
def test_a_trace_that_is_not_here_is_named_and_found_under_traces(tmp_path: Path) -> None:
    """Ranks 1 and 2 wrote on other hosts' disks (their recorded paths are not here): the file holds rank 0, and
    says where the others are; with a copy of their capture folder under --traces DIR, every rank."""
    parts = write_capture(tmp_path / "cap-1", HOSTS)
    copied = tmp_path / "copied" / "cap-1"
    copied.mkdir(parents=True)
    for p in parts[1:]:
        shutil.move(p.trace, copied / Path(p.trace).name)
    code, text, merged = run_export(parts, tmp_path / "a.json")
    assert code == 3 and merged is not None and merged["ondemandProf"]["ranks"] == [0], text
    assert "rank 1    b                not in it: its trace " in text and " on b is not readable here" in text, text
    assert "--traces DIR" in text
    parts = write_capture(tmp_path / "again", {}) + [type(p)(p.rank, p.host, p.daemon, p.trace, p.summary)
                                                      for p in parts]
    code, text, merged = run_export(parts, tmp_path / "b.json", traces=[str(tmp_path / "copied")])
    assert code == 0 and merged is not None and merged["ondemandProf"]["ranks"] == [0, 1, 2], text
    assert str(copied / Path(parts[1].trace).name) in text


@pytest.mark.quick
def test_what_the_export_refuses(tmp_path: Path) -> None:
    from ondemand_prof.host.client import CtlError

    parts = write_capture(tmp_path / "cap-1", HOSTS)
    with pytest.raises(CtlError, match=r"hold 0 MB of text, over --max-mb 0: export fewer ranks \(--ranks\)"):
        run_export(parts, tmp_path / "x.json", max_mb=0)
    with pytest.raises(CtlError, match=r"--ranks 7: the capture has rank\(s\) 0-2"):
        run_export(parts, tmp_path / "x.json", ranks="7")
    os.replace(parts[1].trace, tmp_path / "r1")
    os.replace(parts[2].trace, parts[1].trace)  # rank 2's trace where rank 1's should be
    with pytest.raises(CtlError, match=r"rank 1: .* is rank 2's trace \(its distributedInfo\), not rank 1's"):
        run_export(parts, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists() and not list(tmp_path.glob(".x.json*"))
    code, text, merged = run_export(parts, tmp_path / "y.json", ranks="0")
    assert code == 0 and merged is not None and merged["ondemandProf"]["ranks"] == [0]


# ----------------------------------------------------------------------------------------------------------
# Live, one host: a daemon, two gloo ranks, a capture, the CLI as a user runs it


LIVE_JOB = {"world": 2, "warm_steps": 40}  # conftest's live_job


@pytest.fixture(scope="module")
def job(live_job: dict[str, Any]) -> dict[str, Any]:
    return {"run": live_job["run"], "work": live_job["work"]}


def test_capture_says_how_to_export_and_export_writes_both_ranks(job: dict[str, Any], tmp_path: Path) -> None:
    res = ctl(job["run"], "capture", "--steps", "4", "--wait", "--timeout", "90")
    assert res.returncode == 0, res.stdout + res.stderr
    cid = res.stdout.split()[1].rstrip(":")
    assert f"  one timeline: ondemandctl export {cid} --perfetto {cid}.json" in res.stdout, res.stdout
    out = tmp_path / "one.json"
    res = ctl(job["run"], "export", cid[:12], "--perfetto", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"capture {cid}: 2 rank(s) on 1 host(s) in one trace: {out}" in res.stdout, res.stdout
    assert "clock: one host: one clock, nothing to align" in res.stdout
    merged = json.loads(out.read_text())  # Chrome's JSON Object Format
    shown = json.loads(ctl(job["run"], "show", cid, "--json").stdout)
    of_pid = rank_of_pid(merged)
    for rank, part in shown["parts"].items():  # every event of each rank's trace is in it, on that rank's tracks
        with open(part["trace"]) as fh:
            trace = json.load(fh)
        mine = [e for e in merged["traceEvents"] if e["ph"] != "M" and of_pid[e["pid"]] == int(rank)]
        assert len(mine) == sum(1 for e in trace["traceEvents"] if e.get("ph") != "M"), rank
        names = {e["name"] for e in mine}
        assert {f"ProfilerStep#{s}" for s in part["steps"]} <= names and "gloo:all_reduce" in names
    order = sorted(tracks(merged).values(), key=lambda t: t[1])
    assert order[0][0].startswith("rank 0 · ") and order[-1][0].startswith("rank 1 · "), order
    assert len(collective_ends(merged)[0]) == len(collective_ends(merged)[1]) >= 4 * 4
    res = ctl(job["run"], "export", cid, "--perfetto", str(tmp_path / "r1.json"), "--ranks", "1", "--json")
    assert res.returncode == 0 and [r["rank"] for r in json.loads(res.stdout)["ranks"]] == [1], res.stderr
    folder = Path(next(iter(shown["parts"].values()))["trace"]).parent  # no daemon asked: the folder itself
    res = ctl(Path("/nonexistent"), "export", str(folder), "--perfetto", str(tmp_path / "f.json"))
    assert res.returncode == 0 and "2 rank(s) on 1 host(s)" in res.stdout, res.stdout + res.stderr


# ----------------------------------------------------------------------------------------------------------
# Three hosts in network namespaces (tests/test_netns.py's), each rank's clock skewed: the alignment is real


SKEW_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
#include <sys/time.h>
/* CLOCK_REALTIME (what torch's profiler stamps events with) moved by $ODP_TEST_CLOCK_SKEW_US: another host's clock */
static long long skew_ns(void) { const char *s = getenv("ODP_TEST_CLOCK_SKEW_US"); return s ? atof(s) * 1000 : 0; }
int clock_gettime(clockid_t id, struct timespec *ts) {
  static int (*real)(clockid_t, struct timespec *);
  if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
  int rc = real(id, ts);
  if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
    long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + skew_ns();
    ts->tv_sec = t / 1000000000LL; ts->tv_nsec = t % 1000000000LL;
  }
  return rc;
}
int gettimeofday(struct timeval *tv, void *tz) {
  struct timespec ts; int rc = clock_gettime(CLOCK_REALTIME, &ts);
  if (rc == 0 && tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
  return rc;
}
"""
NETNS_SKEW_US = {"h1": 0.0, "h2": 2_500.0, "h3": -1_700.0}


def skew_shim(where: Path) -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    (where / "skew.c").write_text(SKEW_C)
    res = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(where / "skew.so"), str(where / "skew.c"), "-ldl"],
                         capture_output=True, text=True)
    return where / "skew.so" if res.returncode == 0 else None


@pytest.fixture(scope="module")
def net3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    netns = pytest.importorskip("test_netns")
    if netns.WHY_NOT is not None:
        pytest.skip(netns.WHY_NOT)
    root = tmp_path_factory.mktemp("netns3")
    shim = skew_shim(root)
    if shim is None:
        pytest.skip("needs a C compiler to skew the ranks' clocks")

    class Net3(netns.Net):  # one rank on each host, each host's clock its own
        hosts = ("h1", "h2", "h3")

        def save(self, rank: int) -> Path:
            return self.root / f"profile-{self.hosts[rank]}"

        def start_ranks(self) -> None:
            for rank, host in enumerate(self.hosts):
                env = netns.base_env(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR=self.addr("h1"),
                                     MASTER_PORT="29519", GLOO_SOCKET_IFNAME="eth0", LD_PRELOAD=str(shim),
                                     ODP_TEST_CLOCK_SKEW_US=str(NETNS_SKEW_US[host]),
                                     ONDEMAND_PROF_RUNTIME_DIR=str(self.daemons[host]["run"]))
                self.ranks.append(self.spawn(host, [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps",
                                                    "1000000", "--step-sleep", str(netns.STEP_S),
                                                    "--profile-min-free-mb", "0", "--profile-save-path",
                                                    str(self.save(rank))], env, self.root / f"rank{rank}.log"))

    n = Net3(root)
    try:
        n.up()
        netns.keygen(n.keys)
        for host in Net3.hosts:
            n.start_daemon(host)
        n.start_ranks()

        def stepping() -> bool:
            res = n.ctl("status", "--json", "--connect-timeout", "2")
            if res.returncode != 0:
                return False
            ranks = [r for h in json.loads(res.stdout)["hosts"].values() for rs in h["data"]["jobs"].values()
                     for r in rs]
            return len(ranks) == 3 and all(r["step_time_s"] for r in ranks)

        wait_for(stepping, 180, "3 ranks on h1, h2 and h3 registered and stepping", pause=0.5)
        yield n
    finally:
        n.down()


def test_three_hosts_one_timeline_their_collectives_end_together(net3: Any) -> None:
    res = net3.ctl("capture", "--steps", "6", "--wait", "--timeout", "120")
    assert res.returncode == 0, res.stdout + res.stderr
    cid = res.stdout.split()[1].rstrip(":")
    assert f"one timeline: ondemandctl --hosts ... export {cid} --perfetto {cid}.json" in res.stdout, res.stdout
    # the clocks are aligned on the timelines of the ranks' summaries, written after "done" at idle priority (issue 44)
    summaries_written(m["dir"] for rank in range(3) for m in net3_captures(net3, rank) if m["capture_id"] == cid)
    out = net3.root / "merged.json"
    res = net3.ctl("export", cid, "--perfetto", str(out))  # on h1: the other hosts' traces by their recorded paths
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"capture {cid}: 3 rank(s) on 3 host(s) in one trace" in res.stdout, res.stdout
    assert "clock: the clocks of 3 hosts aligned on " in res.stdout, res.stdout
    merged = json.loads(out.read_text())
    info = merged["ondemandProf"]
    skew = info["skew_us"]
    assert info["ranks"] == [0, 1, 2] and info["hosts"] == ["h1", "h2", "h3"] and skew is not None, info
    assert merged["metadata"]["ondemand_prof.clock_skew_us"] == skew
    names = [n for n, _ in sorted(tracks(merged).values(), key=lambda t: t[1])]
    assert [n.split(" · ")[:2] for n in names] == [["rank 0", "h1"], ["rank 1", "h2"], ["rank 2", "h3"]], names
    of_pid = rank_of_pid(merged)
    for rank in range(3):  # every rank's events: each one its trace holds, and its steps
        meta = next(m for m in net3_captures(net3, rank) if m["capture_id"] == cid)
        with open(meta["dir"] / meta["trace_file"]) as fh:
            trace = json.load(fh)
        mine = [e for e in merged["traceEvents"] if e["ph"] != "M" and of_pid[e["pid"]] == rank]
        assert len(mine) == sum(1 for e in trace["traceEvents"] if e.get("ph") != "M"), rank
    # the ranks' clocks were apart by the skew put on them; in the file their collectives end together
    offsets = info["clock"]["offsets_us"]
    for host in ("h2", "h3"):
        assert abs(offsets[host] + NETNS_SKEW_US[host]) < 1_000 + skew, (offsets, skew)
    gaps = residuals(collective_ends(merged), [0, 1, 2])
    assert p90([abs(g) for g in gaps]) <= skew + 1.0, (p90([abs(g) for g in gaps]), skew)
    assert abs(statistics.median(gaps)) <= skew, (statistics.median(gaps), skew)


def net3_captures(net: Any, rank: int) -> list[dict[str, Any]]:
    from conftest import captures

    return captures(net.save(rank))
