"""The shapes of a capture record as it crosses the wire and the disk: what the daemon stores (one JSON file per
capture, host/records.py), the plan it keeps on it, each rank's part, and the record and list entry ondemandctl
gets. TypedDicts, not classes: a record is JSON as it is built, kept and sent; these name its fields and their
types for editors and mypy (tests/test_types.py). Fields a record may lack are optional (total=False): a record
read back from disk is checked field by field (records.record_problem), not against these, so readers of a field
that older daemons did not write still ask with .get. This module imports nothing of the package's: records.py,
alignment.py, merge.py and the commands all import it."""

from __future__ import annotations

from typing import Any, TypedDict


class HistoryEntry(TypedDict, total=False):
    """One state a part went through. Written by records.new_part and CaptureRecord._move (both keys); a part that
    merge.py makes for a rank of a lost host has no `at`. Read by follow.Progress (each state printed once)."""

    state: str
    at: str  # ISO time (core/files.iso_time)


class _PartCore(TypedDict):
    rank: int
    host: str
    pid: int
    state: str  # records.PART_STATES; across hosts (merge.py) also "unreachable"
    history: list[HistoryEntry]


class Part(_PartCore, total=False):
    """A target rank's part of a capture, the record's `parts[str(rank)]`. Written by records.new_part, then by
    CaptureRecord._move from the rank's events (the optional fields, each checked: records.PART_FIELDS), by
    service._progress (`at_step`), and across hosts by merge.merged_record (`daemon`, `last_state`). Read by the
    daemon (service: liveness, delivery, cancel; alignment: the steps recorded; summaries: the paths) and by the
    CLI (follow.py: progress and results; capture, report, export: paths and owners)."""

    uid: int | None  # the rank's, the kernel's word (None: not known; absent in records of older daemons)
    path: str  # the capture folder
    trace: str  # the trace file
    error: str
    note: str
    status: str
    late_by: int
    current_step: int
    steps: list[int]  # the steps recorded
    window: list[int | None]  # [start, end) as the rank took it (end None: open until closed)
    cancelled: bool
    pod_path: str  # a rank in a container: its own name of the trace (host/podpath.py)
    pod_only: bool  # ... or its files are not on this host at all
    at_step: int  # a recording rank's last heartbeat step ("recording step k of N")
    daemon: str  # across hosts: the daemon that has the part (merge.merged_record)
    last_state: str  # across hosts: an unreachable part's last known state


# what `plan.replanned` says of a capture planned again (CaptureRecord.planned_again): the window it was moved
# from, and why; read by follow.Progress ("replanned: ...")
Replanned = TypedDict("Replanned", {"from": list[int], "why": str})


class _PlanCore(TypedDict):
    current_steps: dict[str, int]  # target rank (as text: JSON's keys) -> its step when the window was planned
    lead_steps: int
    late_ranks: list[int]
    past_ranks: list[int]
    note: str
    start_step: int
    end_step: int


class StoredPlan(_PlanCore, total=False):
    """The record's `plan`: records.Plan.as_dict, written by CaptureRecord.new and planned_again (`replanned`),
    and by CaptureRecord.add_part (another rank's current step); across hosts merge.capture_record adds
    `sent_s`. Read by service._learn_delivery (current_steps: the delivery learned), capture._plan_text (what
    capture prints first), captures.Show (the note) and follow.Progress (replanned)."""

    after: dict[str, Any]  # the windows it was moved after
    replanned: Replanned
    sent_s: float  # across hosts: how long sending the windows took


class Misaligned(TypedDict):
    """The record's `misaligned` (alignment.misalignment): what each group of ranks recorded, largest first, and
    the text show and capture print (follow.result_text). Written by alignment.mark_misaligned."""

    groups: list[dict[str, Any]]  # {"steps": [first, last], "count": n, "ranks": [...]}
    text: str


