"""SQL planning for the summary and the job list: which plan answers `--by` (the central server's
rollups, one index range per group through a covering index, or one pass over the records),
and how a large single file is spread over threads (fan_out: sqlite releases the GIL) with the
partial results merged into what one pass gives (report/tables.py).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from slurm_gpu.errors import InputError
from slurm_gpu.report import sql as S
from slurm_gpu.report.calendar import calendar
from slurm_gpu.report.query import GROUP_KEYS, TIME_KEYS
from slurm_gpu.report.sources import ReportSource
from slurm_gpu.report.tables import JOB_LIST_COLUMNS, merge_partials, merge_sorted

T = TypeVar("T")
R = TypeVar("R")


def _calendar_for(src: ReportSource, unit: str) -> List[Tuple[float, float, str]]:
    """Buckets for the window, or for the data's time range where the window is open."""
    span = records_span(src)
    return [] if span is None else calendar(span[0], span[1], unit, src.query.tz)


@dataclass(frozen=True)
class SummaryPlan:
    """The aggregation for `report --by`: SQL with parameters, plus the calendar it uses (if any)."""

    sql: str
    params: Dict[str, Any]
    buckets: Tuple[Tuple[float, float, str], ...] = ()
    time_key: Optional[str] = None  # the column holding a bucket index, turned into its label

    def parts(self, n: int) -> List["SummaryPlan"]:
        """The plan as is (n = 1), or once per job_id partition (partitioned())."""
        return [SummaryPlan(sql, self.params, self.buckets, self.time_key) for sql in partitioned(self.sql, n)]

    def run(self, src: ReportSource, conn: Any) -> List[Dict[str, Any]]:
        if self.buckets:
            src.install_calendar(conn, self.buckets)
        rows = list(S.dict_rows(conn.execute(self.sql.replace(S.PART, ""), self.params)))
        if self.time_key:
            for row in rows:
                row[self.time_key] = self.buckets[row[self.time_key]][2]
        return rows


def summary_plan(src: ReportSource, by: Sequence[str]) -> Optional[SummaryPlan]:
    """`report --by ...` as one SELECT: used where the covering indexes do not apply (a v1 file,
    merged files, several plain keys, a filter on another column, a narrow --since), and what the
    benchmark runs in the sqlite3 shell.

    None when a calendar grouping finds no records at all.
    """
    q = src.query
    where, params = S.where(q, use_index=src.use_end_index())
    where += S.PART
    params["thr"] = q.idle_threshold_pct
    unit = next((k for k in by if k in TIME_KEYS), None)
    # The unary + keeps SQLite from walking a non-covering index to avoid a sort: a table lookup
    # per row costs more than sorting.  A covering index (schema v2) is walked: no sort at all.
    plus = "" if _covering_key(src, by) else src.PLUS
    group = ", ".join(f"{plus}\"{k}\"" for k in by)
    jobs = "COUNT(DISTINCT job_id)" if src.single_cluster() else "COUNT(DISTINCT cluster || '/' || job_id)"
    if unit is None:
        t = S.overlap_sql(q, src=src)
        keys = ", ".join(f"{GROUP_KEYS[k]} AS \"{k}\"" for k in by)
        sql = (f"SELECT {keys},\n  {jobs} AS jobs,\n  {S.aggregates_sql(t, S.energy_sql(q, t, False))}\n"
               f"FROM {src.table}\nWHERE {where}\nGROUP BY {group}\nORDER BY {group}")
        return SummaryPlan(sql, params)
    buckets = _calendar_for(src, unit)
    if not buckets:
        return None
    pieces = _bucket_pieces(src, by, unit, where, buckets)
    keys = ", ".join(f"\"{k}\"" for k in by)
    sql = (f"SELECT {keys},\n  {jobs} AS jobs,\n  {S.aggregates_sql('t', 'e')}\n"
           f"FROM (\n  {pieces}\n) AS pieces\nGROUP BY {group}\nORDER BY {group}")
    return SummaryPlan(sql, params, tuple(buckets), unit)


