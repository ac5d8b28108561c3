"""MIG Type= names as the site's Slurm version derives them (issue 10, "Slurm's names, Slurm's rules").

Verified in Slurm's source, src/plugins/gpu/nvml/gpu_nvml.c, _handle_mig() (docs/gres-conf.md):

* up to 23.02.5 (slurm-22-05-8-1, slurm-23-02-5-1):
  ``"_%ug.%lugb", gpuInstanceSliceCount, roundl(memorySizeMB / 1024.0)``
* from 23.02.6 (commits 04f0e4c3d7, a7b8997e52, e199093320, "Bug 17705"; same at
  slurm-25-11-7-1): the NVML MIG device name, lowercased, spaces to '_', from "mig_" on
  without the "mig"; fallback ``_[<ci>c.]<gi>g.<ceil(memorySizeMB / 1024)>gb``.

Both prefix the parent GPU's AutoDetect name cut at its first '-'.

The profiles below are real ones.  Memory sizes are what NVML reports for the instance
(nvidia-smi prints them in GiB with two decimals, here converted back to MiB):
* A100-SXM4-40GB: `nvidia-smi mig -lgip` in the NVIDIA developer forum thread
  https://forums.developer.nvidia.com/t/why-mig-instances-can-only-sum-up-to-98-sms-instead-of-the-108-sms-available/170488
  (4.75 / 9.75 / 19.62 / 19.62 / 39.50 GiB); 1c.3g.20gb and 1c.7g.40gb are compute-instance
  profiles from NVIDIA's MIG user guide (`nvidia-smi -L` example) and share their GPU instance's memory.
* A100-SXM4-80GB: NVIDIA/go-nvml pkg/nvml/mock/shared/gpus/a100.go (a100_80gb profiles,
  MemorySizeMB 9856 / 19968 / 19968 / 40192 / 40192 / 80384).  Real job scripts request the
  22.05 names these give (`nvidia_a100_3g.39gb`, `7g.79gb`, issue 10).
* A30: `nvidia-smi mig -lgip` in Summer-Lo/Docker_configuration 000-MIG/README.md
  (5.81 / 5.81 / 11.69 / 23.50 GiB).
* H100 80GB HBM3: `nvidia-smi mig -lgip` on https://jbarrow.ai/field_notes/nvidia-mig/
  (9.75 / 9.75 / 19.62 / 19.62 / 39.50 / 39.50 / 79.25 GiB).
* H200: NVIDIA/go-nvml pkg/nvml/mock/shared/gpus/h200.go (nominal sizes, 18432 ... 144384
  MiB: no measured `-lgip` output was found; the 22.05 names here follow from those numbers).
"""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from slurm_gpu.errors import InputError
from slurm_gpu.gres import collect, inventory
from slurm_gpu.gres import generate as gres
from slurm_gpu.slurm import conf as slurmconf

OLD = (22, 5, 8)
NEW = (23, 2, 6)

