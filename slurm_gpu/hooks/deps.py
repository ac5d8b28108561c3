"""What a hook talks to (HookDeps: the seams tests inject fakes at) and the job's GPUs through it."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from slurm_gpu.config import Config
from slurm_gpu.hooks import procs
from slurm_gpu.hooks.check import make_reader
from slurm_gpu.hooks.log import BoundLog
from slurm_gpu.slurm.gpumap import JobGpuMap, map_job_gpus
from slurm_gpu.slurm.jobenv import JobEnv


class HookDeps:
    """What a hook talks to; tests inject fakes at these seams.  Whatever is not given is the real thing."""

    def __init__(self, cfg: Config, log: Any, *, reader: Any = None, store: Any = None, slurm: Any = None,
                 now: Callable[[], float] = time.time, kill: Optional[Callable[[int, int], None]] = None,
                 pid_alive: Optional[Callable[[int], bool]] = None,
                 owns: Optional[Callable[[int, JobEnv], bool]] = None, slurm_conf: str = "",
                 started: Optional[float] = None):
        self.cfg = cfg
        self.log = log  # HookLog
        self.reader = make_reader(cfg) if reader is None else reader  # NvmlReader
        if store is None:
            from slurm_gpu.store.node import Store
            store = Store.from_config(cfg)
        self.store = store  # Store
        self.slurm = slurm  # SlurmBackend, chosen when first needed (backend())
        self.now = now
        self.kill = os.kill if kill is None else kill
        self.pid_alive = procs.pid_alive if pid_alive is None else pid_alive
        # (pid, job) -> does the process belong to the job?  Only those are ever killed.
        self.owns = procs.process_belongs_to_job if owns is None else owns
        # Default: $SLURM_CONF (slurmd sets it), else the config's slurm_conf.
        self.slurm_conf = slurm_conf or os.environ.get("SLURM_CONF") or cfg.get("", "slurm_conf")
        # Unix time slurmd started this hook process (hooks/main.py sets it; None: deps.now() when
        # the flow begins).  Python's start-up and imports come before the flow's first clock read.
        self.started = started
        self._job_log: Optional[BoundLog] = None

    def job_log(self, job: JobEnv) -> BoundLog:
        """The log with the job and node bound: every line of the hook run names them."""
        if self._job_log is None or self._job_log.bound != {"job": job.job_id, "node": job.node}:
            self._job_log = BoundLog(self.log, job=job.job_id, node=job.node)
        return self._job_log

    def backend(self):
        if self.slurm is None:
            from slurm_gpu.slurm.backend import get_backend
            self.slurm = get_backend(self.cfg)
        return self.slurm


def map_gpus(deps: HookDeps, job: JobEnv) -> JobGpuMap:
    """Slurm's GPU indices of the job -> GPUs (and MIG instances) through the node's Slurm config."""
    return map_job_gpus(job.gpus, deps.reader.identities(), deps.cfg, job.node, deps.slurm_conf, deps.log)
