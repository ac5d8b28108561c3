"""Running jobs' GPU samples and the idle policy's actions in the node database (schema v11,
docs/efficiency.md): which job starts are still running here, the samples' writes, their
downsampling and their bounds, and the actions' rows.

Standard library only; every function takes an open connection (Store.connect()).
"""
from __future__ import annotations

import sqlite3
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

from slurm_gpu.store import schema
from slurm_gpu.store.apply import rollback
from slurm_gpu.store.schema import SAMPLE_COLUMNS

COARSE_STEP_S = 600.0  # a coarse row covers at most one 10-minute bucket of one GPU
# A sample row in the database file, its indexes and outbox columns included, with most rows coarse (measured:
# benchmarks/bench_efficiency.py, 214 bytes; docs/benchmarks.md).
ROW_BYTES = 215

ACTION_COLUMNS = schema.ACTION_COLUMNS + ("message",)


class RunningStart(NamedTuple):
    """One GPU (or MIG slice) of a job start the prolog recorded here and no epilog has ended."""

    cluster: str
    job_id: int
    restart_count: int
    node: str
    gpu_uuid: str
    gpu_index: Optional[int]
    start_time: float
    energy_mj: Optional[int]


def running_starts(conn: sqlite3.Connection, node: str, booted_at: float) -> List[RunningStart]:
    """The job starts on `node` that have no end record, started since the node booted (a start from
    before a crash is no running job).  A GPU claimed by two starts belongs to the newer one: the older
    one's epilog record never arrived (it sits in the spool or was lost with the node)."""
    rows = conn.execute(
        "SELECT s.cluster, s.job_id, s.restart_count, s.node, s.gpu_uuid, s.gpu_index, s.start_time, s.energy_mj "
        "FROM job_starts s WHERE s.node = ? AND s.start_time >= ? AND NOT EXISTS (SELECT 1 FROM jobs j "
        "WHERE j.cluster = s.cluster AND j.job_id = s.job_id AND j.restart_count = s.restart_count AND j.node = s.node) "
        "ORDER BY s.start_time", (node, booted_at)).fetchall()
    by_gpu: Dict[str, RunningStart] = {}
    for r in rows:
        by_gpu[r[4]] = RunningStart(*r)  # ordered by start time: the newest start of a GPU stays
    return sorted(by_gpu.values(), key=lambda s: (s.cluster, s.job_id, s.restart_count, s.gpu_index or 0, s.gpu_uuid))


