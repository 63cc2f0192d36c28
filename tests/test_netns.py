"""A real multi-host job in network namespaces, with faults injected there (root only; CI runs as root).

Three "hosts", each a network namespace with its own address (10.77.0.1-3) and, per process, its own host
name (a UTS namespace: h1, h2, h3), joined by a bridge that lives in a fourth namespace (the switch), so that
nothing is added to the machine's own network and no traffic leaves these namespaces. Each host runs
ondemand-profd with `--listen tcp://ADDR:7355 --keys DIR`; a gloo training job has one rank on h1 and one on
h2 (MASTER_ADDR h1's address); h3 has a daemon and no ranks; h9 (10.77.0.9) is in the host list and does
not exist. ondemandctl runs on h1, naming hosts as users do (`--hosts h1,h2,h3,h9`, from the namespace's
/etc/hosts). Faults: the dead host in the list, h2's link down for 20 s mid-capture, h2's daemon killed
and restarted mid-capture. Checked: what the CLI prints and exits, and the ProfilerStep#N set in each rank's
trace on disk. Everything is removed in teardown, on failure too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT, base_env, captures, short_dir, trace_steps, wait_for
from ondemand_prof.host.keys import keygen

HOSTS = {"h1": 1, "h2": 2, "h3": 3}  # host name -> last byte of its address
RANK_HOSTS = ("h1", "h2")  # rank i runs on RANK_HOSTS[i]
DEAD = "h9"  # in every /etc/hosts, at 10.77.0.9, where nothing exists
NET = "10.77.0"
PORT = 7355
STEP_S = 0.05


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs, a bridge); CI runs as root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} ({'iproute2' if tool == 'ip' else 'util-linux'}: apt-get install -y iproute2)"
    probe = f"odpprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


class Net:
    """The namespaces, the processes started in them, and their cleanup."""

    def __init__(self, root: Path) -> None:
        tag = f"odp{os.getpid() % 100000}"  # unique per test process: two runs at once do not collide
        self.root = root
        self.ns = {h: f"{tag}{h}" for h in HOSTS}
        self.switch = f"{tag}sw"
        self.keys = root / "keys"
        self.procs: list[subprocess.Popen] = []
        self.daemons: dict[str, dict[str, Any]] = {}
        self.ranks: list[subprocess.Popen] = []

    def addr(self, host: str) -> str:
        return f"{NET}.{HOSTS.get(host, 9)}"

    def up(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(h)} {h}\n" for h in [*HOSTS, DEAD])
        for host, ns in self.ns.items():
            ip("netns", "add", ns)
            etc = Path("/etc/netns") / ns  # `ip netns exec` mounts this hosts file over /etc/hosts
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{host}", "netns", self.switch)
            ip("-n", self.switch, "link", "set", f"v{host}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def spawn(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """A process on `host`: its network namespace, and its own UTS namespace named after the host
        (`ip netns exec` then `unshare` then `sh` each exec the next: the pid is the program's)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                                 f'hostname {host} && exec "$@"', "sh", *argv], env=env,
                                stdout=subprocess.DEVNULL, stderr=open(log, "a"))
        self.procs.append(proc)
        return proc

    def start_daemon(self, host: str) -> dict[str, Any]:
        d = self.daemons.get(host) or {"run": short_dir(f"odn{host}-"), "state": short_dir(f"odns{host}-"),
                                       "log": self.root / f"profd-{host}.log"}
        (d["run"] / "profd.tcp").unlink(missing_ok=True)
        d["proc"] = self.spawn(host, [str(ROOT / "bin" / "ondemand-profd"), "--runtime-dir", str(d["run"]),
                                      "--state-dir", str(d["state"]), "--listen", f"tcp://{self.addr(host)}:{PORT}",
                                      "--keys", str(self.keys)], base_env(), d["log"])
        wait_for(lambda: (d["run"] / "profd.tcp").exists() or d["proc"].poll() is not None, 60, f"daemon on {host}")
        assert d["proc"].poll() is None, d["log"].read_text()
        self.daemons[host] = d
        return d

    def start_ranks(self) -> None:
        for rank, host in enumerate(RANK_HOSTS):
            env = base_env(RANK=str(rank), WORLD_SIZE=str(len(RANK_HOSTS)), LOCAL_RANK="0",
                           MASTER_ADDR=self.addr(RANK_HOSTS[0]), MASTER_PORT="29517", GLOO_SOCKET_IFNAME="eth0",
                           ONDEMAND_PROF_RUNTIME_DIR=str(self.daemons[host]["run"]))
            self.ranks.append(self.spawn(host, [sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps",
                                                "1000000", "--step-sleep", str(STEP_S), "--profile-min-free-mb", "0",
                                                "--profile-save-path", str(self.save(rank))],
                                         env, self.root / f"rank{rank}.log"))

    def save(self, rank: int) -> Path:
        return self.root / f"profile-{RANK_HOSTS[rank]}"  # each host its own disk

    def ctl(self, *args: str, hosts: str = "h1,h2,h3", keys: bool = True, timeout: float = 180
            ) -> subprocess.CompletedProcess:
        """ondemandctl, run on h1."""
        return subprocess.run(["ip", "netns", "exec", self.ns["h1"], str(ROOT / "bin" / "ondemandctl"), "--hosts",
                               hosts, *(["--keys", str(self.keys)] if keys else []), *args], env=base_env(),
                              capture_output=True, text=True, timeout=timeout)

    def ctl_background(self, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns["h1"], str(ROOT / "bin" / "ondemandctl"), "--hosts",
                                 "h1,h2,h3", "--keys", str(self.keys), *args], env=base_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def down(self) -> None:
        """Every process started here, then every namespace (which takes the veths and the bridge along)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        try:
            Path("/etc/netns").rmdir()  # only when empty: nobody else's namespaces are touched
        except OSError:
            pass
        for d in self.daemons.values():
            shutil.rmtree(d["run"], ignore_errors=True)
            shutil.rmtree(d["state"], ignore_errors=True)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    n = Net(tmp_path_factory.mktemp("netns"))
    try:
        n.up()
        keygen(n.keys)
        for host in HOSTS:
            n.start_daemon(host)
        n.start_ranks()

        def stepping() -> bool:
            res = n.ctl("status", "--json", "--connect-timeout", "2")
            if res.returncode != 0:
                return False
            ranks = [r for h in json.loads(res.stdout)["hosts"].values() for rs in h["data"]["jobs"].values()
                     for r in rs]
            return len(ranks) == len(RANK_HOSTS) and all(r["step_time_s"] for r in ranks)

        wait_for(stepping, 180, "2 ranks on h1 and h2 registered and stepping", pause=0.5)
        yield n
    finally:
        n.down()


def _part_record(net: Net, host: str, before: set[Path], state: str) -> bool:
    """A new capture record on `host` has a part in `state` now (not merely in its history)."""
    for path in set((net.daemons[host]["state"] / "captures").glob("*.json")) - before:
        try:
            parts = json.loads(path.read_text()).get("parts") or {}
        except (OSError, ValueError):  # being replaced
            continue
        if any(p.get("state") == state for p in parts.values()):
            return True
    return False


def _steps_on_disk(net: Net, capture_id: str) -> dict[int, list[int]]:
    """Each rank's ProfilerStep#N set, from the trace it wrote on its own host."""
    out = {}
    for rank in range(len(RANK_HOSTS)):
        for meta in captures(net.save(rank)):
            if meta["capture_id"] == capture_id:
                out[meta["rank"]] = trace_steps(meta)
    return out


