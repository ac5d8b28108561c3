"""What a report reads: one interface (ReportSource), implemented by the node files (FileSource,
here) and by the central server (report/central.py).

A source gives the planner (report/plan.py) a connection onto one consistent state of the
records, the table that holds them, the SQL spellings of its engine, and answers for itself
what the planner may use: covering indexes, the end_time index, more connections onto the very
same data for threads.

Node databases are opened read-only (store/liveread.py): a report never writes one, and every
report describes one committed state however hooks write meanwhile (read_consistently).
"""
from __future__ import annotations

import abc
import glob
import os
import sqlite3
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Self, Sequence, Tuple

from slurm_gpu.errors import InputError, StoreError
from slurm_gpu.report import sql as S
from slurm_gpu.report.query import Query
from slurm_gpu.store import schema
from slurm_gpu.store.liveread import CORRUPT_HINT, READ_ATTEMPTS, FileRead, SourceChanged, check_database, connect, reread

Buckets = Sequence[Tuple[float, float, str]]


class ReportSource(abc.ABC):
    """What every report reads through: ``conn`` (execute -> cursor), ``table`` (job_gpus rows),
    ``query``, ``files`` (what was read, in words: paths or the server), and the SQL spellings
    that differ between SQLite and the central server."""

    table = "job_gpus"
    files: List[str] = []
    query: Query
    conn: Any
    LEAST, GREATEST = "MIN", "MAX"  # two-argument min/max
    PLUS = "+"  # a unary plus that hides a column from SQLite's planner (nothing elsewhere)
    SPAN = "end_time - start_time"  # the record's duration as the source's index knows it
    plan = ""  # which plan the last summary ran (`report --explain`)
    replica_note: Optional[str] = None  # the central server is a replica: how old its newest push is

    @abc.abstractmethod
    def covering_keys(self) -> FrozenSet[str]:
        """The columns whose covering index (schema v2) answers `--by COLUMN` alone."""

    @abc.abstractmethod
    def use_end_index(self) -> bool:
        """Whether the planner should walk the end_time index for --since (a narrow window)."""

    @abc.abstractmethod
    def parallel_connect(self) -> Optional[Callable[[], Any]]:
        """Opens more connections onto the very same data, for threads; None: read everything on ``conn``."""

    @abc.abstractmethod
    def unchanged(self) -> bool:
        """After the read: true when no writer can have changed what was read."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the read (and the source's snapshot)."""

    def floor(self, expr: str) -> str:
        return f"CAST({expr} AS INTEGER)"  # values here are >= 0: truncation is the floor

    def skipped(self) -> Dict[str, int]:
        """Records that cannot be placed in time, by reason (Table.notes)."""
        return S.count_skipped(self.conn, self.table, self.query, self.SPAN, self.PLUS)

    def summary_rows(self, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
        """A source's own plan for the summary's raw sums (the central server's rollups); None: none."""
        return None

    def has_actions(self) -> bool:
        """Does the source hold the idle policy's actions (node schema v11, central v12)?"""
        return False

    def idle_actions(self, keys: Sequence[Tuple[str, int, int]]) -> Dict[Tuple[str, int, int], str]:
        """What the idle policy did to these job runs (docs/efficiency.md), as 'notify sent, cancel done'."""
        if not keys or not self.has_actions():
            return {}
        wanted = set(keys)
        ids = sorted({k[1] for k in wanted})
        out: Dict[Tuple[str, int, int], Dict[str, str]] = {}  # by stage: a copy of a node file counts once
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            rows = self.conn.execute(
                "SELECT cluster, job_id, restart_count, stage, mail_state, cancel_state FROM efficiency_actions "
                f"WHERE job_id IN ({', '.join('?' * len(part))}) ORDER BY time", part).fetchall()
            for cluster, job_id, restart, stage, mail, cancel in rows:
                key = (str(cluster), int(job_id), int(restart))
                if key in wanted:
                    out.setdefault(key, {})[str(stage)] = (f"{stage} {cancel or 'pending'}" if stage == "cancel"
                                                           else f"{stage} {mail or 'pending'}")
        return {k: ", ".join(v.values()) for k, v in out.items()}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    def single_cluster(self) -> bool:
        # Both ends of the primary-key index: O(log n), no scan.
        lo = self.conn.execute(f"SELECT cluster FROM {self.table} ORDER BY cluster LIMIT 1").fetchone()
        hi = self.conn.execute(f"SELECT cluster FROM {self.table} ORDER BY cluster DESC LIMIT 1").fetchone()
        return bool(lo == hi)

    def end_time_range(self) -> Tuple[Optional[float], Optional[float]]:
        """The earliest and latest plausible end times (end_time index: O(log n))."""
        lo = self.conn.execute(f"SELECT end_time FROM {self.table} WHERE end_time >= ? ORDER BY end_time LIMIT 1",
                               (S.TIME_MIN_S,)).fetchone()
        hi = self.conn.execute(f"SELECT end_time FROM {self.table} WHERE end_time < ? ORDER BY end_time DESC LIMIT 1",
                               (S.TIME_MAX_S,)).fetchone()
        return (lo[0] if lo else None), (hi[0] if hi else None)

    def install_calendar(self, conn: Any, buckets: Buckets) -> None:
        conn.execute("DROP TABLE IF EXISTS temp.cal")
        conn.execute("CREATE TEMP TABLE cal (idx INTEGER NOT NULL, b_start REAL NOT NULL, b_end REAL NOT NULL, "
                     "label TEXT NOT NULL)")
        conn.executemany("INSERT INTO temp.cal VALUES (?, ?, ?, ?)", [(i,) + tuple(b) for i, b in enumerate(buckets)])
        conn.execute("CREATE INDEX temp.cal_start ON cal (b_start)")


def resolve_paths(paths: Sequence[str]) -> List[str]:
    """Files as given; directories expand to their ``*.db`` files.  Sorted, duplicates removed.

    (Here, not in cli/: FileSource and read_consistently resolve the paths they are given.)
    """
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


def describe_files(files: Sequence[str]) -> str:
    return files[0] if len(files) == 1 else f"{len(files)} databases"


_ACTION_COPY = ("time", "cluster", "job_id", "restart_count", "stage", "mail_state", "cancel_state")


class FileSource(ReportSource):
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
            self.reading = FileRead(self.files[0], live)
            self.conn = self._open_one(self.reading)
            self.indexed = True
        else:
            # The merged temp database has no covering index: building one is a sort of every row,
            # which is what the plain GROUP BY does anyway.
            self.conn = self._merge(self.files, query, live)
            self.indexed = False
            self._covering: FrozenSet[str] = frozenset()
        self.table = "main.job_gpus"

    def _open_one(self, reading: FileRead) -> sqlite3.Connection:
        path = reading.path
        try:
            self.conn = conn = connect(reading.uri, path)
            # One read transaction for every query of the report: one snapshot of a live database.
            self.conn.execute("BEGIN")
            check_database(self.conn, reading)
            names = {r[0] for r in self.conn.execute(
                "SELECT name FROM main.sqlite_master WHERE type='index' AND tbl_name='job_gpus'")}
        except BaseException:
            self.close()
            raise
        # Schema v2's covering indexes (a v1 file read as is has none: the report never migrates).
        self._covering = frozenset(c for c in schema.REPORT_INDEX_KEYS if f"job_gpus_by_{c}" in names) \
            if "job_gpus_duration" in names else frozenset()
        return conn

    def _merge(self, files: Sequence[str], query: Query, live: bool) -> sqlite3.Connection:
        # "" = an anonymous on-disk temporary database: pages beyond the cache spill to a temp file,
        # so memory stays flat however many rows are merged.
        conn = sqlite3.connect("", uri=True, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        ddl = next(s for s in schema.MIGRATIONS[0] if "TABLE IF NOT EXISTS job_gpus" in s)
        conn.execute(ddl)
        conn.execute(f"CREATE TABLE efficiency_actions ({', '.join(_ACTION_COPY)})")
        try:
            for path in files:
                self._merge_file(conn, path, query, live)
        except BaseException:
            conn.close()
            raise
        return conn

    def _merge_file(self, conn: sqlite3.Connection, path: str, query: Query, live: bool) -> None:
        def once(again: bool) -> None:
            self._merge_one(conn, path, query, live or again)

        def kept_changing() -> StoreError:
            return StoreError(f"{path}: the database kept changing while it was read ({READ_ATTEMPTS} attempts)",
                              "run the report again, or report from a copy made with `slurm-gpu db backup`")

        reread(once, kept_changing)

    def _merge_one(self, conn: sqlite3.Connection, path: str, query: Query, live: bool) -> None:
        """Copy the file's matching rows into conn (SourceChanged: a writer came; read it again)."""
        cols = ", ".join(schema.JOB_GPU_COLUMNS)
        where, params = S.where(query, use_index=True)
        reading = FileRead(path, live)
        try:
            try:
                conn.execute("ATTACH DATABASE ? AS src", (reading.uri,))
            except sqlite3.Error as e:
                raise StoreError(f"{path}: cannot open database ({e})", "check the file and its directory permissions") from None
            try:
                conn.execute("BEGIN")  # one snapshot of the file for the copy and the counts
                check_database(conn, reading, "src")
                conn.execute(f"INSERT OR IGNORE INTO main.job_gpus ({cols}) SELECT {cols} FROM src.job_gpus "
                             f"WHERE {where}", params)
                skipped = S.count_skipped(conn, "src.job_gpus", query)
                if conn.execute("SELECT 1 FROM src.sqlite_master WHERE type = 'table' AND name = 'efficiency_actions'"
                                ).fetchone():  # node schema v11: what the idle policy did (report jobs --idle)
                    cols = ", ".join(_ACTION_COPY)
                    conn.execute(f"INSERT INTO main.efficiency_actions ({cols}) SELECT {cols} FROM src.efficiency_actions")
                if not reading.unchanged():
                    raise SourceChanged(path)
                conn.execute("COMMIT")
                for k, v in skipped.items():
                    self.merge_skipped[k] = self.merge_skipped.get(k, 0) + v
            except sqlite3.DatabaseError as e:
                if reading.unchanged():
                    raise StoreError(f"{path}: cannot read job_gpus ({e})", CORRUPT_HINT) from None
                raise SourceChanged(path) from None  # a checkpoint rewrote pages under the immutable read
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.execute("DETACH DATABASE src")
        finally:
            reading.release()

    def covering_keys(self) -> FrozenSet[str]:
        return self._covering

    def has_actions(self) -> bool:
        return bool(self.conn.execute("SELECT 1 FROM main.sqlite_master WHERE type = 'table' "
                                      "AND name = 'efficiency_actions'").fetchone())

    def connect_again(self) -> sqlite3.Connection:
        """Another connection to the single file, for a thread (only where the file cannot change)."""
        assert self.reading is not None and self.reading.stable
        return connect(self.reading.uri, self.reading.path)

    def parallel_connect(self) -> Optional[Callable[[], sqlite3.Connection]]:
        # The merged temp database lives in one connection; a live WAL file is read in one snapshot.
        if not self.indexed or self.reading is None or not self.reading.stable:
            return None
        return self.connect_again

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


def open_sources(paths: Sequence[str], query: Query, live: bool = False) -> FileSource:
    return FileSource(paths, query, live)


def read_consistently(paths: Sequence[str], query: Query, fn: Callable[[FileSource], Any]) -> Any:
    """fn(source), from data that no writer changed while fn read it.

    A file read as immutable that got a writer meanwhile is read again (twice the same way,
    then through SQLite's WAL protocol).  A database damaged in the middle is a StoreError
    naming the file, not a traceback.
    """
    def once(live: bool) -> Any:
        with open_sources(paths, query, live=live) as src:
            try:
                result = fn(src)
            except sqlite3.DatabaseError as e:
                if not src.unchanged():
                    raise SourceChanged() from None  # a checkpoint rewrote pages under the immutable read: not damage
                raise StoreError(f"{describe_files(src.files)}: cannot read job_gpus ({e})", CORRUPT_HINT) from None
            if not src.unchanged():
                raise SourceChanged()
            return result

    return reread(once, lambda: StoreError(
        f"{describe_files(resolve_paths(paths))}: the database kept changing while it was read ({READ_ATTEMPTS} attempts)",
        "run the report again, or report from a copy made with `slurm-gpu db backup`"))
