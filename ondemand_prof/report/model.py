"""The report's shape: what build_report returns, --json prints, and text.py and html.py render.

TypedDicts, not classes: the report is JSON as it is built (a worker process returns a rank's result, --json
prints the whole), and these name its fields and their types for editors, mypy and the renderers. Every field
a reader may lack is optional (total=False): a rank that could not be read has "error" and little else."""

from __future__ import annotations

from typing import Any, TypedDict


class RankResult(TypedDict, total=False):
    """One rank of one capture (sources.read_source)."""

    path: str
    kind: str  # capture | trace | db | ascend
    folder: str  # what grouping sees as its folder
    rank: int | None
    world_size: int | None
    error: str  # nothing could be read; the rest may be missing
    warnings: list[str]  # read in part (a cut trace, a skipped file)
    # from our metadata.json
    host: str | None
    pid: int | None
    job_id: str | None
    capture_id: str | None
    status: str | None
    window: Any
    options: dict[str, Any] | None
    source: str | None  # what opened the window: file, daemon, auto, ...
    published_at: str | None
    # what was read
    read_from: str  # summary.json: the rank's summary stood for its trace (a comparison on this host)
    trace: str
    db: str
    files_used: list[str]
    split_from: str  # torch_npu: which file the per-step split comes from
    events: int
    steps: list[dict[str, Any]]  # one row per ProfilerStep: step, start_us, dur_ms and each share
    basis: str  # device | cpu: what the shares were measured on
    step_ms_mean: float
    step_ms_max: float
    compute_pct: float
    comm_pct: float
    overlap_pct: float
    idle_pct: float
    top_self: list[dict[str, Any]]
    top_total: list[dict[str, Any]]
    top_kernels: list[dict[str, Any]]
    operators: int
    cpu_self_total_us: float
    annotations: list[dict[str, Any]]
    kernel_steps: dict[str, int]
    comm_libraries: list[dict[str, Any]]
    collectives: list[dict[str, Any]]  # per collective kind: calls and time per step, via, issued_by (analyze.py)
    step_ops: dict[str, Any]  # the operators and kernels inside the steps, what a comparison matches (compare.py)
    timeline: dict[str, Any] | None  # each step's collectives, arrival and end (timeline.py): waits.py, replay.py
    pipeline: dict[str, Any] | None  # torch.distributed.pipelining's schedule: actions, span, bubble (pipeline.py)
    cpu_by_step: dict[str, Any] | None  # the training thread's CPU and run-queue wait per step (rank/cpuclock.py)
    memory: dict[str, Any] | None
    # across hosts (host/summaries.merge_summaries): which daemon returned the rank, how late its window began
    daemon: str
    late_by: int | None


class FailedRank(TypedDict):
    rank: int | None
    path: str
    error: str


class Slowest(TypedDict, total=False):
    """The slowest rank of a capture against the median (grouping.slowest_rank)."""

    rank: int | None
    step_ms: float
    vs_median_ms: float
    vs_median_pct: float
    stands_out: bool
    rule: str
    why_not: str
    others_median_ms: float
    others_spread_ms: float
    threshold_ms: float
    by: str  # "wait caused": judged by how long the others waited for it at collectives (step_ms holds that)
    last_share: float  # ... how often it arrived last
    wait_ms: float  # ... and how long it waited itself


class CaptureGroup(TypedDict, total=False):
    """One capture across its ranks (summarize_group)."""

    job_id: Any
    capture_id: Any
    ranks: list[RankResult]  # read, in rank order
    failed: list[FailedRank]
    grouped_by: str | None
    newest: str | None
    title_path: str
    window: Any
    source: str | None
    options: dict[str, Any] | None
    median_step_ms: float  # of the ranks' mean step times, when any was timed
    slowest: Slowest | None
    collectives: dict[str, Any]  # who made whom wait, and the what-if replay (waits.summary, replay.analyze)


class _ReportCore(TypedDict):
    captures: list[CaptureGroup]
    problems: list[dict[str, str]]  # a given path with nothing to report on
    ranks_read: int
    seconds: float


class Report(_ReportCore, total=False):
    """build_report's has every field; a report across hosts (host/summaries.merge_summaries) searched no path,
    so it has no sources, and it names the hosts that did not answer."""

    sources: list[dict[str, Any]]
    other_files: dict[str, int]
    failed_hosts: dict[str, str]  # daemon name -> why it gave no answer


# ----------------------------------------------------------------------------------------------------------
# A comparison of a capture with its baseline (compare.py): what --json prints under "comparison", what the daemon
# keeps on an automatic capture's record, what text.py and html.py render


class Test(TypedDict):
    """One figure's test on its per-step values (stats.Change.as_dict): means before and after, their difference
    and its 95 % interval (None: one step on a side), the verdict, the steps on each side, Cohen's d."""

    before: float | None
    after: float | None
    delta: float | None
    lo: float | None
    hi: float | None
    verdict: str  # grew | shrank | same | one_step | none
    n_before: int
    n_after: int
    effect: float | None


class Pair(TypedDict):
    baseline: float | None
    now: float | None


class RankComparison(TypedDict, total=False):
    """One rank, baseline against now (compare.compare_rank)."""

    rank: int | None
    host: dict[str, str | None]
    step_ms: Pair
    step_ms_by_step: dict[str, list[float]]
    split: dict[str, Pair]  # compute, communication, overlap, idle
    tests: dict[str, Test]  # step, own, compute, communication, overlap, idle, cpu, cpu_wait, proc_cpu, proc_wait
    hiccups: dict[str, dict[str, Any] | None]
    communication: dict[str, list[dict[str, Any]]]  # libraries, collectives (per kind, with its test)
    changes: list[dict[str, Any]]  # the operators and kernels that changed most, each with its test
    per_call: dict[str, Any] | None  # the operators of unchanged calls: their time a call, now over baseline
    own_growth_ms: float
    wait_growth_ms: float
    collective_host_ms: float
    matched_share: float
    world_size: dict[str, int | None]
    level: dict[str, str | None]
    basis: dict[str, str | None]
    device: dict[str, str | None]  # what each side ran on (deviceProperties, NPU_INFO): compare._notes
    steps: dict[str, int]
    timeline: dict[str, Any]  # (read by conclude, then dropped)


class Comparison(TypedDict, total=False):
    """The comparison (compare.conclude)."""

    baseline: Any
    capture: Any
    job: dict[str, Any]
    step_ms: dict[str, Any]  # baseline, now, delta, pct, test
    ranks: list[RankComparison]
    cause: str
    category: str | None
    verdict: str  # none | one_step | no_change | faster | hiccup | slower | rank | alike | host
    kind: str  # job | host | none: whose the verdict is
    culprits: list[int]
    waiting: list[int]
    notes: list[str]
    communication: list[dict[str, Any]]  # per collective kind, mean of the ranks
    collectives: dict[str, dict[str, Any] | None]  # who made whom wait on each side (waits.summary)
    replay: dict[str, Any]  # the capture's what-if replay (replay.analyze)
    shares: dict[str, Any] | None  # each rank's share of the growth (replay.growth)
    rule: str
    failed_hosts: Any  # across hosts: the daemons that did not answer
    trimmed: str  # on an automatic capture's record: what was left out to keep it bounded
