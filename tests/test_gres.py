"""`slurm-gpu inventory` / `gres-conf`: golden files, grouping, --check, and the errors admins meet.

Golden files live in tests/golden/gres/.  The node inventories there were written by
`slurm-gpu inventory` against the simulated driver (tests/simgpu.py profiles);
test_inventory_from_simulated_driver_matches_fixture keeps them honest.  After an intended
change, regenerate with:  UPDATE_GOLDEN=1 python -m pytest tests/test_gres.py
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_gpu.cli import main
from slurm_gpu.errors import InputError
from slurm_gpu.gpu.snapshot import GpuSnapshot, MigDevice, NodeSnapshot, NvLink, failed, unsupported, value
from slurm_gpu.gres import collect, inventory
from slurm_gpu.gres import generate as gres
from slurm_gpu.slurm import hostlist

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "gres"
INV = GOLDEN / "inventory"
REPO = HERE.parent
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

# hostname in the fixture -> simgpu profile it was read from
PROFILES = {"hgx001": "h100_sxm", "pcie01": "a100_pcie", "mig01": "mig_gpu"}


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"output differs from {path} (UPDATE_GOLDEN=1 to accept)"


def write_config(tmp_path: Path, extra: str = "", **gres_keys: str) -> Path:
    lines = [extra] if extra else []
    lines.append("[gres]")
    lines.append(f'mig_minors_path = "{GOLDEN / "mig-minors"}"')
    if "slurm_version" not in gres_keys:
        lines.append('slurm_version = "22.05.8"')  # MIG type names must not depend on this machine's slurmd
    lines.append(f'cpu_topology_dir = "{fake_sysfs(tmp_path / "sys", sockets=2, cores=56, threads=1)}"')
    for k, v in gres_keys.items():
        lines.append(f"{k} = {v}")
    p = tmp_path / "config.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def fake_sysfs(root: Path, sockets: int, cores: int, threads: int) -> Path:
    """A /sys/devices/system/cpu tree numbered like Linux does: siblings are core + n*ncores."""
    ncores = sockets * cores
    for t in range(threads):
        for c in range(ncores):
            cpu = t * ncores + c
            d = root / f"cpu{cpu}" / "topology"
            d.mkdir(parents=True, exist_ok=True)
            (d / "physical_package_id").write_text(f"{c // cores}\n")
            sib = ",".join(str(s * ncores + c) for s in range(threads))
            (d / "thread_siblings_list").write_text(sib + "\n")
    return root


def run_cli(*args: str, config: Path = None):
    argv = (["--config", str(config)] if config else []) + list(args)
    return CliRunner().invoke(main, argv, catch_exceptions=False)


def load(host: str) -> inventory.Inventory:
    return inventory.load(str(INV / f"{host}.json"))


def clone(inv_json: dict, host: str) -> dict:
    d = copy.deepcopy(inv_json)
    d["hostname"] = host
    for g in d["gpus"]:
        g["uuid"] = f"GPU-{host}-{g['index']}"
        for m in g["mig_devices"]:
            m["uuid"] = f"MIG-{host}-{g['index']}-{m['index']}"
    return d


def write_inventories(dirpath: Path, docs) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    for d in docs:
        (dirpath / f"{d['hostname']}.json").write_text(json.dumps(d, indent=2))
    return dirpath


# --- the simulated driver -> inventory fixture -----------------------------------------------

@pytest.fixture(scope="module")
def simlib():
    sys.path.insert(0, str(HERE))
    try:
        import simgpu
    finally:
        sys.path.remove(str(HERE))
    if shutil.which("cc") is None:
        from testbed import unavailable
        unavailable("no C compiler for the simulated NVML library")
    return simgpu, simgpu.build()


def _sim_cli(simlib, tmp_path: Path, profile: str, *args: str) -> subprocess.CompletedProcess:
    simgpu, lib = simlib
    state = tmp_path / f"{profile}.state"
    simgpu.write_state(state, simgpu.PROFILES[profile](seed=profile))
    cfg = write_config(tmp_path, extra=f'nvml_library = "{lib}"')
    env = simgpu.environ(state)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), *args],
                          capture_output=True, text=True, env=env, timeout=60, cwd=str(tmp_path))


@pytest.mark.parametrize("host", sorted(PROFILES))
def test_inventory_from_simulated_driver_matches_fixture(simlib, tmp_path, host):
    out = tmp_path / "inv.json"
    res = _sim_cli(simlib, tmp_path, PROFILES[host], "inventory", "--hostname", host, "--output", str(out))
    assert res.returncode == 0, res.stderr
    if UPDATE:
        shutil.copy(out, INV / f"{host}.json")
    assert json.loads(out.read_text()) == json.loads((INV / f"{host}.json").read_text())


def test_gres_conf_on_a_live_node_reads_the_driver(simlib, tmp_path):
    res = _sim_cli(simlib, tmp_path, "h100_sxm", "gres-conf", "--type-naming", "short")
    assert res.returncode == 0, res.stderr
    lines = [l for l in res.stdout.splitlines() if l.startswith("NodeName=")]
    assert [l.split(" ", 1)[1] for l in lines] == [
        "Name=gpu Type=h100 File=/dev/nvidia[0-3] Cores=0-55",
        "Name=gpu Type=h100 File=/dev/nvidia[4-7] Cores=56-111",
    ]


# --- golden files ----------------------------------------------------------------------------

def test_golden_h100_sxm_nvswitch_node(tmp_path):
    res = run_cli("gres-conf", "--inventory", str(INV / "hgx001.json"), config=write_config(tmp_path))
    assert res.exit_code == 0, res.output
    golden("h100_sxm.gres.conf", res.stdout)


def test_golden_a100_pcie_without_nvlink_short_names(tmp_path):
    res = run_cli("gres-conf", "--inventory", str(INV / "pcie01.json"), "--type-naming", "short",
                  config=write_config(tmp_path))
    assert res.exit_code == 0, res.output
    golden("a100_pcie.gres.conf", res.stdout)


def test_golden_mig_gpu_uses_multiple_files_with_caps(tmp_path):
    res = run_cli("gres-conf", "--inventory", str(INV / "mig01.json"), config=write_config(tmp_path))
    assert res.exit_code == 0, res.output
    golden("mig_gpu.gres.conf", res.stdout)
    assert "MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap12,/dev/nvidia-caps/nvidia-cap13" in res.stdout
    assert "Type=nvidia_a100_3g.20gb" in res.stdout  # AutoDetect cuts the name at the first '-'


def mixed_cluster(tmp_path: Path) -> Path:
    """200 nodes in three hardware groups, with a hole in the H100 range filled by a PCIe node."""
    base = {h: json.loads((INV / f"{h}.json").read_text()) for h in PROFILES}
    docs = [clone(base["hgx001"], f"gpu{i:03d}") for i in list(range(1, 65)) + list(range(66, 129))]
    docs += [clone(base["pcie01"], f"gpu{i:03d}") for i in [65] + list(range(129, 169))]
    docs += [clone(base["mig01"], f"mig{i:02d}") for i in range(1, 33)]
    assert len(docs) == 200
    return write_inventories(tmp_path / "inv", docs)


def test_golden_mixed_cluster_of_200_nodes_groups_into_hostlists(tmp_path):
    inv_dir = mixed_cluster(tmp_path)
    cfg = write_config(tmp_path)
    res = run_cli("gres-conf", "--inventory", str(inv_dir), "--type-naming", "short", config=cfg)
    assert res.exit_code == 0, res.output
    golden("mixed_cluster.gres.conf", res.stdout)
    assert "NodeName=gpu[001-064,066-128] Name=gpu Type=h100 File=/dev/nvidia[0-3] Cores=0-55" in res.stdout
    res = run_cli("gres-conf", "--inventory", str(inv_dir), "--type-naming", "short", "--slurm-conf-lines", config=cfg)
    assert res.exit_code == 0, res.output
    golden("mixed_cluster.slurm.conf", res.stdout)


def test_direct_nvlink_bridges_become_links_in_pci_order(tmp_path):
    # Two NvLink-bridged pairs (0<->1, 2<->3, three links each); PCI order differs from NVML index order.
    d = json.loads((INV / "pcie01.json").read_text())
    gpus = d["gpus"]
    gpus[0]["pci_bus_id"], gpus[1]["pci_bus_id"] = gpus[1]["pci_bus_id"], gpus[0]["pci_bus_id"]
    for a, b in ((0, 1), (2, 3)):
        gpus[a]["nvlink_peers"] = {gpus[b]["pci_bus_id"]: 3}
        gpus[b]["nvlink_peers"] = {gpus[a]["pci_bus_id"]: 3}
    inv = inventory.from_json(d, "bridged")
    recs = gres.node_records(inv, "short", {})
    assert [r.render() for r in recs] == [
        "Name=gpu Type=a100 File=/dev/nvidia1 Cores=0-31 Links=-1,3,0,0",
        "Name=gpu Type=a100 File=/dev/nvidia0 Cores=0-31 Links=3,-1,0,0",
        "Name=gpu Type=a100 File=/dev/nvidia2 Cores=32-63 Links=0,0,-1,3",
        "Name=gpu Type=a100 File=/dev/nvidia3 Cores=32-63 Links=0,0,3,-1",
    ]


def test_nvswitch_only_links_are_not_counted_as_gpu_links():
    inv = load("hgx001")
    assert all(inv.switch_links(g) == 18 for g in inv.gpus)
    assert all(x <= 0 for g in inv.gpus for x in inv.links(g))
    assert all(not r.links for r in gres.node_records(inv, "short", {}))


# --- grouping and equality -------------------------------------------------------------------

def test_identical_hardware_compares_equal_ignoring_uuid_and_hostname():
    a = load("hgx001")
    b = inventory.from_json(clone(inventory.to_json(a), "gpu777"), "b")
    assert a.hostname != b.hostname and a.gpus[0].uuid != b.gpus[0].uuid
    assert a.hardware_facts() == b.hardware_facts()
    c_doc = clone(inventory.to_json(a), "gpu778")
    c_doc["gpus"][3]["cores"] = "56-111"
    assert inventory.from_json(c_doc, "c").hardware_facts() != a.hardware_facts()


def test_group_with_a_disagreeing_node_names_node_and_field(tmp_path):
    base = json.loads((INV / "hgx001.json").read_text())
    docs = [clone(base, f"gpu{i:02d}") for i in range(1, 6)]
    docs[2]["gpus"][5]["cores"] = "0-55"  # gpu03: GPU 5 wired to the wrong socket
    inv_dir = write_inventories(tmp_path / "inv", docs)
    res = run_cli("gres-conf", "--inventory", str(inv_dir), "--group", "gpu[01-05]", config=write_config(tmp_path))
    assert res.exit_code == 2
    err = res.stderr
    assert "node gpu03" in err and "gpus[5].cores" in err and "'0-55'" in err and "'56-111'" in err
    assert "hint:" in err and "Traceback" not in res.output
    # without the group declaration the odd node simply gets its own lines
    res = run_cli("gres-conf", "--inventory", str(inv_dir), config=write_config(tmp_path))
    assert res.exit_code == 0
    assert "NodeName=gpu[01-02,04-05] " in res.stdout and "NodeName=gpu03 " in res.stdout


def test_group_naming_a_node_without_inventory_is_an_error(tmp_path):
    inv_dir = write_inventories(tmp_path / "inv", [clone(json.loads((INV / "hgx001.json").read_text()), "gpu01")])
    res = run_cli("gres-conf", "--inventory", str(inv_dir), "--group", "gpu[01-02]", config=write_config(tmp_path))
    assert res.exit_code == 2 and "no inventory for node(s) gpu02" in res.stderr


def test_same_node_in_two_inventories_is_an_error(tmp_path):
    d = json.loads((INV / "hgx001.json").read_text())
    (tmp_path / "a.json").write_text(json.dumps(d))
    (tmp_path / "b.json").write_text(json.dumps(d))
    res = run_cli("gres-conf", "--inventory", str(tmp_path / "a.json"), "--inventory", str(tmp_path / "b.json"))
    assert res.exit_code == 2 and "node hgx001 appears in two inventories" in res.stderr


# --- type naming -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, short", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"),
    ("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA H200", "h200"), ("NVIDIA L40S", "l40s"), ("NVIDIA GH200 480GB", "gh200"),
    ("Tesla T4", "t4"), ("NVIDIA A10G", "a10g"),
])
def test_short_type_names(name, short):
    assert gres.gpu_type(name, "short", {}) == short


def test_autodetect_type_is_slurms_lowercase_underscore_name():
    assert gres.gpu_type("NVIDIA H100 80GB HBM3", "autodetect", {}) == "nvidia_h100_80gb_hbm3"


def test_unknown_gpu_in_short_naming_without_mapping_is_an_error(tmp_path):
    d = json.loads((INV / "pcie01.json").read_text())
    for g in d["gpus"]:
        g["name"] = "NVIDIA GeForce RTX 4090"
    (tmp_path / "ws.json").write_text(json.dumps(d))
    cfg = write_config(tmp_path)
    res = run_cli("gres-conf", "--inventory", str(tmp_path / "ws.json"), "--type-naming", "short", config=cfg)
    assert res.exit_code == 2
    assert res.stderr.splitlines()[0] == ("slurm-gpu: error: node pcie01: no short type name known for GPU "
                                          "'NVIDIA GeForce RTX 4090'")
    assert 'hint: add it to the config: [gres.type_map] "NVIDIA GeForce RTX 4090" = "<type>"' in res.stderr
    # the mapping the hint asks for makes it work, and wins over both namings
    cfg = write_config(tmp_path, **{"type_map": '{ "NVIDIA GeForce RTX 4090" = "rtx4090" }'})
    res = run_cli("gres-conf", "--inventory", str(tmp_path / "ws.json"), "--type-naming", "short", config=cfg)
    assert res.exit_code == 0, res.output
    assert "Type=rtx4090 File=/dev/nvidia[0-1]" in res.stdout


def test_type_map_value_unusable_in_slurm_conf_is_rejected():
    with pytest.raises(InputError, match="not usable"):
        gres.gpu_type("NVIDIA H100 80GB HBM3", "short", {"NVIDIA H100 80GB HBM3": "h100:big"})


def test_mig_types_follow_parent_mapping():
    assert gres.mig_type("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "1g.5gb", "short", {}) == "a100_1g.5gb"
    assert gres.mig_type("NVIDIA A100-SXM4-40GB", "x", "1g.5gb", "short", {"NVIDIA A100-SXM4-40GB": "big"}) == "big_1g.5gb"


# --- --check ---------------------------------------------------------------------------------

def test_check_accepts_same_content_spelled_differently(tmp_path):
    cfg = write_config(tmp_path)
    inv_dir = write_inventories(tmp_path / "inv", [clone(json.loads((INV / "hgx001.json").read_text()), f"gpu{i:03d}")
                                                   for i in (1, 2, 3, 5)])
    existing = tmp_path / "gres.conf"
    existing.write_text(
        "# hand-kept copy\n"
        "nodename=gpu005,gpu[001-003]   name=GPU TYPE=nvidia_h100_80gb_hbm3 "
        "file=/dev/nvidia[4-5],/dev/nvidia[6-7]  cores=56-111\n"
        "NodeName=gpu[1-3],gpu5 Name=gpu Type=nvidia_h100_80gb_hbm3 File=/dev/nvidia[0-3] Cores=0-55\n"
        .replace("gpu[1-3],gpu5", "gpu[001-003],gpu005"))
    res = run_cli("gres-conf", "--inventory", str(inv_dir), "--check", str(existing), config=cfg)
    assert res.exit_code == 0, res.output
    assert res.stdout == "" and "matches the hardware" in res.stderr


def test_check_reports_a_unified_diff_and_exits_1(tmp_path):
    cfg = write_config(tmp_path)
    inv = str(INV / "hgx001.json")
    good = run_cli("gres-conf", "--inventory", inv, config=cfg).stdout
    existing = tmp_path / "gres.conf"
    existing.write_text(good.replace("Cores=56-111", "Cores=0-55"))
    res = run_cli("gres-conf", "--inventory", inv, "--check", str(existing), config=cfg)
    assert res.exit_code == 1
    out = res.stdout
    assert out.startswith(f"--- {existing} (normalised)\n+++ generated (normalised)\n")
    assert "-NodeName=hgx001 Name=gpu Type=nvidia_h100_80gb_hbm3 Cores=0-55 File=/dev/nvidia4\n" in out
    assert "+NodeName=hgx001 Name=gpu Type=nvidia_h100_80gb_hbm3 Cores=56-111 File=/dev/nvidia4\n" in out
    assert "differs from the hardware (8 normalised lines)" in res.stderr


def test_check_of_a_missing_node_line_is_a_difference():
    a = "NodeName=n[1-2] Name=gpu Type=x File=/dev/nvidia0\n"
    b = "NodeName=n1 Name=gpu Type=x File=/dev/nvidia0\n"
    diff = gres.check(b, a)
    assert "+NodeName=n2 Name=gpu Type=x File=/dev/nvidia0" in diff


def test_check_applies_lines_without_nodename_to_the_generated_nodes():
    # A node-local gres.conf usually has no NodeName=; checked on that node it must match.
    generated = "NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-3\n"
    assert gres.check("Name=gpu Type=h100 File=/dev/nvidia0 Cores=0,1,2,3\nName=gpu Type=h100 File=/dev/nvidia1 Cores=0-3\n",
                      generated) == ""
    assert "-NodeName=n1 Name=gpu Type=h100 Cores=0-3 File=/dev/nvidia2" in gres.check(
        "Name=gpu Type=h100 File=/dev/nvidia[0-2] Cores=0-3\n", generated)


def test_check_names_the_line_of_a_broken_existing_file():
    with pytest.raises(InputError, match=r"old.conf:2: expected key=value, got 'File'"):
        gres.normalise_gres_conf("Name=gpu File=/dev/nvidia0\nName=gpu File\n", "old.conf")
    with pytest.raises(InputError, match=r"old.conf:1: .*bad range"):
        gres.normalise_gres_conf("NodeName=n[a-b] Name=gpu File=/dev/nvidia0\n", "old.conf")


# --- malformed inventories and unreadable nodes ------------------------------------------------

@pytest.mark.parametrize("mutate, field, problem", [
    (lambda d: d.pop("format"), "format", "expected 'slurm-gpu-inventory/1'"),
    (lambda d: d["gpus"][2].pop("minor"), "gpus[2].minor", "missing"),
    (lambda d: d["gpus"][1].__setitem__("minor", "one"), "gpus[1].minor", "expected a non-negative integer"),
    (lambda d: d["gpus"][3].__setitem__("cores", "0-x"), "gpus[3].cores", "bad CPU list item"),
    (lambda d: d["gpus"][0].__setitem__("pci_bus_id", "18:00"), "gpus[0].pci_bus_id", "expected"),
    (lambda d: d["gpus"][0].__setitem__("nvlink_peers", {"00000000:05:00.0": -2}),
     "gpus[0].nvlink_peers['00000000:05:00.0']", "link count"),
    (lambda d: d["gpus"][4].__setitem__("minor", 0), "gpus[4].minor", "repeats gpus[0].minor"),
    (lambda d: d.__setitem__("gpus", {}), "gpus", "expected list"),
    (lambda d: d.__setitem__("hostname", "gpu 1"), "hostname", "not a usable Slurm node name"),
])
def test_malformed_inventory_error_names_file_node_and_field(tmp_path, mutate, field, problem):
    d = json.loads((INV / "hgx001.json").read_text())
    mutate(d)
    p = tmp_path / "broken.json"
    p.write_text(json.dumps(d))
    res = run_cli("gres-conf", "--inventory", str(p))
    assert res.exit_code == 2
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"slurm-gpu: error: inventory {p} (node ")
    assert f": {field}: " in first and problem in first
    assert res.stderr.splitlines()[1].startswith("hint: ")


def _bounded_cli(*args: str) -> "subprocess.CompletedProcess[str]":
    """`slurm-gpu ARGS` in a child held to 1 GiB of address space and 60 s: an unbounded range
    expansion dies there (MemoryError, a kill), not in the test process."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    return subprocess.run([sys.executable, "-c", "from slurm_gpu.cli import run; run()", *args], preexec_fn=limit,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("cores", ["0-99999999999", "0-9999999", "99999999999999999999999"])
