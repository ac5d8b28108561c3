"""How a record becomes rows of the node database: every SQL write statement, the first-wins
rules, the completion of partial rows by their start record, and the dedupe keys of events and
drains (docs/hooks.md, "Nothing is lost").  store/node.py's Store decides where a record goes
(database or spool); this module applies it inside one transaction.  Standard library only (hook path).
"""
from __future__ import annotations

import sqlite3
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from slurm_gpu.store.record import (
    DRAIN_COLUMNS,
    HEALTH_COLUMNS,
    JOB_GPU_WRITE_COLUMNS,
    JOB_KEY,
    JOB_WRITE_COLUMNS,
    START_COLUMNS,
    accounting_of,
    drains_of,
    usage,
    xid_text,
    xids_after,
)
from slurm_gpu.store.schema import INVENTORY_COLUMNS, XID_COLUMNS, XID_SAME_S

START_RECORDS_KEPT_S = 7 * 86400
# healthcheck's event for nvmlInit's LIB_RM_VERSION_MISMATCH (hooks/healthcheck.record_mismatch)
MISMATCH_CHECK = "driver_library_mismatch"

_JOB_COLUMNS = JOB_WRITE_COLUMNS[:JOB_WRITE_COLUMNS.index("partial")]  # jobs as v1 wrote it, before `partial`
_DEFAULTS = {"partial": 0, "restart_count": 0}
# Columns that follow the winning record as a whole; the others are filled from the loser where empty.
_WINNER_ONLY = frozenset(("start_time", "end_time", "duration_s", "partial", "notes", "end_counters"))


def insert_sql(table: str, columns: Tuple[str, ...], verb: str = "INSERT") -> str:
    return f"{verb} INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _first_wins(table: str, columns: Tuple[str, ...], key: Tuple[str, ...]) -> str:
    """An upsert: a complete record beats a partial one, then the earlier end_time (the first
    epilog run) wins; the loser only fills the winner's empty columns — and only a record of the
    same kind: a partial record's lower-bound figures never mix into a complete one."""
    old = table
    new_wins = (f"(excluded.partial < {old}.partial OR (excluded.partial = {old}.partial "
                f"AND excluded.end_time < {old}.end_time))")
    sets = []
    for c in columns:
        if c in key:
            continue
        if c in _WINNER_ONLY:
            expr = f"CASE WHEN {new_wins} THEN excluded.{c} ELSE {old}.{c} END"
        else:
            expr = (f"CASE WHEN excluded.partial < {old}.partial THEN excluded.{c} "
                    f"WHEN excluded.partial > {old}.partial THEN {old}.{c} "
                    f"WHEN excluded.end_time < {old}.end_time THEN COALESCE(excluded.{c}, {old}.{c}) "
                    f"ELSE COALESCE({old}.{c}, excluded.{c}) END")
        sets.append(f"{c} = {expr}")
    return f"{insert_sql(table, columns)} ON CONFLICT ({', '.join(key)}) DO UPDATE SET {', '.join(sets)}"


_SQL = {
    "job": _first_wins("jobs", JOB_WRITE_COLUMNS, JOB_KEY),
    "job_gpu": _first_wins("job_gpus", JOB_GPU_WRITE_COLUMNS, JOB_KEY + ("gpu_uuid",)),
    # A prolog re-run for the same job start keeps the latest counters.
    "start": insert_sql("job_starts", START_COLUMNS, "INSERT OR REPLACE"),
    # The first occurrence of an event wins (a re-run epilog's copy is later).
    "health": insert_sql("health_events", HEALTH_COLUMNS) + (
        " ON CONFLICT (dedupe_key) DO UPDATE SET time = excluded.time, message = excluded.message"
        " WHERE excluded.time < health_events.time"),
    "drain": insert_sql("drains", DRAIN_COLUMNS) + " ON CONFLICT (dedupe_key) DO NOTHING",
}


