"""The central server's schema: its tables and columns, their DDL, the staged push's apply_batch
procedure and the versioned migrations that `central init` runs (central/server.py Central.migrate).

- The schema is versioned like the node schema (table `meta`, name 'schema_version').
  Records are keyed as on the nodes; a node never deletes here: a row it deleted after
  shipping is marked `withdrawn`, and reports read the view `job_gpus_current`.
- Schema v2 adds `gpu_inventory` (one row per GPU per observation) and `xid_events`, which
  `slurm-gpu fleet` reads (docs/fleet.md).
- Schema v3: jobs and job_gpus rows carry the node's row version (its push_version), and
  apply_batch keeps the server's row when it is complete and the staged one partial, or when
  both are alike and the server's is newer: a node restored from an old backup cannot undo a
  newer or more complete record.
- Schema v4 adds the report's per-day sums ("rollups"), kept by apply_batch in the same
  transaction (central/rollups.py).
- Schema v5: one writer account per node or node group (table `writer_nodes`); apply_batch first
  calls check_batch_owner, which refuses a batch with a row of another node or cluster
  (central/writers.py).
- Schema v6: job counts and peaks in the rollups' cells, so that a report's job counts do not
  grow with jobs (central/rollups.py), built from the rollups already there.
- Schema v7 adds `remediations` (every node's remediation attempts, keyed by the node's row id,
  with its row version: the newer wins) and `remediation_history(serial)`, the one read a writer
  may make: a GPU's attempts on every node (`slurm-gpu remediate`'s lemon budget, docs/remediation.md).
- Schema v8: coarse rollups (per month, and per node without the user, account and partition),
  so that a year's report reads months x groups, not days x groups x nodes (central/rollups.py).
- Schema v9: the push's rollups in fixed join orders, cut into days once (rollups_before only).
- Schema v10: rollup_partition_day, per partition and GPU model without user and account, so that
  a year's report by those reads days x partitions x models (central/rollups.py).
- Schema v11: each run's SLUID in jobs and job_gpus (Slurm 25.11+; node schema v10).
- Schema v12: running jobs' GPU samples and the idle policy's actions (docs/efficiency.md; node schema
  v11).  A coarse sample row replaces the fine rows of its 10 minutes, as on the node; apply_batch keeps
  a node's samples for SAMPLES_KEPT_S.  An XID row carries its line count and last line's time: a flood
  of identical lines is one row, updated as it grows (node schema v11).
- Schema v13: `push_clock`, the server's time of each node's newest applied batch (apply_batch
  writes the batch's nodes' rows): a report from a replica says how old its newest push is, and an
  admin sees which node has not pushed for how long (docs/central.md, "Topologies").
- Schema v14: fences in every staging table (stage_fences_step), so that a batch's locks there stay
  between two fences and concurrent pushes no longer wait on each other's staged rows.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, List, Sequence, Tuple, Union

from slurm_gpu.central import rollup_push, rollup_steps
from slurm_gpu.central import writers as W

if TYPE_CHECKING:
    from slurm_gpu.central.server import Central

SCHEMA_VERSION = 14
# Samples of running jobs are for the policy's window and `slurm-gpu job` on a running job: a week is kept.
SAMPLES_KEPT_S = 7 * 86400
SAMPLE_BUCKET_S = 600  # a coarse sample row's 10 minutes (store/samples.py COARSE_STEP_S)

# --------------------------------------------------------------------------- schema
#
# The writer may neither read nor delete records, and MariaDB checks SELECT for every column
# an `INSERT ... ON DUPLICATE KEY UPDATE` touches.  So the nodes INSERT into per-push staging
# tables (stage_*: no SELECT, no UPDATE, no DELETE) and CALL apply_batch(batch), a
# SQL SECURITY DEFINER procedure created by `central init`, which upserts the batch into the
# record tables and removes it from staging, in the writer's transaction.

_NAME = "VARCHAR(255)"
_TAIL = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"

# Columns of the central server's tables (CENTRAL_*: the server's own, apart from the node's in
# store/record.py; named as on the node, the key columns first).
CENTRAL_JOB_COLUMNS = ("cluster", "job_id", "restart_count", "node", "user", "uid", "account", "partition", "gpu_count",
               "start_time", "end_time", "exit_code", "partial", "sluid")
CENTRAL_JOB_GPU_COLUMNS = ("cluster", "job_id", "restart_count", "node", "gpu_uuid", "gpu_index", "gpu_model", "user",
                   "account", "partition", "start_time", "end_time", "duration_s", "energy_j", "gpu_util_mean_pct",
                   "mem_util_mean_pct", "max_memory_bytes", "process_count", "ecc_corrected_delta",
                   "ecc_uncorrected_delta", "retired_pages_delta", "remapped_rows_delta", "clock_event_reasons",
                   "xid_events", "parent_gpu_uuid", "notes", "partial", "memory_total_bytes", "sluid")
CENTRAL_EVENT_COLUMNS = ("cluster", "node", "event_key", "time", "source", "job_id", "gpu_index", "gpu_uuid", "check_name",
                 "status", "message")
CENTRAL_DRAIN_COLUMNS = ("cluster", "node", "drain_key", "time", "source", "job_id", "restart_count", "reason", "ok",
                 "outcome", "kept_reason")
# Schema v2 (`slurm-gpu fleet`, docs/fleet.md): one row per GPU per observation, and the XIDs the
# node's healthcheck read.  Counters are the driver's; NULL means unsupported or unknown, never 0.
INVENTORY_COUNTERS = ("ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
                      "ecc_uncorrected_aggregate", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending",
                      "remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failure",
                      "remap_hist_max", "remap_hist_high", "remap_hist_partial", "remap_hist_low", "remap_hist_none",
                      "sram_corrected", "sram_uncorrected")
CENTRAL_INVENTORY_COLUMNS = ("cluster", "node", "gpu_uuid", "time", "gpu_index", "serial", "model", "vbios",
                     "driver_version", "cuda_version", "mig_mode", *INVENTORY_COUNTERS)
# Schema v12 (issue 39): a flood of identical lines is one row with its line count and last line's time.
CENTRAL_XID_COLUMNS = ("cluster", "node", "event_key", "time", "gpu_index", "gpu_uuid", "pci_bus_id", "xid", "detail",
                       "line_count", "last_time")
# Schema v7 (docs/remediation.md): the nodes' remediation attempts, keyed by the node's own row id and
# the attempt's time (a reimaged node's new database starts its ids at 1 again; time never changes);
# row_version is the node's push_version of the row (an attempt's outcome comes after its intent).
CENTRAL_REMEDIATION_COLUMNS = ("cluster", "node", "id", "time", "gpu_index", "gpu_uuid", "serial", "fault_check", "fault",
                               "action", "outcome", "detail", "drain_time", "finished", "row_version")
# Schema v12 (docs/efficiency.md): running jobs' GPU samples keyed as on the node (a coarse row beside the
# fine rows it replaces: the coarse flag is part of the key), and the idle policy's actions keyed by the
# deciding host's row id and time, with its row version (a mail's outcome comes after the decision).
CENTRAL_SAMPLE_COLUMNS = ("cluster", "node", "job_id", "restart_count", "gpu_uuid", "time", "coarse", "gpu_index", "span_s",
                          "samples", "gpu_util_pct", "gpu_util_max_pct", "memory_used_bytes", "memory_total_bytes",
                          "energy_j")
CENTRAL_ACTION_COLUMNS = ("cluster", "node", "id", "time", "job_id", "restart_count", "user", "account", "partition",
                          "stage", "idle_since", "idle_s", "gpus", "idle_gpus", "evidence", "mail_to", "mail_state",
                          "mail_tries", "mail_time", "mail_error", "cancel_state", "cancel_error", "row_version")
V1_TABLES = ("jobs", "job_gpus", "health_events", "drains")
V2_TABLES = V1_TABLES + ("gpu_inventory", "xid_events")  # the record tables of schema v2 to v6
COLUMNS = {"jobs": CENTRAL_JOB_COLUMNS, "job_gpus": CENTRAL_JOB_GPU_COLUMNS, "health_events": CENTRAL_EVENT_COLUMNS,
           "drains": CENTRAL_DRAIN_COLUMNS, "gpu_inventory": CENTRAL_INVENTORY_COLUMNS, "xid_events": CENTRAL_XID_COLUMNS,
           "remediations": CENTRAL_REMEDIATION_COLUMNS, "job_samples": CENTRAL_SAMPLE_COLUMNS,
           "efficiency_actions": CENTRAL_ACTION_COLUMNS}
# leading key columns of each list
KEYS = {"jobs": 4, "job_gpus": 5, "health_events": 3, "drains": 3, "gpu_inventory": 4, "xid_events": 3,
        "remediations": 4, "job_samples": 7, "efficiency_actions": 4}
RECORD_TABLES = tuple(COLUMNS)
V7_TABLES = V2_TABLES + ("remediations",)  # the record tables of schema v7 to v11 (their migrations' text)
SHIPPED = ("withdrawn", "shipped_at")  # set by push, not by the node's row
# v3: rows that change on the node carry its version of them (push_version).
VERSIONED = ("jobs", "job_gpus")


def staged_columns(table: str) -> Tuple[str, ...]:
    """The node's columns of a table as staged and kept (v3: with the row version)."""
    return COLUMNS[table] + (("row_version",) if table in VERSIONED else ())

