"""Comparisons on real trace pairs from public repositories (issue 40; tests/fixtures/real/README.md says where each
file comes from): what a new user's `report NOW --baseline BASE` got wrong on them, each checked against a plain
recount from the files here, not our analysis. Each test failed on the code before its fix."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT, ctl
from ondemand_prof.host.summaries import merge_summaries
from ondemand_prof.report import build_report, build_reports, compare_groups
from ondemand_prof.report.checks import MAX_NAME
from ondemand_prof.report.html import render_html
from ondemand_prof.report.text import render_text

pytestmark = pytest.mark.quick  # in-process, and a few short CLI runs: the quick tier (conftest.py)

REAL = Path(__file__).resolve().parent / "fixtures" / "real"
FLUX = "tracelens_xdit_flux_mi300x_rank0.json.gz"  # MI300X, one step, a 5,160-character normal_ kernel
NORMALIZATION = "tracelens_mi300x_normalization_layer_test.json.gz"  # MI300X, a 5,096-character normal_ kernel


def events_of(path: Path) -> list[dict[str, Any]]:
    data = json.loads(gzip.decompress(path.read_bytes()))
    return data if isinstance(data, list) else data["traceEvents"]


def npu_copy(tmp: Path, name: str) -> Path:
    """A torch_npu fixture folder as torch_npu wrote it (the databases gzipped here, unzipped again)."""
    out = tmp / name
    shutil.copytree(REAL / name, out)
    for packed in out.rglob("*.db.gz"):
        packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()
    return out


def compared(now: Path, base: Path) -> dict[str, Any]:
    """What `ondemandctl report NOW --baseline BASE` compares on this host (host/commands/report.py compare_here)."""
    now_report, base_report = build_reports([[now], [base]], summaries=True, workers=1)
    return compare_groups(base_report["captures"][0], now_report["captures"][0])


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return ctl(Path("/nonexistent"), "report", *args, cwd=cwd)


# ----------------------------------------------------------------------------------------------------------
# 1. A kernel name over 4,096 characters


def test_a_kernel_name_over_4096_characters_is_shortened_never_a_rank_dropped(tmp_path: Path) -> None:
    """TraceLens' xDiT Flux rank on an MI300X: torch.randn's normal_ kernel has a 5,160-character name. The trace
    compared with itself said 'nothing to compare' (exit 1: step_ops.kernels[121][0] is not a name of at most 4096
    characters); now rank 0 is compared, and the name is its first characters and a hash of the whole."""
    for side in ("base", "now"):
        (tmp_path / side).mkdir()
        shutil.copy(REAL / FLUX, tmp_path / side / FLUX)
    (long_name,) = {e["name"] for e in events_of(REAL / FLUX) if len(str(e.get("name", ""))) > MAX_NAME}
    assert len(long_name) == 5160 and "normal" in long_name

    res = cli(tmp_path, "now", "--baseline", "base", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    comparison = json.loads(res.stdout)["comparison"]
    assert [r["rank"] for r in comparison["ranks"]] == [0], comparison["notes"]
    assert not any("not compared" in n for n in comparison["notes"]), comparison["notes"]
    assert not comparison["cause"].startswith("nothing to compare"), comparison["cause"]

    res = cli(tmp_path, "now", "--json", "--top", "400")
    assert res.returncode == 0, res.stderr
    (rank,) = json.loads(res.stdout)["captures"][0]["ranks"]
    digest = hashlib.sha1(long_name.encode()).hexdigest()[:16]
    shortened = [k["name"] for k in rank["top_kernels"] if k["name"].endswith(digest)]
    assert len(shortened) == 1 and len(shortened[0]) == MAX_NAME
    head, tail = shortened[0][:-len(digest) - 2], shortened[0][-len(digest) - 2:]
    assert long_name.startswith(head) and tail == f"…#{digest}"
    assert shortened[0] in [row[0] for row in rank["step_ops"]["kernels"]]  # what a comparison matches by name


def _record(folder: Path, cid: str, summary: dict[str, Any]) -> dict[str, Any]:
    """A finished capture record of one rank (0) whose summary.json is `summary` (host/records.py)."""
    import time

    from ondemand_prof.host.records import CaptureRecord

    wall = time.time()
    record = CaptureRecord.new(cid, "j", {}, {"start_step": 1, "end_step": 5}, {},
                               [{"rank": 0, "host": "h", "pid": 10}], wall)
    (folder / cid).mkdir(parents=True)
    (folder / cid / "summary.json").write_text(json.dumps(summary))
    record.update(0, "done", {"path": str(folder / cid)}, wall)
    return record.data


def test_a_summary_with_a_long_kernel_name_is_compared_across_hosts(tmp_path: Path) -> None:
    """The summary.json a rank writes (rank/postprocess.py) of the xDiT Flux trace holds the 5,160-character kernel
    in its per-step table: each daemon's comparison refused the rank ('summary.json: the baseline's
    step_ops.kernels[..][0] is ... not a name of at most 4096 characters'). Now the summary holds the shortened
    name, and one written before (the whole name) is compared too. Two long names keep apart (their hashes)."""
    from ondemand_prof.host.summaries import compare_records, conclude_replies
    from ondemand_prof.rank.postprocess import write_rank_summary
    from ondemand_prof.report.checks import bounded_name

    trace = json.loads(gzip.decompress((REAL / FLUX).read_bytes()))
    write_rank_summary(tmp_path, trace, {"rank": 0, "world_size": 1, "meta": {}})
    summary = json.loads((tmp_path / "summary.json").read_text())
    (long_name,) = {e["name"] for e in trace["traceEvents"] if len(str(e.get("name", ""))) > MAX_NAME}
    assert bounded_name(long_name) in [row[0] for row in summary["step_ops"]["kernels"]]
    older = json.loads(json.dumps(summary).replace(json.dumps(bounded_name(long_name)), json.dumps(long_name)))
    assert long_name in [row[0] for row in older["step_ops"]["kernels"]]
    for i, said in enumerate((summary, older)):
        reply = compare_records(_record(tmp_path, f"now{i}", said), _record(tmp_path, f"base{i}", said))
        assert reply["problems"] == {} and [r["rank"] for r in reply["ranks"]] == [0], reply["problems"]
        assert conclude_replies([("h", reply)])["cause"].startswith("one step on a side")
    normalization = {e["name"] for e in events_of(REAL / NORMALIZATION) if len(str(e.get("name", ""))) > MAX_NAME}
    (other,) = normalization
    assert bounded_name(other) != bounded_name(long_name) and bounded_name(long_name + " ") != bounded_name(long_name)


# ----------------------------------------------------------------------------------------------------------
# 2. torch_npu's level, 3. text and db exports of one job, 5. HCCL tasks once


def test_torch_npu_levels_are_read_from_profiler_info_and_said(tmp_path: Path) -> None:
    """MindStudio Insight's Level2 Megatron job as the baseline of its Level1 2-rank job: compared silently;
    now the levels torch_npu wrote (profiler_info_N.json experimental_config._profiler_level) are said."""
    text, st = npu_copy(tmp_path, "msinsight_text_level1_2rank"), npu_copy(tmp_path, "msinsight_st_level2_4rank")
    for folder, want in ((text, "Level1"), (st, "Level2")):
        for info in folder.rglob("profiler_info_*.json"):
            assert json.loads(info.read_text())["config"]["experimental_config"]["_profiler_level"] == want
    c = compared(text, st)
    assert {(r["level"]["baseline"], r["level"]["now"]) for r in c["ranks"]} == {("level2", "level1")}
    assert any(n.startswith("different levels (level2 in the baseline, level1 now)") for n in c["notes"]), c["notes"]
    res = cli(tmp_path, str(text), "--baseline", str(st))
    assert "note: different levels (level2 in the baseline, level1 now)" in res.stdout, res.stdout


def _db_tasks_by_hand(db: Path) -> Counter[str]:
    """The db's device tasks as the text export names them, counted with plain SQL: a compute task by its name,
    an HCCL task by its type, a sync task by its type; the hcom_ operations."""
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    strings = dict(con.execute("SELECT id, value FROM STRING_IDS"))
    out: Counter[str] = Counter()
    for name, in con.execute("SELECT c.name FROM TASK t JOIN COMPUTE_TASK_INFO c USING (globalTaskId)"):
        out[strings[name]] += 1
    for kind, in con.execute("SELECT m.taskType FROM TASK t JOIN COMMUNICATION_TASK_INFO m USING (globalTaskId)"):
        out[strings[kind]] += 1
    for kind, in con.execute("SELECT taskType FROM TASK WHERE globalTaskId NOT IN (SELECT globalTaskId FROM "
                             "COMPUTE_TASK_INFO) AND globalTaskId NOT IN (SELECT globalTaskId FROM "
                             "COMMUNICATION_TASK_INFO)"):
        if strings[kind] in ("EVENT_WAIT", "EVENT_RECORD", "MEMCPY_ASYNC", "PROFILING_ENABLE", "PROFILING_DISABLE"):
            out[strings[kind]] += 1
    out["hcom_allReduce_"] += con.execute("SELECT COUNT(*) FROM COMMUNICATION_OP").fetchone()[0]
    con.close()
    return out


def _text_tasks_by_hand(view: Path) -> Counter[str]:
    """trace_view.json's device tasks, each once: the HCCL process's, and the Ascend Hardware rows that are no
    copy of one (same start, same duration)."""
    events = events_of(view)
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    hccl = [e for e in events if e.get("ph") == "X" and process.get(e["pid"]) == "HCCL"]
    copies = {(e["ts"], e["dur"]) for e in hccl}
    hardware = [e for e in events if e.get("ph") == "X" and process.get(e["pid"]) == "Ascend Hardware"
                and (e["ts"], e["dur"]) not in copies]
    return Counter(re.sub(r"^(hcom_[A-Za-z]+_)_\d+(?:_\d+)*$", r"\1", e["name"]) for e in hccl + hardware)


def test_the_text_and_db_exports_of_one_job_read_the_same_tasks(tmp_path: Path) -> None:
    """MindStudio Insight's 2-rank Level1 job exported as text and as db (two captures of one script): the db's
    HCCL tasks (COMMUNICATION_TASK_INFO) and its tasks known by type only (EVENT_WAIT, MEMCPY_ASYNC) were not read,
    so Notify_Wait, SDMA, Reduce_Inline, Memcpy, EVENT_WAIT showed as vanished. Now both read the same tasks under
    the same names (each counted by hand from its own file), and the comparison has no task new or vanished."""
    text, db = npu_copy(tmp_path, "msinsight_text_level1_2rank"), npu_copy(tmp_path, "msinsight_db_level1_2rank")
    for r in (0, 1):
        by_hand_text = _text_tasks_by_hand(text / f"rank{r}_ascend_pt" / "ASCEND_PROFILER_OUTPUT" /
                                           "trace_view.json.gz")
        by_hand_db = _db_tasks_by_hand(db / f"rank{r}_ascend_pt" / "ASCEND_PROFILER_OUTPUT" /
                                       f"ascend_pytorch_profiler_{r}.db")
        assert by_hand_text == by_hand_db  # the same tasks, by name and count, in both exports
        for folder, by_hand in ((text, by_hand_text), (db, by_hand_db)):
            rank = build_report([folder / f"rank{r}_ascend_pt"], workers=1)["captures"][0]["ranks"][0]
            in_steps = {name: calls for name, calls, _ in rank["step_ops"]["kernels"]}  # what a comparison matches
            outside = {"PROFILING_ENABLE": 1, "PROFILING_DISABLE": 1}  # (the profiler's own, before and after)
            assert in_steps == {k: n - outside.get(k, 0) for k, n in by_hand.items() if n > outside.get(k, 0)}
            assert rank["step_ops"]["complete"]["kernels"]
    c = compared(db, text)
    assert [r["rank"] for r in c["ranks"]] == [0, 1]
    for r in c["ranks"]:
        assert {x["status"] for x in r["changes"]} == {"changed"}, [(x["name"], x["status"]) for x in r["changes"]]
        assert {x["category"] for x in r["changes"] if x["name"] in ("Notify_Wait", "Memcpy")} <= {"communication"}
    kinds = {k["kind"]: k for k in c["communication"]}
    assert kinds["all_reduce"]["calls_baseline"] == kinds["all_reduce"]["calls_now"] == 4


def test_hccl_tasks_count_once_as_communication_and_the_split_is_torch_npus(tmp_path: Path) -> None:
    """The text export's HCCL tasks appear twice in trace_view.json: on the HCCL process (Notify_Wait) and on the
    Ascend Hardware track (Notify Wait, Write Value, SDMA: same start, same duration). Both were read, the
    hardware copies as compute kernels, so our own split of step 50 (without step_trace_time.csv) had 106 ms of
    overlap where torch_npu says 4.03 ms. Now each task counts once, as communication, and our split is
    torch_npu's own to 5 us."""
    text = npu_copy(tmp_path, "msinsight_text_level1_2rank")
    for r in (0, 1):
        out = text / f"rank{r}_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
        (row,) = csv.DictReader((out / "step_trace_time.csv").open())
        (out / "step_trace_time.csv").unlink()
        (out / "kernel_details.csv").unlink()  # (our tables from trace_view.json alone)
        rank = build_report([out.parent], top=10_000, workers=1)["captures"][0]["ranks"][0]
        kernels = {k["name"]: k for k in rank["top_kernels"]}
        assert not {"Notify Wait", "Write Value", "SDMA"} & set(kernels), sorted(kernels)
        waits = sum(1 for e in events_of(out / "trace_view.json.gz") if e.get("name") == "Notify_Wait")
        assert kernels["Notify_Wait"]["calls"] == waits == 112 and kernels["Notify_Wait"]["comm"]
        (s,) = rank["steps"]
        computing, overlapped = float(row["Computing"]), float(row["Overlapped"])
        assert (s["compute_ms"], s["comm_ms"], s["overlap_ms"], s["idle_ms"]) == pytest.approx(
            ((computing - overlapped) / 1000, float(row["Communication(Not Overlapped)"]) / 1000, overlapped / 1000,
             float(row["Free"]) / 1000), abs=0.005)


