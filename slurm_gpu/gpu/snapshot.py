"""The typed GPU/node model every layer shares.

gpu/nvml.py produces it, policy/health.py judges it, hooks/records.py records it,
gres/inventory.py renders it and `slurm-gpu snapshot` serialises it.  Every hardware reading
keeps one of three distinct outcomes: a value, *unsupported on this GPU*, or *failed* with an
NVML error.  There is no magic "N/A" number anywhere.  The few readings only inventories and
node checks need (VBIOS, row-remapper histogram, SRAM ECC, the InfoROM check) are not read by the prolog: until
read they hold NOT_READ, an unsupported reading that checks pass over in silence.

The records are NamedTuples, not dataclasses: the prolog imports this module on every job
start, and a dataclass costs ~1.5 ms to create (plus `dataclasses` itself, which imports
`inspect`).  Being tuples, they compare equal to plain tuples of the same values; nothing
relies on that, and each has its own ``to_json`` (json.dumps would write a list).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Generic, NamedTuple, Optional, Tuple, TypeVar, Union, overload

OK = "ok"
UNSUPPORTED = "unsupported"
FAILED = "failed"


T = TypeVar("T", covariant=True)  # read-only: a Reading[bool] is a Reading[int]
D = TypeVar("D")
V = TypeVar("V")


class Reading(NamedTuple, Generic[T]):
    """One hardware reading: status is OK (value set), UNSUPPORTED or FAILED (error set).

    Typed by what it holds (``Reading[int]``, ``Reading[Tuple[Process, ...]]``): `value` is that
    type when the status is OK, and None otherwise (read it after `ok`, or through `get`)."""

    status: str
    value: T = None  # type: ignore[assignment]  # None unless OK: the one place that says so
    error: str = ""  # NVML error text, e.g. "GPU is lost"
    function: str = ""  # the NVML function that produced the error

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def unsupported(self) -> bool:
        return self.status == UNSUPPORTED

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @overload
    def get(self) -> Optional[T]: ...

    @overload
    def get(self, default: D) -> Union[T, D]: ...

    def get(self, default: Any = None) -> Any:
        return self.value if self.status == OK else default

    def describe(self) -> str:
        if self.status == OK:
            return str(self.value)
        if self.status == UNSUPPORTED:
            return "n/a"
        return f"error: {self.function} {self.error}".replace("  ", " ").strip()

    def to_json(self) -> Dict[str, Any]:
        if self.status == OK:
            v: Any = self.value
            if hasattr(v, "to_json"):
                v = v.to_json()
            elif isinstance(v, tuple):
                v = [x.to_json() if hasattr(x, "to_json") else x for x in v]
            return {"status": OK, "value": v}
        return {"status": self.status, "error": self.error, "function": self.function}


def value(v: V) -> Reading[V]:
    return Reading(OK, v)


def unsupported(function: str = "", error: str = "Not Supported") -> Reading[Any]:
    return Reading(UNSUPPORTED, None, error, function)


def failed(function: str, error: str) -> Reading[Any]:
    return Reading(FAILED, None, error, function)


# Default of every reading until the driver answers: one shared immutable value (cheaper to
# build than 40 default factories, which matters on the prolog's start-up path).
_NA: Reading[Any] = Reading(UNSUPPORTED)
# Default of the readings only a full read takes (NvmlReader.snapshot(inventory=True): VBIOS,
# row-remapper histogram, SRAM ECC): the prolog does not read them, and a check of a reading
# that was not taken says nothing, where an unsupported one SKIPs.
NOT_READ: Reading[Any] = Reading(UNSUPPORTED, None, "not read")


def was_read(r: Reading[Any]) -> bool:
    return r != NOT_READ


def cuda_version(r: Reading[int]) -> Optional[str]:
    """NVML's CUDA driver version 12040 -> "12.4" (what nvidia-smi prints); None when unknown."""
    if not r.ok or r.value is None:
        return None
    v = int(r.value)
    return f"{v // 1000}.{(v % 1000) // 10}"


