"""GPU accounting reports over one or more node databases (read-only).

How the numbers are computed (docs/report.md is the long form):

- The unit of record is one ``job_gpus`` row: one job run (cluster, job_id, restart_count) on one
  node and one GPU, with its start/end time and the GPU's mean utilisation, memory
  utilisation, peak memory and energy over that time.
- Time window: a record counts when its interval [start, end) overlaps [since, until); it
  contributes only the overlapping part (as sreport does).  Energy is prorated by the same
  fraction.  Day/week/month groups split a record the same way at bucket boundaries.
- ``gpu_hours_alloc`` = sum of overlap seconds / 3600.
- ``gpu_util_mean_pct`` = time-weighted mean of utilisation over records that report it;
  records with NULL utilisation are left out of the mean and shown in ``gpu_hours_no_util``.
- ``gpu_hours_used`` = sum(overlap * util / 100) / 3600 over records that report utilisation
  (= alloc x mean util when every record reports it; unknown utilisation never counts as used).
- ``gpu_hours_idle`` = overlap of records whose utilisation is known and < the idle threshold
  (unknown utilisation never counts as idle).
- ``jobs`` = distinct (cluster, job_id) with time in the group: a requeued job counts once.
- Records with zero duration carry no GPU time and are not counted.
- Records whose times cannot be placed (end before start, end outside 2000-2099 or not a
  number, longer than ten years) are skipped and counted in Table.notes; utilisation outside
  0..100 % counts as 0 or 100 (also noted).  No figure is ever NaN or infinite.
- TOTAL lines come from the groups' unrounded sums, computed like any group's figures.

Databases are opened with ``mode=ro`` URIs: a report never writes a node database.  A WAL file
without its ``-wal`` file is read as ``immutable=1`` (nothing is created beside it) only under
a read lock that keeps checkpoints out, and read again when a writer came meanwhile
(FileRead, read_consistently): every report describes one committed state.
"""
from __future__ import annotations

import glob
import math
import os
import sqlite3
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import quote

from slurm_gpu.store import schema
from slurm_gpu.errors import InputError, StoreError
from slurm_gpu.report.timespec import format_time, in_zone, time_zone, wall_time

# --by keys: name -> SQL expression over job_gpus (time keys come from the calendar join).
GROUP_KEYS: Dict[str, str] = {
    "user": '"user"',
    "account": '"account"',
    "partition": '"partition"',
    "node": '"node"',
    "gpu-model": '"gpu_model"',
    "cluster": '"cluster"',
}
TIME_KEYS = ("day", "week", "month")
BY_CHOICES = tuple(GROUP_KEYS) + TIME_KEYS
_BY_ALIASES = {"gpu_model": "gpu-model", "model": "gpu-model", "users": "user", "accounts": "account",
               "partitions": "partition", "nodes": "node", "days": "day", "weeks": "week", "months": "month",
               "daily": "day", "weekly": "week", "monthly": "month"}

SUMMARY_COLUMNS = ("jobs", "gpu_hours_alloc", "gpu_hours_used", "gpu_util_mean_pct", "mem_util_mean_pct",
                   "peak_memory_gib", "energy_kwh", "gpu_hours_idle", "gpu_hours_no_util")
SUMMARY_HEADERS = ("jobs", "GPU-h alloc", "GPU-h used", "util %", "mem util %", "peak mem GiB", "energy kWh",
                   "idle GPU-h", "GPU-h no util")

JOB_LIST_COLUMNS = ("cluster", "job_id", "restart", "user", "account", "partition", "start", "end", "nodes", "gpus",
                    "gpu_hours_alloc", "gpu_hours_used", "gpu_util_mean_pct", "gpu_util_min_pct",
                    "mem_util_mean_pct", "peak_memory_gib", "energy_kwh", "idle_gpus", "gpu_hours_idle")
JOB_LIST_HEADERS = ("cluster", "job", "restart", "user", "account", "partition", "start", "end", "nodes", "gpus",
                    "GPU-h alloc", "GPU-h used", "util %", "min util %", "mem util %", "peak mem GiB",
                    "energy kWh", "idle GPUs", "idle GPU-h")

JOB_DETAIL_COLUMNS = ("cluster", "job_id", "restart", "node", "gpu_index", "gpu_uuid", "gpu_model", "user", "account",
                      "partition", "start", "end", "gpu_hours", "gpu_util_mean_pct", "mem_util_mean_pct",
                      "peak_memory_gib", "energy_kwh", "idle", "processes", "ecc_corrected", "ecc_uncorrected",
                      "retired_pages", "remapped_rows", "clock_event_reasons", "xid_events")
JOB_DETAIL_HEADERS = ("cluster", "job", "restart", "node", "gpu", "uuid", "model", "user", "account", "partition",
                      "start", "end", "GPU-h", "util %", "mem util %", "peak mem GiB", "energy kWh", "idle",
                      "procs", "ecc corr", "ecc uncorr", "retired pages", "remapped rows", "clock events", "xids")

GIB = float(1 << 30)


@dataclass(frozen=True)
class Query:
    """What to count: time window (unix seconds, None = open), filters, idle threshold, zone of calendar keys."""

    since_s: Optional[float] = None
    until_s: Optional[float] = None
    users: Tuple[str, ...] = ()
    accounts: Tuple[str, ...] = ()
    partitions: Tuple[str, ...] = ()
    nodes: Tuple[str, ...] = ()
    clusters: Tuple[str, ...] = ()
    idle_threshold_pct: float = 5.0
    tz: str = "utc"
    job_id: Optional[int] = None  # report job JOBID

    def __post_init__(self) -> None:
        if self.since_s is not None and self.until_s is not None and self.until_s <= self.since_s:
            raise InputError(
                f"empty time window: --until ({format_time(self.until_s, self.tz)}) is not after --since "
                f"({format_time(self.since_s, self.tz)})", "give a --since earlier than --until")
        if not 0 <= self.idle_threshold_pct <= 100:
            raise InputError(f"idle threshold {self.idle_threshold_pct:g}% is outside 0..100",
                             "give --idle-threshold between 0 and 100")
        time_zone(self.tz)


@dataclass(frozen=True)
class Table:
    """A report result: rows are dicts keyed by ``columns``; ``headers`` are the human column titles."""

    title: str
    columns: Tuple[str, ...]
    headers: Tuple[str, ...]
    rows: Tuple[Dict[str, Any], ...]
    keys: Tuple[str, ...] = ()  # the group-by columns (summary) or identity columns
    kind: str = "summary"  # summary, jobs or job
    total: Optional[Dict[str, Any]] = None  # summary: the TOTAL line, from unrounded sums
    notes: Tuple[str, ...] = ()  # records skipped or adjusted, said on stderr


def parse_by(values: Sequence[str]) -> Tuple[str, ...]:
    """`--by account,month` (comma lists, repeatable) -> ('account', 'month'); InputError on unknown keys."""
    out: List[str] = []
    for v in values:
        for part in v.split(","):
            name = part.strip().lower()
            if not name:
                continue
            name = _BY_ALIASES.get(name, name)
            if name not in BY_CHOICES:
                raise InputError(f"unknown --by key {part.strip()!r}", "choose from " + ", ".join(BY_CHOICES)
                                 + " (comma-separated, e.g. --by account,month)")
            if name not in out:
                out.append(name)
    if sum(1 for k in out if k in TIME_KEYS) > 1:
        raise InputError("--by takes at most one of day, week, month", "e.g. --by account,month")
    return tuple(out) or ("user",)


def split_list(values: Sequence[str]) -> Tuple[str, ...]:
    """Comma lists, repeatable options: ('a,b', 'c') -> ('a', 'b', 'c')."""
    return tuple(p.strip() for v in values for p in v.split(",") if p.strip())


# --------------------------------------------------------------------------- sources


def resolve_paths(paths: Sequence[str]) -> List[str]:
    """Files as given; directories expand to their ``*.db`` files.  Sorted, duplicates removed."""
    files: List[str] = []
    if not paths:
        raise InputError("no database to read", "give --db FILE_OR_DIR or set report.sources in the config")
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(glob.escape(p), "*.db")))
            if not found:
                raise InputError(f"no *.db files in directory {p}", "give node database files or a directory holding them")
            files.extend(found)
        elif os.path.exists(p):
            files.append(p)
        else:
            raise InputError(f"database {p} does not exist", "check the path given with --db (or report.sources)")
    seen = set()
    unique = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            unique.append(f)
    return unique


