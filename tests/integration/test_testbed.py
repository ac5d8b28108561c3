"""The testbed itself: what a real Slurm 22.05 gives jobs and prologs, and that it cleans up.

These pin down the Slurm facts the product relies on (docs/testbed.md): GPU indices in
SLURM_JOB_GPUS, the prolog's minimal environment, drain + requeue on a failing prolog.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from testbed import CRED_EXPIRE_S, REGISTRY, SlurmTestbed, reap_crashed_runs

from .sites import PROBE, parse_env_file, parse_probe, wait_for_file

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ plain cluster

def test_gpu_job_runs_as_sgtest_with_two_gpus_and_is_accounted_to_physics(slurm_testbed: SlurmTestbed):
    tb = slurm_testbed
    job = tb.sbatch(PROBE, args=["--gres=gpu:2"])
    assert tb.wait_job(job) == "COMPLETED", tb.job_output(job)
    out = parse_probe(tb.job_output(job))
    assert out["user"] == "sgtest"
    gpus = out["gpus"].split(",")
    assert len(gpus) == 2 and all(g in {"0", "1", "2", "3"} for g in gpus), out
    assert out["cvd"] == out["gpus"]  # task/none: no cgroup renumbering
    assert out["account"] == "physics"
    row = tb.wait_sacct(job)
    assert (row["State"], row["Account"], row["User"]) == ("COMPLETED", "physics", "sgtest"), row
    assert "gres/gpu=2" in row["AllocTRES"], row


def test_slurmdbds_mariadb_runs_without_snapshot_isolation_as_slurm_requires(slurm_testbed: SlurmTestbed):
    # on (MariaDB >= 11.6.2's default), slurmdbd dies on the first write that conflicts with a
    # concurrent one (error 1020): 26.05 did, in CI, when `sacctmgr modify job` met its job update
    have = slurm_testbed.sql("SHOW GLOBAL VARIABLES LIKE 'innodb_snapshot_isolation'").split()
    assert have in ([], ["innodb_snapshot_isolation", "OFF"]), have


def test_each_node_runs_jobs_and_job_gpus_are_node_local_indices_not_device_minors(slurm_testbed: SlurmTestbed):
    tb = slurm_testbed
    jobs = {node: tb.sbatch(PROBE, args=["--gres=gpu:4", "-w", node]) for node in tb.nodes}
    for node, job in jobs.items():
        assert tb.wait_job(job) == "COMPLETED", tb.job_output(job)
        out = parse_probe(tb.job_output(job))
        assert out["node"] == node
        # gpu02's gres.conf names /dev/nvidia[4-7], yet its jobs see 0-3: SLURM_JOB_GPUS is the
        # position in the node's gres.conf list, not the device minor number.
        assert out["gpus"] == "0,1,2,3", (node, out)
    assert tb.gpu_minors["gpu02"] == [4, 5, 6, 7]
    assert "File=/dev/nvidia[4-7]" in (tb.conf_dir / "gres.conf").read_text()


def test_slurmctld_stop_makes_clients_fail_and_start_brings_the_cluster_back(slurm_testbed: SlurmTestbed):
    tb = slurm_testbed
    tb.stop_slurmctld()
    try:
        r = tb.run("scontrol", "ping", check=False, timeout=20)
        assert "DOWN" in r.stdout or r.returncode != 0, r.stdout
    finally:
        tb.start_slurmctld()
    for node in tb.nodes:
        tb.wait_node_state(node, "IDLE")
    job = tb.sbatch("true", args=["--gres=gpu:1"])
    assert tb.wait_job(job) == "COMPLETED"


# ------------------------------------------------------------------ prolog / epilog

@pytest.fixture(scope="module")
def hook_dir(tmp_path_factory) -> Path:
    """Prolog/epilog scripts that dump their environment; the prolog fails once when armed."""
    d = tmp_path_factory.mktemp("hooks")
    (d / "prolog").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        /usr/bin/env > {d}/prolog-env-$SLURM_JOB_ID-$SLURMD_NODENAME-$SLURM_JOB_RESTART_COUNT
        if [ -e {d}/arm ] && [ ! -e {d}/failed-on ]; then
            echo "$SLURMD_NODENAME" > {d}/failed-on
            exit 1
        fi
        exit 0
        """))
    (d / "epilog").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        /usr/bin/env > {d}/epilog-env-$SLURM_JOB_ID-$SLURMD_NODENAME
        """))
    for name in ("prolog", "epilog"):
        os.chmod(d / name, 0o755)
    return d


GPU_CONFIG = "[log]\nsyslog = false\n"


@pytest.fixture
def hooked_testbed(slurm_testbed_factory, hook_dir: Path) -> SlurmTestbed:
    return slurm_testbed_factory(prolog=str(hook_dir / "prolog"), epilog=str(hook_dir / "epilog"),
                                 slurm_gpu_config=GPU_CONFIG)


def test_prolog_and_epilog_see_slurm_job_vars_but_no_path(hooked_testbed: SlurmTestbed, hook_dir: Path):
    tb = hooked_testbed
    job = tb.sbatch(PROBE, args=["--gres=gpu:2"])
    assert tb.wait_job(job) == "COMPLETED", tb.job_output(job)
    node = parse_probe(tb.job_output(job))["node"]
    env = parse_env_file(wait_for_file(hook_dir / f"prolog-env-{job}-{node}-0"))
    assert env["SLURM_SCRIPT_CONTEXT"] == "prolog_slurmd"
    assert env["SLURMD_NODENAME"] == node
    assert env["SLURM_JOB_ACCOUNT"] == "physics"
    assert env["SLURM_JOB_USER"] == "sgtest"
    assert env["SLURM_CONF"] == str(tb.slurm_conf)
    assert len(env["SLURM_JOB_GPUS"].split(",")) == 2
    assert env["CUDA_VISIBLE_DEVICES"] == env["SLURM_JOB_GPUS"]
    assert "PATH" not in env and "LD_LIBRARY_PATH" not in env and "HOME" not in env, sorted(env)
    # The product finds its config beside SLURM_CONF and refuses one that others can write.
    toml = Path(env["SLURM_CONF"]).parent / "slurm-gpu.toml"
    st = toml.stat()
    assert toml.read_text() == GPU_CONFIG and st.st_uid == 0 and st.st_mode & 0o777 == 0o644

    env = parse_env_file(wait_for_file(hook_dir / f"epilog-env-{job}-{node}"))
    assert env["SLURM_SCRIPT_CONTEXT"] == "epilog_slurmd"
    assert env["SLURM_JOB_EXIT_CODE"] == "0" and env["SLURM_JOB_DERIVED_EC"] == "0"
    assert "PATH" not in env


def test_failing_prolog_drains_node_and_requeued_job_completes_on_the_other_node(
        hooked_testbed: SlurmTestbed, hook_dir: Path):
    tb = hooked_testbed
    (hook_dir / "arm").touch()
    try:
        t0 = time.monotonic()
        job = tb.sbatch(PROBE, args=["--gres=gpu:1"])
        assert tb.wait_job(job, timeout=CRED_EXPIRE_S + 40) == "COMPLETED", tb.job_output(job)
        took = time.monotonic() - t0
        bad = wait_for_file(hook_dir / "failed-on").read_text().strip()
    finally:
        (hook_dir / "arm").unlink()
    good = next(n for n in tb.nodes if n != bad)
    info = tb.job_info(job)
    assert info["Restarts"] == "1" and info["NodeList"] == good, info
    assert parse_probe(tb.job_output(job))["node"] == good
    node = tb.node_info(bad)
    assert "DRAIN" in node["State"] and node["Reason"].startswith("Prolog error"), node
    assert [r["reason"] for r in tb.sinfo_reasons() if r["node"] == bad] == [node["Reason"].split(" [")[0]]
    # nohold_on_prolog_fail: requeued, not held; only the credential delay stands between.
    assert took < CRED_EXPIRE_S + 20, took
    (hook_dir / "failed-on").unlink()


# ------------------------------------------------------------------ own clusters

def test_workdir_the_job_user_cannot_enter_still_runs_jobs(slurm_testbed_factory, tmp_path):
    """pytest's tmp_path is under /tmp/pytest-of-root (0700): sgtest must still reach slurm.conf,
    the munge socket, its script and slurmd's spool (slurmstepd execs the script as sgtest)."""
    assert not os.stat(tmp_path.parent.parent).st_mode & 0o001
    with SlurmTestbed(tmp_path / "bed", nodes=("gpu01",)) as bed:
        assert bed.public_dir != bed.workdir and bed.conf_dir.parent == bed.public_dir
        job = bed.sbatch(PROBE, args=["--gres=gpu:1"])
        assert bed.wait_job(job) == "COMPLETED", bed.slurmd_log("gpu01")[-2000:]
        assert parse_probe(bed.job_output(job))["user"] == "sgtest"
        public = bed.public_dir
    assert not public.exists()


