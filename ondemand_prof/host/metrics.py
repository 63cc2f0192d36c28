"""ondemand-profd's Prometheus endpoint (`--metrics HOST:PORT`): every local rank's step, step time, stall and
distance from its job's median, the captures and the daemon's own health, in Prometheus's text format at
/metrics, for the dashboards and alerts a cluster already has (dynolog exports its host metrics the same way).

Scraping never touches the daemon's state or slows its loop. The loop publishes an immutable Snapshot (plain
tuples it copies: 5 ms at 4096 ranks), at most once a second and only when a scrape asked for one since the
last. A scrape is served on this module's one thread from the newest Snapshot, rendered once per Snapshot (the
per-rank gauges here, the rest by prometheus_client) and kept, so a scraper in a loop costs the daemon nothing
more than the bytes. When the loop cannot publish (it is stuck), scrapes still answer with the last Snapshot,
and ondemand_prof_snapshot_age_seconds says how old it is: alert on it.

This module holds what is served: the Snapshot the loop publishes, the per-rank text and the metric families;
host/metrics_http.py serves it (one thread, a selector, the bearer token). prometheus_client is an optional
dependency (the `metrics` extra): it is imported only with --metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, NamedTuple, Protocol

from .records import record_source
from .stalls import stalled_for, time_in_step
from .stalls import stragglers

if TYPE_CHECKING:
    from .records import RecordStore
    from .registry import RankInfo
    from .service import Service

log = logging.getLogger("ondemand_prof.host.profd")

PUBLISH_EVERY_S = 1.0  # the loop builds at most one Snapshot a second
WAIT_FOR_LOOP_S = 1.0  # a scrape waits this long for a fresh Snapshot, then serves the newest it has
MAX_JOBS = 256  # jobs whose automatic captures are counted (the oldest are forgotten beyond this)
METRICS_FILE = "profd.metrics"  # in the runtime dir: the HOST:PORT actually bound (port 0 picks a free one)


class MetricsError(RuntimeError):
    """--metrics cannot be served; the message says why and what to do."""


# ----------------------------------------------------------------------------------------------------------
# What the loop publishes (pure: built from the daemon's objects, read by the server thread)

class RankRow(NamedTuple):
    """What the loop copies of a rank (a plain tuple: 4096 of them cost the loop about a millisecond); what
    is derived from it (stalled, time in step, distance from the median) is computed on the server thread.
    Its field names are RankInfo's, so stalls.stalled_for reads it as it reads a rank."""
    job: str
    rank: int
    host: str
    step: int
    step_time: float | None
    step_began_at: float | None
    observed_step_time: float | None = None
    sent_at: float | None = None
    heard_at: float | None = None


@dataclass(frozen=True)
class Health:
    messages: dict[str, int]  # by message type ("hb": heartbeats)
    invalid_messages: int
    refused: dict[str, int]  # error replies by message type ("register": a rank refused)
    tcp_clients_refused: int
    open_fds: int
    fd_limit: int
    accepting: bool
    running_captures: int


@dataclass(frozen=True)
class Snapshot:
    wall: float
    ranks: tuple[RankRow, ...]
    world_sizes: dict[str, int]
    captures: dict[tuple[str, str], int]  # (source, outcome) -> count since the daemon started
    auto_captures: dict[str, int]  # job -> count since the daemon started
    health: Health
    host: str
    version: str
    serial: int = 0


def rank_rows(ranks: Iterable["RankInfo"], names: dict[Any, str] | None = None) -> tuple[RankRow, ...]:
    """`names`: each job's name as status shows it (JobKey -> name: owner:id where users share an id, so that
    two users' jobs are never one label set)."""
    return tuple(RankRow(names.get(i.key, i.job) if names else i.job, i.rank, i.host, i.step, i.step_time,
                         i.step_began_at, i.observed_step_time, i.sent_at, i.heard_at) for i in ranks)


def capture_source(record: Mapping[str, Any]) -> str:
    """Who asked, from a capture record (records.record_source): `file` or `signal` (a rank's trigger file or
    signal), `auto` (--profile-auto: a slowdown, or the job's automatic baseline) or `ondemandctl` (any host's)."""
    source = record_source(record)
    return "ondemandctl" if source == "daemon" else source


