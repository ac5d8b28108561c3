"""A hook's drain: the one drain decision (policy/drain.py) asked, the circuit breaker where the hook
asks it, and the drain's record."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence, Tuple

from slurm_gpu.errors import SlurmGpuError
from slurm_gpu.hooks.observe import seen_drain
from slurm_gpu.hooks.records import write
from slurm_gpu.policy import health
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.store import record as R

if TYPE_CHECKING:
    from slurm_gpu.hooks.deps import HookDeps


def drain_node(deps: HookDeps, job: JobEnv, source: str, fault: str, check: str = "",
               breaker: bool = False) -> Tuple[bool, R.Drain]:
    """Drain this node with our reason (naming the check).  Returns (the hook may exit 0: the node
    is drained now, or the circuit breaker keeps it in service), the drain record).

    The record says what really happened (docs/hooks.md, drains table): `drained` (ok=1);
    `kept` when the node was already drained and Slurm kept that reason (ok=0, kept_reason);
    `breaker` when the circuit breaker, asked first (breaker=True: the epilog), was open for the
    check (ok=0); `failed` when slurmctld could not be reached; `off` with hooks.drain_on_fault = false."""
    from slurm_gpu.policy.drain import KEEP, decide_drain
    from slurm_gpu.slurm.reason import format_reason
    reason = format_reason(fault, f"{source} job {job.job_id}", check=check)
    drained, outcome, kept = False, "off", None
    if deps.cfg.get("hooks", "drain_on_fault"):
        try:
            backend = deps.backend()
            info = backend.node(job.node)
            decision = decide_drain(info, reason)  # policy/drain.py: the one rule
            if decision.action == KEEP:
                # Already drained or down: the first reason stays (policy/drain.py).
                deps.job_log(job).warning("already-drained", reason=reason, existing=info.reason)
                outcome, kept = "kept", info.reason or ""
            elif breaker and _breaker_open(deps, job, check):
                outcome = "breaker"
            else:
                backend.drain(job.node, decision.reason)
                deps.job_log(job).warning("drain", reason=reason)
                outcome = "breaker" if breaker and _withdrawn(deps, job, check, decision.reason) else "drained"
            drained = True
        except SlurmGpuError as e:
            deps.job_log(job).error("drain-failed", reason=reason, error=e.message)
            outcome = "failed"
    else:
        deps.job_log(job).warning("fault-no-drain", reason=reason)
    return drained, R.drain(job.node, source, reason, outcome, deps.now(), kept_reason=kept, job_id=job.job_id,
                            cluster=job.cluster, restart_count=job.restart_count)


def _breaker_open(deps: HookDeps, job: JobEnv, check: str) -> bool:
    """Ask the circuit breaker (hooks/breaker.py) before a drain for `check`; True: do not drain."""
    from slurm_gpu.hooks.breaker import ask
    return ask(deps.cfg, deps.backend(), job.node, check, deps.now(), deps.log, job=job.job_id).open


def _withdrawn(deps: HookDeps, job: JobEnv, check: str, reason: str) -> bool:
    """The breaker's second count after this drain (nodes deciding at the same moment); True: the
    drain was withdrawn, nodes drained before this one filling the share."""
    from slurm_gpu.hooks.breaker import confirm
    return confirm(deps.cfg, deps.backend(), job.node, check, reason, deps.log, job=job.job_id).open


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
    checks = [r.check for r in health.failures(results)]
    if not deps.cfg.get("hooks", "drain_on_fault") or not may_suspend(checks):
        return False
    from slurm_gpu.hooks.breaker import ask_all
    try:
        backend = deps.backend()
    except SlurmGpuError:
        return False
    why = ask_all(deps.cfg, backend, job.node, checks, deps.now(), deps.log, job=job.job_id)
    if why:
        deps.job_log(job).warning("gate-suspended", fault=health.drain_fault(results), message=why)
    return bool(why)
