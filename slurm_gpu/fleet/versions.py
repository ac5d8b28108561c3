"""`fleet versions`: driver, CUDA and VBIOS versions per (partition, GPU model) group (docs/fleet.md).

A node's value for a group is what its GPUs of that model report; GPUs of one node that disagree
make the node *mixed* (named, with each GPU's value) and keep it out of the majority count.  The
majority is the value most nodes report (a tie goes to the highest version and is said); every
other node is an outlier, named with its value.  A pinned version (health.required_driver_version,
fleet.expected_cuda_version, fleet.expected_vbios[model]) names every node that differs from it.
Unknown values (v1 inventories, a driver that does not say) are listed, never guessed.
A node whose driver refuses NVML (kernel module and library from different driver versions,
nvmlInit: LIB_RM_VERSION_MISMATCH) gets a "driver/library mismatch" row per partition, naming
both versions: every CUDA job fails there until the node is rebooted.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm_gpu.fleet.model import UNKNOWN, Fleet, Gpu, matches_pin, names, version_key
from slurm_gpu.slurm import hostlist

COMPONENTS = (("driver", "driver_version"), ("cuda", "cuda_version"), ("vbios", "vbios"))
COLUMNS = ("partition", "model", "component", "nodes", "majority", "majority_nodes", "pinned", "status",
           "outliers", "off_pin", "gpus_disagree", "unknown")
CONSISTENT, INCONSISTENT, OFF_PIN, NO_DATA, NEVER = ("consistent", "inconsistent", "differs from pinned",
                                                     "unknown", "never reported")
MISMATCH = "driver/library mismatch"


class Pins:
    """Pinned versions: driver (a '550.' prefix pins a branch), CUDA, VBIOS per model."""

    def __init__(self, driver: str = "", cuda: str = "", vbios: Optional[Mapping[str, str]] = None):
        self.driver, self.cuda, self.vbios = driver, cuda, dict(vbios or {})

    def of(self, component: str, model: str) -> str:
        return {"driver": self.driver, "cuda": self.cuda}.get(component, self.vbios.get(model, ""))


def groups(fleet: Fleet) -> Dict[Tuple[str, str], Dict[str, List[Gpu]]]:
    """(partition, model) -> node -> that node's GPUs of the model."""
    out: Dict[Tuple[str, str], Dict[str, List[Gpu]]] = {}
    for g in fleet.gpus:
        for part in fleet.partitions_of(g.node):
            out.setdefault((part, g.model or UNKNOWN), {}).setdefault(g.node, []).append(g)
    return out


def _node_values(gpus_by_node: Dict[str, List[Gpu]], attr: str) -> Tuple[Dict[str, str], Dict[str, str], List[str]]:
    """(node -> its one value, node -> 'GPU i=v, ...' when its GPUs disagree, nodes with no value)."""
    single: Dict[str, str] = {}
    mixed: Dict[str, str] = {}
    unknown: List[str] = []
    for node, gpus in gpus_by_node.items():
        values = {getattr(g, attr) for g in gpus if getattr(g, attr)}
        if not values:
            unknown.append(node)
        elif len(values) == 1:
            single[node] = values.pop()
        else:
            mixed[node] = ", ".join(f"{g.label}={getattr(g, attr) or '?'}"
                                    for g in sorted(gpus, key=lambda g: (g.index is None, g.index or 0)))
    return single, mixed, unknown


def _majority(single: Dict[str, str]) -> Tuple[str, int, bool]:
    counts: Dict[str, int] = {}
    for v in single.values():
        counts[v] = counts.get(v, 0) + 1
    if not counts:
        return "", 0, False
    best = max(counts.items(), key=lambda kv: (kv[1], version_key(kv[0])))
    tie = sum(1 for n in counts.values() if n == best[1]) > 1
    return best[0], best[1], tie


def _by_value(nodes: Mapping[str, str]) -> str:
    """'535.104.05: gpu[017-018]; 550.40.07: gpu100' (values in version order)."""
    inverse: Dict[str, List[str]] = {}
    for node, v in nodes.items():
        inverse.setdefault(v, []).append(node)
    return "; ".join(f"{v}: {names(ns)}" for v, ns in sorted(inverse.items(), key=lambda kv: version_key(kv[0])))


def component_row(part: str, model: str, component: str, attr: str, by_node: Dict[str, List[Gpu]],
                  pins: Pins) -> Dict[str, Any]:
    single, mixed, unknown = _node_values(by_node, attr)
    majority, count, tie = _majority(single)
    pinned = pins.of(component, model)
    outliers = {n: v for n, v in single.items() if v != majority}
    off_pin = {n: v for n, v in single.items() if pinned and not matches_pin(v, pinned)}
    status = []
    if outliers or mixed:
        status.append(INCONSISTENT + (" (no majority: tie)" if tie else ""))
    if off_pin:
        status.append(OFF_PIN)
    if not status:
        status.append(CONSISTENT if single else NO_DATA)
    return dict(partition=part, model=model, component=component, nodes=len(by_node), majority=majority or None,
                majority_nodes=count, pinned=pinned or None, status="; ".join(status),
                outliers=_by_value(outliers) or None,
                off_pin=(f"all {len(off_pin)} nodes ({majority})" if off_pin and len(off_pin) == len(single) and not outliers
                         else _by_value(off_pin)) or None,
                gpus_disagree="; ".join(f"{n} ({v})" for n, v in sorted(mixed.items(), key=lambda kv: hostlist.sort_key(kv[0])))
                or None, unknown=names(unknown) or None)


def versions_view(fleet: Fleet, pins: Pins) -> List[Dict[str, Any]]:
    """One row per (partition, model, component), and a row per partition for nodes that never reported."""
    rows = []
    for (part, model), by_node in sorted(groups(fleet).items()):
        for component, attr in COMPONENTS:
            rows.append(component_row(part, model, component, attr, by_node, pins))
    silent: Dict[str, List[str]] = {}
    for node in fleet.never_reported():
        for part in fleet.partitions_of(node):
            silent.setdefault(part, []).append(node)
    for part, nodes in sorted(silent.items()):
        rows.append(dict(partition=part, model=UNKNOWN, component="-", nodes=len(nodes), majority=None,
                         majority_nodes=0, pinned=None, status=NEVER, outliers=None, off_pin=None,
                         gpus_disagree=None, unknown=names(nodes)))
    return rows + mismatch_rows(fleet)


def mismatch_rows(fleet: Fleet) -> List[Dict[str, Any]]:
    """One row per partition with nodes in the driver/library mismatch state; `outliers` names
    them by their versions ('kernel module 535.104.05, NVML library 550.54.15: gpu[003-004]')."""
    by_part: Dict[str, Dict[str, str]] = {}
    for node, m in fleet.mismatched.items():
        said = f"kernel module {m.kernel_version or 'unknown'}, NVML library {m.library_version or 'unknown'}"
        for part in fleet.partitions_of(node):
            by_part.setdefault(part, {})[node] = said
    return [dict(partition=part, model=UNKNOWN, component="driver", nodes=len(nodes), majority=None, majority_nodes=0,
                 pinned=None, status=MISMATCH, outliers=_by_value(nodes), off_pin=None, gpus_disagree=None, unknown=None)
            for part, nodes in sorted(by_part.items())]


def failing(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Exit 1: a group is inconsistent or differs from a pinned version, or a node's driver and
    library disagree."""
    return any(INCONSISTENT in r["status"] or OFF_PIN in r["status"] or r["status"] == MISMATCH for r in rows)
