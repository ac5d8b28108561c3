"""Issue 26's reboot path on real Slurm.  A GPU reset that does not cure (the simulated GPU keeps
its pending row remap through the reset) escalates to `scontrol reboot ASAP nextstate=DOWN`;
slurmctld sends the reboot to slurmd, which runs the testbed's RebootProgram, and the testbed boots
the node: that slurmd stopped, the boot applies the pending remap on the simulated GPUs, slurmd
started again reporting the boot (tests/bootclock.c).  Slurm then has the node DOWN, our reason
with its own " : reboot issued : reboot complete" appended; the next `slurm-gpu remediate` verifies
and resumes it and the node takes a job.  Slurm's accounting shows no job on the node between its drain and its resume.

The cluster runs ReturnToService=1: with the testbed's usual 2, Slurm (24.11 here) returns the
DOWN node to service by itself on its next registration, before any verification; remediate's
answer to that is tests/test_remediation.py's returned-to-service test."""
from __future__ import annotations

import threading
import time

import pytest
import simgpu
from testbed import slurm_version

from .sites import RemediationSite, drained_by_prolog, hooked_cluster, jobs_on, node_reasons, power_cycle, remediate, site_fixture

pytestmark = pytest.mark.slurm


site = site_fixture(RemediationSite, "reboot")


@pytest.fixture
def boot_held():
    """Set by the test to let the held boot go on: until then the node stays REBOOT_ISSUED, its slurmd stopped."""
    return threading.Event()  # the cluster fixture sets it before the testbed stops


@pytest.fixture
def cluster(site, slurm_testbed_factory, boot_held):
    def boot(node):
        boot_held.wait(120)
        power_cycle(site, node)
    yield hooked_cluster(site, slurm_testbed_factory, on_reboot=boot, extra_slurm_conf="ReturnToService=1")
    boot_held.set()  # before the testbed stops: it joins the boot thread


def test_a_reset_that_does_not_cure_reboots_through_slurm_and_the_booted_node_is_verified_and_resumed(cluster, site,
                                                                                                     boot_held):
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1, reset_sticky=1)
    drained_at = drained_by_prolog(cluster, site)
    r = remediate(cluster, "gpu01")
    assert "reboot requested through Slurm" in r.stdout, r.stdout + r.stderr
    # The boot held while Slurm has the node REBOOT_ISSUED: remediate waits (it resumes only a node
    # Slurm has seen boot), and from 25.11 Slurm itself refuses to set such a node IDLE.
    cluster.wait_node_state("gpu01", lambda i: "REBOOT_ISSUED" in i["State"], timeout=60)
    r = remediate(cluster, "gpu01")
    # exit 1: the node stays drained (docs/remediation.md)
    assert r.returncode == 1 and "reboot under way" in r.stdout and "REBOOT_ISSUED" in r.stdout, r.stdout + r.stderr
    if slurm_version()[:2] >= (25, 11):
        refused = cluster.run("scontrol", "update", "NodeName=gpu01", "State=IDLE", check=False)
        assert refused.returncode != 0, refused
        print(f"\nscontrol State=IDLE of a REBOOT_ISSUED node: {(refused.stdout + refused.stderr).strip()}")
    assert "REBOOT_ISSUED" in cluster.node_info("gpu01")["State"]
    boot_held.set()
    # Slurm, not we, reboots it: REBOOT_REQUESTED (drained ASAP), REBOOT_ISSUED, RebootProgram, the boot.
    seen = set()
    cluster.wait_node_state("gpu01", lambda i: seen.add(i["State"]) or ("DOWN" in i["State"] and "REBOOT" not in i["State"]),
                            timeout=90)
    assert [n for n, _ in cluster.reboots] == ["gpu01"], sorted(seen)
    # The boot slurmctld recorded comes before slurmd's start, as on a machine: with slurmd -b both fell
    # in one second, and the registration a resume asks for could then count as an unexpected reboot
    # (node DOWN; docs/testbed.md, on_reboot).
    info = cluster.node_info("gpu01")
    boot, started = (time.mktime(time.strptime(info[k], "%Y-%m-%dT%H:%M:%S")) for k in ("BootTime", "SlurmdStartTime"))
    assert started - boot >= 1, info
    # slurmctld appends its own words to our reason (set_node_reason): the reason is still ours,
    # still remediate's, still names its check (the reboot breaker counts by it).
    reason = {r["node"]: r["reason"] for r in node_reasons(cluster)}["gpu01"]  # sinfo -R: no [user@time]
    assert reason.startswith("slurm-gpu: ") and reason.endswith(
        "[remediate: reboot; check reboot] : reboot issued : reboot complete"), reason
    r = remediate(cluster, "gpu01")
    resumed_at = time.time()
    assert r.returncode == 0 and "rebooted; verified; resumed" in r.stdout, r.stdout + r.stderr
    assert "DOWN" not in cluster.node_info("gpu01")["State"]
    assert site.rows("gpu01", "SELECT action, outcome FROM remediations ORDER BY id") == [
        {"action": "reset", "outcome": "escalated"}, {"action": "reboot", "outcome": "resumed"}]
    assert jobs_on(cluster, "gpu01", drained_at, resumed_at) == []
    print(f"\ndrain-to-resume (reboot path: reset, reboot through Slurm, verify): {resumed_at - drained_at:.1f} s")
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4", "-w", "gpu01"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"