# SQLite's unix locking protocol (os_unix.c): every connection reading the database holds a read
# lock on SHARED_SIZE bytes from SHARED_FIRST; a writer of a rollback-journal database, and the
# checkpoint that the last connection to close a WAL database runs, need a write lock on them.
_PENDING_BYTE = 0x40000000
_SHARED_FIRST = _PENDING_BYTE + 2
_SHARED_SIZE = 510
LOCK_WAIT_S = 5.0  # how long to wait for a closing writer's checkpoint before reading through the WAL


def _read_only_medium(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _ofd_read_lock(fd: int, wait_s: float) -> bool:
    """A read lock on SQLite's SHARED bytes, owned by this open file (Linux OFD lock): while it is
    held no connection can checkpoint a WAL into the main file, delete the -wal file, or write a
    rollback-journal database.  False where the lock cannot be had (no OFD locks on this system or
    file system, or a writer kept it past `wait_s`)."""
    import errno
    import fcntl
    import struct

    cmd = getattr(fcntl, "F_OFD_SETLK", None)
    if cmd is None:
        return False
    # struct flock {short l_type, l_whence; off_t l_start, l_len; pid_t l_pid;} (l_pid 0 for OFD locks)
    arg = struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, _SHARED_FIRST, _SHARED_SIZE, 0)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.fcntl(fd, cmd, arg)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                return False
        time.sleep(0.005)


class FileRead:
    """How one database file is read, and afterwards whether it can have changed meanwhile.

    - No `-wal` file beside a WAL database (the state every hook leaves when it closes): the main
      file holds every committed record.  It is read as `immutable=1` (no -shm/-wal is created,
      so reports work on read-only files and directories), holding a read lock on SQLite's
      SHARED bytes.  Any writer that opens the database meanwhile creates the -wal file, and the
      lock keeps it from checkpointing and deleting it on close; so `unchanged()` (no -wal file
      after the read) proves that nothing touched the main file.  When a writer did come (its
      WAL may even have been auto-checkpointed into the pages being read), the caller reads again.
    - A `-wal` file (a hook has the database open now), or `live=True` where the directory is
      writable (SQLite then creates the -wal and -shm files): SQLite's own WAL read protocol; all
      queries of the report run in one read transaction (one snapshot) on one connection.
    - A rollback-journal file: SQLite's own locks; ours keeps writers out between statements.
    - A read-only file system: nothing can change; `immutable=1` when there is no -wal file.
    """

    def __init__(self, path: str, live: bool = False):
        self.path = path
        self.fd: Optional[int] = None
        try:
            with open(path, "rb") as f:
                header = f.read(100)
        except OSError as e:
            raise StoreError(f"database {path} cannot be read: {e.strerror}", "check its permissions") from None
        self.wal_mode = len(header) >= 20 and header[18] == 2 and header[19] == 2
        self.wal_path = path + "-wal"
        base = "file:" + quote(os.path.abspath(path)) + "?mode=ro"
        self.uri = base
        self.stable = False  # True: the file cannot change while it is read (threads may share the read)
        self.frozen = False  # True: read as immutable under our lock; unchanged() must confirm it
        if _read_only_medium(path):
            self.stable = True
            if self.wal_mode and not os.path.exists(self.wal_path):
                self.uri = base + "&immutable=1"
            return
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise StoreError(f"database {path} cannot be read: {e.strerror}", "check its permissions") from None
        if not _ofd_read_lock(fd, LOCK_WAIT_S):
            os.close(fd)
            return  # live: SQLite's own protocol
        self.fd = fd
        if not self.wal_mode:
            self.stable = True  # rollback journal: no writer gets past our lock
        elif not os.path.exists(self.wal_path) and not (live and os.access(os.path.dirname(os.path.abspath(path)),
                                                                            os.W_OK)):
            # Checked under the lock: a writer that comes now leaves its -wal file (unchanged()).
            # (live=True reads through the WAL instead, creating -wal/-shm, where it may.)
            self.uri = base + "&immutable=1"
            self.stable = self.frozen = True
        else:
            self.release()

    def unchanged(self) -> bool:
        """After the read: could a writer have changed what was read?  (Call before release().)"""
        return not self.frozen or not os.path.exists(self.wal_path)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SourceChanged(Exception):
    """A database read as immutable got a writer during the read: read it again."""


def readonly_uri(path: str) -> str:
    """The URI a report opens `path` with when it is read now (for tools such as the benchmark)."""
    reading = FileRead(path)
    reading.release()
    return reading.uri


def _check_database(conn: sqlite3.Connection, reading: FileRead, prefix: str = "main") -> None:
    path = reading.path
    try:
        version = conn.execute(f"PRAGMA {prefix}.user_version").fetchone()[0]
        has_table = conn.execute(f"SELECT 1 FROM {prefix}.sqlite_master WHERE type='table' AND name='job_gpus'").fetchone()
    except sqlite3.DatabaseError as e:
        if not reading.unchanged():
            raise SourceChanged(path) from None
        raise StoreError(f"{path}: not a readable SQLite database ({e})", "give slurm-gpu node databases (usage.db)") from None
    if version > schema.SCHEMA_VERSION:
        raise StoreError(f"{path}: schema version {version} is newer than this slurm-gpu understands ({schema.SCHEMA_VERSION})",
                         "upgrade slurm-gpu on the host that runs the report")
    if not has_table:
        if reading.wal_mode and not os.path.exists(reading.wal_path):
            raise StoreError(
                f"{path}: no job_gpus table, and its write-ahead log {os.path.basename(reading.wal_path)} is missing: "
                "a copy of a live node database made without its -wal file (cp, rsync, scp) lacks the records "
                "still in the WAL", "copy node databases with `slurm-gpu db backup --database SRC DEST` "
                "(SQLite's backup API), or copy the -wal file together with the database")
        raise StoreError(f"{path}: no job_gpus table, not a slurm-gpu node database", "give slurm-gpu node databases (usage.db)")


def _connect(uri: str, path: str) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot open database ({e})", "check the file and its directory permissions") from None
    return conn