# (parent NVML name, MIG profile as NVML names the device, memory MiB, Slurm 22.05 type, Slurm >= 23.02.6 type)
PROFILES = [
    ("NVIDIA A100-SXM4-40GB", "1g.5gb", 4864, "nvidia_a100_1g.5gb", "nvidia_a100_1g.5gb"),
    ("NVIDIA A100-SXM4-40GB", "1g.5gb+me", 4864, "nvidia_a100_1g.5gb", "nvidia_a100_1g.5gb+me"),
    ("NVIDIA A100-SXM4-40GB", "2g.10gb", 9984, "nvidia_a100_2g.10gb", "nvidia_a100_2g.10gb"),
    ("NVIDIA A100-SXM4-40GB", "3g.20gb", 20096, "nvidia_a100_3g.20gb", "nvidia_a100_3g.20gb"),
    ("NVIDIA A100-SXM4-40GB", "4g.20gb", 20096, "nvidia_a100_4g.20gb", "nvidia_a100_4g.20gb"),
    ("NVIDIA A100-SXM4-40GB", "7g.40gb", 40448, "nvidia_a100_7g.40gb", "nvidia_a100_7g.40gb"),
    ("NVIDIA A100-SXM4-40GB", "1c.3g.20gb", 20096, "nvidia_a100_3g.20gb", "nvidia_a100_1c.3g.20gb"),
    ("NVIDIA A100-SXM4-40GB", "1c.7g.40gb", 40448, "nvidia_a100_7g.40gb", "nvidia_a100_1c.7g.40gb"),
    ("NVIDIA A100-SXM4-80GB", "1g.10gb", 9856, "nvidia_a100_1g.10gb", "nvidia_a100_1g.10gb"),
    ("NVIDIA A100-SXM4-80GB", "1g.20gb", 19968, "nvidia_a100_1g.20gb", "nvidia_a100_1g.20gb"),
    ("NVIDIA A100-SXM4-80GB", "2g.20gb", 19968, "nvidia_a100_2g.20gb", "nvidia_a100_2g.20gb"),
    ("NVIDIA A100-SXM4-80GB", "3g.40gb", 40192, "nvidia_a100_3g.39gb", "nvidia_a100_3g.40gb"),
    ("NVIDIA A100-SXM4-80GB", "4g.40gb", 40192, "nvidia_a100_4g.39gb", "nvidia_a100_4g.40gb"),
    ("NVIDIA A100-SXM4-80GB", "7g.80gb", 80384, "nvidia_a100_7g.79gb", "nvidia_a100_7g.80gb"),
    ("NVIDIA A30", "1g.6gb", 5952, "nvidia_a30_1g.6gb", "nvidia_a30_1g.6gb"),
    ("NVIDIA A30", "1g.6gb+me", 5952, "nvidia_a30_1g.6gb", "nvidia_a30_1g.6gb+me"),
    ("NVIDIA A30", "2g.12gb", 11968, "nvidia_a30_2g.12gb", "nvidia_a30_2g.12gb"),
    ("NVIDIA A30", "4g.24gb", 24064, "nvidia_a30_4g.24gb", "nvidia_a30_4g.24gb"),
    ("NVIDIA H100 80GB HBM3", "1g.10gb", 9984, "nvidia_h100_80gb_hbm3_1g.10gb", "nvidia_h100_80gb_hbm3_1g.10gb"),
    ("NVIDIA H100 80GB HBM3", "1g.10gb+me", 9984, "nvidia_h100_80gb_hbm3_1g.10gb", "nvidia_h100_80gb_hbm3_1g.10gb+me"),
    ("NVIDIA H100 80GB HBM3", "1g.20gb", 20096, "nvidia_h100_80gb_hbm3_1g.20gb", "nvidia_h100_80gb_hbm3_1g.20gb"),
    ("NVIDIA H100 80GB HBM3", "2g.20gb", 20096, "nvidia_h100_80gb_hbm3_2g.20gb", "nvidia_h100_80gb_hbm3_2g.20gb"),
    ("NVIDIA H100 80GB HBM3", "3g.40gb", 40448, "nvidia_h100_80gb_hbm3_3g.40gb", "nvidia_h100_80gb_hbm3_3g.40gb"),
    ("NVIDIA H100 80GB HBM3", "4g.40gb", 40448, "nvidia_h100_80gb_hbm3_4g.40gb", "nvidia_h100_80gb_hbm3_4g.40gb"),
    ("NVIDIA H100 80GB HBM3", "7g.80gb", 81152, "nvidia_h100_80gb_hbm3_7g.79gb", "nvidia_h100_80gb_hbm3_7g.80gb"),
    ("NVIDIA H200", "1g.18gb", 18432, "nvidia_h200_1g.18gb", "nvidia_h200_1g.18gb"),
    ("NVIDIA H200", "1g.18gb+me", 18432, "nvidia_h200_1g.18gb", "nvidia_h200_1g.18gb+me"),
    ("NVIDIA H200", "1g.35gb", 35840, "nvidia_h200_1g.35gb", "nvidia_h200_1g.35gb"),
    ("NVIDIA H200", "2g.35gb", 35840, "nvidia_h200_2g.35gb", "nvidia_h200_2g.35gb"),
    ("NVIDIA H200", "3g.71gb", 72704, "nvidia_h200_3g.71gb", "nvidia_h200_3g.71gb"),
    ("NVIDIA H200", "4g.71gb", 72704, "nvidia_h200_4g.71gb", "nvidia_h200_4g.71gb"),
    ("NVIDIA H200", "7g.141gb", 144384, "nvidia_h200_7g.141gb", "nvidia_h200_7g.141gb"),
]


def _type(parent, profile, mib, version):
    return gres.mig_type(parent, f"{parent} MIG {profile}", profile, "autodetect", {},
                         memory_mib=mib, slurm_version=version)


@pytest.mark.parametrize("parent, profile, mib, old, new", PROFILES)
def test_slurm_22_05_names_mig_types_from_memory_rounded_to_gib(parent, profile, mib, old, new):
    assert _type(parent, profile, mib, OLD) == old
    assert _type(parent, profile, mib, (23, 2, 5)) == old  # the change came with 23.02.6


@pytest.mark.parametrize("parent, profile, mib, old, new", PROFILES)
def test_slurm_23_02_6_and_later_name_mig_types_from_the_profile(parent, profile, mib, old, new):
    for version in (NEW, (23, 11, 0), (24, 5, 4), (25, 11, 2)):
        assert _type(parent, profile, mib, version) == new


