"""NVIDIA XID events from the kernel log.

Sources (config xid.source): 'kmsg' (/dev/kmsg), 'journal' (journalctl -k), 'file:/path' or 'none'.
Only events inside the time window count, and the caller de-duplicates per GPU and XID: an
old XID must never keep a node drained forever.

Floods are counted, not stored (issue 39): the lines of one window that are the same XID of the
same GPU (PCI bus and MIG GPU instance, code, and message text exactly as the driver wrote it) are
one XidEvent with their number (`line_count`), the first line's time (`time`) and the last one's
(`last_time`).  Lines are aggregated as they are read, from every source, so memory follows the
distinct events, never the lines: 800,000 lines of one XID 95 are one event of line_count 800,000.
The message is compared as written, numbers included: two lines that differ in an address, a pid
or a register are two events (XID 154 carries the recovery action and XID 13/31/74 the unit or
address in it; merging them would lose what the catalog reads).  At most MAX_MESSAGES distinct
messages are kept per GPU and code; the lines of further ones are counted in one more event of that
GPU and code (OTHER_MESSAGES).  Events come in the log's order of their first lines, as lines did.

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
from collections import Counter
from typing import IO, Any, BinaryIO, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

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
_XID_TEXT = "NVRM: Xid"  # what every XID line holds: other lines are dropped unread
_XID_BYTES = _XID_TEXT.encode()
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
    time: Optional[float]  # unix seconds of the first line in the window; None: the line carries no usable date
    bus: Tuple[int, int, int]  # (domain, bus, device)
    xid: int
    message: str
    gpu_instance: Optional[int] = None  # MIG GPU instance id (GPU-I:) the driver attributed it to
    line_count: int = 1  # identical lines in the window (a flood is one event)
    last_time: Optional[float] = None  # unix seconds of the last of them; None: `time` (one line)
    # (first, last, line count) of the lines in each slice of the window (WINDOW_SLICES of them) that holds
    # any: how many came after a given time (lines_after).  Empty: one run, (time, last, line_count).
    runs: Tuple[Tuple[float, float, int], ...] = ()

    @property
    def last(self) -> Optional[float]:
        """The last line's time (the first's for one line)."""
        return self.time if self.last_time is None else self.last_time


class XidReading(NamedTuple):
    events: List[XidEvent]  # dated events inside the window, in the log's order of their first lines
    problem: str  # why the source could not be read; "" when it was
    undated: int  # XID lines without a usable date: counted, never judged


def lines_after(e: XidEvent, t: float) -> int:
    """How many of the event's lines are dated after t: exact, except within the one slice of the
    window that holds t, whose lines are taken as evenly spread between its first and last."""
    if e.time is None:
        return 0
    return runs_after(e.runs or ((e.time, e.time if e.last_time is None else e.last_time, e.line_count),), t)


def runs_after(runs: "Iterable[Tuple[float, float, int]]", t: float) -> int:
    """lines_after on an event's runs (XidEvent.runs): (first, last, line count) each."""
    n = 0.0
    for first, last, count in runs:
        if first > t:
            n += count
        elif last > t:  # first <= t < last
            n += count * (last - t) / (last - first)
    return int(round(n))


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


def _date_and_tag(head: str, boot: Optional[float], year: Optional[int], now: float) -> Tuple[Optional[float], bool]:
    """(the date of a line, whether it is the kernel's) from the line's text before "NVRM: Xid".  The
    date prefix and a syslog header ("host tag[pid]: ") both end before it: a header's tag cannot
    hold a ":", so the header is read on the head followed by the XID text's first word, as on the
    whole line.  Read once per distinct head (a flood's lines share theirs within a second)."""
    t, kernel = _raw_date_and_tag(head, boot, year, now)
    return _not_future(t, now), kernel


def _raw_date_and_tag(head: str, boot: Optional[float], year: Optional[int], now: float) -> Tuple[Optional[float], bool]:
    """_date_and_tag before the future rule."""
    t, text = _split_time((head + _XID_TEXT).strip(), boot, year, now)
    header = re.match(_SYSLOG_HEADER, text)
    return t, not (header and header.group(1) != "kernel")


