"""Property-based tests (hypothesis) of every parser that takes input from outside: the protocol decoder, the
trigger file parser, the rank grammar and the configuration parser. Each must either give a value of the
expected shape or refuse with its own error type; nothing else may escape (no RecursionError, OverflowError,
TypeError, ...). The running-daemon fuzz is tests/test_security.py::test_hostile_messages_never_kill_the_daemon...
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# the quick tier (conftest.py) holds every test here but the last, which starts a daemon: each marked

hypothesis = pytest.importorskip("hypothesis", reason="the test extra (pip install -e '.[test]') brings hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ondemand_prof.core.options import ConfigError, config_from_mapping  # noqa: E402
from ondemand_prof.core.protocol import INT_BOUNDS, INT_DEFAULT_BOUNDS, RANK_MESSAGES, ProtocolError, decode  # noqa: E402,E501
from ondemand_prof.core.ranks import MAX_LISTED, RankSpecError, parse_ranks  # noqa: E402
from ondemand_prof.core.requests import RequestError, parse_request  # noqa: E402
from ondemand_prof.core.safejson import UnsafeJSON, loads, nesting_depth  # noqa: E402
from ondemand_prof.host.client import REPLIES  # noqa: E402
from ondemand_prof.host.transport import SCHEMA  # noqa: E402
from ondemand_prof.rank.triggers import read_trigger  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest's helpers, for the daemon fuzz
from conftest import register_msg  # noqa: E402

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
        # text no terminal can print: lone surrogates, escaped or as (invalid) UTF-8 bytes, anywhere in a message
        st.tuples(st.sampled_from([b"\\ud800", b"\\uDFFF", b"\\udc80x", b"\xed\xa0\x80", b"\\ud83d\\ude00"]),
                  st.sampled_from([b'{"v":1,"type":"hb","step":1,"state":"i%s"}',
                                   b'{"v":1,"type":"event","capture_id":"c1","event":"failed","info":{"error":"%s"}}',
                                   b'{"v":1,"type":"register","job":"j","rank":0,"world_size":1,"host":"h","pid":1,'
                                   b'"step":0,"save_root":"/tmp/%s"}', b'{"v":1,"type":"status","id":1,"k%s":1}'])
                  ).map(lambda t: t[1].replace(b"%s", t[0])),
    )


@pytest.mark.quick
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
        # what was accepted is finite and shallow: re-encoding it is safe and strict; and printable (the CLI writes
        # UTF-8: a lone surrogate stored by the daemon made every ondemandctl that printed it fail)
        json.dumps(msg, allow_nan=False)
        json.dumps(msg, ensure_ascii=False).encode("utf-8")


REGISTER = {"v": 1, **register_msg(pid=1, step=0)}
del REGISTER["began"]  # the step last: a tail cut into the frame extends that integer, which the decoder bounds


def _required_ints_bounded(msg: dict[str, Any]) -> bool:
    """The integers in a message's required fields are within their bounds (the handlers do arithmetic on them)."""
    ints = {k: msg[k] for k in RANK_MESSAGES[msg["type"]] if type(msg[k]) is int}
    return all(INT_BOUNDS.get(k, INT_DEFAULT_BOUNDS)[0] <= v <= INT_BOUNDS.get(k, INT_DEFAULT_BOUNDS)[1]
               for k, v in ints.items())


@pytest.mark.quick
@FUZZ
@given(st.sampled_from(["rank", "world_size", "pid", "step"]),
       st.integers() | st.integers(-3, 1 << 23) | st.floats() | st.booleans())
def test_rank_messages_carry_ints_exactly_within_their_bounds(field: str, value: Any) -> None:
    lo, hi = INT_BOUNDS[field]
    ok = type(value) is int and lo <= value <= hi
    try:
        msg = decode(json.dumps({**REGISTER, field: value}).encode(), RANK_MESSAGES)
    except ProtocolError as exc:
        assert not ok, f"{field}={value!r} is within [{lo}, {hi}] but was refused: {exc}"
        if type(value) is int and len(str(value)) < 30:  # longer ones are refused as JSON, before the fields
            assert f"register: field '{field}' must be between {lo} and {hi}" in str(exc)
        return
    assert ok, f"{field}={value!r} is outside [{lo}, {hi}] (or not an integer) but was accepted"
    assert msg[field] == value


@pytest.mark.quick
@FUZZ
@given(st.binary(max_size=300))
def test_a_rank_message_cut_and_extended_is_refused_or_bounded(tail: bytes) -> None:
    frame = json.dumps(REGISTER).encode()[:-1] + tail
    try:
        msg = decode(frame, RANK_MESSAGES)
    except ProtocolError:
        return
    assert msg["type"] in RANK_MESSAGES and _required_ints_bounded(msg), msg


@pytest.mark.quick
@FUZZ
@given(st.lists(st.from_regex(r"-?[0-9]{1,40}(\.[0-9]{1,40})?([eE][+-]?[0-9]{1,4})?", fullmatch=True),
                min_size=1, max_size=4))
