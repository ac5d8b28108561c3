"""`slurm-gpu db push`: ship what the central server does not have yet (docs/central.md).

The node database is the outbox (schema v5): a row whose push_version is ahead of its
pushed_version has not reached the server in its current form; a shipped row that was deleted
left a tombstone in push_withdrawn.  One batch is one upsert statement and one server commit,
then the rows are marked shipped in the node database, only if they did not change meanwhile.
A push that dies between the two sends the batch again next time: the upserts are keyed
(cluster, job, restart, node, GPU UUID; events and drains by their own key; inventory rows
by node, GPU UUID and time; XIDs by node and event key; remediation attempts by node, row id and time,
the newer version winning), so nothing is doubled, and a node
database restored from an old backup ships its rows again, harmlessly.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import sqlite3
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

from slurm_gpu.central import schema as C
from slurm_gpu.errors import CentralError, StoreError
from slurm_gpu.store import record as R
from slurm_gpu.store.schema import (
    ACTION_COLUMNS,
    INVENTORY_COLUMNS,
    PUSHED_TABLES,
    REMEDIATION_COLUMNS,
    SAMPLE_COLUMNS,
    XID_COLUMNS,
)

_ORDER = dict(PUSHED_TABLES)
# A batch rolled back for another's locks (deadlock victim 1213, lock wait timeout 1205) is sent again;
# so is one that read a row another transaction changed after this one's snapshot (1020, "Record has
# changed since last read": innodb_snapshot_isolation, on by default from MariaDB 11.6.2).
LOCK_CONFLICTS = frozenset((1020, 1205, 1213))
# A Galera node that loses its primary component for a moment (another node died, the network split)
# fails a commit it could not replicate with 1180 ("Error while appending streaming replication
# fragment (provider status: ...)"), rolled back whole: sent again like a lock conflict.
RESENT = LOCK_CONFLICTS | {1180}
RETRIES = 8
# Node columns read per table (store/record.py's; the central key columns of events and drains are
# derived, a partial row's end counters stay on the node).
_NODE_COLUMNS = {
    "jobs": R.JOB_WRITE_COLUMNS,
    "job_gpus": tuple(c for c in R.JOB_GPU_WRITE_COLUMNS if c != "end_counters"),
    "health_events": ("id",) + R.HEALTH_COLUMNS,
    "drains": ("id",) + R.DRAIN_COLUMNS,
    # v6, the fleet's history: the node's columns are the central ones, less the cluster
    "gpu_inventory": INVENTORY_COLUMNS,
    "xid_events": XID_COLUMNS,
    # v8: the node's row id (with the attempt's time) is the central key; its push_version the central row_version (newer wins)
    "remediations": ("id",) + REMEDIATION_COLUMNS + ("push_version",),
    # v12 (docs/efficiency.md): samples as they are; actions keyed by the deciding host's row id and time (the
    # mail's text stays on the host that sent it)
    "job_samples": SAMPLE_COLUMNS,
    "efficiency_actions": ("id",) + ACTION_COLUMNS + ("push_version",),
}


class Backlog(NamedTuple):
    """What is waiting: rows per table (tombstones under 'withdrawn') and the oldest one's time."""

    rows: Dict[str, int]
    oldest_time: Optional[float]

    @property
    def total(self) -> int:
        return sum(self.rows.values())


class PushResult(NamedTuple):
    shipped: Dict[str, int]
    refused: List[str]  # one line per record the server refused (it stays unshipped)
    left: Backlog
    stopped_early: bool  # the time budget ran out with records left
    retried: int = 0  # batches sent again after a lock conflict with another transaction


def backlog(conn: sqlite3.Connection) -> Backlog:
    """Unshipped rows per table and the time of the oldest (each table's partial index: cheap)."""
    rows: Dict[str, int] = {}
    oldest: List[float] = []
    for table, when in PUSHED_TABLES:
        n, first = conn.execute(f"SELECT COUNT(*), MIN({when}) FROM {table} WHERE pushed_version < push_version").fetchone()
        rows[table] = n
        if first is not None:
            oldest.append(first)
    n, first = conn.execute("SELECT COUNT(*), MIN(time) FROM push_withdrawn").fetchone()
    rows["withdrawn"] = n
    if first is not None:
        oldest.append(first)
    return Backlog(rows, min(oldest) if oldest else None)