def _bucket_pieces(src: ReportSource, by: Sequence[str], unit: str, where: str,
                   buckets: Sequence[Tuple[float, float, str]]) -> str:
    """The records' pieces inside the calendar's buckets: a derived table of (keys, bucket, t, e)."""
    q = src.query
    maxlen = int(max(b - a for a, b, _ in buckets)) + 1
    bucket_of_start = S.bucket_tree("start_time", buckets, str)
    end_of_start_bucket = S.bucket_tree("start_time", buckets, lambda i: repr(buckets[i][1]))
    plain = [f"{GROUP_KEYS[k]} AS \"{k}\"" for k in by if k not in TIME_KEYS]
    # (cluster once: the server refuses a derived table with two columns of one name)
    cols = ", ".join(plain + (["cluster"] if "cluster" not in by else [])
                     + ["job_id", "gpu_util_mean_pct", "mem_util_mean_pct", "max_memory_bytes"])
    t_in = S.overlap_sql(q, src=src)
    t_cut = S.overlap_sql(q, bucketed=True, src=src)
    # Most records lie inside one bucket: their bucket comes from a CASE on start_time (the
    # calendar is clipped to the window, so t is the window overlap).  Only records crossing a
    # bucket boundary are joined with the calendar and cut into pieces.  CROSS JOIN keeps
    # job_gpus as the outer loop; the b_start range touches only the buckets a record overlaps.
    return (
        f"SELECT {cols}, {bucket_of_start} AS \"{unit}\", {t_in} AS t, {S.energy_sql(q, t_in, True)} AS e\n"
        f"  FROM {src.table} WHERE {where} AND end_time <= {end_of_start_bucket}\n"
        f"  UNION ALL\n"
        f"  SELECT {cols}, cal.idx, {t_cut}, {S.energy_sql(q, t_cut, True)}\n"
        f"  FROM {src.table} CROSS JOIN cal ON b_start < end_time AND b_start > start_time - {maxlen} "
        f"AND b_end > start_time\n  WHERE {where} AND end_time > {end_of_start_bucket}"
    )


PARALLEL_MIN_ROWS = 200_000


def _partitions(src: ReportSource) -> int:
    """How many threads to aggregate a single file with (1: no parallel pass)."""
    if src.parallel_connect() is None:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < 2:
        return 1
    rows = src.conn.execute(f"SELECT MAX(rowid) FROM {src.table}").fetchone()[0] or 0
    return 1 if rows < PARALLEL_MIN_ROWS else min(cpus, 8)


def fan_out(src: ReportSource, tasks: Sequence[T], run: Callable[[Any, T], R], threads: int) -> List[R]:
    """run(conn, task) for every task, the results in task order: on src's own connection, or
    shared out to `threads` threads that each take the next task on a connection of their own."""
    connect = src.parallel_connect()
    n = min(threads, len(tasks))
    if n <= 1 or connect is None:
        return [run(src.conn, t) for t in tasks]
    results: List[Any] = [None] * len(tasks)
    lock = threading.Lock()
    counter = iter(range(len(tasks)))

    def next_task() -> Optional[int]:
        with lock:
            return next(counter, None)

    def worker(_: int) -> None:
        conn = connect()
        try:
            while (i := next_task()) is not None:
                results[i] = run(conn, tasks[i])
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(worker, range(n)))
    return results


def partitioned(sql: str, n: int) -> List[str]:
    """A query holding the S.PART marker as is (n = 1), or once per job_id partition: partitions
    hold disjoint jobs, so their results add up exactly."""
    if n == 1:
        return [sql.replace(S.PART, "")]
    return [sql.replace(S.PART, f" AND job_id % {int(n)} = {int(k)}") for k in range(n)]


def _covering_key(src: ReportSource, by: Sequence[str], with_time: bool = False) -> Optional[str]:
    """The column whose covering index (schema v2) can answer `--by`, or None.

    It applies to one plain key (plus, with `with_time`, one calendar key), when every filter
    is on that key or the cluster (another filter's column is not in the index) and no narrow
    --since makes the end_time index the better start.
    """
    plain = [k for k in by if k not in TIME_KEYS]
    col = GROUP_KEYS[plain[0]].strip('"') if len(plain) == 1 else ""
    if len(plain) != 1 or (len(by) > 1 and not with_time) or col not in src.covering_keys():
        return None
    q = src.query
    for fcol, vals in (("user", q.users), ("account", q.accounts), ("partition", q.partitions), ("node", q.nodes)):
        if vals and fcol != col:  # cluster is in the index
            return None
    if q.job_id is not None or src.use_end_index():
        return None
    return col


