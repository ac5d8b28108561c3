"""Slurm's GPU index -> device -> GPU or MIG slice, and the hooks touching only the job's GPUs.

Simulated GPUs (tests/simnvml) and real files: the node's slurm.conf and gres.conf are written
beside each other as slurmd reads them.  tests/integration/test_gresmap_slurmd.py checks the
numbering against real slurmd.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import simgpu
from test_hooks import RecordingSlurm, deps_for, job_env, rows

from slurm_gpu.hooks import flows as hooks
from slurm_gpu.slurm import conf as slurmconf
from slurm_gpu.slurm import gpumap
from slurm_gpu.slurm.conf import GresConfigError
from slurm_gpu.slurm.jobenv import from_env

GOLDEN_MIG_MINORS = Path(__file__).resolve().parent / "golden" / "gres" / "mig-minors"


def write_slurm(node, gres_line: str, gres_conf: str, name: str = "gpu01") -> Path:
    conf = node.tmp / "slurm.conf"
    conf.write_text(f"ClusterName=sgtest\nGresTypes=gpu\nNodeName={name} CPUs=8 Gres={gres_line}\n"
                    f"PartitionName=gpu Nodes={name}\n")
    (node.tmp / "gres.conf").write_text(gres_conf)
    return conf


@contextlib.contextmanager
def sleeping_process(**env):
    """A real process (the simulated driver lists only live pids) with extra environment."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ, **env))
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def mapping(node, gpus: str, **deps_kw):
    deps = deps_for(node, **deps_kw)
    return hooks.map_gpus(deps, from_env(job_env(gpus=gpus)))


# --------------------------------------------------------------------------- numbering


def test_mixed_types_follow_slurm_conf_gres_order_not_device_minor(sim_node):
    # The node: Gres=gpu:a100:1,gpu:v100:2 with gres.conf v100 nvidia0, a100 nvidia1,
    # v100 nvidia2.  slurmd numbers a100 first: Slurm GPU 0 is /dev/nvidia1.
    node = sim_node(simgpu.h100_sxm(3))
    write_slurm(node, "gpu:a100:1,gpu:v100:2",
                "NodeName=gpu01 Name=gpu Type=v100 File=/dev/nvidia0\n"
                "NodeName=gpu01 Name=gpu Type=a100 File=/dev/nvidia1\n"
                "NodeName=gpu01 Name=gpu Type=v100 File=/dev/nvidia2\n")
    gmap = mapping(node, "0-2")
    assert [(g.slurm_index, g.device) for g in gmap.gpus] == [(0, "/dev/nvidia1"), (1, "/dev/nvidia0"), (2, "/dev/nvidia2")]
    assert [g.nvml_index for g in gmap.gpus] == [1, 0, 2] and gmap.configured == 3


def test_prolog_of_a100_job_resets_the_a100_not_device_zero(sim_node):
    node = sim_node(simgpu.h100_sxm(3))
    write_slurm(node, "gpu:a100:1,gpu:v100:2",
                "NodeName=gpu01 Name=gpu Type=v100 File=/dev/nvidia0\n"
                "NodeName=gpu01 Name=gpu Type=a100 File=/dev/nvidia1\n"
                "NodeName=gpu01 Name=gpu Type=v100 File=/dev/nvidia2\n")
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=3)  # the v100 another job may be using
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps) == 0
    assert deps.slurm.drains == []
    assert {a["gpu"] for a in simgpu.read_actions(node.state)} == {1}
    (start,) = rows(node.db, "SELECT gpu_index FROM job_starts")
    assert start["gpu_index"] == 1


def test_minors_out_of_enumeration_order_map_by_minor_number(sim_node):
    prof = simgpu.h100_sxm(4)
    for i, g in enumerate(prof["gpus"]):
        g["minor"] = [6, 4, 7, 5][i]
    node = sim_node(prof)
    write_slurm(node, "gpu:h100:4", "NodeName=gpu01 Name=gpu Type=h100 File=/dev/nvidia[4-7]\n")
    gmap = mapping(node, "0-3")
    assert {g.slurm_index: g.nvml_index for g in gmap.gpus} == {0: 1, 1: 3, 2: 0, 3: 2}
    assert gmap.source.endswith("gres.conf")


def test_gpu_missing_from_driver_is_a_fail_naming_it_not_a_shifted_mapping(sim_node):
    # The GPU of minor 1 fell off the bus: the driver lists minors 0, 2, 3.  Slurm GPU 1 must
    # not become minor 2 (maybe another job's GPU) — it is a FAIL naming /dev/nvidia1.
    prof = simgpu.h100_sxm(4)
    del prof["gpus"][1]
    node = sim_node(prof)
    write_slurm(node, "gpu:h100:4", "NodeName=gpu01 Name=gpu Type=h100 File=/dev/nvidia[0-3]\n")
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="1")), deps) == 1
    (_, reason), = deps.slurm.drains
    assert "Slurm GPU 1 is /dev/nvidia1 but the driver shows no GPU with minor 1" in reason, reason
    assert simgpu.read_actions(node.state) == []  # nothing reset on the neighbour


