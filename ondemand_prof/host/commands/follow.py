"""A capture as it goes and as it ends, on one host or across hosts alike: `follow` asks the daemons' long
poll (`watch`, host/commands/watch.py) and prints each rank's progress; `result_text` says what each rank wrote, or why
not. One host's daemon is followed through client.OneHost, many through the fan-out (host/fanout.py). Used
by `capture` (host/commands/capture.py) and `show` (host/commands/captures.py)."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, TextIO, cast

from ...core.files import presence_note
from ...core.protocol import FINAL_STATES
from ...core.ranks import spans
from ..alignment import MISALIGNED
from ..client import EXIT_FAILED, EXIT_MISALIGNED, EXIT_OK, EXIT_PARTIAL, EXIT_TIMEOUT, CtlError, OneHost
from ..merge import fail_host, no_capture
from ..recordtypes import Part, RecordView
from ..stalls import stall_text
from .base import who, window_text

if TYPE_CHECKING:
    from ..fanout import Fanout

HOLD_ONE_S = 10.0  # one host: each watch waits this long at most for a change
WATCH_HOLD_S = 1.0  # across hosts: each round of watches waits at most this long for a change on any host


def running(data: RecordView) -> bool:
    return data["status"] == "running"


def merge_watched(held: RecordView | None, reply: RecordView) -> RecordView:
    """A watch reply applied to the record the caller held: a changes-only reply updates its parts."""
    if not reply.get("changed_only"):
        return reply
    merged = cast(RecordView, {k: v for k, v in reply.items() if k != "changed_only"})
    merged["parts"] = {**(held.get("parts", {}) if held else {}), **reply["parts"]}
    return merged


def follow(fan: Fanout | OneHost, found: dict[str, RecordView], failed: dict[str, str], timeout: float,
           out: TextIO | None, pending: Callable[[RecordView], bool] = running,
           quiet: dict[str, str] | None = None, capture_id: str | None = None) -> bool:
    """Long-poll every host whose record is `pending` (default: still running), printing each rank's progress
    to `out`. `fan`: the fan-out across hosts (each rank's line names its daemon), or this host's daemon
    (client.OneHost, whose errors raise): then each watch holds longer, a recording rank's step is shown, and
    when nothing moved in a round, what status says of a stall among the ranks still working (once per change).

    A host that does not answer goes into `quiet` (host -> why; hosts the capture was sent to without an
    answer start there) and is asked again every round until `timeout`: a partition heals, a daemon
    restarts, and the ranks there may be writing all along. A host that answers with an error is `failed`.
    True when no host is left waiting; False when `timeout` ran out first (then the hosts still in `quiet`
    are unreachable, and any other still pending timed out)."""
    quiet = {} if quiet is None else quiet
    capture_id = capture_id or next(iter(found.values()))["capture_id"]
    one_host = fan.local
    progress = None if out is None else Progress(out, one_host)
    shown_stall = ""
    deadline = time.monotonic() + timeout
    while True:
        if progress is not None:
            progress.show(found)
        waiting = [n for n, d in found.items() if n not in failed and pending(d)] + \
            [n for n in quiet if n not in found]
        if not waiting:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        hold = min(HOLD_ONE_S if one_host else WATCH_HOLD_S, left)
        seen = {n: d["version"] for n, d in found.items()}
        # a host whose record we lack is asked for it at once (timeout_s 0), the others hold for a change
        per_host = {n: {"capture_id": capture_id, "seen": found[n]["version"], "timeout_s": hold, "changed_only": True}
                    if n in found else {"capture_id": capture_id, "seen": 0, "timeout_s": 0} for n in waiting}
        began = time.monotonic()
        replies = fan.request("watch", per_host=per_host, wait_s=hold + fan.timeout_s, hosts=waiting)
        for name, reply in replies.items():
            if reply.ok:
                found[name] = merge_watched(found.get(name), reply.data)
                quiet.pop(name, None)
            elif reply.kind == "error":
                quiet.pop(name, None)
                known = name in found
                failed[name] = reply.error if known or not no_capture(reply) else (
                    f"its daemon has no record of this capture (lost on the way, or refused: its log says which; "
                    f"{reply.error})")
                if known:
                    fail_host(found[name], f"host {name}: {reply.error}")
            else:
                quiet[name] = reply.error
        if not any(r.ok or r.kind == "error" for r in replies.values()):  # nobody answered: do not spin
            time.sleep(max(0.0, min(hold, deadline - time.monotonic()) - (time.monotonic() - began)))
        elif one_host and out is not None and all(found[n]["version"] == seen.get(n) for n in waiting):
            for data in found.values():  # nothing moved for a while: is the job hung?
                stall = _stall_of(fan, data)
                if stall and stall != shown_stall:
                    shown_stall = stall
                    out.write(f"  {stall}; the window cannot go on until they step again (still waiting, up to "
                              f"--timeout {timeout:g} s)\n")


def _stall_of(fan: Fanout | OneHost, record: RecordView) -> str:
    """What status says of a stall among a capture's unfinished ranks ('' when none, or when it cannot say)."""
    waiting = {p["rank"] for p in record["parts"].values() if p["state"] not in FINAL_STATES}
    try:
        reply = next(iter(fan.request("status", {"job": record["job"], "brief": True}).values()))
    except CtlError:
        return ""
    stall = reply.data.get("stalled", {}).get(record["job"]) if reply.ok else None
    if not stall or not waiting.intersection(stall["ranks"]):
        return ""
    return stall_text(record["job"], stall)


class Progress:
    """Each rank's progress as it happens: every state its part went through, even brief ones; across hosts
    with the daemon that has it, on one host with the step a recording rank reached."""

    def __init__(self, out: TextIO, one_host: bool) -> None:
        self.out = out
        self.one_host = one_host
        self.printed: dict[str, int] = {}  # history entries shown per rank
        self.shown_step: dict[str, str] = {}
        self.replanned: dict[str, Any] = {}

    def show(self, found: dict[str, RecordView]) -> None:
        for name, record in found.items():
            daemon = None if self.one_host else name
            plan = record.get("plan")
            again = plan.get("replanned") if plan else None
            if isinstance(again, dict) and again != self.replanned.get(name):  # the daemon planned it again
                self.replanned[name] = again
                self.out.write(f"  replanned: steps {window_text(record.get('window'))}: {again.get('why')}\n")
            for key, part in sorted(record["parts"].items(), key=lambda kv: int(kv[0])):
                history = part.get("history") or [{"state": part["state"]}]
                for entry in history[self.printed.get(key, 0):]:
                    self.out.write(who(part, daemon) + progress_text({**part, "state": entry["state"]}) + "\n")
                self.printed[key] = len(history)
                step_text = recording_step(record, part) if self.one_host else ""
                if step_text and self.shown_step.get(key) != step_text:
                    self.shown_step[key] = step_text
                    self.out.write(who(part) + step_text + "\n")
        self.out.flush()


def recording_step(record: RecordView, part: Part) -> str:
    """'recording step k of N' from the step a recording rank last reported (heartbeats, once a second)."""
    at, window = part.get("at_step"), record.get("window")
    if part["state"] != "recording" or at is None or not window:
        return ""
    total = window[1] - window[0]
    return f"recording step {min(max(at - window[0] + 1, 1), total)} of {total}"


def progress_text(part: Part) -> str:
    state = part["state"]
    if state in ("received", "scheduled"):
        return f"{state:<10} window {window_text(part.get('window'))}"
    if state == "recording":
        late = part.get("late_by") or 0
        why = part.get("note") or "it got the window after its start"  # the rank's note says which, and where to
        return "recording" + (f" (late by {late} step{'s' if late != 1 else ''}: {why})" if late else "")
    if state == "done":
        return f"{'done':<10} {part.get('trace') or part.get('path')}"
    if state in ("failed", "rejected"):
        return f"{state:<10} {part.get('error')}"
    return state


# ----------------------------------------------------------------------------------------------------------
# The result

def result_text(record: RecordView, finished: bool, waited: bool = True, across: bool = False) -> str:
    """The outcome and each rank's result, or why it has none. On one host (and `show`, across hosts too):
    the capture folder (what HTA, TensorBoard and `ondemandctl report` open) and each rank's trace file, checked
    on disk; a capture across hosts (`across`): each rank's folder with the daemon that has it, how late it
    began, and what became of ranks whose host was given up on. Then what is wrong with hosts, and whether
    the ranks recorded different steps."""
    parts = sorted(record["parts"].values(), key=lambda p: p["rank"])
    done = [p for p in parts if p["state"] == "done"]
    lines = [_head(record, parts, len(done), finished, waited, across)]
    folders = [] if across else sorted({os.path.dirname(p["path"]) for p in done if p.get("path")})
    if folders:
        lines.append(f"  capture folder{'s' if len(folders) > 1 else ''}: {', '.join(folders)}  (ondemandctl report "
                     f"{record['capture_id']})\n")
        if len(folders) == 1 and all(str(p.get("trace") or "").endswith(KINETO_TRACE) for p in done):
            lines.append(hta_line(folders[0]))
    here = socket.gethostname()
    lines += [line for p in parts if (line := _part_result(p, here, across))]
    hosts, misaligned = _host_lines(record), record.get("misaligned")
    tail = [f"  MISALIGNED: {misaligned['text']}\n"] if misaligned else []
    return "".join(lines + (hosts + tail if across else tail + hosts))


KINETO_TRACE = (".pt.trace.json", ".pt.trace.json.gz")  # torch's traces: what HTA reads (torch_npu's: not)


def hta_line(folder: str) -> str:
    """How to open the capture folder in HTA with every captured step: HTA drops a trace's last ProfilerStep
    unless asked (include_last_profiler_step, False by default in HTA 0.5), so `--steps 2` showed one step."""
    return (f"  in HTA: TraceAnalysis(trace_dir={folder!r}, include_last_profiler_step=True)  (without it HTA leaves "
            "out the last captured step)\n")


def _head(record: RecordView, parts: list[Part], done: int, finished: bool, waited: bool,
          across: bool) -> str:
    if across and not waited:
        return f"sent; follow it with: ondemandctl --hosts ... show {record['capture_id']}\n"
    if not finished and across:
        return "timed out waiting; still running on rank(s) " + (
            spans(p["rank"] for p in parts if p["state"] not in (*FINAL_STATES, "unreachable")) or "none") + "\n"
    if not finished:
        pending = ", ".join(str(p["rank"]) for p in parts if p["state"] not in FINAL_STATES)
        return (f"timed out waiting; still running on rank(s) {pending} (ondemandctl show {record['capture_id']})\n"
                if waited else f"running: rank(s) {pending} still working\n")
    on = f" on {len(record['hosts'])} host(s)" if across else ""
    return f"{record['status']}: {done} of {len(parts)} rank(s){on} wrote a trace\n"


def _part_result(p: Part, here: str, across: bool) -> str:
    """One rank's line of the result ('' for a rank still on its way)."""
    start = who(p, p["daemon"] if across else None)
    late = f"  late by {p['late_by']} step(s)" if across and p.get("late_by") else ""
    if p["state"] == "done":
        steps = p.get("steps")
        if across:  # the rank's folder, on its host
            path, note = p.get("path"), ""
        else:  # the trace file (torch_npu writes a directory), checked when it is on this host
            path = p.get("trace") or p.get("path") or "?"
            note = presence_note(path) if p["host"] == here or p.get("pod_path") else ""
        if p.get("pod_path"):  # a rank in a container: where this host has its file, then the rank's own name
            note += f"  (in its container: {p['pod_path']})"
        elif p.get("pod_only"):
            note += "  (in its container's own filesystem: not on this host; see ondemandctl show)"
        return start + f"{path}" + (f"  steps {steps[0]}..{steps[-1]}" if steps else "") + note + late + "\n"
    if p["state"] in ("failed", "rejected") or (across and p["state"] == "cancelled"):
        return start + f"{p['state']}: {p.get('error')}{late}\n"
    if across and p["state"] == "unreachable":
        last = f" (last known: {p['last_state']})" if p.get("last_state") else ""
        return start + f"unreachable{last}\n"
    return ""


def _host_lines(record: RecordView) -> list[str]:
    """What is wrong with hosts (a record merged from several, host/merge.py)."""
    lines = []
    for name, host in (record.get("hosts") or {}).items():
        if host["status"] in ("unreachable", "failed") and host.get("error"):
            lines.append(f"  host {name} {host['status'].upper()}: {host['error']}\n")
    for name, error in (record.get("unanswered") or {}).items():
        lines.append(f"  host {name} did not answer the status round: {error}\n")
    if record.get("unanswered") and record.get("missing_ranks"):
        lines.append(f"  rank(s) {spans(record['missing_ranks'])} of the job were found on no host that answered\n")
    return lines


def exit_for(record: RecordView) -> int:
    return {"done": EXIT_OK, "partial": EXIT_PARTIAL, MISALIGNED: EXIT_MISALIGNED}.get(
        record["status"], EXIT_FAILED if record["status"] != "running" else EXIT_TIMEOUT)