def test_numbers_are_taken_or_refused_as_the_checking_decoder_does(numbers: list[str]) -> None:
    """loads() parses text without long numbers with json's own number parsers: the values and the refusals must
    be those of the decoder that checks every number (its hooks)."""
    from ondemand_prof.core import safejson

    text = "[" + ",".join(numbers) + "]"
    try:
        expected: Any = safejson._DECODER.decode(text)  # noqa: SLF001 - the reference
    except ValueError:
        expected = UnsafeJSON
    try:
        got: Any = loads(text.encode(), 10**6)
    except UnsafeJSON:
        got = UnsafeJSON
    assert got == expected, text


@pytest.mark.quick
def test_only_utf8_without_lone_surrogates_is_taken() -> None:
    """UTF-8 only (a byte-order mark allowed): UTF-16 hid brackets from the depth scan (an escaped quote read as
    UTF-8), and a lone surrogate, escaped or raw, could be stored and printed to other users."""
    deep = "[" * 100 + "]" * 100
    for raw in [deep.encode("utf-16"), deep.encode("utf-32-le"), json.dumps({"a": "x"}).encode("utf-16-le"),
                b'{"a":"idle\\ud800"}', b'{"k\\udfff":1}', b'["\\uD83D"]', b'{"a":"\xed\xa0\x80"}', "[\"\udc80\"]"]:
        with pytest.raises(UnsafeJSON):
            loads(raw, 1 << 20)
    assert loads(b'{"a":"\\ud83d\\ude00 \\u00e9"}', 1 << 20) == {"a": "\U0001f600 \u00e9"}  # a pair is one character
    assert loads(b'\xef\xbb\xbf{"a":"\xc3\xa9"}', 1 << 20) == {"a": "\u00e9"}  # UTF-8 with a byte-order mark
    assert loads(b'{"a":"\\\\ud800"}', 1 << 20) == {"a": "\\ud800"}  # an escaped backslash, not an escape


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


# ----------------------------------------------------------------------------------------------------------
# Every field of every rank message, against a real daemon, then the CLI (issue 18)

HOSTILE_TEXT = st.sampled_from(["\x1b[2J\x1b[H", "\x1b]0;owned\x07", "a\rb", "\u202egnp.exe", "\x00", "../../etc/x",
                                "/etc/shadow", "x" * 5000, "", " ", "auto-1-r0-1", "\x9b31m", "\ud7ff\ufeff"])
CONTROL_TEXT = st.text(alphabet=st.characters(max_codepoint=0x9F), min_size=1, max_size=20)  # mostly controls
wire_values = st.one_of(json_values, HOSTILE_TEXT, CONTROL_TEXT,
                        st.lists(st.one_of(HOSTILE_TEXT, st.integers(), json_values), max_size=4),
                        st.dictionaries(st.sampled_from(["x", "path", "error", "capture_id", "start", "end"]),
                                        st.one_of(HOSTILE_TEXT, json_values), max_size=3))
EVENT_INFO_KEYS = ["path", "error", "late_by", "steps", "window", "status", "current_step", "note", "cancelled", "x"]
RANK_FIELDS: dict[str, list[str]] = {
    "register": ["job", "rank", "world_size", "host", "pid", "step", "local_rank", "save_root", "trigger_dir",
                 "version", "recent", "defaults", "native_dump", "began", "step_time", "state", "windows"],
    "hb": ["step", "began", "step_time", "state", "windows"],
    "event": ["capture_id", "event", "info"],
    "auto_capture": ["window"],
    "triage_result": ["result"],
}
_CONTROL_OUT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]")


def rank_messages() -> st.SearchStrategy[tuple[str, dict]]:
    """One rank message: a well-formed base with some of its fields replaced by hostile values (event info and
    windows field by field as well)."""
    def build(kind: str) -> st.SearchStrategy[tuple[str, dict]]:
        fields = st.dictionaries(st.sampled_from(RANK_FIELDS[kind]), wire_values, max_size=4)
        info = st.dictionaries(st.sampled_from(EVENT_INFO_KEYS), st.one_of(HOSTILE_TEXT, CONTROL_TEXT, wire_values),
                               max_size=4)
        windows = st.lists(st.dictionaries(st.sampled_from(["capture_id", "start", "end", "source", "state"]),
                                           wire_values, max_size=5), max_size=3)
        return st.tuples(st.just(kind), fields, info, windows, st.sampled_from(PART_EVENTS))
    return st.sampled_from(list(RANK_FIELDS)).flatmap(build)


PART_EVENTS = ["received", "scheduled", "recording", "writing", "done", "failed", "rejected", "cancelled", "bogus"]


