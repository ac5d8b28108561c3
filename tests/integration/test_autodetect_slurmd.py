"""AutoDetect=nvml observed, not derived: Slurm's own NVML plugin against the simulated driver.

Slurm 24.11 (Debian 13) and 26.05 (Debian unstable) ship Slurm's NVML GPU plugin, gpu_nvml.so,
in contrib's slurm-wlm-nvml-plugin (.ci/rootfs.sh installs it). Real `slurmd -G` with
``AutoDetect=nvml`` then loads the simulated libnvidia-ml.so.1 (tests/simnvml) and prints the GPU
GRES records it detects. For a plain node, a node with two GPU models and a MIG node, three
things must agree record by record, in index order:

1. what slurmd's AutoDetect detects (Type, File, Cores, Links),
2. what slurmd makes of the gres.conf that ``slurm-gpu gres-conf`` writes for the same GPUs, with
   the slurm.conf ``Gres=`` line that ``slurm-gpu gres-conf --slurm-conf-lines`` prints, and
3. our hooks' index mapping (slurm/gpumap.py) on the AutoDetect node: Slurm GPU k is the device
   file (and MIG instance) of slurmd's record k.

Debian 12's Slurm 22.05 has no NVML plugin to install: there the same test shows what slurmd
does with ``AutoDetect=nvml`` (no GPU record with a device file) - the documented difference
(docs/testbed.md, "Slurm versions").
"""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import simgpu
from test_hooks import deps_for, job_env
from testbed import _slurmd_cpus, slurm_version, slurmd_gres

from slurm_gpu.hooks import flows as hooks
from slurm_gpu.slurm import hostlist
from slurm_gpu.slurm.jobenv import from_env

from .sites import need_slurmd

pytestmark = pytest.mark.slurm
GOLDEN_MIG_MINORS = Path(__file__).resolve().parents[1] / "golden" / "gres" / "mig-minors"
PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib/slurm")
NODE = socket.gethostname().split(".")[0]  # the name `slurm-gpu gres-conf` writes for this node


def _has_nvml_plugin() -> bool:
    return any(os.path.exists(os.path.join(d, "gpu_nvml.so")) for d in PLUGIN_DIRS)


def _fit_affinity(node: Dict[str, Any]) -> Dict[str, Any]:
    """Give each GPU CPUs this machine has (a 2-core runner): slurmd masks affinity to online CPUs,
    and our generator refuses a GPU none of whose CPUs is online."""
    cpus = _slurmd_cpus()
    gpus = node["gpus"]
    for i, g in enumerate(gpus):
        k = i * cpus // len(gpus)
        g["cpu_affinity"] = str(k) if len(gpus) > 1 else f"0-{cpus - 1}"
    return node


def plain_node() -> Dict[str, Any]:
    return _fit_affinity(simgpu.h100_sxm(4, seed=NODE))


def mixed_node() -> Dict[str, Any]:
    """NVML order: an A100 PCIe (minor 0), then two H100 SXM (minors 1, 2)."""
    a100 = simgpu.a100_pcie(1, seed=NODE)["gpus"]
    h100 = simgpu.h100_sxm(2, seed=NODE)["gpus"]
    gpus = [copy.deepcopy(g) for g in a100 + h100]
    for i, g in enumerate(gpus):
        g["minor"] = i
    node = simgpu.h100_sxm(1, seed=NODE)
    node["gpus"] = gpus
    return _fit_affinity(node)


def mig_node() -> Dict[str, Any]:
    return _fit_affinity(simgpu.mig_gpu(1, seed=NODE))


NODES = {"plain": plain_node, "mixed": mixed_node, "mig": mig_node}


def _cli(node, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], env=node.env(), capture_output=True,
                          text=True, timeout=120)


def _ours(node, version: str) -> Dict[str, str]:
    """(gres.conf, the Gres= of slurm.conf) as `slurm-gpu gres-conf` writes them for this node."""
    common = ["gres-conf", "--type-naming", "autodetect", "--slurm-version", version]
    conf = _cli(node, *common)
    lines = _cli(node, *common, "--slurm-conf-lines")
    assert conf.returncode == 0 and lines.returncode == 0, conf.stderr + lines.stderr
    line = next(ln for ln in lines.stdout.splitlines() if ln.startswith(f"NodeName={NODE} "))
    gres = next(w for w in line.split() if w.startswith("Gres="))
    return {"gres_conf": conf.stdout, "node_gres": gres[len("Gres="):]}


def _simulated_env(node) -> Dict[str, str]:
    """What slurmd needs to load the simulated driver: Slurm's NVML plugin dlopen()s
    libnvidia-ml.so.1 through the library search path."""
    return {"LD_LIBRARY_PATH": str(node.lib.parent), "SIMNVML_STATE": str(node.state)}


def _mig_minors(kind: str):
    return GOLDEN_MIG_MINORS.read_text() if kind == "mig" else None


