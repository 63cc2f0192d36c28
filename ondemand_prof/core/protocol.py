"""The control protocol between ranks, the host daemon and ondemandctl. Pure: no sockets here.

Every message is one ZMQ frame holding a JSON object: {"v": 1, "type": ..., "id": ..., ...}. A CLI request
gets exactly one reply, {"type": "ok", "id": <same>, "data": {...}} or {"type": "error", "id": <same>,
"error": "<what a person can act on>"}. Ranks send register/heartbeat/event messages and receive "capture"
and "register" (the daemon does not know this connection: send your registration again).

Where the daemon and its clients meet (the runtime directory):
  --runtime-dir / ONDEMAND_PROF_RUNTIME_DIR, else /run/ondemand_prof for root and
  /tmp/ondemand_prof-<uid>/run for everyone else. A system daemon shared by a group is reached by setting
  ONDEMAND_PROF_RUNTIME_DIR=/run/ondemand_prof for the group's users (see systemd/ondemand-profd.service).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any, Mapping

from .ids import BadId, check_id, valid_id
from .ranks import MAX_RANK
from .bounds import MAX_STEP, bounded_int
from .safejson import UnsafeJSON, loads

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024  # what the daemon and the ranks accept (and what a trigger file may hold)
# the socket option (ZMQ MAXMSGSIZE) on every socket we listen or connect with: a larger frame drops the
# connection inside ZMQ, before a byte of it is buffered for us; decode() then holds each message to its limit
MAX_FRAME_BYTES = 1024 * 1024
MAX_REPLY_BYTES = 256 * 1024 * 1024  # what the CLI accepts (status and show of thousands of ranks are large)
SOCKET_NAME = "profd.sock"
RUNTIME_ENV = "ONDEMAND_PROF_RUNTIME_DIR"
STATE_ENV = "ONDEMAND_PROF_STATE_DIR"
# sun_path is 108 bytes on Linux; ZMQ needs the whole "ipc://" endpoint's path to fit
MAX_SOCKET_PATH = 107

# what happens to a rank's part of a capture ends in one of these (the daemon records it, the CLI shows it)
FINAL_STATES = ("done", "failed", "rejected", "cancelled")

MAX_BATCHED_EVENTS = 32  # items of one "events" message (the daemon refuses more; a rank sends at most what it says)

TCP_PORT = 7355  # ondemand-profd --listen's customary port across hosts (ondemandctl --port's default)
HEARTBEAT_S = 1.0  # a rank's heartbeat period
RANK_TIMEOUT_S = 3.5  # no heartbeat for this long: the rank is gone

# message type -> {field: accepted python types}; required fields only, others are checked where used
RANK_MESSAGES: dict[str, dict[str, tuple[type, ...]]] = {
    "register": {"job": (str,), "rank": (int,), "world_size": (int,), "host": (str,), "pid": (int,),
                 "step": (int,)},
    "hb": {"step": (int,)},
    "event": {"capture_id": (str,), "event": (str,), "info": (dict,)},
    # several events in one message (each item as an "event" message's fields): sent only to a daemon whose
    # "registered" reply says it takes them (events_batch: how many at most); a window's "received" and
    # "scheduled" leave a rank together, so a capture costs the daemon one decode a rank instead of two
    "events": {"events": (list,)},
    "bye": {},
    "triage_result": {"triage_id": (str,), "result": (dict,)},
    "auto_capture": {"window": (dict,)},
}
# integer fields anywhere in a message's required fields: the range a real rank can send (a pid of 10**30 or a
# step of -10**20 is refused at the door, not found later by a handler that does arithmetic on it)
PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "rank": (0, MAX_RANK), "world_size": (1, MAX_RANK), "pid": (1, PID_MAX), "step": (-1, MAX_STEP),
    "seen": (0, 1 << 62),
}
INT_DEFAULT_BOUNDS = (-(1 << 62), 1 << 62)
# fields that name a capture, a job or a triage request, in any message: checked by core/ids.py's one rule
ID_FIELDS = ("capture_id", "job", "triage_id")


def native_dump_signal() -> int | None:
    """The one signal a daemon sends a silent rank for a native stack dump (SIGRTMAX-3, where faulthandler waits
    in the rank: rank/triage.py NativeDump). Fixed here, on both sides: a rank says whether it listens, never
    which signal to send (a rank that could choose would have the daemon, often root, send SIGKILL)."""
    rtmax = getattr(signal, "SIGRTMAX", None)
    return None if rtmax is None else int(rtmax) - 3


class ProtocolError(ValueError):
    """A message that cannot be taken; the text goes back to the sender as the error reply."""


def default_runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get(RUNTIME_ENV):
        return Path(environ[RUNTIME_ENV]).expanduser()
    if os.getuid() == 0:
        return Path("/run/ondemand_prof")
    return Path(f"/tmp/ondemand_prof-{os.getuid()}/run")


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get(STATE_ENV):
        return Path(environ[STATE_ENV]).expanduser()
    if os.getuid() == 0:
        return Path("/var/lib/ondemand_prof")
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "ondemand_prof"


def socket_path(runtime_dir: Path) -> Path:
    return runtime_dir / SOCKET_NAME


def endpoint(runtime_dir: Path) -> str:
    path = str(socket_path(runtime_dir).absolute())
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ProtocolError(f"socket path {path} is {len(path.encode())} bytes; a unix socket path holds at most "
                            f"{MAX_SOCKET_PATH}: choose a shorter --runtime-dir")
    return "ipc://" + path


def encode(msg_type: str, **fields: Any) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, "type": msg_type, **fields}, separators=(",", ":"),
                      default=str).encode()


def reply_ok(request_id: Any, data: Any) -> bytes:
    return encode("ok", id=request_id, data=data)


def reply_error(request_id: Any, error: str) -> bytes:
    return encode("error", id=request_id, error=error)


def decode(frame: bytes, schema: Mapping[str, Mapping[str, tuple[type, ...]]],
           max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse and check one message against `schema`; ProtocolError says what is wrong with it."""
    if len(frame) > max_bytes:
        raise ProtocolError(f"message is {len(frame)} bytes; the limit is {max_bytes}")
    try:
        msg = loads(frame, max_bytes)
    except UnsafeJSON as exc:
        raise ProtocolError(f"not a JSON message we accept: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a JSON object, got {type(msg).__name__}")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported; this daemon speaks "
                            f"version {PROTOCOL_VERSION} (upgrade the older side)")
    msg_type = msg.get("type")
    fields = schema.get(msg_type) if isinstance(msg_type, str) else None
    if fields is None:
        raise ProtocolError(f"unknown message type {msg_type!r}; accepted: {', '.join(schema)}")
    for name, types in fields.items():
        value = msg.get(name)
        if value is None or not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join(t.__name__ for t in types)
            raise ProtocolError(f"{msg_type}: field {name!r} must be {want}, got {_short(value)}")
        if type(value) is int:
            lo, hi = INT_BOUNDS.get(name, INT_DEFAULT_BOUNDS)
            if not bounded_int(value, lo, hi):
                raise ProtocolError(f"{msg_type}: field {name!r} must be between {lo} and {hi}, got {_short(value)}")
    for name in ID_FIELDS:  # every id from the wire, before it touches a path or a record
        if msg.get(name) is not None and not valid_id(msg[name]):
            try:
                check_id(msg[name], f"{msg_type}: field {name!r}")
            except BadId as exc:
                raise ProtocolError(str(exc)) from None
    for name, (check, want) in TEXT_FIELDS.items():  # what a rank says about itself, shown to every user
        if name in msg and not check(msg[name]):
            raise ProtocolError(f"{msg_type}: field {name!r} must be {want}, got {_short(msg[name])}")
    return msg