_TYPES = {
    "cluster": "VARCHAR(64)", "job_id": "BIGINT", "restart_count": "INT", "node": "VARCHAR(255)", "user": _NAME,
    "uid": "BIGINT", "account": _NAME, "partition": _NAME,
    "gpu_count": "INT NOT NULL DEFAULT 0", "start_time": "DOUBLE", "end_time": "DOUBLE", "exit_code": "VARCHAR(64)",
    "partial": "TINYINT NOT NULL DEFAULT 0", "gpu_uuid": "VARCHAR(128)", "gpu_index": "INT",
    "gpu_model": _NAME, "duration_s": "DOUBLE NOT NULL", "energy_j": "DOUBLE", "gpu_util_mean_pct": "DOUBLE",
    "mem_util_mean_pct": "DOUBLE", "max_memory_bytes": "BIGINT", "memory_total_bytes": "BIGINT", "process_count": "INT",
    "ecc_corrected_delta": "BIGINT", "ecc_uncorrected_delta": "BIGINT", "retired_pages_delta": "BIGINT",
    "remapped_rows_delta": "BIGINT", "clock_event_reasons": "BIGINT", "xid_events": "MEDIUMTEXT",
    "parent_gpu_uuid": "VARCHAR(128)", "notes": "TEXT", "event_key": "CHAR(64)", "drain_key": "CHAR(64)",
    "time": "DOUBLE NOT NULL", "source": "VARCHAR(64) NOT NULL", "check_name": "VARCHAR(128) NOT NULL",
    "status": "VARCHAR(16) NOT NULL", "message": "TEXT NOT NULL", "reason": "TEXT NOT NULL", "ok": "TINYINT NOT NULL",
    "outcome": "VARCHAR(16)", "kept_reason": "TEXT", "withdrawn": "TINYINT NOT NULL DEFAULT 0",
    "shipped_at": "DOUBLE NOT NULL", "serial": "VARCHAR(64)", "model": _NAME, "vbios": "VARCHAR(64)",
    "driver_version": "VARCHAR(64)", "cuda_version": "VARCHAR(32)", "mig_mode": "INT", "pci_bus_id": "VARCHAR(32)",
    "xid": "INT NOT NULL", "detail": "TEXT", "row_version": "BIGINT NOT NULL DEFAULT 0",
    "id": "BIGINT", "fault_check": "VARCHAR(128)", "fault": "TEXT", "action": "VARCHAR(16) NOT NULL",
    "drain_time": "DOUBLE", "finished": "DOUBLE", "sluid": "VARCHAR(32)",
    "coarse": "TINYINT NOT NULL", "span_s": "DOUBLE NOT NULL", "samples": "INT", "gpu_util_pct": "DOUBLE",
    "gpu_util_max_pct": "DOUBLE", "memory_used_bytes": "BIGINT", "stage": "VARCHAR(16) NOT NULL",
    "idle_since": "DOUBLE", "idle_s": "DOUBLE", "gpus": "INT", "idle_gpus": "INT", "evidence": "MEDIUMTEXT",
    "mail_to": _NAME, "mail_state": "VARCHAR(16)", "mail_tries": "INT", "mail_time": "DOUBLE", "mail_error": "TEXT",
    "cancel_state": "VARCHAR(16)", "cancel_error": "TEXT", "line_count": "BIGINT NOT NULL DEFAULT 1",
    "last_time": "DOUBLE",
    **{c: "BIGINT" for c in INVENTORY_COUNTERS},
}
# Besides the key columns: a record's times may be unknown only in jobs; in job_gpus they are the record.
_NOT_NULL_IN = {"job_gpus": ("start_time", "end_time")}