# A date to the sub-second that only its fraction tells from the line before (rsyslog high precision,
# journalctl short-iso-precise and short-precise: ISO 8601 and syslog dates, whose converters add the
# fraction to the whole second; journalctl short-unix): a flood's heads are all different, their whole
# seconds are not.  Anchored: the first date form that matches such a head is the one that reads it.
_FRACTION = (r"^(?:(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d)[.,]|(?P<syslog>[A-Z][a-z]{2}\s+\d{1,2} \d\d:\d\d:\d\d)\.)"
             r"(?P<fraction>\d+)|^(?P<unix>\d{9,11}\.\d+)\s+(?P<rest>.*)$")


_Fields = Tuple[Tuple[int, int, int], Optional[int], int, str]  # (bus, GPU instance, XID, message)


def _xid_fields(tail: str) -> Optional[_Fields]:
    """(bus, GPU instance, XID, message) of a line's text from "NVRM: Xid" on; None when it is not one."""
    x = re.search(_XID, tail)
    if not x:
        return None
    gi = re.search(_GPU_INSTANCE, x.group("attrs"))
    return bus_key(x.group("bus")), int(gi.group(1)) if gi else None, int(x.group("xid")), x.group("msg").strip()


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
    at = line.find(_XID_TEXT)
    if at < 0:  # most kernel lines: skip the date parsing
        return None
    now = time.time() if now is None else now
    t, kernel = _date_and_tag(line[:at], boot_time, year, now)
    if not kernel:
        return None  # a program's line in a syslog file, not the kernel's (a forged XID drains no node)
    fields = _xid_fields(line[at:])
    if fields is None:
        return None
    bus, gi, code, message = fields
    return XidEvent(t, bus, code, message, gi)


# Distinct messages kept per GPU (bus, GPU instance) and XID code; the lines of any further one are
# counted in one event of that GPU and code with this message.  A log whose every line names another
# address must not make memory follow its lines; 64 is twice what floods in the field showed (29
# distinct events among 800,000 lines of XID 95, NVSentinel #1120).
MAX_MESSAGES = 64
OTHER_MESSAGES = f"(lines with other messages: slurm-gpu keeps {MAX_MESSAGES} distinct messages per GPU and XID)"
WINDOW_SLICES = 64  # a flood's lines are counted per slice of the window too (XidEvent.runs, lines_after)
_CACHE = 4096  # heads and tails of lines parsed, kept per read (then started again)
_MISSING = object()


