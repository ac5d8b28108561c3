"""The XID reader against the line forms real drivers and log tools print (tests/data/xid_corpus.txt),
the dating rules (never a future time, year-less syslog dates) and the count of undated lines."""
from __future__ import annotations

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
    lines = xid.window_lines(io.BytesIO(data), len(data), 600, None, now, block=block)
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
    lines = xid.window_lines(f, len(data), 600, None, now)
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
    lines = xid.window_lines(io.BytesIO(data), len(data), 600, None, NOW, block=1 << 16)
    blocks = -(-len(data) // (1 << 16))
    assert lines == ["NVRM: Xid (PCI:0000:44:00): 79, off the bus"] and len(calls) <= 8 * blocks, (len(calls), blocks)