def test_two_clusters_with_the_same_node_name_and_job_id_never_end_each_others_jobs(tmp_path):
    """Issue 36: a user's job died by a signal no slurmctld sent, during another job's epilog.  On one
    machine's own cgroup hierarchies two testbeds share /slurm_gpu01/uid_N/job_1/: slurmstepd of one
    cluster's job 1 ends every process there, the other cluster's job 1 too (reproduced: WTERMSIG 9
    within a second of the other job's end).  Each testbed's cgroup namespace keeps them apart."""
    with SlurmTestbed(tmp_path / "a", nodes=("gpu01",)) as a, SlurmTestbed(tmp_path / "b", nodes=("gpu01",)) as b:
        if not (a.cgroups and b.cgroups):
            pytest.skip("no cgroup v1 on this machine: the testbeds run without the cgroup plugins")
        long, short = a.sbatch("sleep 60", args=["--gres=gpu:1"]), b.sbatch("sleep 2", args=["--gres=gpu:1"])
        assert long == short == 1
        assert b.wait_job(short) == "COMPLETED"
        time.sleep(3)  # slurmstepd ends the step's processes at once, KillWait=3 at most
        assert a.job_info(long).get("JobState") == "RUNNING", a.slurmctld_log()[-1500:]


# ------------------------------------------------------------------ crash recovery

