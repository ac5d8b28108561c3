"""The simulated NVML (tests/simnvml) seen through the REAL pynvml.

pynvml keeps process-global state (the loaded library, a function-pointer cache, an init
refcount), so every scenario runs in a fresh interpreter: the library is loaded by absolute
path with RTLD_GLOBAL (as the product does for `nvml_library`), then pynvml is used as is.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simgpu  # noqa: E402

PRELUDE = """
import ctypes, json, os, sys, time
LIB = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import pynvml as N
out = {}
def err(fn, *a):
    try:
        fn(*a)
    except N.NVMLError as e:
        return [type(e).__name__, e.value, str(e)]
    return None
"""
EPILOGUE = "\nprint('@@' + json.dumps(out, default=str))\n"


@pytest.fixture(scope="session")
def lib() -> Path:
    return simgpu.build()


def clean_env(state: Optional[Path], **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "SIMNVML_STATE")}
    if state is not None:
        env["SIMNVML_STATE"] = str(state)
    env.update(extra)
    return env


def run_nvml(lib: Path, state: Optional[Path], code: str, timeout: float = 20, **extra_env: str) -> Dict[str, Any]:
    """Run `code` (with `N` = pynvml, `out` = result dict, `err()`) in a fresh interpreter."""
    src = PRELUDE + textwrap.dedent(code) + EPILOGUE
    res = subprocess.run([sys.executable, "-c", src, str(lib)], env=clean_env(state, **extra_env),
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"scenario failed:\n{res.stderr}"
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])


@pytest.fixture
def node_state(tmp_path: Path):
    """Write a node dict to <tmp>/node.state and return the path."""
    def make(node: Dict[str, Any]) -> Path:
        return simgpu.write_state(tmp_path / "node.state", node)
    return make


# --- loading -----------------------------------------------------------------------------------

def test_library_loaded_by_absolute_path_serves_pynvml_without_ld_library_path(lib, node_state):
    node = simgpu.h100_sxm(1)
    node["driver_version"] = "999.88.77"
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        out["driver"] = N.nvmlSystemGetDriverVersion()
        out["same_lib"] = (ctypes.cast(N.nvmlLib.nvmlInitWithFlags, ctypes.c_void_p).value
                           == ctypes.cast(LIB.nvmlInitWithFlags, ctypes.c_void_p).value)
        out["ld_path"] = os.environ.get("LD_LIBRARY_PATH")
    """)
    assert out == {"driver": "999.88.77", "same_lib": True, "ld_path": None}


def test_pynvml_alone_does_not_find_the_library_so_the_preload_is_what_works(lib, node_state):
    # Proves the test above is meaningful: without the RTLD_GLOBAL preload there is no NVML.
    # Asked in a fresh interpreter: this one may hold the simulated library already (same SONAME).
    probe = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"],
                           env=clean_env(None), capture_output=True, timeout=20)
    if probe.returncode == 0:
        pytest.skip("a real libnvidia-ml.so.1 is on this machine's search path")
    src = "import pynvml as N\ntry:\n    N.nvmlInit()\nexcept N.NVMLError_LibraryNotFound:\n    print('notfound')\n"
    res = subprocess.run([sys.executable, "-c", src], env=clean_env(node_state(simgpu.h100_sxm(1))),
                         capture_output=True, text=True, timeout=20)
    assert res.stdout.strip() == "notfound", res.stderr


# --- every field -------------------------------------------------------------------------------

