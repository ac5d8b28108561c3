"""A running job's figures so far, for `slurm-gpu job JOBID` while it runs (docs/efficiency.md).

Whoever judges the job (its node, or the central run for a job on several nodes) also writes, every
efficiency.live_summary_every_s, the job's GPU summary so far into its AdminComment: the same encoding
as a finished job's (store/summary.py), marked partial, with each GPU's idle time and its last hour
of utilisation, one point a minute.  Slurm shows a running job's AdminComment (`scontrol show job`) only
to whom it shows the job (PrivateData=jobs), so users read their own running jobs' figures without any
database credentials, as they read their finished jobs'.  The controller epilog replaces it with the
final summary when the job ends; another tool's AdminComment is never overwritten.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm_gpu.efficiency.policy import JobFacts, Judgement
from slurm_gpu.store import summary as sg

POINTS = 60  # the last hour, a point a minute
POINT_S = 60.0
MIB = float(1 << 20)


def _points(rows: Sequence[Mapping[str, Any]], now: float) -> List[Optional[int]]:
    """Utilisation per minute of the last hour (the mean of the samples in it), None for a minute unseen."""
    sums: Dict[int, Tuple[float, float]] = {}
    start = now - POINTS * POINT_S
    for r in rows:
        t, util = float(r["time"]), r.get("gpu_util_pct")
        if util is None or t <= start or t > now:
            continue
        i = min(POINTS - 1, max(0, math.ceil((t - start) / POINT_S) - 1))  # minute i is (start + 60 i, start + 60 (i + 1)]
        total, n = sums.get(i, (0.0, 0.0))
        sums[i] = (total + float(util), n + 1)
    return [int(round(sums[i][0] / sums[i][1])) if i in sums else None for i in range(POINTS)]


def summary(job: JobFacts, totals: Sequence[Mapping[str, Any]], recent: Sequence[Mapping[str, Any]], j: Judgement,
            now: float) -> sg.Summary:
    """totals: one row per GPU over the whole job (node, gpu_uuid, gpu_index, start, end, util_pct, memory_max_bytes,
    memory_total_bytes, energy_j); recent: the last hour's samples; j: the judgement of this run (idle times)."""
    idle = {(s.node, s.gpu_uuid): (s.newest - s.idle_since if s.idle_since is not None else 0.0) for s in j.stretches}
    by_gpu: Dict[Tuple[str, str], List[Mapping[str, Any]]] = {}
    for r in recent:
        by_gpu.setdefault((str(r["node"]), str(r["gpu_uuid"])), []).append(r)
    rows = sorted(totals, key=lambda t: (str(t["node"]), -1 if t.get("gpu_index") is None else int(t["gpu_index"])))
    gpus, live = [], []
    for t in rows:
        key = (str(t["node"]), str(t["gpu_uuid"]))
        peak, total, energy = t.get("memory_max_bytes"), t.get("memory_total_bytes"), t.get("energy_j")
        gpus.append(sg.GpuUse(
            node=key[0], index=t.get("gpu_index"), model=None,
            start=None if t.get("start") is None else int(t["start"]), end=None if t.get("end") is None else int(t["end"]),
            util_pct=None if t.get("util_pct") is None else round(float(t["util_pct"]), 1), mem_util_pct=None,
            peak_mib=None if peak is None else int(round(peak / MIB)),
            total_mib=None if total is None else int(round(total / MIB)),
            energy_wh=None if energy is None else round(float(energy) / 3600.0, 2), ecc_uncorrected=None, xids=[],
            mig=False))
        live.append([round(idle.get(key, 0.0)), _points(by_gpu.get(key, []), now)])
    newest = max((float(t["end"]) for t in rows if t.get("end") is not None), default=now)
    nodes = sorted({g.node for g in gpus})
    return sg.Summary(job.cluster, job.job_id, job.restart_count, True, nodes, [], gpus, "gpu",
                      {"t": math.floor(newest * 10) / 10, "g": live})  # down: never later than the sample


def due(admin_comment: str, every_s: float, now: float, restart: int = 0) -> bool:
    """Is a new live summary due?  Not over another tool's AdminComment or our cancel note; not sooner than
    every_s after the one there; over a finished summary only when it is an earlier run's (a requeued job)."""
    if not admin_comment:
        return True
    if not sg.is_ours(admin_comment) or sg.is_cancel_note(admin_comment):
        return False
    old = sg.decode_safe(admin_comment)
    if old is None:
        return True  # damaged: write it again
    if old.live is None:
        return old.restart < restart  # the final summary of the run before a requeue; this run's stays
    return now - float(old.live["t"]) >= every_s