class SourceBase:
    """What every report reads through: ``conn`` (execute -> cursor), ``table`` (job_gpus rows),
    ``query``, and the SQL spellings that differ between SQLite and the central server."""

    table = "job_gpus"
    files: List[str] = []
    query: "Query"
    conn: Any
    LEAST, GREATEST = "MIN", "MAX"  # two-argument min/max
    PLUS = "+"  # a unary plus that hides a column from SQLite's planner (nothing elsewhere)

    def floor(self, expr: str) -> str:
        return f"CAST({expr} AS INTEGER)"  # values here are >= 0: truncation is the floor

    SPAN = "end_time - start_time"  # the record's duration as the source's index knows it

    def skipped(self) -> Dict[str, int]:
        return _count_skipped(self.conn, self.table, self.query, self.SPAN, self.PLUS)

    plan = ""  # which plan the last summary ran (`report --explain`)

    def summary_rows(self, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
        """A source's own plan for the summary's raw sums (the central server's rollups); None: none."""
        return None

    def unchanged(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def __enter__(self) -> "SourceBase":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    def single_cluster(self) -> bool:
        # Both ends of the primary-key index: O(log n), no scan.
        lo = self.conn.execute(f"SELECT cluster FROM {self.table} ORDER BY cluster LIMIT 1").fetchone()
        hi = self.conn.execute(f"SELECT cluster FROM {self.table} ORDER BY cluster DESC LIMIT 1").fetchone()
        return lo == hi

    def end_time_range(self) -> Tuple[Optional[float], Optional[float]]:
        """The earliest and latest plausible end times (end_time index: O(log n))."""
        lo = self.conn.execute(f"SELECT end_time FROM {self.table} WHERE end_time >= ? ORDER BY end_time LIMIT 1",
                               (TIME_MIN_S,)).fetchone()
        hi = self.conn.execute(f"SELECT end_time FROM {self.table} WHERE end_time < ? ORDER BY end_time DESC LIMIT 1",
                               (TIME_MAX_S,)).fetchone()
        return (lo[0] if lo else None), (hi[0] if hi else None)

    def use_end_index(self) -> bool:
        return False

    def install_calendar(self, conn: Any, buckets: Sequence[Tuple[float, float, str]]) -> None:
        conn.execute("DROP TABLE IF EXISTS temp.cal")
        conn.execute("CREATE TEMP TABLE cal (idx INTEGER NOT NULL, b_start REAL NOT NULL, b_end REAL NOT NULL, "
                     "label TEXT NOT NULL)")
        conn.executemany("INSERT INTO temp.cal VALUES (?, ?, ?, ?)", [(i,) + tuple(b) for i, b in enumerate(buckets)])
        conn.execute("CREATE INDEX temp.cal_start ON cal (b_start)")


class Source(SourceBase):
    """One connection over all given databases, with job_gpus reachable as ``self.table``.

    One file: the file itself, aggregated in place (fast path).  Several: the rows that pass the
    query's window and filters are copied, de-duplicated on the primary key (first file in sorted
    path order wins), into a private temporary database; files are attached one at a time, so any
    number of files works despite SQLite's limit on attached databases.

    `live=True` reads every file through SQLite's WAL protocol (see FileRead); `unchanged()`
    says whether the result can be trusted (read_consistently() retries when it cannot).
    """

    def __init__(self, paths: Sequence[str], query: Query, live: bool = False):
        self.files = resolve_paths(paths)
        self.query = query
        self.reading: Optional[FileRead] = None
        # Records that cannot be placed in time, found while merging several files: reason -> count.
        self.merge_skipped: Dict[str, int] = {}
        if len(self.files) == 1:
            path = self.files[0]
            self.reading = FileRead(path, live)
            try:
                self.conn = _connect(self.reading.uri, path)
                # One read transaction for every query of the report: one snapshot of a live database.
                self.conn.execute("BEGIN")
                _check_database(self.conn, self.reading)
                names = {r[0] for r in self.conn.execute(
                    "SELECT name FROM main.sqlite_master WHERE type='index' AND tbl_name='job_gpus'")}
            except BaseException:
                self.close()
                raise
            self.indexed = True
            # Schema v2's covering indexes (a v1 file read as is has none: the report never migrates).
            self.covering = frozenset(c for c in schema.REPORT_INDEX_KEYS if f"job_gpus_by_{c}" in names) \
                if "job_gpus_duration" in names else frozenset()
        else:
            # The merged temp database has no covering index: building one is a sort of every row,
            # which is what the plain GROUP BY does anyway.
            self.conn = self._merge(self.files, query, live)
            self.indexed = False
            self.covering = frozenset()
        self.table = "main.job_gpus"

    def _merge(self, files: Sequence[str], query: Query, live: bool) -> sqlite3.Connection:
        # "" = an anonymous on-disk temporary database: pages beyond the cache spill to a temp file,
        # so memory stays flat however many rows are merged.
        conn = sqlite3.connect("", uri=True, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        ddl = next(s for s in schema.MIGRATIONS[0] if "TABLE IF NOT EXISTS job_gpus" in s)
        conn.execute(ddl)
        try:
            for path in files:
                self._merge_one(conn, path, query, live)
        except BaseException:
            conn.close()
            raise
        return conn

    def _merge_one(self, conn: sqlite3.Connection, path: str, query: Query, live: bool) -> None:
        cols = ", ".join(schema.JOB_GPU_COLUMNS)
        where, params = _where(query, use_index=True)
        for attempt in range(READ_ATTEMPTS):
            reading = FileRead(path, live or attempt >= 2)
            try:
                try:
                    conn.execute("ATTACH DATABASE ? AS src", (reading.uri,))
                except sqlite3.Error as e:
                    raise StoreError(f"{path}: cannot open database ({e})", "check the file and its directory permissions") from None
                try:
                    conn.execute("BEGIN")  # one snapshot of the file for the copy and the counts
                    _check_database(conn, reading, "src")
                    conn.execute(f"INSERT OR IGNORE INTO main.job_gpus ({cols}) SELECT {cols} FROM src.job_gpus "
                                 f"WHERE {where}", params)
                    skipped = _count_skipped(conn, "src.job_gpus", query)
                    if reading.unchanged():
                        conn.execute("COMMIT")
                        for k, v in skipped.items():
                            self.merge_skipped[k] = self.merge_skipped.get(k, 0) + v
                        return
                    conn.execute("ROLLBACK")
                except sqlite3.DatabaseError as e:
                    if reading.unchanged():
                        raise StoreError(f"{path}: cannot read job_gpus ({e})", _CORRUPT_HINT) from None
                    # else a checkpoint rewrote pages under the immutable read: read it again
                except SourceChanged:
                    pass
                finally:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    conn.execute("DETACH DATABASE src")
            finally:
                reading.release()
        raise StoreError(f"{path}: the database kept changing while it was read ({READ_ATTEMPTS} attempts)",
                         "run the report again, or report from a copy made with `slurm-gpu db backup`")

    def connect_again(self) -> sqlite3.Connection:
        """Another connection to the single file, for a thread (only where the file cannot change)."""
        assert self.reading is not None and self.reading.stable
        return _connect(self.reading.uri, self.reading.path)

    def unchanged(self) -> bool:
        return self.reading is None or self.reading.unchanged()

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()
        if self.reading is not None:
            self.reading.release()

    def skipped(self) -> Dict[str, int]:
        if self.reading is None:
            return dict(self.merge_skipped)
        return super().skipped()

    def use_end_index(self) -> bool:
        """Use the end_time index only when --since keeps a small part of the data.

        Without statistics SQLite would always take the index for `end_time > ?`, and an index
        walk with a table lookup per row is several times slower than a plain scan when most
        rows qualify.  End times are spread roughly evenly, so the time fraction estimates the
        row fraction.
        """
        if self.query.since_s is None or not self.indexed:
            return False
        lo, hi = self.end_time_range()
        if lo is None or hi is None or hi <= lo:
            return True
        return (hi - self.query.since_s) / (hi - lo) < 0.25


READ_ATTEMPTS = 4
_CORRUPT_HINT = ("the file is damaged: `slurm-gpu db check --database FILE` shows where; `sqlite3 FILE .recover` "
                 "salvages the readable records into a new database")


def open_sources(paths: Sequence[str], query: Query, live: bool = False) -> Source:
    return Source(paths, query, live)


def read_consistently(paths: Sequence[str], query: Query, fn: Callable[[Source], Any]) -> Any:
    """fn(source), from data that no writer changed while fn read it.

    A file read as immutable that got a writer meanwhile is read again (twice the same way,
    then through SQLite's WAL protocol).  A database damaged in the middle is a StoreError
    naming the file, not a traceback.
    """
    for attempt in range(READ_ATTEMPTS):
        try:
            src = open_sources(paths, query, live=attempt >= 2)
        except SourceChanged:
            continue
        with src:
            try:
                result = fn(src)
            except sqlite3.DatabaseError as e:
                if not src.unchanged():
                    continue  # a checkpoint rewrote pages under the immutable read: not damage
                raise StoreError(f"{_describe_files(src.files)}: cannot read job_gpus ({e})", _CORRUPT_HINT) from None
            if src.unchanged():
                return result
    raise StoreError(f"{_describe_files(resolve_paths(paths))}: the database kept changing while it was read "
                     f"({READ_ATTEMPTS} attempts)", "run the report again, or report from a copy made with `slurm-gpu db backup`")


def copy_database(src_path: str, dest_path: str) -> int:
    """A consistent, self-contained copy of a node database: `slurm-gpu db backup`.

    SQLite's backup API reads one snapshot (read-only, as a report does: a hook may be writing),
    records still in the -wal file included; the copy is switched to a rollback journal so it is
    one file that needs no -wal beside it.  DEST is never overwritten.  Returns the number of
    job_gpus records copied.
    """
    if not os.path.exists(src_path):
        raise InputError(f"database {src_path} does not exist", "give the node database with --database")
    if os.path.lexists(dest_path):
        raise InputError(f"{dest_path} exists", "give a new file name: db backup never overwrites")
    dest_dir = os.path.dirname(os.path.abspath(dest_path))
    os.makedirs(dest_dir, mode=0o755, exist_ok=True)
    tmp = os.path.join(dest_dir, f".{os.path.basename(dest_path)}.{os.getpid()}.tmp")
    try:
        n = _snapshot_into(src_path, tmp)
        try:
            os.link(tmp, dest_path)  # fails instead of replacing a file that appeared meanwhile
        except FileExistsError:
            raise InputError(f"{dest_path} exists", "give a new file name: db backup never overwrites") from None
        except OSError:
            os.rename(tmp, dest_path)  # a file system without hard links
    except OSError as e:
        raise StoreError(f"cannot write {dest_path}: {e.strerror or e}", "check the directory and free space") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def _snapshot_into(src_path: str, tmp: str) -> int:
    """Back src_path up into tmp, reading again while a writer changes it; the job_gpus rows copied."""
    for attempt in range(READ_ATTEMPTS):
        reading = FileRead(src_path, live=attempt >= 2)
        try:
            n = _backup_once(src_path, reading, tmp)
            if n is not None and reading.unchanged():
                return n
            if os.path.exists(tmp):
                os.unlink(tmp)
        finally:
            reading.release()
    raise StoreError(f"{src_path}: the database kept changing while it was copied ({READ_ATTEMPTS} attempts)",
                     "run the backup again")


def _backup_once(src_path: str, reading: FileRead, tmp: str) -> Optional[int]:
    """One read of src_path copied into tmp: the job_gpus rows copied, None when a writer changed it meanwhile."""
    src = _connect(reading.uri, src_path)
    try:
        _check_database(src, reading)
        old = os.umask(0o027)  # like the node database: no write for group, nothing for others
        try:
            dst = sqlite3.connect(tmp, isolation_level=None)
        finally:
            os.umask(old)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
            return dst.execute("SELECT COUNT(*) FROM job_gpus").fetchone()[0]
        finally:
            dst.close()
    except sqlite3.DatabaseError as e:
        if reading.unchanged():
            raise StoreError(f"{src_path}: cannot copy ({e})", _CORRUPT_HINT) from None
        return None
    except SourceChanged:
        return None
    finally:
        src.close()


# --------------------------------------------------------------------------- SQL building

# A record's times must be plausible: anything else is a clock or storage fault.  Such records
# are skipped and counted (Table.notes), never allowed to turn into absurd or infinite figures.
TIME_MIN_S = 946684800.0  # 2000-01-01T00:00:00Z: earliest end time
TIME_MAX_S = 4102444800.0  # 2100-01-01T00:00:00Z: end times must be before it
MAX_RECORD_S = 3653 * 86400.0  # ten years: no allocation lasts longer

# Utilisation is a percentage: a value outside 0..100 (a driver or storage fault) counts as 0 or
# 100.  (CASE, not MIN/MAX: half the cost per record; NULL stays NULL.)
UTIL = "CASE WHEN gpu_util_mean_pct > 100 THEN 100.0 WHEN gpu_util_mean_pct < 0 THEN 0.0 ELSE gpu_util_mean_pct END"
MEM_UTIL = "CASE WHEN mem_util_mean_pct > 100 THEN 100.0 WHEN mem_util_mean_pct < 0 THEN 0.0 ELSE mem_util_mean_pct END"
# UTIL < :thr without computing UTIL (thresholds lie in 0..100).
IDLE = "(gpu_util_mean_pct < :thr AND (:thr > 0 OR gpu_util_mean_pct >= 0))"
_OUT_OF_RANGE = "(gpu_util_mean_pct NOT BETWEEN 0 AND 100 OR mem_util_mean_pct NOT BETWEEN 0 AND 100)"


def _valid_sql() -> str:
    # The unary + keeps SQLite from walking the end_time or duration index for these (nearly
    # always true) conditions: a table lookup per row costs more than the scan.
    return ("end_time > start_time AND +end_time >= :tmin AND +end_time < :tmax "
            "AND +end_time - start_time <= :maxdur")


def _filters(q: Query, params: Dict[str, Any], column: Callable[[str], str] = lambda c: f'"{c}"',
             prefix: str = "") -> List[str]:
    """The query's filters as conditions on column(name), their values in params (prefix, name, i)."""
    conds = []
    for col, vals in (("user", q.users), ("account", q.accounts), ("partition", q.partitions),
                      ("node", q.nodes), ("cluster", q.clusters)):
        if vals:
            names = []
            for i, v in enumerate(vals):
                params[f"{prefix}{col}{i}"] = v
                names.append(f":{prefix}{col}{i}")
            conds.append(f'{column(col)} IN ({", ".join(names)})')
    if q.job_id is not None:
        conds.append("job_id = :job_id")
        params["job_id"] = q.job_id
    return conds


def _where(q: Query, use_index: bool = True) -> Tuple[str, Dict[str, Any]]:
    conds = [_valid_sql()]
    params: Dict[str, Any] = {"tmin": TIME_MIN_S, "tmax": TIME_MAX_S, "maxdur": MAX_RECORD_S}
    if q.since_s is not None:
        # The unary + hides the column from the planner: a full scan beats the index for wide windows.
        conds.append(("end_time" if use_index else "+end_time") + " > :since")
        params["since"] = q.since_s
    if q.until_s is not None:
        conds.append("start_time < :until")
        params["until"] = q.until_s
    conds += _filters(q, params)
    return " AND ".join(conds), params


SKIP_REASONS = {
    "end_before_start": "end before start",
    "implausible_time": "end time outside 2000-2099 or not a number",
    "too_long": "longer than ten years",
}


def _count_skipped(conn: Any, table: str, q: Query, span: str = "end_time - start_time",
                   plus: str = "+") -> Dict[str, int]:
    """Records (matching the filters, in any window) that cannot be placed in time, by reason.

    Each count is a range of the duration or end_time index (O(log n) plus the records found)
    where the file has them; the conditions are disjoint.  `span` names the indexed duration:
    SQLite matches the expression index on end_time - start_time, the central server needs the
    name of its indexed virtual column; `plus` hides a column from SQLite's planner.
    """
    params: Dict[str, Any] = {"tmin": TIME_MIN_S, "tmax": TIME_MAX_S, "maxdur": MAX_RECORD_S}
    filt = "".join(" AND " + c for c in _filters(q, params))
    checks = {
        "end_before_start": f"{span} < 0",
        "implausible_time": (f"end_time < :tmin AND NOT ({plus}{span} < 0)",
                             f"end_time >= :tmax AND NOT ({plus}{span} < 0)"),
        "too_long": f"{span} > :maxdur AND {plus}end_time >= :tmin AND {plus}end_time < :tmax",
    }
    out = {}
    for reason, conds in checks.items():
        n = sum(conn.execute(f"SELECT COUNT(*) FROM {table} WHERE {cond}{filt}", params).fetchone()[0]
                for cond in ((conds,) if isinstance(conds, str) else conds))
        if n:
            out[reason] = n
    return out


def skipped_records(src: SourceBase) -> Dict[str, int]:
    return src.skipped()


def _notes(src: Source, clamped_s: float) -> Tuple[str, ...]:
    """What the figures leave out or adjusted, for stderr (and the HTML page)."""
    notes = []
    skipped = skipped_records(src)
    if skipped:
        why = ", ".join(f"{n} {SKIP_REASONS[k]}" for k, n in skipped.items())
        notes.append(f"skipped {sum(skipped.values())} record(s) that cannot be placed in time ({why}); "
                     "`slurm-gpu report job JOBID` does not show them either: query job_gpus directly")
    if clamped_s > 0:
        notes.append(f"{format_gpu_time(clamped_s / 3600)} of GPU time carry a utilisation outside 0-100 % "
                     "(a driver or storage fault): counted as 0 % or 100 %")
    return tuple(notes)


def _overlap_sql(q: Query, bucketed: bool = False, src: Optional[SourceBase] = None) -> str:
    """Seconds of the record inside the window (and inside the calendar bucket when bucketed)."""
    least, greatest = (src.LEAST, src.GREATEST) if src is not None else ("MIN", "MAX")
    if bucketed:  # the calendar buckets are already clipped to the window
        return f"({least}(end_time, b_end) - {greatest}(start_time, b_start))"
    hi = f"{least}(end_time, :until)" if q.until_s is not None else "end_time"
    lo = f"{greatest}(start_time, :since)" if q.since_s is not None else "start_time"
    return f"({hi} - {lo})"


def _energy_sql(q: Query, t: str, bucketed: bool) -> str:
    if not bucketed and q.since_s is None and q.until_s is None:
        return "energy_j"
    return f"energy_j * {t} / (end_time - start_time)"


def _aggregates_sql(t: str, e: str) -> str:
    return f"""SUM({t}) AS alloc_s,
  SUM({t} * {UTIL}) AS util_pct_s,
  SUM(CASE WHEN gpu_util_mean_pct IS NOT NULL THEN {t} END) AS util_known_s,
  SUM({t} * {MEM_UTIL}) AS mem_pct_s,
  SUM(CASE WHEN mem_util_mean_pct IS NOT NULL THEN {t} END) AS mem_known_s,
  MAX(max_memory_bytes) AS peak_bytes,
  SUM({e}) AS energy_j,
  SUM(CASE WHEN {IDLE} THEN {t} END) AS idle_s,
  SUM(CASE WHEN {_OUT_OF_RANGE} THEN {t} END) AS clamped_s"""


HOURS_ND = 6  # GPU-hours and kWh in JSON/CSV: 6 decimals resolve 0.004 s and 0.004 J


def _r(v: Optional[float], nd: int = 3) -> Optional[float]:
    """Rounded; None for a missing or non-finite value (an overflowing sum): JSON never gets Infinity/NaN."""
    if v is None or not math.isfinite(v):
        return None
    return round(v, nd)


def _figures(row: Dict[str, Any]) -> Dict[str, Any]:
    """Turn raw sums (seconds, percent-seconds, joules, bytes) into report columns."""
    alloc = row["alloc_s"] or 0.0
    known = row["util_known_s"] or 0.0
    mem_known = row["mem_known_s"] or 0.0
    return {
        "gpu_hours_alloc": _r(alloc / 3600, HOURS_ND),
        "gpu_hours_used": _r((row["util_pct_s"] or 0.0) / 100 / 3600, HOURS_ND),
        "gpu_util_mean_pct": _r(row["util_pct_s"] / known, 2) if known > 0 and row["util_pct_s"] is not None else None,
        "mem_util_mean_pct": _r(row["mem_pct_s"] / mem_known, 2) if mem_known > 0 and row["mem_pct_s"] is not None else None,
        "peak_memory_gib": _r(row["peak_bytes"] / GIB) if row["peak_bytes"] is not None else None,
        "energy_kwh": _r(row["energy_j"] / 3.6e6, HOURS_ND) if row["energy_j"] is not None else None,
        "gpu_hours_idle": _r((row["idle_s"] or 0.0) / 3600, HOURS_ND),
        "gpu_hours_no_util": _r(max(alloc - known, 0.0) / 3600, HOURS_ND),
    }


def _dict_rows(cur: sqlite3.Cursor) -> Iterator[Dict[str, Any]]:
    names = [d[0] for d in cur.description]
    for tup in cur:
        yield dict(zip(names, tup))


# --------------------------------------------------------------------------- calendar


def _bucket_start(ts: float, unit: str, tz: str) -> datetime:
    d = in_zone(ts, tz)
    if unit == "month":
        return wall_time(d.year, d.month, 1, 0, 0, 0, tz)
    day = wall_time(d.year, d.month, d.day, 0, 0, 0, tz)
    if unit == "week":  # ISO weeks start on Monday
        monday = day.replace(tzinfo=None) - timedelta(days=d.weekday())
        return wall_time(monday.year, monday.month, monday.day, 0, 0, 0, tz)
    return day


def _next_bucket(d: datetime, unit: str, tz: str) -> datetime:
    if unit == "month":
        y, m = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
        return wall_time(y, m, 1, 0, 0, 0, tz)
    step = 7 if unit == "week" else 1
    n = d.replace(tzinfo=None) + timedelta(days=step)  # calendar days: DST-safe in local time
    return wall_time(n.year, n.month, n.day, 0, 0, 0, tz)


def _label(d: datetime, unit: str) -> str:
    if unit == "month":
        return d.strftime("%Y-%m")
    if unit == "week":
        iso = d.isocalendar()
        return f"{iso[0]:04d}-W{iso[1]:02d}"
    return d.strftime("%Y-%m-%d")


MAX_BUCKETS = 100_000


def calendar(lo_s: float, hi_s: float, unit: str, tz: str) -> List[Tuple[float, float, str]]:
    """Buckets (start_s, end_s, label) covering [lo_s, hi_s), the first and last clipped to it."""
    out: List[Tuple[float, float, str]] = []
    d = _bucket_start(lo_s, unit, tz)
    while d.timestamp() < hi_s:
        n = _next_bucket(d, unit, tz)
        out.append((max(d.timestamp(), lo_s), min(n.timestamp(), hi_s), _label(d, unit)))
        if len(out) > MAX_BUCKETS:
            raise InputError(f"the records span more than {MAX_BUCKETS} {unit}s", "narrow the window with --since/--until")
        d = n
    return out


def _calendar_for(src: Source, unit: str, where: str, params: Dict[str, Any]) -> List[Tuple[float, float, str]]:
    """Buckets for the window, or for the data's time range where the window is open."""
    q = src.query
    lo, hi = q.since_s, q.until_s
    if lo is None or hi is None:
        row = src.conn.execute(f"SELECT MIN(start_time), MAX(end_time) FROM {src.table} WHERE {where}", params).fetchone()
        if row[0] is None:
            return []
        lo = row[0] if lo is None else lo
        hi = row[1] if hi is None else hi
    return calendar(lo, hi, unit, q.tz)


_PART = "/*partition*/"


@dataclass(frozen=True)
class SummaryPlan:
    """The aggregation for `report --by`: SQL with parameters, plus the calendar it uses (if any)."""

    sql: str
    params: Dict[str, Any]
    buckets: Tuple[Tuple[float, float, str], ...] = ()
    time_key: Optional[str] = None  # the column holding a bucket index, turned into its label

    def partition(self, k: int, n: int) -> "SummaryPlan":
        """Only jobs with job_id % n == k: partitions hold disjoint jobs, so results add up exactly."""
        return SummaryPlan(self.sql.replace(_PART, f" AND job_id % {int(n)} = {int(k)}"), self.params, self.buckets,
                           self.time_key)

    def run(self, src: SourceBase, conn: Any) -> List[Dict[str, Any]]:
        if self.buckets:
            src.install_calendar(conn, self.buckets)
        rows = list(_dict_rows(conn.execute(self.sql.replace(_PART, ""), self.params)))
        if self.time_key:
            for row in rows:
                row[self.time_key] = self.buckets[row[self.time_key]][2]
        return rows


def _bucket_tree(col: str, buckets: Sequence[Tuple[float, float, str]], leaf: Callable[[int], str],
                 lo: int = 0, hi: Optional[int] = None) -> str:
    """A balanced CASE over the bucket starts: log2(buckets) comparisons per row instead of a join."""
    hi = len(buckets) if hi is None else hi
    if hi - lo == 1:
        return leaf(lo)
    mid = (lo + hi) // 2
    return (f"CASE WHEN {col} < {buckets[mid][0]!r} THEN {_bucket_tree(col, buckets, leaf, lo, mid)} "
            f"ELSE {_bucket_tree(col, buckets, leaf, mid, hi)} END")


def summary_plan(src: Source, by: Sequence[str]) -> Optional[SummaryPlan]:
    """`report --by ...` as one SELECT: used where the covering indexes do not apply (a v1 file,
    merged files, several plain keys, a filter on another column, a narrow --since), and what the
    benchmark runs in the sqlite3 shell.

    None when a calendar grouping finds no records at all.
    """
    q = src.query
    where, params = _where(q, use_index=src.use_end_index())
    where += _PART
    params["thr"] = q.idle_threshold_pct
    unit = next((k for k in by if k in TIME_KEYS), None)
    # The unary + keeps SQLite from walking a non-covering index to avoid a sort: a table lookup
    # per row costs more than sorting.  A covering index (schema v2) is walked: no sort at all.
    plus = "" if _covering_key(src, by) else src.PLUS
    group = ", ".join(f"{plus}\"{k}\"" for k in by)
    jobs = "COUNT(DISTINCT job_id)" if src.single_cluster() else "COUNT(DISTINCT cluster || '/' || job_id)"
    if unit is None:
        t = _overlap_sql(q, src=src)
        keys = ", ".join(f"{GROUP_KEYS[k]} AS \"{k}\"" for k in by)
        sql = (f"SELECT {keys},\n  {jobs} AS jobs,\n  {_aggregates_sql(t, _energy_sql(q, t, False))}\n"
               f"FROM {src.table}\nWHERE {where}\nGROUP BY {group}\nORDER BY {group}")
        return SummaryPlan(sql, params)
    buckets = _calendar_for(src, unit, where.replace(_PART, ""), params)
    if not buckets:
        return None
    maxlen = int(max(b - a for a, b, _ in buckets)) + 1
    bucket_of_start = _bucket_tree("start_time", buckets, str)
    end_of_start_bucket = _bucket_tree("start_time", buckets, lambda i: repr(buckets[i][1]))
    plain = [f"{GROUP_KEYS[k]} AS \"{k}\"" for k in by if k not in TIME_KEYS]
    # (cluster once: the server refuses a derived table with two columns of one name)
    cols = ", ".join(plain + (["cluster"] if "cluster" not in by else [])
                     + ["job_id", "gpu_util_mean_pct", "mem_util_mean_pct", "max_memory_bytes"])
    t_in = _overlap_sql(q, src=src)
    t_cut = _overlap_sql(q, bucketed=True, src=src)
    # Most records lie inside one bucket: their bucket comes from a CASE on start_time (the
    # calendar is clipped to the window, so t is the window overlap).  Only records crossing a
    # bucket boundary are joined with the calendar and cut into pieces.  CROSS JOIN keeps
    # job_gpus as the outer loop; the b_start range touches only the buckets a record overlaps.
    pieces = (
        f"SELECT {cols}, {bucket_of_start} AS \"{unit}\", {t_in} AS t, {_energy_sql(q, t_in, True)} AS e\n"
        f"  FROM {src.table} WHERE {where} AND end_time <= {end_of_start_bucket}\n"
        f"  UNION ALL\n"
        f"  SELECT {cols}, cal.idx, {t_cut}, {_energy_sql(q, t_cut, True)}\n"
        f"  FROM {src.table} CROSS JOIN cal ON b_start < end_time AND b_start > start_time - {maxlen} "
        f"AND b_end > start_time\n  WHERE {where} AND end_time > {end_of_start_bucket}"
    )
    keys = ", ".join(f"\"{k}\"" for k in by)
    sql = (f"SELECT {keys},\n  {jobs} AS jobs,\n  {_aggregates_sql('t', 'e')}\n"
           f"FROM (\n  {pieces}\n) AS pieces\nGROUP BY {group}\nORDER BY {group}")
    return SummaryPlan(sql, params, tuple(buckets), unit)


_SUM_FIELDS = ("jobs", "alloc_s", "util_pct_s", "util_known_s", "mem_pct_s", "mem_known_s", "energy_j", "idle_s",
               "clamped_s")
PARALLEL_MIN_ROWS = 200_000


def _add(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return b if a is None else a if b is None else a + b


def _merge_partials(parts: Sequence[List[Dict[str, Any]]], by: Sequence[str]) -> List[Dict[str, Any]]:
    merged: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for rows in parts:
        for row in rows:
            key = tuple(row[k] for k in by)
            have = merged.get(key)
            if have is None:
                merged[key] = dict(row)
                continue
            for f in _SUM_FIELDS:
                have[f] = _add(have[f], row[f])
            if row["peak_bytes"] is not None and (have["peak_bytes"] is None or row["peak_bytes"] > have["peak_bytes"]):
                have["peak_bytes"] = row["peak_bytes"]
    # SQLite's order: NULL first, then text in byte order (= code point order for UTF-8).
    return [merged[k] for k in sorted(merged, key=lambda key: tuple((v is not None, v) for v in key))]


def _partitions(src: Source) -> int:
    """How many threads to aggregate a single file with (1: no parallel pass)."""
    if not src.indexed or src.reading is None or not src.reading.stable:
        return 1  # the merged temp database lives in one connection; a live WAL file is read in one snapshot
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < 2:
        return 1
    rows = src.conn.execute(f"SELECT MAX(rowid) FROM {src.table}").fetchone()[0] or 0
    return 1 if rows < PARALLEL_MIN_ROWS else min(cpus, 8)


def _covering_key(src: Source, by: Sequence[str], with_time: bool = False) -> Optional[str]:
    """The column whose covering index (schema v2) can answer `--by`, or None.

    It applies to one plain key (plus, with `with_time`, one calendar key), when every filter
    is on that key or the cluster (another filter's column is not in the index) and no narrow
    --since makes the end_time index the better start.
    """
    plain = [k for k in by if k not in TIME_KEYS]
    col = GROUP_KEYS[plain[0]].strip('"') if len(plain) == 1 else ""
    if len(plain) != 1 or (len(by) > 1 and not with_time) or col not in src.covering:
        return None
    q = src.query
    for fcol, vals in (("user", q.users), ("account", q.accounts), ("partition", q.partitions), ("node", q.nodes)):
        if vals and fcol != col:  # cluster is in the index
            return None
    if q.job_id is not None or src.use_end_index():
        return None
    return col


MAX_INDEX_TASKS = 20_000  # (key, bucket) queries; beyond that the one-pass sort wins


def _index_tasks(src: Source, by: Sequence[str], col: str, unit: Optional[str]
                 ) -> Optional[Tuple[str, Dict[str, Any], List[Tuple[Any, Optional[int]]], Tuple[Tuple[float, float, str], ...]]]:
    """One aggregate query per group, each an index range: SQL, parameters, (key, bucket) tasks, calendar."""
    q = src.query
    where, params = _where(q, use_index=False)
    params["thr"] = q.idle_threshold_pct
    idx = f"job_gpus_by_{col}"
    keys = _index_keys(src, col, idx)
    jobs = "COUNT(DISTINCT job_id)" if src.single_cluster() else "COUNT(DISTINCT cluster || '/' || job_id)"
    if unit is None:
        t = _overlap_sql(q)
        sql = (f"SELECT {jobs} AS jobs,\n  {_aggregates_sql(t, _energy_sql(q, t, False))}\n"
               f"FROM {src.table} INDEXED BY {idx}\nWHERE {col} IS :key AND {where}")
        return sql, params, [(k, None) for k in keys], ()
    plan = _index_buckets(src, unit, len(keys))
    if plan is None:
        return None
    params["longest"], buckets = plan
    t = "(MIN(end_time, :b_end) - MAX(start_time, :b_start))"
    # Every record overlapping the bucket: start_time is a range in the index; the piece inside the
    # bucket is t (buckets are clipped to the window), energy prorated by the same fraction.
    sql = (f"SELECT {jobs} AS jobs,\n  {_aggregates_sql(t, f'energy_j * {t} / (end_time - start_time)')}\n"
           f"FROM {src.table} INDEXED BY {idx}\nWHERE {col} IS :key AND start_time >= :b_start - :longest "
           f"AND start_time < :b_end AND end_time > :b_start AND {where}")
    # Tasks in the order of the output rows: --by month,user sorts by month first.
    if by.index(unit) < by.index(next(k for k in by if k not in TIME_KEYS)):
        tasks = [(k, i) for i in range(len(buckets)) for k in keys]
    else:
        tasks = [(k, i) for k in keys for i in range(len(buckets))]
    return sql, params, tasks, tuple(buckets)


def _index_keys(src: Source, col: str, idx: str) -> List[Any]:
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


def _index_buckets(src: Source, unit: str, n_keys: int) -> Optional[Tuple[float, List[Tuple[float, float, str]]]]:
    """(longest record in seconds, calendar buckets) for one index query per key and bucket; None
    when the records' range is unknown or the one-pass plan is the better one."""
    q = src.query
    # Buckets over the window, or over a bound of the data's range found in O(log n): no record
    # ends before MIN(end_time) nor starts before that minus the longest record.  Buckets
    # without records give no rows.
    # (duration index, walked from the top past records too long to be counted)
    row = src.conn.execute(f"SELECT end_time - start_time FROM {src.table} WHERE end_time - start_time <= ? "
                           f"ORDER BY end_time - start_time DESC LIMIT 1", (MAX_RECORD_S,)).fetchone()
    longest = row[0] if row else None
    lo_end, hi_end = src.end_time_range()
    if longest is None or lo_end is None:
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


def _summary_by_index(src: Source, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
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
    results: List[Optional[Dict[str, Any]]] = [None] * len(tasks)

    def work(conn: sqlite3.Connection, mine: Iterator[int]) -> None:
        p = dict(params)
        for i in mine:
            k, b = tasks[i]
            p["key"] = k
            if b is not None:
                p["b_start"], p["b_end"] = buckets[b][0], buckets[b][1]
            cur = conn.execute(sql, p)
            got = cur.fetchone()
            results[i] = dict(zip([d[0] for d in cur.description], got))

    _spread_tasks(src, len(tasks), work)
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


def _spread_tasks(src: Source, n_tasks: int, work: Callable[[sqlite3.Connection, Iterator[int]], None]) -> None:
    """work(conn, task numbers) over tasks 0..n_tasks-1: on src's own connection, or shared out
    to threads that each take the next task on a connection of their own."""
    n = min(_partitions(src), max(n_tasks, 1))
    if n == 1:
        work(src.conn, iter(range(n_tasks)))
        return
    import threading
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()
    counter = iter(range(n_tasks))

    def shared() -> Iterator[int]:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            yield i

    def run(_: int) -> None:
        conn = src.connect_again()
        try:
            work(conn, shared())
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(run, range(n)))


def summary_raw(src: Source, by: Sequence[str]) -> List[Dict[str, Any]]:
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
    if n == 1:
        return plan.run(src, src.conn)
    from concurrent.futures import ThreadPoolExecutor

    def run(k: int) -> List[Dict[str, Any]]:
        conn = src.connect_again()
        try:
            return plan.partition(k, n).run(src, conn)
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=n) as pool:
        parts = list(pool.map(run, range(n)))
    return _merge_partials(parts, by)


def _run_partitioned(src: Source, sql: str, params: Dict[str, Any]) -> List[List[Dict[str, Any]]]:
    """Run a query holding the _PART marker once, or once per job_id partition on its own connection."""
    n = _partitions(src)
    if n == 1:
        return [list(_dict_rows(src.conn.execute(sql.replace(_PART, ""), params)))]
    from concurrent.futures import ThreadPoolExecutor

    def run(k: int) -> List[Dict[str, Any]]:
        conn = src.connect_again()
        try:
            return list(_dict_rows(conn.execute(sql.replace(_PART, f" AND job_id % {n} = {k}"), params)))
        finally:
            conn.close()

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n)))


