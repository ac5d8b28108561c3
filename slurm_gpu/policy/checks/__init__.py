"""The one registry of health checks, filled by the family modules beside it.

A family module (memory, thermal, links, processes, versions, xids) decorates each check with
`gpu_check` (run once per judged, reachable GPU: fn(judge, gpu, ctx)) or `node_check` (run once:
fn(judge, ctx), phase "before" the GPUs or "after" them).  Checks run in registration order,
which is the order of FAMILIES and, within a family, of definition: the first FAIL becomes the
drain reason, so the order is part of the behaviour.  A new check touches two files: its family
file here and its CheckSpec in slurm_gpu/checkcatalog.py (name, severity, hardware, remedy, docs line;
tests/test_checkcatalog.py fails until both exist).
"""
from __future__ import annotations

from typing import Callable, Dict, List, TypeVar

Check = Callable[..., None]
GPU_CHECKS: List[Check] = []
NODE_CHECKS: Dict[str, List[Check]] = {"before": [], "after": []}
F = TypeVar("F", bound=Check)

FAMILIES = ("memory", "thermal", "links", "versions", "processes", "xids")


def gpu_check(fn: F) -> F:
    GPU_CHECKS.append(fn)
    return fn


def node_check(phase: str) -> Callable[[F], F]:
    def register(fn: F) -> F:
        NODE_CHECKS[phase].append(fn)
        return fn
    return register


def load() -> None:
    """Import every family once (their decorators fill the registry)."""
    # Importing a family registers its checks; Python imports each module once.
    from slurm_gpu.policy.checks import links, memory, processes, thermal, versions, xids  # noqa: F401
