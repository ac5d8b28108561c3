"""Leftovers on a GPU handed to a job: compute processes and memory in use."""
from __future__ import annotations

from typing import Optional

from slurm_gpu.gpu.snapshot import GpuSnapshot
from slurm_gpu.policy.checks import gpu_check
from slurm_gpu.policy.judge import FAIL, Context, Judge


@gpu_check
def idle(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """A GPU handed to a job must be idle: no processes, no memory in use."""
    if g.index not in ctx.idle:
        return
    limit_b = int(ctx.hc["idle_memory_used_mib"]) * 1024 * 1024

    def procs(v: object) -> Optional[tuple]:
        if not v:
            return None
        pids = ", ".join(str(p.pid) for p in v)  # type: ignore[attr-defined]
        return (FAIL, g, f"{len(v)} compute process(es) still on the GPU (pid {pids})",  # type: ignore[arg-type]
                "a previous job left processes behind: kill them or drain the node")
    j.reading("leftover_processes", g, g.processes, "compute processes", procs)
    j.reading("memory_in_use", g, g.memory_used_bytes, "memory in use",
              lambda v: (FAIL, g, f"{int(v) // (1024 * 1024)} MiB GPU memory in use on an idle GPU (leaked memory)",  # type: ignore[arg-type]
                         "a crashed process may hold GPU memory: reset the GPU") if int(v) > limit_b else None)  # type: ignore[arg-type]
