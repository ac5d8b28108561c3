"""The node database and the spool that make sure nothing is lost (a record's SQL: store/apply.py;
the spool written, ingested and replayed: store/ingest.py).

Hooks write through `Store.write(record)`.  A record is one of store/record.py's typed records,
or its JSON shape ``{"kind": ..., ...}`` (spool files, log replays).  If the database cannot take
it (locked past the busy timeout, disk full, read-only, corrupt, refused as unsafe), the record is
written as a JSON file into the spool directory instead, and a later write or `slurm-gpu db ingest`
ingests the spool.
When even the spool fails the caller logs the record as JSON (`db ingest --from-log`).

Nothing is lost, nothing is doubled, nothing is forged (docs/hooks.md, "Nothing is lost"):
- Writes are keyed (cluster, job id, restart count, node, GPU UUID).  The first complete
  record of a job start wins, whichever path it took (database, spool, log replay); a later
  one (a re-run epilog) only fills what the first left empty.  A complete record replaces a
  partial one (the epilog could not read the prolog's start record); a partial record is
  completed when its start record turns up, and dropped when the prolog is found to have
  failed on this node (the job never ran here).
- Health events and drains carry a dedupe key: re-runs and replays do not repeat them.
- A spool file that the database refuses (a NOT NULL violation, a malformed record) or that
  an unprivileged user could have written is moved to ``<spool>/quarantine/`` and never
  blocks the files after it.  A claim (``.<name>.<pid>.claim``) whose process is gone goes
  back to the spool.
- Nothing is opened through a symlink: the spool directory is opened with
  O_DIRECTORY|O_NOFOLLOW and used through its descriptor (store/spool.py); directories,
  the database and spool files an unprivileged user owns or may write are refused with one
  line naming the path.

The hook path uses the stdlib sqlite3 module only: sqlite-utils costs ~0.1 s to import,
more than the whole prolog budget (it serves the `slurm-gpu db` admin commands).  `json` is
imported where it is used: a hook whose records go straight into the database never needs it.
"""
from __future__ import annotations

import os
import sqlite3
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import StoreError
from slurm_gpu.store.apply import (
    START_RECORDS_KEPT_S,
    Incomplete,
    apply_in_transaction,
    drains_or_none,
    insert_sql,
    inventory_due,
    is_lock,
    is_prolog_drain_of,
    latest_inventory,
    latest_mismatch,
    prolog_failed,
    rollback,
    sql_row,
    write_all,
    write_xids,
)
from slurm_gpu.store.diagnose import check_database_path, describe_error
from slurm_gpu.store.ingest import IngestReport, SpoolIngest, is_record_problem
from slurm_gpu.store.record import (
    KINDS,
    START_COLUMNS,
    Record,
    as_dict,
)
from slurm_gpu.store.schema import INVENTORY_COLUMNS, MIGRATIONS, REMEDIATION_COLUMNS, SCHEMA_VERSION

# --------------------------------------------------------------------------- results


class Written(str):
    """Where Store.write put a record: `where` is DB, SPOOL or QUARANTINE, `path` the file (spool,
    quarantine).  Its text is the old form ('db', 'spool:<file>', 'quarantine:<file>') for whoever
    prints it; callers read the fields."""

    where: str
    path: str

    def __new__(cls, where: str, path: str = "") -> "Written":
        self = super().__new__(cls, f"{where}:{path}" if path else where)
        self.where, self.path = where, path
        return self

    @property
    def in_database(self) -> bool:
        return self.where == DB


DB, SPOOL, QUARANTINED = "db", "spool", "quarantine"


class StartLookup(NamedTuple):
    """What the epilog knows of the job's start on this node."""

    starts: Dict[str, Dict[str, Any]]  # the prolog's counters by GPU UUID (database and spool)
    prolog_failed: bool  # a drain by this job's prolog on this node: the job never ran here
    unreadable: str  # why the database could not be read ("" when it could): the answer may be incomplete