def summary(src: Source, by: Sequence[str]) -> Table:
    rows: List[Dict[str, Any]] = []
    raws = summary_raw(src, by)
    for raw in raws:
        row = {k: raw[k] for k in by}
        row["jobs"] = raw["jobs"]
        row.update(_figures(raw))
        rows.append(row)
    headers = tuple(k.replace("-", " ") for k in by) + SUMMARY_HEADERS
    title = "GPU usage by " + ", ".join(by)
    total = _total(raws, by) if raws else None
    notes = _notes(src, sum(r.get("clamped_s") or 0.0 for r in raws))
    return Table(title, tuple(by) + SUMMARY_COLUMNS, headers, tuple(rows), tuple(by), "summary", total, notes)


def _total(raws: Sequence[Dict[str, Any]], by: Sequence[str]) -> Dict[str, Any]:
    """The TOTAL line: the same figures as a group's, from the groups' unrounded sums."""
    acc: Dict[str, Any] = {f: None for f in _SUM_FIELDS}
    acc["peak_bytes"] = None
    for raw in raws:
        for f in _SUM_FIELDS:
            acc[f] = _add(acc[f], raw.get(f))
        if raw["peak_bytes"] is not None and (acc["peak_bytes"] is None or raw["peak_bytes"] > acc["peak_bytes"]):
            acc["peak_bytes"] = raw["peak_bytes"]
    total: Dict[str, Any] = {k: None for k in by}
    total[by[0]] = "TOTAL"
    # A job appears in several groups when grouping by node, model or time: its count is not additive.
    total["jobs"] = acc["jobs"] if all(k in ("user", "account", "partition", "cluster") for k in by) else None
    total.update(_figures(acc))
    return total


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


