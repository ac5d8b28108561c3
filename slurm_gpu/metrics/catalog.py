"""The metric catalog: every family slurm-gpu exposes, its type, labels and meaning.

docs/prometheus.md embeds reference_markdown() (a test keeps them equal); monitoring/'s alert
rules and dashboards are written against exactly these names and labels.  Per-GPU labels are
named as dcgm-exporter names them (`gpu`, `UUID`, `modelName`), so PromQL joins on `UUID`.
Standard library only: the prolog imports this.
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

PREFIX = "slurm_gpu_"
GPU_LABELS = ("gpu", "UUID", "modelName")
STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
SOURCES = ("prolog", "epilog", "healthcheck")

# The files of the textfile directory, one per concern, so that separate processes never fight.
NODE_FILE = "slurm_gpu_node.prom"
USAGE_FILE = "slurm_gpu_usage.prom"
REMEDIATION_FILE = "slurm_gpu_remediation.prom"
BREAKER_FILE = "slurm_gpu_breaker.prom"
JOB_FILE_PREFIX = "slurm_gpu_job_"  # + <job id> + ".prom"
EFFICIENCY_FILE = "slurm_gpu_efficiency.prom"

# NVML clock event reason bits (nvmlClocksEventReason*) -> label value.
CLOCK_EVENT_REASONS: Tuple[Tuple[int, str], ...] = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"),
)


class Family(NamedTuple):
    name: str
    type: str  # gauge | counter
    labels: Tuple[str, ...]
    help: str  # the HELP line
    written_by: str  # who writes it, into which file (the reference's last column)


_HOOKS = "prolog, epilog, healthcheck (node file)"
_STORE = "healthcheck (node file), exporter (each scrape)"
_USAGE = "epilog (usage file)"
_EFFICIENCY = "`efficiency sample` and `run` (`slurm_gpu_efficiency.prom`, replaced each run)"


def _gpu(name: str, kind: str, extra: Tuple[str, ...], text: str, note: str = "") -> Family:
    """A per-GPU family of the node file (labels gpu, UUID, modelName first)."""
    return Family(name, kind, GPU_LABELS + extra, text, _HOOKS + (f"; {note}" if note else ""))


FAMILIES: Tuple[Family, ...] = (
    _gpu("slurm_gpu_check_status", "gauge", ("check", "status"),
         "Last status of a health check: 1 for the status it has, 0 for the other three of PASS/WARN/FAIL/SKIP.",
         'node-wide checks have gpu="", UUID="", modelName=""'),
    Family("slurm_gpu_check_timestamp_seconds", "gauge", ("source",),
           "Unix time of the last health check, by the program that ran it (prolog, epilog, healthcheck).", _HOOKS),
    _gpu("slurm_gpu_ecc_errors_total", "counter", ("type", "counter"),
         "ECC error counts as the driver reports them (type corrected/uncorrected, counter volatile/aggregate).",
         "absent where the GPU has no ECC"),
    _gpu("slurm_gpu_retired_pages", "gauge", ("cause",),
         "Retired memory pages by cause (sbe: single-bit, dbe: double-bit errors).", "pre-Ampere GPUs"),
    _gpu("slurm_gpu_retired_pages_pending", "gauge", (), "1 when a page retirement waits for a GPU reset."),
    _gpu("slurm_gpu_remapped_rows", "gauge", ("type",),
         "Rows remapped by the memory's row remapper (type correctable/uncorrectable).", "Ampere and later"),
    _gpu("slurm_gpu_row_remap_failure", "gauge", (), "1 when a row remapping failed (no spare row left: the RMA criterion)."),
    _gpu("slurm_gpu_row_remap_pending", "gauge", (), "1 when a row remapping waits for a GPU reset."),
    _gpu("slurm_gpu_xid_errors_total", "counter", ("xid",),
         "XID lines of the GPU seen in the kernel log, by code; each line is counted once, every line of a "
         "flood of identical lines included.", "a series appears with its first event"),
    _gpu("slurm_gpu_xid_last_timestamp_seconds", "gauge", (),
         "Unix time of the newest XID line counted for the GPU (the counter's de-duplication mark)."),
    _gpu("slurm_gpu_persistence_mode", "gauge", (), "1 when persistence mode is on.",
         "the prolog writes 1 where it turned persistence on"),
    _gpu("slurm_gpu_clock_event_reason", "gauge", ("reason",),
         "1 for each clock event reason active at the last reading (NVML clock event reason bits), else 0."),
    _gpu("slurm_gpu_fabric_state", "gauge", (),
         "NVSwitch fabric registration state (nvmlDeviceGetGpuFabricInfoV): 0 not supported, 1 not started, "
         "2 in progress, 3 completed; CUDA fails on a GPU of an NVSwitch system below 3.",
         "absent where the call is not supported"),
    _gpu("slurm_gpu_fabric_status", "gauge", (),
         "NVML return code of the fabric registration (0 success; 23 Insufficient Resources, ...).",
         "absent where the call is not supported"),
    _gpu("slurm_gpu_recovery_action", "gauge", (),
         "Recovery action the driver asks for (NVML field 230): 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, "
         "4 drain and reset, 5 recover IMEX domain, 6 bus reset, 7 system reboot.", "R565+ drivers"),
    _gpu("slurm_gpu_power_limit_watts", "gauge", ("limit",),
         "Power limits in watts: limit=enforced (in force now) and limit=default (the board's default)."),
    _gpu("slurm_gpu_fan_speed_ratio", "gauge", ("fan", "kind"),
         "Fan speed as a share of the fan's maximum, 0..1: kind=speed (measured) and kind=target (requested).",
         "boards with fans only"),
    Family("slurm_gpu_inforom_valid", "gauge", GPU_LABELS, "1 when nvmlDeviceValidateInforom passes, 0 when the "
           "InfoROM is corrupted.", "healthcheck (node file; the prolog and epilog do not read it)"),
    Family("slurm_gpu_driver_library_mismatch", "gauge", ("kernel_version", "library_version"),
           "1 when NVML cannot start because the kernel module and the NVML library differ "
           "(LIB_RM_VERSION_MISMATCH after a driver update without a reboot), else 0 with empty labels.", _HOOKS),
    Family("slurm_gpu_row_remap_banks", "gauge", GPU_LABELS + ("availability",),
           "DRAM banks by spare rows left (row-remapper histogram: max, high, partial, low, none); a bank with none "
           "cannot remap another row.", "healthcheck (node file; the prolog and epilog do not read it); Ampere and later"),
    Family("slurm_gpu_vbios_info", "gauge", GPU_LABELS + ("vbios",), "1, with the GPU's VBIOS version as a label.",
           "healthcheck (node file; the prolog and epilog do not read it)"),
    Family("slurm_gpu_driver_info", "gauge", ("driver_version", "cuda_version"),
           "1, with the node's NVIDIA driver version and the CUDA version it supports as labels.", _HOOKS),
    Family("slurm_gpu_node_drained", "gauge", ("reason",),
           "1 when slurm-gpu drained this node (reason: the failing check's name, or other), else 0 with reason=\"\".",
           "prolog and epilog when they drain, healthcheck always (node file)"),
    Family("slurm_gpu_remediation_total", "counter", ("action", "outcome"),
           "Remediation attempts on this node by action (reset, reboot, rma, verify) and outcome (resumed, "
           "failed, escalated, requested, refused, rma, busy, started, interrupted), counted from the node "
           "database's remediations table.",
           "remediate and healthcheck with remediation.enabled (`slurm_gpu_remediation.prom`)"),
    Family("slurm_gpu_clock_skew_seconds", "gauge", (),
           "This node's clock minus slurmctld's (sdiag's report time), as remediate last measured it; past "
           "remediation.clock_slack_s either way remediate neither reboots nor resumes the node.",
           "remediate and healthcheck with remediation.enabled, when they act on a drained node "
           "(`slurm_gpu_remediation.prom`)"),
    Family("slurm_gpu_breaker_open", "gauge", ("check",),
           "1 while the circuit breaker holds drains (or, for check reboot, remediate's reboots) for this check: the "
           "share of the node's partition drained by slurm-gpu for it within breaker.window_s reached "
           "breaker.max_drained_pct; 0 once a drain was allowed again or after `slurm-gpu breaker reset`.",
           "prolog, epilog, healthcheck, remediate when they would drain or reboot; `breaker reset` (`slurm_gpu_breaker.prom`)"),
    Family("slurm_gpu_spool_records", "gauge", (), "Records waiting in the spool directory for the node database.", _STORE),
    Family("slurm_gpu_unpushed_records", "gauge", (),
           "Records of the node database not yet shipped to the central server (db push).", _STORE),
    Family("slurm_gpu_unpushed_oldest_timestamp_seconds", "gauge", (),
           "Unix time of the oldest record not yet shipped to the central server; absent when none waits.", _STORE),
    Family("slurm_gpu_exporter_unreadable_files", "gauge", (),
           "slurm_gpu_*.prom files of the textfile directory that this scrape could not read (a symlink, a directory, "
           "another user's file): skipped, named in the exporter's log.", "exporter (each scrape)"),
    Family("slurm_gpu_last_run_timestamp_seconds", "gauge", ("hook",),
           "Unix time of the last completed run of the prolog, epilog or healthcheck.", _HOOKS),
    Family("slurm_gpu_job_info", "gauge", GPU_LABELS + ("GPU_I_ID", "slurm_job", "user", "account", "partition"),
           "1 while a Slurm job holds the GPU (GPU_I_ID: the MIG GPU instance of a slice, else empty).",
           "prolog writes `slurm_gpu_job_<job>.prom`, the epilog removes it"),
    Family("slurm_gpu_running_job_gpu_utilization_ratio", "gauge", GPU_LABELS,
           "Utilisation (0..1) of a GPU that a running job holds, at the last sample; absent while no job holds it "
           "(join slurm_gpu_job_info on UUID for the job).", _EFFICIENCY),
    Family("slurm_gpu_running_job_memory_used_bytes", "gauge", GPU_LABELS,
           "Memory used on a GPU (or MIG slice: its own UUID) that a running job holds, at the last sample.", _EFFICIENCY),
    Family("slurm_gpu_running_job_gpu_idle_seconds", "gauge", GPU_LABELS,
           "How long a running job's GPU has been idle by the [efficiency] policy's rule (0 when busy); the policy "
           "acts on the job when all its GPUs are idle long enough.", _EFFICIENCY),
    Family("slurm_gpu_efficiency_actions_total", "counter", ("stage", "outcome"),
           "Idle-policy decisions taken on this node, by stage (advice, notify, cancel) and outcome (the mail's: "
           "sent, failed, pending, capped; for a cancel, done or failed), from the node database.", _EFFICIENCY),
    Family("slurm_gpu_allocated_seconds_total", "counter", ("account",),
           "GPU-seconds allocated to finished jobs on this node, by account (node database, job_gpus).", _USAGE),
    Family("slurm_gpu_used_seconds_total", "counter", ("account",),
           "GPU-seconds weighted by utilisation (allocated seconds x mean utilisation / 100), by account.", _USAGE),
    Family("slurm_gpu_energy_joules_total", "counter", ("account",),
           "GPU energy of finished jobs on this node in joules, by account (whole GPUs; MIG slices have none).", _USAGE),
)

BY_NAME = {f.name: f for f in FAMILIES}
GPU_FAMILIES = frozenset(f.name for f in FAMILIES if f.labels[:3] == GPU_LABELS and f.name != "slurm_gpu_job_info")
# Per-GPU families from readings only a full read takes (`healthcheck`; the prolog skips them).
INVENTORY_FAMILIES = frozenset({"slurm_gpu_row_remap_banks", "slurm_gpu_vbios_info", "slurm_gpu_inforom_valid"})


def reference_markdown() -> str:
    """The metric reference, generated from FAMILIES (docs/prometheus.md embeds it; a test keeps them equal)."""
    lines: List[str] = ["| metric | type | labels | meaning | written by |", "| --- | --- | --- | --- | --- |"]
    for f in FAMILIES:
        labels = ", ".join(f"`{label}`" for label in f.labels) or "-"
        lines.append(f"| `{f.name}` | {f.type} | {labels} | {f.help} | {f.written_by} |")
    lines.append("")
    reasons = ", ".join(f"`{n}` (0x{bit:x})" for bit, n in CLOCK_EVENT_REASONS)
    lines.append(f"`slurm_gpu_clock_event_reason` reasons: {reasons}.")
    lines.append("")
    return "\n".join(lines)
