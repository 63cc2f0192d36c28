"""One timeline of a capture: every rank's Kineto trace merged into one Chrome trace (JSON Object Format), which
Perfetto UI, chrome://tracing and any Chrome-trace reader open as one file, each rank's processes named tracks in
rank order, on one clock.

    align(ranks)             -> Alignment: what to add to each rank's times (waits.py's alignment on collective ends)
    Merger(out, head)        -> .add(rank, host, events, shift_us) per rank, in rank order, then .close()

Clocks: ranks of one host share a clock; another host's is moved by the median difference of the collectives' ends
(waits.match, the alignment `report` states), so that the ends line up within the residual skew (p90) stated in
the file's metadata. A rank with no timeline in its summary takes its host's offset, or keeps its own clock (said).

What the merge changes in each event, and nothing else:
  * pid: each (rank, pid of its trace) gets a pid of its own (two ranks' traces both hold device 0 and tid 7, and
    two hosts' pids can be equal); the rank's own process (its first numeric pid, or the one given) is its main
    track, and the trace's named pseudo-processes (Kineto's "Spans", "Traces", "") are folded into it;
    process_name / process_labels / process_sort_index are written anew: `rank R · HOST · CPU (pid P)`, sorted
    by rank (Perfetto reads process_sort_index as its ordering hint);
  * ts: moved onto the common clock, relative to the merged file's baseTimeNanoseconds (as Kineto writes it: time
    since the epoch = ts + base); a trace without a base holds epoch microseconds (base 0);
  * flow and async ids (`id`, `bind_id`, `id2`): prefixed with the rank (`3:1042`), so that no arrow joins two ranks;
  * a global instant ("s": "g", Kineto's "Iteration Start") becomes the rank's own ("s": "p").
Pure: events in, text out (the caller opens the traces and the file)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, TextIO

from .timeline import Timeline
from .waits import clock_text, match

FORMAT_VERSION = 1
PIDS_PER_RANK = 256  # process_sort_index = rank * this + the process's place in the rank's trace
_PROCESS_META = frozenset({"process_name", "process_labels", "process_sort_index"})
_FLOW_IDS = ("id", "bind_id")


@dataclass
class Alignment:
    offsets_us: dict[int, float]  # rank -> what to add to its times (since the epoch) to put them on the common clock
    clock: dict[str, Any]  # waits.py's clock: hosts, aligned_on, skew_us, offsets_us (by host), unaligned
    unaligned: list[int]  # ranks left on their own clock
    notes: list[str] = field(default_factory=list)

    @property
    def skew_us(self) -> float | None:
        skew = self.clock.get("skew_us")
        return float(skew) if isinstance(skew, (int, float)) else None

    def text(self) -> str:
        """One line: how the clocks were put on one (waits.clock_text), or why they were not."""
        if self.clock.get("hosts", 1) <= 1:
            return "one host: one clock, nothing to align"
        if not self.clock.get("aligned_on"):
            return f"the clocks of {self.clock['hosts']} hosts were not aligned: " + (
                self.notes[0] if self.notes else "no collective matched across them")
        return clock_text(self.clock)


def _host(rank: int, host: str | None) -> str:
    return host if host else f"rank {rank}"  # as waits.py keys its clocks: a rank of unknown host is its own


def align(ranks: Sequence[tuple[int, str | None, Timeline | None]]) -> Alignment:
    """(rank, host, timeline or None) of each rank -> each rank's offset on the clock of the lowest rank's host,
    from the collectives' ends (waits.match). A rank without a timeline takes its host's offset; where its host
    has none (no other rank there had one), it keeps its own clock and is listed as unaligned."""
    hosts = list(dict.fromkeys(_host(r, h) for r, h, _ in sorted(ranks, key=lambda x: x[0])))
    timed = [(r, h, t) for r, h, t in ranks if t is not None]
    matched = match(timed) if len(timed) > 1 and len(hosts) > 1 else None
    notes: list[str] = []
    if matched is None:
        clock: dict[str, Any] = {"hosts": len(hosts), "aligned_on": 0, "skew_us": None, "offsets_us": {}}
        if len(hosts) > 1:
            notes.append("fewer than two ranks' summaries hold a timeline" if len(timed) < 2 else
                         "no collective was matched across the ranks' timelines")
    else:
        clock = dict(matched.clock)
        notes += matched.notes
    by_host = {h: float(v) for h, v in (clock.get("offsets_us") or {}).items()}
    offsets, unaligned = {}, []
    for rank, host, _ in ranks:
        key = _host(rank, host)
        offsets[rank] = by_host.get(key, 0.0)
        if len(hosts) > 1 and key not in by_host:
            unaligned.append(rank)
    if unaligned and matched is not None:
        notes.append(f"rank(s) {', '.join(map(str, sorted(unaligned)[:16]))} kept their own clock: no rank of their "
                     "host has a timeline that shares a collective with the others")
    return Alignment(offsets, clock, sorted(unaligned), notes)


@dataclass
class RankStats:
    rank: int
    host: str | None
    shift_us: float
    events: int = 0
    dropped: int = 0  # events without a usable time
    first_us: float | None = None  # the earliest and latest event time, on the merged file's clock
    last_us: float | None = None
    processes: dict[str, int] = field(default_factory=dict)  # the trace's pid (as text) -> its pid in the merged file

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "events": self.events, "dropped": self.dropped,
                "shift_us": round(self.shift_us, 3), "first_us": self.first_us, "last_us": self.last_us,
                "processes": self.processes}


class Merger:
    """Writes one Chrome trace to `out`: the top-level `head` (metadata, known before any event), then each rank's
    events as `add` is given them (rank order is the caller's), then `tail` at close."""

    def __init__(self, out: TextIO, head: dict[str, Any]) -> None:
        self.out = out
        self._next_pid = 1
        self._first = True
        out.write("{" + "".join(f"{json.dumps(k)}:{_dumps(v)}," for k, v in head.items()) + '"traceEvents":[\n')

    def add(self, rank: int, host: str | None, events: Iterable[dict[str, Any]], shift_us: float,
            main_pid: int | None = None) -> RankStats:
        """One rank's events, each moved by `shift_us` (its base, its host's offset and the file's origin), its
        processes renamed. `main_pid`: the rank's own process in its trace (None: its first numeric pid)."""
        st = RankStats(rank, host, shift_us)
        ranked = _Processes(self, rank, host, main_pid)
        write = self.out.write
        for ev in events:
            ts = _number(ev.get("ts"))
            if ts is None:
                st.dropped += 1
                continue
            ts = round(ts + shift_us, 3)
            ev["ts"] = ts
            if "dur" in ev:
                dur = _number(ev["dur"])
                if dur is None:
                    st.dropped += 1
                    continue
                ev["dur"] = dur
            if ev.get("ph") == "M" and ev.get("name") in _PROCESS_META:
                ranked.metadata(ev)
                continue
            ev["pid"] = ranked.pid_of(ev.get("pid"))
            _rank_ids(ev, rank)
            if ev.get("s") == "g":
                ev["s"] = "p"
            write(("" if self._first else ",\n") + _dumps(ev))
            self._first = False
            st.events += 1
            st.first_us = ts if st.first_us is None or ts < st.first_us else st.first_us
            end = ts + (ev.get("dur") or 0)
            st.last_us = end if st.last_us is None or end > st.last_us else st.last_us
        ranked.finish(st.first_us if st.first_us is not None else 0.0)
        st.processes = {str(k): v for k, v in ranked.pids.items()}
        return st

    def meta(self, ev: dict[str, Any]) -> None:
        self.out.write(("" if self._first else ",\n") + _dumps(ev))
        self._first = False

    def new_pid(self) -> int:
        pid, self._next_pid = self._next_pid, self._next_pid + 1
        return pid

    def close(self, tail: dict[str, Any] | None = None) -> None:
        self.out.write("\n]" + "".join(f",{json.dumps(k)}:{_dumps(v)}" for k, v in (tail or {}).items()) + "}\n")


class _Processes:
    """One rank's processes: their pids in the merged file, names and order. The main track (order 0) is the rank's
    own process: the trace's pid `main_pid` where given, else its first numeric pid; the named pseudo-processes go
    there too. Every other numeric pid (a device) is a track of its own, in the order the trace has them."""

    def __init__(self, merger: Merger, rank: int, host: str | None, main_pid: int | None) -> None:
        self.merger, self.rank, self.host, self.main_pid = merger, rank, host, main_pid
        self.pids: dict[Any, int] = {}
        self.given: dict[int, dict[str, str]] = {}  # new pid -> what the trace said of it: pid, name, labels
        self.main: int | None = None
        self.main_bound = False  # a numeric pid of the trace is the main track's
        self.order: dict[int, int] = {}  # new pid -> its place among the rank's tracks

    def pid_of(self, pid: Any) -> int:
        new = self.pids.get(pid)
        if new is not None:
            return new
        if type(pid) is not int:
            new = self._main()
        elif not self.main_bound and (pid == self.main_pid or self.main_pid is None):
            new = self._main()
            self.main_bound = True
            self.given[new]["pid"] = str(pid)
        else:
            new = self._new(len(self.given) + (0 if self.main is not None else 1), pid)
        self.pids[pid] = new
        return new

    def _main(self) -> int:
        if self.main is None:
            self.main = self._new(0, None)
        return self.main

    def _new(self, order: int, pid: Any) -> int:
        new = self.merger.new_pid()
        self.given[new] = {"pid": str(pid)} if pid is not None else {}
        self.order[new] = min(order, PIDS_PER_RANK - 1)
        return new

    def finish(self, ts: float) -> None:
        """Each process's name and place, once its trace has said all it says of it (Perfetto and chrome://tracing
        read metadata events wherever they are)."""
        for new, order in self.order.items():
            self.merger.meta({"ph": "M", "name": "process_sort_index", "pid": new, "tid": 0, "ts": ts,
                              "args": {"sort_index": self.rank * PIDS_PER_RANK + order}})
            self.merger.meta({"ph": "M", "name": "process_name", "pid": new, "tid": 0, "ts": ts,
                              "args": {"name": self.name(new)}})

    def metadata(self, ev: dict[str, Any]) -> None:
        """The trace's own process_name / process_labels: kept in the new name; its sort index: replaced."""
        pid = ev.get("pid")
        if type(pid) is not int:  # Kineto's "Spans"/"Traces": folded into the main track, not named after it
            return
        new = self.pid_of(pid)
        raw = ev.get("args")
        args = raw if isinstance(raw, dict) else {}
        key = {"process_name": "name", "process_labels": "labels"}.get(str(ev.get("name")))
        value = args.get(key) if key else None
        if key and isinstance(value, str) and value:
            self.given[new][key] = value[:200]

    def name(self, new: int) -> str:
        """`rank R · HOST · WHAT`: what the trace calls the process (its labels, else its name), with its pid where
        that says which process it is (a CPU process named python)."""
        given = self.given[new]
        what = given.get("labels") or given.get("name") or ""
        if given.get("pid") and what in ("", "python", "CPU", given.get("name")):
            what = f"{what} (pid {given['pid']})" if what else f"pid {given['pid']}"
        return " · ".join(x for x in (f"rank {self.rank}", self.host or "", what) if x)


def _number(value: Any) -> float | None:
    if type(value) in (int, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


def _rank_ids(ev: dict[str, Any], rank: int) -> None:
    for key in _FLOW_IDS:
        if key in ev:
            ev[key] = f"{rank}:{ev[key]}"
    id2 = ev.get("id2")
    if isinstance(id2, dict):
        ev["id2"] = {k: f"{rank}:{v}" for k, v in id2.items()}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def origin_us(shifts: Iterable[float]) -> int:
    """The merged file's base (whole microseconds): no rank's times go below it, so no event's ts is negative
    where the trace's were not."""
    return math.floor(min(shifts, default=0.0))


def metadata(capture_id: str, job: str | None, ranks: Sequence[int], hosts: Sequence[str], alignment: Alignment,
             base_ns: int) -> dict[str, Any]:
    """The merged file's top level before its events: Perfetto lists `metadata` (flat values) in its metadata
    table (json_metadata.*); `ondemandProf` holds the same for scripts, nested."""
    skew = alignment.skew_us
    flat: dict[str, Any] = {"ondemand_prof.capture_id": capture_id, "ondemand_prof.ranks": len(ranks),
                            "ondemand_prof.hosts": ", ".join(hosts), "ondemand_prof.clock": alignment.text(),
                            "ondemand_prof.clock_offsets_us": _dumps(alignment.clock.get("offsets_us") or {})}
    if job:
        flat["ondemand_prof.job"] = job
    if skew is not None:
        flat["ondemand_prof.clock_skew_us"] = skew
    return {"displayTimeUnit": "ms", "baseTimeNanoseconds": base_ns, "metadata": flat,
            "ondemandProf": {"version": FORMAT_VERSION, "capture_id": capture_id, "job": job, "ranks": list(ranks),
                             "hosts": list(hosts), "clock": alignment.clock, "clock_text": alignment.text(),
                             "skew_us": skew, "offsets_us": {str(r): v for r, v in sorted(alignment.offsets_us.items())},
                             "unaligned": alignment.unaligned, "notes": alignment.notes}}