class CaptureCounts:
    """Captures since the daemon started, by source and outcome, and automatic ones by job, counted from the
    capture records as they change (records the daemon loaded at start are not counted again).

    A record that is created and pruned between two updates is missed: only with more than the store's
    1000 records in one second."""

    def __init__(self, store: "RecordStore") -> None:
        self.seen: dict[str, str] = {cid: r.status for cid, r in store.records.items()}
        self.outcomes: dict[tuple[str, str], int] = {}
        self.auto: dict[str, int] = {}  # least recently counted first

    def update(self, store: "RecordStore") -> None:
        seen = self.seen
        for cid, record in store.records.items():
            status, before = record.status, seen.get(cid)
            if status == before:
                continue
            source = capture_source(record.data)
            request = record.data.get("request")
            if before is None and isinstance(request, dict) and "auto" in request:  # a slowdown's, not a baseline
                job = record.data.get("job", "")
                self.auto[job] = self.auto.pop(job, 0) + 1
                while len(self.auto) > MAX_JOBS:
                    del self.auto[next(iter(self.auto))]
            if status != "running":
                key = (source, status)
                self.outcomes[key] = self.outcomes.get(key, 0) + 1
            seen[cid] = status
        if len(seen) > len(store.records):
            for cid in [c for c in seen if c not in store.records]:
                del seen[cid]