class PushBusy(Exception):
    """Another `db push` of the same node database holds its lock."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


@contextlib.contextmanager
def push_lock(db_path: str) -> Iterator[None]:
    """One push per node database at a time: two would ship the same rows (harmless on the server,
    upserts) and both count them.  The lock is DB.push-lock beside the database, mode 0600, opened
    without following a symlink; the kernel drops it when the holder dies."""
    path = f"{db_path}.push-lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        raise StoreError(f"cannot open the push lock {path} ({e.strerror or e})",
                         "db push needs to write beside the node database (store.database)") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PushBusy(path) from None
        yield
    finally:
        os.close(fd)


def _key(*parts: Any) -> str:
    return hashlib.sha256("|".join(repr(p) for p in parts).encode("utf-8", "backslashreplace")).hexdigest()


def _central_row(table: str, row: Dict[str, Any], cluster: str) -> Tuple[Any, ...]:
    if table == "health_events":
        key = row["dedupe_key"] or f"id|{row['id']}|{row['time']!r}"
        row = dict(row, cluster=cluster, event_key=_key(key))
    elif table == "drains":
        key = row["dedupe_key"] or f"id|{row['id']}|{row['time']!r}"
        row = dict(row, cluster=row["cluster"] or cluster, drain_key=_key(key))
    elif table in ("gpu_inventory", "xid_events"):
        row = dict(row, cluster=cluster)
    elif table == "remediations":
        row = dict(row, cluster=cluster, row_version=row["push_version"])
    elif table == "efficiency_actions":
        row = dict(row, node=row["decided_on"], row_version=row["push_version"])
    return tuple(row[c] for c in C.COLUMNS[table])


def _mark(conn: sqlite3.Connection, table: str, marks: Sequence[Tuple[int, int]]) -> None:
    """Rows shipped at these versions: marked unless they changed in the meantime (then they ship again)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(f"UPDATE {table} SET pushed_version = ? WHERE rowid = ? AND push_version = ?",
                             [(v, rid, v) for rid, v in marks])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as e:
        raise StoreError(f"shipped, but cannot mark {len(marks)} {table} record(s) as shipped in the node database ({e})",
                         "they ship again next time (upserts: nothing is doubled); run `slurm-gpu db check`") from None