class RemapHistogram(NamedTuple):
    """nvmlDeviceGetRowRemapperHistogram: how many DRAM banks have all (max), most (high), some
    (partial), few (low) or no (none) spare rows left.  A bank with none cannot remap a row."""

    max: int
    high: int
    partial: int
    low: int
    none: int

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


class FabricInfo(NamedTuple):
    """nvmlDeviceGetGpuFabricInfoV: the GPU's registration with the NVSwitch fabric."""

    state: int  # FABRIC_STATE_*: 0 not supported, 1 not started, 2 in progress, 3 completed
    status: int  # NVML return code of the registration (0: success)
    clique_id: int
    health_mask: int
    cluster_uuid: str = ""  # hex; all zeros when the fabric manager assigned none

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


FABRIC_STATE_NOT_SUPPORTED, FABRIC_STATE_NOT_STARTED, FABRIC_STATE_IN_PROGRESS, FABRIC_STATE_COMPLETED = 0, 1, 2, 3
FABRIC_STATE_NAMES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h, nvmlDeviceGpuRecoveryAction_t).
RECOVERY_ACTION_NAMES = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset",
                         5: "recover IMEX domain", 6: "bus reset", 7: "system reboot"}


class Fan(NamedTuple):
    fan: int
    speed_pct: Reading[int]  # nvmlDeviceGetFanSpeed_v2, percent of the fan's maximum
    target_pct: Reading[int]  # nvmlDeviceGetTargetFanSpeed

    def to_json(self) -> Dict[str, Any]:
        return {"fan": self.fan, "speed_pct": self.speed_pct.to_json(), "target_pct": self.target_pct.to_json()}


class Process(NamedTuple):
    pid: int
    used_memory_bytes: Optional[int]  # None: the driver does not expose it (MIG, no permission)
    gpu_instance_id: Optional[int] = None  # the MIG GPU instance it runs in; None outside MIG
    compute_instance_id: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return {"pid": self.pid, "used_memory_bytes": self.used_memory_bytes,
                "gpu_instance_id": self.gpu_instance_id, "compute_instance_id": self.compute_instance_id}


class NvLink(NamedTuple):
    link: int
    active: Reading[bool]
    remote_bus_id: Reading[str]  # PCI bus id of the peer

    def to_json(self) -> Dict[str, Any]:
        return {"link": self.link, "active": self.active.to_json(), "remote_bus_id": self.remote_bus_id.to_json()}


class MigDevice(NamedTuple):
    index: int  # type: ignore[assignment]  # a field named like tuple's method
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_total_bytes: Optional[int]
    name: str = ""
    memory_used_bytes: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


