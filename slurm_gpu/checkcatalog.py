"""Every health check slurm-gpu can name, declared once.

A check's name is what a drain reason, a health event, a metric's `check` label, the circuit
breaker and the remedy map say.  Each `CheckSpec` holds all that is known about one check; the
tables the rest of the package reads are derived from it:

- `config.CHECK_NAMES` (what `health.severity` may set): the judged checks (policy/checks runs
  them in its own order, which decides the drain reason: this one is the documentation's);
- `policy.judge.DEFAULT_SEVERITY`: the checks whose FAIL is a WARN unless the site says otherwise;
- `policy.breaker.HARDWARE`: the checks whose FAIL always gates a job (the breaker never
  suspends them);
- `remediation.remedy.CHECK_REMEDY`: the checks with one remedy whatever the reading;
- the `check` label of `slurm_gpu_health_check_status` and friends (metrics/node.py);
- the table in docs/hooks.md ("Every check"), which a test keeps equal to `markdown_table()`.

A new check: one `CheckSpec` here, its code in its family module (policy/checks).  Standard
library only: config.py imports it on the hook path.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Tuple

# remedy actions (remediation/remedy.py uses the same words)
RESET, REBOOT, RMA = "reset", "reboot", "rma"


class CheckSpec:
    """One check.  A plain class, not a NamedTuple: config.py imports this module on every job start,
    and a NamedTuple class costs most of a millisecond to make (docs/benchmarks.md)."""

    __slots__ = ("name", "family", "doc", "severity", "hardware", "remedy", "remedy_source")

    def __init__(self, name: str, family: str, doc: str, severity: str = "fail", hardware: bool = False,
                 remedy: str = "", remedy_source: str = "") -> None:
        self.name = name
        self.family = family  # policy/checks module that judges it; 'driver', 'config', 'verify': named outside the judge
        self.doc = doc  # what a FAIL (or WARN) means, one line
        self.severity = severity  # default severity of its FAIL: fail | warn
        self.hardware = hardware  # its FAIL means the GPU (or the driver serving it) is broken: always gates a job
        self.remedy = remedy  # one remedy whatever the reading ('' : from the reading, XIDs, or a human)
        self.remedy_source = remedy_source  # where that remedy comes from

    @property
    def judged(self) -> bool:
        """Run by the judge (policy/checks), so `health.severity` may set it."""
        return self.family not in OUTSIDE_THE_JUDGE

    def __repr__(self) -> str:
        return f"CheckSpec({self.name!r}, {self.family!r})"


OUTSIDE_THE_JUDGE = ("driver", "config", "verify")
_MEMORY_GUIDE = "NVIDIA memory error management"
_OFF_THE_BUS = "NVIDIA XID catalog (79, RESTART_BM): a GPU off the bus needs a node reboot"

CHECKS: Tuple[CheckSpec, ...] = (
    # judged by policy/checks (and policy/health.py: responsive)
    CheckSpec("gpu_count", "versions", "fewer GPUs visible to NVML than Slurm's gres.conf gives the node",
              hardware=True, remedy=REBOOT, remedy_source=_OFF_THE_BUS),
    CheckSpec("responsive", "health", "a GPU that does not answer NVML within nvml_timeout_s, or is lost",
              hardware=True, remedy=REBOOT, remedy_source=_OFF_THE_BUS),
    CheckSpec("ecc_uncorrectable", "memory", "volatile uncorrectable ECC errors", hardware=True, remedy=RESET,
              remedy_source="NVIDIA XID catalog (48/95, RESET_GPU): a reset clears the volatile counters"),
    CheckSpec("row_remap_failure", "memory", "a row remapping failed (no spare row left in a bank)", hardware=True,
              remedy=RMA, remedy_source=f"{_MEMORY_GUIDE}, RMA policy: the remapping-failure flag"),
    CheckSpec("pending_reset", "memory", "a page retirement or row remap waits for a GPU reset", hardware=True,
              remedy=RESET,
              remedy_source=f"{_MEMORY_GUIDE}: a pending remap/retirement takes effect at a GPU reset"),
    CheckSpec("retired_pages", "memory", "retired pages at the RMA limit (health.max_retired_pages)", remedy=RMA,
              remedy_source=f"{_MEMORY_GUIDE}: retired-page limit (RMA guidance 60 of 64)"),
    CheckSpec("temperature", "thermal", "GPU temperature at or above health.max_temperature_c"),
    CheckSpec("clock_events", "thermal", "the driver slows the clocks for heat, power brake or a hardware slowdown"),
    CheckSpec("pcie_link", "links", "PCIe link narrower than the GPU's maximum (a slower generation: WARN)"),
    CheckSpec("nvlink", "links", "an NvLink of the GPU is down"),
    CheckSpec("persistence_mode", "versions", "persistence mode is off", severity="warn"),
    CheckSpec("leftover_processes", "processes", "a compute process still on a GPU that should be idle"),
    CheckSpec("memory_in_use", "processes", "GPU memory in use on a GPU that should be idle (leaked by a process)"),
    CheckSpec("driver_version", "versions", "the driver is not health.required_driver_version (when set)"),
    CheckSpec("xid", "xids", "a critical XID in the kernel log within xid.window_s"),
    CheckSpec("remap_spare_rows", "memory", "a memory bank with no spare row left for a remap", severity="warn"),
    CheckSpec("vbios_consistency", "versions", "GPUs of one model on the node run different VBIOS versions",
              severity="warn"),
    CheckSpec("fabric", "links", "the NVSwitch fabric is not ready: every CUDA program fails at start", hardware=True),
    CheckSpec("recovery_action", "xids", "the driver asks for a recovery action (NVML field 230 / XID 154)",
              hardware=True),
    CheckSpec("inforom", "memory", "the InfoROM does not validate (corrupt): the GPU's error records are not kept",
              severity="warn"),
    CheckSpec("power_cap", "thermal", "the enforced power limit is below the board's default", severity="warn"),
    CheckSpec("fans", "thermal", "a fan stopped or under half its target speed on a warm GPU"),
    CheckSpec("stuck_clocks", "thermal", "a busy job's SM clock stayed low with no clock event reason", severity="warn"),
    # named outside the judge
    CheckSpec("nvml", "driver", "NVML cannot start: the driver cannot serve the GPUs at all", hardware=True),
    CheckSpec("driver_library_mismatch", "driver",
              "the kernel module and the NVML library differ in version (a driver update without a reboot)"),
    CheckSpec("config", "config", "slurm-gpu's config file cannot be read: healthcheck drains rather than guess"),
    CheckSpec("verify_dcgm", "verify", "the verification job's DCGM diagnostic failed on the GPU", remedy=RESET,
              remedy_source="verification job: DCGM diagnostic failed (dcgmi diag)"),
    CheckSpec("verify_nccl", "verify", "the verification job's all_reduce_perf failed or missed its bandwidth floor",
              remedy=RESET,
              remedy_source="verification job: nccl-tests all_reduce_perf failed or under its bus bandwidth floor"),
    CheckSpec("verify_command", "verify", "a site command of the verification job failed on the node", remedy=RESET,
              remedy_source="verification job: a site command (verify.commands) failed"),
)

BY_NAME: Dict[str, CheckSpec] = {c.name: c for c in CHECKS}
JUDGED: Tuple[str, ...] = tuple(c.name for c in CHECKS if c.judged)
DEFAULT_SEVERITY: Dict[str, str] = {c.name: c.severity for c in CHECKS if c.severity != "fail"}
HARDWARE: FrozenSet[str] = frozenset(c.name for c in CHECKS if c.hardware)
CHECK_REMEDY: Dict[str, Tuple[str, str]] = {c.name: (c.remedy, c.remedy_source) for c in CHECKS if c.remedy}


def metric_label(check: str) -> str:
    """The check's `check` label: its name when the catalog has it, else 'other' (bounded cardinality)."""
    return check if check in BY_NAME else "other"


def markdown_table() -> str:
    """docs/hooks.md's "Every check" table."""
    lines = ["| check | family | FAIL means | default | always gates a job | remedy |", "|---|---|---|---|---|---|"]
    for c in CHECKS:
        lines.append(f"| `{c.name}` | {c.family} | {c.doc} | {c.severity if c.judged else '-'} | "
                     f"{'yes' if c.hardware else 'no'} | {c.remedy or 'from the reading'} |")
    return "\n".join(lines) + "\n"