class _RecordCore(TypedDict):
    capture_id: str
    job: str
    created_at: str  # ISO time
    request: dict[str, Any]  # what was asked (a CaptureRequest's, an automatic or opened window's)
    window: list[int]  # [start, end) as planned (a file read back may hold null, or end null: record_problem lets it)
    status: str  # records.RECORD_STATUSES
    parts: dict[str, Part]  # str(rank) -> its part


class RecordData(_RecordCore, total=False):
    """A capture record as the daemon keeps it (CaptureRecord.data) and writes it (RecordStore.save, one file
    per capture). Written by CaptureRecord.new (with plan and options always), Service.open_capture (`kind`, and
    the marks `baseline`, `compare_with`), RecordStore.add (`owner_uid` or `owner_key`), CaptureRecord._settle
    (`finished_at`, `misaligned`), Cancel (`cancel_requested`) and the comparison of an automatic capture
    (`comparison`, `cause`: service._conclude_automatic, Show). Read by the daemon's commands and the metrics,
    and sent whole in the record view (RecordView)."""

    plan: StoredPlan  # (a file read back may lack it or hold null: record_problem lets it; readers ask with .get)
    options: dict[str, Any]  # the window options asked (null or absent only in a file read back)
    kind: str  # records.CAPTURE_KINDS (absent in records of older daemons)
    source: str  # records of daemons from before kinds were kept said what opened them (records.record_source)
    baseline: bool
    compare_with: str  # an automatic capture: the baseline it is compared with once done
    cause: str  # ... and the comparison's cause line
    comparison: dict[str, Any]  # ... and the comparison (records.stored_comparison), or {"error": ...}
    cancel_requested: bool
    finished_at: str
    owner_uid: int  # whom the record is charged to (records.charged): the asker's uid
    owner_key: str  # ... or its client key over TCP, key:NAME
    misaligned: Misaligned


class HostOutcome(TypedDict, total=False):
    """One host's outcome in a record merged across hosts (merge.merged_record); read by follow._host_lines."""

    status: str
    error: str


class RecordView(RecordData, total=False):
    """The record as ondemandctl gets it: CaptureRecord.view (the record, what opened it as `source`, and its
    `version`; a watch's changes-only reply holds only the parts changed, marked `changed_only`), with what the
    command adds: capture's reply `asked_by` (and `unsaved`: a baseline not yet on disk), show's
    `is_job_baseline` and `comparison`. Across hosts the CLI merges the hosts' views into one (merge.merged_record,
    capture_record: `hosts`, and for a capture launched across hosts `unanswered`, `missing_ranks`). Read by
    follow.py (progress, result_text, exit_for), captures.Show, capture._plan_text and owner_note, report and
    export (the parts' paths)."""

    version: int
    changed_only: bool
    asked_by: int | None  # the asker's uid, as the daemon saw it (capture)
    unsaved: str  # capture --baseline: why the record is not on disk yet
    is_job_baseline: bool  # show
    hosts: dict[str, HostOutcome]  # merged across hosts
    unanswered: dict[str, str]  # host -> why it did not answer the status round (a capture across hosts)
    missing_ranks: list[int]  # ... and the job's ranks no host that answered has


class _SummaryCore(TypedDict):
    capture_id: str
    job: str
    created_at: str
    window: list[int] | None
    status: str
    ranks: int  # how many parts
    states: dict[str, int]  # part state -> how many
    request: dict[str, Any]
    baseline: bool
    recorded: list[list[int]]  # the distinct steps the finished ranks recorded: [first, last, count] each


class RecordSummary(_SummaryCore, total=False):
    """One capture in `list`'s reply: CaptureRecord.summary (List.execute sets `baseline`: the job's current
    baseline). Merged across hosts by merge.merge_lists (`hosts`: the daemons that have it, ranks and states
    summed, one status); read by List.console (the table) and --json."""

    compare_with: str
    cause: str
    hosts: list[str]  # merged across hosts
