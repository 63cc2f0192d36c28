"""The GPU check (scripts/gpu_check.sh, bench/gpu_check.py; issue 33), so that it cannot rot before a GPU runs it:
its CPU run end to end (the quick wiring: a real daemon, a real training rank, the real CLI, the native save, the
window-cost benchmark), and the parts only a GPU reaches, on synthetic CUDA inputs fed to the same functions and
to torch's own readers (_memory_viz, the flight-recorder analyzer)."""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import ROOT, base_env
from test_triage import synthetic_cuda_snapshot, synthetic_fr_dump


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gc = _load()


def table_rows(text: str) -> dict[str, tuple[str, str]]:
    """table.md's rows: check -> (result, figure)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in ("PASS", "FAIL", "SKIP"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def test_the_cpu_run_passes_every_row_and_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick", "--out",
                          str(out)], env=base_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    text = (out / "table.md").read_text()
    rows = table_rows(text)
    assert len(rows) == 13 and all(r == "PASS" for r, _ in rows.values()), text
    fig = {check.split(":")[0] if not check.startswith("level") else check: f for check, (_, f) in rows.items()}
    assert "--device cpu --quick: torch" in text.splitlines()[0]
    assert "byte-identical to export_chrome_trace: True" in fig["native save"]
    assert "5 of 5 written by it" in fig["native save"]  # every capture of the rank took the native save
    assert "0 outside the ProfilerStep# ranges" in fig["capture --steps 2"]
    assert "cpu_op 0," in fig["level mapping: level_none"] and "stacks 0" in fig["level mapping: level0"]
    assert re.search(r"memory [1-9]", fig["level mapping: level2"]) and "with_flops 1" in fig["level mapping: level1"]
    assert "not available on this backend (CPU)" in fig["memory --steps 2"]
    assert "gloo:all_reduce" in fig["flight-recorder (gloo)"]
    assert "basis cpu" in fig["report on the capture"] and "no kernels" in fig["report on the capture"]
    assert "ours" in fig["window cost"] and " MB vs torch " in fig["window cost"]
    data = json.loads((out / "results.json").read_text())
    assert data["device"] == "cpu" and [r["result"] for r in data["rows"]] == ["PASS"] * 13
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/daemon.log", "logs/rank.log", "logs/kernels.log", "logs/bench.log"} <= names, names
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "results.json", "table.md"]


# ----------------------------------------------------------------------------------------------------------
# What only a GPU reaches, on synthetic CUDA inputs


def _cuda_trace(kernel_past_end_us: float = 0.0) -> dict[str, Any]:
    """SYNTHETIC: two ProfilerStep# ranges on the host thread, kernels and a copy on a device stream."""
    steps: list[dict[str, Any]] = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{7 + i}", "pid": 1,
                                    "tid": 1, "ts": 1000.0 + i * 1000, "dur": 900.0} for i in range(2)]
    # kineto repeats each step on the device's timeline (not a step of its own)
    steps += [dict(s, cat="gpu_user_annotation", pid=0, tid=7, ts=s["ts"] + 40) for s in steps]
    device = [{"ph": "X", "cat": "kernel", "name": "ampere_sgemm", "pid": 0, "tid": 7, "ts": 1050.0, "dur": 300.0},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "pid": 0, "tid": 7, "ts": 1800.0, "dur": 20.0},
              {"ph": "X", "cat": "kernel", "name": "flash_fwd", "pid": 0, "tid": 7, "ts": 2100.0,
               "dur": 800.0 + kernel_past_end_us}]  # ends where its step ends
    ops = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1010.0, "dur": 30.0,
            "args": {"Input Dims": [[2, 2], [2, 2]]}},
           {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 99, "ts": 5000.0, "dur": 30.0}]
    return {"traceEvents": [*steps, *device, *ops], "record_shapes": 1}


