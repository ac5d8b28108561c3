"""The node database schema: versioned migrations, shared by store/node.py (writes) and report/query.py (reads).

Times are unix seconds (REAL, UTC).  Energy in joules, memory in bytes, utilisation in
percent (0-100).  NULL means "not available on this GPU" (unsupported or failed reading),
never zero.  job_gpus repeats user/account/partition so reports aggregate one table.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from slurm_gpu import groupkeys
from slurm_gpu.store import record

SCHEMA_VERSION = 11

# Group-by columns of `slurm-gpu report` with a covering index (slurm_gpu/groupkeys.py), and the
# columns the index carries after the key: everything report.summary reads, so the table itself is
# never touched.  The indexes of v2 are v2's own list: a migration's text never changes.
REPORT_INDEX_KEYS: Tuple[str, ...] = groupkeys.INDEXED
_V2_INDEX_KEYS = ("user", "account", "partition", "node", "gpu_model")
COVERED = ("start_time", "end_time", "job_id", "cluster", "gpu_util_mean_pct", "mem_util_mean_pct",
           "max_memory_bytes", "energy_j")

# The tables `db push` ships, with the column that orders their outbox (oldest first): those of
# v5, the fleet's history of v6, and the remediation attempts of v8.
_V5_PUSHED = (("jobs", "end_time"), ("job_gpus", "end_time"), ("health_events", "time"), ("drains", "time"))
PUSHED_TABLES = _V5_PUSHED + (("gpu_inventory", "time"), ("xid_events", "time"), ("remediations", "time"),
                              ("job_samples", "time"), ("efficiency_actions", "time"))

# v6 (`slurm-gpu fleet`, docs/fleet.md).  gpu_inventory: one row per GPU per observation, written
# by `healthcheck` when anything but the time changed, or once per inventory.record_every_s.
# The state columns are also the keys of an inventory file's per-GPU "state" (gres/inventory.py).
INVENTORY_STATIC = ("serial", "model", "vbios", "driver_version", "cuda_version")
INVENTORY_STATE = ("mig_mode", "ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
                   "ecc_uncorrected_aggregate", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending",
                   "remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failure",
                   "remap_hist_max", "remap_hist_high", "remap_hist_partial", "remap_hist_low", "remap_hist_none",
                   "sram_corrected", "sram_uncorrected")
INVENTORY_COLUMNS = ("time", "node", "gpu_index", "gpu_uuid") + INVENTORY_STATIC + INVENTORY_STATE
# xid_events: every dated XID a healthcheck read in the kernel log, once (event_key).  v11: a flood of
# identical lines (gpu/xid.py) is one row with its line_count, first (`time`) and last line's time.
_V6_XID_COLUMNS = ("event_key", "time", "node", "gpu_index", "gpu_uuid", "pci_bus_id", "xid", "detail")
XID_COLUMNS = _V6_XID_COLUMNS + ("line_count", "last_time")
# The XIDs of a kernel log read twice are one event each.  kmsg dates are boot time + uptime, and
# the boot time is read again each run (/proc/uptime, 10 ms steps): an event the node has with the
# same GPU bus, XID and text within this many seconds is the same event; and a flood read again,
# its first line within this many seconds of the row's or inside the row's lines (the window moved
# on), is the same flood: its row's line_count and last_time grow (store/node.py record_xids).
XID_SAME_S = 2.0
# v7 (`slurm-gpu remediate`, docs/remediation.md): every remediation attempt of a node, its intent
# written before the act and its outcome after; budgets and lemons are counted from it by GPU serial.
REMEDIATION_COLUMNS = ("time", "node", "gpu_index", "gpu_uuid", "serial", "fault_check", "fault", "action",
                       "outcome", "detail", "drain_time", "finished")
# Their columns at v5: a write that leaves all of them as they were (a re-run epilog whose
# record loses to the first) is no change and does not ship the row again.  Spelled out, not
# taken from store/record.py: a migration's text never changes (a column added later would not
# exist yet when v5's triggers are made).
_V5_COLUMNS = {
    "jobs": ("cluster", "job_id", "restart_count", "node", "user", "uid", "account", "partition", "gpu_count",
             "start_time", "end_time", "exit_code", "partial"),
    "job_gpus": ("cluster", "job_id", "restart_count", "node", "gpu_uuid", "gpu_index", "gpu_model", "user",
                 "account", "partition", "start_time", "end_time", "duration_s", "energy_j", "gpu_util_mean_pct",
                 "mem_util_mean_pct", "max_memory_bytes", "process_count", "ecc_corrected_delta",
                 "ecc_uncorrected_delta", "retired_pages_delta", "remapped_rows_delta", "clock_event_reasons",
                 "xid_events", "parent_gpu_uuid", "notes", "partial", "end_counters", "memory_total_bytes"),
    "health_events": ("time", "node", "source", "job_id", "gpu_index", "gpu_uuid", "check_name", "status", "message",
                      "dedupe_key"),
    "drains": ("time", "node", "source", "job_id", "reason", "ok", "cluster", "restart_count", "outcome",
               "kept_reason", "dedupe_key"),
}


# v11 (docs/efficiency.md): running jobs' samples and the idle policy's actions (the message itself stays here).
SAMPLE_COLUMNS = ("cluster", "job_id", "restart_count", "node", "gpu_uuid", "gpu_index", "time", "span_s", "samples",
                  "coarse", "gpu_util_pct", "gpu_util_max_pct", "memory_used_bytes", "memory_total_bytes", "energy_j")
ACTION_COLUMNS = ("time", "cluster", "job_id", "restart_count", "decided_on", "user", "account", "partition", "stage",
                  "idle_since", "idle_s", "gpus", "idle_gpus", "evidence", "mail_to", "mail_state", "mail_tries",
                  "mail_time", "mail_error", "cancel_state", "cancel_error")
_PUSHED_COLUMNS = dict(_V5_COLUMNS, gpu_inventory=INVENTORY_COLUMNS, xid_events=XID_COLUMNS,
                       remediations=REMEDIATION_COLUMNS, job_samples=SAMPLE_COLUMNS, efficiency_actions=ACTION_COLUMNS)


def _changed(table: str, columns: Optional[Tuple[str, ...]] = None) -> str:
    return " OR ".join(f'NEW."{c}" IS NOT OLD."{c}"' for c in (columns or _PUSHED_COLUMNS[table]))


def _changed_trigger(table: str, columns: Optional[Tuple[str, ...]] = None) -> str:
    return (f"CREATE TRIGGER IF NOT EXISTS {table}_changed AFTER UPDATE ON {table} "
            f"WHEN NEW.pushed_version = OLD.pushed_version AND NEW.push_version = OLD.push_version "
            f"AND ({_changed(table, columns)}) "
            f"BEGIN UPDATE {table} SET push_version = OLD.push_version + 1 WHERE rowid = NEW.rowid; END")


def _outbox(table: str, when: str, columns: Optional[Tuple[str, ...]] = None) -> Tuple[str, ...]:
    """The outbox of a table that has its push_version/pushed_version columns (v5, docs/central.md);
    columns: those whose change ships the row again, when the table had fewer then than now."""
    return (
        f"CREATE INDEX IF NOT EXISTS {table}_unpushed ON {table} ({when}) WHERE pushed_version < push_version",
        _changed_trigger(table, columns),
    )


_OUTBOX_COLUMNS = "push_version INTEGER NOT NULL DEFAULT 1,\n            pushed_version INTEGER NOT NULL DEFAULT 0"
_COUNT = " INTEGER,\n            ".join(INVENTORY_STATE) + " INTEGER"

# Each migration takes the database from version i to i+1 (index i).
MIGRATIONS: List[Tuple[str, ...]] = [
    (
        """CREATE TABLE IF NOT EXISTS jobs (
            cluster TEXT NOT NULL,
            job_id INTEGER NOT NULL,
            restart_count INTEGER NOT NULL DEFAULT 0,
            node TEXT NOT NULL,
            user TEXT,
            uid INTEGER,
            account TEXT,
            partition TEXT,
            gpu_count INTEGER NOT NULL DEFAULT 0,
            start_time REAL,
            end_time REAL,
            exit_code TEXT,
            PRIMARY KEY (cluster, job_id, restart_count, node)
        )""",
        # One row per job, node and GPU: written by the epilog in one transaction.
        """CREATE TABLE IF NOT EXISTS job_gpus (
            cluster TEXT NOT NULL,
            job_id INTEGER NOT NULL,
            restart_count INTEGER NOT NULL DEFAULT 0,
            node TEXT NOT NULL,
            gpu_uuid TEXT NOT NULL,
            gpu_index INTEGER,
            gpu_model TEXT,
            user TEXT,
            account TEXT,
            partition TEXT,
            start_time REAL NOT NULL,
            end_time REAL NOT NULL,
            duration_s REAL NOT NULL,
            energy_j REAL,
            gpu_util_mean_pct REAL,
            mem_util_mean_pct REAL,
            max_memory_bytes INTEGER,
            process_count INTEGER,
            ecc_corrected_delta INTEGER,
            ecc_uncorrected_delta INTEGER,
            retired_pages_delta INTEGER,
            remapped_rows_delta INTEGER,
            clock_event_reasons INTEGER,
            xid_events TEXT,
            PRIMARY KEY (cluster, job_id, restart_count, node, gpu_uuid)
        )""",
        # Written by the prolog: the counters the epilog subtracts from.
        """CREATE TABLE IF NOT EXISTS job_starts (
            cluster TEXT NOT NULL,
            job_id INTEGER NOT NULL,
            restart_count INTEGER NOT NULL DEFAULT 0,
            node TEXT NOT NULL,
            gpu_uuid TEXT NOT NULL,
            gpu_index INTEGER,
            start_time REAL NOT NULL,
            energy_mj INTEGER,
            ecc_corrected INTEGER,
            ecc_uncorrected INTEGER,
            retired_pages INTEGER,
            remapped_rows INTEGER,
            PRIMARY KEY (cluster, job_id, restart_count, node, gpu_uuid)
        )""",
        """CREATE TABLE IF NOT EXISTS health_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            time REAL NOT NULL,
            node TEXT NOT NULL,
            source TEXT NOT NULL,
            job_id INTEGER,
            gpu_index INTEGER,
            gpu_uuid TEXT,
            check_name TEXT NOT NULL,
            status TEXT NOT NULL,
            message TEXT NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS drains (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            time REAL NOT NULL,
            node TEXT NOT NULL,
            source TEXT NOT NULL,
            job_id INTEGER,
            reason TEXT NOT NULL,
            ok INTEGER NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS job_gpus_end ON job_gpus (end_time)",
        "CREATE INDEX IF NOT EXISTS job_gpus_user ON job_gpus (user, end_time)",
        "CREATE INDEX IF NOT EXISTS job_gpus_account ON job_gpus (account, end_time)",
        "CREATE INDEX IF NOT EXISTS health_events_time ON health_events (time)",
        "CREATE INDEX IF NOT EXISTS drains_time ON drains (time)",
    ),
    # v2: covering indexes for `report --by KEY`.  SQLite then reads each group's rows in key
    # order from the index alone: no table lookups and no sort of the whole table (the sort was
    # two thirds of a 1M-record report).  start_time second: a --user/--account filter or a
    # calendar bucket becomes an index range.  The v1 (user|account, end_time) indexes are
    # subsumed.  The expression index answers MAX(end_time - start_time) in O(log n): how far
    # back a record can start and still reach into a calendar bucket.
    (
        "DROP INDEX IF EXISTS job_gpus_user",
        "DROP INDEX IF EXISTS job_gpus_account",
        *(f"CREATE INDEX IF NOT EXISTS job_gpus_by_{col} ON job_gpus ({col}, {', '.join(COVERED)})"
          for col in _V2_INDEX_KEYS),
        "CREATE INDEX IF NOT EXISTS job_gpus_duration ON job_gpus ((end_time - start_time))",
    ),
    # v3: a MIG slice is recorded under its own MIG UUID (gpu_uuid) with its GPU's UUID beside
    # it, and a record says in `notes` what could not be measured (NVML counts energy,
    # utilisation and peak memory per GPU, not per MIG instance).
    (
        "ALTER TABLE job_gpus ADD COLUMN parent_gpu_uuid TEXT",
        "ALTER TABLE job_gpus ADD COLUMN notes TEXT",
    ),
    # v4: nothing lost, nothing doubled (docs/hooks.md, "Nothing is lost").
    # - partial = 1: the epilog could not find the prolog's start record; what the end tells
    #   (processes, accounting, XIDs) is kept, start_time is a lower bound and the counter deltas
    #   are empty.  end_counters (JSON) holds the end counters, so that the row is completed when
    #   the start record turns up (spool, `db ingest --from-log`).  A complete record replaces a
    #   partial one; among records of one kind the first (earliest end_time) wins, a later one
    #   only fills what it left empty.
    # - dedupe_key: a re-run epilog or a replayed record does not add a health event or drain twice.
    # - drains say what happened: outcome drained | kept (the node was already drained:
    #   kept_reason is the reason Slurm kept) | failed | off (drain_on_fault = false) and for
    #   which job start (cluster, restart_count).
    (
        "ALTER TABLE job_gpus ADD COLUMN partial INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE job_gpus ADD COLUMN end_counters TEXT",
        "ALTER TABLE jobs ADD COLUMN partial INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE health_events ADD COLUMN dedupe_key TEXT",
        "CREATE UNIQUE INDEX IF NOT EXISTS health_events_dedupe ON health_events (dedupe_key)",
        "ALTER TABLE drains ADD COLUMN cluster TEXT",
        "ALTER TABLE drains ADD COLUMN restart_count INTEGER",
        "ALTER TABLE drains ADD COLUMN outcome TEXT",
        "ALTER TABLE drains ADD COLUMN kept_reason TEXT",
        "ALTER TABLE drains ADD COLUMN dedupe_key TEXT",
        "CREATE UNIQUE INDEX IF NOT EXISTS drains_dedupe ON drains (dedupe_key)",
        "CREATE INDEX IF NOT EXISTS drains_job ON drains (job_id, node)",
    ),
    # v5: the outbox of `slurm-gpu db push` (central/push.py, docs/central.md).  Every row
    # carries the version the central server has (pushed_version) beside its own
    # (push_version); any change to a row, by any writer, bumps push_version in a trigger, so
    # the row ships again (a write that changes no value is no change).  A deleted row that
    # was shipped leaves a tombstone in push_withdrawn (the central writer may not delete: the
    # server marks the row withdrawn).  Existing rows start unshipped: the first push sends a
    # node's whole history.
    # The GPU's (or MIG slice's) memory comes with each usage record: `slurm-gpu job` judges a
    # job's peak memory against it.
    ("ALTER TABLE job_gpus ADD COLUMN memory_total_bytes INTEGER",) +
    tuple(stmt for table, when in _V5_PUSHED for stmt in (
        f"ALTER TABLE {table} ADD COLUMN push_version INTEGER NOT NULL DEFAULT 1",
        f"ALTER TABLE {table} ADD COLUMN pushed_version INTEGER NOT NULL DEFAULT 0",
        *_outbox(table, when),
    )) + (
        """CREATE TABLE IF NOT EXISTS push_withdrawn (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            tbl TEXT NOT NULL,
            cluster TEXT,
            job_id INTEGER,
            restart_count INTEGER,
            node TEXT,
            gpu_uuid TEXT,
            time REAL NOT NULL
        )""",
        "CREATE TRIGGER IF NOT EXISTS jobs_withdrawn AFTER DELETE ON jobs WHEN OLD.pushed_version > 0 "
        "BEGIN INSERT INTO push_withdrawn (tbl, cluster, job_id, restart_count, node, time) "
        "VALUES ('jobs', OLD.cluster, OLD.job_id, OLD.restart_count, OLD.node, (julianday('now') - 2440587.5) * 86400.0); END",
        "CREATE TRIGGER IF NOT EXISTS job_gpus_withdrawn AFTER DELETE ON job_gpus WHEN OLD.pushed_version > 0 "
        "BEGIN INSERT INTO push_withdrawn (tbl, cluster, job_id, restart_count, node, gpu_uuid, time) "
        "VALUES ('job_gpus', OLD.cluster, OLD.job_id, OLD.restart_count, OLD.node, OLD.gpu_uuid, "
        "(julianday('now') - 2440587.5) * 86400.0); END",
        """CREATE TABLE IF NOT EXISTS push_state (
            name TEXT PRIMARY KEY,
            value
        )""",
    ),
    # v6: the fleet's history (docs/fleet.md), shipped by `db push` like health events: every
    # GPU's inventory when it changed (NULL: unsupported or unreadable, never 0) and the XIDs
    # read from the kernel log.  Rows are only added; a node keeps its whole history.
    (
        f"""CREATE TABLE IF NOT EXISTS gpu_inventory (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            node TEXT NOT NULL,
            gpu_index INTEGER,
            gpu_uuid TEXT NOT NULL,
            serial TEXT,
            model TEXT,
            vbios TEXT,
            driver_version TEXT,
            cuda_version TEXT,
            {_COUNT},
            {_OUTBOX_COLUMNS}
        )""",
        # healthcheck reads each GPU's latest row of its node: one range of this index
        "CREATE INDEX IF NOT EXISTS gpu_inventory_gpu ON gpu_inventory (node, gpu_uuid)",
        f"""CREATE TABLE IF NOT EXISTS xid_events (
            id INTEGER PRIMARY KEY,
            event_key TEXT NOT NULL UNIQUE,
            time REAL NOT NULL,
            node TEXT NOT NULL,
            gpu_index INTEGER,
            gpu_uuid TEXT,
            pci_bus_id TEXT,
            xid INTEGER NOT NULL,
            detail TEXT,
            {_OUTBOX_COLUMNS}
        )""",
        "CREATE INDEX IF NOT EXISTS xid_events_time ON xid_events (time)",
        *_outbox("gpu_inventory", "time"),
        *_outbox("xid_events", "time", _V6_XID_COLUMNS),
    ),
    # v7: remediation attempts (docs/remediation.md).  One row per attempt and GPU (gpu_uuid ''
    # for a node-wide step such as a reboot): outcome 'started' is the intent, written before the
    # reset or reboot is issued; the row is updated to its outcome (resumed, failed, escalated,
    # rma, requested, refused) once known.  Shipped by `db push` from v8.
    (
        """CREATE TABLE IF NOT EXISTS remediations (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            node TEXT NOT NULL,
            gpu_index INTEGER,
            gpu_uuid TEXT NOT NULL DEFAULT '',
            serial TEXT,
            fault_check TEXT,
            fault TEXT,
            action TEXT NOT NULL,
            outcome TEXT NOT NULL,
            detail TEXT,
            drain_time REAL,
            finished REAL
        )""",
        "CREATE INDEX IF NOT EXISTS remediations_serial ON remediations (serial, time)",
        "CREATE INDEX IF NOT EXISTS remediations_node ON remediations (node, time)",
    ),
    # v8: remediation attempts shipped by `db push` (docs/remediation.md): the outbox columns and
    # trigger of v5, so that a row's outcome written after it was shipped (started -> resumed,
    # escalated, ...) ships it again.  Existing rows start unshipped.
    (
        "ALTER TABLE remediations ADD COLUMN push_version INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE remediations ADD COLUMN pushed_version INTEGER NOT NULL DEFAULT 0",
        *_outbox("remediations", "time"),
    ),
    # v9: the episode is the state (docs/remediation.md, "Episodes"): a step's own process, kept on this
    # node only (never shipped, never part of a row's version): the reset command's pid and its start
    # time in clock ticks since boot (/proc/PID/stat; a pid reused by another process does not match),
    # and the verification job's id.  A run that finds a step `started` reads them before anything else.
    (
        "ALTER TABLE remediations ADD COLUMN pid INTEGER",
        "ALTER TABLE remediations ADD COLUMN pid_start INTEGER",
        "ALTER TABLE remediations ADD COLUMN job_id INTEGER",
    ),
    # v10: the run's SLUID where Slurm gives one (SLURM_JOB_SLUID, 25.11+; NULL before): a requeued
    # job's runs share the job id but each has a SLUID of its own, and `slurm-gpu job SLUID` (sacct
    # takes SLUIDs from 26.05) finds that run's rows by it.  Shipped by `db push` (central v11).
    (
        "ALTER TABLE jobs ADD COLUMN sluid TEXT",
        "ALTER TABLE job_gpus ADD COLUMN sluid TEXT",
        "CREATE INDEX IF NOT EXISTS job_gpus_sluid ON job_gpus (sluid) WHERE sluid IS NOT NULL",
    ),
    # v11: running jobs' GPUs sampled (`slurm-gpu efficiency sample`, docs/efficiency.md) and what the idle
    # policy did about them.  A sample row covers span_s seconds up to `time` on one GPU or MIG slice of one
    # job start: a fine row is one reading (samples = 1); rows older than efficiency.samples_fine_s are merged
    # into coarse rows of up to 10 minutes (coarse = 1: mean and max utilisation, peak memory, the last energy
    # figure), so fine and coarse rows of a GPU never overlap.  NULL: not available (a MIG slice has no
    # utilisation of its own), never 0.  energy_j counts from the job's start on the GPU (the prolog's counter).
    (
        f"""CREATE TABLE IF NOT EXISTS job_samples (
            id INTEGER PRIMARY KEY,
            cluster TEXT NOT NULL,
            job_id INTEGER NOT NULL,
            restart_count INTEGER NOT NULL DEFAULT 0,
            node TEXT NOT NULL,
            gpu_uuid TEXT NOT NULL,
            gpu_index INTEGER,
            time REAL NOT NULL,
            span_s REAL NOT NULL,
            samples INTEGER NOT NULL DEFAULT 1,
            coarse INTEGER NOT NULL DEFAULT 0,
            gpu_util_pct REAL,
            gpu_util_max_pct REAL,
            memory_used_bytes INTEGER,
            memory_total_bytes INTEGER,
            energy_j REAL,
            {_OUTBOX_COLUMNS}
        )""",
        "CREATE INDEX IF NOT EXISTS job_samples_job ON job_samples (cluster, job_id, restart_count, node, time)",
        "CREATE INDEX IF NOT EXISTS job_samples_time ON job_samples (coarse, time)",
        # One row per job start and stage (advice, notify, cancel): at most one message per job and stage,
        # whatever crashes or runs twice.  The mail's and the cancel's outcome are written after the act.
        f"""CREATE TABLE IF NOT EXISTS efficiency_actions (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            cluster TEXT NOT NULL,
            job_id INTEGER NOT NULL,
            restart_count INTEGER NOT NULL DEFAULT 0,
            decided_on TEXT NOT NULL,
            user TEXT,
            account TEXT,
            partition TEXT,
            stage TEXT NOT NULL,
            idle_since REAL,
            idle_s REAL,
            gpus INTEGER,
            idle_gpus INTEGER,
            evidence TEXT,
            mail_to TEXT,
            mail_state TEXT NOT NULL,
            mail_tries INTEGER NOT NULL DEFAULT 0,
            mail_time REAL,
            mail_error TEXT,
            message TEXT,
            cancel_state TEXT,
            cancel_error TEXT,
            {_OUTBOX_COLUMNS},
            UNIQUE (cluster, job_id, restart_count, stage)
        )""",
        "CREATE INDEX IF NOT EXISTS efficiency_actions_time ON efficiency_actions (time)",
        "CREATE INDEX IF NOT EXISTS efficiency_actions_mail ON efficiency_actions (mail_to, mail_time)",
        # Shipped by `db push` (central v12): the samples once (rows are only added; the merged fine rows the
        # server drops when their coarse row arrives), the actions again whenever their outcome changes.
        *_outbox("job_samples", "time"),
        *_outbox("efficiency_actions", "time"),
        # Floods counted, not stored (issue 39, gpu/xid.py): a row is one event of line_count identical
        # lines, from `time` to last_time (NULL in rows written before: one line).  A flood read again
        # updates its row (store/node.py record_xids), found through last_time; its change ships the row
        # again, so the trigger of v6 is made again with the new columns.
        "ALTER TABLE xid_events ADD COLUMN line_count INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE xid_events ADD COLUMN last_time REAL",
        "CREATE INDEX IF NOT EXISTS xid_events_last ON xid_events (last_time)",
        "DROP TRIGGER IF EXISTS xid_events_changed",
        _changed_trigger("xid_events"),
    ),
]

assert len(MIGRATIONS) == SCHEMA_VERSION

# The columns of job_gpus as reports read them, and as the epilog writes them: store/record.py's
# GpuUsage fields (reports read JOB_GPU_COLUMNS only, so databases of every version read alike).
JOB_GPU_COLUMNS, JOB_GPU_WRITE_COLUMNS = record.JOB_GPU_COLUMNS, record.JOB_GPU_WRITE_COLUMNS