# Group keys of `report --by` with a covering index (as on the nodes: slurm_gpu/groupkeys.py), as
# v1 made them: a migration's text never changes (a key indexed later gets a migration of its own).
_V1_INDEX_KEYS = ("user", "account", "partition", "node", "gpu_model")
_COVERED = ("end_time", "start_time", "withdrawn", "gpu_util_mean_pct", "mem_util_mean_pct", "max_memory_bytes",
            "energy_j")
_INDEXES = {
    "jobs": ("KEY jobs_end (end_time)",),
    "job_gpus": ("KEY job_gpus_end (end_time)", "KEY job_gpus_span (span_s)", "KEY job_gpus_sluid (sluid)",
                 *(f'KEY job_gpus_by_{k} ("{k}", {", ".join(_COVERED)})' for k in _V1_INDEX_KEYS)),
    "health_events": ("KEY health_events_time (time)",),
    "drains": ("KEY drains_time (time)",),
    "gpu_inventory": ("KEY gpu_inventory_time (time)",),
    "xid_events": ("KEY xid_events_time (time)",),
    "remediations": ("KEY remediations_serial (serial, time)", "KEY remediations_time (time)"),
    "job_samples": ("KEY job_samples_job (cluster, job_id, restart_count, time)", "KEY job_samples_node_time (node, time)"),
    "efficiency_actions": ("KEY efficiency_actions_time (time)", "KEY efficiency_actions_job (cluster, job_id, restart_count)"),
}


