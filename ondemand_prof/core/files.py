"""Small file and process helpers every process uses: one timestamp form, atomic JSON writes, pid checks."""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def iso_time(t: float | None = None) -> str:
    """Local time with offset, to the millisecond, of epoch seconds `t` (now by default): every timestamp we
    write (metadata, status files, capture records) has this one form."""
    return _dt.datetime.fromtimestamp(time.time() if t is None else t).astimezone().isoformat(
        timespec="milliseconds")


def write_json_atomic(path: Path, data: Any, compact: bool = False, mode: int = 0o600) -> None:
    """Readers see the old file or the new one, never a partial one. The temporary file has an unpredictable
    name and is created exclusively (mkstemp: O_EXCL, so a planted symlink is never written through), and the
    final name is replaced, never opened: a symlink there is replaced, not followed."""
    text = json.dumps(data, separators=(",", ":"), default=str) if compact else \
        json.dumps(data, indent=2, sort_keys=True, default=str)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if mode != 0o600:
                os.fchmod(fh.fileno(), mode)
            fh.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_nofollow(path: Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of a file, never through a symbolic link; None when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def pid_alive(pid: int, thorough: bool = False) -> bool:
    """Whether a process runs; `thorough` also rules out a zombie (a killed rank its launcher has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if thorough:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return True  # no /proc here: trust kill()
    return True