@pytest.mark.quick
def test_device_kernels_past_a_step_are_counted_outside() -> None:
    inside = gc.events_in_steps(_cuda_trace(), cuda=True)
    assert (inside["steps"], inside["events"], inside["kernels"], inside["outside"]) == ([7, 8], 3, 2, 0)
    late = gc.events_in_steps(_cuda_trace(kernel_past_end_us=100.0), cuda=True)
    assert late["outside"] == 1 and late["worst_outside_us"] == pytest.approx(100.0)
    assert "flash_fwd" in late["first_outside"][0]
    # within the tolerance at an edge: inside; on the CPU, only the ops of the steps' own thread count
    assert gc.events_in_steps(_cuda_trace(kernel_past_end_us=gc.TOLERANCE_US / 2), cuda=True)["outside"] == 0
    assert gc.events_in_steps(_cuda_trace(), cuda=False)["events"] == 1


@pytest.mark.quick
def test_a_level_that_breaks_its_promise_on_cuda_is_named() -> None:
    facts = gc.trace_facts(_cuda_trace())
    assert (facts["device"], facts["cpu_op"], facts["shapes"], facts["flops"], facts["steps"]) == (3, 2, 1, 0, 2)
    # level1 on CUDA: shapes, kernels, both activities, but no with_flops mark
    assert gc.level_findings("level1", facts, ["CPU", "CUDA"], cuda=True) == ["no flops (the trace's with_flops mark)"]
    # level0 promises no shapes; and a level0 trace with no kernels on a CUDA device is wrong
    no_kernels = dict(facts, device=0, shapes=0)
    assert gc.level_findings("level0", no_kernels, ["CPU", "CUDA"], cuda=True) == ["no device kernels"]
    assert gc.level_findings("level0", dict(facts, shapes=0), ["CPU"], cuda=True) == [
        "activities ['CPU'], not ['CPU', 'CUDA']"]
    # level_none records no CUDA activity at all, on any device
    none = dict.fromkeys(facts, 0) | {"annotations": 2, "steps": 2}
    assert gc.level_findings("level_none", none, ["CPU"], cuda=True) == []
    assert gc.level_findings("level_none", dict(none, device=3), ["CPU"], cuda=True) == [
        "3 device events (none promised)"]


def _run(tmp_path: Path) -> Any:
    (tmp_path / "logs").mkdir()
    run = gc.Run(device="cuda", quick=True, work=tmp_path, out=tmp_path / "out", budget_s=120)
    run.check_deadline = time.monotonic() + 120
    run.current_log = tmp_path / "logs" / "t.log"
    return run


def test_torchs_memory_viz_reads_a_cuda_snapshot_and_refuses_other_files(tmp_path: Path) -> None:
    run = _run(tmp_path)
    snap = tmp_path / "vm_1_rank0.memory.pickle"
    snap.write_bytes(pickle.dumps(synthetic_cuda_snapshot()))
    said = gc.memory_viz_reads(run, snap)
    assert "_memory_viz stats" in said and "kB of HTML" in said
    bad = tmp_path / "not_a_snapshot.pickle"
    bad.write_bytes(b"not a pickle")
    with pytest.raises(gc.Failed, match="_memory_viz stats: exit 1"):
        gc.memory_viz_reads(run, bad)


def test_torchs_analyzer_reads_a_one_rank_nccl_dump_as_written(tmp_path: Path) -> None:
    dump = synthetic_fr_dump(0, 5, "completed")
    dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}}  # one rank, as the check's group

    def analyzer(name: str) -> dict[str, Any]:
        written = tmp_path / name / "flight-recorder-x"
        written.mkdir(parents=True)
        (written / name).write_bytes(pickle.dumps(dump))
        res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--fr-child", str(written),
                              str(written.parent)], env=base_env(), capture_output=True, text=True, timeout=120)
        return json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])

    result = analyzer("fr_trace_rank_0")  # as the rank names it (rank/layout.py)
    assert result["loader"] == {"ok": True, "value": {"version": "2.10", "entries": 5, "ranks": [0]}}
    assert result["full"]["ok"] and result["full"]["value"] > 0, result
    old = analyzer("host_12_rank0.fr_trace.pickle")  # how dumps were named before: the loader wants the rank last
    assert not old["loader"]["ok"] and not old["full"]["ok"], old


