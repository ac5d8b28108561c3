"""Issue 35 item 6 through `slurm-gpu remediate` on real Slurm: no GPU back in service on passive
counters alone.  With [verify] enabled, after the reset (or the reboot) and the passive passes, remediate
verifies the node with a job of its own in the reservation slurm-gpu-verify-NODE (the stand-in dcgmi and
all_reduce_perf on the simulated GPUs).  A healthy GPU is resumed after that job; a GPU whose fault shows
only under the diagnostic is never resumed: reset, reboot, RMA.  Slurm's accounting says where the jobs
ran; no reservation is left.  Only testbed APIs: the same tests run on every Slurm the testbed has."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import simgpu

from .sites import VerifySite, drained_by_prolog, hook_script, hooked_cluster, jobs_on, node_reasons, power_cycle, site_fixture

pytestmark = pytest.mark.slurm


class VerifyRemediateSite(VerifySite):
    """The stand-in nvidia-smi resets, one passive pass, then the verification job.  A node just back from
    its reboot takes a while before slurmctld starts jobs on it (26.05 under load: over 5 s)."""

    START_TIMEOUT_S = 60

    def config(self) -> str:
        cmd = [sys.executable, str(simgpu.STAND_IN_NVIDIA_SMI), "--state", f"{self.root}/%n.state", "--gpu-reset",
               "-i", "{pci_bus_id}"]
        return super().config() + (
            "[remediation]\nreset_command = [%s]\nverify_passes = 1\nverify_interval_s = 0\n"
            'lock_file = "%s/%%n/remediate.lock"\n[breaker]\nsettle_s = 1\n'
            % (", ".join(f'"{a}"' for a in cmd), self.root))


site = site_fixture(VerifyRemediateSite, "verify-remediate")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    bed = hooked_cluster(site, slurm_testbed_factory, on_reboot=lambda node: power_cycle(site, node),
                         extra_slurm_conf="ReturnToService=1")
    yield bed
    bed.run("scontrol", "delete", "Reservation=slurm-gpu-verify-gpu01", check=False)


def _remediate(cluster, site) -> "subprocess.CompletedProcess[str]":
    env = dict(cluster.env, SLURMD_NODENAME="gpu01", **site.job_env())
    return subprocess.run([hook_script("slurm-gpu"), "remediate", "--node-name", "gpu01"], env=env,
                          capture_output=True, text=True, timeout=180)


def _verify_jobs(cluster, before=(), want: int = 0) -> list:
    """(job id, node, reservation, state) of the slurm-gpu-verify jobs in Slurm's accounting not in `before`,
    waiting up to 20 s for `want` of them to have ended there (slurmdbd hears of an end a moment later)."""
    end = time.monotonic() + 20
    while True:
        r = cluster.run("sacct", "-n", "-P", "-X", "-a", "--name=slurm-gpu-verify", "-S", "now-1hour",
                        "-o", "JobID,NodeList,Reservation,State")
        jobs = [tuple(line.split("|")[:4]) for line in r.stdout.splitlines() if line.strip()]
        jobs = [j for j in jobs if j not in before]
        if len([j for j in jobs if j[3] not in ("PENDING", "RUNNING")]) >= want or time.monotonic() > end:
            return jobs
        time.sleep(0.5)


def _no_reservation(cluster) -> None:
    out = cluster.run("scontrol", "-o", "show", "reservation", check=False).stdout
    assert "slurm-gpu-verify" not in out, out


def test_a_reset_gpu_is_resumed_only_after_a_verification_job_in_its_own_reservation(cluster, site):
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1)
    drained_at = drained_by_prolog(cluster, site)
    before = set(_verify_jobs(cluster))
    t0 = time.monotonic()
    r = _remediate(cluster, site)
    took = time.monotonic() - t0
    resumed_at = time.time()
    assert r.returncode == 0 and "reset and verified; resumed" in r.stdout, r.stdout + r.stderr + site.log("gpu01")
    jobs = _verify_jobs(cluster, before, want=1)
    # The reservation as sacct shows it: slurm-gpu keeps the reservation until slurmdbd has the job's end
    # and slurmctld's last update of it (verifyjob._await_accounting); under CI load that last update
    # can still come later, and Slurm then records the job without it (Reservation empty).
    assert len(jobs) == 1 and jobs[0][1] == "gpu01" and jobs[0][3] == "COMPLETED", jobs
    assert jobs[0][2] in ("slurm-gpu-verify-gpu01", ""), jobs
    _no_reservation(cluster)
    others = [j for j in jobs_on(cluster, "gpu01", drained_at, resumed_at - 1) if j[0] != jobs[0][0]]
    assert others == [], others
    rows = site.rows("gpu01", "SELECT action, outcome, detail, job_id FROM remediations ORDER BY id")
    assert [(x["action"], x["outcome"]) for x in rows] == [("reset", "resumed"), ("verify", "resumed")], rows
    assert str(rows[1]["job_id"]) == jobs[0][0] and "passed in" in rows[0]["detail"], rows
    m = re.search(r"passed in ([\d.]+) s, its battery ([\d.]+) s", rows[1]["detail"])
    verify_s, battery_s = float(m.group(1)), float(m.group(2))
    print(f"\nremediate: {took:.1f} s in all; the verification {verify_s:.1f} s, its battery {battery_s:.1f} s")
    assert verify_s <= battery_s + 15, rows[1]  # Slurm scheduling, a second before the job, 3 s after it
    assert "DRAIN" not in cluster.node_info("gpu01")["State"]


def test_a_gpu_whose_fault_shows_only_under_diag_is_never_resumed_and_ends_as_rma(cluster, site):
    """The passive checks pass after the reset and after the reboot; the DCGM diagnostic fails both times."""
    simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1, diag_fail="memory")
    drained_at = drained_by_prolog(cluster, site)
    before = set(_verify_jobs(cluster))
    r = _remediate(cluster, site)
    assert r.returncode == 1 and "reboot requested through Slurm" in r.stdout, r.stdout + r.stderr + site.log("gpu01")
    cluster.wait_node_state("gpu01", lambda i: "DOWN" in i["State"] and "REBOOT" not in i["State"], timeout=90)
    r = _remediate(cluster, site)
    serial = simgpu.read_state(site.state("gpu01"))["gpu.2.serial"]
    assert r.returncode == 1 and f"RMA: GPU {serial}" in r.stdout, r.stdout + r.stderr + site.log("gpu01")
    reason = {x["node"]: x["reason"] for x in node_reasons(cluster)}["gpu01"]
    assert reason.startswith(f"slurm-gpu: RMA: GPU {serial} ") and reason.endswith("[remediate]"), reason
    jobs = _verify_jobs(cluster, before, want=2)
    assert len(jobs) == 2 and all(j[1] == "gpu01" and j[2] in ("slurm-gpu-verify-gpu01", "") for j in jobs), jobs
    _no_reservation(cluster)
    others = [j for j in jobs_on(cluster, "gpu01", drained_at, time.time()) if j[0] not in {x[0] for x in jobs}]
    assert others == [], others
    rows = site.rows("gpu01", "SELECT action, outcome, fault_check, gpu_index, serial FROM remediations ORDER BY id")
    steps = [(x["action"], x["outcome"]) for x in rows]
    assert steps == [("reset", "escalated"), ("verify", "failed"), ("verify", "failed"), ("reboot", "failed"),
                     ("verify", "failed"), ("verify", "failed"), ("rma", "rma")], rows
    failed = [x for x in rows if x["action"] == "verify" and x["gpu_index"] is not None]
    assert all((x["fault_check"], x["gpu_index"], x["serial"]) == ("verify_dcgm", 2, serial) for x in failed), rows
