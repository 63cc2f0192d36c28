"""HOST:PORT text: the one place it is split, and a port's number read (issue 41). The parsers on top keep their
own rules, error types and messages: host/transport.py parse_listen (tcp://HOST:PORT for --listen; a [v6] host
keeps its brackets), host/metrics_http.py parse_address (--metrics: HOST:PORT or a port alone; a [v6] host
unwrapped) and host/hosts.py (--hosts: host[:PORT] with bracket ranges, or a checked [IPv6] literal)."""

from __future__ import annotations

MAX_PORT = 65535


def split_host_port(text: str, *, brackets: bool = False) -> tuple[str, str | None]:
    """`text` split at its last ':' into (HOST, PORT text), neither checked (either may be empty, PORT may be no
    number); PORT is None where there is no ':' to split at. With `brackets`, only a ':' after the last ']' splits
    (the ':' of `[fe80::1]` and the brackets of `node[01-04]` are not a port's)."""
    if ":" not in (text.rsplit("]", 1)[-1] if brackets else text):
        return text, None
    host, _, port = text.rpartition(":")
    return host, port


def port_number(text: str, lowest: int = 0) -> int | None:
    """The port `text` names, `lowest` to MAX_PORT; None where it names none (not all digits, out of range). As
    str.isdigit() and int() read digits: other scripts' decimal digits count; a digit int() cannot read (a
    superscript) raises ValueError."""
    if not text.isdigit():
        return None
    port = int(text)
    return port if lowest <= port <= MAX_PORT else None
