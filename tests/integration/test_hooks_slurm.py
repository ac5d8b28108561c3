"""The prolog and epilog under real slurmd: real sbatch jobs of an unprivileged user, simulated GPUs.

Each node's hooks see that node's simulated driver: the library is built with a default state
path containing %n, which it fills from SLURMD_NODENAME (slurmd gives hooks no other environment).
"""
from __future__ import annotations

import sqlite3
import time

import pytest
import simgpu

from .sites import node_reasons, wait_running

pytestmark = pytest.mark.slurm


def test_healthy_job_records_usage_per_gpu_from_driver_counters(cluster, site):
    job = cluster.sbatch("sleep 4", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:2"])
    wait_running(cluster, site, "gpu01", job)
    # While the job runs the driver counts energy and the job's processes (per-process accounting).
    now_us = int(time.time() * 1e6)
    for i in range(4):
        simgpu.set_gpu(site.state("gpu01"), i, energy_mj=1_000_000_000 + i * 1_000_003 + 12_000_000,
                       acct=[dict(pid=4000 + i, gpu_util=90, mem_util=40, max_mem_bytes=(10 + i) << 30,
                                  time_ms=2000, start_time_us=now_us, is_running=0)])
    assert cluster.wait_job(job, timeout=60) == "COMPLETED"
    rows = site.rows("gpu01", "SELECT * FROM job_gpus WHERE job_id = ?", job)
    assert len(rows) == 2, site.log("gpu01")
    uuids = {g["uuid"] for g in simgpu.h100_sxm(4, seed="gpu01")["gpus"]}
    for r in rows:
        assert r["gpu_uuid"] in uuids and r["gpu_index"] in (0, 1)
        assert (r["user"], r["account"], r["partition"], r["node"], r["cluster"]) == \
               ("sgtest", "physics", "gpu", "gpu01", "sgtest")
        assert r["energy_j"] == pytest.approx(12_000.0)
        assert r["max_memory_bytes"] == (10 + r["gpu_index"]) << 30 and r["process_count"] == 1
        # 90 % for 2 s of a job of ~4-5 s
        assert 30 < r["gpu_util_mean_pct"] < 50, r
    # Clocks reset and earlier jobs' PIDs cleared; accounting, read as on already, is not set again.
    assert {a["function"] for a in simgpu.read_actions(site.state("gpu01"))} >= {
        "nvmlDeviceResetApplicationsClocks", "nvmlDeviceClearAccountingPids"}
    assert all(simgpu.read_state(site.state("gpu01"))[f"gpu.{i}.accounting_mode"] == "1" for i in (0, 1))
    assert cluster.node_info("gpu01")["State"] == "IDLE"


def test_job_on_gpu_with_uncorrectable_ecc_drains_node_and_finishes_elsewhere(cluster, site):
    for i in range(4):
        simgpu.set_gpu(site.state("gpu01"), i, ecc_volatile_uncorrected=2)
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:2"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    assert cluster.job_info(job)["NodeList"] == "gpu02"
    reasons = {r["node"]: r["reason"] for r in node_reasons(cluster)}
    assert "gpu01" in reasons and "gpu02" not in reasons
    ours = site.rows("gpu01", "SELECT reason FROM drains")
    assert ours and ours[0]["reason"].startswith("slurm-gpu: GPU 0 (GPU-")
    assert "uncorrectable ECC errors: 2" in ours[0]["reason"] and f"[prolog job {job}; check " in ours[0]["reason"]
    assert reasons["gpu01"] == ours[0]["reason"], reasons  # Slurm kept our reason, not "Prolog error"
    # The requeued run is recorded on gpu02 with restart count 1.
    restarts = site.rows("gpu02", "SELECT DISTINCT restart_count FROM job_gpus WHERE job_id=?", job)
    assert [r["restart_count"] for r in restarts] == [1]
    # gpu01's epilog runs after the requeue (SLURM_JOB_RESTART_COUNT already 1): the job never
    # ran there, so no usage - not even a partial record - may be recorded for it.
    assert site.rows("gpu01", "SELECT job_id, restart_count, partial FROM job_gpus WHERE job_id=?", job) == [], site.log("gpu01")


def test_hung_gpu_drains_within_deadline_and_prolog_does_not_hang(cluster, site):
    for i in range(4):
        simgpu.inject_hang(site.state("gpu01"), i, "nvmlDeviceGetTemperature", 600)
    t0 = time.monotonic()
    job = cluster.sbatch("true", args=["-p", "gpu", "--gres=gpu:1"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    assert time.monotonic() - t0 < 45
    ours = site.rows("gpu01", "SELECT reason FROM drains")
    assert ours and "nvmlDeviceGetTemperature timed out after 2s" in ours[0]["reason"], site.log("gpu01")
    assert "DRAIN" in cluster.node_info("gpu01")["State"]


def test_leftover_process_is_terminated_by_epilog(cluster, site):
    pidfile = cluster.jobs_dir / "leftover.pid"
    job = cluster.sbatch(f"setsid -f sh -c 'echo $$ > {pidfile}; exec sleep 300'; sleep 3",
                         args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    wait_running(cluster, site, "gpu01", job)
    end = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < end:
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    if cluster.cgroups:
        # proctrack/cgroup ends whatever stays in the job's cgroup before the epilog runs
        # (test_cgroup_processes_slurm.py): the epilog's own kill is for a process that left it,
        # still carrying the job's SLURM_JOB_ID.
        cluster.escape_cgroups(pid)
    simgpu.set_gpu(site.state("gpu01"), 0, procs=[(pid, 2 << 30)])
    assert cluster.wait_job(job, timeout=60) == "COMPLETED"
    _wait_gone(pid)
    assert f"leftover-processes job={job} " in site.log("gpu01") and f"pids={pid}" in site.log("gpu01")
    assert cluster.node_info("gpu01")["State"] == "IDLE"
    assert len(site.rows("gpu01", "SELECT * FROM job_gpus WHERE job_id=?", job)) == 1


def test_process_of_another_user_on_the_jobs_gpu_is_not_killed_and_drains_node(cluster, site):
    # A root process (pid 2, kthreadd) on the job's GPU after the job: not the job's (uid
    # sgtest), so the epilog never signals it; the leftover check drains the node instead.
    # (A process of the job that survives SIGKILL: tests/test_hooks.py.)
    job = cluster.sbatch("sleep 2", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    wait_running(cluster, site, "gpu01", job)
    simgpu.set_gpu(site.state("gpu01"), 0, procs=[(2, 1 << 30)])
    cluster.wait_job(job, timeout=60)
    cluster.wait_node_state("gpu01", "DRAIN", timeout=30)
    reason = {r["node"]: r["reason"] for r in node_reasons(cluster)}["gpu01"]
    assert reason.startswith("slurm-gpu:") and "still on the GPU (pid 2)" in reason and f"[epilog job {job}; check " in reason
    assert "leftover-processes-not-ours" in site.log("gpu01") and "SIGKILL" not in reason


def test_jobs_ending_together_on_one_node_all_recorded(cluster, site):
    jobs = [cluster.sbatch("sleep 3", args=["-p", "gpu", "-w", "gpu02", "--gres=gpu:1"]) for _ in range(4)]
    for j in jobs:
        assert cluster.wait_job(j, timeout=90) == "COMPLETED"
    marks = ",".join("?" * len(jobs))
    got = site.rows("gpu02", f"SELECT job_id, gpu_uuid FROM job_gpus WHERE job_id IN ({marks})", *jobs)
    assert sorted(r["job_id"] for r in got) == sorted(jobs)
    assert len({r["gpu_uuid"] for r in got}) == 4  # four different GPUs, mapped through minors 4-7


def test_unwritable_database_spools_record_then_ingests(cluster, site):
    first = cluster.sbatch("true", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    assert cluster.wait_job(first, timeout=60) == "COMPLETED"  # creates the database
    job = cluster.sbatch("sleep 3", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    wait_running(cluster, site, "gpu01", job)
    locker = sqlite3.connect(str(site.db("gpu01")), isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # held past the epilog's busy timeout
    try:
        assert cluster.wait_job(job, timeout=60) == "COMPLETED"
        spool = site.root / "gpu01" / "spool"
        assert len(list(spool.glob("*-job_end.json"))) == 1, site.log("gpu01")
        assert site.rows("gpu01", "SELECT * FROM job_gpus WHERE job_id=?", job) == []
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    nxt = cluster.sbatch("true", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    assert cluster.wait_job(nxt, timeout=60) == "COMPLETED"
    assert len(site.rows("gpu01", "SELECT * FROM job_gpus WHERE job_id=?", job)) == 1
    assert list((site.root / "gpu01" / "spool").glob("*.json")) == []
    assert cluster.node_info("gpu01")["State"] == "IDLE"


def _wait_gone(pid: int, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} still alive")
