"""A node's inventory taken on the node: from a GPU snapshot, the CPU topology in sysfs and the
driver's nvidia-caps MIG minors (what `slurm-gpu inventory` writes; the model and the file
format: gres/inventory.py)."""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot, Reading, cuda_version
from slurm_gpu.gres.inventory import (
    MIG_PROFILE,
    Inventory,
    InventoryError,
    InvGpu,
    InvMig,
    format_cpulist,
    normalise_bus_id,
    parse_cpulist,
)
from slurm_gpu.store.observations import gpu_state


def read_cpu_topology(sysfs_cpu_dir: str) -> Optional[Dict[int, int]]:
    """Map each online CPU id to Slurm's abstract core id, from /sys/devices/system/cpu.

    Cores are the sets of hyper-thread siblings; they are numbered by socket, then by their
    lowest CPU id, as Slurm (via hwloc's logical order) numbers them.  None when the
    topology cannot be read (containers without sysfs): callers fall back to CPU ids.
    """
    try:
        entries = os.listdir(sysfs_cpu_dir)
    except OSError:
        return None
    cores: Dict[Tuple[int, Tuple[int, ...]], None] = {}
    for e in entries:
        if not re.fullmatch(r"cpu\d+", e):
            continue
        topo = os.path.join(sysfs_cpu_dir, e, "topology")
        try:
            with open(os.path.join(topo, "physical_package_id")) as f:
                pkg = int(f.read().strip())
            with open(os.path.join(topo, "thread_siblings_list")) as f:
                siblings = parse_cpulist(f.read())
        except (OSError, ValueError):
            continue  # offline CPUs have no topology directory
        cores[(pkg, siblings)] = None
    if not cores:
        return None
    mapping: Dict[int, int] = {}
    for core_id, (_, siblings) in enumerate(sorted(cores, key=lambda k: (k[0], k[1][0] if k[1] else -1))):
        for cpu in siblings:
            mapping[cpu] = core_id
    return mapping


def read_mig_minors(path: str) -> Dict[str, int]:
    """Parse /proc/driver/nvidia-caps/mig-minors: 'gpu0/gi1/ci0/access 22' lines."""
    out: Dict[str, int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].isdigit():
                raise InventoryError(f"{path}:{lineno}: expected '<name> <minor>', got {line.strip()!r}",
                                     "is this the driver's /proc/driver/nvidia-caps/mig-minors? (gres.mig_minors_path)")
            out[parts[0]] = int(parts[1])
    return out


def _need(gpu: GpuSnapshot, field: str, hostname: str) -> Any:
    r: Reading[Any] = getattr(gpu, field)
    if r.ok and r.value is not None:
        return r.value
    what = "is not supported by the driver" if r.unsupported else f"could not be read ({r.describe()})"
    raise InventoryError(f"node {hostname}: {gpu.label}: {field} {what}",
                         "run `slurm-gpu check` on this node; gres.conf needs every GPU's name, minor number and PCI bus id")


def _opt_text(r: Reading[Any]) -> Optional[str]:
    return str(r.value) if r.ok and r.value is not None else None


def inventory_from_snapshot(snap: NodeSnapshot, hostname: Optional[str] = None,
                            cpu_to_core: Optional[Mapping[int, int]] = None,
                            mig_minors: Optional[Mapping[str, int]] = None,
                            mig_minors_path: str = "/proc/driver/nvidia-caps/mig-minors",
                            state: bool = False, warn: Callable[[str], None] = lambda text: None) -> Inventory:
    """Keep the static facts of a snapshot (with `state`, also its counters and time).
    `cpu_to_core` None: CPU ids are taken as core ids; warn() hears of offline CPUs left out."""
    host = hostname or snap.hostname
    gpus: List[InvGpu] = []
    for g in snap.gpus:
        if g.unreachable:
            raise InventoryError(f"node {host}: {g.label} is unreachable: {g.unreachable}",
                                 "a GPU that cannot be read cannot go into gres.conf; fix or drain the node first")
        minor = int(_need(g, "minor_number", host))
        name = str(_need(g, "name", host))
        bus = normalise_bus_id(str(_need(g, "pci_bus_id", host)))
        uuid = str(g.uuid.get("") or "")
        if g.cpu_affinity.failed:
            _need(g, "cpu_affinity", host)
        cpus = tuple(sorted(g.cpu_affinity.get(()) or ()))
        cores = _cores(g, host, cpus, cpu_to_core, warn)
        peers = _nvlink_peers(g, host)
        mig_on = bool(g.mig_mode_current.get(False))
        migs: List[InvMig] = []
        if mig_on:
            devs = _need(g, "mig_devices", host)
            if not devs:
                raise InventoryError(f"node {host}: {g.label}: MIG mode is enabled but no MIG devices exist",
                                     "create MIG instances (nvidia-smi mig -cgi ... -C) or disable MIG mode")
            if mig_minors is None:
                mig_minors = _read_mig_minors_of(host, mig_minors_path)
            migs = [_mig(host, g, minor, m, mig_minors, mig_minors_path) for m in devs]
        gpus.append(InvGpu(g.index, minor, uuid, name, bus, cpus, cores, peers, mig_on, tuple(migs),
                           _opt_text(g.serial), _opt_text(g.vbios), gpu_state(g) if state else None))
    return Inventory(host, tuple(sorted(gpus, key=lambda x: x.index)), "", _opt_text(snap.driver_version),
                     cuda_version(snap.cuda_driver_version), snap.taken_at if state else None)