MAX_INDEX_TASKS = 20_000  # (key, bucket) queries; beyond that the one-pass sort wins


def _index_tasks(src: ReportSource, by: Sequence[str], col: str, unit: Optional[str]
                 ) -> Optional[Tuple[str, Dict[str, Any], List[Tuple[Any, Optional[int]]], Tuple[Tuple[float, float, str], ...]]]:
    """One aggregate query per group, each an index range: SQL, parameters, (key, bucket) tasks, calendar."""
    q = src.query
    where, params = S.where(q, use_index=False)
    params["thr"] = q.idle_threshold_pct
    idx = f"job_gpus_by_{col}"
    keys = _index_keys(src, col, idx)
    jobs = "COUNT(DISTINCT job_id)" if src.single_cluster() else "COUNT(DISTINCT cluster || '/' || job_id)"
    if unit is None:
        t = S.overlap_sql(q)
        sql = (f"SELECT {jobs} AS jobs,\n  {S.aggregates_sql(t, S.energy_sql(q, t, False))}\n"
               f"FROM {src.table} INDEXED BY {idx}\nWHERE {col} IS :key AND {where}")
        return sql, params, [(k, None) for k in keys], ()
    plan = _index_buckets(src, unit, len(keys))
    if plan is None:
        return None
    params["longest"], buckets = plan
    t = "(MIN(end_time, :b_end) - MAX(start_time, :b_start))"
    # Every record overlapping the bucket: start_time is a range in the index; the piece inside the
    # bucket is t (buckets are clipped to the window), energy prorated by the same fraction.
    sql = (f"SELECT {jobs} AS jobs,\n  {S.aggregates_sql(t, f'energy_j * {t} / (end_time - start_time)')}\n"
           f"FROM {src.table} INDEXED BY {idx}\nWHERE {col} IS :key AND start_time >= :b_start - :longest "
           f"AND start_time < :b_end AND end_time > :b_start AND {where}")
    # Tasks in the order of the output rows: --by month,user sorts by month first.
    tasks: List[Tuple[Any, Optional[int]]]
    if by.index(unit) < by.index(next(k for k in by if k not in TIME_KEYS)):
        tasks = [(k, i) for i in range(len(buckets)) for k in keys]
    else:
        tasks = [(k, i) for k in keys for i in range(len(buckets))]
    return sql, params, tasks, tuple(buckets)


def _index_keys(src: ReportSource, col: str, idx: str) -> List[Any]:
    """The distinct values of `col` the query's filters let through, in SQLite's order (NULL first)."""
    # By skipping through the index: O(keys x log rows), not a scan.
    keys: List[Any] = [v for (v,) in src.conn.execute(
        f"WITH RECURSIVE k(v) AS (SELECT MIN({col}) FROM {src.table} INDEXED BY {idx} UNION ALL "
        f"SELECT (SELECT MIN({col}) FROM {src.table} INDEXED BY {idx} WHERE {col} > k.v) FROM k WHERE k.v IS NOT NULL) "
        f"SELECT v FROM k WHERE v IS NOT NULL")]
    if src.conn.execute(f"SELECT EXISTS (SELECT 1 FROM {src.table} INDEXED BY {idx} WHERE {col} IS NULL)").fetchone()[0]:
        keys.insert(0, None)
    q = src.query
    wanted = {"user": q.users, "account": q.accounts, "partition": q.partitions, "node": q.nodes}.get(col)
    return [k for k in keys if k in wanted] if wanted else keys


