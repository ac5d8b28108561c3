"""Rollups on the central server: a report's sums per day, kept by `apply_batch` (docs/central.md).

Three tables, all derived from `job_gpus` (never written by a node):

- `rollup_day`: per (cluster, day, user, account, partition, gpu_model) the sums a summary report
  adds up (GPU-seconds allocated, utilisation- and memory-utilisation-weighted seconds and the
  seconds they are known for, energy, idle and clamped seconds, record counts), as exact
  DECIMALs: a record taken out again (withdrawn, or replaced by a more complete version) leaves
  the sums exactly as if it had never been there.
- `rollup_day_node`: the same with the node, for node views and --node filters.
- `rollup_jobs`: one row per (cluster, job, day, node, user, account, partition, gpu_model) with
  the peak memory (a job's rows are recomputed from its records whenever any of them changes),
  and what kind of day it is for the job counts (schema v6, `day_kind` and `node_kind`).

Job counts (v6).  Jobs are not additive over days (a job over midnight counts once) nor over
groups (a job with two GPU models is one job of its user).  But a job whose rows all lie in one
group and on consecutive days (a "simple" job: nearly all of them) is counted once in the
window's days by counting it on its first day (`jobs_first`) plus, on the window's or bucket's
first day only, the simple jobs there that began before (`jobs_later`): both sums in the cells of
rollup_day.  `day_kind` of a rollup_jobs row says 1: the simple job's first day, 2: a later day,
0: the job is not simple (several groups, or a day without it between two with it: a requeue) and
is counted distinct from these rows.  `node_kind` is the same for the job's rows on one node, for
rollup_day_node, whose counts are per node (a job on two nodes counts on each).  The cells' peak
memory (`peak_bytes`) is the maximum of their rollup_jobs rows: raised as rows come in, computed
again from the rows where a job's rows leave a cell.

A record contributes to each day of `rollup_days` it overlaps the part inside that day, cut
exactly as the report's calendar cuts a day bucket (report/query.py).  The days are those of one
zone, chosen when the rollups are built (`central init --rollup-tz`) and kept in `meta`.

Names in the key columns may be NULL in job_gpus but not in a primary key: they are stored as ''
with a bit in `nulls` (1 user, 2 account, 4 partition, 8 gpu_model: slurm_gpu/groupkeys.py) saying
which were NULL.

The month, week and node tables (v8, "coarse rollups") are sums of these cells: see their section
below.  A push applies its whole change in `rollups_before`, before the job_gpus upsert, each
table once (`rollups_after` is left empty for the apply_batch that calls it): central/rollup_push.py.

The tables' DDL is all here; the migration steps that make and fill them, "rollups" (v4), "job
counts" (v6), "coarse rollups" (v8) and "partition rollups" (v10), are central/rollup_steps.py's.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from slurm_gpu import groupkeys
from slurm_gpu.config import IDLE_THRESHOLD_PCT  # the rollups' idle threshold (re-exported)
from slurm_gpu.timefmt import wall_clock_to_unix

TAIL = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
NAME = "VARCHAR(255)"
SUM = "DECIMAL(65,20)"  # exact: adding and taking out a contribution is reversible
FIRST_YEAR, END_YEAR = 1990, 2100  # valid records end in 2000-2099 and last at most ten years

# The report's rules for a record (report/query.py: _valid_sql, UTIL, MEM_UTIL, IDLE, _OUT_OF_RANGE);
# tests/test_rollups.py checks they stay the same.
VALID = ("end_time > start_time AND end_time >= 946684800.0 AND end_time < 4102444800.0 "
         "AND end_time - start_time <= 315619200.0")
UTIL = "CASE WHEN gpu_util_mean_pct > 100 THEN 100.0 WHEN gpu_util_mean_pct < 0 THEN 0.0 ELSE gpu_util_mean_pct END"
MEM_UTIL = "CASE WHEN mem_util_mean_pct > 100 THEN 100.0 WHEN mem_util_mean_pct < 0 THEN 0.0 ELSE mem_util_mean_pct END"
IDLE = f"(gpu_util_mean_pct < {IDLE_THRESHOLD_PCT!r} AND gpu_util_mean_pct >= 0)"
OUT_OF_RANGE = "(gpu_util_mean_pct NOT BETWEEN 0 AND 100 OR mem_util_mean_pct NOT BETWEEN 0 AND 100)"

# The group columns of every cell (slurm_gpu/groupkeys.py), in the order of their bits in `nulls`.
_GROUPS = sorted((k for k in groupkeys.KEYS if k.null_bit), key=lambda k: k.null_bit)
GROUP_COLUMNS = tuple(k.column for k in _GROUPS)
NULL_BITS = {k.column: k.null_bit for k in _GROUPS}
# (column, the contribution of one record's piece of t seconds inside a day)
_T = "(LEAST(end_time, d_end) - GREATEST(start_time, d_start))"
SUMS: Tuple[Tuple[str, str], ...] = (
    ("alloc_s", _T),
    ("util_pct_s", f"COALESCE({_T} * {UTIL}, 0)"),
    ("util_known_s", f"CASE WHEN gpu_util_mean_pct IS NOT NULL THEN {_T} ELSE 0 END"),
    ("mem_pct_s", f"COALESCE({_T} * {MEM_UTIL}, 0)"),
    ("mem_known_s", f"CASE WHEN mem_util_mean_pct IS NOT NULL THEN {_T} ELSE 0 END"),
    ("energy_j", f"COALESCE(energy_j * {_T} / (end_time - start_time), 0)"),
    ("idle_s", f"CASE WHEN {IDLE} THEN {_T} ELSE 0 END"),
    ("clamped_s", f"CASE WHEN {OUT_OF_RANGE} THEN {_T} ELSE 0 END"),
)
COUNTS: Tuple[Tuple[str, str], ...] = (
    ("records", "1"),
    ("util_n", "gpu_util_mean_pct IS NOT NULL"),
    ("mem_n", "mem_util_mean_pct IS NOT NULL"),
    ("energy_n", "energy_j IS NOT NULL"),
)
FIGURES = tuple(c for c, _ in SUMS) + tuple(c for c, _ in COUNTS)
# v6: a cell's job counts and peak (after FIGURES, in the order v6's ALTER TABLE adds them)
JOB_FIGURES = ("jobs_first", "jobs_later", "peak_bytes")
JOB_FIGURES_DDL = ('"jobs_first" BIGINT NOT NULL DEFAULT 0', '"jobs_later" BIGINT NOT NULL DEFAULT 0',
                   '"peak_bytes" BIGINT')
KINDS = ("day_kind", "node_kind")  # rollup_jobs: 0 counted distinct, 1 first day, 2 later day
KINDS_DDL = tuple(f'"{k}" TINYINT NOT NULL DEFAULT 0' for k in KINDS)
JOBS_KEYS = ("KEY rollup_jobs_cell (day, gkey)", "KEY rollup_jobs_mixed (day_kind, day)",
             "KEY rollup_jobs_node_mixed (node_kind, day)")
SUM_TABLES = {"rollup_day": (), "rollup_day_node": ("node",)}  # table -> key columns besides the groups
COARSE_TABLES = ("rollup_month", "rollup_week", "rollup_node_day", "rollup_node_month",  # v8: sums of day cells
                 "rollup_partition_day")  # v10
COARSE_VERSION = 8  # the central schema with the coarse tables (an older server: days only)
PARTITION_VERSION = 10  # ... and with rollup_partition_day
TABLES = ("rollup_days", "rollup_day", "rollup_day_node", "rollup_jobs", *COARSE_TABLES)


def _keys(extra: Sequence[str]) -> List[str]:
    return ["cluster", "day", *extra, "gkey"]


def _group_ddl() -> List[str]:
    # Four names of 255 characters are past InnoDB's 3072 bytes of key: the key holds their hash.
    return [f'"{c}" {NAME} NOT NULL' for c in GROUP_COLUMNS] + ["nulls TINYINT NOT NULL", "gkey BINARY(32) NOT NULL"]


def sum_table_ddl(table: str, temporary: bool = False) -> str:
    extra = SUM_TABLES[table]
    cols = ['cluster VARCHAR(64) NOT NULL', 'day INT NOT NULL', *(f'"{c}" VARCHAR(255) NOT NULL' for c in extra),
            *_group_ddl(), *(f'"{c}" {SUM} NOT NULL' for c, _ in SUMS), *(f'"{c}" BIGINT NOT NULL' for c, _ in COUNTS),
            *JOB_FIGURES_DDL, f"PRIMARY KEY ({_q(_keys(extra))})", f"KEY {table}_day (day)"]
    return (f"CREATE {'TEMPORARY ' if temporary else ''}TABLE IF NOT EXISTS {_name(table, temporary)} (\n    "
            + ",\n    ".join(cols) + f"\n) {TAIL}")


def jobs_table_ddl(temporary: bool = False) -> str:
    cols = ["cluster VARCHAR(64) NOT NULL", "job_id BIGINT NOT NULL", "day INT NOT NULL", f'"node" {NAME} NOT NULL',
            *_group_ddl(), "peak_bytes BIGINT", *KINDS_DDL,
            f"PRIMARY KEY ({_q(['cluster', 'job_id', 'day', 'node', 'gkey'])})", *JOBS_KEYS]
    return (f"CREATE {'TEMPORARY ' if temporary else ''}TABLE IF NOT EXISTS {_name('rollup_jobs', temporary)} (\n    "
            + ",\n    ".join(cols) + f"\n) {TAIL}")


DAYS_DDL = (f"CREATE TABLE IF NOT EXISTS rollup_days (\n    day INT NOT NULL PRIMARY KEY,\n    label CHAR(10) NOT NULL,\n"
            f"    d_start DOUBLE NOT NULL,\n    d_end DOUBLE NOT NULL,\n    KEY rollup_days_start (d_start)\n) {TAIL}")


def _q(cols: Sequence[str]) -> str:
    return ", ".join(f'"{c}"' for c in cols)


def _name(table: str, temporary: bool) -> str:
    return f"tmp_{table}" if temporary else table


def day_rows(utc: bool) -> List[Tuple[int, str, float, float]]:
    """(day number, YYYY-MM-DD, start, end) for every calendar day FIRST_YEAR..END_YEAR, midnight to
    midnight in UTC or the host's local zone (as report/calendar.py cuts days)."""
    from datetime import date, timedelta
    out: List[Tuple[int, str, float, float]] = []
    d, end = date(FIRST_YEAR, 1, 1), date(END_YEAR, 1, 1)
    start = wall_clock_to_unix(d.year, d.month, d.day, utc=utc)
    while d < end:
        n = d + timedelta(days=1)
        nxt = wall_clock_to_unix(n.year, n.month, n.day, utc=utc)
        out.append((len(out), d.isoformat(), start, nxt))
        d, start = n, nxt
    return out


