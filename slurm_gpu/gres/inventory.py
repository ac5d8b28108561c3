"""A node's GPU facts, as `slurm-gpu inventory` writes them (taken on the node by gres/collect.py) and
`slurm-gpu fleet` (without a central server) read them.

An inventory holds what does not change while the node runs: GPU names, serials, VBIOS and
driver/CUDA versions, device minor numbers, PCI bus ids, CPU affinity (and the Slurm core ids
it maps to), NvLink peers and MIG devices with their nvidia-caps minors.  No readings, no
times: two runs on the same node give the same file, and two nodes with the same hardware give
files that differ only in hostname, UUIDs, serials and versions (``hardware_facts``, what
gres.conf depends on, leaves those out).  ``slurm-gpu inventory --state`` adds the GPUs' memory
health counters and when they were read (``collected_at``): what `slurm-gpu fleet` reads from a
directory of inventories when there is no central server.

Format ``slurm-gpu-inventory/2`` (``/1`` files, without the versions, serials and state, are
still read)::

    {"format": "slurm-gpu-inventory/2", "hostname": "gpu001",
     "driver_version": "550.54.15", "cuda_version": "12.4",
     "collected_at": 1718000000.0,                                  # --state only
     "gpus": [{"index": 0, "minor": 0, "uuid": "GPU-...", "serial": "1654922000001",
               "name": "NVIDIA H100 80GB HBM3", "vbios": "96.00.74.00.0D",
               "pci_bus_id": "00000000:18:00.0", "cpu_affinity": "0-47,96-143", "cores": "0-47",
               "nvlink_peers": {"00000000:2a:00.0": 2}, "mig_enabled": false, "mig_devices": [],
               "state": {"mig_mode": 0, "ecc_corrected_volatile": 0, ..., "remap_hist_none": 0,
                         "sram_corrected": 0, "sram_uncorrected": 0}}]}  # --state only

On a node whose driver refuses NVML with a driver/library mismatch (nvmlInit:
LIB_RM_VERSION_MISMATCH, a driver update without a reboot), `slurm-gpu inventory` still writes
the file, with no GPUs, the time and both versions (null where unknown), then fails::

    {"format": "slurm-gpu-inventory/2", "hostname": "gpu001", "driver_version": null,
     "cuda_version": null, "collected_at": 1718000000.0, "gpus": [],
     "driver_library_mismatch": {"kernel_version": "535.104.05", "library_version": "550.54.15"}}

`slurm-gpu fleet` lists such a node; `gres-conf` refuses it (it has no GPUs to describe).

Versions, serial and VBIOS are always written, null where the driver does not report them.
The keys of ``state`` are the gpu_inventory columns from ``mig_mode`` to ``sram_uncorrected``
(store/schema.py INVENTORY_STATE); a null counter was unsupported or unreadable, never 0.
CPU lists use the kernel's cpulist syntax ("0-3,8").  ``cores`` are Slurm's abstract core
ids (core 0 = first core of the first socket; hyper-thread siblings share one id), which
is what gres.conf ``Cores=`` wants; ``cpu_affinity`` keeps the raw CPU ids NVML reported.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.slurm.hostlist import RangeError, parse_index_ranges
from slurm_gpu.store.schema import INVENTORY_STATE

FORMAT = "slurm-gpu-inventory/2"
READABLE_FORMATS = ("slurm-gpu-inventory/1", FORMAT)
MAX_FILE_BYTES = 16 << 20  # an inventory of 8 GPUs, every one in MIG mode, is about 20 KiB
# "3g.20gb", compute-instance profiles "1c.3g.20gb", extensions "1g.10gb+me", "1g.24gb+me.all"
MIG_PROFILE = re.compile(r"(?:\d+c\.)?\d+g\.\d+gb(?:\+[a-z0-9.+]+)?", re.IGNORECASE)


class InventoryError(InputError):
    """A malformed inventory file or a node whose GPUs cannot be inventoried."""


# --- cpu lists -----------------------------------------------------------------------------

# The highest CPU id a list may name, checked before a range is expanded: Linux builds for at most
# 8,192 CPUs (NR_CPUS), Slurm's core bitmaps are sized by the node.  A typo like 0-99999999999 would
# otherwise be expanded (12.9 GB, issue 39).
MAX_CPU_ID = (1 << 16) - 1


@functools.lru_cache(maxsize=4096)  # a cluster repeats a handful of CPU lists thousands of times
def parse_cpulist(text: str) -> Tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8), sorted.  Raises ValueError naming the bad part.

    Parsed by slurm/hostlist.parse_index_ranges, the one parser of index-range lists, with every
    id bounded by MAX_CPU_ID before anything is expanded."""
    try:
        return tuple(sorted(parse_index_ranges(text, max_value=MAX_CPU_ID)))
    except RangeError as e:
        if e.kind == "backwards":
            raise ValueError(f"CPU range {e.item!r} runs backwards") from None
        if e.kind == "too-large":
            shown = e.value if len(e.value) <= 24 else e.value[:20] + "..."
            raise ValueError(f"CPU id {shown} in {e.item[:60]!r} is over {MAX_CPU_ID}: no node has that many "
                             "CPUs") from None
        raise ValueError(f"bad CPU list item {e.item!r} (expected N or N-M)") from None


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8'."""
    return _format_cpulist(tuple(cpus))


