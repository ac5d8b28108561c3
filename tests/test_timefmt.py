"""slurm_gpu.timefmt: the time conversions shared by the Slurm backend, the XID reader and report specs."""
from __future__ import annotations

import subprocess
import sys
import time
from calendar import timegm

import pytest

from slurm_gpu import timefmt


@pytest.fixture
def new_york(monkeypatch):
    """The host's local zone is America/New_York: EDT (UTC-4) in summer, EST (UTC-5) in winter."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


def utc(*args: int) -> float:
    return float(timegm(args + (0,) * (6 - len(args))))


def test_local_wall_clock_follows_the_host_offset_in_summer_and_winter(new_york):
    assert timefmt.local_to_unix(2026, 7, 1, 12, 0, 0) == utc(2026, 7, 1, 16)
    assert timefmt.local_to_unix(2026, 12, 1, 12, 0, 0) == utc(2026, 12, 1, 17)


def test_time_in_the_skipped_dst_hour_is_read_with_the_offset_before_the_change(new_york):
    # 2026-03-08 02:00 EST jumps to 03:00 EDT: 02:30 does not exist; it is taken as 02:30 EST = 03:30 EDT.
    assert timefmt.local_to_unix(2026, 3, 8, 2, 30, 0) == utc(2026, 3, 8, 7, 30)
    assert timefmt.slurm_to_unix("2026-03-08T02:30:00") == utc(2026, 3, 8, 7, 30)


def test_time_in_the_repeated_dst_hour_is_its_first_occurrence(new_york):
    # 2026-11-01 02:00 EDT falls back to 01:00 EST: 01:30 happens twice; the first is 01:30 EDT.
    assert timefmt.local_to_unix(2026, 11, 1, 1, 30, 0) == utc(2026, 11, 1, 5, 30)
    assert timefmt.iso_to_unix("2026-11-01T01:30:00") == utc(2026, 11, 1, 5, 30)


def test_29_february_exists_only_in_leap_years():
    assert timefmt.wall_clock_to_unix(2024, 2, 29, 10, 0, 0, utc=True) == utc(2024, 2, 29, 10)
    assert timefmt.local_to_unix(2025, 2, 29, 10, 0, 0) is None
    assert timefmt.local_to_unix(2000, 2, 29) is not None and timefmt.local_to_unix(1900, 2, 29) is None
    with pytest.raises(ValueError, match="^2025-02-29 00:00:00 is not a date and time that exists$"):
        timefmt.wall_clock_to_unix(2025, 2, 29, utc=True)


@pytest.mark.parametrize("fields", [(2026, 11, 31, 0, 0, 0), (2026, 13, 1, 0, 0, 0), (2026, 1, 1, 25, 0, 0),
                                    (2026, 1, 1, 0, 60, 0), (2026, 1, 1, 0, 0, 60), (0, 1, 1, 0, 0, 0)])
def test_impossible_local_time_is_none(fields):
    assert timefmt.local_to_unix(*fields) is None


@pytest.mark.parametrize("text,want", [
    ("2026-11-29T11:38:47Z", utc(2026, 11, 29, 11, 38, 47)),
    ("2026-11-29T11:38:47+00:00", utc(2026, 11, 29, 11, 38, 47)),
    ("2026-11-29T11:38:47+05:30", utc(2026, 11, 29, 6, 8, 47)),
    ("2026-11-29T11:38:47+0530", utc(2026, 11, 29, 6, 8, 47)),
    ("2026-11-29T11:38:47-08:00", utc(2026, 11, 29, 19, 38, 47)),
    ("2026-11-29 11:38:47-0800", utc(2026, 11, 29, 19, 38, 47)),
    ("2026-11-29T11:38:47.250000Z", utc(2026, 11, 29, 11, 38, 47) + 0.25),
    ("2026-11-29T11:38:47,5+01:00", utc(2026, 11, 29, 10, 38, 47) + 0.5),
    ("2026-12-31T23:30:00-01:00", utc(2027, 1, 1, 0, 30)),  # the offset carries it into the next year
])
def test_iso_8601_with_offset_and_fraction(text, want):
    assert timefmt.iso_to_unix(text) == pytest.approx(want, abs=1e-6)


def test_iso_8601_without_offset_is_local_time(new_york):
    assert timefmt.iso_to_unix("2026-11-29T11:38:47.5") == utc(2026, 11, 29, 16, 38, 47) + 0.5
    assert timefmt.iso_to_unix("2026-11-29 11:38:47") == utc(2026, 11, 29, 16, 38, 47)


@pytest.mark.parametrize("text", ["", None, "2026-11-29", "2026-11-29T11:38", "2026-02-30T00:00:00Z",
                                  "2026-11-29T11:38:47+5:30", "yesterday", "2026-11-29T11:38:47 trailing"])
def test_not_an_iso_time_is_none(text):
    assert timefmt.iso_to_unix(text) is None


@pytest.mark.parametrize("text,want", [("Z", 0), (None, 0), ("+00:00", 0), ("+05:30", 19800), ("+0530", 19800),
                                       ("-08:00", -28800), ("-0345", -(3 * 3600 + 45 * 60))])
def test_offset_seconds(text, want):
    assert timefmt.offset_seconds(text) == want


@pytest.mark.parametrize("digits,want", [(None, 0.0), ("", 0.0), ("5", 0.5), ("25", 0.25), ("000001", 1e-6)])
def test_fraction(digits, want):
    assert timefmt.fraction(digits) == pytest.approx(want)


def test_slurm_time_is_local_and_unknown_is_none(new_york):
    assert timefmt.slurm_to_unix("2026-11-29T20:08:08") == utc(2026, 11, 30, 1, 8, 8)
    assert timefmt.slurm_to_unix(" 2026-11-29T20:08:08\n") == utc(2026, 11, 30, 1, 8, 8)
    for text in (None, "", "Unknown", "None", "N/A", "2026-11-29 20:08:08", "2026-11-29T20:08:08Z",
                 "2026-11-31T00:00:00", "2026-11-29T20:08"):
        assert timefmt.slurm_to_unix(text) is None, text


def test_importing_it_imports_no_datetime():
    # gpu/xid.py imports it on every job start: datetime only when a date is read.
    code = "import sys, slurm_gpu.timefmt; print('datetime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