def jobs(src: Source, sort: Optional[str] = None, limit: Optional[int] = None, idle_only: bool = False) -> Table:
    """One row per job run (cluster, job_id, restart) with its GPUs' figures; `idle_only`: jobs with an idle GPU."""
    q = src.query
    where, params = _where(q, use_index=src.use_end_index())
    params["thr"] = q.idle_threshold_pct
    t = _overlap_sql(q, src=src)
    e = _energy_sql(q, t, False)
    sort, descending = _job_sort(sort, idle_only)
    if limit is not None and limit < 1:
        raise InputError(f"--limit must be at least 1, got {limit}", "e.g. --limit 20")
    order = f"_sortkey {'DESC' if descending else 'ASC'}, cluster, job_id, restart_count"
    having = "HAVING idle_gpus > 0" if idle_only else ""
    per_job = (f'SELECT cluster, job_id, restart_count, MAX("user") AS "user", MAX(account) AS account,\n'
               f'  MAX("partition") AS "partition", MIN(start_time) AS start_s, MAX(end_time) AS end_s,\n'
               f"  COUNT(DISTINCT node) AS nodes, COUNT(*) AS gpus, MIN({UTIL}) AS util_min,\n"
               f"  SUM({IDLE}) AS idle_gpus,\n  {_aggregates_sql(t, e)}\n"
               f"FROM {src.table}\nWHERE {where}{_PART}\nGROUP BY cluster, job_id, restart_count\n{having}")
    sort_sql = _JOB_SORT_SQL.get(sort, f"\"{sort}\"")
    sql = f"SELECT per_job.*, {sort_sql} AS _sortkey FROM (\n{per_job}\n) AS per_job\nORDER BY {order}"
    if limit is not None:
        sql += f"\nLIMIT {int(limit)}"
    result = _merge_sorted(_run_partitioned(src, sql, params), descending, limit)
    rows = [_job_row(raw, q.tz) for raw in result]
    title = "Jobs that held GPUs idle" if idle_only else "GPU usage by job"
    notes = _notes(src, sum(r.get("clamped_s") or 0.0 for r in result))
    return Table(title, JOB_LIST_COLUMNS, JOB_LIST_HEADERS, tuple(rows), ("cluster", "job_id", "restart"), "jobs",
                 notes=notes)


