"""The job tables' columns, tied together: the record's fields (store/record.py), the node database
after every migration, the columns `db push` reads and the central server's (central/server.py).
A column added in one place and forgotten in another fails here, not in a push at 3 a.m."""
from __future__ import annotations

import sqlite3

import pytest

from slurm_gpu.central import push as P
from slurm_gpu.central import schema as CS
from slurm_gpu.central import server as C
from slurm_gpu.store import record as R
from slurm_gpu.store.node import Store

OUTBOX = {"push_version", "pushed_version"}  # the node's own bookkeeping (schema v5), never shipped
NODE_ONLY = {"job_gpus": {"end_counters"}, "jobs": set()}  # a partial row's end counters stay on the node


@pytest.fixture
def node_db(tmp_path):
    st = Store(str(tmp_path / "usage.db"), str(tmp_path / "spool"))
    st.connect()  # made and migrated to the current version
    st.close()
    conn = sqlite3.connect(str(tmp_path / "usage.db"))
    yield conn
    conn.close()


@pytest.mark.parametrize("table, fields", [("jobs", R.JOB_WRITE_COLUMNS), ("job_gpus", R.JOB_GPU_WRITE_COLUMNS)])
def test_the_node_tables_columns_are_the_records_fields(node_db, table, fields):
    have = [r[1] for r in node_db.execute(f"PRAGMA table_info({table})")]
    assert set(have) - OUTBOX == set(fields), (sorted(set(have) - OUTBOX - set(fields)), sorted(set(fields) - set(have)))


@pytest.mark.parametrize("table, fields", [("jobs", R.JOB_WRITE_COLUMNS), ("job_gpus", R.JOB_GPU_WRITE_COLUMNS)])
def test_push_reads_and_the_central_server_keeps_every_shipped_field(table, fields):
    shipped = set(fields) - NODE_ONLY[table]
    assert set(P._NODE_COLUMNS[table]) == shipped
    assert set(C.COLUMNS[table]) == shipped, (sorted(set(C.COLUMNS[table]) - shipped), sorted(shipped - set(C.COLUMNS[table])))
    assert all(c in CS._TYPES for c in C.COLUMNS[table])  # every central column has its SQL type


def test_the_key_columns_agree():
    assert C.COLUMNS["jobs"][:C.KEYS["jobs"]] == R.JOB_KEY == R._JobKey._fields
    assert C.COLUMNS["job_gpus"][:C.KEYS["job_gpus"]] == R._GpuKey._fields[:-1]  # gpu_index is no key