def test_every_state_field_round_trips_through_pynvml(lib, node_state, tmp_path):
    live = os.getpid()
    node = simgpu.h100_sxm(2, seed="rt")
    g = node["gpus"][0]
    g.update(
        name="NVIDIA H100 80GB HBM3", uuid="GPU-11111111-2222-3333-4444-555555555555", serial="1650000000001",
        minor=3, pci_bus_id="00000000:9a:00.0", pci_device_id="0x233010DE", pci_subsystem_id="0x16C110DE",
        memory_total=80 * 2**30, memory_used=3 * 2**30, memory_reserved=2**29, temperature=71, power_mw=412345,
        energy_mj=123456789012, gpu_util=87, mem_util=42,
        ecc_volatile_corrected=5, ecc_volatile_uncorrected=2, ecc_aggregate_corrected=50, ecc_aggregate_uncorrected=20,
        retired_pages_sbe=3, retired_pages_dbe=1, retired_pages_pending=1,
        remapped_corrected=4, remapped_uncorrected=1, remapped_pending=1, remapped_failure=0,
        clock_event_reasons=hex(0x40 | 0x4), persistence_mode=0, pstate=2,
        pcie_gen_cur=3, pcie_gen_max=5, pcie_gen_gpu_max=5, pcie_width_cur=8, pcie_width_max=16,
        nvlinks=[{"state": 1, "remote_bus_id": "00000000:05:00.0"}, {"state": 0, "remote_bus_id": "00000000:06:00.0"}],
        procs=[(live, 2**30), (os.getppid(), None)],
        cpu_affinity="0-3,64,70-71",
        mig_mode=0, mig_mode_pending=1,
    )
    node["cuda_driver_version"] = 12020
    node["nvml_version"] = "12.535.104.05"
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        p = N.nvmlDeviceGetPciInfo(h)
        m1 = N.nvmlDeviceGetMemoryInfo(h)
        m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
        u = N.nvmlDeviceGetUtilizationRates(h)
        ecc = {f"{e}{c}": N.nvmlDeviceGetTotalEccErrors(h, e, c) for e in (0, 1) for c in (0, 1)}
        aff = N.nvmlDeviceGetCpuAffinity(h, 2)
        out.update(
            count=N.nvmlDeviceGetCount(), cuda=N.nvmlSystemGetCudaDriverVersion(),
            cuda2=N.nvmlSystemGetCudaDriverVersion_v2(), nvml=N.nvmlSystemGetNVMLVersion(),
            index=N.nvmlDeviceGetIndex(h), minor=N.nvmlDeviceGetMinorNumber(h), uuid=N.nvmlDeviceGetUUID(h),
            name=N.nvmlDeviceGetName(h), serial=N.nvmlDeviceGetSerial(h),
            pci=[p.busId, p.busIdLegacy, p.domain, p.bus, p.device, p.pciDeviceId, p.pciSubSystemId],
            mem1=[m1.total, m1.used, m1.free], mem2=[m2.total, m2.reserved, m2.used, m2.free],
            temp=N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
            tempv=N.nvmlDeviceGetTemperatureV(h, N.NVML_TEMPERATURE_GPU),
            power=N.nvmlDeviceGetPowerUsage(h), energy=N.nvmlDeviceGetTotalEnergyConsumption(h),
            util=[u.gpu, u.memory], ecc=ecc,
            sbe=N.nvmlDeviceGetRetiredPages(h, 0), dbe=N.nvmlDeviceGetRetiredPages_v2(h, 1),
            pending=N.nvmlDeviceGetRetiredPagesPendingStatus(h), remap=list(N.nvmlDeviceGetRemappedRows(h)),
            reasons=N.nvmlDeviceGetCurrentClocksEventReasons(h),
            throttle=N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
            persist=N.nvmlDeviceGetPersistenceMode(h), pstate=N.nvmlDeviceGetPerformanceState(h),
            pcie=[N.nvmlDeviceGetCurrPcieLinkGeneration(h), N.nvmlDeviceGetMaxPcieLinkGeneration(h),
                  N.nvmlDeviceGetGpuMaxPcieLinkGeneration(h), N.nvmlDeviceGetCurrPcieLinkWidth(h),
                  N.nvmlDeviceGetMaxPcieLinkWidth(h)],
            links=[N.nvmlDeviceGetNvLinkState(h, 0), N.nvmlDeviceGetNvLinkState(h, 1)],
            remote=N.nvmlDeviceGetNvLinkRemotePciInfo(h, 1).busId,
            procs=[[x.pid, x.usedGpuMemory, x.gpuInstanceId] for x in N.nvmlDeviceGetComputeRunningProcesses(h)],
            mig=N.nvmlDeviceGetMigMode(h), migmax=N.nvmlDeviceGetMaxMigDeviceCount(h),
            affinity=[aff[0], aff[1]],
            by_uuid=N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID("GPU-11111111-2222-3333-4444-555555555555")),
            by_bus=N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId("0000:9A:00.0")),
            ismig=N.nvmlDeviceIsMigDeviceHandle(h).value,
            eccmode=N.nvmlDeviceGetEccMode(h),
        )
    """)
    ppid = os.getppid()
    assert out["count"] == 2 and out["cuda"] == 12020 and out["cuda2"] == 12020 and out["nvml"] == "12.535.104.05"
    assert (out["index"], out["minor"], out["uuid"]) == (0, 3, "GPU-11111111-2222-3333-4444-555555555555")
    assert (out["name"], out["serial"]) == ("NVIDIA H100 80GB HBM3", "1650000000001")
    assert out["pci"] == ["00000000:9A:00.0", "0000:9A:00.0", 0, 0x9A, 0, 0x233010DE, 0x16C110DE]
    assert out["mem1"] == [80 * 2**30, 3 * 2**30, 77 * 2**30]
    assert out["mem2"] == [80 * 2**30, 2**29, 3 * 2**30 - 2**29, 77 * 2**30]
    assert (out["temp"], out["tempv"], out["power"], out["energy"]) == (71, 71, 412345, 123456789012)
    assert out["util"] == [87, 42]
    assert out["ecc"] == {"00": 5, "01": 50, "10": 2, "11": 20}
    assert len(out["sbe"]) == 3 and len(set(out["sbe"])) == 3
    assert len(out["dbe"]) == 1 and set(out["dbe"][0]) == {"address", "timestamp"}
    assert (out["pending"], out["remap"]) == (1, [4, 1, 1, 0])
    assert out["reasons"] == out["throttle"] == 0x44
    assert (out["persist"], out["pstate"]) == (0, 2)
    assert out["pcie"] == [3, 5, 5, 8, 16]
    assert out["links"] == [1, 0] and out["remote"] == "00000000:06:00.0"
    assert sorted(out["procs"]) == sorted([[os.getpid(), 2**30, 0xFFFFFFFF], [ppid, None, 0xFFFFFFFF]])
    assert (out["mig"], out["migmax"]) == ([0, 1], 0)
    assert out["affinity"] == [0b1111, 0b11000001]  # CPUs 0-3 | 64, 70, 71
    assert (out["by_uuid"], out["by_bus"], out["ismig"], out["eccmode"]) == (0, 0, 0, [1, 1])


def test_defaults_make_a_healthy_gpu_from_a_near_empty_state(lib, tmp_path):
    state = tmp_path / "s.state"
    state.write_text("# only a count\ngpu_count=1\nunknown.future.key=whatever\n")
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out.update(temp=N.nvmlDeviceGetTemperature(h, 0), reasons=N.nvmlDeviceGetCurrentClocksEventReasons(h),
                   procs=N.nvmlDeviceGetComputeRunningProcesses(h), uuid=N.nvmlDeviceGetUUID(h),
                   nvlink=err(N.nvmlDeviceGetNvLinkState, h, 0), acct=err(N.nvmlDeviceGetAccountingPids, h),
                   driver=N.nvmlSystemGetDriverVersion())
    """)
    assert out["temp"] == 35 and out["reasons"] == 0x1 and out["procs"] == []
    assert out["uuid"].startswith("GPU-") and out["driver"] == "550.54.15"
    assert out["nvlink"][0] == "NVMLError_NotSupported"  # no NvLink by default
    assert out["acct"][0] == "NVMLError_NotSupported"  # accounting off by default


