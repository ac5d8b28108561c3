"""Issue 25 on real Slurm 22.05: an NVSwitch fabric that is not up, a driver asking for a node
reboot (recovery action), and a driver/library version mismatch each drain the node the job
was sent to, with a reason that names the fault, and the job finishes on the other node."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import simgpu

from .sites import Site, hooked_cluster, node_reasons, site_fixture

pytestmark = pytest.mark.slurm

KERNEL, LIBRARY = "550.54.15", "560.35.03"


class FaultSite(Site):
    """The simulated library under a versioned file name (as libnvidia-ml.so.1 links to on a real
    node) and a stand-in for /proc/driver/nvidia/version naming another version."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.versioned = root / "lib" / f"libnvidia-ml.so.{LIBRARY}"
        shutil.copy(self.lib, self.versioned)
        (root / "nvidia-version").write_text(
            f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {KERNEL}  Tue Mar  5 22:23:56 UTC 2024\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")

    def config(self) -> str:
        return (super().config().replace(f'nvml_library = "{self.lib}"', f'nvml_library = "{self.versioned}"')
                .replace("nvml_timeout_s = 2.0\n", f'nvml_timeout_s = 2.0\nnvidia_version_file = "{self.root}/nvidia-version"\n'))


site = site_fixture(FaultSite, "faults")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory)


def _drained_with(cluster, site, job, words):
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    assert cluster.job_info(job)["NodeList"] == "gpu02"
    reasons = {r["node"]: r["reason"] for r in node_reasons(cluster)}
    assert "gpu02" not in reasons, reasons
    assert reasons.get("gpu01", "").startswith("slurm-gpu: ") and f"[prolog job {job}; check " in reasons["gpu01"], reasons
    for w in words:
        assert w in reasons["gpu01"], (reasons, site.log("gpu01"))


def test_fabric_not_started_drains_node_naming_the_fabric_manager(cluster, site):
    for i in range(4):
        simgpu.set_gpu(site.state("gpu01"), i, fabric_state=simgpu.FABRIC_NOT_STARTED)
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:2"])
    _drained_with(cluster, site, job, ["NVSwitch fabric registration not started", "fabric manager"])


def test_driver_recovery_action_drains_node_naming_the_action(cluster, site):
    for i in range(4):
        simgpu.set_gpu(site.state("gpu01"), i, **{"field.230": simgpu.RECOVERY_NODE_REBOOT})
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:2"])
    _drained_with(cluster, site, job, ["driver requests recovery: node reboot"])


def test_driver_library_mismatch_drains_node_naming_both_versions(cluster, site):
    simgpu.set_node(site.state("gpu01"), init_error=simgpu.LIB_RM_VERSION_MISMATCH)
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:2"])
    _drained_with(cluster, site, job, ["NVIDIA driver/library version mismatch", f"kernel module {KERNEL}",
                                       f"NVML library {LIBRARY}", "reboot the node or reload the nvidia module"])