# --------------------------------------------------------------------------- SQL

# Day n starts within 14 hours of UTC's midnight of FIRST_YEAR's first day + n days (no zone is
# further from UTC), so a time t lies in one of the days floor((t - that midnight) / 86400) +- 1:
# a range of the primary key, where d_start's range (~25 h of days) went through its secondary
# index and a lookup of d_end per day (the push's most expensive join).
_EPOCH = wall_clock_to_unix(FIRST_YEAR, 1, 1, utc=True)
_DAY_JOIN = (f"JOIN rollup_days d FORCE INDEX (PRIMARY) ON d.day BETWEEN FLOOR((r.start_time - {_EPOCH!r}) / 86400) - 1 "
             f"AND FLOOR((r.end_time - {_EPOCH!r}) / 86400) + 1 AND d.d_start < r.end_time AND d.d_end > r.start_time")


def _group_select() -> List[str]:
    """The group columns, `nulls` and `gkey`: SHA-256 of the names, each length-prefixed, and `nulls`."""
    nulls = " + ".join(f'{bit} * (r."{c}" IS NULL)' for c, bit in NULL_BITS.items())
    names = [f'COALESCE(r."{c}", \'\')' for c in GROUP_COLUMNS]
    parts = ", ':', ".join(f"CHAR_LENGTH({n}), '/', {n}" for n in names)
    return names + [f"({nulls})", f"UNHEX(SHA2(CONCAT(({nulls}), ':', {parts}), 256))"]


