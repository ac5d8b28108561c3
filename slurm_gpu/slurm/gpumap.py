"""Slurm's GPU index -> device file -> the GPU (or MIG instance) NVML sees.

``SLURM_JOB_GPUS`` holds node-wide GRES indices.  They are positions in slurmd's list of the
node's GPU GRES records (slurm/conf.py has the observed rule), not NVML indices and not device
minors.  A record names a device file; the GPU is the one whose ``nvmlDeviceGetMinorNumber``
is that file's minor — never an enumeration position, so a GPU missing from the driver is a
FAIL naming it instead of a shifted mapping onto another job's GPU.  A MIG record also names
nvidia-caps files; the driver's mig-minors file turns the compute-instance cap into
(GPU, GPU instance, compute instance).  On a GPU the job holds only MIG slices of, the job's
snapshot and XIDs are scoped to those slices (scope_to_instances, scope_xids).

Standard library only (hook path).
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import InputError
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu import xid
from slurm_gpu.gpu.snapshot import NodeSnapshot
from slurm_gpu.slurm import conf as slurmconf
from slurm_gpu.slurm.conf import GresConfigError, GresRecord


class MissingGpu(InputError):
    """A GPU the job was given is not there (or not readable): a node fault, never fail-open."""


class JobGpu(NamedTuple):
    slurm_index: int  # the index in SLURM_JOB_GPUS
    nvml_index: int
    device: str  # /dev/nvidia<minor>
    mig: Any = None  # snapshot.MigDevice the job was given; None: the whole GPU


class JobGpuMap(NamedTuple):
    gpus: Tuple[JobGpu, ...]
    source: str  # where the numbering came from: a gres.conf path, "autodetect" or "minor order"
    configured: Optional[int]  # physical GPUs Slurm configured on this node (None: unknown)

    @property
    def nvml_indices(self) -> List[int]:
        return sorted({g.nvml_index for g in self.gpus})

    def instances(self) -> Dict[int, FrozenSet[int]]:
        """{nvml index: GPU instance ids the job holds} for GPUs the job holds only slices of."""
        out: Dict[int, Set[int]] = {}
        for g in self.gpus:
            if g.mig is not None:
                out.setdefault(g.nvml_index, set()).add(int(g.mig.gpu_instance_id))
        return {i: frozenset(s) for i, s in out.items()}


def _gpu_by_minor(ident: Any) -> Tuple[Dict[int, Any], List[str]]:
    """{minor: GpuSnapshot} and the problems of GPUs whose minor could not be read."""
    by_minor: Dict[int, Any] = {}
    problems: List[str] = []
    for g in ident.gpus:
        if g.unreachable:
            problems.append(f"{g.label}: {g.unreachable}")
        elif g.minor_number.ok:
            by_minor[int(g.minor_number.value)] = g
        else:
            problems.append(f"{g.label}: minor number unreadable: {g.minor_number.error}")
    return by_minor, problems


def _records(cfg: Config, slurm_conf: str, node: str, ident: Any) -> Tuple[List[GresRecord], str]:
    records, autodetect = slurmconf.node_gres_records(slurm_conf, node)
    if not autodetect:
        gres_conf = slurm_conf.rsplit("/", 1)[0] + "/gres.conf" if "/" in slurm_conf else "gres.conf"
        return records, gres_conf
    detected: List[Tuple[str, Tuple[str, ...]]] = []
    minors = _mig_minors(cfg, ident)
    caps_of = {v: k for k, v in minors.items()}
    for g in ident.gpus:
        if not g.minor_number.ok:
            raise MissingGpu(f"{g.label}: minor number unreadable ({g.minor_number.error or g.unreachable})",
                             "with AutoDetect=nvml every GPU must answer; check nvidia-smi and dmesg")
        minor, dev = int(g.minor_number.value), f"/dev/nvidia{int(g.minor_number.value)}"
        migs = g.mig_devices.get(()) if g.mig_mode_current.get(False) else ()
        if not migs:
            detected.append((slurmconf.autodetect_type(g.name.get("") or ""), (dev,)))
        for m in migs:
            gi = caps_of.get((minor, m.gpu_instance_id, None))
            ci = caps_of.get((minor, m.gpu_instance_id, m.compute_instance_id))
            files = (dev, f"/dev/nvidia-caps/nvidia-cap{gi}", f"/dev/nvidia-caps/nvidia-cap{ci}")
            detected.append((slurmconf.autodetect_type(m.name or ""), files))
    return slurmconf.autodetect_records(slurm_conf, node, detected), "autodetect"


def _mig_minors(cfg: Config, ident: Any) -> Dict[int, Tuple[int, int, Optional[int]]]:
    if not any(g.mig_mode_current.get(False) for g in ident.gpus):
        return {}
    path = cfg.gres.mig_minors_path
    try:
        return slurmconf.read_mig_minors(path)
    except GresConfigError as e:
        raise GresConfigError(e.message, "MIG slices are mapped through the driver's mig-minors file "
                              "(gres.mig_minors_path)") from None


def _minor_order(ident: Any) -> List[GresRecord]:
    """The fallback without Slurm's configuration: the k-th GPU by device minor."""
    by_minor, _ = _gpu_by_minor(ident)
    return [GresRecord(k, "", (f"/dev/nvidia{m}",), "minor order") for k, m in enumerate(sorted(by_minor))]