def test_status_names_each_hosts_own_ranks_and_host_names(net: Net) -> None:
    res = net.ctl("status", "--json")
    assert res.returncode == 0, res.stderr
    hosts = json.loads(res.stdout)["hosts"]
    assert {name: h["data"]["daemon"]["host"] for name, h in hosts.items()} == {"h1": "h1", "h2": "h2", "h3": "h3"}
    ranks = {r["rank"]: (name, r["host"]) for name, h in hosts.items() for rs in h["data"]["jobs"].values() for r in rs}
    assert ranks == {0: ("h1", "h1"), 1: ("h2", "h2")}
    keyless = net.ctl("status", "--connect-timeout", "2", hosts="h2", keys=False)
    assert keyless.returncode == 4 and "the daemon at h2 requires CurveZMQ keys: pass --keys DIR" in keyless.stderr, \
        keyless.stderr


def test_a_dead_host_in_the_list_makes_no_rank_late(net: Net) -> None:
    res = net.ctl("capture", "--steps", "3", "--wait", "--json", "--timeout", "120", "--connect-timeout", "3",
                  hosts=f"h1,h2,h3,{DEAD}")
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads(res.stdout)
    start, end = record["window"]
    assert {int(k): (p["state"], p.get("late_by") or 0, p["host"]) for k, p in record["parts"].items()} == \
        {0: ("done", 0, "h1"), 1: ("done", 0, "h2")}, record["parts"]
    assert DEAD in record["unanswered"] and record["missing_ranks"] == []
    assert _steps_on_disk(net, record["capture_id"]) == {0: list(range(start, end)), 1: list(range(start, end))}


