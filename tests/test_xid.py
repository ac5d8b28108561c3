"""The XID reader against the line forms real drivers and log tools print (tests/data/xid_corpus.txt),
the dating rules (never a future time, year-less syslog dates) and the count of undated lines."""
from __future__ import annotations

import os
import pathlib
import time
from datetime import datetime, timezone

import pytest

from slurm_gpu import config
from slurm_gpu.gpu import xid
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot, value
from slurm_gpu.gpu.xid import XidEvent, bus_key, parse_line
from slurm_gpu.policy import health

CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "xid_corpus.txt"

# "Now" for every dated test: 30 November 2026, 09:00 local time (the reader's clock).
NOW = datetime(2026, 11, 30, 9, 0, 0).timestamp()


def local(*args: int) -> float:
    """Unix time of a local wall-clock time, as syslog and `dmesg -T` print it."""
    return datetime(*args).timestamp()


def _corpus():
    cases = []
    for n, raw in enumerate(CORPUS.read_text().splitlines(), 1):
        if not raw.strip() or raw.startswith("#"):
            continue
        fields, line = raw.split("\t", 1)
        cases.append(pytest.param(fields.split(), line, id=f"line{n}"))
    return cases


@pytest.mark.parametrize("expected,line", _corpus())
def test_xid_corpus(expected, line):
    want_xid, want_bus, want_gi = expected
    ev = parse_line(line, boot_time=NOW - 30 * 86400, now=NOW)
    if want_xid == "-":
        assert ev is None, f"not a GPU XID, parsed as {ev}"
        return
    assert ev is not None, "a GPU XID line was missed"
    assert (ev.xid, ev.bus) == (int(want_xid), bus_key(want_bus))
    assert ev.gpu_instance == (None if want_gi == "-" else int(want_gi))
    assert ev.message and not ev.message.startswith(",")
    assert ev.time is None or ev.time <= NOW


# --- 1. MIG: the GPU instance sits inside the parentheses --------------------------------

def test_mig_xid_with_gpu_instance_is_not_missed():
    ev = parse_line("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
                    now=NOW)
    assert ev is not None
    assert (ev.xid, ev.bus, ev.gpu_instance) == (94, (0, 1, 0), 5)
    assert ev.message.startswith("pid=7194, Contained: CE User Channel")


def test_mig_xid_with_gpu_and_compute_instance_is_not_missed():
    ev = parse_line("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception", now=NOW)
    assert ev is not None
    assert (ev.xid, ev.bus, ev.gpu_instance) == (13, (0, 0x3B, 0), 1)


def test_xid_event_keeps_positional_construction_and_has_no_gpu_instance_by_default():
    ev = XidEvent(1.0, (0, 1, 0), 79, "GPU has fallen off the bus")
    assert ev.gpu_instance is None


# --- 2. Older drivers: no "PCI:" prefix ------------------------------------------------------

def test_xid_without_pci_prefix_from_older_drivers_is_not_missed():
    ev = parse_line("NVRM: Xid (0000:03:00): 14, Channel 00000001", now=NOW)
    assert ev is not None
    assert (ev.xid, ev.bus, ev.gpu_instance, ev.message) == (14, (0, 3, 0), None, "Channel 00000001")


# --- 3. Year-less syslog dates never land in the future ------------------------------------

SYSLOG_DEC_2 = ("Dec  2 11:38:47 worker4 kernel: [  219.470994] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', "
                "name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU")


def test_yearless_syslog_date_read_on_30_november_is_not_dated_in_the_future():
    ev = parse_line(SYSLOG_DEC_2, now=NOW)
    assert ev is not None and ev.time is not None
    assert ev.time == local(2025, 12, 2, 11, 38, 47), "2 December belongs to the previous year"
    assert ev.time <= NOW


def test_yearless_syslog_date_a_few_minutes_ahead_is_clock_skew_clamped_to_now():
    # The log writer's clock runs 5 minutes ahead of ours: the event happened just now, this year.
    ev = parse_line("Nov 30 09:05:00 worker4 kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.", now=NOW)
    assert ev is not None and ev.time == NOW


def test_syslog_line_written_just_after_new_year_read_just_before_is_not_a_year_old():
    now = local(2026, 12, 31, 23, 59, 59)
    ev = parse_line("Jan  1 00:00:02 worker4 kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.", now=now)
    assert ev is not None and ev.time == now, "dated 1 Jan 2027 (3 s of clock skew), clamped to now"


def test_yearless_syslog_date_20_hours_ahead_is_last_years_not_now():
    # Read on 1 December, written on 2 December last year: within the old one-day slack it was
    # taken as this year's, clamped to now, and failed the GPU on a year-old XID.
    now = local(2026, 12, 1, 15, 0, 0)
    ev = parse_line("Dec  2 11:00:00 worker4 kernel: NVRM: Xid (PCI:0000:07:00): 48, DBE", now=now)
    assert ev is not None and ev.time == local(2025, 12, 2, 11, 0, 0)


def test_yearless_syslog_date_50_minutes_ahead_is_still_clock_skew():
    now = local(2026, 12, 1, 15, 0, 0)
    ev = parse_line("Dec  1 15:50:00 worker4 kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.", now=now)
    assert ev is not None and ev.time == now


def test_yearless_29_february_is_dated_in_the_last_leap_year():
    ev = parse_line("Feb 29 10:00:00 worker4 kernel: NVRM: Xid (PCI:0000:07:00): 48, DBE", now=NOW)
    assert ev is not None and ev.time == local(2024, 2, 29, 10, 0, 0)