@pytest.fixture(scope="module")
def fuzz_daemon() -> Any:
    import shutil
    import zmq

    from conftest import short_dir, start_daemon
    from ondemand_prof.core.options import WindowOptions, make_config_class
    from ondemand_prof.core.requests import WindowDefaults

    run, state = short_dir("odpfz"), short_dir("odpfzs")
    proc = start_daemon(run, state, "--log-level", "ERROR")
    ctx = zmq.Context()
    rank = ctx.socket(zmq.DEALER)
    rank.setsockopt(zmq.LINGER, 0)
    rank.connect(f"ipc://{run}/profd.sock")
    config = make_config_class()()
    base = {"v": 1, **register_msg(0, 2, job="fz", pid=os.getpid(), step=5, save_root=str(state),
                                   defaults=WindowDefaults.from_config(config).to_wire())}
    del base["began"]  # (a rank that says no step time, as this base always was)
    env = {"run": run, "proc": proc, "rank": rank, "base": base, "ctx": ctx, "capture": None,
           "options": WindowOptions.from_config(config)}
    yield env
    ctx.destroy(linger=0)
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    assert "Traceback" not in err, err[-3000:]


def _cli(run: Path, *args: str) -> tuple[int, str]:
    """ondemandctl in this process (its output through its own choke point); what it printed, stdout and stderr."""
    import contextlib
    import io

    from ondemand_prof.host import ctl

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ctl.main([*args, "--runtime-dir", str(run)])
    return code, out.getvalue() + err.getvalue()


def _drain(rank: Any, wait_ms: int = 0) -> list[dict]:
    got = []
    while rank.poll(wait_ms):
        got.append(json.loads(rank.recv()))
        wait_ms = 0
    return got


def _fresh_capture(env: dict) -> str:
    """Registered as the base rank, with a running capture whose part is ours to move."""
    rank = env["rank"]
    rank.send(json.dumps(env["base"]).encode())
    _drain(rank, 2000)
    code, text = _cli(env["run"], "capture", "--job", "fz", "--ranks", "0", "--steps", "1", "--no-wait", "--json")
    assert code == 0, text
    cid = json.loads(text)["capture_id"]
    _drain(rank, 2000)
    return cid


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(rank_messages())
def test_every_rank_message_field_against_the_daemon_and_the_cli(fuzz_daemon: dict, case: tuple) -> None:
    import threading

    env = fuzz_daemon
    rank, run = env["rank"], env["run"]
    kind, fields, info, windows, event = case
    cid = env["capture"]
    if cid is None or json.loads(_cli(run, "show", cid, "--json")[1])["status"] != "running":
        cid = env["capture"] = _fresh_capture(env)  # parts only move forward: a final one is done being fuzzed
    msg: dict = {"register": dict(env["base"]), "hb": {"v": 1, "type": "hb", "step": 6, "windows": windows},
                 "event": {"v": 1, "type": "event", "capture_id": cid, "event": event, "info": info},
                 "auto_capture": {"v": 1, "type": "auto_capture", "window": {
                     "capture_id": f"auto-fz-{time.monotonic_ns()}-r0-{os.getpid()}", "start_step": 50,
                     "end_step": 52, "options": env["options"].as_dict(), "requested": {"auto": info}}},
                 "triage_result": {"v": 1, "type": "triage_result", "triage_id": "x", "result": info}}[kind]
    if kind == "register":
        msg["windows"] = windows
        msg["recent"] = [{"capture_id": cid, "event": event, "info": info}]
    msg.update(fields)
    stacks: dict = {}
    if kind == "triage_result":  # a pending stacks request that this rank's (fuzzed) answer completes
        thread = threading.Thread(target=lambda: stacks.update(zip(("code", "text"), _cli(
            run, "stacks", "--job", "fz", "--ranks", "0", "--timeout", "1"))))
        thread.start()
        ask = next((m for m in _drain(rank, 3000) if m.get("type") == "triage"), None)
        if ask is not None:
            msg["triage_id"] = ask["triage_id"]
        rank.send(json.dumps(msg).encode())
        thread.join(30)
        assert not thread.is_alive()
    else:
        rank.send(json.dumps(msg).encode())
    rank.send(json.dumps({"v": 1, "type": "hb", "step": 7}).encode())
    _drain(rank, 50)
    assert env["proc"].poll() is None, "the daemon died"
    outputs = [_cli(run, "status"), _cli(run, "list"), _cli(run, "show", cid), _cli(run, "status", "--json")]
    if stacks:
        outputs.append((stacks["code"], stacks["text"]))
    for code, text in outputs:
        assert code in (0, 1, 3, 5), text  # an answer, or a clear error; never a traceback (2: usage, 4: no daemon)
        assert "Traceback" not in text and "malformed" not in text, text[-2000:]
        assert not _CONTROL_OUT.search(text), repr(text[-500:])  # every control character escaped
    if kind == "register":  # back to the well-formed rank for the next example
        rank.send(json.dumps(env["base"]).encode())
        _drain(rank, 200)
