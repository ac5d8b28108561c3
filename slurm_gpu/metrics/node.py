"""slurm_gpu_node.prom: GPU state, check statuses, XID counters, drain state and hook times.

The prolog, the epilog and `healthcheck` each know part of the node: a prolog reads only its
job's GPUs.  So every writer merges (NodeUpdate, apply): it replaces what it looked at and
keeps what an earlier writer wrote about the rest, under the directory's lock.

- GPU state (ECC, retired pages, remapped rows, persistence, clock event reasons): the series
  of the GPUs the writer read are replaced, by index or UUID (a swapped GPU's old series go).
  VBIOS and the row-remapper histogram only by a writer that read them (healthcheck): the
  prolog's quick read leaves them as they were.  The driver's versions: whoever read them.
- Check statuses: per (GPU, check) for the GPUs the writer judged and the checks it ran, so a
  check that ran and found nothing on a GPU (no XID any more) drops its old status there.
- XID counters only go up: an XID line is counted when it is newer than the GPU's mark
  (slurm_gpu_xid_last_timestamp_seconds), which survives in the file between hook runs.  A flood
  of identical lines is one event (gpu/xid.py) whose lines after the mark are counted, each once.
- `healthcheck` sees every GPU: series of GPUs no longer on the node go (RMA, swap).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from slurm_gpu.checkcatalog import metric_label
from slurm_gpu.gpu.snapshot import cuda_version, was_read
from slurm_gpu.gpu.xid import bus_key, lines_after
from slurm_gpu.metrics.catalog import CLOCK_EVENT_REASONS, GPU_FAMILIES, INVENTORY_FAMILIES, STATUSES
from slurm_gpu.metrics.textfile import Labels, Samples

CHECK = "slurm_gpu_check_status"
XID = "slurm_gpu_xid_errors_total"
XID_MARK = "slurm_gpu_xid_last_timestamp_seconds"
DRAINED = "slurm_gpu_node_drained"
DRIVER = "slurm_gpu_driver_info"
_STATE = GPU_FAMILIES - {XID, XID_MARK} - INVENTORY_FAMILIES
_RANK = {"SKIP": 0, "PASS": 1, "WARN": 2, "FAIL": 3}
NOT_DRAINED: Labels = (("reason", ""),)


def gpu_labels(g: Any) -> Labels:
    return (("gpu", str(g.index)), ("UUID", g.uuid.get("") or ""), ("modelName", g.name.get("") or ""))


def check_label(check: Optional[str]) -> str:
    """A drain reason's label: a check of the catalog (checkcatalog.py), or 'other' (bounded)."""
    return metric_label(check or "")


def _identity(labels: Labels) -> str:
    d = dict(labels)
    return d.get("UUID") or f"index-{d.get('gpu', '')}"


