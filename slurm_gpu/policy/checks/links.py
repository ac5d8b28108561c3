"""Link checks: the PCIe link, NvLinks and the NVSwitch fabric registration."""
from __future__ import annotations

from slurm_gpu.gpu.snapshot import FABRIC_STATE_COMPLETED, FABRIC_STATE_NAMES, FABRIC_STATE_NOT_SUPPORTED, GpuSnapshot
from slurm_gpu.policy.checks.registry import gpu_check
from slurm_gpu.policy.judge import FAIL, PASS, SKIP, WARN, Context, Judge

# NVML return codes a fabric registration reports in its status (nvml.h); others by number.
_NVML_STATUS = {0: "Success", 3: "Not Supported", 6: "Not Found", 10: "Timeout", 23: "Insufficient Resources",
                27: "Not Ready", 999: "Unknown Error"}
_FM_HINT = ("CUDA fails on this GPU until the fabric is up: check the NVIDIA fabric manager "
            "(systemctl status nvidia-fabricmanager; /var/log/fabricmanager.log), restart it, then re-check")


@gpu_check
def pcie_link(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
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


@gpu_check
def nvlink(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
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


@gpu_check
def fabric(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """NVSwitch systems: a GPU whose fabric registration is not COMPLETED with status Success fails
    every CUDA program at initialisation (NVIDIA fabric manager user guide).  Where the GPU has no
    fabric (state NOT_SUPPORTED, or the call is) the check SKIPs."""
    def verdict(f: object) -> object:
        state, status = f.state, f.status  # type: ignore[attr-defined]
        if state != FABRIC_STATE_COMPLETED:
            return (FAIL, g, f"NVSwitch fabric registration {FABRIC_STATE_NAMES.get(state, state)}: "
                             "is the fabric manager running?", _FM_HINT)
        if status != 0:
            text = _NVML_STATUS.get(status, f"NVML error {status}")
            return (FAIL, g, f"NVSwitch fabric registration failed: {text} (clique {f.clique_id}); "  # type: ignore[attr-defined]
                             "check the fabric manager", _FM_HINT)
        return None
    r = g.fabric
    if r.ok and r.value.state == FABRIC_STATE_NOT_SUPPORTED:
        j.add("fabric", SKIP, g, "no NVSwitch fabric")
        return
    j.reading("fabric", g, r, "NVSwitch fabric state", verdict)  # type: ignore[arg-type]