def test_a_huge_cores_range_in_gres_conf_is_one_line_and_exit_2_not_gigabytes(tmp_path, cores):
    """Issue 39: `Cores=0-99999999999` grew to 12.9 GB and was killed at 60 s; 0-9999999 took 5.4 s
    and 997 MB. CPU ids are bounded (2^16) before anything is expanded."""
    existing = tmp_path / "gres.conf"
    existing.write_text(f"NodeName=hgx001 Name=gpu Type=h100 File=/dev/nvidia0 Cores={cores}\n")
    r = _bounded_cli("gres-conf", "--inventory", str(INV / "hgx001.json"), "--check", str(existing))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"slurm-gpu: error: {existing}:1: Cores=") and "65535" in lines[0], lines
    assert lines[1].startswith("hint: "), lines


@pytest.mark.parametrize("line, says", [
    ("NodeName=hgx001 Name=gpu Type=h100 File=/dev/nvidia[0-65535]", "File= names 65,536 GPU devices on one line"),
    ("NodeName=hgx[000-65535] Name=gpu Type=h100 File=/dev/nvidia[0-63]", "expands to 4,194,304 node-device lines"),
    ("NodeName=n[0-65535] Name=gpu Type=h100 File=/dev/nvidia[0-65535]", "File= names 65,536 GPU devices"),
])
def test_a_gres_conf_line_expanding_past_any_node_is_refused_in_one_line(tmp_path, line, says):
    """Both died of MemoryError (2 GB, 5-10 s) before the bounds; now 0.2-0.6 s."""
    existing = tmp_path / "gres.conf"
    existing.write_text(line + "\n")
    r = _bounded_cli("gres-conf", "--inventory", str(INV / "hgx001.json"), "--check", str(existing))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"slurm-gpu: error: {existing}:1: ") and says in lines[0], lines