# --- init -----------------------------------------------------------------------------------------

def test_state_is_reread_at_every_init(lib, node_state):
    state = node_state(simgpu.h100_sxm(2))
    out = run_nvml(lib, state, f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import simgpu
        N.nvmlInit()
        h1 = N.nvmlDeviceGetHandleByIndex(1)
        out["before"] = N.nvmlDeviceGetTemperature(h1, 0)
        simgpu.set_gpu({str(state)!r}, 1, temperature=88)
        out["same_init"] = N.nvmlDeviceGetTemperature(h1, 0)
        N.nvmlShutdown()
        out["after_shutdown"] = err(N.nvmlDeviceGetTemperature, h1, 0)
        N.nvmlInit()
        out["after"] = N.nvmlDeviceGetTemperature(h1, 0)
        simgpu.set_node({str(state)!r}, gpu_count=1)
        N.nvmlShutdown(); N.nvmlInit()
        out["count"] = N.nvmlDeviceGetCount()
        out["stale_handle"] = err(N.nvmlDeviceGetTemperature, h1, 0)
        out["index_past_count"] = err(N.nvmlDeviceGetHandleByIndex, 1)
    """)
    assert (out["before"], out["same_init"], out["after"]) == (35, 35, 88)
    assert out["after_shutdown"][0] == "NVMLError_Uninitialized"
    assert out["count"] == 1
    assert out["stale_handle"][0] == out["index_past_count"][0] == "NVMLError_InvalidArgument"


def test_missing_state_file_is_driver_not_loaded(lib, tmp_path):
    out = run_nvml(lib, tmp_path / "absent.state", "out['init'] = err(N.nvmlInit)")
    assert out["init"] == ["NVMLError_DriverNotLoaded", 9, "Driver Not Loaded"]


def test_init_error_and_init_hang_are_injected(lib, node_state):
    node = simgpu.h100_sxm(1)
    node.update(init_error=simgpu.LIB_RM_VERSION_MISMATCH, init_hang_s=0.3)
    state = node_state(node)
    out = run_nvml(lib, state, """
        t = time.monotonic(); out["init"] = err(N.nvmlInit); out["took"] = time.monotonic() - t
        out["count"] = err(N.nvmlDeviceGetCount)
    """)
    assert out["init"][0] == "NVMLError_LibRmVersionMismatch"
    assert out["took"] >= 0.3
    assert out["count"][0] == "NVMLError_Uninitialized"


def test_default_state_path_expands_node_name_without_any_simnvml_env(tmp_path):
    lib = simgpu.build(out_dir=tmp_path / "build", default_state=str(tmp_path / "%n.state"))
    node = simgpu.a100_pcie(3, seed="nodeA")
    simgpu.write_state(tmp_path / "nodeA.state", node)
    out = run_nvml(lib, None, "N.nvmlInit(); out['n'] = N.nvmlDeviceGetCount()", SLURMD_NODENAME="nodeA")
    assert out == {"n": 3}
    out = run_nvml(lib, None, "out['init'] = err(N.nvmlInit)", SLURMD_NODENAME="nodeB")
    assert out["init"][0] == "NVMLError_DriverNotLoaded"
    assert simgpu.build(out_dir=tmp_path / "build", default_state=str(tmp_path / "%n.state")) == lib  # cached


# --- fleet readings: VBIOS, row-remapper histogram, ECC by location ----------------------------------

FLEET_CALLS = """
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    def hist():
        v = N.nvmlDeviceGetRowRemapperHistogram(h)
        return [v.max, v.high, v.partial, v.low, v.none]
    def mem(e, c, loc):
        return N.nvmlDeviceGetMemoryErrorCounter(h, e, c, loc)
    SRAM, DRAM = N.NVML_MEMORY_LOCATION_SRAM, N.NVML_MEMORY_LOCATION_DRAM
    out.update(
        vbios=err(N.nvmlDeviceGetVbiosVersion, h) or N.nvmlDeviceGetVbiosVersion(h),
        serial=err(N.nvmlDeviceGetSerial, h) or N.nvmlDeviceGetSerial(h),
        hist=err(N.nvmlDeviceGetRowRemapperHistogram, h) or hist(),
        sram=err(mem, 0, 1, SRAM) or [mem(e, c, SRAM) for e in (0, 1) for c in (0, 1)],
        dram=err(mem, 0, 1, DRAM) or [mem(e, c, DRAM) for e in (0, 1) for c in (0, 1)],
        l2=err(mem, 0, 1, N.NVML_MEMORY_LOCATION_L2_CACHE),
        bad_location=err(mem, 0, 1, 9),
    )
"""


def test_vbios_histogram_and_sram_counts_reach_pynvml(lib, node_state):
    node = simgpu.h100_sxm(1)
    node["gpus"][0].update(vbios="96.00.74.00.0D", remap_hist_max=2550, remap_hist_high=6, remap_hist_partial=2,
                           remap_hist_low=1, remap_hist_none=1,
                           ecc_volatile_corrected=10, ecc_aggregate_corrected=40, ecc_volatile_uncorrected=3,
                           ecc_aggregate_uncorrected=5, sram_volatile_corrected=4, sram_aggregate_corrected=7,
                           sram_volatile_uncorrected=1, sram_aggregate_uncorrected=2)
    out = run_nvml(lib, node_state(node), FLEET_CALLS)
    assert out["vbios"] == "96.00.74.00.0D" and out["serial"] == node["gpus"][0]["serial"]
    assert out["hist"] == [2550, 6, 2, 1, 1]
    # (corrected, uncorrected) x (volatile, aggregate); DRAM + SRAM = the totals
    assert out["sram"] == [4, 7, 1, 2] and out["dram"] == [6, 33, 2, 3]
    assert out["l2"][0] == "NVMLError_NotSupported"  # folded into SRAM on Hopper
    assert out["bad_location"][0] == "NVMLError_InvalidArgument"


def test_profiles_have_every_spare_row_and_no_sram_error(lib, node_state):
    out = run_nvml(lib, node_state(simgpu.a100_pcie(1)), FLEET_CALLS)
    assert out["vbios"] == "92.00.45.00.06" and out["hist"] == [640, 0, 0, 0, 0]
    assert out["sram"] == [0, 0, 0, 0]


@pytest.mark.parametrize("function, key", [("nvmlDeviceGetVbiosVersion", "vbios"),
                                           ("nvmlDeviceGetSerial", "serial"),
                                           ("nvmlDeviceGetRowRemapperHistogram", "hist"),
                                           ("nvmlDeviceGetMemoryErrorCounter", "sram")])
def test_each_fleet_reading_can_be_not_supported_on_one_gpu(lib, node_state, function, key):
    node = simgpu.h100_sxm(2)
    node["gpus"][0]["errors"] = {function: simgpu.NOT_SUPPORTED}
    state = node_state(node)
    out = run_nvml(lib, state, FLEET_CALLS)
    assert out[key][0] == "NVMLError_NotSupported"
    other = run_nvml(lib, state, FLEET_CALLS.replace("HandleByIndex(0)", "HandleByIndex(1)"))
    assert "NVMLError" not in json.dumps(other[key])  # the other GPU answers


def test_consumer_board_has_no_histogram_and_no_ecc_by_location_but_a_vbios(lib, node_state):
    out = run_nvml(lib, node_state(simgpu.consumer_gpu()), FLEET_CALLS)
    assert out["vbios"] == "95.02.3C.00.8E"
    for k in ("hist", "sram", "dram"):
        assert out[k][0] == "NVMLError_NotSupported", k


def test_ecc_disabled_makes_the_location_counters_not_supported(lib, node_state):
    node = simgpu.h100_sxm(1)
    node["gpus"][0]["ecc_mode"] = 0
    out = run_nvml(lib, node_state(node), FLEET_CALLS)
    assert out["sram"][0] == out["dram"][0] == "NVMLError_NotSupported"
    assert out["hist"] == [2560, 0, 0, 0, 0]


# --- fault injection ------------------------------------------------------------------------------

def test_injected_errors_raise_the_matching_nvmlerror_subclass(lib, node_state):
    node = simgpu.h100_sxm(2)
    node["gpus"][0]["errors"] = {"nvmlDeviceGetTemperature": simgpu.NOT_SUPPORTED,
                                 "nvmlDeviceGetPciInfo": simgpu.NO_PERMISSION,  # base name hits the _v3 symbol
                                 "nvmlDeviceGetComputeRunningProcesses_v3": simgpu.TIMEOUT}
    node["errors"] = {"nvmlSystemGetDriverVersion": simgpu.UNKNOWN}
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        out.update(temp=err(N.nvmlDeviceGetTemperature, h0, 0), pci=err(N.nvmlDeviceGetPciInfo, h0),
                   procs=err(N.nvmlDeviceGetComputeRunningProcesses, h0), drv=err(N.nvmlSystemGetDriverVersion),
                   other_gpu=N.nvmlDeviceGetTemperature(h1, 0), power=N.nvmlDeviceGetPowerUsage(h0))
    """)
    assert out["temp"] == ["NVMLError_NotSupported", 3, "Not Supported"]
    assert out["pci"] == ["NVMLError_NoPermission", 4, "Insufficient Permissions"]
    assert out["procs"] == ["NVMLError_Timeout", 10, "Timeout"]
    assert out["drv"] == ["NVMLError_Unknown", 999, "Unknown Error"]
    assert out["other_gpu"] == 35 and out["power"] == 70000


