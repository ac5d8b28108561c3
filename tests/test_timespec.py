"""Slurm-style --since/--until specs: each accepted form, and one-line errors naming the bad value."""
from __future__ import annotations

import time
from calendar import timegm

import pytest

from slurm_gpu.errors import InputError
from slurm_gpu.report.timespec import format_time, parse_time

NOW = float(timegm((2026, 11, 15, 13, 45, 30)))  # Sunday 2026-11-15T13:45:30Z
MIDNIGHT = float(timegm((2026, 11, 15, 0, 0, 0)))


@pytest.mark.parametrize("spec,want", [
    ("2026-11-01", timegm((2026, 11, 1, 0, 0, 0))),
    ("2026-11-01T13:00", timegm((2026, 11, 1, 13, 0, 0))),
    ("2026-11-01T13:00:07", timegm((2026, 11, 1, 13, 0, 7))),
    ("2026-11-01 13:00", timegm((2026, 11, 1, 13, 0, 0))),
    ("11/01", timegm((2026, 11, 1, 0, 0, 0))),
    ("11/01/25", timegm((2025, 11, 1, 0, 0, 0))),
    ("11/01/2024", timegm((2024, 11, 1, 0, 0, 0))),
    ("08:30", timegm((2026, 11, 15, 8, 30, 0))),
    ("now", NOW),
    ("NOW", NOW),
    ("now-7days", NOW - 7 * 86400),
    ("now-3hours", NOW - 3 * 3600),
    ("now-30minutes", NOW - 1800),
    ("now+1hour", NOW + 3600),
    ("now-2weeks", NOW - 14 * 86400),
    ("now-90", NOW - 90),
    ("now - 1 day", NOW - 86400),
    ("today", MIDNIGHT),
    ("midnight", MIDNIGHT),
    ("yesterday", MIDNIGHT - 86400),
    ("tomorrow", MIDNIGHT + 86400),
    ("noon", MIDNIGHT + 12 * 3600),
    ("@1767225600", 1767225600),
])
def test_accepted_forms_in_utc(spec, want):
    assert parse_time(spec, now_s=NOW) == float(want)


@pytest.mark.parametrize("spec", ["2026-13-01", "2026-02-30", "2026-11-01T25:00", "now-5parsecs", "last tuesday",
                                  "", "   ", "now-", "13/45", "2026-11"])
def test_bad_spec_is_one_line_error_naming_the_value(spec):
    with pytest.raises(InputError) as err:
        parse_time(spec, now_s=NOW, option="--since")
    assert str(err.value).startswith(f"--since: cannot read time {spec!r}")
    assert "\n" not in str(err.value)
    assert "now-7days" in err.value.hint


def test_local_time_zone_uses_host_offset_and_dst(monkeypatch):
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        # EDT (UTC-4) before 2026-11-01 02:00 local, EST (UTC-5) after.
        assert parse_time("2026-10-31T12:00", tz="local") == float(timegm((2026, 10, 31, 16, 0, 0)))
        assert parse_time("2026-11-02T12:00", tz="local") == float(timegm((2026, 11, 2, 17, 0, 0)))
        # "yesterday" across the DST change is a calendar day (25 h back), not 86400 s.
        now = float(timegm((2026, 11, 2, 15, 0, 0)))  # 10:00 EST on Nov 2
        assert parse_time("today", now_s=now, tz="local") - parse_time("yesterday", now_s=now, tz="local") == 25 * 3600
        assert parse_time("yesterday", now_s=now, tz="local") == float(timegm((2026, 11, 1, 4, 0, 0)))
        assert format_time(float(timegm((2026, 11, 2, 17, 0, 0))), "local") == "2026-11-02T12:00:00-05:00"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_unknown_time_zone_is_rejected():
    with pytest.raises(InputError, match="unknown time zone 'mars'"):
        parse_time("now", tz="mars")


def test_format_time_is_iso_utc():
    assert format_time(NOW) == "2026-11-15T13:45:30Z"
    assert format_time(None) is None
