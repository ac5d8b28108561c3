"""The fleet's data: one GPU's latest observation, data marks, and what a view is built from.

A counter is an int, or None when the driver does not support it or the node did not say
(never 0 for "unknown").  Bad data is never smoothed over: it becomes a Mark that the views
show (a node that never reported, a stale node, a swapped GPU, a counter that went down).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.central.schema import INVENTORY_COUNTERS
from slurm_gpu.slurm import hostlist

# Nodes write an inventory at least daily (docs/fleet.md); two days without one is stale.
STALE_S = 2 * 86400.0
UNKNOWN = "(unknown)"


@dataclass(frozen=True)
class Gpu:
    """One GPU as its node last reported it."""

    node: str
    uuid: str
    time: Optional[float]  # unix seconds of the observation; None when the source has no time
    index: Optional[int] = None
    serial: Optional[str] = None
    model: Optional[str] = None
    vbios: Optional[str] = None
    driver_version: Optional[str] = None
    cuda_version: Optional[str] = None
    mig_mode: Optional[int] = None
    counters: Mapping[str, Optional[int]] = field(default_factory=dict)

    def count(self, name: str) -> Optional[int]:
        v = self.counters.get(name)
        return None if v is None else int(v)

    @property
    def label(self) -> str:
        return f"GPU {self.index}" if self.index is not None else self.uuid


class Mark(NamedTuple):
    """A data problem, said in words, for a node (and a GPU when it concerns one)."""

    node: str
    what: str
    gpu_index: Optional[int] = None
    gpu_uuid: str = ""


class Mismatch(NamedTuple):
    """A node whose driver refused NVML (nvmlInit: LIB_RM_VERSION_MISMATCH) when it last said anything."""

    node: str
    kernel_version: str  # the loaded kernel module's; "" when unknown
    library_version: str  # the NVML library's; "" when unknown
    time: Optional[float]  # when it was seen (unix seconds)


class Point(NamedTuple):
    """One observation of a GPU's correctable ECC counters (growth rates)."""

    time: float
    serial: Optional[str]
    corrected_aggregate: Optional[int]
    corrected_volatile: Optional[int]


@dataclass
class Fleet:
    """What the views read: current GPUs, marks, history (central only) and Slurm's view."""

    source: str
    gpus: List[Gpu]
    marks: List[Mark] = field(default_factory=list)
    history: Optional[Dict[Tuple[str, str], List[Point]]] = None  # (node, uuid) -> points, oldest first
    partitions: Optional[Dict[str, Tuple[str, ...]]] = None  # node -> partitions; None: not read
    slurm_gpu_nodes: Optional[List[str]] = None  # nodes with GPUs in Slurm; None: not read
    slurm_problem: str = ""
    notes: List[str] = field(default_factory=list)
    mismatched: Dict[str, Mismatch] = field(default_factory=dict)  # node -> its driver/library mismatch, now

    def reported_nodes(self) -> List[str]:
        return sorted({g.node for g in self.gpus} | set(self.mismatched), key=hostlist.sort_key)

    def never_reported(self) -> List[str]:
        """Nodes with GPUs in Slurm that the source has nothing about."""
        if self.slurm_gpu_nodes is None:
            return []
        seen = set(self.reported_nodes()) | {m.node for m in self.marks}
        return sorted((n for n in self.slurm_gpu_nodes if n not in seen), key=hostlist.sort_key)

    def partitions_of(self, node: str) -> Tuple[str, ...]:
        if self.partitions is None:
            return (UNKNOWN,)
        return self.partitions.get(node) or ("(not in Slurm)",)


def names(nodes: Iterable[str]) -> str:
    """Node names as a Slurm hostlist (gpu[017-018]); plain and comma-separated if it cannot be one."""
    uniq = sorted(set(nodes), key=hostlist.sort_key)
    try:
        return hostlist.compress(uniq)
    except ValueError:
        return ",".join(uniq)


def version_key(v: str) -> Tuple[Tuple[int, object], ...]:
    """Natural order of version strings: 535.104.05 < 550.54.15, 12.4 < 12.10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-_ ]", v))


def matches_pin(actual: str, pinned: str) -> bool:
    """As health.required_driver_version: exact, or a prefix ending in '.' (a branch)."""
    return actual.startswith(pinned) if pinned.endswith(".") else actual == pinned


def current(observations: Sequence[Gpu], now: float) -> Tuple[List[Gpu], List[Mark]]:
    """The current GPUs of each node out of the latest observation per GPU UUID, with marks:
    a GPU replaced at the same index (swapped), a GPU missing from the node's later reports,
    a node whose newest report is older than STALE_S."""
    by_node: Dict[str, List[Gpu]] = {}
    for g in observations:
        by_node.setdefault(g.node, []).append(g)
    gpus: List[Gpu] = []
    marks: List[Mark] = []
    for node in sorted(by_node, key=hostlist.sort_key):
        kept, node_marks = _node_current(node, by_node[node], now)
        gpus += kept
        marks += node_marks
    return gpus, marks


def _node_current(node: str, obs: List[Gpu], now: float) -> Tuple[List[Gpu], List[Mark]]:
    newest = max((g.time for g in obs if g.time is not None), default=None)
    marks: List[Mark] = []
    if newest is not None and now - newest > STALE_S:
        marks.append(Mark(node, f"stale: the newest report is {(now - newest) / 86400:.1f} days old"))
    by_index: Dict[object, List[Gpu]] = {}
    for g in obs:
        by_index.setdefault(g.index if g.index is not None else g.uuid, []).append(g)
    kept: List[Gpu] = []
    for _key, same in sorted(by_index.items(), key=lambda kv: str(kv[0]).zfill(8)):
        same.sort(key=lambda g: g.time or 0.0, reverse=True)
        cur = same[0]
        kept.append(cur)
        for old in same[1:]:
            marks.append(Mark(node, f"GPU swapped: {old.uuid} (serial {old.serial or '?'}) replaced by {cur.uuid} "
                                    f"(serial {cur.serial or '?'}); trends start again with the new GPU",
                              cur.index, cur.uuid))
        if newest is not None and cur.time is not None and newest - cur.time > STALE_S:
            marks.append(Mark(node, f"{cur.label} missing from the node's reports for "
                                    f"{(newest - cur.time) / 86400:.1f} days (lost or removed?)", cur.index, cur.uuid))
    return kept, marks


COUNTERS: Tuple[str, ...] = INVENTORY_COUNTERS


def with_slurm(fleet: Fleet, nodes: Optional[Sequence[object]], problem: str = "") -> Fleet:
    """Attach Slurm's view (NodeInfo list: partitions, nodes with GPUs), or say why there is none."""
    if nodes is None:
        fleet.slurm_problem = problem or "not read"
        fleet.notes.append(f"partitions could not be read from Slurm ({fleet.slurm_problem}): groups show "
                           f"partition {UNKNOWN} and nodes that never reported cannot be named")
        return fleet
    fleet.partitions = {n.name: tuple(n.partitions) for n in nodes}  # type: ignore[attr-defined]
    fleet.slurm_gpu_nodes = [n.name for n in nodes if n.gpus_configured > 0]  # type: ignore[attr-defined]
    return fleet