def test_hung_function_sleeps_before_answering(lib, node_state):
    state = node_state(simgpu.h100_sxm(2))
    simgpu.inject_hang(state, 1, "nvmlDeviceGetTemperature", 0.4)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        def timed(fn, *a):
            t = time.monotonic(); v = fn(*a); return [v, time.monotonic() - t]
        out.update(hung=timed(N.nvmlDeviceGetTemperature, h1, 0), fast=timed(N.nvmlDeviceGetTemperature, h0, 0),
                   other=timed(N.nvmlDeviceGetPowerUsage, h1))
    """)
    assert out["hung"][0] == 35 and out["hung"][1] >= 0.4
    assert out["fast"][1] < 0.1 and out["other"][1] < 0.1


def test_hang_all_delays_every_call_on_that_gpu(lib, node_state):
    node = simgpu.h100_sxm(1)
    node["gpus"][0]["hang_all"] = 0.15
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        t = time.monotonic(); h = N.nvmlDeviceGetHandleByIndex(0); N.nvmlDeviceGetUUID(h)
        out["took"] = time.monotonic() - t
        t = time.monotonic(); N.nvmlSystemGetDriverVersion(); out["node_call"] = time.monotonic() - t
    """)
    assert out["took"] >= 0.3 and out["node_call"] < 0.1


