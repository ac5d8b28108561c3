"""NVIDIA XID events from the kernel log.

Sources (config xid.source): 'kmsg' (/dev/kmsg), 'journal' (journalctl -k), 'file:/path' or 'none'.
Only events inside the time window count, and the caller de-duplicates per GPU and XID: an
old XID must never keep a node drained forever.

Dating (docs/config.md, "XID lines"):
- A reader never returns a time in the future.  A date up to FUTURE_SLACK_S ahead of `now` is
  clock skew between the log's writer and us: it becomes `now`.  A date further ahead comes
  from a broken clock: the line is *undated*.
- A syslog date has no year: it gets the latest year that does not put it more than
  YEARLESS_SLACK_S ahead of `now` (read on 1 December, "Dec  2" is last December).
- A dmesg uptime (`[  219.470994]`, kmsg records) is turned into a date with the boot time of
  *this* boot; in a file that holds an older boot's log these dates are wrong.  A stamp beyond
  the current uptime (by more than UPTIME_SLACK_S) cannot be from this boot: *undated*.
- XID lines that cannot be dated are counted (XidReading.undated), never judged: an old XID
  without a date must not drain a node.
"""
from __future__ import annotations

import itertools
import os
import re
import stat as _stat
import time
from typing import BinaryIO, Callable, Iterable, List, NamedTuple, Optional, Tuple

from slurm_gpu import timefmt

# How far ahead of our clock a log date may be and still count as "now".  One day covers clock
# skew and a log written in another time zone.
FUTURE_SLACK_S = 86400.0
# A year-less (syslog) date more than this ahead of our clock is last year's.  Not a day: read on
# 1 December, a line of 2 December last year would be 20 hours ahead and taken as now.  An hour
# covers clock skew between the log's writer and us and a daylight-saving change (the kernel
# log is this node's, in its time zone).
YEARLESS_SLACK_S = 3600.0
# How far a dmesg/kmsg uptime stamp may be beyond the current uptime: lines logged after the
# reader took `now`.  A stamp further beyond comes from an earlier (longer) boot.
UPTIME_SLACK_S = 60.0

# The driver prints (NVIDIA/open-gpu-kernel-modules src/nvidia/src/kernel/gpu/rc/kernel_rc.c)
#   NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[ GPU-CI:%02u]]): %d, [pid=%s, name=%s, ]<message>
# and older drivers drop the "PCI:" (docs.nvidia.com/deploy/xid-errors).  Anything else inside
# the parentheses is tolerated.  "NVRM: Xid" and not a bare "Xid": NVSwitch errors read
# "nvidia-nvswitchN: SXid (...)", and messages say "caused by previous Xid 149".
# Patterns are kept as text: re compiles (and caches) them on first use, so a job start whose
# kernel log holds no XID line never pays for compiling them.
_XID = (r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+(?:\.[0-9A-Fa-f]+)?)"
        r"(?P<attrs>[^)]*)\):\s*(?P<xid>\d+),?\s*(?P<msg>.*)")
_XID_BYTES = b"NVRM: Xid"  # what every XID line holds: other lines are dropped unread
_GPU_INSTANCE = r"\bGPU-I:\s*(\d+)"  # decimal (%02u); GPU-CI is the compute instance

# Time prefixes; the last group of each is the rest of the line.
_KMSG = r"^\d+,\d+,(\d+),[^;]*;(.*)$"  # /dev/kmsg: prio,seq,usec since boot,flags[,caller=..];text
_DMESG_DECODE = r"^[a-z0-9]+\s*:\s*(?:emerg|alert|crit|err|warn|notice|info|debug)\s*:\s*"  # dmesg -x
_UPTIME = r"^(?:<\d+>)?\[\s*(\d+(?:\.\d+)?)\]\s?(.*)$"  # dmesg, dmesg -r
_CTIME = r"^\[[A-Z][a-z]{2} ([A-Z][a-z]{2})\s+(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\]\s?(.*)$"  # dmesg -T
_UNIX = r"^(\d{9,11}(?:\.\d+)?)\s+(.*)$"  # journalctl -o short-unix
_ISO = "^(" + timefmt.ISO_8601 + r")\s+(.*)$"  # dmesg --time-format iso, journalctl -o short-iso(-precise)
_SYSLOG = r"^([A-Z][a-z]{2})\s+(\d{1,2}) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?\s+(.*)$"
# After a syslog or journal date: "host tag[pid]: ".  The kernel's lines carry the tag "kernel";
# any other tag is a program's line, and a user's `logger` can write "NVRM: Xid ..." there.
_SYSLOG_HEADER = r"^[^\s:]+\s+([^\s\[\]:]+)(?:\[\d+\])?:\s"  # a host name holds no ":"
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}


