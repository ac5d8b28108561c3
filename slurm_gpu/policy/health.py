"""Health policy: pure functions from a snapshot (+ XID events) and config to check results.

No I/O here.  Every check returns PASS / WARN / FAIL / SKIP per GPU (or node-wide), with a
one-line message and a remedy hint.  A reading that *failed* makes its check FAIL (a broken
diagnostic is never read as healthy); a reading that is *unsupported* makes it SKIP; a reading
that was *not read* (the prolog skips VBIOS, the remap histogram and the InfoROM) gives no result.

The checks live by family in policy/checks/ (memory, thermal, links, versions, processes, xids),
registered in one registry (policy/checks/__init__.py); this module runs them.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set

from slurm_gpu.config import Config
from slurm_gpu.gpu.snapshot import NodeSnapshot
from slurm_gpu.gpu.xid import XidEvent
from slurm_gpu.policy import checks
from slurm_gpu.policy.checks import registry
from slurm_gpu.policy.checks.thermal import CLOCK_EVENT_NAMES  # noqa: F401  (re-exported)
from slurm_gpu.policy.judge import FAIL, PASS, SKIP, WARN, CheckResult, Context, Judge, drain_fault, failures, worst  # noqa: F401  (re-exported)

# The check API callers use: statuses and the judge's results, re-exported from policy.judge.
__all__ = ["CLOCK_EVENT_NAMES", "FAIL", "PASS", "SKIP", "WARN", "CheckResult", "Context", "Judge", "drain_fault",
           "failures", "worst", "evaluate", "judge_stuck_clocks"]

_HEALTH_KEYS = ("expected_gpu_count", "required_driver_version", "max_temperature_c", "max_retired_pages",
                "idle_memory_used_mib", "clock_event_mask", "power_cap_tolerance_pct", "stuck_clocks_busy_pct",
                "stuck_clocks_ratio_pct")


def evaluate(
    snap: NodeSnapshot,
    cfg: Config,
    *,
    gpus: Optional[Sequence[int]] = None,
    idle: "Optional[Iterable[int] | bool]" = None,
    expected_count: Optional[int] = None,
    xid_events: Sequence[XidEvent] = (),
    xid_problem: str = "",
    xid_undated: int = 0,
    now: Optional[float] = None,
    recorded_events: Optional[Sequence[Dict[str, Any]]] = None,
    recorded_problem: str = "",
) -> List[CheckResult]:
    """Judge the node.

    gpus: indices to judge (default: every GPU in the snapshot); node-wide checks always run.
    idle: indices that must be idle (no processes, no memory in use) — e.g. a job's GPUs in the
          prolog — or True for every judged GPU.  Others are not judged for leftovers, since a
          running job legitimately uses them.
    expected_count: physical GPUs Slurm configures on the node: fewer visible is a FAIL, more is
          fine (a GPU Slurm does not schedule).  health.expected_gpu_count, when set, wins and
          must match exactly.
    xid_undated: XID lines in the log that could not be dated (xid.read); said, never judged.
    recorded_events: the node database's recent stuck_clocks events (healthcheck, `check`); None: not read.
    """
    checks.load()
    j = Judge(cfg)
    judged = [g for g in snap.gpus if gpus is None or g.index in set(gpus)]
    idle_set: Set[int] = {g.index for g in judged} if idle is True else set(idle or ())
    ctx = Context(cfg, {k: cfg.get("health", k) for k in _HEALTH_KEYS}, snap, judged, idle_set, expected_count,
                  xid_events, xid_problem, xid_undated, now, recorded_events, recorded_problem)
    for check in registry.NODE_CHECKS["before"]:
        check(j, ctx)
    for g in judged:
        if g.unreachable:
            j.add("responsive", FAIL, g, f"not responding: {g.unreachable}",
                  "the GPU may have fallen off the bus: check dmesg for XID 79/48, reset the GPU or reboot the node")
            continue
        j.add("responsive", PASS, g, "responds")
        for check in registry.GPU_CHECKS:
            check(j, g, ctx)
    for check in registry.NODE_CHECKS["after"]:
        check(j, ctx)
    return j.out


def judge_stuck_clocks(snap: NodeSnapshot, util_pct: Mapping[int, Optional[float]], cfg: Config) -> List[CheckResult]:
    """The epilog's stuck-clock verdicts: each whole GPU in util_pct (index -> the job's mean
    utilisation, None when unknown) judged on the clocks read at the job's end."""
    from slurm_gpu.policy.checks.thermal import stuck_clocks
    j = Judge(cfg)
    hc = {k: cfg.get("health", k) for k in _HEALTH_KEYS}
    for g in snap.gpus:
        if g.index in util_pct and not g.unreachable:
            stuck_clocks(j, g, util_pct[g.index], hc)
    return j.out
