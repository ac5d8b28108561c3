"""Issue 35's crash loop on real Slurm: `slurm-gpu remediate` killed (SIGKILL) at 10 random moments,
alternately of a slow reset and of a reboot claim (the breaker's claim, `scontrol reboot`, the boot).
After each kill, remediate is run again until the node is back in service.  Every time:

- no job starts on the node between its drain and its verified resume (a job pinned to the node waits
  pending the whole time; Slurm's accounting has its start after the resume),
- no two resets of the GPU overlap (the reset command logs when it begins and ends),
- every episode ends with no step left `started` in the node database.

The moments come from a seeded generator (printed; SLURM_GPU_KILL_SEED repeats a run).  once_on("trixie"):
one Slurm release is enough for a loop this long (the rows' own tests run on every release); in CI it
runs on 24.11 beside the host's run, on the host when the axis does not run beside it.  24.11, not
26.05: 26.05's suite is CI's longest, and this loop's two minutes decided CI's wall time."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest
import simgpu

from slurm_gpu.slurm.reason import format_reason

from .sites import CrashSite, hook_script, hooked_cluster, jobs_on, power_cycle, site_fixture
from .test_remediation_crash_slurm import assert_no_overlapping_resets

pytestmark = [pytest.mark.slurm, pytest.mark.once_on("trixie")]


class LoopSite(CrashSite):
    def config(self) -> str:
        return super().config() + "max_reboots_per_node_per_day = 50\nmax_resets_per_gpu_per_day = 50\n" \
                                  "lemon_remedies = 100\n[breaker]\nsettle_s = 1\n"


site = site_fixture(LoopSite, "remediate-sigkill")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory, on_reboot=lambda node: power_cycle(site, node),
                          extra_slurm_conf="ReturnToService=1")


def _remediate(cluster) -> "subprocess.Popen[str]":
    env = dict(cluster.env, SLURMD_NODENAME="gpu01")
    return subprocess.Popen([hook_script("slurm-gpu"), "remediate", "--node-name", "gpu01"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _state(cluster) -> str:
    return cluster.node_info("gpu01").get("State", "")


def _until_resumed(cluster, site, what: str, timeout: float = 120) -> tuple:
    """remediate again and again (as a timer would) until the node is back; the outputs seen."""
    end = time.monotonic() + timeout
    said = []
    while time.monotonic() < end:
        state = _state(cluster)
        if not any(f in state for f in ("DRAIN", "DOWN", "REBOOT")):
            return tuple(said)
        p = _remediate(cluster)
        out, err = p.communicate(timeout=120)
        said.append(out.strip() or err.strip())
        if "resumed" in out and "not resumed" not in out:
            return tuple(said)
        time.sleep(0.5)
    raise AssertionError(f"{what}: the node never came back ({_state(cluster)}):\n" + "\n".join(said) + site.log("gpu01"))


def test_remediate_killed_at_random_moments_of_resets_and_reboot_claims_never_lets_a_job_in_early(cluster, site):
    seed = int(os.environ.get("SLURM_GPU_KILL_SEED") or time.time())
    rng = random.Random(seed)
    print(f"\nSLURM_GPU_KILL_SEED={seed}")
    for n in range(10):
        reboot = n % 2 == 1
        simgpu.set_gpu(site.state("gpu01"), 2, remapped_pending=1, reset_sticky=1 if reboot else 0)
        site.slow(rng.uniform(0, 0.6), rng.uniform(0.3, 1.2))
        (site.root / "resets.log").unlink(missing_ok=True)
        reason = format_reason("GPU 2 pending row remap: needs a GPU reset", f"prolog job {9000 + n}",
                               check="pending_reset")
        cluster.run("scontrol", "update", "NodeName=gpu01", "State=DRAIN", f"Reason={reason}")
        cluster.wait_node_state("gpu01", lambda i: "DRAIN" in i.get("State", ""))
        drained_at = time.time()
        job = cluster.sbatch("true", args=["-p", "gpu", "--gres=gpu:4", "-w", "gpu01"])

        first = _remediate(cluster)
        moment = rng.uniform(0.2, 4.0 if reboot else 2.2)
        time.sleep(moment)
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
        what = f"kill {n + 1} ({'reboot claim' if reboot else 'reset'}) at {moment:.2f} s"
        said = _until_resumed(cluster, site, what)
        resumed_at = time.time()
        print(f"{what}: {len(said)} more runs: {' | '.join(s[:90] for s in said)}")

        assert_no_overlapping_resets(site.reset_log())
        open_rows = site.rows("gpu01", "SELECT id, action, outcome FROM remediations WHERE outcome = 'started'")
        assert open_rows == [], (what, open_rows)
        assert cluster.wait_job(job, timeout=90) == "COMPLETED", (what, cluster.job_info(job))
        early = [j for j in jobs_on(cluster, "gpu01", drained_at, resumed_at - 1.5) if j[0] == str(job)]
        assert early == [], (what, early, said)
