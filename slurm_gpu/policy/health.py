"""Health policy: pure functions from a snapshot (+ XID events) and config to check results.

No I/O here.  Every check returns PASS / WARN / FAIL / SKIP per GPU (or node-wide), with a
one-line message and a remedy hint.  A reading that *failed* makes its check FAIL (a broken
diagnostic is never read as healthy); a reading that is *unsupported* makes it SKIP; a reading
that was *not read* (the prolog skips VBIOS and the row-remapper histogram) gives no result.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set

from slurm_gpu.config import Config
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot, Reading, was_read
from slurm_gpu.gpu.xid import XidEvent, bus_key
from slurm_gpu.gpu.xidcatalog import action_for

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
_RANK = {SKIP: 0, PASS: 1, WARN: 2, FAIL: 3}

# Checks whose natural FAIL is only a warning unless the site says otherwise.
_DEFAULT_SEVERITY = {"persistence_mode": "warn", "remap_spare_rows": "warn", "vbios_consistency": "warn"}

CLOCK_EVENT_NAMES = {
    0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown", 0x10: "SyncBoost",
    0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown", 0x80: "HwPowerBrakeSlowdown", 0x100: "DisplayClockSetting",
}


class CheckResult(NamedTuple):
    check: str
    status: str
    gpu_index: Optional[int]  # None: node-wide
    gpu_uuid: str
    message: str
    hint: str = ""

    @property
    def where(self) -> str:
        return "node" if self.gpu_index is None else f"GPU {self.gpu_index}"

    def to_json(self) -> Dict[str, object]:
        return {"check": self.check, "status": self.status, "gpu_index": self.gpu_index, "gpu_uuid": self.gpu_uuid,
                "message": self.message, "hint": self.hint}


def worst(results: Iterable[CheckResult]) -> str:
    w = SKIP
    for r in results:
        if _RANK[r.status] > _RANK[w]:
            w = r.status
    return w


def failures(results: Iterable[CheckResult]) -> List[CheckResult]:
    return [r for r in results if r.status == FAIL]


def drain_fault(results: Sequence[CheckResult]) -> str:
    """The fault text of a drain reason: the first FAIL in full, then how many more."""
    fails = failures(results)
    if not fails:
        return ""
    first = fails[0]
    text = first.message
    if len(fails) > 1:
        text += f" (+{len(fails) - 1} more)"
    return text


# --- helpers -------------------------------------------------------------------------------

class _Judge:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.severity: Dict[str, str] = dict(_DEFAULT_SEVERITY)
        self.severity.update(cfg.get("health", "severity"))
        self.out: List[CheckResult] = []

    def enabled(self, check: str) -> bool:
        return self.severity.get(check, "fail") != "off"

    def add(self, check: str, status: str, gpu: Optional[GpuSnapshot], message: str, hint: str = "") -> None:
        if not self.enabled(check):
            return
        if status == FAIL and self.severity.get(check, "fail") == "warn":
            status = WARN
        idx = None if gpu is None else gpu.index
        uuid = "" if gpu is None else (gpu.uuid.get() or "")
        if gpu is not None:
            message = f"{gpu.label} {message}"
        self.out.append(CheckResult(check, status, idx, uuid, message, hint))

    def reading(self, check: str, gpu: GpuSnapshot, r: Reading, what: str,
                judge: Callable[[object], Optional[tuple]]) -> None:
        """Common three-outcome handling; judge(value) returns (status, message, hint) or None for PASS."""
        if not self.enabled(check):
            return
        if r.failed:
            self.add(check, FAIL, gpu, f"cannot read {what}: {r.error} ({r.function})",
                     "a failing NVML query usually means a driver or hardware fault; check dmesg and nvidia-smi -q")
            return
        if r.unsupported:
            self.add(check, SKIP, gpu, f"{what} not available ({r.error or 'unsupported'})")
            return
        verdict = judge(r.value)
        if verdict is None:
            self.add(check, PASS, gpu, f"{what} ok ({_fmt(r.value)})")
        else:
            self.add(check, *verdict)  # type: ignore[arg-type]


def _fmt(v: object) -> str:
    if hasattr(v, "_asdict"):
        return ", ".join(f"{k} {x}" for k, x in v._asdict().items())  # type: ignore[attr-defined]
    if isinstance(v, tuple):
        return f"{len(v)} items"
    return str(v)


def _reasons(mask: int) -> str:
    names = [n for bit, n in CLOCK_EVENT_NAMES.items() if mask & bit]
    return "|".join(names) or hex(mask)


def _driver_matches(actual: str, required: str) -> bool:
    if required.endswith("."):
        return actual.startswith(required)
    return actual == required


# --- the policy ----------------------------------------------------------------------------

def evaluate(
    snap: NodeSnapshot,
    cfg: Config,
    *,
    gpus: Optional[Sequence[int]] = None,
    idle: "Optional[Iterable[int] | bool]" = None,
    expected_count: Optional[int] = None,
    xid_events: Sequence[XidEvent] = (),
    xid_problem: str = "",
    xid_undated: int = 0,
    now: Optional[float] = None,
) -> List[CheckResult]:
    """Judge the node.

    gpus: indices to judge (default: every GPU in the snapshot); node-wide checks always run.
    idle: indices that must be idle (no processes, no memory in use) — e.g. a job's GPUs in the
          prolog — or True for every judged GPU.  Others are not judged for leftovers, since a
          running job legitimately uses them.
    expected_count: physical GPUs Slurm configures on the node: fewer visible is a FAIL, more is
          fine (a GPU Slurm does not schedule).  health.expected_gpu_count, when set, wins and
          must match exactly.
    xid_undated: XID lines in the log that could not be dated (xid.read); said, never judged.
    """
    j = _Judge(cfg)
    hc = {k: cfg.get("health", k) for k in ("expected_gpu_count", "required_driver_version", "max_temperature_c",
                                             "max_retired_pages", "idle_memory_used_mib", "clock_event_mask")}
    judged = [g for g in snap.gpus if gpus is None or g.index in set(gpus)]
    idle_set: Set[int] = {g.index for g in judged} if idle is True else set(idle or ())
    _gpu_count(j, snap, hc["expected_gpu_count"], expected_count)
    _driver_version(j, snap, str(hc["required_driver_version"]))
    _vbios_consistency(j, [g for g in judged if not g.unreachable])
    for g in judged:
        if g.unreachable:
            j.add("responsive", FAIL, g, f"not responding: {g.unreachable}",
                  "the GPU may have fallen off the bus: check dmesg for XID 79/48, reset the GPU or reboot the node")
            continue
        j.add("responsive", PASS, g, "responds")
        _gpu_checks(j, g, hc, g.index in idle_set)

    _xid_checks(j, snap, judged, xid_events, xid_problem, cfg, now, xid_undated)
    return j.out


def _gpu_count(j: _Judge, snap: NodeSnapshot, expected_exactly: object, configured: Optional[int]) -> None:
    if not j.enabled("gpu_count"):
        return
    exact = bool(expected_exactly)
    want = expected_exactly or configured or 0
    seen = snap.gpu_count.get()
    if snap.gpu_count.failed:
        j.add("gpu_count", FAIL, None, f"cannot count GPUs: {snap.gpu_count.error}", "check nvidia-smi and dmesg")
    elif not want:
        j.add("gpu_count", SKIP, None, "no expected GPU count configured")
    elif seen < want or (exact and seen != want):
        origin = "expected (health.expected_gpu_count)" if exact else "configured in Slurm"
        j.add("gpu_count", FAIL, None, f"{seen} GPUs visible, {want} {origin}",
              "a GPU fell off the bus or is not detected: check dmesg (XID 79), lspci, then reboot or reseat")
    else:
        j.add("gpu_count", PASS, None, f"{seen} GPUs visible" + (f" ({want} configured in Slurm)" if seen != want else ""))


def _driver_version(j: _Judge, snap: NodeSnapshot, required: str) -> None:
    if not j.enabled("driver_version"):
        return
    if not required:
        j.add("driver_version", SKIP, None, "no required driver version configured")
    elif snap.driver_version.failed:
        j.add("driver_version", FAIL, None, f"cannot read driver version: {snap.driver_version.error}")
    elif not _driver_matches(str(snap.driver_version.get("")), required):
        j.add("driver_version", FAIL, None, f"driver {snap.driver_version.get()} does not match required {required}",
              "install the site's driver version or update health.required_driver_version")
    else:
        j.add("driver_version", PASS, None, f"driver {snap.driver_version.get()}")


def _vbios_consistency(j: _Judge, gpus: Sequence[GpuSnapshot]) -> None:
    """GPUs of one model on one node should run one VBIOS: a mix means a half-done firmware update."""
    read = [g for g in gpus if was_read(g.vbios)]
    if not read or not j.enabled("vbios_consistency"):
        return  # not read (the prolog), or off
    bad = [g for g in read if g.vbios.failed]
    if bad:
        j.add("vbios_consistency", FAIL, None, f"cannot read the VBIOS version of {bad[0].label}: "
              f"{bad[0].vbios.error} ({bad[0].vbios.function})")
        return
    by_model: Dict[str, Dict[str, List[int]]] = {}
    for g in read:
        if g.vbios.ok:
            by_model.setdefault(str(g.name.get("?")), {}).setdefault(str(g.vbios.value), []).append(g.index)
    if not by_model:
        j.add("vbios_consistency", SKIP, None, f"VBIOS version not available ({read[0].vbios.error or 'unsupported'})")
        return
    mixed = {m: v for m, v in by_model.items() if len(v) > 1}
    if not mixed:
        same = "; ".join(f"{m}: VBIOS {next(iter(v))}" for m, v in sorted(by_model.items()))
        j.add("vbios_consistency", PASS, None, same)
        return
    for model, versions in sorted(mixed.items()):
        ranked = sorted(versions.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        text = ", ".join(f"{ver} on GPU {','.join(map(str, idx))}" for ver, idx in ranked)
        j.add("vbios_consistency", FAIL, None, f"{model} GPUs run {len(ranked)} VBIOS versions: {text}",
              "flash every GPU of a model to the same VBIOS (the vendor's firmware bundle); `slurm-gpu fleet versions` "
              "compares nodes")


def _gpu_checks(j: _Judge, g: GpuSnapshot, hc: Dict[str, object], must_be_idle: bool) -> None:
    _memory_errors(j, g, int(hc["max_retired_pages"]))  # type: ignore[arg-type]
    tmax = int(hc["max_temperature_c"])  # type: ignore[arg-type]
    j.reading("temperature", g, g.temperature_c, "temperature",
              lambda v: (FAIL, g, f"temperature {v} C >= {tmax} C",
                         "check cooling (fans, airflow, liquid loop) before returning the node to service")
              if v >= tmax else None)
    mask = int(hc["clock_event_mask"])  # type: ignore[arg-type]
    j.reading("clock_events", g, g.clock_event_reasons, "clock event reasons",
              lambda v: (FAIL, g, f"hardware clock slowdown active: {_reasons(v & mask)}",
                         "HW slowdown/power brake means thermal, power-supply or board trouble: inspect the chassis")
              if v & mask else None)
    _pcie(j, g)
    _nvlink(j, g)
    j.reading("persistence_mode", g, g.persistence_mode, "persistence mode",
              lambda v: None if v else (FAIL, g, "persistence mode is off",
                                        "enable nvidia-persistenced (or let the prolog set it) to avoid slow job starts"))
    if must_be_idle:
        _idle(j, g, int(hc["idle_memory_used_mib"]) * 1024 * 1024)  # type: ignore[arg-type]


def _memory_errors(j: _Judge, g: GpuSnapshot, max_retired_pages: int) -> None:
    """Uncorrectable ECC, row remapping, a pending retirement or remap, retired pages."""
    j.reading("ecc_uncorrectable", g, g.ecc_volatile_uncorrected, "volatile uncorrectable ECC count",
              lambda v: (FAIL, g, f"uncorrectable ECC errors: {v}",
                         "drain, reset the GPU (nvidia-smi -r) and watch for recurrence; RMA if it repeats")
              if v else None)
    j.reading("row_remap_failure", g, g.remapped_rows_failure, "row remapping",
              lambda v: (FAIL, g, "row remapping failed (no spare rows left)", "the GPU needs an RMA") if v else None)
    pending = []
    if g.retired_pages_pending.ok and g.retired_pages_pending.value:
        pending.append("page retirement")
    if g.remapped_rows_pending.ok and g.remapped_rows_pending.value:
        pending.append("row remap")
    _pending_reset(j, g, pending)
    _retired_pages(j, g, max_retired_pages)
    if was_read(g.remap_histogram):  # the prolog does not read it: then nothing to say
        j.reading("remap_spare_rows", g, g.remap_histogram, "row-remapper histogram", lambda v: _no_spare_rows(g, v))


def _no_spare_rows(g: GpuSnapshot, hist: Any) -> Optional[tuple]:
    """A bank without spare rows cannot take another remap (NVIDIA, memory error management)."""
    if hist.none <= 0:
        return None
    banks = f"{hist.none} memory bank{'s' if hist.none != 1 else ''}"
    return (FAIL, g, f"{banks} with no spare rows left (row-remapper histogram)",
            "an uncorrectable error in such a bank cannot be remapped: watch the GPU (`slurm-gpu fleet memory`) and "
            "plan its replacement")


def _pending_reset(j: _Judge, g: GpuSnapshot, pending: List[str]) -> None:
    if pending:
        j.add("pending_reset", FAIL, g, f"pending {' and '.join(pending)}: needs a GPU reset",
              "drain the node, then nvidia-smi -r -i <index> (or reboot) to apply it")
    else:
        both = [r for r in (g.retired_pages_pending, g.remapped_rows_pending)]
        bad = [r for r in both if r.failed]
        if bad:
            j.add("pending_reset", FAIL, g, f"cannot read pending retirement/remap state: {bad[0].error} ({bad[0].function})")
        elif all(r.unsupported for r in both):
            j.add("pending_reset", SKIP, g, f"pending retirement/remap state not available ({both[0].error or 'unsupported'})")
        else:
            j.add("pending_reset", PASS, g, "no pending page retirement or row remap")


def _retired_pages(j: _Judge, g: GpuSnapshot, limit: int) -> None:
    sbe, dbe = g.retired_pages_sbe, g.retired_pages_dbe
    if sbe.failed or dbe.failed:
        r = sbe if sbe.failed else dbe
        j.add("retired_pages", FAIL, g, f"cannot read retired pages: {r.error} ({r.function})")
    elif sbe.unsupported and dbe.unsupported:
        j.add("retired_pages", SKIP, g, f"retired pages not available ({sbe.error or 'unsupported'})")
    else:
        total = (sbe.get(0) or 0) + (dbe.get(0) or 0)
        if total > limit:
            j.add("retired_pages", FAIL, g, f"{total} retired pages (limit {limit})", "the GPU is wearing out: plan an RMA")
        else:
            j.add("retired_pages", PASS, g, f"{total} retired pages")


def _idle(j: _Judge, g: GpuSnapshot, limit_b: int) -> None:
    """A GPU handed to a job must be idle: no processes, no memory in use."""
    def procs(v: object) -> Optional[tuple]:
        if not v:
            return None
        pids = ", ".join(str(p.pid) for p in v)  # type: ignore[attr-defined]
        return (FAIL, g, f"{len(v)} compute process(es) still on the GPU (pid {pids})",  # type: ignore[arg-type]
                "a previous job left processes behind: kill them or drain the node")
    j.reading("leftover_processes", g, g.processes, "compute processes", procs)
    j.reading("memory_in_use", g, g.memory_used_bytes, "memory in use",
              lambda v: (FAIL, g, f"{int(v) // (1024 * 1024)} MiB GPU memory in use on an idle GPU (leaked memory)",  # type: ignore[arg-type]
                         "a crashed process may hold GPU memory: reset the GPU") if int(v) > limit_b else None)  # type: ignore[arg-type]


def _pcie(j: _Judge, g: GpuSnapshot) -> None:
    if not j.enabled("pcie_link"):
        return
    rs = (g.pcie_width_current, g.pcie_width_max, g.pcie_gen_current, g.pcie_gen_max)
    bad = [r for r in rs if r.failed]
    if bad:
        j.add("pcie_link", FAIL, g, f"cannot read PCIe link: {bad[0].error} ({bad[0].function})")
        return
    wc, wm, gc, gm = (r.get() for r in rs)
    if wc is None or wm is None:
        j.add("pcie_link", SKIP, g, "PCIe link width not available")
        return
    if wc < wm:
        j.add("pcie_link", FAIL, g, f"PCIe link x{wc}, expected x{wm}",
              "a degraded link halves host<->GPU bandwidth: reseat the GPU or riser")
        return
    # GPUs lower the link generation when idle to save power; only a busy GPU (P0) at a lower
    # generation is suspicious, and even then it is a warning, not a reason to drain.
    if gc is not None and gm is not None and gc < gm and g.performance_state.get() == 0:
        j.add("pcie_link", WARN, g, f"PCIe gen{gc} while busy, max gen{gm}", "check BIOS PCIe settings and risers")
        return
    j.add("pcie_link", PASS, g, f"PCIe x{wc}" + (f" gen{gc}/{gm}" if gc is not None else ""))


def _nvlink(j: _Judge, g: GpuSnapshot) -> None:
    if not j.enabled("nvlink"):
        return
    r = g.nvlinks
    if r.failed:
        j.add("nvlink", FAIL, g, f"cannot read NvLink state: {r.error} ({r.function})")
        return
    if r.unsupported or not r.value:
        j.add("nvlink", SKIP, g, "no NvLink")
        return
    down = [l.link for l in r.value if l.active.ok and not l.active.value]
    broken = [l for l in r.value if l.active.failed]
    if broken:
        j.add("nvlink", FAIL, g, f"cannot read NvLink {broken[0].link}: {broken[0].active.error}")
    elif down:
        j.add("nvlink", FAIL, g, f"NvLink {', '.join(map(str, down))} down ({len(r.value) - len(down)}/{len(r.value)} up)",
              "multi-GPU jobs will be slow or hang: check the NVSwitch fabric (nv-fabricmanager) and reseat/RMA")
    else:
        j.add("nvlink", PASS, g, f"{len(r.value)} NvLinks up")


def _xid_checks(j: _Judge, snap: NodeSnapshot, judged: Sequence[GpuSnapshot], events: Sequence[XidEvent],
                problem: str, cfg: Config, now: Optional[float], undated: int = 0) -> None:
    if not j.enabled("xid"):
        return
    if cfg.get("xid", "source") == "none":
        j.add("xid", SKIP, None, "XID source disabled")
        return
    if problem:
        # An unreadable log is not a GPU fault: warn, never drain for it.
        j.add("xid", WARN, None, problem, "fix xid.source in the config, or set it to 'none'")
        return
    ignore = set(cfg.get("xid", "ignore"))
    critical = set(cfg.get("xid", "critical"))
    window = cfg.get("xid", "window_s")
    by_bus = {bus_key(g.pci_bus_id.get("")): g for g in snap.gpus if g.pci_bus_id.ok}
    judged_idx = {g.index for g in judged}
    seen: Dict[tuple, XidEvent] = {}
    for e in events:
        if now is not None and e.time is not None and e.time < now - window:
            continue
        if e.xid in ignore:
            continue
        seen.setdefault((e.bus, e.xid), e)  # de-duplicate: one result per GPU and XID
    reported = False
    for (bus, xid), e in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        g = by_bus.get(bus)
        if g is not None and g.index not in judged_idx:
            continue  # another job's GPU: not ours to judge here
        status = FAIL if xid in critical else WARN
        j.add("xid", status, g, f"XID {xid} in kernel log: {e.message[:120]}",
              f"NVIDIA's XID catalog: {action_for(xid, e.message)}")
        reported = True
    # Undated XID lines cannot be placed in the window, so they never FAIL (an old one must not
    # drain the node), but the admin learns that part of the log was not judged.  Kept out of
    # the FAIL messages, which become drain reasons.
    unjudged = ""
    hint = ""
    if undated > 0:
        unjudged = (f"{undated} XID line{'s' if undated != 1 else ''} in the log could not be dated "
                    f"and {'were' if undated != 1 else 'was'} not judged")
        hint = "read XIDs from kmsg or the journal, or log kernel messages with dates (see docs/config.md, XID lines)"
    if not reported:
        j.add("xid", PASS, None, f"no relevant XID in the last {window} s" + (f"; {unjudged}" if unjudged else ""), hint)
    elif unjudged:
        j.add("xid", PASS, None, unjudged, hint)
