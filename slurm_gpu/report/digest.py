"""The weekly digest (`slurm-gpu report digest`): per user and per account, a week's GPU-hours
allocated, used and idle, its jobs and idle jobs, and the change against the week before; as a
table, JSON or an HTML page, or as mails (each user their own line; the whole digest to admins).

The figures are the report's own, never SQL of the digest's: each week is one read of the sources
(node files or the central server, report/sources.py, report/central.py) that runs
`reports.summary(src, ("user",))` and `("account",)` - what `slurm-gpu report --by user --since
MON --until MON` runs, rollups included - and `reports.jobs(src, idle_only=True)` (what `report
jobs --idle` lists) for the idle jobs.  So a user's GPU-hours in the digest are, to the last
digit, those of `report --by user` for the same window.
"""
from __future__ import annotations

import json
import re
import shlex
import socket
import textwrap
from dataclasses import dataclass, replace
from datetime import date, timedelta
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from slurm_gpu import render
from slurm_gpu.config import Config
from slurm_gpu.efficiency.mail import Message
from slurm_gpu.errors import InputError
from slurm_gpu.report import reports
from slurm_gpu.report.query import Query
from slurm_gpu.report.sources import ReportSource
from slurm_gpu.report.tables import HOURS_ND, Table, rounded
from slurm_gpu.report.timespec import format_time, in_zone, wall_time
from slurm_gpu.report.units import TIME_UNITS, pick_unit

KEYS = ("user", "account")  # the digest's two tables, in this order
FIGURES = ("jobs", "idle_jobs", "gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle")
CHANGES = ("gpu_hours_alloc", "gpu_hours_idle")  # the trend: signed change against the week before

# ------------------------------------------------------------------ the window


@dataclass(frozen=True)
class Window:
    """[since_s, until_s) in unix seconds, and the zone its calendar days are cut in ('utc', 'local')."""

    since_s: float
    until_s: float
    tz: str

    def days(self) -> Optional[Tuple[date, date]]:
        """(first day, day after the last) when both ends are midnights of the zone; else None."""
        a, b = _midnight_day(self.since_s, self.tz), _midnight_day(self.until_s, self.tz)
        return (a, b) if a is not None and b is not None else None

    @property
    def label(self) -> str:
        """'2026-W48' for an ISO week (Monday to Monday), '2026-11-01 to 2026-12-01' for other whole
        days (the end exclusive, as --until), else the two times."""
        d = self.days()
        if d is not None:
            first, after = d
            if first.weekday() == 0 and (after - first).days == 7:
                iso = first.isocalendar()
                return f"{iso[0]:04d}-W{iso[1]:02d}"
            return f"{first.isoformat()} to {after.isoformat()}"
        return f"{format_time(self.since_s, self.tz)} to {format_time(self.until_s, self.tz)}"


def _midnight(day: date, tz: str) -> float:
    return wall_time(day.year, day.month, day.day, 0, 0, 0, tz).timestamp()


def _midnight_day(ts: float, tz: str) -> Optional[date]:
    """The day whose midnight (in tz) is ts exactly, or None."""
    d = in_zone(ts, tz).date()
    return d if _midnight(d, tz) == ts else None


def window(since_s: float, until_s: float, tz: str) -> Window:
    if until_s <= since_s:
        raise InputError(f"empty time window: --until ({format_time(until_s, tz)}) is not after --since "
                         f"({format_time(since_s, tz)})", "give a --since earlier than --until")
    return Window(since_s, until_s, tz)


def last_full_week(now_s: float, tz: str) -> Window:
    """The last ISO week that has ended: Monday 00:00 to Monday 00:00 in tz (as `--by week` cuts weeks)."""
    today = in_zone(now_s, tz).date()
    monday = today - timedelta(days=today.weekday())
    return Window(_midnight(monday - timedelta(days=7), tz), _midnight(monday, tz), tz)


_ISO_WEEK = re.compile(r"(\d{4})-?[Ww](\d{1,2})")