def test_job_on_healthy_gpu_fails_when_driver_shows_fewer_gpus_than_slurm_configures(sim_node):
    prof = simgpu.h100_sxm(4)
    del prof["gpus"][3]
    node = sim_node(prof)
    write_slurm(node, "gpu:h100:4", "NodeName=gpu01 Name=gpu Type=h100 File=/dev/nvidia[0-3]\n")
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps) == 1
    assert "3 GPUs visible, 4 configured in Slurm" in deps.slurm.drains[0][1]


def test_more_gpus_than_slurm_schedules_is_not_a_fault(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    write_slurm(node, "gpu:h100:2", "NodeName=gpu01 Name=gpu Type=h100 File=/dev/nvidia[0-1]\n")
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps) == 0 and deps.slurm.drains == []


def test_every_nvml_call_failing_names_the_nvml_error_not_zero_gpus(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_node(node.state, errors={"nvmlDeviceGetCount_v2": simgpu.UNKNOWN})
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps) == 1
    reason = deps.slurm.drains[0][1]
    assert "cannot list the GPUs" in reason and "Unknown Error" in reason and "0 GPUs" not in reason, reason


def test_index_past_the_gres_records_drains_with_the_config_named(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    write_slurm(node, "gpu:h100:2", "NodeName=gpu01 Name=gpu Type=h100 File=/dev/nvidia[0-1]\n")
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="2")), deps) == 1
    assert "gres.conf lists only 2 GPUs" in deps.slurm.drains[0][1]


