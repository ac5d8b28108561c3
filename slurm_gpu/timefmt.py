"""Time text -> unix seconds: the conversions that Slurm's output, kernel logs and the report's
--since/--until share.  Each caller keeps its own grammar (slurm/cli_text.py: Slurm's local
ISO form; gpu/xid.py: log-line prefixes; report/timespec.py: relative specs such as now-2days).

Local wall-clock times (what Slurm, syslog and `dmesg -T` print) follow Python's rule for a
naive datetime (fold=0): a time inside the hour a DST change skips is read with the offset in
force before the change (02:30 on a spring-forward night is 03:30 summer time); a time inside
the hour a change repeats is its first occurrence (still summer time).

The one way back: unix_to_local (Slurm's local ISO form, for people reading our output beside
Slurm's).

Imported by every prolog (through gpu/xid.py): `datetime` is imported, and the patterns
compiled (re's own cache), on first use only.
"""
from __future__ import annotations

import re
import time
from typing import Optional

# ISO 8601 as journals and `dmesg --time-format iso` print it: date, 'T' or a space, seconds,
# an optional fraction ('.' or ','), an optional offset (Z, +05:30, -0800).  A caller may embed
# it in a longer pattern (gpu/xid.py: a time prefix before the text) and pass the text it
# matched to iso_to_unix.
ISO_8601 = (r"(?P<year>\d{4})-(?P<month>\d\d)-(?P<day>\d\d)[T ]"
            r"(?P<hour>\d\d):(?P<minute>\d\d):(?P<second>\d\d)"
            r"(?:[.,](?P<fraction>\d+))?(?P<offset>Z|[+-]\d\d:?\d\d)?")
# Slurm's times with SLURM_TIME_FORMAT=standard: local time, no fraction, no offset.
SLURM_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"


def wall_clock_to_unix(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0,
                       *, utc: bool = False) -> float:
    """Unix seconds of a calendar date and time read in UTC, or in the host's local time zone.

    ValueError for a date or time that does not exist (31 November, 29 February 2025, hour 25);
    OverflowError or OSError outside the platform's range.
    """
    from datetime import datetime, timezone  # lazily: not every job start reads a date
    try:
        d = datetime(year, month, day, hour, minute, second)
    except ValueError:
        # Our own words: Python 3.14 rewords datetime's ("day 29 must be in range 1..28 ...").
        raise ValueError(f"{year:04d}-{month:02d}-{day:02d} {hour:02d}:{minute:02d}:{second:02d} "
                         "is not a date and time that exists") from None
    return d.replace(tzinfo=timezone.utc).timestamp() if utc else d.timestamp()


def local_to_unix(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> Optional[float]:
    """Unix seconds of a local wall-clock time; None for an impossible or out-of-range date."""
    try:
        return wall_clock_to_unix(year, month, day, hour, minute, second)
    except (ValueError, OverflowError, OSError):
        return None


def offset_seconds(text: Optional[str]) -> int:
    """A UTC offset in seconds east: 'Z' and None -> 0, '+05:30' -> 19800, '-0800' -> -28800."""
    if not text or text == "Z":
        return 0
    sign = -1 if text[0] == "-" else 1
    digits = text[1:].replace(":", "")
    return sign * (int(digits[:2]) * 3600 + int(digits[2:4]) * 60)


def fraction(digits: Optional[str]) -> float:
    """The digits after the decimal point as seconds: '25' -> 0.25; None or '' -> 0.0."""
    return float("0." + digits) if digits else 0.0


def iso_to_unix(text: Optional[str]) -> Optional[float]:
    """'2026-11-29T11:38:47.25+05:30' (see ISO_8601) -> unix seconds; None when it is not one or
    names an impossible date.  Without an offset the time is local."""
    m = re.fullmatch(ISO_8601, (text or "").strip())
    if m is None:
        return None
    fields = [int(m.group(g)) for g in ("year", "month", "day", "hour", "minute", "second")]
    offset = m.group("offset")
    if offset is None:
        t = local_to_unix(*fields)
    else:
        try:
            t = wall_clock_to_unix(*fields, utc=True) - offset_seconds(offset)
        except (ValueError, OverflowError):
            return None
    return None if t is None else t + fraction(m.group("fraction"))


def slurm_to_unix(text: Optional[str]) -> Optional[float]:
    """Slurm's local ISO time ('2024-05-01T10:00:00') -> unix seconds; None for Unknown, None,
    N/A, an empty value or an impossible date."""
    text = (text or "").strip()
    if not re.fullmatch(SLURM_ISO, text):
        return None
    return local_to_unix(int(text[0:4]), int(text[5:7]), int(text[8:10]),
                         int(text[11:13]), int(text[14:16]), int(text[17:19]))


def unix_to_local(t: float) -> str:
    """Unix seconds -> local wall-clock time in Slurm's ISO form ('2024-05-01T10:00:00', no offset)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))
