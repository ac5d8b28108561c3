"""Version and configuration checks: GPU count, driver version, one VBIOS per model, persistence mode."""
from __future__ import annotations

from typing import Dict, List, Sequence

from slurm_gpu.gpu.snapshot import GpuSnapshot, was_read
from slurm_gpu.policy.checks.registry import gpu_check, node_check
from slurm_gpu.policy.judge import FAIL, PASS, SKIP, Context, Judge


def _driver_matches(actual: str, required: str) -> bool:
    if required.endswith("."):
        return actual.startswith(required)
    return actual == required


@node_check("before")
def gpu_count(j: Judge, ctx: Context) -> None:
    if not j.enabled("gpu_count"):
        return
    expected_exactly, snap = ctx.hc["expected_gpu_count"], ctx.snap
    exact = bool(expected_exactly)
    want = expected_exactly or ctx.expected_count or 0
    seen = snap.gpu_count.get()
    if snap.gpu_count.failed:
        j.add("gpu_count", FAIL, None, f"cannot count GPUs: {snap.gpu_count.error}", "check nvidia-smi and dmesg")
    elif not want:
        j.add("gpu_count", SKIP, None, "no expected GPU count configured")
    elif seen is None:  # unsupported: a driver (or a snapshot file) that gave no count to compare
        j.add("gpu_count", FAIL, None, "cannot count GPUs: the driver reported no GPU count", "check nvidia-smi and dmesg")
    elif seen < want or (exact and seen != want):
        origin = "expected (health.expected_gpu_count)" if exact else "configured in Slurm"
        j.add("gpu_count", FAIL, None, f"{seen} GPUs visible, {want} {origin}",
              "a GPU fell off the bus or is not detected: check dmesg (XID 79), lspci, then reboot or reseat")
    else:
        j.add("gpu_count", PASS, None, f"{seen} GPUs visible" + (f" ({want} configured in Slurm)" if seen != want else ""))


@node_check("before")
def driver_version(j: Judge, ctx: Context) -> None:
    if not j.enabled("driver_version"):
        return
    required, snap = str(ctx.hc["required_driver_version"]), ctx.snap
    if not required:
        j.add("driver_version", SKIP, None, "no required driver version configured")
    elif snap.driver_version.failed:
        j.add("driver_version", FAIL, None, f"cannot read driver version: {snap.driver_version.error}")
    elif not _driver_matches(str(snap.driver_version.get("")), required):
        j.add("driver_version", FAIL, None, f"driver {snap.driver_version.get()} does not match required {required}",
              "install the site's driver version or update health.required_driver_version")
    else:
        j.add("driver_version", PASS, None, f"driver {snap.driver_version.get()}")


@node_check("before")
def vbios_consistency(j: Judge, ctx: Context) -> None:
    """GPUs of one model on one node should run one VBIOS: a mix means a half-done firmware update."""
    gpus: Sequence[GpuSnapshot] = [g for g in ctx.judged if not g.unreachable]
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


@gpu_check
def persistence_mode(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    j.reading("persistence_mode", g, g.persistence_mode, "persistence mode",
              lambda v: None if v else (FAIL, g, "persistence mode is off",
                                        "enable nvidia-persistenced (or let the prolog set it) to avoid slow job starts"))
