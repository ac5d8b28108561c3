"""The epilog (docs/architecture.md, step 4): the job's own leftover processes go, its GPUs are read and
judged again, and what the job did with them is recorded, one usage row per GPU or MIG slice."""
from __future__ import annotations

from typing import Any, Dict, List

from slurm_gpu.errors import NvmlWriteError
from slurm_gpu.gpu.snapshot import NodeSnapshot
from slurm_gpu.hooks.check import fault_check, log_results, read_and_judge
from slurm_gpu.hooks.deps import HookDeps, map_gpus
from slurm_gpu.hooks.drain import drain, drain_node
from slurm_gpu.hooks.observe import FlowResult, HookExit, run_flow, seen_drain
from slurm_gpu.hooks.procs import kill_leftovers
from slurm_gpu.hooks.records import housekeeping, record_usage, results_events, usage_rows, write
from slurm_gpu.policy import health
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.policy.observed import Observed
from slurm_gpu.slurm.gpumap import JobGpuMap, MissingGpu
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.store import record as R


def epilog(job: JobEnv, deps: HookDeps) -> int:
    """Record what the job did with its GPUs, clean up, and check the GPUs again."""
    return run_flow(job, deps, "epilog", _epilog)


def _epilog(job: JobEnv, deps: HookDeps, end: float) -> FlowResult:
    # The job ended when the epilog started (end): what the epilog spends is not the job's GPU time.
    log, seen = deps.job_log(job), Observed()
    try:
        gmap = map_gpus(deps, job)  # which GPUs (and MIG slices) are the job's
    except MissingGpu as e:
        log.error("check", check="gpu_count", status=health.FAIL, message=e.message)
        seen.saw(None, [CheckResult("gpu_count", health.FAIL, None, "", e.message, e.hint)], ())
        drained = drain(deps, job, "epilog", e.message, seen, "gpu_count", breaker=True)
        return FlowResult(HookExit.OK if drained else HookExit.FAULT, seen)
    # The job's own processes go; everyone else's stay and are judged.
    survivors, killed = kill_leftovers(deps, job, gmap)
    acct = _read_accounting(deps, job, gmap)
    snap, results, events = read_and_judge(deps, gmap, deps.now(), end, killed)
    seen.saw(snap, results, events)  # from here on the results are seen's: what the metrics say
    _reset_after(deps, job, gmap, snap)
    # Judge and drain before anything is stored: a GPU fault reaches Slurm whatever the storage does.
    fault = _epilog_fault(seen, survivors, snap)
    log_results(log, seen)
    check = "leftover_processes" if survivors else fault_check(seen)
    drained, drain_record = drain_node(deps, job, "epilog", fault, check, breaker=True) if fault else (True, None)
    seen_drain(seen, drain_record, check)
    rows = usage_rows(deps, job, gmap, snap, events, acct, end)
    seen.extend(_stuck_clocks(deps, job, snap, rows))  # a health event, never a drain
    record_usage(deps, job, rows, results_events(seen, job.node, "epilog", job.job_id, end), end)
    if drain_record is not None:
        write(deps, R.Drains([drain_record]), job)
    # Housekeeping last, bounded: a spool backlog never delays the drain or this job's record.
    housekeeping(deps, job, "epilog")
    return FlowResult(epilog_exit(job, bool(fault), drained), seen)


def epilog_exit(job: JobEnv, fault: bool, drained: bool) -> HookExit:
    """The epilog's exit code, what Slurm acts on.

    - A drain that did not reach slurmctld: FAULT, so that Slurm drains the node ("Epilog error").
    - A GPU fault drained with our reason: from 25.11 (Slurm gives the epilog SLURM_JOB_SLUID) FAULT.
      A failed epilog is what lets a job submitted with --requeue=expedite that exited non-zero run again
      at once, elsewhere, at the top of the queue; with every epilog passing Slurm holds it instead
      (REQUEUE_HOLD, "no epilogs failed").  Slurm keeps the drain reason already set (observed on 26.05).
      Before 25.11 OK: 22.05 replaced our reason with "Epilog error".
    - Healthy: OK.  An internal error of ours never reaches here (run_flow: fail_open, default exit 0),
      so a bug of ours requeues nothing."""
    if not drained:
        return HookExit.FAULT
    return HookExit.FAULT if fault and job.sluid else HookExit.OK


def _read_accounting(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Dict[int, Any]:
    """The driver's per-process accounting of the job's whole GPUs (MIG slices have none per instance)."""
    whole = [i for i in gmap.nvml_indices if i not in gmap.instances()]
    acct = deps.reader.accounting_many(whole) if whole else {}
    for i, a in list(acct.items()):
        if isinstance(a, NvmlWriteError):
            deps.job_log(job).error("accounting-read-failed", index=i, error=a.message)
            acct[i] = None
    return acct


def _reset_after(deps: HookDeps, job: JobEnv, gmap: JobGpuMap, snap: NodeSnapshot) -> None:
    if not deps.cfg.hooks.reset_clocks:
        return
    sliced = gmap.instances()
    whole = [g.index for g in snap.gpus if not g.unreachable and g.index not in sliced]
    if not whole:
        return
    log = deps.job_log(job)
    for i, outcome in deps.reader.prepare(whole, reset_clocks=True).items():
        g = snap.gpu_at(i)
        if isinstance(outcome, NvmlWriteError):
            log.error("reset-failed", gpu=g.uuid_or_index, error=outcome.message)
        else:
            log.info("reset", gpu=g.uuid_or_index)


def _epilog_fault(results: List[CheckResult], survivors: Dict[int, List[int]], snap: NodeSnapshot) -> str:
    """The drain fault of the epilog ('' when healthy); a SIGKILL survivor comes first."""
    if survivors:
        g_idx = sorted(survivors)[0]
        g = snap.gpu(g_idx)
        label = g.label if g else f"GPU {g_idx}"
        pids = ",".join(str(p) for ps in survivors.values() for p in ps)
        fault = f"{label} processes survived SIGKILL after the job: pid {pids}"
        results.append(CheckResult("leftover_processes", health.FAIL, g_idx, g.uuid.get("") if g else "", fault,
                                   "processes stuck in the driver (D state) need a GPU reset or reboot"))
        return fault
    return health.drain_fault(results) if health.worst(results) == health.FAIL else ""


def _stuck_clocks(deps: HookDeps, job: JobEnv, snap: NodeSnapshot, rows: List[R.GpuUsage]) -> List[CheckResult]:
    """The job's whole GPUs judged for clocks stuck low on the job's utilisation; only WARN/FAIL
    are kept (the metrics' steady stuck_clocks status is healthcheck's, from these events)."""
    util = {r.gpu_index: r.gpu_util_mean_pct for r in rows if r.parent_gpu_uuid is None}
    found = [r for r in health.judge_stuck_clocks(snap, util, deps.cfg) if r.status in (health.WARN, health.FAIL)]
    log_results(deps.job_log(job), found)
    return found
