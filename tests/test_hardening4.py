"""Hardening, round 4 (issue 41, items 1 and 2): attacks from a root pod on the node's daemon, with real
namespaces (the pods of tests/test_containers.py: unshare, the runtime directory and a volume bound in; root only,
as CI runs; skipped with the reason otherwise). Each test fails on the code before its fix.

1. A root pod registered a node process it cannot even see as its rank and had the root daemon send it the
   native-dump signal (SIGRTMAX-3: it died). A rank is now the process that connected, whatever its uid.
2. A root pod with the runtime directory mounted read-write moved `profd.sock` aside and bound its own: ranks on
   the node registered with it and root's `ondemandctl status` printed its answers. The pods mount it read-only
   now, and ranks and the CLI check the process behind the socket (SO_PEERCRED: its uid and pid namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import base_env, ctl, kill_tree, short_dir, start_daemon, wait_for
from test_containers import Pod, WHY_NOT, needs_namespaces  # noqa: F401 - one copy of the pods' code
from test_containers import host, pods  # noqa: F401 - fixtures: the module's daemon, each test's pods


def _pod(host: dict[str, Any], pods: list[Pod], name: str, argv: list[str], **kw: Any) -> Pod:  # noqa: F811
    pod = Pod(name, argv, kw.pop("run_dir", host["run"]), host["base"], **kw)
    pods.append(pod)
    return pod


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


# ----------------------------------------------------------------------------------------------------------
# 1. A rank is the process that connected


# Pod pid 1, root: registers the node process argv[1] (which it cannot see) as its rank, saying the node's host
# name, with a native-dump file of that pid written through its trace volume (root's on the node, at the node's
# path argv[3]); then it beats and never answers, so `stacks` falls back on the native dump.
REGISTER_ANOTHER = r"""
import json, os, sys, time, zmq
from ondemand_prof.core.protocol import native_dump_signal
victim, node_host, node_dump = int(sys.argv[1]), sys.argv[2], sys.argv[3]
open("/srv/data/" + os.path.basename(node_dump), "w").close()
out = open("/srv/data/attacker.jsonl", "a", buffering=1)
s = zmq.Context().socket(zmq.DEALER)
s.connect("ipc:///srv/run/profd.sock")
s.send(json.dumps({"v": 1, "type": "register", "job": "evil", "rank": 0, "world_size": 1, "host": node_host,
                   "pid": victim, "step": 5, "native_dump": {"signal": native_dump_signal(),
                                                             "file": node_dump}}).encode())
while True:
    if s.poll(300):
        out.write(s.recv().decode() + "\n")
    s.send(json.dumps({"v": 1, "type": "hb", "step": 5}).encode())
"""


@needs_namespaces
def test_a_root_pod_cannot_register_a_node_process_nor_have_it_signalled(
        host: dict[str, Any], pods: list[Pod]) -> None:  # noqa: F811
    """Issue 41, 1. Before: registered (root could register another process), and `ondemandctl stacks` sent the
    node's root process the native-dump signal, which killed it (signal 61). Now the registration is refused (the
    pid is not the connecting process), and the node's process lives."""
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        dump = host["base"] / "pod-x-data" / f"native-stacks-{victim.pid}.txt"  # the volume, as the node has it
        pod = _pod(host, pods, "pod-x", [sys.executable, "-c", REGISTER_ANOTHER, str(victim.pid),
                                         socket.gethostname(), str(dump)])
        replies = pod.data / "attacker.jsonl"
        first = wait_for(lambda: _lines(replies), 60, "the daemon's answer to the pod")[0]
        res = ctl(host["run"], "stacks", "--job", "evil", "--timeout", "2")
        time.sleep(0.5)  # what the daemon sent has arrived
        assert victim.poll() is None, f"the node's process died ({victim.returncode}): {first} {res.stdout}"
        assert first["type"] == "error" and "is not the connecting process" in first["error"], first
        assert res.returncode != 0 and "no live job 'evil'" in res.stderr, res.stdout + res.stderr
    finally:
        kill_tree(victim)


@pytest.mark.quick
def test_root_is_the_hosts_root_only_in_the_daemons_namespaces() -> None:
    """Issue 41, 1, in the daemon's terms: root registers only itself (its pid, or its own view of it), and
    uid 0 is root for the ownership rules only in the daemon's own pid and mount namespaces (a peer the daemon
    cannot see, pid 0, never is)."""
    from ondemand_prof.host.listener import Peer
    from ondemand_prof.host.registry import Registry
    from ondemand_prof.host.service import BadRequest, check_registration, host_root, with_kernel_pid

    me = os.getpid()
    msg = {"job": "j", "rank": 0, "world_size": 1, "host": "h", "pid": 1, "step": 0}
    root = Peer(0, 0, me, alive=True, nspids=(me,))
    with pytest.raises(BadRequest, match="is not the connecting process"):
        check_registration(root, msg, Registry())
    check_registration(root, {**msg, "pid": me}, Registry())
    assert with_kernel_pid(Peer(0, 0, me, alive=True, nspids=(me, 7)), {**msg, "pid": 7}) == ({**msg, "pid": me}, 7)
    assert host_root(root)  # this process: in the daemon's (its own) namespaces
    assert not host_root(Peer(0, 0, 0)) and not host_root(Peer(1000, 1000, me)) and not host_root(None)


