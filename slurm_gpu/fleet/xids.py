"""`fleet xids`: XID events by code, node and GPU, classified with NVIDIA's catalog (gpu/xidcatalog.py).

A flood of identical lines is one row on the server with its line count (gpu/xid.py): `events` counts
lines, so a GPU with 800,000 lines of XID 95 says 800,000, from the first line's time to the last's.

An XID code the catalog does not know is classed "unknown" and said so, never guessed.  XID 154
carries the driver's recovery action in its message: the newest one of each group is shown.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.fleet.model import names
from slurm_gpu.gpu import xidcatalog
from slurm_gpu.slurm import hostlist

BY = ("gpu", "node", "code")
COLUMNS = {
    "gpu": ("xid", "class", "name", "node", "gpu_index", "gpu_uuid", "events", "first", "last", "action", "example"),
    "node": ("xid", "class", "name", "node", "gpus", "events", "first", "last", "action", "example"),
    "code": ("xid", "class", "name", "nodes", "node_list", "events", "first", "last", "action", "example"),
}


def _iso(t: Optional[float]) -> Optional[str]:
    return None if t is None else datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(e: Dict[str, Any], by: str) -> Tuple[Any, ...]:
    if by == "gpu":
        return (int(e["xid"]), e["node"], e.get("gpu_uuid") or "", e.get("gpu_index"))
    if by == "node":
        return (int(e["xid"]), e["node"])
    return (int(e["xid"]),)


def _last(e: Dict[str, Any]) -> float:
    """A row's last line's time (a flood's row has one of its own; a row of one line, its time)."""
    return float(e["time"] if e.get("last_time") is None else e["last_time"])


def xids_view(events: Sequence[Dict[str, Any]], by: str = "gpu") -> List[Dict[str, Any]]:
    """One row per group: the XID lines (a flood's row counts its line_count), first and last time,
    NVIDIA's class and action, the newest message."""
    groups: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = {}
    for e in sorted(events, key=_last):
        groups.setdefault(_key(e, by), []).append(e)
    rows = [_row(key, evs, by) for key, evs in groups.items()]
    rows.sort(key=lambda r: (r["xid"], hostlist.sort_key(r.get("node") or ""), r.get("gpu_index") or -1))
    return rows


def _row(key: Tuple[Any, ...], evs: List[Dict[str, Any]], by: str) -> Dict[str, Any]:
    info = xidcatalog.describe(key[0])
    newest = evs[-1]
    row: Dict[str, Any] = {"xid": key[0], "class": info.kind, "name": info.name,
                           "events": sum(int(e.get("line_count") or 1) for e in evs),
                           "first": _iso(min(float(e["time"]) for e in evs)), "last": _iso(_last(newest)),
                           "action": xidcatalog.action_for(key[0], newest.get("detail") or ""),
                           "example": (newest.get("detail") or "")[:200] or None}
    if by == "gpu":
        row.update(node=key[1], gpu_index=newest.get("gpu_index"), gpu_uuid=key[2] or None)
    elif by == "node":
        row.update(node=key[1], gpus=len({e.get("gpu_uuid") or e.get("pci_bus_id") for e in evs}))
    else:
        nodes = {e["node"] for e in evs}
        row.update(nodes=len(nodes), node_list=names(nodes))
    return row


def unknown_codes(rows: Sequence[Dict[str, Any]]) -> List[int]:
    return sorted({r["xid"] for r in rows if r["class"] == xidcatalog.UNKNOWN})
