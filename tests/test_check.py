"""`slurm-gpu check` against the simulated driver: every check FAILs on an injected fault and
PASSes without it.  Faults are injected in the state file (the driver boundary), never in Python."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import simgpu

from slurm_gpu import config
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.policy import health


def run_check(node, *args, timeout=60):
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--json", *args], env=node.env(),
                        capture_output=True, text=True, timeout=timeout)
    return cp


def check_in_process(node, **kw):
    cfg = config.load(str(node.config))
    os.environ["SIMNVML_STATE"] = str(node.state)
    reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)
    try:
        return hooks.check_node(cfg, reader=reader, **kw)[1]
    finally:
        reader.close()


def by_check(results, name, gpu=None):
    return [r for r in results if r.check == name and (gpu is None or r.gpu_index == gpu)]


# (check name, GPU fields that break it, config lines, idle)
FAULTS = [
    ("ecc_uncorrectable", {"ecc_volatile_uncorrected": 2}, "", False),
    ("row_remap_failure", {"remapped_failure": 1}, "", False),
    ("pending_reset", {"retired_pages_pending": 1}, "", False),
    ("pending_reset", {"remapped_pending": 1}, "", False),
    ("retired_pages", {"retired_pages_sbe": 50, "retired_pages_dbe": 11}, "", False),
    ("temperature", {"temperature": 93}, "", False),
    ("clock_events", {"clock_event_reasons": 0x40}, "", False),
    ("clock_events", {"clock_event_reasons": 0x80 | 0x1}, "", False),
    ("pcie_link", {"pcie_width_cur": 8}, "", False),
    ("nvlink", {"nvlink.5.state": 0}, "", False),
    ("persistence_mode", {"persistence_mode": 0}, "[health.severity]\npersistence_mode = \"fail\"\n", False),
    ("memory_in_use", {"memory_used": 3 << 30}, "", True),
]


@pytest.mark.parametrize("check,fields,extra,idle", FAULTS, ids=[f"{f[0]}-{list(f[1])[0]}" for f in FAULTS])
def test_check_fails_on_injected_fault_and_passes_without(sim_node, check, fields, extra, idle):
    node = sim_node(simgpu.h100_sxm(4))
    node.write_config(extra)
    kw = {"idle": True} if idle else {}
    before = check_in_process(node, **kw)
    assert [r.status for r in by_check(before, check, 1)] == ["PASS"], before
    simgpu.set_gpu(node.state, 1, **fields)
    after = check_in_process(node, **kw)
    res = by_check(after, check, 1)
    assert [r.status for r in res] == ["FAIL"], res
    assert res[0].gpu_uuid.startswith("GPU-") and res[0].hint
    # the other GPUs are untouched
    assert all(r.status == "PASS" for r in by_check(after, check, 0))


def test_leftover_process_on_idle_gpu_fails(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    assert by_check(check_in_process(node, idle=True), "leftover_processes", 0)[0].status == "PASS"
    simgpu.set_gpu(node.state, 0, procs=[(os.getpid(), 512 << 20)])
    res = by_check(check_in_process(node, idle=True), "leftover_processes", 0)
    assert res[0].status == "FAIL" and str(os.getpid()) in res[0].message
    # Not asked to be idle (a running job may use it): not judged.
    assert by_check(check_in_process(node), "leftover_processes") == []


def test_process_of_exited_pid_is_not_a_leftover(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, procs=[(simgpu.dead_pid(), 1 << 20)])
    assert by_check(check_in_process(node, idle=True), "leftover_processes", 0)[0].status == "PASS"


def test_gpu_count_below_expected_fails(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    node.write_config("[health]\nexpected_gpu_count = 4\n")
    assert by_check(check_in_process(node), "gpu_count")[0].status == "PASS"
    simgpu.set_node(node.state, gpu_count=3)
    res = by_check(check_in_process(node), "gpu_count")
    assert res[0].status == "FAIL" and "3 GPUs visible, 4 expected" in res[0].message


def test_driver_version_mismatch_fails(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    node.write_config('[health]\nrequired_driver_version = "550."\n')
    assert by_check(check_in_process(node), "driver_version")[0].status == "PASS"
    simgpu.set_node(node.state, driver_version="535.161.08")
    res = by_check(check_in_process(node), "driver_version")
    assert res[0].status == "FAIL" and "535.161.08" in res[0].message


def test_lost_gpu_fails_responsive_while_others_pass(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    simgpu.lose_gpu(node.state, 2)
    res = check_in_process(node)
    assert by_check(res, "responsive", 2)[0].status == "FAIL"
    assert "GPU is lost" in by_check(res, "responsive", 2)[0].message
    assert [r.status for g in (0, 1, 3) for r in by_check(res, "responsive", g)] == ["PASS"] * 3


def test_failed_reading_fails_the_check_not_skips(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetTotalEccErrors", simgpu.CORRUPTED_INFOROM)
    res = by_check(check_in_process(node), "ecc_uncorrectable", 0)
    assert res[0].status == "FAIL" and "cannot read" in res[0].message and "infoROM" in res[0].message


def test_consumer_gpu_not_supported_everywhere_gives_skip_not_fail(sim_node):
    node = sim_node(simgpu.consumer_gpu(2))
    res = check_in_process(node, idle=True)
    assert not [r for r in res if r.status == "FAIL"], [r for r in res if r.status == "FAIL"]
    for name in ("ecc_uncorrectable", "row_remap_failure", "pending_reset", "retired_pages", "nvlink"):
        assert {r.status for r in by_check(res, name)} == {"SKIP"}, name
    assert {r.status for r in by_check(res, "temperature")} == {"PASS"}


def test_no_permission_is_skip_not_fail(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetRetiredPages", simgpu.NO_PERMISSION)
    res = by_check(check_in_process(node), "retired_pages", 0)
    assert res[0].status == "SKIP" and "Insufficient Permissions" in res[0].message


def test_critical_xid_in_window_fails_and_app_xid_is_ignored(sim_node, tmp_path):
    node = sim_node(simgpu.h100_sxm(2))
    log = tmp_path / "kern.log"
    now = time.time()
    node.write_config(f'[xid]\nsource = "file:{log}"\nwindow_s = 600\n')
    log.write_text(f"{now - 5:.6f} vm kernel: NVRM: Xid (PCI:0000:18:00): 13, pid=123, Graphics Exception\n"
                   f"{now - 4000:.6f} vm kernel: NVRM: Xid (PCI:0000:2a:00): 79, pid=0, GPU has fallen off the bus.\n")
    res = by_check(check_in_process(node), "xid")
    assert [r.status for r in res] == ["PASS"], res  # app XID ignored, old XID outside the window
    with open(log, "a") as f:
        f.write(f"{now - 3:.6f} vm kernel: NVRM: Xid (PCI:0000:2a:00): 79, pid=0, GPU has fallen off the bus.\n")
        f.write(f"{now - 2:.6f} vm kernel: NVRM: Xid (PCI:0000:2a:00): 79, pid=0, GPU has fallen off the bus.\n")
    res = by_check(check_in_process(node), "xid")
    assert [(r.status, r.gpu_index) for r in res] == [("FAIL", 1)], res  # de-duplicated, mapped by bus id


def test_unreadable_xid_source_warns_never_fails(sim_node, tmp_path):
    node = sim_node(simgpu.h100_sxm(1))
    node.write_config(f'[xid]\nsource = "file:{tmp_path}/missing.log"\n')
    res = by_check(check_in_process(node), "xid")
    assert [r.status for r in res] == ["WARN"] and "not found" in res[0].message


def test_hung_gpu_fails_within_deadline_others_reported(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    node.write_config(nvml_timeout_s=1.0)
    simgpu.inject_hang(node.state, 2, "nvmlDeviceGetTemperature", 60)
    t0 = time.monotonic()
    cp = run_check(node)
    took = time.monotonic() - t0
    assert took < 6, took
    assert cp.returncode == 1, cp.stderr
    out = json.loads(cp.stdout)
    resp = {r["gpu_index"]: r for r in out["results"] if r["check"] == "responsive"}
    assert resp[2]["status"] == "FAIL" and "nvmlDeviceGetTemperature timed out" in resp[2]["message"]
    assert [resp[i]["status"] for i in (0, 1, 3)] == ["PASS"] * 3
    temps = [r for r in out["results"] if r["check"] == "temperature"]
    assert sorted(r["gpu_index"] for r in temps) == [0, 1, 3]


def test_slow_gpus_are_read_beside_each_other_not_in_turn(sim_node):
    """One worker reads a fast driver; a call that lasts brings more workers, so four GPUs that
    each take 0.4 s in one call cost about 0.4 s, not 1.6 s (all under the deadline: no FAIL)."""
    node = sim_node(simgpu.h100_sxm(4))
    node.write_config(nvml_timeout_s=5.0)
    for i in range(4):
        simgpu.inject_hang(node.state, i, "nvmlDeviceGetTemperature", 0.4)
    cfg = config.load(str(node.config))
    os.environ["SIMNVML_STATE"] = str(node.state)
    reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)
    try:
        reader.identities()
        t0 = time.monotonic()
        snap = reader.snapshot()
        took = time.monotonic() - t0
    finally:
        reader.close()
    assert [g.temperature_c.ok for g in snap.gpus] == [True] * 4
    assert took < 1.2, took


def test_check_exit_codes_and_human_output(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check"], env=node.env(), capture_output=True, text=True)
    assert cp.returncode == 0 and "overall: PASS" in cp.stdout
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=3)
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--gpus", "0"], env=node.env(),
                        capture_output=True, text=True)
    assert cp.returncode == 1 and "uncorrectable ECC errors: 3" in cp.stdout and "hint:" in cp.stdout
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--gpus", "1"], env=node.env(),
                        capture_output=True, text=True)
    assert cp.returncode == 0, cp.stdout  # --gpus limits the judged GPUs


def test_bad_gpu_list_is_usage_error(sim_node):
    node = sim_node()
    cp = run_check(node, "--gpus", "0,x")
    assert cp.returncode == 2 and "invalid GPU list" in cp.stderr and "Traceback" not in cp.stderr


def test_no_driver_library_gives_documented_exit_code_and_hint(sim_node, tmp_path):
    node = sim_node()
    node.write_config(nvml_library=str(tmp_path / "nope" / "libnvidia-ml.so.1"))
    cp = run_check(node)
    assert cp.returncode == 3
    assert "does not exist" in cp.stderr and "hint:" in cp.stderr and "Traceback" not in cp.stderr
    # No configured path and no driver on the system: the loader finds nothing.
    node.config.write_text('[xid]\nsource = "none"\n')
    env = node.env()
    env.pop("LD_LIBRARY_PATH", None)
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check"], env=env, capture_output=True, text=True)
    assert cp.returncode == 3 and "libnvidia-ml.so.1 not found" in cp.stderr and "nvml_library" in cp.stderr


def test_driver_not_loaded_gives_exit_code_3(sim_node):
    node = sim_node()
    node.state.unlink()  # the simulated driver answers DRIVER_NOT_LOADED without a state
    cp = run_check(node)
    assert cp.returncode == 3 and "Driver Not Loaded" in cp.stderr


def test_nvml_lib_option_overrides_config(sim_node, sim_lib):
    node = sim_node(simgpu.h100_sxm(1))
    node.config.write_text('nvml_library = "/nonexistent/libnvidia-ml.so.1"\n[xid]\nsource = "none"\n')
    cp = run_check(node, "--nvml-lib", str(sim_lib))
    assert cp.returncode == 0, cp.stderr


def test_snapshot_roundtrip_and_offline_check(sim_node, tmp_path):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, temperature=99)
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "snapshot"], env=node.env(), capture_output=True,
                        text=True, check=True)
    snap_file = tmp_path / "snap.json"
    snap_file.write_text(cp.stdout)
    data = json.loads(cp.stdout)
    assert data["gpus"][1]["temperature_c"] == {"status": "ok", "value": 99}
    assert len(data["gpus"][0]["nvlinks"]["value"]) == 18
    # Offline: no driver needed, same verdict; a policy change can be tried on the saved file.
    env = node.env()
    env.pop("SIMNVML_STATE")
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--json", "--snapshot", str(snap_file)],
                        env=env, capture_output=True, text=True)
    assert cp.returncode == 1 and json.loads(cp.stdout)["status"] == "FAIL"
    node.write_config("[health]\nmax_temperature_c = 100\n")
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--snapshot", str(snap_file)],
                        env=env, capture_output=True, text=True)
    assert cp.returncode == 0, cp.stdout
    snap_file.write_text("{\"gpus\": []}")
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--snapshot", str(snap_file)],
                        env=env, capture_output=True, text=True)
    assert cp.returncode == 2 and "not a valid snapshot" in cp.stderr


def test_a_gpu_count_the_driver_did_not_report_fails_the_count_check_instead_of_crashing(sim_node, tmp_path):
    """Found by Reading[T]: an unsupported count (a snapshot file without one, a driver answering
    NOT_SUPPORTED) compared None with the expected count: a TypeError, and the hooks fail open."""
    node = sim_node(simgpu.h100_sxm(1))
    snap_file = tmp_path / "snap.json"
    snap_file.write_text(json.dumps({"format": "slurm-gpu-snapshot/1", "hostname": "n1", "taken_at": 1, "gpus": []}))
    env = node.env()
    env.pop("SIMNVML_STATE")
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "check", "--json", "--snapshot", str(snap_file),
                         "--expected-count", "2"], env=env, capture_output=True, text=True)
    assert cp.returncode == 1, cp.stderr
    count, = [r for r in json.loads(cp.stdout)["results"] if r["check"] == "gpu_count"]
    assert count["status"] == "FAIL" and "cannot count GPUs" in count["message"]


def test_pcie_gen_downshift_at_idle_is_not_a_fault(sim_node):
    # GPUs drop the link generation when idle to save power: draining for that would empty a cluster.
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, pcie_gen_cur=1, pstate=8)
    assert by_check(check_in_process(node), "pcie_link", 0)[0].status == "PASS"
    simgpu.set_gpu(node.state, 0, pcie_gen_cur=3, pstate=0)
    assert by_check(check_in_process(node), "pcie_link", 0)[0].status == "WARN"


def test_severity_off_removes_check(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    node.write_config('[health.severity]\ntemperature = "off"\n')
    simgpu.set_gpu(node.state, 0, temperature=110)
    res = check_in_process(node)
    assert by_check(res, "temperature") == [] and health.worst(res) != "FAIL"


def test_healthcheck_checks_leftovers_only_when_no_gpu_is_allocated(sim_node):
    import types

    from slurm_gpu.hooks.healthcheck import default_checker
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, memory_used=8 << 30)
    os.environ["SIMNVML_STATE"] = str(node.state)
    check = default_checker(config.load(str(node.config)))
    idle_node = check(types.SimpleNamespace(name="gpu01", gpus_configured=2, gpus_allocated=0))
    assert [r.status for r in by_check(idle_node, "memory_in_use", 1)] == ["FAIL"]
    busy_node = check(types.SimpleNamespace(name="gpu01", gpus_configured=2, gpus_allocated=1))
    assert by_check(busy_node, "memory_in_use") == [] and health.worst(busy_node) != "FAIL"


def test_driver_reserved_memory_is_not_leaked_memory(sim_node):
    # Drivers >= 515 count memory they reserve for themselves as used in the v1 call: 2.5 GiB
    # "used" on an idle GPU of which 2 GiB are the driver's own.  Only v2 tells them apart.
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, memory_used=2560 << 20, memory_reserved=2048 << 20)
    (mem,) = by_check(check_in_process(node, idle=True), "memory_in_use", 0)
    assert mem.status == "PASS", mem.message
    assert {a["function"] for a in simgpu.read_actions(node.state)} == set()


def test_v1_memory_call_answers_when_the_driver_lacks_v2(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, memory_used=3 << 30)
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetMemoryInfo_v2", simgpu.FUNCTION_NOT_FOUND)
    (mem,) = by_check(check_in_process(node, idle=True), "memory_in_use", 0)
    assert mem.status == "FAIL" and "3072 MiB" in mem.message


def test_accounting_stats_work_without_pynvmls_private_function_lookup(sim_node, monkeypatch):
    # A future nvidia-ml-py may drop _nvmlGetFunctionPointer: the public wrapper then answers.
    import time as _time

    import pynvml

    from slurm_gpu.gpu import nvml_read
    node = sim_node(simgpu.h100_sxm(1))
    now_us = int(_time.time() * 1e6)
    simgpu.set_gpu(node.state, 0, acct=[dict(pid=4242, gpu_util=70, mem_util=20, max_mem_bytes=5 << 30,
                                             time_ms=1000, start_time_us=now_us, is_running=0)])


    class WithoutPrivateLookup:
        def __getattr__(self, name):
            if name == "_nvmlGetFunctionPointer":
                raise AttributeError(name)
            return getattr(pynvml, name)

    monkeypatch.setattr(nvml_read, "pynvml", WithoutPrivateLookup())
    os.environ["SIMNVML_STATE"] = str(node.state)
    cfg = config.load(str(node.config))
    reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)
    (rec,) = reader.accounting_many([0])[0].value
    assert (rec.pid, rec.gpu_utilization_pct, rec.max_memory_bytes) == (4242, 70, 5 << 30)
    assert nvml_read._NoMaxMemory().maxMemoryUsage == nvml_read._NOT_AVAILABLE_U64


# --- fleet checks: spare rows per bank, one VBIOS per model, a pinned driver --------------------------------

def test_bank_without_spare_rows_warns_with_the_number_of_banks(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    assert [r.status for r in by_check(check_in_process(node), "remap_spare_rows", 1)] == ["PASS"]
    simgpu.set_gpu(node.state, 1, remap_hist_max=2555, remap_hist_low=3, remap_hist_none=2)
    res = check_in_process(node)
    (r,) = by_check(res, "remap_spare_rows", 1)
    assert r.status == "WARN" and "2 memory banks with no spare rows left" in r.message and r.hint
    assert r.gpu_uuid.startswith("GPU-") and by_check(res, "remap_spare_rows", 0)[0].status == "PASS"
    assert health.worst(res) == "WARN"  # a warning, never a drain, unless the site says so
    node.write_config('[health.severity]\nremap_spare_rows = "fail"\n')
    assert [r.status for r in by_check(check_in_process(node), "remap_spare_rows", 1)] == ["FAIL"]


def test_gpus_of_one_model_on_different_vbios_warn_naming_each_version(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    assert [(r.status, r.gpu_index) for r in by_check(check_in_process(node), "vbios_consistency")] == [("PASS", None)]
    simgpu.set_gpu(node.state, 3, vbios="96.00.61.00.01")
    (r,) = by_check(check_in_process(node), "vbios_consistency")
    assert r.status == "WARN" and r.gpu_index is None and r.hint
    assert "2 VBIOS versions: 96.00.99.00.01 on GPU 0,1,2, 96.00.61.00.01 on GPU 3" in r.message
    node.write_config('[health.severity]\nvbios_consistency = "fail"\n')
    assert [r.status for r in by_check(check_in_process(node), "vbios_consistency")] == ["FAIL"]


def test_different_models_on_one_node_may_run_different_vbios(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, name="NVIDIA H100 PCIe", vbios="96.00.30.00.01")
    (r,) = by_check(check_in_process(node), "vbios_consistency")
    assert r.status == "PASS" and "96.00.30.00.01" in r.message


def test_fleet_checks_skip_when_the_driver_does_not_support_the_reading(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    for i in (0, 1):
        simgpu.inject_error(node.state, i, "nvmlDeviceGetVbiosVersion", simgpu.NOT_SUPPORTED)
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetRowRemapperHistogram", simgpu.NOT_SUPPORTED)
    res = check_in_process(node)
    assert [r.status for r in by_check(res, "vbios_consistency")] == ["SKIP"]
    assert [r.status for r in by_check(res, "remap_spare_rows", 0)] == ["SKIP"]
    consumer = check_in_process(sim_node(simgpu.consumer_gpu(2)))
    assert {r.status for r in by_check(consumer, "remap_spare_rows")} == {"SKIP"}
    assert health.worst(consumer) != "FAIL"


def test_one_gpu_without_a_vbios_reading_does_not_make_a_mismatch(sim_node):
    node = sim_node(simgpu.h100_sxm(3))
    simgpu.inject_error(node.state, 2, "nvmlDeviceGetVbiosVersion", simgpu.NO_PERMISSION)
    assert [r.status for r in by_check(check_in_process(node), "vbios_consistency")] == ["PASS"]


def test_a_histogram_that_cannot_be_read_warns_it_is_never_read_as_healthy(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetRowRemapperHistogram", simgpu.CORRUPTED_INFOROM)
    (r,) = by_check(check_in_process(node), "remap_spare_rows", 0)
    assert r.status == "WARN" and "cannot read" in r.message and "infoROM" in r.message


def test_severity_off_removes_the_fleet_checks(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 0, remap_hist_none=4, vbios="96.00.01.00.01")
    node.write_config('[health.severity]\nremap_spare_rows = "off"\nvbios_consistency = "off"\n')
    res = check_in_process(node)
    assert by_check(res, "remap_spare_rows") == [] and by_check(res, "vbios_consistency") == []


def test_a_pinned_driver_that_differs_fails_and_its_severity_is_configurable(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_node(node.state, driver_version="535.161.08")
    node.write_config('[health]\nrequired_driver_version = "550.54.15"\n')
    assert [r.status for r in by_check(check_in_process(node), "driver_version")] == ["FAIL"]
    node.write_config('[health]\nrequired_driver_version = "550.54.15"\n[health.severity]\ndriver_version = "warn"\n')
    (r,) = by_check(check_in_process(node), "driver_version")
    assert r.status == "WARN" and "535.161.08" in r.message
    node.write_config('[health]\nrequired_driver_version = "550.54.15"\n[health.severity]\ndriver_version = "off"\n')
    assert by_check(check_in_process(node), "driver_version") == []


def test_the_prologs_read_gives_no_fleet_check_result_at_all(sim_node):
    # The prolog reads without VBIOS and histogram: its results (and the metrics written from
    # them) must not turn a healthcheck's WARN into a SKIP.
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, remap_hist_none=1)
    cfg = config.load(str(node.config))
    os.environ["SIMNVML_STATE"] = str(node.state)
    reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)
    try:
        snap = reader.snapshot([0, 1])
    finally:
        reader.close()
    res = health.evaluate(snap, cfg, gpus=[0, 1], idle=[0, 1])
    assert by_check(res, "remap_spare_rows") == [] and by_check(res, "vbios_consistency") == []
    assert by_check(res, "ecc_uncorrectable", 1)[0].status == "PASS"
