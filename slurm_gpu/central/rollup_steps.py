"""The rollups' schema steps (central/rollups.py, docs/central.md "Rollups"): what each migration
that made or changed them does, as a callable that central/schema.py appends to MIGRATIONS.

- "rollups" (v4): rollup_days and the day tables, the push's procedures, the days of the chosen
  zone, then the rollups of the records already there;
- "job counts" (v6): the cells' job counts and peaks and the rows' kinds, from v5's rollups;
- "coarse rollups" (v8): rollup_days' months and weeks, the month, week and node tables;
- "partition rollups" (v10): rollup_partition_day.

Each builds in one serializable transaction that pushes wait for; the migration commits it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from slurm_gpu.central import rollup_push
from slurm_gpu.central.rollups import (
    COARSE_TABLES,
    DAYS_DDL,
    JOB_FIGURES_DDL,
    JOBS_KEYS,
    KINDS_DDL,
    SUM_TABLES,
    build,
    coarse_build,
    coarse_table_ddl,
    day_rows,
    job_counts,
    jobs_table_ddl,
    sum_table_ddl,
)
from slurm_gpu.config import IDLE_THRESHOLD_PCT

V8_COARSE = COARSE_TABLES[:4]  # what schema v8 made (v10: rollup_partition_day)

DAYS_MONTH_DDL = ("ALTER TABLE rollup_days ADD COLUMN IF NOT EXISTS month_day INT NOT NULL DEFAULT 0, "
                  "ADD COLUMN IF NOT EXISTS week_day INT NOT NULL DEFAULT 0, "
                  "ADD KEY IF NOT EXISTS rollup_days_month (month_day), ADD KEY IF NOT EXISTS rollup_days_week (week_day)")
# Each day's month by its label (days are numbered one per calendar day): the zone the days were
# cut in needs not be this host's.
# Day 0, 1990-01-01, was a Monday: ISO weeks begin on the days divisible by 7.
DAYS_MONTH_FILL = ("UPDATE rollup_days SET month_day = day - (CAST(SUBSTRING(label, 9, 2) AS UNSIGNED) - 1), "
                   "week_day = day - day MOD 7")


def _serializable(srv: Any) -> None:
    """End the transaction of the reads and DDL before (DDL commits anyway); begin the serializable one."""
    srv.commit()
    srv.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
    srv.execute("START TRANSACTION")


def fill_days(srv: Any, utc: bool, zone_name: str) -> None:
    srv.execute("DELETE FROM rollup_days")
    rows = day_rows(utc)
    for i in range(0, len(rows), 5000):
        srv.executemany("INSERT INTO rollup_days (day, label, d_start, d_end) VALUES (%s, %s, %s, %s)", rows[i:i + 5000])
    for name, value in (("rollup_zone", zone_name), ("rollup_idle_threshold_pct", repr(IDLE_THRESHOLD_PCT))):
        srv.execute("INSERT INTO meta (name, value) VALUES (%s, %s) ON DUPLICATE KEY UPDATE value = VALUES(value)",
                    (name, value))


def migration_step(utc: bool, zone_name: str, progress: Optional[Callable[[int, int], None]] = None,
                   apply_batch: Sequence[str] = ()) -> Callable[[Any], None]:
    """The schema step "rollups" as a callable of the migration: tables, days, procedures (and
    `apply_batch`, the DDL of the one that calls them), then the rollups of the records already
    there in one serializable transaction that pushes wait for; the caller commits it."""

    def step(srv: Any) -> None:
        for ddl in (DAYS_DDL, *(sum_table_ddl(t) for t in SUM_TABLES), jobs_table_ddl(), *rollup_push.procedures(),
                    *apply_batch):
            srv.execute(ddl)
        _serializable(srv)
        fill_days(srv, utc, zone_name)
        for t in ("rollup_day", "rollup_day_node", "rollup_jobs"):
            srv.execute(f"DELETE FROM {t}")
        build(srv, progress=progress, counts=False)  # the v6 step that follows counts the jobs
    return step


def job_counts_step(srv: Any) -> None:
    """The schema step "job counts" (v6) from v5's rollups: the cells' job counts and peaks and the
    rows' kinds as columns, the procedures that keep them, then their values from the rollup_jobs
    rows already there (themselves built from the records) in one serializable transaction."""
    for t in SUM_TABLES:
        srv.execute(f"ALTER TABLE {t} " + ", ".join(f"ADD COLUMN IF NOT EXISTS {c}" for c in JOB_FIGURES_DDL))
    srv.execute("ALTER TABLE rollup_jobs " + ", ".join(
        [f"ADD COLUMN IF NOT EXISTS {c}" for c in KINDS_DDL] + ["DROP INDEX IF EXISTS rollup_jobs_day"]
        + [f"ADD {k.replace('KEY ', 'KEY IF NOT EXISTS ', 1)}" for k in JOBS_KEYS]))
    for ddl in rollup_push.procedures():
        srv.execute(ddl)
    _serializable(srv)
    job_counts(srv)


def coarse_step(srv: Any, tables: Sequence[str] = V8_COARSE, months: bool = True) -> None:
    """The schema step "coarse rollups" (v8; v10 with rollup_partition_day): rollup_days' months
    (v8 only: `months`), the tables, the procedures that keep them, then their cells from the day
    tables already there, in one serializable transaction."""
    for ddl in ((DAYS_MONTH_DDL,) if months else ()) + tuple(coarse_table_ddl(t) for t in tables) \
            + tuple(rollup_push.procedures()):
        srv.execute(ddl)
    _serializable(srv)
    if months:
        srv.execute(DAYS_MONTH_FILL)
    for t in tables:
        srv.execute(f"DELETE FROM {t}")
    coarse_build(srv, tables=tables)


def partition_step(srv: Any) -> None:
    """The schema step "partition rollups" (v10): rollup_partition_day from rollup_day."""
    coarse_step(srv, ("rollup_partition_day",), months=False)
