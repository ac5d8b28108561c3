"""`slurm-gpu fleet capacity` and the partitions of `fleet versions` against the real Slurm 22.05 testbed.

Three nodes with 4 h100 each, partition gpu (all three) and debug (gpu03): gpu01 drained by
slurm-gpu (`slurm-gpu drain`, reason `slurm-gpu: ...`), gpu02 drained by an admin with
`scontrol` and a reason of their own, a job holding 2 GPUs on gpu03.  Every command runs as a
subprocess with SLURM_CONF pointing at the testbed, as an admin runs it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
NODES = ("gpu01", "gpu02", "gpu03")


@pytest.fixture
def tb(slurm_testbed_factory):
    return slurm_testbed_factory(nodes=NODES, extra_slurm_conf="PartitionName=debug Nodes=gpu03 MaxTime=INFINITE State=UP")


def run_cli(tb, cfg: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(tb.env)
    e["SLURM_GPU_CONFIG"] = str(cfg)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


def wait_running(tb, job: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while tb.job_info(job).get("JobState") != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} not running: {tb.job_info(job)}"
        time.sleep(0.2)


def by_group(rows: List[Dict]) -> Dict:
    return {(r["partition"], r["model"]): r for r in rows}


def test_capacity_counts_our_drain_an_admin_drain_and_a_running_job(tb, cfg_file):
    r = run_cli(tb, cfg_file, "drain", "gpu01", "--reason", "GPU 2 replaced, burn-in pending")
    assert r.returncode == 0, r.stderr
    tb.run("scontrol", "update", "NodeName=gpu02", "State=DRAIN", "Reason=disk replacement")
    job = tb.sbatch("sleep 120", args=["-p", "gpu", "-w", "gpu03", "--gres=gpu:2"])
    try:
        wait_running(tb, job)
        tb.wait_node_state("gpu02", "DRAIN")
        r = run_cli(tb, cfg_file, "fleet", "capacity", "--json")
        assert r.returncode == 1, r.stdout + r.stderr  # 20 % of 12 is 3 idle GPUs; 2 are
        rows = by_group(json.loads(r.stdout))
        gpu = rows[("gpu", "h100")]
        assert {k: gpu[k] for k in ("nodes", "total", "allocated", "idle", "drained_slurm_gpu", "drained_admin",
                                    "down", "reserve_target", "reserve_holds", "shortfall")} == dict(
            nodes=3, total=12, allocated=2, idle=2, drained_slurm_gpu=4, drained_admin=4, down=0,
            reserve_target=3, reserve_holds="no", shortfall=1)
        debug = rows[("debug", "h100")]
        assert (debug["total"], debug["allocated"], debug["idle"], debug["reserve_holds"]) == (4, 2, 2, "yes")
        assert rows[("(cluster)", "h100")]["reserve_holds"] == "no"
        r = run_cli(tb, cfg_file, "fleet", "capacity", "--reserve-pct", "10")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "drained (slurm-gpu)" in r.stdout.splitlines()[0]
    finally:
        tb.run("scancel", str(job), check=False)


def test_capacity_cannot_read_slurm_is_exit_4_with_a_hint(tb, cfg_file, tmp_path):
    e = dict(tb.env, SLURM_CONF=str(tmp_path / "missing.conf"), SLURM_GPU_CONFIG=str(cfg_file),
             PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "fleet", "capacity"], env=e, capture_output=True,
                       text=True, timeout=60, cwd=str(REPO))
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stderr.startswith("slurm-gpu: error: ") and "\nhint: " in r.stderr


def test_versions_groups_by_slurm_partition_and_names_nodes_that_never_reported(tb, cfg_file, tmp_path):
    inv = tmp_path / "inv"
    inv.mkdir()
    for node, driver in (("gpu01", "550.54.15"), ("gpu02", "535.104.05")):
        doc = {"format": "slurm-gpu-inventory/2", "hostname": node, "driver_version": driver, "cuda_version": "12.4",
               "collected_at": time.time(), "gpus": [
                   {"index": i, "minor": i, "uuid": f"GPU-{node}-{i}", "name": "NVIDIA H100 80GB HBM3",
                    "pci_bus_id": f"00000000:{0x18 + i:02x}:00.0", "serial": f"{node}{i}", "vbios": "96.00.74.00.01"}
                   for i in range(4)]}
        (inv / f"{node}.json").write_text(json.dumps(doc))
    r = run_cli(tb, cfg_file, "fleet", "versions", "--inventory-dir", str(inv), "--format", "json")
    assert r.returncode == 1, r.stderr
    rows = json.loads(r.stdout)
    drv = [x for x in rows if x["partition"] == "gpu" and x["component"] == "driver"][0]
    assert drv["nodes"] == 2 and drv["status"] == "inconsistent (no majority: tie)"
    never = {(x["partition"], x["unknown"]) for x in rows if x["status"] == "never reported"}
    assert never == {("gpu", "gpu03"), ("debug", "gpu03")}
    assert "partitions could not be read" not in r.stderr
