"""Static windows end to end: real training processes (single and 2-rank gloo), real traces on disk."""

from __future__ import annotations

import csv
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_ok, base_env, captures, load_trace, run_ranks, trace_steps

COMMON = ["--no-profile-ondemand", "--profile-min-free-mb", "0"]


def static(save_path: Path, start: int, end: int, *extra: str) -> list[str]:
    return ["--profile", "--profile-step-start", str(start), "--profile-step-end", str(end),
            "--profile-save-path", str(save_path), *COMMON, *extra]


def test_window_records_exactly_its_steps(save_path: Path) -> None:
    assert_ok(run_ranks(["--steps", "10", *static(save_path, 3, 6)]))
    (cap,) = captures(save_path)
    assert trace_steps(cap) == [3, 4, 5]
    assert cap["status"] == "ok"
    assert cap["window"]["recorded_steps"] == [3, 4, 5]
    assert cap["trigger"]["source"] == "static"
    assert cap["rank"] == 0 and cap["world_size"] == 1 and cap["pid"] > 0 and cap["host"]
    assert cap["backend"]["name"] == "torch" and cap["backend"]["torch"]
    assert cap["options"]["level"] == "level0"
    name = cap["dir"].name
    assert name.startswith(f"{cap['host']}_{cap['pid']}_") and name.endswith("_pt")
    assert len(name.split("_")[-2]) == 17  # YYYYmmddHHMMSSmmm
    # HTA and TensorBoard need the rank even without torch.distributed
    assert load_trace(cap)["distributedInfo"]["rank"] == 0
    with open(cap["dir"] / "step_summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [3, 4, 5]
    assert all(float(r["duration_ms"]) > 0 for r in rows)
    with open(cap["dir"] / "operator_summary.csv") as fh:
        ops = {r["name"]: r for r in csv.DictReader(fh)}
    assert "aten::addmm" in ops and int(ops["aten::addmm"]["calls"]) >= 3


def test_window_from_step_zero_and_until_close(save_path: Path) -> None:
    assert_ok(run_ranks(["--steps", "4", *static(save_path, 0, -1)]))
    (cap,) = captures(save_path)
    # the step after the last one never ran: no ProfilerStep#4
    assert trace_steps(cap) == [0, 1, 2, 3]
    assert cap["window"]["end"] is None


def test_resumed_loop_counts_its_own_steps(save_path: Path) -> None:
    # a run resumed at iteration 100 that passes its counter: the window is in the loop's numbers
    assert_ok(run_ranks(["--steps", "8", "--first-step", "100", "--pass-step", *static(save_path, 103, 105)]))
    (cap,) = captures(save_path)
    assert trace_steps(cap) == [103, 104]


def test_two_ranks_only_selected_rank_writes(save_path: Path) -> None:
    assert_ok(run_ranks(["--steps", "8", *static(save_path, 2, 4), "--profile-ranks", "1"], world=2))
    caps = captures(save_path)
    assert [c["rank"] for c in caps] == [1]
    assert caps[0]["world_size"] == 2
    trace = load_trace(caps[0])
    assert trace["distributedInfo"]["rank"] == 1 and trace["distributedInfo"]["backend"] == "gloo"
    assert trace_steps(caps[0]) == [2, 3]
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "allreduce_grads" in names and any("all_reduce" in str(n) for n in names)


def test_minus_one_anywhere_means_all_ranks(save_path: Path) -> None:
    # MindSpeed compares the list to [-1] exactly, so "-1 0" profiles rank 0 only there
    assert_ok(run_ranks(["--steps", "6", *static(save_path, 1, 3), "--profile-ranks", "-1", "0"], world=2))
    caps = captures(save_path)
    assert sorted(c["rank"] for c in caps) == [0, 1]
    assert all(trace_steps(c) == [1, 2] for c in caps)


def test_rank_from_environment_without_distributed(save_path: Path) -> None:
    assert_ok(run_ranks(["--steps", "5", *static(save_path, 1, 2), "--profile-ranks", "3", "--no-dist"],
                        env={"RANK": "3", "WORLD_SIZE": "4"}))
    (cap,) = captures(save_path)
    assert cap["rank"] == 3 and cap["world_size"] == 4
    assert load_trace(cap)["distributedInfo"] == {"backend": "none", "rank": 3, "world_size": 4}


def test_yaml_training_section(tmp_path: Path, save_path: Path) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"""
model: {{hidden: 256}}
training:
  lr: 0.01
  profile: true
  profile_step_start: 2
  profile_step_end: 4
  profile_level: level1
  profile_with_stack: true
  profile_save_path: {save_path}
  profile_ondemand: false
  profile_min_free_mb: 0
""")
    assert_ok(run_ranks(["--steps", "6", "--config", str(cfg)]))
    (cap,) = captures(save_path)
    assert trace_steps(cap) == [2, 3]
    assert cap["options"]["level"] == "level1" and cap["options"]["with_stack"] is True
    kwargs = cap["backend"]["torch_profile_kwargs"]
    assert kwargs["with_flops"] is True and kwargs["record_shapes"] is True and kwargs["with_stack"] is True
    cats = {e.get("cat") for e in load_trace(cap)["traceEvents"]}
    assert "python_function" in cats  # the stack was recorded


