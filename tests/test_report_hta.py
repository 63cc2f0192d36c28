"""Our published traces in HTA (HolisticTraceAnalysis, the `test` extra): two real gloo ranks through our own
export, their capture folder read by HTA's TraceAnalysis, which finds each file's rank with a regex on the raw
text."""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pytest

from conftest import assert_ok, captures, run_ranks


def test_hta_sees_each_rank_of_our_traces(tmp_path: Path) -> None:
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is in the test extra")
    save = tmp_path / "profile"
    assert_ok(run_ranks(["--steps", "8", "--profile", "--profile-step-start", "3", "--profile-step-end", "5",
                         "--profile-ranks", "-1", "--profile-save-path", str(save), "--profile-min-free-mb", "0"],
                        world=2))
    caps = captures(save)
    (folder,) = {cap["folder"] for cap in caps}  # one capture folder: the ranks' traces side by side
    for cap in caps:
        trace = (cap["dir"] / cap["trace_file"]).resolve()
        text = (gzip.decompress(trace.read_bytes()) if trace.name.endswith(".gz") else trace.read_bytes()).decode()
        assert re.search(r'"rank":\s+(\d+)', text).group(1) == str(cap["rank"])  # HTA's own regex
        data = json.loads(text)
        assert data["distributedInfo"]["backend"] == "gloo"  # the job's collectives are gloo:*
        assert (folder / data["traceName"]).resolve() == trace  # not the deleted staging file
    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = hta.TraceAnalysis(trace_dir=str(folder))
    assert sorted(analysis.t.traces) == [0, 1]
