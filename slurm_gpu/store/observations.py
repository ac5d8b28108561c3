"""The fleet's history rows (schema v6): a GPU's inventory and the XIDs of the kernel log.

`healthcheck` turns its snapshot into one gpu_inventory row per GPU (`inventory_rows`) and the
XIDs it read into xid_events rows (`xid_rows`); store/node.py writes the ones that are new and
`db push` ships them (docs/fleet.md).  The same per-GPU state goes into an inventory file's
"state" object (`slurm-gpu inventory --state`, gres/inventory.py).

A value the driver did not support, failed to read, or was not asked for is None (NULL), never
0: a counter of 0 means the driver said 0.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, Iterable, List, Optional

from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot, Reading, cuda_version
from slurm_gpu.gpu.xid import bus_key
from slurm_gpu.store.schema import INVENTORY_STATE


def _int(r: Reading[int]) -> Optional[int]:
    return int(r.value) if r.ok and r.value is not None else None


def _text(r: Reading[str]) -> Optional[str]:
    return str(r.value) if r.ok and r.value is not None else None


def gpu_state(g: GpuSnapshot) -> Dict[str, Optional[int]]:
    """The GPU's counters under the gpu_inventory column names (INVENTORY_STATE, in that order)."""
    hist = g.remap_histogram.value if g.remap_histogram.ok else None
    state: Dict[str, Optional[int]] = {
        "mig_mode": _int(g.mig_mode_current),
        "ecc_corrected_volatile": _int(g.ecc_volatile_corrected),
        "ecc_uncorrected_volatile": _int(g.ecc_volatile_uncorrected),
        "ecc_corrected_aggregate": _int(g.ecc_aggregate_corrected),
        "ecc_uncorrected_aggregate": _int(g.ecc_aggregate_uncorrected),
        "retired_pages_sbe": _int(g.retired_pages_sbe),
        "retired_pages_dbe": _int(g.retired_pages_dbe),
        "retired_pages_pending": _int(g.retired_pages_pending),
        "remapped_rows_correctable": _int(g.remapped_rows_corrected),
        "remapped_rows_uncorrectable": _int(g.remapped_rows_uncorrected),
        "remap_pending": _int(g.remapped_rows_pending),
        "remap_failure": _int(g.remapped_rows_failure),
    }
    for part in ("max", "high", "partial", "low", "none"):
        state[f"remap_hist_{part}"] = None if hist is None else int(getattr(hist, part))
    state["sram_corrected"] = _int(g.sram_corrected)
    state["sram_uncorrected"] = _int(g.sram_uncorrected)
    assert tuple(state) == INVENTORY_STATE
    return state


def inventory_rows(snap: NodeSnapshot, node: str, now: float) -> List[Dict[str, Any]]:
    """One gpu_inventory row per GPU that could be read and named (a row is keyed by UUID)."""
    driver, cuda = _text(snap.driver_version), cuda_version(snap.cuda_driver_version)
    rows = []
    for g in snap.gpus:
        uuid = _text(g.uuid)
        if g.unreachable or not uuid:
            continue
        row: Dict[str, Any] = {"time": now, "node": node, "gpu_index": g.index, "gpu_uuid": uuid,
                               "serial": _text(g.serial), "model": _text(g.name), "vbios": _text(g.vbios),
                               "driver_version": driver, "cuda_version": cuda}
        row.update(gpu_state(g))
        rows.append(row)
    return rows


def pci_bus_text(bus: Any) -> str:
    """An XID's (domain, bus, device) as NVML writes a bus id: "00000000:3B:00.0"."""
    dom, b, dev = bus
    return f"{dom:08X}:{b:02X}:{dev:02X}.0"


def xid_key(node: str, time: float, pci_bus_id: str, xid: int, detail: str) -> str:
    """sha256 hex of node|time (whole seconds)|pci bus|xid|detail.  A time that rounds the other way
    when the log is read again is caught by the writer (schema.XID_SAME_S)."""
    text = f"{node}|{int(round(time))}|{pci_bus_id}|{xid}|{detail}"
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()


def xid_rows(events: Iterable[Any], snap: Optional[NodeSnapshot], node: str) -> List[Dict[str, Any]]:
    """xid_events rows of the dated XIDs (gpu/xid.XidEvent: a flood is one, with its line count and last
    time), with the GPU they name where it is known."""
    gpus = {bus_key(g.pci_bus_id.value): g for g in (snap.gpus if snap is not None else ()) if g.pci_bus_id.ok}
    rows: Dict[Any, Dict[str, Any]] = {}
    for e in events:
        if e.time is None:
            continue  # undated lines are counted by the check, never recorded: they cannot be placed
        bus = pci_bus_text(e.bus)
        last = float(e.time if e.last_time is None else e.last_time)
        runs = tuple(e.runs) or ((float(e.time), last, int(e.line_count)),)
        same = rows.get((bus, e.xid, e.message))
        if same is not None:  # another MIG instance's lines of the same text: the table has no instance column
            same["line_count"] += int(e.line_count)
            same["last_time"] = max(same["last_time"], last)
            same["runs"] += runs
            if e.time < same["time"]:
                same.update(time=float(e.time), event_key=xid_key(node, e.time, bus, e.xid, e.message))
            continue
        g = gpus.get(tuple(e.bus))
        rows[(bus, e.xid, e.message)] = {
            "event_key": xid_key(node, e.time, bus, e.xid, e.message), "time": float(e.time), "node": node,
            "gpu_index": None if g is None else g.index, "gpu_uuid": None if g is None else _text(g.uuid),
            "pci_bus_id": bus, "xid": int(e.xid), "detail": e.message, "line_count": int(e.line_count), "last_time": last,
            # not a column: when the flood was read before, how many of its lines are new (record_xids)
            "runs": runs}
    return list(rows.values())
