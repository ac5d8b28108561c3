"""The one drain routine of the hooks and healthcheck (apply_drain): the one drain decision
(policy/drain.py) asked, the circuit breaker asked before and counted again after where the caller
wants it, the reason set through Slurm; and a hook's drain with its record (drain_node, drain)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Sequence, Tuple

from slurm_gpu.errors import SlurmGpuError
from slurm_gpu.hooks.observe import seen_drain
from slurm_gpu.hooks.records import write
from slurm_gpu.policy import health
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.store import record as R

if TYPE_CHECKING:
    from slurm_gpu.hooks.deps import HookDeps


KEPT, WOULD_DRAIN, BREAKER, DRAINED, WITHDRAWN = "kept", "would-drain", "breaker", "drained", "withdrawn"


class Attempt:
    """What apply_drain did (a plain class: the prolog imports this module, and a NamedTuple costs
    a quarter of a millisecond to create)."""

    __slots__ = ("outcome", "reason", "whose", "why")

    def __init__(self, outcome: str, reason: str, whose: str, why: str = "") -> None:
        self.outcome = outcome  # KEPT | WOULD_DRAIN | BREAKER (not drained) | DRAINED | WITHDRAWN (drained, then withdrawn)
        self.reason = reason  # the reason set (or that would be), or the one Slurm kept
        self.whose = whose  # the owner of a drain already there: "slurm-gpu", "other", "" (policy/drain.py)
        self.why = why  # the circuit breaker's words (BREAKER, WITHDRAWN)


def apply_drain(backend: Any, info: Any, node: str, reason: str, check: str, *, breaker_cfg: Any = None,
                log: Any = None, now: float = 0.0, dry_run: bool = False, **ids: Any) -> Attempt:
    """Put our `reason` on `node` (as Slurm described it in `info`) for a FAIL of `check`.

    A node already drained or down keeps its reason (KEPT: whoever drained it; policy/drain.py).  With
    `breaker_cfg` the circuit breaker is asked first (BREAKER: not drained) and counts again right
    after the drain (WITHDRAWN: nodes drained before this one filled the share; hooks/breaker.py).
    A SlurmGpuError from the drain itself propagates, carrying `drain_reason` for the caller's record."""
    from slurm_gpu.policy.drain import KEEP, decide_drain
    decision = decide_drain(info, reason)  # the one rule
    if decision.action == KEEP:
        return Attempt(KEPT, decision.reason, decision.whose)
    if dry_run:
        return Attempt(WOULD_DRAIN, decision.reason, decision.whose)
    if breaker_cfg is not None:
        from slurm_gpu.hooks.breaker import ask
        verdict = ask(breaker_cfg, backend, node, check, now, log, fault=decision.reason, **ids)
        if verdict.open:
            return Attempt(BREAKER, decision.reason, decision.whose, verdict.text)
    try:
        backend.drain(node, decision.reason)
    except SlurmGpuError as e:
        e.drain_reason = decision.reason  # type: ignore[attr-defined]
        raise
    if breaker_cfg is not None:
        from slurm_gpu.hooks.breaker import confirm
        second = confirm(breaker_cfg, backend, node, check, decision.reason, log, **ids)
        if second.open:
            return Attempt(WITHDRAWN, decision.reason, decision.whose, second.text)
    return Attempt(DRAINED, decision.reason, decision.whose)


def drain_node(deps: HookDeps, job: JobEnv, source: str, fault: str, check: str = "",
               breaker: bool = False) -> Tuple[bool, R.Drain]:
    """Drain this node with our reason (naming the check).  Returns (the hook may exit 0: the node
    is drained now, or the circuit breaker keeps it in service), the drain record).

    The record says what really happened (docs/hooks.md, drains table): `drained` (ok=1);
    `kept` when the node was already drained and Slurm kept that reason (ok=0, kept_reason);
    `breaker` when the circuit breaker, asked first (breaker=True: the epilog), was open for the
    check (ok=0); `failed` when slurmctld could not be reached; `off` with hooks.drain_on_fault = false."""
    from slurm_gpu.slurm.reason import format_reason
    reason = format_reason(fault, f"{source} job {job.job_id}", check=check)
    drained, outcome, kept = False, "off", None
    if deps.cfg.hooks.drain_on_fault:
        try:
            backend = deps.backend()
            info = backend.node(job.node)
            a = apply_drain(backend, info, job.node, reason, check, breaker_cfg=deps.cfg if breaker else None,
                            log=deps.log, now=deps.now(), job=job.job_id)
            if a.outcome == KEPT:
                # Already drained or down: the first reason stays (policy/drain.py).
                deps.job_log(job).warning("already-drained", reason=reason, existing=info.reason)
                outcome, kept = "kept", info.reason or ""
            elif a.outcome == BREAKER:
                outcome = "breaker"
            else:
                deps.job_log(job).warning("drain", reason=reason)
                outcome = "breaker" if a.outcome == WITHDRAWN else "drained"
            drained = True
        except SlurmGpuError as e:
            deps.job_log(job).error("drain-failed", reason=reason, error=e.message)
            outcome = "failed"
    else:
        deps.job_log(job).warning("fault-no-drain", reason=reason)
    return drained, R.drain(job.node, source, reason, outcome, deps.now(), kept_reason=kept, job_id=job.job_id,
                            cluster=job.cluster, restart_count=job.restart_count)


def drain(deps: HookDeps, job: JobEnv, source: str, fault: str, seen: Any = None, check: str = "",
          breaker: bool = False) -> bool:
    """Drain this node with our reason; record it.  Returns True when the node is drained now (or
    the breaker, asked when breaker=True, keeps it in service).
    seen (the flow's Observed, for its metrics) learns the drain state and the check."""
    drained, d = drain_node(deps, job, source, fault, check, breaker)
    write(deps, R.Drains([d]), job)
    seen_drain(seen, d, check)
    return drained


def gate_suspended(deps: HookDeps, job: JobEnv, results: Sequence[CheckResult]) -> bool:
    """A FAIL of only non-hardware checks while the circuit breaker is open for each of them: the job
    starts and the node stays in service (logged).  A hardware fault of the job's GPUs (policy/breaker.py
    HARDWARE) always gates: a job never starts on a broken GPU."""
    from slurm_gpu.policy.breaker import gate_suspended as may_suspend
    fails = health.failures(results)
    checks = [r.check for r in fails]
    if not deps.cfg.hooks.drain_on_fault or not may_suspend(checks):
        return False
    from slurm_gpu.hooks.breaker import ask_all
    try:
        backend = deps.backend()
    except SlurmGpuError:
        return False
    faults: Dict[str, str] = {}
    for r in fails:  # an xid FAIL per code: the breaker counts the nodes drained for the same codes
        faults[r.check] = f"{faults.get(r.check, '')} {r.message}".strip()
    why = ask_all(deps.cfg, backend, job.node, checks, deps.now(), deps.log, faults=faults, job=job.job_id)
    if why:
        deps.job_log(job).warning("gate-suspended", fault=health.drain_fault(results), message=why)
    return bool(why)
