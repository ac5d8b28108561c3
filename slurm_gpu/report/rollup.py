"""`report --by` from the central server's rollups (central/rollups.py): whole months from the
per-month sums (whole ISO weeks from the per-week ones for --by week), the other whole days from
the per-day sums, the partial days at the window's edges from the records, one SQL statement.
`--by node` without user, account or partition (keys or filters) reads the node tables without
those keys; a grouping of partition, GPU model and cluster only (no user, account or node, as
keys or filters) reads the per-day partition table, whatever the buckets.

The plan applies when the rollups exist, the idle threshold is theirs, no job is named, and the
window holds at least one whole day of the rollups' zone; for day/week/month groups every
bucket boundary must also be a rollup day boundary (the rollups' zone cuts days as --tz does).
Otherwise the caller reads the records (`plan()` says why).  The figures are the raw plan's:
each record's piece inside a day is the piece the report's calendar cuts, the window's edges
are clipped as the raw plan clips them, and a job is counted once over both parts (by the cells'
job counts where it lies in one group on consecutive days, central/rollups.py; else distinct).
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from slurm_gpu import groupkeys
from slurm_gpu.central import rollups as R
from slurm_gpu.report import sql as S
from slurm_gpu.report.calendar import calendar
from slurm_gpu.report.query import GROUP_KEYS, TIME_KEYS, Query

_KEY_COLUMN = groupkeys.COLUMN  # a key's column: the record's, and the rollup tables' that keep it


def _col(name: str) -> str:
    """A group column of a rollup table, NULL where the record's was."""
    if name in R.NULL_BITS:
        return f'CASE WHEN nulls & {R.NULL_BITS[name]} THEN NULL ELSE "{name}" END'
    return f'"{name}"'


class Plan:
    """What a summary reads: `sql` and its parameters, or `reason` to read the records instead."""

    def __init__(self, reason: str = "", sql: str = "", params: Optional[Dict[str, Any]] = None,
                 buckets: Sequence[Tuple[float, float, str]] = (), time_key: Optional[str] = None,
                 describe: str = ""):
        self.reason, self.sql, self.params = reason, sql, params or {}
        self.buckets, self.time_key, self.describe = tuple(buckets), time_key, describe


def plan(src: Any, by: Sequence[str]) -> Plan:
    q = src.query
    info = R.meta(lambda sql: src.conn.execute(sql).fetchall())
    if info is None:
        return Plan("the server has no rollups")
    if int(info.get("schema_version", R.JOB_COUNTS_VERSION)) < R.JOB_COUNTS_VERSION:
        return Plan(f"schema v{info['schema_version']}'s rollups have no job counts: `slurm-gpu central init` migrates it")
    if float(info["rollup_idle_threshold_pct"]) != q.idle_threshold_pct:
        return Plan(f"--idle-threshold {q.idle_threshold_pct:g} is not the rollups' {info['rollup_idle_threshold_pct']}")
    if q.job_id is not None:
        return Plan("one job")
    version = int(info.get("schema_version", R.PARTITION_VERSION))
    unit = next((k for k in by if k in TIME_KEYS), None)
    asked = _asked(by, q)
    tables = _tables(asked, unit, version)
    if tables is None:  # a key (or a filter's) no rollup table keeps: the records have it
        lost = asked - _carried("rollup_day_node")
        return Plan("the rollups keep no " + ", ".join(k.name for k in groupkeys.KEYS if k.column in lost))
    ex = src.conn.execute
    first = ex("SELECT MIN(day), MAX(day) FROM rollup_day").fetchone()
    if first is None or first[0] is None:
        return Plan("the rollups are empty")
    d_lo = ex("SELECT MIN(day) FROM rollup_days WHERE d_start >= ?", (q.since_s,)).fetchone()[0] \
        if q.since_s is not None else 0
    d_hi = ex("SELECT MAX(day) FROM rollup_days WHERE d_end <= ?", (q.until_s,)).fetchone()[0] \
        if q.until_s is not None else 10 ** 9
    if d_lo is None or d_hi is None or d_lo > d_hi:
        return Plan("no whole day of the rollups' zone in the window")
    used = ex("SELECT day, d_start, d_end FROM rollup_days WHERE day BETWEEN ? AND ? ORDER BY day",
              (max(d_lo, first[0]), min(d_hi, first[1]))).fetchall()
    whole_lo = ex("SELECT d_start FROM rollup_days WHERE day = ?", (d_lo,)).fetchone()[0] if q.since_s is not None else None
    whole_hi = ex("SELECT d_end FROM rollup_days WHERE day = ?", (d_hi,)).fetchone()[0] if q.until_s is not None else None
    buckets: List[Tuple[float, float, str]] = []
    if not used:
        return Plan("no rollup rows in the window's whole days")
    if unit is not None:
        lo = q.since_s if q.since_s is not None else used[0][1]
        hi = q.until_s if q.until_s is not None else used[-1][2]
        buckets = calendar(lo, hi, unit, q.tz)
        if not _in_one_bucket(used, buckets):
            return Plan(f"the rollups' days ({info['rollup_zone']}) are not the {unit}s of --tz {q.tz}")
    return _build(src, by, unit, tables, buckets, (d_lo, d_hi), (whole_lo, whole_hi), used, info)