class GpuSnapshot(NamedTuple):
    """Everything we read about one GPU at one moment."""

    index: int  # type: ignore[assignment]  # NVML index == node-wide ordinal used by SLURM_JOB_GPUS
    minor_number: Reading[int] = _NA  # int, /dev/nvidia<minor>
    uuid: Reading[str] = _NA  # str "GPU-..."
    name: Reading[str] = _NA  # str
    serial: Reading[str] = _NA  # str
    vbios: Reading[str] = NOT_READ  # str, e.g. "96.00.74.00.0D" (inventory reads only)
    pci_bus_id: Reading[str] = _NA  # str "00000000:18:00.0"
    memory_total_bytes: Reading[int] = _NA
    memory_used_bytes: Reading[int] = _NA
    temperature_c: Reading[int] = _NA
    power_draw_mw: Reading[int] = _NA
    energy_mj: Reading[int] = _NA  # since driver load
    gpu_utilization_pct: Reading[int] = _NA
    memory_utilization_pct: Reading[int] = _NA
    ecc_volatile_corrected: Reading[int] = _NA
    ecc_volatile_uncorrected: Reading[int] = _NA
    ecc_aggregate_corrected: Reading[int] = _NA
    ecc_aggregate_uncorrected: Reading[int] = _NA
    retired_pages_sbe: Reading[int] = _NA  # count
    retired_pages_dbe: Reading[int] = _NA  # count
    retired_pages_pending: Reading[bool] = _NA  # bool
    remapped_rows_corrected: Reading[int] = _NA
    remapped_rows_uncorrected: Reading[int] = _NA
    remapped_rows_pending: Reading[bool] = _NA  # bool
    remapped_rows_failure: Reading[bool] = _NA  # bool
    remap_histogram: Reading[RemapHistogram] = NOT_READ  # RemapHistogram (inventory reads only)
    sram_corrected: Reading[int] = NOT_READ  # SRAM ECC count, aggregate (lifetime) (inventory reads only)
    sram_uncorrected: Reading[int] = NOT_READ
    clock_event_reasons: Reading[int] = _NA  # bitmask int
    persistence_mode: Reading[bool] = _NA  # bool
    performance_state: Reading[int] = _NA  # int, P0 = 0
    pcie_gen_current: Reading[int] = _NA
    pcie_gen_max: Reading[int] = _NA
    pcie_width_current: Reading[int] = _NA
    pcie_width_max: Reading[int] = _NA
    nvlinks: Reading[Tuple[NvLink, ...]] = _NA  # tuple[NvLink]
    processes: Reading[Tuple[Process, ...]] = _NA  # tuple[Process]
    mig_mode_current: Reading[bool] = _NA  # bool
    mig_mode_pending: Reading[bool] = _NA  # bool
    mig_devices: Reading[Tuple[MigDevice, ...]] = _NA  # tuple[MigDevice]
    accounting_mode: Reading[bool] = _NA  # bool
    cpu_affinity: Reading[Tuple[int, ...]] = _NA  # tuple[int] CPU ids
    fabric: Reading[FabricInfo] = _NA  # FabricInfo (NVSwitch systems; state 0 elsewhere)
    recovery_action: Reading[int] = _NA  # int, RECOVERY_ACTION_NAMES (field 230)
    power_limit_mw: Reading[int] = _NA  # int, the enforced power limit
    power_default_limit_mw: Reading[int] = _NA  # int, the board's default power limit
    fans: Reading[Tuple[Fan, ...]] = _NA  # tuple[Fan]; () on a passively cooled board
    sm_clock_mhz: Reading[int] = _NA  # int, current SM clock
    sm_clock_max_mhz: Reading[int] = _NA  # int
    inforom_valid: Reading[bool] = NOT_READ  # bool (nvmlDeviceValidateInforom; inventory reads only)
    # Set when the GPU could not be reached at all (no handle, lost, hung):
    unreachable: str = ""

    @property
    def label(self) -> str:
        """Human label for messages and drain reasons: 'GPU 3 (GPU-8f2c1a2b…)'."""
        u = self.uuid.get()
        if u:
            return f"GPU {self.index} ({u[:12]}…)" if len(u) > 12 else f"GPU {self.index} ({u})"
        return f"GPU {self.index}"

    @property
    def uuid_or_index(self) -> str:
        return self.uuid.get() or f"index-{self.index}"

    def readings(self) -> Dict[str, Reading[Any]]:
        return {name: r for name, r in zip(self._fields, self) if isinstance(r, Reading)}

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"index": self.index}
        for name, r in self.readings().items():
            out[name] = r.to_json()
        out["unreachable"] = self.unreachable
        return out


class NodeSnapshot(NamedTuple):
    hostname: str
    taken_at: float  # unix time
    driver_version: Reading[str] = _NA
    cuda_driver_version: Reading[int] = _NA  # int, e.g. 12040
    gpu_count: Reading[int] = _NA
    gpus: Tuple[GpuSnapshot, ...] = ()

    def gpu(self, index: int) -> Optional[GpuSnapshot]:
        for g in self.gpus:
            if g.index == index:
                return g
        return None

    def gpu_at(self, index: int) -> GpuSnapshot:
        """The GPU a job's mapping was built from this snapshot names: there by construction."""
        g = self.gpu(index)
        if g is None:
            raise LookupError(f"GPU {index} is not in the snapshot (GPUs {[x.index for x in self.gpus]})")
        return g

    def to_json(self) -> Dict[str, Any]:
        return {
            "format": "slurm-gpu-snapshot/1",
            "hostname": self.hostname,
            "taken_at": self.taken_at,
            "driver_version": self.driver_version.to_json(),
            "cuda_driver_version": self.cuda_driver_version.to_json(),
            "gpu_count": self.gpu_count.to_json(),
            "gpus": [g.to_json() for g in self.gpus],
        }

    def dumps(self) -> str:
        import json  # lazily: the hooks never print a snapshot
        return json.dumps(self.to_json(), indent=2, sort_keys=False)


