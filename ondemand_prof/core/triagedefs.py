"""The triage vocabulary shared by the rank (rank/triage.py answers), the daemon (host/commands/triage.py
checks and forwards) and ondemandctl (prints): the actions, their arguments and bounds, and how a thread's
stack is printed."""

from __future__ import annotations

from typing import Any

from .bounds import checked_int

ACTIONS = ("stacks", "memory", "flight_recorder")
MAX_MEMORY_STEPS = 100
DEFAULT_MEMORY_STEPS = 3
DEFAULT_MAX_ENTRIES = 100_000
MAX_ENTRIES = 10_000_000
MEMORY_STACKS = ("python", "all")  # Python frames only (fast), or C++ too (dumps can take minutes)
# every thread ondemand_prof starts in a rank, or names once a library started it for us (watchdog's), is named so:
# stacks fold them into one line unless asked (ondemandctl stacks --all-threads)
OWN_THREAD_PREFIX = "ondemand-prof-"


def check_args(action: str, args: Any) -> dict[str, Any]:
    """A request's arguments, bounded; ValueError says what is wrong."""
    if action not in ACTIONS:
        raise ValueError(f"unknown triage action {action!r}; accepted: {', '.join(ACTIONS)}")
    args = dict(args or {}) if isinstance(args, dict) else {}
    if action != "memory":
        return {}
    out = {"steps": args.get("steps", DEFAULT_MEMORY_STEPS),
           "max_entries": args.get("max_entries", DEFAULT_MAX_ENTRIES), "stacks": args.get("stacks", MEMORY_STACKS[0])}
    for key, hi in (("steps", MAX_MEMORY_STEPS), ("max_entries", MAX_ENTRIES)):
        checked_int(out[key], 1, hi, key)
    if out["stacks"] not in MEMORY_STACKS:
        raise ValueError(f"stacks must be 'python' or 'all', got {out['stacks']!r}")
    return out


def format_thread(thread: dict[str, Any]) -> str:
    """One thread as Python prints a traceback (most recent call last)."""
    tags = [x for x, on in (("main", thread.get("main")), ("daemon", thread.get("daemon")),
                            ("ondemand_prof's", thread.get("own")), ("this collector", thread.get("collector")))
            if on]
    head = f'Thread "{thread["name"]}"' + (f" ({', '.join(tags)})" if tags else "")
    hidden = thread.get("depth", len(thread["frames"])) - len(thread["frames"])
    lines = [head + " (most recent call last):"]
    if hidden > 0:
        lines.append(f"  ... {hidden} outer frame(s) not shown")
    for filename, lineno, name, code in thread["frames"]:
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        if code:
            lines.append(f"    {code}")
    return "\n".join(lines) + "\n"

