"""Fleet data from a directory of `slurm-gpu inventory` files (no central server: no history).

The files are read by gres/inventory.py, the one reader of the format (``slurm-gpu-inventory/1``
or ``/2``); this module turns each Inventory into the fleet's Gpu records.  A v1 file has no
versions and no state: they are unknown, never guessed.  A file that is not a usable inventory
is a Mark, not an abort: one broken file must not hide the other nodes.  A file written while
the driver refused NVML (driver_library_mismatch) makes its node a Mismatch.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from slurm_gpu.fleet.model import COUNTERS, Gpu, Mark, Mismatch
from slurm_gpu.gres.inventory import READABLE_FORMATS, Inventory, InventoryError, InvGpu, load


def inventory_files(directory: str) -> List[str]:
    """The *.json files of a directory (not recursive), sorted."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        from slurm_gpu.errors import InputError
        raise InputError(f"--inventory-dir {directory}: {e.strerror}",
                         "give a directory of `slurm-gpu inventory --state` JSON files") from None
    return sorted(os.path.join(directory, n) for n in names if n.endswith(".json"))


def gpus_of(inv: Inventory, mtime: Optional[float]) -> Tuple[List[Gpu], List[Mark]]:
    """The GPUs one inventory describes, and its marks (v1, no state, no date)."""
    name, host = os.path.basename(inv.source), inv.hostname
    marks: List[Mark] = []
    when = inv.collected_at
    if when is None:
        when = mtime
        marks.append(Mark(host, f"{name}: no collected_at; the file's modification time is used"))
    if inv.format == READABLE_FORMATS[0]:
        marks.append(Mark(host, f"{name}: inventory format 1 has no versions or counters "
                                "(write it again with `slurm-gpu inventory --state`)"))
    gpus = [_gpu(inv, g, when) for g in inv.gpus if g.uuid.strip()]
    if not gpus and inv.driver_library_mismatch is None:  # a mismatch is said as such (mismatch_of)
        marks.append(Mark(host, f"{name}: lists no GPUs"))
    if inv.format != READABLE_FORMATS[0] and inv.gpus and all(g.state is None for g in inv.gpus):
        marks.append(Mark(host, f"{name}: no GPU state (memory counters unknown; "
                                "write it with `slurm-gpu inventory --state`)"))
    return gpus, marks


def _gpu(inv: Inventory, g: InvGpu, when: Optional[float]) -> Gpu:
    state = g.state or {}
    return Gpu(node=inv.hostname, uuid=g.uuid.strip(), time=when, index=g.index, serial=g.serial or None,
               model=g.name.strip() or None, vbios=g.vbios or None, driver_version=inv.driver_version or None,
               cuda_version=inv.cuda_version or None, mig_mode=state.get("mig_mode"),
               counters={k: state.get(k) for k in COUNTERS})


def mismatch_of(inv: Inventory, mtime: Optional[float]) -> Optional[Mismatch]:
    """The node's driver/library mismatch when the file was written while the driver refused NVML."""
    if inv.driver_library_mismatch is None:
        return None
    kernel, library = inv.driver_library_mismatch
    return Mismatch(inv.hostname, kernel, library, inv.collected_at if inv.collected_at is not None else mtime)


class Directory(NamedTuple):
    """What a directory of inventory files says."""

    gpus: List[Gpu]
    marks: List[Mark]
    notes: List[str]
    mismatched: Dict[str, Mismatch]


class _Read(NamedTuple):
    when: float
    gpus: List[Gpu]
    marks: List[Mark]
    path: str
    mismatch: Optional[Mismatch]


def read_directory(paths: Iterable[str], progress: Callable[[int], None] = lambda n: None) -> Directory:
    """GPUs, marks, notes and mismatched nodes from inventory files; for a host found in several
    files the newest wins."""
    newest: Dict[str, _Read] = {}
    notes: List[str] = []
    bad: List[Mark] = []
    for path in paths:
        progress(1)
        try:
            inv = load(path)
            mtime = os.stat(path, follow_symlinks=False).st_mtime
            gpus, marks = gpus_of(inv, mtime)
        except (OSError, InventoryError) as e:
            why = e.message if isinstance(e, InventoryError) else e.strerror
            bad.append(Mark(os.path.basename(path), f"unreadable inventory file {path}: {why}"))
            continue
        host, mismatch = inv.hostname, mismatch_of(inv, mtime)
        when = max((g.time or 0.0 for g in gpus), default=(mismatch.time or 0.0) if mismatch else 0.0)
        if host in newest:
            notes.append(f"{host}: several inventory files; the newest is used ({path} vs {newest[host].path})")
            if newest[host].when >= when:
                continue
        newest[host] = _Read(when, gpus, marks, path, mismatch)
    return Directory([g for v in newest.values() for g in v.gpus], [m for v in newest.values() for m in v.marks] + bad,
                     notes, {h: v.mismatch for h, v in newest.items() if v.mismatch is not None})
