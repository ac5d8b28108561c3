"""The HTML report: one self-contained page (inline CSS, JS and SVG charts; no network).

Every user-controlled string (user, account, partition, node, model, XID text...) is escaped:
the template autoescapes, and the SVG charts drawn here escape their labels themselves.  A
Content-Security-Policy with a per-page nonce is a second fence: even a string that escaped
escaping could not run a script.
"""
from __future__ import annotations

import math
import secrets
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from slurm_gpu import __version__
from slurm_gpu.render import _cell
from slurm_gpu.report import reports as report
from slurm_gpu.report.timespec import format_time
from slurm_gpu.report.units import ENERGY_UNITS, TIME_UNITS, format_duration, human_view, pick_unit

if TYPE_CHECKING:  # types only: jinja2 is imported when the page is rendered
    import jinja2

TEMPLATE = "report.html.j2"
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759")


def _esc(s: Any) -> str:
    from markupsafe import escape
    return str(escape("" if s is None else str(s)))


def _short(s: str, n: int = 28) -> str:
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def _fmt(v: float) -> str:
    """A value label: thousands as integers, three significant digits below 10 (never a row of 0.00)."""
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:#.3g}"


def nice_ticks(vmax: float, target: int = 4) -> Tuple[List[float], int]:
    """Axis ticks 0, step, 2 step, ... up to >= vmax with step 1, 2 or 5 x 10^k, and the decimals
    that tell them apart (every label differs, however small the figures)."""
    if not vmax > 0 or not math.isfinite(vmax):
        return [0.0, 1.0], 0
    raw = vmax / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    decimals = max(0, -int(math.floor(math.log10(step) + 1e-9)))
    n = int(math.ceil(vmax / step - 1e-9))
    return [round(i * step, decimals + 2) for i in range(n + 1)], decimals


def bar_chart(title: str, items: Sequence[Tuple[str, Sequence[Optional[float]]]], series: Sequence[str],
              unit: str = "") -> str:
    """Horizontal bars, one row per label; several series are drawn overlaid (the first is the widest)."""
    width, label_w, row_h, top = 760, 200, 22, 34
    plot_w = width - label_w - 90
    vmax = max([v for _, vals in items for v in vals if v is not None] or [0.0]) or 1.0
    height = top + row_h * max(len(items), 1) + 10
    out = [f'<svg class="chart" role="img" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><title>{_esc(title)}</title>']
    x = label_w
    for i, name in enumerate(series):
        out.append(f'<rect x="{x}" y="8" width="12" height="12" fill="{PALETTE[i % len(PALETTE)]}"/>'
                   f'<text x="{x + 16}" y="18" class="legend">{_esc(name)}</text>')
        x += 26 + 8 * len(name)
    if unit:
        out.append(f'<text x="{width - 10}" y="18" text-anchor="end" class="legend">{_esc(unit)}</text>')
    for row, (label, vals) in enumerate(items):
        y = top + row * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end" class="label">{_esc(_short(label))}'
                   f'<title>{_esc(label)}</title></text>')
        for i, v in enumerate(vals):
            if v is None:
                continue
            w = max(plot_w * v / vmax, 0.5 if v > 0 else 0)
            inset = 3 * i
            out.append(f'<rect class="bar s{i}" x="{label_w}" y="{y + 2 + inset}" width="{w:.1f}" '
                       f'height="{row_h - 6 - 2 * inset}" fill="{PALETTE[i % len(PALETTE)]}">'
                       f'<title>{_esc(label)}: {_esc(series[i])} {_fmt(v)} {_esc(unit)}</title></rect>')
        if vals and vals[0] is not None:
            out.append(f'<text x="{label_w + plot_w * vals[0] / vmax + 4:.1f}" y="{y + 15}" class="value">'
                       f'{_fmt(vals[0])}</text>')
    out.append("</svg>")
    return "".join(out)