# --- deserialisation (for `check --snapshot FILE` and inventories) ---------------------

class SnapshotFormatError(ValueError):
    pass


def _reading_from(obj: Any, name: str, kind: Optional[type] = None) -> Reading[Any]:
    if not isinstance(obj, dict) or "status" not in obj:
        raise SnapshotFormatError(f"field {name!r}: expected an object with 'status'")
    st = obj["status"]
    if st == OK:
        v = obj.get("value")
        if kind is not None and v is not None:
            v = kind(v)
        return Reading(OK, v)
    if st in (UNSUPPORTED, FAILED):
        return Reading(st, None, str(obj.get("error", "")), str(obj.get("function", "")))
    raise SnapshotFormatError(f"field {name!r}: unknown status {st!r}")


_TUPLE_FIELDS: Dict[str, Callable[[Any], Any]] = {
    "nvlinks": lambda items: tuple(
        NvLink(int(i["link"]), _reading_from(i["active"], "nvlinks.active"),
               _reading_from(i["remote_bus_id"], "nvlinks.remote_bus_id"))
        for i in items
    ),
    "processes": lambda items: tuple(Process(int(i["pid"]), i.get("used_memory_bytes"), i.get("gpu_instance_id"),
                                             i.get("compute_instance_id")) for i in items),
    "mig_devices": lambda items: tuple(MigDevice(**i) for i in items),
    "cpu_affinity": lambda items: tuple(int(i) for i in items),
    "fabric": lambda v: FabricInfo(**v),
    "fans": lambda items: tuple(Fan(int(i["fan"]), _reading_from(i["speed_pct"], "fans.speed_pct"),
                                    _reading_from(i["target_pct"], "fans.target_pct")) for i in items),
    "remap_histogram": lambda v: RemapHistogram(**v) if isinstance(v, dict) else RemapHistogram(*v),
}


def gpu_from_json(d: Dict[str, Any]) -> GpuSnapshot:
    if not isinstance(d, dict) or "index" not in d:
        raise SnapshotFormatError("gpu entry without 'index'")
    kwargs: Dict[str, Any] = {"index": int(d["index"]), "unreachable": str(d.get("unreachable", ""))}
    for name in GpuSnapshot._fields:
        if name in ("index", "unreachable") or name not in d:
            continue
        r = _reading_from(d[name], name)
        if r.ok and name in _TUPLE_FIELDS:
            try:
                r = Reading(OK, _TUPLE_FIELDS[name](r.value if r.value is not None else []))
            except (KeyError, TypeError, ValueError) as e:
                raise SnapshotFormatError(f"field {name!r}: {e}") from None
        kwargs[name] = r
    return GpuSnapshot(**kwargs)


def node_from_json(d: Dict[str, Any]) -> NodeSnapshot:
    if not isinstance(d, dict) or not str(d.get("format", "")).startswith("slurm-gpu-snapshot/"):
        raise SnapshotFormatError("not a slurm-gpu snapshot (missing 'format': 'slurm-gpu-snapshot/1')")
    return NodeSnapshot(
        hostname=str(d.get("hostname", "")),
        taken_at=float(d.get("taken_at", 0.0)),
        driver_version=_reading_from(d.get("driver_version", {"status": UNSUPPORTED}), "driver_version"),
        cuda_driver_version=_reading_from(d.get("cuda_driver_version", {"status": UNSUPPORTED}), "cuda_driver_version"),
        gpu_count=_reading_from(d.get("gpu_count", {"status": UNSUPPORTED}), "gpu_count"),
        gpus=tuple(gpu_from_json(g) for g in d.get("gpus", [])),
    )
