"""What a push does to the rollups (central/rollups.py, docs/central.md "Rollups"): the SQL of the
procedures `rollups_before(b)` and `rollups_after(b)` that `apply_batch` calls around its job_gpus
upsert, in the push's transaction.

The batch's records are keyed once and cut into their days once, summed per job, day, node and
group; from those come the batch's jobs' rollup_jobs rows with their kinds, the change of the
cells' job counts and peaks, and the net change of their sums, applied to each rollup table in one
upsert.  Every join runs along primary keys in a fixed order (schema v9).
"""
from __future__ import annotations

from typing import List

from slurm_gpu.central.rollups import (
    _DAY_JOIN,
    _EPOCH,
    COARSE,
    COUNTS,
    FIGURES,
    GROUP_COLUMNS,
    JOB_COLS,
    JOB_FIGURES,
    KINDS,
    SUM,
    SUM_TABLES,
    SUMS,
    VALID,
    _coarse_cols,
    _coarse_pk,
    _coarse_select,
    _cols,
    _first_later,
    _group_by,
    _group_select,
    _later_sum,
    _q,
    _with_kinds,
    null_mask,
)

_KINDED = JOB_COLS + list(KINDS)
_NODE_KEYS = ["cluster", "day", "node", *GROUP_COLUMNS, "nulls", "gkey"]
_COUNT_DELTAS = ("d_first", "d_later", "n_first", "n_later")

# A push's rollups (rollups_before) in temporary tables, each joined with STRAIGHT_JOIN along
# its keys: the batch's jobs; its records (+1 the staged rows the upsert applies, -1 the server's
# current versions of the staged rows, 0 its jobs' other rows), each keyed once, and their
# groups' names; the records' pieces per day, cut and weighed once and summed per job row; then
# the jobs' rows with their kinds and the cells' change from those.  The names (four
# VARCHAR(255)) stay in rollup_groups until the upserts: carried through every grouping, they
# made its temporary tables wide enough to go to disk.  The optimizer left to itself changed
# plans with the batch's size and the tables' statistics: from 4,000 records a batch the join
# with the days ran through rollup_days_start for every record (72 s for 8,000 records where
# 1.6 s is right), and the jobs' rows took 45 to 290 ms a batch from push to push.
_PUSH_TEMPS = ("rollup_batch_jobs", "rollup_recs", "rollup_groups", "rollup_jobday", "rollup_jobs_new", "rollup_cells",
               "rollup_delta")
_RECORD = ("cluster", "job_id", "node", *GROUP_COLUMNS, "start_time", "end_time", "energy_j", "gpu_util_mean_pct",
           "mem_util_mean_pct", "max_memory_bytes")
_KEY = ("cluster", "job_id", "restart_count", "node", "gpu_uuid")
_NARROW_JOB = ["cluster", "job_id", "day", "node", "nulls", "gkey", "peak_bytes"]  # rollup_jobs' columns but the names
_NARROW_CELL = ["cluster", "day", "node", "nulls", "gkey"]


def _key_on(a: str, b: str) -> str:
    return " AND ".join(f'{a}."{k}" = {b}."{k}"' for k in _KEY)


def _valid(alias: str) -> str:
    return VALID.replace("end_time", f"{alias}.end_time").replace("start_time", f"{alias}.start_time")


def _push_records() -> List[str]:
    """The batch's jobs, its records (sgn +1, -1, 0: see above) with their group keys, and the groups."""
    jobs = ("CREATE TEMPORARY TABLE rollup_batch_jobs (PRIMARY KEY (cluster, job_id))\n"
            "SELECT DISTINCT cluster, job_id FROM stage_job_gpus WHERE batch = b")
    staged = (f"SELECT 1 AS sgn, {_cols('s', _RECORD)} FROM stage_job_gpus s WHERE s.batch = b AND s.withdrawn = 0 "
              f"AND {_valid('s')}")
    # The server's rows of the batch's jobs, read once through the jobs' key prefix: -1 where the
    # batch stages a row of the same key (its current version goes out), 0 where it does not.  A
    # batch of new jobs costs one empty range per job, where a lookup per staged record (the
    # current versions) and a pass over the jobs' rows (the others) cost two reads.
    staged_too = f"EXISTS (SELECT 1 FROM stage_job_gpus t WHERE t.batch = b AND {_key_on('t', 'g')})"
    server = (f"SELECT IF({staged_too}, -1, 0) AS sgn, {_cols('g', _RECORD)} FROM rollup_batch_jobs j "
              f"STRAIGHT_JOIN job_gpus g ON g.cluster = j.cluster AND g.job_id = j.job_id "
              f"WHERE g.withdrawn = 0 AND {_valid('g')}")
    # each part keyed in its own statement: a UNION's derived table (with the names) was copied once more
    keyed = [f'{e} AS "{c}"' for e, c in zip(_group_select(), (*GROUP_COLUMNS, "nulls", "gkey"))]
    rest = [c for c in _RECORD if c not in GROUP_COLUMNS]
    recs = [f"SELECT r.sgn, {_cols('r', rest)}, {', '.join(keyed)} FROM ({part}) AS r" for part in (staged, server)]
    recs = [f"CREATE TEMPORARY TABLE rollup_recs AS\n{recs[0]}", f"INSERT INTO rollup_recs\n{recs[1]}"]
    groups = (f"CREATE TEMPORARY TABLE rollup_groups (PRIMARY KEY (gkey))\n"
              f"SELECT gkey, nulls, {_q(GROUP_COLUMNS)} FROM rollup_recs GROUP BY gkey")
    return [jobs, *recs, groups]


