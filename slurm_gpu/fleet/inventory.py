"""Fleet data from a directory of `slurm-gpu inventory` files (no central server: no history).

The files are read by gres/inventory.py, the one reader of the format (``slurm-gpu-inventory/1``
or ``/2``); this module turns each Inventory into the fleet's Gpu records.  A v1 file has no
versions and no state: they are unknown, never guessed.  A file that is not a usable inventory
is a Mark, not an abort: one broken file must not hide the other nodes.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from slurm_gpu.fleet.model import COUNTERS, Gpu, Mark
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
    if not gpus:
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


def read_directory(paths: Iterable[str], progress: Callable[[int], None] = lambda n: None
                   ) -> Tuple[List[Gpu], List[Mark], List[str]]:
    """GPUs, marks and notes from inventory files; for a host found in several files the newest wins."""
    newest: Dict[str, Tuple[float, List[Gpu], List[Mark], str]] = {}
    notes: List[str] = []
    bad: List[Mark] = []
    for path in paths:
        progress(1)
        try:
            inv = load(path)
            gpus, marks = gpus_of(inv, os.stat(path, follow_symlinks=False).st_mtime)
        except (OSError, InventoryError) as e:
            why = e.message if isinstance(e, InventoryError) else e.strerror
            bad.append(Mark(os.path.basename(path), f"unreadable inventory file {path}: {why}"))
            continue
        host = inv.hostname
        when = max((g.time or 0.0 for g in gpus), default=0.0)
        if host in newest:
            notes.append(f"{host}: several inventory files; the newest is used ({path} vs {newest[host][3]})")
            if newest[host][0] >= when:
                continue
        newest[host] = (when, gpus, marks, path)
    out_gpus = [g for v in newest.values() for g in v[1]]
    out_marks = [m for v in newest.values() for m in v[2]] + bad
    return out_gpus, out_marks, notes