def _mig_device(rec: GresRecord, g: Any, minors: Dict[int, Tuple[int, int, Optional[int]]], slurm_index: int) -> Any:
    where = f"Slurm GPU {slurm_index} ({','.join(rec.files)}, {rec.origin})"
    ci_cap = rec.caps_minors[-1]
    owner = minors.get(ci_cap)
    if owner is None or owner[2] is None:
        raise MissingGpu(f"{where}: nvidia-cap{ci_cap} is not a compute instance in the driver's mig-minors",
                         "MIG instances changed since gres.conf was written: regenerate it (slurm-gpu gres-conf)")
    _, gi, ci = owner
    if not g.mig_mode_current.get(False):
        raise MissingGpu(f"{g.label} has MIG off but {where} names its MIG instance gi {gi} ci {ci}",
                         "enable MIG and recreate the instances, or regenerate gres.conf")
    for m in g.mig_devices.get(()) or ():
        if int(m.gpu_instance_id) == gi and int(m.compute_instance_id) == ci:
            return m
    raise MissingGpu(f"{g.label} has no MIG instance gi {gi} ci {ci} ({where})",
                     "MIG instances changed since gres.conf was written: recreate them or regenerate gres.conf")


def map_job_gpus(job_gpus: Sequence[int], ident: Any, cfg: Config, node: str, slurm_conf: str,
                 log: Any = None) -> JobGpuMap:
    """Map the job's Slurm GPU indices through this node's Slurm configuration.

    Raises MissingGpu (a node fault: the hook FAILs and drains) when a GPU of the job cannot
    be found, and GresConfigError when neither the configuration nor a safe fallback says
    which GPU is which (our environment's problem: the hook fails open, logged).
    """
    if ident.gpu_count.failed:
        raise MissingGpu(f"cannot list the GPUs: {ident.gpu_count.error} ({ident.gpu_count.function})",
                         "the driver does not answer: check nvidia-smi and dmesg")
    try:
        records, source = _records(cfg, slurm_conf, node, ident)
    except GresConfigError as e:
        if any(g.mig_mode_current.get(False) for g in ident.gpus):
            raise GresConfigError(f"cannot map Slurm's GPU indices on a MIG node: {e.message}", e.hint) from None
        if log is not None:
            log.warning("gres-map-fallback", node=node, error=e.message,
                        note="mapping Slurm GPU k to the GPU with the k-th smallest device minor")
        records, source = _minor_order(ident), "minor order"
    by_minor, problems = _gpu_by_minor(ident)
    minors = _mig_minors(cfg, ident) if any(r.is_mig for r in records) else {}
    out: List[JobGpu] = []
    for k in job_gpus:
        if k >= len(records):
            listed = "the driver shows only" if source == "minor order" else f"{source} lists only"
            raise MissingGpu(f"Slurm gave the job GPU {k} but {listed} {len(records)} GPUs"
                             + (f" ({'; '.join(problems)})" if problems else ""),
                             "gres.conf changed without restarting slurmd, or a GPU fell off the bus: check nvidia-smi")
        rec = records[k]
        minor = rec.gpu_minor
        g = by_minor.get(minor) if minor is not None else None
        if g is None:
            seen = ",".join(str(m) for m in sorted(by_minor)) or "none"
            why = f"; {'; '.join(problems)}" if problems else ""
            raise MissingGpu(f"Slurm GPU {k} is {rec.files[0]} but the driver shows no GPU with minor {minor} "
                             f"(minors seen: {seen}{why})",
                             "a GPU fell off the bus or gres.conf names the wrong device: check nvidia-smi, dmesg (XID 79)")
        mig = _mig_device(rec, g, minors, k) if rec.is_mig else None
        out.append(JobGpu(k, g.index, rec.files[0], mig))
    configured = len({r.gpu_minor for r in records}) if source != "minor order" else None
    return JobGpuMap(tuple(out), source, configured)


