"""The HTML report: one self-contained file (inline CSS, inline SVG charts drawn here, a few lines of JS for
tabs and sorting; nothing is fetched), with an Operator view, a Memory view and a Timeline view per capture."""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from .analyze import SHARES
from .grouping import vs_median_pct
from .model import CaptureGroup, RankResult, Report
from .pipeline import KINDS as PIPELINE_KINDS, stage_label
from .text import comm_counted, shares_text, short_names

PALETTE = {"compute": "#4e79a7", "comm": "#e15759", "overlap": "#b07aa1", "idle": "#bab0ac", "slow": "#e15759",
           "bar": "#4e79a7", "mem": "#59a14f"}
SHARE_LABELS = {"compute": "compute", "comm": "communication (exposed)", "overlap": "overlap", "idle": "idle"}

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:12px 24px}header h1{font-size:20px;margin:0}
main{padding:12px 24px}section.capture{background:#fff;border:1px solid #ddd;border-radius:6px;margin:16px 0;
padding:12px 16px}h2{font-size:17px;margin:4px 0 8px}h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;margin:6px 0}th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:left}
th{cursor:pointer;background:#f3f3f3;user-select:none}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.slowest td{background:#fdecea}.tabs button{border:1px solid #ccc;background:#f3f3f3;padding:5px 12px;
cursor:pointer;margin-right:4px;border-radius:4px 4px 0 0}.tabs button.active{background:#fff;
border-bottom-color:#fff;font-weight:600}.view{display:none;border:1px solid #ccc;padding:8px;
border-radius:0 4px 4px 4px}.view.active{display:block}.problem{color:#b00020}.muted{color:#666}
code{background:#f3f3f3;padding:1px 4px;border-radius:3px}svg text{font:11px system-ui,sans-serif}
.legend span{display:inline-block;width:10px;height:10px;margin:0 4px 0 12px;vertical-align:middle}
td.name{max-width:36em;overflow-wrap:anywhere}nav.index{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:8px 16px;margin:16px 0}nav.index ol{margin:4px 0;padding-left:24px}.rank-view{display:none}
.rank-view.active{display:block}.note{background:#fff8e1;border-left:3px solid #f9a825;padding:4px 8px}
details.sources{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 16px;margin:16px 0}
"""

JS = """
function showView(id){
  var v=document.getElementById(id);
  if(!v||!v.classList.contains('view'))return false;
  var sec=v.parentElement;
  sec.querySelectorAll(':scope > .view').forEach(function(x){x.classList.remove('active');});
  sec.querySelectorAll(':scope > .tabs button').forEach(function(b){b.classList.toggle('active',b.dataset.view===id);});
  v.classList.add('active');return true;
}
document.querySelectorAll('.tabs button').forEach(function(b){
  b.addEventListener('click',function(){showView(b.dataset.view);});
});
function showRank(sel,value){
  sel.value=value;
  sel.closest('.view').querySelectorAll(':scope > .rank-view').forEach(function(v){
    v.classList.toggle('active',v.dataset.rank===value);
  });
}
document.querySelectorAll('select.rank-select').forEach(function(sel){
  sel.addEventListener('change',function(){showRank(sel,sel.value);});
});
// a link can open a view and a rank in it: report.html#view=c0-mem&rank=1 (not an element id: no jump)
(function(){
  var args={};location.hash.slice(1).split('&').forEach(function(kv){var p=kv.split('=');args[p[0]]=p[1];});
  if(args.view&&showView(args.view)&&args.rank!==undefined){
    var sel=document.getElementById(args.view).querySelector('select.rank-select');if(sel)showRank(sel,args.rank);
  }
})();
document.querySelectorAll('table.sortable th').forEach(function(th,i){
  th.addEventListener('click',function(){
    var table=th.closest('table'),body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
    var asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
    rows.sort(function(a,b){
      var x=a.cells[i].dataset.v||a.cells[i].textContent,y=b.cells[i].dataset.v||b.cells[i].textContent;
      var nx=parseFloat(x),ny=parseFloat(y);
      var c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c;
    });
    rows.forEach(function(r){body.appendChild(r);});
  });
});
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _rank(r: RankResult) -> str:
    return "?" if r.get("rank") is None else _e(r["rank"])


def _said(rank: Any) -> str:
    """A compared rank's number, escaped; a trace that names none (no distributedInfo) says so, not None."""
    return "? (no distributedInfo)" if rank is None else _e(rank)


def _num(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _count(x: float | None) -> str:
    """Calls: a whole number as one (a mean per step of 1.0 read `1.0`), else to a tenth."""
    return "-" if x is None else f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def render_html(report: Report) -> str:
    body = [_sources(report)]
    for p in report["problems"]:
        body.append(f'<p class="problem">Cannot report on <code>{_e(p["path"])}</code>: {_e(p["error"])}</p>')
    if not report["captures"]:
        body.append("<p>Nothing to report.</p>")
    if len(report["captures"]) > 1:
        body.append(_index(report["captures"]))
    for i, group in enumerate(report["captures"]):
        body.append(_group(group, f"c{i}"))
    title = "ondemand_prof report"
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><style>{CSS}</style></head>"
            f"<body><header><h1>{title}</h1><div class=\"muted\" style=\"color:#cfd8dc\">{report['ranks_read']} rank "
            f"capture(s) from {len(report['captures'])} capture(s)</div></header><main>{''.join(body)}</main>"
            f"<script>{JS}</script></body></html>")


def _sources(report: Report) -> str:
    """What the search found and skipped (each with the reason), folded unless something was skipped."""
    listing = report.get("sources") or []
    skipped = [e for e in listing if e["status"] != "found"]
    found = [e for e in listing if e["status"] == "found"]
    if len(found) <= 1 and not skipped:
        return ""
    rows = [f'<tr><td>found</td><td><code>{_e(e["path"])}</code></td><td>{_e(e["format"])}'
            + (f' → <a href="#c{e["capture"] - 1}">capture {e["capture"]}</a>' if e.get("capture") else "")
            + "</td></tr>" for e in found]
    rows += [f'<tr><td class=problem>skipped</td><td><code>{_e(e["path"])}</code></td><td>{_e(e["reason"])}</td></tr>'
             for e in skipped]
    others = report.get("other_files") or {}
    extra = (f'<p class=muted>{sum(others.values())} other file(s) of no profile format: '
             + ", ".join(f"{_e(k)} {n}" for k, n in others.items()) + "</p>") if others else ""
    return (f'<details class="sources"{" open" if skipped else ""}><summary>Sources: {len(found)} found, '
            f'{len(skipped)} skipped</summary><table><tbody>{"".join(rows)}</tbody></table>{extra}</details>')


def _title(group: CaptureGroup) -> str:
    if group.get("capture_id"):
        return f"Capture {_e(group['capture_id'])}"
    members = group["ranks"] or group["failed"]
    kinds: dict[str | None, str] = {"ascend": "torch_npu output", "db": "Databases"}  # no rank read: None
    where = os.path.commonpath([str(Path(m["path"]).parent) for m in members]) if members else ""
    return f"{kinds.get((group['ranks'] or [{}])[0].get('kind'), 'Traces')} in <code>{_e(where)}</code>"


def _index(groups: list[CaptureGroup]) -> str:
    """Links to each capture, with its ranks and mean step, so a long report can be navigated."""
    items = []
    for i, g in enumerate(groups):
        steps = [r["step_ms_mean"] for r in g["ranks"] if r.get("step_ms_mean")]
        detail = f"{len(g['ranks'])} rank(s)" + (f", {len(g['failed'])} failed" if g["failed"] else "")
        if steps:
            detail += f", mean step {sum(steps) / len(steps):.1f} ms"
        items.append(f'<li><a href="#c{i}">{_title(g)}</a> <span class="muted">{_e(g.get("newest") or "")} '
                     f'{detail}</span></li>')
    return f'<nav class="index"><strong>{len(groups)} captures</strong><ol>{"".join(items)}</ol></nav>'


def _group(group: CaptureGroup, gid: str) -> str:
    title = _title(group)
    meta = []
    if group.get("grouped_by"):
        meta.append(f"grouped by {_e(group['grouped_by'])}")
    if group.get("job_id"):
        meta.append(f"job <code>{_e(group['job_id'])}</code>")
    if group.get("source"):
        meta.append(f"trigger {_e(group['source'])}")
    w = group.get("window")
    if isinstance(w, dict):
        meta.append(f"window [{_e(w.get('start'))}, {_e(w.get('end'))})")
    options = group.get("options")
    if options:
        meta.append("options " + ", ".join(f"{_e(k)}={_e(v)}" for k, v in options.items()))
    parts = [f'<section class="capture" id="{gid}"><h2>{title}</h2><div class="muted">{" · ".join(meta)}</div>',
             _ranks_table(group), _pipeline_html(group["ranks"])]
    for f in group["failed"]:
        parts.append(f'<p class="problem">Rank {_e(f["rank"])} failed: {_e(f["error"])} '
                     f'<span class="muted">({_e(f["path"])})</span></p>')
    if group["ranks"]:
        views = [("Operators", f"{gid}-ops", _operator_view(group, gid)),
                 ("Memory", f"{gid}-mem", _memory_view(group, gid)),
                 ("Timeline", f"{gid}-tl", _timeline_view(group, gid))]
        parts.append('<div class="tabs">' + "".join(
            f'<button data-view="{vid}"{" class=active" if k == 0 else ""}>{name}</button>'
            for k, (name, vid, _) in enumerate(views)) + "</div>")
        for k, (_, vid, content) in enumerate(views):
            parts.append(f'<div class="view{" active" if k == 0 else ""}" id="{vid}">{content}</div>')
        parts.append(_open_traces(group))
    parts.append("</section>")
    return "".join(parts)


def _ranks_table(group: CaptureGroup) -> str:
    ranks = group["ranks"]
    if not ranks:
        return "<p>No rank could be read.</p>"
    slowest = group.get("slowest") or {}
    median = group.get("median_step_ms")
    rows = []
    for r in ranks:
        pct = vs_median_pct(r.get("step_ms_mean"), median)
        vs = f"{pct:+.1f}%" if pct is not None else "-"
        is_slow = bool(slowest.get("stands_out")) and r.get("rank") == slowest.get("rank")
        rows.append(f'<tr{" class=slowest" if is_slow else ""}><td>{_rank(r)}'
                    f'{" (slowest)" if is_slow else ""}</td><td class=num>{len(r.get("steps") or [])}</td>'
                    f'<td class=num>{_num(r.get("step_ms_mean"))}</td><td class=num>{_num(r.get("step_ms_max"))}</td>'
                    + "".join(f"<td class=num>{v}</td>" for v in shares_text(r)) + f'<td class=num>{vs}</td></tr>')
    note = ""
    if slowest and len(ranks) > 1:
        s = slowest
        what = (f'the others waited {s["step_ms"]:.2f} ms per step for it at collectives (it arrived last at '
                f'{100 * s.get("last_share", 0):.0f}% of them)') if s.get("by") == "wait caused" else \
            f'{s["step_ms"]:.2f} ms per step, {s["vs_median_ms"]:+.2f} ms ({s["vs_median_pct"]:+.1f}%) from the median ' \
            f'{median:.2f} ms'
        note = (f'<p>Slowest: rank {_e(s["rank"])}, {what}'
                + (": it stands out" if s.get("stands_out") else f"; not marked: {_e(s.get('why_not'))}")
                + f'. <span class=muted>The slowest rank is {_e(s.get("rule"))}.</span></p>')
        note += _waits_html(group.get("collectives"))
    return ('<h3>Across ranks</h3><table class="sortable"><thead><tr><th>Rank</th><th>Steps</th><th>Step ms</th>'
            '<th>Max ms</th><th>Compute %</th><th>Comm % (exposed)</th><th>Overlap %</th><th>Idle %</th>'
            '<th>vs median</th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>" + note + _split_chart(ranks))


PIPELINE_COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "I": "#f28e2b", "W": "#59a14f"}


def _pipeline_html(ranks: list[RankResult]) -> str:
    """The pipeline schedule (pipeline.py): per rank its stage, span, computing and bubble, and each rank's
    microbatches drawn from the step's start (the mean over the steps: forward blue, backward orange, the weights'
    backward green; the darker part of a box is the computing in it)."""
    shown = [(r, p) for r in ranks if (p := r.get("pipeline"))]
    if not shown:
        return ""
    rows = "".join(f'<tr><td>{_rank(r)}</td><td>{_e(stage_label(p))}</td><td class=num>{_e(p["microbatches"])}</td>'
                   f'<td class=num>{p["span_ms"]:.2f}</td><td class=num>{p["busy_ms"]:.2f}</td>'
                   f'<td class=num>{p["bubble_ms"]:.2f}</td><td class=num>{p["bubble_pct"]:.1f}</td></tr>'
                   for r, p in shown)
    width, lane_h, left = 900, 22, 110
    end = max((a[3] + a[4] for _, p in shown for a in p["actions"]), default=0.0) or 1.0
    scale = (width - left - 10) / end
    lanes = []
    for r, p in shown:
        for stage in sorted({a[0] for a in p["actions"]}, key=lambda x: -1 if x is None else x):
            lanes.append((r, p, stage, [a for a in p["actions"] if a[0] == stage]))
    parts = []
    for i, (r, p, stage, acts) in enumerate(lanes):
        y = 18 + i * lane_h
        label = f"rank {_rank(r)}" + (f" · stage {stage}" if stage is not None else "")
        parts.append(f'<text x="4" y="{y + 13}">{label}</text>')
        for a in acts:
            x, w = left + a[3] * scale, max(1.0, a[4] * scale)
            busy = min(w, a[5] * scale)
            colour = PIPELINE_COLOURS.get(a[1], "#999")
            parts.append(f'<g><rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h - 6}" fill="{colour}" '
                         f'fill-opacity="0.3" stroke="{colour}"><title>rank {_rank(r)} {_e(PIPELINE_KINDS[a[1]])} '
                         f'microbatch {a[2]}: starts {a[3]:.2f} ms into the step, {a[4]:.2f} ms, computing {a[5]:.2f} '
                         f'ms</title></rect><rect x="{x:.1f}" y="{y + lane_h - 10}" width="{busy:.1f}" height="4" '
                         f'fill="{colour}"/>' + (f'<text x="{x + 2:.1f}" y="{y + 11}">{_e(a[1])}{a[2]}</text>'
                                                 if w > 16 else "") + "</g>")
    parts.append(f'<text x="{left}" y="11">0 ms</text><text x="{width - 10}" y="11" text-anchor="end">'
                 f'{end:.1f} ms from the step\'s start</text>')
    return ('<h3>Pipeline schedule</h3><p class=muted>torch.distributed.pipelining\'s labels; per step, the mean over '
            'the steps. Bubble: the span (the first microbatch\'s start to the last\'s end) less the time the stage '
            'computes in it.</p><table class="sortable"><thead><tr><th>Rank</th><th>Stage</th><th>Microbatches</th>'
            '<th>Span ms</th><th>Computing ms</th><th>Bubble ms</th><th>Bubble %</th></tr></thead><tbody>' + rows
            + f'</tbody></table><svg class="chart" width="{width}" height="{24 + len(lanes) * lane_h}" role="img">'
            + "".join(parts) + "</svg>")


def _waits_html(w: dict[str, Any] | None) -> str:
    """Who made whom wait in the capture (waits.summary): per rank, and the wait matrix (rows: who waited)."""
    if not w:
        return ""
    rows = "".join(f'<tr><td>{_e(r["rank"])}</td><td class=num>{r["arrived_last"]} ({100 * r["last_share"]:.0f}%)</td>'
                   f'<td class=num>{r["caused_ms"]:.2f}</td><td class=num>{r["wait_ms"]:.2f}</td></tr>'
                   for r in w["ranks"])
    html = (f'<h3>Who made whom wait</h3><p>{w["matched"]} collectives matched across the ranks '
            f'(arrival: {_e(w["arrival"])}); ms per step.</p><table class="sortable"><thead><tr><th>Rank</th>'
            '<th>Arrived last</th><th>Others waited for it</th><th>Its wait</th></tr></thead><tbody>' + rows
            + '</tbody></table>')
    m = w.get("matrix") or {}
    if m.get("ranks"):
        head = "".join(f"<th>{_e(r)}</th>" for r in m["ranks"])
        body = "".join(f'<tr><th>{_e(i)}</th>' + "".join(f'<td class=num>{v:.2f}</td>' for v in row) + "</tr>"
                       for i, row in zip(m["ranks"], m["ms_per_step"]))
        html += (f'<p class=muted>How long each rank (row) waited for each other rank (column), ms per step.</p>'
                 f'<table><thead><tr><th></th>{head}</tr></thead><tbody>{body}</tbody></table>')
    return html


def _mean_split(r: RankResult) -> dict[str, float] | None:
    """Each share's mean ms per step and the mean window, from the per-step rows (what was measured)."""
    steps = [s for s in r.get("steps") or [] if s.get("window_ms")]
    if not steps:
        return None
    out = {key: sum(s[f"{key}_ms"] for s in steps) / len(steps) for key in SHARES}
    out["window"] = sum(s["window_ms"] for s in steps) / len(steps)
    out["cpu"] = sum(s["dur_ms"] for s in steps) / len(steps)
    out["steps"] = len(steps)
    return out


def _split_chart(ranks: list[RankResult]) -> str:
    """Stacked bars: each rank's mean step window split into the four shares, each segment the mean of the
    per-step rows (ms measured, not a share of another mean)."""
    timed = [(r, m) for r in ranks if (m := _mean_split(r))]
    if not timed:
        if any(r.get("steps") for r in ranks):
            return ('<p class="note">No step has a split to draw: its window is empty (no device kernel in the '
                    'steps, or steps of zero length).</p>')
        return ""
    width, row_h, left, right = 760, 20, 70, 190
    scale = (width - left - right) / (max(m["window"] for _, m in timed) or 1.0)
    parts = []
    for i, (r, m) in enumerate(timed):
        y, x = 6 + i * row_h, float(left)
        for key in SHARES:
            w = m[key] * scale
            pct = 100 * m[key] / m["window"] if m["window"] else 0.0
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" fill="{PALETTE[key]}">'
                         f'<title>rank {_rank(r)} {SHARE_LABELS[key]}: {m[key]:.2f} ms per step (mean of '
                         f'{m["steps"]} steps), {pct:.1f}% of the window</title></rect>')
            x += w
        label = f'{m["window"]:.2f} ms'
        if abs(m["window"] - m["cpu"]) > 0.005:
            label += f' (CPU step {m["cpu"]:.2f} ms)'
        parts.append(f'<text x="4" y="{y + 11}">rank {_rank(r)}</text>'
                     f'<text x="{x + 4:.1f}" y="{y + 11}">{_e(label)}</text>')
    height = 12 + len(timed) * row_h
    legend = "".join(f'<span style="background:{PALETTE[k]}"></span>{SHARE_LABELS[k]}' for k in SHARES)
    device = any(r.get("basis") == "device" for r, _ in timed)
    what = "mean device window per step" if device else "mean step"
    return (f'<div class="legend">{what}, split{legend}</div><svg class="chart" id="split-chart" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" role="img">{"".join(parts)}</svg>')


def _rank_views(group: CaptureGroup, gid: str, kind: str, render: Callable[[RankResult, str], str]) -> str:
    """One block per rank, one shown at a time, chosen with a rank selector (all of them when one rank)."""
    blocks = [(r, render(r, f"{gid}-r{r.get('rank')}")) for r in group["ranks"]]
    blocks = [(r, b) for r, b in blocks if b]
    if not blocks:
        return ""
    if len(blocks) == 1:
        return blocks[0][1]
    options = "".join(f'<option value="{k}">rank {_rank(r)}</option>' for k, (r, _) in enumerate(blocks))
    select = (f'<p><label>Rank <select class="rank-select" id="{gid}-{kind}-select">{options}</select></label> '
              f'<span class=muted>({len(blocks)} ranks)</span></p>')
    return select + "".join(f'<div class="rank-view{" active" if k == 0 else ""}" data-rank="{k}">{b}</div>'
                            for k, (_, b) in enumerate(blocks))


def _operator_view(group: CaptureGroup, gid: str) -> str:
    out = _rank_views(group, gid, "ops", _rank_operators)
    return out or "<p class=muted>No operators in this capture.</p>"


def _rank_operators(r: RankResult, rid: str) -> str:
    ops = r.get("top_self") or []
    kernels = r.get("top_kernels") or []
    out = [f"<h3>Rank {_rank(r)}</h3><p class=muted>{_e(comm_counted(r))}</p>"]
    if ops:
        out.append(_bar_chart([(o["name"], o["self_us"] / 1000) for o in ops], f"op-chart-{rid}", "self time, ms"))
        out.append(_ops_table(ops))
    if kernels:
        labels = short_names([k["name"] for k in kernels])
        out.append(_bar_chart([(k["name"], k["total_us"] / 1000) for k in kernels], f"kernel-chart-{rid}",
                              "device time, ms"))
        out.append('<table class="sortable"><thead><tr><th>Kernel</th><th>Calls</th><th>Total ms</th>'
                   '<th>Avg us</th><th>Kind</th></tr></thead><tbody>' + "".join(
                       f'<tr><td class=name title="{_e(k["name"])}">{_e(label)}</td>'
                       f'<td class=num>{_count(k["calls"])}</td>'
                       f'<td class=num>{k["total_us"] / 1000:.3f}</td><td class=num>{k["avg_us"]:.1f}</td>'
                       f'<td>{"communication" if k["comm"] else "compute"}</td></tr>' for k, label in zip(kernels, labels))
                   + "</tbody></table>")
    if not ops and not kernels:
        out.append("<p class=muted>No operators for this rank.</p>")
    return "".join(out)


def _ops_table(ops: list[dict[str, Any]]) -> str:
    labels = short_names([o["name"] for o in ops])
    return ('<table class="sortable"><thead><tr><th>Operator</th><th>Calls</th><th>Self ms</th><th>Total ms</th>'
            '<th>Avg us</th><th>Kind</th></tr></thead><tbody>' + "".join(
                f'<tr><td class=name title="{_e(o["name"])}">{_e(label)}</td><td class=num>{_count(o["calls"])}'
                f'</td><td class=num>{o["self_us"] / 1000:.3f}'
                f'</td><td class=num>{o["total_us"] / 1000:.3f}</td><td class=num>{o["avg_us"]:.1f}</td>'
                f'<td>{"communication" if o["comm"] else "compute"}</td></tr>' for o, label in zip(ops, labels))
            + "</tbody></table>")


def _bar_chart(items: list[tuple[str, float]], cid: str, unit: str) -> str:
    if not items:
        return ""
    width, row_h, label_chars = 860, 18, 48
    label_w = 7 * label_chars  # 11px labels are under 7px a character: the longest one fits left of the bars
    top = max(v for _, v in items) or 1.0
    scale = (width - label_w - 80) / top
    parts = []
    labels = short_names([name for name, _ in items], label_chars)
    for i, ((name, value), label) in enumerate(zip(items, labels)):
        y = 4 + i * row_h
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end"><title>{_e(name)}</title>{_e(label)}'
                     '</text>'
                     f'<rect x="{label_w}" y="{y + 2}" width="{max(1.0, value * scale):.1f}" height="{row_h - 5}" '
                     f'fill="{PALETTE["bar"]}"><title>{_e(name)}: {value:.3f} ms</title></rect>'
                     f'<text x="{label_w + value * scale + 4:.1f}" y="{y + 12}">{value:.3f}</text>')
    return (f'<div class="muted">{_e(unit)}</div><svg class="chart" id="{_e(cid)}" width="{width}" '
            f'height="{8 + len(items) * row_h}" role="img">{"".join(parts)}</svg>')


def _memory_view(group: CaptureGroup, gid: str) -> str:
    out = _rank_views(group, gid, "mem", _rank_memory)
    return out or ("<p class=muted>No memory events in these captures. Capture with <code>--with-memory</code> "
                   "(ondemandctl) or <code>--profile-with-memory</code>.</p>")


def _rank_memory(r: RankResult, rid: str) -> str:
    mem = r.get("memory")
    if not mem:
        return ""
    head = f"<h3>Rank {_rank(r)}: allocated memory on {_e(mem.get('series_device'))}</h3>" + _memory_summary(mem)
    series = mem.get("series") or []
    if not series:
        return head + ('<p class="note">No allocated-memory values recorded (the columns are empty): no curve to '
                       'draw; the peaks above are what the file holds.</p>')
    t0, t1 = series[0][0], series[-1][0]
    if t1 <= t0:
        return head + (f'<p class="note">All {len(series)} samples share one timestamp (the file\'s times are '
                       f'rounded, e.g. by a spreadsheet): no curve over time to draw. Highest value '
                       f'{max(v for _, v in series) / 2**20:.1f} MiB.</p>')
    width, height, pad = 860, 220, 50
    peak = max(v for _, v in series) or 1.0
    sx = (width - 2 * pad) / (t1 - t0)
    sy = (height - 2 * 20) / peak
    pts = " ".join(f"{pad + (t - t0) * sx:.1f},{height - 20 - v * sy:.1f}" for t, v in series)
    return (head + f'<svg class="chart" id="mem-chart-{_e(rid)}" width="{width}" height="{height}" role="img">'
            f'<line x1="{pad}" y1="{height - 20}" x2="{width - pad}" y2="{height - 20}" stroke="#999"/>'
            f'<line x1="{pad}" y1="20" x2="{pad}" y2="{height - 20}" stroke="#999"/>'
            f'<text x="4" y="24">{peak / 2**20:.1f} MiB</text><text x="4" y="{height - 22}">0</text>'
            f'<text x="{width - pad}" y="{height - 4}" text-anchor="end">{(t1 - t0) / 1000:.1f} ms</text>'
            f'<polyline fill="none" stroke="{PALETTE["mem"]}" stroke-width="1.5" points="{pts}"/></svg>')


def _mib(value: float | None) -> str:
    return "not recorded" if value is None else f"{value / 2**20:.1f} MiB"


def _memory_summary(mem: dict[str, Any]) -> str:
    d = mem["devices"][0]
    text = f'<p>Peak allocated {_mib(d.get("peak_allocated"))}'
    if d.get("peak_reserved") is not None:
        text += f', peak reserved {_mib(d["peak_reserved"])}'
    if d.get("allocs") is not None:
        text += f', {d["allocs"]} allocations ({_mib(d.get("alloc_bytes"))}), {d["frees"]} frees'
    if d.get("derived"):
        text += " (the trace records only allocation sizes: the curve starts at 0 where the capture began)"
    others = [o for o in mem["devices"][1:] if o.get("component")]
    if others:  # torch_npu's other memory components, listed beside the allocator's
        text += ". Other components: " + ", ".join(
            f'{_e(o["component"])} on {_e(o["device"])} peak allocated {_mib(o.get("peak_allocated"))}'
            + (f', reserved {_mib(o["peak_reserved"])}' if o.get("peak_reserved") is not None else "")
            for o in others)
    return text + ".</p>"


def _timeline_view(group: CaptureGroup, gid: str) -> str:
    """Each rank's recorded steps on one time axis (wall clock), so a rank that lags or stalls stands out."""
    lanes = [(r, _timed_steps(r.get("steps") or [])) for r in group["ranks"]]
    lanes = [(r, s) for r, s in lanes if s]
    if not lanes:
        return "<p class=muted>No steps to draw.</p>"
    relative = any(s.get("relative") for _, steps in lanes for s in steps)
    if relative:  # one axis for all: a rank without start times puts every rank on the relative axis
        lanes = [(r, _timed_steps(r.get("steps") or [], relative=True)) for r, _ in lanes]
    t0 = min(s["start_us"] for _, steps in lanes for s in steps)
    t1 = max(s["start_us"] + s["dur_ms"] * 1000 for _, steps in lanes for s in steps)
    width, lane_h, left = 900, 26, 70
    scale = (width - left - 10) / ((t1 - t0) or 1.0)
    parts = []
    for i, (r, steps) in enumerate(lanes):
        y = 20 + i * lane_h
        parts.append(f'<text x="4" y="{y + 14}">rank {_rank(r)}</text>')
        for s in steps:
            x = left + (s["start_us"] - t0) * scale
            w = max(1.0, s["dur_ms"] * 1000 * scale)
            comm_w = min(w, w * (s.get("comm_total_ms") or 0) / s["window_ms"]) if s.get("window_ms") else 0
            parts.append(f'<g><rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h - 8}" fill="{PALETTE["compute"]}"'
                         f' fill-opacity="0.35" stroke="#4e79a7"><title>rank {_rank(r)} step {s["step"]}: '
                         f'{s["dur_ms"]:.2f} ms (communication {s.get("comm_total_ms") or 0:.2f} ms, exposed '
                         f'{s["comm_ms"]:.2f} ms)</title></rect>'
                         f'<rect x="{x:.1f}" y="{y + lane_h - 12}" width="{comm_w:.1f}" height="4" '
                         f'fill="{PALETTE["comm"]}"/>'
                         + (f'<text x="{x + 3:.1f}" y="{y + 12}">{s["step"]}</text>' if w > 18 else "") + "</g>")
    height = 30 + len(lanes) * lane_h
    parts.append(f'<text x="{left}" y="12">0 ms</text><text x="{width - 10}" y="12" text-anchor="end">'
                 f'{(t1 - t0) / 1000:.1f} ms</text>')
    axis = ("steps laid end to end from each rank's first (the trace gives no start times, e.g. torch_npu's "
            "step_trace_time.csv)" if relative else "steps on a shared wall-clock axis")
    return (f'<div class="legend">{axis}; red bar: communication share (exposed and overlapped)'
            f'</div><svg class="chart" id="timeline-{gid}" width="{width}" height="{height}" role="img">'
            f'{"".join(parts)}</svg>')


def _timed_steps(steps: list[dict[str, Any]], relative: bool = False) -> list[dict[str, Any]]:
    """Steps with a start time; when none has one (or asked), the steps laid end to end from 0, marked relative."""
    if not relative and any(s.get("start_us") is not None for s in steps):
        return [s for s in steps if s.get("start_us") is not None]
    out, t = [], 0.0
    for s in steps:
        out.append({**s, "start_us": t, "relative": True})
        t += s["dur_ms"] * 1000
    return out


def _open_traces(group: CaptureGroup) -> str:
    items = []
    for r in group["ranks"]:
        trace = os.path.normpath(r.get("trace") or r.get("db") or r["path"])  # a capture's: <rank dir>/../<file>
        items.append(f"<li>rank {_rank(r)}: <code>{_e(trace)}</code></li>")
    return ("<h3>Open the traces</h3><p>In <a href=\"https://ui.perfetto.dev\">ui.perfetto.dev</a>: "
            "<em>Open trace file</em> and pick the file (it is read in your browser, nothing is uploaded); or "
            "<code>tensorboard --logdir &lt;save path&gt;</code>; or HTA's <code>TraceAnalysis(trace_dir=..., "
            "include_last_profiler_step=True)</code> (without it HTA leaves out the last captured step)."
            "</p><ul>" + "".join(items) + "</ul>")



def render_comparison_html(c: Mapping[str, Any]) -> str:
    """A capture against its baseline, side by side: the cause line, the step time per rank, each rank's split as
    two bars (baseline, now), communication by collective, and what changed most; measured values only."""
    from .figures import SPLIT

    jobs = c.get("job") or {}
    s = c["step_ms"]
    head = [f'<p><strong>Capture</strong> <code>{_e(c["capture"])}</code>'
            + (f' (job <code>{_e(jobs["now"])}</code>)' if jobs.get("now") else "")
            + f' <strong>against baseline</strong> <code>{_e(c["baseline"])}</code>'
            + (f' (job <code>{_e(jobs["baseline"])}</code>)' if jobs.get("baseline") else "") + "</p>"]
    if s.get("baseline") is not None and s.get("now") is not None:
        pct = f", {s['pct']:+.1f}%" if s.get("pct") is not None else ""
        t = s.get("test") or {}
        tested = "" if t.get("delta") is None else " — one step on a side: no noise estimate" \
            if t.get("lo") is None else (f" — {t['delta']:+.2f} ms/step, 95 % CI {t['lo']:+.2f} to {t['hi']:+.2f} "
                                         f"({'significant' if t['verdict'] in ('grew', 'shrank') else 'not significant'})")
        head.append(f"<p>Step time {s['baseline']:.2f} → {s['now']:.2f} ms ({s['delta']:+.2f} ms{pct}), mean of "
                    f"the ranks{_e(tested)}</p>")
    head.append(f'<p class="note" id="cause"><strong>Cause:</strong> {_e(c["cause"])}</p>')
    head += [f'<p class="note">{_e(n)}</p>' for n in c.get("notes") or []]
    ranks = c["ranks"]
    body = [f'<section class="capture"><h2>What changed</h2>{"".join(head)}', _compare_step_chart(ranks),
            _compare_split_chart(ranks)]
    rows = []
    for r in ranks:
        role = "cause" if r["rank"] in (c.get("culprits") or []) else \
            "waited" if r["rank"] in (c.get("waiting") or []) else ""
        cells = "".join(f'<td class=num>{_pair_text(r["split"][key])}</td>' for key, _ in SPLIT)
        rows.append(f'<tr{" class=slowest" if role == "cause" else ""}><td>{_said(r["rank"])}</td>'
                    f'<td class=num>{_pair_text(r["step_ms"])}</td>{cells}<td>{role}</td></tr>')
    body.append('<h3>Per rank, ms per step (baseline → now)</h3><table class="sortable"><thead><tr><th>Rank</th>'
                '<th>Step</th><th>Compute</th><th>Comm (exposed)</th><th>Overlap</th><th>Idle</th><th></th></tr>'
                '</thead><tbody>' + "".join(rows) + "</tbody></table>")
    kinds = c.get("communication") or []
    if kinds:
        body.append('<h3>Communication by collective, mean of the ranks, per step</h3><table class="sortable">'
                    '<thead><tr><th>Kind</th><th>Calls baseline</th><th>Calls now</th><th>Baseline ms</th>'
                    '<th>Now ms</th><th>Δ ms</th></tr></thead><tbody>' + "".join(
                        f'<tr><td>{_e(k["kind"])}</td><td class=num>{k["calls_baseline"]:g}</td>'
                        f'<td class=num>{k["calls_now"]:g}</td><td class=num>{k["baseline_ms"]:.2f}</td>'
                        f'<td class=num>{k["now_ms"]:.2f}</td><td class=num>{k["now_ms"] - k["baseline_ms"]:+.2f}</td>'
                        "</tr>" for k in kinds) + "</tbody></table>")
    body.append(_compared_waits_html(c))
    for r in ranks:
        if not r["changes"]:
            continue
        labels = short_names([x["name"] for x in r["changes"]])
        body.append(f'<h3>Rank {_said(r["rank"])}: what changed most, per step</h3><table class="sortable"><thead><tr>'
                    '<th>Name</th><th>What</th><th>Baseline ms</th><th>Now ms</th><th>Δ ms</th><th>Calls baseline'
                    '</th><th>Calls now</th><th>Mean us baseline</th><th>Mean us now</th></tr></thead><tbody>' + "".join(
                        f'<tr><td class=name title="{_e(x["name"])}">{_e(label)}</td><td>{_e(x["category"])}'
                        f'{"" if x["status"] == "changed" else " (" + _e(x["status"]) + ")"}</td>'
                        f'<td class=num>{_num(x["baseline_ms"], 3)}</td><td class=num>{_num(x["now_ms"], 3)}</td>'
                        f'<td class=num>{_delta_ms(x)}</td><td class=num>{_count(x["calls_baseline"])}</td>'
                        f'<td class=num>{_count(x["calls_now"])}</td><td class=num>{_num(x["mean_us_baseline"], 1)}'
                        f'</td><td class=num>{_num(x["mean_us_now"], 1)}</td></tr>'
                        for x, label in zip(r["changes"], labels)) + "</tbody></table>")
    body.append(f'<p class="muted">Rule: {_e(c.get("rule", ""))}. Operators by self time, kernels by their time '
                "inside the steps; every figure is a mean per recorded step.</p></section>")
    title = "ondemand_prof comparison"
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><style>{CSS}</style></head>"
            f"<body><header><h1>{title}</h1><div class=\"muted\" style=\"color:#cfd8dc\">{_e(c['capture'])} against "
            f"{_e(c['baseline'])}</div></header><main>{''.join(body)}</main><script>{JS}</script></body></html>")


