"""The driver gateway: the only module that imports pynvml.

Reads every GPU into a frozen `GpuSnapshot` (three outcomes per field), performs the few
writes the hooks need, and puts every call under a deadline: a GPU that fell off the bus
can make NVML block, and a hook must never hang a node.

Deadline model: GPUs are read by daemon worker threads, each recording which NVML call it is
in and since when.  The caller waits; a GPU whose current call exceeds `timeout_s` is
abandoned and reported with ``unreachable = "NVML call X timed out after Ns"`` while the
other GPUs are reported normally.  An abandoned thread stays blocked in C; the process
exits regardless (daemon thread), and that GPU is never touched again by this reader.

Workers take GPUs from a shared queue, and their number doubles every `_GROW_S` while GPUs are
still waiting: a slow or hung GPU soon has the others read beside it (up to one worker per
GPU), and a driver that answers in microseconds (most calls, most of the time) is read by one
or two threads.  Eight threads contending for the GIL around every ctypes call cost four
times the reads themselves (measured: 8 simulated GPUs, 22 ms against 5.5 ms read in turn).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import time
import types
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Collection, Deque, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.errors import DriverLibraryMismatch, NvmlUnavailable, NvmlWriteError
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu.deadline import run_with_deadline
from slurm_gpu.gpu.snapshot import GpuSnapshot, MigDevice, NodeSnapshot, NvLink, Process, Reading


def _find_library_when_called(name: str) -> Optional[str]:
    from ctypes.util import find_library  # the real one, imported at the first call
    return find_library(name)


def _load_pynvml() -> Any:
    """nvidia-ml-py, imported without ctypes.util.  pynvml.py does `from ctypes.util import
    find_library` at its top and never calls it on Linux; ctypes.util imports subprocess, shutil
    and tempfile: 10 ms of every prolog and epilog (-X importtime, docs/benchmarks.md).  During this
    one import a stand-in module gives pynvml a find_library that imports the real one when called;
    then the stand-in is gone, and `import ctypes.util` anywhere gets the real module as always.
    A pynvml that wants more of ctypes.util (ImportError) is imported the ordinary way."""
    if "pynvml" in sys.modules or "ctypes.util" in sys.modules:
        import pynvml as loaded
        return loaded
    stand_in = types.ModuleType("ctypes.util")
    stand_in.find_library = _find_library_when_called  # type: ignore[attr-defined]
    sys.modules["ctypes.util"] = stand_in
    try:
        import pynvml as loaded
    except ImportError:
        loaded = None
    finally:
        if sys.modules.get("ctypes.util") is stand_in:
            del sys.modules["ctypes.util"]
    if loaded is None:
        import pynvml as loaded
    return loaded


if TYPE_CHECKING:
    import pynvml
else:
    pynvml = _load_pynvml()

# Errors that mean "this GPU does not offer that reading" rather than "something is wrong".
_UNSUPPORTED_CODES = {
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # older driver without the function
    pynvml.NVML_ERROR_NO_PERMISSION,  # not root, or a restricted container: not a GPU fault
}
# Errors after which nothing more can be read from the GPU.
_FATAL_CODES = {pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_UNKNOWN,
                pynvml.NVML_ERROR_TIMEOUT}
_NO_LINK_CODES = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND,
                  pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
# The v2 memory call is missing or refused on older drivers: then v1 answers.
_V1_FALLBACK_CODES = {pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED,
                      getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25)}
# While GPUs wait in the queue, the workers double every _GROW_S: for n GPUs, all have a worker
# after log2(n) * _GROW_S at the latest.
_GROW_S = 0.005
_MAX_NVLINKS = 18  # NVLink 4 (H100/H200); newer parts expose more, probed until the first missing link
_CPUSET_WORDS = 16  # 1024 CPUs


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _cpus_from_mask(words: Sequence[int]) -> Tuple[int, ...]:
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    return tuple(w_i * bits + b for w_i, w in enumerate(words) for b in range(bits) if (int(w) >> b) & 1)


_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process outside MIG


def _process(x: Any) -> Process:
    def inst(name: str) -> Optional[int]:
        v = getattr(x, name, None)
        return None if v is None or int(v) == _NO_INSTANCE else int(v)
    return Process(int(x.pid), None if x.usedGpuMemory is None else int(x.usedGpuMemory),
                   inst("gpuInstanceId"), inst("computeInstanceId"))


class _GpuLost(Exception):
    """Internal: stop reading a GPU after a fatal error."""


class _GpuReader:
    """Reads one GPU, recording each call so the caller can enforce the deadline."""

    def __init__(self, index: int, ident_only: bool = False, body: Optional[Callable[["_GpuReader"], Any]] = None,
                 inventory: bool = False):
        self.index = index
        self.ident_only = ident_only
        self.inventory = inventory  # also VBIOS, row-remapper histogram, SRAM ECC (not for the prolog)
        self.body = body  # a task other than reading the GPU (writes, process lists, accounting)
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.fields: Dict[str, Any] = {}
        self.current: Optional[str] = None
        self.started = 0.0
        self.done = threading.Event()
        self.unreachable = ""
        self.lock = threading.Lock()

    def call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            self.current, self.started = name, time.monotonic()
        try:
            return fn(*args)
        finally:
            with self.lock:
                self.current = None

    def reading(self, field: str, name: str, fn: Callable[..., Any], *args: Any,
                convert: Callable[[Any], Any] = lambda v: v) -> Reading:
        try:
            r = S.value(convert(self.call(name, fn, *args)))
        except pynvml.NVMLError as e:
            r = self._error(name, e)
        self.fields[field] = r
        return r

    def _error(self, name: str, e: "pynvml.NVMLError") -> Reading:
        code = getattr(e, "value", None)
        if code in _UNSUPPORTED_CODES:
            return S.unsupported(name, str(e))
        if code in _FATAL_CODES:
            self.unreachable = f"{e} ({name})"
            raise _GpuLost()
        return S.failed(name, str(e))

    def run(self) -> None:
        try:
            if self.body is not None:
                self.result = self.body(self)
            else:
                self._read_all()
        except _GpuLost:
            pass
        except (NvmlWriteError, pynvml.NVMLError) as e:
            self.error = e
        except Exception as e:  # a bug or an unexpected binding error must not lose the other GPUs
            self.unreachable = f"unexpected error reading GPU: {type(e).__name__}: {e}"
        finally:
            self.done.set()

    def _read_all(self) -> None:
        p = pynvml
        try:
            h = self.call("nvmlDeviceGetHandleByIndex", p.nvmlDeviceGetHandleByIndex, self.index)
        except p.NVMLError as e:
            self.unreachable = f"{e} (nvmlDeviceGetHandleByIndex)"
            return
        self.handle = h
        self.reading("uuid", "nvmlDeviceGetUUID", p.nvmlDeviceGetUUID, h, convert=_text)
        self.reading("minor_number", "nvmlDeviceGetMinorNumber", p.nvmlDeviceGetMinorNumber, h)
        if self.ident_only:
            # What mapping Slurm's GPU indices needs: the device minor, MIG instances, the name
            # (AutoDetect's Type=) and the bus id (XID lines).
            self._read_bus_id(h)
            self.reading("name", "nvmlDeviceGetName", p.nvmlDeviceGetName, h, convert=_text)
            self._read_mig(h)
            return
        self.reading("name", "nvmlDeviceGetName", p.nvmlDeviceGetName, h, convert=_text)
        self.reading("serial", "nvmlDeviceGetSerial", p.nvmlDeviceGetSerial, h, convert=_text)
        self._read_bus_id(h)
        self._read_usage(h)
        self._read_memory_errors(h)
        if self.inventory:
            self._read_inventory(h)
        self._read_state(h)
        self._read_fabric_and_recovery(h)
        self._read_power_fans_clocks(h)
        self.fields["nvlinks"] = self._nvlinks(h)
        self.reading("processes", "nvmlDeviceGetComputeRunningProcesses", p.nvmlDeviceGetComputeRunningProcesses, h,
                     convert=lambda ps: tuple(_process(x) for x in ps))
        self._read_mig(h)
        self.reading("accounting_mode", "nvmlDeviceGetAccountingMode", p.nvmlDeviceGetAccountingMode, h,
                     convert=lambda v: v == p.NVML_FEATURE_ENABLED)
        self.reading("cpu_affinity", "nvmlDeviceGetCpuAffinity", p.nvmlDeviceGetCpuAffinity, h, _CPUSET_WORDS,
                     convert=_cpus_from_mask)

    def _split(self, reading: Reading, fields: Sequence[str]) -> None:
        """One call's reading as several fields: each part of its value, or the same error."""
        for i, field in enumerate(fields):
            self.fields[field] = S.value(reading.value[i]) if reading.ok else reading

    def _read_bus_id(self, h: Any) -> None:
        self.reading("pci_bus_id", "nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, h,
                     convert=lambda i: _text(i.busId))

    def _read_usage(self, h: Any) -> None:
        """Memory, temperature, power, energy and utilisation."""
        p = pynvml
        mem = self.reading("_mem", "nvmlDeviceGetMemoryInfo", _memory_info, self, h)
        self.fields.pop("_mem")
        self._split(mem, ("memory_total_bytes", "memory_used_bytes"))
        self.reading("temperature_c", "nvmlDeviceGetTemperature", p.nvmlDeviceGetTemperature, h, p.NVML_TEMPERATURE_GPU)
        self.reading("power_draw_mw", "nvmlDeviceGetPowerUsage", p.nvmlDeviceGetPowerUsage, h)
        self.reading("energy_mj", "nvmlDeviceGetTotalEnergyConsumption", p.nvmlDeviceGetTotalEnergyConsumption, h)
        util = self.reading("_util", "nvmlDeviceGetUtilizationRates", p.nvmlDeviceGetUtilizationRates, h,
                            convert=lambda u: (int(u.gpu), int(u.memory)))
        self.fields.pop("_util")
        self._split(util, ("gpu_utilization_pct", "memory_utilization_pct"))

    def _read_memory_errors(self, h: Any) -> None:
        """ECC counters, retired pages and remapped rows."""
        p = pynvml
        for field, etype, ctype in (
            ("ecc_volatile_corrected", p.NVML_MEMORY_ERROR_TYPE_CORRECTED, p.NVML_VOLATILE_ECC),
            ("ecc_volatile_uncorrected", p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, p.NVML_VOLATILE_ECC),
            ("ecc_aggregate_corrected", p.NVML_MEMORY_ERROR_TYPE_CORRECTED, p.NVML_AGGREGATE_ECC),
            ("ecc_aggregate_uncorrected", p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, p.NVML_AGGREGATE_ECC),
        ):
            self.reading(field, "nvmlDeviceGetTotalEccErrors", p.nvmlDeviceGetTotalEccErrors, h, etype, ctype)
        self.reading("retired_pages_sbe", "nvmlDeviceGetRetiredPages", p.nvmlDeviceGetRetiredPages, h,
                     p.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, convert=len)
        self.reading("retired_pages_dbe", "nvmlDeviceGetRetiredPages", p.nvmlDeviceGetRetiredPages, h,
                     p.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, convert=len)
        self.reading("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus",
                     p.nvmlDeviceGetRetiredPagesPendingStatus, h, convert=bool)
        rr = self.reading("_rr", "nvmlDeviceGetRemappedRows", p.nvmlDeviceGetRemappedRows, h,
                          convert=lambda t: (int(t[0]), int(t[1]), bool(int(t[2])), bool(int(t[3]))))
        self.fields.pop("_rr")
        self._split(rr, ("remapped_rows_corrected", "remapped_rows_uncorrected", "remapped_rows_pending",
                         "remapped_rows_failure"))

    def _read_inventory(self, h: Any) -> None:
        """VBIOS, the row-remapper histogram and SRAM ECC counts (aggregate: the RMA criteria count
        a GPU's lifetime).  A pynvml without the function reads as unsupported."""
        p = pynvml
        self._optional("vbios", "nvmlDeviceGetVbiosVersion", h, convert=_text)
        self._optional("remap_histogram", "nvmlDeviceGetRowRemapperHistogram", h,
                       convert=lambda v: S.RemapHistogram(*(int(getattr(v, k)) for k in S.RemapHistogram._fields)))
        sram = getattr(p, "NVML_MEMORY_LOCATION_SRAM", 7)
        for field, etype in (("sram_corrected", p.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                             ("sram_uncorrected", p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            self._optional(field, "nvmlDeviceGetMemoryErrorCounter", h, etype, p.NVML_AGGREGATE_ECC, sram, convert=int)
        self._read_inforom(h)

    def _read_inforom(self, h: Any) -> None:
        """nvmlDeviceValidateInforom checksums the whole InfoROM: not for the prolog.  CORRUPTED_INFOROM
        is the answer (False), not a failed reading."""
        fn = getattr(pynvml, "nvmlDeviceValidateInforom", None)
        if fn is None:
            self.fields["inforom_valid"] = S.unsupported("nvmlDeviceValidateInforom", _absent())
            return
        try:
            self.call("nvmlDeviceValidateInforom", fn, h)
            self.fields["inforom_valid"] = S.value(True)
        except pynvml.NVMLError as e:
            if getattr(e, "value", None) == pynvml.NVML_ERROR_CORRUPTED_INFOROM:
                self.fields["inforom_valid"] = S.value(False)
            else:
                self.fields["inforom_valid"] = self._error("nvmlDeviceValidateInforom", e)

    def _read_fabric_and_recovery(self, h: Any) -> None:
        """The NVSwitch fabric registration and the driver's recovery action (field 230)."""
        p = pynvml
        struct = getattr(p, "c_nvmlGpuFabricInfo_v2_t", None)
        if struct is None or not hasattr(p, "nvmlDeviceGetGpuFabricInfoV"):
            self.fields["fabric"] = S.unsupported("nvmlDeviceGetGpuFabricInfoV", _absent())
        else:
            self.reading("fabric", "nvmlDeviceGetGpuFabricInfoV", _fabric_info, self, h, struct)
        field = getattr(p, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            self.fields["recovery_action"] = S.unsupported("nvmlDeviceGetFieldValues", _absent())
        else:
            self.reading("recovery_action", "nvmlDeviceGetFieldValues", _field_uint, self, h, field)

    def _read_power_fans_clocks(self, h: Any) -> None:
        """Power limits (enforced, default), fans, and the SM clock against its maximum."""
        p = pynvml
        self.reading("power_limit_mw", "nvmlDeviceGetEnforcedPowerLimit", p.nvmlDeviceGetEnforcedPowerLimit, h, convert=int)
        self.reading("power_default_limit_mw", "nvmlDeviceGetPowerManagementDefaultLimit",
                     p.nvmlDeviceGetPowerManagementDefaultLimit, h, convert=int)
        n = self._optional("_fans", "nvmlDeviceGetNumFans", h, convert=int)
        self.fields.pop("_fans")
        self.fields["fans"] = S.value(tuple(self._fan(h, f) for f in range(n.value))) if n.ok else n
        sm = p.NVML_CLOCK_SM
        self.reading("sm_clock_mhz", "nvmlDeviceGetClockInfo", p.nvmlDeviceGetClockInfo, h, sm, convert=int)
        self.reading("sm_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", p.nvmlDeviceGetMaxClockInfo, h, sm, convert=int)

    def _fan(self, h: Any, fan: int) -> S.Fan:
        speed = self._optional("_fan", "nvmlDeviceGetFanSpeed_v2", h, fan, convert=int)
        target = self._optional("_fan", "nvmlDeviceGetTargetFanSpeed", h, fan, convert=int)
        self.fields.pop("_fan")
        return S.Fan(fan, speed, target)

    def _optional(self, field: str, name: str, *args: Any, convert: Callable[[Any], Any] = lambda v: v) -> Reading:
        """A reading through a pynvml function that older nvidia-ml-py releases lack."""
        fn = getattr(pynvml, name, None)
        if fn is None:
            absent = S.unsupported(name, _absent())
            self.fields[field] = absent
            return absent
        return self.reading(field, name, fn, *args, convert=convert)

    def _read_state(self, h: Any) -> None:
        """Clock event reasons, persistence mode, performance state and the PCIe link."""
        p = pynvml
        fn = getattr(p, "nvmlDeviceGetCurrentClocksEventReasons", None) or p.nvmlDeviceGetCurrentClocksThrottleReasons
        self.reading("clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", fn, h, convert=int)
        self.reading("persistence_mode", "nvmlDeviceGetPersistenceMode", p.nvmlDeviceGetPersistenceMode, h,
                     convert=lambda v: v == p.NVML_FEATURE_ENABLED)
        self.reading("performance_state", "nvmlDeviceGetPerformanceState", p.nvmlDeviceGetPerformanceState, h, convert=int)
        self.reading("pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration", p.nvmlDeviceGetCurrPcieLinkGeneration, h)
        self.reading("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", p.nvmlDeviceGetMaxPcieLinkGeneration, h)
        self.reading("pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth", p.nvmlDeviceGetCurrPcieLinkWidth, h)
        self.reading("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", p.nvmlDeviceGetMaxPcieLinkWidth, h)

    def _read_mig(self, h: Any) -> None:
        p = pynvml
        mig = self.reading("_mig", "nvmlDeviceGetMigMode", p.nvmlDeviceGetMigMode, h, convert=lambda t: (bool(t[0]), bool(t[1])))
        self.fields.pop("_mig")
        self.fields["mig_mode_current"] = S.value(mig.value[0]) if mig.ok else mig
        self.fields["mig_mode_pending"] = S.value(mig.value[1]) if mig.ok else mig
        self.fields["mig_devices"] = self._mig_devices(h) if mig.ok and mig.value[0] else (S.value(()) if mig.ok else mig)

    def _nvlinks(self, h: Any) -> Reading:
        p = pynvml
        links: List[NvLink] = []
        for link in range(_MAX_NVLINKS):
            try:
                state = self.call("nvmlDeviceGetNvLinkState", p.nvmlDeviceGetNvLinkState, h, link)
            except p.NVMLError as e:
                if getattr(e, "value", None) in _NO_LINK_CODES:
                    if link == 0:
                        return S.unsupported("nvmlDeviceGetNvLinkState", str(e))
                    break
                links.append(NvLink(link, self._error("nvmlDeviceGetNvLinkState", e), S.unsupported()))
                continue
            try:
                remote = S.value(_text(self.call("nvmlDeviceGetNvLinkRemotePciInfo", p.nvmlDeviceGetNvLinkRemotePciInfo,
                                                 h, link).busId))
            except p.NVMLError as e:
                remote = self._error("nvmlDeviceGetNvLinkRemotePciInfo", e)
            links.append(NvLink(link, S.value(state == p.NVML_FEATURE_ENABLED), remote))
        return S.value(tuple(links))

    def _mig_devices(self, h: Any) -> Reading:
        p = pynvml
        try:
            count = self.call("nvmlDeviceGetMaxMigDeviceCount", p.nvmlDeviceGetMaxMigDeviceCount, h)
        except p.NVMLError as e:
            return self._error("nvmlDeviceGetMaxMigDeviceCount", e)
        devs: List[MigDevice] = []
        for k in range(count):
            try:
                mh = self.call("nvmlDeviceGetMigDeviceHandleByIndex", p.nvmlDeviceGetMigDeviceHandleByIndex, h, k)
            except p.NVMLError as e:
                if getattr(e, "value", None) in (p.NVML_ERROR_NOT_FOUND, p.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                return self._error("nvmlDeviceGetMigDeviceHandleByIndex", e)
            try:
                info = self.call("nvmlDeviceGetMemoryInfo", p.nvmlDeviceGetMemoryInfo, mh)
                mem: Optional[int] = int(info.total)
                used: Optional[int] = int(info.used)
            except p.NVMLError:
                mem = used = None
            try:
                name = _text(self.call("nvmlDeviceGetName", p.nvmlDeviceGetName, mh))
            except p.NVMLError:
                name = ""
            try:
                devs.append(MigDevice(
                    index=k,
                    uuid=_text(self.call("nvmlDeviceGetUUID", p.nvmlDeviceGetUUID, mh)),
                    gpu_instance_id=int(self.call("nvmlDeviceGetGpuInstanceId", p.nvmlDeviceGetGpuInstanceId, mh)),
                    compute_instance_id=int(self.call("nvmlDeviceGetComputeInstanceId", p.nvmlDeviceGetComputeInstanceId, mh)),
                    memory_total_bytes=mem, name=name, memory_used_bytes=used))
            except p.NVMLError as e:
                return self._error("nvmlDeviceGetMigDeviceHandleByIndex", e)
        return S.value(tuple(devs))

    def snapshot(self) -> GpuSnapshot:
        fields = dict(self.fields)  # the thread may still be writing if abandoned
        return GpuSnapshot(index=self.index, unreachable=self.unreachable, **fields)


def _work(queue: "Deque[_GpuReader]") -> None:
    """A worker thread: read GPUs from the queue until it is empty (popleft is atomic)."""
    while True:
        try:
            reader = queue.popleft()
        except IndexError:
            return
        reader.run()


def _run_with_deadline(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """An NVML call under gpu/deadline.py's runner; TimeoutError naming the call when it overruns."""
    return run_with_deadline(fn, timeout_s, f"nvml-{name}", f"NVML call {name} timed out after {timeout_s:g}s")


_LOADED: Dict[str, Any] = {}


def _load_library(path: str) -> None:
    """Load a specific libnvidia-ml.so.1 so that pynvml's CDLL('libnvidia-ml.so.1') reuses it (same SONAME)."""
    if not path or path in _LOADED:
        return
    if not os.path.exists(path):
        raise NvmlUnavailable(f"NVML library {path} does not exist",
                              "fix nvml_library in the config (or --nvml-lib), or leave it empty to use the system driver")
    try:
        _LOADED[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NvmlUnavailable(f"cannot load NVML library {path}: {e}",
                              "point nvml_library at the driver's libnvidia-ml.so.1") from None
    # pynvml loads by SONAME; if it already holds another library, point it at ours.
    if getattr(pynvml, "nvmlLib", None) is not None and getattr(pynvml.nvmlLib, "_name", path) != path:
        cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
        if not isinstance(cache, dict):
            raise NvmlUnavailable(f"this nvidia-ml-py ({_pynvml_version()}) cannot be pointed at {path}: "
                                  "it has no function-pointer cache to reset",
                                  "load the configured library before any other NVML use, or pin nvidia-ml-py 12.x/13.x")
        pynvml.nvmlLib = _LOADED[path]
        cache.clear()


KERNEL_VERSION_FILE = "/proc/driver/nvidia/version"
_VERSION = re.compile(r"(\d+\.\d+(?:\.\d+)?)")


def kernel_module_version(path: str = KERNEL_VERSION_FILE) -> str:
    """The loaded kernel module's version from the first line of /proc/driver/nvidia/version
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..." or "... Open Kernel
    Module for x86_64  550.54.15  Release Build ..."); "" when unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.readline()
    except OSError:
        return ""
    m = re.search(r"Kernel Module(?: for \S+)?\s+" + _VERSION.pattern, line)
    return m.group(1) if m else ""


def library_version(maps: str = "/proc/self/maps") -> str:
    """The version of the NVML library this process loaded, from its file name
    (libnvidia-ml.so.550.54.15, the file libnvidia-ml.so.1 links to); "" when it has none."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libnvidia-ml.so" in line}
    except OSError:
        return ""
    for path in sorted(paths):
        m = re.search(r"libnvidia-ml\.so\." + _VERSION.pattern + "$", os.path.realpath(path))
        if m:
            return m.group(1)
    return ""


_NO_DRIVER_HINT = ("is the NVIDIA driver installed and loaded (nvidia-smi)? For a non-standard install set "
                   "nvml_library in /etc/slurm-gpu/config.toml or pass --nvml-lib PATH")


class NvmlReader:
    """A session with the driver: `snapshot()` for checks, the write methods for hooks."""

    def __init__(self, library: str = "", timeout_s: float = 5.0, version_file: str = KERNEL_VERSION_FILE):
        self.library = library
        self.version_file = version_file  # the kernel module's version (a driver/library mismatch names it)
        self.timeout_s = timeout_s
        self._initialised = False
        self._stuck: Dict[int, str] = {}  # GPUs abandoned because a call hung: never touch them again
        self._handles: Dict[int, Any] = {}

    # -- session ---------------------------------------------------------------------------
    def open(self) -> "NvmlReader":
        if self._initialised:
            return self
        _load_library(self.library)
        try:
            _run_with_deadline(pynvml.nvmlInit, self.timeout_s, "nvmlInit")
        except TimeoutError as e:
            raise NvmlUnavailable(f"{e}: the driver does not answer",
                                  "check dmesg for NVIDIA XID errors; the node may need a reboot") from None
        except pynvml.NVMLError as e:
            code = getattr(e, "value", None)
            if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise NvmlUnavailable("NVML library libnvidia-ml.so.1 not found", _NO_DRIVER_HINT) from None
            if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
                raise DriverLibraryMismatch(kernel_module_version(self.version_file), library_version()) from None
            raise NvmlUnavailable(f"NVML initialisation failed: {e}", _NO_DRIVER_HINT) from None
        self._initialised = True
        return self

    def close(self) -> None:
        if self._initialised and not self._stuck:
            try:
                _run_with_deadline(pynvml.nvmlShutdown, self.timeout_s, "nvmlShutdown")
            except (TimeoutError, pynvml.NVMLError):
                pass
        self._initialised = False

    def __enter__(self) -> "NvmlReader":
        return self.open()

    def __exit__(self, *_: Any) -> None:
        self.close()

    def _node_readings(self) -> Tuple[Reading, Reading, Reading]:
        """Driver version, CUDA driver version and GPU count, in one thread under one deadline."""
        calls = (("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion, _text),
                 ("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion, int),
                 ("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount, int))

        def read_all() -> Tuple[Reading, ...]:
            out = []
            for name, fn, convert in calls:
                try:
                    out.append(S.value(convert(fn())))
                except pynvml.NVMLError as e:
                    code = getattr(e, "value", None)
                    out.append(S.unsupported(name, str(e)) if code in _UNSUPPORTED_CODES else S.failed(name, str(e)))
            return tuple(out)

        try:
            got: Tuple[Reading, Reading, Reading] = _run_with_deadline(read_all, self.timeout_s, "nvmlSystemGetDriverVersion")
            return got
        except TimeoutError as e:
            return tuple(S.failed(name, str(e)) for name, _, _ in calls)  # type: ignore[return-value]

    # -- reads -----------------------------------------------------------------------------
    def identities(self) -> NodeSnapshot:
        """A cheap read of every GPU's UUID, minor number and PCI bus id (to map Slurm's indices)."""
        return self.snapshot(None, ident_only=True)

    def snapshot(self, indices: Optional[Sequence[int]] = None, ident_only: bool = False,
                 inventory: bool = False) -> NodeSnapshot:
        """Read the node; `indices` limits per-GPU reads (node-wide facts are always read).

        `inventory` also reads what only inventories and node checks need (VBIOS, row-remapper
        histogram, SRAM ECC counts); without it those readings are NOT_READ (the prolog)."""
        self.open()
        taken = time.time()
        driver, cuda, count = self._node_readings()
        n = count.value if count.ok else 0
        wanted = sorted(set(range(n) if indices is None else indices))
        readers = self._parallel(wanted, ident_only=ident_only, count=n, inventory=inventory)
        for r in readers:
            h = getattr(r, "handle", None)
            if h is not None and not r.unreachable:
                self._handles[r.index] = h
        gpus = tuple(r.snapshot() for r in readers)
        return NodeSnapshot(hostname=os.uname().nodename.split(".")[0], taken_at=taken, driver_version=driver,
                            cuda_driver_version=cuda, gpu_count=count, gpus=gpus)

    def _parallel(self, indices: Sequence[int], body: Optional[Callable[[_GpuReader], Any]] = None,
                  ident_only: bool = False, count: Optional[int] = None, inventory: bool = False) -> List[_GpuReader]:
        """Read each GPU (or run `body` on it) in worker threads, under the per-call deadline."""
        readers = [_GpuReader(i, ident_only, body, inventory) for i in indices]
        queue: Deque[_GpuReader] = deque()
        for r in readers:
            if r.index in self._stuck:
                r.unreachable = self._stuck[r.index]
                r.done.set()
            elif count is not None and r.index >= count:
                r.unreachable = f"no GPU with index {r.index} (the driver reports {count})"
                r.done.set()
            else:
                queue.append(r)
        self._wait(readers, queue)
        return readers

    def _wait(self, readers: List[_GpuReader], queue: Deque[_GpuReader]) -> None:
        """Until every GPU is done or abandoned: add workers while GPUs wait in the queue, and
        abandon a GPU whose current call is past the deadline."""
        workers = 0
        grow_at = 0.0
        pending = [r for r in readers if not r.done.is_set()]
        while pending:
            now = time.monotonic()
            if queue and now >= grow_at:
                for _ in range(min(len(queue), max(1, workers))):  # doubling
                    threading.Thread(target=_work, args=(queue,), name=f"nvml-worker{workers}", daemon=True).start()
                    workers += 1
                grow_at = now + _GROW_S
            pending, wake = self._abandon_overdue(pending, now)
            if pending:
                if queue:
                    wake = min(wake, grow_at)
                # The last GPU queued is, nearly always, the last one done.
                pending[-1].done.wait(max(0.001, min(wake - time.monotonic(), 0.05)))

    def _abandon_overdue(self, pending: List[_GpuReader], now: float) -> Tuple[List[_GpuReader], float]:
        """(GPUs still being read, when the next of their current calls is due)."""
        due = now + self.timeout_s
        still: List[_GpuReader] = []
        for r in pending:
            if r.done.is_set():
                continue
            with r.lock:
                current, started = r.current, r.started
            if current is not None and now - started >= self.timeout_s:
                msg = f"NVML call {current} timed out after {self.timeout_s:g}s"
                r.unreachable = msg
                self._stuck[r.index] = msg
                continue
            if current is not None:
                due = min(due, started + self.timeout_s)
            still.append(r)
        return still, due

    def _on_gpus(self, indices: Sequence[int], task: Callable[[_GpuReader, Any], Any]) -> Dict[int, Any]:
        """Run task(worker, handle) on each GPU in parallel: {index: result}, or NvmlWriteError for that GPU."""
        self.open()

        def body(w: _GpuReader) -> Any:
            h = self._handles.get(w.index)
            if h is None:
                h = w.call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, w.index)
            return task(w, h)

        out: Dict[int, Any] = {}
        for w in self._parallel(sorted(set(indices)), body):
            if w.unreachable:
                out[w.index] = NvmlWriteError(f"GPU {w.index}: {w.unreachable}",
                                              "the GPU may have fallen off the bus; check dmesg for XID 79")
            elif isinstance(w.error, pynvml.NVMLError):
                out[w.index] = NvmlWriteError(f"GPU {w.index}: {w.current or 'NVML call'} failed: {w.error}",
                                              _write_hint(w.error))
            elif w.error is not None:
                out[w.index] = w.error
            else:
                out[w.index] = w.result
        return out

    # -- per-GPU reads for the hooks --------------------------------------------------------
    def processes_many(self, indices: Sequence[int]) -> Dict[int, Any]:
        """{index: tuple[Process] | NvmlWriteError}: compute processes on each GPU."""
        def task(w: _GpuReader, h: Any) -> Tuple[Process, ...]:
            ps = w.call("nvmlDeviceGetComputeRunningProcesses", pynvml.nvmlDeviceGetComputeRunningProcesses, h)
            return tuple(_process(x) for x in ps)
        return self._on_gpus(indices, task)

    def accounting_many(self, indices: Sequence[int]) -> Dict[int, Any]:
        """{index: Reading[tuple[AccountingRecord]] | NvmlWriteError}: the driver's per-process accounting."""
        def task(w: _GpuReader, h: Any) -> Reading:
            try:
                pids = w.call("nvmlDeviceGetAccountingPids", pynvml.nvmlDeviceGetAccountingPids, h)
                out = []
                for pid in pids:
                    st = w.call("nvmlDeviceGetAccountingStats", _accounting_stats, h, pid)
                    mem = int(st.maxMemoryUsage)
                    out.append(AccountingRecord(int(pid), int(st.gpuUtilization), int(st.memoryUtilization),
                                                None if mem == _NOT_AVAILABLE_U64 else mem, int(st.time),
                                                int(st.startTime), bool(st.isRunning)))
                return S.value(tuple(out))
            except pynvml.NVMLError as e:
                if getattr(e, "value", None) in _UNSUPPORTED_CODES:
                    return S.unsupported("nvmlDeviceGetAccountingPids", str(e))
                return S.failed("nvmlDeviceGetAccountingPids", str(e))
        return self._on_gpus(indices, task)

    # -- writes (strict: a failure is an NvmlWriteError naming the GPU and the NVML error) ---
    def prepare(self, indices: Sequence[int], *, persistence: bool = False, reset_clocks: bool = False,
                accounting: bool = False, power_cap_tolerance_pct: Optional[float] = None,
                in_place: Optional[Mapping[int, Collection[str]]] = None) -> Dict[int, Any]:
        """Put GPUs into a known state, all GPUs in parallel.

        Returns {index: {operation: done} | NvmlWriteError}; done is False when the GPU does
        not support the operation (nothing to reset is not an error).  `in_place` names, per
        GPU, the set-operations whose state a read of this GPU moments ago already showed
        (persistence or accounting on): those are reported done without a driver write.
        """
        p = pynvml
        ops: List[Tuple[str, Callable[..., Any], Tuple[Any, ...]]] = []
        if persistence:
            ops.append(("nvmlDeviceSetPersistenceMode", p.nvmlDeviceSetPersistenceMode, (p.NVML_FEATURE_ENABLED,)))
        if reset_clocks:
            ops += [("nvmlDeviceResetApplicationsClocks", p.nvmlDeviceResetApplicationsClocks, ()),
                    ("nvmlDeviceResetGpuLockedClocks", p.nvmlDeviceResetGpuLockedClocks, ()),
                    ("nvmlDeviceResetMemoryLockedClocks", p.nvmlDeviceResetMemoryLockedClocks, ())]
        if power_cap_tolerance_pct is not None:
            # A limit capped below the board's default goes back to the default (nothing of ours lowers it).
            ops.append(("nvmlDeviceSetPowerManagementLimit", _reset_power_limit, (power_cap_tolerance_pct,)))
        if accounting:
            # Accounting must be on before the job's first process starts; PIDs of earlier
            # jobs would be mistaken for this job's, so they are cleared.
            ops += [("nvmlDeviceSetAccountingMode", p.nvmlDeviceSetAccountingMode, (p.NVML_FEATURE_ENABLED,)),
                    ("nvmlDeviceClearAccountingPids", p.nvmlDeviceClearAccountingPids, ())]

        def task(w: _GpuReader, h: Any) -> Dict[str, bool]:
            done: Dict[str, bool] = {}
            shown = in_place.get(w.index, ()) if in_place else ()
            for name, fn, args in ops:
                if name in shown and name in _SET_ONLY_IF_OFF:
                    done[name] = True
                    continue
                if name == "nvmlDeviceClearAccountingPids" and not done.get("nvmlDeviceSetAccountingMode"):
                    continue
                try:
                    w.call(name, fn, h, *args)
                    done[name] = True
                except p.NVMLError as e:
                    if getattr(e, "value", None) in (p.NVML_ERROR_NOT_SUPPORTED, p.NVML_ERROR_FUNCTION_NOT_FOUND):
                        done[name] = False
                        continue
                    raise NvmlWriteError(f"GPU {w.index}: {name} failed: {e}", _write_hint(e)) from None
            return done
        return self._on_gpus(indices, task)

    def is_stuck(self, index: int) -> bool:
        return index in self._stuck


_NOT_AVAILABLE_U64 = 2**64 - 1
# Writes that only turn a mode on: with the mode already on (read just before), they change nothing.
# The clock and power resets and the clearing of accounting PIDs are done every time.
_SET_ONLY_IF_OFF = frozenset({"nvmlDeviceSetPersistenceMode", "nvmlDeviceSetAccountingMode"})


def _pynvml_version() -> str:
    try:
        from importlib.metadata import version
        return "nvidia-ml-py " + version("nvidia-ml-py")
    except Exception:
        return "unknown version"


def _reset_power_limit(h: Any, tolerance_pct: float) -> bool:
    """Set the enforced power limit back to the default when it is capped beyond the tolerance; True when set."""
    p = pynvml
    limit, default = int(p.nvmlDeviceGetEnforcedPowerLimit(h)), int(p.nvmlDeviceGetPowerManagementDefaultLimit(h))
    if limit >= default * (1 - tolerance_pct / 100.0):
        return False
    p.nvmlDeviceSetPowerManagementLimit(h, default)
    return True


def _absent() -> str:
    return f"not in this nvidia-ml-py ({_pynvml_version()})"


def _fabric_info(w: "_GpuReader", h: Any, struct: type) -> S.FabricInfo:
    """nvmlDeviceGetGpuFabricInfoV with the v2 struct (its version field set by its constructor)."""
    info = struct()
    w.call("nvmlDeviceGetGpuFabricInfoV", pynvml.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))
    return S.FabricInfo(int(info.state), int(info.status), int(info.cliqueId), int(info.healthMask),
                        bytes(info.clusterUuid).hex())


def _field_uint(w: "_GpuReader", h: Any, field: int) -> int:
    """One field through nvmlDeviceGetFieldValues; the entry's own return code raises as an NVMLError."""
    v = w.call("nvmlDeviceGetFieldValues", pynvml.nvmlDeviceGetFieldValues, h, [field])[0]
    if int(v.nvmlReturn) != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(int(v.nvmlReturn))
    return int(v.value.uiVal)


def _accounting_stats(handle: Any, pid: int) -> Any:
    """nvmlDeviceGetAccountingStats without pynvml's wrapper, which raises TypeError (not an
    NVMLError) when the driver reports maxMemoryUsage as not available (2**64-1).

    That takes pynvml's private function lookup; a release without it gets the public
    wrapper, whose TypeError then means "max memory not available"."""
    get_fn = getattr(pynvml, "_nvmlGetFunctionPointer", None)
    struct = getattr(pynvml, "c_nvmlAccountingStats_t", None)
    if get_fn is None or struct is None:
        try:
            return pynvml.nvmlDeviceGetAccountingStats(handle, pid)
        except TypeError:
            return _NoMaxMemory()
    st = struct()
    fn = get_fn("nvmlDeviceGetAccountingStats")
    ret = fn(handle, ctypes.c_uint(pid), ctypes.byref(st))
    if ret != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(ret)
    return st


class _NoMaxMemory:
    """Accounting stats whose peak memory the driver does not know (public-wrapper fallback)."""

    def __init__(self) -> None:
        self.gpuUtilization = self.memoryUtilization = self.time = self.startTime = self.isRunning = 0
        self.maxMemoryUsage = _NOT_AVAILABLE_U64


def _memory_info(w: "_GpuReader", h: Any) -> Tuple[int, int]:
    """(total, used) bytes.  Drivers >= 515 count memory they reserve for themselves as "used"
    in the v1 call: a GPU nobody uses would look like leaked memory, so v2 comes first."""
    p = pynvml
    v2 = getattr(p, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            m = w.call("nvmlDeviceGetMemoryInfo_v2", p.nvmlDeviceGetMemoryInfo, h, v2)
            return int(m.total), int(m.used)
        except p.NVMLError as e:
            if getattr(e, "value", None) not in _V1_FALLBACK_CODES:
                raise
        except TypeError:  # a release whose nvmlDeviceGetMemoryInfo takes no version
            pass
    m = w.call("nvmlDeviceGetMemoryInfo", p.nvmlDeviceGetMemoryInfo, h)
    return int(m.total), int(m.used)


def _write_hint(e: Exception) -> str:
    code = getattr(e, "value", None)
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return "GPU settings need root: run the hook as root (slurmd does)"
    if code in _FATAL_CODES:
        return "the GPU needs a reset or the node a reboot; drain it and check dmesg"
    return "see `slurm-gpu check` for the GPU's state"


class AccountingRecord(NamedTuple):
    """One process as the driver's accounting saw it (kept after the process exits)."""

    pid: int
    gpu_utilization_pct: int  # mean over the process lifetime (driver-sampled)
    memory_utilization_pct: int
    max_memory_bytes: Optional[int]  # None: the driver does not know
    time_ms: int  # process run time
    start_time_us: int  # unix epoch, microseconds
    is_running: bool
