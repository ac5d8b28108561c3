"""A report's result (Table), its columns, and how raw sums become figures.

Raw sums (seconds, percent-seconds, joules, bytes) come from the SQL (report/sql.py) per group
or per job; Sums adds them up, for the partial results of one group computed on several threads
and for the TOTAL line alike, and figures() turns them into the report's columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from slurm_gpu import groupkeys

SUMMARY_COLUMNS = ("jobs", "gpu_hours_alloc", "gpu_hours_used", "gpu_util_mean_pct", "mem_util_mean_pct",
                   "peak_memory_gib", "energy_kwh", "gpu_hours_idle", "gpu_hours_no_util")
SUMMARY_HEADERS = ("jobs", "GPU-h alloc", "GPU-h used", "util %", "mem util %", "peak mem GiB", "energy kWh",
                   "idle GPU-h", "GPU-h no util")

JOB_LIST_COLUMNS = ("cluster", "job_id", "restart", "user", "account", "partition", "start", "end", "nodes", "gpus",
                    "gpu_hours_alloc", "gpu_hours_used", "gpu_util_mean_pct", "gpu_util_min_pct",
                    "mem_util_mean_pct", "peak_memory_gib", "energy_kwh", "idle_gpus", "gpu_hours_idle")
JOB_LIST_HEADERS = ("cluster", "job", "restart", "user", "account", "partition", "start", "end", "nodes", "gpus",
                    "GPU-h alloc", "GPU-h used", "util %", "min util %", "mem util %", "peak mem GiB",
                    "energy kWh", "idle GPUs", "idle GPU-h")

JOB_DETAIL_COLUMNS = ("cluster", "job_id", "restart", "node", "gpu_index", "gpu_uuid", "gpu_model", "user", "account",
                      "partition", "start", "end", "gpu_hours", "gpu_util_mean_pct", "mem_util_mean_pct",
                      "peak_memory_gib", "energy_kwh", "idle", "processes", "ecc_corrected", "ecc_uncorrected",
                      "retired_pages", "remapped_rows", "clock_event_reasons", "xid_events")
JOB_DETAIL_HEADERS = ("cluster", "job", "restart", "node", "gpu", "uuid", "model", "user", "account", "partition",
                      "start", "end", "GPU-h", "util %", "mem util %", "peak mem GiB", "energy kWh", "idle",
                      "procs", "ecc corr", "ecc uncorr", "retired pages", "remapped rows", "clock events", "xids")

GIB = float(1 << 30)


@dataclass(frozen=True)
class Table:
    """A report result: rows are dicts keyed by ``columns``; ``headers`` are the human column titles."""

    title: str
    columns: Tuple[str, ...]
    headers: Tuple[str, ...]
    rows: Tuple[Dict[str, Any], ...]
    keys: Tuple[str, ...] = ()  # the group-by columns (summary) or identity columns
    kind: str = "summary"  # summary, jobs or job
    total: Optional[Dict[str, Any]] = None  # summary: the TOTAL line, from unrounded sums
    notes: Tuple[str, ...] = ()  # records skipped or adjusted, said on stderr


HOURS_ND = 6  # GPU-hours and kWh in JSON/CSV: 6 decimals resolve 0.004 s and 0.004 J


def rounded(v: Optional[float], nd: int = 3) -> Optional[float]:
    """Rounded; None for a missing or non-finite value (an overflowing sum): JSON never gets Infinity/NaN."""
    if v is None or not math.isfinite(v):
        return None
    return round(v, nd)


def figures(row: Dict[str, Any]) -> Dict[str, Any]:
    """Turn raw sums (seconds, percent-seconds, joules, bytes) into report columns."""
    alloc = row["alloc_s"] or 0.0
    known = row["util_known_s"] or 0.0
    mem_known = row["mem_known_s"] or 0.0
    return {
        "gpu_hours_alloc": rounded(alloc / 3600, HOURS_ND),
        "gpu_hours_used": rounded((row["util_pct_s"] or 0.0) / 100 / 3600, HOURS_ND),
        "gpu_util_mean_pct": rounded(row["util_pct_s"] / known, 2) if known > 0 and row["util_pct_s"] is not None else None,
        "mem_util_mean_pct": rounded(row["mem_pct_s"] / mem_known, 2) if mem_known > 0 and row["mem_pct_s"] is not None else None,
        "peak_memory_gib": rounded(row["peak_bytes"] / GIB) if row["peak_bytes"] is not None else None,
        "energy_kwh": rounded(row["energy_j"] / 3.6e6, HOURS_ND) if row["energy_j"] is not None else None,
        "gpu_hours_idle": rounded((row["idle_s"] or 0.0) / 3600, HOURS_ND),
        "gpu_hours_no_util": rounded(max(alloc - known, 0.0) / 3600, HOURS_ND),
    }


# The --by keys whose groups never share a job (slurm_gpu/groupkeys.py): their job counts add up.
ONE_GROUP_PER_JOB: FrozenSet[str] = frozenset(k.name for k in groupkeys.KEYS if k.one_per_job)

SUM_FIELDS = ("jobs", "alloc_s", "util_pct_s", "util_known_s", "mem_pct_s", "mem_known_s", "energy_j", "idle_s",
              "clamped_s")


def _add(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return b if a is None else a if b is None else a + b


class Sums:
    """Raw sums added up, NULL (None) meaning no value yet; the largest peak is kept.  `row` starts
    as a copy of `first` (its group keys included) or empty."""

    def __init__(self, first: Optional[Dict[str, Any]] = None):
        self.row: Dict[str, Any] = dict(first) if first is not None else dict.fromkeys(SUM_FIELDS + ("peak_bytes",))

    def add(self, raw: Dict[str, Any]) -> None:
        row = self.row
        for f in SUM_FIELDS:
            row[f] = _add(row[f], raw.get(f))
        if raw["peak_bytes"] is not None and (row["peak_bytes"] is None or raw["peak_bytes"] > row["peak_bytes"]):
            row["peak_bytes"] = raw["peak_bytes"]


def merge_partials(parts: Sequence[List[Dict[str, Any]]], by: Sequence[str]) -> List[Dict[str, Any]]:
    """Per-group raw sums of disjoint partitions of the records, as one pass over them would give."""
    if len(parts) == 1:
        return parts[0]
    merged: Dict[Tuple[Any, ...], Sums] = {}
    for rows in parts:
        for row in rows:
            key = tuple(row[k] for k in by)
            have = merged.get(key)
            if have is None:
                merged[key] = Sums(row)
            else:
                have.add(row)
    # SQLite's order: NULL first, then text in byte order (= code point order for UTF-8).
    return [merged[k].row for k in sorted(merged, key=lambda key: tuple((v is not None, v) for v in key))]


def total(raws: Sequence[Dict[str, Any]], by: Sequence[str]) -> Dict[str, Any]:
    """The TOTAL line: the same figures as a group's, from the groups' unrounded sums."""
    acc = Sums()
    for raw in raws:
        acc.add(raw)
    out: Dict[str, Any] = {k: None for k in by}
    out[by[0]] = "TOTAL"
    # A job appears in several groups when grouping by node, model or time: its count is not additive.
    out["jobs"] = acc.row["jobs"] if all(k in ONE_GROUP_PER_JOB for k in by) else None
    out.update(figures(acc.row))
    return out


def merge_sorted(parts: List[List[Dict[str, Any]]], descending: bool, limit: Optional[int]) -> List[Dict[str, Any]]:
    """Partitions each sorted and limited on their own, merged as ORDER BY would (NULLs first
    ascending, last descending; ties by cluster, job id, restart)."""
    if len(parts) == 1:
        return parts[0]
    merged = sorted((r for part in parts for r in part), key=lambda r: (r["cluster"], r["job_id"], r["restart_count"]))
    merged.sort(key=lambda r: (r["_sortkey"] is not None, r["_sortkey"]), reverse=descending)
    return merged[:limit] if limit is not None else merged