def _cores(g: GpuSnapshot, host: str, cpus: Tuple[int, ...], cpu_to_core: Optional[Mapping[int, int]],
           warn: Callable[[str], None]) -> Tuple[int, ...]:
    """The Slurm core ids of a GPU's CPU affinity (the CPU ids themselves without a map).  CPUs
    that are offline (SMT switched off: NVML still lists the second threads) are left out, with
    a warning; an affinity with no online CPU at all is refused."""
    if cpu_to_core is None:
        return cpus
    offline = [c for c in cpus if c not in cpu_to_core]
    if offline and len(offline) == len(cpus):
        raise InventoryError(f"node {host}: {g.label}: no CPU of its affinity ({format_cpulist(cpus)}) is online",
                             "check /sys/devices/system/cpu (gres.cpu_topology_dir)")
    if offline:
        warn(f"node {host}: {g.label}: CPUs {format_cpulist(offline)} of its affinity are offline; "
             "Cores= lists the online ones")
    return tuple(sorted({cpu_to_core[c] for c in cpus if c in cpu_to_core}))


def _nvlink_peers(g: GpuSnapshot, host: str) -> Tuple[Tuple[str, int], ...]:
    """(peer PCI bus id, active NvLinks to it), sorted; an NvLink that cannot be read is an error."""
    peers: Dict[str, int] = {}
    if g.nvlinks.failed:
        _need(g, "nvlinks", host)
    for link in g.nvlinks.get(()) or ():
        if link.active.failed or (link.active.get(False) and link.remote_bus_id.failed):
            raise InventoryError(f"node {host}: {g.label}: NvLink {link.link} could not be read "
                                 f"({(link.active if link.active.failed else link.remote_bus_id).describe()})",
                                 "run `slurm-gpu check` on this node; Links= would be wrong without it")
        if link.active.get(False):
            rb = normalise_bus_id(str(link.remote_bus_id.get("")))
            peers[rb] = peers.get(rb, 0) + 1
    return tuple(sorted(peers.items()))


def _read_mig_minors_of(host: str, path: str) -> Mapping[str, int]:
    try:
        return read_mig_minors(path)
    except OSError as e:
        raise InventoryError(f"node {host}: cannot read {path}: {e.strerror}",
                             "MIG device files need the nvidia-caps minors; set gres.mig_minors_path") from None


def _mig(host: str, g: GpuSnapshot, minor: int, m: Any, minors: Mapping[str, int], path: str) -> InvMig:
    pm = MIG_PROFILE.search(m.name or "")
    if not pm:
        raise InventoryError(f"node {host}: {g.label}: MIG device {m.index} has no profile in its name ({m.name!r})",
                             "expected an NVML name like 'NVIDIA A100-SXM4-40GB MIG 3g.20gb'")
    gi_key = f"gpu{minor}/gi{m.gpu_instance_id}/access"
    ci_key = f"gpu{minor}/gi{m.gpu_instance_id}/ci{m.compute_instance_id}/access"
    for key in (gi_key, ci_key):
        if key not in minors:
            raise InventoryError(f"node {host}: {g.label}: MIG device {m.index}: no '{key}' in {path}",
                                 "the driver lists every GPU/compute instance there; is gres.mig_minors_path right?")
    mem = getattr(m, "memory_total_bytes", None)
    return InvMig(m.index, m.uuid, m.name, pm.group(0).lower(), int(m.gpu_instance_id),
                  int(m.compute_instance_id), minors[gi_key], minors[ci_key],
                  int(mem) >> 20 if mem is not None else None)
