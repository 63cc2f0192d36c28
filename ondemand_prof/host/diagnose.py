"""Why a host's daemon did not answer, said plainly: a name that does not resolve, nothing listening, no
route, a daemon that wants CurveZMQ keys this client does not have, or one that accepts connections and
then says nothing (stopped, overloaded).

ZMQ hides all of these behind silence (it retries a connection forever), so a host that did not answer in
time is probed afterwards, outside ZMQ: a name lookup, a plain TCP connection, and the first 64 bytes of the
ZMTP handshake, whose greeting names the security mechanism the daemon requires. The probe sends only the
start of a greeting (no request, no key) and closes; only hosts that already failed are probed, in parallel, each within
a bounded time."""

from __future__ import annotations

import errno
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from .hosts import Target

PROBE_S = 2.0  # each probe's budget (name lookup aside: the resolver has its own timeouts)
MAX_PROBES = 64  # hosts probed per round; beyond that the plain "did not answer" is kept
# The start of a ZMTP 3 greeting (RFC 23): signature and major version. That much makes a daemon send its
# whole greeting; the rest of ours (mechanism) is never sent, so no mismatch is detected and nothing logged.
GREETING_START = b"\xff" + b"\x00" * 7 + b"\x01" + b"\x7f" + b"\x03"
GREETING_BYTES = 64


def probe(target: Target, keyed: bool, budget: float = PROBE_S) -> tuple[str, str] | None:
    """(kind, message) saying why `target` does not answer, or None when it looks like a daemon that is
    merely slow. Kinds: unresolved, nokeys, timeout."""
    port, name = target.port, target.name
    try:
        socket.getaddrinfo(target.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return "unresolved", f"cannot resolve host {target.host} ({exc.strerror})"
    except UnicodeError:
        return "unresolved", f"cannot resolve host {target.host} (not a valid name)"
    deadline = time.monotonic() + budget
    try:
        conn = socket.create_connection((target.host, port), timeout=budget)
    except ConnectionRefusedError:
        return "timeout", (f"{name}: nothing listens on port {port} (connection refused): is ondemand-profd "
                           f"running there with --listen on port {port}?")
    except socket.timeout:
        return "timeout", (f"{name}: no TCP connection to port {port} within {budget:g} s (host down, network "
                           "unreachable, or a firewall drops it)")
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return "timeout", f"{name}: {why} (host down or no route to it)"
        return "timeout", f"{name}: cannot connect to port {port}: {why}"
    with conn:
        greeting = _exchange(conn, deadline)
    if greeting is None:
        return "timeout", (f"{name} accepts connections on port {port} but its daemon does not respond (stopped, "
                           "or overloaded?)")
    if len(greeting) < GREETING_BYTES or greeting[0] != 0xFF or greeting[9] != 0x7F:
        return "timeout", f"{name}: port {port} does not speak ZMTP (is that ondemand-profd's --listen port?)"
    mechanism = greeting[12:32].rstrip(b"\x00").decode("ascii", "replace")
    if mechanism == "CURVE" and not keyed:
        return "nokeys", f"the daemon at {name} requires CurveZMQ keys: pass --keys DIR"
    return None


def _exchange(conn: socket.socket, deadline: float) -> bytes | None:
    """Send the start of our greeting and read the daemon's whole one; None when it sends nothing in time."""
    data = b""
    try:
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        conn.sendall(GREETING_START)
        while len(data) < GREETING_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            chunk = conn.recv(GREETING_BYTES - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data or None


def explain(targets: Iterable[Target], keyed: bool, budget: float = PROBE_S) -> dict[str, tuple[str, str]]:
    """Probe hosts that did not answer (at most MAX_PROBES, in parallel); target name -> (kind, message) for
    those with something clearer to say."""
    chosen = list(targets)[:MAX_PROBES]
    if not chosen:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(chosen)), thread_name_prefix="probe") as pool:
        found = dict(zip((t.name for t in chosen), pool.map(lambda t: probe(t, keyed, budget), chosen)))
    return {name: verdict for name, verdict in found.items() if verdict is not None}
