"""Parallel requests to many daemons over TCP: one DEALER socket per host on one ZMQ poller (no thread per
host), each request with its own deadline. A host that does not answer in time is reported by name and the
others proceed; a host that refuses our key says so (its handshake fails), rather than timing out."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..core.protocol import MAX_REPLY_BYTES, ProtocolError, decode, encode
from .client import REPLIES, CtlError, EXIT_USAGE
from .hosts import Target
from .keys import CLIENT, KeyFileError, load_pair, server_public_key

log = logging.getLogger("ondemand_prof.host.fanout")

AUTH_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_FAILED = AUTH_FAILED | int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) | \
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass
class Reply:
    """One host's answer: `kind` is ok, error (the daemon refused the request), timeout or refused (our key)."""

    kind: str
    data: Any = None
    error: str = ""
    seconds: float = 0.0
    received_at: float = 0.0  # wall time this reply arrived: what it says is anchored here, not at the round's end

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"ok": True, "data": self.data} if self.ok else {"ok": False, "kind": self.kind, "error": self.error}


class _Peer:
    def __init__(self, ctx: zmq.Context, target: Target, creds: tuple[bytes, bytes] | None,
                 key_dir: Path | None) -> None:
        self.target = target
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.monitor: zmq.Socket | None = None
        self.refused = ""
        if creds is not None:
            assert key_dir is not None
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key(key_dir, target.host))
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, creds[0])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, creds[1])
            self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.sock.connect(target.url)
        self.pending: tuple[int, float, float] | None = None  # (request id, sent at, deadline)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


class Fanout:
    """Connections to every target, kept for the session (a capture asks each host several times)."""

    def __init__(self, targets: list[Target], key_dir: Path | None, timeout_s: float = 5.0) -> None:
        self.targets = targets
        self.timeout_s = timeout_s
        self.keyed = key_dir is not None  # host/diagnose.py tells a keyless client it needs keys
        self._ids = itertools.count(1)
        creds = None
        if key_dir is not None:
            try:
                pair = load_pair(key_dir, CLIENT)
                creds = (pair.public, pair.secret)
                for t in targets:
                    server_public_key(key_dir, t.host)
            except KeyFileError as exc:
                raise CtlError(f"--keys {key_dir}: {exc}", EXIT_USAGE) from None
        self._ctx = zmq.Context()
        self.peers = {t.name: _Peer(self._ctx, t, creds, key_dir) for t in targets}
        self._by_sock = {p.sock: p for p in self.peers.values()}
        self._by_monitor = {p.monitor: p for p in self.peers.values() if p.monitor is not None}

    def close(self) -> None:
        for p in self.peers.values():
            p.close()
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
                peer.sock.send(body, zmq.NOBLOCK)
            except zmq.Again:
                out[name] = Reply("timeout", error=f"{name}: not connected (is ondemand-profd listening on "
                                                    f"{peer.target.url}?)")
                continue
            peer.pending = (rid, now, now + wait)
        self._gather(names, out)
        return {name: out[name] for name in names}

    def _gather(self, names: list[str], out: dict[str, Reply]) -> None:
        waiting = {n for n in names if n not in out}
        poller = zmq.Poller()
        for n in waiting:
            poller.register(self.peers[n].sock, zmq.POLLIN)
            if self.peers[n].monitor is not None:
                poller.register(self.peers[n].monitor, zmq.POLLIN)
        while waiting:
            now = time.monotonic()
            for n in list(waiting):
                peer = self.peers[n]
                assert peer.pending is not None
                if now >= peer.pending[2]:
                    out[n] = Reply("timeout", error=f"{n} did not answer within {peer.pending[2] - peer.pending[1]:g} "
                                                    f"s (is ondemand-profd running there with --listen on "
                                                    f"port {peer.target.port}?)", seconds=now - peer.pending[1])
                    peer.pending = None
                    waiting.discard(n)
            if not waiting:
                break
            nearest = min(self.peers[n].pending[2] for n in waiting)  # type: ignore[index]
            for sock, _ in poller.poll(max(1, int((nearest - now) * 1000) + 1)):
                if sock in self._by_monitor:
                    self._on_monitor(self._by_monitor[sock], waiting, out)
                else:
                    self._on_reply(self._by_sock[sock], waiting, out)

    def _on_reply(self, peer: _Peer, waiting: set[str], out: dict[str, Reply]) -> None:
        name = peer.target.name
        while True:
            try:
                frame = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if peer.pending is None:
                continue
            try:
                reply = decode(frame, REPLIES, MAX_REPLY_BYTES)
            except ProtocolError as exc:
                reply = {"type": "error", "id": peer.pending[0], "error": f"bad reply: {exc}"}
            if reply.get("id") != peer.pending[0]:
                continue  # a late answer to an earlier request that timed out
            took, wall = time.monotonic() - peer.pending[1], time.time()
            peer.pending = None
            waiting.discard(name)
            if reply["type"] == "error":
                out[name] = Reply("error", error=reply["error"], seconds=took, received_at=wall)
            else:
                out[name] = Reply("ok", data=reply.get("data"), seconds=took, received_at=wall)

    def _on_monitor(self, peer: _Peer, waiting: set[str], out: dict[str, Reply]) -> None:
        assert peer.monitor is not None
        try:
            event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if not int(event["event"]) & HANDSHAKE_FAILED:
            return
        name = peer.target.name
        peer.refused = (f"{name} refused this client's key (add its public key, client.key, to the daemon's "
                        "authorized/ directory)" if int(event["event"]) == AUTH_FAILED else
                        f"{name}: the CurveZMQ handshake failed (is server.key, or servers/{peer.target.host}.key, "
                        "that daemon's public key?)")
        if name in waiting:
            waiting.discard(name)
            peer.pending = None
            out[name] = Reply("refused", error=peer.refused)
