"""The node database: every SQL write statement and the spool that makes sure nothing is lost.

Hooks write through `Store.write(record)`.  A record is a plain JSON-able dict
``{"kind": ..., ...}``.  If the database cannot take it (locked past the busy timeout,
disk full, read-only, corrupt), the record is written as a JSON file into the spool
directory instead, and the next successful write ingests the spool.  Writes are keyed
(cluster, job id, restart count, node, GPU UUID), so a record written twice — a re-run
epilog, a spool file ingested after a crash — does not duplicate anything.

The hook path uses the stdlib sqlite3 module only: sqlite-utils costs ~0.1 s to import,
more than the whole prolog budget (it serves the `slurm-gpu db` admin commands).
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .errors import StoreError
from .schema import JOB_GPU_WRITE_COLUMNS, MIGRATIONS, SCHEMA_VERSION

KINDS = ("job_start", "job_end", "health", "drain")

_JOB_COLUMNS = ("cluster", "job_id", "restart_count", "node", "user", "uid", "account", "partition", "gpu_count",
                "start_time", "end_time", "exit_code")
_START_COLUMNS = ("cluster", "job_id", "restart_count", "node", "gpu_uuid", "gpu_index", "start_time", "energy_mj",
                  "ecc_corrected", "ecc_uncorrected", "retired_pages", "remapped_rows")
_HEALTH_COLUMNS = ("time", "node", "source", "job_id", "gpu_index", "gpu_uuid", "check_name", "status", "message")
_DRAIN_COLUMNS = ("time", "node", "source", "job_id", "reason", "ok")


def _insert(table: str, columns: Tuple[str, ...], verb: str) -> str:
    return f"{verb} INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


_SQL = {
    # First record wins: a re-run epilog (counters already consumed) must not overwrite the real one.
    "job": _insert("jobs", _JOB_COLUMNS, "INSERT OR IGNORE"),
    "job_gpu": _insert("job_gpus", JOB_GPU_WRITE_COLUMNS, "INSERT OR IGNORE"),
    # A prolog re-run for the same job start keeps the latest counters.
    "start": _insert("job_starts", _START_COLUMNS, "INSERT OR REPLACE"),
    "health": _insert("health_events", _HEALTH_COLUMNS, "INSERT"),
    "drain": _insert("drains", _DRAIN_COLUMNS, "INSERT"),
}


def _row(d: Dict[str, Any], columns: Iterable[str]) -> Tuple[Any, ...]:
    return tuple(d.get(c) for c in columns)


class Store:
    def __init__(self, path: str, spool_dir: str, busy_timeout_s: float = 10.0):
        self.path = path
        self.spool_dir = spool_dir
        self.busy_timeout_s = busy_timeout_s
        self._conn: Optional[sqlite3.Connection] = None

    @classmethod
    def from_config(cls, cfg: Any) -> "Store":
        return cls(cfg.path_value("store", "database"), cfg.path_value("store", "spool_dir"),
                   cfg.get("store", "busy_timeout_s"))

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, mode=0o755, exist_ok=True)
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
            self._conn.close()
            self._conn = None

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
            conn.execute("ROLLBACK")
            raise

    # -- writing -----------------------------------------------------------------------------
    def write(self, record: Dict[str, Any]) -> str:
        """Write a record; returns 'db' or 'spool:<file>'.  Raises StoreError only when both fail."""
        if record.get("kind") not in KINDS:
            raise ValueError(f"unknown record kind {record.get('kind')!r}")
        try:
            _apply_in_transaction(self.connect(), record)
        except (sqlite3.Error, OSError, StoreError) as e:
            self.close()  # a broken connection must not be reused
            where = self.spool(record, reason=str(e))
            return f"spool:{where}"
        self.ingest_spool()
        return "db"

    def spool(self, record: Dict[str, Any], reason: str = "") -> str:
        rec = dict(record)
        rec["_spooled_at"] = time.time()
        rec["_spool_reason"] = reason[:500]
        name = f"{time.time_ns()}-{os.getpid()}-{record['kind']}.json"
        tmp = os.path.join(self.spool_dir, "." + name + ".tmp")
        final = os.path.join(self.spool_dir, name)
        try:
            os.makedirs(self.spool_dir, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(rec, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, final)
        except OSError as e:
            raise StoreError(f"cannot write {self.path} ({reason}) nor spool to {self.spool_dir}: {e.strerror or e}",
                             "free disk space or fix permissions; the record is in the hook log") from None
        return final

    def spooled(self) -> List[str]:
        try:
            return sorted(os.path.join(self.spool_dir, n) for n in os.listdir(self.spool_dir)
                          if n.endswith(".json") and not n.startswith("."))
        except FileNotFoundError:
            return []

    def ingest_spool(self) -> Tuple[int, List[str]]:
        """Move spooled records into the database.  Returns (ingested, problems).

        Each file is claimed by renaming it first, so concurrent epilogs never ingest the
        same file twice; a file that cannot be written goes back to the spool.
        """
        files = self.spooled()
        if not files:
            return 0, []
        conn = self.connect()
        done, problems = 0, []
        for path in files:
            claimed = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{os.getpid()}.claim"
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                continue  # another process claimed it
            try:
                with open(claimed, encoding="utf-8") as f:
                    rec = json.load(f)
                if rec.get("kind") not in KINDS:
                    raise ValueError(f"unknown kind {rec.get('kind')!r}")
            except (OSError, ValueError) as e:
                bad = path + ".bad"
                os.rename(claimed, bad)
                problems.append(f"{os.path.basename(path)}: unreadable ({e}); kept as {os.path.basename(bad)}")
                continue
            try:
                _apply_in_transaction(conn, rec)
            except sqlite3.Error as e:
                os.rename(claimed, path)
                problems.append(f"{os.path.basename(path)}: {e}")
                break  # the database is not taking writes: leave the rest for later
            os.unlink(claimed)
            done += 1
        return done, problems

    # -- reading (for the epilog) --------------------------------------------------------------
    def job_starts(self, cluster: str, job_id: int, restart_count: int, node: str) -> Dict[str, Dict[str, Any]]:
        """The prolog's counters for a job, by GPU UUID; spooled ones included."""
        out: Dict[str, Dict[str, Any]] = {}
        try:
            conn = self.connect()
            cur = conn.execute(
                f"SELECT {', '.join(_START_COLUMNS)} FROM job_starts WHERE cluster=? AND job_id=? AND restart_count=? AND node=?",
                (cluster, job_id, restart_count, node))
            for row in cur.fetchall():
                d = dict(zip(_START_COLUMNS, row))
                out[d["gpu_uuid"]] = d
        except (sqlite3.Error, OSError, StoreError):
            self.close()
        # A prolog record may still sit in the spool (database was down at job start).
        for path in self.spooled():
            if not path.endswith("-job_start.json"):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            for s in rec.get("starts", []):
                if (s.get("cluster"), s.get("job_id"), s.get("restart_count"), s.get("node")) == (cluster, job_id, restart_count, node):
                    out.setdefault(s["gpu_uuid"], s)
        return out