def test_a_huge_cpu_range_in_an_inventory_names_the_field_and_is_refused_before_expanding(tmp_path):
    d = json.loads((INV / "hgx001.json").read_text())
    d["gpus"][3]["cores"] = "0-99999999999"
    p = tmp_path / "huge.json"
    p.write_text(json.dumps(d))
    r = _bounded_cli("gres-conf", "--inventory", str(p))
    assert r.returncode == 2, r.stderr[-2000:]
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"slurm-gpu: error: inventory {p} (node ") and ": gpus[3].cores: " in first, first
    assert "65535" in first, first


def test_inventory_that_is_not_json_is_named(tmp_path):
    p = tmp_path / "gpu9.json"
    p.write_text("{not json")
    res = run_cli("gres-conf", "--inventory", str(tmp_path))
    assert res.exit_code == 2 and f"inventory {p} (node ?): not valid JSON" in res.stderr


def test_empty_inventory_directory_is_an_error(tmp_path):
    res = run_cli("gres-conf", "--inventory", str(tmp_path))
    assert res.exit_code == 2 and "holds no *.json files" in res.stderr


def _gpu(i: int, **kw) -> GpuSnapshot:
    base = dict(index=i, minor_number=value(i), uuid=value(f"GPU-{i}"), name=value("NVIDIA H100 80GB HBM3"),
                pci_bus_id=value(f"00000000:{0x18 + i:02X}:00.0"), cpu_affinity=value((0, 1, 8, 9)),
                mig_mode_current=value(False))
    base.update(kw)
    return GpuSnapshot(**base)