def test_the_a100_80gb_names_real_job_scripts_request_under_22_05():
    assert _type("NVIDIA A100-SXM4-80GB", "3g.40gb", 40192, OLD) == "nvidia_a100_3g.39gb"
    assert _type("NVIDIA A100-SXM4-80GB", "7g.80gb", 80384, OLD) == "nvidia_a100_7g.79gb"
    # A GPU name without '-' is kept whole (nvidia_a100_80gb_pcie_3g.39gb in job scripts)
    assert _type("NVIDIA A100 80GB PCIe", "3g.40gb", 40192, OLD) == "nvidia_a100_80gb_pcie_3g.39gb"


def test_newer_slurm_without_a_profile_in_the_nvml_name_falls_back_to_rounded_up_memory():
    # gpu_nvml.c's backup path: "_[<ci>c.]<gi>g.<ceil(MiB/1024)>gb"
    got = gres.mig_type("NVIDIA A100-SXM4-80GB", "", "1c.3g.40gb", "autodetect", {}, memory_mib=40192, slurm_version=NEW)
    assert got == "nvidia_a100_1c.3g.40gb"
    got = gres.mig_type("NVIDIA A100-SXM4-80GB", "", "7g.80gb", "autodetect", {}, memory_mib=80384, slurm_version=NEW)
    assert got == "nvidia_a100_7g.79gb"


def test_22_05_naming_without_the_instance_memory_is_an_error_not_a_guess():
    with pytest.raises(InputError, match="memory") as e:
        gres.mig_type("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "3g.40gb", "autodetect", {},
                      memory_mib=None, slurm_version=OLD)
    assert "inventory" in e.value.hint


def test_autodetect_naming_of_a_mig_device_without_a_slurm_version_is_an_error():
    with pytest.raises(InputError, match="Slurm version"):
        gres.mig_type("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "3g.40gb", "autodetect", {},
                      memory_mib=40192, slurm_version=None)