def test_unreadable_slurm_conf_falls_back_to_minor_order_and_says_so(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    gmap = mapping(node, "1")
    assert gmap.source == "minor order" and gmap.gpus[0].nvml_index == 1 and gmap.configured is None
    assert "gres-map-fallback" in node.log_text()


def test_slurm_conf_env_of_the_hook_wins_over_config(sim_node, tmp_path, monkeypatch):
    node = sim_node(simgpu.h100_sxm(2))
    other = tmp_path / "other"
    other.mkdir()
    (other / "slurm.conf").write_text("NodeName=gpu01 Gres=gpu:x:2\n")
    (other / "gres.conf").write_text("Name=gpu Type=x File=/dev/nvidia1\nName=gpu Type=x File=/dev/nvidia0\n")
    monkeypatch.setenv("SLURM_CONF", str(other / "slurm.conf"))
    assert [g.nvml_index for g in mapping(node, "0,1").gpus] == [1, 0]


# --------------------------------------------------------------------------- config syntax

def test_slurm_config_syntax_as_slurm_parses_it(tmp_path):
    (tmp_path / "nodes.conf").write_text("NodeName=DEFAULT CPUs=8 \\\n   Gres=gpu:v100:2,gpu:a100:1(S:0)\n"
                                         "NodeName=gpu[01-04] RealMemory=1000\n")
    (tmp_path / "slurm.conf").write_text("ClusterName=c # comment\nInclude nodes.conf\n")
    (tmp_path / "gres.conf").write_text(
        "# a comment line\n"
        "AutoDetect=off\n"
        "NodeName=gpu[01-04] Name=gpu Type=A100 Files=/dev/nvidia3 CPUs=0-3\n"
        "NodeName = gpu[01-02] Name = gpu Type = v100 \\\n  File = /dev/nvidia[0-1]\n"
        "NodeName=gpu[03-04] Name=gpu Type=v100 File=/dev/nvidia[1-2]\n"
        "NodeName=gpu01 Name=mps Count=100\n")
    recs, auto = slurmconf.node_gres_records(str(tmp_path / "slurm.conf"), "gpu02")
    assert not auto
    assert [(r.index, r.type, r.files) for r in recs] == [
        (0, "v100", ("/dev/nvidia0",)), (1, "v100", ("/dev/nvidia1",)), (2, "a100", ("/dev/nvidia3",))]
    recs, _ = slurmconf.node_gres_records(str(tmp_path / "slurm.conf"), "gpu04")
    assert [r.gpu_minor for r in recs] == [1, 2, 3]


def test_node_missing_from_slurm_conf_is_a_config_error(tmp_path):
    (tmp_path / "slurm.conf").write_text("NodeName=gpu01 Gres=gpu:2\n")
    (tmp_path / "gres.conf").write_text("Name=gpu File=/dev/nvidia[0-1]\n")
    with pytest.raises(GresConfigError, match="no NodeName line for gpu07"):
        slurmconf.node_gres_records(str(tmp_path / "slurm.conf"), "gpu07")


def test_gpu_line_without_device_files_is_a_config_error(tmp_path):
    (tmp_path / "slurm.conf").write_text("NodeName=gpu01 Gres=gpu:2\n")
    (tmp_path / "gres.conf").write_text("Name=gpu Count=2\n")
    with pytest.raises(GresConfigError, match="without File="):
        slurmconf.node_gres_records(str(tmp_path / "slurm.conf"), "gpu01")


# --------------------------------------------------------------------------- MIG

def mig_node(sim_node, procs=None):
    """One A100 with MIG slices gi 1 (3g.20gb), gi 5 (2g.10gb), gi 13 (1g.5gb) and a MIG gres.conf
    (caps minors from the golden mig-minors: gi1 12/13, gi5 48/49, gi13 120/121)."""
    prof = simgpu.mig_gpu(1)
    node = sim_node(prof)
    node.write_config(f'[gres]\nmig_minors_path = "{GOLDEN_MIG_MINORS}"\n')
    caps = {1: (12, 13), 5: (48, 49), 13: (120, 121)}
    lines = "".join(f"NodeName=gpu01 Name=gpu Type=a100_{t} MultipleFiles=/dev/nvidia0,"
                    f"/dev/nvidia-caps/nvidia-cap{caps[gi][0]},/dev/nvidia-caps/nvidia-cap{caps[gi][1]}\n"
                    for gi, t in ((1, "3g.20gb"), (5, "2g.10gb"), (13, "1g.5gb")))
    write_slurm(node, "gpu:a100_3g.20gb:1,gpu:a100_2g.10gb:1,gpu:a100_1g.5gb:1", lines)
    return node


def test_mig_slice_index_maps_to_its_instance_not_a_physical_gpu(sim_node):
    node = mig_node(sim_node)
    gmap = mapping(node, "1")
    (g,) = gmap.gpus
    assert g.nvml_index == 0 and g.mig.gpu_instance_id == 5 and g.mig.uuid.startswith("MIG-")
    assert gmap.configured == 1  # one physical GPU, whatever the slice count
    assert gmap.instances() == {0: frozenset({5})}


def test_prolog_on_mig_slice_does_not_drain_while_another_slice_is_busy(sim_node):
    node = mig_node(sim_node)
    with sleeping_process() as busy:
        simgpu.append_lines(node.state, [f"gpu.0.mig.2.procs={busy.pid}:{3 << 30}", f"gpu.0.mig.2.memory_used={3 << 30}"])
        deps = deps_for(node)
        assert hooks.prolog(from_env(job_env(gpus="0")), deps) == 0, node.log_text()
        assert deps.slurm.drains == []
        # The GPU is shared with the other slice's job: no clock reset, no accounting cleared.
        fns = {a["function"] for a in simgpu.read_actions(node.state)}
        assert not fns & {"nvmlDeviceResetApplicationsClocks", "nvmlDeviceClearAccountingPids"}, fns
        (start,) = rows(node.db, "SELECT gpu_uuid, energy_mj FROM job_starts")
        assert start["gpu_uuid"].startswith("MIG-") and start["energy_mj"] is None


def test_prolog_on_mig_slice_fails_when_its_own_slice_has_a_leftover(sim_node):
    node = mig_node(sim_node)
    with sleeping_process() as busy:
        simgpu.append_lines(node.state, [f"gpu.0.mig.1.procs={busy.pid}:{1 << 30}"])
        deps = deps_for(node)
        assert hooks.prolog(from_env(job_env(gpus="1")), deps) == 1
        assert f"pid {busy.pid}" in deps.slurm.drains[0][1]


def test_epilog_of_slice0_job_never_kills_processes_on_slice2(sim_node):
    node = mig_node(sim_node)
    env = job_env(gpus="0", SLURM_JOB_UID=str(os.getuid()))
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    with sleeping_process(SLURM_JOB_ID="4711") as other:  # even one that looks like ours
        simgpu.append_lines(node.state, [f"gpu.0.mig.2.procs={other.pid}:{1 << 30}"])
        deps = deps_for(node)
        assert hooks.epilog(from_env(env), deps) == 0
        time.sleep(0.3)
        assert other.poll() is None, "a process in another MIG slice was killed"
        assert deps.slurm.drains == []
        (rec,) = rows(node.db, "SELECT * FROM job_gpus")
        assert rec["gpu_uuid"].startswith("MIG-") and rec["parent_gpu_uuid"].startswith("GPU-")
        assert rec["energy_j"] is None and rec["gpu_util_mean_pct"] is None and "per instance" in rec["notes"]
        assert "3g.20gb" in rec["gpu_model"]


def test_epilog_kills_the_jobs_own_process_in_its_slice(sim_node):
    node = mig_node(sim_node)
    env = job_env(gpus="2", SLURM_JOB_UID=str(os.getuid()))
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    with sleeping_process(SLURM_JOB_ID="4711") as mine:
        simgpu.append_lines(node.state, [f"gpu.0.mig.2.procs={mine.pid}:{1 << 30}"])
        assert hooks.epilog(from_env(env), deps_for(node)) == 0
        assert mine.wait(timeout=5) == -15


def test_two_slices_of_one_gpu_in_one_job_are_two_records(sim_node):
    node = mig_node(sim_node)
    env = job_env(gpus="0,2")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    assert hooks.epilog(from_env(env), deps_for(node)) == 0
    recs = rows(node.db, "SELECT gpu_uuid, gpu_index FROM job_gpus ORDER BY gpu_uuid")
    assert len(recs) == 2 and len({r["gpu_uuid"] for r in recs}) == 2 and {r["gpu_index"] for r in recs} == {0}


def test_mig_slice_removed_since_gres_conf_was_written_is_a_fail(sim_node):
    node = mig_node(sim_node)
    simgpu.append_lines(node.state, ["gpu.0.mig_count=2"])  # the 1g.5gb instance is gone
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="2")), deps) == 1
    assert "no MIG instance gi 13 ci 0" in deps.slurm.drains[0][1]


