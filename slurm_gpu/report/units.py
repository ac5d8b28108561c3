"""Figures for people: the unit that suits a table's figures (GPU-h, GPU-min, GPU-s; kWh, Wh), a
job's GPU time as Slurm prints elapsed time, and the headers and cell formats of the table,
Markdown and HTML outputs.  JSON and CSV always carry GPU-hours and kWh (6 decimals)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.report.tables import Table

TIME_UNITS = (("GPU-h", 1.0), ("GPU-min", 60.0), ("GPU-s", 3600.0))
ENERGY_UNITS = (("kWh", 1.0), ("Wh", 1e3))
TIME_COLUMNS = ("gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle", "gpu_hours_no_util", "gpu_hours")


def pick_unit(largest: Optional[float], units: Sequence[Tuple[str, float]]) -> Tuple[str, float]:
    """The largest unit in which `largest` is at least 1 (the smallest unit for 0 or nothing)."""
    for name, per in units:
        if largest is not None and largest * per >= 1:
            return name, per
    return units[-1]


def format_duration(hours: Optional[float]) -> str:
    """GPU time as Slurm prints elapsed and CPU time: [D-]HH:MM:SS, to the second."""
    if hours is None:
        return "-"
    sec = int(round(hours * 3600))
    days, sec = divmod(sec, 86400)
    hh, sec = divmod(sec, 3600)
    mm, sec = divmod(sec, 60)
    return (f"{days}-" if days else "") + f"{hh:02d}:{mm:02d}:{sec:02d}"


def format_gpu_time(hours: float) -> str:
    name, per = pick_unit(hours, TIME_UNITS)
    return f"{hours * per:.2f} {name}"


def human_view(table: Table) -> Tuple[Tuple[str, ...], Dict[str, Callable[[Any], str]]]:
    """Headers and cell formats for the table, Markdown and HTML outputs.

    Summary: GPU time in GPU-h, GPU-min or GPU-s and energy in kWh or Wh, whichever keeps the
    largest figure of the table (TOTAL included) at 1 or more, 2 decimals.  jobs / job: GPU time
    of a job as [D-]HH:MM:SS (like sacct's CPUTime: exact to the second however short the job);
    energy as in the summary.
    """
    rows = list(table.rows) + ([table.total] if table.total else [])

    def largest(cols: Sequence[str]) -> Optional[float]:
        vals: List[float] = [v for r in rows for c in cols if isinstance(v := r.get(c), (int, float))]
        return max(vals) if vals else None

    formats: Dict[str, Callable[[Any], str]] = {}
    headers = list(table.headers)
    e_name, e_per = pick_unit(largest(["energy_kwh"]), ENERGY_UNITS)
    t_name, t_per = pick_unit(largest(TIME_COLUMNS), TIME_UNITS)
    for i, col in enumerate(table.columns):
        if col in TIME_COLUMNS:
            if table.kind == "summary":
                headers[i] = headers[i].replace("GPU-h", t_name)
                formats[col] = partial(_scaled, per=t_per)
            else:
                headers[i] = headers[i].replace("GPU-h", "GPU time")
                formats[col] = format_duration
        elif col == "energy_kwh":
            headers[i] = headers[i].replace("kWh", e_name)
            formats[col] = partial(_scaled, per=e_per)
    return tuple(headers), formats


def _scaled(v: Optional[float], per: float) -> str:
    return "-" if v is None else f"{v * per:.2f}"
