"""ondemand-profd --metrics: Prometheus's own text-format parser reads the endpoint of a real daemon serving a real
2-rank gloo job with one rank stalled, and what it reads agrees with `ondemandctl status`; the Grafana dashboard
in deploy/ asks only for metrics the endpoint has; without prometheus_client the daemon starts as before, and
with --metrics says in one line what is missing; 4096 SYNTHETIC ranks (registered in-process, no sockets) scraped
in a tight loop cost the daemon's loop at most one snapshot a second."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from conftest import ROOT, base_env, ctl, ctl_json, daemon, inprocess_daemon, register_msg, short_dir, \
    wait_for  # noqa: E402
from test_triage import ranks, stalled  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[Samples, set[str]]:
    """Every sample of the endpoint, as Prometheus's own parser reads it, and the metric names it exposes."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))  # the name queries use
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
            names.add(s.name)
    return samples, names


def rows(samples: Samples, name: str, **match: str) -> dict[str, float]:
    """rank -> value of a per-rank metric (labels matching `match`)."""
    out = {}
    for (n, labels), value in samples.items():
        lab = dict(labels)
        if n == name and all(lab.get(k) == v for k, v in match.items()):
            out[lab["rank"]] = value
    return out


def metrics_url(run_dir: Path) -> str:
    address = wait_for(lambda: (run_dir / "profd.metrics").exists() and (run_dir / "profd.metrics").read_text(),
                       30, "the metrics address")
    return f"http://{address.strip()}/metrics"


def test_a_stalled_rank_and_a_refused_capture_read_by_prometheus_parser(env: dict[str, Any]) -> None:
    daemon(env, "--metrics", "127.0.0.1:0")
    url = metrics_url(env["run"])
    status = env["save"].parent / "steps.jsonl"
    # STALLED from 10 s on: the 20 s after it hold the scrape, status and the refused capture, even on a loaded
    # machine (a 16 s stall left 6 s for three CLI and HTTP round trips)
    ranks(env, 2, "--steps", "100000", "--step-sleep", "0.01", "--stall-rank", "1", "--stall-at-step", "30",
          "--stall-s", "30", "--status-file", str(status), job="met")
    stalled(env, status, 2)
    host = socket.gethostname()

    # the stall crosses the 10 s floor: the endpoint says STALLED where status does (the stalled rank, and the
    # rank waiting for it in the all_reduce), at the step status shows
    samples = wait_for(lambda: (lambda s: rows(s, "ondemand_prof_rank_stalled", job="met") == {"0": 1.0, "1": 1.0}
                                and s)(scrape(url)[0]), 60, "both ranks STALLED on /metrics", pause=0.5)
    st = ctl_json(env["run"], "status")
    assert sorted(st["stalled"]["met"]["ranks"]) == [0, 1]
    steps = rows(samples, "ondemand_prof_step", job="met", host=host)
    assert steps == {str(r["rank"]): float(r["step"]) for r in st["jobs"]["met"]}, (steps, st["jobs"]["met"])
    assert steps["1"] == 30.0
    assert all(v >= 10 for v in rows(samples, "ondemand_prof_rank_in_step_seconds", job="met").values())
    assert set(rows(samples, "ondemand_prof_step_seconds", job="met")) == {"0", "1"}
    assert set(rows(samples, "ondemand_prof_rank_vs_median", job="met")) == {"0", "1"}
    assert samples[("ondemand_prof_ranks", frozenset({("job", "met")}))] == 2.0
    assert samples[("ondemand_prof_world_size", frozenset({("job", "met")}))] == 2.0

    # a capture of a stalled job is refused, and counted
    res = ctl(env["run"], "capture", "--steps", "2", "--wait")
    assert res.returncode == 1 and "STALLED" in res.stderr, (res.returncode, res.stderr)
    refused = frozenset({("source", "ondemandctl"), ("outcome", "refused")})
    samples = wait_for(lambda: (lambda s: s.get(("ondemand_prof_captures_total", refused)) == 1.0 and s)(
        scrape(url)[0]), 30, "the refused capture counted", pause=0.5)
    assert samples[("ondemand_prof_refused_total", frozenset({("type", "capture")}))] == 1.0
    assert samples[("ondemand_prof_messages_total", frozenset({("type", "register")}))] >= 2
    assert samples[("ondemand_prof_messages_total", frozenset({("type", "hb")}))] > 0
    assert samples[("ondemand_prof_daemon_info", frozenset({("host", host), ("version", st["daemon"]["version"])}))]

    # once the ranks step again the stall clears, and a capture that writes is counted as done
    wait_for(lambda: rows(scrape(url)[0], "ondemand_prof_rank_stalled", job="met") == {"0": 0.0, "1": 0.0}, 60,
             "the stall to clear", pause=0.5)
    res = ctl(env["run"], "capture", "--steps", "2", "--wait")
    assert res.returncode == 0, res.stdout + res.stderr
    done = frozenset({("source", "ondemandctl"), ("outcome", "done")})
    wait_for(lambda: scrape(url)[0].get(("ondemand_prof_captures_total", done)) == 1.0, 30, "the capture counted",
             pause=0.5)


def test_the_dashboard_asks_only_for_metrics_the_endpoint_has(env: dict[str, Any]) -> None:
    daemon(env, "--metrics", "127.0.0.1:0")
    _, names = scrape(metrics_url(env["run"]))
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b((?:ondemand_prof|process)_[a-z_]+)\b", e)}
    assert {"ondemand_prof_step_seconds", "ondemand_prof_rank_stalled", "ondemand_prof_captures_total"} <= used
    assert used <= names, f"the dashboard asks for metrics the endpoint does not have: {sorted(used - names)}"
    alerts = (ROOT / "deploy" / "ondemand-prof-alerts.yml").read_text()
    assert set(re.findall(r"\b(ondemand_prof_[a-z_]+)\b", alerts)) <= names