def test_syslog_date_with_microseconds_from_journalctl_short_precise():
    ev = parse_line("Nov 29 10:00:00.250000 worker4 kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.",
                    now=NOW)
    assert ev is not None and ev.time == pytest.approx(local(2026, 11, 29, 10, 0, 0) + 0.25)


def test_parse_line_takes_an_explicit_year():
    ev = parse_line(SYSLOG_DEC_2, year=2024, now=NOW)
    assert ev is not None and ev.time == local(2024, 12, 2, 11, 38, 47)


def test_dated_line_far_in_the_future_is_undated_never_a_future_time():
    ev = parse_line("2030-01-01T00:00:00+00:00 host kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.",
                    now=NOW)
    assert ev is not None and ev.xid == 79
    assert ev.time is None, "a date years ahead is a broken clock: not judged, counted as undated"


def test_dated_line_seconds_in_the_future_is_clamped_to_now():
    ev = parse_line(f"{NOW + 2:.6f} host kernel: NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.", now=NOW)
    assert ev is not None and ev.time == NOW


# --- 4. dmesg uptime, dmesg -T, kmsg, journal, ISO-8601, rsyslog ------------------------------

def test_kmsg_record_is_dated_from_boot_time():
    ev = parse_line("3,1234,5000000,-;NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.",
                    boot_time=NOW - 100, now=NOW)
    assert ev is not None and ev.time == NOW - 95


def test_kmsg_record_with_caller_field_is_dated():
    ev = parse_line("4,2211,6000000,-,caller=T812;NVRM: Xid (PCI:0000:18:00): 48, DBE", boot_time=NOW - 100, now=NOW)
    assert ev is not None and ev.time == NOW - 94


def test_uptime_line_without_a_known_boot_time_is_undated():
    ev = parse_line("[  219.470994] NVRM: Xid (PCI:0000:07:00): 48, DBE", now=NOW)
    assert ev is not None and ev.time is None


@pytest.mark.parametrize("line", [
    "[  219.470994] NVRM: Xid (PCI:0000:07:00): 48, DBE",
    "<3>[  219.470994] NVRM: Xid (PCI:0000:07:00): 48, DBE",  # dmesg -r
])
def test_dmesg_uptime_line_is_dated_with_the_boot_time(line):
    ev = parse_line(line, boot_time=NOW - 1000, now=NOW)
    assert ev is not None and ev.time == pytest.approx(NOW - 1000 + 219.470994)


@pytest.mark.parametrize("line", [
    "[24128.000000] NVRM: Xid (PCI:0000:07:00): 48, DBE",  # dmesg of an earlier, longer boot
    "3,1234,24128000000,-;NVRM: Xid (PCI:0000:07:00): 48, DBE",  # kmsg
])
def test_uptime_stamp_beyond_the_current_uptime_is_undated_never_now(line):
    # Up 1,000 s, a stamp of 24,128 s cannot be from this boot: it was dated "now" and FAILed.
    ev = parse_line(line, boot_time=NOW - 1000, now=NOW)
    assert ev is not None and ev.xid == 48 and ev.time is None