def configured_gpus(slurm_conf: str, node: str) -> Optional[int]:
    """Physical GPUs this node's gres.conf gives Slurm (MIG slices of one GPU count once);
    None when the configuration cannot say (unreadable, AutoDetect)."""
    try:
        records, autodetect = slurmconf.node_gres_records(slurm_conf, node)
    except GresConfigError:
        return None
    return None if autodetect else len({r.gpu_minor for r in records})


# --- MIG scoping: on a GPU the job holds only slices of, the job is judged on its slices alone


def scope_xids(events: Sequence[xid.XidEvent], snap: NodeSnapshot,
               instances: Mapping[int, FrozenSet[int]]) -> List[xid.XidEvent]:
    """On a GPU the job holds only MIG slices of, an XID the driver tagged with another GPU
    instance (a contained error: GPU-I in the line) is that slice's business, not this job's."""
    if not instances:
        return list(events)
    other: Set[Tuple[Tuple[int, int, int], Optional[int]]] = set()  # (bus, GPU instance)
    for g in snap.gpus:
        mine = instances.get(g.index)
        if mine is not None:
            bus = xid.bus_key(g.pci_bus_id.get(""))
            other |= {(bus, e.gpu_instance) for e in events
                      if e.bus == bus and e.gpu_instance is not None and e.gpu_instance not in mine}
    return [e for e in events if (e.bus, e.gpu_instance) not in other]


def scope_to_instances(snap: NodeSnapshot, instances: Mapping[int, FrozenSet[int]]) -> NodeSnapshot:
    """On a GPU the job holds only MIG slices of, judge only those slices: other jobs may run on
    the rest.  Processes of other GPU instances are dropped; memory in use is the job's slices'."""
    if not instances:
        return snap
    gpus = []
    for g in snap.gpus:
        mine = instances.get(g.index)
        if mine is None:
            gpus.append(g)
            continue
        procs = g.processes
        if procs.ok:
            procs = S.value(tuple(p for p in procs.value if p.gpu_instance_id in mine))
        migs = [m for m in (g.mig_devices.get(()) or ()) if m.gpu_instance_id in mine]
        used = [m.memory_used_bytes for m in migs]
        known = [u for u in used if u is not None]
        mem = S.value(sum(known)) if migs and len(known) == len(used) else S.unsupported(
            "nvmlDeviceGetMemoryInfo", "memory in use of a MIG instance not reported")
        gpus.append(g._replace(processes=procs, memory_used_bytes=mem))
    return snap._replace(gpus=tuple(gpus))