def test_gpu_whose_minor_number_fails_is_refused_by_name():
    snap = NodeSnapshot("n1", 0.0, gpus=(_gpu(0), _gpu(1, minor_number=failed("nvmlDeviceGetMinorNumber", "GPU is lost"))))
    with pytest.raises(inventory.InventoryError, match=r"node n1: GPU 1 \(GPU-1\): minor_number could not be read "
                                                         r"\(error: nvmlDeviceGetMinorNumber GPU is lost\)"):
        collect.inventory_from_snapshot(snap)


def test_failed_nvlink_read_is_refused_rather_than_writing_wrong_links():
    link = NvLink(0, value(True), failed("nvmlDeviceGetNvLinkRemotePciInfo", "Unknown Error"))
    snap = NodeSnapshot("n1", 0.0, gpus=(_gpu(0, nvlinks=value((link,))),))
    with pytest.raises(inventory.InventoryError, match="NvLink 0 could not be read"):
        collect.inventory_from_snapshot(snap)


def test_hyperthread_siblings_count_as_one_slurm_core(tmp_path):
    # 2 sockets x 4 cores x 2 threads: CPUs 0-3 and 8-11 are socket 0's cores 0-3.
    topo = collect.read_cpu_topology(str(fake_sysfs(tmp_path / "sys", sockets=2, cores=4, threads=2)))
    assert topo[0] == topo[8] == 0 and topo[4] == topo[12] == 4
    snap = NodeSnapshot("n1", 0.0, gpus=(_gpu(0, cpu_affinity=value((0, 1, 2, 3, 8, 9, 10, 11))),
                                         _gpu(1, cpu_affinity=value((4, 5, 6, 7, 12, 13, 14, 15)))))
    inv = collect.inventory_from_snapshot(snap, cpu_to_core=topo)
    assert [inventory.format_cpulist(g.cores) for g in inv.gpus] == ["0-3", "4-7"]
    assert [inventory.format_cpulist(g.cpu_affinity) for g in inv.gpus] == ["0-3,8-11", "4-7,12-15"]


