"""What a hook talks to (HookDeps: the seams tests inject fakes at) and the job's GPUs through it."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Mapping, Optional, Protocol, Sequence, runtime_checkable

from slurm_gpu.config import Config
from slurm_gpu.hooks import procs
from slurm_gpu.hooks.check import make_reader
from slurm_gpu.hooks.log import BoundLog
from slurm_gpu.slurm.gpumap import JobGpuMap, map_job_gpus
from slurm_gpu.slurm.jobenv import JobEnv

if TYPE_CHECKING:  # types only: the hook path imports the store when it writes, not before
    from slurm_gpu.gpu.snapshot import NodeSnapshot
    from slurm_gpu.slurm.model import SlurmBackend
    from slurm_gpu.store.ingest import IngestReport
    from slurm_gpu.store.node import StartLookup, Written
    from slurm_gpu.store.record import Record


@runtime_checkable
class GpuReader(Protocol):
    """What a hook reads from and sets on the GPUs: gpu/nvml.py's NvmlReader (tests' stand-ins too)."""

    def identities(self) -> "NodeSnapshot": ...

    def snapshot(self, indices: Optional[Sequence[int]] = None, ident_only: bool = False,
                 inventory: bool = False) -> "NodeSnapshot": ...

    def processes_many(self, indices: Sequence[int]) -> Dict[int, Any]: ...

    def accounting_many(self, indices: Sequence[int]) -> Dict[int, Any]: ...

    def prepare(self, indices: Sequence[int], *, persistence: bool = False, reset_clocks: bool = False,
                accounting: bool = False, power_cap_tolerance_pct: Optional[float] = None,
                in_place: Optional[Mapping[int, Collection[str]]] = None) -> Dict[int, Any]: ...

    def is_stuck(self, index: int) -> bool: ...


class NoGpus:
    """The reader of a hook whose driver does not answer (nvmlInit failed): every read raises that
    error again, so nothing in the hook can read a GPU by mistake."""

    def __init__(self, error: Exception):
        self.error = error

    def identities(self) -> "NodeSnapshot":
        raise self.error

    def snapshot(self, indices: Optional[Sequence[int]] = None, ident_only: bool = False,
                 inventory: bool = False) -> "NodeSnapshot":
        raise self.error

    def processes_many(self, indices: Sequence[int]) -> Dict[int, Any]:
        raise self.error

    def accounting_many(self, indices: Sequence[int]) -> Dict[int, Any]:
        raise self.error

    def prepare(self, indices: Sequence[int], *, persistence: bool = False, reset_clocks: bool = False,
                accounting: bool = False, power_cap_tolerance_pct: Optional[float] = None,
                in_place: Optional[Mapping[int, Collection[str]]] = None) -> Dict[int, Any]:
        raise self.error

    def is_stuck(self, index: int) -> bool:
        return False


@runtime_checkable
class RecordStore(Protocol):
    """Where a hook's records go: store/node.py's Store."""

    unavailable: str  # why the database cannot be used right now ('' when it can)

    def write(self, record: "Record", ingest: bool = True) -> "Written": ...

    def find_start(self, cluster: str, job_id: int, restart_count: int, node: str,
                   spool_budget_s: float = 2.0) -> "StartLookup": ...

    def housekeeping(self, max_files: int, max_seconds: float, prune: bool = False) -> "IngestReport": ...


@runtime_checkable
class EventLog(Protocol):
    """The hook's decision log: hooks/log.py's HookLog."""

    hook: str

    def event(self, event: str, level: str = "info", **fields: Any) -> str: ...

    def info(self, event: str, **f: Any) -> str: ...

    def warning(self, event: str, **f: Any) -> str: ...

    def error(self, event: str, **f: Any) -> str: ...


class HookDeps:
    """What a hook talks to; tests inject fakes at these seams.  Whatever is not given is the real thing."""

    def __init__(self, cfg: Config, log: EventLog, *, reader: Optional[GpuReader] = None,
                 store: Optional[RecordStore] = None, slurm: Optional["SlurmBackend"] = None,
                 now: Callable[[], float] = time.time, kill: Optional[Callable[[int, int], None]] = None,
                 pid_alive: Optional[Callable[[int], bool]] = None,
                 owns: Optional[Callable[[int, JobEnv], bool]] = None, slurm_conf: str = "",
                 started: Optional[float] = None):
        self.cfg = cfg
        self.log = log
        self.reader: GpuReader = make_reader(cfg) if reader is None else reader
        if store is None:
            from slurm_gpu.store.node import Store
            store = Store.from_config(cfg)
        self.store: RecordStore = store
        self.slurm = slurm  # chosen when first needed (backend())
        self.now = now
        self.kill = os.kill if kill is None else kill
        self.pid_alive = procs.pid_alive if pid_alive is None else pid_alive
        # (pid, job) -> does the process belong to the job?  Only those are ever killed.
        self.owns = procs.process_belongs_to_job if owns is None else owns
        # Default: $SLURM_CONF (slurmd sets it), else the config's slurm_conf.
        self.slurm_conf = slurm_conf or os.environ.get("SLURM_CONF") or cfg.slurm_conf
        # Unix time slurmd started this hook process (hooks/main.py sets it; None: deps.now() when
        # the flow begins).  Python's start-up and imports come before the flow's first clock read.
        self.started = started
        self._job_log: Optional[BoundLog] = None

    def job_log(self, job: JobEnv) -> BoundLog:
        """The log with the job and node bound: every line of the hook run names them."""
        if self._job_log is None or self._job_log.bound != {"job": job.job_id, "node": job.node}:
            self._job_log = BoundLog(self.log, job=job.job_id, node=job.node)
        return self._job_log

    def backend(self) -> "SlurmBackend":
        if self.slurm is None:
            from slurm_gpu.slurm.backend import get_backend
            self.slurm = get_backend(self.cfg)
        return self.slurm


def map_gpus(deps: HookDeps, job: JobEnv) -> JobGpuMap:
    """Slurm's GPU indices of the job -> GPUs (and MIG instances) through the node's Slurm config."""
    return map_job_gpus(job.gpus, deps.reader.identities(), deps.cfg, job.node, deps.slurm_conf, deps.log)