# A record's days are those of the primary key's range lo..hi (rollups._DAY_JOIN); the server
# looked that range up anew for every record ("Range checked for each record").  A record of at
# most _SHORT + 1 candidate days (nearly all: ~9 days and less) finds each by its key instead,
# day = lo + k for k = 0.._SHORT, from a constant table it reads in a join buffer; longer ones
# keep the range, in a second statement that adds their pieces to the job rows of the first.
_SHORT = 11
_LO = f"FLOOR((r.start_time - {_EPOCH!r}) / 86400) - 1"
_SPAN = f"FLOOR((r.end_time - {_EPOCH!r}) / 86400) + 1 - ({_LO})"
_OFFSETS = " UNION ALL ".join(f"SELECT {k} AS k" for k in range(_SHORT + 1))
_JOBDAY_KEY = ("cluster", "job_id", "day", "node", "gkey")


def _push_jobday() -> List[str]:
    """The records' pieces per day, summed per (job, day, node, group): the signed figures (the
    cells' change), the peak and whether the row is there after the upsert (`present`), and
    whether any of its records changes (`changed`)."""
    # (the sign applied before the cast: negating a double is exact, and the cast rounds both signs alike)
    figs = [*(f'SUM(CAST(r.sgn * {expr} AS {SUM})) AS "{c}"' for c, expr in SUMS),
            *(f'SUM(r.sgn * ({expr})) AS "{c}"' for c, expr in COUNTS)]
    keys = ["r.cluster", "r.job_id", "d.day", "r.node", "r.nulls", "r.gkey"]
    select = (f"SELECT {', '.join(keys)}, MAX(CASE WHEN r.sgn >= 0 THEN r.max_memory_bytes END) AS peak_bytes, "
              f"MAX(r.sgn >= 0) AS present, MAX(r.sgn <> 0) AS changed, {', '.join(figs)}\nFROM rollup_recs r ")
    on = "d.d_start < r.end_time AND d.d_end > r.start_time"
    short = (f"STRAIGHT_JOIN ({_OFFSETS}) AS o ON o.k <= {_SPAN}\nSTRAIGHT_JOIN rollup_days d FORCE INDEX (PRIMARY) "
             f"ON d.day = {_LO} + o.k AND {on}\nWHERE {_SPAN} <= {_SHORT}")
    long = f"{_DAY_JOIN.replace('JOIN rollup_days', 'STRAIGHT_JOIN rollup_days', 1)}\nWHERE {_SPAN} > {_SHORT}"
    added = ", ".join([f"peak_bytes = {_raised('rollup_jobday')}",
                       *(f"{c} = GREATEST({c}, VALUES({c}))" for c in ("present", "changed")),
                       *(f'"{c}" = "{c}" + VALUES("{c}")' for c in FIGURES)])
    return [f"CREATE TEMPORARY TABLE rollup_jobday (PRIMARY KEY ({_q(_JOBDAY_KEY)}))\n{select}{short}\nGROUP BY 1, 2, 3, 4, 6",
            f"INSERT INTO rollup_jobday\n{select}{long}\nGROUP BY 1, 2, 3, 4, 6\nON DUPLICATE KEY UPDATE {added}"]