def test_unreadable_topology_falls_back_to_cpu_ids(tmp_path):
    assert collect.read_cpu_topology(str(tmp_path / "nope")) is None


def _mig_snap(minor: int = 0):
    devs = (MigDevice(0, "MIG-a", 1, 0, 20 << 30, "NVIDIA A100-SXM4-40GB MIG 3g.20gb"),)
    return NodeSnapshot("n1", 0.0, gpus=(_gpu(0, minor_number=value(minor), mig_mode_current=value(True),
                                              mig_devices=value(devs)),))


def test_mig_caps_come_from_the_gpu_minor_in_mig_minors():
    inv = collect.inventory_from_snapshot(_mig_snap(minor=1), mig_minors=collect.read_mig_minors(str(GOLDEN / "mig-minors")))
    m = inv.gpus[0].mig_devices[0]
    # gpu1/gi1: 3 + 135 + 9 = 147, its ci0 148 (driver numbering, see tests/golden/gres/mig-minors)
    assert (m.profile, m.gi_cap_minor, m.ci_cap_minor) == ("3g.20gb", 147, 148)


def test_mig_device_missing_from_mig_minors_is_an_error(tmp_path):
    p = tmp_path / "mig-minors"
    p.write_text("config 1\nmonitor 2\ngpu0/gi1/access 12\n")
    with pytest.raises(inventory.InventoryError, match=r"no 'gpu0/gi1/ci0/access' in .*mig-minors"):
        collect.inventory_from_snapshot(_mig_snap(), mig_minors_path=str(p))