def _compared_waits_html(c: Mapping[str, Any]) -> str:
    """Who made whom wait on each side, inside each capture, and each rank's share of the growth (the replay)."""
    w = c.get("collectives") or {}
    b, n = w.get("baseline") or {}, w.get("now")
    if not n:
        return ""
    before = {r["rank"]: r for r in b.get("ranks", [])}
    share = {x["rank"]: x["ms"] for x in (c.get("shares") or {}).get("shares") or []}
    rows = []
    for r in n["ranks"]:
        o = before.get(r["rank"])
        cell = (lambda key, fmt: f"{fmt(o[key])} → {fmt(r[key])}" if o else fmt(r[key]))
        rows.append(f'<tr><td>{_said(r["rank"])}</td>'
                    f'<td class=num>{cell("last_share", lambda v: f"{100 * v:.0f}%")}</td>'
                    f'<td class=num>{cell("caused_ms", lambda v: f"{v:.2f}")}</td>'
                    f'<td class=num>{cell("wait_ms", lambda v: f"{v:.2f}")}</td>'
                    f'<td class=num>{_num(share.get(r["rank"]))}</td></tr>')
    return ('<h3>Who made whom wait, inside each capture (ms per step, baseline → now)</h3>'
            f'<p class="muted">Collectives matched across the ranks; arrival: {_e(n["arrival"])}. The last column: how '
            'much shorter the step now would be with that rank\'s work as in the baseline (the what-if replay).</p>'
            '<table class="sortable"><thead><tr><th>Rank</th><th>Arrived last</th><th>Others waited for it</th>'
            '<th>Its wait</th><th>Share of the growth, ms</th></tr></thead><tbody>' + "".join(rows) +
            "</tbody></table>")