def test_lost_gpu_fails_every_call_on_it_and_only_on_it(lib, node_state):
    state = node_state(simgpu.h100_sxm(2))
    out = run_nvml(lib, state, f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import simgpu
        N.nvmlInit()
        h1 = N.nvmlDeviceGetHandleByIndex(1)
        simgpu.lose_gpu({str(state)!r}, 1)
        N.nvmlShutdown(); N.nvmlInit()
        out.update(count=N.nvmlDeviceGetCount(), handle=err(N.nvmlDeviceGetHandleByIndex, 1),
                   uuid=err(N.nvmlDeviceGetUUID, h1), temp=err(N.nvmlDeviceGetTemperature, h1, 0),
                   reset=err(N.nvmlDeviceResetApplicationsClocks, h1),
                   gpu0=N.nvmlDeviceGetTemperature(N.nvmlDeviceGetHandleByIndex(0), 0))
    """)
    assert out["count"] == 2 and out["gpu0"] == 35
    for k in ("handle", "uuid", "temp", "reset"):
        assert out[k] == ["NVMLError_GpuIsLost", 15, "GPU is lost"], k
    assert simgpu.read_actions(state) == []  # the failed reset did nothing


# --- processes ------------------------------------------------------------------------------------

def test_process_list_follows_the_insufficient_size_protocol(lib, node_state):
    node = simgpu.h100_sxm(2)
    node["gpus"][0]["procs"] = [(os.getpid(), 5 * 2**30), (os.getppid(), None)]
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        fn = LIB.nvmlDeviceGetComputeRunningProcesses_v3
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        c = ctypes.c_uint(0)
        out["busy_first"] = [fn(h0, ctypes.byref(c), None), c.value]
        c = ctypes.c_uint(1); arr = (N.c_nvmlProcessInfo_v3_t * 1)()
        out["too_small"] = [fn(h0, ctypes.byref(c), arr), c.value]
        c = ctypes.c_uint(0)
        out["idle_first"] = [fn(h1, ctypes.byref(c), None), c.value]
        out["pynvml"] = sorted([p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h0))
    """)
    assert out["busy_first"] == [simgpu.INSUFFICIENT_SIZE, 2]
    assert out["too_small"] == [simgpu.INSUFFICIENT_SIZE, 2]
    assert out["idle_first"] == [simgpu.SUCCESS, 0]
    assert out["pynvml"] == sorted([[os.getpid(), 5 * 2**30], [os.getppid(), None]])


