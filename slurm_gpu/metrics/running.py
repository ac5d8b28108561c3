"""Running jobs' GPUs in Prometheus (`slurm_gpu_efficiency.prom`, docs/efficiency.md): written whole by
each `efficiency sample` run, so a GPU's series vanish with its job.  Labels are the GPU's alone (gpu,
UUID, modelName): one series per GPU and family, whatever the jobs do; the job comes from a join with
slurm_gpu_job_info on UUID (a job label would add a series per job: soperator removed its hpc_job label
for that).  Standard library only."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from slurm_gpu.metrics.catalog import EFFICIENCY_FILE
from slurm_gpu.metrics.textfile import Labels, Samples, ensure_dir, render, write_atomic


def _gpu_labels(row: Mapping[str, Any], models: Mapping[int, str]) -> Labels:
    idx = row.get("gpu_index")
    return (("gpu", "" if idx is None else str(idx)), ("UUID", str(row["gpu_uuid"])),
            ("modelName", models.get(idx, "") if idx is not None else ""))


def running_samples(rows: Sequence[Mapping[str, Any]], models: Mapping[int, str], idle_s: Mapping[str, float],
                    actions: Sequence[Sequence[Any]]) -> Samples:
    """rows: this run's sample rows; models: {NVML index: model name}; idle_s: {GPU UUID: idle seconds};
    actions: (stage, outcome, count) of the node database's efficiency_actions."""
    util: Dict[Labels, float] = {}
    mem: Dict[Labels, float] = {}
    idle: Dict[Labels, float] = {}
    for r in rows:
        labels = _gpu_labels(r, models)
        if r.get("gpu_util_pct") is not None:
            util[labels] = float(r["gpu_util_pct"]) / 100.0
        if r.get("memory_used_bytes") is not None:
            mem[labels] = float(r["memory_used_bytes"])
        idle[labels] = float(idle_s.get(str(r["gpu_uuid"]), 0.0))
    counts: Dict[Labels, float] = {(("stage", str(stage)), ("outcome", str(outcome or "none"))): float(n)
                                   for stage, outcome, n in actions}
    return {"slurm_gpu_running_job_gpu_utilization_ratio": util, "slurm_gpu_running_job_memory_used_bytes": mem,
            "slurm_gpu_running_job_gpu_idle_seconds": idle, "slurm_gpu_efficiency_actions_total": counts}


def write_running(directory: str, samples: Samples, sync: Optional[bool] = False) -> None:
    ensure_dir(directory)
    write_atomic(directory, EFFICIENCY_FILE, render(samples), sync=bool(sync))


def action_counts(conn: Any) -> Sequence[Sequence[Any]]:
    """(stage, outcome, count): a cancel's outcome is its cancel_state, any other stage's its mail's."""
    rows: Sequence[Sequence[Any]] = conn.execute(
        "SELECT stage, CASE WHEN stage = 'cancel' THEN cancel_state ELSE mail_state END, COUNT(*) "
        "FROM efficiency_actions GROUP BY 1, 2").fetchall()
    return rows


__all__ = ["running_samples", "write_running", "action_counts"]
