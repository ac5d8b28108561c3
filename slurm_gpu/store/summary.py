"""A job's GPU summary as it is kept in Slurm's accounting (the job's AdminComment): docs/job.md.

Written once per job by `slurm-gpu-epilog-ctld` (EpilogSlurmctld) from the nodes' records on the
central server, read by `slurm-gpu job JOBID` through `sacct`, so that Slurm's own privacy rules
decide who sees it and no user needs database credentials.

Encoding: ``sg1:`` + lowercase base32 (no padding) of zlib-compressed compact JSON.  While
EpilogSlurmctld runs, slurmctld refuses `scontrol update job AdminComment=` ("Job has already
finished"), and `sacctmgr modify job ... set AdminComment=` lowercases the value (Slurm 22.05.8,
observed): base64 would be destroyed, base32 survives (it reads back case-insensitively).

The JSON (version 1)::

    {"v": 1, "c": cluster, "j": job id (raw), "r": restart count,
     "p": 1 when records of some node were missing (partial), "n": [node, ...] (the job's nodes),
     "m": [node, ...] (nodes whose records were missing), "k": [model, ...],
     "g": [[node#, gpu index, model#, start, end, util %, mem util %, peak MiB, total MiB,
            energy Wh, uncorrectable ECC, [XID codes], MIG 0/1], ...]}

Times are unix seconds (whole), utilisation in percent with one decimal, memory in MiB,
energy in Wh with two decimals; null = not measured.  Column positions are fixed by
``GPU_FIELDS``; readers ignore columns they do not know (later versions append).
"""
from __future__ import annotations

import base64
import binascii
import json
import zlib
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence

from slurm_gpu.errors import InputError

PREFIX = "sg1:"
VERSION = 1
GPU_FIELDS = ("node", "index", "model", "start", "end", "util_pct", "mem_util_pct", "peak_mib", "total_mib",
              "energy_wh", "ecc_uncorrected", "xids", "mig")
MIB = float(1 << 20)


class GpuUse(NamedTuple):
    node: str
    index: Optional[int]
    model: Optional[str]
    start: Optional[float]
    end: Optional[float]
    util_pct: Optional[float]
    mem_util_pct: Optional[float]
    peak_mib: Optional[int]
    total_mib: Optional[int]
    energy_wh: Optional[float]
    ecc_uncorrected: Optional[int]
    xids: List[int]
    mig: bool


class Summary(NamedTuple):
    cluster: str
    job_id: int
    restart: int
    partial: bool
    nodes: List[str]
    missing: List[str]
    gpus: List[GpuUse]

    def to_json(self) -> Dict[str, Any]:
        return {"cluster": self.cluster, "job_id": self.job_id, "restart": self.restart, "partial": self.partial,
                "nodes": self.nodes, "nodes_missing": self.missing, "gpus": [g._asdict() for g in self.gpus]}


def _r(v: Optional[float], nd: int) -> Optional[float]:
    return None if v is None else round(float(v), nd)


def _i(v: Optional[float]) -> Optional[int]:
    return None if v is None else int(round(float(v)))


def from_records(cluster: str, job_id: int, restart: int, nodes: Sequence[str], rows: Iterable[Dict[str, Any]]
                 ) -> Summary:
    """The summary of a job run from its job_gpus rows (node database or central server columns)."""
    gpus = []
    for row in rows:
        xids = []
        if row.get("xid_events"):
            try:
                xids = sorted({int(x["xid"]) for x in json.loads(row["xid_events"]) if isinstance(x, dict)})
            except (ValueError, TypeError, KeyError):
                xids = []
        energy = row.get("energy_j")
        peak, total = row.get("max_memory_bytes"), row.get("memory_total_bytes")
        gpus.append(GpuUse(
            node=row["node"], index=row.get("gpu_index"), model=row.get("gpu_model"),
            start=_i(row.get("start_time")), end=_i(row.get("end_time")),
            util_pct=_r(row.get("gpu_util_mean_pct"), 1), mem_util_pct=_r(row.get("mem_util_mean_pct"), 1),
            peak_mib=None if peak is None else int(round(peak / MIB)),
            total_mib=None if total is None else int(round(total / MIB)),
            energy_wh=None if energy is None else round(energy / 3600.0, 2),
            ecc_uncorrected=_i(row.get("ecc_uncorrected_delta")), xids=xids,
            mig=bool(row.get("parent_gpu_uuid"))))
    gpus.sort(key=lambda g: (g.node, -1 if g.index is None else g.index))
    seen = {g.node for g in gpus}
    missing = [n for n in nodes if n not in seen]
    return Summary(cluster, int(job_id), int(restart), bool(missing), list(nodes), missing, gpus)


def encode(s: Summary) -> str:
    nodes = list(s.nodes) + sorted({g.node for g in s.gpus} - set(s.nodes))
    models = sorted({g.model for g in s.gpus if g.model})
    n_of = {n: i for i, n in enumerate(nodes)}
    m_of = {m: i for i, m in enumerate(models)}
    doc = {"v": VERSION, "c": s.cluster, "j": s.job_id, "r": s.restart, "p": int(s.partial), "n": nodes,
           "m": s.missing, "k": models,
           "g": [[n_of[g.node], g.index, m_of.get(g.model) if g.model else None, g.start, g.end, g.util_pct,
                  g.mem_util_pct, g.peak_mib, g.total_mib, g.energy_wh, g.ecc_uncorrected, g.xids, int(g.mig)]
                 for g in s.gpus]}
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    packed = zlib.compress(raw, 9)
    return PREFIX + base64.b32encode(packed).decode("ascii").rstrip("=").lower()


def is_ours(text: Optional[str]) -> bool:
    return bool(text) and text.strip().lower().startswith(PREFIX)


def decode(text: str) -> Summary:
    """The summary in an AdminComment written by `encode` (any letter case); InputError if not one."""
    body = text.strip()
    if not body.lower().startswith(PREFIX):
        raise InputError("the job's AdminComment is not a slurm-gpu summary", "another tool may own the field")
    b32 = body[len(PREFIX):].upper()
    try:
        packed = base64.b32decode(b32 + "=" * (-len(b32) % 8))
        doc = json.loads(zlib.decompress(packed).decode("ascii"))
        if not isinstance(doc, dict) or int(doc.get("v", 0)) < 1:
            raise ValueError("not a version-1 document")
        nodes, models = doc["n"], doc["k"]
        gpus = []
        for row in doc["g"]:
            row = list(row) + [None] * (len(GPU_FIELDS) - len(row))
            gpus.append(GpuUse(
                node=nodes[row[0]], index=row[1], model=models[row[2]] if row[2] is not None else None,
                start=row[3], end=row[4], util_pct=row[5], mem_util_pct=row[6], peak_mib=row[7], total_mib=row[8],
                energy_wh=row[9], ecc_uncorrected=row[10], xids=list(row[11] or []), mig=bool(row[12])))
        return Summary(str(doc["c"]), int(doc["j"]), int(doc["r"]), bool(doc["p"]), list(nodes), list(doc["m"]), gpus)
    except (ValueError, TypeError, KeyError, IndexError, zlib.error, binascii.Error) as e:
        raise InputError(f"the job's GPU summary is damaged ({e})",
                         "an admin can write it again: slurm-gpu central annotate --job JOBID") from None


def decode_safe(text: str) -> Optional[Summary]:
    """decode(), or None for a damaged or foreign text."""
    try:
        return decode(text)
    except InputError:
        return None
