"""Issue 35 on real Slurm: a remediation loop that a crash, a clock or a look-alike reason cannot turn
against the cluster.  One test per row of the issue's table that involves Slurm (1, 3, 4, 5, 6); each
failed on main at a140cd8.  The reset command is a script around the stand-in nvidia-smi that can be
slowed before and after it applies the reset (as a real reset's driver teardown is), and logs when
each reset begins and ends.  Only testbed APIs: the same tests run on every Slurm the testbed has."""
from __future__ import annotations

import fcntl
import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import simgpu

from slurm_gpu.slurm.reason import format_reason

from .sites import CrashSite, drained_by_prolog, hook_script, hooked_cluster, jobs_on, node_reasons, site_fixture

pytestmark = pytest.mark.slurm


site = site_fixture(CrashSite, "remediate-crash")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory)


def _cli(cluster, node: str, *args: str, env_node: str = "", prefix=()) -> "subprocess.Popen[str]":
    env = dict(cluster.env, SLURMD_NODENAME=env_node or node)
    return subprocess.Popen([*prefix, hook_script("slurm-gpu"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(cluster, node: str, *args: str, **kw) -> "subprocess.CompletedProcess[str]":
    p = _cli(cluster, node, *args, **kw)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _remediate(cluster, node: str = "gpu01", *extra: str, **kw) -> "subprocess.CompletedProcess[str]":
    return _run(cluster, node, "remediate", "--node-name", node, *extra, **kw)


def _wait(predicate, what: str, timeout: float = 60):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def _drained_like_the_prolog(cluster, site, gpu: int = 2) -> None:
    """The prolog's drain for a pending row remap on `gpu`, set directly (drained_by_prolog runs a job for it:
    the rows below that need no job save those seconds)."""
    simgpu.set_gpu(site.state("gpu01"), gpu, remapped_pending=1)
    reason = format_reason(f"GPU {gpu} pending row remap: needs a GPU reset", "prolog job 1", check="pending_reset")
    cluster.run("scontrol", "update", "NodeName=gpu01", "State=DRAIN", f"Reason={reason}")
    cluster.wait_node_state("gpu01", lambda i: "DRAIN" in i.get("State", ""))


def _reason(cluster, node: str = "gpu01") -> str:
    return {r["node"]: r["reason"] for r in node_reasons(cluster)}.get(node, "")


def _resets(log: str):
    """(pid, begin, end or None) per reset the script ran."""
    begins = {m.group(1): float(m.group(2)) for m in re.finditer(r"^begin \S+ \S+ (\d+) ([\d.]+)$", log, re.M)}
    ends = {m.group(1): float(m.group(2)) for m in re.finditer(r"^end \S+ \S+ (\d+) ([\d.]+)$", log, re.M)}
    return sorted((pid, t, ends.get(pid)) for pid, t in begins.items())


def assert_no_overlapping_resets(log: str) -> None:
    spans = sorted((b, e if e is not None else float("inf")) for _, b, e in _resets(log))
    for (b1, e1), (b2, _) in zip(spans, spans[1:]):
        assert b2 >= e1, f"two resets of one GPU at once:\n{log}"


# ------------------------------------------------------------------ row 1: SIGKILL during a reset

@pytest.mark.parametrize("moment", ["before the reset applied", "after the reset applied"])
def test_remediate_killed_during_a_reset_keeps_the_node_drained_until_the_reset_ends(cluster, site, moment):
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1)
    drained_at = drained_by_prolog(cluster, site)
    site.slow(2, 0.3) if moment.startswith("before") else site.slow(0, 2.5)
    first = _cli(cluster, "gpu01", "remediate", "--node-name", "gpu01")
    _wait(lambda: "begin gpu01" in site.reset_log(), f"no reset began: {site.log('gpu01')}")
    if moment.startswith("after"):
        _wait(lambda: simgpu.read_state(site.state("gpu01")).get("gpu.2.resets") == "1", "the reset never applied")
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)

    # The killed run's reset still runs: the next run must not verify (the GPU may already look healthy) nor reset.
    second = _remediate(cluster)
    assert second.returncode == 1 and "still runs" in second.stdout, second.stdout + second.stderr
    assert "[remediate: reset]" in _reason(cluster), _reason(cluster)
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4", "-w", "gpu01"])
    hc = _run(cluster, "gpu01", "healthcheck", "--node-name", "gpu01")
    assert "held by remediate" in hc.stdout or "reason left as is" in hc.stdout, hc.stdout + hc.stderr
    assert "[remediate: reset]" in _reason(cluster), _reason(cluster)
    assert cluster.job_info(job)["JobState"] == "PENDING", cluster.job_info(job)

    _wait(lambda: "end gpu01" in site.reset_log(), "the reset never ended", timeout=30)
    (pid, _, _), = _resets(site.reset_log())
    _wait(lambda: not os.path.exists(f"/proc/{pid}"), "the reset command never exited", timeout=10)
    third = _remediate(cluster)
    resumed_at = time.time()
    assert third.returncode == 0 and "resumed" in third.stdout, third.stdout + third.stderr
    assert_no_overlapping_resets(site.reset_log())
    assert site.reset_log().count("begin gpu01") == 1 and simgpu.read_state(site.state("gpu01"))["gpu.2.resets"] == "1"
    rows = site.rows("gpu01", "SELECT action, outcome, detail FROM remediations")
    assert [(r["action"], r["outcome"]) for r in rows] == [("reset", "resumed")], rows
    assert "interrupted" in rows[0]["detail"], rows
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    ran = [j for j in jobs_on(cluster, "gpu01", drained_at, resumed_at - 1) if j[0] == str(job)]
    assert ran == [], (ran, rows)


# ------------------------------------------------------------------ row 3: --node-name is the node

def test_node_name_names_the_lock_and_the_database_not_the_host(cluster, site):
    """With gpu01's lock held, `remediate --node-name gpu01` run where SLURMD_NODENAME says gpu02 must see
    gpu01's lock, and read gpu01's database (an open reset there, whose process still lives)."""
    _drained_like_the_prolog(cluster, site)
    lock = site.root / "gpu01" / "remediate.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r = _remediate(cluster, "gpu01", "-n", env_node="gpu02")
    assert "holds the node's lock" in r.stdout and "would" not in r.stdout, r.stdout + r.stderr
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        start = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        conn = sqlite3.connect(str(site.db("gpu01")))
        conn.execute("INSERT INTO remediations (time, node, gpu_index, gpu_uuid, action, outcome, pid, pid_start) "
                     "VALUES (?, 'gpu01', 2, '', 'reset', 'started', ?, ?)", (time.time(), sleeper.pid, start))
        conn.commit()
        conn.close()
        r = _remediate(cluster, "gpu01", env_node="gpu02")
        assert f"(pid {sleeper.pid})" in r.stdout and "still runs" in r.stdout, r.stdout + r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not site.db("gpu02").exists() or not site.rows("gpu02", "SELECT * FROM remediations")


# ------------------------------------------------------------------ row 4: whose clock

@pytest.mark.parametrize("shift", ["+2h", "-25h"])
def test_a_node_clock_off_slurmctlds_neither_resets_reboots_nor_resumes(cluster, site, shift):
    if not os.path.exists("/usr/bin/faketime"):
        pytest.fail("faketime is not installed (apt-get install faketime; .ci/run installs it)")
    _drained_like_the_prolog(cluster, site)
    before = _reason(cluster)
    r = _remediate(cluster, prefix=("faketime", "-f", shift))
    assert r.returncode == 1 and "off slurmctld's" in r.stdout and "left drained" in r.stdout, r.stdout + r.stderr
    assert _reason(cluster) == before and site.reset_log() == ""
    assert "remediate-clock-skew" in site.log("gpu01"), site.log("gpu01")
    # The same node with its clock right goes on.
    r = _remediate(cluster)
    assert r.returncode == 0 and "reset and verified; resumed" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------ row 5: an admin's look-alike reason

def test_an_admins_reason_that_starts_with_slurm_gpu_is_never_lifted(cluster, site):
    text = "slurm-gpu: hold for vendor ticket 4711, do not resume"
    cluster.run("scontrol", "update", "NodeName=gpu01", "State=DRAIN", f"Reason={text}")
    cluster.wait_node_state("gpu01", lambda i: "DRAIN" in i.get("State", ""))
    r = _remediate(cluster)
    assert "left alone" in r.stdout, r.stdout + r.stderr
    hc = _run(cluster, "gpu01", "healthcheck", "--node-name", "gpu01")
    assert "not ours, left alone" in hc.stdout, hc.stdout + hc.stderr
    assert _reason(cluster) == text
    assert site.reset_log() == ""
    cluster.run("scontrol", "update", "NodeName=gpu01", "State=RESUME")


# ------------------------------------------------------------------ row 6: in use means busy, never worse

def test_a_process_that_appears_before_the_reset_makes_it_busy_not_a_reboot(cluster, site):
    _drained_like_the_prolog(cluster, site)
    holder = subprocess.Popen(["sleep", "120"])
    try:
        (site.root / "appear.pid").write_text(str(holder.pid))
        r = _remediate(cluster)
        assert r.returncode == 1 and "in use, not broken" in r.stdout, r.stdout + r.stderr
        info = cluster.node_info("gpu01")
        assert "REBOOT" not in info["State"] and "DRAIN" in info["State"], info
        assert "[remediate: reset]" in _reason(cluster) and holder.poll() is None
        rows = site.rows("gpu01", "SELECT action, outcome FROM remediations")
        assert [(r["action"], r["outcome"]) for r in rows] == [("reset", "busy")], rows
        # Still there at the next run: seen before anything is done, no reset tried.
        r = _remediate(cluster)
        assert r.returncode == 1 and f"pid {holder.pid}" in r.stdout and "nothing done" in r.stdout, r.stdout + r.stderr
        assert site.reset_log().count("begin gpu01") == 1
    finally:
        holder.kill()
        holder.wait()
        (site.root / "appear.pid").unlink(missing_ok=True)
    simgpu.set_gpu(site.state("gpu01"), 2, procs=[])
    r = _remediate(cluster)
    assert r.returncode == 0 and "reset and verified; resumed" in r.stdout, r.stdout + r.stderr
    rows = site.rows("gpu01", "SELECT action, outcome FROM remediations")
    assert [(r["action"], r["outcome"]) for r in rows] == [("reset", "busy"), ("reset", "resumed")], rows