def _group_by(keys: Sequence[str]) -> str:
    """GROUP BY the key columns' positions but the names: `gkey` (their hash with `nulls`) stands
    for them, and a grouping on four VARCHAR(255) made every statement's temporary table wide."""
    return "GROUP BY " + ", ".join(str(i) for i, k in enumerate(keys, 1) if k not in GROUP_COLUMNS and k != "nulls")


def _sums_insert(table: str, target: str, records_sql: str, sign: int) -> str:
    """Add (sign 1) or take out (sign -1) the pieces of the records `records_sql` selects."""
    extra = SUM_TABLES[table]
    cols = ["cluster", "day", *extra, *GROUP_COLUMNS, "nulls", "gkey"] + list(FIGURES)
    sel = ["r.cluster", "d.day", *(f'r."{c}"' for c in extra), *_group_select(),
           *(f"{sign} * SUM(CAST({expr} AS {SUM}))" for _, expr in SUMS),
           *(f"{sign} * SUM({expr})" for _, expr in COUNTS)]
    n_keys = len(cols) - len(FIGURES)
    upd = ", ".join(f'"{c}" = "{c}" + VALUES("{c}")' for c in FIGURES)
    return (f"INSERT INTO {target} ({_q(cols)})\nSELECT {', '.join(sel)}\nFROM ({records_sql}) AS r {_DAY_JOIN}\n"
            f"{_group_by(cols[:n_keys])}\nON DUPLICATE KEY UPDATE {upd}")


