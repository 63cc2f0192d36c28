"""What the agent asks of each of its extensions (the daemon link, triage, automatic captures), on the agent
thread: a typed Protocol, and a base class with the defaults, so that the agent calls every method directly
and an extension says only what it does differently; and what an extension may ask of the agent (AgentLike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..core.window import Window


class AgentLike(Protocol):
    """What an extension asks of the agent that runs it (rank/agent.py Agent), so that no extension imports the
    agent (which imports them): the daemon link and the trigger file hold one of these. A stand-in in bench/
    drives the daemon link with one, without a training loop."""

    config: Any
    prof: Any
    triage: Any  # rank/triage.py Triage: answers stacks, memory, flight_recorder
    link: Any  # rank/daemon_link.py DaemonLink, or None (no daemon link)
    clock: Any  # core/window.py StepClock: which step ran at a wall time (step_at)

    @property
    def trigger_dir(self) -> Path | str:
        """Said at registration (where ondemandctl's users may also write a trigger)."""

    def schedule(self, window: Window, listener: Any) -> None: ...
    def wake(self) -> None: ...
    def add_extension(self, extension: "AgentExtension") -> None: ...
    def lead_steps(self) -> int:
        """Steps ahead a window the rank opens itself starts, so that the job's other ranks are in time."""
    def step_time(self) -> float | None: ...
    def step_began(self) -> tuple[int, float] | None: ...


class AgentExtension(Protocol):
    acknowledged: bool  # a daemon answered this rank's registration (the start-up line waits for it)

    def poll(self, now: float) -> None:
        """Every agent loop (SAMPLE_S): do what is due; never raises."""

    def close(self) -> None:
        """The agent stops: last words, then release what the extension holds."""

    def daemon_present(self) -> bool:
        """Whether a daemon may answer soon (the start-up line waits for it only then)."""

    def reregister(self) -> None:
        """The rank's job, rank or trigger directory changed: say who we are again."""

    def startup_note(self) -> str | None:
        """What the rank's start-up line says of this extension, if anything."""


class Extension:
    """The defaults of AgentExtension: nothing to do, no daemon."""

    acknowledged = False

    def poll(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass

    def daemon_present(self) -> bool:
        return False

    def reregister(self) -> None:
        pass

    def startup_note(self) -> str | None:
        return None