class XidEvent(NamedTuple):  # not a dataclass: this module is imported by every prolog
    time: Optional[float]  # unix seconds; None: the line carries no usable date
    bus: Tuple[int, int, int]  # (domain, bus, device)
    xid: int
    message: str
    gpu_instance: Optional[int] = None  # MIG GPU instance id (GPU-I:) the driver attributed it to


class XidReading(NamedTuple):
    events: List[XidEvent]  # dated events inside the window
    problem: str  # why the source could not be read; "" when it was
    undated: int  # XID lines without a usable date: counted, never judged


def bus_key(bus_id: str) -> Tuple[int, int, int]:
    """'00000000:18:00.0' (NVML) and '0000:18:00' (kernel log) -> (0, 0x18, 0)."""
    parts = bus_id.split(".")[0].split(":")
    if len(parts) != 3:
        return (-1, -1, -1)
    try:
        return (int(parts[0], 16), int(parts[1], 16), int(parts[2], 16))
    except ValueError:
        return (-1, -1, -1)


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # uptime stamps then stay undated rather than landing in 1970


# --- one converter per time prefix: (match, boot_time, year, now) -> unix time or None ---------

def _this_boot(boot: Optional[float], uptime_s: float, now: float) -> Optional[float]:
    """The date of an uptime stamp of this boot; None for one beyond this boot's uptime."""
    if boot is None or boot + uptime_s > now + UPTIME_SLACK_S:
        return None
    return boot + uptime_s


def _from_uptime(m: "re.Match[str]", boot: Optional[float], year: Optional[int], now: float) -> Optional[float]:
    return _this_boot(boot, float(m.group(1)), now)


def _from_ctime(m: "re.Match[str]", boot: Optional[float], year: Optional[int], now: float) -> Optional[float]:
    mon = _MONTHS.get(m.group(1))  # dmesg -T prints local time; the weekday adds nothing
    return None if mon is None else timefmt.local_to_unix(int(m.group(6)), mon, *(int(g) for g in m.group(2, 3, 4, 5)))


def _from_unix(m: "re.Match[str]", boot: Optional[float], year: Optional[int], now: float) -> Optional[float]:
    return float(m.group(1))


def _from_iso(m: "re.Match[str]", boot: Optional[float], year: Optional[int], now: float) -> Optional[float]:
    return timefmt.iso_to_unix(m.group(1))


def _from_syslog(m: "re.Match[str]", boot: Optional[float], year: Optional[int], now: float) -> Optional[float]:
    mon = _MONTHS.get(m.group(1))
    if mon is None:
        return None
    clock = tuple(int(g) for g in m.group(2, 3, 4, 5))
    if year is not None:
        t = timefmt.local_to_unix(year, mon, *clock)
        return None if t is None else t + timefmt.fraction(m.group(6))
    # The latest year that does not put the date beyond the slack: next year too, for a line
    # written just after midnight on 1 January by a clock slightly ahead of ours.  Eight years
    # back always reach a leap year for 29 February.
    this_year = time.localtime(now).tm_year
    for y in range(this_year + 1, this_year - 8, -1):
        t = timefmt.local_to_unix(y, mon, *clock)
        if t is not None and t <= now + YEARLESS_SLACK_S:
            return t + timefmt.fraction(m.group(6))
    return None


_Converter = Callable[["re.Match[str]", Optional[float], Optional[int], float], Optional[float]]
_DATED_FORMS: Tuple[Tuple[str, _Converter], ...] = (
    (_UPTIME, _from_uptime), (_CTIME, _from_ctime), (_UNIX, _from_unix), (_ISO, _from_iso), (_SYSLOG, _from_syslog),
)


