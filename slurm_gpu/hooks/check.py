"""Reading and judging GPUs: `slurm-gpu check`, healthcheck's checker, and the prolog's and epilog's
gate on the job's own GPUs."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

from slurm_gpu.config import Config, node_name
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu import xid
from slurm_gpu.gpu.snapshot import NodeSnapshot
from slurm_gpu.policy import health
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.policy.observed import Observed
from slurm_gpu.slurm.gpumap import JobGpuMap, scope_to_instances, scope_xids

if TYPE_CHECKING:  # types only: the hook path imports pynvml when it first reads a GPU
    from slurm_gpu.gpu.nvml import NvmlReader
    from slurm_gpu.hooks.deps import GpuReader, HookDeps


def make_reader(cfg: Config, library: Optional[str] = None) -> "NvmlReader":
    from slurm_gpu.gpu.nvml import NvmlReader
    return NvmlReader(library=library if library is not None else cfg.nvml_library,
                      timeout_s=cfg.nvml_timeout_s, version_file=cfg.nvidia_version_file)


def read_xids(cfg: Config, now: Optional[float] = None) -> xid.XidReading:
    source = cfg.xid.source.replace("%n", getattr(cfg, "node", None) or node_name())
    return xid.read(source, cfg.xid.window_s, timeout_s=cfg.nvml_timeout_s, now=now)


def check_node(
    cfg: Config,
    indices: Optional[Sequence[int]] = None,
    *,
    idle: "Optional[Iterable[int] | bool]" = None,
    expected_count: Optional[int] = None,
    reader: Optional[GpuReader] = None,
    snapshot: Optional[NodeSnapshot] = None,
    now: Optional[float] = None,
) -> Tuple[NodeSnapshot, Observed]:
    """Read (or take) a snapshot, read XIDs, and judge: (the snapshot, the results with what they were
    judged on).  Raises NvmlUnavailable when there is no driver."""
    now = time.time() if now is None else now
    if snapshot is None:
        reader = reader or make_reader(cfg)
        snapshot = reader.snapshot(indices, inventory=True)  # not the prolog's read: VBIOS, remap histogram too
        events, problem, undated = read_xids(cfg, now)
        recorded, recorded_problem = recorded_stuck_clocks(cfg, now)
    else:
        events, problem, undated = [], "", 0  # offline evaluation of a saved snapshot: no live kernel log
        recorded, recorded_problem = None, ""
    results = health.evaluate(snapshot, cfg, gpus=indices, idle=idle, expected_count=expected_count,
                              xid_events=events, xid_problem=problem, xid_undated=undated, now=now,
                              recorded_events=recorded, recorded_problem=recorded_problem)
    return snapshot, Observed(results, snapshot, events, all_gpus=indices is None)


def recorded_stuck_clocks(cfg: Config, now: float) -> Tuple[Optional[List[Dict[str, Any]]], str]:
    """(the stuck_clocks events epilogs recorded within health.stuck_clocks_recent_s, problem):
    read-only and quick; a database that cannot be read is a problem said, never a crash."""
    if not health.Judge(cfg).enabled("stuck_clocks"):
        return None, ""
    from slurm_gpu.store.diagnose import describe_error, recent_health_events
    since = now - float(cfg.health.stuck_clocks_recent_s)
    try:
        return recent_health_events(cfg.path_value("store", "database"), "stuck_clocks", since), ""
    except Exception as e:  # a locked, corrupt or foreign file: the other checks still run
        return [], describe_error(e)


def mismatch_metric(cfg: Config, log: Any, hook: str, e: Exception) -> None:
    """A driver/library mismatch as a metric (never raises: metrics never change a hook's outcome)."""
    from slurm_gpu.errors import DriverLibraryMismatch
    if not isinstance(e, DriverLibraryMismatch):
        return
    from slurm_gpu.config import metrics_enabled
    if metrics_enabled(cfg):
        from slurm_gpu.metrics import hookwrite
        hookwrite.mismatch(cfg, log, hook, node_name(), e.kernel_version, e.library_version, time.time())


def without_pids(snap: NodeSnapshot, pids: Iterable[int]) -> NodeSnapshot:
    drop = set(pids)
    if not drop:
        return snap
    gpus = tuple(g._replace(processes=S.value(tuple(p for p in g.processes.value if p.pid not in drop)))
                 if g.processes.ok else g for g in snap.gpus)
    return snap._replace(gpus=gpus)


def read_and_judge(deps: HookDeps, gmap: JobGpuMap, xids_at: float, judged_at: float, killed: Iterable[int] = ()
                   ) -> Tuple[NodeSnapshot, List[CheckResult], List[xid.XidEvent]]:
    """(snapshot, results, XIDs in the kernel log): the job's GPUs read and judged; they must be
    idle, except for the job's processes that were just killed."""
    events, problem, undated = read_xids(deps.cfg, xids_at)
    indices = gmap.nvml_indices
    snap = deps.reader.snapshot(indices)
    judged = scope_to_instances(without_pids(snap, killed), gmap.instances())
    results = health.evaluate(judged, deps.cfg, gpus=indices, idle=indices, expected_count=gmap.configured,
                              xid_events=scope_xids(events, snap, gmap.instances()), xid_problem=problem,
                              xid_undated=undated, now=judged_at)
    return snap, results, events


def log_results(log: Any, results: Sequence[CheckResult]) -> None:
    """One line per WARN or FAIL (log: the hook's, with the job bound)."""
    for r in results:
        if r.status in (health.FAIL, health.WARN):
            log.event("check", "warning" if r.status == health.WARN else "error", gpu=r.gpu_uuid or r.where,
                      check=r.check, status=r.status, message=r.message)


def fault_check(results: Sequence[CheckResult]) -> str:
    """The check whose FAIL leads the drain reason (health.drain_fault's first)."""
    fails = health.failures(results)
    return fails[0].check if fails else ""
