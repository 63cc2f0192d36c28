"""Reports: on traces from real CPU runs (single rank against torch's own key_averages(), multi-rank gloo
through the real CLI), and on hand-built FIXTURES for what a CPU run cannot produce (GPU kernels with
correlation ids and NCCL kernels; torch_npu's ASCEND_PROFILER_OUTPUT CSVs). Fixtures are named fixture_*."""

from __future__ import annotations

import csv
import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import assert_ok, base_env, captures, ctl, load_trace, run_ranks, start_ranks, trace_steps, wait_all
from ondemand_prof.report import build_report
from ondemand_prof.report.analyze import RankAnalyzer
from ondemand_prof.report.tracefile import TraceReader

TORCH_PROFILE = r"""
import json, sys, torch
from torch.profiler import profile, ProfilerActivity, schedule
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True,
             schedule=schedule(wait=0, warmup=1, active=4, repeat=1)) as prof:
    for _ in range(5):
        x = torch.randn(32, 64)
        loss = model(x).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        prof.step()
prof.export_chrome_trace(sys.argv[1])
ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
json.dump(ops, open(sys.argv[2], "w"))
"""


def test_operator_self_times_and_steps_agree_with_torch(tmp_path: Path) -> None:
    trace, ref = tmp_path / "rank0.pt.trace.json", tmp_path / "key_averages.json"
    subprocess.run([sys.executable, "-c", TORCH_PROFILE, str(trace), str(ref)], check=True, env=base_env(),
                   timeout=300)
    an = RankAnalyzer()
    an.feed(TraceReader(trace).events())
    ours = an.operator_self_times()
    torch_self = json.loads(ref.read_text())
    compared = {name: t for name, t in torch_self.items() if name in ours}
    assert len(compared) >= 10, sorted(torch_self)
    total_ours, total_torch = sum(ours[n] for n in compared), sum(compared.values())
    assert abs(total_ours - total_torch) <= 0.01 * total_torch, (total_ours, total_torch)
    for name, t in compared.items():  # and operator by operator
        assert abs(ours[name] - t) <= 0.01 * t + 0.01, (name, ours[name], t)
    # step times are the ProfilerStep#N events, exactly
    events = json.loads(trace.read_text())["traceEvents"]
    labelled = {int(e["name"].split("#")[1]): e["dur"] / 1000 for e in events
                if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"}
    result = an.result()
    assert {s["step"]: s["dur_ms"] for s in result["steps"]} == pytest.approx(labelled)
    assert len(result["steps"]) == 4
    mem = result["memory"]
    assert mem and mem["devices"][0]["allocs"] > 0 and mem["devices"][0]["peak_allocated"] > 0


def test_multi_rank_report_through_the_cli(tmp_path: Path) -> None:
    save = tmp_path / "profile"
    assert_ok(run_ranks(["--steps", "14", "--profile", "--profile-step-start", "4", "--profile-step-end", "8",
                         "--profile-ranks", "-1", "--profile-with-memory", "--profile-save-path", str(save),
                         "--profile-min-free-mb", "0"], world=2))
    caps = captures(save)
    assert len(caps) == 2
    res = ctl(tmp_path, "report", str(save), "--top", "15")  # c10d::allreduce_ is among the top 15 on any host
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "across ranks" in out and "slowest: rank" in out
    assert "window [4, 8) recorded 4..7" in out
    for rank in (0, 1):
        assert f"-- rank {rank}  {save}" in out
    assert "c10d::allreduce_" in out and "comm" in out
    assert "memory" in out and "PEAK MIB" in out
    data = json.loads(ctl(tmp_path, "report", str(save), "--json").stdout)
    (group,) = data["captures"]
    assert [r["rank"] for r in group["ranks"]] == [0, 1] and group["failed"] == []
    for r, cap in zip(group["ranks"], sorted(caps, key=lambda c: c["rank"])):
        assert [s["step"] for s in r["steps"]] == [4, 5, 6, 7]
        expected = cpu_split_by_hand(load_trace(cap)["traceEvents"])
        for s in r["steps"]:  # against a plain recomputation from the trace's JSON
            compute, exposed, overlap = expected[s["step"]]
            assert (s["compute_ms"], s["comm_ms"], s["overlap_ms"]) == pytest.approx(
                (compute / 1000, exposed / 1000, overlap / 1000), abs=1e-6), s
            assert s["idle_ms"] == pytest.approx(s["dur_ms"] - (compute + exposed + overlap) / 1000, abs=1e-6), s
        # both libraries, longest first: which one is longer depends on how long gloo's threads wait (CI saw both)
        libs = r["comm_libraries"]
        assert sorted(lib["library"] for lib in libs) == ["c10d", "gloo"]
        assert [lib["ms"] for lib in libs] == sorted((lib["ms"] for lib in libs), reverse=True)
        assert all(lib["ms"] > 0 and lib["count"] > 0 for lib in libs)
        assert r["comm_pct"] > 0 and r["memory"]["devices"][0]["peak_allocated"] > 0
        assert r["memory"]["devices"][0]["device"] == "CPU"
    # one capture directory alone
    one = ctl(tmp_path, "report", str(caps[0]["dir"]), "--json")
    assert len(json.loads(one.stdout)["captures"][0]["ranks"]) == 1
    # the capture folder: each rank once (its trace sits beside its directory, and is read through it)
    folder = json.loads(ctl(tmp_path, "report", str(caps[0]["folder"]), "--json").stdout)
    assert [r["rank"] for g in folder["captures"] for r in g["ranks"]] == [0, 1]


def test_a_one_rank_capture_reads_as_one_rank_and_its_html_as_the_text(tmp_path: Path) -> None:
    """Issue 44, 6: a 1-rank report said "communication: none recognised (NCCL/RCCL, HCCL, ...)", as if names
    had been missed; the HTML showed call counts as `1.0` (the comparison's means per step) and each trace's path
    as `<rank dir>/../<file>`. Two 1-rank captures (static windows of two runs, no process group): the report
    says what is true for one rank, and the HTML of it and of their comparison shows whole calls as whole
    numbers and each trace's path as the file's."""
    common = ["--steps", "12", "--no-dist", "--profile", "--profile-step-start", "3", "--profile-step-end", "6",
              "--profile-min-free-mb", "0"]
    assert_ok(wait_all([*start_ranks([*common, "--profile-save-path", str(tmp_path / "a")]),
                        *start_ranks([*common, "--profile-save-path", str(tmp_path / "b")])], timeout=300))
    (now,), (base,) = captures(tmp_path / "a"), captures(tmp_path / "b")
    text = ctl(tmp_path, "report", str(now["folder"]))
    assert text.returncode == 0, text.stderr
    assert "  communication: none (one rank, world size 1: no collectives in its steps)" in text.stdout, text.stdout
    assert "none recognised" not in text.stdout
    page = tmp_path / "one.html"
    assert ctl(tmp_path, "report", str(now["folder"]), "--html", str(page)).returncode == 0
    html = page.read_text()
    assert "communication: none (one rank, world size 1" in html
    (listed,) = re.findall(r"<li>rank 0: <code>([^<]*)</code></li>", html)
    assert listed == str(now["folder"] / Path(now["trace_file"]).name) and "/../" not in listed, listed
    calls = re.findall(r'<td class=name title="[^"]*">[^<]*</td><td class=num>([^<]*)</td>', html)
    assert calls and all(c.isdigit() for c in calls), calls  # the operator tables' CALLS column
    page = tmp_path / "compare.html"
    res = ctl(tmp_path, "report", str(now["folder"]), "--baseline", str(base["folder"]), "--html", str(page))
    assert res.returncode == 0, res.stdout + res.stderr
    table = page.read_text().split("<th>Calls baseline</th>", 1)[1].split("</table>", 1)[0]
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in table.split("<tr>")[1:]]
    rows = [cells for cells in rows if len(cells) == 9]  # name, what, ms baseline, now, delta, calls, calls, us, us
    assert rows, table
    assert not [cells for cells in rows if re.fullmatch(r"\d+\.0", cells[5]) or re.fullmatch(r"\d+\.0", cells[6])], \
        rows