def test_mig_enabled_without_mig_devices_is_an_error():
    snap = NodeSnapshot("n1", 0.0, gpus=(_gpu(0, mig_mode_current=value(True), mig_devices=value(())),))
    with pytest.raises(inventory.InventoryError, match="MIG mode is enabled but no MIG devices exist"):
        collect.inventory_from_snapshot(snap)


def test_gpu_without_nvlink_support_has_no_peers():
    snap = NodeSnapshot("n1", 0.0, gpus=(_gpu(0, nvlinks=unsupported("nvmlDeviceGetNvLinkState")),))
    assert collect.inventory_from_snapshot(snap).gpus[0].nvlink_peers == ()


# --- output, templates, CLI ----------------------------------------------------------------------

def test_inventory_round_trips_through_json():
    inv = load("mig01")
    again = inventory.from_json(json.loads(inventory.dumps(inv)), "x")
    assert again.gpus == inv.gpus and again.hostname == inv.hostname


def test_output_file_is_written_and_check_with_output_is_refused(tmp_path):
    out = tmp_path / "gres.conf"
    res = run_cli("gres-conf", "--inventory", str(INV / "hgx001.json"), "--output", str(out))
    assert res.exit_code == 0 and res.stdout == ""
    assert out.read_text().count("NodeName=hgx001") == 2
    res = run_cli("gres-conf", "--inventory", str(INV / "hgx001.json"), "--output", str(out), "--check", str(out))
    assert res.exit_code == 2 and "--check compares and writes nothing" in res.stderr