def test_short_naming_keeps_the_full_profile():
    assert gres.mig_type("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", "1c.3g.20gb", "short", {}) \
        == "a100_1c.3g.20gb"
    assert gres.mig_type("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "1g.10gb+me", "short", {}) \
        == "h100_1g.10gb+me"


@pytest.mark.parametrize("text, version", [
    ("slurm-wlm 22.05.8\n", (22, 5, 8)), ("slurm 23.02.6", (23, 2, 6)), ("slurm 25.11.0-0rc2", (25, 11, 0)),
    ("23.11", (23, 11, 0)), ("24.05.4-1", (24, 5, 4)),
])
def test_slurm_version_is_read_from_what_slurmd_and_the_config_say(text, version):
    assert gres.parse_slurm_version(text) == version


def test_slurm_version_that_is_not_one_is_an_error():
    with pytest.raises(InputError, match="Slurm version"):
        gres.parse_slurm_version("latest")


def _fake(tmp_path: Path, name: str, out: str, rc: int = 0) -> None:
    p = tmp_path / name
    p.write_text(f"#!/bin/sh\necho '{out}'\nexit {rc}\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_slurm_version_is_detected_from_slurmd_then_scontrol(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    _fake(tmp_path, "scontrol", "slurm 23.11.4")
    assert gres.detect_slurm_version() == ((23, 11, 4), "scontrol -V")
    _fake(tmp_path, "slurmd", "slurm 22.05.8")
    assert gres.detect_slurm_version() == ((22, 5, 8), "slurmd -V")


def test_no_slurm_commands_means_no_detected_version(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    version, why = gres.detect_slurm_version()
    assert version is None and "slurmd" in why


# --- the whole flow: inventory -> gres.conf, per Slurm version ----------------------------------------

def _mig_inventory(parent: str, layout):
    migs = [{"index": k, "uuid": f"MIG-{k}", "name": f"{parent} MIG {prof}", "profile": prof,
             "memory_mib": mib, "gpu_instance_id": gi, "compute_instance_id": 0,
             "gi_cap_minor": 10 + 2 * k, "ci_cap_minor": 11 + 2 * k}
            for k, (prof, gi, mib) in enumerate(layout)]
    return inventory.from_json({"format": inventory.FORMAT, "hostname": "mig80", "gpus": [{
        "index": 0, "minor": 0, "uuid": "GPU-x", "name": parent, "pci_bus_id": "00000000:18:00.0",
        "cpu_affinity": "0-3", "cores": "0-3", "mig_enabled": True, "mig_devices": migs}]}, "mig80")


A100_80 = [("3g.40gb", 1, 40192), ("2g.20gb", 5, 19968), ("1g.10gb+me", 13, 9856)]


def test_gres_conf_for_slurm_22_05_uses_its_names(tmp_path):
    inv = _mig_inventory("NVIDIA A100-SXM4-80GB", A100_80)
    groups = gres.build([inv], "autodetect", {}, slurm_version=OLD)
    assert [r.type for r in groups[0].records] == ["nvidia_a100_3g.39gb", "nvidia_a100_2g.20gb", "nvidia_a100_1g.10gb"]
    groups = gres.build([inv], "autodetect", {}, slurm_version=(24, 11, 1))
    assert [r.type for r in groups[0].records] == ["nvidia_a100_3g.40gb", "nvidia_a100_2g.20gb", "nvidia_a100_1g.10gb+me"]


def test_cli_takes_the_slurm_version_from_the_option_or_the_config(tmp_path):
    from click.testing import CliRunner

    from slurm_gpu.cli import main

    inv = _mig_inventory("NVIDIA A100-SXM4-80GB", A100_80)
    p = tmp_path / "mig80.json"
    p.write_text(inventory.dumps(inv))
    cfg = tmp_path / "config.toml"
    cfg.write_text('[gres]\nslurm_version = "22.05.8"\n')
    res = CliRunner().invoke(main, ["--config", str(cfg), "gres-conf", "--inventory", str(p)])
    assert res.exit_code == 0, res.output
    assert "Type=nvidia_a100_3g.39gb " in res.stdout
    res = CliRunner().invoke(main, ["--config", str(cfg), "gres-conf", "--inventory", str(p), "--slurm-version", "23.02.7"])
    assert res.exit_code == 0, res.output
    assert "Type=nvidia_a100_3g.40gb " in res.stdout and "slurm 23.02.7" in res.stdout


def test_cli_without_any_slurm_version_for_mig_types_says_how_to_give_one(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from slurm_gpu.cli import main

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    inv = _mig_inventory("NVIDIA A100-SXM4-80GB", A100_80)
    p = tmp_path / "mig80.json"
    p.write_text(inventory.dumps(inv))
    res = CliRunner().invoke(main, ["gres-conf", "--inventory", str(p)])
    assert res.exit_code == 2
    assert "Slurm version" in res.stderr and "--slurm-version" in res.stderr and "gres.slurm_version" in res.stderr
    # short naming does not depend on Slurm's rules: no version needed
    res = CliRunner().invoke(main, ["gres-conf", "--inventory", str(p), "--type-naming", "short"])
    assert res.exit_code == 0, res.output


def test_inventory_keeps_the_instance_memory_and_full_profile():
    from slurm_gpu.gpu.snapshot import GpuSnapshot, MigDevice, NodeSnapshot, value

    devs = (MigDevice(0, "MIG-a", 1, 0, 40192 << 20, "NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb"),)
    g = GpuSnapshot(index=0, minor_number=value(0), uuid=value("GPU-0"), name=value("NVIDIA A100-SXM4-80GB"),
                    pci_bus_id=value("00000000:18:00.0"), cpu_affinity=value((0, 1)), mig_mode_current=value(True),
                    mig_devices=value(devs))
    inv = collect.inventory_from_snapshot(NodeSnapshot("n1", 0.0, gpus=(g,)),
                                          mig_minors={"gpu0/gi1/access": 12, "gpu0/gi1/ci0/access": 13})
    m = inv.gpus[0].mig_devices[0]
    assert (m.profile, m.memory_mib) == ("1c.3g.40gb", 40192)
    again = inventory.from_json(json.loads(inventory.dumps(inv)), "x").gpus[0].mig_devices[0]
    assert again == m


# --- the hooks: AutoDetect=nvml records typed with either version's names -----------------------------

@pytest.mark.parametrize("conf_type", ["nvidia_a100_3g.39gb", "nvidia_a100_3g.40gb", "a100_3g.40gb", "3g.39gb"])
def test_hooks_match_a_detected_mig_slice_to_either_slurm_versions_type(conf_type):
    detected = slurmconf.autodetect_type("NVIDIA A100-SXM4-80GB MIG 3g.40gb")
    assert slurmconf._detected_type(conf_type, detected)


@pytest.mark.parametrize("conf_type", ["nvidia_a100_1g.10gb", "nvidia_a100_2g.39gb", "nvidia_a100_3g.20gb",
                                       "nvidia_a100_1c.3g.40gb"])
def test_hooks_do_not_match_a_mig_slice_to_another_profiles_type(conf_type):
    detected = slurmconf.autodetect_type("NVIDIA A100-SXM4-80GB MIG 3g.40gb")
    assert not slurmconf._detected_type(conf_type, detected)


def test_hooks_match_22_05_names_of_compute_instance_and_media_profiles():
    # 22.05 names a 1c.3g.40gb slice and a 1g.10gb+me slice by GPU-instance slices and memory only
    assert slurmconf._detected_type("nvidia_a100_3g.39gb", slurmconf.autodetect_type("NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb"))
    assert slurmconf._detected_type("nvidia_a100_1g.10gb", slurmconf.autodetect_type("NVIDIA A100-SXM4-80GB MIG 1g.10gb+me"))
