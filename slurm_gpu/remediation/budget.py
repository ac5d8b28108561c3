"""What a remediation may cost: the one place that says it (DESIGN.md §2 item 14).

Every caller asks here, with the node database's attempts (store remediations rows: dicts with
time, action, outcome) of the GPU serial or the node: `remediate` before a reset or a reboot,
and before acting on a GPU at all (a lemon goes to RMA).  Pure and standard library only.

- Resets: at most remediation.max_resets_per_gpu_per_day per GPU serial in 24 h (attempts, not
  successes: a reset that keeps failing must not be retried all day).  One more is escalated.
- Reboots: at most remediation.max_reboots_per_node_per_day per node in 24 h; past it the node
  stays drained for a human (a reboot loop helps nobody).
- Lemons: a GPU with remediation.lemon_remedies verified remedies (outcome resumed) or failed
  verification jobs (action verify, outcome failed) within remediation.lemon_window_days that faults
  again is an RMA case, whatever the fault.  So is one whose kernel log shows
  remediation.lemon_xid_bursts separate bursts of hardware XIDs (the catalog's hardware, memory and
  NVLink classes, among xid.critical) in that window: a burst is one or more such XID rows of the
  GPU with less than xid.window_s between them (a flood is one row already, gpu/xid.py).  Application
  and driver/firmware XIDs never count: a driver rollout writes those on every GPU of the fleet.

A step refused as `busy` (a process held the GPU) was never carried out: it costs nothing.  One a
killed run left (`interrupted`) did run: it counts.
"""
from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping, NamedTuple, Tuple

from slurm_gpu.config import Config

DAY_S = 86400.0
# Outcomes that mean the step was really issued (a refusal before acting costs nothing).
ISSUED = ("started", "resumed", "failed", "escalated", "requested", "interrupted")


class Budget(NamedTuple):
    resets_per_gpu_per_day: int
    reboots_per_node_per_day: int
    lemon_window_s: float
    lemon_remedies: int
    lemon_xid_bursts: int = 0  # 0: XID bursts are not counted
    burst_gap_s: float = 3600.0  # xid.window_s: XIDs closer than this are one burst
    burst_codes: Collection[int] = ()  # the hardware XIDs a burst is made of

    @classmethod
    def from_config(cls, cfg: Config) -> "Budget":
        from slurm_gpu.gpu import xidcatalog

        def get(k: str) -> Any:
            return cfg.get("remediation", k)
        ignore = set(cfg.xid.ignore)
        codes = frozenset(int(c) for c in cfg.xid.critical if int(c) not in ignore
                          and xidcatalog.describe(int(c)).kind in HARDWARE_XID_CLASSES)
        return cls(int(get("max_resets_per_gpu_per_day")), int(get("max_reboots_per_node_per_day")),
                   float(get("lemon_window_days")) * DAY_S, int(get("lemon_remedies")),
                   int(get("lemon_xid_bursts")), float(cfg.xid.window_s), codes)


# The XID classes (gpu/xidcatalog.py) that speak of the board itself.
HARDWARE_XID_CLASSES = ("hardware", "memory", "NVLink")


def _count(rows: Iterable[Mapping[str, Any]], action: str, since: float, outcomes: Tuple[str, ...]) -> int:
    return sum(1 for r in rows if r.get("action") == action and float(r.get("time") or 0) >= since
               and r.get("outcome") in outcomes)


def may_reset(b: Budget, serial_rows: Iterable[Mapping[str, Any]], now: float) -> Tuple[bool, str]:
    used = _count(serial_rows, "reset", now - DAY_S, ISSUED)
    if used >= b.resets_per_gpu_per_day:
        return False, f"{used} resets in 24 h (max_resets_per_gpu_per_day {b.resets_per_gpu_per_day})"
    return True, f"reset {used + 1} of {b.resets_per_gpu_per_day} in 24 h"


def may_reboot(b: Budget, node_rows: Iterable[Mapping[str, Any]], now: float) -> Tuple[bool, str]:
    used = _count(node_rows, "reboot", now - DAY_S, ISSUED)
    if used >= b.reboots_per_node_per_day:
        return False, f"{used} reboots in 24 h (max_reboots_per_node_per_day {b.reboots_per_node_per_day})"
    return True, f"reboot {used + 1} of {b.reboots_per_node_per_day} in 24 h"


def is_lemon(b: Budget, serial_rows: Iterable[Mapping[str, Any]], now: float,
             xid_rows: Iterable[Mapping[str, Any]] = ()) -> Tuple[bool, str]:
    """serial_rows: the GPU's remediation attempts; xid_rows: its xid_events rows (xid, time, last_time)."""
    rows = list(serial_rows)
    days = b.lemon_window_s / DAY_S
    cured = _count(rows, "reset", now - b.lemon_window_s, ("resumed",)) + \
        _count(rows, "reboot", now - b.lemon_window_s, ("resumed",)) + \
        _count(rows, "verify", now - b.lemon_window_s, ("failed",))
    if cured >= b.lemon_remedies:
        return True, f"lemon: faulted again after {cured} remedies in {days:g} days (lemon_remedies {b.lemon_remedies})"
    if b.lemon_xid_bursts > 0:
        bursts, codes = xid_bursts(b, xid_rows, now)
        if bursts >= b.lemon_xid_bursts:
            return True, (f"lemon: faulted again after {bursts} bursts of hardware XIDs "
                          f"({', '.join(map(str, codes))}) in {days:g} days (lemon_xid_bursts {b.lemon_xid_bursts})")
    return False, ""


def xid_bursts(b: Budget, xid_rows: Iterable[Mapping[str, Any]], now: float) -> Tuple[int, Tuple[int, ...]]:
    """How many separate bursts of the budget's hardware XIDs the rows hold within the lemon window
    (rows closer than burst_gap_s, first line to the previous row's last, are one burst), and the codes."""
    spans = sorted((float(r["time"]), float(r.get("last_time") or r["time"]), int(r["xid"])) for r in xid_rows
                   if int(r["xid"]) in b.burst_codes and float(r.get("last_time") or r["time"]) >= now - b.lemon_window_s)
    bursts, reach = 0, float("-inf")
    for first, last, _code in spans:
        if first - reach >= b.burst_gap_s:
            bursts += 1
        reach = max(reach, last)
    return bursts, tuple(sorted({c for _f, _l, c in spans}))
