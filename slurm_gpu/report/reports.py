"""The three reports (the summary by group, the job list, one job) and the HTML page's chart data,
as Tables from one source (report/sources.py: node files or the central server).

How the numbers are computed (docs/report.md is the long form):

- The unit of record is one ``job_gpus`` row: one job run (cluster, job_id, restart_count) on one
  node and one GPU, with its start/end time and the GPU's mean utilisation, memory
  utilisation, peak memory and energy over that time.
- Time window: a record counts when its interval [start, end) overlaps [since, until); it
  contributes only the overlapping part (as sreport does).  Energy is prorated by the same
  fraction.  Day/week/month groups split a record the same way at bucket boundaries.
- ``gpu_hours_alloc`` = sum of overlap seconds / 3600.
- ``gpu_util_mean_pct`` = time-weighted mean of utilisation over records that report it;
  records with NULL utilisation are left out of the mean and shown in ``gpu_hours_no_util``.
- ``gpu_hours_used`` = sum(overlap * util / 100) / 3600 over records that report utilisation
  (= alloc x mean util when every record reports it; unknown utilisation never counts as used).
- ``gpu_hours_idle`` = overlap of records whose utilisation is known and < the idle threshold
  (unknown utilisation never counts as idle).
- ``jobs`` = distinct (cluster, job_id) with time in the group: a requeued job counts once.
- Records with zero duration carry no GPU time and are not counted.
- Records whose times cannot be placed (end before start, end outside 2000-2099 or not a
  number, longer than ten years) are skipped and counted in Table.notes; utilisation outside
  0..100 % counts as 0 or 100 (also noted).  No figure is ever NaN or infinite.
- TOTAL lines come from the groups' unrounded sums, computed like any group's figures.

"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.report import plan as P
from slurm_gpu.report.sources import ReportSource, describe_files
from slurm_gpu.report.sql import SKIP_REASONS
from slurm_gpu.report.tables import (
    GIB,
    HOURS_ND,
    JOB_DETAIL_COLUMNS,
    JOB_DETAIL_HEADERS,
    JOB_LIST_COLUMNS,
    JOB_LIST_HEADERS,
    SUMMARY_COLUMNS,
    SUMMARY_HEADERS,
    Table,
    figures,
    rounded,
    total,
)
from slurm_gpu.report.timespec import format_time
from slurm_gpu.report.units import format_gpu_time


def _notes(src: ReportSource, clamped_s: float) -> Tuple[str, ...]:
    """What the figures leave out or adjusted, for stderr (and the HTML page)."""
    notes = []
    skipped = src.skipped()
    if skipped:
        why = ", ".join(f"{n} {SKIP_REASONS[k]}" for k, n in skipped.items())
        notes.append(f"skipped {sum(skipped.values())} record(s) that cannot be placed in time ({why}); "
                     "`slurm-gpu report job JOBID` does not show them either: query job_gpus directly")
    if clamped_s > 0:
        notes.append(f"{format_gpu_time(clamped_s / 3600)} of GPU time carry a utilisation outside 0-100 % "
                     "(a driver or storage fault): counted as 0 % or 100 %")
    return tuple(notes)


def summary(src: ReportSource, by: Sequence[str]) -> Table:
    rows: List[Dict[str, Any]] = []
    raws = P.summary_raw(src, by)
    for raw in raws:
        row = {k: raw[k] for k in by}
        row["jobs"] = raw["jobs"]
        row.update(figures(raw))
        rows.append(row)
    headers = tuple(k.replace("-", " ") for k in by) + SUMMARY_HEADERS
    title = "GPU usage by " + ", ".join(by)
    line = total(raws, by) if raws else None
    notes = _notes(src, sum(r.get("clamped_s") or 0.0 for r in raws))
    return Table(title, tuple(by) + SUMMARY_COLUMNS, headers, tuple(rows), tuple(by), "summary", line, notes)


def jobs(src: ReportSource, sort: Optional[str] = None, limit: Optional[int] = None, idle_only: bool = False) -> Table:
    """One row per job run (cluster, job_id, restart) with its GPUs' figures; `idle_only`: jobs with an idle GPU."""
    result = P.job_rows(src, sort, limit, idle_only)
    rows = [_job_row(raw, src.query.tz) for raw in result]
    title = "Jobs that held GPUs idle" if idle_only else "GPU usage by job"
    notes = _notes(src, sum(r.get("clamped_s") or 0.0 for r in result))
    columns: Tuple[str, ...] = JOB_LIST_COLUMNS
    headers: Tuple[str, ...] = JOB_LIST_HEADERS
    if idle_only:
        # What the idle policy did while each job ran (docs/efficiency.md): its warnings and cancels.
        done = src.idle_actions([(str(r["cluster"]), int(r["job_id"]), int(r["restart"])) for r in rows])
        for r in rows:
            r["idle_policy"] = done.get((str(r["cluster"]), int(r["job_id"]), int(r["restart"])))
        columns, headers = columns + ("idle_policy",), headers + ("idle policy",)
    return Table(title, columns, headers, tuple(rows), ("cluster", "job_id", "restart"), "jobs", notes=notes)


