"""Where the time of a job's first capture goes, against its later ones, on tiny steps (issue 32: 6 s for a 47 KB
trace, later ones 0.4-3 s).

    python bench/bench_first_capture.py [--captures 4] [--repeat 2] [--native fresh|cached] [--copy fresh|warm]

A toy rank (--no-dist, about 1 ms steps) runs from a copy of the package: `--copy fresh` has no __pycache__, as a
fresh clone (an editable install compiles every module at its first import), `warm` is the copy after one run.
`--native fresh` gives the rank an empty cache (XDG_CACHE_HOME), so the first capture starts the native save's
build in the background, as on a new machine; `cached` uses the user's cache. Captures come from the trigger file,
one after another; each one's metadata timings are printed (export = write + post-processing), and where its
summaries are written after it is published (issue 44), the time from the touch until its metadata says so. Then the
post-processing child alone, on the first capture's trace: cold (no __pycache__) and warm, at normal priority.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


SUMMARY_WAIT_S = 120.0  # a summary written after its capture is published (issue 44): waited for this long
SOURCE = ROOT  # --package: another checkout's (git archive OLD | tar -x -C DIR), to compare


def copy_package(dest: Path) -> Path:
    """The package as a fresh clone has it: sources only (no __pycache__, no built module)."""
    shutil.copytree(SOURCE / "ondemand_prof", dest / "ondemand_prof",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    return dest


def metadata(save: Path) -> list[dict[str, Any]]:
    out = []
    for meta in save.glob("*/*/metadata.json"):
        try:
            out.append(json.loads(meta.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda m: m["published_at"])


def children_cpu(pid: int) -> float:
    """CPU seconds of the rank's reaped children (/proc/PID/stat cutime + cstime): its post-processing child, once
    each capture's has ended (the native build's too, once the rank reaps it)."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rpartition(b")")[2].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def run_rank(pkg: Path, cache: Path | None, captures: int, tmp: Path) -> list[dict[str, Any]]:
    trig, save = tmp / "trig", tmp / "save"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
    env.update(PYTHONPATH=str(pkg), OMP_NUM_THREADS="1", ONDEMAND_PROF_RUNTIME_DIR=str(tmp / "nodaemon"))
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    proc = subprocess.Popen([sys.executable, "-m", "ondemand_prof.demo.toy_train", "--no-dist", "--hidden", "16",
                             "--steps", "100000000", "--profile-save-path", str(save), "--profile-trigger-dir",
                             str(trig), "--profile-min-free-mb", "0"], env=env, cwd=tmp,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        while not (trig / "capture.status").exists():
            time.sleep(0.05)
        time.sleep(1.0)
        for i in range(captures):
            children0 = children_cpu(proc.pid)
            t0 = time.monotonic()
            (trig / "capture").write_text(json.dumps({"steps": 2, "id": f"b{i}"}))
            while len(metadata(save)) <= i:
                time.sleep(0.01)
            meta = metadata(save)[i]
            published = time.monotonic()
            summary_s = None
            if (meta.get("summary") or {}).get("status") == "pending":  # issue 44: written after, at idle priority
                folder = next(save.glob(f"*/{Path(meta['trace_file']).name}")).parent
                rank_dir = next(d for d in folder.iterdir() if d.is_dir() and (d / "metadata.json").exists())
                while time.monotonic() - published < SUMMARY_WAIT_S:
                    state = json.loads((rank_dir / "metadata.json").read_text()).get("summary") or {}
                    if state.get("status") != "pending":
                        summary_s = time.monotonic() - t0
                        break
                    time.sleep(0.05)
            t = meta["timings"]
            rows.append({"capture": i + 1, "touch_to_published_s": published - t0, "touch_to_summary_s": summary_s,
                         "child_cpu_s": children_cpu(proc.pid) - children0,
                         "export_s": t["export_s"], "write_s": t["write_s"], "postprocess_s": t.get("postprocess_s"),
                         "save": meta["backend"].get("trace_save", "?"), "kb": sum(
                             v for k, v in meta["files"].items() if "trace" in k) / 1024,
                         "trace": next(save.glob(f"*/{Path(meta['trace_file']).name}"), None)})
    finally:
        proc.kill()
        proc.wait()
    return rows


def time_child(pkg: Path, trace: Path, tmp: Path, n: int) -> list[float]:
    """Wall seconds of the post-processing child on `trace` (normal priority), n runs."""
    out = []
    for _ in range(n):
        work = Path(tempfile.mkdtemp(prefix="pp", dir=tmp))
        raw = work / "raw.json"
        shutil.copy(trace, raw)
        spec = {"raw": str(raw), "out_dir": str(work), "trace_name": "t.pt.trace.json", "keep_steps": None,
                "level": "level0", "simplify": False, "gzip": False, "rank": 0, "world_size": 1,
                "export_type": "text", "meta": {}}
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=str(pkg), PYTHONSAFEPATH="1")
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-P", "-m", "ondemand_prof.rank.postprocess", str(work / "spec.json")],
                       env=env, cwd="/", check=True, stdout=subprocess.DEVNULL)
        out.append(time.monotonic() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captures", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="fresh rank runs")
    parser.add_argument("--native", choices=["fresh", "cached"], default="fresh")
    parser.add_argument("--copy", choices=["fresh", "warm"], default="fresh")
    parser.add_argument("--package", type=Path, default=ROOT, help="the checkout whose ondemand_prof/ runs")
    args = parser.parse_args()
    global SOURCE
    SOURCE = args.package
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; native cache {args.native}, package copy "
          f"{args.copy}, from {args.package}")
    print(f"{'run':>3} {'cap':>3} {'touch->published':>16} {'export':>8} {'write':>7} {'postproc':>9} "
          f"{'child CPU':>9} {'save':>10} {'KB':>6} {'touch->summary':>14}")
    firsts, laters = [], []
    trace = None
    for run in range(args.repeat):
        tmp = Path(tempfile.mkdtemp(prefix="odp-first-"))
        try:
            pkg = copy_package(tmp / "pkg")
            if args.copy == "warm":
                subprocess.run([sys.executable, "-c", "import ondemand_prof, ondemand_prof.rank.postprocess, "
                                "ondemand_prof.report.analyze"], env=dict(os.environ, PYTHONPATH=str(pkg)), check=True)
            cache = tmp / "cache" if args.native == "fresh" else None
            rows = run_rank(pkg, cache, args.captures, tmp)
            for r in rows:
                print(f"{run + 1:>3} {r['capture']:>3} {r['touch_to_published_s']:>15.2f}s {r['export_s']:>7.2f}s "
                      f"{r['write_s']:>6.2f}s {r['postprocess_s'] or 0:>8.2f}s {r['child_cpu_s']:>8.2f}s "
                      f"{r['save']:>10} {r['kb']:>6.0f} "
                      + (f"{r['touch_to_summary_s']:>13.2f}s" if r["touch_to_summary_s"] is not None else f"{'-':>14}"))
            firsts.append(rows[0]["export_s"])
            laters += [r["export_s"] for r in rows[1:]]
            if run == 0 and rows[0]["trace"] is not None:
                trace = tmp.parent / "odp-first-trace.json"
                shutil.copy(rows[0]["trace"], trace)
                cold_pkg = copy_package(Path(tempfile.mkdtemp(prefix="odp-cold-")))
                cold = time_child(cold_pkg, trace, tmp, 1)  # the first run compiles the package's .pyc
                warm = time_child(cold_pkg, trace, tmp, 3)
                shutil.rmtree(cold_pkg, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if laters:
        print(f"\nexport, first capture: median {statistics.median(firsts):.2f} s; later ones: median "
              f"{statistics.median(laters):.2f} s (first - later: {statistics.median(firsts) - statistics.median(laters):+.2f} s)")
    if trace is not None:
        print(f"post-processing child alone (normal priority): cold {cold[0]:.2f} s, warm median "
              f"{statistics.median(warm):.2f} s")
        trace.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