def _value(v: Any) -> Any:
    """A value SQLite takes whatever the record holds: text that UTF-8 cannot encode (bytes
    that were not UTF-8 in Slurm's environment) gets backslash escapes, an integer beyond
    64 bits becomes a float, anything structured becomes JSON text."""
    if v is None or isinstance(v, (float, bytes)):
        return v
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v if -(1 << 63) <= v < (1 << 63) else float(v)
    if isinstance(v, str):
        try:
            v.encode("utf-8")
            return v
        except UnicodeEncodeError:
            return v.encode("utf-8", "backslashreplace").decode("utf-8")
    import json
    return _value(json.dumps(v, sort_keys=True, default=str))


def sql_row(d: Dict[str, Any], columns: Iterable[str]) -> Tuple[Any, ...]:
    """A record's row as SQLite takes it; a job's XID events become their JSON text here, no sooner."""
    return tuple(_value(xid_text(d.get(c)) if c == "xid_events" else d.get(c, _DEFAULTS.get(c))) for c in columns)


# --------------------------------------------------------------------------- error words


class Incomplete(Exception):
    pass


def drains_or_none(rec: Dict[str, Any]) -> List[Any]:
    try:
        drains = drains_of(rec)
    except KeyError:  # a drain record of neither shape: not trusted to say anything
        return []
    return drains if isinstance(drains, list) else []


# --------------------------------------------------------------------------- the fleet's history

SQL_XID = (f"INSERT INTO xid_events ({', '.join(XID_COLUMNS)}) VALUES ({', '.join('?' * len(XID_COLUMNS))}) "
           "ON CONFLICT (event_key) DO NOTHING")
_SAME_XID = "node = ? AND xid = ? AND pci_bus_id IS ? AND detail IS ?"
# The row of the same flood (v11): its lines overlap the event's, the one with the same first line first.
_XID_FLOOD = (f"SELECT id, time, line_count, last_time FROM xid_events WHERE last_time >= ? AND time <= ? AND {_SAME_XID} "
              "ORDER BY time BETWEEN ? AND ? DESC, time DESC LIMIT 1")
# Rows written before v11, one per line (last_time NULL): the one of the event's first line, and how many
# more lie inside the event's lines (already recorded, so not counted again).
_XID_LINE = (f"SELECT id, time, line_count, time FROM xid_events WHERE time BETWEEN ? AND ? AND +last_time IS NULL "
             f"AND {_SAME_XID} ORDER BY ABS(time - ?) LIMIT 1")
_XID_LINES = (f"SELECT COUNT(*) FROM xid_events WHERE time BETWEEN ? AND ? AND +last_time IS NULL AND {_SAME_XID} "
              "AND id IS NOT ?")


def write_xids(conn: sqlite3.Connection, rows: Sequence[Dict[str, Any]]) -> int:
    """Add the xid_events rows (store/observations.xid_rows), or grow the row of a flood read before;
    in one transaction.  Returns how many rows were added or grown.

    An event is the row's that has the same node, GPU bus, XID and text and either the same first
    line (within XID_SAME_S: a kmsg date read again one rounding away): its line count is the larger
    (the window still holds the flood's start, so the new count is its whole); or a first line inside
    the row's lines (the window moved on): the lines after the row's last are added (gpu/xid.py
    runs_after: exact but for one slice of the window).  Rows of single lines written before v11
    inside the event's lines are its lines already: not counted again."""
    from slurm_gpu.gpu.xid import runs_after
    changed = 0
    conn.execute("BEGIN IMMEDIATE")
    try:
        for r in rows:
            t, last, count = r["time"], r.get("last_time") or r["time"], int(r.get("line_count") or 1)
            same = (r["node"], r["xid"], r["pci_bus_id"], r["detail"])
            hit = conn.execute(_XID_FLOOD, (t - XID_SAME_S, last + XID_SAME_S, *same, t - XID_SAME_S,
                                            t + XID_SAME_S)).fetchone()
            if hit is None:
                hit = conn.execute(_XID_LINE, (t - XID_SAME_S, t + XID_SAME_S, *same, t)).fetchone()
            if hit is not None and abs(hit[1] - t) > XID_SAME_S:  # the window moved on: the new lines only
                grown, new_last = hit[2] + runs_after(r.get("runs") or ((t, last, count),), hit[3]), max(hit[3], last)
            else:
                legacy = conn.execute(_XID_LINES, (t - XID_SAME_S, last + XID_SAME_S, *same,
                                                   None if hit is None else hit[0])).fetchone()[0]
                grown = count - legacy
                if hit is None:
                    if grown > 0:
                        cur = conn.execute(SQL_XID, sql_row(dict(r, line_count=grown, last_time=last), XID_COLUMNS))
                        changed += cur.rowcount
                    continue
                grown, new_last = max(hit[2], grown), max(hit[3], last)
            if (grown, new_last) != (hit[2], hit[3]):
                conn.execute("UPDATE xid_events SET line_count = ?, last_time = ? WHERE id = ?", (grown, new_last, hit[0]))
                changed += 1
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return changed


