"""Issue 26 on real Slurm: a GPU with a pending row remap is drained by the prolog, the next job
lands on the other node, `slurm-gpu remediate` resets it (the stand-in nvidia-smi on the simulated
driver), verifies and resumes it, and the node takes a job again; a GPU whose row remapping failed
ends drained as an RMA.  Slurm's own records show that no job ran on the node between its drain
and its verified resume.  Only testbed APIs: the same test runs on every Slurm the testbed has."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import simgpu

from tests.integration.test_hooks_slurm import Site, _reasons, _script, hooked_cluster, site_fixture

pytestmark = pytest.mark.slurm


class RemediationSite(Site):
    def config(self) -> str:
        cmd = [sys.executable, str(simgpu.STAND_IN_NVIDIA_SMI), "--state", f"{self.root}/%n.state", "--gpu-reset",
               "-i", "{pci_bus_id}"]
        return super().config() + ("[remediation]\nreset_command = [%s]\nverify_passes = 2\nverify_interval_s = 1\n"
                                   'lock_file = "%s/%%n/remediate.lock"\n' % (", ".join(f'"{a}"' for a in cmd), self.root))


site = site_fixture(RemediationSite, "remediate")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory)


def _remediate(cluster, node: str) -> "subprocess.CompletedProcess[str]":
    env = dict(cluster.env, SLURMD_NODENAME=node)
    return subprocess.run([_script("slurm-gpu"), "remediate", "--node", node], env=env, capture_output=True,
                          text=True, timeout=120)


def _drained_by_prolog(cluster, site):
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    assert cluster.job_info(job)["NodeList"] == "gpu02", site.log("gpu01")
    reasons = {r["node"]: r["reason"] for r in _reasons(cluster)}
    assert reasons.get("gpu01", "").startswith("slurm-gpu: ") and f"[prolog job {job}; check " in reasons["gpu01"], reasons
    return time.time()


def _jobs_on(cluster, node: str, since: float, until: float):
    """(job, start, end) of every job Slurm's accounting has on the node that overlaps [since, until]."""
    r = cluster.run("sacct", "-n", "-P", "-X", "-a", "-N", node, "-S", "now-1hour", "-E", "now",
                    "--format=JobID,Start,End,NodeList", "-o", "JobID,Start,End")
    out = []
    for line in r.stdout.splitlines():
        jid, start, end = line.split("|")[:3]
        ts = lambda v: time.mktime(time.strptime(v, "%Y-%m-%dT%H:%M:%S")) if v[:1].isdigit() else float("inf")  # noqa: E731
        if ts(start) < until and ts(end) > since:
            out.append((jid, start, end))
    return out


def test_pending_remap_gpu_is_reset_verified_and_resumed_and_takes_a_job(cluster, site):
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1)
    drained_at = _drained_by_prolog(cluster, site)
    r = _remediate(cluster, "gpu01")
    resumed_at = time.time()
    assert r.returncode == 0 and "reset and verified; resumed" in r.stdout, (r.stdout + r.stderr, site.rows(
        "gpu01", "SELECT outcome, detail FROM remediations"))
    assert simgpu.read_state(site.state("gpu01"))["gpu.2.resets"] == "1"
    assert "gpu01" not in {x["node"] for x in _reasons(cluster)}
    assert _jobs_on(cluster, "gpu01", drained_at, resumed_at) == []
    rows = site.rows("gpu01", "SELECT action, outcome, gpu_index FROM remediations")
    assert rows == [{"action": "reset", "outcome": "resumed", "gpu_index": 2}]
    print(f"\ndrain-to-resume (reset path, remediate run right after the drain): {resumed_at - drained_at:.1f} s")
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4", "-w", "gpu01"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"


def test_remap_failure_gpu_ends_drained_as_rma(cluster, site):
    simgpu.set_gpu(site.state("gpu01"), 1, remapped_failure=1)
    _drained_by_prolog(cluster, site)
    r = _remediate(cluster, "gpu01")
    assert r.returncode == 1, r.stdout + r.stderr
    serial = simgpu.read_state(site.state("gpu01"))["gpu.1.serial"]
    reasons = {x["node"]: x["reason"] for x in _reasons(cluster)}
    assert reasons["gpu01"].startswith(f"slurm-gpu: RMA: GPU {serial} "), reasons
    assert "gpu.1.resets" not in simgpu.read_state(site.state("gpu01"))
