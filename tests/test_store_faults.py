"""Storage faults: no record is lost, none is forged (issue 10).

Real SQLite files in WAL mode, real spool files, real symlinks and ownership (the suite runs
as root, so a file can be handed to another uid).  Each test is named after the failure it
reproduces.
"""
from __future__ import annotations

import gc
import json
import os
import sqlite3
import subprocess
import sys
import time
import types

import pytest
import simgpu
from test_hooks import RecordingSlurm, deps_for, job_env, rows
from test_store import count, job_end

from slurm_gpu import config
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.hooks.log import HookLog
from slurm_gpu.hooks.records import HOOK_INGEST_BOUNDS
from slurm_gpu.slurm.jobenv import from_env
from slurm_gpu.store.diagnose import integrity_check
from slurm_gpu.store.node import Store
from slurm_gpu.store.schema import SCHEMA_VERSION

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks need root")


def cli(cfg, *args):
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), *args],
                          capture_output=True, text=True, timeout=120)


def store_cfg(tmp_path, db, spool):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndatabase = "{db}"\nspool_dir = "{spool}"\nbusy_timeout_s = 0.5\n'
                   f'[log]\nsyslog = false\n')
    return cfg


def spool_file(spool, name, record, mode=0o600, uid=None):
    spool.mkdir(mode=0o700, exist_ok=True)
    p = spool / name
    p.write_text(json.dumps(record))
    os.chmod(p, mode)
    if uid is not None:
        os.chown(p, uid, -1)
    return p


def corrupt_table(db, table):
    """Overwrite the root page of one table with garbage (the database is checkpointed first)."""
    c = sqlite3.connect(str(db), isolation_level=None)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = c.execute("PRAGMA page_size").fetchone()[0]
    root = c.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (table,)).fetchone()[0]
    c.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xde\xad\xbe\xef" * (page_size // 4))


def exclusive_lock(db):
    """A connection that keeps everyone else out, readers included (locking_mode=EXCLUSIVE)."""
    gc.collect()  # earlier hooks' connections (HookDeps holds reference cycles) must be gone first
    c = sqlite3.connect(str(db), isolation_level=None)
    c.execute("PRAGMA locking_mode=EXCLUSIVE")
    c.execute("BEGIN EXCLUSIVE")
    c.execute("SELECT count(*) FROM jobs").fetchone()
    return c


E0 = 1_000_000_000  # the simulated GPU 0's energy counter at the prolog (mJ)


# ================================================================== 1. start record unreadable or lost


