"""NVIDIA XID events from the kernel log.

Sources (config xid.source): '/dev/kmsg', 'journal' (journalctl -k), 'file:/path' or 'none'.
Only events inside the time window count, and the caller de-duplicates per GPU and XID: an
old XID must never keep a node drained forever (DESIGN.md §5).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+(?:\.[0-9A-Fa-f]+)?)\): (\d+),?\s*(.*)")
_KMSG_RE = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")
_UNIX_RE = re.compile(r"^(\d{9,11}(?:\.\d+)?)\s+(.*)$")
_ISO_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(Z|[+-]\d\d:?\d\d)?\s+(.*)$")
_SYSLOG_RE = re.compile(r"^([A-Z][a-z]{2})\s+(\d{1,2}) (\d\d):(\d\d):(\d\d)\s+(.*)$")
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}


@dataclass(frozen=True)
class XidEvent:
    time: Optional[float]  # unix seconds
    bus: Tuple[int, int, int]  # (domain, bus, device)
    xid: int
    message: str


def bus_key(bus_id: str) -> Tuple[int, int, int]:
    """'00000000:18:00.0' (NVML) and '0000:18:00' (kernel log) -> (0, 0x18, 0)."""
    parts = bus_id.split(".")[0].split(":")
    if len(parts) != 3:
        return (-1, -1, -1)
    try:
        return (int(parts[0], 16), int(parts[1], 16), int(parts[2], 16))
    except ValueError:
        return (-1, -1, -1)


def _boot_time() -> float:
    try:
        with open("/proc/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def _tz_offset(s: Optional[str]) -> int:
    if not s or s == "Z":
        return 0
    sign = -1 if s[0] == "-" else 1
    digits = s[1:].replace(":", "")
    return sign * (int(digits[:2]) * 3600 + int(digits[2:4]) * 60)


def parse_line(line: str, boot_time: float = 0.0, year: Optional[int] = None) -> Optional[XidEvent]:
    """One log line in kmsg, unix-timestamp (journalctl -o short-unix), ISO-8601 or syslog format."""
    line = line.rstrip("\n")
    t: Optional[float] = None
    m = _KMSG_RE.match(line)
    if m:
        t, text = boot_time + int(m.group(1)) / 1e6, m.group(2)
    elif _UNIX_RE.match(line):
        m = _UNIX_RE.match(line)
        t, text = float(m.group(1)), m.group(2)  # type: ignore[union-attr]
    elif _ISO_RE.match(line):
        import calendar
        m = _ISO_RE.match(line)
        t = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) - _tz_offset(m.group(2))  # type: ignore[union-attr]
        text = m.group(3)  # type: ignore[union-attr]
    elif _SYSLOG_RE.match(line):
        m = _SYSLOG_RE.match(line)
        mon, day, hh, mm, ss, text = m.groups()  # type: ignore[union-attr]
        y = year or time.localtime().tm_year
        t = time.mktime((y, _MONTHS.get(mon, 1), int(day), int(hh), int(mm), int(ss), 0, 0, -1))
    else:
        text = line
    x = _XID_RE.search(text)
    if not x:
        return None
    return XidEvent(t, bus_key(x.group(1)), int(x.group(2)), x.group(3).strip())


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
            lines.append(rec.decode("utf-8", "replace").split("\n", 1)[0])
    finally:
        os.close(fd)
    return lines


def read_events(source: str, window_s: int, timeout_s: float = 5.0, now: Optional[float] = None) -> Tuple[List[XidEvent], str]:
    """Return (events in the window, problem).  A source that cannot be read gives a problem text, never an exception."""
    now = time.time() if now is None else now
    if source == "none":
        return [], ""
    import subprocess  # only the journal source needs it; kept off the default (kmsg) path
    try:
        if source == "kmsg":
            boot = _boot_time()
            lines: Iterable[str] = _read_kmsg(timeout_s)
        elif source == "journal":
            boot = 0.0
            cp = subprocess.run(["journalctl", "-k", "-q", "--no-pager", "-o", "short-unix", "--since", f"-{int(window_s)}s"],
                                capture_output=True, text=True, timeout=timeout_s)
            if cp.returncode != 0:
                return [], f"journalctl -k failed: {cp.stderr.strip()[:200]}"
            lines = cp.stdout.splitlines()
        else:
            boot = _boot_time()
            path = source[len("file:"):]
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
    except subprocess.TimeoutExpired:
        return [], f"reading XIDs from {source} timed out after {timeout_s:g}s"
    except FileNotFoundError as e:
        return [], f"XID source {source} not found: {e.filename or e}"
    except OSError as e:
        return [], f"cannot read XID source {source}: {e.strerror or e}"
    events = []
    for line in lines:
        ev = parse_line(line, boot)
        # Lines without a time cannot be placed in the window: ignoring them is the safe side
        # (an undated old XID must not drain a node forever).
        if ev is not None and ev.time is not None and ev.time >= now - window_s:
            events.append(ev)
    return events, ""
