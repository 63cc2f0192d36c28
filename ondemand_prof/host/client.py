"""A short-lived connection from ondemandctl to the daemon: one request, exactly one reply, bounded waits; the
exit codes; and the shape of one host's answer (Reply) that the fan-out across hosts gives for each host."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from ..core.processes import peer_address_ids
from ..core.safedir import NOBODY_LISTENS, daemon_peer_problem, daemon_process_problem, daemon_socket_problem
from ..core.protocol import MAX_REPLY_BYTES, ProtocolError, decode, encode, endpoint, socket_path

REPLIES: dict[str, dict[str, tuple[type, ...]]] = {"ok": {}, "error": {"error": (str,)}}

# exit codes (docs/daemon.md)
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_NO_DAEMON = 4
EXIT_TIMEOUT = 5
EXIT_MISALIGNED = 6  # every rank finished, but not all recorded the same steps (host/alignment.py)


class CtlError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


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


class Client:
    def __init__(self, runtime_dir: Path, timeout_s: float = 5.0) -> None:
        self.runtime_dir = runtime_dir
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        path = socket_path(runtime_dir)
        if os.path.isdir(path.parent) and not os.access(path.parent, os.X_OK):
            raise CtlError(f"permission denied on {path.parent}: the daemon serves its own user only, unless started "
                           "with --group (and you are in that group)", EXIT_NO_DAEMON)
        exists = os.path.lexists(path)
        if not exists:
            raise CtlError(f"no daemon: {path} does not exist (start ondemand-profd, or point "
                           f"--runtime-dir / ONDEMAND_PROF_RUNTIME_DIR at the daemon's runtime directory)",
                           EXIT_NO_DAEMON)
        problem = daemon_socket_problem(path)
        if problem:
            raise CtlError(problem, EXIT_NO_DAEMON)
        # the process behind the socket, before anything is sent to it (its owner alone cannot tell a root pod's
        # socket from the daemon's: issue 41, 2); nobody listening: the request waits as before, and each reply
        # is checked (_check_peer)
        problem = daemon_peer_problem(path, min(timeout_s, 5.0))
        if problem and not problem.endswith(NOBODY_LISTENS):
            raise CtlError(problem, EXIT_NO_DAEMON)
        self._peer: tuple[int, int] | None = None  # (uid, pid) of the daemon whose replies were checked
        if not os.access(path, os.W_OK):
            st = path.stat()
            raise CtlError(f"permission denied on {path} (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}): the "
                           "daemon serves its own user only, unless started with --group", EXIT_NO_DAEMON)
        try:
            url = endpoint(runtime_dir)
        except ProtocolError as exc:
            raise CtlError(str(exc), EXIT_USAGE) from None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, msg_type: str, wait_s: float | None = None, **fields: Any) -> Any:
        """Send one request and return the reply's data; CtlError carries the daemon's error or a timeout."""
        rid = next(self._ids)
        self._sock.send(encode(msg_type, id=rid, **fields))
        wait = self.timeout_s if wait_s is None else wait_s
        while True:
            if not self._sock.poll(int(wait * 1000)):
                raise CtlError(f"the daemon at {socket_path(self.runtime_dir)} did not answer within {wait:g} s "
                               "(is ondemand-profd running? systemctl status ondemand-profd)", EXIT_NO_DAEMON)
            frame = self._sock.recv(copy=False)
            self._check_peer(frame)
            try:
                reply = decode(frame.bytes, REPLIES, MAX_REPLY_BYTES)
            except ProtocolError as exc:
                raise CtlError(f"bad reply from the daemon: {exc}") from None
            if reply.get("id") != rid:
                continue  # a late answer to an earlier request that timed out
            if reply["type"] == "error":
                raise CtlError(reply["error"])
            return reply.get("data")

    def _check_peer(self, frame: Any) -> None:
        """A reply is the daemon's only when the process that sent it passes the check made before the request
        (the kernel's word on its connection: libzmq's Peer-Address); another one, a socket put there since,
        is refused before anything it said is printed."""
        try:
            ids = peer_address_ids(frame.get("Peer-Address"))
        except (zmq.ZMQError, AttributeError, TypeError):
            ids = None
        if ids is None or ids == self._peer:
            return
        problem = daemon_process_problem(ids[0], ids[1], socket_path(self.runtime_dir))
        if problem:
            raise CtlError(problem, EXIT_NO_DAEMON)
        self._peer = ids


class OneHost:
    """This host's daemon behind the fan-out's request() (host/fanout.py), so that what is written for many hosts
    (following a capture) serves one. The daemon's errors and silence are raised as CtlError, as one host's
    commands always did, rather than returned as a Reply."""

    name = "local"
    local = True  # a fan-out of one: its reply is printed as it is (host/commands/base.py alone)

    def __init__(self, client: Client) -> None:
        self.client = client
        self.timeout_s = client.timeout_s

    def request(self, msg_type: str, fields: dict[str, Any] | None = None,
                per_host: dict[str, dict[str, Any]] | None = None, wait_s: float | None = None,
                hosts: list[str] | None = None) -> dict[str, Reply]:
        more = (per_host or {}).get(self.name) or {}
        return {self.name: Reply("ok", self.client.request(msg_type, wait_s=wait_s, **(fields or {}), **more))}


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)