def test_reboot_only_healthcheck_is_the_after_boot_hook_that_verifies_and_resumes(site, slurm_testbed_factory, tmp_path):
    """Slurm 26.05's HealthCheckNodeState=REBOOT_ONLY runs HealthCheckProgram only when slurmd reports
    back after a reboot: with our healthcheck there and [remediation] enabled, the node Slurm rebooted for
    us is verified and resumed by its own first healthcheck, no timer and no admin needed; and no
    healthcheck runs before the boot.  Older releases ignore the value (test_version_facts)."""
    from .sites import healthcheck_wrapper, hook_script
    if slurm_version()[:2] < (26, 5):
        pytest.skip("HealthCheckNodeState=REBOOT_ONLY is Slurm 26.05's (test_version_facts: older slurmd ignore it)")
    cluster = hooked_cluster(site, slurm_testbed_factory, on_reboot=lambda node: power_cycle(site, node),
                             extra_slurm_conf="ReturnToService=1\nHealthCheckNodeState=REBOOT_ONLY")
    cfg = cluster.conf_dir / "slurm-gpu.toml"
    cluster.use_hooks(prolog=hook_script("slurm-gpu-prolog"), epilog=hook_script("slurm-gpu-epilog"),
                      health_check_program=str(healthcheck_wrapper(tmp_path, cfg, site.root, cluster.slurm_conf)),
                      slurm_gpu_config=site.config() + "enabled = true\n")
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1, reset_sticky=1)
    drained_by_prolog(cluster, site)
    time.sleep(3)  # longer than the testbed's HealthCheckInterval: a periodic healthcheck would have run
    assert "healthcheck" not in site.log("gpu01"), site.log("gpu01")
    r = remediate(cluster, "gpu01")
    assert "reboot requested through Slurm" in r.stdout, r.stdout + r.stderr
    seen = set()
    cluster.wait_node_state("gpu01", lambda i: seen.add(i["State"]) or ("DRAIN" not in i["State"] and "DOWN" not in
                                                                        i["State"] and "REBOOT" not in i["State"]),
                            timeout=120)
    assert site.rows("gpu01", "SELECT action, outcome FROM remediations ORDER BY id") == [
        {"action": "reset", "outcome": "escalated"}, {"action": "reboot", "outcome": "resumed"}], sorted(seen)
    assert "rebooted; verified; resumed" in site.log("gpu01"), site.log("gpu01")
