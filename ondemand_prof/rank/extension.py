"""What the agent asks of each of its extensions (the daemon link, triage, automatic captures), on the agent
thread: a typed Protocol, and a base class with the defaults, so that the agent calls every method directly
and an extension says only what it does differently."""

from __future__ import annotations

from typing import Protocol


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