def _q(cols: Sequence[str]) -> str:
    return ", ".join(f'"{c}"' for c in cols)


def _column_ddl(table: str, col: str, staging: bool = False) -> str:
    kind = _TYPES[col]
    if (col in _NOT_NULL_IN.get(table, ()) or col in COLUMNS[table][:KEYS[table]]) and "NOT NULL" not in kind:
        kind += " NOT NULL"
    if staging and col in ("withdrawn",):
        kind = "TINYINT NOT NULL"
    return f'"{col}" {kind}'


def _table_ddl(table: str) -> str:
    cols = COLUMNS[table] + SHIPPED
    body = [_column_ddl(table, c) for c in cols]
    if table == "job_gpus":
        # The record's span, indexed: the report's counts of records that cannot be placed in
        # time (span < 0, longer than ten years) read the index instead of every row.
        body.append('"span_s" DOUBLE AS (end_time - start_time) VIRTUAL')
    body.append(f"PRIMARY KEY ({_q(COLUMNS[table][:KEYS[table]])})")
    body += list(_INDEXES[table])
    return f"CREATE TABLE IF NOT EXISTS {table} (\n    " + ",\n    ".join(body) + f"\n) {_TAIL}"


def _stage_type(col: str) -> str:
    return _TYPES[col].replace(" NOT NULL", "").replace(" DEFAULT 0", "")


