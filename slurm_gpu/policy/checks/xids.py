"""Driver-reported faults: XIDs in the kernel log, and the recovery action the driver asks for
(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, field 230)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

from slurm_gpu.gpu.snapshot import RECOVERY_ACTION_NAMES, GpuSnapshot
from slurm_gpu.gpu.xid import XidEvent, bus_key
from slurm_gpu.gpu.xidcatalog import action_for
from slurm_gpu.policy.checks.registry import gpu_check, node_check
from slurm_gpu.policy.judge import FAIL, PASS, SKIP, WARN, Context, Judge

# What each recovery action asks of an admin (nvml.h, nvmlDeviceGpuRecoveryAction_t; NVIDIA's XID catalog).
_RECOVERY_HINTS = {
    1: "drain the node and reset the GPU (nvidia-smi -r -i <index>) once no process holds it",
    2: "drain the node and reboot it",
    3: "peer-to-peer traffic is unsafe: drain the node, let running jobs finish, then reset the GPU",
    4: "drain the node, let running jobs finish, then reset the GPU",
    5: "recover the IMEX domain (restart the IMEX service on the domain's nodes)",
    6: "drain the node and reset the PCIe bus of the GPU (or reboot)",
    7: "drain the node and power-cycle it (a warm reboot is not enough)",
}


@gpu_check
def recovery_action(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """The driver's verdict after a fault (R565+ drivers): anything but NONE means the GPU must not take
    jobs until the action is done (DCGM issue #263: nvidia-smi said "Reset" while dcgmi said Healthy)."""
    j.reading("recovery_action", g, g.recovery_action, "driver recovery action",
              lambda v: None if v == 0 else (
                  FAIL, g, f"driver requests recovery: {RECOVERY_ACTION_NAMES.get(v, f'action {v}')} (NVML field 230)",
                  _RECOVERY_HINTS.get(v, "see NVIDIA's XID catalog for the recovery action")))


@node_check("after")
def xid(j: Judge, ctx: Context) -> None:
    snap, judged, events, problem, cfg, now, undated = (ctx.snap, ctx.judged, ctx.xid_events, ctx.xid_problem, ctx.cfg,
                                                        ctx.now, ctx.xid_undated)
    if not j.enabled("xid"):
        return
    if cfg.xid.source == "none":
        j.add("xid", SKIP, None, "XID source disabled")
        return
    if problem:
        # An unreadable log is not a GPU fault: warn, never drain for it.
        j.add("xid", WARN, None, problem, "fix xid.source in the config, or set it to 'none'")
        return
    ignore = set(cfg.xid.ignore)
    critical = set(cfg.xid.critical)
    window = cfg.xid.window_s
    by_bus = {bus_key(g.pci_bus_id.get("")): g for g in snap.gpus if g.pci_bus_id.ok}
    judged_idx = {g.index for g in judged}
    seen: Dict[Tuple[Any, ...], XidEvent] = {}
    for e in events:
        # A flood is one event (gpu/xid.py): it is in the window while its last line is.
        if now is not None and e.time is not None and e.last is not None and e.last < now - window:
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