COLLECTIVE_PREFIXES = ("gloo:", "c10d::", "record_param_comms", "nccl:")


def cpu_split_by_hand(events: list[dict[str, Any]]) -> dict[int, tuple[float, float, float]]:
    """step -> (compute, exposed communication, overlap) microseconds, from the JSON alone, segment by segment:
    a collective (gloo:*, c10d::*, record_param_comms) open on ANY thread; the step's thread inside a cpu_op that
    starts in the step and is not inside one of its own collectives."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    out = {}
    for st in steps:
        lo, hi = float(st["ts"]), float(st["ts"]) + float(st["dur"])

        def spans(keep: Any) -> list[tuple[float, float]]:
            return [(max(lo, float(e["ts"])), min(hi, float(e["ts"]) + float(e["dur"]))) for e in events
                    if e.get("ph") == "X" and e is not st and keep(e)]
        same = (st.get("pid"), st.get("tid"))
        comm = spans(lambda e: str(e["name"]).startswith(COLLECTIVE_PREFIXES))
        own_comm = spans(lambda e: (e.get("pid"), e.get("tid")) == same and lo <= float(e["ts"]) < hi
                         and str(e["name"]).startswith(COLLECTIVE_PREFIXES))
        ops = spans(lambda e: e.get("cat") == "cpu_op" and (e.get("pid"), e.get("tid")) == same
                    and lo <= float(e["ts"]) < hi)
        cuts = sorted({lo, hi, *(x for a, b in comm + ops if b > a for x in (a, b))})
        compute = exposed = overlap = 0.0
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            inside = lambda ivs: any(x <= mid < y for x, y in ivs)  # noqa: E731
            works, talks = inside(ops) and not inside(own_comm), inside(comm)
            compute += (b - a) * (works and not talks)
            exposed += (b - a) * (talks and not works)
            overlap += (b - a) * (works and talks)
        out[int(st["name"].split("#")[1])] = (compute, exposed, overlap)
    return out


def test_reads_db_gzip_and_simplified_exports(tmp_path: Path) -> None:
    save = tmp_path / "profile"
    assert_ok(run_ranks(["--steps", "8", "--profile", "--profile-step-start", "2", "--profile-step-end", "5",
                         "--profile-export-type", "db", "--profile-gzip", "--profile-data-simplification",
                         "--profile-save-path", str(save), "--profile-min-free-mb", "0"]))
    (cap,) = captures(save)
    assert cap["trace_file"].endswith(".json.gz")
    from_trace = build_report([cap["dir"]])["captures"][0]["ranks"][0]
    assert [s["step"] for s in from_trace["steps"]] == [2, 3, 4] == trace_steps(cap)
    (cap["dir"] / cap["trace_file"]).unlink()  # only profile.db is left
    from_db = build_report([cap["dir"]])["captures"][0]["ranks"][0]
    assert "db" in from_db and [s["step"] for s in from_db["steps"]] == [2, 3, 4]
    assert from_db["step_ms_mean"] == pytest.approx(from_trace["step_ms_mean"], rel=1e-6)
    top = {o["name"]: o["self_us"] for o in from_trace["top_self"]}
    for o in from_db["top_self"][:5]:
        assert o["self_us"] == pytest.approx(top[o["name"]], rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Fixtures: what a CPU-only machine cannot record

def fixture_gpu_trace(path: Path, rank: int, slow: float = 0.0) -> None:
    """Two steps; per step two compute kernels and one NCCL kernel overlapping the second compute kernel."""
    events: list[dict[str, Any]] = []
    for k, step in enumerate((10, 11)):
        t = 1000.0 + k * (1000.0 + slow)
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                       "ts": t, "dur": 1000.0 + slow})
        for j, (name, a, d) in enumerate([("aten::mm", 10, 100), ("ncclDevKernel_AllReduce_Sum_f32", 300, 400)]):
            events.append({"ph": "X", "cat": "cpu_op", "name": name if j == 0 else "c10d::allreduce_", "pid": 1,
                           "tid": 1, "ts": t + a, "dur": 20, "args": {"External id": 10 * k + j}})
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": t + a + 2, "dur": 5, "args": {"correlation": 100 * k + j}})
        events += [
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32", "pid": 0, "tid": 7, "ts": t + 50, "dur": 200,
             "args": {"correlation": 100 * k, "stream": 7, "device": 0}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "pid": 0, "tid": 20,
             "ts": t + 400, "dur": 400, "args": {"correlation": 100 * k + 1, "stream": 20, "device": 0}},
            {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "pid": 0, "tid": 7, "ts": t + 600, "dur": 300,
             "args": {"correlation": 100 * k + 2, "stream": 7, "device": 0}},
        ]
    path.write_text(json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2},
                                "traceEvents": events}))


def test_fixture_gpu_kernels_split_compute_communication_and_overlap(tmp_path: Path) -> None:
    fixture_gpu_trace(tmp_path / "fixture_rank0.json", 0)
    fixture_gpu_trace(tmp_path / "fixture_rank1.json", 1, slow=200.0)
    data = build_report([tmp_path])
    (group,) = data["captures"]
    r0, r1 = group["ranks"]
    assert (r0["rank"], r1["rank"], r0["basis"]) == (0, 1, "device")
    # per step: compute 200 + 300 = 500 us, NCCL 400 us, overlapping the elementwise kernel for 200 us: compute
    # alone 300, exposed NCCL 200, overlap 200. Step 10's device window runs from its first kernel (t+50) to step
    # 11's (1000 us, idle 300); step 11's to its last kernel's end (850 us, idle 150)
    s10, s11 = r0["steps"]
    assert (s10["window_ms"], s10["compute_ms"], s10["comm_ms"], s10["overlap_ms"], s10["idle_ms"]) == pytest.approx(
        (1.0, 0.3, 0.2, 0.2, 0.3))
    assert (s11["window_ms"], s11["idle_ms"], s11["comm_total_ms"]) == pytest.approx((0.85, 0.15, 0.4))
    assert r0["comm_pct"] == pytest.approx(100 * 0.4 / 1.85)
    assert sum(r0[f"{k}_pct"] for k in ("compute", "comm", "overlap", "idle")) == pytest.approx(100)
    # the elementwise kernel's launch is not in the file: placed by time; the others by their launch
    assert r0["kernel_steps"] == {"by_launch": 4, "by_time": 2, "outside_steps": 0}
    kernels = {k["name"]: k for k in r0["top_kernels"]}
    assert kernels["ncclDevKernel_AllReduce_Sum_f32"]["comm"] is True
    assert kernels["sm90_xmma_gemm_f32"]["calls"] == 2 and kernels["sm90_xmma_gemm_f32"]["total_us"] == 400
    # rank 1's steps are 1.2 ms against 1.0: the slowest, 10% above the median of 1.1 ms
    assert group["slowest"]["rank"] == 1
    assert group["slowest"]["vs_median_pct"] == pytest.approx(100 * 0.1 / 1.1)


def fixture_ascend_output(root: Path, rank: int) -> Path:
    """torch_npu's layout and column names (ASCEND_PROFILER_OUTPUT of a *_ascend_pt directory)."""
    out = root / f"node0_{4000 + rank}_20261129120000000_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)

    def write(name: str, header: list[str], rows: list[list[Any]]) -> None:
        with open(out / name, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(header)
            w.writerows(rows)

    write("step_trace_time.csv", ["Device_id", "Step", "Computing", "Communication(Not Overlapped)", "Overlapped",
                                  "Communication", "Free", "Stage", "Bubble",
                                  "Communication(Not Overlapped and Exclude Receive)", "Preparing"],
          [[rank, 3, 8000, 1500, 500, 2000, 500, 0, 0, 1500, 0], [rank, 4, 8200, 1300, 700, 2000, 500, 0, 0, 1300, 0]])
    write("op_statistic.csv", ["Device_id", "OP Type", "Core Type", "Count", "Total Time(us)", "Min Time(us)",
                               "Avg Time(us)", "Max Time(us)", "Ratio(%)"],
          [[rank, "MatMulV2", "AI_CORE", 40, 6000, 100, 150, 200, 60], [rank, "hcom_allReduce_", "COMMUNICATION", 4,
                                                                         2000, 400, 500, 600, 20]])
    write("memory_record.csv", ["Component", "Timestamp(us)", "Total Allocated(MB)", "Total Reserved(MB)",
                                "Total Active(MB)", "Stream Ptr", "Device Type"],
          [["PTA", 100, 512, 1024, 512, "", "NPU:0"], ["PTA", 200, 1536, 2048, 1536, "", "NPU:0"],
           ["GE", 150, 9999, 9999, 9999, "", "NPU:0"]])
    (out.parent / f"profiler_info_{rank}.json").write_text("{}")
    return out.parent


@pytest.mark.quick
def test_fixture_ascend_profiler_output(tmp_path: Path) -> None:
    d = fixture_ascend_output(tmp_path, 3)
    (r,) = build_report([d])["captures"][0]["ranks"]
    assert r["rank"] == 3 and r["kind"] == "ascend"
    assert [s["step"] for s in r["steps"]] == [3, 4]
    # Computing 8000 (500 of it overlapped) + exposed 1500 + Free 500 = 10 ms
    s3 = r["steps"][0]
    assert s3["dur_ms"] == pytest.approx(10.0) and s3["comm_total_ms"] == pytest.approx(2.0)
    assert (s3["compute_ms"], s3["comm_ms"], s3["overlap_ms"], s3["idle_ms"]) == pytest.approx((7.5, 1.5, 0.5, 0.5))
    assert r["top_kernels"][0]["name"] == "MatMulV2" and r["top_kernels"][1]["comm"] is True
    pta, ge = r["memory"]["devices"]  # the GE row is another component, kept apart
    assert (pta["component"], pta["device"], pta["peak_allocated"]) == ("PTA", "NPU:0", 1536 * 2**20)
    assert (ge["component"], ge["peak_allocated"]) == ("GE", 9999 * 2**20)
    assert set(r["files_used"]) == {"step_trace_time.csv", "op_statistic.csv", "memory_record.csv"}
    # without op_statistic.csv the kernels come from kernel_details.csv, per operator type
    d2 = fixture_ascend_output(tmp_path / "other", 5)
    out = d2 / "ASCEND_PROFILER_OUTPUT"
    (out / "op_statistic.csv").unlink()
    with open(out / "kernel_details.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Step Id", "Model ID", "Task ID", "Stream ID", "Name", "Type", "Accelerator Core",
                    "Start Time(us)", "Duration(us)", "Wait Time(us)", "Block Dim"])
        w.writerows([[3, 0, 1, 2, "aclnnMatmul_MatMulV2", "MatMulV2", "AI_CORE", 10, 120, 0, 8],
                     [3, 0, 2, 2, "aclnnMatmul_MatMulV2", "MatMulV2", "AI_CORE", 200, 80, 0, 8],
                     [3, 0, 3, 3, "hcom_allReduce__1", "hcom_allReduce_", "COMMUNICATION", 300, 500, 0, 0]])
    (r2,) = build_report([d2])["captures"][0]["ranks"]
    kernels = {k["name"]: k for k in r2["top_kernels"]}
    assert kernels["MatMulV2"]["calls"] == 2 and kernels["MatMulV2"]["total_us"] == 200
    assert kernels["hcom_allReduce_"]["comm"] is True and "kernel_details.csv" in r2["files_used"]


