"""What each fault needs: the one fault -> remedy map of `slurm-gpu remediate` (docs/remediation.md).

A failed check maps to one of five remedies, from NVIDIA's own signals, in this order:

1. NVML's GPU recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, field 230; nvml.h,
   nvmlDeviceGpuRecoveryAction_t): the driver's verdict wins over anything we infer.
2. The recovery action an XID 154 line carries (gpu/xidcatalog.recovery_action).
3. The XID catalog's immediate action (gpu/xidcatalog.py: NVIDIA's "Resolution Bucket").
4. The memory rules (NVIDIA, "GPU Memory Error Management"; docs/fleet.md): a pending row remap
   or page retirement takes effect at the next GPU reset; a row-remapping failure or the retired-page
   limit is an RMA: no remedy on the node cures it (the checks' own remedies: slurm_gpu/checkcatalog.py).
   Uncorrectable SRAM errors are an early warning of `slurm-gpu fleet memory`, not a check.

NONE: nothing to do on the GPU (an application's fault).  RESET: reset the GPU when idle.
REBOOT: reboot the node through Slurm.  RMA: replace the board; the drain stays.
MANUAL: slurm-gpu knows no safe automatic remedy (thermal, links, configuration, versions):
the drain stays for a human, as before this module existed.

Pure and standard library only.  Remediation's alone: the hook path (prolog, epilog) imports nothing
of slurm_gpu.remediation (.importlinter, the hook-path contract).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence

from slurm_gpu import checkcatalog as catalog
from slurm_gpu.gpu import xidcatalog
from slurm_gpu.gpu.xid import bus_key

NONE, RESET, REBOOT, RMA, MANUAL = "none", catalog.RESET, catalog.REBOOT, catalog.RMA, "manual"
# Which remedy wins when a node has several faults: MANUAL first (no automatic step would cure
# it, so none is tried), then the strongest step.
_RANK = {NONE: 0, RESET: 1, REBOOT: 2, RMA: 3, MANUAL: 4}
# The ladder a failed verification climbs: a reset that did not cure becomes a reboot, a reboot
# that did not cure becomes an RMA.
ESCALATION = {RESET: REBOOT, REBOOT: RMA}

# nvmlDeviceGpuRecoveryAction_t -> remedy.  DRAIN_P2P (3) and DRAIN_AND_RESET (4) need the GPU's
# peer-to-peer traffic stopped: an idle node has none, so a reset is what is left.  BUS_RESET (6)
# is not done by nvidia-smi --gpu-reset: a reboot resets the bus.  SYSTEM_REBOOT (7) asks for a
# power cycle: the site's RebootProgram decides whether its reboot is one (docs/remediation.md).
# RECOVER_IMEX_DOMAIN (5) is the IMEX service's business: MANUAL.
RECOVERY_REMEDY = {0: NONE, 1: RESET, 2: REBOOT, 3: RESET, 4: RESET, 5: MANUAL, 6: REBOOT, 7: REBOOT}
# NVIDIA's resolution bucket -> remedy.
BUCKET_REMEDY = {"RESTART_APP": NONE, "IGNORE": NONE, "RESET_GPU": RESET, "RESTART_BM": REBOOT,
                 "CONTACT_SUPPORT": MANUAL}
# Checks whose FAIL has one remedy whatever the reading (the memory rules, a GPU that is gone, a failed
# verification test; remediate's ladder, ESCALATION, makes a repeat a reboot, then an RMA): checkcatalog.py.
CHECK_REMEDY = catalog.CHECK_REMEDY


class Remedy(NamedTuple):
    """What one failed check needs."""

    check: str
    gpu_index: Optional[int]  # None: node-wide
    gpu_uuid: str
    action: str  # NONE | RESET | REBOOT | RMA | MANUAL
    source: str  # where the action comes from, for the admin and the node database
    fault: str  # the check's message


def remedy_for(result: Any, snap: Any = None, xid_events: Sequence[Any] = ()) -> Remedy:
    """The remedy of one FAIL (a CheckResult), from the snapshot's recovery action and the XIDs."""
    gpu = _gpu(snap, result.gpu_index)
    action, source = _action(result.check, gpu, xid_events)
    return Remedy(result.check, result.gpu_index, result.gpu_uuid, action, source, result.message)


def _action(check: str, gpu: Any, events: Sequence[Any]) -> "tuple[str, str]":
    if check == "recovery_action" and gpu is not None and gpu.recovery_action.ok:
        code = int(gpu.recovery_action.value)
        return RECOVERY_REMEDY.get(code, MANUAL), f"NVML recovery action {code} (field 230)"
    if check == "xid":
        return _xid_action(gpu, events)
    if check in CHECK_REMEDY:
        return CHECK_REMEDY[check]
    return MANUAL, "no automatic remedy known for this check: a human decides"


def _xid_action(gpu: Any, events: Sequence[Any]) -> "tuple[str, str]":
    """The strongest action among the XIDs logged for this GPU (node-wide: all of them)."""
    bus = bus_key(gpu.pci_bus_id.get("")) if gpu is not None and gpu.pci_bus_id.ok else None
    best, why = NONE, "XID catalog: application or informational XIDs only"
    for e in events:
        if bus is not None and e.bus != bus:
            continue
        code = xidcatalog.recovery_action(e.message) if e.xid == 154 else None
        if code is not None:
            act, src = RECOVERY_REMEDY.get(code, MANUAL), f"XID 154: driver recovery action {code}"
        else:
            info = xidcatalog.describe(e.xid)
            act, src = BUCKET_REMEDY.get(info.bucket, MANUAL), f"XID catalog: XID {e.xid} {info.bucket or 'unknown'}"
        if _RANK[act] > _RANK[best]:
            best, why = act, src
    return best, why


def _gpu(snap: Any, index: Optional[int]) -> Any:
    if snap is None or index is None:
        return None
    for g in getattr(snap, "gpus", ()):
        if g.index == index:
            return g
    return None


def remedies(results: Iterable[Any], snap: Any = None, xid_events: Sequence[Any] = ()) -> List[Remedy]:
    """The remedy of every FAIL in results, in their order."""
    return [remedy_for(r, snap, xid_events) for r in results if getattr(r, "status", "") == "FAIL"]


def node_action(found: Sequence[Remedy]) -> str:
    """The one step for the node: NONE when nothing failed, MANUAL when any fault has no automatic remedy,
    else the strongest of RESET < REBOOT < RMA."""
    best = NONE
    for r in found:
        if _RANK[r.action] > _RANK[best]:
            best = r.action
    return best


def table() -> List[Dict[str, str]]:
    """The map as rows (docs/hooks.md and docs/remediation.md show it; a test keeps them equal)."""
    rows = [{"fault": f"recovery action {code} ({xidcatalog.RECOVERY_ACTIONS[code].split(':')[0]})",
             "remedy": act, "source": "NVML field 230 / XID 154"} for code, act in sorted(RECOVERY_REMEDY.items())]
    rows += [{"fault": f"XID bucket {b}", "remedy": act, "source": "NVIDIA XID catalog (gpu/xidcatalog.py)"}
             for b, act in BUCKET_REMEDY.items()]
    rows += [{"fault": f"check {c}", "remedy": act, "source": src} for c, (act, src) in CHECK_REMEDY.items()]
    rows.append({"fault": "any other failed check", "remedy": MANUAL, "source": "no automatic remedy: a human decides"})
    return rows


def markdown_table() -> str:
    lines = ["| fault | remedy | source |", "|---|---|---|"]
    lines += [f"| {r['fault']} | {r['remedy']} | {r['source']} |" for r in table()]
    return "\n".join(lines) + "\n"
