"""Prolog/epilog flows on simulated GPUs and a real on-disk SQLite database.

Slurm itself is replaced here by a recording backend (the seam HookDeps.slurm); the same flows
run under real slurmd in tests/integration/test_hooks_slurm.py.
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
import types

import pytest
import simgpu

from slurm_gpu import config
from slurm_gpu.errors import SlurmError
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.hooks.log import HookLog
from slurm_gpu.slurm.jobenv import from_env


class RecordingSlurm:
    def __init__(self, fail: bool = False, drained_reason: str = ""):
        self.drains = []
        self.fail = fail
        self.drained_reason = drained_reason

    def node(self, name):
        if self.fail:
            raise SlurmError("slurmctld not reachable: Unable to contact slurm controller", "scontrol ping")
        return types.SimpleNamespace(name=name, drained=bool(self.drained_reason), reason=self.drained_reason)

    def drain(self, node, reason):
        if self.fail:
            raise SlurmError("slurmctld not reachable: Unable to contact slurm controller", "scontrol ping")
        self.drains.append((node, reason))

    def nodes(self, names=None):
        return [self.node(n) for n in (names or ["gpu01"])]


def job_env(job_id=4711, gpus="0,1", node="gpu01", restart=0, **extra):
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_GPUS": gpus, "SLURMD_NODENAME": node,
           "SLURM_CLUSTER_NAME": "sgtest", "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "2501",
           "SLURM_JOB_ACCOUNT": "physics", "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_RESTART_COUNT": str(restart)}
    env.update(extra)
    return env


def deps_for(node, slurm=None, now=None, **kw):
    cfg = config.load(str(node.config))
    os.environ["SIMNVML_STATE"] = str(node.state)
    return hooks.HookDeps(cfg=cfg, log=HookLog("test", syslog_on=False, path=str(node.tmp / "hooks.log")),
                          reader=NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s), slurm=slurm or RecordingSlurm(),
                          now=now or time.time, **kw)


def rows(db, sql, *args):
    conn = sqlite3.connect(str(db))
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, args)]
    finally:
        conn.close()


def test_prolog_resets_clocks_enables_accounting_and_records_start(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    simgpu.set_gpu(node.state, 0, persistence_mode=0, accounting_mode=0)
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0,2")), deps) == 0
    acts = simgpu.read_actions(node.state)
    touched = {a["gpu"] for a in acts}
    assert touched == {0, 2}, acts  # only the job's GPUs
    fns = [a["function"] for a in acts if a["gpu"] == 0]
    for fn in ("nvmlDeviceSetPersistenceMode", "nvmlDeviceResetApplicationsClocks", "nvmlDeviceResetGpuLockedClocks",
               "nvmlDeviceResetMemoryLockedClocks", "nvmlDeviceSetAccountingMode", "nvmlDeviceClearAccountingPids"):
        assert fn in fns
    # GPU 2 was read with persistence and accounting on: those modes are not written again,
    # while its clocks are reset and the PIDs of earlier jobs cleared as on GPU 0.
    on_already = [a["function"] for a in acts if a["gpu"] == 2]
    assert "nvmlDeviceSetPersistenceMode" not in on_already and "nvmlDeviceSetAccountingMode" not in on_already
    for fn in ("nvmlDeviceResetApplicationsClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceResetMemoryLockedClocks",
               "nvmlDeviceClearAccountingPids"):
        assert fn in on_already, on_already
    starts = rows(node.db, "SELECT * FROM job_starts ORDER BY gpu_index")
    assert [s["gpu_index"] for s in starts] == [0, 2]
    assert starts[0]["energy_mj"] == 1_000_000_000 and starts[0]["gpu_uuid"].startswith("GPU-")
    assert deps.slurm.drains == []


def test_prolog_drains_on_uncorrectable_ecc_naming_gpu_and_job(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    simgpu.set_gpu(node.state, 1, ecc_volatile_uncorrected=2)
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps) == 1
    (n, reason), = deps.slurm.drains
    assert n == "gpu01"
    assert reason.startswith("slurm-gpu: GPU 1 (GPU-") and "uncorrectable ECC errors: 2" in reason
    assert reason.endswith("[prolog job 4711; check ecc_uncorrectable]")
    assert rows(node.db, "SELECT reason, ok FROM drains") == [{"reason": reason, "ok": 1}]
    assert rows(node.db, "SELECT check_name, status FROM health_events") == [
        {"check_name": "ecc_uncorrectable", "status": "FAIL"}]
    # No reset of a faulty GPU, no start record for a job that will not run here.
    assert simgpu.read_actions(node.state) == []


def test_prolog_ignores_fault_on_a_gpu_the_job_did_not_get(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    simgpu.set_gpu(node.state, 3, ecc_volatile_uncorrected=5, temperature=99)
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps) == 0
    assert deps.slurm.drains == []


def test_prolog_fails_on_leftover_memory_of_previous_job(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 0, memory_used=10 << 30)
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps) == 1
    assert "leaked memory" in deps.slurm.drains[0][1]


def test_prolog_without_gpus_does_nothing(sim_node):
    node = sim_node()
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="")), deps) == 0
    assert not node.db.exists() and simgpu.read_actions(node.state) == []


def _run_job(node, deps_factory, env, acct):
    assert hooks.prolog(from_env(env), deps_factory()) == 0
    for i, recs in acct.items():
        simgpu.set_gpu(node.state, i, acct=recs)


def test_epilog_records_energy_utilisation_and_memory_from_driver_counters(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    t0 = 1_800_000_000.0
    clock = {"t": t0}
    env = job_env(gpus="1,2")
    assert hooks.prolog(from_env(env), deps_for(node, now=lambda: clock["t"])) == 0
    start_us = int((t0 + 1) * 1e6)
    # Job ran 100 s.  GPU 1: two processes, 50 s at 80 % and 25 s at 40 % -> (40+10)/100 = 50 %.
    simgpu.set_gpu(node.state, 1, energy_mj=1_000_003 + 1_000_000_000 + 30_000_000,
                   acct=[dict(pid=101, gpu_util=80, mem_util=30, max_mem_bytes=20 << 30, time_ms=50_000,
                              start_time_us=start_us, is_running=0),
                         dict(pid=102, gpu_util=40, mem_util=10, max_mem_bytes=30 << 30, time_ms=25_000,
                              start_time_us=start_us + 50_000_000, is_running=0)])
    # GPU 2 held idle the whole job.
    simgpu.set_gpu(node.state, 2, energy_mj=2 * 1_000_003 + 1_000_000_000 + 7_000_000, acct=[])
    clock["t"] = t0 + 100
    assert hooks.epilog(from_env(dict(env, SLURM_JOB_EXIT_CODE="0")), deps_for(node, now=lambda: clock["t"])) == 0
    got = {r["gpu_index"]: r for r in rows(node.db, "SELECT * FROM job_gpus")}
    assert set(got) == {1, 2}
    g1, g2 = got[1], got[2]
    assert g1["energy_j"] == pytest.approx(30_000.0) and g2["energy_j"] == pytest.approx(7_000.0)
    assert g1["gpu_util_mean_pct"] == pytest.approx(50.0) and g1["mem_util_mean_pct"] == pytest.approx(17.5)
    assert g1["max_memory_bytes"] == 30 << 30 and g1["process_count"] == 2
    assert g2["gpu_util_mean_pct"] == 0.0 and g2["process_count"] == 0
    assert g1["duration_s"] == pytest.approx(100.0)
    assert (g1["user"], g1["account"], g1["partition"], g1["node"], g1["cluster"]) == \
        ("alice", "physics", "gpu", "gpu01", "sgtest")
    assert g1["gpu_model"] == "NVIDIA H100 80GB HBM3" and g1["ecc_uncorrected_delta"] == 0
    job = rows(node.db, "SELECT * FROM jobs")
    assert len(job) == 1 and job[0]["gpu_count"] == 2 and job[0]["exit_code"] == "0"


def test_epilog_run_twice_does_not_duplicate_or_overwrite(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, energy_mj=1_000_000_000 + 5_000_000)
    assert hooks.epilog(from_env(env), deps_for(node)) == 0
    first = rows(node.db, "SELECT * FROM job_gpus")
    simgpu.set_gpu(node.state, 0, energy_mj=1_000_000_000 + 9_000_000)
    assert hooks.epilog(from_env(env), deps_for(node)) == 0
    assert rows(node.db, "SELECT * FROM job_gpus") == first
    # A requeued job (restart count 1) is a new record: from 25.11 with a SLUID of its own (the
    # first run's record, made before, has none).
    env1 = job_env(gpus="0", restart=1, SLURM_JOB_SLUID="s0KRJ2ZB1C8100")
    assert hooks.prolog(from_env(env1), deps_for(node)) == 0
    assert hooks.epilog(from_env(env1), deps_for(node)) == 0
    assert [(r["restart_count"], r["sluid"]) for r in rows(node.db, "SELECT restart_count, sluid FROM job_gpus ORDER BY 1")] \
        == [(0, None), (1, "s0KRJ2ZB1C8100")]
    assert [r["sluid"] for r in rows(node.db, "SELECT sluid FROM jobs ORDER BY restart_count")] == [None, "s0KRJ2ZB1C8100"]


def test_epilog_kills_leftover_process_with_term(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    env = job_env(gpus="1", SLURM_JOB_UID=str(os.getuid()))  # the job's own process
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            env=dict(os.environ, SLURM_JOB_ID="4711"))
    try:
        simgpu.set_gpu(node.state, 1, procs=[(proc.pid, 1 << 30)])
        deps = deps_for(node)
        assert hooks.epilog(from_env(env), deps) == 0
        assert proc.wait(timeout=5) == -15  # SIGTERM
        assert deps.slurm.drains == []
    finally:
        proc.kill()


def test_epilog_drains_when_a_process_survives_kill(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    node.write_config("[hooks]\nkill_grace_s = 0.2\n")
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    # A process that no signal removes, like one stuck in the driver in D state: a kernel
    # thread (kthreadd, pid 2) ignores SIGTERM and SIGKILL, so sending them is harmless.
    survivor = 2
    assert open(f"/proc/{survivor}/stat").read().split()[1] == "(kthreadd)"
    simgpu.set_gpu(node.state, 0, procs=[(survivor, 1 << 30)])
    deps = deps_for(node, owns=lambda pid, job: True)  # as if the job's own process
    assert hooks.epilog(from_env(env), deps) == 0
    (n, reason), = deps.slurm.drains
    assert "survived SIGKILL" in reason and "pid 2 " in reason and reason.endswith("[epilog job 4711; check leftover_processes]")
    assert rows(node.db, "SELECT count(*) AS n FROM job_gpus")[0]["n"] == 1  # still recorded


def test_epilog_exits_nonzero_when_drain_cannot_reach_slurm(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, remapped_pending=1)
    assert hooks.epilog(from_env(env), deps_for(node, slurm=RecordingSlurm(fail=True))) == 1
    assert rows(node.db, "SELECT ok FROM drains") == [{"ok": 0}]


def test_epilog_spools_when_database_unwritable_and_next_write_ingests(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(job_id=10, gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    # Another process holds the write lock past the busy timeout.
    locker = sqlite3.connect(str(node.db), isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        assert hooks.epilog(from_env(env), deps_for(node)) == 0
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    spooled = list(node.spool.glob("*-job_end.json"))
    assert len(spooled) == 1 and oct(spooled[0].stat().st_mode & 0o777) == "0o600"
    assert rows(node.db, "SELECT count(*) AS n FROM job_gpus")[0]["n"] == 0
    env2 = job_env(job_id=11, gpus="0")
    assert hooks.prolog(from_env(env2), deps_for(node)) == 0  # a successful write ingests the spool
    assert [r["job_id"] for r in rows(node.db, "SELECT job_id FROM job_gpus")] == [10]
    assert list(node.spool.glob("*.json")) == []


def test_bad_slurm_job_gpus_is_logged_error_not_traceback(sim_node):
    node = sim_node()
    cp = subprocess.run([sys.executable, "-c", "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=node.env(**job_env(gpus="0,abc")), capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0  # fail_open
    assert "Traceback" not in cp.stderr and "SLURM_JOB_GPUS='0,abc'" in node.log_text()
    node.write_config("[hooks]\nfail_open = false\n")
    cp = subprocess.run([sys.executable, "-c", "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=node.env(**job_env(gpus="0,abc")), capture_output=True, text=True, timeout=60)
    assert cp.returncode == 1


def test_missing_job_id_is_a_clear_error(sim_node):
    node = sim_node()
    env = node.env(**job_env())
    del env["SLURM_JOB_ID"]
    cp = subprocess.run([sys.executable, "-c", "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=env, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0 and "SLURM_JOB_ID is not set" in node.log_text()


def test_broken_config_fails_open_with_one_line(sim_node):
    node = sim_node()
    node.write_config("[health]\nmax_temperature_c = 'hot'\n")
    cp = subprocess.run([sys.executable, "-c", "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=node.env(**job_env()), capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0
    assert "max_temperature_c" in cp.stderr and "Traceback" not in cp.stderr
    # Only the broken key falls back to its default: the job is still gated and recorded.
    assert len(rows(node.db, "SELECT * FROM job_starts")) == 2


def test_prolog_with_hung_gpu_finishes_within_deadline_and_drains(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config(nvml_timeout_s=1.0)
    simgpu.inject_hang(node.state, 1, "nvmlDeviceGetPowerUsage", 120)
    deps = deps_for(node)
    t0 = time.monotonic()
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps) == 1
    assert time.monotonic() - t0 < 5
    assert "nvmlDeviceGetPowerUsage timed out" in deps.slurm.drains[0][1]


def test_hook_deadline_ends_a_stuck_hook(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    # The NVML timeout is longer than the whole hook budget: the watchdog must end the hook.
    node.write_config("[hooks]\nprolog_deadline_s = 1.5\n", nvml_timeout_s=30.0)
    simgpu.inject_hang(node.state, 0, "nvmlDeviceGetUUID", 120)
    t0 = time.monotonic()
    cp = subprocess.run([sys.executable, "-c", "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=node.env(**job_env(gpus="0")), capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 10
    assert cp.returncode == 0 and "deadline-exceeded" in node.log_text()


def test_gres_index_maps_through_minor_numbers(sim_node):
    # A node whose device minors are 4-7 (second node of a shared testbed, or odd BIOS order).
    prof = simgpu.h100_sxm(4)
    for i, g in enumerate(prof["gpus"]):
        g["minor"] = [6, 4, 7, 5][i]
    node = sim_node(prof)
    deps = deps_for(node)  # no slurm.conf: the fallback numbers GPUs by device minor
    gmap = hooks.map_gpus(deps, from_env(job_env(gpus="0-3")))
    assert {g.slurm_index: g.nvml_index for g in gmap.gpus} == {0: 1, 1: 3, 2: 0, 3: 2}
    assert gmap.source == "minor order" and "gres-map-fallback" in node.log_text()


def test_fault_on_already_drained_node_keeps_existing_reason(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=1)
    slurm = RecordingSlurm(drained_reason="maintenance")
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node, slurm=slurm)) == 1
    assert slurm.drains == []  # an admin's drain is never replaced by ours
    assert "already-drained" in node.log_text() and "maintenance" in node.log_text()


def test_fault_on_down_node_keeps_slurms_reason(sim_node):
    # policy/drain.py: a DOWN node is someone else's (Slurm's "Not responding", an admin's);
    # the hooks used to drain it over that reason, healthcheck did not.
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=1)

    class DownSlurm(RecordingSlurm):
        def node(self, name):
            return types.SimpleNamespace(name=name, drained=False, down=True, reason="Not responding")

    slurm = DownSlurm()
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node, slurm=slurm)) == 1
    assert slurm.drains == []
    assert "already-drained" in node.log_text() and "Not responding" in node.log_text()


def test_epilog_after_failed_prolog_records_no_usage(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=1)
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 1
    # slurmd runs the epilog even though the prolog failed; the job was requeued elsewhere.
    assert hooks.epilog(from_env(env), deps_for(node, slurm=RecordingSlurm(drained_reason="slurm-gpu: x"))) == 0
    assert rows(node.db, "SELECT count(*) AS n FROM job_gpus")[0]["n"] == 0
    assert rows(node.db, "SELECT count(*) AS n FROM health_events WHERE source='epilog'")[0]["n"] == 1


def test_log_file_directory_is_created(tmp_path):
    log = HookLog("prolog", syslog_on=False, path=str(tmp_path / "new" / "dir" / "hooks.log"))
    log.info("pass", job=1, gpu="GPU-1", note="two words")
    text = (tmp_path / "new" / "dir" / "hooks.log").read_text()
    assert 'INFO prolog pass job=1 gpu=GPU-1 note="two words"' in text and log.problems == []


def _sleeper(**env):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ, **env))


def test_epilog_never_kills_another_users_process_on_the_jobs_gpu(sim_node):
    # A process of another uid on the job's GPU (a job sharing it through shards/MPS, a system
    # agent): reported by the health policy, never signalled.
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0", SLURM_JOB_UID=str(os.getuid() + 1))
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    proc = _sleeper()
    try:
        simgpu.set_gpu(node.state, 0, procs=[(proc.pid, 1 << 30)])
        deps = deps_for(node)
        assert hooks.epilog(from_env(env), deps) == 0
        time.sleep(0.3)
        assert proc.poll() is None, "another user's process was killed"
        assert "leftover-processes-not-ours" in node.log_text()
        (n, reason), = deps.slurm.drains
        assert "compute process(es) still on the GPU" in reason and f"pid {proc.pid}" in reason
    finally:
        proc.kill()
        proc.wait()


def test_epilog_never_kills_a_process_of_another_job_of_the_same_user(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    env = job_env(gpus="0", SLURM_JOB_UID=str(os.getuid()))
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    proc = _sleeper(SLURM_JOB_ID="4712")  # same uid, the user's other job
    try:
        simgpu.set_gpu(node.state, 0, procs=[(proc.pid, 1 << 30)])
        assert hooks.epilog(from_env(env), deps_for(node)) == 0
        time.sleep(0.3)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_whose_environment_reads_empty_is_never_claimed_for_the_job():
    # Python 3.14's subprocess returns before the child's execve() has set up its new stack:
    # /proc/PID/environ then reads empty, and an empty environment used to mean "no other job
    # id shown", so another job's process of the same user was the job's to kill. A process
    # started with no environment at all reads empty forever: it reproduces that window.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={})
    try:
        deadline = time.monotonic() + 10
        while not open(f"/proc/{proc.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.01)  # past the exec: what stays empty is the environment itself
        assert hooks.process_identity(proc.pid) == (os.getuid(), hooks.UNKNOWN_JOB)
        job = from_env(job_env(job_id=1, SLURM_JOB_UID=str(os.getuid())))
        assert not hooks.process_belongs_to_job(proc.pid, job)
    finally:
        proc.kill()
        proc.wait()


def test_process_identity_reads_uid_and_job_id_from_proc():
    proc = _sleeper(SLURM_JOB_ID="9876")
    try:
        uid, job_id = hooks.process_identity(proc.pid)
        assert uid == os.getuid() and job_id in (9876, None) or job_id is not None
        job = from_env(job_env(job_id=9876, SLURM_JOB_UID=str(os.getuid())))
        assert hooks.process_belongs_to_job(proc.pid, job)
        assert not hooks.process_belongs_to_job(proc.pid, from_env(job_env(job_id=1, SLURM_JOB_UID=str(os.getuid()))))
        assert not hooks.process_belongs_to_job(proc.pid, from_env(job_env(job_id=9876, SLURM_JOB_UID=str(os.getuid() + 1))))
    finally:
        proc.kill()
        proc.wait()
    assert hooks.process_identity(simgpu.dead_pid()) == (None, None)


def test_epilog_with_killing_disabled_reports_leftovers_as_check_failure(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    node.write_config("[hooks]\nkill_leftovers = false\n")
    env = job_env(gpus="0")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        simgpu.set_gpu(node.state, 0, procs=[(proc.pid, 1 << 30)])
        deps = deps_for(node)
        assert hooks.epilog(from_env(env), deps) == 0
        assert proc.poll() is None  # not killed
        (n, reason), = deps.slurm.drains
        assert "compute process(es) still on the GPU" in reason and "SIGKILL" not in reason
    finally:
        proc.kill()
        proc.wait()


def test_prolog_drains_when_slurm_gpu_index_is_past_the_gpus_the_driver_shows(sim_node):
    # GPU 3 fell off the bus: the driver shows 3 GPUs, Slurm still hands out index 3.
    node = sim_node(simgpu.h100_sxm(4))
    simgpu.set_node(node.state, gpu_count=3)
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="2,3")), deps) == 1  # never fail open on a missing GPU
    assert "Slurm gave the job GPU 3 but the driver shows only 3 GPUs" in deps.slurm.drains[0][1]
    deps = deps_for(node, slurm=RecordingSlurm())
    assert hooks.epilog(from_env(job_env(gpus="2,3")), deps) == 0
    assert "driver shows only 3 GPUs" in deps.slurm.drains[0][1]


def test_prolog_on_node_whose_driver_does_not_load_fails_the_job_and_tries_to_drain(sim_node):
    node = sim_node()
    node.write_config(slurm_timeout_s=2.0)
    node.state.unlink()  # the simulated driver then answers DRIVER_NOT_LOADED
    cp = subprocess.run([sys.executable, "-c", "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=node.env(**job_env(gpus="0"), SLURM_CONF="/nonexistent/slurm.conf"),
                        capture_output=True, text=True, timeout=60)
    log = node.log_text()
    assert cp.returncode == 1, (cp.stderr, log)  # a GPU job must not start without a working driver
    assert "nvml-unavailable" in log and "Driver Not Loaded" in log
    assert "drain" in log and "Traceback" not in cp.stderr


def test_hooks_do_not_import_click_jinja2_or_sqlite_utils(sim_node):
    # Start-up time is part of every job start: the heavy libraries belong to the admin CLI only.
    node = sim_node(simgpu.h100_sxm(2))
    for main in ("prolog_main", "epilog_main"):
        cp = subprocess.run([sys.executable, "-X", "importtime", "-c", f"from slurm_gpu.hooks.main import {main}; {main}()"],
                            env=node.env(**job_env(gpus="0")), capture_output=True, text=True, timeout=60)
        assert cp.returncode == 0, cp.stderr[-2000:]
        mods = {line.split("|")[2].strip().split(".")[0] for line in cp.stderr.splitlines()
                if line.startswith("import time") and line.count("|") == 2}
        assert not mods & {"click", "jinja2", "sqlite_utils", "rich"}, (main, mods & {"click", "jinja2", "sqlite_utils"})
        assert "slurm_gpu" in mods and "pynvml" in mods  # the measurement itself works


def test_process_start_time_is_when_the_process_started():
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.5)
        started = hooks.process_start_time(str(proc.pid))
        assert started is not None and t0 - 0.05 <= started <= t0 + 0.3, (t0, started)
    finally:
        proc.kill()
        proc.wait()
    assert hooks.process_start_time(str(simgpu.dead_pid())) is None


def test_gpu_time_starts_when_slurmd_started_the_prolog_not_after_python_imports(sim_node):
    # Python's start-up and imports (~0.1-0.3 s) are part of the allocation Slurm counts.
    node = sim_node(simgpu.h100_sxm(1))
    t0 = time.time()
    cp = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); "
                         "from slurm_gpu.hooks.main import prolog_main; prolog_main()"],
                        env=node.env(**job_env(gpus="0")), capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    (start,) = rows(node.db, "SELECT start_time FROM job_starts")
    assert t0 - 0.05 <= start["start_time"] < t0 + 0.4, (t0, start)


def test_the_seams_of_a_hook_are_protocols_its_real_parts_and_the_no_gpu_reader_implement(sim_node):
    """HookDeps' reader, store and log are Protocols (hooks/deps.py): the real NvmlReader, Store and
    HookLog implement them whole, and so does the reader of a hook whose driver does not answer
    (it used to be a bare object() that would have failed with AttributeError)."""
    from slurm_gpu.errors import NvmlUnavailable
    from slurm_gpu.hooks.deps import EventLog, GpuReader, NoGpus, RecordStore
    deps = deps_for(sim_node(simgpu.h100_sxm(2)))
    assert isinstance(deps.reader, GpuReader) and isinstance(deps.store, RecordStore) and isinstance(deps.log, EventLog)
    dead = NoGpus(NvmlUnavailable("NVML: driver not loaded", "load the driver"))
    assert isinstance(dead, GpuReader) and not isinstance(object(), GpuReader)
    with pytest.raises(NvmlUnavailable):
        dead.snapshot([0])


@pytest.mark.parametrize("sluid, fault, drained, code", [
    ("sEKNKTV3WPV500", True, True, 1),    # 25.11+: the failed epilog lets --requeue=expedite move the job
    ("sEKNKTV3WPV500", False, True, 0),
    ("", True, True, 0),                  # before 25.11: our reason must not become "Epilog error"
    ("", False, True, 0),
    ("", True, False, 1),                 # the drain did not reach slurmctld: Slurm must drain the node
    ("sEKNKTV3WPV500", True, False, 1),
])
def test_the_epilog_fails_for_a_gpu_fault_only_where_slurm_requeues_by_it(sluid, fault, drained, code):
    from slurm_gpu.hooks.epilog import epilog_exit
    job = from_env(job_env(job_id=7, SLURM_JOB_SLUID=sluid))
    assert epilog_exit(job, fault, drained) == code