def _device_files(make, kind: str) -> None:
    files = [f"/dev/nvidia{i}" for i in range(4)]
    if kind == "mig":
        for line in GOLDEN_MIG_MINORS.read_text().splitlines():
            name, _, minor = line.partition(" ")
            if name.startswith("gpu0/"):
                files.append(f"/dev/nvidia-caps/nvidia-cap{minor}")
    make(files)


@pytest.mark.parametrize("kind", sorted(NODES))
def test_autodetect_equals_our_gres_conf_and_our_index_mapping(kind, sim_node, slurmd_munge, tmp_path, device_files):
    version = "%d.%02d.%d" % slurm_version()
    node = sim_node(NODES[kind]())
    node.write_config(f'[gres]\nmig_minors_path = "{GOLDEN_MIG_MINORS}"\n')
    _device_files(device_files, kind)
    ours = _ours(node, version)
    need_slurmd()
    munge = slurmd_munge
    if not _has_nvml_plugin():
        _autodetect_is_unavailable(node, munge, tmp_path, ours["node_gres"])
        return

    detected, out_a = slurmd_gres(tmp_path / "autodetect", munge, NODE, ours["node_gres"], "AutoDetect=nvml\n",
                                  env=_simulated_env(node), mig_minors=_mig_minors(kind))
    from_ours, out_b = slurmd_gres(tmp_path / "ours", munge, NODE, ours["node_gres"], ours["gres_conf"])
    assert detected, f"AutoDetect found no GPU:\n{out_a}"
    assert all(r.type for r in detected), f"slurmd could not match a detected GPU to Gres={ours['node_gres']}:\n{out_a}"
    assert _per_device(detected) == _per_device(from_ours), \
        f"AutoDetect:\n{out_a}\n--- our gres.conf:\n{ours['gres_conf']}\n{out_b}"

    # Our hooks on the AutoDetect node: Slurm GPU k is slurmd's record k.
    (node.tmp / "slurm.conf").write_text(f"ClusterName=sgtest\nGresTypes=gpu\nNodeName={NODE} CPUs=2 "
                                         f"Gres={ours['node_gres']}\nPartitionName=gpu Nodes={NODE}\n")
    (node.tmp / "gres.conf").write_text("AutoDetect=nvml\n")
    indices = ",".join(str(k) for k in range(len(detected)))
    mapped = hooks.map_gpus(deps_for(node), from_env(job_env(gpus=indices, SLURMD_NODENAME=NODE)))
    assert mapped.source == "autodetect"
    caps = _caps_by_instance()
    for rec, gpu in zip(detected, mapped.gpus):
        want = rec.files.split(",")  # AutoDetect's records hold one GPU (or slice) each
        assert gpu.device == want[0], (rec.line, gpu)
        if gpu.mig is not None:
            gi, ci = int(gpu.mig.gpu_instance_id), int(gpu.mig.compute_instance_id)
            assert want[1:] == [f"/dev/nvidia-caps/nvidia-cap{caps[(0, gi, None)]}",
                                f"/dev/nvidia-caps/nvidia-cap{caps[(0, gi, ci)]}"], (rec.line, gpu)
        else:
            assert len(want) == 1, (rec.line, gpu)


def _per_device(records) -> List[Tuple[str, str, str, str]]:
    """(type, files, cores, links) per GPU or MIG slice. slurmd prints a gres.conf line of
    several files (File=/dev/nvidia[0-1]) as one record of Count=2: one entry per file here.
    Links: AutoDetect writes -1 for the GPU itself and 0 for every GPU without a direct NvLink
    (an NVSwitch node: Links=-1,0,0,0); `slurm-gpu gres-conf` leaves Links= out when no GPU pair
    has a direct link. Both mean that no GPU is closer to another, so both read as ''."""
    out = []
    for r in records:
        links = "" if all(v in ("0", "-1") for v in r.links.split(",") if v) else r.links
        files = [r.files] if "nvidia-caps" in r.files else hostlist.expand(r.files)
        out += [(r.type, f, r.cores, links) for f in files]
    return out


def _caps_by_instance() -> Dict[Any, int]:
    out: Dict[Any, int] = {}
    for line in GOLDEN_MIG_MINORS.read_text().splitlines():
        name, _, minor = line.partition(" ")
        parts = name.split("/")
        if len(parts) >= 3 and parts[0].startswith("gpu") and parts[1].startswith("gi"):
            gpu, gi = int(parts[0][3:]), int(parts[1][2:])
            ci = int(parts[2][2:]) if parts[2].startswith("ci") else None
            out[(gpu, gi, ci)] = int(minor)
    return out


def _autodetect_is_unavailable(node, munge, tmp_path: Path, node_gres: str) -> None:
    """Debian 12's Slurm 22.05 (no NVML plugin): slurmd says so and configures the GPUs of Gres=
    without device files, so Slurm neither binds nor constrains them. Sites there write gres.conf,
    which `slurm-gpu gres-conf` generates (tests/integration/test_gres_slurmd.py runs it here)."""
    records, out = slurmd_gres(tmp_path, munge, NODE, node_gres, "AutoDetect=nvml\n", env=_simulated_env(node))
    assert "nvml" in out.lower(), out
    assert not [r for r in records if r.files.startswith("/dev/")], out
