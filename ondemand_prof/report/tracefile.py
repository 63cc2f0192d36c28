"""Read a Chrome/Kineto trace (.json or .json.gz) one event at a time.

Two layouts, both of Chrome's Trace Event Format:
  * JSON Object Format (Kineto): {"schemaVersion": .., "distributedInfo": {..}, "traceEvents": [ {event}, ... ], ...};
    the other top-level keys (before and after the array) are parsed on the side into `header`;
  * JSON Array Format (torch_npu's trace_view.json): a bare [ {event}, ... ], whose closing "]" may be missing.
The events are decoded one by one from a sliding text buffer with the C JSON scanner, so a trace of hundreds of MB
never becomes one Python list. A file that ends early yields what it holds and then raises TraceError saying where
it stopped.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from pathlib import Path
from typing import Any, Iterator

CHUNK = 1 << 20
MAX_EVENT_CHARS = 16 << 20  # no event is this long: a decode error with this much text left is corruption
_KEY = re.compile(r'"traceEvents"\s*:\s*\[')
_WS = " \t\r\n,"


class TraceError(ValueError):
    pass


def open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


class TraceReader:
    """Iterate `events()`; afterwards `header` holds the other top-level keys (distributedInfo, ...)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header: dict[str, Any] = {}
        self.bytes_read = 0
        self.array_format = False

    def events(self) -> Iterator[dict[str, Any]]:
        raw_decode = json.JSONDecoder().raw_decode
        try:
            fh = open_text(self.path)
        except OSError as exc:
            raise TraceError(f"cannot open {self.path}: {exc.strerror}") from None
        with fh:
            buf = self._read(fh)
            if not buf.strip():
                raise TraceError(f"{self.path} is empty")
            buf = buf.lstrip("\ufeff")  # a byte-order mark some Windows tools write
            bare = buf.lstrip().startswith("[")
            if bare:  # JSON Array Format
                self.array_format = True
                buf = buf[buf.index("[") + 1:]
            else:
                buf = self._skip_to_events(fh, buf)
            pos, eof = 0, False
            while True:
                n = len(buf)
                while pos < n and buf[pos] in _WS:
                    pos += 1
                if pos >= n:
                    if eof and bare:  # the format allows leaving out the closing bracket
                        return
                    if eof:
                        raise TraceError(self._stopped(pos, "the file ends inside the event list"))
                    more = self._read(fh)
                    eof = not more
                    buf, pos = buf[pos:] + more, 0
                    continue
                if buf[pos] == "]":
                    self._parse_suffix(buf[pos + 1:] + fh.read())
                    return
                try:
                    event, pos = raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if eof or n - pos > MAX_EVENT_CHARS:
                        raise TraceError(self._stopped(pos, exc.msg)) from None
                    more = self._read(fh)
                    eof = not more
                    buf, pos = buf[pos:] + more, 0
                    continue
                if type(event) is dict:
                    yield event
                if pos > CHUNK:  # keep the buffer small: drop what has been decoded
                    buf, pos = buf[pos:], 0

    def _skip_to_events(self, fh: io.TextIOBase, buf: str) -> str:
        """Read up to the start of the "traceEvents" array, parse what precedes it, return what follows."""
        match = _KEY.search(buf)
        while match is None:
            more = self._read(fh)
            if not more:
                raise TraceError(f"{self.path} has no \"traceEvents\" array and is not a bare array of events "
                                 "(not a Chrome/Kineto trace)")
            buf += more
            match = _KEY.search(buf)
        self._parse_prefix(buf[:match.start()])
        return buf[match.end():]

    def _read(self, fh: io.TextIOBase) -> str:
        try:
            text = fh.read(CHUNK)
        except (OSError, EOFError) as exc:  # e.g. a gzip stream cut short
            raise TraceError(f"{self.path}: {exc} after {self.bytes_read} characters") from None
        self.bytes_read += len(text)
        return text

    def _stopped(self, pos: int, why: str) -> str:
        return (f"{self.path} is truncated or corrupt ({why}; read {self.bytes_read} characters): the events before "
                "that point are used")

    def _parse_prefix(self, text: str) -> None:
        text = text.strip().rstrip(",")
        if not text.startswith("{"):
            return
        try:
            obj = json.loads(text + "}") if text != "{" else {}
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            self.header.update(obj)

    def _parse_suffix(self, text: str) -> None:
        text = text.strip().lstrip(",").strip()
        if not text or text == "}":
            return
        try:
            obj = json.loads("{" + text)
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            self.header.update(obj)