@pytest.mark.quick
def test_a_cuda_table_fills_the_readme_section_and_a_cpu_table_does_not(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())  # the real README's markers
    cpu, cuda = tmp_path / "cpu.md", tmp_path / "cuda.md"
    cpu.write_text("GPU check, 2026-12-03, --device cpu: torch 2.13.0+cpu\n\n| check | result | figure | s |\n")
    cuda.write_text("GPU check, 2026-12-03, --device cuda: torch 2.11.0+cu130, NVIDIA H200\n\n"
                    "| check | result | figure | s |\n|---|---|---|---|\n| torch and device | PASS | H200 | 3 |\n")
    assert gc.fill_readme(cpu, readme) == 2 and readme.read_text() == (ROOT / "README.md").read_text()
    assert gc.fill_readme(cuda, readme) == 0
    text = readme.read_text()
    section = text[text.index("## Measured on a GPU"):text.index("**How a lent machine runs it.**")]
    assert "| torch and device | PASS | H200 | 3 |" in section and "Not yet" not in section
    assert section.count(gc.README_BEGIN) == 1 and section.count(gc.README_END) == 1
    assert gc.fill_readme(cuda, readme) == 0 and readme.read_text() == text  # again: the same, not twice


# bench_window_cost.py's progress lines, as it prints them (a process a run; --same-process)
BENCH_PER_PROCESS = """native save: already built: /root/.cache/ondemand_prof/native/odp_save-94b789def4f53cf2986e.so
run 1 threads 1 torch (load 9.8, others 1.80 cores): stall 189.8 ms, +10 800.8 ms (collect 142, cpu 27, runqueue 774, \
asleep -8; save 47 in the step, post 0), own 38.2 ms, +10 800.8 ms, published after 0 ms, rss +6 MB, capture None
run 1 threads 1 ours (load 9.6, others 1.81 cores): stall 68.4 ms, +10 -432.5 ms (collect 59, cpu -16, runqueue 471, \
asleep -9; save 388 native, post 2132), own -3.9 ms, +10 432.5 ms, published after 2537 ms, rss +7 MB, capture \
{'status': 'ok', 'steps': [35, 36, 37, 38, 39]}
"""
BENCH_SAME_PROCESS = """round 1 threads 1 torch (load 14.9): stall 260.8 ms, +10 212.8 ms, own 2.8 ms (collect 157, \
cpu 3, runqueue 378, asleep -22; save 104 in the step, post 0)
round 1 threads 1 ours (load 15.9): stall 138.9 ms, +10 346.8 ms, own 47.5 ms (collect 130, cpu 16, runqueue 301, \
asleep 5; save 295 native, post 2473)
"""


@pytest.mark.quick
def test_the_benchmarks_runs_are_read_in_either_form_and_a_lost_window_fails() -> None:
    assert gc.parse_bench(BENCH_PER_PROCESS) == {"torch": [(189.8, 800.8)], "ours": [(68.4, -432.5)]}
    assert gc.parse_bench(BENCH_SAME_PROCESS) == {"torch": [(260.8, 212.8)], "ours": [(138.9, 346.8)]}
    with pytest.raises(gc.Failed, match="capture {'status': 'failed'"):
        gc.parse_bench(BENCH_PER_PROCESS.replace("'status': 'ok'", "'status': 'failed'"))
    with pytest.raises(gc.Failed, match="written None"):
        gc.parse_bench(BENCH_SAME_PROCESS.replace("save 295 native", "save 0 None"))
    with pytest.raises(gc.Failed, match="no per-run lines"):
        gc.parse_bench("native save: built\n")
