"""What ondemand-profd takes off the wire, apart from the process that serves it (host/daemon.py): the
messages it accepts (SCHEMA), the heartbeat read without the general decoder (the common case: 4,096 ranks
beat once a second), and the TCP side (TcpListener: CurveZMQ keys and their ZAP handler, peers' routes marked
TCP_ROUTE so that replies find their socket)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import zmq

from ..core.bounds import MAX_STEP, bounded_int
from ..core.netaddr import port_number, split_host_port
from ..core.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, RANK_MESSAGES, encode
from .commands import CLI_MESSAGES
from .hosts import is_loopback
from .listener import HANDSHAKE_S, TCP_PER_PEER

log = logging.getLogger("ondemand_prof.host.profd")

_NOBLOCK = int(zmq.NOBLOCK)
SCHEMA = {**RANK_MESSAGES, **CLI_MESSAGES}
# routes of TCP peers carry this prefix, so the service's replies find the socket they came from (rank and
# ipc routes never start with it: ranks name themselves "r/...", ZMQ's own identities start with a zero byte)
TCP_ROUTE = b"\x01tcp/"
TCP_FILE = "profd.tcp"  # the TCP endpoint actually bound (port 0 picks a free one)
_json_decode = json.JSONDecoder().decode
HB_PREFIX = encode("hb")[:-1]  # b'{"v":1,"type":"hb"': how every heartbeat of ours begins (core/protocol.encode)


def heartbeat(frame: bytes) -> dict[str, Any] | None:
    """A heartbeat as the ranks' encoder writes it, read without the general decoder; None for anything else
    (parsed once, by that decoder: trying json here first cost every event a second parse). A frame with a \\u
    escape takes the general decoder, which refuses lone surrogates (ours never have one)."""
    if len(frame) >= 512 or not frame.startswith(HB_PREFIX) or b"\\u" in frame:
        return None
    try:
        msg = _json_decode(frame.decode())  # json.loads without its encoding sniffing: the frame is UTF-8
    except ValueError:  # UnicodeDecodeError included: the general decoder says what is wrong
        return None
    # a frame this short cannot nest deeply enough to hurt json; NaN and huge numbers are caught by the
    # registry's bounds (registry.py _update), the step here
    if type(msg) is dict and msg.get("type") == "hb" and msg.get("v") == PROTOCOL_VERSION and \
            bounded_int(msg.get("step"), -1, MAX_STEP):
        return msg
    return None


class DaemonError(RuntimeError):
    pass


class TcpListener:
    """The TCP side: a second ROUTER socket (CURVE_SERVER is set per socket, before bind) and, with keys, the
    ZAP handler on the daemon's own loop. Without keys only a loopback address is served. The descriptor gate
    (host/listener.py) holds each peer to `per_peer` connections and all of them to a share of the descriptors."""

    def __init__(self, ctx: zmq.Context, listen: str, keys: Path | None, per_peer: int = TCP_PER_PEER) -> None:
        from .keys import SERVER, ZAP_DOMAIN, ZAP_ENDPOINT, KeyFileError, ZapHandler, load_pair

        host, port = parse_listen(listen)
        if keys is None and not is_loopback(host):
            raise DaemonError(f"--listen {listen} reaches beyond this host: give --keys DIR (CurveZMQ keys; create "
                              "them with: ondemandctl keygen DIR), or listen on 127.0.0.1")
        self.per_peer = per_peer
        self.zap: Any = None  # keys.ZapHandler
        self._zap_sock: zmq.Socket | None = None
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))  # unauthenticated: closed fast
        try:
            if keys is not None:
                pair = load_pair(keys, SERVER)
                self.zap = ZapHandler(keys)
                self._zap_sock = ctx.socket(zmq.REP)
                self._zap_sock.setsockopt(zmq.LINGER, 0)
                self._zap_sock.bind(ZAP_ENDPOINT)  # before the listener: no handshake without the handler
                self.sock.setsockopt(zmq.CURVE_SERVER, 1)
                self.sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
                self.sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            else:
                log.warning("ondemand-profd: TCP on %s without keys: any local user can reach this daemon over TCP "
                            "(give --keys DIR to require CurveZMQ keys)", host)
            # libzmq's TCP listener survives EMFILE (unlike its ipc one), so it binds this socket itself; the
            # descriptor gate holds what it accepts to the per-peer limit and the TCP budget
            self.sock.bind(f"tcp://{host}:{port}")
        except (KeyFileError, OSError) as exc:
            self.close()
            raise DaemonError(f"--listen {listen}: {exc}") from None
        except zmq.ZMQError as exc:
            self.close()
            raise DaemonError(f"--listen {listen}: cannot bind: {exc}") from None
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        log.info("ondemand-profd: serving ondemandctl on %s (%s)", self.endpoint,
                 "CurveZMQ, keys from " + str(keys) if keys else "no authentication")

    def sockets(self) -> list[zmq.Socket]:
        return [s for s in (self.sock, self._zap_sock) if s is not None]

    def answer_zap(self) -> None:
        if self._zap_sock is None or self.zap is None:
            return
        while True:
            try:
                frames = self._zap_sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            self._zap_sock.send_multipart(self.zap.reply(frames))

    def receive(self, limit: int = 10_000) -> list[tuple[bytes, Any]]:
        """(route, zmq.Frame of the body) of each message waiting: the frame carries the client key's name
        (User-Id) and the connection it came on."""
        out = []
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) == 2:
                out.append((TCP_ROUTE + frames[0].bytes, frames[1]))
        return out

    def close(self) -> None:
        for s in self.sockets():
            s.close(linger=0)
        self._zap_sock = None


def parse_listen(listen: str) -> tuple[str, int]:
    """tcp://HOST:PORT (HOST may be [v6]) -> (host, port); DaemonError says what is wrong."""
    rest = listen[len("tcp://"):] if listen.startswith("tcp://") else None
    host, port = split_host_port(rest or "")
    number = port_number(port) if rest is not None and port is not None and host else None
    if rest is None or number is None or not host:
        raise DaemonError(f"--listen {listen!r}: expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")
    return host, number
