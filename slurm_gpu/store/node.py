"""The node database: every SQL write statement and the spool that makes sure nothing is lost.

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

import errno
import os
import re
import sqlite3
import stat
import time
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.errors import StoreError
from slurm_gpu.store.record import (
    DRAIN_COLUMNS,
    HEALTH_COLUMNS,
    JOB_GPU_WRITE_COLUMNS,
    JOB_KEY,
    JOB_WRITE_COLUMNS,
    KINDS,
    START_COLUMNS,
    Record,
    accounting_of,
    as_dict,
    drains_of,
    usage,
    xid_text,
    xids_after,
)
from slurm_gpu.store.schema import INVENTORY_COLUMNS, MIGRATIONS, REMEDIATION_COLUMNS, SCHEMA_VERSION, XID_COLUMNS, XID_SAME_S
from slurm_gpu.store.spool import CLAIM, NAME, QUARANTINE, STALE_CLAIM_S, TMP, Untrusted, age_s, exists, open_dir, pid_gone, quarantine_reason, read_json, reclaim, refuse_unsafe, waiting, write_file

START_RECORDS_KEPT_S = 7 * 86400
# healthcheck's event for nvmlInit's LIB_RM_VERSION_MISMATCH (hooks/healthcheck.record_mismatch)
MISMATCH_CHECK = "driver_library_mismatch"

_JOB_COLUMNS = JOB_WRITE_COLUMNS[:-1]  # jobs as v1 wrote it, before `partial`
_DEFAULTS = {"partial": 0, "restart_count": 0}
# Columns that follow the winning record as a whole; the others are filled from the loser where empty.
_WINNER_ONLY = frozenset(("start_time", "end_time", "duration_s", "partial", "notes", "end_counters"))


def _insert(table: str, columns: Tuple[str, ...], verb: str = "INSERT") -> str:
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
    return f"{_insert(table, columns)} ON CONFLICT ({', '.join(key)}) DO UPDATE SET {', '.join(sets)}"


_SQL = {
    "job": _first_wins("jobs", JOB_WRITE_COLUMNS, JOB_KEY),
    "job_gpu": _first_wins("job_gpus", JOB_GPU_WRITE_COLUMNS, JOB_KEY + ("gpu_uuid",)),
    # A prolog re-run for the same job start keeps the latest counters.
    "start": _insert("job_starts", START_COLUMNS, "INSERT OR REPLACE"),
    # The first occurrence of an event wins (a re-run epilog's copy is later).
    "health": _insert("health_events", HEALTH_COLUMNS) + (
        " ON CONFLICT (dedupe_key) DO UPDATE SET time = excluded.time, message = excluded.message"
        " WHERE excluded.time < health_events.time"),
    "drain": _insert("drains", DRAIN_COLUMNS) + " ON CONFLICT (dedupe_key) DO NOTHING",
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


def _row(d: Dict[str, Any], columns: Iterable[str]) -> Tuple[Any, ...]:
    """A record's row as SQLite takes it; a job's XID events become their JSON text here, no sooner."""
    return tuple(_value(xid_text(d.get(c)) if c == "xid_events" else d.get(c, _DEFAULTS.get(c))) for c in columns)


# --------------------------------------------------------------------------- error words


def describe_error(e: BaseException) -> str:
    """What went wrong, in words an admin acts on ("disk full", not "cannot rollback")."""
    if isinstance(e, StoreError):
        return e.message
    text = str(e) or type(e).__name__
    low = text.lower()
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"disk full ({e.strerror})"
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        if code == 13 or "disk is full" in low:
            return f"disk full ({text})"
        if "locked" in low or "busy" in low:
            return f"database locked past store.busy_timeout_s ({text})"
        if "readonly" in low or "read-only" in low:
            return f"database read-only ({text})"
        if "malformed" in low or "not a database" in low:
            return f"database corrupt ({text})"
        return text
    if isinstance(e, OSError):
        return f"{e.strerror or text}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {text}"


def _is_record_problem(e: BaseException) -> bool:
    """True when the database works but refuses this record: retrying it later cannot help."""
    if isinstance(e, (sqlite3.IntegrityError, sqlite3.DataError)):
        return True
    if isinstance(e, (sqlite3.Error, OSError, StoreError)):
        return False  # the database (or the disk) is the problem: the record waits in the spool
    return isinstance(e, Exception)  # KeyError, TypeError, AttributeError, ValueError: a malformed record


def _read_record(dfd: int, name: str) -> Dict[str, Any]:
    """A spool file's record (spool.read_json's checks first); ValueError when it is no record."""
    rec = read_json(dfd, name)
    if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
        raise ValueError(f"not a record (kind {rec.get('kind') if isinstance(rec, dict) else type(rec).__name__!r})")
    return rec


def _record_job_id(rec: Dict[str, Any]) -> Optional[int]:
    try:
        kind = rec["kind"]
        if kind == "job_start":
            j = rec["starts"][0]["job_id"]
        elif kind == "job_end":
            j = rec["job"]["job_id"]
        elif kind == "health":
            j = rec["events"][0]["job_id"]
        else:
            j = drains_of(rec)[0]["job_id"]
        return j if isinstance(j, int) and not isinstance(j, bool) and j >= 0 else None
    except (KeyError, IndexError, TypeError):
        return None


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


class IngestReport:
    """What one pass over the spool did."""

    def __init__(self) -> None:
        self.done = 0
        self.problems: List[str] = []  # one line each, quarantines included
        self.quarantined: List[Tuple[str, str]] = []  # (file, why)
        self.reclaimed = 0  # stranded claims and orphaned temp files put back
        self.left = 0  # files still waiting (a bound was reached or the database stopped taking writes)
        self.total = 0  # files waiting when the pass began (stranded claims put back included)
        self.refused: Optional[StoreError] = None  # the spool directory itself was refused or unusable


class StartLookup(NamedTuple):
    """What the epilog knows of the job's start on this node."""

    starts: Dict[str, Dict[str, Any]]  # the prolog's counters by GPU UUID (database and spool)
    prolog_failed: bool  # a drain by this job's prolog on this node: the job never ran here
    unreadable: str  # why the database could not be read ("" when it could): the answer may be incomplete


