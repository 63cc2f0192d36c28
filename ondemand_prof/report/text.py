"""The terminal report."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Mapping

from .analyze import SHARES, round_shares
from .classify import short_name
from .figures import SPLIT
from .waits import clock_text
from .grouping import vs_median_pct
from .model import CaptureGroup, RankResult, Report
from .pipeline import KINDS as PIPELINE_KINDS, stage_label


def _table(rows: list[list[str]], header: list[str], indent: str = "  ") -> str:
    if not rows:
        return ""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    right = [all(_numeric(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(x).rjust(w) if right[i] and r is not header else str(x).ljust(w)
                 for i, (x, w) in enumerate(zip(r, widths))]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _numeric(s: str) -> bool:
    return s.replace(".", "", 1).replace("-", "", 1).replace("%", "").replace("+", "").strip().isdigit() or s == "-"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _rank(r: RankResult) -> str:
    return "?" if r.get("rank") is None else str(r["rank"])


def rank_said(rank: Any) -> str:
    """A compared rank's number; a trace that names none (no distributedInfo in a Kineto trace) says so, rather
    than printing None."""
    return "? (no distributedInfo)" if rank is None else str(rank)


def _window(w: Any) -> str:
    if isinstance(w, dict):
        steps = w.get("recorded_steps") or []
        text = f"[{w.get('start')}, {w.get('end')})"
        return text + (f" recorded {steps[0]}..{steps[-1]}" if steps else "")
    return "-"


def short_names(names: list[str], n: int = 60) -> list[str]:
    """short_name of each, made distinct: names that shorten to the same text (template kernels that differ only
    in the middle, or in the folded parameters) show the part where they differ; if that is not enough, a number
    (`#2`) in the order of their full names."""
    out = [short_name(x, n) for x in names]
    for idx in _clashes(names, out):
        for i in idx:
            out[i] = _differing_part(names[i], [names[j] for j in idx if names[j] != names[i]], n)
    for idx in _clashes(names, out):  # still alike (or alike another name's label): number them
        full = sorted({names[i] for i in idx})
        for i in idx:
            out[i] = f"{out[i]} #{full.index(names[i]) + 1}"
    return out


def _clashes(names: list[str], labels: list[str]) -> list[list[int]]:
    """Index groups whose labels are equal while their full names are not."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, text in enumerate(labels):
        groups[text].append(i)
    return [idx for idx in groups.values() if len({names[i] for i in idx}) > 1]