def _index_buckets(src: ReportSource, unit: str, n_keys: int) -> Optional[Tuple[float, List[Tuple[float, float, str]]]]:
    """(longest record in seconds, calendar buckets) for one index query per key and bucket; None
    when the records' range is unknown or the one-pass plan is the better one."""
    q = src.query
    # Buckets over the window, or over a bound of the data's range found in O(log n): no record
    # ends before MIN(end_time) nor starts before that minus the longest record.  Buckets
    # without records give no rows.
    # (duration index, walked from the top past records too long to be counted)
    row = src.conn.execute(f"SELECT end_time - start_time FROM {src.table} WHERE end_time - start_time <= ? "
                           f"ORDER BY end_time - start_time DESC LIMIT 1", (S.MAX_RECORD_S,)).fetchone()
    longest = row[0] if row else None
    lo_end, hi_end = src.end_time_range()
    if longest is None or lo_end is None or hi_end is None:
        return None
    lo = q.since_s if q.since_s is not None else lo_end - max(longest, 0.0)
    hi = q.until_s if q.until_s is not None else hi_end
    if hi <= lo:
        return None
    try:
        buckets = calendar(lo, hi, unit, q.tz)
    except InputError:
        return None  # `lo` is only a bound: the one-pass plan decides on the records' real range
    # A bucket's query walks the records starting up to `longest` before it: give up when that
    # reads the table more than about twice (day buckets and multi-day jobs).
    if len(buckets) * max(longest, 0.0) > 2 * (hi - lo) or n_keys * len(buckets) > MAX_INDEX_TASKS:
        return None
    return max(longest, 0.0), buckets


def _summary_by_index(src: ReportSource, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
    """`--by KEY[,day|week|month]` through KEY's covering index: one query per group, in group order.

    Each query is an index range with no sort; groups are spread over threads (each with its
    own connection; sqlite releases the GIL) and come back in key, bucket order.  None: this
    database or grouping cannot use it.
    """
    col = _covering_key(src, by, with_time=True)
    if col is None:
        return None
    unit = next((k for k in by if k in TIME_KEYS), None)
    plan = _index_tasks(src, by, col, unit)
    if plan is None:
        return None
    sql, params, tasks, buckets = plan
    key = next(k for k in by if k not in TIME_KEYS)

    def one(conn: Any, task: Tuple[Any, Optional[int]]) -> Dict[str, Any]:
        k, b = task
        p = dict(params, key=k)
        if b is not None:
            p["b_start"], p["b_end"] = buckets[b][0], buckets[b][1]
        cur = conn.execute(sql, p)
        got = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], got))

    results = fan_out(src, tasks, one, _partitions(src))
    rows: List[Dict[str, Any]] = []
    for (k, b), res in zip(tasks, results):
        if res is None or res["alloc_s"] is None:  # no record in this group
            continue
        row = {key: k}
        row.update(res)
        if unit is not None and b is not None:
            row[unit] = buckets[b][2]
        rows.append(row)
    return rows


def summary_raw(src: ReportSource, by: Sequence[str]) -> List[Dict[str, Any]]:
    """Raw per-group sums; large single files are split by job_id across threads (sqlite releases the GIL)."""
    own = src.summary_rows(by)
    if own is not None:
        return own
    fast = _summary_by_index(src, by)
    if fast is not None:
        src.plan = f"the covering index of {_covering_key(src, by, with_time=True)}"
        return fast
    src.plan = src.plan or "records"
    plan = summary_plan(src, by)
    if plan is None:
        return []
    n = _partitions(src)
    parts = fan_out(src, plan.parts(n), lambda conn, part: part.run(src, conn), n)
    return merge_partials(parts, by)


# --sort column -> the raw sum it sorts by: SQL sorts, so that --limit never pulls every job into Python.
_JOB_SORT_SQL = {
    "job_id": "job_id", "restart": "restart_count", "start": "start_s", "end": "end_s",
    "gpu_hours_alloc": "alloc_s", "gpu_hours_used": "util_pct_s", "gpu_hours_idle": "idle_s",
    "gpu_util_mean_pct": "util_pct_s / util_known_s", "mem_util_mean_pct": "mem_pct_s / mem_known_s",
    "peak_memory_gib": "peak_bytes", "energy_kwh": "energy_j", "gpu_util_min_pct": "util_min",
}


def _job_sort(sort: Optional[str], idle_only: bool) -> Tuple[str, bool]:
    """--sort [-|+]COLUMN -> (column, descending); the default is the most GPU time (idle with --idle-only)."""
    descending = True
    if sort is None:
        sort = "gpu_hours_idle" if idle_only else "gpu_hours_alloc"
    elif sort.startswith("-"):
        sort = sort[1:]
    elif sort.startswith("+"):
        sort, descending = sort[1:], False
    else:
        descending = False
    sort = sort.replace("-", "_")
    sort = {"job": "job_id", "restart_count": "restart"}.get(sort, sort)
    if sort not in JOB_LIST_COLUMNS:
        raise InputError(f"unknown --sort column {sort!r}", "choose from " + ", ".join(JOB_LIST_COLUMNS)
                         + " (prefix with - for largest first)")
    return sort, descending


