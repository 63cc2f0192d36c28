"""Read a Chrome/Kineto trace (.json or .json.gz) one event at a time.

Two layouts, both of Chrome's Trace Event Format:
  * JSON Object Format (Kineto): {"schemaVersion": .., "distributedInfo": {..}, "traceEvents": [ {event}, ... ], ...};
    the other top-level keys (before and after the array) are parsed on the side into `header`;
  * JSON Array Format (torch_npu's trace_view.json): a bare [ {event}, ... ], whose closing "]" may be missing.
The events are decoded one by one from a sliding text buffer with the C JSON scanner, so a trace of hundreds of MB
never becomes one Python list. A file that ends early yields what it holds and then raises TraceError saying where
it stopped.

A trace comes from a capture folder anyone may have written (issue 41, 7): it is opened without blocking and must
be a regular file (a FIFO or /dev/zero hung the report), not through a link where the folder names it
(`nofollow`); what a gzip holds is read up to GZIP_RATIO times its size (a 1 MB gzip holding 1 GiB after the
events took 57 s and 2.7 GB), what precedes the events and what follows them up to MAX_PREFIX_CHARS and
MAX_SUFFIX_CHARS (1 GiB before "traceEvents" was searched again at every MiB read: quadratic).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import stat
from pathlib import Path
from typing import IO, Any, Iterator, cast

CHUNK = 1 << 20
MAX_EVENT_CHARS = 16 << 20  # no event is this long: a decode error with this much text left is corruption
MAX_PREFIX_CHARS = 64 << 20  # before "traceEvents": Kineto's header is a few KB (deviceProperties, distributedInfo)
MAX_SUFFIX_CHARS = 16 << 20  # after the events' "]": a few keys (traceName, displayTimeUnit, baseTimeNanoseconds)
GZIP_RATIO = 100  # a .gz is read up to this many times its size (traces compress 5-20 times) ...
GZIP_SLACK = 256 << 20  # ... plus this much (a small trace may compress better)
_KEY = re.compile(r'"traceEvents"\s*:\s*\[')
_KEY_TAIL = 64  # a chunk's end the key may straddle: searched again with the next chunk
_WS = " \t\r\n,"
_SKIP = re.compile(r"[ \t\r\n,]*")


class TraceError(ValueError):
    pass


def open_binary(path: Path, nofollow: bool = False) -> tuple[IO[bytes], int | None]:
    """A trace's bytes (decompressed for .gz) and how many may be read (None: the file's own size bounds it).
    Opened without blocking (a FIFO named like a trace hung the report) and never a link with `nofollow` (the
    name a capture folder's metadata gives); OSError unless it is a regular file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if nofollow and exc.errno == 40:  # ELOOP
            raise OSError(exc.errno, "a symbolic link (not followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        raw = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    if path.name.endswith(".gz"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb")), GZIP_SLACK + GZIP_RATIO * st.st_size
    return raw, None


def open_text(path: Path, nofollow: bool = False) -> io.TextIOBase:
    return io.TextIOWrapper(open_binary(path, nofollow)[0], encoding="utf-8", errors="replace")


class TraceReader:
    """Iterate `events()`; afterwards `header` holds the other top-level keys (distributedInfo, ...)."""

    def __init__(self, path: Path, nofollow: bool = False) -> None:
        self.path = path
        self.nofollow = nofollow  # the name a capture folder gave: never through a link
        self.header: dict[str, Any] = {}
        self.bytes_read = 0
        self.limit: int | None = None  # characters that may be read (a .gz: GZIP_RATIO times its size)
        self.array_format = False

    def events(self) -> Iterator[dict[str, Any]]:
        raw_decode = json.JSONDecoder().raw_decode
        try:
            binary, self.limit = open_binary(self.path, self.nofollow)
        except OSError as exc:
            raise TraceError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        fh = io.TextIOWrapper(binary, encoding="utf-8", errors="replace")
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
                if pos < n and buf[pos] in _WS:
                    pos = _SKIP.match(buf, pos).end()  # type: ignore[union-attr]  # (matches even nothing)
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
                    rest = buf[pos + 1:]
                    while len(rest) <= MAX_SUFFIX_CHARS:
                        more = self._read(fh)
                        if not more:
                            self._parse_suffix(rest)  # (longer: the header keys after the events are let go)
                            break
                        rest += more
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
        """Read up to the start of the "traceEvents" array, parse what precedes it, return what follows. Each
        chunk is searched once (with the tail of the one before, which the key may straddle), and no more than
        MAX_PREFIX_CHARS are read for it."""
        match = _KEY.search(buf)
        while match is None:
            if len(buf) > MAX_PREFIX_CHARS:
                raise TraceError(f"{self.path} has no \"traceEvents\" array in its first {MAX_PREFIX_CHARS >> 20} "
                                 "MiB (a Kineto trace's header is a few KB): not read further")
            more = self._read(fh)
            if not more:
                raise TraceError(f"{self.path} has no \"traceEvents\" array and is not a bare array of events "
                                 "(not a Chrome/Kineto trace)")
            start = max(0, len(buf) - _KEY_TAIL)
            buf += more
            match = _KEY.search(buf, start)
        self._parse_prefix(buf[:match.start()])
        return buf[match.end():]

    def _read(self, fh: io.TextIOBase) -> str:
        try:
            text = fh.read(CHUNK)
        except (OSError, EOFError) as exc:  # e.g. a gzip stream cut short
            raise TraceError(f"{self.path}: {exc} after {self.bytes_read} characters") from None
        self.bytes_read += len(text)
        if self.limit is not None and self.bytes_read > self.limit:
            raise TraceError(f"{self.path} decompresses to more than {self.limit >> 20} MiB ({GZIP_RATIO} times its "
                             "size and more): not read further")
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
