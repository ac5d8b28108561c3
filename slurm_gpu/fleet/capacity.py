"""`fleet capacity`: GPUs per partition and model from live Slurm, against the reserve target.

Every GPU of a node is in exactly one of: allocated (Slurm's GresUsed), down (the node is DOWN or
not responding), drained by slurm-gpu (drained with a `slurm-gpu:` reason, slurm/reason.py),
drained by an admin (any other drain reason), idle (the rest: healthy, free).  A draining node's
running jobs still hold their GPUs: they count as allocated.  A node in several partitions counts
in each; the "(cluster)" rows count every node once.  The reserve holds when the idle GPUs are at
least ceil(total x fleet.reserve_pct / 100).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

from slurm_gpu.slurm.conf import parse_gres
from slurm_gpu.slurm.model import NodeInfo

CLUSTER = "(cluster)"
UNTYPED = "(untyped)"
COLUMNS = ("partition", "model", "nodes", "total", "allocated", "idle", "drained_slurm_gpu", "drained_admin", "down",
           "reserve_pct", "reserve_target", "reserve_holds", "shortfall")
_COUNTS = ("total", "allocated", "idle", "drained_slurm_gpu", "drained_admin", "down")


def _per_type(gres: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for name, typ, count in parse_gres(gres):
        if name == "gpu":
            out[typ or UNTYPED] = out.get(typ or UNTYPED, 0) + count
    return out


def node_gpus(node: NodeInfo) -> Dict[str, Dict[str, int]]:
    """model -> {total, allocated, idle, drained_slurm_gpu, drained_admin, down} for one node."""
    total, used = _per_type(node.gres), _per_type(node.gres_used)
    if UNTYPED in used and UNTYPED not in total and len(total) == 1:
        used = {next(iter(total)): used[UNTYPED]}  # GresUsed without the type on a one-type node
    out = {}
    for model, n in total.items():
        alloc = min(n, used.get(model, 0))
        rest = n - alloc
        counts = dict.fromkeys(_COUNTS, 0)
        counts.update(total=n, allocated=alloc)
        if node.down or "NOT_RESPONDING" in node.states:
            counts["down"] = rest
        elif node.drained:
            counts["drained_slurm_gpu" if node.drained_by_us else "drained_admin"] = rest
        else:
            counts["idle"] = rest
        out[model] = counts
    return out


def reserve_target(total: int, pct: float) -> int:
    return math.ceil(total * pct / 100.0 - 1e-9)


def _row(part: str, model: str, sums: Dict[str, int], nodes: int, pct: float) -> Dict[str, Any]:
    target = reserve_target(sums["total"], pct)
    return dict(partition=part, model=model, nodes=nodes, **sums, reserve_pct=pct, reserve_target=target,
                reserve_holds="yes" if sums["idle"] >= target else "no", shortfall=max(0, target - sums["idle"]))


def capacity_view(nodes: Sequence[NodeInfo], pct: float) -> List[Dict[str, Any]]:
    """One row per (partition, model), then one per model for the whole cluster."""
    groups: Dict[Tuple[str, str], Tuple[Dict[str, int], List[str]]] = {}
    for node in nodes:
        for model, counts in node_gpus(node).items():
            for part in tuple(node.partitions or ("(no partition)",)) + (CLUSTER,):
                sums, members = groups.setdefault((part, model), (dict.fromkeys(_COUNTS, 0), []))
                for k in _COUNTS:
                    sums[k] += counts[k]
                members.append(node.name)
    keyed = sorted(groups.items(), key=lambda kv: (kv[0][0] == CLUSTER, kv[0]))
    return [_row(part, model, sums, len(members), pct) for (part, model), (sums, members) in keyed]


def failing(rows: Sequence[Dict[str, Any]]) -> bool:
    """Exit 1: the reserve does not hold somewhere."""
    return any(r["reserve_holds"] == "no" for r in rows)