class SpoolStatus:
    """What `slurm-gpu db check` reports about the spool directory."""

    def __init__(self) -> None:
        self.waiting: List[str] = []
        self.live_claims: List[str] = []
        self.stale_claims: List[str] = []
        self.orphaned_tmp: List[str] = []
        self.bad: List[str] = []
        self.quarantined: List[Tuple[str, str]] = []  # (file, why it is there, as far as it shows)
        self.problem = ""  # the directory itself cannot be used
        self.hint = ""


# --------------------------------------------------------------------------- the store


class Store:
    def __init__(self, path: str, spool_dir: str, busy_timeout_s: float = 10.0):
        self.path = path
        self.spool_dir = spool_dir
        self.busy_timeout_s = busy_timeout_s
        self._conn: Optional[sqlite3.Connection] = None
        # Once the database failed in this process (locked past the busy timeout, corrupt,
        # refused), later records go straight to the spool instead of waiting again.
        self.unavailable = ""

    @classmethod
    def from_config(cls, cfg: Any) -> "Store":
        return cls(cfg.path_value("store", "database"), cfg.path_value("store", "spool_dir"),
                   cfg.get("store", "busy_timeout_s"))

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
            _rollback(conn)
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
            _apply_in_transaction(self.connect(), record)
        except Exception as e:
            if _is_record_problem(e):
                return Written(QUARANTINED, self.spool(record, reason=describe_error(e), quarantine=True))
            return Written(SPOOL, self.spool(record, reason=self._failed(e)))
        if ingest:
            try:
                self.ingest(max_files=200, max_seconds=1.0)
            except Exception:  # the record is in; the spool waits for the next ingest
                pass
        return Written(DB)

    def _spool_name(self, record: Dict[str, Any]) -> str:
        job = _record_job_id(record)
        return f"{time.time_ns()}-{os.getpid()}-{'' if job is None else f'j{job}-'}{record['kind']}.json"

    def spool(self, record: Dict[str, Any], reason: str = "", quarantine: bool = False) -> str:
        rec = dict(record)
        rec["_spooled_at"] = time.time()
        rec["_spool_reason"] = reason[:500]
        name = self._spool_name(record)
        import json
        try:
            data = json.dumps(rec, sort_keys=True, default=str).encode("ascii")
            dfd = open_dir(self.spool_dir, 0o700)
            try:
                target = dfd
                if quarantine:
                    target = open_dir(QUARANTINE, 0o700, dir_fd=dfd)
                try:
                    write_file(target, name, data)
                finally:
                    if target != dfd:
                        os.close(target)
            finally:
                os.close(dfd)
        except StoreError as e:
            raise StoreError(f"cannot write {self.path} ({reason}) nor spool: {e.message}", e.hint) from None
        except (OSError, ValueError, TypeError) as e:
            why = describe_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            raise StoreError(f"cannot write {self.path} ({reason}) nor spool to {self.spool_dir}: {why}",
                             "free disk space or fix permissions; the record is in the hook log "
                             "(`slurm-gpu db ingest --from-log FILE` replays it)") from None
        return os.path.join(self.spool_dir, QUARANTINE, name) if quarantine else os.path.join(self.spool_dir, name)

    # -- the spool ---------------------------------------------------------------------------
    def _spool_fd(self) -> Optional[int]:
        """The spool directory's descriptor, or None when there is none yet."""
        try:
            return open_dir(self.spool_dir, create=False)
        except FileNotFoundError:
            return None

    def spooled(self) -> List[str]:
        """Records waiting in the spool (paths, oldest first).  Raises StoreError for an unsafe spool."""
        dfd = self._spool_fd()
        if dfd is None:
            return []
        try:
            return [os.path.join(self.spool_dir, n) for n in waiting(dfd)]
        finally:
            os.close(dfd)

    def ingest_spool(self) -> Tuple[int, List[str]]:
        """Move every spooled record into the database.  Returns (ingested, problems)."""
        rep = self.ingest()
        return rep.done, rep.problems

    def ingest(self, max_files: Optional[int] = None, max_seconds: Optional[float] = None) -> IngestReport:
        """Move spooled records into the database, oldest first, within the bounds given.

        Each file is claimed by renaming it first, so concurrent ingests never take the same
        file twice; claims left by a process that died are put back first.  A file the
        database refuses, or that is not root's own, is quarantined and the next one follows;
        when the database stops taking writes the rest waits for the next ingest.
        """
        rep = IngestReport()
        try:
            dfd = self._spool_fd()
        except (StoreError, OSError) as e:
            rep.refused = e if isinstance(e, StoreError) else StoreError(f"{self.spool_dir}: {describe_error(e)}",
                                                                         "run as root")
            rep.problems.append(rep.refused.message)
            return rep
        if dfd is None:
            return rep
        try:
            return self._ingest_from(dfd, rep, max_files, max_seconds)
        except OSError as e:  # the spool directory itself misbehaves (permissions, I/O error)
            rep.problems.append(f"{self.spool_dir}: {describe_error(e)}")
            return rep
        finally:
            os.close(dfd)

    def _ingest_from(self, dfd: int, rep: IngestReport, max_files: Optional[int],
                     max_seconds: Optional[float]) -> IngestReport:
        rep.reclaimed = reclaim(dfd)
        names = waiting(dfd)
        rep.total = len(names)
        if not names:
            return rep
        if self.unavailable:
            rep.left = len(names)
            return rep
        try:
            conn = self.connect()
        except Exception as e:
            rep.problems.append(f"{self.path}: {self._failed(e)}")
            rep.left = len(names)
            return rep
        end = None if max_seconds is None else time.monotonic() + max_seconds
        for i, name in enumerate(names):
            if (max_files is not None and i >= max_files) or (end is not None and time.monotonic() > end):
                rep.left = len(names) - i
                break
            if not self._ingest_one(dfd, conn, name, rep):
                rep.left = len(names) - i
                break
        return rep

    def _ingest_one(self, dfd: int, conn: sqlite3.Connection, name: str, rep: IngestReport) -> bool:
        """One spool file; False when the database stopped taking writes."""
        claim = f".{name}.{os.getpid()}.claim"
        try:
            os.rename(name, claim, src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            return True  # another process claimed it
        try:
            rec = _read_record(dfd, claim)
        except Untrusted as e:
            self._quarantine(dfd, claim, name, str(e), rep)
            return True
        except (OSError, ValueError) as e:
            bad = name + ".bad"
            os.rename(claim, bad, src_dir_fd=dfd, dst_dir_fd=dfd)
            rep.problems.append(f"{name}: unreadable ({e}); kept as {bad}")
            return True
        try:
            _apply_in_transaction(conn, rec)
        except Exception as e:
            if _is_record_problem(e):
                self._quarantine(dfd, claim, name, f"refused by the database: {describe_error(e)}", rep)
                return True
            os.rename(claim, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            rep.problems.append(f"{name}: {self._failed(e)}")
            return False
        os.unlink(claim, dir_fd=dfd)
        rep.done += 1
        return True

    def _quarantine(self, dfd: int, claim: str, name: str, why: str, rep: IngestReport) -> None:
        where = f"{os.path.join(self.spool_dir, QUARANTINE, name)}"
        try:
            qfd = open_dir(QUARANTINE, 0o700, dir_fd=dfd)
            try:
                target = name
                if exists(qfd, target):
                    target = f"{time.time_ns()}-{name}"
                    where = os.path.join(self.spool_dir, QUARANTINE, target)
                os.rename(claim, target, src_dir_fd=dfd, dst_dir_fd=qfd)
            finally:
                os.close(qfd)
        except (OSError, StoreError) as e:
            # No quarantine directory: keep it aside in the spool, never retried, never lost.
            os.rename(claim, name + ".bad", src_dir_fd=dfd, dst_dir_fd=dfd)
            where = os.path.join(self.spool_dir, name + ".bad")
            why += f" (quarantine unusable: {e.message if isinstance(e, StoreError) else describe_error(e)})"
        rep.quarantined.append((name, why))
        rep.problems.append(f"{name}: {why}; quarantined as {where}")

    def replay(self, records: Iterable[Dict[str, Any]]) -> IngestReport:
        """Records recovered from a log (`db ingest --from-log`): idempotent, like every write."""
        rep = IngestReport()
        conn = self.connect()
        for n, rec in enumerate(records, 1):
            if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
                rep.problems.append(f"record {n}: not a record")
                continue
            try:
                _apply_in_transaction(conn, rec)
            except Exception as e:
                if not _is_record_problem(e):
                    raise
                rep.problems.append(f"record {n} ({rec.get('kind')}): refused by the database: {describe_error(e)}")
                continue
            rep.done += 1
        return rep

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

    def spool_status(self) -> SpoolStatus:
        out = SpoolStatus()
        try:
            dfd = self._spool_fd()
        except StoreError as e:
            out.problem, out.hint = e.message, e.hint
            return out
        except OSError as e:
            out.problem, out.hint = f"{self.spool_dir}: {describe_error(e)}", "run as root"
            return out
        if dfd is None:
            return out
        try:
            for n in sorted(os.listdir(dfd)):
                m = re.match(CLAIM, n)
                t = re.match(TMP, n)
                if n.endswith(".json") and not n.startswith("."):
                    out.waiting.append(n)
                elif m:
                    stale = pid_gone(int(m.group(2))) or age_s(dfd, n) > STALE_CLAIM_S
                    (out.stale_claims if stale else out.live_claims).append(n)
                elif t:
                    if pid_gone(int(t.group(3))):
                        out.orphaned_tmp.append(n)
                elif n.endswith(".bad"):
                    out.bad.append(n)
            try:
                qfd = open_dir(QUARANTINE, create=False, dir_fd=dfd)
            except FileNotFoundError:
                qfd = None
            except (StoreError, OSError) as e:
                out.problem = e.message if isinstance(e, StoreError) else f"{QUARANTINE}: {describe_error(e)}"
                qfd = None
            if qfd is not None:
                try:
                    out.quarantined = [(n, quarantine_reason(qfd, n)) for n in sorted(os.listdir(qfd))]
                finally:
                    os.close(qfd)
        finally:
            os.close(dfd)
        return out

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
            mine = _latest_inventory(conn, node)
            latest.update(mine)
            mismatch_at[node] = _latest_mismatch(conn, node, min((r["time"] or 0.0 for r in mine.values()), default=None))
        due = [r for r in rows if _inventory_due(latest.get((r["node"], r["gpu_uuid"])), r, every_s, now,
                                                 mismatch_at[r["node"]])]
        if due:
            _write_all(conn, _insert("gpu_inventory", INVENTORY_COLUMNS), [_row(r, INVENTORY_COLUMNS) for r in due])
        return len(due)

    def record_xids(self, rows: Sequence[Dict[str, Any]]) -> int:
        """Add the xid_events rows (store/observations.xid_rows) not there yet; returns how many.

        An event is there when its event_key is, or when the node has one with the same GPU bus,
        XID and text within XID_SAME_S seconds (a kmsg date read again one rounding away)."""
        if not rows:
            return 0
        conn = self.connect()
        before = conn.total_changes
        _write_all(conn, _SQL_XID, [_row(r, XID_COLUMNS) + (r["node"], r["xid"], r["pci_bus_id"], r["detail"],
                                                             r["time"] - XID_SAME_S, r["time"] + XID_SAME_S)
                                    for r in rows])
        return conn.total_changes - before

    def latest_inventory_time(self, node: str) -> Optional[float]:
        """When the node's newest gpu_inventory row was read; None when it has none."""
        (t,) = self.connect().execute("SELECT MAX(time) FROM gpu_inventory WHERE node = ?", (node,)).fetchone()
        return None if t is None else float(t)

    # -- remediation attempts (`slurm-gpu remediate`; schema v7) --------------------------------
    def record_remediation(self, row: Dict[str, Any]) -> int:
        """Write one attempt (REMEDIATION_COLUMNS; missing ones NULL) in its own transaction; its id."""
        conn = self.connect()
        cur = conn.execute(_insert("remediations", REMEDIATION_COLUMNS),
                           tuple(row.get(c) for c in REMEDIATION_COLUMNS))
        assert cur.lastrowid is not None  # an INSERT's row
        return cur.lastrowid

    def finish_remediation(self, row_id: int, outcome: str, detail: str, now: float) -> None:
        """The outcome of attempt row_id, once known."""
        self.connect().execute("UPDATE remediations SET outcome = ?, detail = ?, finished = ? WHERE id = ?",
                               (outcome, detail, now, row_id))

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
                failed = _prolog_failed(conn, *key)
            except sqlite3.DatabaseError as e:
                if isinstance(e, sqlite3.OperationalError) and _is_lock(e):
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
                elif any(isinstance(d, dict) and _is_prolog_drain_of(d, *key) for d in _drains_or_none(rec)):
                    failed = True
        except _Incomplete as e:
            unreadable = unreadable or str(e)
        except (StoreError, OSError) as e:
            unreadable = unreadable or (e.message if isinstance(e, StoreError) else describe_error(e))
        return StartLookup(starts, failed, unreadable)

    def _spooled_records_of(self, job_id: int, kinds: Tuple[str, ...], budget_s: float) -> Iterator[Dict[str, Any]]:
        dfd = self._spool_fd()
        if dfd is None:
            return
        end = time.monotonic() + budget_s
        try:
            for n in waiting(dfd):
                m = re.match(NAME, n)
                if m is None or m.group(4) not in kinds or (m.group(3) is not None and int(m.group(3)) != job_id):
                    continue
                if time.monotonic() > end:  # a backlog of files named without job ids (older versions)
                    raise _Incomplete(f"spool {self.spool_dir} not searched to the end within {budget_s:g} s")
                try:
                    yield _read_record(dfd, n)
                except (OSError, ValueError, Untrusted):
                    continue  # claimed meanwhile, or not ours: never trusted
        finally:
            os.close(dfd)


class _Incomplete(Exception):
    pass


def _drains_or_none(rec: Dict[str, Any]) -> List[Any]:
    try:
        drains = drains_of(rec)
    except KeyError:  # a drain record of neither shape: not trusted to say anything
        return []
    return drains if isinstance(drains, list) else []


# --------------------------------------------------------------------------- the fleet's history

_SQL_XID = (f"INSERT INTO xid_events ({', '.join(XID_COLUMNS)}) SELECT {', '.join('?' * len(XID_COLUMNS))} "
            "WHERE NOT EXISTS (SELECT 1 FROM xid_events WHERE node = ? AND xid = ? AND pci_bus_id IS ? "
            "AND detail IS ? AND time BETWEEN ? AND ?) ON CONFLICT (event_key) DO NOTHING")


def _latest_inventory(conn: sqlite3.Connection, node: str) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """{(node, GPU UUID): its latest gpu_inventory row} (SQLite takes the bare columns from the
    row holding MAX(id): the newest row of each GPU, one index range per node)."""
    cols = ", ".join(INVENTORY_COLUMNS)
    out: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for r in conn.execute(f"SELECT {cols}, MAX(id) FROM gpu_inventory WHERE node = ? GROUP BY gpu_uuid", (node,)):
        row = dict(zip(INVENTORY_COLUMNS, r))
        out[(row["node"], row["gpu_uuid"])] = row
    return out


def _latest_mismatch(conn: sqlite3.Connection, node: str, after: Optional[float]) -> float:
    """When the node's latest driver/library mismatch event after `after` (the oldest of its GPUs'
    latest rows: only a newer event makes a row due) was recorded; 0.0: none.  The time index
    keeps this to the recent events (a full scan of 100,000 events took 22 ms)."""
    if after is None:
        return 0.0
    (t,) = conn.execute("SELECT MAX(time) FROM health_events WHERE time > ? AND node = ? AND check_name = ?",
                        (after, node, MISMATCH_CHECK)).fetchone()
    return float(t or 0.0)


def _inventory_due(last: Optional[Dict[str, Any]], row: Dict[str, Any], every_s: float, now: float,
                   mismatch_at: float = 0.0) -> bool:
    """A GPU's row is due when it changed, is every_s old, or is older than the node's latest
    driver/library mismatch: `fleet` takes the newer of the two as the node's state."""
    if last is None or now - (last["time"] or 0.0) >= every_s or (last["time"] or 0.0) < mismatch_at:
        return True
    return any(_value(row.get(c)) != last[c] for c in INVENTORY_COLUMNS if c != "time")


def _write_all(conn: sqlite3.Connection, sql: str, params: List[Tuple[Any, ...]]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(sql, params)
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


# --------------------------------------------------------------------------- applying records


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back what is still open.  SQLite rolls back by itself on some errors (disk full):
    a second ROLLBACK would replace the real error with 'cannot rollback'."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _apply_in_transaction(conn: sqlite3.Connection, rec: Dict[str, Any]) -> None:
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
            _rollback(conn)
        except BaseException:
            _rollback(conn)
            raise


class _LookupFailed(Exception):
    pass


def _apply(conn: sqlite3.Connection, rec: Dict[str, Any], lookups: bool = True) -> None:
    kind = rec["kind"]
    if kind == "job_start":
        starts = rec.get("starts") or []
        conn.executemany(_SQL["start"], [_row(s, START_COLUMNS) for s in starts])
        for s in starts:
            _complete_partial_rows(conn, s)
    elif kind == "job_end":
        _apply_job_end(conn, rec, lookups)
    if kind in ("job_end", "health") and rec.get("events"):
        conn.executemany(_SQL["health"], [_row(dict(e, dedupe_key=_event_key(rec, e)), HEALTH_COLUMNS)
                                          for e in rec["events"]])
    if kind == "drain":
        for d in drains_of(rec):
            conn.execute(_SQL["drain"], _row(dict(d, dedupe_key=_drain_key(d)), DRAIN_COLUMNS))
            if d.get("source") == "prolog" and d.get("job_id") is not None and d.get("cluster") is not None:
                _drop_partial_rows(conn, d["cluster"], d["job_id"], d.get("restart_count") or 0, d["node"])


def _apply_job_end(conn: sqlite3.Connection, rec: Dict[str, Any], lookups: bool = True) -> None:
    job = dict(rec["job"])
    gpus = [dict(g) for g in rec.get("gpus", [])]
    key = tuple(job[k] for k in JOB_KEY)
    if lookups and any(g.get("partial") for g in gpus):
        if _readable(_prolog_failed, conn, *key):
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
    conn.execute(_SQL["job"], _row(job, JOB_WRITE_COLUMNS))
    conn.executemany(_SQL["job_gpu"], [_row(g, JOB_GPU_WRITE_COLUMNS) for g in gpus])


def _readable(lookup: Any, conn: sqlite3.Connection, *args: Any) -> Any:
    """A lookup that completes a record; a table that cannot be read (corrupt) leaves the
    record as it is instead of making it wait in the spool for a repair that may never come."""
    try:
        return lookup(conn, *args)
    except sqlite3.DatabaseError as e:
        if isinstance(e, sqlite3.OperationalError) and _is_lock(e):
            raise
        raise _LookupFailed(str(e)) from e


def _is_lock(e: BaseException) -> bool:
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


def _is_prolog_drain_of(d: Dict[str, Any], cluster: str, job_id: int, restart_count: int, node: str) -> bool:
    restart = d.get("restart_count")
    return (d.get("source") == "prolog" and d.get("job_id") == job_id and d.get("node") == node
            and d.get("cluster") in (None, cluster) and (restart is None or restart <= restart_count))


def _prolog_failed(conn: sqlite3.Connection, cluster: str, job_id: int, restart_count: int, node: str) -> bool:
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
    conn.execute(_SQL["job_gpu"], _row(done, JOB_GPU_WRITE_COLUMNS))
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


def recent_health_events(path: str, check_name: str, since: float, timeout_s: float = 2.0) -> List[Dict[str, Any]]:
    """The node database's health events of one check at or after since, read-only
    (healthcheck asks what the epilogs recorded); [] when there is no database yet."""
    if not os.path.exists(path):
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout_s)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(
            "SELECT time, source, job_id, gpu_index, gpu_uuid, check_name, status, message FROM health_events"
            " WHERE check_name = ? AND time >= ? ORDER BY time", (check_name, since))]
    finally:
        conn.close()


def check_database_path(path: str, create_dir: bool = False) -> None:
    """Refuse a database reached through a symlink, or one (or its directory) that an
    unprivileged user owns or may write.  Raises StoreError naming the path."""
    d = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    if create_dir:
        dfd = open_dir(d, 0o755)
    else:
        dfd = open_dir(d, create=False)
    try:
        for n in (name, name + "-wal", name + "-shm"):
            try:
                st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            shown = os.path.join(d, n)
            if stat.S_ISLNK(st.st_mode):
                raise StoreError(f"refusing database {shown}: it is a symbolic link (root never follows one here)",
                                 f"point store.database at the real file, or move the link away: rm {shown}")
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"refusing database {shown}: not a regular file", "point store.database at a file")
            refuse_unsafe(st, shown, "database", f"chown root:root {shown}; chmod 640 {shown}")
    finally:
        os.close(dfd)