JOB_COLS = ["cluster", "job_id", "day", "node", *GROUP_COLUMNS, "nulls", "gkey", "peak_bytes"]


def _jobs_select(records_sql: str) -> str:
    """The rollup_jobs rows (without kinds) of the records `records_sql` selects."""
    sel = ["r.cluster", "r.job_id", "d.day", "r.node", *_group_select(), "MAX(r.max_memory_bytes)"]
    names = [f'{e} AS "{c}"' for e, c in zip(sel, JOB_COLS)]
    return f"SELECT {', '.join(names)}\nFROM ({records_sql}) AS r {_DAY_JOIN}\n{_group_by(JOB_COLS[:-1])}"


def _jobs_insert(target: str, records_sql: str) -> str:
    return f"INSERT INTO {target} ({_q(JOB_COLS)})\n{_jobs_select(records_sql)}"


def _cols(alias: str, cols: Sequence[str]) -> str:
    return ", ".join(f'{alias}."{c}"' for c in cols)


def _with_kinds(rows: str, cols: Sequence[str] = JOB_COLS) -> str:
    """The rollup_jobs rows `rows` selects (every row of their jobs; their columns `cols`) with their kinds.

    day_kind: 0 the job is not simple (several groups, or a day without it between two with it);
    for a simple job, on one row per day (the first node's, the "lead"), 1 its first day and 2 a
    later one, 3 on its other nodes' rows: so that rollup_day's counts are sums of its node
    cells'.  node_kind: the same for the job's rows on one node (one row a day there)."""
    job, node = "PARTITION BY cluster, job_id", "PARTITION BY cluster, job_id, node"
    w1 = (f"SELECT y.*, MIN(gkey) OVER ({job}) AS g_lo, MAX(gkey) OVER ({job}) AS g_hi, MIN(day) OVER ({job}) AS d_lo, "
          f"MAX(day) OVER ({job}) AS d_hi, ROW_NUMBER() OVER ({job}, day ORDER BY node, gkey) AS lead, "
          f"MIN(gkey) OVER ({node}) AS ng_lo, MAX(gkey) OVER ({node}) AS ng_hi, MIN(day) OVER ({node}) AS nd_lo, "
          f"MAX(day) OVER ({node}) AS nd_hi, COUNT(*) OVER ({node}) AS nn FROM ({rows}) AS y")
    w2 = f"SELECT w.*, SUM(lead = 1) OVER ({job}) AS n_days FROM ({w1}) AS w"
    day_kind = ("CASE WHEN g_lo = g_hi AND d_hi - d_lo + 1 = n_days THEN "
                "CASE WHEN lead = 1 THEN 1 + (day > d_lo) ELSE 3 END ELSE 0 END")
    node_kind = "CASE WHEN ng_lo = ng_hi AND nd_hi - nd_lo + 1 = nn THEN 1 + (day > nd_lo) ELSE 0 END"
    return f"SELECT {_q(cols)}, {day_kind} AS day_kind, {node_kind} AS node_kind FROM ({w2}) AS k"