def _in_one_bucket(used: Sequence[Tuple[Any, ...]], buckets: Sequence[Tuple[float, float, str]]) -> bool:
    """Every used day lies inside one bucket: no bucket boundary of --tz cuts a rollup day."""
    from bisect import bisect_right
    starts = [b[0] for b in buckets]
    for _day, start, end in used:
        i = bisect_right(starts, start) - 1
        if i < 0 or end > buckets[i][1]:
            return False
    return True


def _bucket_of(col: str, buckets: Sequence[Tuple[float, float, str]]) -> str:
    return S.bucket_tree(col, buckets, str) if buckets else "0"


def _kind(by: Sequence[str], q: Query) -> Optional[str]:
    """The rollup_jobs column whose kinds make the cells' job counts exact for this grouping; None:
    every job is counted distinct.  rollup_day's counts add over any grouping of its keys (a simple
    job lies in one cell a day); rollup_day_node's per node, so only where the node is a key (or
    one node is asked for): a job on two nodes is one job of its user."""
    if "node" not in by and not q.nodes:
        return "day_kind"
    return "node_kind" if "node" in by or len(q.nodes) == 1 else None


# the coarse table's period -> (its column in rollup_days, what the plan calls it)
_PERIODS = {"rollup_month": ("month_day", "month"), "rollup_week": ("week_day", "week"),
            "rollup_node_month": ("month_day", "month")}


def _asked(by: Sequence[str], q: Query) -> FrozenSet[str]:
    """The record columns the grouping's keys and the query's filters tell apart."""
    return frozenset(k.column for k in groupkeys.KEYS
                     if k.name in by or (k.filter_field and getattr(q, k.filter_field)))


def _carried(table: str) -> FrozenSet[str]:
    """The record columns a rollup table's cells keep apart (besides the day)."""
    own = R.COARSE[table][1] if table in R.COARSE else (*R.SUM_TABLES[table], *R.GROUP_COLUMNS)
    return frozenset(("cluster", *own))


def _tables(asked: FrozenSet[str], unit: Optional[str], version: int) -> Optional[Tuple[str, Optional[str]]]:
    """(the day table, the week or month table or None) whose keys carry the grouping and the
    filters (`asked`), the fewest cells first, and whose periods fit in the buckets (weeks for
    --by week, months otherwise); None: no rollup table keeps them apart."""
    coarse = version >= R.COARSE_VERSION
    if version >= R.PARTITION_VERSION and asked <= _carried("rollup_partition_day"):
        # (365 x partitions x models cells a year, where rollup_month has 12 x every group's)
        return "rollup_partition_day", None
    if asked <= _carried("rollup_day"):
        period = None if unit == "day" or not coarse else "rollup_week" if unit == "week" else "rollup_month"
        return "rollup_day", period
    if coarse and asked <= _carried("rollup_node_day"):
        return "rollup_node_day", None if unit in ("day", "week") else "rollup_node_month"
    return ("rollup_day_node", None) if asked <= _carried("rollup_day_node") else None