def _stage_ddl(table: str) -> str:
    # Same columns, every one nullable but batch and withdrawn: a tombstone carries only the key.
    cols = [f'"{c}" {_stage_type(c)}' for c in COLUMNS[table] + ("shipped_at",)]
    body = ["batch CHAR(32) NOT NULL", *cols, "withdrawn TINYINT NOT NULL",
            f"PRIMARY KEY (batch, {_q(COLUMNS[table][:KEYS[table]])})"]
    return f"CREATE TABLE IF NOT EXISTS stage_{table} (\n    " + ",\n    ".join(body) + f"\n) {_TAIL}"


def _apply_sql(table: str, version: int = SCHEMA_VERSION) -> List[str]:
    cols = (staged_columns(table) if version >= 3 else COLUMNS[table]) + SHIPPED
    key = COLUMNS[table][:KEYS[table]]
    sets = ", ".join(f'"{c}" = VALUES("{c}")' for c in cols[KEYS[table]:])
    out = []
    if version >= 3 and table in VERSIONED:
        # Older than the server's: a complete row is never replaced by a partial one, nor a row
        # by an older version of itself (a node restored from a backup ships its old rows again).
        on = " AND ".join(f's."{k}" = t."{k}"' for k in key)
        out.append(f"DELETE s FROM stage_{table} AS s JOIN {table} AS t ON {on} WHERE s.batch = b AND s.withdrawn = 0 "
                   "AND (t.partial < s.partial OR (t.partial = s.partial AND t.row_version > s.row_version))")
    elif "row_version" in COLUMNS[table]:  # v7's remediations: an older version of a row never replaces it
        on = " AND ".join(f's."{k}" = t."{k}"' for k in key)
        out.append(f"DELETE s FROM stage_{table} AS s JOIN {table} AS t ON {on} WHERE s.batch = b AND s.withdrawn = 0 "
                   "AND t.row_version > s.row_version")
    if table == "job_samples":
        # A coarse row replaces the fine rows of its 10 minutes (store/samples.py merged them on the node).
        out.append("DELETE f FROM job_samples AS f JOIN stage_job_samples AS s ON f.cluster = s.cluster AND f.node = s.node "
                   "AND f.job_id = s.job_id AND f.restart_count = s.restart_count AND f.gpu_uuid = s.gpu_uuid "
                   "WHERE s.batch = b AND s.withdrawn = 0 AND s.coarse = 1 AND f.coarse = 0 "
                   f"AND FLOOR(f.time / {SAMPLE_BUCKET_S}) = FLOOR(s.time / {SAMPLE_BUCKET_S})")
    out.append(f"INSERT INTO {table} ({_q(cols)}) SELECT {_q(cols)} FROM stage_{table} WHERE batch = b AND withdrawn = 0 "
               f"ON DUPLICATE KEY UPDATE {sets}")
    if table == "job_samples":
        out.append("DELETE FROM job_samples WHERE node IN (SELECT DISTINCT node FROM stage_job_samples WHERE batch = b) "
                   f"AND time < UNIX_TIMESTAMP() - {SAMPLES_KEPT_S}")
    if table in ("jobs", "job_gpus"):
        # A tombstone: the row the node deleted after shipping it.  Never seen here (a push
        # lost before it): a placeholder row, already withdrawn, that no report reads.
        fill = ", 0, 0, 0" if table == "job_gpus" else ""
        fill_cols = ', "start_time", "end_time", "duration_s"' if table == "job_gpus" else ""
        out.append(f"INSERT INTO {table} ({_q(key)}{fill_cols}, withdrawn, shipped_at) "
                   f"SELECT {_q(key)}{fill}, 1, shipped_at FROM stage_{table} WHERE batch = b AND withdrawn = 1 "
                   "ON DUPLICATE KEY UPDATE withdrawn = 1, shipped_at = VALUES(shipped_at)")
    out.append(f"DELETE FROM stage_{table} WHERE batch = b")
    return out


