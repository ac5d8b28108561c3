"""What a check or a hook saw and found: one type for `slurm-gpu check`, healthcheck, the prolog and
the epilog, and for the metrics they write (metrics/hookwrite.py)."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple


class Observed(list[Any]):
    """The results (this list of policy/health.CheckResult) with what they were judged on: the
    snapshot and the kernel log's XIDs.  A hook adds what its metrics say besides: the GPUs a job
    holds, where persistence is on now, the node's drain state; nvmlInit's refusal its versions."""

    def __init__(self, results: Iterable[Any] = (), snapshot: Any = None, xid_events: Sequence[Any] = (),
                 all_gpus: bool = False):
        super().__init__(results)
        self.snapshot = snapshot  # NodeSnapshot the results were judged on
        self.xid_events = xid_events
        self.all_gpus = all_gpus  # the snapshot holds every GPU of the node (healthcheck)
        self.persistence_on: Sequence[int] = ()  # GPUs the prolog turned persistence on for
        self.held: List[Tuple[Any, Any]] = []  # (GpuSnapshot, JobGpu) of a job that starts
        self.drain: Optional[Tuple[str, str]] = None  # metrics/node.NodeUpdate.drain's (state, check)
        self.mismatch: Optional[Tuple[str, str]] = None  # (kernel module, NVML library) versions when nvmlInit refused

    @property
    def results(self) -> "Observed":
        return self

    def saw(self, snapshot: Any, results: Iterable[Any], xid_events: Sequence[Any]) -> None:
        """What a hook read and judged, in place of what it saw before."""
        self.snapshot, self.xid_events = snapshot, xid_events
        self[:] = list(results)
