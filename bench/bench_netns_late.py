"""How late live ranks start a cross-host capture when the host list names a dead host (root; Linux).

Builds tests/test_netns.py's hosts (network namespaces h1, h2, h3 on a bridge in its own namespace, a keyed
daemon each, a gloo job with one rank on h1 and one on h2), then runs `ondemandctl --hosts h1,h2,h3,h9
capture --steps 3 --wait --json` from h1, where h9's address has no host behind it (the status round waits
the default 5 s --connect-timeout for it). Prints each capture's late_by per rank and exit status, for this
tree and, with --before DIR, for an older tree's ondemandctl (e.g. `git archive ff64ddb | tar -x -C DIR`)
against the same daemons, alternating.

    sudo .venv/bin/python bench/bench_netns_late.py [--captures 5] [--before /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_netns as T  # noqa: E402
from ondemand_prof.host.keys import keygen  # noqa: E402


def capture(net: T.Net, tree: Path) -> tuple[int, list[int]]:
    env = T.base_env(PYTHONPATH=str(tree))
    res = subprocess.run(["ip", "netns", "exec", net.ns["h1"], sys.executable, "-m", "ondemand_prof.host.ctl",
                          "--hosts", f"h1,h2,h3,{T.DEAD}", "--keys", str(net.keys), "capture", "--steps", "3",
                          "--wait", "--json", "--timeout", "60"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tree)  # cwd: `python -m` puts it first on sys.path
    try:
        parts = json.loads(res.stdout)["parts"]
    except (ValueError, KeyError):
        raise SystemExit(f"{tree}: exit {res.returncode}: {res.stdout[-400:]} {res.stderr[-400:]}")
    return res.returncode, [parts[k].get("late_by") or 0 for k in sorted(parts, key=int)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--captures", type=int, default=5)
    ap.add_argument("--before", type=Path, help="an older tree to compare with")
    args = ap.parse_args()
    if T.WHY_NOT:
        raise SystemExit(T.WHY_NOT)
    net = T.Net(Path(tempfile.mkdtemp(prefix="odpbench")))
    rows = []
    try:
        net.up()
        keygen(net.keys)
        for host in T.HOSTS:
            net.start_daemon(host)
        net.start_ranks()

        def stepping() -> bool:
            res = net.ctl("status", "--json")
            ranks = [r for h in json.loads(res.stdout)["hosts"].values() for rs in h["data"]["jobs"].values()
                     for r in rs] if res.returncode == 0 else []
            return len(ranks) == 2 and all(r["step_time_s"] for r in ranks)

        T.wait_for(stepping, 180, "the ranks", pause=0.5)
        trees = [("this tree", ROOT)] + ([(f"before ({args.before})", args.before)] if args.before else [])
        results: dict[str, list[tuple[int, list[int]]]] = {label: [] for label, _ in trees}
        for _ in range(args.captures):
            for label, tree in trees:
                results[label].append(capture(net, tree))
        for label, runs in results.items():
            rows.append((label, ", ".join("/".join(map(str, late)) for _, late in runs),
                         ", ".join(str(rc) for rc, _ in runs)))
    finally:
        net.down()
    print("| ondemandctl | late by (steps), rank 0/rank 1, per capture | exit |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