class NodeUpdate:
    """One writer's view of the node, applied to the node file by apply()."""

    def __init__(self, source: str, now: float):
        self.source = source  # prolog | epilog | healthcheck
        self.now = now
        self.samples: Samples = {}
        self.indices: Set[str] = set()  # GPUs read (index as text) ...
        self.uuids: Set[str] = set()  # ... and their UUIDs
        self.inventory_read: Set[str] = set()  # GPUs (index) whose VBIOS and remap histogram were read
        self.checks: Set[str] = set()  # checks that ran
        self.present: Optional[Set[Tuple[str, str]]] = None  # every (index, UUID) on the node, when known
        self.xid_events: Sequence[Any] = ()
        self.xid_gpus: List[Any] = []
        self.drained: Optional[Tuple[str, str]] = None  # ("set", reason) / ("clear", "") / ("ours", check)
        self.replaced: Set[str] = set()

    def _put(self, name: str, labels: Labels, value: Optional[float]) -> None:
        if value is not None:
            self.samples.setdefault(name, {})[labels] = float(value)

    def gpu(self, g: Any, persistence: Optional[bool] = None) -> None:
        """The GPU's state as read (readings that are unsupported or failed are left out)."""
        labels = gpu_labels(g)
        self.indices.add(str(g.index))
        if g.uuid.get():
            self.uuids.add(g.uuid.get())
        for kind, counter, r in (("corrected", "volatile", g.ecc_volatile_corrected),
                                 ("uncorrected", "volatile", g.ecc_volatile_uncorrected),
                                 ("corrected", "aggregate", g.ecc_aggregate_corrected),
                                 ("uncorrected", "aggregate", g.ecc_aggregate_uncorrected)):
            self._put("slurm_gpu_ecc_errors_total", labels + (("type", kind), ("counter", counter)), r.get())
        self._put("slurm_gpu_retired_pages", labels + (("cause", "sbe"),), g.retired_pages_sbe.get())
        self._put("slurm_gpu_retired_pages", labels + (("cause", "dbe"),), g.retired_pages_dbe.get())
        self._put("slurm_gpu_retired_pages_pending", labels, _flag(g.retired_pages_pending.get()))
        self._put("slurm_gpu_remapped_rows", labels + (("type", "correctable"),), g.remapped_rows_corrected.get())
        self._put("slurm_gpu_remapped_rows", labels + (("type", "uncorrectable"),), g.remapped_rows_uncorrected.get())
        self._put("slurm_gpu_row_remap_failure", labels, _flag(g.remapped_rows_failure.get()))
        self._put("slurm_gpu_row_remap_pending", labels, _flag(g.remapped_rows_pending.get()))
        self._put("slurm_gpu_persistence_mode", labels, _flag(g.persistence_mode.get() if persistence is None else persistence))
        mask = g.clock_event_reasons.get()
        if mask is not None:
            for bit, reason in CLOCK_EVENT_REASONS:
                self._put("slurm_gpu_clock_event_reason", labels + (("reason", reason),), 1 if int(mask) & bit else 0)
        self._faults(g, labels)
        self._inventory(g, labels)
        self.xid_gpus.append(g)

    def _faults(self, g: Any, labels: Labels) -> None:
        """Fabric, recovery action, power limits and fans (issue 25's readings)."""
        fab = g.fabric.get()
        if fab is not None:
            self._put("slurm_gpu_fabric_state", labels, fab.state)
            self._put("slurm_gpu_fabric_status", labels, fab.status)
        self._put("slurm_gpu_recovery_action", labels, g.recovery_action.get())
        for kind, r in (("enforced", g.power_limit_mw), ("default", g.power_default_limit_mw)):
            mw = r.get()
            self._put("slurm_gpu_power_limit_watts", labels + (("limit", kind),), None if mw is None else mw / 1000.0)
        for f in g.fans.get(()) or ():
            for kind, rr in (("speed", f.speed_pct), ("target", f.target_pct)):
                pct = rr.get()
                self._put("slurm_gpu_fan_speed_ratio", labels + (("fan", str(f.fan)), ("kind", kind)),
                          None if pct is None else pct / 100.0)

    def _inventory(self, g: Any, labels: Labels) -> None:
        """VBIOS and the row-remapper histogram, when this writer read them (healthcheck)."""
        if not (was_read(g.vbios) or was_read(g.remap_histogram)):
            return
        self.inventory_read.add(str(g.index))
        if g.inforom_valid.ok:
            self._put("slurm_gpu_inforom_valid", labels, 1 if g.inforom_valid.value else 0)
        if g.vbios.ok and g.vbios.value:
            self._put("slurm_gpu_vbios_info", labels + (("vbios", str(g.vbios.value)),), 1)
        hist = g.remap_histogram.get()
        if hist is not None:
            for name in hist._fields:
                self._put("slurm_gpu_row_remap_banks", labels + (("availability", name),), getattr(hist, name))

    def driver(self, snap: Any) -> None:
        """The node's driver and CUDA versions (the family replaced: one series)."""
        version = snap.driver_version.get()
        if version:
            self.replace({DRIVER: {(("driver_version", str(version)),
                                    ("cuda_version", cuda_version(snap.cuda_driver_version) or "")): 1.0}})

    def results(self, results: Iterable[Any], snap: Any) -> None:
        """Check statuses (the worst where a check reported a GPU twice) and the check time."""
        worst: Dict[Tuple[Labels, str], str] = {}
        for r in results:
            g = snap.gpu(r.gpu_index) if (snap is not None and r.gpu_index is not None) else None
            if g is not None:
                labels = gpu_labels(g)
            elif r.gpu_index is None:
                labels = (("gpu", ""), ("UUID", ""), ("modelName", ""))
            else:
                labels = (("gpu", str(r.gpu_index)), ("UUID", r.gpu_uuid or ""), ("modelName", ""))
            key = (labels, r.check)
            if key not in worst or _RANK.get(r.status, 0) > _RANK.get(worst[key], 0):
                worst[key] = r.status
            self.checks.add(r.check)
            if r.gpu_index is not None:
                self.indices.add(str(r.gpu_index))
                if r.gpu_uuid:
                    self.uuids.add(r.gpu_uuid)
        for (labels, check), status in worst.items():
            for s in STATUSES:
                self._put(CHECK, labels + (("check", check), ("status", s)), 1 if s == status else 0)
        self._put("slurm_gpu_check_timestamp_seconds", (("source", self.source),), self.now)

    def xids(self, events: Sequence[Any]) -> None:
        self.xid_events = events

    def node_gpus(self, snap: Any) -> None:
        """The writer saw every GPU of the node: series of GPUs that are gone can go (only when
        every GPU's UUID was readable: a GPU that fell off the bus keeps its history)."""
        count = snap.gpu_count.get()
        if count is None or count != len(snap.gpus) or not all(g.uuid.get() for g in snap.gpus):
            return
        self.present = {(str(g.index), g.uuid.get()) for g in snap.gpus}

    def drain(self, state: str, check: str = "") -> None:
        """set: drained by us for check; clear: not drained by us; ours: drained by us, cause
        unknown here (keep the reason an earlier writer knew, else the check or 'other')."""
        self.drained = (state, check)

    def replace(self, samples: Samples) -> None:
        """Whole families this writer knows all of (a family given empty goes from the file)."""
        for name, series in samples.items():
            self.samples[name] = dict(series)
            self.replaced.add(name)

    def ran(self, hook: str) -> None:
        self._put("slurm_gpu_last_run_timestamp_seconds", (("hook", hook),), self.now)


