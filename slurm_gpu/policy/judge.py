"""What every health check shares: the result record, the statuses, and the judge that collects
results (severity overrides, the three-outcome handling of a reading).  Pure; no I/O."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from slurm_gpu import checkcatalog as catalog
from slurm_gpu.config import Config
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot, Reading
from slurm_gpu.gpu.xid import XidEvent

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
_RANK = {SKIP: 0, PASS: 1, WARN: 2, FAIL: 3}

# Checks whose natural FAIL is only a warning unless the site says otherwise (checkcatalog.py).
DEFAULT_SEVERITY = catalog.DEFAULT_SEVERITY


class CheckResult(NamedTuple):
    check: str
    status: str
    gpu_index: Optional[int]  # None: node-wide
    gpu_uuid: str
    message: str
    hint: str = ""

    @property
    def where(self) -> str:
        return "node" if self.gpu_index is None else f"GPU {self.gpu_index}"

    def to_json(self) -> Dict[str, object]:
        return {"check": self.check, "status": self.status, "gpu_index": self.gpu_index, "gpu_uuid": self.gpu_uuid,
                "message": self.message, "hint": self.hint}


def worst(results: Iterable[CheckResult]) -> str:
    w = SKIP
    for r in results:
        if _RANK[r.status] > _RANK[w]:
            w = r.status
    return w


def failures(results: Iterable[CheckResult]) -> List[CheckResult]:
    return [r for r in results if r.status == FAIL]


def drain_fault(results: Sequence[CheckResult]) -> str:
    """The fault text of a drain reason: the first FAIL in full, then how many more."""
    fails = failures(results)
    if not fails:
        return ""
    first = fails[0]
    text = first.message
    if len(fails) > 1:
        text += f" (+{len(fails) - 1} more)"
    return text


class Context(NamedTuple):
    """What a check may look at besides the judge and (for a per-GPU check) its GPU."""

    cfg: Config
    hc: Dict[str, Any]  # the [health] settings the checks read
    snap: NodeSnapshot
    judged: Sequence[GpuSnapshot]
    idle: Set[int]  # indices that must be idle
    expected_count: Optional[int] = None
    xid_events: Sequence[XidEvent] = ()
    xid_problem: str = ""
    xid_undated: int = 0
    now: Optional[float] = None
    # healthcheck and `check`: the node database's recent stuck_clocks events (None: not read,
    # as in the prolog and epilog); recorded_problem: why they could not be read
    recorded_events: Optional[Sequence[Dict[str, Any]]] = None
    recorded_problem: str = ""


# What a check's judge returns for a reading that is not PASS: (status, gpu, message[, hint]).
Verdict = Tuple[Any, ...]


class Judge:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.severity: Dict[str, str] = dict(DEFAULT_SEVERITY)
        self.severity.update(cfg.health.severity)
        self.out: List[CheckResult] = []

    def enabled(self, check: str) -> bool:
        return self.severity.get(check, "fail") != "off"

    def add(self, check: str, status: str, gpu: Optional[GpuSnapshot], message: str, hint: str = "") -> None:
        if not self.enabled(check):
            return
        if status == FAIL and self.severity.get(check, "fail") == "warn":
            status = WARN
        idx = None if gpu is None else gpu.index
        uuid = "" if gpu is None else (gpu.uuid.get() or "")
        if gpu is not None:
            message = f"{gpu.label} {message}"
        self.out.append(CheckResult(check, status, idx, uuid, message, hint))

    def reading(self, check: str, gpu: GpuSnapshot, r: Reading[Any], what: str,
                judge: Callable[[Any], Optional[Verdict]]) -> None:
        """Common three-outcome handling; judge(value) returns (status, message, hint) or None for PASS."""
        if not self.enabled(check):
            return
        if r.failed:
            self.add(check, FAIL, gpu, f"cannot read {what}: {r.error} ({r.function})",
                     "a failing NVML query usually means a driver or hardware fault; check dmesg and nvidia-smi -q")
            return
        if r.unsupported:
            self.add(check, SKIP, gpu, f"{what} not available ({r.error or 'unsupported'})")
            return
        verdict = judge(r.value)
        if verdict is None:
            self.add(check, PASS, gpu, f"{what} ok ({fmt(r.value)})")
        else:
            self.add(check, *verdict)


def fmt(v: object) -> str:
    if hasattr(v, "_asdict"):
        return ", ".join(f"{k} {x}" for k, x in getattr(v, "_asdict")().items())
    if isinstance(v, tuple):
        return f"{len(v)} items"
    return str(v)
