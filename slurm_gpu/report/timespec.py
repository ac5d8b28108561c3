"""Slurm-style time specifications for `--since/--until` (as sacct -S/-E and sbatch --begin take them).

Accepted (case-insensitive):

- ``YYYY-MM-DD``, ``YYYY-MM-DDTHH:MM``, ``YYYY-MM-DDTHH:MM:SS`` (a space instead of ``T`` works too)
- ``MM/DD``, ``MM/DD/YY``, ``MM/DD/YYYY`` (a date, at 00:00)
- ``HH:MM``, ``HH:MM:SS`` (today at that time)
- ``now``, ``now-7days``, ``now+1hour``, ``now-30minutes``, ``now-90`` (a bare count is seconds);
  units: seconds/sec/s, minutes/min, hours/hour/h, days/day/d, weeks/week/w
- ``today`` and ``midnight`` (today 00:00), ``yesterday`` (yesterday 00:00), ``tomorrow``
  (tomorrow 00:00), ``noon`` (today 12:00)
- ``@1767225600`` (unix seconds)

Calendar times are read in UTC unless the caller asks for the local time zone, so that a
report run on any host (or in CI) gives the same answer for the same spec.
"""
from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone
from typing import Optional

from slurm_gpu.errors import InputError

TZ_CHOICES = ("utc", "local")

HINT = ("use YYYY-MM-DD[THH:MM[:SS]], MM/DD[/YY], HH:MM[:SS], now, now-7days, now-3hours, now-30minutes, "
        "today, midnight, yesterday, tomorrow, noon or @UNIXSECONDS")

_UNITS_S = {
    "": 1, "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "week": 604800, "weeks": 604800,
}

_RELATIVE = re.compile(r"now(?:\s*([+-])\s*(\d+)\s*([a-z]*))?")
_ISO = re.compile(r"(\d{4})-(\d{1,2})-(\d{1,2})(?:[t ](\d{1,2}):(\d{2})(?::(\d{2}))?)?")
_US_DATE = re.compile(r"(\d{1,2})/(\d{1,2})(?:/(\d{2}|\d{4}))?")
_CLOCK = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?")
_EPOCH = re.compile(r"@(\d+(?:\.\d+)?)")


def _zone(tz: str):
    if tz == "utc":
        return timezone.utc
    if tz == "local":
        return None  # datetime.astimezone() with no argument: the host's local zone
    raise InputError(f"unknown time zone {tz!r}", "use --tz utc or --tz local")


def _today_midnight(now_s: float, tz: str) -> datetime:
    zone = _zone(tz)
    now = datetime.fromtimestamp(now_s, zone) if zone else datetime.fromtimestamp(now_s).astimezone()
    return _at(now.year, now.month, now.day, 0, 0, 0, tz)


def _at(year: int, month: int, day: int, hour: int, minute: int, second: int, tz: str) -> datetime:
    zone = _zone(tz)
    naive = datetime(year, month, day, hour, minute, second)
    # astimezone() on a naive datetime assumes local time and attaches the right UTC offset (DST included).
    return naive.replace(tzinfo=zone) if zone else naive.astimezone()


def parse_time(spec: str, *, now_s: Optional[float] = None, tz: str = "utc", option: str = "time") -> float:
    """Return unix seconds for a Slurm-style time spec; InputError (one line, naming the value) if unreadable."""
    now_s = time.time() if now_s is None else now_s
    text = (spec or "").strip().lower()

    def bad(why: str = "") -> InputError:
        detail = f": {why}" if why else ""
        return InputError(f"{option}: cannot read time {spec!r}{detail}", HINT)

    if not text:
        raise bad("empty value")
    _zone(tz)
    try:
        m = _RELATIVE.fullmatch(text)
        if m:
            if not m.group(1):
                return float(now_s)
            unit = m.group(3)
            if unit not in _UNITS_S:
                raise bad(f"unknown unit {unit!r} (seconds, minutes, hours, days, weeks)")
            delta = int(m.group(2)) * _UNITS_S[unit]
            return float(now_s + delta if m.group(1) == "+" else now_s - delta)
        if text in ("today", "midnight"):
            return _today_midnight(now_s, tz).timestamp()
        if text == "yesterday":
            return _shift_days(_today_midnight(now_s, tz), -1, tz).timestamp()
        if text == "tomorrow":
            return _shift_days(_today_midnight(now_s, tz), 1, tz).timestamp()
        if text == "noon":
            d = _today_midnight(now_s, tz)
            return _at(d.year, d.month, d.day, 12, 0, 0, tz).timestamp()
        m = _EPOCH.fullmatch(text)
        if m:
            return float(m.group(1))
        m = _ISO.fullmatch(text)
        if m:
            y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
            hh, mm, ss = int(m.group(4) or 0), int(m.group(5) or 0), int(m.group(6) or 0)
            return _at(y, mo, d, hh, mm, ss, tz).timestamp()
        m = _US_DATE.fullmatch(text)
        if m:
            today = _today_midnight(now_s, tz)
            year = today.year
            if m.group(3):
                year = int(m.group(3))
                year = year + 2000 if year < 100 else year
            return _at(year, int(m.group(1)), int(m.group(2)), 0, 0, 0, tz).timestamp()
        m = _CLOCK.fullmatch(text)
        if m:
            d = _today_midnight(now_s, tz)
            return _at(d.year, d.month, d.day, int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), tz).timestamp()
    except ValueError as e:  # datetime() range errors: month 13, hour 25, Feb 30, ...
        raise bad(str(e)) from None
    except OverflowError:
        raise bad("out of range") from None
    raise bad()


def _shift_days(d: datetime, days: int, tz: str) -> datetime:
    # Shift the calendar date, not by 86400 s: across a DST change a local day is 23 or 25 hours.
    target = (d.replace(tzinfo=None) + timedelta(days=days))
    return _at(target.year, target.month, target.day, 0, 0, 0, tz)


def format_time(ts: Optional[float], tz: str = "utc") -> Optional[str]:
    """ISO 8601 text for unix seconds (seconds precision), in UTC ('Z') or local time with offset."""
    if ts is None:
        return None
    zone = _zone(tz)
    d = datetime.fromtimestamp(ts, zone) if zone else datetime.fromtimestamp(ts).astimezone()
    text = d.replace(microsecond=0).isoformat()
    return text.replace("+00:00", "Z") if zone is not None else text