def _split_time(line: str, boot: Optional[float], year: Optional[int], now: float) -> Tuple[Optional[float], str]:
    """(unix time or None, the rest of the line) for every prefix form we know."""
    m = re.match(_KMSG, line)
    if m:
        return _this_boot(boot, int(m.group(1)) / 1e6, now), m.group(2)
    line = re.sub(_DMESG_DECODE, "", line, count=1)
    for pattern, convert in _DATED_FORMS:
        m = re.match(pattern, line)
        if m:
            return convert(m, boot, year, now), m.group(m.re.groups)
    return None, line


def _not_future(t: Optional[float], now: float) -> Optional[float]:
    if t is None or t > now + FUTURE_SLACK_S:
        return None  # a broken clock: the line is counted as undated, never judged
    return min(t, now)  # clock skew: it happened just now


def parse_line(line: str, boot_time: Optional[float] = None, year: Optional[int] = None,
               now: Optional[float] = None) -> Optional[XidEvent]:
    """One log line (kmsg record, dmesg with uptime / -T / -x / --time-format iso, journal
    short-unix / short / short-iso / short-precise, syslog, rsyslog high precision) -> XidEvent,
    or None when it is not a GPU XID line.  A line with a syslog header ("host tag[pid]: ") counts
    only when its tag is "kernel": any program, and so any user, can log the same text under its
    own.  The event's time is None when the line cannot be dated: no date, an uptime without
    boot_time, or a date beyond the future slack.

    boot_time: unix time of the boot the uptime stamps count from (None: unknown).
    year: the year of a syslog date (default: the year rule against `now`).
    now: the reader's clock (default time.time()); pass it for deterministic results.
    """
    if "NVRM: Xid" not in line:  # most kernel lines: skip the date parsing
        return None
    now = time.time() if now is None else now
    t, text = _split_time(line.strip(), boot_time, year, now)
    header = re.match(_SYSLOG_HEADER, text)
    if header and header.group(1) != "kernel":
        return None  # a program's line in a syslog file, not the kernel's (a forged XID drains no node)
    x = re.search(_XID, text)
    if not x:
        return None
    gi = re.search(_GPU_INSTANCE, x.group("attrs"))
    return XidEvent(_not_future(t, now), bus_key(x.group("bus")), int(x.group("xid")), x.group("msg").strip(),
                    int(gi.group(1)) if gi else None)


def _read_kmsg(deadline_s: float) -> List[str]:
    lines: List[str] = []
    end = time.monotonic() + deadline_s
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        while time.monotonic() < end:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:  # EPIPE: the record was overwritten while reading; go on
                if e.errno == 32:
                    continue
                raise
            if not rec:
                break
            if _XID_BYTES in rec:  # only XID records are kept: memory follows them, not the ring buffer
                lines.append(rec.decode("utf-8", "replace").split("\n", 1)[0])
    finally:
        os.close(fd)
    return lines


READ_BACK_SLACK_S = 600.0  # a file is read back this far before the window: lines a little out of order
_BLOCK = 1 << 16  # read back a file in blocks of this size
_MAX_LINE = 1 << 16  # a longer "line" is no kernel line (the kernel's are under 1 KiB): dropped, not kept


def _block_is_older(lines: List[bytes], start: float, boot: Optional[float], now: float, tries: int = 8) -> bool:
    """Whether the first dated line of a block (oldest first) is older than `start`: the lines
    before it then are too.  Only the first `tries` lines are looked at (a log without dates, dmesg
    -t, must not cost a date parse per line); a block without a dated one among them says nothing."""
    for raw in itertools.islice((line for line in lines if line.strip()), tries):
        t, _ = _split_time(raw.decode("utf-8", "replace").strip(), boot, None, now)
        if t is not None:
            return t < start
    return False


