"""`fleet xids`: XID events by code, node and GPU, classified with NVIDIA's catalog (gpu/xidcatalog.py).

A flood of identical lines is one row on the server with its line count (gpu/xid.py): `events` counts
lines, so a GPU with 800,000 lines of XID 95 says 800,000, from the first line's time to the last's.

Storms (`--by storm`): the same XID first seen on at least `min_nodes` nodes within `window_s` is one
fleet event, with the likely common cause by the code's class (a driver or firmware rollout, one job
across its nodes), not that many broken GPUs.  Each row's first line counts (a flood that began
long before is not part of a new storm's onset); windows of qualifying nodes that overlap merge into
one storm.  The circuit breaker holds such a storm at its share on the nodes (policy/breaker.py).

An XID code the catalog does not know is classed "unknown" and said so, never guessed.  XID 154
carries the driver's recovery action in its message: the newest one of each group is shown.
"""
from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.fleet.model import names
from slurm_gpu.gpu import xidcatalog
from slurm_gpu.slurm import hostlist

BY = ("gpu", "node", "code", "storm")
COLUMNS = {
    "storm": ("xid", "class", "name", "nodes", "node_list", "gpus", "events", "first", "last", "cause", "action",
              "example"),
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


# What many nodes with the same code at once most likely means, by the code's class.
_STORM_CAUSE = {
    xidcatalog.APPLICATION: "one job across these nodes, or a CUDA/framework change: the application's fault, "
                            "not the GPUs'",
    xidcatalog.DRIVER: "a driver or firmware rollout (or its bug) on these nodes, not broken GPUs: check what "
                       "changed, hold the rollout",
}
_COMMON_CAUSE = "a common cause (a driver change, power, cooling, the fabric) is likelier than this many broken " \
                "GPUs at once: check what the nodes share before replacing boards"


def storms(events: Sequence[Dict[str, Any]], window_s: float, min_nodes: int) -> List[Dict[str, Any]]:
    """The fleet events: for each XID code, the runs of its rows (by first line) where at least
    `min_nodes` distinct nodes first saw it within `window_s`; overlapping runs are one storm.  One row
    per storm (COLUMNS["storm"]), oldest first."""
    by_code: Dict[int, List[Dict[str, Any]]] = {}
    for e in events:
        by_code.setdefault(int(e["xid"]), []).append(e)
    out: List[Tuple[float, Dict[str, Any]]] = []
    for code, evs in by_code.items():
        evs.sort(key=lambda e: float(e["time"]))
        times = [float(e["time"]) for e in evs]
        in_window: "Counter[str]" = Counter()
        groups: List[Tuple[int, int]] = []  # [first, last] index of each storm
        left = 0
        for right, e in enumerate(evs):
            in_window[e["node"]] += 1
            while times[right] - times[left] > window_s:
                gone = evs[left]["node"]
                in_window[gone] -= 1
                if not in_window[gone]:
                    del in_window[gone]
                left += 1
            if len(in_window) >= max(2, min_nodes):
                if groups and left <= groups[-1][1]:
                    groups[-1] = (groups[-1][0], right)
                else:
                    groups.append((left, right))
        for first, last in groups:
            members = evs[first:last + 1]
            out.append((times[first], _storm_row(code, members)))
    return [row for _t, row in sorted(out, key=lambda x: (x[0], x[1]["xid"]))]


def _storm_row(code: int, evs: List[Dict[str, Any]]) -> Dict[str, Any]:
    row = _row((code,), sorted(evs, key=_last), "code")
    row["gpus"] = len({(e["node"], e.get("gpu_uuid") or e.get("pci_bus_id")) for e in evs})
    row["cause"] = _STORM_CAUSE.get(row["class"], _COMMON_CAUSE)
    return row


def storm_notes(rows: Sequence[Dict[str, Any]], window_s: float) -> List[str]:
    """One line per storm for the other views."""
    return [f"XID {r['xid']} on {r['nodes']} nodes ({r['node_list']}) within {window_s / 60:g} min from {r['first']}: "
            f"one fleet event (a storm), see --by storm" for r in rows]
