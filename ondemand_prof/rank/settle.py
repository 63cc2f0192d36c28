"""Rank, world size and job settle when torch.distributed does.

A profiler is often built before the process group exists (a Lightning callback's __init__, a script that
parses flags first): it then knows only what the launcher put in the environment, which may be nothing yet
(Lightning's rank 0 is the launcher process itself). The agent thread asks every SETTLE_POLL_S whether the
group is up; once it is, the ranks agree on one job id through the group's store (rank 0's id wins) and the
agent moves the rank to that job's trigger directory and registers it with the daemon again.

Nothing here blocks: a rank that does not see rank 0's id yet asks again at the next poll, and after
AGREE_TIMEOUT_S takes its own launcher-derived id (rank 0 may run without the on-demand agent).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from ..core.options import default_job_id

log = logging.getLogger("ondemand_prof")

SETTLE_POLL_S = 0.5
AGREE_TIMEOUT_S = 30.0
STORE_KEY = "ondemand_prof/job_id"


def dist_rank() -> int | None:
    """This process's rank once torch.distributed is initialised, else None. Never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a half-torn-down group: not settled
        pass
    return None


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()  # noqa: SLF001 - the one handle on the group's store
    except Exception:  # noqa: BLE001 - no store (a group without one, or a torch that lacks the call)
        return None


class JobAgreement:
    """Agree one job id across the ranks of a process group, without blocking (poll it until not None)."""

    def __init__(self, fixed: str = "", timeout_s: float = AGREE_TIMEOUT_S) -> None:
        self.fixed = fixed  # the user named the job: nothing to agree
        self.timeout_s = timeout_s
        self._since: float | None = None

    def poll(self, rank: int) -> str | None:
        if self.fixed:
            return self.fixed
        mine = default_job_id()  # now: the launcher's environment is complete once the group is up
        store = _default_store()
        if store is None:
            return mine
        try:
            if rank == 0:
                store.set(STORE_KEY, mine)
                return mine
            if store.check([STORE_KEY]):
                return bytes(store.get(STORE_KEY)).decode("utf-8", "replace") or mine
        except Exception as exc:  # noqa: BLE001 - a store that fails: keep our own id
            log.debug("ondemand_prof: job id agreement failed: %s", exc)
            return mine
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since >= self.timeout_s:
            log.info("ondemand_prof: rank 0 published no job id within %.0f s; using %s", self.timeout_s, mine)
            return mine
        return None