CRASHER = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from testbed import SlurmTestbed
bed = SlurmTestbed(Path({workdir!r}), nodes=("gpu01",))
bed.start()
print(" ".join(str(d.pid) for d in bed._daemons.values()), flush=True)
time.sleep(600)
"""


def test_daemons_of_a_crashed_run_are_ended_by_the_next_start(slurm_testbed_factory):
    """A test process killed with SIGKILL leaves its daemons running; the next start ends them."""
    workdir = Path(slurm_testbed_factory.base) / "crashed"
    child = subprocess.Popen([sys.executable, "-c", CRASHER.format(tests=str(TESTS), workdir=str(workdir))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip(), child.stderr.read()
        pids = [int(p) for p in line.split()]
        assert all(os.path.exists(f"/proc/{p}") for p in pids)
        assert str(pids[0]) in REGISTRY.read_text()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert all(os.path.exists(f"/proc/{p}") for p in pids), "daemons should outlive the crashed owner"

    reaped = reap_crashed_runs()  # what SlurmTestbed.start() does first
    assert len(reaped) == len(pids), reaped
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert not any(f" {p} " in f" {line} " for line in REGISTRY.read_text().splitlines() for p in pids)


def test_a_reused_pid_leading_a_new_session_is_not_taken_for_a_dead_daemons_session():
    """A registry row names its daemon by pid and start tick; the pid reused by a new session leader
    (another testbed's daemon) must not be reaped with the dead daemon's session."""
    from testbed import _proc_stat, _session_members
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        st = _proc_stat(p.pid)
        assert st is not None and st[0] == p.pid
        assert _session_members(p.pid, st[1]) == [p.pid]
        assert _session_members(p.pid, st[1] - 1) == []  # the row of an older process with this pid
    finally:
        p.kill()
        p.wait(10)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