def _jobs_change() -> List[str]:
    """The batch's jobs' rows as the upsert will leave their records (with their kinds), the change
    of their counts (old rows out, new in) and peaks (raised by the new rows; where old rows left
    a cell with a peak above the new rows', `peak_may_drop`) per node cell into rollup_cells, and
    the rows replaced."""
    rows = f"SELECT {_q(_NARROW_JOB)} FROM rollup_jobday WHERE present"
    kinded = _NARROW_JOB + list(KINDS)
    old = (f"SELECT -1 AS sgn, {_cols('o', kinded)} FROM rollup_batch_jobs s STRAIGHT_JOIN rollup_jobs o "
           "ON o.cluster = s.cluster AND o.job_id = s.job_id")
    new = f"SELECT 1, {_cols('n', kinded)} FROM rollup_jobs_new n"
    deltas = [f'{e} AS "{c}"' for c, table in (("d", "rollup_day"), ("n", "rollup_day_node"))
              for e, c in zip(_first_later(table, "j.sgn * "), (f"{c}_first", f"{c}_later"))]
    # A cell's peak is taken again from its rows only where an old row's peak is above every new row's
    # in the node cell: a multi-node job's rows that another node's push takes out and puts back as
    # they were (its batch rewrites all of its job's rows) leave every peak as it was.  Taking the
    # peaks again read a whole day of rollup_day's cells for rollup_partition_day's, with shared locks
    # that every push of that day waited on (benchmarks/bench_central_load.py: most of the deadlocks).
    old_peak, new_peak = ("MAX(CASE WHEN j.sgn < 0 THEN j.peak_bytes END)", "MAX(CASE WHEN j.sgn > 0 THEN j.peak_bytes END)")
    deltas += [f"{new_peak} AS new_peak", f"COALESCE({old_peak} > {new_peak}, {old_peak} IS NOT NULL) AS peak_may_drop"]
    cells = (f"CREATE TEMPORARY TABLE rollup_cells AS\nSELECT {_cols('j', _NARROW_CELL)}, {', '.join(deltas)}\n"
             f"FROM ({old}\n  UNION ALL\n  {new}) AS j\nGROUP BY 1, 2, 3, 5")
    named = [f'g."{c}"' if c in GROUP_COLUMNS else f'n."{c}"' for c in _KINDED]
    return [f"CREATE TEMPORARY TABLE rollup_jobs_new AS\n{_with_kinds(rows, _NARROW_JOB)}", cells,
            "DELETE j FROM rollup_batch_jobs s STRAIGHT_JOIN rollup_jobs j ON j.cluster = s.cluster AND j.job_id = s.job_id",
            f"INSERT INTO rollup_jobs ({_q(_KINDED)}) SELECT {', '.join(named)}\n"
            "FROM rollup_jobs_new n STRAIGHT_JOIN rollup_groups g ON g.gkey = n.gkey"]


def _cell_upserts() -> List[str]:
    """rollup_delta's node cells (sums, counts and raised peaks) into the day tables, each once;
    then the peaks of the cells a job's rows left, from the rows there now."""
    out = []
    for table, extra in SUM_TABLES.items():
        keys = ["cluster", "day", *extra, *GROUP_COLUMNS, "nulls", "gkey"]
        p = "n" if extra else "d"
        figs = [f'SUM(c."{c}")' for c in FIGURES] + [f"SUM(c.{p}_first)", f"SUM(c.{p}_later)", "MAX(c.new_peak)"]
        upd = ", ".join(f'{table}."{c}" = {table}."{c}" + VALUES("{c}")' for c in (*FIGURES, "jobs_first", "jobs_later"))
        out.append(f"INSERT INTO {table} ({_q(keys + list(FIGURES + JOB_FIGURES))})\n"
                   f"SELECT {_cols('c', keys)}, {', '.join(figs)} FROM rollup_delta c\n"
                   f"{_group_by(keys)}\nON DUPLICATE KEY UPDATE {upd}, {table}.peak_bytes = {_raised(table)}")
        out.append(_peaks_again(table))
    return out


def _raised(table: str) -> str:
    return (f'GREATEST(COALESCE({table}.peak_bytes, VALUES(peak_bytes)), '
            f'COALESCE(VALUES(peak_bytes), {table}.peak_bytes))')


def _peaks_again(table: str) -> str:
    """The peaks of the cells a job's rows left, from the rows there now (peaks only rise otherwise:
    no other job's rows are read, so concurrent pushes into one cell do not wait on each other's)."""
    keys = ["cluster", "day", *SUM_TABLES[table], "gkey"]
    on = " AND ".join(f'r."{k}" = c."{k}"' for k in keys)
    same = " AND ".join(f'x."{k}" = r."{k}"' for k in ("day", "gkey", "cluster", *SUM_TABLES[table]))
    cells = f"SELECT DISTINCT {_cols('o', keys)} FROM rollup_delta o WHERE o.peak_may_drop"
    return _only_where_rows_left(f"UPDATE ({cells}) AS c STRAIGHT_JOIN {table} r {_BY_KEY} ON {on}\n"
                                 f"SET r.peak_bytes = (SELECT MAX(x.peak_bytes) FROM rollup_jobs x "
                                 f"FORCE INDEX (rollup_jobs_cell) WHERE {same})")