def _merge_sorted(parts: List[List[Dict[str, Any]]], descending: bool, limit: Optional[int]) -> List[Dict[str, Any]]:
    """Partitions each sorted and limited on their own, merged as ORDER BY would (NULLs first
    ascending, last descending; ties by cluster, job id, restart)."""
    if len(parts) == 1:
        return parts[0]
    merged = sorted((r for part in parts for r in part), key=lambda r: (r["cluster"], r["job_id"], r["restart_count"]))
    merged.sort(key=lambda r: (r["_sortkey"] is not None, r["_sortkey"]), reverse=descending)
    return merged[:limit] if limit is not None else merged


def _job_row(raw: Dict[str, Any], tz: str) -> Dict[str, Any]:
    row = {
        "cluster": raw["cluster"], "job_id": raw["job_id"], "restart": raw["restart_count"],
        "user": raw["user"], "account": raw["account"], "partition": raw["partition"],
        "start": format_time(raw["start_s"], tz), "end": format_time(raw["end_s"], tz),
        "nodes": raw["nodes"], "gpus": raw["gpus"],
    }
    row.update(_figures(raw))
    row["gpu_util_min_pct"] = _r(raw["util_min"], 2)
    row["idle_gpus"] = raw["idle_gpus"] or 0
    return row


def job(src: Source) -> Table:
    """Every record of one job (all restarts, nodes and GPUs), unclipped by any window."""
    q = src.query
    if q.job_id is None:
        raise InputError("no job id given", "slurm-gpu report job JOBID")
    where, params = _where(q)
    params["thr"] = q.idle_threshold_pct
    sql = (f"SELECT *, {UTIL} AS util, {MEM_UTIL} AS mem_util, {IDLE} AS is_idle, "
           f"CASE WHEN {_OUT_OF_RANGE} THEN end_time - start_time END AS clamped_s "
           f"FROM {src.table} WHERE {where} ORDER BY cluster, restart_count, node, gpu_index, gpu_uuid")
    rows = []
    clamped_s = 0.0
    for raw in _dict_rows(src.conn.execute(sql, params)):
        dur = raw["end_time"] - raw["start_time"]
        clamped_s += raw["clamped_s"] or 0.0
        rows.append({
            "cluster": raw["cluster"], "job_id": raw["job_id"], "restart": raw["restart_count"], "node": raw["node"],
            "gpu_index": raw["gpu_index"], "gpu_uuid": raw["gpu_uuid"], "gpu_model": raw["gpu_model"],
            "user": raw["user"], "account": raw["account"], "partition": raw["partition"],
            "start": format_time(raw["start_time"], q.tz), "end": format_time(raw["end_time"], q.tz),
            "gpu_hours": _r(dur / 3600, HOURS_ND), "gpu_util_mean_pct": _r(raw["util"], 2),
            "mem_util_mean_pct": _r(raw["mem_util"], 2),
            "peak_memory_gib": _r(raw["max_memory_bytes"] / GIB) if raw["max_memory_bytes"] is not None else None,
            "energy_kwh": _r(raw["energy_j"] / 3.6e6, HOURS_ND) if raw["energy_j"] is not None else None,
            "idle": None if raw["is_idle"] is None else bool(raw["is_idle"]),
            "processes": raw["process_count"], "ecc_corrected": raw["ecc_corrected_delta"],
            "ecc_uncorrected": raw["ecc_uncorrected_delta"], "retired_pages": raw["retired_pages_delta"],
            "remapped_rows": raw["remapped_rows_delta"], "clock_event_reasons": raw["clock_event_reasons"],
            "xid_events": raw["xid_events"],
        })
    notes = _notes(src, clamped_s)
    if not rows:
        raise InputError(f"no GPU records for job {q.job_id} in {_describe_files(src.files)}"
                         + (f" ({'; '.join(notes)})" if notes else ""),
                         "check the job id, --cluster and --db (jobs without GPUs are not recorded)")
    return Table(f"Job {q.job_id}: GPUs", JOB_DETAIL_COLUMNS, JOB_DETAIL_HEADERS, tuple(rows),
                 ("cluster", "job_id", "restart", "node", "gpu_index"), "job", notes=notes)