def _periods(src: Any, table: str, window: Tuple[int, int], used: Sequence[Tuple[Any, ...]],
             buckets: Sequence[Tuple[float, float, str]]) -> Optional[Tuple[int, int, int, int]]:
    """(first day of the first period, of the last, the last one's last day, periods): the whole
    months (weeks) of the rollups' zone in the window's whole days, each inside one bucket; None: none."""
    col = _PERIODS[table][0]
    rows = src.conn.execute(
        f"SELECT {col}, MIN(day), MAX(day), MIN(d_start), MAX(d_end) FROM rollup_days WHERE {col} "
        f"BETWEEN (SELECT {col} FROM rollup_days WHERE day = ?) AND ? GROUP BY {col} ORDER BY {col}",
        (used[0][0], used[-1][0])).fetchall()
    # (an open window's buckets begin and end with the records: its first and last months may not fit)
    whole = [r for r in rows if r[1] >= window[0] and r[2] <= window[1]
             and (not buckets or _in_one_bucket([(r[0], r[3], r[4])], buckets))]
    if not whole or any(b[1] != a[2] + 1 for a, b in zip(whole, whole[1:])):
        return None
    return int(whole[0][0]), int(whole[-1][0]), int(whole[-1][2]), len(whole)


def _sums_select(table: str, by: Sequence[str], buckets: Sequence[Tuple[float, float, str]], where: Sequence[str],
                 kind: Optional[str]) -> str:
    """The cells' sums, job counts and peaks of `table` where `where` holds, per group."""
    plain = [k for k in by if k not in TIME_KEYS]
    keys = [f'{_col(_KEY_COLUMN[k])} AS "{k}"' for k in plain]
    sums = ", ".join(f'SUM(r."{c}") AS "{c}"' for c in R.FIGURES)
    cond = " AND ".join(list(where) + ["r.records <> 0"])
    group = ", ".join(str(i) for i in range(1, len(keys) + 2))  # the keys and the bucket (or the day)
    if not buckets:
        jobs_n = "r.jobs_first + CASE WHEN r.day = :r_d0 THEN r.jobs_later ELSE 0 END" if kind else "0"
        # Added up per group here: the cells (days x groups) never make a derived table.
        head = ", ".join(keys + ['0 AS "_bucket"'])
        return (f"SELECT {head}, {sums}, SUM({jobs_n}) AS jobs_n, MAX(r.peak_bytes) AS peak "
                f"FROM {table} r WHERE {cond} GROUP BY {group}")
    # Jobs that began before a bucket (or the window) count on its first day (a month's cells: the
    # month's first day).
    starts = S.bucket_tree("d.d_start", buckets, lambda i: repr(buckets[i][0]))
    if table in R.COARSE and R.COARSE[table][2] is None:
        # A day table without the user and account (rollup_partition_day, rollup_node_day): its
        # cells are nearly one per group and day already, so each cell's day is looked up
        # directly (a per-day derived table of as many rows cost as much again).
        jobs_n = f"r.jobs_first + CASE WHEN r.day = :r_d0 OR d.d_start = {starts} THEN r.jobs_later ELSE 0 END" \
            if kind else "0"
        head = ", ".join(keys + [f'{_bucket_of("d.d_start", buckets)} AS "_bucket"'])
        return (f"SELECT {head}, {sums}, SUM({jobs_n}) AS jobs_n, MAX(r.peak_bytes) AS peak "
                f"FROM {table} r STRAIGHT_JOIN rollup_days d ON d.day = r.day WHERE {cond} GROUP BY {group}")
    # Per group and day first, then per bucket: a day's start (its bucket) is looked up once per
    # group and day, not once per cell (a year's weeks: 220,000 cells, 1,300 weeks x groups at 10 M).
    jobs = "SUM(r.jobs_first) AS jf, SUM(r.jobs_later) AS jl" if kind else "0 AS jf, 0 AS jl"
    days = (f"SELECT {', '.join(keys + ['r.day AS day'])}, {sums}, {jobs}, MAX(r.peak_bytes) AS peak FROM {table} r "
            f"WHERE {cond} GROUP BY {group}")
    first = f"x.day = :r_d0 OR d.d_start = {starts}"
    outer = [f'x."{k}"' for k in plain] + [f'{_bucket_of("d.d_start", buckets)} AS "_bucket"']
    figs = ", ".join(f'SUM(x."{c}") AS "{c}"' for c in R.FIGURES)
    return (f"SELECT {', '.join(outer)}, {figs}, "
            f"SUM(x.jf + CASE WHEN {first} THEN x.jl ELSE 0 END) AS jobs_n, MAX(x.peak) AS peak "
            f"FROM ({days}) AS x STRAIGHT_JOIN rollup_days d ON d.day = x.day GROUP BY {group}")


