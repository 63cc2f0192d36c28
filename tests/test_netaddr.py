"""HOST:PORT parsers (issue 41): core/netaddr.py split_host_port and port_number are the one splitter and port
reader of --listen (host/transport.py parse_listen), --metrics (host/metrics_http.py parse_address) and --hosts
(host/hosts.py parse_hosts). Each parser keeps exactly what it accepted and refused, and its own error type and
message, before the split was shared: the tables below were made by the parsers before it (quirks included: a
port 0 is taken by --listen and --metrics, not by --hosts; tcp://::1 reads as host ':' and port 1; other
scripts' decimal digits are read; a superscript digit raises ValueError). A change of any row is a change of
the command line's behaviour, to be made on purpose."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from ondemand_prof.core.netaddr import port_number, split_host_port
from ondemand_prof.host.hosts import parse_hosts
from ondemand_prof.host.metrics_http import parse_address
from ondemand_prof.host.transport import parse_listen

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


def outcome(parse: Callable[[str], Any], text: str) -> tuple[str, Any]:
    """("ok", what `parse` returned: targets as (name, host, port)) or (the error's type, its message)."""
    try:
        out = parse(text)
    except Exception as exc:  # noqa: BLE001 (the type is what is compared)
        return type(exc).__name__, str(exc)
    if isinstance(out, list):
        out = [(t.name, t.host, t.port) for t in out]
    return "ok", out


LISTEN: list[tuple[str, tuple[str, Any]]] = [
    ('tcp://0.0.0.0:7355', ('ok', ('0.0.0.0', 7355))),
    ('tcp://[::1]:7355', ('ok', ('[::1]', 7355))),
    ('tcp://::1:7355', ('ok', ('::1', 7355))),
    ('tcp://::1', ('ok', (':', 1))),
    ('tcp://[::1]', ('DaemonError', "--listen 'tcp://[::1]': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://host', ('DaemonError', "--listen 'tcp://host': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://host:', ('DaemonError', "--listen 'tcp://host:': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://:7355', ('DaemonError', "--listen 'tcp://:7355': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://host:0', ('ok', ('host', 0))),
    ('tcp://host:65535', ('ok', ('host', 65535))),
    ('tcp://host:65536',
     ('DaemonError', "--listen 'tcp://host:65536': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('', ('DaemonError', "--listen '': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://', ('DaemonError', "--listen 'tcp://': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('0.0.0.0:7355', ('DaemonError', "--listen '0.0.0.0:7355': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://host:+1', ('DaemonError', "--listen 'tcp://host:+1': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://host:٣', ('ok', ('host', 3))),
    ('tcp://[::1]x:80', ('ok', ('[::1]x', 80))),
    ('tcp://a:b:80', ('ok', ('a:b', 80))),
    ('tcp://host:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    ('tcp://:²', ('DaemonError', "--listen 'tcp://:²': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp:/:1', ('DaemonError', "--listen 'tcp:/:1': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
    ('tcp://²', ('DaemonError', "--listen 'tcp://²': expected tcp://HOST:PORT, e.g. tcp://0.0.0.0:7355")),
]


HINT = (": expected HOST:PORT (e.g. 127.0.0.1:9464, or 0.0.0.0:9464 for every interface) or a port alone "
        "(loopback)")  # --metrics' message after its text

METRICS: list[tuple[str, tuple[str, Any]]] = [
    ('127.0.0.1:9464', ('ok', ('127.0.0.1', 9464))),
    ('9464', ('ok', ('127.0.0.1', 9464))),
    ('[::1]:9464', ('ok', ('::1', 9464))),
    ('::1:9464', ('ok', ('::1', 9464))),
    ('::1', ('ok', (':', 1))),
    ('[::1]', ('MetricsError', "--metrics '[::1]'" + HINT)),
    ('host', ('MetricsError', "--metrics 'host'" + HINT)),
    ('host:', ('MetricsError', "--metrics 'host:'" + HINT)),
    (':9464', ('ok', ('127.0.0.1', 9464))),
    ('host:0', ('ok', ('host', 0))),
    ('0', ('ok', ('127.0.0.1', 0))),
    ('host:65535', ('ok', ('host', 65535))),
    ('host:65536', ('MetricsError', "--metrics 'host:65536'" + HINT)),
    ('', ('MetricsError', "--metrics ''" + HINT)),
    ('[]:80', ('MetricsError', "--metrics '[]:80'" + HINT)),
    ('[::1]x:80', ('ok', ('::1]x', 80))),
    ('٣', ('ok', ('127.0.0.1', 3))),
    ('[[::1]]:80', ('ok', ('::1', 80))),
    ('a:b:80', ('ok', ('a:b', 80))),
    (':', ('MetricsError', "--metrics ':'" + HINT)),
    ('host:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    (':²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    ('[]:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    ('[::1]:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
]


HOSTS: list[tuple[str, tuple[str, Any]]] = [
    ('node01', ('ok', [('node01', 'node01', 7355)])),
    ('node01:7356', ('ok', [('node01:7356', 'node01', 7356)])),
    ('[::1]:7355', ('ok', [('[::1]:7355', '::1', 7355)])),
    ('[fe80::1]', ('ok', [('[fe80::1]', 'fe80::1', 7355)])),
    ('[::1', ('HostSpecError', "'[::1': '[' without ']'")),
    ('::1', ('HostSpecError', "':' (from '::1') is not a host name")),
    ('::1:7355', ('HostSpecError', "'::1' (from '::1:7355') is not a host name")),
    ('node:', ('ok', [('node', 'node', 7355)])),
    ('node:0', ('HostSpecError', "'node:0': port '0' is not a number from 1 to 65535")),
    ('node:65535', ('ok', [('node:65535', 'node', 65535)])),
    ('node:65536', ('HostSpecError', "'node:65536': port '65536' is not a number from 1 to 65535")),
    ('', ('ok', [])),
    ('node[01-02]:7400', ('ok', [('node01:7400', 'node01', 7400), ('node02:7400', 'node02', 7400)])),
    ('[::1]x', ('HostSpecError', "'[::1]x': expected [IPv6]:PORT")),
    ('[::1]:x', ('HostSpecError', "'[::1]:x': port 'x' is not a number from 1 to 65535")),
    ('[zz::]:80', ('HostSpecError', "'[zz::]:80': 'zz::' is not an IPv6 address")),
    ('a:b:c', ('HostSpecError', "'a:b:c': port 'c' is not a number from 1 to 65535")),
    ('[::1]:80]', ('HostSpecError', "'[::1]:80]': ']' without '['")),
    ('node[1-2]', ('ok', [('node1', 'node1', 7355), ('node2', 'node2', 7355)])),
    ('[::1]:0', ('HostSpecError', "'[::1]:0': port '0' is not a number from 1 to 65535")),
    ('n:٣', ('ok', [('n:3', 'n', 3)])),
    (':80', ('HostSpecError', "'' (from ':80') is not a host name")),
    ('a,[::1]:9,b:3', ('ok', [('a', 'a', 7355), ('[::1]:9', '::1', 9), ('b:3', 'b', 3)])),
    ('n:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    ('[::1]:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    ('[zz]:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
    ('bad name:²', ('ValueError', "invalid literal for int() with base 10: '²'")),
]


@pytest.mark.parametrize("parse, table", [(parse_listen, LISTEN), (parse_address, METRICS), (parse_hosts, HOSTS)],
                         ids=["listen", "metrics", "hosts"])
def test_each_parser_accepts_and_refuses_what_it_did(parse: Callable[[str], Any],
                                                     table: list[tuple[str, tuple[str, Any]]]) -> None:
    assert [(text, outcome(parse, text)) for text, _ in table] == table


def test_the_splitter_and_the_port_reader() -> None:
    assert split_host_port("h:1") == ("h", "1") and split_host_port("a:b:") == ("a:b", "")
    assert split_host_port("h") == ("h", None) and split_host_port("") == ("", None)
    assert split_host_port("[::1]:80") == ("[::1]", "80") and split_host_port("[::1]") == ("[:", "1]")
    assert split_host_port("[::1]", brackets=True) == ("[::1]", None)
    assert split_host_port("[::1]:80", brackets=True) == ("[::1]", "80")
    assert split_host_port("node[01-02]:7", brackets=True) == ("node[01-02]", "7")
    assert [port_number(p) for p in ("0", "65535", "65536", "", "-1", "+1", " 1", "\u0663")] == \
        [0, 65535, None, None, None, None, None, 3]
    assert port_number("0", lowest=1) is None and port_number("1", lowest=1) == 1
    with pytest.raises(ValueError):
        port_number("\u00b2")