# The peaks-again updates find each cell and its rows by their keys, in this order: left to
# itself the server read the cells of rollup_node_day and rollup_node_month end to end for every
# cell a batch changed, and every row of the cluster in rollup_jobs, rollup_day or rollup_node_day
# for each peak (their primary keys' first column, the cluster; ~2.6 s for a batch of 2,000
# records that replace others on a 100,000-record server, 0.1 s with the keys).
_BY_KEY = "FORCE INDEX (PRIMARY)"


def _only_where_rows_left(update: str) -> str:
    """A peaks-again UPDATE, run only when a job's rows left a cell with a peak above the rows that
    replace them (a batch of new jobs: only where a job's GPUs came in the batch before with a
    higher peak), the cells first, each found by its primary key."""
    return f"IF EXISTS (SELECT 1 FROM rollup_delta WHERE peak_may_drop) THEN\n  {update};\nEND IF"


def _delta() -> List[str]:
    """The batch's whole change per node cell, once, into a temporary table: the job rows' signed
    sums (the records' current versions out, the staged ones in) and rollup_cells' counts and
    peaks, with the group's names (rollups_after puts it into every table: _cells)."""
    zeros = ", ".join(["0"] * len(FIGURES))
    sums = (f"SELECT {_q(_NARROW_CELL)}, {_q(FIGURES)}, 0 AS d_first, 0 AS d_later, 0 AS n_first, 0 AS n_later, "
            "NULL AS new_peak, 0 AS peak_may_drop FROM rollup_jobday WHERE changed")
    cells = (f"SELECT {_cols('c', _NARROW_CELL)}, {zeros}, {', '.join(f'c.{k}' for k in _COUNT_DELTAS)}, c.new_peak, "
             "c.peak_may_drop FROM rollup_cells c")
    agg = [*(f'SUM(u."{c}") AS "{c}"' for c in (*FIGURES, *_COUNT_DELTAS)), 'MAX(u.new_peak) AS new_peak',
           'MAX(u.peak_may_drop) AS peak_may_drop']
    grouped = (f"SELECT {_cols('u', _NARROW_CELL)}, {', '.join(agg)} FROM ({sums}\n  UNION ALL\n  {cells}) AS u "
               "GROUP BY 1, 2, 3, 5")
    named = [f'g."{c}"' if c in GROUP_COLUMNS else f'x."{c}"' for c in _NODE_KEYS]
    make = (f"CREATE TEMPORARY TABLE rollup_delta AS\nSELECT {', '.join(named)}, "
            f"{_cols('x', (*FIGURES, *_COUNT_DELTAS, 'new_peak', 'peak_may_drop'))}\n"
            f"FROM ({grouped}) AS x STRAIGHT_JOIN rollup_groups g ON g.gkey = x.gkey")
    return [f"DROP TEMPORARY TABLE IF EXISTS {', '.join(_PUSH_TEMPS)}", *_push_records(), *_push_jobday(),
            *_jobs_change(), make]


def _cells() -> List[str]:
    """rollup_delta into every table's cells, each in one statement (peaks again where they may drop)."""
    out = _cell_upserts()
    for t in COARSE:  # (in order: rollup_node_month's peaks come from rollup_node_day's)
        out += [_coarse_upsert(t), _coarse_peaks_again(t)]
    return out + [f"DROP TEMPORARY TABLE {', '.join(_PUSH_TEMPS)}"]


def procedures() -> List[str]:
    """rollups_before(b) / rollups_after(b): what apply_batch calls around its job_gpus upsert,
    in the same transaction.  Before it, all of the batch's change, read while the records are as
    before: its jobs' rows and counts as the upsert will leave their records, and the net change
    of the sums (its records' current versions out, the staged ones in), into temporary tables.
    After it, that change into each table's cells once: the cells other pushes write too (a day's
    partition and model, a day's group) are locked as late as apply_batch allows, and so held for
    the shortest time (benchmarks/bench_central_load.py: at 4,000 nodes on the timer, pushes
    waited on rollup_partition_day's cells most)."""
    out = []
    for name, body in (("rollups_before", _delta()), ("rollups_after", _cells())):
        out.append(f"CREATE OR REPLACE PROCEDURE {name}(IN b CHAR(32)) MODIFIES SQL DATA SQL SECURITY DEFINER\n"
                   "BEGIN\n  " + ";\n  ".join(body) + ";\nEND")
    return out