def test_epilog_with_corrupt_start_table_records_partial_usage_not_nothing(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    corrupt_table(node.db, "job_starts")
    now_us = int(time.time() * 1e6)
    simgpu.set_gpu(node.state, 0, energy_mj=E0 + 5_000_000,
                   acct=[dict(pid=77, gpu_util=50, mem_util=10, max_mem_bytes=4 << 30, time_ms=1000,
                              start_time_us=now_us, is_running=0)])
    assert hooks.epilog(from_env(env), deps_for(node)) == 0
    (r,) = rows(node.db, "SELECT * FROM job_gpus")  # the rest of the database still takes records
    assert r["partial"] == 1 and "start record" in r["notes"]
    assert r["process_count"] == 1 and r["max_memory_bytes"] == 4 << 30
    assert r["energy_j"] is None  # unknown without the start counter: never a guess
    assert "start-record-unreadable" in node.log_text()


def test_epilog_with_database_exclusively_locked_spools_partial_record_and_ingest_completes_it(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, energy_mj=E0 + 5_000_000)
    locker = exclusive_lock(node.db)
    try:
        assert hooks.epilog(from_env(env), deps_for(node)) == 0
    finally:
        locker.close()
    (spooled,) = node.spool.glob("*job_end.json")
    assert json.load(open(spooled))["gpus"][0]["partial"] == 1
    st = Store(str(node.db), str(node.spool))
    assert st.ingest_spool() == (1, [])
    (r,) = rows(node.db, "SELECT * FROM job_gpus")
    # The start counters were in the database all along: ingest completes the record.
    assert r["partial"] == 0 and r["energy_j"] == pytest.approx(5000.0) and r["notes"] is None
    assert rows(node.db, "SELECT partial FROM jobs") == [{"partial": 0}]


def test_prolog_that_wrote_neither_database_nor_spool_leaves_partial_record_and_log_replay_completes_it(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    state = node.tmp / "state"
    node.db, node.spool = state / "usage.db", state / "spool"
    node.write_config()
    env = job_env(gpus="0")
    state.write_text("a file where the store's directory should be")  # neither database nor spool
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    assert "record-lost-to-log" in node.log_text()
    state.unlink()  # storage is back before the epilog
    simgpu.set_gpu(node.state, 0, energy_mj=E0 + 5_000_000)
    assert hooks.epilog(from_env(env), deps_for(node)) == 0
    (r,) = rows(node.db, "SELECT * FROM job_gpus")
    assert r["partial"] == 1 and r["energy_j"] is None
    cp = cli(node.config, "db", "ingest", "--from-log", str(node.tmp / "hooks.log"))
    assert cp.returncode == 0 and "1 record(s) replayed" in cp.stdout, (cp.stdout, cp.stderr)
    (r,) = rows(node.db, "SELECT * FROM job_gpus")
    assert r["partial"] == 0 and r["energy_j"] == pytest.approx(5000.0)
    # Replaying the same log again changes nothing.
    cp = cli(node.config, "db", "ingest", "--from-log", str(node.tmp / "hooks.log"))
    assert cp.returncode == 0 and rows(node.db, "SELECT count(*) AS n FROM job_starts") == [{"n": 1}]


def test_epilog_finds_start_record_that_was_spooled(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    Store(str(node.db), str(node.spool)).connect()
    locker = sqlite3.connect(str(node.db), isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        assert hooks.prolog(from_env(env), deps_for(node)) == 0
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert len(list(node.spool.glob("*job_start.json"))) == 1
    simgpu.set_gpu(node.state, 0, energy_mj=E0 + 5_000_000)
    assert hooks.epilog(from_env(env), deps_for(node)) == 0
    (r,) = rows(node.db, "SELECT * FROM job_gpus")
    assert r["partial"] == 0 and r["energy_j"] == pytest.approx(5000.0)


def test_epilog_without_any_start_record_records_partial_usage(sim_node):
    # slurm-gpu installed while the job ran (or the prolog failed open): the job did run here.
    node = sim_node(simgpu.h100_sxm(1))
    now_us = int(time.time() * 1e6)
    simgpu.set_gpu(node.state, 0, acct=[dict(pid=5, gpu_util=90, mem_util=5, max_mem_bytes=1 << 30, time_ms=2000,
                                             start_time_us=now_us - 2_000_000, is_running=0)])
    assert hooks.epilog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    (r,) = rows(node.db, "SELECT * FROM job_gpus")
    assert r["partial"] == 1 and r["process_count"] == 1 and r["energy_j"] is None
    assert r["start_time"] == pytest.approx(now_us / 1e6 - 2, abs=0.01)  # a lower bound: the first process
    assert "no-start-record" in node.log_text()


def test_epilog_after_failed_prolog_whose_records_were_spooled_records_no_usage(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=1)
    env = job_env(gpus="0")
    Store(str(node.db), str(node.spool)).connect()
    locker = sqlite3.connect(str(node.db), isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        assert hooks.prolog(from_env(env), deps_for(node)) == 1
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert list(node.spool.glob("*drain.json"))
    assert hooks.epilog(from_env(env), deps_for(node, slurm=RecordingSlurm(drained_reason="slurm-gpu: x"))) == 0
    assert rows(node.db, "SELECT count(*) AS n FROM job_gpus") == [{"n": 0}]
    assert "prolog-failed" in node.log_text()


def test_partial_record_of_a_job_whose_prolog_failed_is_dropped_when_the_evidence_arrives(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    rec = job_end(9, gpus=1)
    rec["gpus"][0]["partial"] = 1
    rec["job"]["partial"] = 1
    assert st.write(rec) == "db"
    assert st.write({"kind": "drain", "drain": {"time": 1.0, "node": "n1", "source": "prolog", "job_id": 9,
                                                "cluster": "c", "restart_count": 0, "reason": "x", "ok": 1}}) == "db"
    assert count(st.path) == 0 and count(st.path, "jobs") == 0


# ================================================================== 2. any exception while writing


def test_record_with_non_utf8_user_reaches_the_database(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    rec = job_end(1)
    rec["job"]["user"] = "al\udcffice"  # a byte that is not UTF-8, as os.environ hands it over
    for g in rec["gpus"]:
        g["user"] = "al\udcffice"
    assert st.write(rec) == "db"
    assert rows(st.path, "SELECT DISTINCT user FROM job_gpus") == [{"user": "al\\udcffice"}]


def test_malformed_spool_files_do_not_lose_the_record_or_skip_the_drain(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    spool_file(node.spool, "1-1-job_end.json", {"kind": "job_end"})  # KeyError
    spool_file(node.spool, "2-1-job_end.json", {"kind": "job_end", "job": [], "gpus": []})  # AttributeError
    spool_file(node.spool, "3-1-job_start.json", {"kind": "job_start", "starts": [1]})
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=3)
    deps = deps_for(node)
    assert hooks.epilog(from_env(env), deps) == 0
    assert len(deps.slurm.drains) == 1
    assert count(node.db) == 1 and rows(node.db, "SELECT ok FROM drains") == [{"ok": 1}]
    assert sorted(p.name for p in (node.spool / "quarantine").glob("*.json")) == [
        "1-1-job_end.json", "2-1-job_end.json", "3-1-job_start.json"]
    assert "spool-quarantined" in node.log_text()


def test_store_that_raises_anything_still_drains_and_logs_the_record_as_json(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=3)

    class Broken(Store):
        def write(self, record, **kw):
            raise RuntimeError("a bug in the store")

    deps = deps_for(node, store=Broken(str(node.db), str(node.spool)))
    assert hooks.epilog(from_env(env), deps) == 0
    assert len(deps.slurm.drains) == 1
    log = node.log_text()
    assert "record-lost-to-log" in log and "a bug in the store" in log
    # Both records (usage and drain) can be replayed from the log.
    cp = cli(node.config, "db", "ingest", "--from-log", str(node.tmp / "hooks.log"))
    assert cp.returncode == 0 and "2 record(s) replayed" in cp.stdout, (cp.stdout, cp.stderr)
    assert count(node.db) == 1 and count(node.db, "drains") == 1 and count(node.db, "health_events") == 1
    # The same lines are in the fixed fallback log; replaying those too adds nothing.
    cp = cli(node.config, "db", "ingest", "--from-log", os.environ["SLURM_GPU_FALLBACK_LOG"])
    assert cp.returncode == 0 and "2 record(s) replayed" in cp.stdout, (cp.stdout, cp.stderr)
    assert count(node.db) == 1 and count(node.db, "drains") == 1 and count(node.db, "health_events") == 1


# ================================================================== 3. stranded claims


def test_claim_left_by_a_killed_ingest_is_reported_and_reclaimed(tmp_path):
    db, spool = tmp_path / "u.db", tmp_path / "spool"
    st = Store(str(db), str(spool))
    st.connect()
    dead = simgpu.dead_pid()
    spool_file(spool, f".1-1-job_end.json.{dead}.claim", job_end(5))
    cfg = store_cfg(tmp_path, db, spool)
    cp = cli(cfg, "db", "check")
    assert cp.returncode == 1 and "1 stranded claim" in cp.stdout, cp.stdout
    cp = cli(cfg, "db", "ingest")
    assert cp.returncode == 0 and "ingested 1 of 1" in cp.stdout and "1 stranded claim(s) put back" in cp.stdout
    assert count(str(db), "jobs") == 1 and os.listdir(spool) == []
    assert cli(cfg, "db", "check").returncode == 0


def test_spool_file_whose_writer_died_mid_write_is_ingested_not_forgotten(tmp_path):
    spool = tmp_path / "spool"
    st = Store(str(tmp_path / "u.db"), str(spool))
    spool_file(spool, f".1-{simgpu.dead_pid()}-job_end.json.tmp", job_end(6))
    spool_file(spool, f".2-{os.getppid()}-job_end.json.tmp", job_end(7))  # its writer is still at it
    assert "1 spool file(s) whose writer died" in cli(store_cfg(tmp_path, st.path, spool), "db", "check").stdout
    assert st.ingest_spool() == (1, []) and count(st.path, "jobs") == 1
    assert os.listdir(spool) == [f".2-{os.getppid()}-job_end.json.tmp"]


def test_claim_of_a_live_ingest_is_left_alone(tmp_path):
    spool = tmp_path / "spool"
    st = Store(str(tmp_path / "u.db"), str(spool))
    spool_file(spool, f".1-1-job_end.json.{os.getppid()}.claim", job_end(5))
    assert st.ingest_spool() == (0, [])
    assert os.listdir(spool) == [f".1-1-job_end.json.{os.getppid()}.claim"]


# ================================================================== 4. a big backlog and the drain


def _backlog(spool, n):
    spool.mkdir(mode=0o700, exist_ok=True)
    for i in range(n):
        rec = json.dumps({"kind": "health", "events": [{"time": 1.0 + i, "node": "n1", "source": "test", "job_id": None,
                                                         "gpu_index": 0, "gpu_uuid": None, "check_name": "x",
                                                         "status": "WARN", "message": "m"}]})
        fd = os.open(spool / f"{1000 + i}-1-health.json", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, rec.encode())
        os.close(fd)


def test_big_spool_backlog_does_not_keep_the_epilog_from_draining(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    n = 30_000
    _backlog(node.spool, n)
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=2)

    class TimedSlurm(RecordingSlurm):
        def drain(self, node, reason):
            self.at = time.monotonic()
            super().drain(node, reason)

    deps = deps_for(node, slurm=TimedSlurm())
    t0 = time.monotonic()
    assert hooks.epilog(from_env(env), deps) == 0
    took = time.monotonic() - t0
    assert len(deps.slurm.drains) == 1 and count(node.db) == 1
    # The drain comes before any housekeeping (its time: the spool's 30,000 files are not read first),
    # and the housekeeping is bounded by its file count, not by how slow a loaded machine is (CI under
    # three suites at once: the epilog took 8.7 s of wall time, 2 of them the breaker's confirmation).
    assert deps.slurm.at - t0 < 2.0, (deps.slurm.at - t0, took)
    left = len(list(node.spool.glob("*.json")))
    assert n - HOOK_INGEST_BOUNDS["epilog"][0] <= left < n  # some housekeeping, bounded; the rest is for `db ingest`
    assert "spool-backlog" in node.log_text()
    done, problems = Store(str(node.db), str(node.spool)).ingest_spool()
    assert done == left and problems == [] and count(node.db, "health_events") >= n


# ================================================================== 5. poison files


def test_poison_spool_file_is_quarantined_and_later_files_still_ingest(tmp_path):
    db, spool = tmp_path / "u.db", tmp_path / "spool"
    st = Store(str(db), str(spool))
    st.connect()
    poison = job_end(1)
    del poison["gpus"][0]["start_time"]  # NOT NULL constraint
    spool_file(spool, "1-1-job_end.json", poison)
    spool_file(spool, "2-1-job_end.json", job_end(2))
    done, problems = st.ingest_spool()
    assert done == 1 and count(str(db), "jobs") == 1
    assert "quarantined" in problems[0] and "NOT NULL" in problems[0]
    assert os.listdir(spool / "quarantine") == ["1-1-job_end.json"]
    assert st.ingest_spool() == (0, [])  # never blocks a later ingest
    cp = cli(store_cfg(tmp_path, db, spool), "db", "check")
    assert cp.returncode == 1 and "1 quarantined" in cp.stdout and "1-1-job_end.json" in cp.stdout


# ================================================================== 6. first complete record wins


def test_rerun_epilog_does_not_overwrite_a_first_record_that_was_spooled(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, energy_mj=E0 + 5_000_000)
    locker = sqlite3.connect(str(node.db), isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        assert hooks.epilog(from_env(env), deps_for(node)) == 0  # 5 kJ, spooled
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    simgpu.set_gpu(node.state, 0, energy_mj=E0 + 50_000_000)
    assert hooks.epilog(from_env(env), deps_for(node)) == 0  # rerun: 50 kJ, straight to the database
    Store(str(node.db), str(node.spool)).ingest_spool()
    assert [r["energy_j"] for r in rows(node.db, "SELECT energy_j FROM job_gpus")] == [pytest.approx(5000.0)]


def test_rerun_fills_only_what_the_first_record_missed(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    first = job_end(1, gpus=1)
    first["gpus"][0].update(energy_j=None, max_memory_bytes=7)
    rerun = job_end(1, gpus=1)
    rerun["gpus"][0].update(energy_j=99.0, max_memory_bytes=1000, end_time=20.0, duration_s=19.0)
    rerun["job"]["end_time"] = 20.0
    st.write(rerun)
    st.write(first)  # the first record arrives last (it was spooled)
    (r,) = rows(st.path, "SELECT energy_j, max_memory_bytes, end_time FROM job_gpus")
    assert r == {"energy_j": 99.0, "max_memory_bytes": 7, "end_time": 11.0}


def test_complete_record_replaces_a_partial_one(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    partial = job_end(1, gpus=1)
    partial["gpus"][0].update(partial=1, notes="start record unknown", energy_j=None)
    partial["job"]["partial"] = 1
    st.write(partial)
    st.write(job_end(1, gpus=1))
    (r,) = rows(st.path, "SELECT partial, notes, energy_j FROM job_gpus")
    assert r == {"partial": 0, "notes": None, "energy_j": 5.0}
    st.write(partial)  # a partial record never touches a complete one
    assert rows(st.path, "SELECT partial, notes, energy_j FROM job_gpus") == [r]


def test_rerun_epilog_does_not_duplicate_health_events(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=2, temperature=95)
    for _ in range(2):
        assert hooks.epilog(from_env(env), deps_for(node)) == 0
    got = rows(node.db, "SELECT check_name, count(*) AS n FROM health_events GROUP BY check_name")
    assert got and all(r["n"] == 1 for r in got), got


# ================================================================== 7. symlinks and permissive directories


@needs_root
def test_world_writable_spool_directory_is_refused_and_a_forged_record_never_ingested(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    node.spool.mkdir()
    os.chmod(node.spool, 0o777)  # pre-existing, world-writable
    forged = job_end(666, gpus=1)
    forged["gpus"][0].update(user="victim", duration_s=8e9, end_time=8e9 + 1)
    p = spool_file(node.spool, "1-1-job_end.json", forged, mode=0o644, uid=NOBODY)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    assert rows(node.db, "SELECT * FROM job_gpus") == []
    assert p.exists()  # left for the admin to look at
    log = node.log_text()
    assert str(node.spool) in log and "writable by" in log


@needs_root
def test_spool_file_not_owned_by_root_or_writable_by_others_is_never_ingested(tmp_path):
    db, spool = tmp_path / "u.db", tmp_path / "spool"
    st = Store(str(db), str(spool))
    st.connect()
    spool_file(spool, "1-1-job_end.json", job_end(1), uid=NOBODY)
    spool_file(spool, "2-1-job_end.json", job_end(2), mode=0o666)
    done, problems = st.ingest_spool()
    assert done == 0 and count(str(db), "jobs") == 0
    assert sorted(os.listdir(spool / "quarantine")) == ["1-1-job_end.json", "2-1-job_end.json"]
    assert any("owned by uid 65534" in p for p in problems) and any("writable" in p for p in problems)


def test_symlinked_spool_directory_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "1-1-job_end.json").write_text(json.dumps(job_end(1)))
    (target / ".precious.123.claim").write_text("x")
    before = sorted(os.listdir(target))
    spool = tmp_path / "spool"
    spool.symlink_to(target)
    st = Store(str(tmp_path / "u.db"), str(spool))
    st.connect()
    done, problems = st.ingest_spool()
    assert done == 0 and "symbolic link" in problems[0] and str(spool) in problems[0]
    st.close()
    locker = sqlite3.connect(st.path, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        from slurm_gpu.errors import StoreError
        with pytest.raises(StoreError, match="symbolic link"):
            Store(st.path, str(spool), busy_timeout_s=0.2).write(job_end(2))
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert sorted(os.listdir(target)) == before and count(st.path, "jobs") == 0


def test_symlinked_log_file_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "hooks.log"
    link.symlink_to(victim)
    log = HookLog("prolog", syslog_on=False, path=str(link))
    log.info("pass", job=1)
    assert victim.read_text() == "precious\n"
    assert log.problems and "symbolic link" in log.problems[0] and str(link) in log.problems[0]


def test_symlinked_database_is_refused_and_its_target_not_turned_into_sqlite(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    db = tmp_path / "usage.db"
    db.symlink_to(victim)
    st = Store(str(db), str(tmp_path / "spool"))
    where = st.write(job_end(1))
    assert where.startswith("spool:")
    assert "symbolic link" in json.load(open(where[6:]))["_spool_reason"]
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "victim.txt-wal").exists()
    cp = cli(store_cfg(tmp_path, db, tmp_path / "spool"), "db", "check")
    assert cp.returncode == 1 and "symbolic link" in cp.stdout + cp.stderr


@needs_root
def test_database_not_owned_by_root_is_refused(tmp_path):
    db = tmp_path / "usage.db"
    st = Store(str(db), str(tmp_path / "spool"))
    assert st.write(job_end(1)) == "db"
    st.close()
    os.chown(db, NOBODY, -1)
    where = Store(str(db), str(tmp_path / "spool")).write(job_end(2))
    assert where.startswith("spool:") and "owned by uid 65534" in json.load(open(where[6:]))["_spool_reason"]
    cp = cli(store_cfg(tmp_path, db, tmp_path / "spool"), "db", "check")
    assert cp.returncode == 1 and "owned by uid 65534" in cp.stdout + cp.stderr


@needs_root
def test_group_writable_database_directory_is_refused(tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    os.chmod(d, 0o775)
    where = Store(str(d / "usage.db"), str(tmp_path / "spool")).write(job_end(1))
    assert where.startswith("spool:") and "writable by" in json.load(open(where[6:]))["_spool_reason"]
    assert not (d / "usage.db").exists()


# ================================================================== 8. every drain in the drains table


def test_epilog_drain_that_slurm_ignored_is_recorded_as_kept_not_taken(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=2)
    slurm = RecordingSlurm(drained_reason="Prolog error")
    assert hooks.epilog(from_env(env), deps_for(node, slurm=slurm)) == 0
    (d,) = rows(node.db, "SELECT source, ok, outcome, kept_reason, reason FROM drains")
    assert d["source"] == "epilog" and d["ok"] == 0 and d["outcome"] == "kept"
    assert d["kept_reason"] == "Prolog error" and d["reason"].startswith("slurm-gpu: ")


class MemSlurm:
    """Enough of a Slurm backend for the admin commands: node states, drains."""

    timeout_s = 1.0

    def __init__(self, **reasons):
        self.reasons = reasons
        self.actions = []

    def _info(self, name):
        from slurm_gpu.slurm.model import NodeInfo, split_state
        r = self.reasons.get(name, "")
        state = "IDLE+DRAIN" if r else "IDLE"
        return NodeInfo(name, state, split_state(state), r, "root" if r else "", 1.7e9 if r else None, "gpu:h100:1", "", 1, 0)

    def node(self, name):
        return self._info(name)

    def lookup_nodes(self, names):
        from slurm_gpu.slurm.model import NodeLookup
        return NodeLookup({n: self._info(n) for n in names}, {})

    def drain(self, name, reason):
        self.actions.append(("drain", name, reason))

    def drain_many(self, names, reason):
        from slurm_gpu.slurm.model import BatchResult
        for n in names:
            self.drain(n, reason)
        return BatchResult(done=list(names), requests=1)


def _app(cfg):
    return types.SimpleNamespace(config=config.load(str(cfg)), config_path=str(cfg))


def test_manual_drain_is_recorded_in_the_drains_table(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from slurm_gpu import cli as cli_mod
    from slurm_gpu.cli import admin as cli_admin
    cfg = store_cfg(tmp_path, tmp_path / "u.db", tmp_path / "spool")
    backend = MemSlurm(gpu02="maintenance")
    monkeypatch.setattr(cli_admin, "_backend", lambda app: backend)
    res = CliRunner().invoke(cli_mod.main, ["--config", str(cfg), "drain", "gpu01", "gpu02", "--reason", "RMA"])
    assert res.exit_code == 0, res.output
    got = rows(tmp_path / "u.db", "SELECT node, source, ok, outcome, kept_reason, reason FROM drains ORDER BY node")
    assert [(r["node"], r["source"], r["ok"], r["outcome"], r["kept_reason"]) for r in got] == [
        ("gpu01", "manual", 1, "drained", None), ("gpu02", "manual", 0, "kept", "maintenance")]
    assert got[0]["reason"].startswith("slurm-gpu: RMA [manual by ")


@pytest.mark.parametrize("allow_resume,context,source", [(True, "healthcheck", "healthcheck"),
                                                         (False, "drain --unhealthy", "drain --unhealthy")])
def test_healthcheck_and_drain_unhealthy_drains_are_recorded(tmp_path, monkeypatch, allow_resume, context, source):
    from slurm_gpu.cli import admin as cli_admin
    from slurm_gpu.policy.health import CheckResult
    cfg = store_cfg(tmp_path, tmp_path / "u.db", tmp_path / "spool")
    backend = MemSlurm()
    monkeypatch.setattr(cli_admin, "_backend", lambda app: backend)
    fail = [CheckResult("ecc_uncorrectable", "FAIL", 2, "GPU-ab", "GPU 2 (GPU-ab) uncorrectable ECC errors: 2")]
    with pytest.raises(SystemExit) as e:
        cli_admin._run_health(_app(cfg), "gpu01", allow_resume=allow_resume, dry_run=False, deadline_s=30,
                              context=context, checker=lambda info: fail)
    assert e.value.code == 1 and backend.actions
    (d,) = rows(tmp_path / "u.db", "SELECT node, source, ok, outcome, reason FROM drains")
    assert (d["node"], d["source"], d["ok"], d["outcome"]) == ("gpu01", source, 1, "drained")
    assert "uncorrectable ECC errors: 2" in d["reason"]


# ================================================================== 9. messages that say what happened


def test_db_check_on_a_newer_schema_says_upgrade_slurm_gpu(tmp_path):
    db = tmp_path / "u.db"
    c = sqlite3.connect(db)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    c.close()
    assert any("upgrade slurm-gpu" in p for p in integrity_check(str(db)))
    cp = cli(store_cfg(tmp_path, db, tmp_path / "spool"), "db", "check")
    assert cp.returncode == 1 and "upgrade slurm-gpu" in cp.stdout + cp.stderr
    assert "run any hook" not in cp.stdout + cp.stderr


def test_disk_full_is_reported_as_disk_full_not_cannot_rollback(tmp_path):
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    assert st.write(job_end(1)) == "db"
    conn = st.connect()
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")  # the disk is full
    big = job_end(2, gpus=200)
    for g in big["gpus"]:
        g["xid_events"] = "x" * 3000
    where = st.write(big)
    reason = json.load(open(where[6:]))["_spool_reason"]
    assert "disk full" in reason and "rollback" not in reason


def test_healthcheck_drain_that_did_not_reach_slurm_is_recorded_as_failed(tmp_path, monkeypatch):
    from slurm_gpu.cli import admin as cli_admin
    from slurm_gpu.errors import SlurmError
    from slurm_gpu.policy.health import CheckResult
    cfg = store_cfg(tmp_path, tmp_path / "u.db", tmp_path / "spool")

    class Down(MemSlurm):
        def drain(self, name, reason):
            raise SlurmError("slurmctld not reachable", "scontrol ping")

    monkeypatch.setattr(cli_admin, "_backend", lambda app: Down())
    fail = [CheckResult("ecc_uncorrectable", "FAIL", 2, "GPU-ab", "GPU 2 (GPU-ab) uncorrectable ECC errors: 2")]
    # The error goes up to the CLI group, the one place that prints it and exits 4 (docs/exit-codes.md).
    with pytest.raises(SlurmError) as e:
        cli_admin._run_health(_app(cfg), "gpu01", allow_resume=True, dry_run=False, deadline_s=30,
                              context="healthcheck", checker=lambda info: fail)
    assert e.value.exit_code == 4
    assert rows(tmp_path / "u.db", "SELECT source, ok, outcome FROM drains") == [
        {"source": "healthcheck", "ok": 0, "outcome": "failed"}]
