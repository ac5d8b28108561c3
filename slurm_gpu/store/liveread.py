"""Reading a live SQLite node database consistently, read-only (reports, `db backup`).

A hook may write the database while it is read.  FileRead says how one file is opened (a
`mode=ro` URI; `immutable=1` under a read lock that keeps checkpoints out where the file has no
-wal beside it) and afterwards whether a writer can have changed what was read; `reread`
repeats a read until it describes one committed state: twice the same way, then through
SQLite's WAL protocol.
"""
from __future__ import annotations

import os
import sqlite3
import time
from typing import Callable, Optional, TypeVar
from urllib.parse import quote

from slurm_gpu.errors import StoreError
from slurm_gpu.store import schema

T = TypeVar("T")

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



READ_ATTEMPTS = 4
CORRUPT_HINT = ("the file is damaged: `slurm-gpu db check --database FILE` shows where; `sqlite3 FILE .recover` "
                "salvages the readable records into a new database")


def reread(read: Callable[[bool], T], kept_changing: Callable[[], StoreError]) -> T:
    """read(live) again while it raises SourceChanged (a writer came during the read): twice the
    same way, then with live=True (SQLite's WAL protocol); then the error kept_changing() makes."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return read(attempt >= 2)
        except SourceChanged:
            continue
    raise kept_changing()


def readonly_uri(path: str) -> str:
    """The URI a report opens `path` with when it is read now (for tools such as the benchmark)."""
    reading = FileRead(path)
    reading.release()
    return reading.uri


def check_database(conn: sqlite3.Connection, reading: FileRead, prefix: str = "main") -> None:
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


def connect(uri: str, path: str) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot open database ({e})", "check the file and its directory permissions") from None
    return conn
