"""The SQL every report shares: which records count (the window, the filters, plausible times),
the overlap of a record with the window or a calendar bucket, the raw sums of a group, and the
records that cannot be placed in time.

Written once for SQLite and the central server alike: double-quoted names and `||` (the
server's session runs with ANSI_QUOTES and PIPES_AS_CONCAT); the few spellings that differ come
from the source (report/sources.py: LEAST/GREATEST, the unary plus, the indexed duration).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from slurm_gpu.report.query import Query

# A record's times must be plausible: anything else is a clock or storage fault.  Such records
# are skipped and counted (Table.notes), never allowed to turn into absurd or infinite figures.
TIME_MIN_S = 946684800.0  # 2000-01-01T00:00:00Z: earliest end time
TIME_MAX_S = 4102444800.0  # 2100-01-01T00:00:00Z: end times must be before it
MAX_RECORD_S = 3653 * 86400.0  # ten years: no allocation lasts longer

# Utilisation is a percentage: a value outside 0..100 (a driver or storage fault) counts as 0 or
# 100.  (CASE, not MIN/MAX: half the cost per record; NULL stays NULL.)
UTIL = "CASE WHEN gpu_util_mean_pct > 100 THEN 100.0 WHEN gpu_util_mean_pct < 0 THEN 0.0 ELSE gpu_util_mean_pct END"
MEM_UTIL = "CASE WHEN mem_util_mean_pct > 100 THEN 100.0 WHEN mem_util_mean_pct < 0 THEN 0.0 ELSE mem_util_mean_pct END"
# UTIL < :thr without computing UTIL (thresholds lie in 0..100).
IDLE = "(gpu_util_mean_pct < :thr AND (:thr > 0 OR gpu_util_mean_pct >= 0))"
OUT_OF_RANGE = "(gpu_util_mean_pct NOT BETWEEN 0 AND 100 OR mem_util_mean_pct NOT BETWEEN 0 AND 100)"


def valid_sql() -> str:
    # The unary + keeps SQLite from walking the end_time or duration index for these (nearly
    # always true) conditions: a table lookup per row costs more than the scan.
    return ("end_time > start_time AND +end_time >= :tmin AND +end_time < :tmax "
            "AND +end_time - start_time <= :maxdur")


def filters(q: Query, params: Dict[str, Any], column: Callable[[str], str] = lambda c: f'"{c}"',
             prefix: str = "") -> List[str]:
    """The query's filters as conditions on column(name), their values in params (prefix, name, i)."""
    conds = []
    for col, vals in (("user", q.users), ("account", q.accounts), ("partition", q.partitions),
                      ("node", q.nodes), ("cluster", q.clusters)):
        if vals:
            names = []
            for i, v in enumerate(vals):
                params[f"{prefix}{col}{i}"] = v
                names.append(f":{prefix}{col}{i}")
            conds.append(f'{column(col)} IN ({", ".join(names)})')
    if q.job_id is not None:
        conds.append("job_id = :job_id")
        params["job_id"] = q.job_id
    return conds


def where(q: Query, use_index: bool = True) -> Tuple[str, Dict[str, Any]]:
    conds = [valid_sql()]
    params: Dict[str, Any] = {"tmin": TIME_MIN_S, "tmax": TIME_MAX_S, "maxdur": MAX_RECORD_S}
    if q.since_s is not None:
        # The unary + hides the column from the planner: a full scan beats the index for wide windows.
        conds.append(("end_time" if use_index else "+end_time") + " > :since")
        params["since"] = q.since_s
    if q.until_s is not None:
        conds.append("start_time < :until")
        params["until"] = q.until_s
    conds += filters(q, params)
    return " AND ".join(conds), params


SKIP_REASONS = {
    "end_before_start": "end before start",
    "implausible_time": "end time outside 2000-2099 or not a number",
    "too_long": "longer than ten years",
}


