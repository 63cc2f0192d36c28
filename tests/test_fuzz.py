"""Property-based tests (hypothesis) of every parser that takes input from outside: the protocol decoder, the
trigger file parser, the rank grammar and the configuration parser. Each must either give a value of the
expected shape or refuse with its own error type; nothing else may escape (no RecursionError, OverflowError,
TypeError, ...). The running-daemon fuzz is tests/test_security.py::test_hostile_messages_never_kill_the_daemon...
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the test extra (pip install -e '.[test]') brings hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ondemand_prof.core.options import ConfigError, config_from_mapping  # noqa: E402
from ondemand_prof.core.protocol import RANK_MESSAGES, ProtocolError, decode  # noqa: E402
from ondemand_prof.core.ranks import MAX_LISTED, RankSpecError, parse_ranks  # noqa: E402
from ondemand_prof.core.requests import RequestError, parse_request  # noqa: E402
from ondemand_prof.core.safejson import UnsafeJSON, loads, nesting_depth  # noqa: E402
from ondemand_prof.host.client import REPLIES  # noqa: E402
from ondemand_prof.host.transport import SCHEMA  # noqa: E402
from ondemand_prof.rank.triggers import read_trigger  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text()
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=5) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=30)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def frames() -> st.SearchStrategy[bytes]:
    """Random bytes, JSON of any shape (NaN included), messages with hostile fields, truncations, nesting."""
    message = st.fixed_dictionaries({"v": st.sampled_from([1, 1, 2, "1", None]),
                                     "type": st.sampled_from([*SCHEMA, "nope", 3])},
                                    optional={"id": json_values, "job": json_values, "rank": json_values,
                                              "world_size": json_values, "host": json_values, "pid": json_values,
                                              "step": json_values, "capture_id": json_values, "seen": json_values,
                                              "request": json_values, "event": json_values, "info": json_values})
    as_bytes = message.map(lambda m: json.dumps(m).encode())
    return st.one_of(
        st.binary(max_size=2000),
        json_values.map(lambda v: json.dumps(v).encode()),
        as_bytes,
        as_bytes.flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # truncated
        st.integers(1, 100_000).map(nested),
        st.integers(60, 5000).map(lambda n: b'{"v":1,"type":"status","id":' + nested(n) + b"}"),
        st.integers(1, 6000).map(lambda n: b'{"v":1,"type":"hb","step":' + b"9" * n + b"}"),
        st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e400", b'{"v":1,"type":"hb","step":1e999}']),
    )


@FUZZ
@given(frames())
def test_protocol_decoder_accepts_or_refuses_cleanly(frame: bytes) -> None:
    for schema, limit in ((SCHEMA, 64 * 1024), (REPLIES, 256 * 1024)):
        try:
            msg = decode(frame, schema, limit)
        except ProtocolError:
            continue
        assert isinstance(msg, dict) and msg["type"] in schema
        for name in schema[msg["type"]]:
            assert name in msg
        # what was accepted is finite and shallow: re-encoding it is safe and strict
        json.dumps(msg, allow_nan=False)


@FUZZ
@given(st.binary(max_size=300))
def test_rank_messages_never_carry_absurd_ints(tail: bytes) -> None:
    base = {"v": 1, "type": "register", "job": "j", "rank": 0, "world_size": 1, "host": "h", "pid": 1, "step": 0}
    for field in ("rank", "world_size", "pid", "step"):
        for value in (-(10**30), 10**30, 2**63, -2):
            with pytest.raises(ProtocolError):
                decode(json.dumps({**base, field: value}).encode(), RANK_MESSAGES)
    try:
        decode(json.dumps(base).encode()[:-1] + tail, RANK_MESSAGES)
    except ProtocolError:
        pass


@FUZZ
@given(st.integers(1, 200_000), st.integers(0, 3))
def test_nesting_depth_is_measured_without_recursion(depth: int, kind: int) -> None:
    raw = [nested(depth), b"{\"a\":" * depth + b"1" + b"}" * depth,
           b'"[[[[' + b"[" * depth + b'"', b"[" * depth][kind]
    if kind == 2:
        assert nesting_depth(raw) == 0  # brackets inside a string do not nest
    try:
        value = loads(raw, 10**7)
    except UnsafeJSON:
        assert depth > 64 or kind == 3
    else:
        assert kind == 2 or depth <= 64


@FUZZ
@given(st.one_of(st.binary(max_size=3000), json_values.map(lambda v: json.dumps(v).encode()),
                 st.integers(1, 80_000).map(nested),
                 st.sampled_from([b'{"steps": NaN}', b'{"ranks": "0-20000000"}', b'{"steps": 1e999}',
                                  b'{"start_step": ' + b"9" * 50 + b"}", b"\xff\xfe", b"   ", b""])))
def test_trigger_parser_never_raises(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = Path(tmp_path_factory.mktemp("trig")) / "capture"
    path.write_bytes(raw)
    trig = read_trigger(path)
    assert trig is not None
    if trig.error is not None:
        assert trig.data is None and isinstance(trig.error, str)
        return
    assert isinstance(trig.data, dict)
    try:
        request = parse_request(trig.data)
    except RequestError as exc:
        assert str(exc)
        return
    if request.ranks is not None:
        assert len(request.ranks) <= MAX_LISTED


rank_items = st.one_of(st.integers(-5, 2**40), st.text(alphabet="0123456789-, ", max_size=30),
                       st.booleans(), st.floats(), st.none())


@FUZZ
@given(st.one_of(rank_items, st.lists(rank_items, max_size=6)), st.one_of(st.none(), st.integers(1, 1 << 20)))
def test_rank_grammar_is_bounded(spec: object, world: int | None) -> None:
    try:
        ranks = parse_ranks(spec, world_size=world)
    except RankSpecError as exc:
        assert str(exc)
        return
    assert ranks == (-1,) or (0 < len(ranks) <= MAX_LISTED and all(0 <= r < (world or 1 << 20) for r in ranks))


config_values = st.one_of(json_leaf, st.lists(json_leaf, max_size=3), st.dictionaries(st.text(max_size=5), json_leaf,
                                                                                        max_size=2))
config_keys = st.sampled_from(["profile", "profile_step_start", "profile_step_end", "profile_ranks", "profile_level",
                               "profile_export_type", "profile_with_stack", "profile_save_path",
                               "profile_max_window_steps", "profile_trigger_poll", "profile_signal",
                               "profile_file_mode", "profile_min_free_mb", "unknown_key"])


@FUZZ
@given(st.dictionaries(config_keys, config_values, max_size=6))
def test_config_parser_accepts_or_names_the_bad_option(values: dict) -> None:
    try:
        config = config_from_mapping({"training": values})
    except ConfigError as exc:
        assert str(exc)
        return
    for name in ("step_start", "step_end", "max_window_steps", "min_free_mb", "file_mode"):
        value = getattr(config, name)
        assert isinstance(value, int) and not isinstance(value, bool)
    assert math.isfinite(config.trigger_poll_s)
