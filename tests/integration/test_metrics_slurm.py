"""Metrics end to end: real jobs on the Slurm testbed write textfiles, Debian's node_exporter
serves them (one per node), Debian's Prometheus scrapes them, and the assertions go through
Prometheus's HTTP API — with the shipped alert rules loaded.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import simgpu
from prometheus import NodeExporter, Prometheus, PrometheusUnavailable, require
from testbed import unavailable

from .sites import hook_script, play_work, wait_running

pytestmark = pytest.mark.slurm

RULES = Path(__file__).resolve().parents[2] / "monitoring" / "alerts" / "slurm-gpu.rules.yml"


@pytest.fixture
def stack(site, slurm_testbed_factory, tmp_path):
    try:
        require("prometheus", "prometheus-node-exporter")
    except PrometheusUnavailable as e:
        unavailable(str(e))
    site.reset()
    textfiles = tmp_path / "textfile"
    config = site.config() + f'[metrics]\ntextfile_dir = "{textfiles}/%n"\n'
    bed = slurm_testbed_factory(prolog=hook_script("slurm-gpu-prolog"), epilog=hook_script("slurm-gpu-epilog"),
                                slurm_gpu_config=config, prolog_epilog_timeout=60)
    exporters = {}
    for node in ("gpu01", "gpu02"):
        (textfiles / node).mkdir(parents=True, exist_ok=True)
        exporters[node] = NodeExporter(textfiles / node, tmp_path / f"ne-{node}").start()
    prom = Prometheus({"node": [(e.address, {"node": n}) for n, e in exporters.items()]}, rule_files=[RULES],
                      workdir=tmp_path / "prometheus").start()
    yield bed, prom
    prom.cleanup()
    for e in exporters.values():
        e.cleanup()


def _values(result):
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}


def test_job_info_check_status_drain_and_usage_reach_prometheus(stack, site):
    bed, prom = stack
    busy = bed.sbatch("sleep 6", args=["-p", "gpu", "-w", "gpu01", "-A", "physics", "--gres=gpu:1"])
    idle = bed.sbatch("sleep 6", args=["-p", "gpu", "-w", "gpu02", "-A", "chem", "--gres=gpu:1"])
    wait_running(bed, site, "gpu01", busy)
    play_work(site, "gpu01", 0, energy_j=7_200, pid=5151, util=80, mem_util=30, peak_bytes=4 << 30, busy_ms=5000)
    # While the jobs run, each GPU they hold carries the job's info (the DCGM join key: UUID).
    held = prom.wait_for(f'slurm_gpu_job_info{{slurm_job=~"{busy}|{idle}"}}', lambda r: len(r) == 2)
    labels = {r["metric"]["slurm_job"]: r["metric"] for r in held}
    assert labels[str(busy)]["account"] == "physics" and labels[str(idle)]["account"] == "chem"
    assert labels[str(busy)]["node"] == "gpu01" and labels[str(busy)]["UUID"].startswith("GPU-")
    assert labels[str(busy)]["user"] == "sgtest" and labels[str(busy)]["partition"] == "gpu"
    for j in (busy, idle):
        assert bed.wait_job(j, timeout=90) == "COMPLETED"
    prom.wait_for(f'slurm_gpu_job_info{{slurm_job=~"{busy}|{idle}"}}', lambda r: r == [])
    # Usage counters equal the node databases' sums.
    for node, account in (("gpu01", "physics"), ("gpu02", "chem")):
        rows = site.rows(node, "SELECT SUM(end_time - start_time) AS alloc, SUM(energy_j) AS e FROM job_gpus "
                               "WHERE account = ?", account)[0]
        got = prom.wait_for(f'slurm_gpu_allocated_seconds_total{{node="{node}",account="{account}"}}',
                            lambda r: len(r) == 1)
        assert float(got[0]["value"][1]) == pytest.approx(rows["alloc"], abs=0.01)
        energy = prom.query(f'slurm_gpu_energy_joules_total{{node="{node}",account="{account}"}}')["result"]
        assert float(energy[0]["value"][1]) == pytest.approx(rows["e"] or 0.0, abs=0.01)
    # An uncorrectable ECC error on gpu01: the next job's prolog fails the check and drains the node.
    for i in range(4):
        simgpu.set_gpu(site.state("gpu01"), i, ecc_volatile_uncorrected=2)
    bed.sbatch("sleep 1", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    prom.wait_for('slurm_gpu_check_status{node="gpu01",check="ecc_uncorrectable",status="FAIL"} == 1',
                  lambda r: len(r) >= 1, timeout=60)
    drained = prom.wait_for('slurm_gpu_node_drained{node="gpu01"} == 1', lambda r: len(r) == 1, timeout=60)
    assert drained[0]["metric"]["reason"] == "ecc_uncorrectable"
    assert prom.query('slurm_gpu_node_drained{node="gpu02"} == 1')["result"] == []
    # The prolog reads only the job's GPU: its counter, not the others'.
    prom.wait_for('slurm_gpu_ecc_errors_total{node="gpu01",type="uncorrected",counter="volatile"} == 2',
                  lambda r: len(r) >= 1)
    # The shipped rules see it too (their `for:` delays firing; pending is enough here).
    prom.wait_for_alerts(lambda alerts: any(a["labels"].get("alertname") == "SlurmGpuCheckFailed"
                                            for a in alerts), timeout=60)