def _describe_files(files: Sequence[str]) -> str:
    return files[0] if len(files) == 1 else f"{len(files)} databases"


# --------------------------------------------------------------------------- units for people

# Table, Markdown and HTML show figures in a unit that suits their size; JSON and CSV always
# carry GPU-hours and kWh (6 decimals).  Name, factor per GPU-hour / per kWh.
TIME_UNITS = (("GPU-h", 1.0), ("GPU-min", 60.0), ("GPU-s", 3600.0))
ENERGY_UNITS = (("kWh", 1.0), ("Wh", 1e3))
TIME_COLUMNS = ("gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle", "gpu_hours_no_util", "gpu_hours")


def pick_unit(largest: Optional[float], units: Sequence[Tuple[str, float]]) -> Tuple[str, float]:
    """The largest unit in which `largest` is at least 1 (the smallest unit for 0 or nothing)."""
    for name, per in units:
        if largest is not None and largest * per >= 1:
            return name, per
    return units[-1]


def format_duration(hours: Optional[float]) -> str:
    """GPU time as Slurm prints elapsed and CPU time: [D-]HH:MM:SS, to the second."""
    if hours is None:
        return "-"
    sec = int(round(hours * 3600))
    days, sec = divmod(sec, 86400)
    hh, sec = divmod(sec, 3600)
    mm, sec = divmod(sec, 60)
    return (f"{days}-" if days else "") + f"{hh:02d}:{mm:02d}:{sec:02d}"