def iso_week(text: str, tz: str) -> Window:
    """`--week 2026-W48` (or 2026W48): that ISO week, Monday 00:00 to Monday 00:00 in tz."""
    m = _ISO_WEEK.fullmatch(text.strip())
    try:
        if not m:
            raise ValueError("not YYYY-Www")
        monday = date.fromisocalendar(int(m.group(1)), int(m.group(2)), 1)
    except ValueError as e:
        raise InputError(f"--week: cannot read {text!r}: {e}", "give an ISO week, e.g. --week 2026-W48") from None
    return Window(_midnight(monday, tz), _midnight(monday + timedelta(days=7), tz), tz)


def previous(w: Window) -> Window:
    """The window of the same length just before w: in calendar days where w is whole days (a week
    across a DST change is still Monday to Monday), else in seconds."""
    d = w.days()
    if d is not None:
        first, after = d
        return Window(_midnight(first - (after - first), w.tz), w.since_s, w.tz)
    return Window(w.since_s - (w.until_s - w.since_s), w.since_s, w.tz)


# ------------------------------------------------------------------ reading


class Week(NamedTuple):
    """One window's reads, all from one consistent state of the sources."""

    tables: Tuple[Table, ...]  # summary by user, by account (KEYS' order)
    idle_jobs: Tuple[Dict[str, Any], ...]  # `report jobs --idle` rows: cluster, job_id, user, account, ...
    notes: Tuple[str, ...]
    plans: Tuple[str, ...]  # which plan each summary ran (`--explain`)


def read_week(src: ReportSource) -> Week:
    """The summaries by user and by account and the idle jobs: `report --by user`, `--by account` and
    `report jobs --idle` on this source."""
    tables: List[Table] = []
    plans: List[str] = []
    for key in KEYS:
        src.plan = ""  # the planner keeps a plan once set: each summary says its own
        tables.append(reports.summary(src, (key,)))
        plans.append(f"by {key}: {src.plan}" if src.plan else "")
    idle = reports.jobs(src, idle_only=True)
    notes = tuple(dict.fromkeys(tables[0].notes + idle.notes))
    return Week(tuple(tables), idle.rows, notes, tuple(p for p in plans if p))


Reader = Callable[[Query, Callable[[ReportSource], Week]], Week]


# ------------------------------------------------------------------ the digest


class Figures(NamedTuple):
    jobs: int
    idle_jobs: int
    gpu_hours_alloc: Optional[float]
    gpu_hours_used: Optional[float]
    gpu_hours_idle: Optional[float]

    def as_dict(self) -> Dict[str, Any]:
        return dict(self._asdict())


