"""The faults sites meet that no check caught (issue 25): NVSwitch fabric, the driver's recovery
action, a corrupted InfoROM, a power cap, a stopped fan.  Each FAILs (or WARNs) on the fault
injected in the simulated driver, and SKIPs where the reading is NOT_SUPPORTED, refused
(NO_PERMISSION) or absent from an older nvidia-ml-py: nothing new can drain a healthy node."""
from __future__ import annotations

import os

import pynvml
import pytest
import simgpu
from test_check import check_in_process

from slurm_gpu import config
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.hooks import flows as hooks


def one(results, name, gpu):
    res = [r for r in results if r.check == name and r.gpu_index == gpu]
    assert len(res) == 1, results
    return res[0]


# (check, profile, fault fields on GPU 1, status, words the message must carry)
FAULTS = [
    ("fabric", simgpu.h100_sxm, {"fabric_state": simgpu.FABRIC_NOT_STARTED}, "FAIL", "fabric manager"),
    ("fabric", simgpu.h100_sxm, {"fabric_state": simgpu.FABRIC_IN_PROGRESS}, "FAIL", "in progress"),
    ("fabric", simgpu.h200, {"fabric_status": 23, "fabric_clique_id": 0}, "FAIL", "Insufficient Resources"),
    ("recovery_action", simgpu.h100_sxm, {"field.230": simgpu.RECOVERY_GPU_RESET}, "FAIL", "GPU reset"),
    ("recovery_action", simgpu.h100_sxm, {"field.230": simgpu.RECOVERY_NODE_REBOOT}, "FAIL", "node reboot"),
    ("recovery_action", simgpu.h100_sxm, {"field.230": simgpu.RECOVERY_DRAIN_P2P}, "FAIL", "drain P2P"),
    ("inforom", simgpu.h100_sxm, {"inforom_corrupted": 1}, "WARN", "InfoROM is corrupted"),
    ("power_cap", simgpu.h100_sxm, {"power_limit_mw": 400000}, "WARN", "capped at 400 W, board default 700 W"),
    ("fans", simgpu.consumer_gpu, {"temperature": 70, "fan.0.speed_pct": 0}, "FAIL", "fan 0 at 0 %"),
    ("fans", simgpu.consumer_gpu, {"temperature": 70, "fan.0.speed_pct": 20, "fan.0.target_pct": 80}, "FAIL",
     "target 80 %"),
]


@pytest.mark.parametrize("check,profile,fields,status,words", FAULTS,
                         ids=[f"{f[0]}-{'-'.join(map(str, f[2].values()))}" for f in FAULTS])
def test_new_check_fails_on_injected_fault_and_passes_without(sim_node, check, profile, fields, status, words):
    node = sim_node(profile(2))
    assert one(check_in_process(node), check, 1).status == "PASS"
    simgpu.set_gpu(node.state, 1, **fields)
    res = one(check_in_process(node), check, 1)
    assert res.status == status and words in res.message and res.hint, res
    assert one(check_in_process(node), check, 0).status == "PASS"


# (check, profile, fault, the NVML function whose answer decides)
SKIPS = [
    ("fabric", simgpu.h100_sxm, {"fabric_state": simgpu.FABRIC_NOT_STARTED}, "nvmlDeviceGetGpuFabricInfoV"),
    ("recovery_action", simgpu.h100_sxm, {"field.230": simgpu.RECOVERY_NODE_REBOOT}, "nvmlDeviceGetFieldValues"),
    ("inforom", simgpu.h100_sxm, {"inforom_corrupted": 1}, "nvmlDeviceValidateInforom"),
    ("power_cap", simgpu.h100_sxm, {"power_limit_mw": 400000}, "nvmlDeviceGetPowerManagementDefaultLimit"),
    ("fans", simgpu.consumer_gpu, {"temperature": 70, "fan.0.speed_pct": 0}, "nvmlDeviceGetNumFans"),
]


@pytest.mark.parametrize("code", [simgpu.NOT_SUPPORTED, simgpu.NO_PERMISSION, simgpu.FUNCTION_NOT_FOUND],
                         ids=["not-supported", "no-permission", "function-not-found"])
@pytest.mark.parametrize("check,profile,fields,function", SKIPS, ids=[s[0] for s in SKIPS])
def test_new_check_skips_when_the_driver_does_not_answer(sim_node, check, profile, fields, function, code):
    node = sim_node(profile(1))
    simgpu.set_gpu(node.state, 0, **fields)
    simgpu.inject_error(node.state, 0, function, code)
    res = one(check_in_process(node), check, 0)
    assert res.status == "SKIP", res