def _kinds_update(target: str, rows: str) -> str:
    """Set day_kind and node_kind of target's rows from every row of their jobs (`rows`)."""
    on = " AND ".join(f'k."{c}" = j."{c}"' for c in ("cluster", "job_id", "day", "node", "gkey"))
    return (f"UPDATE {target} j JOIN ({_with_kinds(rows)}) AS k ON {on}\n"
            "SET j.day_kind = k.day_kind, j.node_kind = k.node_kind")


def _first_later(table: str, sign: str = "") -> Tuple[str, str]:
    kind = "node_kind" if SUM_TABLES[table] else "day_kind"
    return f"SUM({sign}(j.{kind} = 1))", f"SUM({sign}(j.{kind} = 2))"


def _counts_assign(table: str, target: str, rows: str) -> str:
    """Set the job counts and peaks of target's cells from the rollup_jobs rows `rows` selects (a build)."""
    keys = ["cluster", "day", *SUM_TABLES[table], *GROUP_COLUMNS, "nulls", "gkey"]
    sel = [_cols("j", keys)] + ["0"] * len(FIGURES) + list(_first_later(table)) + ["MAX(j.peak_bytes)"]
    upd = ", ".join(f'"{c}" = VALUES("{c}")' for c in JOB_FIGURES)
    return (f"INSERT INTO {target} ({_q(keys + list(FIGURES + JOB_FIGURES))})\nSELECT {', '.join(sel)}\n"
            f"FROM ({rows}) AS j\n{_group_by(keys)}\nON DUPLICATE KEY UPDATE {upd}")


# --------------------------------------------------------------------------- build and rebuild

MONTH_DAYS = 31  # days per chunk of a build: one progress step


def _chunk_records(lo: float, hi: float, longest: float) -> str:
    """The valid current records with a piece in [lo, hi)."""
    return (f"SELECT * FROM job_gpus WHERE withdrawn = 0 AND {VALID} AND end_time > {lo!r} "
            f"AND end_time < {hi + longest + 1!r} AND start_time < {hi!r}")


def _chunks(srv: Any, first_day: int) -> List[Tuple[int, int, float, float]]:
    """(day from, day to, start, end) chunks of MONTH_DAYS days covering the records' days."""
    row = srv.execute(f"SELECT MIN(start_time), MAX(end_time), MAX(span_s) FROM job_gpus WHERE withdrawn = 0 AND {VALID}")
    if not row or row[0][0] is None:
        return []
    lo, hi = float(row[0][0]), float(row[0][1])
    days = srv.execute("SELECT day, d_start, d_end FROM rollup_days WHERE day >= %s AND d_end > %s AND d_start < %s "
                       "ORDER BY day", (first_day, lo, hi))
    out = []
    for i in range(0, len(days), MONTH_DAYS):
        part = days[i:i + MONTH_DAYS]
        out.append((int(part[0][0]), int(part[-1][0]), float(part[0][1]), float(part[-1][2])))
    return out


def build(srv: Any, first_day: int = 0, temporary: bool = False,
          progress: Optional[Callable[[int, int], None]] = None, counts: bool = True, coarse: bool = True) -> None:
    """Fill the rollup tables (or their temporary twins) from the records, for days >= first_day
    (without `counts`, their job counts and kinds are left to job_counts(); without `coarse`, or
    without counts, the coarse tables are left to coarse_build()).

    The caller holds the transaction; with `temporary` the tables are created empty first."""
    if temporary:
        for t in SUM_TABLES:
            srv.execute(f"DROP TEMPORARY TABLE IF EXISTS tmp_{t}")
            srv.execute(sum_table_ddl(t, True))
        srv.execute("DROP TEMPORARY TABLE IF EXISTS tmp_rollup_jobs")
        srv.execute(jobs_table_ddl(True))
    longest = srv.execute(f"SELECT MAX(span_s) FROM job_gpus WHERE {VALID}")[0][0] or 0.0
    chunks = _chunks(srv, first_day)
    for i, (d0, d1, lo, hi) in enumerate(chunks):
        records = _chunk_records(lo, hi, float(longest))
        for t in SUM_TABLES:
            srv.execute(_sums_insert(t, _name(t, temporary), records, 1).replace(
                f"{_DAY_JOIN}", f"{_DAY_JOIN} AND d.day BETWEEN {d0} AND {d1}"))
        srv.execute(_jobs_insert(_name("rollup_jobs", temporary), records).replace(
            f"{_DAY_JOIN}", f"{_DAY_JOIN} AND d.day BETWEEN {d0} AND {d1}"))
        if progress is not None:
            progress(i + 1, len(chunks))
    if counts:
        job_counts(srv, first_day, temporary)
        if coarse:
            coarse_build(srv, first_day, temporary)