NONE = Figures(0, 0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Line:
    """One user's or account's figures this window and the window before (or the TOTAL)."""

    key: Optional[str]
    now: Figures
    before: Figures
    idle_job_ids: Tuple[Tuple[str, int], ...] = ()  # (cluster, job_id) of this window's idle jobs

    def change(self, col: str) -> Optional[float]:
        a, b = getattr(self.now, col), getattr(self.before, col)
        return None if a is None or b is None else rounded(a - b, HOURS_ND)


@dataclass(frozen=True)
class Digest:
    window: Window
    previous: Window
    idle_threshold_pct: float
    lines: Dict[str, Tuple[Line, ...]]  # "user" / "account" -> lines, in the report's group order
    totals: Dict[str, Line]
    notes: Tuple[str, ...] = ()
    plans: Tuple[str, ...] = ()

    def empty(self) -> bool:
        return not any(self.lines.values())


def _idle_sets(week: Week, key: str) -> Dict[Optional[str], Set[Tuple[str, int]]]:
    out: Dict[Optional[str], Set[Tuple[str, int]]] = {}
    for row in week.idle_jobs:
        out.setdefault(row[key], set()).add((row["cluster"], row["job_id"]))
    return out


def _figures(row: Optional[Dict[str, Any]], idle: int) -> Figures:
    if row is None:
        return NONE
    return Figures(int(row["jobs"] or 0), idle, row["gpu_hours_alloc"], row["gpu_hours_used"], row["gpu_hours_idle"])


def _order(k: Optional[str]) -> Tuple[bool, str]:
    return (k is not None, k or "")  # the report's order: no name first, then by name


def build(window: Window, prev: Window, this: Week, before: Week, idle_threshold_pct: float) -> Digest:
    """The digest's lines from two weeks' reads: a group of either window is a line (one that had GPU
    time only the week before shows zeros this week and its drop as the change)."""
    lines: Dict[str, Tuple[Line, ...]] = {}
    totals: Dict[str, Line] = {}
    for i, key in enumerate(KEYS):
        now_rows = {r[key]: r for r in this.tables[i].rows}
        before_rows = {r[key]: r for r in before.tables[i].rows}
        idle_now, idle_before = _idle_sets(this, key), _idle_sets(before, key)
        out = []
        for k in sorted(set(now_rows) | set(before_rows), key=_order):
            ids = tuple(sorted(idle_now.get(k, set())))
            out.append(Line(k, _figures(now_rows.get(k), len(ids)),
                            _figures(before_rows.get(k), len(idle_before.get(k, set()))), ids))
        lines[key] = tuple(out)
        all_now = {(r["cluster"], r["job_id"]) for r in this.idle_jobs}
        all_before = {(r["cluster"], r["job_id"]) for r in before.idle_jobs}
        totals[key] = Line("TOTAL", _figures(this.tables[i].total, len(all_now)),
                           _figures(before.tables[i].total, len(all_before)), tuple(sorted(all_now)))
    return Digest(window, prev, idle_threshold_pct, lines, totals, this.notes,
                  tuple(f"{window.label} {p}" for p in this.plans) + tuple(f"{prev.label} {p}" for p in before.plans))


def collect(read: Reader, query: Query, w: Window) -> Digest:
    """Read `w` and the window before it through `read(query, fn)` (one consistent read each) with the
    query's filters and idle threshold."""
    prev = previous(w)
    this = read(replace(query, since_s=w.since_s, until_s=w.until_s, tz=w.tz), read_week)
    before = read(replace(query, since_s=prev.since_s, until_s=prev.until_s, tz=w.tz), read_week)
    return build(w, prev, this, before, query.idle_threshold_pct)


# ------------------------------------------------------------------ output


def _window_json(w: Window) -> Dict[str, Any]:
    return {"label": w.label, "since": format_time(w.since_s, w.tz), "until": format_time(w.until_s, w.tz)}


def _line_json(key: str, line: Line) -> Dict[str, Any]:
    out: Dict[str, Any] = {key: line.key}
    out.update(line.now.as_dict())
    for col in CHANGES:
        out[f"{col}_change"] = line.change(col)
    out["idle_job_ids"] = [{"cluster": c, "job_id": j} for c, j in line.idle_job_ids]
    out["previous"] = line.before.as_dict()
    return out


def to_json(d: Digest) -> str:
    """users and accounts with this window's figures, the change, the idle jobs and the window before's figures."""
    doc: Dict[str, Any] = {
        "window": _window_json(d.window), "previous": _window_json(d.previous), "tz": d.window.tz,
        "idle_threshold_pct": d.idle_threshold_pct,
    }
    for key in KEYS:
        doc[f"{key}s"] = [_line_json(key, line) for line in d.lines[key]]
    for key in KEYS:
        total = _line_json(key, d.totals[key])
        del total[key]
        doc[f"{key}s_total"] = total
    return json.dumps(doc, indent=2, allow_nan=False)


TABLE_COLUMNS = ("jobs", "idle_jobs", "gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle", "gpu_hours_alloc_change",
                 "gpu_hours_idle_change")
_TIME_COLS = ("gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle")


def _unit(values: Sequence[Optional[float]]) -> Tuple[str, float]:
    """GPU-h, GPU-min or GPU-s: the largest unit in which the largest figure is at least 1 (as the report)."""
    return pick_unit(max([abs(v) for v in values if v is not None] or [0.0]), TIME_UNITS)


def _digest_unit(d: Digest) -> Tuple[str, float]:
    lines = [ln for key in KEYS for ln in d.lines[key] + (d.totals[key],)]
    return _unit([getattr(f, c) for ln in lines for f in (ln.now, ln.before) for c in _TIME_COLS])


def _view(d: Digest, key: str) -> Tuple[Tuple[str, ...], List[Dict[str, Any]], Dict[str, Callable[[Any], str]]]:
    """Columns, rows (TOTAL last, where there are lines) and cell formats of one table for people."""
    name, per = _digest_unit(d)
    headers = (key, "jobs", "idle jobs", f"{name} alloc", f"{name} used", f"idle {name}", f"{name} alloc change",
               f"idle {name} change")

    def amount(v: Any) -> str:
        return "-" if v is None else f"{v * per:.2f}"

    def signed(v: Any) -> str:
        return "-" if v is None else f"{v * per:+.2f}"

    formats: Dict[str, Callable[[Any], str]] = {c: amount for c in _TIME_COLS}
    formats.update({f"{c}_change": signed for c in CHANGES})
    lines = list(d.lines[key]) + ([d.totals[key]] if d.lines[key] else [])
    rows = []
    for ln in lines:
        row: Dict[str, Any] = {key: ln.key}
        row.update(ln.now.as_dict())
        row.update({f"{c}_change": ln.change(c) for c in CHANGES})
        rows.append(row)
    return headers, rows, formats


def heading(d: Digest) -> List[str]:
    w, p = d.window, d.previous
    return [f"GPU digest {w.label}: {format_time(w.since_s, w.tz)} to {format_time(w.until_s, w.tz)}",
            f"change: against {p.label} ({format_time(p.since_s, p.tz)} to {format_time(p.until_s, p.tz)}); "
            f"idle: GPUs whose mean utilisation stayed below {d.idle_threshold_pct:g} %"]


def to_text(d: Digest) -> str:
    """Both tables as the terminal table of render.py (control characters in names shown as escapes)."""
    out = heading(d)
    for key in KEYS:
        headers, rows, formats = _view(d, key)
        out += ["", f"By {key}"]
        out.append(render.render(rows, (key,) + TABLE_COLUMNS, "table", headers, formats) if rows
                   else "(no GPU records)")
    return "\n".join(out)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>slurm-gpu digest {{ label }}</title>
<style>{{ style }}</style>
</head>
<body>
<h1>GPU digest {{ label }}</h1>
<p class="meta">{% for m in meta %}<span>{{ m }}</span>{% endfor %}</p>
{% for n in notes %}<p class="note">Note: {{ n }}</p>
{% endfor %}{% for t in tables %}<h2>By {{ t.key }}</h2>
{% if not t.rows %}<p class="empty">No GPU records.</p>{% else %}<table>
<thead><tr>{% for h in t.headers %}<th scope="col">{{ h }}</th>{% endfor %}</tr></thead>
<tbody>
{% for r in t.rows %}<tr{% if loop.last %} class="total"{% endif %}>
{%- for c in r %}<td{% if not loop.first %} class="num"{% endif %}>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</tbody>
</table>{% endif %}
{% endfor %}<footer>slurm-gpu {{ version }}. The figures are those of <code>slurm-gpu report --by user</code> (and
<code>--by account</code>) for the same window: GPU time clipped to the window, GPU-hours used weighted by utilisation,
idle GPU-hours those of GPUs whose mean utilisation stayed below the threshold; idle jobs held at least one such GPU.
The change is against the window before. See docs/report.md, "Weekly digest".</footer>
</body>
</html>
"""


def _report_style() -> str:
    """The report page's stylesheet (templates/report.html.j2), so that both pages look alike."""
    from slurm_gpu.render import template_env
    from slurm_gpu.report.html import TEMPLATE
    env = template_env(html=True)
    try:
        source = env.loader.get_source(env, TEMPLATE)[0] if env.loader is not None else ""
    except Exception:  # noqa: BLE001 - a missing template costs the page its looks, not the digest
        source = ""
    m = re.search(r"<style>(.*?)</style>", source, re.S)
    return m.group(1) if m else ""


def to_html(d: Digest, generated_s: float) -> str:
    """One self-contained page with the two tables; every name is escaped (the template autoescapes)
    and no script runs (the page's Content-Security-Policy has none)."""
    from markupsafe import Markup

    from slurm_gpu import __version__
    from slurm_gpu.render import template_env
    w, p = d.window, d.previous
    tables = []
    for key in KEYS:
        headers, rows, formats = _view(d, key)
        cols = (key,) + TABLE_COLUMNS
        tables.append({"key": key, "headers": headers,
                       "rows": [[render._cell(r.get(c), formats.get(c)) for c in cols] for r in rows]})
    meta = [f"window: {format_time(w.since_s, w.tz)} to {format_time(w.until_s, w.tz)}",
            f"compared with: {p.label} ({format_time(p.since_s, p.tz)} to {format_time(p.until_s, p.tz)})",
            f"idle threshold: {d.idle_threshold_pct:g} %", f"generated: {format_time(generated_s, w.tz)}"]
    return template_env(html=True).from_string(_PAGE).render(
        label=w.label, style=Markup(_report_style()), meta=meta, notes=d.notes, tables=tables, version=__version__)


# ------------------------------------------------------------------ mail

# A user name that is safe as a mail address's local part and as an argument of the mail command
# (names come from job environments: one starting with '-' would be an option of `mail`).
_MAILABLE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def user_address(cfg: Config, user: str) -> str:
    """USER@efficiency.mail_domain, else the bare user name (which only a mail command delivers), as
    efficiency/mail.address() does for a job without Slurm's MailUser.  InputError for a name that
    cannot be an address."""
    if not _MAILABLE.fullmatch(user):
        raise InputError(f"user name {user!r} is not a plain user name: not mailed", "mail this user by hand")
    domain = cfg.efficiency.mail_domain
    return f"{user}@{domain}" if domain else user


def _spec(ts: float, tz: str) -> str:
    """A --since/--until value that `slurm-gpu report` reads back as exactly ts."""
    day = _midnight_day(ts, tz)
    return day.isoformat() if day is not None else f"@{ts!r}" if ts != int(ts) else f"@{int(ts)}"


def report_args(d: Digest, query: Query, default_tz: str, default_threshold_pct: float) -> List[str]:
    """The window, filters and threshold of the digest as `slurm-gpu report` options (the user filter
    aside), for a config whose report.tz and report.idle_threshold_pct are the defaults given."""
    w = d.window
    args = ["--since", _spec(w.since_s, w.tz), "--until", _spec(w.until_s, w.tz)]
    if w.tz != default_tz:
        args += ["--tz", w.tz]
    for opt, vals in (("--account", query.accounts), ("--partition", query.partitions), ("--node", query.nodes),
                      ("--cluster", query.clusters)):
        if vals:
            args += [opt, ",".join(vals)]
    if d.idle_threshold_pct != default_threshold_pct:
        args += ["--idle-threshold", f"{d.idle_threshold_pct:g}"]
    return args


def _wrap(text: str) -> List[str]:
    return textwrap.wrap(text, 76, break_long_words=False, break_on_hyphens=False)


def human_window(w: Window) -> str:
    """'Mon 2026-11-02 00:00 to Mon 2026-11-09 00:00 UTC': the window for people (the end exclusive)."""
    a, b = in_zone(w.since_s, w.tz), in_zone(w.until_s, w.tz)
    zone = "UTC" if w.tz == "utc" else (a.tzname() if a.tzname() == b.tzname() else f"{a.tzname()}/{b.tzname()}")
    return f"{a:%a %Y-%m-%d %H:%M} to {b:%a %Y-%m-%d %H:%M} {zone}"


def _job_ids(ids: Sequence[Tuple[str, int]], limit: int = 30) -> str:
    several = len({c for c, _ in ids}) > 1
    shown = [f"{j} ({c})" if several else str(j) for c, j in ids[:limit]]
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return ", ".join(shown) + more


def user_message(d: Digest, line: Line, to: str, args: Sequence[str]) -> Message:
    """One user's mail: the window, their figures and the week before's, the change, their idle jobs
    and the command that shows the details."""
    user = str(line.key)
    name, per = _unit([getattr(f, c) for f in (line.now, line.before) for c in _TIME_COLS])
    w, p = d.window, d.previous

    def hours(v: Optional[float], sign: bool = False) -> str:
        return "n/a" if v is None else f"{v * per:+.2f}" if sign else f"{v * per:.2f}"

    rows = [("", w.label, p.label, "change"),
            (f"{name} allocated", hours(line.now.gpu_hours_alloc), hours(line.before.gpu_hours_alloc),
             hours(line.change("gpu_hours_alloc"), True)),
            (f"{name} used", hours(line.now.gpu_hours_used), hours(line.before.gpu_hours_used), ""),
            (f"{name} idle", hours(line.now.gpu_hours_idle), hours(line.before.gpu_hours_idle),
             hours(line.change("gpu_hours_idle"), True)),
            ("jobs", str(line.now.jobs), str(line.before.jobs), ""),
            ("jobs with idle GPUs", str(line.now.idle_jobs), str(line.before.idle_jobs), "")]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = ["  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in rows]
    quoted = shlex.join(["--user", user, *args])
    body = [f"Hello {user},", "",
            *_wrap(f"this is your jobs' GPU use in {w.label} ({human_window(w)}), and the change against "
                   f"{p.label}:"), "", *table, "",
            *_wrap(f"Used GPU time is weighted by utilisation (a GPU busy 50 % for an hour counts 0.5 GPU-h); idle "
                   f"GPU time is that of GPUs whose mean utilisation stayed below {d.idle_threshold_pct:g} %.")]
    if line.idle_job_ids:
        body += ["", *_wrap(f"Jobs that held GPUs idle: {_job_ids(line.idle_job_ids)}"),
                 *_wrap("Please request only the GPUs your programs use (--gres=gpu:N or --gpus=N), and end jobs "
                        "that wait for something else.")]
    body += ["", f"Details: slurm-gpu report {quoted}",
             f"Idle jobs: slurm-gpu report jobs --idle {quoted}", "",
             "-- ", f"slurm-gpu on {socket.gethostname()}, weekly GPU digest", ""]
    subject = (f"[slurm-gpu] Your GPU use in {w.label}: {hours(line.now.gpu_hours_alloc)} {name}, "
               f"{hours(line.now.gpu_hours_idle)} idle")
    return Message(to, subject, "\n".join(body))


def admin_message(d: Digest, to: str) -> Message:
    """The whole digest (both tables) for the admins and account coordinators."""
    body = to_text(d) + "\n\n-- \n" + f"slurm-gpu on {socket.gethostname()}, weekly GPU digest\n"
    return Message(to, f"[slurm-gpu] GPU digest {d.window.label}", body)


class Mailing(NamedTuple):
    messages: Tuple[Message, ...]
    refused: Tuple[str, ...]  # one line each: users that cannot be mailed (a name that is no address)


def user_messages(cfg: Config, d: Digest, query: Query) -> Mailing:
    """One message per user with GPU time in the window (a line of records without a user is no one's)."""
    args = report_args(d, query, cfg.report.tz, cfg.report.idle_threshold_pct)
    out: List[Message] = []
    refused: List[str] = []
    for line in d.lines["user"]:
        if line.key is None or not line.now.jobs:
            continue
        try:
            to = user_address(cfg, line.key)
        except InputError as e:
            refused.append(e.message)
            continue
        out.append(user_message(d, line, to, args))
    return Mailing(tuple(out), tuple(refused))


def admin_messages(d: Digest, to: Sequence[str]) -> Mailing:
    return Mailing(tuple(admin_message(d, a) for a in to), ())


def dry_run_text(messages: Sequence[Message]) -> str:
    """What --dry-run prints: each message's recipient, subject and body."""
    return "\n".join(f"To: {m.to}\nSubject: {m.subject}\n\n{m.body}\n" for m in messages).rstrip("\n")
