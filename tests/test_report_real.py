"""Reports on real traces from public repositories (tests/fixtures/real/README.md says where each comes from),
each figure checked against a plain recomputation from the file's JSON or CSV written here, not our analysis."""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import json
import shutil
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from conftest import ctl
from ondemand_prof.report import build_report
from test_report import cpu_split_by_hand
from ondemand_prof.report.html import render_html
from ondemand_prof.report.text import render_text, short_name, short_names

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)

REAL = Path(__file__).resolve().parent / "fixtures" / "real"
SHARES = ("compute_pct", "comm_pct", "overlap_pct", "idle_pct")
LAUNCH = {"cuda_runtime", "cuda_driver", "Runtime"}
DEVICE = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}


def events_of(name: str) -> list[dict[str, Any]]:
    data = json.loads(gzip.decompress((REAL / name).read_bytes()))
    return data if isinstance(data, list) else data["traceEvents"]


def one_rank(path: Path, top: int = 10_000) -> dict[str, Any]:
    report = build_report([path], top=top, workers=1)
    assert not report["problems"], report["problems"]
    (group,) = report["captures"]
    assert not group["failed"], group["failed"]
    (rank,) = group["ranks"]
    return rank


def kernel_ms_per_step(events: list[dict[str, Any]]) -> dict[int, float]:
    """HTA's rule by hand: a kernel belongs to the step whose span holds its launch (the runtime call with the
    same correlation id), else the step its own start falls in."""
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH and "correlation" in (e.get("args") or {})}
    longest: dict[int, tuple[float, float]] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"):
            n = int(e["name"].split("#")[1])
            if n not in longest or float(e["dur"]) > longest[n][1]:
                longest[n] = (float(e["ts"]), float(e["dur"]))
    steps = sorted((ts, ts + dur, n) for n, (ts, dur) in longest.items())
    out: dict[int, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE:
            t = launched.get((e.get("args") or {}).get("correlation"), float(e["ts"]))
            k = bisect.bisect_right([s[0] for s in steps], t) - 1
            if k >= 0 and t < steps[k][1]:
                out[steps[k][2]] += float(e["dur"]) / 1000
    return out


def assert_shares(rank: dict[str, Any]) -> None:
    assert sum(rank[k] for k in SHARES) == pytest.approx(100.0)
    for s in rank["steps"]:
        parts = s["compute_ms"] + s["comm_ms"] + s["overlap_ms"] + s["idle_ms"]
        assert parts == pytest.approx(s["window_ms"], abs=1e-6), s
        assert min(s["compute_ms"], s["comm_ms"], s["overlap_ms"], s["idle_ms"]) >= -1e-9, s


# ----------------------------------------------------------------------------------------------------------
# Kineto, torch 1.8 to today

def test_torch_1_9_kineto_trace_old_categories_and_memory_without_totals() -> None:
    name = "kineto_resnet50_2021-06.pt.trace.json.gz"
    events = events_of(name)
    r = one_rank(REAL / name)
    labelled = {int(e["name"].split("#")[1]): e["dur"] / 1000 for e in events
                if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert {s["step"]: s["dur_ms"] for s in r["steps"]} == pytest.approx(labelled)
    assert sorted(labelled) == [5, 6, 7, 8, 9, 10] and r["basis"] == "device"
    # every kernel/memcpy/memset, and their time, as the JSON sums them
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE]
    assert sum(k["calls"] for k in r["top_kernels"]) == len(device)
    assert sum(k["total_us"] for k in r["top_kernels"]) == pytest.approx(sum(e["dur"] for e in device))
    assert not any(k["comm"] for k in r["top_kernels"])  # one GPU, no collectives
    assert {s["step"]: s["kernel_ms"] for s in r["steps"]} == pytest.approx(kernel_ms_per_step(events))
    assert r["kernel_steps"]["by_launch"] == len(device) and r["operators"] > 50
    assert "ProfilerStep#5" not in {o["name"] for o in r["top_total"]}
    assert_shares(r)
    # memory: only Bytes per event; the peak is the running sum's (here by hand, per device)
    running: dict[tuple[Any, Any], float] = defaultdict(float)
    peak: dict[tuple[Any, Any], float] = defaultdict(float)
    allocs: dict[tuple[Any, Any], int] = defaultdict(int)
    for e in events:
        if e.get("name") == "[memory]":
            key = (e["args"]["Device Type"], e["args"]["Device Id"])
            running[key] += e["args"]["Bytes"]
            peak[key] = max(peak[key], running[key])
            allocs[key] += e["args"]["Bytes"] > 0
    devices = {d["device"]: d for d in r["memory"]["devices"]}
    assert set(devices) == {"cuda:0", "CPU"} and r["memory"]["series_device"] == "cuda:0"
    assert devices["cuda:0"]["peak_allocated"] == peak[(1, 0)] > 2000 * 2**20
    assert devices["cuda:0"]["allocs"] == allocs[(1, 0)] and devices["cuda:0"]["derived"] is True
    assert devices["CPU"]["peak_allocated"] == peak[(0, -1)]


def test_torch_1_8_kineto_trace() -> None:
    name = "kineto_resnet50_2021-02.pt.trace.json.gz"
    events = events_of(name)
    r = one_rank(REAL / name)
    assert [s["step"] for s in r["steps"]] == [5, 6, 7, 8, 9, 10]
    assert {s["step"]: s["kernel_ms"] for s in r["steps"]} == pytest.approx(kernel_ms_per_step(events))
    kernels = [e for e in events if e.get("cat") == "Kernel"]
    assert sum(k["calls"] for k in r["top_kernels"]) >= len(kernels) > 9000
    assert r["top_self"] and r["memory"] is None
    assert_shares(r)


def test_two_nccl_ranks_kernels_by_launch_and_communication() -> None:
    report = build_report([REAL / "hta_sampled_rank-0.json.gz", REAL / "hta_sampled_rank-1.json.gz"], top=10_000,
                          workers=1)
    (group,) = report["captures"]
    assert [r["rank"] for r in group["ranks"]] == [0, 1]
    for r in group["ranks"]:
        events = events_of(f"hta_sampled_rank-{r['rank']}.json.gz")
        assert [s["step"] for s in r["steps"]] == [551, 552]
        assert {s["step"]: s["kernel_ms"] for s in r["steps"]} == pytest.approx(kernel_ms_per_step(events))
        nccl = [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel")]
        comm = [k for k in r["top_kernels"] if k["comm"]]
        assert sum(k["calls"] for k in comm) == len(nccl) > 0
        assert sum(k["total_us"] for k in comm) == pytest.approx(sum(e["dur"] for e in nccl))
        assert r["comm_pct"] > 5 and r["overlap_pct"] > 0
        assert_shares(r)
    # the same numbers from a process pool
    pooled = build_report([REAL / "hta_sampled_rank-0.json.gz", REAL / "hta_sampled_rank-1.json.gz"], top=10_000,
                          workers=2)
    assert pooled["captures"][0]["ranks"] == group["ranks"]


def test_rocm_trace() -> None:
    events = events_of("hta_mi250_rocm6_2.json.gz")
    r = one_rank(REAL / "hta_mi250_rocm6_2.json.gz")
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE]
    assert sum(k["calls"] for k in r["top_kernels"]) == len(device) > 10
    assert r["kernel_steps"]["by_launch"] == len(device)
    assert [s["step"] for s in r["steps"]][:1] == [1]
    assert_shares(r)


def test_cpu_only_trace_split_by_hand() -> None:
    """A CPU-only trace of a GPU job (no device activity recorded): its training thread spends most of the step in
    record_function labels (## backward ##: the autograd engine works elsewhere) without an operator open, which
    is idle, not compute; its record_param_comms and nccl:all_to_all ranges are the communication."""
    events = events_of("hta_rank_non_gpu.json.gz")
    r = one_rank(REAL / "hta_rank_non_gpu.json.gz")
    (s,) = r["steps"]
    ((compute, exposed, overlap),) = cpu_split_by_hand(events).values()
    assert exposed > 0
    assert (s["compute_ms"], s["comm_ms"], s["overlap_ms"]) == pytest.approx(
        (compute / 1000, exposed / 1000, overlap / 1000), abs=1e-6)
    assert s["idle_ms"] > s["compute_ms"]  # the labels' time without an operator
    # record_param_comms (c10d) around ProcessGroupNCCL's nccl:all_to_all ranges
    assert r["basis"] == "cpu" and {lib["library"] for lib in r["comm_libraries"]} == {"c10d", "NCCL/RCCL"}
    assert_shares(r)


# ----------------------------------------------------------------------------------------------------------
# torch_npu

def ascend_dir(root: Path, files: dict[str, str]) -> Path:
    """An *_ascend_pt directory holding the given real files (name in ASCEND_PROFILER_OUTPUT -> fixture)."""
    top = root / "node0_1234_20250101000000000_ascend_pt"
    out = top / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    for target, fixture in files.items():
        (out / target).write_bytes(gzip.decompress((REAL / fixture).read_bytes()))
    return top


def test_torch_npu_trace_view_json_array_format(tmp_path: Path) -> None:
    events = events_of("mstt_trace_view.json.gz")
    plain = tmp_path / "trace_view.json"
    plain.write_bytes(gzip.decompress((REAL / "mstt_trace_view.json.gz").read_bytes()))
    r = one_rank(plain)
    hardware = {e["pid"] for e in events if e.get("ph") == "M" and e["args"].get("name") == "Ascend Hardware"}
    tasks = [e for e in events if e.get("ph") == "X" and e.get("pid") in hardware]
    assert sum(k["calls"] for k in r["top_kernels"]) == len(tasks)
    assert sum(k["total_us"] for k in r["top_kernels"]) == pytest.approx(sum(float(e["dur"]) for e in tasks))
    finishes = {e["ts"] for e in events if e.get("cat") == "async_npu" and e.get("ph") == "f"}
    assert r["kernel_steps"]["by_launch"] == sum(e["ts"] in finishes for e in tasks) > 200
    (step,) = r["steps"]
    assert step["step"] == 1 and step["dur_ms"] == pytest.approx(14.09197)
    assert "ProfilerStep#1" not in {o["name"] for o in r["top_total"]} and r["operators"] > 20
    assert_shares(r)
    # the Array Format may leave out the closing bracket
    cut = plain.read_text().rstrip()
    assert cut.endswith("]")
    plain.write_text(cut[:-1])
    assert one_rank(plain)["events"] == r["events"] == len(events)


def kernel_details_by_hand(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(type -> total us of HCCL rows, type -> total us of other rows) from the CSV."""
    comm: dict[str, float] = defaultdict(float)
    other: dict[str, float] = defaultdict(float)
    for row in csv.DictReader(io.StringIO(text)):
        (comm if row["Accelerator Core"] == "HCCL" else other)[row["Type"]] += float(row["Duration(us)"])
    return comm, other


def test_torch_npu_directory_with_trace_view_and_kernel_details(tmp_path: Path) -> None:
    top = ascend_dir(tmp_path, {"trace_view.json": "mstt_trace_view.json.gz",
                                "kernel_details.csv": "mstt_kernel_details.csv.gz"})
    r = one_rank(top)
    assert r["kind"] == "ascend" and r["files_used"] == ["trace_view.json", "kernel_details.csv"]
    comm, other = kernel_details_by_hand(gzip.decompress((REAL / "mstt_kernel_details.csv.gz").read_bytes()).decode())
    kernels = {k["name"]: k for k in r["top_kernels"]}
    assert {n for n, k in kernels.items() if k["comm"]} == set(comm) == {
        "hcom_allReduce_", "hcom_broadcast_", "hcom_allGather_", "hcom_reduceScatter_"}
    for name, total in comm.items():
        assert kernels[name]["total_us"] == pytest.approx(total)
    assert kernels["BroadcastTo"]["comm"] is False and kernels["BroadcastTo"]["calls"] == 5  # a vector op
    assert kernels["MatMul"]["total_us"] == pytest.approx(other["MatMul"])
    assert r["steps"][0]["start_us"] is not None


def test_torch_npu_level0_kernel_details_type_na(tmp_path: Path) -> None:
    """Level0 writes Type as N/A (derived here from the real level1 file by blanking Type: synthetic)."""
    text = gzip.decompress((REAL / "mstt_kernel_details.csv.gz").read_bytes()).decode()
    rows = list(csv.DictReader(io.StringIO(text)))
    out = tmp_path / "synthetic_level0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    with open(out / "kernel_details.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({**row, "Type": "N/A"} for row in rows)
    r = one_rank(out.parent)
    kernels = {k["name"]: k for k in r["top_kernels"]}
    assert "N/A" not in kernels
    comm, _ = kernel_details_by_hand(text)
    assert kernels["hcom_allReduce_"]["comm"] and kernels["hcom_allReduce_"]["calls"] == 14
    assert kernels["hcom_allReduce_"]["total_us"] == pytest.approx(comm["hcom_allReduce_"])
    assert sum(k["total_us"] for k in r["top_kernels"] if k["comm"]) == pytest.approx(sum(comm.values()))


def npu_db_dir(root: Path, with_analysis: bool = True) -> Path:
    """MindStudio Insight's test/data/pytorch/db/level1/rank0_ascend_pt, as torch_npu laid it out."""
    top = root / "rank0_ascend_pt"
    out = top / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    shutil.copy(REAL / "msinsight_db_level1_rank0_profiler_info_0.json", top / "profiler_info_0.json")
    (out / "ascend_pytorch_profiler_0.db").write_bytes(
        gzip.decompress((REAL / "msinsight_db_level1_rank0_ascend_pytorch_profiler_0.db.gz").read_bytes()))
    if with_analysis:
        (out / "analysis.db").write_bytes(gzip.decompress((REAL / "msinsight_db_level1_rank0_analysis.db.gz").read_bytes()))
    return top


def test_torch_npu_db_export_agrees_with_torch_npus_own_split(tmp_path: Path) -> None:
    """The db export (the one that raised TypeError: PYTORCH_API's times are TEXT): read from its tables alone,
    our split of step 50 equals torch_npu's own (analysis.db StepTraceTime) to the microsecond."""
    bare = one_rank(npu_db_dir(tmp_path / "bare", with_analysis=False))
    full = one_rank(npu_db_dir(tmp_path / "full"))
    db = sqlite3.connect(tmp_path / "full" / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "ascend_pytorch_profiler_0.db")
    assert db.execute("SELECT typeof(startNs) FROM PYTORCH_API LIMIT 1").fetchone() == ("text",)
    ((start, end),) = db.execute("SELECT startNs, endNs FROM STEP_TIME").fetchall()
    con = sqlite3.connect(tmp_path / "full" / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "analysis.db")
    ((computing, exposed, overlapped, free),) = con.execute(
        "SELECT computing, communication_not_overlapped, overlapped, free FROM StepTraceTime").fetchall()
    (s,) = bare["steps"]
    assert (s["step"], s["dur_ms"]) == (50, pytest.approx((end - start) / 1e6))
    assert (s["compute_ms"], s["comm_ms"], s["overlap_ms"], s["idle_ms"]) == pytest.approx(
        ((computing - overlapped) / 1000, exposed / 1000, overlapped / 1000, free / 1000), abs=0.005)
    assert full["split_from"] == "analysis.db StepTraceTime" and full["files_used"] == [
        "ascend_pytorch_profiler_0.db", "analysis.db"]
    assert bare["rank"] == full["rank"] == 0 and bare["comm_libraries"][0]["library"] == "HCCL"
    ops = {o["name"] for o in bare["top_total"]} | {o["name"] for o in bare["top_self"]}
    assert "Enqueue" not in ops and not any(n.startswith("torch/") for n in ops)  # task queue, Python frames
    assert any(n.startswith("aten::") for n in ops)
    pta = bare["memory"]["devices"][0]
    assert (pta["component"], pta["device"]) == ("PTA", "NPU:0") and pta["peak_allocated"] == pytest.approx(
        db.execute("SELECT MAX(totalAllocated) FROM MEMORY_RECORD m JOIN STRING_IDS s ON s.id = m.component "
                   "WHERE s.value = 'PTA'").fetchone()[0])


def test_msinsight_server_ranks_rounded_memory_and_empty_columns(tmp_path: Path) -> None:
    """MindStudio Insight's server test ranks: step_trace_time.csv, kernel_details.csv, and a memory_record.csv
    whose timestamps a spreadsheet rounded to 1.69512E+15 and whose APP rows have no Total Allocated."""
    shutil.copytree(REAL / "msinsight_server", tmp_path / "srv")
    report = build_report([tmp_path / "srv"], workers=1)
    (group,) = report["captures"]
    r0, r1 = group["ranks"]
    assert (r0["rank"], r1["rank"]) == (0, 1) and r1["split_from"] == "step_trace_time.csv"
    devices = {d["component"]: d for d in r1["memory"]["devices"]}
    assert devices["APP"]["peak_allocated"] is None and devices["APP"]["peak_reserved"] == 10750.375 * 2**20
    assert {t for t, _ in r1["memory"]["series"]} == {1.69512e15}
    page = render_html(report)
    assert "APP on NPU:1 peak allocated not recorded, reserved 10750.4 MiB" in page
    assert "samples share one timestamp" in page and "APP on NPU:1 peak 0.0" not in page
    app = [line.split() for line in render_text(report).splitlines() if line.split()[:2] == ["NPU:1", "APP"]]
    assert app == [["NPU:1", "APP", "-", "10750.4", "-", "-", "-"]]  # the text table: "-", not 0.0


def test_other_ascend_databases_load_or_get_one_line(tmp_path: Path) -> None:
    """CANN's msprof_0.db (device tasks, no steps) loads; MindStudio's memscope dump is named as another kind,
    found by a search or given by name; nothing prints a traceback."""
    (tmp_path / "msprof_0.db").write_bytes(gzip.decompress((REAL / "msinsight_msprof_0.db.gz").read_bytes()))
    (tmp_path / "memscope.db").write_bytes(gzip.decompress((REAL / "msinsight_memscope_dump.db.gz").read_bytes()))
    msprof = one_rank(tmp_path / "msprof_0.db")
    assert msprof["kind"] == "ascend" and sum(k["calls"] for k in msprof["top_kernels"]
                                              if not k["comm"]) == 11  # COMPUTE_TASK_INFO (and its HCCL tasks)
    res = ctl(tmp_path, "report", str(tmp_path / "memscope.db"))
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    (line,) = [x for x in res.stdout.splitlines() if "memscope.db" in x]
    assert "neither our profile.db nor torch_npu's" in line and "memory_allocation" in line


# ----------------------------------------------------------------------------------------------------------
# What a person reads

def test_text_json_and_html_of_real_traces(tmp_path: Path) -> None:
    for name in ("hta_sampled_rank-0.json.gz", "hta_sampled_rank-1.json.gz",
                 "kineto_resnet50_2021-06.pt.trace.json.gz"):
        shutil.copy(REAL / name, tmp_path / name)
    top = ascend_dir(tmp_path / "npu", {"trace_view.json": "mstt_trace_view.json.gz"})
    report = build_report([tmp_path, top], top=15, workers=2)
    text = render_text(report)
    rows = 0
    for line in text.splitlines():  # the across-ranks rows: four shares that add up to 100.0, as printed
        cells = line.split()
        if len(cells) >= 9 and (cells[0].isdigit() or cells[0] == "?") and cells[4].replace(".", "").isdigit():
            assert sum(float(c) for c in cells[4:8]) == pytest.approx(100.0, abs=1e-9), line
            rows += 1
    assert rows == 4
    assert "cuda:0" in text and "1:0" not in text
    json.dumps(report)  # what --json prints
    page = render_html(report)
    assert page.count('<nav class="index">') == 1 and 'href="#c0"' in page  # an index: several captures
    long_name = next(k["name"] for g in report["captures"] for r in g["ranks"] for k in r["top_kernels"]
                     if len(k["name"]) > 120)
    full = long_name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    assert f'<td class=name title="{full}">' in page  # the full name on hover
    assert f">{full}</td>" not in page and f"</title>{full}</text>" not in page  # shown shortened
    assert_bars_fit(page)


def test_kernel_names_that_shorten_alike_are_told_apart() -> None:
    """Real kernels whose shortened names clash (8 pairs in the 2021 ResNet trace, 31 in the NCCL rank, 2 in the
    ROCm one: the template arguments that differ sit in the cut middle) each get a label of their own."""
    for name, clashes in (("kineto_resnet50_2021-06.pt.trace.json.gz", 8), ("hta_sampled_rank-0.json.gz", 31),
                          ("hta_mi250_rocm6_2.json.gz", 2)):
        names = sorted({e["name"] for e in events_of(name) if e.get("cat") in ("kernel", "Kernel")})
        assert len(names) - len({short_name(n) for n in names}) >= clashes  # what a plain cut would show
        labels = short_names(names)
        assert len(set(labels)) == len(names) and max(len(x) for x in labels) <= 64, name


def assert_bars_fit(page: str) -> None:
    """The stacked step bars: every segment inside the chart, and a rank's segments end where its bar does."""
    import re
    chart = re.search(r'<svg class="chart" id="split-chart" width="(\d+)".*?</svg>', page, re.S)
    assert chart
    width = float(chart.group(1))
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for x, y, w in re.findall(r'<rect x="([\d.]+)" y="(\d+)" width="([\d.]+)"', chart.group(0)):
        rows[y].append((float(x), float(w)))
        assert float(x) + float(w) <= width
    for segments in rows.values():
        assert len(segments) == 4  # compute, comm, overlap, idle
