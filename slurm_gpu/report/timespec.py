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
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Callable, Optional, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.timefmt import wall_clock_to_unix

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


def time_zone(tz: str) -> Optional[tzinfo]:
    """The tzinfo of --tz: UTC, or None for the host's local zone; InputError for anything else."""
    if tz == "utc":
        return timezone.utc
    if tz == "local":
        return None  # datetime.astimezone() with no argument: the host's local zone
    raise InputError(f"unknown time zone {tz!r}", "use --tz utc or --tz local")


def in_zone(ts: float, tz: str) -> datetime:
    """Unix seconds as an aware datetime in UTC or in the host's local zone."""
    zone = time_zone(tz)
    return datetime.fromtimestamp(ts, zone) if zone else datetime.fromtimestamp(ts).astimezone()


def wall_time(year: int, month: int, day: int, hour: int, minute: int, second: int, tz: str) -> datetime:
    """A calendar date and time read in UTC or local time (timefmt's DST rule), as an aware datetime.
    ValueError for a date or time that does not exist."""
    return in_zone(wall_clock_to_unix(year, month, day, hour, minute, second, utc=time_zone(tz) is not None), tz)


def _today_midnight(now_s: float, tz: str) -> datetime:
    now = in_zone(now_s, tz)
    return wall_time(now.year, now.month, now.day, 0, 0, 0, tz)


def _shift_days(d: datetime, days: int, tz: str) -> datetime:
    # Shift the calendar date, not by 86400 s: across a DST change a local day is 23 or 25 hours.
    target = (d.replace(tzinfo=None) + timedelta(days=days))
    return wall_time(target.year, target.month, target.day, 0, 0, 0, tz)


# --- one reader per form: (text, now_s, tz) -> unix seconds, None when the form does not match ---

def _relative(text: str, now_s: float, tz: str) -> Optional[float]:
    m = _RELATIVE.fullmatch(text)
    if not m:
        return None
    if not m.group(1):
        return float(now_s)
    unit = m.group(3)
    if unit not in _UNITS_S:
        raise ValueError(f"unknown unit {unit!r} (seconds, minutes, hours, days, weeks)")
    delta = int(m.group(2)) * _UNITS_S[unit]
    return float(now_s + delta if m.group(1) == "+" else now_s - delta)


def _named_day(text: str, now_s: float, tz: str) -> Optional[float]:
    shift = {"today": 0, "midnight": 0, "yesterday": -1, "tomorrow": 1}.get(text)
    if shift is not None:
        return _shift_days(_today_midnight(now_s, tz), shift, tz).timestamp()
    if text == "noon":
        d = _today_midnight(now_s, tz)
        return wall_time(d.year, d.month, d.day, 12, 0, 0, tz).timestamp()
    return None


def _epoch(text: str, now_s: float, tz: str) -> Optional[float]:
    m = _EPOCH.fullmatch(text)
    return float(m.group(1)) if m else None


def _iso_date(text: str, now_s: float, tz: str) -> Optional[float]:
    m = _ISO.fullmatch(text)
    if not m:
        return None
    y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    hh, mm, ss = int(m.group(4) or 0), int(m.group(5) or 0), int(m.group(6) or 0)
    return wall_time(y, mo, d, hh, mm, ss, tz).timestamp()


def _us_date(text: str, now_s: float, tz: str) -> Optional[float]:
    m = _US_DATE.fullmatch(text)
    if not m:
        return None
    year = _today_midnight(now_s, tz).year
    if m.group(3):
        year = int(m.group(3))
        year = year + 2000 if year < 100 else year
    return wall_time(year, int(m.group(1)), int(m.group(2)), 0, 0, 0, tz).timestamp()


def _clock(text: str, now_s: float, tz: str) -> Optional[float]:
    m = _CLOCK.fullmatch(text)
    if not m:
        return None
    d = _today_midnight(now_s, tz)
    return wall_time(d.year, d.month, d.day, int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), tz).timestamp()


_READERS: Tuple[Callable[[str, float, str], Optional[float]], ...] = (
    _relative, _named_day, _epoch, _iso_date, _us_date, _clock)


def parse_time(spec: str, *, now_s: Optional[float] = None, tz: str = "utc", option: str = "time") -> float:
    """Return unix seconds for a Slurm-style time spec; InputError (one line, naming the value) if unreadable."""
    now_s = time.time() if now_s is None else now_s
    text = (spec or "").strip().lower()

    def bad(why: str = "") -> InputError:
        detail = f": {why}" if why else ""
        return InputError(f"{option}: cannot read time {spec!r}{detail}", HINT)

    if not text:
        raise bad("empty value")
    time_zone(tz)
    try:
        for read in _READERS:
            t = read(text, now_s, tz)
            if t is not None:
                return t
    except ValueError as e:  # datetime() range errors: month 13, hour 25, Feb 30, ...; an unknown unit
        raise bad(str(e)) from None
    except OverflowError:
        raise bad("out of range") from None
    raise bad()


def format_time(ts: Optional[float], tz: str = "utc") -> Optional[str]:
    """ISO 8601 text for unix seconds (seconds precision), in UTC ('Z') or local time with offset."""
    if ts is None:
        return None
    d = in_zone(ts, tz)
    text = d.replace(microsecond=0).isoformat()
    return text.replace("+00:00", "Z") if tz == "utc" else text
