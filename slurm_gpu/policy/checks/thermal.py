"""Thermal, power and clock checks: temperature, hardware clock slowdowns, a power limit capped
below the board's default, and fans."""
from __future__ import annotations

from typing import Any, Dict, Optional

from slurm_gpu.gpu.snapshot import GpuSnapshot
from slurm_gpu.policy.checks.registry import gpu_check
from slurm_gpu.policy.judge import FAIL, PASS, SKIP, Context, Judge

CLOCK_EVENT_NAMES = {
    0x1: "GpuIdle", 0x2: "ApplicationsClocksSetting", 0x4: "SwPowerCap", 0x8: "HwSlowdown", 0x10: "SyncBoost",
    0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown", 0x80: "HwPowerBrakeSlowdown", 0x100: "DisplayClockSetting",
}
# A fan is judged only on a warm GPU: an idle card may legitimately stop its fans (zero-RPM mode).
FAN_WARM_C = 50


def reasons(mask: int) -> str:
    names = [n for bit, n in CLOCK_EVENT_NAMES.items() if mask & bit]
    return "|".join(names) or hex(mask)


@gpu_check
def temperature(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    tmax = int(ctx.hc["max_temperature_c"])
    j.reading("temperature", g, g.temperature_c, "temperature",
              lambda v: (FAIL, g, f"temperature {v} C >= {tmax} C",
                         "check cooling (fans, airflow, liquid loop) before returning the node to service")
              if v >= tmax else None)


@gpu_check
def clock_events(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    mask = int(ctx.hc["clock_event_mask"])
    j.reading("clock_events", g, g.clock_event_reasons, "clock event reasons",
              lambda v: (FAIL, g, f"hardware clock slowdown active: {reasons(v & mask)}",
                         "HW slowdown/power brake means thermal, power-supply or board trouble: inspect the chassis")
              if v & mask else None)


def power_capped(limit_mw: int, default_mw: int, tolerance_pct: float) -> bool:
    return limit_mw < default_mw * (1 - tolerance_pct / 100.0)


@gpu_check
def power_cap(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """Enforced limit below the board's default by more than health.power_cap_tolerance_pct.  We never
    lower a limit, so a cap is someone else's (an admin, a BMC, a tool): a warning by default."""
    if not j.enabled("power_cap"):
        return
    lim, dflt = g.power_limit_mw, g.power_default_limit_mw
    bad = next((r for r in (lim, dflt) if r.failed), None)
    if bad is not None:
        j.add("power_cap", FAIL, g, f"cannot read power limits: {bad.error} ({bad.function})")
    elif not (lim.ok and dflt.ok):
        r = lim if not lim.ok else dflt
        j.add("power_cap", SKIP, g, f"power limits not available ({r.error or 'unsupported'})")
    elif power_capped(int(lim.value), int(dflt.value), float(ctx.hc["power_cap_tolerance_pct"])):
        j.add("power_cap", FAIL, g, f"power capped at {lim.value // 1000} W, board default {dflt.value // 1000} W",
              "nvidia-smi -i <index> -pl <default W> restores it (or set hooks.reset_power_limit = true); "
              "check who set it: a BMC or DCGM power policy may set it again")
    else:
        j.add("power_cap", PASS, g, f"power limit {lim.value // 1000} W (default {dflt.value // 1000} W)")


@gpu_check
def fans(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """A fan at 0 % or under half its target on a warm GPU.  Passively cooled boards (no fans, or
    nvmlDeviceGetNumFans NOT_SUPPORTED) SKIP."""
    if not j.enabled("fans"):
        return
    r = g.fans
    if r.failed:
        j.add("fans", FAIL, g, f"cannot read fans: {r.error} ({r.function})")
        return
    if r.unsupported or not r.value:
        j.add("fans", SKIP, g, "no fans (passively cooled)" if r.ok else f"fans not available ({r.error})")
        return
    broken = next((f for f in r.value if f.speed_pct.failed), None)
    if broken is not None:
        j.add("fans", FAIL, g, f"cannot read fan {broken.fan}: {broken.speed_pct.error} ({broken.speed_pct.function})")
        return
    temp = g.temperature_c.get()
    bad = [f for f in r.value if _fan_short(f.speed_pct.get(), f.target_pct.get())]
    if bad and temp is not None and temp >= FAN_WARM_C:
        f = bad[0]
        target = f" (target {f.target_pct.value} %)" if f.target_pct.ok else ""
        j.add("fans", FAIL, g, f"fan {f.fan} at {f.speed_pct.value} %{target} at {temp} C",
              "a stopped or failing fan overheats the GPU under load: replace the fan or the card")
        return
    speeds = ", ".join(f"{f.speed_pct.value} %" for f in r.value if f.speed_pct.ok)
    j.add("fans", PASS, g, f"{len(r.value)} fan(s) {speeds}")


def _fan_short(speed: Optional[int], target: Optional[int]) -> bool:
    if speed is None:
        return False
    return speed == 0 or (target is not None and target > 0 and speed < target / 2)


# Clocks stuck low during a busy job ("stuck in P8").  The epilog judges each whole GPU of the job
# once, on the job's mean utilisation (the driver's accounting) and the clocks it reads at the
# job's end (a point reading: docs/hooks.md says what it cannot see); the verdict is a health
# event, which healthcheck and `check` WARN on while it is recent (stuck_clocks_recorded).
GPU_IDLE, APPLICATIONS_CLOCKS = 0x1, 0x2


def stuck_clocks(j: Judge, g: GpuSnapshot, util_pct: Optional[float], hc: Dict[str, Any]) -> None:
    """One GPU at the job's end: SM clock under stuck_clocks_ratio_pct of its maximum after a job at
    stuck_clocks_busy_pct or more, with no clock event reason at all.  Every explained low clock SKIPs."""
    busy = float(hc["stuck_clocks_busy_pct"])
    if util_pct is None:
        j.add("stuck_clocks", SKIP, g, "job utilisation unknown (accounting off or unreadable): clocks not judged")
        return
    if util_pct < busy:
        j.add("stuck_clocks", PASS, g, f"job at {util_pct:g} % utilisation (< {busy:g} %): clocks not judged")
        return
    clk, top, why = g.sm_clock_mhz, g.sm_clock_max_mhz, g.clock_event_reasons
    bad = next((r for r in (clk, top) if not r.ok or not r.value), None)
    if bad is not None:
        j.add("stuck_clocks", SKIP, g, f"SM clock not available ({bad.error or 'no maximum'}, {bad.function})")
        return
    sampled = f"SM clock {clk.value} of {top.value} MHz"
    if clk.value * 100 >= top.value * float(hc["stuck_clocks_ratio_pct"]):
        j.add("stuck_clocks", PASS, g, f"{sampled} at the job's end")
        return
    explained = _low_clock_explained(why)
    if explained:
        j.add("stuck_clocks", SKIP, g, f"{sampled} at the job's end, explained: {explained}")
        return
    pstate = f" in P{g.performance_state.value}" if g.performance_state.ok else ""
    j.add("stuck_clocks", FAIL, g, f"{sampled}{pstate} ({100 * clk.value // top.value} %) after a job at "
          f"{util_pct:g} % utilisation, no clock event reason and no application or locked clocks",
          "clocks stuck low under load (a GPU stuck in P8): look at nvidia-smi -q -d PERFORMANCE,CLOCK under load; "
          "a GPU reset (nvidia-smi -r, idle GPU) or a reboot clears it, a GPU where it returns is an RMA case")


def _low_clock_explained(reasons_reading: Any) -> str:
    """Why a low clock at the job's end is no stuck clock ('' when nothing explains it)."""
    if not reasons_reading.ok:
        return f"clock event reasons not available ({reasons_reading.error}): a throttle cannot be ruled out"
    mask = int(reasons_reading.value)
    if mask & APPLICATIONS_CLOCKS:
        return "application or locked clocks set (ApplicationsClocksSetting)"
    if mask & ~(GPU_IDLE | APPLICATIONS_CLOCKS):
        return f"throttled ({reasons(mask & ~GPU_IDLE)})"
    if mask & GPU_IDLE:
        return "the driver reports the GPU idle (GpuIdle), as after any job: an idle clock is no stuck one"
    return ""


@gpu_check
def stuck_clocks_recorded(j: Judge, g: GpuSnapshot, ctx: Context) -> None:
    """healthcheck and `check`: WARN on a stuck clock an epilog recorded on this GPU within
    stuck_clocks_recent_s (nothing in the prolog and epilog, which do not read the records)."""
    if ctx.recorded_events is None or not j.enabled("stuck_clocks"):
        return
    if ctx.recorded_problem:
        j.add("stuck_clocks", SKIP, g, f"epilog records not readable ({ctx.recorded_problem})")
        return
    uuid = g.uuid.get()
    mine = [e for e in ctx.recorded_events if e.get("check_name") == "stuck_clocks" and uuid and e.get("gpu_uuid") == uuid]
    if not mine:
        j.add("stuck_clocks", PASS, g, "no stuck clocks recorded by recent epilogs")
        return
    last = max(mine, key=lambda e: e["time"])
    detail = str(last["message"])
    if detail.startswith(g.label + " "):
        detail = detail[len(g.label) + 1:]
    more = f" (+{len(mine) - 1} more)" if len(mine) > 1 else ""
    j.add("stuck_clocks", FAIL, g, f"clocks stuck low in job {last.get('job_id')}{more}: {detail}",
          "clocks stuck low under load (a GPU stuck in P8): a GPU reset (nvidia-smi -r) or a reboot clears it; "
          "the WARN ends health.stuck_clocks_recent_s after the last such job")