def _rollup_parts(by: Sequence[str], buckets: Sequence[Tuple[float, float, str]], q: Query, params: Dict[str, Any],
                  days: Tuple[int, int], kind: Optional[str], tables: Tuple[str, Optional[str]],
                  months: Optional[Tuple[int, int, int, int]], used: Sequence[Tuple[Any, ...]]
                  ) -> Tuple[List[str], str, List[str]]:
    """(the whole days' sums, job counts and peaks: one SELECT per table and range; the jobs counted
    distinct; what was read): the whole months (weeks) from their table, the other days from the day table."""
    params["r_d0"], params["r_d1"] = days
    filters = S.filters(q, params, _col, "r_")
    sums, read = [], []
    ranges = [(":r_d0", ":r_d1", len(used))]
    if months is not None and tables[1] is not None:
        params["r_m0"], params["r_m1"], params["r_m9"] = months[:3]
        sums.append(_sums_select(tables[1], by, buckets, ["r.day BETWEEN :r_m0 AND :r_m1"] + filters, kind))
        read.append(f"{months[3]} {_PERIODS[tables[1]][1]}(s) of {tables[1]}")
        before = sum(1 for u in used if u[0] < months[0])
        after = sum(1 for u in used if u[0] > months[2])
        ranges = ([(":r_d0", ":r_m0 - 1", before)] if before else []) + ([(":r_m9 + 1", ":r_d1", after)] if after else [])
    for lo, hi, n in ranges:
        sums.append(_sums_select(tables[0], by, buckets, [f"r.day BETWEEN {lo} AND {hi}"] + filters, kind))
    if ranges:
        read.append(f"{sum(n for _, _, n in ranges)} day(s) of {tables[0]}")
    keys = [f'{_col(_KEY_COLUMN[k])} AS "{k}"' for k in by if k not in TIME_KEYS]
    head = ", ".join(keys + [f'{_bucket_of("d.d_start", buckets)} AS "_bucket"'])
    distinct = [f"r.{kind} = 0"] if kind else []
    days_join = " JOIN rollup_days d ON d.day = r.day" if buckets else ""
    jobs = (f"SELECT {head}, r.cluster AS jc, r.job_id AS jid FROM rollup_jobs r{days_join} "
            f"WHERE {' AND '.join(['r.day BETWEEN :r_d0 AND :r_d1'] + filters + distinct)}")
    return sums, jobs, read