def _pair_text(p: dict[str, Any]) -> str:
    b, n = p.get("baseline"), p.get("now")
    return "-" if b is None or n is None else f"{b:.2f} → {n:.2f} ({n - b:+.2f})"


def _delta_ms(x: dict[str, Any]) -> str:
    if x["baseline_ms"] is None or x["now_ms"] is None:
        return "?"
    return f"{x['now_ms'] - x['baseline_ms']:+.3f}"


def _compare_step_chart(ranks: list[dict[str, Any]]) -> str:
    """Step time per rank: the baseline's bar over now's."""
    timed = [r for r in ranks if r["step_ms"]["baseline"] is not None and r["step_ms"]["now"] is not None]
    if not timed:
        return ""
    width, left, right, bar = 760, 70, 150, 9
    top = max(max(r["step_ms"]["baseline"], r["step_ms"]["now"]) for r in timed) or 1.0
    scale = (width - left - right) / top
    parts = []
    for i, r in enumerate(timed):
        y = 6 + i * (2 * bar + 8)
        for k, (side, color) in enumerate((("baseline", "#bab0ac"), ("now", PALETTE["bar"]))):
            v = r["step_ms"][side]
            parts.append(f'<rect x="{left}" y="{y + k * bar}" width="{v * scale:.1f}" height="{bar - 1}" '
                         f'fill="{color}"><title>rank {_said(r["rank"])} {side}: {v:.2f} ms per step</title></rect>'
                         f'<text x="{left + v * scale + 4:.1f}" y="{y + k * bar + 8}">{side} {v:.2f} ms</text>')
        parts.append(f'<text x="4" y="{y + bar + 3}">rank {"?" if r["rank"] is None else _e(r["rank"])}</text>')
    height = 12 + len(timed) * (2 * bar + 8)
    return (f'<h3>Step time per rank</h3><div class="legend"><span style="background:#bab0ac"></span>baseline'
            f'<span style="background:{PALETTE["bar"]}"></span>now</div><svg class="chart" id="step-compare" '
            f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">{"".join(parts)}</svg>')


def _compare_split_chart(ranks: list[dict[str, Any]]) -> str:
    """Each rank's split per step, the baseline's stacked bar above now's, on one scale."""
    from .figures import SPLIT

    keys = [(key, share) for (key, _), share in zip(SPLIT, SHARES)]
    timed = [r for r in ranks if all(r["split"][k]["baseline"] is not None and r["split"][k]["now"] is not None
                                     for k, _ in keys)]
    if not timed:
        return ""
    width, left, right, bar = 760, 110, 120, 12
    top = max(sum(r["split"][k][side] for k, _ in keys) for r in timed for side in ("baseline", "now")) or 1.0
    scale = (width - left - right) / top
    parts = []
    for i, r in enumerate(timed):
        y = 6 + i * (2 * bar + 10)
        for j, side in enumerate(("baseline", "now")):
            x = float(left)
            for key, share in keys:
                v = r["split"][key][side]
                parts.append(f'<rect x="{x:.1f}" y="{y + j * bar}" width="{v * scale:.1f}" height="{bar - 2}" '
                             f'fill="{PALETTE[share]}"><title>rank {_said(r["rank"])} {side} {SHARE_LABELS[share]}: '
                             f'{v:.2f} ms per step</title></rect>')
                x += v * scale
            label = "?" if r["rank"] is None else _e(r["rank"])  # (a chart's label: short)
            parts.append(f'<text x="4" y="{y + j * bar + 9}">rank {label} {side}</text>')
    height = 12 + len(timed) * (2 * bar + 10)
    legend = "".join(f'<span style="background:{PALETTE[s]}"></span>{SHARE_LABELS[s]}' for _, s in keys)
    return (f'<h3>Split per step, baseline and now</h3><div class="legend">{legend}</div><svg class="chart" '
            f'id="split-compare" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
            f'{"".join(parts)}</svg>')