def test_db_export_tables(save_path: Path) -> None:
    assert_ok(run_ranks(["--steps", "7", *static(save_path, 2, 5), "--profile-export-type", "db",
                         "--profile-with-memory"]))
    (cap,) = captures(save_path)
    assert (cap["dir"] / "profile.db").is_file()
    assert not (cap["dir"] / "operator_summary.csv").exists()
    con = sqlite3.connect(cap["dir"] / "profile.db")
    tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
    assert {"meta", "steps", "events", "operators", "memory_events"} <= tables
    assert [r[0] for r in con.execute("select step from steps order by step")] == [2, 3, 4]
    top = con.execute("select name, calls, self_us from operators where category='cpu_op' order by self_us desc")
    assert top.fetchone()[1] >= 1
    assert con.execute("select count(*) from memory_events").fetchone()[0] > 0
    assert con.execute("select count(*) from events where step=3").fetchone()[0] > 0
    con.close()


def test_data_simplification_shrinks_the_trace(tmp_path: Path) -> None:
    plain, simple = tmp_path / "plain", tmp_path / "simple"
    args = ["--steps", "6", "--profile-record-shapes", "--profile-with-stack"]
    assert_ok(run_ranks([*args, *static(plain, 2, 5)]))
    assert_ok(run_ranks([*args, *static(simple, 2, 5), "--profile-data-simplification"]))
    (p,), (s,) = captures(plain), captures(simple)
    p_size = (p["dir"] / p["trace_file"]).stat().st_size
    s_size = (s["dir"] / s["trace_file"]).stat().st_size
    assert s_size < 0.9 * p_size, (s_size, p_size)
    assert trace_steps(s) == trace_steps(p) == [2, 3, 4]
    events = load_trace(s)["traceEvents"]
    assert not any("Record function id" in e.get("args", {}) for e in events)
    assert not any(e.get("ph") in ("s", "f") for e in events)
    assert s["postprocess"]["dropped"]["args"] > 0


def test_gzip_and_level_none(save_path: Path) -> None:
    assert_ok(run_ranks(["--steps", "5", *static(save_path, 1, 3), "--profile-gzip", "--profile-level",
                         "level_none"]))
    (cap,) = captures(save_path)
    assert cap["trace_file"].endswith(".pt.trace.json.gz")
    events = load_trace(cap)["traceEvents"]
    assert trace_steps(cap) == [1, 2]
    cats = {e.get("cat") for e in events if e.get("ph") == "X"}
    assert cats == {"user_annotation"}  # host annotations only: steps, forward, backward


def test_crash_mid_window_leaves_no_final_directory(save_path: Path) -> None:
    results = run_ranks(["--steps", "20", *static(save_path, 2, 15), "--kill-at-step", "6"])
    assert results[0][0] != 0
    assert captures(save_path) == []
    # a fresh run on the same host removes the dead process's staging and publishes its own
    assert_ok(run_ranks(["--steps", "4", *static(save_path, 1, 2)]))
    assert len(captures(save_path)) == 1
    assert [p for p in save_path.iterdir() if p.name.startswith(".")] == []


def test_full_disk_skips_window_and_training_continues(save_path: Path) -> None:
    results = run_ranks(["--steps", "5", *static(save_path, 1, 3)[:-2], "--profile-min-free-mb", str(10**9)])
    assert_ok(results)
    assert captures(save_path) == []
    assert "skipping window [1, 3) on rank 0: only" in results[0][2]
    assert "--profile-min-free-mb" in results[0][2]


def test_the_loops_own_step_numbers_by_keyword_in_every_state(tmp_path: Path) -> None:
    """prof.step(step=n) and prof.step(n) both work idle, while a window is pending and while it records (the
    idle form is another function than the method: a keyword it refused would fail only hours in)."""
    import torch

    from ondemand_prof import OnDemandProfiler, ProfileConfig

    save = tmp_path / "profile"
    prof = OnDemandProfiler(ProfileConfig(enabled=True, step_start=15, step_end=17, ondemand=False,
                                          save_path=str(save), min_free_mb=0), first_step=10)
    x = torch.ones(8, 8)
    for n in range(10, 20):  # idle (10-13), pending and warmup (14), recording (15-16), idle again
        x = x @ x / 8
        assert prof.current_step == n
        prof.step(step=n) if n % 2 else prof.step(n)
    prof.close()
    (cap,) = captures(save)
    assert trace_steps(cap) == [15, 16] and cap["status"] == "ok"


WINDOW_THEN_REPORT = """
import sys, torch
from ondemand_prof import OnDemandProfiler, ProfileConfig
if sys.argv[2] == "compiled":  # a program that uses inductor, with CUDA graphs on
    import torch._inductor.config
    torch._inductor.config.triton.cudagraphs = True
prof = OnDemandProfiler(ProfileConfig(enabled=True, step_start=2, step_end=4, ondemand=False, save_path=sys.argv[1],
                                      min_free_mb=0))
seen = []
real = torch.profiler.profile.prepare_trace
torch.profiler.profile.prepare_trace = lambda self: (real(self), seen.append(self.has_cudagraphs))[0]
x = torch.ones(8, 8, requires_grad=True)
for _ in range(6):
    (x @ x).sum().backward()
    prof.step()
prof.close()
print("inductor" if "torch._inductor" in sys.modules else "no inductor", seen)
"""


@pytest.mark.parametrize("program", ["eager", "compiled"])
def test_a_window_does_not_import_inductor_into_an_eager_program(tmp_path: Path, program: str) -> None:
    """torch.profiler's prepare_trace imports torch._inductor and torch._dynamo just to read one setting (2-3 s of
    CPU on the training thread at the first window, +70 MB): an eager program's first window no longer pays it,
    and a program that uses inductor still has the setting read."""
    res = subprocess.run([sys.executable, "-c", WINDOW_THEN_REPORT, str(tmp_path / "profile"), program],
                         env=base_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[0] == ("no inductor [False]" if program == "eager" else "inductor [True]"), res.stdout
    (cap,) = captures(tmp_path / "profile")
    assert trace_steps(cap) == [2, 3]