@functools.lru_cache(maxsize=4096)
def _format_cpulist(cpus: Tuple[int, ...]) -> str:
    vals = sorted(set(cpus))
    parts: List[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(parts)


# --- the model -----------------------------------------------------------------------------

@dataclass(frozen=True)
class InvMig:
    index: int
    uuid: str
    name: str  # NVML name of the MIG device, e.g. "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    profile: str  # "3g.20gb", "1c.3g.20gb", "1g.10gb+me": the profile in the NVML name
    gpu_instance_id: int
    compute_instance_id: int
    gi_cap_minor: int  # /dev/nvidia-caps/nvidia-cap<gi_cap_minor>
    ci_cap_minor: int
    # The instance's memory in MiB as NVML reports it (its memory-info total, which public
    # nvidia-smi outputs show equal to the profile's memorySizeMB); Slurm up to 23.02.5 names
    # MIG types from it.  None in inventories written before slurm-gpu kept it.
    memory_mib: Optional[int] = None


@dataclass(frozen=True)
class InvGpu:
    index: int
    minor: int  # /dev/nvidia<minor>
    uuid: str
    name: str
    pci_bus_id: str  # normalised: lower case, 8-digit domain
    cpu_affinity: Tuple[int, ...]
    cores: Tuple[int, ...]
    nvlink_peers: Tuple[Tuple[str, int], ...]  # (remote PCI bus id, active link count), sorted
    mig_enabled: bool = False
    mig_devices: Tuple[InvMig, ...] = ()
    serial: Optional[str] = None  # None: not reported (v1 file, unsupported)
    vbios: Optional[str] = None
    # --state: {INVENTORY_STATE column: count or None}; None: no state in the file
    state: Optional[Dict[str, Optional[int]]] = _field(default=None, hash=False)


@dataclass(frozen=True)
class Inventory:
    hostname: str
    gpus: Tuple[InvGpu, ...]
    source: str = ""  # file it was read from, for messages
    driver_version: Optional[str] = None  # None: not reported (v1 file, unreadable)
    cuda_version: Optional[str] = None  # "12.4"
    collected_at: Optional[float] = None  # unix time the state was read (--state); None without state
    format: str = _field(default=FORMAT, compare=False)  # of the file it was read from
    # (kernel module, NVML library) versions, "" where unknown, when nvmlInit refused with a mismatch
    driver_library_mismatch: Optional[Tuple[str, str]] = None

    def devices(self) -> Tuple[InvGpu, ...]:
        """GPUs in Slurm's device order: sorted by PCI bus id (gres.conf Links= positions)."""
        return tuple(sorted(self.gpus, key=lambda g: (g.pci_bus_id, g.index)))

    def links(self, gpu: InvGpu) -> Tuple[int, ...]:
        """Direct NvLink count to every GPU of the node in device order, -1 for itself.

        Links to anything that is not a GPU of this node (an NVSwitch) are not counted: that
        is what Slurm's AutoDetect=nvml does, and through a switch every GPU is equally near.
        """
        return self._links(gpu, self.devices())

    @staticmethod
    def _links(gpu: InvGpu, devices: Tuple[InvGpu, ...]) -> Tuple[int, ...]:
        peers = dict(gpu.nvlink_peers)
        return tuple(-1 if d is gpu else peers.get(d.pci_bus_id, 0) for d in devices)

    def switch_links(self, gpu: InvGpu) -> int:
        gpu_ids = {d.pci_bus_id for d in self.gpus}
        return sum(n for bus, n in gpu.nvlink_peers if bus not in gpu_ids)

    def hardware_facts(self) -> List[Dict[str, Any]]:
        """What must be equal for two nodes to share gres.conf lines: no uuid/hostname/bus ids, and
        no versions, serials, VBIOS or state (a firmware update does not change gres.conf)."""
        facts = []
        devices = self.devices()
        for d in devices:
            facts.append({
                "name": d.name,
                "minor": d.minor,
                "cores": format_cpulist(d.cores),
                "links": ",".join(str(x) for x in self._links(d, devices)),
                "mig_enabled": d.mig_enabled,
                "mig_devices": [
                    {"profile": m.profile, "name": m.name, "memory_mib": m.memory_mib, "gpu_instance_id": m.gpu_instance_id,
                     "compute_instance_id": m.compute_instance_id, "gi_cap_minor": m.gi_cap_minor,
                     "ci_cap_minor": m.ci_cap_minor}
                    for m in d.mig_devices
                ],
            })
        return facts


# --- PCI bus ids ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=65536)
def normalise_bus_id(bus_id: str) -> str:
    """'0000:18:00.0' and '00000000:18:00.0' name the same device; NVML uses both forms."""
    b = bus_id.strip().lower()
    dom, sep, rest = b.partition(":")
    if sep and rest.count(":") == 1 and len(dom) < 8:
        b = dom.zfill(8) + ":" + rest
    return b


# --- JSON ----------------------------------------------------------------------------------

def to_json(inv: Inventory) -> Dict[str, Any]:
    out: Dict[str, Any] = {"format": FORMAT, "hostname": inv.hostname, "driver_version": inv.driver_version,
                           "cuda_version": inv.cuda_version}
    if inv.collected_at is not None:
        out["collected_at"] = inv.collected_at
    out["gpus"] = [_gpu_to_json(g) for g in inv.gpus]
    if inv.driver_library_mismatch is not None:
        kernel, library = inv.driver_library_mismatch
        out["driver_library_mismatch"] = {"kernel_version": kernel or None, "library_version": library or None}
    return out


def mismatch_inventory(hostname: str, kernel_version: str, library_version: str, now: float) -> Inventory:
    """The inventory of a node whose driver refused NVML with a driver/library mismatch."""
    return Inventory(hostname, (), "", None, None, now, driver_library_mismatch=(kernel_version, library_version))


def _gpu_to_json(g: InvGpu) -> Dict[str, Any]:
    out = {
        "index": g.index, "minor": g.minor, "uuid": g.uuid, "serial": g.serial, "name": g.name, "vbios": g.vbios,
        "pci_bus_id": g.pci_bus_id, "cpu_affinity": format_cpulist(g.cpu_affinity), "cores": format_cpulist(g.cores),
        "nvlink_peers": dict(g.nvlink_peers), "mig_enabled": g.mig_enabled,
        "mig_devices": [
            dict({"index": m.index, "uuid": m.uuid, "name": m.name, "profile": m.profile},
                 **({"memory_mib": m.memory_mib} if m.memory_mib is not None else {}),
                 gpu_instance_id=m.gpu_instance_id, compute_instance_id=m.compute_instance_id,
                 gi_cap_minor=m.gi_cap_minor, ci_cap_minor=m.ci_cap_minor)
            for m in g.mig_devices
        ],
    }
    if g.state is not None:
        out["state"] = {k: g.state.get(k) for k in INVENTORY_STATE}
    return out


def dumps(inv: Inventory) -> str:
    return json.dumps(to_json(inv), indent=2) + "\n"


class _Reader:
    """Field access that turns every shape error into 'file (node X): gpus[3].minor: ...'."""

    def __init__(self, source: str):
        self.source = source
        self.node = "?"

    def fail(self, field: str, problem: str) -> InventoryError:
        return InventoryError(f"inventory {self.source} (node {self.node}): {field}: {problem}",
                              "regenerate it with `slurm-gpu inventory --output FILE` on that node")

    def get(self, obj: Mapping[str, Any], key: str, field: str, kind: type, default: Any = ...) -> Any:
        if key not in obj:
            if default is not ...:
                return default
            raise self.fail(field, "missing")
        v = obj[key]
        if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise self.fail(field, f"expected a non-negative integer, got {v!r}")
        if kind is not int and not isinstance(v, kind):
            raise self.fail(field, f"expected {kind.__name__}, got {v!r}")
        return v

    def optional(self, obj: Mapping[str, Any], key: str, field: str, kind: type) -> Any:
        """A value that may be missing or null (None then)."""
        return None if obj.get(key) is None else self.get(obj, key, field, kind)

    def cpus(self, obj: Mapping[str, Any], key: str, field: str) -> Tuple[int, ...]:
        v = self.get(obj, key, field, str, "")
        try:
            return parse_cpulist(v)
        except ValueError as e:
            raise self.fail(field, str(e)) from None


def from_json(d: Any, source: str = "<inventory>") -> Inventory:
    r = _Reader(source)
    if not isinstance(d, dict):
        raise r.fail("(top level)", "expected a JSON object")
    if isinstance(d.get("hostname"), str) and d["hostname"]:
        r.node = d["hostname"]
    if d.get("format") not in READABLE_FORMATS:
        raise r.fail("format", f"expected {' or '.join(map(repr, READABLE_FORMATS))}, got {d.get('format')!r}")
    host = r.get(d, "hostname", "hostname", str)
    if not host or any(c in host for c in "[],= \t\n#"):
        raise r.fail("hostname", f"not a usable Slurm node name: {host!r}")
    raw_gpus = r.get(d, "gpus", "gpus", list)
    gpus = [_gpu_from_json(r, g, f"gpus[{i}]") for i, g in enumerate(raw_gpus)]
    _check_unique(r, gpus, "index", lambda g: g.index)
    _check_unique(r, gpus, "minor", lambda g: g.minor)
    _check_unique(r, gpus, "pci_bus_id", lambda g: g.pci_bus_id)
    collected = d.get("collected_at")
    if collected is not None and (isinstance(collected, bool) or not isinstance(collected, (int, float))):
        raise r.fail("collected_at", f"expected unix seconds, got {collected!r}")
    return Inventory(host, tuple(sorted(gpus, key=lambda g: g.index)), source,
                     r.optional(d, "driver_version", "driver_version", str),
                     r.optional(d, "cuda_version", "cuda_version", str),
                     None if collected is None else float(collected), d["format"], _mismatch_from_json(r, d))


def _mismatch_from_json(r: _Reader, d: Mapping[str, Any]) -> Optional[Tuple[str, str]]:
    m = r.optional(d, "driver_library_mismatch", "driver_library_mismatch", dict)
    if m is None:
        return None
    f = "driver_library_mismatch."
    return (r.optional(m, "kernel_version", f + "kernel_version", str) or "",
            r.optional(m, "library_version", f + "library_version", str) or "")


def _gpu_from_json(r: _Reader, g: Any, f: str) -> InvGpu:
    """One entry of "gpus" (f: its place, gpus[i], for the error messages)."""
    if not isinstance(g, dict):
        raise r.fail(f, "expected an object")
    peers_raw = r.get(g, "nvlink_peers", f + ".nvlink_peers", dict, {})
    peers = []
    for bus, n in peers_raw.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise r.fail(f"{f}.nvlink_peers[{bus!r}]", f"expected a link count, got {n!r}")
        peers.append((normalise_bus_id(bus), n))
    migs = [_mig_from_json(r, m, f"{f}.mig_devices[{j}]")
            for j, m in enumerate(r.get(g, "mig_devices", f + ".mig_devices", list, []))]
    mig_enabled = r.get(g, "mig_enabled", f + ".mig_enabled", bool, bool(migs))
    if mig_enabled and not migs:
        raise r.fail(f + ".mig_devices", "MIG is enabled but no MIG devices are listed")
    name = r.get(g, "name", f + ".name", str)
    if not name.strip():
        raise r.fail(f + ".name", "empty")
    bus = r.get(g, "pci_bus_id", f + ".pci_bus_id", str)
    if not re.fullmatch(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]", bus.strip()):
        raise r.fail(f + ".pci_bus_id", f"expected 'DDDDDDDD:BB:DD.F', got {bus!r}")
    return InvGpu(
        r.get(g, "index", f + ".index", int), r.get(g, "minor", f + ".minor", int),
        r.get(g, "uuid", f + ".uuid", str, ""), name, normalise_bus_id(bus),
        r.cpus(g, "cpu_affinity", f + ".cpu_affinity"), r.cpus(g, "cores", f + ".cores"),
        tuple(sorted(peers)), mig_enabled, tuple(migs), r.optional(g, "serial", f + ".serial", str),
        r.optional(g, "vbios", f + ".vbios", str), _state_from_json(r, g.get("state"), f + ".state"))


def _state_from_json(r: _Reader, st: Any, f: str) -> Optional[Dict[str, Optional[int]]]:
    """A GPU's "state" (--state): exactly the INVENTORY_STATE keys, each a count or null."""
    if st is None:
        return None
    if not isinstance(st, dict):
        raise r.fail(f, "expected an object")
    unknown = sorted(set(st) - set(INVENTORY_STATE))
    if unknown:
        raise r.fail(f"{f}.{unknown[0]}", f"unknown counter (known: {', '.join(INVENTORY_STATE)})")
    return {k: r.optional(st, k, f"{f}.{k}", int) for k in INVENTORY_STATE}


def _mig_from_json(r: _Reader, m: Any, mf: str) -> InvMig:
    """One entry of a GPU's "mig_devices" (mf: its place, for the error messages)."""
    if not isinstance(m, dict):
        raise r.fail(mf, "expected an object")
    profile = r.get(m, "profile", mf + ".profile", str)
    if not MIG_PROFILE.fullmatch(profile):
        raise r.fail(mf + ".profile", f"expected '[<c>c.]<slices>g.<memory>gb[+ext]', got {profile!r}")
    mig_name = r.get(m, "name", mf + ".name", str, "")
    in_name = MIG_PROFILE.search(mig_name)
    if in_name and in_name.group(0).lower() != profile.lower():
        # inventories before 1c./+me profiles were kept whole stored "3g.20gb" for them
        profile = in_name.group(0).lower()
    return InvMig(
        r.get(m, "index", mf + ".index", int), r.get(m, "uuid", mf + ".uuid", str, ""),
        mig_name, profile,
        r.get(m, "gpu_instance_id", mf + ".gpu_instance_id", int),
        r.get(m, "compute_instance_id", mf + ".compute_instance_id", int),
        r.get(m, "gi_cap_minor", mf + ".gi_cap_minor", int), r.get(m, "ci_cap_minor", mf + ".ci_cap_minor", int),
        r.get(m, "memory_mib", mf + ".memory_mib", int, None))


def _check_unique(r: _Reader, gpus: Sequence[InvGpu], field: str, key: Any) -> None:
    seen: Dict[Any, int] = {}
    for i, g in enumerate(gpus):
        k = key(g)
        if k in seen:
            raise r.fail(f"gpus[{i}].{field}", f"{k!r} repeats gpus[{seen[k]}].{field}")
        seen[k] = i


def read_file(path: str) -> bytes:
    """An inventory file's bytes: never through a symlink, never waiting on a FIFO, only a
    regular file and at most MAX_FILE_BYTES (a file of a directory of many must not hang,
    or exhaust, the command that reads them all)."""
    regenerate = "regenerate it with `slurm-gpu inventory --output FILE` on that node"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InventoryError(f"inventory {path}: a symbolic link (not followed)",
                                 "copy the inventory itself there, not a link") from None
        raise InventoryError(f"inventory {path}: cannot be read: {e.strerror}", "check the path and its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InventoryError(f"inventory {path}: not a regular file", regenerate)
        chunks: List[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
            size += len(b)
        raise InventoryError(f"inventory {path}: larger than {MAX_FILE_BYTES >> 20} MiB, which no inventory is", regenerate)
    except OSError as e:
        raise InventoryError(f"inventory {path}: cannot be read: {e.strerror}", "check the path and its permissions") from None
    finally:
        os.close(fd)


def load(path: str) -> Inventory:
    raw = read_file(path)
    regenerate = "regenerate it with `slurm-gpu inventory --output FILE` on that node"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InventoryError(f"inventory {path} (node ?): not valid JSON: {e}", regenerate) from None
    except RecursionError:
        raise InventoryError(f"inventory {path} (node ?): not valid JSON: nested too deeply", regenerate) from None
    return from_json(data, path)


def inventory_paths(args: Sequence[str]) -> List[str]:
    """Files named, plus every *.json directly inside directories named (sorted)."""
    out: List[str] = []
    for a in args:
        if os.path.isdir(a):
            names = sorted(n for n in os.listdir(a) if n.endswith(".json") and not n.startswith("."))
            if not names:
                raise InventoryError(f"inventory directory {a} holds no *.json files",
                                     "collect `slurm-gpu inventory --output DIR/$(hostname -s).json` from each node")
            out.extend(os.path.join(a, n) for n in names)
        elif os.path.exists(a):
            out.append(a)
        else:
            raise InventoryError(f"inventory {a} does not exist", "pass a directory of inventories or inventory files")
    return out


def load_all(args: Sequence[str]) -> List[Inventory]:
    invs = [load(p) for p in inventory_paths(args)]
    seen: Dict[str, str] = {}
    for inv in invs:
        if inv.driver_library_mismatch is not None:
            kernel, library = inv.driver_library_mismatch
            raise InventoryError(f"inventory {inv.source} (node {inv.hostname}): written while the driver refused NVML "
                                 f"(driver/library mismatch: kernel module {kernel or 'unknown'}, NVML library "
                                 f"{library or 'unknown'}): it lists no GPUs for gres.conf",
                                 "reboot the node (or reload the nvidia module), then write its inventory again")
        if inv.hostname in seen:
            raise InventoryError(f"node {inv.hostname} appears in two inventories: {seen[inv.hostname]} and {inv.source}",
                                 "keep one inventory per node")
        seen[inv.hostname] = inv.source
    return invs
