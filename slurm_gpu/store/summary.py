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
            energy Wh, uncorrectable ECC, [XID codes], MIG 0/1, GPUs], ...],
     "d": "gpu" | "node" | "central" (what "g" holds; absent: "gpu")}

Times are unix seconds (whole), utilisation in percent with one decimal, memory in MiB,
energy in Wh with two decimals; null = not measured.  Column positions are fixed by
``GPU_FIELDS``; readers ignore columns they do not know (later versions append).

Size: slurmdbd keeps AdminComment in a TEXT column and cuts it at 65,535 bytes while sacctmgr
exits 0, which would leave a summary nobody can decode (about 26 bytes per GPU: ~2,450 GPUs).
``fit`` never returns more than ``MAX_BYTES``: one row per GPU ("d": "gpu") when that fits,
else one row per node with its GPU count in the last column ("d": "node": per-node totals,
means and peaks), else no rows and "d": "central" (the detail is on the central server).

Decoding checks every type (numbers are finite numbers, indices non-negative integers inside
their lists, names strings): a damaged summary is an InputError, never a traceback and never
another node's row.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence

from slurm_gpu.errors import InputError

PREFIX = "sg1:"
VERSION = 1
GPU_FIELDS = ("node", "index", "model", "start", "end", "util_pct", "mem_util_pct", "peak_mib", "total_mib",
              "energy_wh", "ecc_uncorrected", "xids", "mig", "count")
MIB = float(1 << 20)
# slurmdbd's AdminComment column (MySQL TEXT): what is longer is cut, silently (22.05.8).
MAX_BYTES = 65535
DETAILS = ("gpu", "node", "central")


class GpuUse(NamedTuple):
    node: str
    index: Optional[int]  # type: ignore[assignment]  # a field named like tuple's method
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
    count: int = 1  # type: ignore[assignment]  # GPUs this row stands for: >1 only in a per-node summary


class Summary(NamedTuple):
    cluster: str
    job_id: int
    restart: int
    partial: bool
    nodes: List[str]
    missing: List[str]
    gpus: List[GpuUse]
    detail: str = "gpu"  # what gpus holds: one row per GPU, per node, or none ("central")
    # A running job's figures so far (`slurm-gpu efficiency`, docs/efficiency.md): {"t": time of the newest
    # sample, "g": one [idle seconds, [utilisation % per minute of the last hour, None for a minute unseen]]
    # per row of gpus (empty when the rows are per node)}; None: the summary of a job that ended.
    live: Optional[Dict[str, Any]] = None

    def to_json(self) -> Dict[str, Any]:
        out = {"cluster": self.cluster, "job_id": self.job_id, "restart": self.restart, "partial": self.partial,
               "nodes": self.nodes, "nodes_missing": self.missing, "detail": self.detail,
               "gpus": [g._asdict() for g in self.gpus]}
        if self.live is not None:
            out["live"] = self.live
        return out


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
                 + ([g.count] if g.count != 1 else []) for g in s.gpus]}
    if s.detail != "gpu":
        doc["d"] = s.detail
    if s.live is not None:
        doc["l"] = s.live
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    packed = zlib.compress(raw, 9)
    return PREFIX + base64.b32encode(packed).decode("ascii").rstrip("=").lower()


def per_node(s: Summary) -> Summary:
    """The same job in one row per node: GPU count, earliest start, latest end, mean utilisation,
    highest peak, energy and ECC summed, every XID."""
    by_node: Dict[str, List[GpuUse]] = {}
    for g in s.gpus:
        by_node.setdefault(g.node, []).append(g)
    rows = []
    for node, gs in by_node.items():
        models = {g.model for g in gs}
        rows.append(GpuUse(
            node=node, index=None, model=models.pop() if len(models) == 1 else None,
            start=_least([g.start for g in gs]), end=_most([g.end for g in gs]),
            util_pct=_mean([g.util_pct for g in gs]), mem_util_pct=_mean([g.mem_util_pct for g in gs]),
            peak_mib=_most([g.peak_mib for g in gs]), total_mib=_most([g.total_mib for g in gs]),
            energy_wh=_sum([g.energy_wh for g in gs], 2), ecc_uncorrected=_sum([g.ecc_uncorrected for g in gs], 0),
            xids=sorted({x for g in gs for x in g.xids}), mig=any(g.mig for g in gs),
            count=sum(g.count for g in gs)))
    return s._replace(gpus=rows, detail="node", live=None if s.live is None else {"t": s.live["t"], "g": []})


def _known(vals: Iterable[Any]) -> List[Any]:
    return [v for v in vals if v is not None]


def _least(vals: Iterable[Any]) -> Any:
    return min(_known(vals), default=None)


def _most(vals: Iterable[Any]) -> Any:
    return max(_known(vals), default=None)


def _mean(vals: Iterable[Optional[float]]) -> Optional[float]:
    known = _known(vals)
    return round(sum(known) / len(known), 1) if known else None


def _sum(vals: Iterable[Any], nd: int) -> Any:
    known = _known(vals)
    if not known:
        return None
    return round(sum(known), nd) if nd else int(sum(known))


def fit(s: Summary, limit: int = MAX_BYTES) -> str:
    """The encoded summary in at most `limit` bytes: per GPU, else per node, else a marker that the
    detail is on the central server (docs/job.md)."""
    smaller = [per_node(s)] if s.detail == "gpu" else []
    for candidate in [s, *smaller, s._replace(gpus=[], detail="central")]:
        text = encode(candidate)
        if len(text) <= limit:
            return text
    raise ValueError(f"even the marker of job {s.job_id} exceeds {limit} bytes")  # thousands of node names