def insert_samples(conn: sqlite3.Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    sql = f"INSERT INTO job_samples ({', '.join(SAMPLE_COLUMNS)}) VALUES ({', '.join('?' * len(SAMPLE_COLUMNS))})"
    conn.executemany(sql, [tuple(r.get(c) for c in SAMPLE_COLUMNS) for r in rows])


def downsample(conn: sqlite3.Connection, before: float) -> int:
    """Merge the fine rows of the 10-minute buckets that end before `before` into one coarse row per
    bucket and GPU; returns the fine rows merged.  The cut is at a bucket boundary, so a bucket is merged
    whole and fine and coarse rows never overlap."""
    cut = (before // COARSE_STEP_S) * COARSE_STEP_S
    conn.execute(
        f"INSERT INTO job_samples ({', '.join(SAMPLE_COLUMNS)}) "
        "SELECT cluster, job_id, restart_count, node, gpu_uuid, MAX(gpu_index), MAX(time), SUM(span_s), SUM(samples), 1, "
        "SUM(gpu_util_pct * span_s) / SUM(CASE WHEN gpu_util_pct IS NOT NULL THEN span_s END), MAX(gpu_util_max_pct), "
        "MAX(memory_used_bytes), MAX(memory_total_bytes), MAX(energy_j) "
        "FROM job_samples WHERE coarse = 0 AND time < ? "
        f"GROUP BY cluster, job_id, restart_count, node, gpu_uuid, CAST(time / {COARSE_STEP_S} AS INTEGER)",
        (cut,))
    return conn.execute("DELETE FROM job_samples WHERE coarse = 0 AND time < ?", (cut,)).rowcount


def bound(conn: sqlite3.Connection, keep_before: float, max_bytes: float) -> int:
    """Delete samples older than `keep_before`, then the oldest rows past the cap; returns rows deleted."""
    # Both through the (coarse, time) index: a range per kind of row, never a scan of the table.
    gone = conn.execute("DELETE FROM job_samples WHERE coarse IN (0, 1) AND time < ?", (keep_before,)).rowcount
    over = conn.execute("SELECT count(*) FROM job_samples").fetchone()[0] - int(max_bytes // ROW_BYTES)
    for coarse in (1, 0):  # the oldest coarse rows first: fine rows are the last hour's
        if over > 0:
            n = conn.execute("DELETE FROM job_samples WHERE id IN (SELECT id FROM job_samples WHERE coarse = ? "
                             "ORDER BY time LIMIT ?)", (coarse, over)).rowcount
            gone, over = gone + n, over - n
    return int(gone)


def record_samples(conn: sqlite3.Connection, rows: Sequence[Mapping[str, Any]], *, fine_before: float,
                   keep_before: float, max_bytes: float) -> Dict[str, int]:
    """One run's samples, the downsampling and the bounds: one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        insert_samples(conn, rows)
        merged = downsample(conn, fine_before)
        deleted = bound(conn, keep_before, max_bytes)
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return {"written": len(rows), "merged": merged, "deleted": deleted}


def job_samples(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int,
                since: float = 0.0) -> List[Dict[str, Any]]:
    """A job start's samples on this node, oldest first."""
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(
            f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM job_samples WHERE cluster = ? AND job_id = ? AND restart_count = ? "
            "AND time >= ? ORDER BY time, gpu_uuid", (cluster, job_id, restart_count, since))]
    finally:
        conn.row_factory = None


TOTAL_COLUMNS = ("node", "gpu_uuid", "gpu_index", "start", "end", "util_pct", "memory_max_bytes", "memory_total_bytes",
                 "energy_j")


def totals_sql(mark: str = "?") -> str:
    """A job start's figures so far per GPU, over all its samples (fine and coarse rows never overlap, here and on
    the central server): the SQL for SQLite (mark '?') and MariaDB ('%s')."""
    return ("SELECT node, gpu_uuid, MAX(gpu_index), MIN(time - span_s), MAX(time), "
            "SUM(gpu_util_pct * span_s) / SUM(CASE WHEN gpu_util_pct IS NOT NULL THEN span_s END), "
            "MAX(memory_used_bytes), MAX(memory_total_bytes), MAX(energy_j) FROM job_samples "
            f"WHERE cluster = {mark} AND job_id = {mark} AND restart_count = {mark} GROUP BY node, gpu_uuid")


def job_totals(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int) -> List[Dict[str, Any]]:
    return [dict(zip(TOTAL_COLUMNS, r)) for r in conn.execute(totals_sql(), (cluster, job_id, restart_count))]


# --------------------------------------------------------------------------- actions


def actions_of(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int) -> Dict[str, Dict[str, Any]]:
    """{stage: action row} of one job start."""
    conn.row_factory = sqlite3.Row
    try:
        return {r["stage"]: dict(r) for r in conn.execute(
            "SELECT id, * FROM efficiency_actions WHERE cluster = ? AND job_id = ? AND restart_count = ?",
            (cluster, job_id, restart_count))}
    finally:
        conn.row_factory = None


def mails_since(conn: sqlite3.Connection, to: str, since: float) -> int:
    """Mails sent to `to` since `since` (the daily cap counts what went out)."""
    return int(conn.execute("SELECT count(*) FROM efficiency_actions WHERE mail_to = ? AND mail_state = 'sent' "
                            "AND mail_time >= ?", (to, since)).fetchone()[0])


def add_action(conn: sqlite3.Connection, row: Mapping[str, Any]) -> Optional[int]:
    """The decision, written before anything is mailed or cancelled; None when the job start already has
    a row for the stage (another run decided it first)."""
    cols = [c for c in ACTION_COLUMNS if c in row]  # the others take their defaults
    # Only the stage's own key may make it a no-op: a NOT NULL violation (a bug) must raise, not vanish.
    cur = conn.execute(f"INSERT INTO efficiency_actions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
                       "ON CONFLICT (cluster, job_id, restart_count, stage) DO NOTHING", tuple(row[c] for c in cols))
    return int(cur.lastrowid) if cur.rowcount == 1 and cur.lastrowid is not None else None


def update_action(conn: sqlite3.Connection, row_id: int, **values: Any) -> None:
    bad = set(values) - set(ACTION_COLUMNS)
    assert not bad, bad
    conn.execute(f"UPDATE efficiency_actions SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?",
                 (*values.values(), row_id))


def pending_mails(conn: sqlite3.Connection, retry_before: float) -> List[Dict[str, Any]]:
    """Actions whose mail is still to go: never tried, or failed and last tried before `retry_before`."""
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(
            "SELECT id, * FROM efficiency_actions WHERE mail_state = 'pending' "
            "OR (mail_state = 'failed' AND (mail_time IS NULL OR mail_time < ?)) ORDER BY time", (retry_before,))]
    finally:
        conn.row_factory = None


def actions(conn: sqlite3.Connection, since: float = 0.0, stages: Iterable[str] = ()) -> List[Dict[str, Any]]:
    """Every action since `since`, oldest first (`slurm-gpu efficiency actions`)."""
    stages = tuple(stages)
    where = " AND stage IN (" + ", ".join("?" * len(stages)) + ")" if stages else ""
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(
            f"SELECT id, * FROM efficiency_actions WHERE time >= ?{where} ORDER BY time, job_id", (since, *stages))]
    finally:
        conn.row_factory = None
