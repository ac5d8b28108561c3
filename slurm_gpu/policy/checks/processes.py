"""Leftovers on a GPU handed to a job: compute processes and memory in use."""
from __future__ import annotations

from typing import Any, Optional

from slurm_gpu.gpu.snapshot import GpuSnapshot
from slurm_gpu.policy.checks.registry import gpu_check
from slurm_gpu.policy.judge import FAIL, Context, Judge, Verdict


@gpu_check
def idle(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """A GPU handed to a job must be idle: no processes, no memory in use."""
    if g.index not in ctx.idle:
        return
    limit_b = int(ctx.hc["idle_memory_used_mib"]) * 1024 * 1024

    def procs(v: Any) -> Optional[Verdict]:
        if not v:
            return None
        pids = ", ".join(str(p.pid) for p in v)
        return (FAIL, g, f"{len(v)} compute process(es) still on the GPU (pid {pids})",
                "a previous job left processes behind: kill them or drain the node")
    j.reading("leftover_processes", g, g.processes, "compute processes", procs)
    j.reading("memory_in_use", g, g.memory_used_bytes, "memory in use",
              lambda v: (FAIL, g, f"{int(v) // (1024 * 1024)} MiB GPU memory in use on an idle GPU (leaked memory)",
                         "a crashed process may hold GPU memory: reset the GPU") if int(v) > limit_b else None)