def column_chart(title: str, items: Sequence[Tuple[str, Optional[float]]], unit: str = "", line: bool = False) -> str:
    """Vertical columns (histogram) or a line with points (time series), on a 1-2-5 axis."""
    width, height, left, bottom, top = 760, 260, 60, 50, 16
    plot_w, plot_h = width - left - 10, height - bottom - top
    values = [v or 0.0 for _, v in items]
    ticks, decimals = nice_ticks(max(values or [0.0]))
    vmax = ticks[-1]
    n = max(len(items), 1)
    step = plot_w / n
    out = [f'<svg class="chart" role="img" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><title>{_esc(title)}</title>']
    for tick in ticks:
        y = top + plot_h * (1 - tick / vmax)
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="axis tick">{tick:,.{decimals}f}</text>')
    label_every = max(1, math.ceil(n / 16))
    points = []
    for i, (label, v) in enumerate(items):
        v = v or 0.0
        h = plot_h * v / vmax
        x = left + i * step
        if line:
            points.append(f"{x + step / 2:.1f},{top + plot_h - h:.1f}")
            out.append(f'<circle class="point" cx="{x + step / 2:.1f}" cy="{top + plot_h - h:.1f}" r="2.5" '
                       f'fill="{PALETTE[2]}"><title>{_esc(label)}: {_fmt(v)} {_esc(unit)}</title></circle>')
        else:
            out.append(f'<rect class="bar" x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(step - 2, 1):.1f}" '
                       f'height="{h:.1f}" fill="{PALETTE[0]}"><title>{_esc(label)}: {_fmt(v)} {_esc(unit)}</title></rect>')
        if i % label_every == 0:
            out.append(f'<text x="{x + step / 2:.1f}" y="{top + plot_h + 14}" text-anchor="end" class="axis" '
                       f'transform="rotate(-35 {x + step / 2:.1f} {top + plot_h + 14})">{_esc(label)}</text>')
    if line and points:
        out.insert(1, f'<polyline points="{" ".join(points)}" fill="none" stroke="{PALETTE[2]}" stroke-width="2"/>')
    out.append(f'<text x="{left}" y="{height - 4}" class="axis">{_esc(unit)}</text></svg>')
    return "".join(out)


def _scaled(values: Sequence[Optional[float]], units: Sequence[Tuple[str, float]]) -> Tuple[str, float]:
    """The display unit for a chart: the largest in which its largest value is at least 1."""
    return pick_unit(max([v for v in values if v is not None] or [0.0]), units)


def _times(vals: Sequence[Optional[float]], per: float) -> Tuple[Optional[float], ...]:
    return tuple(None if v is None else v * per for v in vals)


def _group_label(row: Dict[str, Any], keys: Sequence[str]) -> str:
    return " / ".join("-" if row.get(k) is None else str(row.get(k)) for k in keys)