# --------------------------------------------------------------------------- the store


class Store(SpoolIngest):
    def __init__(self, path: str, spool_dir: str, busy_timeout_s: float = 10.0):
        self.path = path
        self.spool_dir = spool_dir
        self.busy_timeout_s = busy_timeout_s
        self._conn: Optional[sqlite3.Connection] = None
        # Once the database failed in this process (locked past the busy timeout, corrupt,
        # refused), later records go straight to the spool instead of waiting again.
        self.unavailable = ""

    @classmethod
    def from_config(cls, cfg: Config, database: Optional[str] = None, spool: Optional[str] = None) -> "Store":
        """The config's database and spool, or those a command names (--db, --spool)."""
        return cls(database or cfg.path_value("store", "database"), spool or cfg.path_value("store", "spool_dir"),
                   cfg.store.busy_timeout_s)

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        check_database_path(self.path, create_dir=True)
        old = os.umask(0o027)  # database, -wal and -shm: no write for group, nothing for others
        try:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        finally:
            os.umask(old)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None

    def _failed(self, e: BaseException) -> str:
        self.close()  # a broken connection must not be reused
        self.unavailable = describe_error(e)
        return self.unavailable

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            raise StoreError(f"database schema version {current} is newer than this slurm-gpu ({SCHEMA_VERSION})",
                             "upgrade slurm-gpu on this node")
        if current == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]  # re-read under the write lock
            if version > SCHEMA_VERSION:
                raise StoreError(f"database schema version {version} is newer than this slurm-gpu ({SCHEMA_VERSION})",
                                 "upgrade slurm-gpu on this node")
            for v in range(version, SCHEMA_VERSION):
                for stmt in MIGRATIONS[v]:
                    conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            raise

    # -- writing -----------------------------------------------------------------------------
    def write(self, record: Record, ingest: bool = True) -> Written:
        """Write a record (store/record.py, or its dict); returns where it went (Written).

        Any failure of the database spools the record; a record the database refuses as such
        (malformed, a constraint) is kept in the quarantine.  Raises StoreError only when the
        record could be written nowhere (the caller then logs it as JSON).  With `ingest`,
        a successful write also ingests a bounded part of the spool.
        """
        record = as_dict(record)
        if not isinstance(record, dict) or record.get("kind") not in KINDS:
            raise ValueError(f"unknown record kind {record.get('kind') if isinstance(record, dict) else record!r}")
        if self.unavailable:
            return Written(SPOOL, self.spool(record, reason=self.unavailable))
        try:
            apply_in_transaction(self.connect(), record)
        except Exception as e:
            if is_record_problem(e):
                return Written(QUARANTINED, self.spool(record, reason=describe_error(e), quarantine=True))
            return Written(SPOOL, self.spool(record, reason=self._failed(e)))
        if ingest:
            try:
                self.ingest(max_files=200, max_seconds=1.0)
            except Exception:  # the record is in; the spool waits for the next ingest
                pass
        return Written(DB)

    def housekeeping(self, max_files: int, max_seconds: float, prune: bool = False) -> IngestReport:
        """What a hook does after its own records and its drain decision: a bounded ingest and
        (prune) dropping start records older than a week."""
        rep = self.ingest(max_files=max_files, max_seconds=max_seconds)
        if prune and not self.unavailable:
            try:
                self.connect().execute("DELETE FROM job_starts WHERE start_time < ?",
                                       (time.time() - START_RECORDS_KEPT_S,))
            except Exception as e:  # a corrupt start table must not cost the hook more than this line
                rep.problems.append(f"{self.path}: pruning old start records: {self._failed(e)}")
        return rep

    # -- the fleet's history (healthcheck; schema v6) ------------------------------------------
    def record_inventory(self, rows: Sequence[Dict[str, Any]], every_s: float, now: float) -> int:
        """Add the gpu_inventory rows (store/observations.inventory_rows) whose GPU's latest row
        differs in any column but the time, or is at least `every_s` old, or is older than the
        node's latest driver_library_mismatch event (the first read after it: `fleet` compares the
        two); returns how many.

        One read of the latest rows of the node(s), one transaction for what is new.  Raises
        sqlite3.Error or StoreError: the caller (healthcheck) says so and goes on."""
        if not rows:
            return 0
        conn = self.connect()
        latest: Dict[Tuple[str, str], Dict[str, Any]] = {}
        mismatch_at: Dict[str, float] = {}
        for node in sorted({r["node"] for r in rows}):
            mine = latest_inventory(conn, node)
            latest.update(mine)
            mismatch_at[node] = latest_mismatch(conn, node, min((r["time"] or 0.0 for r in mine.values()), default=None))
        due = [r for r in rows if inventory_due(latest.get((r["node"], r["gpu_uuid"])), r, every_s, now,
                                                 mismatch_at[r["node"]])]
        if due:
            write_all(conn, insert_sql("gpu_inventory", INVENTORY_COLUMNS), [sql_row(r, INVENTORY_COLUMNS) for r in due])
        return len(due)

    def record_xids(self, rows: Sequence[Dict[str, Any]]) -> int:
        """Add the xid_events rows (store/observations.xid_rows) not there yet, or grow the row of a
        flood read again (its line count and last time); returns how many rows were added or grown.

        An event is there when the node has one with the same GPU bus, XID and text whose first line
        is the event's (within XID_SAME_S seconds: a kmsg date read again one rounding away) or whose
        lines the event's first line continues (store/apply.py write_xids)."""
        if not rows:
            return 0
        return write_xids(self.connect(), rows)

    def latest_inventory_time(self, node: str) -> Optional[float]:
        """When the node's newest gpu_inventory row was read; None when it has none."""
        (t,) = self.connect().execute("SELECT MAX(time) FROM gpu_inventory WHERE node = ?", (node,)).fetchone()
        return None if t is None else float(t)

    # -- remediation attempts (`slurm-gpu remediate`; schema v7) --------------------------------
    def record_remediation(self, row: Dict[str, Any]) -> int:
        """Write one attempt (REMEDIATION_COLUMNS; missing ones NULL) in its own transaction; its id."""
        conn = self.connect()
        cur = conn.execute(insert_sql("remediations", REMEDIATION_COLUMNS),
                           tuple(row.get(c) for c in REMEDIATION_COLUMNS))
        assert cur.lastrowid is not None  # an INSERT's row
        return cur.lastrowid

    def finish_remediation(self, row_id: int, outcome: str, detail: str, now: float) -> None:
        """The outcome of attempt row_id, once known."""
        self.connect().execute("UPDATE remediations SET outcome = ?, detail = ?, finished = ? WHERE id = ?",
                               (outcome, detail, now, row_id))

    def set_step_process(self, row_id: int, *, pid: Optional[int] = None, pid_start: Optional[int] = None,
                         job_id: Optional[int] = None) -> None:
        """The process (or Slurm job) that carries out attempt row_id (schema v9; local, never shipped)."""
        self.connect().execute("UPDATE remediations SET pid = COALESCE(?, pid), pid_start = COALESCE(?, pid_start), "
                               "job_id = COALESCE(?, job_id) WHERE id = ?", (pid, pid_start, job_id, row_id))

    def open_steps(self, node: str) -> List[Dict[str, Any]]:
        """The node's attempts still `started` (a step under way, or one a killed run left), oldest first,
        with their process columns."""
        cur = self.connect().execute(
            "SELECT id, " + ", ".join(REMEDIATION_COLUMNS) + ", pid, pid_start, job_id FROM remediations "
            "WHERE node = ? AND outcome = 'started' ORDER BY time, id", (node,))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    def drain_time(self, node: str, reason: str) -> Optional[float]:
        """When the node was last drained with this reason (the drains table), else when it was last
        drained by us at all; None when the node database has no such drain."""
        row = self.connect().execute(
            "SELECT time FROM drains WHERE node = ? AND ok = 1 AND reason LIKE 'slurm-gpu:%' "
            "ORDER BY reason = ? DESC, time DESC LIMIT 1", (node, reason)).fetchone()
        return None if row is None else float(row[0])

    def remediations(self, *, node: Optional[str] = None, serial: Optional[str] = None,
                     since: float = 0.0) -> List[Dict[str, Any]]:
        """Attempts of a node or a GPU serial at or after since, oldest first."""
        where: List[str] = ["time >= ?"]
        args: List[Any] = [since]
        if node is not None:
            where.append("node = ?")
            args.append(node)
        if serial is not None:
            where.append("serial = ?")
            args.append(serial)
        conn = self.connect()
        cur = conn.execute("SELECT id, " + ", ".join(REMEDIATION_COLUMNS) + " FROM remediations WHERE "
                           + " AND ".join(where) + " ORDER BY time, id", args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    def gpu_xids(self, gpu_uuid: str, since: float) -> List[Dict[str, Any]]:
        """The GPU's XID rows (xid, time, last_time) whose last line is at or after since, oldest first
        (the lemon rule's bursts, remediation/budget.py)."""
        if not gpu_uuid:
            return []
        cur = self.connect().execute(
            "SELECT xid, time, last_time FROM xid_events WHERE gpu_uuid = ? AND COALESCE(last_time, time) >= ? "
            "ORDER BY time", (gpu_uuid, since))
        return [{"xid": x, "time": t, "last_time": last} for x, t, last in cur.fetchall()]

    # -- reading (for the epilog) --------------------------------------------------------------
    def find_start(self, cluster: str, job_id: int, restart_count: int, node: str,
                   spool_budget_s: float = 2.0) -> StartLookup:
        """The prolog's counters for a job start (database, then spool) and whether its prolog
        failed on this node.  Never raises: what cannot be read is said in `unreadable`."""
        starts: Dict[str, Dict[str, Any]] = {}
        failed = False
        unreadable = self.unavailable
        key = (cluster, job_id, restart_count, node)
        if not unreadable:
            try:
                conn = self.connect()
                cur = conn.execute(f"SELECT {', '.join(START_COLUMNS)} FROM job_starts WHERE cluster=? AND job_id=? "
                                   "AND restart_count=? AND node=?", key)
                for row in cur.fetchall():
                    d = dict(zip(START_COLUMNS, row))
                    starts[d["gpu_uuid"]] = d
                failed = prolog_failed(conn, *key)
            except sqlite3.DatabaseError as e:
                if isinstance(e, sqlite3.OperationalError) and is_lock(e):
                    unreadable = self._failed(e)  # locked: the records wait in the spool, not again here
                else:
                    unreadable = describe_error(e)  # a corrupt table: the others may still take records
            except Exception as e:
                unreadable = self._failed(e)
        # Records of the job may still sit in the spool (the database was down at job start).
        try:
            for rec in self._spooled_records_of(job_id, ("job_start", "drain"), spool_budget_s):
                if rec.get("kind") == "job_start":
                    for s in rec.get("starts") or []:
                        if isinstance(s, dict) and (s.get("cluster"), s.get("job_id"), s.get("restart_count"),
                                                    s.get("node")) == key:
                            starts.setdefault(str(s.get("gpu_uuid")), s)
                elif any(isinstance(d, dict) and is_prolog_drain_of(d, *key) for d in drains_or_none(rec)):
                    failed = True
        except Incomplete as e:
            unreadable = unreadable or str(e)
        except (StoreError, OSError) as e:
            unreadable = unreadable or (e.message if isinstance(e, StoreError) else describe_error(e))
        return StartLookup(starts, failed, unreadable)