def _differing_part(name: str, others: list[str], n: int) -> str:
    """The start of `name` and, after an ellipsis, the stretch around the first character where it differs from
    the closest of `others`."""
    text = re.sub(r"^void ", "", name.strip())
    rest = [re.sub(r"^void ", "", o.strip()) for o in others]
    at = max(next((k for k, (a, b) in enumerate(zip(text, o)) if a != b), min(len(text), len(o))) for o in rest)
    if len(text) <= n:
        return text
    head = n // 3
    width = n - head - 2
    lo = max(head, at - width // 3)
    hi = min(len(text), lo + width)
    return text[:head] + "…" + text[lo:hi] + ("…" if hi < len(text) else "")


def shares_text(r: RankResult) -> list[str]:
    """The four shares of a rank, rounded so that they add up to 100.0."""
    values = [r.get(f"{k}_pct") for k in SHARES]  # step_summary's floats, or absent
    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    if len(numbers) < len(SHARES):
        return ["-"] * len(SHARES)
    return [f"{v:.1f}" for v in round_shares(numbers)]


def render_text(report: Report, top: int = 10, per_rank: bool = True) -> str:
    out: list[str] = [sources_text(report, per_rank)]
    for p in report["problems"]:
        out.append(f"cannot report on {p['path']}: {p['error']}\n")
    if not report["captures"]:
        out.append("nothing to report\n")
        return "".join(out)
    for i, group in enumerate(report["captures"]):
        out.append(_group_text(group, top, per_rank, i + 1))
    out.append(f"({report['ranks_read']} rank capture(s) read in {report['seconds']:.2f} s)\n")
    return "".join(out)


def sources_text(report: Report, all_found: bool = True) -> str:
    """What the search found (each, with the capture it went to; only counted with all_found=False) and what it
    skipped, each with the reason; other files counted by extension."""
    listing = report.get("sources") or []
    found = [e for e in listing if e["status"] == "found"]
    skipped = [e for e in listing if e["status"] != "found"]
    if len(found) <= 1 and not skipped and not report.get("other_files"):
        return ""  # one capture asked for, one read: nothing to explain
    lines = [f"sources: {len(found)} found, {len(skipped)} skipped"]
    if all_found:
        width = max((len(e["path"]) for e in found), default=0)
        lines += [f"  found    {e['path'].ljust(width)}  {e['format']}"
                  + (f" -> [{e['capture']}]" if e.get("capture") else "") for e in found]
    lines += [f"  skipped  {e['path']}: {e['reason']}" for e in skipped]
    others = report.get("other_files") or {}
    if others:
        lines.append(f"  ({sum(others.values())} other file(s), no profile format: "
                     + ", ".join(f"{ext} {n}" for ext, n in others.items()) + ")")
    return "\n".join(lines) + "\n"


def _group_text(group: CaptureGroup, top: int, per_rank: bool, number: int = 1) -> str:
    title = f"[{number}] " + (f"capture {group['capture_id']}" if group.get("capture_id") else "traces")
    if group.get("job_id"):
        title += f"  job {group['job_id']}"
    if group.get("source"):
        title += f"  ({group['source']})"
    lines = ["=" * 100, title]
    if group.get("grouped_by"):
        lines.append(f"grouped by {group['grouped_by']}")
    if group.get("window"):
        lines.append(f"window {_window(group['window'])}   options " +
                     ", ".join(f"{k}={v}" for k, v in (group.get("options") or {}).items()))
    text = "\n".join(lines) + "\n"
    ranks = group["ranks"]
    if ranks:
        slowest = group.get("slowest") or {}
        rows = []
        for r in ranks:
            mark = "<- slowest" if slowest.get("stands_out") and r.get("rank") == slowest.get("rank") else ""
            pct = vs_median_pct(r.get("step_ms_mean"), group.get("median_step_ms"))
            vs = f"{pct:+.1f}%" if pct is not None else ""
            rows.append([_rank(r), str(len(r.get("steps") or [])), _f(r.get("step_ms_mean")),
                         _f(r.get("step_ms_max")), *shares_text(r), vs or "-", mark])
        text += "\nacross ranks (mean over the recorded steps; the shares add up to 100%)\n"
        text += _table(rows, ["RANK", "STEPS", "STEP MS", "MAX MS", "COMPUTE %", "COMM %", "OVERLAP %", "IDLE %",
                              "VS MEDIAN", ""])
        if slowest and len(ranks) > 1:
            if slowest.get("by") == "wait caused":
                text += (f"  slowest: rank {slowest['rank']}, the others waited {slowest['step_ms']:.2f} ms per step for "
                         f"it at collectives (it arrived last at {100 * slowest['last_share']:.0f}% of them, waited "
                         f"{slowest['wait_ms']:.2f} ms itself), {slowest['vs_median_ms']:+.2f} ms from the ranks' median")
            else:
                text += (f"  slowest: rank {slowest['rank']}, {slowest['step_ms']:.2f} ms per step, "
                         f"{slowest['vs_median_ms']:+.2f} ms ({slowest['vs_median_pct']:+.1f}%) from the median "
                         f"{group['median_step_ms']:.2f} ms")
            text += ": stands out\n" if slowest.get("stands_out") else f"; not marked: {slowest.get('why_not')}\n"
        if group.get("collectives"):
            text += waits_text(group["collectives"])
        text += pipeline_text(ranks)
    for f in group["failed"]:
        text += f"  rank {f['rank'] if f['rank'] is not None else '?'}: FAILED {f['error']}  ({f['path']})\n"
    if per_rank:
        for r in ranks:
            text += _rank_text(r, top)
    return text + "\n"


def waits_text(w: dict[str, Any]) -> str:
    """Who made whom wait in one capture (waits.summary), and its what-if replay."""
    steps = w["steps"]
    text = (f"\nwho made whom wait: {w['matched']} collectives matched across the ranks in {len(steps)} step(s) "
            f"(arrival: {w['arrival']}; ms per step)\n")
    rows = [[str(r["rank"]), f"{r['arrived_last']} ({100 * r['last_share']:.0f}%)", _f(r["caused_ms"]),
             _f(r["wait_ms"])] for r in w["ranks"]]
    text += _table(rows, ["RANK", "ARRIVED LAST", "OTHERS WAITED FOR IT", "ITS WAIT"])
    if w["kinds"]:
        text += "  by collective kind (mean over its ranks, ms per step)\n"
        text += _table([[k["kind"], _calls(k["calls_per_step"]), _f(k["transfer_ms"]), _f(k["wait_ms"])]
                        for k in w["kinds"]], ["KIND", "CALLS", "TRANSFER", "WAIT"], "    ")
    text += "".join(f"  {line}\n" for line in clock_lines(w) + replay_lines(w.get("replay")))
    return text


def pipeline_text(ranks: list[RankResult], per_table: int = 6) -> str:
    """The pipeline schedule of the ranks that ran one (pipeline.py): per rank, its stage, the span, the computing
    and the bubble; then each microbatch's forward and backward (start from the step's start, time in it, computing
    in it), `per_table` microbatches a table."""
    shown = [(r, p) for r in ranks if (p := r.get("pipeline"))]
    if not shown:
        return ""
    steps = sorted({p["steps"] for _, p in shown})
    basis = {p["basis"] for _, p in shown}
    text = (f"\npipeline schedule (torch.distributed.pipelining's labels {', '.join(sorted({p['labels'] for _, p in shown}))}; "
            f"ms per step, mean of {'/'.join(str(n) for n in steps)} step(s); "
            f"{'on the device' if basis == {'device'} else 'on the CPU' if basis == {'cpu'} else 'CPU and device'})\n")
    rows = [[_rank(r), stage_label(p), str(p["microbatches"]), _f(p["span_ms"]), _f(p["busy_ms"]),
             _f(p["bubble_ms"]), f"{p['bubble_pct']:.1f}"] for r, p in shown]
    text += _table(rows, ["RANK", "STAGE", "MICROBATCHES", "SPAN MS", "COMPUTING MS", "BUBBLE MS", "BUBBLE %"])
    text += ("  bubble: the span (the first microbatch's start to the last's end) less the time the stage computes in "
             "it (waiting for its neighbours, sending, idle)\n")
    lanes: dict[tuple[str, str, str], dict[int, list[Any]]] = {}
    for r, p in shown:
        for row in p["actions"]:
            stage = str(row[0]) if row[0] is not None else p.get("role") or "?"
            lanes.setdefault((_rank(r), stage, row[1]), {})[row[2]] = row
    microbatches = sorted({mb for lane in lanes.values() for mb in lane})
    text += "  each microbatch: start (from the step's start) +time in it (computing in it), ms\n"
    for k in range(0, len(microbatches), per_table):
        chunk = microbatches[k:k + per_table]
        table = [[rank, stage, PIPELINE_KINDS[kind],
                  *[f"{lane[mb][3]:.2f} +{lane[mb][4]:.2f} ({lane[mb][5]:.2f})" if mb in lane else "" for mb in chunk]]
                 for (rank, stage, kind), lane in sorted(lanes.items(), key=lambda kv: (
                     int(kv[0][0]) if kv[0][0].isdigit() else -1, _stage_order(kv[0][1]), "FBIW".index(kv[0][2])))]
        text += _table(table, ["RANK", "STAGE", "ACTION", *[f"MB {mb}" for mb in chunk]], "    ")
    for r, p in shown:
        if p.get("dropped_actions"):
            text += f"  rank {_rank(r)}: {p['dropped_actions']} more action(s) than a summary keeps (the first are shown)\n"
    return text


def _stage_order(stage: str) -> tuple[int, int]:
    """A stage as the schedule's table orders it: by number, or first, middle, last, only."""
    return (0, int(stage)) if stage.isdigit() else (1, ["first", "middle", "last", "only"].index(stage)
                                                    if stage in ("first", "middle", "last", "only") else 4)


def clock_lines(w: dict[str, Any]) -> list[str]:
    clock = w["clock"]
    out = []
    if clock.get("hosts", 1) > 1:
        out.append(clock_text(clock))
    return out + [f"note: {n}" for n in w["notes"]]


def replay_lines(replay: dict[str, Any] | None) -> list[str]:
    """The what-if replay of one capture: its error, the ideal, and the ranks that explain the time above it."""
    if not replay:
        return []
    above = replay["replayed_ms"] - replay["ideal_ms"]
    line = (f"what-if replay: replayed step {replay['replayed_ms']:.2f} ms against {replay['measured_ms']:.2f} measured "
            f"(error {replay['error_pct']:+.1f} %); ideal (every rank's work the ranks' median) {replay['ideal_ms']:.2f} ms")
    top = sorted((s for s in replay["shares"] if s["ms"] > 0), key=lambda s: -s["ms"])[:3]
    if top and above > 0:
        line += "; " + ", ".join(f"rank {s['rank']} explains {min(100, round(100 * s['ms'] / above))} %"
                                 for s in top) + f" of the {above:.2f} ms/step above it"
    return [line]


def _rank_text(r: RankResult, top: int) -> str:
    text = f"\n-- rank {_rank(r)}  {r['path']}\n"
    for w in r.get("warnings") or []:
        text += f"  warning: {w}\n"
    text += _steps_text(r)
    if r.get("top_self"):
        text += f"  top operators by self time (of {r.get('operators')} operators)\n"
        text += _ops_table(r["top_self"][:top])
        text += "  top operators by total time\n"
        text += _ops_table(r["top_total"][:top])
    if r.get("top_kernels"):
        text += "  top device kernels\n"
        kernels = r["top_kernels"][:top]
        rows = [[label, str(k["calls"]), _f(k["total_us"] / 1000, 3), _f(k["avg_us"], 1), "comm" if k["comm"] else ""]
                for k, label in zip(kernels, short_names([k["name"] for k in kernels]))]
        text += _table(rows, ["KERNEL", "CALLS", "TOTAL MS", "AVG US", ""], "    ")
    return text + _memory_text(r.get("memory"))


def _steps_text(r: RankResult) -> str:
    steps = r.get("steps") or []
    if not steps:
        return "  no ProfilerStep#N steps in this trace\n"
    rows = [[str(s["step"]), _f(s["dur_ms"]), _f(s["window_ms"]), _f(s["compute_ms"]), _f(s["comm_ms"]),
             _f(s["overlap_ms"]), _f(s["idle_ms"])] for s in steps]
    if r.get("split_from"):
        basis = f"torch_npu's {r['split_from']}: COMPUTE excludes OVERLAP, COMM is the exposed communication"
    elif r.get("basis") == "device":
        how = r.get("kernel_steps") or {}
        basis = ("device kernels, each in the step that launched it; WINDOW: from the step's first kernel to the "
                 "next step's" + (f"; {how['by_time']} kernel(s) without a launch in the file placed by time"
                                  if how.get("by_time") else ""))
    else:
        basis = ("CPU: COMPUTE = the step's thread in an operator, COMM = a collective on any thread (gloo runs on its "
                 "own threads), OVERLAP = both, IDLE = neither")
    text = f"  steps (split by {basis})\n"
    text += _table(rows, ["STEP", "MS", "WINDOW MS", "COMPUTE MS", "COMM MS", "OVERLAP MS", "IDLE MS"], "    ")
    return text + "  " + comm_counted(r) + "\n"


def comm_counted(r: RankResult) -> str:
    """What the split counted as communication: each collective kind with its calls and time per step (what ran
    the transfer, and what issued it), then each library with its time inside the steps (libraries nest: c10d's
    operator issues gloo's range, so their times do not add up)."""
    libraries = r.get("comm_libraries") or []
    if r.get("split_from"):
        return f"communication: as torch_npu's {r['split_from']} counts it (HCCL)"
    if not libraries and r.get("world_size") == 1:  # no peer to wait for: nothing was missed
        return "communication: none (one rank, world size 1: no collectives in its steps)"
    if not libraries:
        return ("communication: none recognised (NCCL/RCCL, HCCL, gloo, c10d, DeepEP, NVSHMEM, SymmetricMemory, "
                "MSCCL++ names; see docs/reports.md)")
    text = ""
    kinds = r.get("collectives") or []
    if kinds:
        text = "communication per step, by collective (kinds can overlap one another): " + ", ".join(
            f"{k['kind']} {k['ms_per_step']:.2f} ms ({_calls(k['count_per_step'])} call(s) via {'/'.join(k['via'])}"
            + (f", issued by {_issued(k)}" if _issued(k) else "") + ")" for k in kinds) + "\n  "
    return text + "communication counted: " + ", ".join(
        f"{lib['library']} {lib['ms']:.2f} ms ({lib['count']} {lib['unit'] if lib['count'] != 1 else lib['unit'][:-1]})"
        for lib in libraries) + (" (libraries nest, c10d's operators around the transfers: not additive)"
                                 if len(libraries) > 1 else "")


def _issued(k: dict[str, Any]) -> str:
    """Where the kind comes from the operator that issued the transfer, not from the transfer's own name
    (FSDP's reduce_scatter run by gloo as an all_reduce): that operator."""
    issued = k.get("issued_by") or {}
    return next(iter(issued), "") if issued else ""


def _memory_text(mem: dict[str, Any] | None) -> str:
    if not mem:
        return ""
    components = any(d.get("component") for d in mem["devices"])
    rows = [[d.get("device") or "?", *([d.get("component") or "-"] if components else []), _mib(d["peak_allocated"]),
             _mib(d.get("peak_reserved")), str(d["allocs"] if d.get("allocs") is not None else "-"),
             _mib(d.get("alloc_bytes")), str(d["frees"] if d.get("frees") is not None else "-")]
            for d in mem["devices"]]
    text = f"  memory (chart: {mem.get('series_device')})\n"
    if any(d.get("derived") for d in mem["devices"]):
        text += "    (this trace records only allocation sizes: peaks are above what was allocated when it began)\n"
    header = ["DEVICE", *(["COMPONENT"] if components else []), "PEAK MIB", "RESERVED MIB", "ALLOCS", "ALLOC MIB",
              "FREES"]
    return text + _table(rows, header, "    ")


def _ops_table(ops: list[dict[str, Any]]) -> str:
    rows = [[label, str(o["calls"]), _f(o["self_us"] / 1000, 3), _f(o["total_us"] / 1000, 3),
             _f(o["avg_us"], 1), "comm" if o["comm"] else ""] for o, label in zip(ops, short_names([o["name"] for o in ops]))]
    return _table(rows, ["OPERATOR", "CALLS", "SELF MS", "TOTAL MS", "AVG US", ""], "    ")


# ----------------------------------------------------------------------------------------------------------
# A capture against its baseline (compare.py): the cause first, then the figures behind it


def render_comparison(c: Mapping[str, Any], top: int = 5) -> str:
    """What `ondemandctl report NOW --baseline BASE` prints."""
    jobs = c.get("job") or {}
    out = [f"capture {c['capture']}" + (f" (job {jobs['now']})" if jobs.get("now") else "")
           + f" against baseline {c['baseline']}" + (f" (job {jobs['baseline']})" if jobs.get("baseline") else "")]
    s = c["step_ms"]
    if s.get("baseline") is not None and s.get("now") is not None:
        pct = f", {s['pct']:+.1f}%" if s.get("pct") is not None else ""
        test = s.get("test")
        tested = f"; {_test_text(test)}" if test else ""
        out.append(f"  step time {s['baseline']:.2f} -> {s['now']:.2f} ms ({s['delta']:+.2f} ms{pct}), mean of the "
                   f"ranks{tested}")
    out.append(f"  cause: {c['cause']}")
    for note in c.get("notes") or []:
        out.append(f"  note: {note}")
    text = "\n".join(out) + "\n"
    ranks = c["ranks"]
    if ranks:
        rows = []
        for r in ranks:
            mark = ""
            if r["rank"] in (c.get("culprits") or []):
                mark = "comm grew" if c.get("category") == "communication" else "cause"
            elif r["rank"] in (c.get("waiting") or []):
                mark = "waited"
            tests = r.get("tests") or {}
            rows.append(["?" if r["rank"] is None else str(r["rank"]), _arrow(r["step_ms"], tests.get("step")),
                         *[_arrow(r["split"][key], tests.get(key)) for key, _ in SPLIT],
                         _cpu_arrow(tests.get("proc_wait") or tests.get("cpu_wait")), mark])
        text += "\nper rank, ms per step (baseline -> now; * a significant change: Welch's t on the per-step values, 95 %)\n"
        text += _table(rows, ["RANK", "STEP", "COMPUTE", "COMM (EXPOSED)", "OVERLAP", "IDLE", "CPU WAIT", ""])
    kinds = [k for k in c.get("communication") or [] if abs(k["now_ms"] - k["baseline_ms"]) >= 0.005 or
             round(k["calls_now"], 1) != round(k["calls_baseline"], 1)]
    if kinds:
        text += "\ncommunication by collective, mean of the ranks, per step (kinds can overlap one another)\n"
        text += _table([[k["kind"], f"{_calls(k['calls_baseline'])} -> {_calls(k['calls_now'])}",
                         f"{k['baseline_ms']:.2f} -> {k['now_ms']:.2f}", f"{k['now_ms'] - k['baseline_ms']:+.2f}"]
                        for k in kinds], ["KIND", "CALLS", "MS", "DELTA MS"])
    text += _compared_waits(c)
    shown = _ranks_to_detail(c, ranks)
    for r in shown:
        changes = r["changes"][:top]
        if not changes:
            continue
        text += f"\nrank {rank_said(r['rank'])}: what changed most, per step (operators by self time, kernels by time; " \
                "* significant)\n"
        labels = short_names([x["name"] for x in changes], 56)
        text += _table([[label, x["category"] + ("" if x["status"] == "changed" else f" ({x['status']})"),
                         _opt(x["baseline_ms"], 3), _opt(x["now_ms"], 3), _delta(x),
                         f"{_opt_calls(x['calls_baseline'])} -> {_opt_calls(x['calls_now'])}",
                         f"{_opt(x['mean_us_baseline'], 1)} -> {_opt(x['mean_us_now'], 1)}"]
                        for x, label in zip(changes, labels)],
                       ["NAME", "WHAT", "BASE MS", "NOW MS", "DELTA", "CALLS", "MEAN US"])
    if len(shown) < len(ranks):
        text += f"\n({len(ranks) - len(shown)} more rank(s): --json has every rank's changes)\n"
    return text + f"\nrule: {c.get('rule', '')}\n"


def _compared_waits(c: Mapping[str, Any]) -> str:
    """Who made whom wait on each side, inside each capture (immune to the host drifting between the two), the
    transfer per collective kind, and the what-if replay of the growth."""
    w = c.get("collectives") or {}
    b, n = w.get("baseline"), w.get("now")
    if not n:
        return ""
    before = {r["rank"]: r for r in (b or {}).get("ranks", [])}
    rows = []
    for r in n["ranks"]:
        o = before.get(r["rank"])
        rows.append([str(r["rank"]),
                     f"{100 * o['last_share']:.0f}% -> {100 * r['last_share']:.0f}%" if o else f"{100 * r['last_share']:.0f}%",
                     f"{o['caused_ms']:.2f} -> {r['caused_ms']:.2f}" if o else f"{r['caused_ms']:.2f}",
                     f"{o['wait_ms']:.2f} -> {r['wait_ms']:.2f}" if o else f"{r['wait_ms']:.2f}"])
    text = ("\nwho made whom wait, inside each capture (ms per step, baseline -> now; arrival: "
            f"{n['arrival']})\n")
    text += _table(rows, ["RANK", "ARRIVED LAST", "OTHERS WAITED FOR IT", "ITS WAIT"])
    kinds_b = {k["kind"]: k for k in (b or {}).get("kinds", [])}
    krows = [[k["kind"], f"{kinds_b[k['kind']]['transfer_ms']:.2f} -> {k['transfer_ms']:.2f}" if k["kind"] in kinds_b
              else f"- -> {k['transfer_ms']:.2f}",
              f"{kinds_b[k['kind']]['wait_ms']:.2f} -> {k['wait_ms']:.2f}" if k["kind"] in kinds_b
              else f"- -> {k['wait_ms']:.2f}"] for k in n["kinds"]]
    if krows:
        text += "  by collective kind, mean over its ranks (ms per step)\n"
        text += _table(krows, ["KIND", "TRANSFER", "WAIT"], "    ")
    shares = c.get("shares")
    if shares:
        growth = (c["step_ms"].get("delta") or 0.0)
        parts = ", ".join(f"rank {x['rank']} {x['ms']:+.2f}" for x in sorted(shares["shares"], key=lambda x: -x["ms"])[:4])
        text += (f"  what-if replay (error {shares['error_pct']:+.1f} % now, {shares['baseline_error_pct']:+.1f} % in the "
                 f"baseline): the step now would be shorter by, with one rank's work as in the baseline: {parts} ms")
        if shares.get("collectives_ms") is not None:
            text += f"; with every rank's, the collectives' part left of the {growth:+.2f} ms: {shares['collectives_ms']:+.2f} ms"
        text += "\n"
    return text


def _test_text(t: dict[str, Any]) -> str:
    if t.get("delta") is None:
        return "no values"
    if t.get("lo") is None:
        return "one step on a side: no noise estimate"
    word = {"grew": "significant", "shrank": "significant", "same": "not significant"}.get(t["verdict"], t["verdict"])
    return f"{t['delta']:+.2f} ms/step, 95 % CI {t['lo']:+.2f} to {t['hi']:+.2f} ({word})"


def _ranks_to_detail(c: Mapping[str, Any], ranks: list[dict[str, Any]], most: int = 4) -> list[dict[str, Any]]:
    """The culprits, then the ranks that waited, up to `most` (every rank of a small job)."""
    if len(ranks) <= most:
        return ranks
    order = [*(c.get("culprits") or []), *(c.get("waiting") or [])]
    picked = [r for k in order for r in ranks if r["rank"] == k][:most]
    return picked or ranks[:most]


def _arrow(p: dict[str, Any], test: dict[str, Any] | None = None) -> str:
    b, n = p.get("baseline"), p.get("now")
    if b is None or n is None:
        return "-"
    star = "*" if test and test.get("verdict") in ("grew", "shrank") else ""
    return f"{b:.2f} -> {n:.2f} ({n - b:+.2f}{star})"


def _cpu_arrow(t: dict[str, Any] | None) -> str:
    if not t or t.get("before") is None or t.get("after") is None:
        return "-"
    star = "*" if t.get("verdict") in ("grew", "shrank") else ""
    return f"{t['before']:.2f} -> {t['after']:.2f}{star}"


def _opt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _calls(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def _opt_calls(x: float | None) -> str:
    return "?" if x is None else _calls(x)


def _delta(x: dict[str, Any]) -> str:
    if x["baseline_ms"] is None or x["now_ms"] is None:
        return "?"  # below the other side's table (its longest PER_STEP_OPS / PER_STEP_KERNELS)
    star = "*" if (x.get("test") or {}).get("verdict") in ("grew", "shrank") else ""
    return f"{x['now_ms'] - x['baseline_ms']:+.3f}{star}"