# ----------------------------------------------------------------------------------------------------------
# 4. A read-only capture folder


def _read_only(folder: Path) -> Iterator[None]:
    """`folder` read-only as a mount makes it: a read-only bind mount as root, else its modes (a user cannot
    write where the modes say no; root can, so root needs the mount)."""
    if os.geteuid() != 0:
        for p in [folder, *folder.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        yield
        for p in [folder, *folder.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        return
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode != 0:
        pytest.skip("no read-only mount here (mount --bind refused) and root writes through the modes")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)


def test_the_torch_npu_database_is_read_from_a_read_only_folder_and_left_unchanged(tmp_path: Path) -> None:
    """torch_npu's db is in WAL mode: opened read-only (not immutable) it left -shm and -wal files in the capture
    folder at each report, and on a read-only mount it could not be opened at all ('unable to open database
    file'): the rank's operators and kernels were lost. Now the report reads it there and writes nothing."""
    db = npu_copy(tmp_path, "msinsight_db_level1_2rank")
    out = db / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    assert (out / "ascend_pytorch_profiler_0.db").read_bytes()[18:20] == b"\x02\x02"  # WAL
    before = sorted(p.name for p in out.iterdir())
    for _ in _read_only(db):
        report = build_report([db], workers=1)
        (group,) = report["captures"]
        assert [r["rank"] for r in group["ranks"]] == [0, 1] and group["failed"] == []
        for rank in group["ranks"]:
            assert not rank["warnings"], rank["warnings"]
            assert rank["files_used"][0].startswith("ascend_pytorch_profiler_") and rank["top_kernels"]
    build_report([db], workers=1)  # (writable again: still nothing written)
    assert sorted(p.name for p in out.iterdir()) == before


# ----------------------------------------------------------------------------------------------------------
# 6. Two device types, 7. a trace without a rank


def _device_pair(tmp_path: Path) -> tuple[str, str]:
    for side, name in (("h100", "tracelens_bert_small_h100.json.gz"),
                       ("mi300x", "tracelens_bert_small_mi300x.json.gz")):
        (tmp_path / side).mkdir()
        shutil.copy(REAL / name, tmp_path / side / name)
    return "mi300x", "h100"


def test_a_pair_from_two_device_types_is_said_and_names_no_vendor_kernel_as_the_cause(tmp_path: Path) -> None:
    """TraceLens' BERT-small step on an H100 (baseline) and on an MI300X: the cause line named cuBLAS's cutlass
    kernel '(vanished)' and every kernel was new or vanished. Now a note and the cause say the devices differ
    (deviceProperties) and kernels are not compared by name; the operators are."""
    now, base = _device_pair(tmp_path)
    devices = {}
    for side, name in ((now, "tracelens_bert_small_mi300x.json.gz"), (base, "tracelens_bert_small_h100.json.gz")):
        devices[side] = json.loads(gzip.decompress((REAL / name).read_bytes()))["deviceProperties"][0]["name"]
    assert devices == {"mi300x": "AMD Instinct MI300X VF", "h100": "NVIDIA H100 80GB HBM3"}
    said = "different devices (NVIDIA H100 80GB HBM3 in the baseline, AMD Instinct MI300X VF now)"
    res = cli(tmp_path, now, "--baseline", base)
    assert res.returncode == 0, res.stderr
    assert f"note: {said}: a kernel's name is the device's" in res.stdout, res.stdout
    c = json.loads(cli(tmp_path, now, "--baseline", base, "--json").stdout)["comparison"]
    assert said in c["cause"] and "kernels not compared by name" in c["cause"]
    kernels = {e["name"] for name in ("tracelens_bert_small_mi300x.json.gz", "tracelens_bert_small_h100.json.gz")
               for e in events_of(REAL / name) if e.get("cat") == "kernel"}
    assert not any(k.split("<")[0].split("(")[0][:20] in c["cause"] for k in kernels), c["cause"]
    (rank,) = c["ranks"]
    assert rank["changes"] and {x["category"] for x in rank["changes"]} == {"operator"}
    assert rank["device"] == {"baseline": devices["h100"], "now": devices["mi300x"]}


def test_capture_folders_compared_from_their_summaries_say_the_devices_differ(tmp_path: Path) -> None:
    """Our capture folders of the same pair (each rank's trace, metadata.json and the summary.json its
    post-processing writes): a comparison here reads the summaries, which do not name the device; the device is
    read from the trace's header, and the note is said as for the traces themselves."""
    from ondemand_prof.rank.postprocess import write_rank_summary

    folders = {}
    for side, name in (("h100", "tracelens_bert_small_h100.json.gz"), ("mi300x", "tracelens_bert_small_mi300x.json.gz")):
        rank_dir = tmp_path / side / "rank0"
        rank_dir.mkdir(parents=True)
        trace = json.loads(gzip.decompress((REAL / name).read_bytes()))
        trace.pop("metadata", None)  # (TraceLens' pip list; and it moved traceEvents first: Kineto, and our
        trace = {**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": trace["traceEvents"]}
        (rank_dir / "trace.json").write_text(json.dumps(trace))  # captures, write the header before the events)
        meta = {"rank": 0, "capture_id": f"c-{side}", "job_id": "j", "status": "ok", "trace_file": "trace.json"}
        (rank_dir / "metadata.json").write_text(json.dumps(meta))
        write_rank_summary(rank_dir, trace, {"rank": 0, "world_size": 1,
                                             "meta": {"capture_id": f"c-{side}", "job_id": "j"}})
        folders[side] = tmp_path / side
    c = compared(folders["mi300x"], folders["h100"])
    assert c["ranks"][0]["device"] == {"baseline": "NVIDIA H100 80GB HBM3", "now": "AMD Instinct MI300X VF"}
    assert any(n.startswith("different devices (NVIDIA H100 80GB HBM3 in the baseline") for n in c["notes"])


def test_a_trace_that_names_no_rank_is_rank_question_mark_not_none(tmp_path: Path) -> None:
    """The same pair: neither trace has distributedInfo, and the comparison printed 'RANK None', 'rank None:'
    and 'one step on a side (no rank)'. Now: 'rank ? (no distributedInfo)', in the text and the HTML."""
    now, base = _device_pair(tmp_path)
    for name in ("tracelens_bert_small_mi300x.json.gz", "tracelens_bert_small_h100.json.gz"):
        assert "distributedInfo" not in json.loads(gzip.decompress((REAL / name).read_bytes()))
    res = cli(tmp_path, now, "--baseline", base, "--html", str(tmp_path / "c.html"))
    assert res.returncode == 0, res.stderr
    assert "rank ? (no distributedInfo): what changed most" in res.stdout, res.stdout
    assert "one step on a side (rank ? (no distributedInfo))" in res.stdout
    assert not re.search(r"\bNone\b|\(no rank\)", res.stdout), res.stdout
    page = (tmp_path / "c.html").read_text()
    assert "Rank ? (no distributedInfo): what changed most" in page and not re.search(r"[Rr]ank None\b|>None<", page)


# ----------------------------------------------------------------------------------------------------------
# 8. Which step torch_npu's report uses


def test_torch_npus_step_is_its_device_step_and_the_docs_say_so(tmp_path: Path) -> None:
    """Rank 0 of the Level1 text export: the report's step 50 is torch_npu's device step (Computing +
    Communication(Not Overlapped) + Free in step_trace_time.csv: 136.58 ms), not the CPU's ProfilerStep#50 of
    trace_view.json (155.99 ms); docs/reports.md says which step each backend's report uses."""
    text = npu_copy(tmp_path, "msinsight_text_level1_2rank")
    out = text / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    (row,) = csv.DictReader((out / "step_trace_time.csv").open())
    device = sum(float(row[k]) for k in ("Computing", "Communication(Not Overlapped)", "Free")) / 1000
    (cpu,) = [e for e in events_of(out / "trace_view.json.gz") if e.get("name") == "ProfilerStep#50"]
    (s,) = build_report([out.parent], workers=1)["captures"][0]["ranks"][0]["steps"]
    assert s["dur_ms"] == pytest.approx(device, abs=1e-6) == pytest.approx(136.581, abs=1e-3)
    assert float(cpu["dur"]) / 1000 == pytest.approx(155.986, abs=1e-3)
    docs = (ROOT / "docs" / "reports.md").read_text()
    section = docs.split("## Which step", 1)[1].split("\n#", 1)[0]
    for said in ("Computing + Communication(Not Overlapped) + Free", "ProfilerStep#N", "136.6", "156.0"):
        assert said in section, said


# ----------------------------------------------------------------------------------------------------------
# Issue 41 item 10: a summary that passes the check renders


def test_a_summary_whose_top_rows_lack_what_the_report_reads_fails_its_rank_alone(tmp_path: Path) -> None:
    """A rank's summary.json (written by rank/postprocess.py of HTA's real rank-0 trace) with its top operators'
    `calls` taken out passed the check, and the whole report failed with a KeyError in text.py and html.py. The
    check now requires what the renderers read: that rank fails with the field named, the others render."""
    from ondemand_prof.rank.postprocess import write_rank_summary

    trace = json.loads(gzip.decompress((REAL / "hta_sampled_rank-0.json.gz").read_bytes()))
    parts = []
    for r in (0, 1):
        (tmp_path / f"r{r}").mkdir()
        write_rank_summary(tmp_path / f"r{r}", trace, {"rank": r, "world_size": 2,
                                                     "meta": {"capture_id": "c1", "job_id": "j"}})
        summary = json.loads((tmp_path / f"r{r}" / "summary.json").read_text())
        parts.append({"rank": r, "host": "h", "pid": r + 1, "state": "done", "path": str(tmp_path / f"r{r}"),
                      "summary": summary})
    broken = parts[1]["summary"]
    assert broken["top_self"] and all("calls" in row for row in broken["top_self"])
    for row in broken["top_self"]:
        del row["calls"]
    reply = {"capture_id": "c1", "job": "j", "window": [551, 553], "status": "done", "options": {}, "parts": parts}
    merged = merge_summaries([("node1", reply)])
    group = merged["captures"][0]
    assert [r["rank"] for r in group["ranks"]] == [0]
    (failed,) = group["failed"]
    assert failed["rank"] == 1 and failed["error"] == "summary.json: top_self[0].calls is missing, not a number"
    assert "-- rank 0" in render_text(merged) and "top_self[0].calls is missing" in render_text(merged)
    assert "top_self[0].calls is missing" in render_html(merged)