def job_rows(src: ReportSource, sort: Optional[str], limit: Optional[int], idle_only: bool) -> List[Dict[str, Any]]:
    """The raw sums of each job run (cluster, job_id, restart), sorted and limited in SQL;
    `idle_only`: jobs with an idle GPU."""
    q = src.query
    where, params = S.where(q, use_index=src.use_end_index())
    params["thr"] = q.idle_threshold_pct
    t = S.overlap_sql(q, src=src)
    e = S.energy_sql(q, t, False)
    sort, descending = _job_sort(sort, idle_only)
    if limit is not None and limit < 1:
        raise InputError(f"--limit must be at least 1, got {limit}", "e.g. --limit 20")
    order = f"_sortkey {'DESC' if descending else 'ASC'}, cluster, job_id, restart_count"
    having = "HAVING idle_gpus > 0" if idle_only else ""
    per_job = (f'SELECT cluster, job_id, restart_count, MAX("user") AS "user", MAX(account) AS account,\n'
               f'  MAX("partition") AS "partition", MIN(start_time) AS start_s, MAX(end_time) AS end_s,\n'
               f"  COUNT(DISTINCT node) AS nodes, COUNT(*) AS gpus, MIN({S.UTIL}) AS util_min,\n"
               f"  SUM({S.IDLE}) AS idle_gpus,\n  {S.aggregates_sql(t, e)}\n"
               f"FROM {src.table}\nWHERE {where}{S.PART}\nGROUP BY cluster, job_id, restart_count\n{having}")
    sort_sql = _JOB_SORT_SQL.get(sort, f"\"{sort}\"")
    sql = f"SELECT per_job.*, {sort_sql} AS _sortkey FROM (\n{per_job}\n) AS per_job\nORDER BY {order}"
    if limit is not None:
        sql += f"\nLIMIT {int(limit)}"
    n = _partitions(src)
    parts = fan_out(src, partitioned(sql, n), lambda conn, text: list(S.dict_rows(conn.execute(text, params))), n)
    return merge_sorted(parts, descending, limit)


def job_records(src: ReportSource) -> List[Dict[str, Any]]:
    """Every record of the query's job (all restarts, nodes and GPUs), unclipped by any window."""
    q = src.query
    where, params = S.where(q)
    params["thr"] = q.idle_threshold_pct
    sql = (f"SELECT *, {S.UTIL} AS util, {S.MEM_UTIL} AS mem_util, {S.IDLE} AS is_idle, "
           f"CASE WHEN {S.OUT_OF_RANGE} THEN end_time - start_time END AS clamped_s "
           f"FROM {src.table} WHERE {where} ORDER BY cluster, restart_count, node, gpu_index, gpu_uuid")
    return list(S.dict_rows(src.conn.execute(sql, params)))


UTIL_BINS = 10


def utilisation_bins(src: ReportSource) -> Dict[int, float]:
    """GPU-hours by per-GPU mean utilisation decile (0..9; -1 for records without it)."""
    q = src.query
    where, params = S.where(q, use_index=src.use_end_index())
    t = S.overlap_sql(q, src=src)
    sql = (f"SELECT CASE WHEN gpu_util_mean_pct IS NULL THEN -1 "
           f"ELSE {src.LEAST}({src.floor(f'{S.UTIL} / 10')}, 9) END AS bin, SUM({t}) / 3600.0 "
           f"FROM {src.table} WHERE {where} GROUP BY bin ORDER BY bin")
    return dict(src.conn.execute(sql, params).fetchall())


def records_span(src: ReportSource) -> Optional[Tuple[float, float]]:
    """The window, or the matching records' time range where it is open; None: no records."""
    q = src.query
    lo, hi = q.since_s, q.until_s
    if lo is None or hi is None:
        where, params = S.where(q, use_index=src.use_end_index())
        row = src.conn.execute(f"SELECT MIN(start_time), MAX(end_time) FROM {src.table} WHERE {where}", params).fetchone()
        if row[0] is None:
            return None
        lo = row[0] if lo is None else lo
        hi = row[1] if hi is None else hi
    return lo, hi