@needs_namespaces
def test_a_root_pod_is_not_root_for_the_ownership_rules(host: dict[str, Any], pods: list[Pod],  # noqa: F811
                                                        tmp_path: Path) -> None:
    """Issue 41, 1: a connector in another pid and mount namespace is unprivileged whatever its uid. Before, a
    root pod (the kernel's uid 0) marked another user's job's baseline, which only its owner or the host's root
    may do; now it is refused as any other user is, and the host's root still may."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults
    from ondemand_prof.host.listener import Peer
    from conftest import make_service, register_msg

    pod = _pod(host, pods, "pod-b", ["sleep", "300"])
    pod_pid = wait_for(pod.pid, 30, "the pod's pid 1")
    svc = make_service(tmp_path)
    defaults = WindowDefaults.from_config(ProfileConfig()).to_wire()
    svc.registry.register(b"r0", register_msg(0, 1, job="theirs", step_time=0.1, defaults=defaults),
                          time.monotonic(), time.time(), lambda pid, thorough: True, uid=4242)

    def baseline(peer: Any) -> dict[str, Any]:
        return json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 2},
                                              "job": "theirs", "baseline": True, "_peer": peer}))

    refused = baseline(Peer(0, 0, pod_pid))
    assert refused["type"] == "error" and "only its owner (or root) marks its baseline" in refused["error"], refused
    assert baseline(Peer(0, 0, os.getpid()))["type"] == "ok"  # the host's root (this process)


# ----------------------------------------------------------------------------------------------------------
# 2. The daemon on the other end of the socket


# Pod pid 1, root, the runtime directory bound in at /srv/run: moves the daemon's socket aside and binds its own
# there, answers registrations ("registered") and every request (an error that says whose it is), and writes
# what it did and heard to /srv/data/fake.jsonl (the node reads it in the pod's volume).
FAKE_DAEMON = r"""
import json, os, zmq
from ondemand_prof.core.protocol import encode, reply_error
out = open("/srv/data/fake.jsonl", "a", buffering=1)
try:
    os.rename("/srv/run/profd.sock", "/srv/run/.aside.sock")
except OSError as exc:
    out.write(json.dumps({"rename": str(exc)}) + "\n")
    raise SystemExit(0)
s = zmq.Context().socket(zmq.ROUTER)
s.bind("ipc:///srv/run/profd.sock")
out.write(json.dumps({"bound": True}) + "\n")
while True:
    route, body = s.recv_multipart()
    msg = json.loads(body)
    out.write(json.dumps({"heard": msg.get("type"), "job": msg.get("job")}) + "\n")
    if msg.get("type") == "register":
        s.send_multipart([route, encode("registered", daemon_pid=1, heartbeat_s=1.0)])
    elif "id" in msg:
        s.send_multipart([route, reply_error(msg["id"], "FAKE: the root pod's daemon answers")])
"""


@pytest.fixture
def own_daemon() -> Any:
    """A root daemon of the test's own (its socket is swapped by the test's pod), ended with the test."""
    run, state = short_dir("odph4"), short_dir("odph4s")
    proc = start_daemon(run, state)
    yield {"run": run, "state": state, "proc": proc}
    kill_tree(proc)
    for d in (run, state):
        shutil.rmtree(d, ignore_errors=True)


@needs_namespaces
def test_a_root_pod_that_swaps_the_daemons_socket_is_not_the_daemon(
        host: dict[str, Any], pods: list[Pod], own_daemon: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    """Issue 41, 2. A root pod with the runtime directory mounted read-write (as training-pod.yaml had it) binds
    its own socket in the daemon's place. Before: a rank started on the node registered with it, and root's
    `ondemandctl status` printed its answer. Now both look at the process behind the socket (its pid namespace
    is a container's): the rank says why it does not register and sends nothing, the CLI exits 4 saying so.
    With the read-only mount the pods have now, the socket cannot be moved at all."""
    run = own_daemon["run"]
    fake = _pod(host, pods, "pod-f", [sys.executable, "-c", FAKE_DAEMON], run_dir=run, run_writable=True)
    said = fake.data / "fake.jsonl"
    wait_for(lambda: any("bound" in x for x in _lines(said)), 60, "the pod's socket in the daemon's place")
    assert (run / ".aside.sock").exists()
    res = ctl(run, "status")
    assert "FAKE" not in res.stdout + res.stderr, res.stdout + res.stderr
    assert res.returncode == 4 and "runs in a pid namespace below ours (a container's)" in res.stderr, res.stderr
    log = tmp_path / "rank.log"
    rank = subprocess.Popen([sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", "100000",
                             "--step-sleep", "0.05", "--profile-save-path", str(tmp_path / "profile"),
                             "--profile-job-id", "nodejob"],
                            env=base_env(ONDEMAND_PROF_RUNTIME_DIR=str(run)), stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), start_new_session=True)
    try:
        wait_for(lambda: "traces go to" in log.read_text(), 120, "the rank's start-up line")
        time.sleep(2.5)  # two heartbeats: a registration would have been sent by now
        assert not [x for x in _lines(said) if x.get("heard")], _lines(said)  # nothing reached the pod
        text = log.read_text()
        assert "not registering with ondemand-profd" in text and "pid namespace below ours" in text, text[-3000:]
    finally:
        kill_tree(rank)
    # read-only, as the pods mount it now: the socket stays where it is, and the daemon is still the one reached
    fake.kill()
    os.rename(run / ".aside.sock", run / "profd.sock")
    ro = _pod(host, pods, "pod-r", [sys.executable, "-c", FAKE_DAEMON], run_dir=run)
    moved = wait_for(lambda: [x for x in _lines(ro.data / "fake.jsonl") if "rename" in x], 60, "the pod's try")
    assert "Read-only file system" in moved[0]["rename"], moved
    assert ctl(run, "status").returncode == 0