def window_lines(f: "BinaryIO", size: int, window_s: float, boot: Optional[float], now: float,
                 block: int = _BLOCK) -> List[str]:
    """The XID lines of a log file that its window can hold, oldest first: read backwards from the
    end in blocks, keeping only lines with the driver's XID text, and stopping at the first block
    whose first dated line is older than the window (less READ_BACK_SLACK_S).  Memory and time
    follow the window, not the file: a 1 GB log whose last hour holds no XID reads a few blocks.
    An undated XID line further back than that is not seen (nor counted as undated)."""
    start = now - window_s - READ_BACK_SLACK_S
    kept: List[bytes] = []  # newest first
    carry = b""  # the start of a line whose end is in the block read before
    pos = size
    while pos > 0:
        n = min(block, pos)
        pos -= n
        f.seek(pos)
        lines = (f.read(n) + carry).split(b"\n")
        carry = lines.pop(0) if pos > 0 else b""  # may continue in the block before
        if len(carry) > _MAX_LINE:
            carry = b""
        kept.extend(line for line in reversed(lines) if _XID_BYTES in line and len(line) <= _MAX_LINE)
        if _block_is_older(lines, start, boot, now):
            break
    return [line.decode("utf-8", "replace").rstrip("\r") for line in reversed(kept)]


def _source_lines(source: str, window_s: int, timeout_s: float, boot_time: Optional[float],
                  now: Optional[float] = None) -> Tuple[Iterable[str], Optional[float], str]:
    """(lines, boot time for uptime stamps, problem).  A source that cannot be read gives a problem text."""
    import subprocess  # only the journal source needs it; kept off the default (kmsg) path
    try:
        if source == "kmsg":
            return _read_kmsg(timeout_s), (_boot_time() if boot_time is None else boot_time), ""
        if source == "journal":
            cp = subprocess.run(["journalctl", "-k", "-q", "--no-pager", "-o", "short-unix", "--since", f"-{int(window_s)}s"],
                                capture_output=True, text=True, timeout=timeout_s)
            if cp.returncode != 0:
                return [], None, f"journalctl -k failed: {cp.stderr.strip()[:200]}"
            return cp.stdout.splitlines(), None, ""  # short-unix: absolute times, no uptime
        path = source[len("file:"):]
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_mode & 0o002:  # S_IWOTH: what is read is what was opened
                return [], None, (f"XID source {source} is writable by every user (mode {st.st_mode & 0o7777:04o}): "
                                  "not read, since anyone could write an XID into it")
            # Uptime stamps in a file are dated with this boot's start: right only for this boot's log.
            boot = _boot_time() if boot_time is None else boot_time
            if not _stat.S_ISREG(st.st_mode):  # a pipe or a device: no end to read back from
                return [line for line in f.read().decode("utf-8", "replace").splitlines() if "NVRM: Xid" in line], boot, ""
            return window_lines(f, st.st_size, window_s, boot, time.time() if now is None else now), boot, ""
    except subprocess.TimeoutExpired:
        return [], None, f"reading XIDs from {source} timed out after {timeout_s:g}s"
    except FileNotFoundError as e:
        return [], None, f"XID source {source} not found: {e.filename or e}"
    except OSError as e:
        return [], None, f"cannot read XID source {source}: {e.strerror or e}"


def read(source: str, window_s: int, timeout_s: float = 5.0, now: Optional[float] = None, *,
         boot_time: Optional[float] = None) -> XidReading:
    """XID events of the last window_s seconds, the read problem, and how many XID lines had no usable date.

    Never raises for an unreadable source.  boot_time overrides the boot time read from
    /proc/uptime (tests; a site replaying a log of this boot).
    """
    now = time.time() if now is None else now
    if source == "none":
        return XidReading([], "", 0)
    lines, boot, problem = _source_lines(source, window_s, timeout_s, boot_time, now)
    if problem:
        return XidReading([], problem, 0)
    events: List[XidEvent] = []
    undated = 0
    for line in lines:
        ev = parse_line(line, boot, now=now)
        if ev is None:
            continue
        if ev.time is None:
            # Cannot be placed in the window: never judged (an undated old XID must not drain a
            # node forever), but counted so that the check can say the log was not fully read.
            undated += 1
        elif ev.time >= now - window_s:
            events.append(ev)
    return XidReading(events, "", undated)