def test_mig_node_without_readable_slurm_config_fails_open_not_on_a_guess(sim_node):
    node = mig_node(sim_node)
    (node.tmp / "gres.conf").unlink()
    with pytest.raises(GresConfigError, match="cannot map Slurm's GPU indices on a MIG node"):
        mapping(node, "0")


def test_autodetect_nvml_numbers_gpus_and_slices_in_nvml_order(sim_node):
    node = mig_node(sim_node)
    (node.tmp / "gres.conf").write_text("AutoDetect=nvml\n")
    gmap = mapping(node, "0-2")
    assert [g.mig.gpu_instance_id for g in gmap.gpus] == [1, 5, 13] and gmap.source == "autodetect"


def test_autodetect_types_follow_slurm_conf_order(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    write_slurm(node, "gpu:nvidia_h100_80gb_hbm3:2", "AutoDetect=nvml\n")
    assert [g.nvml_index for g in mapping(node, "0,1").gpus] == [0, 1]


def test_mig_xid_of_another_instance_does_not_fail_this_slice(sim_node):
    node = mig_node(sim_node)
    log = node.tmp / "kmsg"
    now = time.time()
    log.write_text(f"{now - 5:.3f} host kernel: NVRM: Xid (PCI:0000:18:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel\n")
    node.write_config(f'[gres]\nmig_minors_path = "{GOLDEN_MIG_MINORS}"\n[xid]\nsource = "file:{log}"\n')
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node)) == 0   # slice gi 1
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(job_id=4712, gpus="1")), deps) == 1  # slice gi 5 itself
    assert "XID 94" in deps.slurm.drains[0][1]


def test_configured_gpus_counts_physical_gpus_of_mig_slices(sim_node):
    node = mig_node(sim_node)
    assert gpumap.configured_gpus(str(node.tmp / "slurm.conf"), "gpu01") == 1
    assert gpumap.configured_gpus(str(node.tmp / "nope.conf"), "gpu01") is None


def test_drain_reason_for_a_missing_gpu_names_job_and_device(sim_node):
    prof = simgpu.h100_sxm(2)
    del prof["gpus"][0]
    node = sim_node(prof)
    write_slurm(node, "gpu:h100:2", "NodeName=gpu01 Name=gpu Type=h100 File=/dev/nvidia[0-1]\n")
    deps = deps_for(node, slurm=RecordingSlurm())
    assert hooks.epilog(from_env(job_env(gpus="0")), deps) == 0
    assert deps.slurm.drains[0][1].startswith("slurm-gpu: Slurm GPU 0 is /dev/nvidia0")


def test_healthcheck_on_mig_node_expects_physical_gpus_not_slurms_slice_count(sim_node, monkeypatch):
    # Slurm configures 3 GPUs (slices) on a node with one physical GPU: "1 GPUs visible,
    # 3 configured" would drain every MIG node at every HealthCheckInterval.
    import types

    from slurm_gpu import config
    from slurm_gpu.hooks.healthcheck import default_checker
    node = mig_node(sim_node)
    monkeypatch.setenv("SIMNVML_STATE", str(node.state))
    monkeypatch.setenv("SLURM_CONF", str(node.tmp / "slurm.conf"))
    results = default_checker(config.load(str(node.config)))(
        types.SimpleNamespace(name="gpu01", gpus_configured=3, gpus_allocated=0))
    (count,) = [r for r in results if r.check == "gpu_count"]
    assert count.status == "PASS", count.message