def format_gpu_time(hours: float) -> str:
    name, per = pick_unit(hours, TIME_UNITS)
    return f"{hours * per:.2f} {name}"


def human_view(table: Table) -> Tuple[Tuple[str, ...], Dict[str, Callable[[Any], str]]]:
    """Headers and cell formats for the table, Markdown and HTML outputs.

    Summary: GPU time in GPU-h, GPU-min or GPU-s and energy in kWh or Wh, whichever keeps the
    largest figure of the table (TOTAL included) at 1 or more, 2 decimals.  jobs / job: GPU time
    of a job as [D-]HH:MM:SS (like sacct's CPUTime: exact to the second however short the job);
    energy as in the summary.
    """
    rows = list(table.rows) + ([table.total] if table.total else [])

    def largest(cols: Sequence[str]) -> Optional[float]:
        vals = [r.get(c) for r in rows for c in cols if isinstance(r.get(c), (int, float))]
        return max(vals) if vals else None

    formats: Dict[str, Callable[[Any], str]] = {}
    headers = list(table.headers)
    e_name, e_per = pick_unit(largest(["energy_kwh"]), ENERGY_UNITS)
    t_name, t_per = pick_unit(largest(TIME_COLUMNS), TIME_UNITS)
    for i, col in enumerate(table.columns):
        if col in TIME_COLUMNS:
            if table.kind == "summary":
                headers[i] = headers[i].replace("GPU-h", t_name)
                formats[col] = lambda v, per=t_per: "-" if v is None else f"{v * per:.2f}"
            else:
                headers[i] = headers[i].replace("GPU-h", "GPU time")
                formats[col] = format_duration
        elif col == "energy_kwh":
            headers[i] = headers[i].replace("kWh", e_name)
            formats[col] = lambda v, per=e_per: "-" if v is None else f"{v * per:.2f}"
    return tuple(headers), formats


# --------------------------------------------------------------------------- chart data (HTML)

UTIL_BINS = 10


def utilisation_histogram(src: Source) -> List[Tuple[str, float]]:
    """GPU-hours by per-GPU mean utilisation, in 10 % bins (plus 'n/a' for records without it)."""
    q = src.query
    where, params = _where(q, use_index=src.use_end_index())
    t = _overlap_sql(q, src=src)
    sql = (f"SELECT CASE WHEN gpu_util_mean_pct IS NULL THEN -1 "
           f"ELSE {src.LEAST}({src.floor(f'{UTIL} / 10')}, 9) END AS bin, SUM({t}) / 3600.0 "
           f"FROM {src.table} WHERE {where} GROUP BY bin ORDER BY bin")
    got = dict(src.conn.execute(sql, params).fetchall())
    out = [(f"{10 * i}-{10 * i + 10}%", _r(got.get(i, 0.0), HOURS_ND) or 0.0) for i in range(UTIL_BINS)]
    if got.get(-1):
        out.append(("n/a", _r(got[-1], HOURS_ND) or 0.0))
    return out


def energy_series(src: Source) -> Tuple[str, List[Tuple[str, Optional[float]]]]:
    """Energy (kWh) per day, week or month (whichever gives a readable number of points)."""
    q = src.query
    lo, hi = q.since_s, q.until_s
    if lo is None or hi is None:
        where, params = _where(q, use_index=src.use_end_index())
        row = src.conn.execute(f"SELECT MIN(start_time), MAX(end_time) FROM {src.table} WHERE {where}", params).fetchone()
        if row[0] is None:
            return "day", []
        lo = row[0] if lo is None else lo
        hi = row[1] if hi is None else hi
    span_days = (hi - lo) / 86400
    unit = "day" if span_days <= 120 else "week" if span_days <= 800 else "month"
    table = summary(src, (unit,))
    return unit, [(r[unit], r["energy_kwh"]) for r in table.rows]
