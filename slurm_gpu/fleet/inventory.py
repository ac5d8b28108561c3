"""Fleet data from a directory of `slurm-gpu inventory` files (no central server: no history).

Only the fields the fleet views need are read: format ``slurm-gpu-inventory/1`` or ``/2``,
top-level ``hostname``, ``driver_version``, ``cuda_version``, ``collected_at`` (unix seconds or
ISO 8601), and per GPU ``index``, ``uuid``, ``name``, ``serial``, ``vbios`` and the ``state``
object that `inventory --state` writes (keys: the gpu_inventory counter names).  A v1 file has
no versions and no state: they are unknown, never guessed.  A file that is not an inventory is
a Mark, not an abort: one broken file must not hide the other nodes.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from slurm_gpu import timefmt
from slurm_gpu.fleet.model import COUNTERS, Gpu, Mark

FORMATS = ("slurm-gpu-inventory/1", "slurm-gpu-inventory/2")
STATE_KEYS = ("mig_mode",) + COUNTERS


class NotInventory(Exception):
    """The file is not a usable inventory; the message says why."""


def inventory_files(directory: str) -> List[str]:
    """The *.json files of a directory (not recursive), sorted."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        from slurm_gpu.errors import InputError
        raise InputError(f"--inventory-dir {directory}: {e.strerror}",
                         "give a directory of `slurm-gpu inventory --state` JSON files") from None
    return sorted(os.path.join(directory, n) for n in names if n.endswith(".json"))


def _text(v: Any) -> Optional[str]:
    return v.strip() or None if isinstance(v, str) else None


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _time(v: Any) -> Optional[float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        return timefmt.iso_to_unix(v)
    return None


def gpus_from_doc(doc: Any, source: str, mtime: Optional[float]) -> Tuple[List[Gpu], List[Mark]]:
    """The GPUs one inventory document describes, and its marks (v1, no state, no date)."""
    if not isinstance(doc, Mapping) or doc.get("format") not in FORMATS:
        got = doc.get("format") if isinstance(doc, Mapping) else type(doc).__name__
        raise NotInventory(f"not a slurm-gpu inventory (format {got!r})")
    host = _text(doc.get("hostname"))
    if not host:
        raise NotInventory("no hostname")
    gpus_json = doc.get("gpus")
    if not isinstance(gpus_json, list):
        raise NotInventory("no gpus list")
    when = _time(doc.get("collected_at"))
    marks: List[Mark] = []
    if when is None:
        when = mtime
        marks.append(Mark(host, f"{os.path.basename(source)}: no collected_at; the file's modification time is used"))
    driver, cuda = _text(doc.get("driver_version")), _text(doc.get("cuda_version"))
    if doc.get("format") == FORMATS[0]:
        marks.append(Mark(host, f"{os.path.basename(source)}: inventory format 1 has no versions or counters "
                                "(write it again with `slurm-gpu inventory --state`)"))
    gpus = [_gpu(host, g, when, driver, cuda) for g in gpus_json if isinstance(g, Mapping) and _text(g.get("uuid"))]
    if not gpus:
        marks.append(Mark(host, f"{os.path.basename(source)}: lists no GPUs"))
    stateful = any(isinstance(g, Mapping) and isinstance(g.get("state"), Mapping) for g in gpus_json)
    if doc.get("format") != FORMATS[0] and gpus_json and not stateful:
        marks.append(Mark(host, f"{os.path.basename(source)}: no GPU state (memory counters unknown; "
                                "write it with `slurm-gpu inventory --state`)"))
    return gpus, marks


def _gpu(host: str, g: Mapping[str, Any], when: Optional[float], driver: Optional[str], cuda: Optional[str]) -> Gpu:
    state = g.get("state") if isinstance(g.get("state"), Mapping) else {}
    return Gpu(node=host, uuid=str(g["uuid"]).strip(), time=when, index=_int(g.get("index")),
               serial=_text(g.get("serial")), model=_text(g.get("name")), vbios=_text(g.get("vbios")),
               driver_version=driver, cuda_version=cuda, mig_mode=_int(state.get("mig_mode")),
               counters={k: _int(state.get(k)) for k in COUNTERS})


def read_directory(paths: Iterable[str], progress: Callable[[int], None] = lambda n: None
                   ) -> Tuple[List[Gpu], List[Mark], List[str]]:
    """GPUs, marks and notes from inventory files; for a host found in several files the newest wins."""
    newest: Dict[str, Tuple[float, List[Gpu], List[Mark], str]] = {}
    notes: List[str] = []
    bad: List[Mark] = []
    for path in paths:
        progress(1)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            mtime = os.stat(path).st_mtime
            gpus, marks = gpus_from_doc(doc, path, mtime)
        except (OSError, ValueError, NotInventory) as e:
            bad.append(Mark(os.path.basename(path), f"unreadable inventory file {path}: {getattr(e, 'strerror', None) or e}"))
            continue
        host = marks[0].node if marks else (gpus[0].node if gpus else str(doc.get("hostname")))
        when = max((g.time or 0.0 for g in gpus), default=0.0)
        if host in newest:
            notes.append(f"{host}: several inventory files; the newest is used ({path} vs {newest[host][3]})")
            if newest[host][0] >= when:
                continue
        newest[host] = (when, gpus, marks, path)
    out_gpus = [g for v in newest.values() for g in v[1]]
    out_marks = [m for v in newest.values() for m in v[2]] + bad
    return out_gpus, out_marks, notes