def test_uptime_stamp_from_an_earlier_boot_is_counted_undated_never_judged(tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text("[24128.000000] NVRM: Xid (PCI:0000:07:00): 48, DBE\n")
    r = xid.read(f"file:{log}", 3600, now=NOW, boot_time=NOW - 1000)
    assert r.events == [] and r.undated == 1 and r.problem == ""


def test_dmesg_ctime_line_is_dated_as_local_time():
    ev = parse_line("[Mon Nov 30 08:38:47 2026] NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.", now=NOW)
    assert ev is not None and ev.time == local(2026, 11, 30, 8, 38, 47)


def test_dmesg_ctime_with_single_digit_day_is_dated():
    ev = parse_line("[Fri Aug  9 13:32:56 2024] NVRM: Xid (PCI:0000:00:08): 94, pid='<unknown>', name=<unknown>, "
                    "Contained: SM (0x1). RST: No, D-RST: No", now=NOW)
    assert ev is not None and ev.time == local(2024, 8, 9, 13, 32, 56)


UTC_11_38_47 = datetime(2026, 11, 29, 11, 38, 47, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize("stamp,expected", [
    ("2026-11-29T11:38:47+00:00", UTC_11_38_47),                       # journalctl -o short-iso
    ("2026-11-29T11:38:47Z", UTC_11_38_47),
    ("2026-11-29T12:38:47+0100", UTC_11_38_47),                        # journalctl short-iso (no colon)
    ("2026-11-29T12:38:47.123456+01:00", UTC_11_38_47 + 0.123456),     # rsyslog high precision, short-iso-precise
    ("2026-11-29T06:38:47,500000-05:00", UTC_11_38_47 + 0.5),          # dmesg --time-format iso
    ("2026-11-29T11:38:47", local(2026, 11, 29, 11, 38, 47)),          # no offset: local time
    ("2026-11-29 11:38:47", local(2026, 11, 29, 11, 38, 47)),
])
def test_iso_8601_dates_are_parsed(stamp, expected):
    ev = parse_line(f"{stamp} host kernel: NVRM: Xid (PCI:0000:07:00): 48, DBE", now=NOW)
    assert ev is not None and ev.time == pytest.approx(expected)


def test_dmesg_decode_prefix_before_an_iso_date_is_skipped():
    ev = parse_line("kern  :err   : 2026-11-29T11:38:47,000000+00:00 NVRM: Xid (PCI:0000:04:00): 79, GPU has fallen off the bus",
                    now=NOW)
    assert ev is not None and ev.time == UTC_11_38_47


def test_journal_short_unix_line_is_dated():
    ev = parse_line(f"{NOW - 60:.6f} host kernel: NVRM: Xid (PCI:0000:2a:00): 48, pid=1, DBE", now=NOW)
    assert ev is not None and ev.time == pytest.approx(NOW - 60)


# --- 5. Undated lines are counted, not dropped silently ---------------------------------------

def test_undated_xid_lines_in_a_file_are_counted_not_dropped(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001\n"
                   "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus\n"
                   "kernel: usb 1-1: new high-speed USB device\n"
                   f"{NOW - 10:.6f} host kernel: NVRM: Xid (PCI:0000:2a:00): 48, pid=1, DBE\n")
    reading = xid.read(f"file:{log}", 600, now=NOW)
    assert reading.problem == ""
    assert reading.undated == 2
    assert [(e.xid, e.bus) for e in reading.events] == [(48, (0, 0x2A, 0))]


def test_uptime_and_ctime_lines_read_from_a_file_are_dated_not_dropped(tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text("[  500.000000] NVRM: Xid (PCI:0000:07:00): 79, GPU has fallen off the bus.\n"
                   "[Mon Nov 30 08:58:00 2026] NVRM: Xid (PCI:0000:08:00): 48, DBE\n")
    reading = xid.read(f"file:{log}", 600, now=NOW, boot_time=NOW - 600)
    assert reading.undated == 0
    assert [(e.xid, e.time) for e in reading.events] == [(79, NOW - 100), (48, local(2026, 11, 30, 8, 58, 0))]


def test_yearless_syslog_file_read_on_30_november_does_not_report_last_decembers_xid(tmp_path):
    log = tmp_path / "syslog"
    log.write_text(SYSLOG_DEC_2 + "\n")
    reading = xid.read(f"file:{log}", 3600, now=NOW)
    assert reading == xid.XidReading([], "", 0), "a year-old XID must neither be judged nor counted as undated"


def test_unreadable_source_is_a_problem_not_an_exception(tmp_path):
    reading = xid.read(f"file:{tmp_path}/missing.log", 600, now=NOW)
    assert reading.events == [] and reading.undated == 0 and "not found" in reading.problem


def test_disabled_source_reads_nothing():
    assert xid.read("none", 600, now=NOW) == xid.XidReading([], "", 0)


# --- 6. NVSwitch SXids are not GPU XIDs -------------------------------------------------------

@pytest.mark.parametrize("line", [
    "NVRM: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 00 sourcetrack timeout error",
    "kernel: nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Data {0x000001c0, 0x00bd5c8a}",
    "[ 1843.308145] nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
])
def test_nvswitch_sxid_is_not_parsed_as_a_gpu_xid(line):
    assert parse_line(line, boot_time=NOW - 5000, now=NOW) is None


# --- health: the undated count is said, never judged -----------------------------------------

def _snapshot() -> NodeSnapshot:
    gpu = GpuSnapshot(0, uuid=value("GPU-8f2c1a2b-0000-0000-0000-000000000000"), pci_bus_id=value("00000000:07:00.0"))
    return NodeSnapshot("n1", NOW, gpus=(gpu,))


def _xid_results(**kw):
    return [r for r in health.evaluate(_snapshot(), config.defaults(), now=NOW, **kw) if r.check == "xid"]


def test_undated_xid_lines_are_mentioned_but_never_fail():
    res = _xid_results(xid_undated=3)
    assert [r.status for r in res] == ["PASS"]
    assert "3 XID lines in the log could not be dated and were not judged" in res[0].message


def test_one_undated_xid_line_is_mentioned_in_the_singular():
    res = _xid_results(xid_undated=1)
    assert "1 XID line in the log could not be dated and was not judged" in res[0].message


def test_undated_note_stays_out_of_the_drain_reason_of_a_dated_critical_xid():
    ev = XidEvent(NOW - 5, (0, 7, 0), 79, "GPU has fallen off the bus.")
    res = _xid_results(xid_events=[ev], xid_undated=2)
    assert sorted(r.status for r in res) == ["FAIL", "PASS"]
    assert "could not be dated" not in health.drain_fault(res)
    assert any("2 XID lines in the log could not be dated" in r.message for r in res if r.status == "PASS")


def test_no_undated_lines_no_note():
    res = _xid_results()
    assert [r.status for r in res] == ["PASS"] and "dated" not in res[0].message


# --- issue 39, item 2: a user's line is not the kernel's ------------------------------------------
# What `logger` (as any user) makes a syslog file hold, in the formats Debian's rsyslog and journalctl
# write: the program's tag where the kernel's lines say "kernel".  Seen: `logger` as an unprivileged
# user wrote the first of these into /var/log/syslog and the next check said FAIL xid ... XID 79.
FORGED = (
    "Dec  3 16:29:40 vm rtuser[4242]: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    "Dec  3 16:29:40 vm rtuser: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    "2026-12-03T16:29:40.123456+00:00 vm rtuser[4242]: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    "Dec 03 16:29:40 vm rtuser[4242]: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    f"{NOW - 60:.6f} vm rtuser[4242]: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    "Dec  3 16:29:40 vm rtuser[4242]: Dec  3 16:29:40 vm kernel: NVRM: Xid (PCI:0000:3a:00): 79, off the bus.",
    "Dec  3 16:29:40 vm rtuser[4242]: [  219.470994] NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
)


@pytest.mark.parametrize("line", FORGED)
def test_an_xid_line_a_program_logged_under_its_own_tag_is_no_event(line):
    assert parse_line(line, boot_time=NOW - 3600, now=NOW) is None


@pytest.mark.parametrize("line", [
    "Dec  3 16:29:40 vm kernel: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    "2026-12-03T16:29:40.123456+00:00 vm kernel: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
    "Dec 03 16:29:40 vm kernel: [  219.470994] NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
])
def test_the_same_line_under_the_kernels_tag_is_an_event(line):
    ev = parse_line(line, boot_time=NOW - 3600, now=NOW)
    assert ev is not None and (ev.xid, ev.bus) == (79, (0, 0x3A, 0))


def test_a_syslog_file_with_a_forged_and_a_real_xid_gives_only_the_kernels(tmp_path):
    log = tmp_path / "syslog"
    log.write_text(f"{NOW - 30:.6f} vm rtuser[4242]: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.\n"
                   f"{NOW - 20:.6f} vm kernel: NVRM: Xid (PCI:0000:2a:00): 48, pid=1, DBE\n")
    reading = xid.read(f"file:{log}", 600, now=NOW)
    assert [(e.xid, e.bus) for e in reading.events] == [(48, (0, 0x2A, 0))] and reading.undated == 0


def test_a_file_source_every_user_can_write_is_not_read_and_says_why(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(f"{NOW - 20:.6f} vm kernel: NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus.\n")
    log.chmod(0o666)
    reading = xid.read(f"file:{log}", 600, now=NOW)
    assert reading.events == [] and "writable by every user (mode 0666)" in reading.problem, reading
    log.chmod(0o644)
    assert [e.xid for e in xid.read(f"file:{log}", 600, now=NOW).events] == [79]


# --- issue 39, item 1: a file is read back from its end, only as far as the window -----------------

def _syslog_date(t: float) -> str:
    return time.strftime("%b %e %H:%M:%S", time.localtime(t))


def _log_with_xids(n_old: int, now: float) -> bytes:
    """n_old lines two days old (one old XID among them), then the last 20 minutes: kernel chatter
    and three XIDs, one of them 30 minutes old (outside a 10-minute window, inside the read-back)."""
    old = [f"{_syslog_date(now - 2 * 86400 + i)} vm kernel: usb 1-1: port {i} reset" for i in range(n_old)]
    old[n_old // 2] = f"{_syslog_date(now - 2 * 86400)} vm kernel: NVRM: Xid (PCI:0000:01:00): 48, old DBE"
    recent = [f"{_syslog_date(now - 1800)} vm kernel: NVRM: Xid (PCI:0000:02:00): 79, half an hour ago"]
    recent += [f"{_syslog_date(now - 1200 + i)} vm kernel: eth0: link up {i}" for i in range(0, 1200, 7)]
    recent.insert(60, f"{_syslog_date(now - 300)} vm kernel: NVRM: Xid (PCI:0000:03:00): 79, off the bus")
    recent.append(f"{_syslog_date(now - 5)} vm kernel: NVRM: Xid (PCI:0000:04:00): 94, pid=7, Contained")
    return ("\n".join(old + recent)).encode()


@pytest.mark.parametrize("block", [7, 64, 1000, 1 << 16])
@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_reading_back_in_blocks_finds_what_reading_forward_finds(block, ending):
    import io
    now = float(int(time.time()))
    data = _log_with_xids(300, now).replace(b"\n", ending.encode() or b"\n") + ending.encode()
    forward = [xid.parse_line(line, now=now) for line in data.decode().splitlines()]
    want = [(e.xid, e.bus) for e in forward if e is not None and e.time is not None and e.time >= now - 600]
    lines = list(xid.window_lines(io.BytesIO(data), len(data), 600, None, now, block=block))[::-1]  # newest first
    got = [(e.xid, e.bus) for e in (xid.parse_line(line, now=now) for line in lines)
           if e is not None and e.time is not None and e.time >= now - 600]
    assert got == want == [(79, (0, 3, 0)), (94, (0, 4, 0))]
    if block <= 1000:  # blocks well inside the file: two days back is never reached
        assert all("old DBE" not in line for line in lines), lines


def test_a_big_log_is_read_back_only_as_far_as_the_window(tmp_path):
    """Issue 39: a 201 MB kernel log made the prolog take 1.76 s and 536 MB; the window's end of it is enough."""
    import io

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, n=-1):
            out = super().read(n)
            Counting.read_bytes += len(out)
            return out

    now = float(int(time.time()))
    data = _log_with_xids(200_000, now)
    f = Counting(data)
    lines = list(xid.window_lines(f, len(data), 600, None, now))[::-1]
    assert [e.xid for e in (xid.parse_line(line, now=now) for line in lines) if e and e.time >= now - 600] == [79, 94]
    assert len(data) > 9_000_000 and Counting.read_bytes <= 3 * (1 << 16), Counting.read_bytes


def test_an_undated_xid_before_the_window_is_not_reached_but_an_undated_log_is_read_whole(tmp_path):
    now = float(int(time.time()))
    log = tmp_path / "kern.log"
    log.write_bytes(b"NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus\n" + _log_with_xids(5000, now))
    assert xid.read(f"file:{log}", 600, now=now).undated == 0  # read back only to two days ago
    log.write_bytes(b"NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus\n" * 3 + b"usb 1-1: reset\n" * 5000)
    assert xid.read(f"file:{log}", 600, now=now).undated == 3  # no date anywhere: every line was read


def test_a_log_without_dates_costs_a_few_date_parses_per_block_not_one_per_line(monkeypatch):
    """dmesg -t output has no dates: the read-back cannot stop early, and must not try every line."""
    import io
    calls = []
    real = xid._split_time
    monkeypatch.setattr(xid, "_split_time", lambda *a: calls.append(1) or real(*a))
    data = b"usb 1-1: reset high-speed USB device\n" * 50_000 + b"NVRM: Xid (PCI:0000:44:00): 79, off the bus\n"
    lines = list(xid.window_lines(io.BytesIO(data), len(data), 600, None, NOW, block=1 << 16))
    blocks = -(-len(data) // (1 << 16))
    assert lines == ["NVRM: Xid (PCI:0000:44:00): 79, off the bus"] and len(calls) <= 8 * blocks, (len(calls), blocks)


# --- issue 39, item 3: floods counted, not stored ---------------------------------------------------
# A node with 800,000 lines of XID 95 (NVSentinel #1120: 29 distinct events among them) made 800,000
# events in memory and, through healthcheck, 800,000 rows.  Identical lines of one GPU are one event now.

FLOOD = "vm kernel: NVRM: Xid (PCI:0000:18:00): 95, pid=2345, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No"


def _flood_file(path, n: int, now: float, span_s: float = 3000.0, line=FLOOD, syslog: bool = True) -> None:
    """n identical XID lines spread over the span_s seconds before now, each with its own date."""
    step = span_s / n
    with open(path, "w") as f:
        for i in range(0, n, 10_000):
            if syslog:
                f.write("".join(f"{_syslog_date(now - span_s + (i + k) * step)} {line}\n" for k in range(min(10_000, n - i))))
            else:
                f.write("".join(f"{now - span_s + (i + k) * step:.6f} {line}\n" for k in range(min(10_000, n - i))))


def test_800000_identical_xid_lines_are_one_event_with_their_count(tmp_path):
    import tracemalloc
    now = float(int(time.time()))
    log = tmp_path / "kern.log"
    _flood_file(log, 800_000, now)
    t0 = time.perf_counter()
    reading = xid.read(f"file:{log}", 3600, now=now)
    took = time.perf_counter() - t0
    assert reading.problem == "" and reading.undated == 0
    [ev] = reading.events
    assert (ev.xid, ev.bus, ev.gpu_instance, ev.line_count) == (95, (0, 0x18, 0), None, 800_000)
    assert ev.message == "pid=2345, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No"
    assert ev.time == local(*time.localtime(now - 3000)[:6]) and ev.last_time == local(*time.localtime(now - 0.00375)[:6])
    assert sum(n for _, _, n in ev.runs) == 800_000 and len(ev.runs) <= xid.WINDOW_SLICES + 1
    assert took < 5.0, f"{took:.2f} s"  # 0.3 s on the 2-core VM: lines repeated byte for byte are parsed once
    # memory follows the distinct events, not the lines (the whole log is 100 MB)
    tracemalloc.start()
    try:
        assert [e.line_count for e in xid.read(f"file:{log}", 3600, now=now).events] == [800_000]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / (1 << 20):.1f} MiB"


def test_a_flood_of_lines_each_dated_to_the_microsecond_is_one_event_too(tmp_path):
    """journalctl -o short-unix and kmsg give every line a date of its own: aggregated line by line."""
    now = float(int(time.time()))
    log = tmp_path / "kern.log"
    _flood_file(log, 100_000, now, span_s=600.0, syslog=False)
    [ev] = xid.read(f"file:{log}", 3600, now=now).events
    assert (ev.xid, ev.line_count) == (95, 100_000)
    assert ev.time == pytest.approx(now - 600.0) and ev.last_time == pytest.approx(now - 0.006)


def test_a_flood_from_the_journal_is_aggregated_as_journalctl_prints_it(tmp_path, monkeypatch):
    """The journal source reads journalctl's output as a stream (it held the whole output before)."""
    now = time.time()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "journalctl"
    script.write_text("#!/usr/bin/env python3\nimport sys\n"
                      f"assert sys.argv[1:] == ['-k', '-q', '--no-pager', '-o', 'short-unix', '--since', '-3600s']\n"
                      f"w = sys.stdout.write\nfor i in range(50000):\n"
                      f"    w('%.6f {FLOOD}\\n' % ({now - 100} + i * 0.001))\n"
                      f"    w('%.6f vm kernel: usb 1-1: reset\\n' % ({now - 100} + i * 0.001))\n"
                      f"w('{now - 5:.6f} vm kernel: NVRM: Xid (PCI:0000:19:00): 79, GPU has fallen off the bus.\\n')\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    reading = xid.read("journal", 3600, now=now)
    assert reading.problem == "", reading.problem
    assert [(e.xid, e.bus, e.line_count) for e in reading.events] == [(95, (0, 0x18, 0), 50_000), (79, (0, 0x19, 0), 1)]
    script.write_text("#!/bin/sh\necho 'No journal files were found.' >&2\nexit 1\n")
    assert xid.read("journal", 3600, now=now).problem == "journalctl -k failed: No journal files were found."
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    t0 = time.monotonic()
    assert xid.read("journal", 3600, timeout_s=0.5, now=now).problem == "reading XIDs from journal timed out after 0.5s"
    assert time.monotonic() - t0 < 10


def test_two_gpus_two_codes_two_instances_or_two_messages_are_never_merged(tmp_path):
    now = float(int(time.time()))
    kinds = ["NVRM: Xid (PCI:0000:18:00): 95, pid=1, Uncontained: FBHUB",
             "NVRM: Xid (PCI:0000:19:00): 95, pid=1, Uncontained: FBHUB",   # another GPU
             "NVRM: Xid (PCI:0000:18:00): 94, pid=1, Uncontained: FBHUB",   # another code
             "NVRM: Xid (PCI:0000:18:00 GPU-I:01): 95, pid=1, Uncontained: FBHUB",  # a MIG instance
             "NVRM: Xid (PCI:0000:18:00 GPU-I:02): 95, pid=1, Uncontained: FBHUB",  # another one
             "NVRM: Xid (PCI:0000:18:00): 95, pid=2, Uncontained: FBHUB",   # another message (pid): kept apart
             "NVRM: Xid (0001:18:00): 95, pid=1, Uncontained: FBHUB"]      # another PCI domain
    log = tmp_path / "kern.log"
    log.write_text("".join(f"{now - 500 + i:.6f} vm kernel: {kinds[i % len(kinds)]}\n" for i in range(7 * 30)))
    events = xid.read(f"file:{log}", 3600, now=now).events
    assert [(e.bus, e.xid, e.gpu_instance, e.message, e.line_count) for e in events] == [
        ((0, 0x18, 0), 95, None, "pid=1, Uncontained: FBHUB", 30), ((0, 0x19, 0), 95, None, "pid=1, Uncontained: FBHUB", 30),
        ((0, 0x18, 0), 94, None, "pid=1, Uncontained: FBHUB", 30), ((0, 0x18, 0), 95, 1, "pid=1, Uncontained: FBHUB", 30),
        ((0, 0x18, 0), 95, 2, "pid=1, Uncontained: FBHUB", 30), ((0, 0x18, 0), 95, None, "pid=2, Uncontained: FBHUB", 30),
        ((1, 0x18, 0), 95, None, "pid=1, Uncontained: FBHUB", 30)]
    assert [e.time for e in events] == [now - 500 + i for i in range(7)]
    assert [e.last_time for e in events] == [now - 500 + 7 * 29 + i for i in range(7)]


def test_the_corpus_gives_the_same_events_as_line_by_line_but_counted(tmp_path):
    """Every real line of tests/data/xid_corpus.txt, the corpus three times over in one file: the
    events of reading it line by line (what the reader gave before), each once, with a count of 3."""
    lines = [p.values[1] for p in _corpus()]
    boot, window = NOW - 30 * 86400, 10 * 366 * 86400  # every dated corpus line is inside the window
    per_line = [parse_line(line, boot_time=boot, now=NOW) for line in lines]
    dated = [e for e in per_line if e is not None and e.time is not None and e.time >= NOW - window]
    want: dict = {}
    for e in dated:
        key = (e.bus, e.gpu_instance, e.xid, e.message)
        prev = want.get(key)
        want[key] = (e.time, e.time, 3) if prev is None else (min(prev[0], e.time), max(prev[1], e.time), prev[2] + 3)
    log = tmp_path / "corpus.log"
    log.write_text("\n".join(lines * 3) + "\n")
    reading = xid.read(f"file:{log}", window, now=NOW, boot_time=boot)
    got = {(e.bus, e.gpu_instance, e.xid, e.message): (e.time, e.last_time, e.line_count) for e in reading.events}
    assert len(dated) >= 10 and got == want
    assert [(e.bus, e.gpu_instance, e.xid, e.message) for e in reading.events] == list(want), "the log's order"
    assert reading.undated == 3 * sum(1 for e in per_line if e is not None and e.time is None)


def test_more_distinct_messages_than_kept_are_counted_in_one_more_event_of_that_gpu_and_code(tmp_path):
    """A log whose every line names another address must not make memory follow its lines."""
    now = float(int(time.time()))
    log = tmp_path / "kern.log"
    log.write_text("".join(f"{now - 900 + i * 0.1:.6f} vm kernel: NVRM: Xid (PCI:0000:18:00): 31, pid=1, MMU Fault at "
                           f"0x{i:08x}\n" for i in range(5000))
                   + f"{now - 1:.6f} vm kernel: NVRM: Xid (PCI:0000:19:00): 31, pid=1, MMU Fault at 0x0\n")
    events = xid.read(f"file:{log}", 3600, now=now).events
    gpu18 = [e for e in events if e.bus == (0, 0x18, 0)]
    assert len(gpu18) == xid.MAX_MESSAGES + 1 and sum(e.line_count for e in gpu18) == 5000
    other = [e for e in gpu18 if e.message == xid.OTHER_MESSAGES]
    assert [e.line_count for e in other] == [5000 - xid.MAX_MESSAGES]
    assert [(e.bus, e.line_count) for e in events if e.bus != (0, 0x18, 0)] == [((0, 0x19, 0), 1)]


def test_lines_after_a_time_are_counted_exactly_but_for_one_slice_of_the_window(tmp_path):
    """What the metric and the node database count when a flood was seen before: its lines after a time.
    A burst, a pause and a second burst: the first burst is not counted again after its end."""
    now = float(int(time.time()))
    log = tmp_path / "kern.log"
    log.write_text("".join(f"{now - 3000 + i:.6f} {FLOOD}\n" for i in range(60))      # 60 lines, a minute
                   + "".join(f"{now - 600 + i * 0.5:.6f} {FLOOD}\n" for i in range(240)))  # 240 lines, two minutes
    [ev] = xid.read(f"file:{log}", 3600, now=now).events
    assert ev.line_count == 300
    assert xid.lines_after(ev, now - 2941) == 240  # the end of the first burst
    assert xid.lines_after(ev, now - 1000) == 240
    assert xid.lines_after(ev, now - 3001) == 300 and xid.lines_after(ev, now) == 0
    assert abs(xid.lines_after(ev, now - 2970) - (29 + 240)) <= 1  # inside the first burst's slice: estimated
    one = XidEvent(now - 10, (0, 0x18, 0), 79, "off the bus")
    assert (xid.lines_after(one, now - 11), xid.lines_after(one, now - 10)) == (1, 0)


# --- the verdict and a job's record are unchanged by the dedup ---------------------------------------

def _gpus_snapshot() -> NodeSnapshot:
    gpus = tuple(GpuSnapshot(i, uuid=value(f"GPU-{i}"), pci_bus_id=value(f"00000000:{0x18 + i:02X}:00.0")) for i in range(4))
    return NodeSnapshot("n1", NOW, gpus=gpus)


@pytest.mark.parametrize("code,line", [
    (95, "Uncontained: FBHUB. RST: Yes, D-RST: No"),  # critical: FAIL
    (43, "Ch 00000008"),                              # ignored (application): PASS
    (57, "Error programming video memory clocks"),    # neither: WARN
])
def test_the_verdict_on_a_flood_is_the_verdict_on_one_of_its_lines(tmp_path, code, line):
    def verdict(n: int):
        log = tmp_path / f"kern-{n}.log"
        log.write_text("".join(f"{NOW - 3000 + i * 2500 / n:.6f} vm kernel: NVRM: Xid (PCI:0000:19:00): {code}, {line}\n"
                               for i in range(n))
                       + f"{NOW - 5:.6f} vm kernel: NVRM: Xid (PCI:0000:1a:00): 79, GPU has fallen off the bus.\n")
        reading = xid.read(f"file:{log}", 3600, now=NOW)
        res = health.evaluate(_gpus_snapshot(), config.defaults(), now=NOW, xid_events=reading.events,
                              xid_problem=reading.problem, xid_undated=reading.undated)
        return [(r.check, r.status, r.gpu_index, r.message) for r in res if r.check == "xid"]
    one, flood = verdict(1), verdict(100_000)
    assert one == flood
    assert ("xid", "FAIL", 2, "GPU 2 (GPU-2) XID 79 in kernel log: GPU has fallen off the bus.") in one
    status = {95: "FAIL", 43: None, 57: "WARN"}[code]
    assert [r[1] for r in one if r[2] == 1] == ([status] if status else [])


def test_a_flood_that_began_before_the_window_still_fails_while_its_lines_go_on():
    """The prolog reads the log, then judges a moment later: a flood whose first line is then just outside
    the window, and its last well inside, still gates the job (each line did before)."""
    ev = XidEvent(NOW - 3700, (0, 0x19, 0), 95, "Uncontained", None, 5000, NOW - 10)
    res = [r for r in health.evaluate(_gpus_snapshot(), config.defaults(), now=NOW, xid_events=[ev]) if r.check == "xid"]
    assert [(r.status, r.gpu_index) for r in res] == [("FAIL", 1)]
    old = XidEvent(NOW - 3700, (0, 0x19, 0), 95, "Uncontained", None, 5000, NOW - 3650)
    res = [r for r in health.evaluate(_gpus_snapshot(), config.defaults(), now=NOW, xid_events=[old]) if r.check == "xid"]
    assert [r.status for r in res] == ["PASS"]


def test_a_jobs_record_lists_a_flood_once_with_its_count_and_the_same_codes():
    from slurm_gpu.hooks.records import _job_xids
    from slurm_gpu.slurm.gpumap import JobGpu
    from slurm_gpu.store import record as R
    g = _gpus_snapshot().gpus[1]
    jg = JobGpu(0, 1, "/dev/nvidia1")
    t0 = NOW - 1000
    lines = [XidEvent(NOW - 900 + i, (0, 0x19, 0), 95, "Uncontained") for i in range(500)] + \
            [XidEvent(NOW - 100, (0, 0x19, 0), 48, "DBE"), XidEvent(NOW - 2000, (0, 0x19, 0), 79, "before the job")]
    flood = [XidEvent(NOW - 900, (0, 0x19, 0), 95, "Uncontained", None, 500, NOW - 401),
             XidEvent(NOW - 100, (0, 0x19, 0), 48, "DBE"), XidEvent(NOW - 2000, (0, 0x19, 0), 79, "before the job")]
    before, after = _job_xids(lines, g, jg, t0), _job_xids(flood, g, jg, t0)
    assert sorted({x["xid"] for x in before}) == sorted({x["xid"] for x in after}) == [48, 95]
    assert after == [{"xid": 95, "time": NOW - 900, "message": "Uncontained", "line_count": 500, "last_time": NOW - 401},
                     {"xid": 48, "time": NOW - 100, "message": "DBE"}]
    import json
    assert json.loads(R.xid_text(after)) == after  # written as it is
    # a flood under way when the job started belongs to the job (its last line came after the start)
    straddle = [XidEvent(t0 - 50, (0, 0x19, 0), 95, "Uncontained", None, 100, t0 + 49)]
    assert [x["xid"] for x in _job_xids(straddle, g, jg, t0)] == [95]
    assert [x["xid"] for x in R.xids_after(_job_xids(straddle, g, jg, 0.0), t0)] == [95]


def test_the_xid_counter_counts_a_floods_lines_once_each_as_it_grows():
    """slurm_gpu_xid_errors_total counts lines: a flood read by the prolog, the epilog and healthcheck
    (each a whole window) adds each of its lines once, and only the new ones when it goes on."""
    from slurm_gpu.metrics import node as N
    g = GpuSnapshot(0, uuid=value("GPU-0"), name=value("H100"), pci_bus_id=value("00000000:18:00.0"))

    def run(old, events):
        up = N.NodeUpdate("healthcheck", NOW)
        up.xid_gpus.append(g)
        up.xids(events)
        return N.apply(old, up)

    def total(samples):
        return {dict(k)["xid"]: v for k, v in samples[N.XID].items()}

    flood = XidEvent(NOW - 600, (0, 0x18, 0), 95, "Uncontained", None, 800_000, NOW - 60, ((NOW - 600, NOW - 60, 800_000),))
    one = XidEvent(NOW - 30, (0, 0x18, 0), 79, "off the bus")
    out = run({}, [flood, one])
    assert total(out) == {"95": 800_000, "79": 1}
    out = run(out, [flood, one])  # the same window read again
    assert total(out) == {"95": 800_000, "79": 1}
    grown = flood._replace(line_count=800_600, last_time=NOW - 1,
                           runs=((NOW - 600, NOW - 60, 800_000), (NOW - 20, NOW - 1, 600)))
    out = run(out, [grown, one])
    assert total(out) == {"95": 800_600, "79": 1}
    assert out[N.XID_MARK] == {N.gpu_labels(g): NOW - 1}


def test_dates_to_the_sub_second_read_once_per_second_are_the_dates_parse_line_gives():
    """A flood with a date to the microsecond on every line (rsyslog high precision, journalctl
    short-iso-precise, short-precise, short-unix) is read once per whole second and header: the same
    dates, and the same lines refused as a program's, as parse_line reading each line whole."""
    import random
    rnd = random.Random(39)
    heads = []
    for _ in range(300):
        t = NOW - rnd.uniform(-2 * 86400, 400 * 86400)
        frac = f"{rnd.randint(0, 999_999):06d}"[:rnd.randint(1, 6)]
        iso, sl = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)), time.strftime("%b %e %H:%M:%S", time.localtime(t))
        tag = rnd.choice(["kernel", "rtuser[42]", "kernel[0]"])
        heads += [f"{iso}.{frac}+01:00 host {tag}: ", f"{iso},{frac} host {tag}: ", f"{iso}.{frac}Z ",
                  f"{sl}.{frac} host {tag}: ", f"{sl},{frac} host {tag}: ", f"{sl}.{frac}  ",
                  f"{t:.6f} host {tag}: ", f"  {t:.{rnd.randint(1, 6)}f}\thost {tag}: ", f"{int(t)} : err : ", f"{t:.3f}"]
    for boot in (None, NOW - 5000):
        w = xid._Window(NOW, 10 ** 9, boot)
        for head in heads:
            line = head + "NVRM: Xid (PCI:0000:18:00): 13, pid=1, Graphics Exception"
            want = parse_line(line, boot, now=NOW)
            got = w._sub_second(head) or xid._date_and_tag(head, boot, None, NOW)
            assert (got[0] if got[1] else "not the kernel's") == (want.time if want else "not the kernel's"), line


def test_events_come_in_the_order_of_their_first_lines_in_the_log(tmp_path):
    """As lines did: a flood that began first comes first, even when another XID's lines are newer."""
    now = float(int(time.time()))
    a = f"{_syslog_date(now - 100)} vm kernel: NVRM: Xid (PCI:0000:18:00): 95, Uncontained"
    b = f"{_syslog_date(now - 100)} vm kernel: NVRM: Xid (PCI:0000:19:00): 79, GPU has fallen off the bus."
    c = f"{_syslog_date(now - 50)} vm kernel: NVRM: Xid (PCI:0000:1a:00): 48, DBE"
    log = tmp_path / "kern.log"
    log.write_text("\n".join([a, b, a, c, a, b]) + "\n")
    assert [(e.xid, e.line_count) for e in xid.read(f"file:{log}", 3600, now=now).events] == [(95, 3), (79, 2), (48, 1)]


def test_a_flood_from_kmsg_is_aggregated_record_by_record(monkeypatch):
    """/dev/kmsg records carry their own sequence number and microseconds: each record is counted
    as it is read, none is kept."""
    seen = []

    def records(deadline_s):
        for i in range(100_000):
            seen.append(i)
            yield f"3,{1000 + i},{(900 + i * 0.001) * 1e6:.0f},-;NVRM: Xid (PCI:0000:18:00): 95, pid=1, Uncontained"
        yield "3,200000,999000000,-;NVRM: Xid (PCI:0000:19:00): 79, GPU has fallen off the bus."
    monkeypatch.setattr(xid, "_kmsg_lines", records)
    reading = xid.read("kmsg", 3600, now=NOW, boot_time=NOW - 1000)
    assert [(e.xid, e.line_count) for e in reading.events] == [(95, 100_000), (79, 1)]
    assert reading.events[0].time == pytest.approx(NOW - 100) and reading.events[0].last_time == pytest.approx(NOW - 0.001)
    assert len(seen) == 100_000