def test_site_template_dir_overrides_shipped_template(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "gres.conf.j2").write_text("{% for g in groups %}{% for r in g.records %}"
                                       "NodeName={{ g.nodelist }} {{ r.render() }} # site\n{% endfor %}{% endfor %}")
    cfg = write_config(tmp_path, template_dir=f'"{site}"')
    res = run_cli("gres-conf", "--inventory", str(INV / "pcie01.json"), config=cfg)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith(" # site")


def test_commands_are_listed_with_help():
    res = run_cli("--help")
    assert "gres-conf" in res.stdout and "inventory" in res.stdout
    res = run_cli("gres-conf", "--help")
    for opt in ("--inventory", "--type-naming", "--slurm-version", "--group", "--slurm-conf-lines", "--check", "--output"):
        assert opt in res.stdout
    text = " ".join(res.stdout.split())
    assert "CPUs/Cores" in text and "AutoDetect=off" in text and "other nodes" in text  # what --check ignores
    assert "23.02.6" in text  # when MIG names change


def test_template_ships_in_the_package_data():
    # pyproject maps templates/ to slurm_gpu.templates with *.j2 as package data
    assert (REPO / "templates" / "gres.conf.j2").exists() and (REPO / "templates" / "gres-slurm-conf.j2").exists()


def test_nodes_without_gpus_get_no_lines():
    inv = inventory.from_json({"format": inventory.FORMAT, "hostname": "cpu01", "gpus": []}, "x")
    groups = gres.build([inv, load("pcie01")], "short", {})
    text = gres.render_gres_conf(groups)
    assert "cpu01" not in text and "NodeName=pcie01 " in text
    assert hostlist.expand("pcie01") == ["pcie01"]


def test_inventory_without_a_driver_exits_3_with_a_hint(tmp_path):
    cfg = write_config(tmp_path, extra=f'nvml_library = "{tmp_path / "missing" / "libnvidia-ml.so.1"}"')
    res = run_cli("inventory", config=cfg)
    assert res.exit_code == 3
    assert res.stderr.startswith("slurm-gpu: error: NVML library ") and "\nhint: " in res.stderr


def test_inventory_from_a_saved_snapshot(tmp_path):
    snap = NodeSnapshot("n7", 0.0, gpus=(_gpu(0), _gpu(1, cpu_affinity=value((2, 3)))))
    (tmp_path / "snap.json").write_text(snap.dumps())
    out = tmp_path / "n7.json"
    res = run_cli("inventory", "--snapshot", str(tmp_path / "snap.json"), "-o", str(out), config=write_config(tmp_path))
    assert res.exit_code == 0, res.output
    inv = inventory.load(str(out))
    assert inv.hostname == "n7" and [g.minor for g in inv.gpus] == [0, 1]
    assert [inventory.format_cpulist(g.cores) for g in inv.gpus] == ["0-1,8-9", "2-3"]


# --- issue 10: --check reads gres.conf as Slurm does -------------------------------------------

GEN_N1 = "NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-3\n"


def test_check_reports_no_difference_for_autodetect_off_on_a_line():
    # AutoDetect=off is the default for a node without a global AutoDetect (gres.conf(5) example)
    existing = "NodeName=n1 AutoDetect=off Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-3\n"
    assert gres.check(existing, GEN_N1) == ""
    assert gres.check("AutoDetect=off\n" + GEN_N1, GEN_N1) == ""


def test_check_reports_no_difference_for_cpus_instead_of_cores():
    # Slurm reads CPUs= into the same field as Cores= (src/interfaces/gres.c, Cores first)
    assert gres.check("NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia[0-1] CPUs=0,1,2,3\n", GEN_N1) == ""


def test_check_accepts_slurms_aliases_continuations_and_spaces_around_equals():
    existing = ("nodename = n1 name=gpu TYPE=h100 \\\n"
                "    Files=/dev/nvidia0 COREs=0-3   # first GPU\n"
                "NodeName=n1 Name=gpu Type=h100 File=/dev/nvi\\\n"
                "dia1 CPUs=0-3\n")
    assert gres.check(existing, GEN_N1) == ""
    links = ("NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia0 Links=-1,2\n"
             "NodeName=n1 Name=gpu Type=h100 File=/dev/nvidia1 Links=2,-1\n")
    assert gres.check(links.replace("Links=", "Link="), links) == ""
    assert gres.check(links.replace("Links=-1,2", "Link = -1,2"), links) == ""


def test_check_still_reports_autodetect_that_changes_the_meaning():
    diff = gres.check("AutoDetect=nvml\n" + GEN_N1, GEN_N1)
    assert "-NodeName=n1 AutoDetect=nvml" in diff
    # a node-local AutoDetect=off undoes the global one: same meaning as no AutoDetect at all
    existing = "AutoDetect=nvml\nNodeName=n1 AutoDetect=off Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-3\n"
    assert gres.check(existing, GEN_N1) == ""


