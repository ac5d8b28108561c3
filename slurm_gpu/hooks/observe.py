"""The metrics side channel of the prolog and epilog: what a flow saw (policy/observed.Observed),
written after the flow when metrics are configured; it never changes a hook's outcome."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, NamedTuple, Optional

from slurm_gpu.config import metrics_enabled
from slurm_gpu.gpu.snapshot import NodeSnapshot
from slurm_gpu.policy.observed import Observed
from slurm_gpu.slurm.gpumap import JobGpuMap
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.store import record as R

if TYPE_CHECKING:
    from slurm_gpu.hooks.deps import HookDeps


class HookExit(enum.IntEnum):
    """What the prolog and epilog exit with (docs/hooks.md): OK, or FAULT: Slurm drains the node
    (after a prolog FAULT it requeues the job).  A drain with our reason exits OK."""

    OK = 0
    FAULT = 1


class FlowResult(NamedTuple):
    """What a flow returns: its exit code and what it saw (for the metrics)."""

    code: HookExit
    seen: Observed


def run_flow(job: JobEnv, deps: HookDeps, hook: str, flow: Callable[[JobEnv, HookDeps, float], FlowResult]) -> HookExit:
    """Run a hook's flow from the time slurmd started the hook (deps.started; else now), then, when
    metrics are configured, write what it saw (never changes the code; without metrics, nothing
    of them is imported).  A job without GPUs has nothing to gate or record: done at once."""
    if not job.gpus:
        deps.job_log(job).info("no-gpus")
        return HookExit.OK
    code, seen = flow(job, deps, deps.started if deps.started is not None else deps.now())
    if metrics_enabled(deps.cfg):
        write_metrics(deps, job, hook, seen)
    return code


def write_metrics(deps: HookDeps, job: JobEnv, hook: str, seen: Observed) -> None:
    """The hook's metrics, last: a few milliseconds, never an exception (metrics/hookwrite.py)."""
    from slurm_gpu.metrics import hookwrite
    t0 = time.monotonic()
    try:
        if hook == "prolog":
            hookwrite.prolog(deps.cfg, deps.log, job, seen, deps.now())
        else:
            hookwrite.epilog(deps.cfg, deps.log, job, seen, deps.now(), store=deps.store)
    except Exception as e:  # a bug in the metrics must not change the hook's outcome
        deps.job_log(job).error("metrics-failed", error=f"{type(e).__name__}: {e}")
    deps.job_log(job).event("metrics", "debug", ms=round((time.monotonic() - t0) * 1000, 2))


def seen_drain(seen: Optional[Observed], d: Optional[R.Drain], check: str) -> None:
    """The node's drain state as the metrics say it: drained by us for this check, already
    drained by us (cause known to an earlier writer), or drained by someone else."""
    if seen is None or d is None:
        return
    from slurm_gpu.slurm.reason import is_ours
    if d.outcome == R.DRAINED:
        seen.drain = ("set", check)
    elif d.outcome == R.KEPT:
        seen.drain = ("ours", check) if is_ours(d.kept_reason) else ("clear", "")


def seen_start(seen: Observed, deps: HookDeps, gmap: JobGpuMap, snap: NodeSnapshot, prepared: Dict[int, Any]) -> None:
    """For the metrics: the GPUs (and slices) the job now holds, and where persistence is on now."""
    seen.held = [(snap.gpu(jg.nvml_index), jg) for jg in gmap.gpus]
    if deps.cfg.hooks.persistence_mode:
        seen.persistence_on = [i for i, out in prepared.items()
                               if isinstance(out, dict) and out.get("nvmlDeviceSetPersistenceMode")]