def test_processes_that_exited_are_not_listed(lib, node_state):
    gone = simgpu.dead_pid()
    node = simgpu.h100_sxm(1)
    node["gpus"][0]["procs"] = [(gone, 2**30), (os.getpid(), 2**20)]
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        out["pids"] = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(0))]
    """)
    assert out["pids"] == [os.getpid()]


def test_a_zombie_is_not_listed_like_the_driver_forgets_a_process_at_exit(lib, node_state):
    """A killed process's GPU context goes when its files close in do_exit, before it is a zombie; the
    epilog met zombies of a job Slurm had just ended on 24.11 and 26.05, and the driver stand-in kept
    listing them (a drain for a process that no longer held the GPU)."""
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        node = simgpu.h100_sxm(1)
        node["gpus"][0]["procs"] = [(zombie.pid, 2**30), (os.getpid(), 2**20)]
        out = run_nvml(lib, node_state(node), """
            N.nvmlInit()
            out["pids"] = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(0))]
        """)
        assert out["pids"] == [os.getpid()]
    finally:
        zombie.wait()


# --- accounting -----------------------------------------------------------------------------------

def test_accounting_pids_and_stats_are_served_while_accounting_is_on(lib, node_state):
    node = simgpu.h100_sxm(2)
    node["gpus"][0]["acct"] = [
        dict(pid=4242, gpu_util=91, mem_util=33, max_mem_bytes=7 * 2**30, time_ms=60000,
             start_time_us=1_700_000_000_000_000, is_running=0),
        dict(pid=4243, gpu_util=10, mem_util=5, max_mem_bytes=None, time_ms=100,
             start_time_us=1_700_000_001_000_000, is_running=1),
    ]
    node["gpus"][1]["accounting_mode"] = 0
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        s = N.nvmlDeviceGetAccountingStats(h0, 4242)
        # Raw call: pynvml 13.x itself raises TypeError on a "not available" maxMemoryUsage.
        s2 = N.c_nvmlAccountingStats_t()
        LIB.nvmlDeviceGetAccountingStats(h0, ctypes.c_uint(4243), ctypes.byref(s2))
        c = ctypes.c_uint(1); arr = (ctypes.c_uint * 1)()
        out.update(mode=N.nvmlDeviceGetAccountingMode(h0), size=N.nvmlDeviceGetAccountingBufferSize(h0),
                   pids=N.nvmlDeviceGetAccountingPids(h0),
                   stats=[s.gpuUtilization, s.memoryUtilization, s.maxMemoryUsage, s.time, s.startTime, s.isRunning],
                   stats2=[s2.maxMemoryUsage, s2.isRunning],
                   small=[LIB.nvmlDeviceGetAccountingPids(h0, ctypes.byref(c), arr), c.value],
                   unknown_pid=err(N.nvmlDeviceGetAccountingStats, h0, 1),
                   off_mode=N.nvmlDeviceGetAccountingMode(h1), off_pids=err(N.nvmlDeviceGetAccountingPids, h1))
    """)
    assert out["mode"] == 1 and out["size"] == 4000 and out["pids"] == [4242, 4243]
    assert out["stats"] == [91, 33, 7 * 2**30, 60000, 1_700_000_000_000_000, 0]
    assert out["stats2"] == [2**64 - 1, 1]
    assert out["small"] == [simgpu.INSUFFICIENT_SIZE, 2]
    assert out["unknown_pid"][0] == "NVMLError_NotFound"
    assert out["off_mode"] == 0 and out["off_pids"][0] == "NVMLError_NotSupported"


# --- mutating calls -------------------------------------------------------------------------------