def job_counts(srv: Any, first_day: int = 0, temporary: bool = False) -> None:
    """The rollup_jobs rows' kinds and the cells' job counts and peaks, from the rollup_jobs rows of
    days >= first_day (a job's rows before it, left as they are, count for its kinds)."""
    jobs = _name("rollup_jobs", temporary)
    rows = f"SELECT {_q(JOB_COLS)} FROM {jobs}"
    if temporary and first_day > 0:
        rows += f" UNION ALL SELECT {_q(JOB_COLS)} FROM rollup_jobs WHERE day < {int(first_day)}"
    srv.execute(_kinds_update(jobs, rows))
    for t in SUM_TABLES:
        srv.execute(_counts_assign(t, _name(t, temporary), f"SELECT * FROM {jobs} WHERE day >= {int(first_day)}"))


REBUILT = ("rollup_day", "rollup_day_node", "rollup_jobs", *COARSE_TABLES)


def _null_safe_join(table: str) -> Tuple[str, str]:
    if table in COARSE:
        keys = _coarse_pk(table)
    else:
        keys = _keys(SUM_TABLES[table]) if table != "rollup_jobs" else ["cluster", "job_id", "day", "node", "gkey"]
    vals = list(FIGURES + JOB_FIGURES) if table != "rollup_jobs" else ["peak_bytes", *KINDS]
    on = " AND ".join(f'a."{k}" = b."{k}"' for k in keys)
    same = " AND ".join(f'a."{v}" <=> b."{v}"' for v in vals)
    return on, same


def _live(table: str, first_day: int) -> str:
    """The table's rows from first_day on (rows whose records all left count as absent)."""
    extra = " AND records <> 0" if table != "rollup_jobs" else ""
    return f"(SELECT * FROM {table} WHERE day >= {int(first_day)}{extra})"


def differences(srv: Any, first_day: int) -> Dict[str, Tuple[int, int, int]]:
    """Per table: (rows missing, rows that should not be there, rows with other figures) of the
    rollups against their rebuilt temporary twins."""
    out = {}
    month0 = period0(srv, first_day)
    for t in REBUILT:
        on, same = _null_safe_join(t)
        live, fresh = _live(t, month0 if t in COARSE else first_day), f"tmp_{t}"
        missing = srv.execute(f"SELECT COUNT(*) FROM {fresh} a LEFT JOIN {live} b ON {on} WHERE b.day IS NULL")[0][0]
        extra = srv.execute(f"SELECT COUNT(*) FROM {live} a LEFT JOIN {fresh} b ON {on} WHERE b.day IS NULL")[0][0]
        other = srv.execute(f"SELECT COUNT(*) FROM {fresh} a JOIN {live} b ON {on} WHERE NOT ({same})")[0][0]
        out[t] = (int(missing), int(extra), int(other))
    return out


def _columns(table: str) -> List[str]:
    if table == "rollup_jobs":
        return JOB_COLS + list(KINDS)
    if table in COARSE:
        return _coarse_cols(table)
    return ["cluster", "day", *SUM_TABLES[table], *GROUP_COLUMNS, "nulls", "gkey", *FIGURES, *JOB_FIGURES]


def rebuild(srv: Any, first_day: int = 0, progress: Optional[Callable[[int, int], None]] = None
            ) -> Dict[str, Tuple[int, int, int]]:
    """Recompute the rollups from the records for days >= first_day, replace them, and say what
    differed.  One serializable transaction: pushes wait for it (and retry on their timeout)."""
    srv.commit()  # (the reads before): the next transaction is the serializable one
    srv.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
    srv.execute("START TRANSACTION")
    try:
        build(srv, first_day, temporary=True, progress=progress)
        diff = differences(srv, first_day)
        month0 = period0(srv, first_day)
        for t in REBUILT:
            srv.execute(f"DELETE FROM {t} WHERE day >= %s", (month0 if t in COARSE else first_day,))
            cols = _q(_columns(t))
            srv.execute(f"INSERT INTO {t} ({cols}) SELECT {cols} FROM tmp_{t}")
        srv.commit()
    except BaseException:
        srv.rollback()
        raise
    return diff


