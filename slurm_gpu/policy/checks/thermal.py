"""Thermal, power and clock checks: temperature, hardware clock slowdowns, a power limit capped
below the board's default, and fans."""
from __future__ import annotations

from typing import Optional

from slurm_gpu.gpu.snapshot import GpuSnapshot
from slurm_gpu.policy.checks import gpu_check
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
