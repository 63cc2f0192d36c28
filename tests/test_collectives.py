"""Issue 32, item 2: the report's communication by collective kind, on a live FSDP2 job (gloo) and on the real
NCCL traces the tests hold: each transfer named by the collective that issued it, with calls and time per step,
and libraries that nest never printed as if they added up."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, assert_ok, ctl, run_ranks

REAL = Path(__file__).parent / "fixtures" / "real"


def _report(*paths: str, cwd: Path | None = None) -> dict:
    res = ctl(Path("/nonexistent"), "report", *paths, "--json", cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_fsdp2_on_gloo_is_all_gather_and_reduce_scatter(tmp_path: Path) -> None:
    """FSDP2 with activation checkpointing, 2 ranks on gloo, a static window of steps 3-4 on every rank: per step,
    each of the 3 blocks all-gathered in the forward and again in the backward (resharded after the forward), and
    reduce-scattered once in the backward. gloo runs the reduce_scatter as an all_reduce: the report says
    reduce_scatter, issued by c10d::_reduce_scatter_base_."""
    results = run_ranks(["--steps", "6", "--profile", "--profile-step-start", "3", "--profile-step-end", "5",
                         "--profile-ranks", "-1", "--profile-save-path", str(tmp_path / "profile")], world=2,
                        module="examples.fsdp2_torchrun", cwd=ROOT, timeout=300)
    assert_ok(results)
    data = _report(str(tmp_path / "profile"))
    (capture,) = data["captures"]
    assert [r["rank"] for r in capture["ranks"]] == [0, 1]
    for rank in capture["ranks"]:
        kinds = {k["kind"]: k for k in rank["collectives"]}
        assert set(kinds) == {"all_gather", "reduce_scatter"}, kinds
        rs = kinds["reduce_scatter"]
        assert rs["via"] == ["gloo"] and rs["issued_by"] == {"c10d::_reduce_scatter_base_": rs["count"]}
        assert rs["count_per_step"] == 3  # one per block (the root holds no parameters of its own)
        assert kinds["all_gather"]["issued_by"] == {"c10d::_allgather_base_": kinds["all_gather"]["count"]}
        assert kinds["all_gather"]["count_per_step"] == 6 and rs["ms_per_step"] > 0
    text = ctl(Path("/nonexistent"), "report", str(tmp_path / "profile")).stdout
    assert "reduce_scatter" in text and "via gloo, issued by c10d::_reduce_scatter_base_" in text, text
    assert "(libraries nest, c10d's operators around the transfers: not additive)" in text


def test_real_nccl_traces_name_their_collectives() -> None:
    """HTA's sampled ranks of a 128-GPU job: all_to_all, all_reduce and all_gather kernels, each named by the
    c10d operator around its launch; its trace_diff pair: SendRecv kernels with no operator around them stay
    send/recv."""
    data = _report(str(REAL / "hta_sampled_rank-0.json.gz"))
    (rank,) = data["captures"][0]["ranks"]
    kinds = {k["kind"]: k for k in rank["collectives"]}
    assert set(kinds) == {"all_to_all", "all_reduce", "all_gather"}
    assert kinds["all_to_all"]["issued_by"] == {"c10d::alltoall_base_": 4} and kinds["all_to_all"]["via"] == \
        ["NCCL/RCCL"]
    assert kinds["all_reduce"]["count_per_step"] == 2 and kinds["all_gather"]["count_per_step"] == 1
    diff = _report(str(REAL / "hta_trace_diff_control.json.gz"))
    kinds = {k["kind"]: k for k in diff["captures"][0]["ranks"][0]["collectives"]}
    assert kinds["send/recv"]["count_per_step"] == 7 and kinds["send/recv"]["issued_by"] == {}
    assert kinds["all_reduce"]["issued_by"] == {"c10d::allreduce_": 18}