def _apply_in_transaction(conn: sqlite3.Connection, rec: Dict[str, Any]) -> None:
    """One record, all or nothing; the write lock is taken up front (BEGIN IMMEDIATE) so a busy
    database makes us wait busy_timeout once instead of failing halfway."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        _apply(conn, rec)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _apply(conn: sqlite3.Connection, rec: Dict[str, Any]) -> None:
    kind = rec["kind"]
    if kind == "job_start":
        conn.executemany(_SQL["start"], [_row(s, _START_COLUMNS) for s in rec.get("starts", [])])
    elif kind == "job_end":
        conn.execute(_SQL["job"], _row(rec["job"], _JOB_COLUMNS))
        conn.executemany(_SQL["job_gpu"], [_row(g, JOB_GPU_WRITE_COLUMNS) for g in rec.get("gpus", [])])
        # Start counters are kept (a re-run epilog finds them) and pruned after a week.
        conn.execute("DELETE FROM job_starts WHERE start_time < ?", (time.time() - 7 * 86400,))
    if kind in ("job_end", "health") and rec.get("events"):
        conn.executemany(_SQL["health"], [_row(e, _HEALTH_COLUMNS) for e in rec["events"]])
    if kind == "drain":
        conn.execute(_SQL["drain"], _row(rec["drain"], _DRAIN_COLUMNS))


def integrity_check(path: str) -> List[str]:
    """Problems found in a database file (empty list: healthy)."""
    if not os.path.exists(path):
        return [f"{path} does not exist"]
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as e:
        return [f"{path}: {e}"]
    problems = [r for r in rows if r != "ok"]
    if version != SCHEMA_VERSION:
        problems.append(f"schema version {version}, expected {SCHEMA_VERSION} (run any hook or `slurm-gpu db ingest` to migrate)")
    return problems