def _edge_part(src: Any, by: Sequence[str], lo: float, hi: float, bucket: int, n: int,
               counted: Optional[Tuple[str, int]]) -> Tuple[str, str, Dict[str, Any]]:
    """The records' pieces in [lo, hi), a part of one day, as the raw plan computes them: (their
    sums and peaks, their jobs, the parameters).  `counted` (kind, day): a job of that kind in the
    rollups on that whole day of the same bucket is counted there already, not here."""
    q = src.query
    edge = Query(since_s=lo, until_s=hi, users=q.users, accounts=q.accounts, partitions=q.partitions,
                   nodes=q.nodes, clusters=q.clusters, idle_threshold_pct=q.idle_threshold_pct, tz=q.tz)
    where, params = S.where(edge)
    params = {f"{k}_e{n}": v for k, v in params.items()}
    where = _rename(where, n)
    t = f"(LEAST(end_time, :until_e{n}) - GREATEST(start_time, :since_e{n}))"
    exprs = {c: e.replace(R._T, t) for c, e in R.SUMS + R.COUNTS}
    keys = [f'{GROUP_KEYS[k]} AS "{k}"' for k in by if k not in TIME_KEYS]
    figs = ", ".join(f'{exprs[c]} AS "{c}"' for c in R.FIGURES)
    head = ", ".join(keys + [f'{bucket} AS "_bucket"'])
    jobs_where = where
    if counted is not None:
        kind, day = counted
        node = " AND x.node = e.node" if kind == "node_kind" else ""
        jobs_where += (f" AND NOT EXISTS (SELECT 1 FROM rollup_jobs x WHERE x.cluster = e.cluster AND x.job_id = e.job_id "
                       f"AND x.day = {int(day)} AND x.{kind} <> 0{node})")
    return (f"SELECT {head}, {figs}, 0 AS jobs_n, max_memory_bytes AS peak FROM {src.table} WHERE {where}",
            f"SELECT {head}, cluster AS jc, job_id AS jid FROM {src.table} AS e WHERE {jobs_where}",
            params)


def _rename(where: str, n: int) -> str:
    import re
    return re.sub(r":([A-Za-z_]\w*)", lambda m: f":{m.group(1)}_e{n}", where)


def _outer(by: Sequence[str], unit: Optional[str], sums: Sequence[str], jobs: Sequence[str]) -> str:
    """The sums (with the cells' job counts) and the jobs counted distinct aggregated apart, then
    joined on the group.

    Apart, because one UNION ALL of both made the server materialise every rollup_jobs row with
    the sums' thirteen (NULL) DECIMAL columns beside it: a derived table too wide for memory."""
    names = [k if k not in TIME_KEYS else "_bucket" for k in by]
    group = ", ".join(f'"{k}"' for k in names)
    out = ", ".join(f's."{k}"' + (f' AS "{unit}"' if k == "_bucket" else "") for k in names)
    figs = ["SUM(alloc_s) AS alloc_s",
            "CASE WHEN SUM(util_n) > 0 THEN SUM(util_pct_s) END AS util_pct_s",
            "CASE WHEN SUM(util_n) > 0 THEN SUM(util_known_s) END AS util_known_s",
            "CASE WHEN SUM(mem_n) > 0 THEN SUM(mem_pct_s) END AS mem_pct_s",
            "CASE WHEN SUM(mem_n) > 0 THEN SUM(mem_known_s) END AS mem_known_s",
            "CASE WHEN SUM(energy_n) > 0 THEN SUM(energy_j) END AS energy_j",
            "SUM(idle_s) AS idle_s", "SUM(clamped_s) AS clamped_s",
            "SUM(jobs_n) AS jobs_n", "MAX(peak) AS peak_bytes"]
    on = " AND ".join(f's."{k}" <=> j."{k}"' for k in names)
    order = ", ".join(f's."{k}"' for k in names)
    s_body = "\n    UNION ALL\n    ".join(sums)
    j_body = "\n    UNION ALL\n    ".join(jobs)
    # The sums as doubles, converted by the server (as Python would: correctly rounded, sent in
    # their shortest exact form): DECIMAL(65,20)'s 40-digit text made each a Decimal in PyMySQL,
    # then a float here (a month's 1,000 nodes: ~9,000 of them).
    figures = ", ".join(f"CAST(s.{c} AS DOUBLE) AS {c}" if c != "peak_bytes" else "s.peak_bytes"
                        for c in ("alloc_s", "util_pct_s", "util_known_s", "mem_pct_s", "mem_known_s", "peak_bytes",
                                  "energy_j", "idle_s", "clamped_s"))
    return (f"SELECT {out},\n  CAST(s.jobs_n AS SIGNED) + COALESCE(j.jobs, 0) AS jobs,\n  {figures}\n"
            f"FROM (\n  SELECT {group},\n  " + ",\n  ".join(figs)
            + f"\n  FROM (\n    {s_body}\n  ) AS sp GROUP BY {group}\n) AS s\n"
            f"LEFT JOIN (\n  SELECT {group}, COUNT(DISTINCT jc, jid) AS jobs\n  FROM (\n    {j_body}\n"
            f"  ) AS jp GROUP BY {group}\n) AS j ON {on}\nORDER BY {order}")


