"""Issue 26's concurrency on real Slurm: while `slurm-gpu remediate` resets a GPU (a slow reset:
the stand-in nvidia-smi applies the reset, then the command takes 4 s more, as a real reset with the
driver's teardown does), a second `remediate` run on the node, a job pinned to the node and a
`healthcheck` that already finds the GPU healthy all come.  No second reset runs, the healthcheck
leaves remediate's drain in place, and slurmctld starts the job only after the verified resume
(Slurm's own job records).  Only testbed APIs: the same test runs on every Slurm the testbed has."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import simgpu

from .sites import Site, drained_by_prolog, hook_script, hooked_cluster, node_reasons, site_fixture

pytestmark = pytest.mark.slurm


class SlowResetSite(Site):
    """Every reset goes through reset.sh: one line in resets.log when it begins and when it ends."""

    def reset(self) -> None:
        super().reset()
        (self.root / "resets.log").unlink(missing_ok=True)

    def reset_log(self) -> str:
        p = self.root / "resets.log"
        return p.read_text() if p.exists() else ""

    def config(self) -> str:
        script = self.root / "reset.sh"
        script.write_text(f"""#!/bin/sh
echo "begin $SLURMD_NODENAME $1 $(date +%s.%N)" >> {self.root}/resets.log
{sys.executable} {simgpu.STAND_IN_NVIDIA_SMI} --state {self.root}/"$SLURMD_NODENAME".state --gpu-reset -i "$1" || exit $?
sleep 4
echo "end $SLURMD_NODENAME $1 $(date +%s.%N)" >> {self.root}/resets.log
""")
        script.chmod(0o755)
        return super().config() + ("[remediation]\nreset_command = [\"%s\", \"{pci_bus_id}\"]\nverify_passes = 2\n"
                                   'verify_interval_s = 1\nlock_file = "%s/%%n/remediate.lock"\n' % (script, self.root))


site = site_fixture(SlowResetSite, "remediate-race")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory)


def _slurm_gpu(cluster, node: str, *args: str) -> "subprocess.Popen[str]":
    env = dict(cluster.env, SLURMD_NODENAME=node)
    return subprocess.Popen([hook_script("slurm-gpu"), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait(predicate, what: str, timeout: float = 60):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.1)


def _start(cluster, job: int) -> float:
    """The job's start time from Slurm's accounting (sacct -X Start)."""
    def started() -> str:
        out = cluster.run("sacct", "-n", "-P", "-X", "-j", str(job), "-o", "Start").stdout.split()
        return out[0] if out and out[0][:1].isdigit() else ""
    _wait(lambda: bool(started()), f"job {job} never started")
    return time.mktime(time.strptime(started(), "%Y-%m-%dT%H:%M:%S"))


def test_second_remediate_a_pinned_job_and_a_healthcheck_during_a_reset_change_nothing(cluster, site):
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1)
    drained_by_prolog(cluster, site)
    first = _slurm_gpu(cluster, "gpu01", "remediate", "--node", "gpu01")
    _wait(lambda: "begin gpu01" in site.reset_log(), f"no reset began: {site.log('gpu01')}")

    # The reset is under way (the GPU already looks healthy, the command has not returned).
    second = _slurm_gpu(cluster, "gpu01", "remediate", "--node", "gpu01")
    out2, err2 = second.communicate(timeout=60)
    assert "a reset of GPU 2 (pid " in out2 and "still runs; the node stays as it is" in out2, out2 + err2
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4", "-w", "gpu01"])
    check = _slurm_gpu(cluster, "gpu01", "healthcheck", "--node", "gpu01")
    out3, err3 = check.communicate(timeout=60)
    assert check.returncode == 0 and "healthy, but the drain is held by remediate, left in place" in out3, out3 + err3
    reason = {r["node"]: r["reason"] for r in node_reasons(cluster)}.get("gpu01", "")
    assert "[remediate: reset" in reason, reason
    assert "end gpu01" not in site.reset_log(), "the reset ended before the others came: lengthen reset.sh's sleep"
    assert cluster.job_info(job)["JobState"] == "PENDING", cluster.job_info(job)

    out1, err1 = first.communicate(timeout=120)
    assert first.returncode == 0 and "reset and verified; resumed" in out1, out1 + err1
    (row,) = site.rows("gpu01", "SELECT action, outcome, finished FROM remediations")
    assert (row["action"], row["outcome"]) == ("reset", "resumed")
    assert site.reset_log().count("begin gpu01") == 1, site.reset_log()  # no double reset
    assert simgpu.read_state(site.state("gpu01"))["gpu.2.resets"] == "1"
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    # slurmctld started the pinned job after the verified resume, not during the reset (whole seconds).
    assert _start(cluster, job) >= int(row["finished"]), (cluster.job_info(job), row)


def test_remediate_leaves_a_node_whose_job_still_runs_and_resets_it_once_the_job_ended(cluster, site):
    """The healthcheck drains gpu01 while a job runs there (Slurm: DRAINING, MIXED+DRAIN): remediate
    finds the job in Slurm's node state and does nothing; after the job it resets and resumes."""
    job = cluster.sbatch("sleep 8", args=["-p", "gpu", "--gres=gpu:1", "-w", "gpu01"])
    _wait(lambda: cluster.job_info(job).get("JobState") == "RUNNING", f"job {job} never ran")
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1)
    hc = _slurm_gpu(cluster, "gpu01", "healthcheck", "--node", "gpu01")
    out, err = hc.communicate(timeout=60)
    assert "drained" in out, out + err
    busy = _slurm_gpu(cluster, "gpu01", "remediate", "--node", "gpu01")
    out, err = busy.communicate(timeout=60)
    assert "nothing done" in out and site.reset_log() == "", (out + err, cluster.node_info("gpu01")["State"])
    assert cluster.job_info(job)["JobState"] == "RUNNING"
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    cluster.wait_node_state("gpu01", lambda i: "ALLOCATED" not in i.get("State", "") and "MIXED" not in i.get("State", ""))
    done = _slurm_gpu(cluster, "gpu01", "remediate", "--node", "gpu01")
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0 and "reset and verified; resumed" in out, out + err
    assert site.reset_log().count("begin gpu01") == 1