BEFORE_UPSERT = "CALL rollups_before(b)"  # apply_batch: before job_gpus' upsert
AFTER_UPSERT = "CALL rollups_after(b)"  # apply_batch: after it, before the staging rows go




def _coarse_upsert(table: str) -> str:
    """push: the batch's change (rollup_delta's node cells: sums, counts, raised peaks) into table."""
    p = "n" if "node" in COARSE[table][1] else "d"  # node tables count per node
    figs = [f'SUM(r."{c}")' for c in FIGURES]
    sel = _coarse_select(table, "rollup_delta", f"SUM(r.{p}_first)", _later_sum(f"r.{p}_later", table),
                         "MAX(r.new_peak)", figs)
    upd = ", ".join(f'{table}."{c}" = {table}."{c}" + VALUES("{c}")' for c in (*FIGURES, "jobs_first", "jobs_later"))
    return (f"INSERT INTO {table} ({_q(_coarse_cols(table))})\n{sel}\n"
            f"ON DUPLICATE KEY UPDATE {upd}, {table}.peak_bytes = {_raised(table)}")


def _coarse_peaks_again(table: str) -> str:
    """push: the peaks of table's cells that a job's rows left, from their source's cells now."""
    source, own, period = COARSE[table]
    pk = _coarse_pk(table)
    keys = [k for k in pk if k != "day"]
    model = f"(o.nulls & {null_mask(table)})" if "gkey" not in own else "o.nulls"
    picked = [(f"dd.{period}" if period else "o.day") + ' AS "day"'] + [
        (f'{model} AS "nulls"' if k == "nulls" else f'o."{k}"') for k in keys]
    cells = (f"SELECT DISTINCT {', '.join(picked)} FROM rollup_delta o JOIN rollup_days dd ON dd.day = o.day "
             "WHERE o.peak_may_drop")
    on = " AND ".join(f'r."{k}" = c."{k}"' for k in pk)
    if source == "rollup_day" and "gkey" not in own:
        return _only_where_rows_left(_peaks_by_day(table, cells, on))
    same = [f'x."{k}" = r."{k}"' for k in keys if k not in ("nulls", "gpu_model")]
    if "gkey" not in own and source == "rollup_day_node":  # the node's cells of every group with that model
        same += ['x."gpu_model" = r."gpu_model"', f"(x.nulls & {null_mask(table)}) = r.nulls"]
    elif "gkey" not in own:
        same += ['x."gpu_model" = r."gpu_model"', "x.nulls = r.nulls"]
    if period:  # the period's days (rollup_days_month or _week), then each day's cells by the source's key
        sub = (f"SELECT MAX(x.peak_bytes) FROM rollup_days md FORCE INDEX (rollup_days_{period.split('_')[0]}) "
               f"STRAIGHT_JOIN {source} x {_BY_KEY} ON x.day = md.day AND {' AND '.join(same)} WHERE md.{period} = r.day")
    else:
        sub = f"SELECT MAX(x.peak_bytes) FROM {source} x {_BY_KEY} WHERE x.day = r.day AND {' AND '.join(same)}"
    return _only_where_rows_left(f"UPDATE ({cells}) AS c STRAIGHT_JOIN {table} r {_BY_KEY} ON {on}\n"
                                 f"SET r.peak_bytes = ({sub})")


def _peaks_by_day(table: str, cells: str, on: str) -> str:
    """rollup_partition_day's peaks again: its source, rollup_day, is keyed by the groups' hash, so a
    cell's source cells are among all of its day's (a range of the source's key): each such day
    is read once, its peaks taken per cell, and set on the cells the batch's rows left."""
    source = COARSE[table][0]
    own = [c for c in COARSE[table][1] if c != "nulls"]
    names = ", ".join(f'x."{c}"' for c in own)
    peaks = (f"SELECT x.cluster, x.day, {names}, (x.nulls & {null_mask(table)}) AS nulls, MAX(x.peak_bytes) AS peak "
             f"FROM (SELECT DISTINCT l.cluster, l.day FROM ({cells}) AS l) AS d\n"
             f"    STRAIGHT_JOIN {source} x {_BY_KEY} ON x.cluster = d.cluster AND x.day = d.day "
             f"GROUP BY 1, 2, {', '.join(str(i) for i in range(3, len(own) + 4))}")
    p_on = " AND ".join(f'p."{k}" = c."{k}"' for k in _coarse_pk(table))
    return (f"UPDATE ({cells}) AS c STRAIGHT_JOIN {table} r {_BY_KEY} ON {on}\n"
            f"  LEFT JOIN ({peaks}) AS p ON {p_on}\nSET r.peak_bytes = p.peak")
