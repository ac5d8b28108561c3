"""The calendar of day/week/month groups: buckets (start, end, label) in the report's zone, local
days cut at local midnight (DST-safe), ISO weeks from Monday."""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import List, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.report.timespec import in_zone, wall_time


def _bucket_start(ts: float, unit: str, tz: str) -> datetime:
    d = in_zone(ts, tz)
    if unit == "month":
        return wall_time(d.year, d.month, 1, 0, 0, 0, tz)
    day = wall_time(d.year, d.month, d.day, 0, 0, 0, tz)
    if unit == "week":  # ISO weeks start on Monday
        monday = day.replace(tzinfo=None) - timedelta(days=d.weekday())
        return wall_time(monday.year, monday.month, monday.day, 0, 0, 0, tz)
    return day


def _next_bucket(d: datetime, unit: str, tz: str) -> datetime:
    if unit == "month":
        y, m = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
        return wall_time(y, m, 1, 0, 0, 0, tz)
    step = 7 if unit == "week" else 1
    n = d.replace(tzinfo=None) + timedelta(days=step)  # calendar days: DST-safe in local time
    return wall_time(n.year, n.month, n.day, 0, 0, 0, tz)


def _label(d: datetime, unit: str) -> str:
    if unit == "month":
        return d.strftime("%Y-%m")
    if unit == "week":
        iso = d.isocalendar()
        return f"{iso[0]:04d}-W{iso[1]:02d}"
    return d.strftime("%Y-%m-%d")


MAX_BUCKETS = 100_000


def calendar(lo_s: float, hi_s: float, unit: str, tz: str) -> List[Tuple[float, float, str]]:
    """Buckets (start_s, end_s, label) covering [lo_s, hi_s), the first and last clipped to it."""
    out: List[Tuple[float, float, str]] = []
    d = _bucket_start(lo_s, unit, tz)
    while d.timestamp() < hi_s:
        n = _next_bucket(d, unit, tz)
        out.append((max(d.timestamp(), lo_s), min(n.timestamp(), hi_s), _label(d, unit)))
        if len(out) > MAX_BUCKETS:
            raise InputError(f"the records span more than {MAX_BUCKETS} {unit}s", "narrow the window with --since/--until")
        d = n
    return out