class DatabaseProblem(NamedTuple):
    text: str
    hint: str


def database_problems(path: str) -> List[DatabaseProblem]:
    """Problems found in a database file, each with what to do (empty list: healthy)."""
    if not os.path.lexists(path):
        return [DatabaseProblem(f"{path} does not exist", "it is created by the first hook run or `slurm-gpu db ingest`")]
    try:
        check_database_path(path)
    except StoreError as e:
        return [DatabaseProblem(e.message, e.hint)]
    except OSError as e:
        return [DatabaseProblem(f"{path}: {describe_error(e)}", "run as root")]
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as e:
        return [DatabaseProblem(f"{path}: {describe_error(e)}", _CORRUPT_HINT)]
    problems = [DatabaseProblem(r, _CORRUPT_HINT) for r in rows if r != "ok"]
    if version > SCHEMA_VERSION:
        problems.append(DatabaseProblem(
            f"schema version {version} is newer than this slurm-gpu understands ({SCHEMA_VERSION}): a newer slurm-gpu "
            f"wrote it; upgrade slurm-gpu on this node", "hooks spool their records until slurm-gpu is upgraded"))
    elif version < SCHEMA_VERSION:
        problems.append(DatabaseProblem(f"schema version {version}, expected {SCHEMA_VERSION}",
                                        "run any hook or `slurm-gpu db ingest` to migrate"))
    return problems


_CORRUPT_HINT = ("a corrupt database keeps spooling records; move it aside (records are kept in the spool), "
                 "then `slurm-gpu db ingest` creates a fresh one")


def integrity_check(path: str) -> List[str]:
    """Problems found in a database file (empty list: healthy)."""
    return [p.text for p in database_problems(path)]


_LOST = r' record-lost-to-log .*?\brecord="((?:[^"\\]|\\.)*)"'  # compiled on first use: `db ingest --from-log`


def records_from_log(lines: Iterable[str]) -> Iterator[Tuple[int, Any]]:
    """(line number, record) for each `record-lost-to-log` line of a hook log (file, fallback
    log or syslog); a line whose record does not parse yields (line number, the error)."""
    import json
    for n, line in enumerate(lines, 1):
        m = re.search(_LOST, line)
        if m is None:
            continue
        text = re.sub(r"\\(.)", r"\1", m.group(1))  # hooklog quoting: \\ and \" only (the JSON is ASCII)
        try:
            yield n, json.loads(text)
        except ValueError as e:
            yield n, e
