"""`slurm-gpu db backup`: a consistent, self-contained copy of a node database (SQLite's backup API,
read as a report reads: store/liveread.py)."""
from __future__ import annotations

import os
import sqlite3

from slurm_gpu.errors import InputError, StoreError
from slurm_gpu.store.liveread import CORRUPT_HINT, READ_ATTEMPTS, FileRead, SourceChanged, check_database, connect, reread


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
    def once(live: bool) -> int:
        reading = FileRead(src_path, live=live)
        try:
            n = _backup_once(src_path, reading, tmp)
            if not reading.unchanged():
                raise SourceChanged(src_path)
            return n
        except SourceChanged:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            reading.release()

    return reread(once, lambda: StoreError(
        f"{src_path}: the database kept changing while it was copied ({READ_ATTEMPTS} attempts)", "run the backup again"))


def _backup_once(src_path: str, reading: FileRead, tmp: str) -> int:
    """One read of src_path copied into tmp: the job_gpus rows copied; SourceChanged when a writer changed it meanwhile."""
    src = connect(reading.uri, src_path)
    try:
        check_database(src, reading)
        old = os.umask(0o027)  # like the node database: no write for group, nothing for others
        try:
            dst = sqlite3.connect(tmp, isolation_level=None)
        finally:
            os.umask(old)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
            n: int = dst.execute("SELECT COUNT(*) FROM job_gpus").fetchone()[0]
            return n
        finally:
            dst.close()
    except sqlite3.DatabaseError as e:
        if reading.unchanged():
            raise StoreError(f"{src_path}: cannot copy ({e})", CORRUPT_HINT) from None
        raise SourceChanged(src_path) from None
    finally:
        src.close()