# The cross-node read `slurm-gpu remediate` needs (a GPU's lemon budget follows its serial): a writer
# may neither SELECT records nor learn other serials, but may ask for one GPU's attempts everywhere.
REMEDIATION_HISTORY_COLUMNS = ("node", "id", "time", "gpu_index", "gpu_uuid", "serial", "fault_check", "fault", "action",
                               "outcome", "detail", "drain_time", "finished")
REMEDIATION_HISTORY_DDL = (
    "CREATE OR REPLACE PROCEDURE remediation_history(IN s VARCHAR(64)) READS SQL DATA SQL SECURITY DEFINER\n"
    f"BEGIN\n  SELECT {_q(REMEDIATION_HISTORY_COLUMNS)} FROM remediations WHERE serial = s AND withdrawn = 0 "
    "ORDER BY time, node, id;\nEND")


# v13: one row per node, the server's time of its newest applied batch.  Per node, not one row for
# all: every push would wait for every other's commit on a single row (and lose certification to it
# on Galera); a node's own pushes run one at a time anyway (its push lock).
PUSH_CLOCK_DDL = f"""CREATE TABLE IF NOT EXISTS push_clock (
    cluster {_TYPES["cluster"]} NOT NULL,
    node {_TYPES["node"]} NOT NULL,
    pushed_at DOUBLE NOT NULL,
    PRIMARY KEY (cluster, node)
) {_TAIL}"""


def _clock_sql(tables: Sequence[str]) -> str:
    """The batch's nodes' push_clock rows, set to the server's time (before the staging rows go)."""
    staged = " UNION ".join(f"SELECT cluster, node FROM stage_{t} WHERE batch = b" for t in tables)
    return (f"INSERT INTO push_clock (cluster, node, pushed_at) SELECT cluster, node, UNIX_TIMESTAMP(NOW(6)) "
            f"FROM ({staged}) AS s ON DUPLICATE KEY UPDATE pushed_at = VALUES(pushed_at)")


def _procedure(tables: Sequence[str] = RECORD_TABLES, version: int = SCHEMA_VERSION, with_rollups: bool = False) -> str:
    # v5: the owner check comes first and alone, so that what follows it can grow on its own.
    owner = ["CALL check_batch_owner(b)"] if version >= 5 else []
    if version >= 13:
        owner.append(_clock_sql(tables))
    stmts = [stmt for t in tables for stmt in _apply_sql(t, version)]
    if with_rollups:
        # The rollups' block (central/rollups.py), in the same transaction: the job_gpus records'
        # old versions out before their upsert (after the staged rows older than the server's
        # are dropped), the new ones in before the staging rows go.
        upsert = next(i for i, stmt in enumerate(stmts) if stmt.startswith("INSERT INTO job_gpus ("))
        stmts.insert(upsert, rollup_push.BEFORE_UPSERT)
        stmts.insert(stmts.index("DELETE FROM stage_job_gpus WHERE batch = b"), rollup_push.AFTER_UPSERT)
    body = ";\n  ".join(owner + stmts)
    return ("CREATE OR REPLACE PROCEDURE apply_batch(IN b CHAR(32)) MODIFIES SQL DATA SQL SECURITY DEFINER\n"
            f"BEGIN\n  {body};\nEND")


def _rollups_step(srv: "Central") -> None:
    tz, progress = getattr(srv, "migrate_options", ("utc", None))
    rollup_steps.migration_step(tz == "utc", _zone_name(tz), progress, [_procedure(V2_TABLES, 4, with_rollups=True)])(srv)