class Observed(Protocol):
    """What the endpoint reads of the daemon it serves (host/daemon.py Daemon), on the daemon's loop only: its
    service (ranks, records, refusals; there once the daemon is open, before the endpoint is made), its sockets'
    gate (`listener`: descriptors estimated, the limit, whether it accepts; `tcp.zap`: clients refused), what it
    counted of messages, and who it is. (This module imports nothing of the daemon's process.)"""

    @property
    def service(self) -> "Service | None": ...

    @property
    def listener(self) -> Any: ...

    @property
    def tcp(self) -> Any: ...

    @property
    def messages(self) -> dict[str, int]: ...

    @property
    def heartbeats_total(self) -> int: ...

    @property
    def invalid_messages(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def version(self) -> str: ...


def build_snapshot(daemon: Observed, counts: CaptureCounts, wall: float, serial: int) -> Snapshot:
    """What the loop publishes: a copy, so that the server thread reads nothing the loop changes."""
    service = daemon.service
    assert service is not None  # (the daemon is open: Observed)
    counts.update(service.store)
    outcomes = dict(counts.outcomes)
    refused = dict(service.refused)
    if refused.get("capture"):  # refused before any record existed (a stalled job, a bad request)
        outcomes[("ondemandctl", "refused")] = refused["capture"]
    world: dict[str, int] = {}
    names = {key: name for name, key in service.registry.job_keys().items()}
    for info in service.registry.by_route.values():
        job = names.get(info.key, info.job)
        world[job] = max(world.get(job, 0), info.world_size)
    listener = daemon.listener
    zap = daemon.tcp.zap if daemon.tcp is not None else None
    messages = dict(daemon.messages)  # heartbeats on the fast path are counted apart (at each tick)
    messages["hb"] = messages.get("hb", 0) + daemon.heartbeats_total
    health = Health(messages=messages,
                    invalid_messages=daemon.invalid_messages, refused=refused,
                    tcp_clients_refused=zap.refused if zap is not None else 0,
                    open_fds=listener.estimate if listener is not None else 0,
                    fd_limit=listener.limit if listener is not None else 0,
                    accepting=bool(listener is not None and listener.lent),
                    running_captures=len(service.store.running()))
    return Snapshot(wall, rank_rows(service.registry.by_route.values(), names), world, outcomes, dict(counts.auto),
                    health, daemon.host, daemon.version, serial)


# ----------------------------------------------------------------------------------------------------------
# Snapshot -> Prometheus metric families (prometheus_client's types, rendered by its generate_latest)

RANK_FAMILIES = (  # (name, help) of the per-rank gauges, labelled job, rank, host
    ("ondemand_prof_step_seconds", "Recent median step time the rank reports (seconds)"),
    ("ondemand_prof_step", "Last step the rank reported"),
    ("ondemand_prof_rank_stalled", "1 while the rank is STALLED in ondemandctl status: its step has run max(10 s, "
     "20 median steps)"),
    ("ondemand_prof_rank_in_step_seconds", "How long the rank's current step has run (seconds)"),
    ("ondemand_prof_rank_vs_median", "The rank's step time as a multiple of its job's median on this host "
     "(ondemandctl status VS MEDIAN)"),
)


def _label(value: str) -> str:
    """A label value in the text format: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def rank_text(snap: Snapshot, wall: float) -> str:
    """The per-rank gauges in Prometheus's text format (version 0.0.4).

    Written here rather than through prometheus_client's metric families, whose renderer spends about 10 us a
    sample: at 4096 ranks and five gauges that was 200 ms with the GIL held, per scrape. The rest of the
    endpoint is prometheus_client's (tests/test_metrics.py reads the whole of it with its parser)."""

    by_job: dict[str, list[dict[str, Any]]] = {}
    for row in snap.ranks:
        by_job.setdefault(row.job, []).append({"rank": row.rank, "step_time_s": row.step_time, "row": row})
    lines: list[list[str]] = [[] for _ in RANK_FAMILIES]
    step_seconds, step, stalled, in_step, vs_median = lines
    for job_ranks in by_job.values():
        stragglers(job_ranks)  # the job's median step time, as ondemandctl status computes it: adds vs_median
        for r in job_ranks:
            row = r["row"]
            labels = f'{{job="{_label(row.job)}",rank="{row.rank}",host="{_label(row.host)}"}} '
            step.append(labels + str(row.step))
            stalled.append(labels + ("1" if stalled_for(row, wall) is not None else "0"))
            if row.step_time is not None:
                step_seconds.append(labels + repr(row.step_time))
            ran = time_in_step(row, wall)
            if ran is not None:
                in_step.append(labels + repr(round(ran, 3)))
            if r["vs_median"] is not None:
                vs_median.append(labels + repr(r["vs_median"]))
    out = []
    for (name, text), samples in zip(RANK_FAMILIES, lines):
        out.append(f"# HELP {name} {text}\n# TYPE {name} gauge\n")
        out.extend(f"{name}{sample}\n" for sample in samples)
    return "".join(out)


def families(snap: Snapshot, now_wall: float) -> Iterator[Any]:
    """The job-level, capture and health metrics, as prometheus_client metric families."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    ranks = GaugeMetricFamily("ondemand_prof_ranks", "Ranks of the job registered with this host's daemon",
                              labels=["job"])
    world = GaugeMetricFamily("ondemand_prof_world_size", "The job's world size (all hosts)", labels=["job"])
    count: dict[str, int] = {}
    for r in snap.ranks:
        count[r.job] = count.get(r.job, 0) + 1
    for job in sorted(count):
        ranks.add_metric([job], count[job])
        world.add_metric([job], snap.world_sizes.get(job, 0))
    yield ranks
    yield world

    captures = CounterMetricFamily("ondemand_prof_captures", "Captures finished since the daemon started, by who "
                                   "asked (ondemandctl; auto: --profile-auto; file, signal: a rank's trigger file or "
                                   "signal) and outcome (done, partial, failed, cancelled, misaligned; refused: the "
                                   "daemon turned the request down)", labels=["source", "outcome"])
    for (source, outcome), n in sorted(snap.captures.items()):
        captures.add_metric([source, outcome], n)
    yield captures
    auto = CounterMetricFamily("ondemand_prof_auto_captures", "Automatic captures opened since the daemon started "
                               "(a rank slowed down: --profile-auto)", labels=["job"])
    for job, n in sorted(snap.auto_captures.items()):
        auto.add_metric([job], n)
    yield auto

    h = snap.health
    yield GaugeMetricFamily("ondemand_prof_captures_running", "Captures in progress", value=h.running_captures)
    messages = CounterMetricFamily("ondemand_prof_messages", "Messages the daemon received and decoded, by "
                                   "type (hb: heartbeats)", labels=["type"])
    for kind, n in sorted(h.messages.items()):
        messages.add_metric([kind], n)
    yield messages
    yield CounterMetricFamily("ondemand_prof_invalid_messages", "Messages refused by the decoder (malformed, "
                              "oversize, unknown type, several frames)", value=h.invalid_messages)
    refused = CounterMetricFamily("ondemand_prof_refused", "Requests refused with an error reply, by type "
                                  "(register: a rank was refused, e.g. another user's job or a rank a live "
                                  "process holds)", labels=["type"])
    for kind, n in sorted(h.refused.items()):
        refused.add_metric([kind], n)
    yield refused
    yield CounterMetricFamily("ondemand_prof_tcp_clients_refused", "TCP clients whose CurveZMQ key is not "
                              "authorised (--listen --keys)", value=h.tcp_clients_refused)
    yield GaugeMetricFamily("ondemand_prof_open_fds", "File descriptors the daemon holds (its own count, as its "
                            "connection gate sees it)", value=h.open_fds)
    yield GaugeMetricFamily("ondemand_prof_fd_limit", "The daemon's open-file limit", value=h.fd_limit)
    yield GaugeMetricFamily("ondemand_prof_accepting_connections", "1 while the daemon accepts connections; 0 "
                            "when descriptors ran low and new clients wait", value=1.0 if h.accepting else 0.0)
    yield GaugeMetricFamily("ondemand_prof_snapshot_age_seconds", "Age of the data this scrape shows (grows when "
                            "the daemon's loop is stuck)", value=max(0.0, now_wall - snap.wall))
    info = GaugeMetricFamily("ondemand_prof_daemon_info", "ondemand-profd's version and host",
                             labels=["version", "host"])
    info.add_metric([snap.version, snap.host], 1.0)
    yield info