def count_skipped(conn: Any, table: str, q: Query, span: str = "end_time - start_time",
                   plus: str = "+") -> Dict[str, int]:
    """Records (matching the filters, in any window) that cannot be placed in time, by reason.

    Each count is a range of the duration or end_time index (O(log n) plus the records found)
    where the file has them; the conditions are disjoint.  `span` names the indexed duration:
    SQLite matches the expression index on end_time - start_time, the central server needs the
    name of its indexed virtual column; `plus` hides a column from SQLite's planner.
    """
    params: Dict[str, Any] = {"tmin": TIME_MIN_S, "tmax": TIME_MAX_S, "maxdur": MAX_RECORD_S}
    filt = "".join(" AND " + c for c in filters(q, params))
    checks = {
        "end_before_start": f"{span} < 0",
        "implausible_time": (f"end_time < :tmin AND NOT ({plus}{span} < 0)",
                             f"end_time >= :tmax AND NOT ({plus}{span} < 0)"),
        "too_long": f"{span} > :maxdur AND {plus}end_time >= :tmin AND {plus}end_time < :tmax",
    }
    out = {}
    for reason, conds in checks.items():
        n = sum(conn.execute(f"SELECT COUNT(*) FROM {table} WHERE {cond}{filt}", params).fetchone()[0]
                for cond in ((conds,) if isinstance(conds, str) else conds))
        if n:
            out[reason] = n
    return out


def overlap_sql(q: Query, bucketed: bool = False, src: Any = None) -> str:
    """Seconds of the record inside the window (and inside the calendar bucket when bucketed)."""
    least, greatest = (src.LEAST, src.GREATEST) if src is not None else ("MIN", "MAX")
    if bucketed:  # the calendar buckets are already clipped to the window
        return f"({least}(end_time, b_end) - {greatest}(start_time, b_start))"
    hi = f"{least}(end_time, :until)" if q.until_s is not None else "end_time"
    lo = f"{greatest}(start_time, :since)" if q.since_s is not None else "start_time"
    return f"({hi} - {lo})"


def energy_sql(q: Query, t: str, bucketed: bool) -> str:
    if not bucketed and q.since_s is None and q.until_s is None:
        return "energy_j"
    return f"energy_j * {t} / (end_time - start_time)"


def aggregates_sql(t: str, e: str) -> str:
    return f"""SUM({t}) AS alloc_s,
  SUM({t} * {UTIL}) AS util_pct_s,
  SUM(CASE WHEN gpu_util_mean_pct IS NOT NULL THEN {t} END) AS util_known_s,
  SUM({t} * {MEM_UTIL}) AS mem_pct_s,
  SUM(CASE WHEN mem_util_mean_pct IS NOT NULL THEN {t} END) AS mem_known_s,
  MAX(max_memory_bytes) AS peak_bytes,
  SUM({e}) AS energy_j,
  SUM(CASE WHEN {IDLE} THEN {t} END) AS idle_s,
  SUM(CASE WHEN {OUT_OF_RANGE} THEN {t} END) AS clamped_s"""


def dict_rows(cur: Any) -> Iterator[Dict[str, Any]]:
    names = [d[0] for d in cur.description]
    for tup in cur:
        yield dict(zip(names, tup))



PART = "/*partition*/"


def bucket_tree(col: str, buckets: Sequence[Tuple[float, float, str]], leaf: Callable[[int], str],
                 lo: int = 0, hi: Optional[int] = None) -> str:
    """A balanced CASE over the bucket starts: log2(buckets) comparisons per row instead of a join."""
    hi = len(buckets) if hi is None else hi
    if hi - lo == 1:
        return leaf(lo)
    mid = (lo + hi) // 2
    return (f"CASE WHEN {col} < {buckets[mid][0]!r} THEN {bucket_tree(col, buckets, leaf, lo, mid)} "
            f"ELSE {bucket_tree(col, buckets, leaf, mid, hi)} END")
