"""Slurm 25.11's expedited requeue (`sbatch --requeue=expedite`, `SlurmctldParameters=
enable_expedited_requeue`) against our epilog, on the versions that have it (26.05 here; no Debian
ships 25.11).  Observed on 26.05.5: a job that exits non-zero is requeued; it runs again at once and
first when an epilog failed, and is held (REQUEUE_HOLD, "no epilogs failed") otherwise.  Our epilog
fails exactly when it found a GPU fault and drained the node for it (hooks/epilog.epilog_exit), and
Slurm keeps our drain reason.
"""
from __future__ import annotations

import time

import pytest
import simgpu
from testbed import slurm_version

from .sites import Site, hook_script, hooked_cluster, node_reasons, site_fixture

pytestmark = pytest.mark.slurm

site = site_fixture(Site, "expedite")


EXPEDITE = slurm_version()[:2] >= (25, 11)


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    extra = "SlurmctldParameters=enable_expedited_requeue\n" if EXPEDITE else ""
    return hooked_cluster(site, slurm_testbed_factory, extra_slurm_conf=extra)


def _runs(cluster, job: int, want: int, timeout: float = 60) -> list:
    """(state, node) of each run of the job in accounting (sacct -D, in order), once there are `want`."""
    end = time.monotonic() + timeout
    while True:
        out = cluster.run("sacct", "-n", "-P", "-D", "-X", "-j", str(job), "-o", "State,NodeList").stdout
        runs = [tuple(line.split("|")) for line in out.splitlines() if line.strip()]
        if len(runs) >= want or time.monotonic() > end:
            return runs
        time.sleep(0.5)


def _fault_where_it_runs(cluster, site, job: int) -> str:
    end = time.monotonic() + 30
    while cluster.job_info(job).get("JobState") != "RUNNING" or f"prolog pass job={job} " not in \
            site.log(cluster.job_info(job).get("NodeList", "")):
        assert time.monotonic() < end, cluster.job_info(job)
        time.sleep(0.1)
    node = cluster.job_info(job)["NodeList"]
    for i in range(4):
        simgpu.set_gpu(site.state(node), i, ecc_volatile_uncorrected=2)
    return node


def test_a_failed_job_whose_gpu_failed_in_the_epilog_runs_again_at_once_elsewhere(cluster, site):
    if not EXPEDITE:
        r = cluster.run("sbatch", "--requeue=expedite", "--wrap", "true", check=False)
        assert r.returncode != 0, r.stdout  # 22.05 and 24.11 know no expedited requeue
        return
    job = cluster.sbatch("sleep 3; exit 3", args=["--requeue=expedite", "--gres=gpu:1"])
    first = _fault_where_it_runs(cluster, site, job)
    other = "gpu02" if first == "gpu01" else "gpu01"
    runs = _runs(cluster, job, 3)
    # Run 0 on the faulty node, requeued; run 1 on the other node at once; then held, since no epilog
    # failed there (Slurm's rule for a job that keeps exiting non-zero).
    assert runs[0] == ("REQUEUED", first) and runs[1][1] == other, runs
    reasons = {r["node"]: r["reason"] for r in node_reasons(cluster)}
    assert f"[epilog job {job}; check ecc_uncorrectable]" in reasons[first] and other not in reasons, reasons
    cluster.run("scancel", str(job))


def test_a_job_that_succeeded_is_not_requeued_by_a_gpu_fault_in_its_epilog(cluster, site):
    job = cluster.sbatch("sleep 3", args=(["--requeue=expedite"] if EXPEDITE else ["--requeue"]) + ["--gres=gpu:1"])
    first = _fault_where_it_runs(cluster, site, job)
    assert cluster.wait_job(job, timeout=60) == "COMPLETED"
    assert _runs(cluster, job, 1) == [("COMPLETED", first)]
    reasons = {r["node"]: r["reason"] for r in node_reasons(cluster)}
    assert f"[epilog job {job}; check ecc_uncorrectable]" in reasons[first], reasons


def test_a_bug_of_ours_in_the_epilog_requeues_nothing(site, slurm_testbed_factory, tmp_path):
    """The epilog hits a bug of ours (an exception injected into its last step, through a
    sitecustomize only this epilog's interpreter loads): it fails open, exit 0, so Slurm sees no
    epilog failure.  From 25.11 a job that exited non-zero is then held, never requeued at once onto
    another node by our mistake; on older versions nothing is requeued either."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import slurm_gpu.hooks.epilog as epilog\n\n\n"
        "def _bug(*args, **kwargs):\n    raise RuntimeError('injected: a bug of ours')\n\n\n"
        "epilog.epilog_exit = _bug\n")
    wrapper = tmp_path / "epilog-with-a-bug"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={inject} exec {hook_script('slurm-gpu-epilog')}\n")
    wrapper.chmod(0o755)
    site.reset()
    extra = "SlurmctldParameters=enable_expedited_requeue\n" if EXPEDITE else ""
    cluster = slurm_testbed_factory(prolog=hook_script("slurm-gpu-prolog"), epilog=str(wrapper),
                                    slurm_gpu_config=site.config(), prolog_epilog_timeout=60, extra_slurm_conf=extra)
    job = cluster.sbatch("sleep 3; exit 3", args=(["--requeue=expedite"] if EXPEDITE else ["--requeue"]) +
                         ["--gres=gpu:1"])
    first = _fault_where_it_runs(cluster, site, job)
    end = time.monotonic() + 60
    while "internal-error" not in site.log(first):
        assert time.monotonic() < end, site.log(first)
        time.sleep(0.5)
    assert "injected: a bug of ours" in site.log(first)
    time.sleep(5)  # an expedited requeue starts the next run at once (under 2 s on 26.05): give it more
    runs = _runs(cluster, job, 2, timeout=2)
    # 26.05: ('REQUEUED', first), then the held record ('PENDING', 'None assigned'); no run anywhere else
    assert runs[0][1] == first and all(state == "PENDING" for state, _ in runs[1:]), runs
    assert cluster.job_info(job).get("JobState") != "RUNNING", cluster.job_info(job)
    reasons = {r["node"]: r["reason"] for r in node_reasons(cluster)}
    assert "Epilog error" not in reasons.get(first, ""), reasons  # Slurm saw no failed epilog
    cluster.run("scancel", str(job), check=False)
