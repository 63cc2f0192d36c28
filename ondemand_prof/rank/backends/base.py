"""What every backend provides. A backend opens one Session per window; the hook drives it from the training thread.

Session protocol (all calls on the training thread):
    warmup(step)  begin the backend without recording; `step` will be discarded
    record(step)  the boundary before recorded step `step` (the first one starts recording)
    finish()      stop collection and return an Export to run on the background worker
    abort()       stop whatever is running, dropping the data; never raises
"""

from __future__ import annotations


from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from ...core.window import Window



@dataclass(frozen=True)
class Identity:
    """Who is profiling: fixed per process, resolved once torch.distributed is up (or from RANK)."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    job_id: str
    dist_initialized: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "host": self.host,
            "pid": self.pid,
            "job_id": self.job_id,
        }


@dataclass(frozen=True)
class Written:
    """What an Export wrote: the directory to publish, and the raw Chrome trace in it to post-process (None
    when the backend's own tools already wrote its final files, as torch_npu's analyse does)."""

    directory: Path
    raw_trace: Path | None = None


@dataclass
class Export:
    """What a finished window hands to the background worker.

    write(staging_dir) writes the backend's files (off the training thread) and says what it wrote.
    """

    write: Callable[[Path], Written]
    info: dict[str, Any] = field(default_factory=dict)


class Session(Protocol):
    def warmup(self, step: int) -> None: ...

    def record(self, step: int) -> None: ...

    def finish(self) -> Export: ...

    def abort(self) -> None: ...


class Backend(Protocol):
    name: str

    def open(self, window: Window, identity: Identity, staging: Path | None = None) -> Session: ...

    def versions(self) -> dict[str, str]: ...


