"""Parallel requests to many daemons over TCP: one ROUTER socket connected to every host (each connection named
by its own routing id, with that host's server key), one monitor for all of them, one ZMQ poller, each request
with its own deadline. So a fan-out to 4096 hosts costs one descriptor per host (its TCP connection) and three
ZMQ sockets in all, not three sockets and four descriptors per host (libzmq's default of 1023 sockets a context
ended such a fan-out at 341 hosts). A host that does not answer in time is reported by name and the others
proceed; a host that refuses our key says so (its handshake fails), rather than timing out."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..core.protocol import MAX_REPLY_BYTES, ProtocolError, decode, encode
from .client import EXIT_USAGE, REPLIES, CtlError, Reply
from .hosts import Target
from .keys import CLIENT, KeyFileError, load_pair, server_public_key
from .listener import open_fds, raise_nofile_limit

log = logging.getLogger("ondemand_prof.host.fanout")

AUTH_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_FAILED = AUTH_FAILED | int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) | \
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
SPARE_FDS = 64  # descriptors kept for the rest of the process (files, the report)


class _Peer:
    """One host: its routing id on the shared ROUTER socket and the request it waits on."""

    def __init__(self, target: Target, routing_id: bytes) -> None:
        self.target = target
        self.routing_id = routing_id
        self.refused = ""
        self.failed_handshakes = 0
        self.pending: tuple[int, float, float] | None = None  # (request id, sent at, deadline)


class Fanout:
    """Connections to every target, kept for the session (a capture asks each host several times)."""

    local = False  # (client.OneHost: this host's daemon alone)

    def __init__(self, targets: list[Target], key_dir: Path | None, timeout_s: float = 5.0) -> None:
        self.targets = targets
        self.timeout_s = timeout_s
        self.keyed = key_dir is not None  # host/diagnose.py tells a keyless client it needs keys
        self._ids = itertools.count(1)
        creds = None
        server_keys: dict[str, bytes] = {}
        if key_dir is not None:
            try:
                pair = load_pair(key_dir, CLIENT)
                creds = (pair.public, pair.secret)
                for t in targets:
                    server_keys[t.name] = server_public_key(key_dir, t.host)
            except KeyFileError as exc:
                raise CtlError(f"--keys {key_dir}: {exc}", EXIT_USAGE) from None
        soft, _ = raise_nofile_limit()
        if len(targets) + SPARE_FDS > soft - open_fds(soft):
            raise CtlError(f"{len(targets)} hosts need {len(targets) + SPARE_FDS} file descriptors, and this "
                           f"process may open {soft} (raise it: ulimit -n)", EXIT_USAGE)
        self._ctx = zmq.Context(io_threads=2 if len(targets) > 256 else 1)
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a host with no pipe says so, never vanishes
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.monitor: zmq.Socket | None = None
        if creds is not None:
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, creds[0])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, creds[1])
            self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.peers: dict[str, _Peer] = {}
        self._by_id: dict[bytes, _Peer] = {}
        self._by_url: dict[str, _Peer] = {}
        for i, t in enumerate(targets):
            peer = _Peer(t, b"h%d" % i)
            if creds is not None:
                self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_keys[t.name])  # read at connect: per host
            self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, peer.routing_id)
            self.sock.connect(t.url)
            self.peers[t.name] = peer
            self._by_id[peer.routing_id] = peer
            self._by_url[t.url] = peer

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Fanout":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, msg_type: str, fields: Mapping[str, Any] | None = None,
                per_host: Mapping[str, Mapping[str, Any]] | None = None, wait_s: float | None = None,
                hosts: list[str] | None = None) -> dict[str, Reply]:
        """Send `msg_type` to each host (`hosts`, default all; `per_host` adds fields for one host) at once and
        gather the replies; each host has `wait_s` (default the session's timeout) from its send."""
        wait = self.timeout_s if wait_s is None else wait_s
        names = list(self.peers) if hosts is None else hosts
        out: dict[str, Reply] = {}
        for name in names:
            peer = self.peers[name]
            if peer.refused:
                out[name] = Reply("refused", error=peer.refused)
                continue
            rid = next(self._ids)
            now = time.monotonic()
            body = encode(msg_type, id=rid, **(fields or {}), **((per_host or {}).get(name) or {}))
            try:
                self.sock.send_multipart([peer.routing_id, body], zmq.NOBLOCK)
            except zmq.ZMQError:  # its queue is full (Again), or no pipe to it (EHOSTUNREACH)
                out[name] = Reply("timeout", error=f"{name}: not connected (is ondemand-profd listening on "
                                                    f"{peer.target.url}?)")
                continue
            peer.pending = (rid, now, now + wait)
        self._gather(names, out)
        return {name: out[name] for name in names}

    def _gather(self, names: list[str], out: dict[str, Reply]) -> None:
        waiting = {n for n in names if n not in out}
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        while waiting:
            now = time.monotonic()
            for n in [n for n in waiting if now >= self.peers[n].pending[2]]:  # type: ignore[index]
                peer = self.peers[n]
                assert peer.pending is not None
                within = peer.pending[2] - peer.pending[1]
                why = (f"{n}: the CurveZMQ handshake failed {peer.failed_handshakes} time(s) and no answer came "
                       f"within {within:g} s (is server.key, or servers/{peer.target.host}.key, that daemon's public "
                       "key? or is it overloaded?)" if peer.failed_handshakes else
                       f"{n} did not answer within {within:g} s (is ondemand-profd running there with --listen on "
                       f"port {peer.target.port}?)")
                out[n] = Reply("timeout", error=why, seconds=now - peer.pending[1])
                peer.pending = None
                waiting.discard(n)
            if not waiting:
                break
            nearest = min(self.peers[n].pending[2] for n in waiting)  # type: ignore[index]
            for sock, _ in poller.poll(max(1, int((nearest - now) * 1000) + 1)):
                if sock is self.monitor:
                    self._on_monitor(waiting, out)
                else:
                    self._on_replies(waiting, out)

    def _on_replies(self, waiting: set[str], out: dict[str, Reply]) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = self._by_id.get(frames[0]) if len(frames) == 2 else None
            if peer is None or peer.pending is None:
                continue
            try:
                reply = decode(frames[1], REPLIES, MAX_REPLY_BYTES)
            except ProtocolError as exc:
                reply = {"type": "error", "id": peer.pending[0], "error": f"bad reply: {exc}"}
            if reply.get("id") != peer.pending[0]:
                continue  # a late answer to an earlier request that timed out
            took, wall = time.monotonic() - peer.pending[1], time.time()
            peer.pending = None
            name = peer.target.name
            waiting.discard(name)
            if reply["type"] == "error":
                out[name] = Reply("error", error=reply["error"], seconds=took, received_at=wall)
            else:
                out[name] = Reply("ok", data=reply.get("data"), seconds=took, received_at=wall)

    def _on_monitor(self, waiting: set[str], out: dict[str, Reply]) -> None:
        assert self.monitor is not None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            endpoint = event.get("endpoint", b"")
            peer = self._by_url.get(endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else
                                    str(endpoint))
            if peer is None or not int(event["event"]) & HANDSHAKE_FAILED:
                continue
            if int(event["event"]) != AUTH_FAILED:
                # the connection ended mid-handshake: a wrong server key, or a daemon too busy to finish in its
                # time; libzmq reconnects until the deadline, whose message then says so (_gather)
                peer.failed_handshakes += 1
                continue
            name = peer.target.name
            peer.refused = (f"{name} refused this client's key (add its public key, client.key, to the daemon's "
                            "authorized/ directory)")
            if name in waiting:
                waiting.discard(name)
                peer.pending = None
                out[name] = Reply("refused", error=peer.refused)