def latest_inventory(conn: sqlite3.Connection, node: str) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """{(node, GPU UUID): its latest gpu_inventory row} (SQLite takes the bare columns from the
    row holding MAX(id): the newest row of each GPU, one index range per node)."""
    cols = ", ".join(INVENTORY_COLUMNS)
    out: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for r in conn.execute(f"SELECT {cols}, MAX(id) FROM gpu_inventory WHERE node = ? GROUP BY gpu_uuid", (node,)):
        row = dict(zip(INVENTORY_COLUMNS, r))
        out[(row["node"], row["gpu_uuid"])] = row
    return out


def latest_mismatch(conn: sqlite3.Connection, node: str, after: Optional[float]) -> float:
    """When the node's latest driver/library mismatch event after `after` (the oldest of its GPUs'
    latest rows: only a newer event makes a row due) was recorded; 0.0: none.  The time index
    keeps this to the recent events (a full scan of 100,000 events took 22 ms)."""
    if after is None:
        return 0.0
    (t,) = conn.execute("SELECT MAX(time) FROM health_events WHERE time > ? AND node = ? AND check_name = ?",
                        (after, node, MISMATCH_CHECK)).fetchone()
    return float(t or 0.0)


def inventory_due(last: Optional[Dict[str, Any]], row: Dict[str, Any], every_s: float, now: float,
                   mismatch_at: float = 0.0) -> bool:
    """A GPU's row is due when it changed, is every_s old, or is older than the node's latest
    driver/library mismatch: `fleet` takes the newer of the two as the node's state."""
    if last is None or now - (last["time"] or 0.0) >= every_s or (last["time"] or 0.0) < mismatch_at:
        return True
    return any(_value(row.get(c)) != last[c] for c in INVENTORY_COLUMNS if c != "time")


