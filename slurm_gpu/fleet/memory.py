"""`fleet memory`: each GPU's memory health against NVIDIA's limits, ranked (docs/fleet.md).

NVIDIA, "GPU Memory Error Management" (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt):
- "Row Remapping": Ampere and later remap up to 512 rows per GPU (page retirement before them:
  at most 64 pages); a remap takes effect at the next GPU reset.
- "RMA Policy": the row-remapping failure flag, validated by NVIDIA's field diagnostic, is the
  RMA criterion.  It is set by a remap attempt for an uncorrectable error on a bank that already
  has eight uncorrectable-error rows remapped, on a row already remapped, or after 512
  uncorrectable-error remaps.  SRAM: more than 4 unique uncorrectable events in an address bank
  (parity-protected) or more than 2 (SECDED) set the SRAM threshold flag.
- NVML's row-remapper histogram (nvmlRowRemapperHistogramValues_t) counts banks by the spare rows
  they have left: max (all), high, partial, low, none (no spare row left).
Pre-Ampere page retirement is judged against health.max_retired_pages (default 60, the RMA
guidance the node checks use) and NVIDIA's 64-page maximum.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.fleet.model import Fleet, Gpu, Mark, Point
from slurm_gpu.slurm import hostlist

MAX_ROW_REMAPS = 512  # uncorrectable-error remaps per GPU (NVIDIA: "RMA Policy", "Row Remapping")
BANK_UNCORRECTABLE_REMAPS = 8  # a bank with 8 uncorrectable remaps cannot take another (RMA Policy)
MAX_RETIRED_PAGES = 64  # pre-Ampere dynamic page retirement: at most 64 pages (Row Remapping table)
SRAM_UCE_PER_BANK_PARITY = 4  # RMA when more unique uncorrectable events per bank (parity SRAM)
SRAM_UCE_PER_BANK_SECDED = 2  # RMA when more unique uncorrectable events per bank (SECDED SRAM)

RMA, RESET, WARNING, DATA = "RMA", "reset", "early-warning", "data"
LISTS = (RMA, RESET, WARNING, DATA)
COLUMNS = ("list", "rank", "node", "gpu_index", "gpu_uuid", "serial", "model", "reason", "action",
           "remapped_uncorrectable", "remapped_correctable", "banks_no_spare", "banks_low_spare",
           "retired_pages", "ecc_corrected_per_day")
TABLE_COLUMNS = ("list", "rank", "node", "gpu_index", "serial", "model", "reason", "action")

ACT_RMA = ("drain the node; run NVIDIA's field diagnostic on the GPU; when it confirms, open an RMA "
           "(serial, nvidia-bug-report.sh)")
ACT_RESET = "drain the node; when its jobs have ended reset the GPU (nvidia-smi -r -i INDEX) or reboot; resume"
ACT_PLAN = "plan a replacement: the next uncorrectable error in that bank fails remapping (RMA); drain if errors go on"
ACT_WATCH = "watch the trend (fleet memory --since); run NVIDIA's field diagnostic at the next maintenance"
ACT_SRAM = "run NVIDIA's field diagnostic: it counts unique events per bank, which the driver's total cannot"
ACT_DATA = "fix the data: see the reason (healthcheck and `db push` running on the node? inventory --state?)"


class Finding(NamedTuple):
    list: str
    severity: int  # higher first within a list
    magnitude: float  # tie-break: the size of the problem
    reason: str
    action: str


class Growth(NamedTuple):
    """Correctable ECC growth of one GPU over the window; per_day None when there is no trend."""

    per_day: Optional[float]
    delta: Optional[int]
    span_s: float
    mark: str  # why there is no trend when the data says so ("" otherwise)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def growth(points: Sequence[Point]) -> Growth:
    """Growth of the lifetime (aggregate) corrected ECC count, else the volatile one; a count that
    goes down or a serial that changes is a mark, never a trend."""
    if len(points) < 2:
        return Growth(None, None, 0.0, "")
    serials = sorted({p.serial for p in points if p.serial})
    if len(serials) > 1:
        return Growth(None, None, 0.0, f"serial changed within the window ({' -> '.join(serials)}): no ECC trend")
    for attr, name in (("corrected_aggregate", "aggregate"), ("corrected_volatile", "volatile")):
        values = [getattr(p, attr) for p in points]
        if all(v is not None for v in values):
            break
    else:
        if any(p.corrected_aggregate is not None or p.corrected_volatile is not None for p in points):
            return Growth(None, None, 0.0, "corrected ECC count missing from some reports: no ECC trend")
        return Growth(None, None, 0.0, "")
    for a, b in zip(points, points[1:]):
        va, vb = getattr(a, attr), getattr(b, attr)
        if vb < va:
            return Growth(None, None, 0.0, f"corrected ECC count ({name}) went down from {va} to {vb} at {_iso(b.time)} "
                                           "(driver reload or counters reset): no ECC trend")
    span = points[-1].time - points[0].time
    if span <= 0:
        return Growth(None, None, 0.0, "")
    delta = values[-1] - values[0]
    return Growth(delta / span * 86400.0, delta, span, "")


def _retired(g: Gpu) -> Optional[int]:
    parts = [g.count("retired_pages_sbe"), g.count("retired_pages_dbe")]
    known = [p for p in parts if p is not None]
    return sum(known) if known else None


def rma_findings(g: Gpu, retired_limit: int) -> List[Finding]:
    out = []
    if (g.count("remap_failure") or 0) > 0:
        out.append(Finding(RMA, 5, 1, "row-remapping failure flag set (NVIDIA's RMA criterion, to be validated "
                                      "by the field diagnostic)", ACT_RMA))
    unc = g.count("remapped_rows_uncorrectable")
    if unc is not None and unc >= MAX_ROW_REMAPS:
        out.append(Finding(RMA, 5, unc, f"{unc} rows remapped for uncorrectable errors: NVIDIA's limit of "
                                        f"{MAX_ROW_REMAPS} per GPU reached", ACT_RMA))
    retired = _retired(g)
    if retired is not None and retired >= retired_limit:
        out.append(Finding(RMA, 4, retired, f"{retired} retired pages: at or above {retired_limit} (RMA guidance; "
                                            f"a GPU can retire at most {MAX_RETIRED_PAGES})", ACT_RMA))
    return out


def reset_findings(g: Gpu) -> List[Finding]:
    out = []
    if (g.count("remap_pending") or 0) > 0:
        out.append(Finding(RESET, 3, 1, "row remapping pending: it takes effect at the next GPU reset", ACT_RESET))
    if (g.count("retired_pages_pending") or 0) > 0:
        out.append(Finding(RESET, 3, 1, "page retirement pending: it takes effect at the next GPU reset "
                                        "(or driver reload)", ACT_RESET))
    return out


def warning_findings(g: Gpu, grow: Optional[Growth], retired_limit: int) -> List[Finding]:
    out = []
    none, low = g.count("remap_hist_none"), g.count("remap_hist_low")
    if none:
        out.append(Finding(WARNING, 4, none, f"{none} memory bank{'s' if none > 1 else ''} with no spare row left "
                                             "(row-remapper histogram)", ACT_PLAN))
    if low:
        out.append(Finding(WARNING, 3, low, f"{low} memory bank{'s' if low > 1 else ''} with few spare rows left "
                                            "(row-remapper histogram: low)", ACT_WATCH))
    sram = g.count("sram_uncorrected")
    if sram:
        out.append(Finding(WARNING, 3, sram, f"{sram} uncorrectable SRAM errors (NVIDIA's RMA threshold: more than "
                                             f"{SRAM_UCE_PER_BANK_PARITY} unique events in a bank, parity; more than "
                                             f"{SRAM_UCE_PER_BANK_SECDED}, SECDED)", ACT_SRAM))
    out += _counter_warnings(g, retired_limit)
    if grow is not None and grow.per_day is not None and grow.per_day > 0:
        out.append(Finding(WARNING, 1, grow.per_day, f"correctable ECC errors growing {grow.per_day:.1f}/day "
                                                     f"(+{grow.delta} in {grow.span_s / 86400:.1f} days)", ACT_WATCH))
    return out


def _counter_warnings(g: Gpu, retired_limit: int) -> List[Finding]:
    out = []
    unc = g.count("remapped_rows_uncorrectable")
    if unc and unc < MAX_ROW_REMAPS:
        out.append(Finding(WARNING, 2, unc, f"{unc} of {MAX_ROW_REMAPS} rows remapped for uncorrectable errors", ACT_WATCH))
    retired = _retired(g)
    if retired and retired < retired_limit:
        out.append(Finding(WARNING, 2, retired, f"{retired} retired pages (RMA guidance at {retired_limit}, "
                                                f"at most {MAX_RETIRED_PAGES})", ACT_WATCH))
    ue = g.count("ecc_uncorrected_volatile")
    if ue:
        out.append(Finding(WARNING, 2, ue, f"{ue} uncorrectable ECC errors since the driver loaded", ACT_WATCH))
    cor = g.count("remapped_rows_correctable")
    if cor:
        out.append(Finding(WARNING, 1, cor, f"{cor} rows remapped for correctable errors", ACT_WATCH))
    return out


def _numbers(g: Gpu, grow: Optional[Growth]) -> Dict[str, Any]:
    return {"remapped_uncorrectable": g.count("remapped_rows_uncorrectable"),
            "remapped_correctable": g.count("remapped_rows_correctable"),
            "banks_no_spare": g.count("remap_hist_none"), "banks_low_spare": g.count("remap_hist_low"),
            "retired_pages": _retired(g),
            "ecc_corrected_per_day": None if grow is None or grow.per_day is None else round(grow.per_day, 3)}


def _gpu_rows(g: Gpu, grow: Optional[Growth], retired_limit: int) -> List[Dict[str, Any]]:
    rma = rma_findings(g, retired_limit)
    per_list = {RMA: rma, RESET: reset_findings(g), WARNING: [] if rma else warning_findings(g, grow, retired_limit)}
    rows = []
    for name, found in per_list.items():
        if not found:
            continue
        found.sort(key=lambda f: (-f.severity, -f.magnitude))
        rows.append(dict(list=name, node=g.node, gpu_index=g.index, gpu_uuid=g.uuid, serial=g.serial, model=g.model,
                         reason="; ".join(f.reason for f in found), action=found[0].action,
                         _key=(-found[0].severity, -found[0].magnitude), **_numbers(g, grow)))
    return rows


def _mark_row(m: Mark) -> Dict[str, Any]:
    return dict(list=DATA, node=m.node, gpu_index=m.gpu_index, gpu_uuid=m.gpu_uuid or None, reason=m.what,
                action=ACT_DATA, _key=(0, 0))


def memory_view(fleet: Fleet, retired_limit: int) -> List[Dict[str, Any]]:
    """Rows of the RMA list, the reset list, the ranked early-warning list and the data marks."""
    rows: List[Dict[str, Any]] = []
    marks = list(fleet.marks)
    for g in fleet.gpus:
        grow = None
        if fleet.history is not None:
            grow = growth(fleet.history.get((g.node, g.uuid), []))
            if grow.mark:
                marks.append(Mark(g.node, grow.mark, g.index, g.uuid))
        rows += _gpu_rows(g, grow, retired_limit)
    marks += [Mark(n, "never reported: Slurm lists GPUs on this node but the source has no inventory of it")
              for n in fleet.never_reported()]
    rows += [_mark_row(m) for m in marks]
    return rank(rows)


def rank(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Sort each list (worst first; the data list by node) and number its rows."""
    def key(r: Dict[str, Any]) -> Tuple[Any, ...]:
        idx = r.get("gpu_index")
        return (LISTS.index(r["list"]), r["_key"], hostlist.sort_key(r["node"]), -1 if idx is None else idx)
    out = sorted(rows, key=key)
    counters: Dict[str, int] = {}
    for r in out:
        counters[r["list"]] = counters.get(r["list"], 0) + 1
        r["rank"] = counters[r["list"]]
        r.pop("_key", None)
    return out