def test_mutating_calls_append_to_state_and_action_log(lib, node_state):
    node = simgpu.h100_sxm(2, seed="mut")
    g = node["gpus"][1]
    g.update(persistence_mode=0, accounting_mode=0, clock_event_reasons="0x3",
             acct=[dict(pid=10, is_running=0), dict(pid=11, is_running=1)])
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(1)
        N.nvmlDeviceSetPersistenceMode(h, 1)
        N.nvmlDeviceResetApplicationsClocks(h)
        N.nvmlDeviceResetGpuLockedClocks(h)
        N.nvmlDeviceResetMemoryLockedClocks(h)
        N.nvmlDeviceSetAccountingMode(h, 1)
        N.nvmlDeviceClearAccountingPids(h)
        out.update(persist=N.nvmlDeviceGetPersistenceMode(h), acct=N.nvmlDeviceGetAccountingMode(h),
                   pids=N.nvmlDeviceGetAccountingPids(h), reasons=N.nvmlDeviceGetCurrentClocksEventReasons(h))
        N.nvmlDeviceResetApplicationsClocks(h)
    """)
    assert out == {"persist": 1, "acct": 1, "pids": [11], "reasons": 0x1}  # visible in-process at once
    st = simgpu.read_state(state)
    assert st["gpu.1.persistence_mode"] == "1" and st["gpu.1.accounting_mode"] == "1"
    assert st["gpu.1.acct"] == "11:0:0:0:0:0:1"
    assert st["gpu.1.app_clocks_resets"] == "2" and st["gpu.1.gpu_locked_clocks_resets"] == "1"
    assert st["gpu.1.mem_locked_clocks_resets"] == "1" and st["gpu.1.accounting_clears"] == "1"
    assert st["gpu.0.persistence_mode"] == "1" and "gpu.0.app_clocks_resets" not in st  # other GPU untouched
    acts = simgpu.read_actions(state)
    assert [a["function"] for a in acts] == [
        "nvmlDeviceSetPersistenceMode", "nvmlDeviceResetApplicationsClocks", "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceResetMemoryLockedClocks", "nvmlDeviceSetAccountingMode", "nvmlDeviceClearAccountingPids",
        "nvmlDeviceResetApplicationsClocks"]
    assert all(a["gpu"] == 1 and a["uuid"] == node["gpus"][1]["uuid"] for a in acts)
    assert acts[0]["args"] == {"mode": 1} and abs(acts[0]["time"] - time.time()) < 60
    # A fresh process (a later prolog) sees the appended state too.
    out = run_nvml(lib, state, "N.nvmlInit(); out['p'] = N.nvmlDeviceGetPersistenceMode(N.nvmlDeviceGetHandleByIndex(1))")
    assert out == {"p": 1}


def test_disabling_accounting_drops_all_records(lib, node_state):
    node = simgpu.h100_sxm(1)
    node["gpus"][0]["acct"] = [dict(pid=11, is_running=1)]
    state = node_state(node)
    run_nvml(lib, state, "N.nvmlInit(); N.nvmlDeviceSetAccountingMode(N.nvmlDeviceGetHandleByIndex(0), 0)")
    st = simgpu.read_state(state)
    assert st["gpu.0.accounting_mode"] == "0" and st["gpu.0.acct"] == ""


def test_failing_mutation_is_reported_and_not_logged(lib, node_state):
    node = simgpu.h100_sxm(1)
    node["gpus"][0]["errors"] = {"nvmlDeviceResetGpuLockedClocks": simgpu.NO_PERMISSION}
    state = node_state(node)
    out = run_nvml(lib, state, "N.nvmlInit(); out['e'] = err(N.nvmlDeviceResetGpuLockedClocks, N.nvmlDeviceGetHandleByIndex(0))")
    assert out["e"][0] == "NVMLError_NoPermission"
    assert simgpu.read_actions(state) == [] and "gpu.0.gpu_locked_clocks_resets" not in simgpu.read_state(state)


def test_concurrent_epilogs_lose_no_reset_and_write_whole_lines(lib, node_state):
    state = node_state(simgpu.h100_sxm(4))
    code = """
        N.nvmlInit()
        for i in range(4):
            h = N.nvmlDeviceGetHandleByIndex(i)
            for _ in range(5):
                N.nvmlDeviceResetApplicationsClocks(h)
    """
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda _: run_nvml(lib, state, code), range(6)))
    st = simgpu.read_state(state)
    assert [st[f"gpu.{i}.app_clocks_resets"] for i in range(4)] == ["30"] * 4
    acts = simgpu.read_actions(state)
    assert len(acts) == 120 and all(a["function"] == "nvmlDeviceResetApplicationsClocks" for a in acts)


# --- MIG, NvLink, affinity ------------------------------------------------------------------------

def test_mig_devices_expose_ids_memory_names_and_parent(lib, node_state):
    node = simgpu.mig_gpu(seed="m")
    node["gpus"][0]["mig"][1]["procs"] = [(os.getpid(), 2**30)]
    state = node_state(node)
    out = run_nvml(lib, state, """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        mx = N.nvmlDeviceGetMaxMigDeviceCount(h)
        migs = []
        for i in range(mx):
            try:
                mh = N.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except N.NVMLError_NotFound:
                continue
            parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mh)
            migs.append([N.nvmlDeviceGetUUID(mh), N.nvmlDeviceGetName(mh), N.nvmlDeviceGetGpuInstanceId(mh),
                         N.nvmlDeviceGetComputeInstanceId(mh), N.nvmlDeviceGetMemoryInfo(mh).total,
                         N.nvmlDeviceIsMigDeviceHandle(mh).value, N.nvmlDeviceGetIndex(parent),
                         [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(mh)]])
        out.update(mode=N.nvmlDeviceGetMigMode(h), max=mx, migs=migs,
                   parent_procs=[[p.pid, p.gpuInstanceId, p.computeInstanceId]
                                 for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
                   by_uuid=N.nvmlDeviceGetGpuInstanceId(N.nvmlDeviceGetHandleByUUID(migs[2][0])),
                   gi_on_gpu=err(N.nvmlDeviceGetGpuInstanceId, h),
                   temp_on_mig=err(N.nvmlDeviceGetTemperature, N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0), 0),
                   past_max=err(N.nvmlDeviceGetMigDeviceHandleByIndex, h, 7))
    """)
    m = node["gpus"][0]["mig"]
    assert out["mode"] == [1, 1] and out["max"] == 7 and len(out["migs"]) == 3
    assert out["migs"][0][:6] == [m[0]["uuid"], "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 1, 0, 19968 * 2**20, 1]
    assert [x[2] for x in out["migs"]] == [1, 5, 13] and all(x[6] == 0 for x in out["migs"])
    assert [x[7] for x in out["migs"]] == [[], [os.getpid()], []]
    assert out["parent_procs"] == [[os.getpid(), 5, 0]]
    assert out["by_uuid"] == 13
    assert out["gi_on_gpu"][0] == out["temp_on_mig"][0] == "NVMLError_NotSupported"
    assert out["past_max"][0] == "NVMLError_InvalidArgument"


def test_nvlink_queries_follow_link_count(lib, tmp_path):
    h100, a100 = tmp_path / "h100.state", tmp_path / "a100.state"
    simgpu.write_state(h100, simgpu.h100_sxm(1))
    simgpu.write_state(a100, simgpu.a100_pcie(1))
    code = """
        N.nvmlInit(); h = N.nvmlDeviceGetHandleByIndex(0)
        out.update(l0=err(N.nvmlDeviceGetNvLinkState, h, 0), l17=err(N.nvmlDeviceGetNvLinkState, h, 17),
                   l18=err(N.nvmlDeviceGetNvLinkState, h, 18), l36=err(N.nvmlDeviceGetNvLinkState, h, 36))
        if out["l0"] is None:
            out["up"] = sum(N.nvmlDeviceGetNvLinkState(h, l) for l in range(18))
    """
    o = run_nvml(lib, h100, code)
    assert o["l0"] is None and o["l17"] is None and o["up"] == 18
    assert o["l18"][0] == "NVMLError_NotSupported" and o["l36"][0] == "NVMLError_InvalidArgument"
    o = run_nvml(lib, a100, code)
    assert o["l0"][0] == o["l17"][0] == "NVMLError_NotSupported"


def test_consumer_profile_reports_datacenter_features_as_not_supported(lib, node_state):
    state = node_state(simgpu.consumer_gpu())
    out = run_nvml(lib, state, """
        N.nvmlInit(); h = N.nvmlDeviceGetHandleByIndex(0)
        out.update(name=N.nvmlDeviceGetName(h), energy=N.nvmlDeviceGetTotalEnergyConsumption(h),
                   ecc=err(N.nvmlDeviceGetTotalEccErrors, h, 1, 0), pages=err(N.nvmlDeviceGetRetiredPages, h, 1),
                   remap=err(N.nvmlDeviceGetRemappedRows, h), acct=err(N.nvmlDeviceGetAccountingMode, h),
                   mig=err(N.nvmlDeviceGetMigMode, h), nvlink=err(N.nvmlDeviceGetNvLinkState, h, 0))
    """)
    assert out["name"] == "NVIDIA GeForce RTX 4090" and out["energy"] > 0
    for k in ("ecc", "pages", "remap", "acct", "mig", "nvlink"):
        assert out[k][0] == "NVMLError_NotSupported", k


# --- the Python helper itself ------------------------------------------------------------------------

def test_profiles_give_distinct_deterministic_identities_per_seed():
    a, a2, b = simgpu.h100_sxm(8, seed="node1"), simgpu.h100_sxm(8, seed="node1"), simgpu.h100_sxm(8, seed="node2")
    uuids = [g["uuid"] for g in a["gpus"]]
    assert uuids == [g["uuid"] for g in a2["gpus"]]
    assert len(set(uuids)) == 8 and not set(uuids) & {g["uuid"] for g in b["gpus"]}
    assert len({g["pci_bus_id"] for g in a["gpus"]}) == 8 and len({g["serial"] for g in a["gpus"]}) == 8
    assert {g["cpu_affinity"] for g in a["gpus"]} == {"0-55", "56-111"}
    for profile in simgpu.PROFILES.values():
        node = profile()
        assert node["gpus"] and all(g["uuid"].startswith("GPU-") for g in node["gpus"])


def test_read_actions_parses_the_log_lines(tmp_path):
    state = tmp_path / "x.state"
    state.write_text(f"action_log={tmp_path / 'custom.log'}\n")
    (tmp_path / "custom.log").write_text(
        "1764445000.123 gpu=0 uuid=GPU-a nvmlDeviceSetPersistenceMode mode=1\n"
        "1764445001.000 gpu=3 uuid=GPU-b nvmlDeviceResetApplicationsClocks\n")
    assert simgpu.read_actions(state) == [
        {"time": 1764445000.123, "gpu": 0, "uuid": "GPU-a", "function": "nvmlDeviceSetPersistenceMode", "args": {"mode": 1}},
        {"time": 1764445001.0, "gpu": 3, "uuid": "GPU-b", "function": "nvmlDeviceResetApplicationsClocks", "args": {}},
    ]


def test_state_values_with_newlines_are_refused(tmp_path):
    with pytest.raises(ValueError, match="newlines"):
        simgpu.write_state(tmp_path / "s.state", {"gpus": [{"name": "a\ngpu.0.lost=1"}]})
    assert simgpu.cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
