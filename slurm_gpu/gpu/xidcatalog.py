"""What an XID code means and what NVIDIA says to do about it: the one home of the catalog.

Source: NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors, "Analyzing Xid Errors with the
Xid Catalog", columns "Resolution Bucket (Immediate Action)" and "Investigatory Action"), and for
the memory XIDs NVIDIA's "GPU Memory Error Management" (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt,
"User Visible Statistics", "Error Recovery and Response Flags").  `action` says NVIDIA's immediate
action in words; `bucket` keeps NVIDIA's bucket name so an admin can find the row in the catalog.

A code that is not here is *unknown to slurm-gpu*, never guessed: describe() says so and points
at NVIDIA's catalog.  XID 154 carries the driver's recovery action in its message (R565 and
later: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)");
recovery_action() reads it, so the action of a 154 is the one the driver asked for.

Standard library only and no work at import: policy/health.py (on the hook path) may use it.
"""
from __future__ import annotations

import re
from typing import Dict, NamedTuple, Optional

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

# Classes, in words (`fleet xids`, docs/fleet.md).
APPLICATION = "application"
HARDWARE = "hardware"
DRIVER = "driver/firmware"
NVLINK = "NVLink"
MEMORY = "memory"
UNKNOWN = "unknown"

_RESTART_APP = ("RESTART_APP", "restart the application; the GPU needs nothing unless it repeats on other jobs")
_IGNORE = ("IGNORE", "none: a consequence of an earlier error or information only")
_RESET_GPU = ("RESET_GPU", "drain the node, reset the GPU (nvidia-smi -r) when its jobs have ended, then resume")
_REBOOT = ("RESTART_BM", "drain the node and reboot it; if it repeats, check power, cooling and seating, then contact NVIDIA")
_TREND = ("IGNORE", "none now; slurm-gpu trends it (`fleet memory`); the remap takes effect at the next GPU reset")
_RMA_CHECK = ("RESET_GPU", "drain, reset the GPU, run NVIDIA's field diagnostic: a remap failure is the RMA criterion")
_SUPPORT = ("CONTACT_SUPPORT", "collect nvidia-bug-report.sh and contact NVIDIA support if it repeats")


class XidInfo(NamedTuple):
    xid: int
    name: str  # NVIDIA's description, shortened
    kind: str  # APPLICATION, HARDWARE, DRIVER, NVLINK, MEMORY or UNKNOWN
    bucket: str  # NVIDIA's resolution bucket (immediate action), "" when unknown
    action: str  # the immediate action in words

    @property
    def known(self) -> bool:
        return self.kind != UNKNOWN


def _entry(xid: int, name: str, kind: str, what: "tuple[str, str]") -> XidInfo:
    return XidInfo(xid, name, kind, what[0], what[1])


_ENTRIES = (
    _entry(8, "GPU stopped processing (channel idle timeout)", APPLICATION, _RESTART_APP),
    _entry(13, "Graphics engine exception", APPLICATION, _RESTART_APP),
    _entry(31, "GPU memory page fault (MMU error)", APPLICATION, _RESTART_APP),
    _entry(32, "Invalid or corrupted push buffer stream", APPLICATION, _RESTART_APP),
    _entry(38, "Driver firmware error", DRIVER, _RESET_GPU),
    _entry(43, "GPU stopped processing (reset channel verification error)", APPLICATION, _RESTART_APP),
    _entry(45, "Preemptive cleanup, due to previous errors", APPLICATION, _IGNORE),
    _entry(48, "Double-bit ECC error (uncorrectable, DRAM)", MEMORY, _RESET_GPU),
    _entry(56, "Display engine error", DRIVER, _SUPPORT),
    _entry(57, "Error programming video memory interface", HARDWARE, _SUPPORT),
    _entry(61, "Internal micro-controller breakpoint/warning", DRIVER, _RESET_GPU),
    _entry(62, "Internal micro-controller halt", DRIVER, _RESET_GPU),
    _entry(63, "Row remapping / page retirement recorded (memory)", MEMORY, _TREND),
    _entry(64, "Row remapping / page retirement failed to record", MEMORY, _RMA_CHECK),
    _entry(68, "Video processor (NVDEC) exception", APPLICATION, _RESTART_APP),
    _entry(69, "Graphics engine class error", APPLICATION, _RESTART_APP),
    _entry(74, "NVLink error", NVLINK, _RESET_GPU),
    _entry(79, "GPU has fallen off the bus", HARDWARE, _REBOOT),
    _entry(92, "High single-bit ECC error rate", MEMORY, _TREND),
    _entry(94, "Contained uncorrectable ECC error", MEMORY, _RESTART_APP),
    _entry(95, "Uncontained uncorrectable ECC error", MEMORY, _RESET_GPU),
    _entry(109, "Context switch timeout", APPLICATION, _RESTART_APP),
    _entry(119, "GSP RPC timeout", DRIVER, _RESET_GPU),
    _entry(120, "GSP error", DRIVER, _RESET_GPU),
    _entry(140, "Unrecovered ECC error", MEMORY, _RESET_GPU),
    _entry(154, "GPU recovery action changed", DRIVER, ("XID_154", "follow the recovery action the driver logged with it")),
)
CATALOG: Dict[int, XidInfo] = {e.xid: e for e in _ENTRIES}

# nvmlDeviceGpuRecoveryAction_t (NVML; the flag of "Error Recovery and Response Flags").
RECOVERY_ACTIONS: Dict[int, str] = {
    0: "none: the GPU can be used again by starting a new GPU process",
    1: "GPU reset: stop its processes, reset the GPU (nvidia-smi -r), then use it again",
    2: "node reboot: the fault may have left the OS inconsistent; reboot the node",
    3: "drain P2P: stop the processes doing peer-to-peer traffic, then read the action again",
    4: "drain P2P and reset: stop peer-to-peer traffic, then reset the GPU",
    5: "recover the IMEX domain",
    6: "reset the GPU's PCIe bus",
    7: "reboot the system",
}
_RECOVERY = r"recovery action changed from\s+0x[0-9a-fA-F]+\s*(?:\([^)]*\))?\s+to\s+(0x[0-9a-fA-F]+|\d+)"


def describe(xid: int) -> XidInfo:
    """The catalog entry, or an entry saying the code is unknown to slurm-gpu."""
    found = CATALOG.get(xid)
    if found is not None:
        return found
    return XidInfo(xid, "not in slurm-gpu's XID catalog", UNKNOWN, "",
                   f"look XID {xid} up in NVIDIA's catalog ({CATALOG_URL})")


def recovery_action(message: str) -> Optional[int]:
    """The new recovery action of an XID 154 message, or None when the message carries none."""
    m = re.search(_RECOVERY, message or "", re.IGNORECASE)
    if not m:
        return None
    text = m.group(1)
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def action_for(xid: int, message: str = "") -> str:
    """What to do about one event: the catalog's action, or for XID 154 the driver's own."""
    if xid == 154:
        code = recovery_action(message)
        if code is not None:
            return "driver asks: " + RECOVERY_ACTIONS.get(code, f"recovery action {code} (unknown to slurm-gpu)")
        return "the message carries no recovery action: read it with nvidia-smi -q (GPU Recovery Action)"
    return describe(xid).action
