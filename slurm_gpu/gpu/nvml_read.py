"""One GPU read through NVML: every reading of a GPU's snapshot, the process lists and the driver's accounting.

`OneGpuReader` reads one GPU (or runs a task on it) in a worker thread of gpu/nvml.py's pool,
recording which NVML call it is in and since when, so that the pool can enforce the per-call
deadline.  Each reading keeps the three outcomes apart: a value, unsupported on this GPU, failed;
an error after which nothing more can be read ends the GPU's reading (`unreachable`).

pynvml is gpu/nvml.py's, the only module that imports it (`_load_pynvml`): it hands the module
over with `bind()` when it is imported, so this module is used through gpu/nvml.py.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from slurm_gpu.errors import NvmlWriteError
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu.snapshot import GpuSnapshot, MigDevice, NvLink, Process, Reading

# nvidia-ml-py, set by bind() from gpu/nvml.py.
pynvml: Any = None
# Errors that mean "this GPU does not offer that reading" rather than "something is wrong".
UNSUPPORTED_CODES: Set[int] = set()
# Errors after which nothing more can be read from the GPU.
FATAL_CODES: Set[int] = set()
_NO_LINK_CODES: Set[int] = set()
# The v2 memory call is missing or refused on older drivers: then v1 answers.
_V1_FALLBACK_CODES: Set[int] = set()
_MAX_NVLINKS = 18  # NVLink 4 (H100/H200); newer parts expose more, probed until the first missing link
_CPUSET_WORDS = 16  # 1024 CPUs


def bind(module: Any) -> None:
    """Read through `module`, the pynvml that gpu/nvml.py imported; the error-code sets are filled
    in place (gpu/nvml.py imports them)."""
    global pynvml
    pynvml = p = module
    UNSUPPORTED_CODES.update({
        p.NVML_ERROR_NOT_SUPPORTED,
        p.NVML_ERROR_FUNCTION_NOT_FOUND,  # older driver without the function
        p.NVML_ERROR_NO_PERMISSION,  # not root, or a restricted container: not a GPU fault
    })
    FATAL_CODES.update({p.NVML_ERROR_GPU_IS_LOST, p.NVML_ERROR_RESET_REQUIRED, p.NVML_ERROR_UNKNOWN, p.NVML_ERROR_TIMEOUT})
    _NO_LINK_CODES.update({p.NVML_ERROR_NOT_SUPPORTED, p.NVML_ERROR_INVALID_ARGUMENT, p.NVML_ERROR_NOT_FOUND,
                           p.NVML_ERROR_FUNCTION_NOT_FOUND})
    _V1_FALLBACK_CODES.update({p.NVML_ERROR_FUNCTION_NOT_FOUND, p.NVML_ERROR_NOT_SUPPORTED,
                               getattr(p, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25)})


def as_text(v: Any) -> str:
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


class OneGpuReader:
    """Reads one GPU, recording each call so the caller can enforce the deadline."""

    def __init__(self, index: int, ident_only: bool = False, body: Optional[Callable[[OneGpuReader], Any]] = None,
                 inventory: bool = False, usage_only: bool = False):
        self.index = index
        self.ident_only = ident_only
        self.usage_only = usage_only  # identity, memory, power, energy, utilisation and MIG slices (efficiency samples)
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
                convert: Callable[[Any], Any] = lambda v: v) -> Reading[Any]:
        try:
            r = S.value(convert(self.call(name, fn, *args)))
        except pynvml.NVMLError as e:
            r = self._error(name, e)
        self.fields[field] = r
        return r

    def _error(self, name: str, e: Exception) -> Reading[Any]:
        code = getattr(e, "value", None)
        if code in UNSUPPORTED_CODES:
            return S.unsupported(name, str(e))
        if code in FATAL_CODES:
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
        self.reading("uuid", "nvmlDeviceGetUUID", p.nvmlDeviceGetUUID, h, convert=as_text)
        self.reading("minor_number", "nvmlDeviceGetMinorNumber", p.nvmlDeviceGetMinorNumber, h)
        if self.ident_only:
            # What mapping Slurm's GPU indices needs: the device minor, MIG instances, the name
            # (AutoDetect's Type=) and the bus id (XID lines).
            self._read_bus_id(h)
            self.reading("name", "nvmlDeviceGetName", p.nvmlDeviceGetName, h, convert=as_text)
            self._read_mig(h)
            return
        self.reading("name", "nvmlDeviceGetName", p.nvmlDeviceGetName, h, convert=as_text)
        if self.usage_only:
            self._read_usage(h)
            self._read_mig(h)
            return
        self.reading("serial", "nvmlDeviceGetSerial", p.nvmlDeviceGetSerial, h, convert=as_text)
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

    def _split(self, reading: Reading[Any], fields: Sequence[str]) -> None:
        """One call's reading as several fields: each part of its value, or the same error."""
        for i, field in enumerate(fields):
            self.fields[field] = S.value(reading.value[i]) if reading.ok else reading

    def _read_bus_id(self, h: Any) -> None:
        self.reading("pci_bus_id", "nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, h,
                     convert=lambda i: as_text(i.busId))

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
        self._optional("vbios", "nvmlDeviceGetVbiosVersion", h, convert=as_text)
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

    def _optional(self, field: str, name: str, *args: Any, convert: Callable[[Any], Any] = lambda v: v) -> Reading[Any]:
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

    def _nvlinks(self, h: Any) -> Reading[Tuple[S.NvLink, ...]]:
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
                remote = S.value(as_text(self.call("nvmlDeviceGetNvLinkRemotePciInfo", p.nvmlDeviceGetNvLinkRemotePciInfo,
                                                 h, link).busId))
            except p.NVMLError as e:
                remote = self._error("nvmlDeviceGetNvLinkRemotePciInfo", e)
            links.append(NvLink(link, S.value(state == p.NVML_FEATURE_ENABLED), remote))
        return S.value(tuple(links))

    def _mig_devices(self, h: Any) -> Reading[Tuple[S.MigDevice, ...]]:
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
                name = as_text(self.call("nvmlDeviceGetName", p.nvmlDeviceGetName, mh))
            except p.NVMLError:
                name = ""
            try:
                devs.append(MigDevice(
                    index=k,
                    uuid=as_text(self.call("nvmlDeviceGetUUID", p.nvmlDeviceGetUUID, mh)),
                    gpu_instance_id=int(self.call("nvmlDeviceGetGpuInstanceId", p.nvmlDeviceGetGpuInstanceId, mh)),
                    compute_instance_id=int(self.call("nvmlDeviceGetComputeInstanceId", p.nvmlDeviceGetComputeInstanceId, mh)),
                    memory_total_bytes=mem, name=name, memory_used_bytes=used))
            except p.NVMLError as e:
                return self._error("nvmlDeviceGetMigDeviceHandleByIndex", e)
        return S.value(tuple(devs))

    def snapshot(self) -> GpuSnapshot:
        fields = dict(self.fields)  # the thread may still be writing if abandoned
        return GpuSnapshot(index=self.index, unreachable=self.unreachable, **fields)