def first_day_of(srv: Any, since_s: Optional[float]) -> int:
    """The number of the rollup day holding `since_s` (0: from the first day)."""
    if since_s is None:
        return 0
    row = srv.execute("SELECT MAX(day) FROM rollup_days WHERE d_start <= %s", (since_s,))
    return int(row[0][0]) if row and row[0][0] is not None else 0


JOB_COUNTS_VERSION = 6  # the central schema whose rollups hold job counts (an older server: records)


def meta(conn_execute: Callable[[str], List[Tuple[Any, ...]]]) -> Optional[Dict[str, str]]:
    """The rollups' zone and idle threshold (and the schema version) from meta; None where the
    schema has no rollups."""
    rows = conn_execute("SELECT name, value FROM meta WHERE name IN ('rollup_zone', 'rollup_idle_threshold_pct', "
                        "'schema_version')")
    got = {str(n): str(v) for n, v in rows}
    return got if "rollup_zone" in got and "rollup_idle_threshold_pct" in got else None


# --------------------------------------------------------------------------- coarse rollups (v8)
#
# A year read from rollup_day costs days x groups cells, from rollup_day_node days x groups x
# nodes.  As slurmdbd keeps hour, day and month tables, four more tables hold the same figures
# per month or week, and per node without the user, account and partition (schema v8, "coarse
# rollups"):
#
# - `rollup_month`: rollup_day's key with `day` the month's first day (a month of the rollups' zone);
# - `rollup_week`: the same per ISO week (`day` its Monday);
# - `rollup_node_day`: (cluster, day, node, gpu_model), rollup_day_node summed over the groups;
# - `rollup_node_month`: the same per month;
# - `rollup_partition_day` (v10): (cluster, day, partition, gpu_model), rollup_day summed over the
#   users and accounts: a year's --by partition,gpu-model,week read 220,000 rollup_week cells at
#   10 M records (200 users), here 365 days x 24 partitions and models.
#
# They are sums of their source's cells, so their figures are exact as the source's.  Job
# counts carry over: a simple job's days are contiguous, so it counts once in a month (week) as
# `jobs_first` on its first day there, or as `jobs_later` on the month's first day (a month's
# jobs_later is its first day's); the node tables count by node_kind (a job simple on the node
# lies in one group there, so in one of their cells a day).  Jobs counted distinct stay distinct
# (their rollup_jobs rows).  `rollup_days.month_day` and `week_day` name each day's month and week.


# table -> (source table, its own group columns besides cluster and day, the rollup_days column
# naming a day's period: its month's or ISO week's first day; None: per day)
COARSE: Dict[str, Tuple[str, Tuple[str, ...], Optional[str]]] = {
    "rollup_month": ("rollup_day", (*GROUP_COLUMNS, "nulls", "gkey"), "month_day"),
    "rollup_week": ("rollup_day", (*GROUP_COLUMNS, "nulls", "gkey"), "week_day"),
    "rollup_node_day": ("rollup_day_node", ("node", "gpu_model", "nulls"), None),
    "rollup_node_month": ("rollup_node_day", ("node", "gpu_model", "nulls"), "month_day"),
    "rollup_partition_day": ("rollup_day", ("partition", "gpu_model", "nulls"), None),
}
assert tuple(COARSE) == COARSE_TABLES


def null_mask(table: str) -> int:
    """The `nulls` bits a coarse table without gkey keeps: those of its own group columns."""
    return sum(NULL_BITS[c] for c in COARSE[table][1] if c in NULL_BITS)


def coarse_keys(table: str) -> List[str]:
    return ["cluster", "day", *COARSE[table][1]]


def _coarse_pk(table: str) -> List[str]:
    return ["cluster", "day", "gkey"] if "gkey" in COARSE[table][1] else coarse_keys(table)


