"""Memory checks: uncorrectable ECC, row remapping, pending retirement/remap, retired pages,
spare rows per bank (row-remapper histogram), and the InfoROM (where the driver keeps the
ECC and retirement records)."""
from __future__ import annotations

from typing import Any, List, Optional

from slurm_gpu.gpu.snapshot import GpuSnapshot, was_read
from slurm_gpu.policy.checks.registry import gpu_check
from slurm_gpu.policy.judge import FAIL, PASS, SKIP, Context, Judge, Verdict


@gpu_check
def ecc_and_row_remap(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    j.reading("ecc_uncorrectable", g, g.ecc_volatile_uncorrected, "volatile uncorrectable ECC count",
              lambda v: (FAIL, g, f"uncorrectable ECC errors: {v}",
                         "drain, reset the GPU (nvidia-smi -r) and watch for recurrence; RMA if it repeats")
              if v else None)
    j.reading("row_remap_failure", g, g.remapped_rows_failure, "row remapping",
              lambda v: (FAIL, g, "row remapping failed (no spare rows left)", "the GPU needs an RMA") if v else None)


@gpu_check
def pending_reset(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    pending: List[str] = []
    if g.retired_pages_pending.ok and g.retired_pages_pending.value:
        pending.append("page retirement")
    if g.remapped_rows_pending.ok and g.remapped_rows_pending.value:
        pending.append("row remap")
    if pending:
        j.add("pending_reset", FAIL, g, f"pending {' and '.join(pending)}: needs a GPU reset",
              "drain the node, then nvidia-smi -r -i <index> (or reboot) to apply it")
        return
    both = [g.retired_pages_pending, g.remapped_rows_pending]
    bad = [r for r in both if r.failed]
    if bad:
        j.add("pending_reset", FAIL, g, f"cannot read pending retirement/remap state: {bad[0].error} ({bad[0].function})")
    elif all(r.unsupported for r in both):
        j.add("pending_reset", SKIP, g, f"pending retirement/remap state not available ({both[0].error or 'unsupported'})")
    else:
        j.add("pending_reset", PASS, g, "no pending page retirement or row remap")


@gpu_check
def retired_pages(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    limit = int(ctx.hc["max_retired_pages"])
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


@gpu_check
def remap_spare_rows(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    if was_read(g.remap_histogram):  # the prolog does not read it: then nothing to say
        j.reading("remap_spare_rows", g, g.remap_histogram, "row-remapper histogram", lambda v: _no_spare_rows(g, v))


def _no_spare_rows(g: GpuSnapshot, hist: Any) -> Optional[Verdict]:
    """A bank without spare rows cannot take another remap (NVIDIA, memory error management)."""
    if hist.none <= 0:
        return None
    banks = f"{hist.none} memory bank{'s' if hist.none != 1 else ''}"
    return (FAIL, g, f"{banks} with no spare rows left (row-remapper histogram)",
            "an uncorrectable error in such a bank cannot be remapped: watch the GPU (`slurm-gpu fleet memory`) and "
            "plan its replacement")


@gpu_check
def inforom(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """nvmlDeviceValidateInforom -> CORRUPTED_INFOROM (DCGM's diagnostic has passed such GPUs).  A warning
    by default (health.severity.inforom): the GPU computes, but its ECC and retirement records may be
    lost.  Not read by the prolog (it checksums the whole InfoROM)."""
    if was_read(g.inforom_valid):
        j.reading("inforom", g, g.inforom_valid, "InfoROM", lambda ok: None if ok else (
            FAIL, g, "InfoROM is corrupted (nvmlDeviceValidateInforom: CORRUPTED_INFOROM)",
            "NVIDIA: the InfoROM holds ECC, retirement and configuration records; update the board's firmware "
            "(InfoROM image) with NVIDIA's tools or RMA the board if it stays corrupted"))