# The AdminComment `slurm-gpu efficiency enforce` sets on a job it cancels (efficiency/enforce.py): ours, so
# that the controller epilog may write the job's summary over it.
CANCEL_NOTE = "slurm-gpu cancelled this job"
_CANCEL_TAIL = "; see slurm-gpu efficiency actions"


def cancel_note(why: str) -> str:
    """The AdminComment of a job the idle policy cancels: 'slurm-gpu cancelled this job: WHY; see ...'."""
    return f"{CANCEL_NOTE}: {why}{_CANCEL_TAIL}"


def is_cancel_note(text: Optional[str]) -> bool:
    """Our cancel note, whole: a text an admin or another tool wrote that merely starts like it is not ours."""
    t = (text or "").strip()
    return t.startswith(CANCEL_NOTE + ": ") and t.endswith(_CANCEL_TAIL)


def is_ours(text: Optional[str]) -> bool:
    return (text or "").strip().lower().startswith(PREFIX) or is_cancel_note(text)


def decode(text: str) -> Summary:
    """The summary in an AdminComment written by `encode` (any letter case); InputError if not one."""
    body = text.strip()
    if not body.lower().startswith(PREFIX):
        raise InputError("the job's AdminComment is not a slurm-gpu summary", "another tool may own the field")
    b32 = body[len(PREFIX):].upper()
    try:
        packed = base64.b32decode(b32 + "=" * (-len(b32) % 8))
        return _from_doc(json.loads(zlib.decompress(packed).decode("ascii")))
    except (ValueError, TypeError, KeyError, IndexError, zlib.error, binascii.Error) as e:
        raise InputError(f"the job's GPU summary is damaged ({e})",
                         "an admin can write it again: slurm-gpu central annotate --job JOBID") from None


def _from_doc(doc: Any) -> Summary:
    if not isinstance(doc, dict) or _int(doc.get("v", 0), "v") < 1:
        raise ValueError("not a version-1 document")
    nodes, models = _strings(doc["n"], "n"), _strings(doc["k"], "k")
    missing = _strings(doc["m"], "m")
    rows = doc["g"]
    if not isinstance(rows, list):
        raise ValueError("g is not a list")
    detail = doc.get("d", "gpu")
    if detail not in DETAILS:
        raise ValueError(f"d is not one of {', '.join(DETAILS)}")
    cluster = doc["c"]
    if not isinstance(cluster, str) or not isinstance(doc["p"], int):
        raise ValueError("c is not a name or p not 0/1")
    gpus = [_gpu(row, nodes, models) for row in rows]
    return Summary(cluster, _int(doc["j"], "j"), _int(doc["r"], "r"), bool(doc["p"]), nodes, missing, gpus, detail,
                   _live(doc["l"], len(gpus)) if "l" in doc else None)


def _live(v: Any, rows: int) -> Dict[str, Any]:
    if not isinstance(v, dict) or _number(v.get("t")) is None or not isinstance(v.get("g"), list):
        raise ValueError("l is not a running job's figures")
    per = v["g"]
    if per and len(per) != rows:
        raise ValueError(f"l has {len(per)} rows for {rows} GPUs")
    for row in per:
        if not isinstance(row, list) or len(row) != 2 or not isinstance(row[1], list) or len(row[1]) > 1440:
            raise ValueError("a row of l is not [idle seconds, [points]]")
        _number(row[0])
        for x in row[1]:
            if x is not None:
                _number(x)
    return {"t": v["t"], "g": per}


def _gpu(row: Any, nodes: List[str], models: List[str]) -> GpuUse:
    if not isinstance(row, list) or len(row) < 1:
        raise ValueError("a GPU row is not a list")
    row = list(row) + [None] * (len(GPU_FIELDS) - len(row))
    model = row[2]
    xids = row[11] if row[11] is not None else []
    if not isinstance(xids, list):
        raise ValueError("XIDs are not a list")
    count = row[13] if row[13] is not None else 1
    return GpuUse(
        node=nodes[_index(row[0], nodes, "node")], index=_opt_int(row[1], "GPU index"),
        model=None if model is None else models[_index(model, models, "model")],
        start=_number(row[3]), end=_number(row[4]), util_pct=_number(row[5]), mem_util_pct=_number(row[6]),
        peak_mib=_opt_int(row[7], "peak"), total_mib=_opt_int(row[8], "total"), energy_wh=_number(row[9]),
        ecc_uncorrected=_opt_int(row[10], "ECC"), xids=[_int(x, "XID") for x in xids],
        mig=bool(_int(row[12] if row[12] is not None else 0, "MIG")), count=_int(count, "GPU count"))


def _int(v: Any, what: str) -> int:
    """A non-negative integer (a boolean is not one)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} is not a non-negative integer: {v!r}"[:120])
    return v


def _opt_int(v: Any, what: str) -> Optional[int]:
    return None if v is None else _int(v, what)


def _index(v: Any, within: List[str], what: str) -> int:
    i = _int(v, f"{what} index")
    if i >= len(within):
        raise ValueError(f"{what} index {i} is past the list of {len(within)}")
    return i


def _number(v: Any) -> Optional[float]:
    """A finite number or None (NaN and infinities are damage, as are strings)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"not a finite number: {v!r}"[:120])
    return v


def _strings(v: Any, what: str) -> List[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{what} is not a list of names")
    return list(v)


def decode_safe(text: str) -> Optional[Summary]:
    """decode(), or None for a damaged or foreign text."""
    try:
        return decode(text)
    except InputError:
        return None
