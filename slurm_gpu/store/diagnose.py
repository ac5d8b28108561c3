"""What is wrong with a node database, for `slurm-gpu db check`, `check` and the hooks' hints:
its path (owner, mode, symlinks), SQLite's integrity check, recent health events, and records
that only the fallback log kept (`db ingest --from-log`)."""
from __future__ import annotations

import errno
import os
import re
import sqlite3
import stat
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Tuple

from slurm_gpu.errors import StoreError
from slurm_gpu.store.schema import SCHEMA_VERSION
from slurm_gpu.store.spool import (
    open_dir,
    refuse_unsafe,
)


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