def request_id_of(frame: bytes) -> int | None:
    """The id of a request that decode() refused, when it can still be read: the client waits for an answer to its
    own id, so an error without it leaves ondemandctl waiting until its timeout instead of saying what was wrong."""
    try:
        msg = loads(frame, MAX_MESSAGE_BYTES)
    except UnsafeJSON:
        return None
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if bounded_int(rid, *INT_DEFAULT_BOUNDS) else None


_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_TOKEN = re.compile(r"[A-Za-z0-9_ .:+-]{0,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _path_field(value: Any) -> bool:
    """A path a rank reports about itself (shown, and checked again where it is used): no control characters."""
    return isinstance(value, str) and len(value) <= 4096 and not _CONTROL.search(value)


# optional top-level fields of rank messages (register's, mostly) and the shape each must have: they are
# stored by the daemon and printed by ondemandctl, for every user of a --group daemon to read
TEXT_FIELDS: dict[str, tuple[Any, str]] = {
    "host": (lambda v: isinstance(v, str) and _HOST.fullmatch(v) is not None,
             "a host name (letters, digits, '.', '_', '-'; at most 253)"),
    "save_root": (_path_field, "a path without control characters"),
    "trigger_dir": (_path_field, "a path without control characters"),
    "version": (lambda v: isinstance(v, str) and _TOKEN.fullmatch(v) is not None, "a version string"),
    "state": (lambda v: isinstance(v, str) and _TOKEN.fullmatch(v) is not None and 0 < len(v) <= 32,
              "a state name"),
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