def _flag(v: Any) -> Optional[int]:
    return None if v is None else (1 if v else 0)


def apply(old: Samples, up: NodeUpdate) -> Samples:
    """The node file after this writer: old minus what it replaces, plus what it set."""
    out: Samples = {name: dict(series) for name, series in old.items() if name not in up.replaced}
    for name, series in out.items():
        if name in _STATE:
            out[name] = {k: v for k, v in series.items() if not _read_again(up, dict(k), name)}
        elif name in INVENTORY_FAMILIES:
            out[name] = {k: v for k, v in series.items() if dict(k).get("gpu") not in up.inventory_read}
        if up.present is not None and (name in GPU_FAMILIES):
            out[name] = {k: v for k, v in out[name].items() if _on_node(up, dict(k))}
    for name, series in up.samples.items():
        out.setdefault(name, {}).update(series)
    _count_xids(out, up)
    _drained(out, old.get(DRAINED, {}), up)
    return {name: series for name, series in out.items() if series}


def _read_again(up: NodeUpdate, d: Dict[str, str], name: str) -> bool:
    if name == CHECK:
        if d.get("check") not in up.checks:
            return False
        if d.get("gpu") == "":
            return True
    return d.get("gpu") in up.indices or (d.get("UUID", "") != "" and d.get("UUID") in up.uuids)


def _on_node(up: NodeUpdate, d: Dict[str, str]) -> bool:
    return d.get("gpu") == "" or (d.get("gpu", ""), d.get("UUID", "")) in (up.present or ())


def _count_xids(out: Samples, up: NodeUpdate) -> None:
    """XID lines newer than each GPU's mark are counted once; the mark moves to the newest.  A flood is
    one event of many identical lines (gpu/xid.py): its lines after the mark count (lines_after)."""
    counts = out.setdefault(XID, {})
    marks = out.setdefault(XID_MARK, {})
    old_mark = {_identity(k): (k, v) for k, v in marks.items()}
    old_count = {(_identity(k), dict(k).get("xid")): v for k, v in counts.items()}
    for g in up.xid_gpus:
        bus = g.pci_bus_id.get()
        if not bus:
            continue
        labels = gpu_labels(g)
        ident = _identity(labels)
        prev_labels, mark = old_mark.get(ident, (None, 0.0))
        fresh = [(e, lines_after(e, mark)) for e in up.xid_events
                 if e.bus == bus_key(bus) and e.time is not None and _last(e) > mark]
        if not fresh:
            continue
        for e, n in fresh:
            key = labels + (("xid", str(e.xid)),)
            if key not in counts:
                counts[key] = old_count.get((ident, str(e.xid)), 0.0)
            counts[key] += n
        if prev_labels is not None and prev_labels != labels:
            marks.pop(prev_labels, None)
        marks[labels] = max(mark, max(_last(e) for e, _ in fresh))


def _last(e: Any) -> float:
    """An XID event's last line's time (its only one's for one line)."""
    last = getattr(e, "last_time", None)
    return float(e.time if last is None else last)


def _drained(out: Samples, old: Dict[Labels, float], up: NodeUpdate) -> None:
    if up.drained is None:
        if not out.get(DRAINED):
            out[DRAINED] = {NOT_DRAINED: 0.0}
        return
    state, check = up.drained
    if state == "clear":
        out[DRAINED] = {NOT_DRAINED: 0.0}
    elif state == "set":
        out[DRAINED] = {(("reason", check_label(check)),): 1.0}
    else:  # ours: an earlier writer's reason stays
        kept = {k: v for k, v in old.items() if v == 1 and dict(k).get("reason")}
        out[DRAINED] = kept or {(("reason", check_label(check or None)),): 1.0}