def _bucket_at(buckets: Sequence[Tuple[float, float, str]], t: float) -> int:
    from bisect import bisect_right
    return max(bisect_right([b[0] for b in buckets], t) - 1, 0) if buckets else 0


def _edges(q: Query, buckets: Sequence[Tuple[float, float, str]], days: Tuple[int, int],
           whole: Tuple[Optional[float], Optional[float]], kind: Optional[str]
           ) -> List[Tuple[float, float, int, Optional[Tuple[str, int]]]]:
    """The window's partial days: (from, to, bucket, the whole day next to it when it is in the same
    bucket and `kind` counts jobs there)."""
    out: List[Tuple[float, float, int, Optional[Tuple[str, int]]]] = []
    if q.since_s is not None and whole[0] is not None and q.since_s < whole[0]:
        same = _bucket_at(buckets, q.since_s) == _bucket_at(buckets, whole[0])
        out.append((q.since_s, whole[0], 0, (kind, days[0]) if kind and same else None))
    if q.until_s is not None and whole[1] is not None and whole[1] < q.until_s:
        last = len(buckets) - 1 if buckets else 0
        same = _bucket_at(buckets, whole[1] - 1.0) == last
        out.append((whole[1], q.until_s, last, (kind, days[1]) if kind and same else None))
    return out


def _build(src: Any, by: Sequence[str], unit: Optional[str], tables: Tuple[str, Optional[str]],
           buckets: List[Tuple[float, float, str]], days: Tuple[int, int], whole: Tuple[Optional[float], Optional[float]],
           used: Sequence[Any], info: Dict[str, str]) -> Plan:
    q = src.query
    params: Dict[str, Any] = {}
    kind = _kind(by, q)
    months = _periods(src, tables[1], days, used, buckets) if tables[1] is not None else None
    sums, day_jobs, read = _rollup_parts(by, buckets, q, params, days, kind, tables, months, used)
    jobs = [day_jobs]
    edges = _edges(q, buckets, days, whole, kind)
    for n, (lo, hi, b, counted) in enumerate(edges):
        edge_sums, edge_jobs, p = _edge_part(src, by, lo, hi, b, n, counted)
        sums.append(edge_sums)
        jobs.append(edge_jobs)
        params.update(p)
    counts = ("job counts from its cells, rollup_jobs for the jobs of several groups or days apart" if kind
              else "rollup_jobs for the job counts (a job on several of the nodes is one job)")
    span = f"{' + '.join(read)} ({info['rollup_zone']}; {counts})"
    describe = f"rollups: {span}" + (f" + records of {len(edges)} partial day(s) at the window's edges" if edges else "")
    return Plan("", _outer(by, unit, sums, jobs), params, buckets, unit, describe)


def summary_rows(src: Any, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
    """The raw sums of `report --by` from the rollups; None (and src.plan saying why) otherwise."""
    p = plan(src, by)
    if p.reason:
        src.plan = f"records (not the rollups: {p.reason})"
        return None
    src.plan = p.describe
    cur = src.conn.execute(p.sql, p.params)
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, r)) for r in cur]
    if p.time_key:
        for row in rows:
            row[p.time_key] = p.buckets[int(row[p.time_key])][2]
    return rows
