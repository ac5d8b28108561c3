"""Slurm's GPU indices, checked against real Slurm 22.05: our numbering equals slurmd's.

* Differential: `slurmd -G` prints the node's GPU GRES records in index order; for each
  configuration below our slurmconf.node_gres_records must name the same device files in
  the same order (mixed types, untyped, hostlists, continuations, MIG MultipleFiles).
* Real cluster: a mixed-type node (Gres=gpu:a100:1,gpu:v100:2, gres.conf lines not in type
  order) and a MIG node (one A100, three slices) under real slurmd with our prolog/epilog:
  the a100 job gets /dev/nvidia1 — not /dev/nvidia0 as a minor-order mapping would say — and
  two jobs on two slices of one GPU run side by side, neither harming the other.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import simgpu

from slurm_gpu.slurm import conf as slurmconf

from .sites import Site, hook_script, slurmd_order, wait_running

pytestmark = pytest.mark.slurm
GOLDEN_MIG_MINORS = Path(__file__).resolve().parents[1] / "golden" / "gres" / "mig-minors"
CAPS = {1: (12, 13), 5: (48, 49), 13: (120, 121)}  # gpu0 gi -> (gi cap, ci0 cap) in the golden mig-minors


CASES = {
    "types_in_slurm_conf_order": ("gpu:a100:1,gpu:v100:2",
                                  "NodeName=n1 Name=gpu Type=v100 File=/dev/nvidia0\n"
                                  "NodeName=n1 Name=gpu Type=a100 File=/dev/nvidia1\n"
                                  "NodeName=n1 Name=gpu Type=v100 File=/dev/nvidia2\n"),
    "reverse_lines_within_a_type": ("gpu:v100:2,gpu:a100:1",
                                    "Name=gpu Type=v100 File=/dev/nvidia2\nName=gpu Type=a100 File=/dev/nvidia1\n"
                                    "Name=gpu Type=v100 File=/dev/nvidia0\n"),
    "untyped_line_order_with_ranges": ("gpu:4", "Name=gpu File=/dev/nvidia3\nName=gpu File=/dev/nvidia[0-2]\n"),
    "hostlist_and_continuation": ("gpu:t4:2,gpu:h100:2",
                                  "NodeName=n[0-2] Name=gpu Type=h100 \\\n File=/dev/nvidia[4-5]\n"
                                  "NodeName=n1,n7 Name=gpu Type=t4 File=/dev/nvidia[6-7]\n"),
    "mig_slices": ("gpu:a100_3g.20gb:1,gpu:a100_1g.5gb:2",
                   "Name=gpu Type=a100_1g.5gb "
                   "MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap120,/dev/nvidia-caps/nvidia-cap121\n"
                   "Name=gpu Type=a100_3g.20gb "
                   "MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap12,/dev/nvidia-caps/nvidia-cap13\n"
                   "Name=gpu Type=a100_1g.5gb "
                   "MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap48,/dev/nvidia-caps/nvidia-cap49\n"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_gpu_numbering_equals_slurmds(case, tmp_path, device_files, slurmd_munge):
    gres_line, gres_conf = CASES[case]
    device_files([f"/dev/nvidia{i}" for i in range(8)] +
                 [f"/dev/nvidia-caps/nvidia-cap{c}" for pair in CAPS.values() for c in pair])
    (tmp_path / "slurm.conf").write_text("ClusterName=t\nSlurmctldHost=localhost\nGresTypes=gpu\nDebugFlags=Gres\n"
                                         f"NodeName=n1 CPUs=2 Gres={gres_line}\nPartitionName=p Nodes=n1\n")
    (tmp_path / "gres.conf").write_text(gres_conf)
    ours, _ = slurmconf.node_gres_records(str(tmp_path / "slurm.conf"), "n1")
    assert [",".join(r.files) for r in ours] == slurmd_order(tmp_path, "n1", slurmd_munge)


# --------------------------------------------------------------------------- the real cluster

MIXED_GRES = ("NodeName=gpu01 Name=gpu Type=v100 File=/dev/nvidia0\n"
              "NodeName=gpu01 Name=gpu Type=a100 File=/dev/nvidia1\n"
              "NodeName=gpu01 Name=gpu Type=v100 File=/dev/nvidia2\n")
MIG_MINOR = 3  # gpu02's A100: /dev/nvidia3


def _mig_caps() -> dict:
    minors = {}
    for line in GOLDEN_MIG_MINORS.read_text().splitlines():
        name, _, minor = line.partition(" ")
        minors[name] = int(minor)
    return {gi: (minors[f"gpu{MIG_MINOR}/gi{gi}/access"], minors[f"gpu{MIG_MINOR}/gi{gi}/ci0/access"]) for gi in (1, 5, 13)}


def _mig_gres() -> str:
    caps = _mig_caps()
    return "".join(f"NodeName=gpu02 Name=gpu Type={t} MultipleFiles=/dev/nvidia{MIG_MINOR},"
                   f"/dev/nvidia-caps/nvidia-cap{caps[gi][0]},/dev/nvidia-caps/nvidia-cap{caps[gi][1]}\n"
                   for gi, t in ((1, "a100_3g.20gb"), (5, "a100_2g.10gb"), (13, "a100_1g.5gb")))


@pytest.fixture(scope="module")
def mixed_site(tmp_path_factory):
    root = Path("/tmp") / f"slurm-gpu-gresmap-{os.getpid()}"
    site = Site(root)
    site.minors = {"gpu01": [0, 1, 2], "gpu02": [MIG_MINOR]}
    yield site
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mixed_cluster(mixed_site, slurm_testbed_factory, device_files):
    device_files([f"/dev/nvidia-caps/nvidia-cap{c}" for pair in _mig_caps().values() for c in pair])
    site = mixed_site
    shutil.rmtree(site.root / "gpu01", ignore_errors=True)
    shutil.rmtree(site.root / "gpu02", ignore_errors=True)
    prof = simgpu.h100_sxm(3, seed="gpu01")
    simgpu.write_state(site.state("gpu01"), prof)
    mig = simgpu.mig_gpu(1, seed="gpu02")
    mig["gpus"][0]["minor"] = MIG_MINOR
    simgpu.write_state(site.state("gpu02"), mig)
    for node in ("gpu01", "gpu02"):
        (site.root / f"{node}.kmsg").write_text("")
    config = site.config() + f'[gres]\nmig_minors_path = "{GOLDEN_MIG_MINORS}"\n'
    bed = slurm_testbed_factory(prolog=hook_script("slurm-gpu-prolog"), epilog=hook_script("slurm-gpu-epilog"),
                                slurm_gpu_config=config, prolog_epilog_timeout=60, gpus_per_node=3,
                                node_gres={"gpu01": "gpu:a100:1,gpu:v100:2",
                                           "gpu02": "gpu:a100_3g.20gb:1,gpu:a100_2g.10gb:1,gpu:a100_1g.5gb:1"},
                                gres_conf=MIXED_GRES + _mig_gres())
    return bed, site


def test_a100_job_on_mixed_node_gets_the_a100_not_device_zero(mixed_cluster):
    bed, site = mixed_cluster
    # The v100 on /dev/nvidia0 is broken: a minor-order mapping would judge it for the a100 job
    # (Slurm index 0) and drain the node.
    simgpu.set_gpu(site.state("gpu01"), 0, ecc_volatile_uncorrected=4)
    job = bed.sbatch("sleep 1", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:a100:1"])
    assert bed.wait_job(job, timeout=60) == "COMPLETED", site.log("gpu01")
    assert "DRAIN" not in bed.node_info("gpu01")["State"], site.log("gpu01")
    a100_uuid = simgpu.h100_sxm(3, seed="gpu01")["gpus"][1]["uuid"]  # minor 1
    recs = site.rows("gpu01", "SELECT gpu_uuid, gpu_index FROM job_gpus WHERE job_id=?", job)
    assert recs == [{"gpu_uuid": a100_uuid, "gpu_index": 1}], site.log("gpu01")
    assert {a["gpu"] for a in simgpu.read_actions(site.state("gpu01"))} == {1}  # only the a100 was reset
    # A v100 job does land on the broken GPU and drains the node naming it.
    job2 = bed.sbatch("sleep 1", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:v100:2"])
    bed.wait_node_state("gpu01", "DRAIN", timeout=60)
    reason = bed.node_info("gpu01")["Reason"]
    assert "GPU 0 (" in reason and "uncorrectable ECC errors: 4" in reason and f"[prolog job {job2}; check " in reason
    bed.run("scancel", str(job2), check=False)


def test_two_jobs_on_two_mig_slices_of_one_gpu_do_not_harm_each_other(mixed_cluster):
    bed, site = mixed_cluster
    pidfile = bed.jobs_dir / "slice-job.pid"
    pidfile.unlink(missing_ok=True)
    # Job A on the 1g.5gb slice (gi 13, Slurm index 2) keeps a process on its slice.
    a = bed.sbatch(f"echo $$ > {pidfile}; sleep 20", args=["-p", "gpu", "-w", "gpu02", "--gres=gpu:a100_1g.5gb:1"])
    wait_running(bed, site, "gpu02", a)
    end = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < end:
        time.sleep(0.1)
    pid_a = int(pidfile.read_text())
    simgpu.append_lines(site.state("gpu02"), [f"gpu.0.mig.2.procs={pid_a}:{2 << 30}", f"gpu.0.mig.2.memory_used={2 << 30}"])
    assert "IDX:2" in bed.run("scontrol", "-d", "show", "job", str(a)).stdout
    # Job B on the 3g.20gb slice of the same GPU starts (slice A busy is not B's leftover) and ends.
    b = bed.sbatch("sleep 1", args=["-p", "gpu", "-w", "gpu02", "--gres=gpu:a100_3g.20gb:1"])
    assert bed.wait_job(b, timeout=60) == "COMPLETED", site.log("gpu02")
    assert os.path.exists(f"/proc/{pid_a}"), "B's epilog killed job A's process:\n" + site.log("gpu02")
    assert bed.job_info(a)["JobState"] == "RUNNING"
    assert "DRAIN" not in bed.node_info("gpu02")["State"], site.log("gpu02")
    # No clock reset or accounting clear on the shared GPU.
    assert not {x["function"] for x in simgpu.read_actions(site.state("gpu02"))} & {
        "nvmlDeviceResetApplicationsClocks", "nvmlDeviceClearAccountingPids"}
    rec = site.rows("gpu02", "SELECT gpu_uuid, parent_gpu_uuid, gpu_model, energy_j, notes FROM job_gpus WHERE job_id=?", b)
    assert len(rec) == 1 and rec[0]["gpu_uuid"].startswith("MIG-") and "3g.20gb" in rec[0]["gpu_model"]
    assert rec[0]["energy_j"] is None and "per instance" in rec[0]["notes"]
    bed.run("scancel", str(a), check=False)