def write_all(conn: sqlite3.Connection, sql: str, params: List[Tuple[Any, ...]]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(sql, params)
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise


# --------------------------------------------------------------------------- applying records


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back what is still open.  SQLite rolls back by itself on some errors (disk full):
    a second ROLLBACK would replace the real error with 'cannot rollback'."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def apply_in_transaction(conn: sqlite3.Connection, rec: Dict[str, Any]) -> None:
    """One record, all or nothing; the write lock is taken up front (BEGIN IMMEDIATE) so a busy
    database makes us wait busy_timeout once instead of failing halfway.

    A table that only completes the record (start records, drains) may be unreadable (corrupt)
    while the rest of the database takes writes; SQLite then fails every later statement of the
    transaction, so the record is written again without those lookups, as it came."""
    for lookups in (True, False):
        conn.execute("BEGIN IMMEDIATE")
        try:
            _apply(conn, rec, lookups)
            conn.execute("COMMIT")
            return
        except _LookupFailed:
            rollback(conn)
        except BaseException:
            rollback(conn)
            raise


class _LookupFailed(Exception):
    pass


def _apply(conn: sqlite3.Connection, rec: Dict[str, Any], lookups: bool = True) -> None:
    kind = rec["kind"]
    if kind == "job_start":
        starts = rec.get("starts") or []
        conn.executemany(_SQL["start"], [sql_row(s, START_COLUMNS) for s in starts])
        for s in starts:
            _complete_partial_rows(conn, s)
    elif kind == "job_end":
        _apply_job_end(conn, rec, lookups)
    if kind in ("job_end", "health") and rec.get("events"):
        conn.executemany(_SQL["health"], [sql_row(dict(e, dedupe_key=_event_key(rec, e)), HEALTH_COLUMNS)
                                          for e in rec["events"]])
    if kind == "drain":
        for d in drains_of(rec):
            conn.execute(_SQL["drain"], sql_row(dict(d, dedupe_key=_drain_key(d)), DRAIN_COLUMNS))
            if d.get("source") == "prolog" and d.get("job_id") is not None and d.get("cluster") is not None:
                _drop_partial_rows(conn, d["cluster"], d["job_id"], d.get("restart_count") or 0, d["node"])


def _apply_job_end(conn: sqlite3.Connection, rec: Dict[str, Any], lookups: bool = True) -> None:
    job = dict(rec["job"])
    gpus = [dict(g) for g in rec.get("gpus", [])]
    key = tuple(job[k] for k in JOB_KEY)
    if lookups and any(g.get("partial") for g in gpus):
        if _readable(prolog_failed, conn, *key):
            # The prolog failed on this node: the job was requeued and never ran here.
            gpus = [g for g in gpus if not g.get("partial")]
            if not gpus:
                return
        else:
            for i, g in enumerate(gpus):
                if g.get("partial"):
                    start = _readable(_start_row, conn, *key, g.get("gpu_uuid"))
                    done = _complete(g, start) if start else None
                    if done is not None:
                        gpus[i] = done
    if gpus:
        times: List[float] = [t for g in gpus if isinstance(t := g.get("start_time"), (int, float))]
        if times:
            job["start_time"] = min(times)
        job["partial"] = int(any(g.get("partial") for g in gpus))
    conn.execute(_SQL["job"], sql_row(job, JOB_WRITE_COLUMNS))
    conn.executemany(_SQL["job_gpu"], [sql_row(g, JOB_GPU_WRITE_COLUMNS) for g in gpus])


def _readable(lookup: Any, conn: sqlite3.Connection, *args: Any) -> Any:
    """A lookup that completes a record; a table that cannot be read (corrupt) leaves the
    record as it is instead of making it wait in the spool for a repair that may never come."""
    try:
        return lookup(conn, *args)
    except sqlite3.DatabaseError as e:
        if isinstance(e, sqlite3.OperationalError) and is_lock(e):
            raise
        raise _LookupFailed(str(e)) from e


def is_lock(e: BaseException) -> bool:
    low = str(e).lower()
    return "locked" in low or "busy" in low


def _event_key(rec: Dict[str, Any], e: Dict[str, Any]) -> str:
    """A job's event is the same event in a re-run of its hook; an event with its own "key" (a state
    that lasts, such as a driver/library mismatch seen every healthcheck) is the same whenever it is
    seen again with that key (the first time is kept); any other is the same only at the same time."""
    nested = rec.get("job")
    job: Dict[str, Any] = nested if isinstance(nested, dict) else rec
    where = e.get("gpu_uuid") or e.get("gpu_index")
    if e.get("key"):
        return f"key|{e.get('node')}|{e.get('source')}|{e.get('check_name')}|{e['key']}"
    if e.get("job_id") is not None and job.get("cluster") is not None and job.get("restart_count") is not None:
        return (f"job|{job['cluster']}|{e['job_id']}|{job['restart_count']}|{e.get('node')}|{e.get('source')}|"
                f"{where}|{e.get('check_name')}|{e.get('status')}")
    return f"at|{e.get('time')!r}|{e.get('node')}|{e.get('source')}|{where}|{e.get('check_name')}|{e.get('status')}"


def _drain_key(d: Dict[str, Any]) -> str:
    """The same drain record replayed (spool and log, a log replayed twice) is one drain."""
    return (f"{d.get('source')}|{d.get('cluster')}|{d.get('job_id')}|{d.get('restart_count')}|{d.get('node')}|"
            f"{d.get('time')!r}|{d.get('outcome')}")


def is_prolog_drain_of(d: Dict[str, Any], cluster: str, job_id: int, restart_count: int, node: str) -> bool:
    restart = d.get("restart_count")
    return (d.get("source") == "prolog" and d.get("job_id") == job_id and d.get("node") == node
            and d.get("cluster") in (None, cluster) and (restart is None or restart <= restart_count))


def prolog_failed(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int, node: str) -> bool:
    """A failed prolog always records its drain (taken, kept or failed): the evidence the job never ran here.

    Slurm requeues the job as soon as the prolog fails, so the epilog of that attempt already sees
    the next restart count (observed on 22.05.8): a prolog drain of an earlier restart counts.  A
    later attempt that did run here has its own start record and never gets this far."""
    return conn.execute(
        "SELECT 1 FROM drains WHERE source = 'prolog' AND job_id = ? AND node = ? "
        "AND (cluster IS NULL OR cluster = ?) AND (restart_count IS NULL OR restart_count <= ?) LIMIT 1",
        (job_id, node, cluster, restart_count)).fetchone() is not None


def _start_row(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int, node: str,
               gpu_uuid: str) -> Optional[Dict[str, Any]]:
    row = conn.execute(f"SELECT {', '.join(START_COLUMNS)} FROM job_starts WHERE cluster=? AND job_id=? "
                       "AND restart_count=? AND node=? AND gpu_uuid=?",
                       (cluster, job_id, restart_count, node, gpu_uuid)).fetchone()
    return dict(zip(START_COLUMNS, row)) if row else None


def _complete(row: Dict[str, Any], start: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A partial usage row completed with its start record: the epilog's own arithmetic
    (record.usage) on the end counters it kept in end_counters."""
    raw = row.get("end_counters")
    try:
        end = raw if isinstance(raw, dict) else _loads(raw or "")
        start_time = float(start["start_time"])
        end_time = float(row["end_time"])
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(end, dict):
        return None
    out = dict(row)
    out.update(usage(start, end, accounting_of(end), start_time, end_time),
               start_time=start_time, partial=0, end_counters=None, notes=end.get("notes"))
    if isinstance(end.get("xids"), list):
        out["xid_events"] = xids_after(end["xids"], start_time) or None
    return out


def _loads(text: str) -> Any:
    import json  # on first use (module docstring)
    return json.loads(text)


def _complete_partial_rows(conn: sqlite3.Connection, s: Dict[str, Any]) -> None:
    """A start record that arrives after its job's end (spool, log replay) completes the partial row."""
    key = (s.get("cluster"), s.get("job_id"), s.get("restart_count") or 0, s.get("node"))
    cols = ", ".join(JOB_GPU_WRITE_COLUMNS)
    row = conn.execute(f"SELECT {cols} FROM job_gpus WHERE cluster=? AND job_id=? AND restart_count=? AND node=? "
                       "AND gpu_uuid=? AND partial=1 AND end_counters IS NOT NULL", key + (s.get("gpu_uuid"),)).fetchone()
    if row is None:
        return
    done = _complete(dict(zip(JOB_GPU_WRITE_COLUMNS, row)), s)
    if done is None:
        return
    conn.execute(_SQL["job_gpu"], sql_row(done, JOB_GPU_WRITE_COLUMNS))
    conn.execute("UPDATE jobs SET partial = EXISTS (SELECT 1 FROM job_gpus g WHERE g.cluster=jobs.cluster AND "
                 "g.job_id=jobs.job_id AND g.restart_count=jobs.restart_count AND g.node=jobs.node AND g.partial=1), "
                 "start_time = (SELECT MIN(g.start_time) FROM job_gpus g WHERE g.cluster=jobs.cluster AND "
                 "g.job_id=jobs.job_id AND g.restart_count=jobs.restart_count AND g.node=jobs.node) "
                 "WHERE cluster=? AND job_id=? AND restart_count=? AND node=?", key)


def _drop_partial_rows(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int, node: str) -> None:
    """The prolog's drain arrived after a partial record of the same job start: the job never ran here."""
    key = (cluster, job_id, restart_count, node)
    conn.execute("DELETE FROM job_gpus WHERE cluster=? AND job_id=? AND restart_count=? AND node=? AND partial=1", key)
    conn.execute("DELETE FROM jobs WHERE cluster=? AND job_id=? AND restart_count=? AND node=? AND partial=1 AND NOT "
                 "EXISTS (SELECT 1 FROM job_gpus g WHERE g.cluster=jobs.cluster AND g.job_id=jobs.job_id AND "
                 "g.restart_count=jobs.restart_count AND g.node=jobs.node)", key)


# --------------------------------------------------------------------------- admin checks