def test_a_link_down_for_20_s_mid_capture_is_waited_for(net: Net) -> None:
    """h2 drops off the network while its rank records (the job stalls: its collectives cross that link);
    the CLI keeps asking h2, which answers once the link is back, and both ranks record the same steps."""
    before = set((net.daemons["h2"]["state"] / "captures").glob("*.json"))
    # 60 steps (3 s): the link goes down while h2's part still records, however slowly the check comes round
    cli = net.ctl_background("capture", "--steps", "60", "--wait", "--json", "--timeout", "150", "--connect-timeout",
                             "2")
    try:
        wait_for(lambda: _part_record(net, "h2", before, "recording"), 60, "h2's rank recording", pause=0.1)
        ip("-n", net.ns["h2"], "link", "set", "eth0", "down")
        try:
            time.sleep(20)  # the fault's length; nothing is timed
            assert cli.poll() is None, cli.communicate()  # still asking
        finally:
            ip("-n", net.ns["h2"], "link", "set", "eth0", "up")
        out, err = cli.communicate(timeout=150)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, out + err
    record = json.loads(out)
    start, end = record["window"]
    assert {int(k): p["state"] for k, p in record["parts"].items()} == {0: "done", 1: "done"}, record["parts"]
    assert all(h["status"] == "done" for h in record["hosts"].values()), record["hosts"]
    assert _steps_on_disk(net, record["capture_id"]) == {0: list(range(start, end)), 1: list(range(start, end))}


def test_a_daemon_killed_and_restarted_mid_capture_is_waited_for(net: Net) -> None:
    before = set((net.daemons["h2"]["state"] / "captures").glob("*.json"))
    cli = net.ctl_background("capture", "--steps", "60", "--wait", "--json", "--timeout", "150", "--connect-timeout",
                             "2")
    try:
        wait_for(lambda: _part_record(net, "h2", before, "recording"), 60, "h2's rank recording", pause=0.1)
        net.daemons["h2"]["proc"].send_signal(signal.SIGKILL)
        net.daemons["h2"]["proc"].wait(timeout=30)
        time.sleep(3)  # a few rounds of watches go unanswered
        assert cli.poll() is None, cli.communicate()
        net.start_daemon("h2")
        out, err = cli.communicate(timeout=150)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, out + err
    record = json.loads(out)
    start, end = record["window"]
    assert {int(k): p["state"] for k, p in record["parts"].items()} == {0: "done", 1: "done"}, record["parts"]
    assert _steps_on_disk(net, record["capture_id"]) == {0: list(range(start, end)), 1: list(range(start, end))}
    text = net.ctl("show", record["capture_id"])
    assert text.returncode == 0 and "done: 2 of 2 rank(s) wrote a trace" in text.stdout, text.stdout
