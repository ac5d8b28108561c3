"""A real Slurm 22.05 slurmd accepts what `slurm-gpu gres-conf` generates.

Two levels:
* `slurmd -G` (no daemons, ~0.1 s): slurmd parses slurm.conf + gres.conf, prints the GRES it
  configured and exits.  It reports bad Cores=, missing device files and count/type
  mismatches with slurm.conf as error:/WARNING: lines, so a clean run plus the expected
  "Gres ..." lines is acceptance.  A negative control proves the check can fail.
* the two-node testbed (tests/testbed.py): slurmctld registers both nodes with our file;
  `scontrol show node` must show the expected Gres and no INVAL state.

Both need root (device files under /dev, slurmd) and the Debian slurmd package.  Device
files this test creates are removed afterwards; existing ones are left alone.
"""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import List

import pytest
from testbed import parse_gres_records, slurmd_gres, unavailable

from slurm_gpu.gres import generate as gres
from slurm_gpu.gres import inventory

from .sites import need_slurmd

HERE = Path(__file__).resolve().parent.parent
INV = HERE / "golden" / "gres" / "inventory"

pytestmark = pytest.mark.slurm


def _host_cores() -> List[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _host_inventory(fixture: str, host: str, minors: List[int] = None) -> dict:
    """A fixture inventory re-homed on this machine: Cores= must exist here or slurmd rejects them."""
    d = json.loads((INV / f"{fixture}.json").read_text())
    d = copy.deepcopy(d)
    d["hostname"] = host
    cores = _host_cores()
    half = max(len(d["gpus"]) // 2, 1)
    for i, g in enumerate(d["gpus"]):
        c = cores[0] if i < half else cores[min(1, len(cores) - 1)]
        g["cores"] = g["cpu_affinity"] = str(c)
        if minors is not None:
            g["minor"] = minors[i]
    return d


def _files(text: str) -> List[str]:
    out: List[str] = []
    for line in text.splitlines():
        m = re.search(r"\b(?:File|MultipleFiles)=(\S+)", line)
        if m and not line.startswith("#"):
            from slurm_gpu.slurm import hostlist
            out += hostlist.expand(m.group(1))
    return out


def _slurmd_G(tmp_path: Path, munge, node: str, gres_conf: str, slurm_gres: str) -> str:
    need_slurmd()
    gres = slurm_gres[len("Gres="):] if slurm_gres.startswith("Gres=") else slurm_gres
    return slurmd_gres(tmp_path, munge, node, gres, gres_conf, cpus=len(_host_cores()))[1]


def _generate(docs, tmp_path: Path, naming: str):
    d = tmp_path / "inv"
    d.mkdir(exist_ok=True)
    for doc in docs:
        (d / f"{doc['hostname']}.json").write_text(json.dumps(doc))
    groups = gres.build(inventory.load_all([str(d)]), naming, {})
    text = gres.render_gres_conf(groups, naming=naming)
    slurm_lines = gres.render_slurm_conf_lines(groups)
    gres_part = {}
    for line in slurm_lines.splitlines():
        m = re.match(r"NodeName=(\S+) (Gres=\S+)", line)
        if m:
            gres_part[m.group(1)] = m.group(2)
    return text, gres_part


def _parsed(out: str) -> List[str]:
    return [r.line for r in parse_gres_records(out)]


def _problems(out: str) -> List[str]:
    # 22.05 says "WARNING:", 24.11 and 26.05 "warning:". 26.05 also warns on every start on a
    # cgroup v1 machine (this runner's kernel), which says nothing about gres.conf.
    return [l for l in out.splitlines() if re.search(r"(?i)error:|fatal:|warning:", l)
            and "cgroup/v1 plugin is deprecated" not in l]


@pytest.mark.parametrize("fixture, naming, expect", [
    ("hgx001", "autodetect", [("nvidia_h100_80gb_hbm3", 4, "/dev/nvidia[0-3]"),
                              ("nvidia_h100_80gb_hbm3", 4, "/dev/nvidia[4-7]")]),
    ("pcie01", "short", [("a100", 2, "/dev/nvidia[0-1]"), ("a100", 2, "/dev/nvidia[2-3]")]),
    ("mig01", "autodetect", [("nvidia_a100_3g.20gb", 1,
                              "/dev/nvidia0,/dev/nvidia-caps/nvidia-cap12,/dev/nvidia-caps/nvidia-cap13"),
                             ("nvidia_a100_2g.10gb", 1, None), ("nvidia_a100_1g.5gb", 1, None)]),
])
def test_slurmd_parses_generated_gres_conf_cleanly(tmp_path, device_files, slurmd_munge, fixture, naming, expect):
    need_slurmd()
    node = "gresnode1"
    text, gres_part = _generate([_host_inventory(fixture, node)], tmp_path, naming)
    device_files(_files(text))
    out = _slurmd_G(tmp_path, slurmd_munge, node, text, gres_part[node])
    assert _problems(out) == [], out
    parsed = _parsed(out)
    assert len(parsed) == len(expect), out
    for line, (typ, count, files) in zip(parsed, expect):
        assert f" Type={typ} Count={count} " in line, out
        if files:
            assert f" File={files} " in line, out


def test_slurmd_flags_cores_the_node_does_not_have(tmp_path, device_files, slurmd_munge):
    # Negative control: the acceptance check above would catch a bad Cores= (wrong topology).
    need_slurmd()
    node = "gresnode1"
    doc = _host_inventory("pcie01", node)
    doc["gpus"][0]["cores"] = "0-4095"
    text, gres_part = _generate([doc], tmp_path, "short")
    device_files(_files(text))
    out = _slurmd_G(tmp_path, slurmd_munge, node, text, gres_part[node])
    assert any("Cores=0-4095" in l for l in _problems(out)), out


def test_slurmd_flags_a_gres_count_slurm_conf_does_not_expect(tmp_path, device_files, slurmd_munge):
    need_slurmd()
    node = "gresnode1"
    text, _ = _generate([_host_inventory("pcie01", node)], tmp_path, "short")
    device_files(_files(text))
    out = _slurmd_G(tmp_path, slurmd_munge, node, text, "Gres=gpu:a100:2")
    assert _problems(out), out


# --- the two-node testbed --------------------------------------------------------------------

def test_testbed_slurmd_accepts_generated_gres_conf(tmp_path, device_files):
    need_slurmd()
    import testbed as tb

    # Both nodes share this machine and its /dev/nvidia0-3: identical inventories, one hostlist line.
    docs = [_host_inventory("pcie01", n) for n in ("gpu01", "gpu02")]
    text, gres_part = _generate(docs, tmp_path, "short")
    assert "NodeName=gpu[01-02] Name=gpu Type=a100 File=/dev/nvidia[0-1]" in text
    assert gres_part == {"gpu[01-02]": "Gres=gpu:a100:4"}
    device_files(_files(text))
    bed = tb.SlurmTestbed(tmp_path / "bed", nodes=("gpu01", "gpu02"), gpus_per_node=4, gpu_type="a100", gres_conf=text)
    try:
        bed.start()
    except tb.TestbedUnavailable as e:
        unavailable(str(e))
    try:
        assert (bed.conf_dir / "gres.conf").read_text() == text
        for node in ("gpu01", "gpu02"):
            info = bed.node_info(node)
            assert "INVAL" not in info.get("State", ""), info
            assert re.match(r"gpu:a100:4(\(S:[0-9-,]+\))?$", info.get("Gres", "")), info
        # and a job can get the GPUs the file describes
        job = bed.sbatch("#!/bin/sh\necho gpus=$CUDA_VISIBLE_DEVICES\n", args=["--gres=gpu:a100:2", "-w", "gpu02"])
        assert bed.wait_job(job) == "COMPLETED"
        assert "gpus=0,1" in bed.job_output(job)
    finally:
        bed.stop()
