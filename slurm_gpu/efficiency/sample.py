"""`slurm-gpu efficiency sample`: this node's running jobs' GPUs, one reading each, into the node database.

Which jobs run here and on which GPUs is what the prolog recorded (job_starts: the GPUs it mapped from
SLURM_JOB_GPUS by the hooks' own rules, by UUID) without an end record from the epilog, started since
the node booted.  Each GPU is found again by its UUID (an NVML index shifts when a GPU leaves the bus);
a whole GPU gives utilisation, memory used and energy since the job's start; a MIG slice gives its
memory used (NVML has no utilisation or energy per slice: NULL, never 0).  Nothing touches a job's
processes: one NVML read per GPU, under the same per-call deadline as the hooks.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.config import Config, node_name
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot
from slurm_gpu.store import samples as Q
from slurm_gpu.store.samples import RunningStart


class SampleRun(NamedTuple):
    node: str
    taken_at: float
    rows: List[Dict[str, Any]]  # the samples written
    missing: List[str]  # GPUs of running jobs that could not be read: "job 12: GPU-... (why)"
    counts: Dict[str, int]  # written, merged, deleted
    problem: str = ""  # the metrics file could not be written (one line)


def booted_at(uptime_path: str = "/proc/uptime") -> float:
    """When this node booted (wall clock minus uptime): a job start from before it is no running job."""
    with open(uptime_path) as f:
        return time.time() - float(f.read().split()[0])


def _by_uuid(snap: NodeSnapshot) -> Dict[str, Any]:
    """{UUID: GpuSnapshot or (GpuSnapshot, MigDevice)} of every GPU and MIG slice read."""
    out: Dict[str, Any] = {}
    for g in snap.gpus:
        if g.uuid.ok:
            out[g.uuid.value] = g
        for m in g.mig_devices.get(()) or ():
            out[m.uuid] = (g, m)
    return out


def sample_row(start: RunningStart, found: Any, now: float, span_s: float) -> Dict[str, Any]:
    """One sample row of one running job's GPU or MIG slice (found: _by_uuid's value)."""
    row: Dict[str, Any] = {"cluster": start.cluster, "job_id": start.job_id, "restart_count": start.restart_count,
                           "node": start.node, "gpu_uuid": start.gpu_uuid, "time": now, "span_s": span_s, "samples": 1,
                           "coarse": 0}
    if not isinstance(found, GpuSnapshot):  # (GPU, MIG slice)
        g, mig = found
        row.update(gpu_index=g.index, memory_used_bytes=mig.memory_used_bytes, memory_total_bytes=mig.memory_total_bytes)
        return row
    g = found
    util = g.gpu_utilization_pct.get()
    energy = g.energy_mj.get()
    row.update(gpu_index=g.index, gpu_util_pct=util, gpu_util_max_pct=util, memory_used_bytes=g.memory_used_bytes.get(),
               memory_total_bytes=g.memory_total_bytes.get(),
               energy_j=(energy - start.energy_mj) / 1000.0 if energy is not None and start.energy_mj is not None
               and energy >= start.energy_mj else None)
    return row


def sample_rows(starts: Sequence[RunningStart], snap: NodeSnapshot, now: float,
                span_s: float) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The rows of the running starts' GPUs found in `snap`, and the GPUs that were not (named)."""
    found = _by_uuid(snap)
    rows: List[Dict[str, Any]] = []
    missing: List[str] = []
    unreachable = {g.index: g.unreachable for g in snap.gpus if g.unreachable}
    for s in starts:
        f = found.get(s.gpu_uuid)
        if f is None:
            why = unreachable.get(s.gpu_index) if s.gpu_index is not None else None
            missing.append(f"job {s.job_id}: {s.gpu_uuid} ({why or 'not found by the driver'})")
            continue
        rows.append(sample_row(s, f, now, span_s))
    return rows, missing


def sample(cfg: Config, conn: Any, reader: Any, *, now: Optional[float] = None, boot: Optional[float] = None,
           node: Optional[str] = None) -> SampleRun:
    """Read and record this node's running jobs' GPUs; the rows are also downsampled and bounded."""
    node = node or cfg.node or node_name()
    eff = cfg.efficiency
    starts = Q.running_starts(conn, node, booted_at() if boot is None else boot)
    rows: List[Dict[str, Any]] = []
    missing: List[str] = []
    taken = time.time() if now is None else now
    if starts:
        snap = reader.usage()
        taken = snap.taken_at if now is None else now
        rows, missing = sample_rows(starts, snap, taken, float(eff.sample_every_s))
    counts = Q.record_samples(conn, rows, fine_before=taken - float(eff.samples_fine_s),
                              keep_before=taken - float(eff.samples_keep_days) * 86400.0,
                              max_bytes=float(eff.samples_max_mb) * 1e6)
    problem = ""
    if cfg.metrics.textfile_dir:
        problem = _write_metrics(cfg, conn, starts, rows, snap.gpus if starts else (), taken)
    return SampleRun(node, taken, rows, missing, counts, problem)


def idle_seconds(cfg: Config, conn: Any, starts: Sequence[RunningStart], now: float) -> Dict[str, float]:
    """{GPU UUID: seconds idle by the policy's rule} of the running starts' GPUs (0 when busy or unknown)."""
    from slurm_gpu.efficiency.policy import Policy, stretch
    p = Policy.from_config(cfg)  # ConfigError: the caller writes no idle figures
    lookback = max(p.notify_after_s, p.cancel_after_s, p.interactive_notify_after_s, p.interactive_cancel_after_s,
                   3600.0) + 2 * p.max_gap_s
    out: Dict[str, float] = {}
    seen = set()
    for s in starts:
        key = (s.cluster, s.job_id, s.restart_count)
        if key in seen:
            continue
        seen.add(key)
        by_gpu: Dict[str, List[Dict[str, Any]]] = {}
        for r in Q.job_samples(conn, s.cluster, s.job_id, s.restart_count, since=now - lookback):
            by_gpu.setdefault(str(r["gpu_uuid"]), []).append(r)
        for uuid, rs in by_gpu.items():
            st = stretch(rs, p, s.start_time + p.grace_s)
            out[uuid] = st.newest - st.idle_since if st.idle_since is not None else 0.0
    return out


def _write_metrics(cfg: Config, conn: Any, starts: Sequence[RunningStart], rows: Sequence[Dict[str, Any]],
                   gpus: Sequence[GpuSnapshot], now: float) -> str:
    """slurm_gpu_efficiency.prom; a failure is returned as one line, never raised (the samples are written)."""
    from slurm_gpu.errors import ConfigError
    from slurm_gpu.metrics.running import action_counts, running_samples, write_running
    directory = cfg.path_value("metrics", "textfile_dir")
    try:
        idle = idle_seconds(cfg, conn, starts, now)
    except ConfigError:
        idle = {}
    models = {g.index: g.name.value for g in gpus if g.name.ok}
    try:
        write_running(directory, running_samples(rows, models, idle, action_counts(conn)))
    except OSError as e:
        return f"metrics not written to {directory}: {e.strerror or e}"
    return ""