def _charts(table: Any, src: Any, kind: str) -> List[Dict[str, str]]:
    charts: List[Dict[str, str]] = []
    rows = list(table.rows)
    hours = ("gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle")
    if kind in ("summary", "jobs"):
        top = sorted(rows, key=lambda r: -(r["gpu_hours_alloc"] or 0))[:25]
        t_unit, t_per = _scaled([r["gpu_hours_alloc"] for r in top], TIME_UNITS)
        label: Callable[[Dict[str, Any]], str]
        if kind == "summary":
            label = lambda r: _group_label(r, table.keys)  # noqa: E731
            title = f"GPU time by {', '.join(table.keys)} (top {len(top)}, {t_unit})"
        else:
            label = lambda r: f"{r['job_id']} {r['user'] or '-'}"  # noqa: E731
            title = f"GPU time of the largest jobs (top {len(top)}, {t_unit})"
        charts.append({"title": title, "svg": bar_chart("GPU time", [(label(r), _times([r[c] for c in hours], t_per))
                                                                     for r in top], ("allocated", "used", "idle"), t_unit)})
    if kind == "summary":
        hist = report.utilisation_histogram(src)
        h_unit, h_per = _scaled([v for _, v in hist], TIME_UNITS)
        charts.append({"title": f"Utilisation distribution ({h_unit} by per-GPU mean utilisation)",
                       "svg": column_chart("utilisation", [(k, v * h_per) for k, v in hist], h_unit)})
        unit, series = report.energy_series(src)
        e_unit, e_per = _scaled([v for _, v in series], ENERGY_UNITS)
        charts.append({"title": f"Energy per {unit} ({e_unit})",
                       "svg": column_chart("energy", [(k, None if v is None else v * e_per) for k, v in series],
                                           e_unit, line=True)})
    elif kind == "jobs":
        bins = [0.0] * 10
        for r in rows:
            if r["gpu_util_mean_pct"] is not None:
                bins[min(int(r["gpu_util_mean_pct"] // 10), 9)] += r["gpu_hours_alloc"] or 0.0
        h_unit, h_per = _scaled(bins, TIME_UNITS)
        charts.append({"title": f"Utilisation distribution of the listed jobs ({h_unit} by job mean utilisation)",
                       "svg": column_chart("utilisation", [(f"{10 * i}-{10 * i + 10}%", b * h_per)
                                                           for i, b in enumerate(bins)], h_unit)})
    elif kind == "job":
        charts.append({"title": "Mean utilisation per GPU (%)",
                       "svg": bar_chart("utilisation", [(f"{r['node']} GPU {r['gpu_index']} (restart {r['restart']})",
                                                         (r["gpu_util_mean_pct"], r["mem_util_mean_pct"])) for r in rows],
                                        ("GPU util", "memory util"), "%")})
    return charts


def _env() -> jinja2.Environment:
    from slurm_gpu.render import template_env  # the one Jinja environment (jinja2 imported lazily)
    return template_env(html=True)


def render_report(table: Any, src: Any, kind: str, now_s: Optional[float] = None) -> str:
    """The whole page for a summary ('summary'), job list ('jobs') or one job ('job')."""
    from markupsafe import Markup

    q = src.query
    window = "all records"
    if q.since_s is not None or q.until_s is not None:
        window = f"{format_time(q.since_s, q.tz) or 'start'} to {format_time(q.until_s, q.tz) or 'now'}"
    filters = [f"{name}: {', '.join(vals)}" for name, vals in (("users", q.users), ("accounts", q.accounts),
                                                                   ("partitions", q.partitions), ("nodes", q.nodes),
                                                                   ("clusters", q.clusters)) if vals]
    headers, formats = human_view(table)
    numeric = [all(r.get(c) is None or (isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool))
                   for r in table.rows) for c in table.columns]
    body = [[{"text": _cell(r.get(c), formats.get(c)), "sort": "" if r.get(c) is None else str(r.get(c)),
              "num": numeric[i]} for i, c in enumerate(table.columns)] for r in table.rows]
    total = None
    if kind == "summary" and table.total:
        total = [_cell(table.total.get(c), formats.get(c)) for c in table.columns]
    charts = [{"title": c["title"], "svg": Markup(c["svg"])} for c in _charts(table, src, kind)]
    return _env().get_template(TEMPLATE).render(
        title=table.title, version=__version__,
        generated=format_time(time.time() if now_s is None else now_s, q.tz),
        window=window, filters=filters, sources=len(src.files), threshold=q.idle_threshold_pct,
        headers=headers, columns=table.columns, numeric=numeric, rows=body, total=total,
        charts=charts, nonce=secrets.token_urlsafe(16), kind=kind, notes=table.notes,
    )


# --------------------------------------------------------------------------- `slurm-gpu job --format html`

JOB_TEMPLATE = "job.html.j2"


def last_hour_chart(title: str, points: Sequence[Optional[float]], end_s: float, tz: str = "local") -> str:
    """A GPU's utilisation over the last hour, a point a minute (None: not sampled): a line broken at every gap,
    on a 0-100 % axis."""
    width, height, left, bottom, top = 380, 150, 40, 26, 10
    plot_w, plot_h = width - left - 10, height - bottom - top
    n = max(len(points), 1)
    step = plot_w / max(n - 1, 1)
    out = [f'<svg class="chart" role="img" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><title>{_esc(title)}</title>']
    for tick in (0, 50, 100):
        y = top + plot_h * (1 - tick / 100)
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="axis tick">{tick} %</text>')
    for i, label in ((0, "-60 min"), (n // 2, "-30 min"), (n - 1, format_time(end_s, tz) or "now")):
        anchor = "start" if i == 0 else "end" if i == n - 1 else "middle"
        out.append(f'<text x="{left + i * step:.1f}" y="{height - 8}" text-anchor="{anchor}" class="axis">{_esc(label)}</text>')
    segment: List[str] = []
    segments: List[List[str]] = []
    for i, v in enumerate(points):
        if v is None:
            if segment:
                segments.append(segment)
            segment = []
            continue
        segment.append(f"{left + i * step:.1f},{top + plot_h * (1 - max(0.0, min(100.0, float(v))) / 100):.1f}")
    if segment:
        segments.append(segment)
    for seg in segments:
        if len(seg) == 1:
            cx, cy = seg[0].split(",")
            out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{PALETTE[2]}"/>')
        else:
            out.append(f'<polyline points="{" ".join(seg)}" fill="none" stroke="{PALETTE[2]}" stroke-width="2"/>')
    out.append("</svg>")
    return "".join(out)


def render_job(view: Any, now_s: Optional[float] = None, most_charts: int = 16) -> str:
    """A job's page (report/jobview.JobView): its header, per-GPU table, charts and notes.  A running job's
    charts are each GPU's last hour; a finished job's, the mean utilisation per GPU."""
    from markupsafe import Markup

    from slurm_gpu.report import jobview as J
    s = view.summary
    live = s.live or {}
    per_gpu = live.get("g") or [None] * len(s.gpus)
    charts: List[Dict[str, Any]] = []
    if s.live is not None:
        for g, row in list(zip(s.gpus, per_gpu))[:most_charts]:
            if row is not None:
                name = f"{g.node} GPU {'-' if g.index is None else g.index}"
                charts.append({"title": f"{name}: utilisation, last hour (%)",
                               "svg": Markup(last_hour_chart(name, row[1], float(live["t"])))})
    elif s.gpus:
        charts.append({"title": "Mean utilisation per GPU over the job (%)",
                       "svg": Markup(bar_chart("utilisation", [(f"{g.node} GPU {'-' if g.index is None else g.index}",
                                                                (g.util_pct,)) for g in s.gpus], ("GPU util",), "%"))})
    headers = ["node", "GPU", "GPU util", "peak memory", "energy"] + (["idle for"] if s.live is not None else [])
    rows = []
    for g, row in zip(s.gpus, per_gpu):
        cells = [g.node, "-" if g.index is None else str(g.index), J.pct_text(g.util_pct), J.memory_text(g),
                 J.energy_text(g.energy_wh)]
        if s.live is not None:
            cells.append("busy" if row is None or not row[0] else format_duration(float(row[0]) / 3600.0))
        rows.append(cells)
    running = s.live is not None
    title = f"Job {view.record.job_id}" + (": figures so far (running)" if running else "")
    footer = ("A running job's figures come from samples taken every minute; the final summary is written when it "
              "ends." if running else "Means over the job, from its summary in Slurm's accounting.")
    return _env().get_template(JOB_TEMPLATE).render(
        job_id=view.record.job_id, title=title, header=J.header_lines(view), charts=charts, headers=headers,
        rows=rows, notes=view.notes, version=__version__, footer=footer, nonce=secrets.token_urlsafe(16),
        generated=format_time(time.time() if now_s is None else now_s, "local"))