def pynvml_version() -> str:
    try:
        from importlib.metadata import version
        return "nvidia-ml-py " + version("nvidia-ml-py")
    except Exception:
        return "unknown version"


def _absent() -> str:
    return f"not in this nvidia-ml-py ({pynvml_version()})"


def _fabric_info(w: OneGpuReader, h: Any, struct: type) -> S.FabricInfo:
    """nvmlDeviceGetGpuFabricInfoV with the v2 struct (its version field set by its constructor)."""
    info = struct()
    w.call("nvmlDeviceGetGpuFabricInfoV", pynvml.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))
    return S.FabricInfo(int(info.state), int(info.status), int(info.cliqueId), int(info.healthMask),
                        bytes(info.clusterUuid).hex())


def _field_uint(w: OneGpuReader, h: Any, field: int) -> int:
    """One field through nvmlDeviceGetFieldValues; the entry's own return code raises as an NVMLError."""
    v = w.call("nvmlDeviceGetFieldValues", pynvml.nvmlDeviceGetFieldValues, h, [field])[0]
    if int(v.nvmlReturn) != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(int(v.nvmlReturn))
    return int(v.value.uiVal)


def _memory_info(w: OneGpuReader, h: Any) -> Tuple[int, int]:
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


# -- processes and the driver's accounting (NvmlReader.processes_many, accounting_many) ----------------


class AccountingRecord(NamedTuple):
    """One process as the driver's accounting saw it (kept after the process exits)."""

    pid: int
    gpu_utilization_pct: int  # mean over the process lifetime (driver-sampled)
    memory_utilization_pct: int
    max_memory_bytes: Optional[int]  # None: the driver does not know
    time_ms: int  # process run time
    start_time_us: int  # unix epoch, microseconds
    is_running: bool


_NOT_AVAILABLE_U64 = 2**64 - 1


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


def running_processes(w: OneGpuReader, h: Any) -> Tuple[Process, ...]:
    """The compute processes on a GPU (NvmlReader.processes_many's task)."""
    ps = w.call("nvmlDeviceGetComputeRunningProcesses", pynvml.nvmlDeviceGetComputeRunningProcesses, h)
    return tuple(_process(x) for x in ps)


def accounting_records(w: OneGpuReader, h: Any) -> Reading[Tuple[AccountingRecord, ...]]:
    """Reading[tuple[AccountingRecord]]: a GPU's per-process accounting (NvmlReader.accounting_many's task)."""
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
        if getattr(e, "value", None) in UNSUPPORTED_CODES:
            return S.unsupported("nvmlDeviceGetAccountingPids", str(e))
        return S.failed("nvmlDeviceGetAccountingPids", str(e))