class _Window:
    """The XID events of one read, aggregated as lines come (module docstring): an entry per
    distinct event, however many lines repeat it.  add() takes a line; events() gives the result."""

    def __init__(self, now: float, window_s: float, boot: Optional[float] = None):
        self.now, self.window_s, self.start, self.boot = now, window_s, now - window_s, boot
        self.slice_s = max(1.0, window_s / WINDOW_SLICES)
        self.undated = 0
        self.step = 1  # +1 reading forward, -1 reading a file back from its end: a line's place in the log
        self._pos = 0
        self._found: Dict[_Fields, List[Any]] = {}  # [first, last, count, place in the log, {slice: [first, last, count]}]
        self._messages: Dict[Tuple[Any, ...], int] = {}  # distinct messages per (bus, GPU instance, XID)
        self._heads: Dict[str, Tuple[Optional[float], bool]] = {}
        self._wholes: Dict[str, Tuple[Optional[float], bool]] = {}  # _sub_second's, by whole second
        self._fraction: "Optional[re.Pattern[str]]" = None  # compiled at the first XID line (module docstring)
        self._tails: Dict[str, Any] = {}

    def add(self, line: str, n: int = 1) -> None:
        """Count a line (n times: n identical lines)."""
        at = line.find(_XID_TEXT)
        if at < 0:
            return
        self._pos += self.step
        head, tail = line[:at], line[at:]
        dated = self._heads.get(head)
        if dated is None:
            dated = self._sub_second(head)
            if dated is None:
                if len(self._heads) >= _CACHE:
                    self._heads.clear()
                dated = self._heads[head] = _date_and_tag(head, self.boot, None, self.now)
        t, kernel = dated
        if not kernel:
            return  # a program's line, not the kernel's (parse_line)
        fields = self._tails.get(tail, _MISSING)
        if fields is _MISSING:
            if len(self._tails) >= _CACHE:
                self._tails.clear()
            fields = self._tails[tail] = _xid_fields(tail)
        if fields is None:
            return
        if t is None:
            # Cannot be placed in the window: never judged (an undated old XID must not drain a
            # node forever), but counted so that the check can say the log was not fully read.
            self.undated += n
            return
        if t < self.start:
            return
        self._count(fields, t, n)

    def _sub_second(self, head: str) -> Optional[Tuple[Optional[float], bool]]:
        """_date_and_tag of a head dated to the sub-second (_FRACTION), read once per whole second and
        header; None for any other head."""
        head = head.lstrip()
        if self._fraction is None:
            self._fraction = re.compile(_FRACTION)
        m = self._fraction.match(head)
        if m is None:
            return None
        iso, syslog, fraction, unix, rest = m.groups()
        key = "unix\0" + rest if unix else (iso or syslog) + head[m.end():]
        whole = self._wholes.get(key)
        if whole is None:
            if len(self._wholes) >= _CACHE:
                self._wholes.clear()
            if unix:  # _from_unix: the number is the date; the header is read once
                header = re.match(_SYSLOG_HEADER, rest + _XID_TEXT)
                whole = self._wholes[key] = (0.0, not (header and header.group(1) != "kernel"))
            else:
                whole = self._wholes[key] = _raw_date_and_tag(key, self.boot, None, self.now)
        t, kernel = whole
        if t is not None:
            t = float(unix) if unix else t + timefmt.fraction(fraction)
        return _not_future(t, self.now), kernel

    def _count(self, fields: _Fields, t: float, n: int) -> None:
        ev = self._found.get(fields)
        if ev is None:
            gpu_code = fields[:3]
            kept = self._messages.get(gpu_code, 0)
            if kept >= MAX_MESSAGES:
                fields = (fields[0], fields[1], fields[2], OTHER_MESSAGES)
                ev = self._found.get(fields)
            else:
                self._messages[gpu_code] = kept + 1
            if ev is None:
                self._found[fields] = [t, t, n, self._pos, {int(t // self.slice_s): [t, t, n]}]
                return
        ev[2] += n
        if self._pos < ev[3]:
            ev[3] = self._pos
        if t < ev[0]:
            ev[0] = t
        if t > ev[1]:
            ev[1] = t
        run = ev[4].get(int(t // self.slice_s))
        if run is None:
            ev[4][int(t // self.slice_s)] = [t, t, n]
        else:
            run[2] += n
            if t < run[0]:
                run[0] = t
            if t > run[1]:
                run[1] = t

    def events(self) -> List[XidEvent]:
        out = sorted(self._found.items(), key=lambda kv: kv[1][3])  # the log's order, as its first lines
        return [XidEvent(first, bus, code, message, gi, count, last,
                         tuple((r[0], r[1], r[2]) for _, r in sorted(runs.items())))
                for (bus, gi, code, message), (first, last, count, _, runs) in out]


def _kmsg_lines(deadline_s: float) -> Iterator[str]:
    """The XID records of /dev/kmsg, one at a time (a record is read whole or not at all)."""
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
            if _XID_BYTES in rec:  # only XID records are parsed; none is kept
                yield rec.decode("utf-8", "replace").split("\n", 1)[0]
    finally:
        os.close(fd)


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


def _blocks_back(f: "BinaryIO", size: int, window_s: float, boot: Optional[float], now: float,
                 block: int = _BLOCK) -> Iterator[List[bytes]]:
    """The lines of a log file that its window can hold, a block at a time (newest block first, its
    lines oldest first): read backwards from the end, stopping after the first block whose first
    dated line is older than the window (less READ_BACK_SLACK_S).  Memory and time follow the
    window, not the file: a 1 GB log whose last hour holds no XID reads a few blocks, and a block is
    all that is held of one whose last hour is a flood."""
    start = now - window_s - READ_BACK_SLACK_S
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
        yield lines
        if _block_is_older(lines, start, boot, now):
            break


def _xid_lines(lines: List[bytes]) -> Iterator[bytes]:
    """A block's lines with the driver's XID text, newest first."""
    return (line for line in reversed(lines) if _XID_BYTES in line and len(line) <= _MAX_LINE)


def window_lines(f: "BinaryIO", size: int, window_s: float, boot: Optional[float], now: float,
                 block: int = _BLOCK) -> Iterator[str]:
    """The XID lines of a log file that its window can hold (_blocks_back), newest first, one at a
    time.  An undated XID line further back than the window's blocks is not seen (nor counted as
    undated)."""
    for lines in _blocks_back(f, size, window_s, boot, now, block):
        for line in _xid_lines(lines):
            yield line.decode("utf-8", "replace").rstrip("\r")


def _stream_lines(f: "IO[bytes]") -> Iterator[str]:
    """The XID lines of a stream read forward (a pipe, journalctl's output), one at a time; a line
    longer than _MAX_LINE is dropped, not kept."""
    too_long = False
    while True:
        raw = f.readline(_MAX_LINE + 1)
        if not raw:
            return
        if too_long or (len(raw) > _MAX_LINE and not raw.endswith(b"\n")):
            too_long = not raw.endswith(b"\n")  # skip to the end of the long line
            continue
        if _XID_BYTES in raw:
            yield raw.decode("utf-8", "replace").rstrip("\r\n")


def _journal(found: _Window, timeout_s: float) -> str:
    """Feed `journalctl -k` of the window to `found` as it prints (short-unix: absolute times, no
    uptime); "" or the problem.  Killed after timeout_s."""
    import subprocess  # only the journal source needs these; kept off the default (kmsg) path
    import tempfile
    import threading
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(["journalctl", "-k", "-q", "--no-pager", "-o", "short-unix",
                              "--since", f"-{int(found.window_s)}s"], stdout=subprocess.PIPE, stderr=err)
        killed: List[bool] = []

        def kill() -> None:
            killed.append(True)
            p.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            assert p.stdout is not None  # stdout=PIPE
            with p.stdout:
                for line in _stream_lines(p.stdout):
                    found.add(line)
            rc = p.wait()
        finally:
            timer.cancel()
            if p.poll() is None:
                p.kill()
                p.wait()
        if killed:
            return f"reading XIDs from journal timed out after {timeout_s:g}s"
        if rc != 0:
            err.seek(0)
            return f"journalctl -k failed: {err.read(4096).decode('utf-8', 'replace').strip()[:200]}"
    return ""


def _feed(source: str, found: _Window, timeout_s: float, boot_time: Optional[float]) -> str:
    """Read the source's lines into `found`: "" or why the source could not be read."""
    try:
        if source == "kmsg":
            found.boot = _boot_time() if boot_time is None else boot_time
            for line in _kmsg_lines(timeout_s):
                found.add(line)
            return ""
        if source == "journal":
            return _journal(found, timeout_s)
        path = source[len("file:"):]
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_mode & 0o002:  # S_IWOTH: what is read is what was opened
                return (f"XID source {source} is writable by every user (mode {st.st_mode & 0o7777:04o}): "
                        "not read, since anyone could write an XID into it")
            # Uptime stamps in a file are dated with this boot's start: right only for this boot's log.
            found.boot = _boot_time() if boot_time is None else boot_time
            if not _stat.S_ISREG(st.st_mode):  # a pipe or a device: no end to read back from
                lines = _stream_lines(f)
                for line in lines:
                    found.add(line)
                return ""
            found.step = -1  # newest first
            for block in _blocks_back(f, st.st_size, found.window_s, found.boot, found.now):
                # A flood's lines repeat byte for byte within a second (syslog dates): each distinct
                # line of a block is parsed and counted once, with its number; newest first, each at
                # the place of its first copy in the block.
                same = Counter(line for line in block if _XID_BYTES in line and len(line) <= _MAX_LINE)
                for raw, n in reversed(same.items()):
                    found.add(raw.decode("utf-8", "replace").rstrip("\r"), n)
            return ""
    except FileNotFoundError as e:
        return f"XID source {source} not found: {e.filename or e}"
    except OSError as e:
        return f"cannot read XID source {source}: {e.strerror or e}"


def read(source: str, window_s: int, timeout_s: float = 5.0, now: Optional[float] = None, *,
         boot_time: Optional[float] = None) -> XidReading:
    """XID events of the last window_s seconds (identical lines aggregated: module docstring), the
    read problem, and how many XID lines had no usable date.

    Never raises for an unreadable source.  boot_time overrides the boot time read from
    /proc/uptime (tests; a site replaying a log of this boot).
    """
    now = time.time() if now is None else now
    if source == "none":
        return XidReading([], "", 0)
    found = _Window(now, window_s)
    problem = _feed(source, found, timeout_s, boot_time)
    if problem:
        return XidReading([], problem, 0)
    return XidReading(found.events(), "", found.undated)
