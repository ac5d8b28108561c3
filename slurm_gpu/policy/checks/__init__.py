"""The one registry of health checks, filled by the family modules beside it.

A family module (memory, thermal, links, processes, versions, xids) decorates each check with
`registry.gpu_check` (run once per judged, reachable GPU: fn(judge, gpu, ctx)) or `registry.node_check` (run once:
fn(judge, ctx), phase "before" the GPUs or "after" them).  Checks run in registration order,
which is the order of FAMILIES and, within a family, of definition: the first FAIL becomes the
drain reason, so the order is part of the behaviour.  A new check touches two files: its family
file here and its CheckSpec in slurm_gpu/checkcatalog.py (name, severity, hardware, remedy, docs line;
tests/test_checkcatalog.py fails until both exist).
"""
from __future__ import annotations

from slurm_gpu.policy.checks import registry

# The order the families' checks run in.  It used to be whatever order the modules happened to be
# imported in (policy/health.py imports thermal first); this is that order, now kept on purpose.
FAMILIES = ("thermal", "links", "memory", "processes", "versions", "xids")
_RANK = {f: i for i, f in enumerate(FAMILIES)}


def load() -> None:
    """Import every family once (their decorators fill the registry), then put the registry in
    FAMILIES order (a stable sort: within a family, the order of definition)."""
    from slurm_gpu.policy.checks import links, memory, processes, thermal, versions, xids  # noqa: F401
    for checks in (registry.GPU_CHECKS, *registry.NODE_CHECKS.values()):
        checks.sort(key=lambda fn: _RANK[fn.__module__.rsplit(".", 1)[-1]])