def _profd(run_dir: Path, state_dir: Path, *extra: str) -> subprocess.Popen:
    """ondemand-profd in a Python where prometheus_client cannot be imported."""
    code = ("import sys; sys.modules['prometheus_client'] = None; from ondemand_prof.host.profd import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", code, "--runtime-dir", str(run_dir), "--state-dir", str(state_dir),
                             *extra], env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_without_prometheus_client_only_metrics_is_refused_in_one_line() -> None:
    run_dir, state_dir = short_dir("odpm"), short_dir("odpms")
    proc = _profd(run_dir / "run", state_dir, "--metrics", "127.0.0.1:0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "needs the prometheus_client package" in err and "pip install 'ondemand_prof[metrics]'" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (run_dir / "run").exists()  # refused before anything was created

    proc = _profd(run_dir / "run", state_dir)  # the daemon itself needs no prometheus_client
    try:
        wait_for(lambda: (run_dir / "run" / "profd.sock").exists() or proc.poll() is not None, 30, "the socket")
        assert proc.poll() is None
        res = ctl(run_dir / "run", "status")
        assert res.returncode == 0 and "no ranks registered" in res.stdout, res.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_bad_metrics_address_is_one_clear_line() -> None:
    run_dir, state_dir = short_dir("odpm"), short_dir("odpms")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for address, says in (("nonsense", "expected HOST:PORT"),
                              (f"127.0.0.1:{taken.getsockname()[1]}", "cannot listen: Address already in use")):
            res = subprocess.run([str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(run_dir / "run"),
                                  "--state-dir", str(state_dir), "--metrics", address], env=base_env(),
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 1 and says in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.quick
def test_scraping_4096_synthetic_ranks_in_a_loop_costs_one_snapshot_a_second(tmp_path: Path) -> None:
    """The daemon object is real (its sockets, its HTTP server); its 4096 ranks are SYNTHETIC: registered and
    heart-beating through Daemon.dispatch from this thread, which plays the daemon's loop (dispatch, then the
    tick the loop runs) while another thread scrapes /metrics as fast as it can."""
    from ondemand_prof.core.protocol import encode

    n = 4096
    d, _ = inprocess_daemon(tmp_path, n, metrics="127.0.0.1:0")  # registered through dispatch as routes r/0 ...
    try:
        routes = [b"r/%d" % r for r in range(n)]
        url = f"http://{d.metrics.address}/metrics"
        bodies: list[bytes] = []
        stop = threading.Event()

        def scraper() -> None:
            while not stop.is_set():
                with urllib.request.urlopen(url, timeout=60) as resp:
                    bodies.append(resp.read())

        t = threading.Thread(target=scraper)
        t0 = time.monotonic()
        t.start()
        step = 0
        while len(bodies) < 5 or step < 3:  # the loop: a heartbeat from every rank, then its tick
            step += 1
            for route in routes:
                d.dispatch(route, encode("hb", step=step, began=time.time(), state="idle", step_time=0.01))
            d.metrics.tick(time.time())
        stop.set()
        t.join(60)
        elapsed = time.monotonic() - t0
        # however often it was scraped, the loop built at most one snapshot a second
        assert d.metrics.published <= elapsed + 1, (d.metrics.published, elapsed, len(bodies))
        assert len(bodies) > d.metrics.published
        last = {}
        for family in text_string_to_metric_families(bodies[-1].decode()):
            last.update({(s.name, s.labels.get("rank")): s.value for s in family.samples})
        steps = [v for (name, _), v in last.items() if name == "ondemand_prof_step"]
        assert len(steps) == n and min(steps) >= 1  # every rank, from a snapshot taken after heartbeats
    finally:
        d.close()


@pytest.mark.quick
def test_stacks_answers_are_folded_as_they_arrive(service: Any) -> None:
    """The daemon keeps one copy of each distinct stack while a `stacks` request waits for its ranks (4096
    answers of up to 56 KiB each were held whole until the last came); the reply reads as before. The service is
    driven directly; the answers are SYNTHETIC (frames of this test's own stack)."""
    from ondemand_prof.host.triage import group_stacks
    from ondemand_prof.rank.triage import collect_stacks

    svc = service
    n = 64
    for r in range(n):
        svc.handle(b"r%d" % r, register_msg(r, n, step=1))
    svc.handle(b"cli", {"type": "stacks", "id": 1, "ranks": [-1], "timeout_s": 30, "args": {}})
    triage_id = json.loads(svc.outbox[0][1])["triage_id"]
    svc.outbox.clear()
    threads = [{**t, "collector": False} for t in collect_stacks()]  # here the main thread collects
    answers = {}
    for r in range(n):
        odd = [{**t, "frames": t["frames"][:-1] + [["train.py", 97, "stuck", "dist.barrier()"]]} for t in threads]
        answers[r] = {"ok": True, "method": "python", "threads": odd if r == 7 else threads, "trimmed": False}
        svc.handle(b"r%d" % r, {"type": "triage_result", "triage_id": triage_id, "result": answers[r]})
        pending = svc.triage.pending.get(triage_id)
        assert pending is None or all("threads" not in res for res in pending.results.values())
    reply = json.loads(svc.outbox[-1][1])["data"]  # answered when the last rank did
    expected = group_stacks(answers)
    assert reply["threads"] == json.loads(json.dumps(expected["threads"]))
    main = next(t for t in reply["threads"] if t["thread"].endswith("(main)"))
    assert [(s["rank_spans"], s["odd"]) for s in main["stacks"]] == [("0-6,8-63", False), ("7", True)]
    assert reply["answered_python"] == list(range(n))
