"""The prolog (docs/architecture.md, steps 2-3): gate the job on its GPUs' health, then reset them and
record the job start."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from slurm_gpu.config import node_name
from slurm_gpu.errors import NvmlWriteError
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot
from slurm_gpu.hooks.check import fault_check, log_results, read_and_judge
from slurm_gpu.hooks.deps import HookDeps, map_gpus
from slurm_gpu.hooks.drain import drain, gate_suspended
from slurm_gpu.hooks.observe import FlowResult, HookExit, run_flow, seen_start
from slurm_gpu.hooks.records import housekeeping, record_key, results_events, start_row, write
from slurm_gpu.policy import health
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.policy.observed import Observed
from slurm_gpu.slurm.gpumap import JobGpuMap, MissingGpu
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.store import record as R

PROLOG_OK, PROLOG_FAULT = HookExit.OK, HookExit.FAULT


def prolog(job: JobEnv, deps: HookDeps) -> int:
    """Gate the job on its GPUs' health, then reset them and record the job start."""
    return run_flow(job, deps, "prolog", _prolog)


def _prolog(job: JobEnv, deps: HookDeps, t: float) -> FlowResult:
    # GPU time starts when the prolog does (t): Slurm's allocation (PrologFlags=Alloc) began then,
    # and sreport/sacct count the prolog's run time as the job's.
    log, seen = deps.job_log(job), Observed()
    gmap, snap, results = _job_gpu_snapshot(deps, job, seen)
    log_results(log, results)
    if health.worst(results) == health.FAIL and (gmap is None or not gate_suspended(deps, job, results)):
        drain(deps, job, "prolog", health.drain_fault(results), seen, fault_check(results))
        write(deps, R.Health(results_events(results, job.node, "prolog", job.job_id, t)), job)
        housekeeping(deps, job, "prolog")
        return FlowResult(PROLOG_FAULT, seen)
    assert gmap is not None  # a mapping failure is a FAIL above
    prepared = _prepare(deps, job, gmap, snap)
    starts = []
    for jg in gmap.gpus:
        g = snap.gpu_at(jg.nvml_index)
        uuid = record_key(g, jg)
        outcome = prepared.get(g.index)
        if isinstance(outcome, NvmlWriteError):
            # A GPU that stops answering while we reset it is a fault; other write errors
            # (e.g. no permission) are our environment's problem and must not block the job.
            if deps.reader.is_stuck(g.index):
                drain(deps, job, "prolog", f"{g.label} stopped responding during reset: {outcome.message}", seen,
                      "responsive")
                housekeeping(deps, job, "prolog")
                return FlowResult(PROLOG_FAULT, seen)
            log.error("reset-failed", gpu=uuid, error=outcome.message)
        starts.append(start_row(job, g, jg, uuid, t))
        log.info("pass", gpu=uuid, index=g.index, slurm_index=jg.slurm_index)
    write(deps, R.JobStart(starts), job)
    warn = results_events(results, job.node, "prolog", job.job_id, t)
    if warn:
        write(deps, R.Health(warn), job)
    housekeeping(deps, job, "prolog")
    seen_start(seen, deps, gmap, snap, prepared)
    return FlowResult(PROLOG_OK, seen)


def _job_gpu_snapshot(deps: HookDeps, job: JobEnv, seen: Observed
                      ) -> Tuple[Optional[JobGpuMap], NodeSnapshot, List[CheckResult]]:
    """Map the job's GPUs, read them, and judge them (they must be idle)."""
    try:
        gmap = map_gpus(deps, job)
    except MissingGpu as e:
        results = [CheckResult("gpu_count", health.FAIL, None, "", e.message, e.hint)]
        seen.saw(None, results, ())
        return None, NodeSnapshot(node_name(), deps.now()), results
    now = deps.now()
    snap, results, events = read_and_judge(deps, gmap, now, now)
    seen.saw(snap, results, events)
    return gmap, snap, results


def _prepare(deps: HookDeps, job: JobEnv, gmap: JobGpuMap, snap: NodeSnapshot) -> Dict[int, Any]:
    """Persistence, clock reset and accounting on the job's whole GPUs.

    A GPU the job holds MIG slices of is shared with whoever holds the others: resetting its
    clocks or clearing its accounting would change their job, so only persistence is set.
    A mode the snapshot just read as on is not set again (a driver write that changes nothing)."""
    cfg = deps.cfg
    sliced = set(gmap.instances())
    whole = [i for i in gmap.nvml_indices if i not in sliced]
    in_place = {i: _modes_on(snap.gpu(i)) for i in gmap.nvml_indices}
    out = deps.reader.prepare(whole, persistence=cfg.hooks.persistence_mode,
                              reset_clocks=cfg.hooks.reset_clocks,
                              accounting=cfg.hooks.accounting_mode,
                              power_cap_tolerance_pct=cfg.health.power_cap_tolerance_pct
                              if cfg.hooks.reset_power_limit else None, in_place=in_place) if whole else {}
    if sliced:
        deps.job_log(job).info("mig-gpu-shared", gpus=",".join(map(str, sorted(sliced))),
                               note="clocks and accounting of a GPU with MIG slices are left alone")
        if cfg.hooks.persistence_mode:
            out.update(deps.reader.prepare(sorted(sliced), persistence=True, in_place=in_place))
    return out


def _modes_on(g: Optional[GpuSnapshot]) -> Tuple[str, ...]:
    """The set-operations whose mode this reading of the GPU shows on already."""
    if g is None:
        return ()
    on = [op for op, r in (("nvmlDeviceSetPersistenceMode", g.persistence_mode),
                           ("nvmlDeviceSetAccountingMode", g.accounting_mode)) if r.ok and r.value is True]
    return tuple(on)
