"""Issue 26 on real Slurm: a GPU with a pending row remap is drained by the prolog, the next job
lands on the other node, `slurm-gpu remediate` resets it (the stand-in nvidia-smi on the simulated
driver), verifies and resumes it, and the node takes a job again; a GPU whose row remapping failed
ends drained as an RMA.  Slurm's own records show that no job ran on the node between its drain
and its verified resume.  Only testbed APIs: the same test runs on every Slurm the testbed has."""
from __future__ import annotations

import time

import pytest
import simgpu

from .sites import RemediationSite, drained_by_prolog, hooked_cluster, jobs_on, node_reasons, remediate, site_fixture

pytestmark = pytest.mark.slurm

site = site_fixture(RemediationSite, "remediate")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory)


def test_pending_remap_gpu_is_reset_verified_and_resumed_and_takes_a_job(cluster, site):
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1)
    drained_at = drained_by_prolog(cluster, site)
    r = remediate(cluster, "gpu01")
    resumed_at = time.time()
    assert r.returncode == 0 and "reset and verified; resumed" in r.stdout, (r.stdout + r.stderr, site.rows(
        "gpu01", "SELECT outcome, detail FROM remediations"))
    assert simgpu.read_state(site.state("gpu01"))["gpu.2.resets"] == "1"
    assert "gpu01" not in {x["node"] for x in node_reasons(cluster)}
    assert jobs_on(cluster, "gpu01", drained_at, resumed_at) == []
    rows = site.rows("gpu01", "SELECT action, outcome, gpu_index FROM remediations")
    assert rows == [{"action": "reset", "outcome": "resumed", "gpu_index": 2}]
    print(f"\ndrain-to-resume (reset path, remediate run right after the drain): {resumed_at - drained_at:.1f} s")
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4", "-w", "gpu01"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"


def test_remap_failure_gpu_ends_drained_as_rma(cluster, site):
    simgpu.set_gpu(site.state("gpu01"), 1, remapped_failure=1)
    drained_by_prolog(cluster, site)
    r = remediate(cluster, "gpu01")
    assert r.returncode == 1, r.stdout + r.stderr
    serial = simgpu.read_state(site.state("gpu01"))["gpu.1.serial"]
    reasons = {x["node"]: x["reason"] for x in node_reasons(cluster)}
    assert reasons["gpu01"].startswith(f"slurm-gpu: RMA: GPU {serial} "), reasons
    assert "gpu.1.resets" not in simgpu.read_state(site.state("gpu01"))