def coarse_table_ddl(table: str, temporary: bool = False) -> str:
    own = COARSE[table][1]
    names = _group_ddl() if "gkey" in own else [*(f'"{c}" {NAME} NOT NULL' for c in own if c != "nulls"),
                                                "nulls TINYINT NOT NULL"]
    cols = ["cluster VARCHAR(64) NOT NULL", "day INT NOT NULL", *names,
            *(f'"{c}" {SUM} NOT NULL' for c, _ in SUMS), *(f'"{c}" BIGINT NOT NULL' for c, _ in COUNTS),
            *JOB_FIGURES_DDL, f"PRIMARY KEY ({_q(_coarse_pk(table))})", f"KEY {table}_day (day)"]
    return (f"CREATE {'TEMPORARY ' if temporary else ''}TABLE IF NOT EXISTS {_name(table, temporary)} (\n    "
            + ",\n    ".join(cols) + f"\n) {TAIL}")


def _coarse_select(table: str, source: str, first: str, later: str, peak: str, figures: Sequence[str],
                   since: int = 0) -> str:
    """SELECT of table's cells from the rows `source` (alias r, joined with its day as `dd`): their
    keys, `figures`, then the job counts and the peak given as expressions; cells from day `since` on."""
    _src, own, period = COARSE[table]
    day = f"dd.{period}" if period else "r.day"
    names = [f"(r.nulls & {null_mask(table)})" if c == "nulls" and "gkey" not in own else f'r."{c}"' for c in own]
    sel = ["r.cluster", day, *names, *figures, first, later, peak]
    group = ", ".join(str(i) for i, k in enumerate(coarse_keys(table), 1) if k in _coarse_pk(table))
    join = " JOIN rollup_days dd ON dd.day = r.day" + (f" WHERE {day} >= {int(since)}" if since else "")
    return f"SELECT {', '.join(sel)} FROM {source} r{join}\nGROUP BY {group}"


def _later_sum(col: str, table: str) -> str:
    """A cell's jobs_later: for a month or week, its first day's only."""
    period = COARSE[table][2]
    return f"SUM(CASE WHEN r.day = dd.{period} THEN {col} ELSE 0 END)" if period else f"SUM({col})"


def _coarse_cols(table: str) -> List[str]:
    return coarse_keys(table) + list(FIGURES + JOB_FIGURES)


def coarse_derive(table: str, target: str, source: str, since: int = 0) -> str:
    """target's cells (all figures) from day `since` on, from the cells `source` selects of table's
    source table (a build)."""
    figs = [f'SUM(r."{c}")' for c in FIGURES]
    sel = _coarse_select(table, source, 'SUM(r."jobs_first")', _later_sum('r."jobs_later"', table),
                         'MAX(r."peak_bytes")', figs, since)
    return f"INSERT INTO {target} ({_q(_coarse_cols(table))})\n{sel}"


def coarse_build(srv: Any, first_day: int = 0, temporary: bool = False, tables: Sequence[str] = COARSE_TABLES) -> None:
    """Fill the coarse tables (or their temporary twins) from the day tables, for their cells from
    the first day of first_day's week or month on (its days before first_day from the day tables
    as they are)."""
    month0 = period0(srv, first_day)
    for table in tables:
        source = COARSE[table][0]
        if temporary:
            srv.execute(f"DROP TEMPORARY TABLE IF EXISTS tmp_{table}")
            srv.execute(coarse_table_ddl(table, True))
        # (cells whose records all left are no cells: as _live() reads the tables)
        if temporary and source in COARSE:  # its twin holds the months from month0 already
            rows = f"(SELECT * FROM tmp_{source} WHERE records <> 0)"
        elif temporary:
            rows = (f"(SELECT * FROM {source} WHERE day >= {month0} AND day < {int(first_day)} AND records <> 0 "
                    f"UNION ALL SELECT * FROM tmp_{source} WHERE records <> 0)")
        else:
            rows = f"(SELECT * FROM {source} WHERE day >= {month0} AND records <> 0)"
        srv.execute(coarse_derive(table, _name(table, temporary), rows, month0))


def period0(srv: Any, first_day: int) -> int:
    """The first day of the week or month (whichever began first) holding first_day: where a
    rebuild from first_day rebuilds the coarse tables from."""
    if first_day <= 0:
        return 0
    row = srv.execute("SELECT LEAST(month_day, week_day) FROM rollup_days WHERE day = %s", (int(first_day),))
    return int(row[0][0]) if row else int(first_day)