def _zone_name(tz: str) -> str:
    if tz == "utc":
        return "utc"
    import time
    return "local:" + (os.environ.get("TZ") or "/".join(time.tzname))


# A batch's statements read its staged rows by their key's prefix (batch = b), and InnoDB's
# repeatable read locks the gaps on either side of them until the commit: in a staging table holding
# only the batches in flight, those gaps are nearly the whole table, and every other push's INSERT of
# its staged rows waited for a commit (benchmarks/bench_central_load.py: 1,000 nodes pushing at the
# same second, ~11 pushes waiting at any time on the staging tables).  Fences, rows that no batch
# ever owns, one per first three hex digits of a batch id (a uuid4's hex: 4,096 of them), keep each
# batch's gaps between two fences, where another batch falls with a chance of 1 in 4,096 per batch in
# flight.  Their batch id is those three digits ('a3f' sorts before every 'a3f...' batch).
STAGE_FENCES = 4096


def _fence_value(col: str) -> Any:
    return "" if "CHAR" in _TYPES[col] or "TEXT" in _TYPES[col] else 0


def stage_fences_step(srv: "Central") -> None:
    """The schema step "staging fences" (v14): STAGE_FENCES rows in every staging table."""
    for table in RECORD_TABLES:
        key = COLUMNS[table][:KEYS[table]]
        sql = (f"INSERT IGNORE INTO stage_{table} (batch, {_q(key)}, withdrawn) "
               f"VALUES ({', '.join(['%s'] * (len(key) + 2))})")
        rows = [(f"{i:03x}", *(_fence_value(c) for c in key), 0) for i in range(STAGE_FENCES)]
        for i in range(0, len(rows), 1024):
            srv.executemany(sql, rows[i:i + 1024])


def staged_rows_sql(table: str) -> str:
    """How many rows are staged in a table and not applied (its fences left out)."""
    return f"SELECT COUNT(*) FROM stage_{table} WHERE LENGTH(batch) > 3"