def _job_row(raw: Dict[str, Any], tz: str) -> Dict[str, Any]:
    row = {
        "cluster": raw["cluster"], "job_id": raw["job_id"], "restart": raw["restart_count"],
        "user": raw["user"], "account": raw["account"], "partition": raw["partition"],
        "start": format_time(raw["start_s"], tz), "end": format_time(raw["end_s"], tz),
        "nodes": raw["nodes"], "gpus": raw["gpus"],
    }
    row.update(figures(raw))
    row["gpu_util_min_pct"] = rounded(raw["util_min"], 2)
    row["idle_gpus"] = raw["idle_gpus"] or 0
    return row


def job(src: ReportSource) -> Table:
    """Every record of one job (all restarts, nodes and GPUs), unclipped by any window."""
    q = src.query
    if q.job_id is None:
        raise InputError("no job id given", "slurm-gpu report job JOBID")
    records = P.job_records(src)
    rows = [_record_row(raw, q.tz) for raw in records]
    notes = _notes(src, sum(raw["clamped_s"] or 0.0 for raw in records))
    if not rows:
        raise InputError(f"no GPU records for job {q.job_id} in {describe_files(src.files)}"
                         + (f" ({'; '.join(notes)})" if notes else ""),
                         "check the job id, --cluster and --db (jobs without GPUs are not recorded)")
    return Table(f"Job {q.job_id}: GPUs", JOB_DETAIL_COLUMNS, JOB_DETAIL_HEADERS, tuple(rows),
                 ("cluster", "job_id", "restart", "node", "gpu_index"), "job", notes=notes)


def _record_row(raw: Dict[str, Any], tz: str) -> Dict[str, Any]:
    dur = raw["end_time"] - raw["start_time"]
    return {
        "cluster": raw["cluster"], "job_id": raw["job_id"], "restart": raw["restart_count"], "node": raw["node"],
        "gpu_index": raw["gpu_index"], "gpu_uuid": raw["gpu_uuid"], "gpu_model": raw["gpu_model"],
        "user": raw["user"], "account": raw["account"], "partition": raw["partition"],
        "start": format_time(raw["start_time"], tz), "end": format_time(raw["end_time"], tz),
        "gpu_hours": rounded(dur / 3600, HOURS_ND), "gpu_util_mean_pct": rounded(raw["util"], 2),
        "mem_util_mean_pct": rounded(raw["mem_util"], 2),
        "peak_memory_gib": rounded(raw["max_memory_bytes"] / GIB) if raw["max_memory_bytes"] is not None else None,
        "energy_kwh": rounded(raw["energy_j"] / 3.6e6, HOURS_ND) if raw["energy_j"] is not None else None,
        "idle": None if raw["is_idle"] is None else bool(raw["is_idle"]),
        "processes": raw["process_count"], "ecc_corrected": raw["ecc_corrected_delta"],
        "ecc_uncorrected": raw["ecc_uncorrected_delta"], "retired_pages": raw["retired_pages_delta"],
        "remapped_rows": raw["remapped_rows_delta"], "clock_event_reasons": raw["clock_event_reasons"],
        "xid_events": raw["xid_events"],
    }


def utilisation_histogram(src: ReportSource) -> List[Tuple[str, float]]:
    """GPU-hours by per-GPU mean utilisation, in 10 % bins (plus 'n/a' for records without it)."""
    got = P.utilisation_bins(src)
    out = [(f"{10 * i}-{10 * i + 10}%", rounded(got.get(i, 0.0), HOURS_ND) or 0.0) for i in range(P.UTIL_BINS)]
    if got.get(-1):
        out.append(("n/a", rounded(got[-1], HOURS_ND) or 0.0))
    return out


def energy_series(src: ReportSource) -> Tuple[str, List[Tuple[str, Optional[float]]]]:
    """Energy (kWh) per day, week or month (whichever gives a readable number of points)."""
    span = P.records_span(src)
    if span is None:
        return "day", []
    lo, hi = span
    span_days = (hi - lo) / 86400
    unit = "day" if span_days <= 120 else "week" if span_days <= 800 else "month"
    table = summary(src, (unit,))
    return unit, [(r[unit], r["energy_kwh"]) for r in table.rows]
