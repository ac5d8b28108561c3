"""The node database on disk: WAL, migrations, concurrent writers, spool and ingest."""
from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap

import pytest

from slurm_gpu.store.diagnose import integrity_check
from slurm_gpu.store.node import Store
from slurm_gpu.store.schema import MIGRATIONS, REPORT_INDEX_KEYS, SCHEMA_VERSION


def job_end(job_id, node="n1", gpus=2, restart=0):
    job = {"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "user": "u", "uid": 1,
           "account": "a", "partition": "p", "gpu_count": gpus, "start_time": 1.0, "end_time": 11.0, "exit_code": "0"}
    rows = [{"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "gpu_uuid": f"GPU-{i}",
             "gpu_index": i, "start_time": 1.0, "end_time": 11.0, "duration_s": 10.0, "energy_j": 5.0 * (i + 1)}
            for i in range(gpus)]
    return {"kind": "job_end", "job": job, "gpus": rows}


def count(db, table="job_gpus"):
    c = sqlite3.connect(db)
    try:
        return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        c.close()


def test_database_is_wal_versioned_and_not_writable_by_others(tmp_path):
    st = Store(str(tmp_path / "d" / "usage.db"), str(tmp_path / "spool"))
    assert st.write(job_end(1)) == "db"
    c = sqlite3.connect(st.path)
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    mode = stat.S_IMODE(os.stat(st.path).st_mode)
    assert mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH) == 0, oct(mode)
    assert integrity_check(st.path) == []


def test_rewriting_a_record_does_not_duplicate(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    st.write(job_end(1))
    st.write(job_end(1))
    st.write(job_end(1, restart=1))
    assert count(st.path) == 4 and count(st.path, "jobs") == 2


def test_readonly_database_spools_then_ingests(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    st.write(job_end(1))
    st.close()
    # A read-only file system: root ignores permission bits, so open the database read-only.
    st._conn = sqlite3.connect(f"file:{st.path}?mode=ro", uri=True, isolation_level=None)
    where = st.write(job_end(2))
    assert where.startswith("spool:") and "readonly" in json.load(open(where[6:]))["_spool_reason"]
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    assert st.write(job_end(3)) == "db"
    assert count(st.path, "jobs") == 3 and st.spooled() == []


def test_corrupt_database_spools_and_db_check_says_so(tmp_path):
    path = tmp_path / "u.db"
    path.write_bytes(b"this is not sqlite" * 100)
    st = Store(str(path), str(tmp_path / "spool"))
    assert st.write(job_end(1)).startswith("spool:")
    assert integrity_check(str(path)) != []
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndatabase = "{path}"\nspool_dir = "{tmp_path / "spool"}"\n')
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), "db", "check"],
                        capture_output=True, text=True)
    assert cp.returncode == 1 and "1 record(s) waiting" in cp.stdout and "Traceback" not in cp.stderr
    # The admin moves the corrupt file aside; ingest recreates the database with nothing lost.
    path.rename(tmp_path / "u.db.corrupt")
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), "db", "ingest"],
                        capture_output=True, text=True)
    assert cp.returncode == 0 and "ingested 1 of 1" in cp.stdout, cp.stderr
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), "db", "check"],
                        capture_output=True, text=True)
    assert cp.returncode == 0 and "job_gpus 2" in cp.stdout


def test_unreadable_spool_file_is_kept_aside_not_lost(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    os.makedirs(st.spool_dir)
    with open(os.path.join(st.spool_dir, "1-1-job_end.json"), "w") as f:
        f.write("{truncated")
    done, problems = st.ingest_spool()
    assert done == 0 and "unreadable" in problems[0]
    assert os.listdir(st.spool_dir) == ["1-1-job_end.json.bad"]


def test_no_database_and_no_spool_raises_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    st = Store(str(blocker / "u.db"), str(blocker / "spool"))
    from slurm_gpu.errors import StoreError
    with pytest.raises(StoreError, match="nor spool"):
        st.write(job_end(1))


def test_newer_schema_is_refused_not_downgraded(tmp_path):
    path = tmp_path / "u.db"
    c = sqlite3.connect(path)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.close()
    st = Store(str(path), str(tmp_path / "spool"))
    assert st.write(job_end(1)).startswith("spool:")
    spooled = json.load(open(st.spooled()[0]))
    assert "newer than this slurm-gpu" in spooled["_spool_reason"]


def test_v1_database_with_rows_migrates_to_v2_on_next_write_and_keeps_its_rows(tmp_path):
    path = tmp_path / "u.db"
    c = sqlite3.connect(path, isolation_level=None)
    for stmt in MIGRATIONS[0]:
        c.execute(stmt)
    c.execute("PRAGMA user_version = 1")
    c.execute("PRAGMA journal_mode = WAL")
    c.close()
    # Rows written by a v1 slurm-gpu: the Store of that version only ran migration 0.
    from slurm_gpu.store import apply as store_mod
    c = sqlite3.connect(path, isolation_level=None)
    from slurm_gpu.store.schema import JOB_GPU_COLUMNS
    v1_insert = f"INSERT INTO job_gpus ({', '.join(JOB_GPU_COLUMNS)}) VALUES ({', '.join('?' * len(JOB_GPU_COLUMNS))})"
    v1_job_insert = store_mod.insert_sql("jobs", store_mod._JOB_COLUMNS)
    for j in (1, 2):
        rec = job_end(j, gpus=4)
        c.execute(v1_job_insert, store_mod.sql_row(rec["job"], store_mod._JOB_COLUMNS))
        c.executemany(v1_insert, [store_mod.sql_row(g, JOB_GPU_COLUMNS) for g in rec["gpus"]])
    before = sorted(c.execute(f"SELECT {', '.join(JOB_GPU_COLUMNS)} FROM job_gpus").fetchall())
    c.close()
    st = Store(str(path), str(tmp_path / "spool"))
    assert st.write(job_end(3)) == "db"
    st.close()
    c = sqlite3.connect(path)
    try:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 11
        indexes = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert {f"job_gpus_by_{k}" for k in REPORT_INDEX_KEYS} | {"job_gpus_duration"} <= indexes
        assert "job_gpus_user" not in indexes  # subsumed by job_gpus_by_user
        rows = sorted(c.execute(f"SELECT {', '.join(JOB_GPU_COLUMNS)} FROM job_gpus").fetchall())
        assert [r for r in rows if r[1] != 3] == before and len(rows) == 4 + 4 + 2
        assert c.execute("SELECT count(*) FROM jobs").fetchone()[0] == 3
        # The report's aggregate reads the new index alone (no table lookups, no sort).
        plan = " ".join(r[3] for r in c.execute(
            "EXPLAIN QUERY PLAN SELECT user, SUM(end_time - start_time), COUNT(DISTINCT job_id) FROM job_gpus "
            "GROUP BY user ORDER BY user"))
        assert "COVERING INDEX job_gpus_by_user" in plan and "GROUP BY" not in plan, plan
    finally:
        c.close()
    assert integrity_check(str(path)) == []


def test_64_concurrent_writers_lose_nothing(tmp_path):
    db, spool = tmp_path / "u.db", tmp_path / "spool"
    Store(str(db), str(spool)).connect()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from slurm_gpu.store.node import Store
        from test_store import job_end
        st = Store({str(db)!r}, {str(spool)!r}, busy_timeout_s=30)
        print(st.write(job_end(int(sys.argv[1]), gpus=8)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(64)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    st = Store(str(db), str(spool))
    st.ingest_spool()
    assert count(str(db)) == 64 * 8 and count(str(db), "jobs") == 64, outs
