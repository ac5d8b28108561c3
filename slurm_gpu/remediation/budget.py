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
  again is an RMA case, whatever the fault.

A step refused as `busy` (a process held the GPU) was never carried out: it costs nothing.  One a
killed run left (`interrupted`) did run: it counts.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Tuple

from slurm_gpu.config import Config

DAY_S = 86400.0
# Outcomes that mean the step was really issued (a refusal before acting costs nothing).
ISSUED = ("started", "resumed", "failed", "escalated", "requested", "interrupted")


class Budget(NamedTuple):
    resets_per_gpu_per_day: int
    reboots_per_node_per_day: int
    lemon_window_s: float
    lemon_remedies: int

    @classmethod
    def from_config(cls, cfg: Config) -> "Budget":
        def get(k: str) -> Any:
            return cfg.get("remediation", k)
        return cls(int(get("max_resets_per_gpu_per_day")), int(get("max_reboots_per_node_per_day")),
                   float(get("lemon_window_days")) * DAY_S, int(get("lemon_remedies")))


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


def is_lemon(b: Budget, serial_rows: Iterable[Mapping[str, Any]], now: float) -> Tuple[bool, str]:
    rows = list(serial_rows)
    cured = _count(rows, "reset", now - b.lemon_window_s, ("resumed",)) + \
        _count(rows, "reboot", now - b.lemon_window_s, ("resumed",)) + \
        _count(rows, "verify", now - b.lemon_window_s, ("failed",))
    if cured >= b.lemon_remedies:
        days = b.lemon_window_s / DAY_S
        return True, f"lemon: faulted again after {cured} remedies in {days:g} days (lemon_remedies {b.lemon_remedies})"
    return False, ""