MIGRATIONS: List[Tuple[Union[str, Callable[["Central"], None]], ...]] = [
    (
        f"""CREATE TABLE IF NOT EXISTS meta (
    name VARCHAR(64) NOT NULL PRIMARY KEY,
    value VARCHAR(255) NOT NULL
) {_TAIL}""",
        *(_table_ddl(t) for t in V1_TABLES),
        *(_stage_ddl(t) for t in V1_TABLES),
        # What reports read: the same columns as a node's job_gpus, without withdrawn rows.
        "CREATE OR REPLACE VIEW job_gpus_current AS SELECT * FROM job_gpus WHERE withdrawn = 0",
        _procedure(V1_TABLES, 1),
    ),
    (   # v2: GPU inventories and XID events for `slurm-gpu fleet`; apply_batch learns them.
        *(_table_ddl(t) for t in ("gpu_inventory", "xid_events")),
        *(_stage_ddl(t) for t in ("gpu_inventory", "xid_events")),
        _procedure(V2_TABLES, 2),
    ),
    (   # v3: row versions (an instant ADD COLUMN on MariaDB >= 10.3); apply_batch compares them.
        *(f'ALTER TABLE {t} ADD COLUMN "row_version" BIGINT NOT NULL DEFAULT 0' for t in VERSIONED),
        *(f'ALTER TABLE stage_{t} ADD COLUMN "row_version" BIGINT' for t in VERSIONED),
        _procedure(V2_TABLES, 3),
    ),
    (   # v4, "rollups" (central/rollups.py): per-day sums kept by apply_batch, built from the records there.
        _rollups_step,
    ),
    (   # v5: per-node writer accounts; apply_batch refuses a batch with another node's rows.
        W.TABLE_DDL,
        W.check_procedure(V2_TABLES),
        _procedure(V2_TABLES, 5, with_rollups=True),
    ),
    (   # v6, "job counts" (central/rollups.py): job counts and peaks in rollup_day(_node)'s cells.
        rollup_steps.job_counts_step,
    ),
    (   # v7, "remediations": the nodes' remediation attempts; apply_batch and its owner check learn them,
        # and a writer reads one GPU's attempts through remediation_history (self-contained: renumber freely).
        _table_ddl("remediations"),
        _stage_ddl("remediations"),
        W.check_procedure(V7_TABLES),
        _procedure(V7_TABLES, 7, with_rollups=True),
        REMEDIATION_HISTORY_DDL,
    ),
    (   # v8, "coarse rollups" (central/rollups.py): rollup_month, rollup_node_day, rollup_node_month.
        rollup_steps.coarse_step,
    ),
    (   # v9, "push plans" (central/rollup_push.py): rollups_before's join orders fixed, its pieces cut once.
        *rollup_push.procedures(),
    ),
    (   # v10, "partition rollups" (central/rollups.py): rollup_partition_day, built from rollup_day.
        rollup_steps.partition_step,
    ),
    (   # v11: each run's SLUID (Slurm 25.11+; NULL before) in jobs and job_gpus, as on the nodes (node
        # schema v10); a server made at v11 has the columns from v1's CREATE TABLE already.  The view's
        # columns were fixed when it was made: made again to show the new one.
        *(stmt for t in VERSIONED for stmt in (
            f'ALTER TABLE {t} ADD COLUMN IF NOT EXISTS "sluid" {_TYPES["sluid"]}',
            f'ALTER TABLE stage_{t} ADD COLUMN IF NOT EXISTS "sluid" {_TYPES["sluid"]}')),
        "ALTER TABLE job_gpus ADD INDEX IF NOT EXISTS job_gpus_sluid (sluid)",
        "CREATE OR REPLACE VIEW job_gpus_current AS SELECT * FROM job_gpus WHERE withdrawn = 0",
        _procedure(V7_TABLES, 11, with_rollups=True),
    ),
    (   # v12, "efficiency" (docs/efficiency.md): running jobs' samples and the idle policy's actions; apply_batch and
        # its owner check learn them (the writers' GRANTs that `central init` prints name their staging tables).
        *(_table_ddl(t) for t in ("job_samples", "efficiency_actions")),
        *(_stage_ddl(t) for t in ("job_samples", "efficiency_actions")),
        # Floods counted, not stored (issue 39; node schema v11): an XID row's line count and last line's time.
        # A server made at v12 has them from v2's CREATE TABLE already; rows shipped before are one line each.
        *(f'ALTER TABLE {t} ADD COLUMN IF NOT EXISTS "{c}" {kind}' for c in ("line_count", "last_time")
          for t, kind in (("xid_events", _TYPES[c]), ("stage_xid_events", _stage_type(c)))),
        W.check_procedure(RECORD_TABLES),
        _procedure(RECORD_TABLES, 12, with_rollups=True),
    ),
    (   # v13, "push clock" (docs/central.md, Topologies): each node's newest applied batch, in the server's time;
        # a replica's report says how old it is.  Filled by the next push of each node.
        PUSH_CLOCK_DDL,
        _procedure(RECORD_TABLES, 13, with_rollups=True),
    ),
    (   # v14, "staging fences": a batch's gap locks in the staging tables kept between two fences.
        stage_fences_step,
    ),
]
assert len(MIGRATIONS) == SCHEMA_VERSION


def stage_sql(table: str) -> str:
    """One staged row: batch, the node's columns, shipped_at, withdrawn (multi-row with executemany)."""
    cols = ("batch",) + staged_columns(table) + ("shipped_at", "withdrawn")
    return f"INSERT INTO stage_{table} ({_q(cols)}) VALUES ({', '.join(['%s'] * len(cols))})"


def withdraw_row(table: str, key: Sequence[Any], shipped_at: float) -> Tuple[Any, ...]:
    """The staged values of a tombstone: the key, nothing else."""
    return tuple(key) + (None,) * (len(staged_columns(table)) - KEYS[table]) + (shipped_at, 1)