ABSENT = [("fabric", simgpu.h100_sxm, {"fabric_state": simgpu.FABRIC_NOT_STARTED}, "nvmlDeviceGetGpuFabricInfoV"),
          ("recovery_action", simgpu.h100_sxm, {"field.230": 2}, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
          ("inforom", simgpu.h100_sxm, {"inforom_corrupted": 1}, "nvmlDeviceValidateInforom"),
          ("fans", simgpu.consumer_gpu, {"temperature": 70, "fan.0.speed_pct": 0}, "nvmlDeviceGetNumFans")]


@pytest.mark.parametrize("check,profile,fields,name", ABSENT, ids=[a[0] for a in ABSENT])
def test_new_check_skips_with_an_older_nvidia_ml_py_without_the_function(sim_node, monkeypatch, check, profile,
                                                                          fields, name):
    node = sim_node(profile(1))
    simgpu.set_gpu(node.state, 0, **fields)
    monkeypatch.delattr(pynvml, name)
    res = one(check_in_process(node), check, 0)
    assert res.status == "SKIP" and "not in this nvidia-ml-py" in res.message, res


def test_fabric_skips_on_a_gpu_without_nvswitch_fabric(sim_node):
    node = sim_node(simgpu.a100_pcie(1))  # the driver answers, with state NOT_SUPPORTED
    res = one(check_in_process(node), "fabric", 0)
    assert res.status == "SKIP" and "no NVSwitch fabric" in res.message


def test_fans_skip_on_a_passively_cooled_board(sim_node):
    node = sim_node(simgpu.h100_sxm(1))  # nvmlDeviceGetNumFans answers 0
    simgpu.set_gpu(node.state, 0, temperature=80)
    assert one(check_in_process(node), "fans", 0).status == "SKIP"


def test_stopped_fan_on_a_cool_idle_gpu_passes(sim_node):
    node = sim_node(simgpu.consumer_gpu(1))  # zero-RPM mode of an idle card
    simgpu.set_gpu(node.state, 0, temperature=35, **{"fan.0.speed_pct": 0})
    assert one(check_in_process(node), "fans", 0).status == "PASS"


def test_power_cap_within_tolerance_passes_and_fail_severity_is_honoured(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, power_limit_mw=680000)  # 2.9 % below 700 W, tolerance 5 %
    assert one(check_in_process(node), "power_cap", 0).status == "PASS"
    node.write_config('[health.severity]\ninforom = "fail"\n')
    simgpu.set_gpu(node.state, 0, inforom_corrupted=1)
    assert one(check_in_process(node), "inforom", 0).status == "FAIL"


def test_snapshot_records_the_new_readings(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, fabric_state=simgpu.FABRIC_IN_PROGRESS, **{"field.230": 1})
    os.environ["SIMNVML_STATE"] = str(node.state)
    cfg = config.load(str(node.config))
    with NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s) as r:
        d = r.snapshot(inventory=True).to_json()["gpus"][0]
    assert d["fabric"]["value"]["state"] == 2 and d["fabric"]["value"]["clique_id"] == 1
    assert d["recovery_action"] == {"status": "ok", "value": 1}
    assert d["power_limit_mw"]["value"] == d["power_default_limit_mw"]["value"] == 700000
    assert d["fans"] == {"status": "ok", "value": []} and d["inforom_valid"]["value"] is True
    assert d["sm_clock_mhz"]["value"] == 1980


def test_snapshot_file_with_the_new_readings_reads_back_to_the_same_verdicts(sim_node):
    from slurm_gpu.gpu.snapshot import node_from_json
    from slurm_gpu.policy import health
    node = sim_node(simgpu.consumer_gpu(1))
    simgpu.set_gpu(node.state, 0, temperature=70, **{"fan.0.speed_pct": 0})
    os.environ["SIMNVML_STATE"] = str(node.state)
    cfg = config.load(str(node.config))
    with NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s) as r:
        snap = r.snapshot(inventory=True)
    back = node_from_json(snap.to_json())
    assert back == snap
    assert one(health.evaluate(back, cfg), "fans", 0).status == "FAIL"


def _prolog(node, cfg_text):
    import time

    from test_hooks import RecordingSlurm, job_env

    from slurm_gpu.hooks.log import HookLog
    from slurm_gpu.slurm.jobenv import from_env
    node.write_config(cfg_text)
    cfg = config.load(str(node.config))
    os.environ["SIMNVML_STATE"] = str(node.state)
    deps = hooks.HookDeps(cfg=cfg, log=HookLog("test", syslog_on=False, path=str(node.tmp / "hooks.log")),
                          reader=NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s), slurm=RecordingSlurm(), now=time.time)
    return hooks.prolog(from_env(job_env(gpus="0,1")), deps)


def test_prolog_puts_a_capped_power_limit_back_to_default_when_asked(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, power_limit_mw=400000)
    assert _prolog(node, "") == 0  # off by default: the cap is only a WARN
    assert not [a for a in simgpu.read_actions(node.state) if a["function"] == "nvmlDeviceSetPowerManagementLimit"]
    assert _prolog(node, "[hooks]\nreset_power_limit = true\n") == 0
    sets = [a for a in simgpu.read_actions(node.state) if a["function"] == "nvmlDeviceSetPowerManagementLimit"]
    assert [(a["gpu"], a["args"].get("limit_mw")) for a in sets] == [(1, 700000)], sets
    assert simgpu.read_state(node.state)["gpu.1.power_limit_mw"] == "700000"
