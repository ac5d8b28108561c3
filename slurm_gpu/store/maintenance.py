"""What the admin commands ask of a node database (cli/db.py, `db push`; the hooks never come here):
the store a command names, its rows per table, the cluster of its latest job."""
from __future__ import annotations

import sqlite3
from typing import Dict, Optional

from slurm_gpu.config import Config
from slurm_gpu.store.node import Store


def node_store(cfg: Config, database: Optional[str] = None, spool: Optional[str] = None) -> Store:
    """The node database and spool a command names (--db, --spool), else the config's."""
    return Store(database or cfg.path_value("store", "database"), spool or cfg.path_value("store", "spool_dir"),
                 cfg.store.busy_timeout_s)


def table_counts(path: str) -> Dict[str, int]:
    """Rows per table, read-only: {table: rows}, in the schema's order (`db check`)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                  if not t.startswith("sqlite_")]
        return {t: conn.execute('SELECT COUNT(*) FROM "%s"' % t.replace('"', '""')).fetchone()[0] for t in tables}
    finally:
        conn.close()


def latest_job_cluster(conn: sqlite3.Connection) -> str:
    """The cluster of the job that ended last, '' when no job row names one."""
    row = conn.execute("SELECT cluster FROM jobs ORDER BY end_time DESC LIMIT 1").fetchone()
    return row[0] if row and row[0] else ""