# ----------------------------------------------------------------------------------------------------------

def test_bad_input_gets_a_message_and_the_rest_is_reported(tmp_path: Path) -> None:
    good = tmp_path / "mixed"
    good.mkdir()
    fixture_gpu_trace(good / "fixture_rank0.json", 0)
    # truncated: the events before the cut are used, with a warning
    text = (good / "fixture_rank0.json").read_text()
    (good / "fixture_rank1.json").write_text(text.replace('"rank": 0', '"rank": 1')[: len(text) * 2 // 3])
    (good / "garbage.json").write_text("{not json at all")
    failed = good / "vm_1_20261129000000000_pt"
    failed.mkdir()
    (failed / "metadata.json").write_text(json.dumps({"rank": 2, "status": "failed", "capture_id": None,
                                                      "error": "RuntimeError: profiler exploded"}))
    data = build_report([good])
    by_rank = {r["rank"]: r for g in data["captures"] for r in g["ranks"]}
    assert by_rank[0]["steps"] and not by_rank[0]["warnings"]
    assert "truncated or corrupt" in by_rank[1]["warnings"][0] and len(by_rank[1]["steps"]) >= 1
    failures = {Path(f["path"]).name: f["error"] for g in data["captures"] for f in g["failed"]}
    assert failures["vm_1_20261129000000000_pt"] == "RuntimeError: profiler exploded"
    (garbage,) = [e for e in data["sources"] if e["path"].endswith("garbage.json")]  # searched: not a trace
    assert garbage["status"] == "skipped" and 'without a "traceEvents" array' in garbage["reason"]
    (r,) = build_report([good / "garbage.json"])["captures"][0]["failed"]  # named: read, and why it fails
    assert "no \"traceEvents\" array" in r["error"]

    empty = tmp_path / "empty"
    empty.mkdir()
    res = ctl(tmp_path, "report", str(empty), str(tmp_path / "nope"))
    assert res.returncode == 1
    assert f"cannot report on {empty}: no captures here" in res.stdout
    assert f"cannot report on {tmp_path / 'nope'}: does not exist" in res.stdout
    gz = tmp_path / "cut.json.gz"
    gz.write_bytes(gzip.compress(text.encode())[:200])
    (r,) = build_report([gz])["captures"][0]["failed"]
    assert "cut.json.gz" in r["error"]


def test_html_report_renders_in_a_headless_browser(tmp_path: Path) -> None:
    """Three captures in one page: a real 1-rank run with memory, four fixture GPU ranks of which one is 30 % slower
    (it stands out: marked), MindStudio Insight's two torch_npu ranks (0.5 % apart: not marked; a memory_record.csv
    whose timestamps were rounded to one value). Rendered by Chromium, looked at in screenshots."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs it)")
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    for rank, slow in enumerate((0.0, 10.0, 5.0, 300.0)):
        fixture_gpu_trace(gpu / f"fixture_rank{rank}.json", rank, slow=slow)
    shutil.copytree(Path(__file__).resolve().parent / "fixtures" / "real" / "msinsight_server", tmp_path / "npu")
    save = tmp_path / "profile"
    assert_ok(run_ranks(["--steps", "8", "--profile", "--profile-step-start", "2", "--profile-step-end", "5",
                         "--profile-with-memory", "--profile-save-path", str(save), "--profile-min-free-mb", "0"]))
    page = tmp_path / "report.html"
    res = ctl(tmp_path, "report", str(save), str(gpu), str(tmp_path / "npu"), "--html", str(page), "--summary")
    assert res.returncode == 0 and f"HTML report: {page}" in res.stdout
    data = json.loads(ctl(tmp_path, "report", str(save), str(gpu), str(tmp_path / "npu"), "--json").stdout)
    text = page.read_text()
    assert "<script src" not in text and "<link" not in text and "http://" not in text  # self-contained

    def render(*flags: str, url: str = page.as_uri()) -> subprocess.CompletedProcess:
        return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                               "--v=0", "--virtual-time-budget=3000", *flags, url], capture_output=True, text=True,
                              timeout=120)
    run = render("--dump-dom")
    dom = run.stdout
    assert "</html>" in dom, run.stderr[-2000:]
    assert [line for line in run.stderr.splitlines() if "CONSOLE" in line] == []
    for marker in ('id="split-chart"', 'id="op-chart-', 'id="kernel-chart-', 'id="mem-chart-', 'id="timeline-',
                   "Open the traces", "samples share one timestamp", "communication counted: NCCL/RCCL"):
        assert marker in dom, marker
    assert dom.count("(slowest)") == 1 and "3 (slowest)" in dom and "not marked: fewer than 3 ranks" in dom
    # a rank selector per multi-rank view (GPU operators; torch_npu operators and memory), one rank shown in each
    assert dom.count('class="rank-select"') == 3 and dom.count('<div class="rank-view active"') == 3
    # every stacked-bar tooltip is a measured mean of the per-step rows
    captions = re.findall(r"<title>rank (\d+) ([a-z ()]+): ([\d.]+) ms per step \(mean of (\d+) steps\)", dom)
    assert len(captions) == 4 * (1 + 4 + 2)
    by_rank = {(g_i, r["rank"]): r for g_i, g in enumerate(data["captures"]) for r in g["ranks"]}
    keys = {"compute": "compute_ms", "communication (exposed)": "comm_ms", "overlap": "overlap_ms", "idle": "idle_ms"}
    for rank, label, ms, n in captions:
        candidates = [r for (_, rk), r in by_rank.items() if rk == int(rank)]
        means = [sum(s[keys[label]] for s in r["steps"]) / len(r["steps"]) for r in candidates]
        assert any(abs(float(ms) - m) < 0.006 and int(n) == len(r["steps"]) for m, r in zip(means, candidates))
    # a link opens a view and a rank: torch_npu's memory, rank 1 (the rounded timestamps' note)
    (npu,) = [k for k, g in enumerate(data["captures"]) if "torch_npu" in g["grouped_by"]]
    linked = render("--dump-dom", url=f"{page.as_uri()}#view=c{npu}-mem&rank=1").stdout
    assert f'<div class="view active" id="c{npu}-mem">' in linked
    view = linked[linked.index(f'id="c{npu}-mem"'):]
    assert '<div class="rank-view" data-rank="0">' in view and '<div class="rank-view active" data-rank="1">' in view
    shot = tmp_path / "shot.png"  # kept in the test's tmp_path for a person to look at
    render("--window-size=1200,1600", f"--screenshot={shot}")
    assert shot.stat().st_size > 20_000  # a page with charts, not a blank one