class Pusher:
    """One run of `db push` from one node database to one central server."""

    def __init__(self, conn: sqlite3.Connection, central: Any, cluster: str, batch_size: int = 2000,
                 max_seconds: Optional[float] = None, progress: Optional[Callable[[int], None]] = None):
        self.conn = conn
        self.central = central
        self.cluster = cluster
        self.batch_size = batch_size
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self.progress = progress or (lambda n: None)
        self.shipped: Dict[str, int] = {}
        self.refused: List[str] = []
        self._refused_rowids: Dict[str, Set[int]] = {}
        self.retried = 0  # batches sent again after a lock conflict

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def run(self) -> PushResult:
        self.central.require_current()
        self.central.wait_for_locks_within_answer()
        stopped = not self._withdrawals()
        for table, _when in PUSHED_TABLES:
            if stopped:
                break
            stopped = not self._table(table)
        _note(self.conn, "last_push_time", time.time())
        return PushResult(self.shipped, self.refused, backlog(self.conn), stopped, self.retried)

    def _withdrawals(self) -> bool:
        while True:
            if self._out_of_time():
                return False
            rows = self.conn.execute("SELECT seq, tbl, cluster, job_id, restart_count, node, gpu_uuid FROM push_withdrawn "
                                     "ORDER BY seq LIMIT ?", (self.batch_size,)).fetchall()
            if not rows:
                return True
            now = time.time()
            staged = {t: [C.withdraw_row(t, r[2:2 + C.KEYS[t]], now) for r in rows if r[1] == t] for t in ("jobs", "job_gpus")}
            self._ship(staged)
            self.conn.execute("DELETE FROM push_withdrawn WHERE seq <= ?", (rows[-1][0],))
            self.shipped["withdrawn"] = self.shipped.get("withdrawn", 0) + len(rows)
            self.progress(len(rows))

    def _table(self, table: str) -> bool:
        cols = _NODE_COLUMNS[table]
        names = ", ".join(f'"{c}"' for c in cols)
        skip = self._refused_rowids.setdefault(table, set())
        while True:
            if self._out_of_time():
                return False
            # Rows the server refused in this run stay behind (reported); the rest go on.
            exclude = f" AND rowid NOT IN ({', '.join(str(r) for r in skip)})" if skip else ""
            rows = self.conn.execute(
                f"SELECT rowid, push_version, {names} FROM {table} WHERE pushed_version < push_version{exclude} "
                f"ORDER BY {_ORDER[table]} LIMIT ?", (self.batch_size,)).fetchall()
            if not rows:
                return True
            now = time.time()
            version = table in C.VERSIONED  # the server keeps the newer and the complete row
            batch = [(r[0], r[1], _central_row(table, dict(zip(cols, r[2:])), self.cluster)
                      + ((r[1],) if version else ()) + (now, 0)) for r in rows]
            try:
                self._ship({table: [b[2] for b in batch]})
                done = [(rid, v) for rid, v, _ in batch]
            except CentralError as e:
                if not _is_refusal(e):
                    raise
                done = self._one_by_one(table, batch, skip)
            if done:
                _mark(self.conn, table, done)
            self.shipped[table] = self.shipped.get(table, 0) + len(done)
            self.progress(len(batch))

    def _one_by_one(self, table: str, batch: Sequence[Tuple[int, int, Tuple[Any, ...]]],
                    skip: Set[int]) -> List[Tuple[int, int]]:
        """A batch the server refused: ship its rows one at a time, keep the refused ones here."""
        done = []
        for rid, version, values in batch:
            try:
                self._ship({table: [values]})
                done.append((rid, version))
            except CentralError as e:
                if not _is_refusal(e):
                    raise
                skip.add(rid)
                key = "/".join(str(v) for v in values[:C.KEYS[table]])
                self.refused.append(f"{table} {key}: {e.message}")
        return done

    def _ship(self, staged: Dict[str, List[Tuple[Any, ...]]]) -> None:
        """Stage the rows under a new batch id and apply them: one server transaction.

        Nodes push at once (a job's nodes end together) and their batches change the same rollup
        cells: a batch the server chose as a deadlock's victim, or one that waited too long for
        another's locks, was rolled back whole, so it is sent again, after a random pause, until
        the push's time is out or RETRIES tries failed."""
        for attempt in range(RETRIES + 1):
            batch = uuid.uuid4().hex
            try:
                for table, rows in staged.items():
                    if rows:
                        self.central.executemany(C.stage_sql(table), [(batch,) + r for r in rows])
                self.central.execute("CALL apply_batch(%s)", (batch,))
                self.central.commit()
                return
            except CentralError as e:
                self.central.rollback()
                if getattr(e, "driver_code", None) not in RESENT or attempt == RETRIES or self._out_of_time():
                    raise
                self.retried += 1
                time.sleep(random.uniform(0.5, 1.0) * min(2.0, 0.05 * 2 ** attempt))
            except BaseException:
                self.central.rollback()
                raise


def _is_refusal(e: CentralError) -> bool:
    """The server refused the data (too long, out of range, wrong value), not the connection."""
    return getattr(e, "driver_code", None) in _DATA_ERRORS


# Data too long, out of range, incorrect value, cannot be null, truncated, check constraint.
_DATA_ERRORS = frozenset((1048, 1264, 1265, 1292, 1366, 1406, 3819, 4025))


def _note(conn: sqlite3.Connection, name: str, value: Any) -> None:
    try:
        conn.execute("INSERT INTO push_state (name, value) VALUES (?, ?) "
                     "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, value))
    except sqlite3.Error as e:  # bookkeeping only: the records are marked already
        raise StoreError(f"cannot record the push time in the node database ({e})", "run `slurm-gpu db check`") from None


def last_push_time(conn: sqlite3.Connection) -> Optional[float]:
    row = conn.execute("SELECT value FROM push_state WHERE name = 'last_push_time'").fetchone()
    return float(row[0]) if row and row[0] is not None else None
