"""What the admin commands ask of a node database (cli/db.py, `db push`; the hooks never come here):
its rows per table, the cluster of its latest job."""
from __future__ import annotations

import sqlite3
from typing import Dict


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