def test_check_of_a_cluster_wide_file_on_one_node_compares_only_that_nodes_lines():
    existing = (GEN_N1 +
                "NodeName=n[2-9] Name=gpu Type=a100 File=/dev/nvidia[0-3]\n"
                "NodeName=gpu[01-64] Name=gpu Type=h200 File=/dev/nvidia[0-7]\n")
    result = gres.compare(existing, GEN_N1, "gres.conf")
    assert result.diff == ""
    assert result.other_lines == 2 and hostlist.compress(result.other_nodes) == "gpu[01-64],n[2-9]"
    assert result.nodes == ("n1",)
    assert gres.check(existing, GEN_N1) == ""
    # a line for the checked node and others is compared for the checked node only
    assert gres.check("NodeName=n[1-9] Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-3\n", GEN_N1) == ""


def test_check_cli_says_how_many_lines_were_for_other_nodes(tmp_path):
    cfg = write_config(tmp_path)
    inv = str(INV / "hgx001.json")
    good = run_cli("gres-conf", "--inventory", inv, config=cfg).stdout
    existing = tmp_path / "gres.conf"
    existing.write_text(good + "NodeName=other[1-3] Name=gpu Type=x File=/dev/nvidia0\n")
    res = run_cli("gres-conf", "--inventory", inv, "--check", str(existing), config=cfg)
    assert res.exit_code == 0, res.output
    assert f"1 line(s) of {existing} are for other nodes (other[1-3]); compared only the lines for hgx001" in res.stderr
    assert "matches the hardware" in res.stderr


def test_check_refuses_a_key_slurm_does_not_know():
    with pytest.raises(InputError, match=r"old.conf:1: unknown key 'Cpu'"):
        gres.normalise_gres_conf("Name=gpu File=/dev/nvidia0 Cpu=0\n", "old.conf")


def test_slurm_config_lines_are_joined_and_escaped_as_parse_config_does():
    from slurm_gpu.slurm import conf as slurmconf
    text = ("Name=gpu File=/dev/nvi\\\ndia[0-1] # comment \\#1\n"   # joined where the '\' was, no space
            "Name=gpu Type=a\\#b   \\   \n  File=/dev/nvidia2\n"      # '\#' is '#'; white space after '\'
            "# Name=gpu File=/dev/nvidia9\n")
    assert list(slurmconf.logical_lines(text)) == [
        (1, "Name=gpu File=/dev/nvidia[0-1]"), (3, "Name=gpu Type=a#b     File=/dev/nvidia2")]


def test_affinity_listing_offline_cpus_builds_cores_from_the_online_ones_with_a_warning(tmp_path):
    # SMT switched off: 2 sockets x 4 cores, CPUs 8-15 (the second threads) offline, which Linux
    # shows as cpuN directories without a topology; NVML still reports the affinity 0-3,8-11.
    sysfs = fake_sysfs(tmp_path / "sys", sockets=2, cores=4, threads=1)
    for cpu in range(8, 16):
        (sysfs / f"cpu{cpu}").mkdir()
    (sysfs / "online").write_text("0-7\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[gres]\nmig_minors_path = "{GOLDEN / "mig-minors"}"\nslurm_version = "22.05.8"\n'
                   f'cpu_topology_dir = "{sysfs}"\n')
    snap = NodeSnapshot("n7", 0.0, gpus=(_gpu(0, cpu_affinity=value((0, 1, 2, 3, 8, 9, 10, 11))),
                                         _gpu(1, cpu_affinity=value((4, 5, 6, 7, 12, 13, 14, 15)))))
    (tmp_path / "snap.json").write_text(snap.dumps())
    out = tmp_path / "n7.json"
    res = run_cli("inventory", "--snapshot", str(tmp_path / "snap.json"), "-o", str(out), config=cfg)
    assert res.exit_code == 0, res.output  # before: the whole node refused ("CPU 8 ... not an online CPU")
    inv = inventory.load(str(out))
    assert [inventory.format_cpulist(g.cores) for g in inv.gpus] == ["0-3", "4-7"]
    assert [inventory.format_cpulist(g.cpu_affinity) for g in inv.gpus] == ["0-3,8-11", "4-7,12-15"]
    warnings = [line for line in res.stderr.splitlines() if line.startswith("slurm-gpu: warning:")]
    assert len(warnings) == 2 and "GPU 0" in warnings[0] and "CPUs 8-11" in warnings[0] and "offline" in warnings[0], warnings
    res = run_cli("gres-conf", "--snapshot", str(tmp_path / "snap.json"), config=cfg)
    assert res.exit_code == 0, res.output
    assert "Cores=0-3" in res.stdout and "Cores=4-7" in res.stdout and "CPUs 12-15" in res.stderr
