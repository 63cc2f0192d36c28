"""Text from peers, made safe to print on a terminal.

Host names, errors, notes, paths and stack frames in ondemandctl's output come from ranks (any user of a
`--group` daemon) and from trace files. A control character in them could move the cursor, rewrite earlier
lines, change the terminal's title or hide text; printable() shows each one as an escape (`\\x1b`, `\\u202e`)
instead. Newlines and tabs stay: they are the layout of what we print.
"""

from __future__ import annotations

import re
from typing import Any, TextIO

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode formatting characters that reorder or hide
# text (bidirectional overrides and isolates, zero-width marks, the BOM)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: Any) -> str:
    """`text` with every control character but newline and tab shown as an escape."""
    return _CONTROL.sub(_escape, text if isinstance(text, str) else str(text))


class PrintableStream:
    """A text stream that escapes control characters in whatever is written to it (ondemandctl's stdout and
    stderr: the one place all its output passes)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer...: the wrapped stream's
        return getattr(self._stream, name)


class printable_streams:
    """While active, sys.stdout and sys.stderr escape control characters (ondemandctl's main: every line it
    prints, its errors and argparse's included, passes here)."""

    def __enter__(self) -> "printable_streams":
        import sys

        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = PrintableStream(sys.stdout), PrintableStream(sys.stderr)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import sys

        sys.stdout, sys.stderr = self._saved
