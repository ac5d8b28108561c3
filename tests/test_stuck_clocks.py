"""Clocks stuck low during a busy job (issue 25, "stuck in P8"): the epilog judges the job's GPUs on
the job's mean utilisation (the driver's accounting) against the SM clock it reads at the job's
end, records a stuck clock as a health event, and healthcheck (and `check`) WARN on it while it
is recent.  A point reading at the job's end cannot tell much: every case where a low clock is
explained (application/locked clocks, a throttle reason, the GPU reported idle) or the job was
not busy records nothing."""
from __future__ import annotations

import pytest
import simgpu
from test_check import check_in_process
from test_hooks import deps_for, job_env, rows

from slurm_gpu import config
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.policy import health
from slurm_gpu.slurm.jobenv import from_env

T0 = 1_800_000_000.0
DURATION_S = 100


def _busy_job(node, util_pct=95, gpus="0,1", **stuck_fields):
    """Prolog, a job keeping GPU 1 busy at util_pct for the whole job (GPU 0 at 90 %), the fields on
    GPU 1 at the job's end, and the epilog."""
    clock = {"t": T0}
    env = job_env(gpus=gpus)
    assert hooks.prolog(from_env(env), deps_for(node, now=lambda: clock["t"])) == 0
    start_us = int((T0 + 1) * 1e6)
    for i, util in ((0, 90), (1, util_pct)):
        simgpu.set_gpu(node.state, i, acct=[dict(pid=100 + i, gpu_util=util, mem_util=20, max_mem_bytes=1 << 30,
                                                 time_ms=DURATION_S * 1000, start_time_us=start_us, is_running=0)])
    simgpu.set_gpu(node.state, 1, **stuck_fields)
    clock["t"] = T0 + DURATION_S
    assert hooks.epilog(from_env(dict(env, SLURM_JOB_EXIT_CODE="0")), deps_for(node, now=lambda: clock["t"])) == 0


def _stuck_events(node):
    return rows(node.db, "SELECT gpu_index, status, message, job_id, source FROM health_events "
                         "WHERE check_name = 'stuck_clocks'")


# The stuck signature: a busy job, the SM clock at an idle clock, and the driver names no reason.
STUCK = {"clock.sm_mhz": 210, "clock_event_reasons": 0, "pstate": 8}


def test_epilog_records_clocks_stuck_low_on_a_busy_gpu_and_healthcheck_warns(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    _busy_job(node, **STUCK)
    (ev,) = _stuck_events(node)
    assert (ev["gpu_index"], ev["status"], ev["job_id"], ev["source"]) == (1, "WARN", 4711, "epilog")
    assert "SM clock 210 of 1980 MHz" in ev["message"] and "95 % utilisation" in ev["message"], ev
    assert "P8" in ev["message"] and "no clock event reason" in ev["message"]
    # The next healthcheck (or `slurm-gpu check`) WARNs on that GPU with the sampled clocks; the other passes.
    simgpu.set_gpu(node.state, 1, clock_event_reasons=simgpu.CLOCK_GPU_IDLE)  # idle now, as after any job
    results = check_in_process(node)
    warn = [r for r in results if r.check == "stuck_clocks" and r.gpu_index == 1]
    assert [r.status for r in warn] == ["WARN"], results
    assert "job 4711" in warn[0].message and "SM clock 210 of 1980 MHz" in warn[0].message and warn[0].hint
    assert warn[0].message.count("GPU 1 (") == 1, warn[0].message
    assert [r.status for r in results if r.check == "stuck_clocks" and r.gpu_index == 0] == ["PASS"]
    assert health.worst(results) == "WARN"  # a warning: nothing drains for it by default


def test_stuck_clocks_recorded_long_ago_no_longer_warn(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    _busy_job(node, **STUCK)
    cfg = config.load(str(node.config))
    recent = cfg.get("health", "stuck_clocks_recent_s")
    with NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s) as r:
        _snap, results = hooks.check_node(cfg, reader=r, now=T0 + DURATION_S + recent + 1)
    assert [x.status for x in results if x.check == "stuck_clocks" and x.gpu_index == 1] == ["PASS"]


# (case, fields on GPU 1 at the job's end, the job's utilisation on GPU 1, status, words of the verdict)
NO_EVENT = [
    ("clock-not-supported", dict(STUCK), 95, "SKIP", "SM clock not available"),
    ("app-clocks-set", dict(STUCK, clock_event_reasons=0x2), 95, "SKIP", "application or locked clocks"),
    ("throttle-reason", dict(STUCK, clock_event_reasons=0x4), 95, "SKIP", "SwPowerCap"),
    ("gpu-reported-idle", dict(STUCK, clock_event_reasons=simgpu.CLOCK_GPU_IDLE), 95, "SKIP", "GpuIdle"),
    ("idle-job", dict(STUCK), 10, "PASS", "10 % utilisation"),
    ("clock-near-max", dict(STUCK, **{"clock.sm_mhz": 1800}), 95, "PASS", "SM clock 1800 of 1980 MHz"),
]


@pytest.mark.parametrize("case,fields,util,status,words", NO_EVENT, ids=[c[0] for c in NO_EVENT])
def test_stuck_clocks_records_nothing_when_the_low_clock_is_explained_or_the_job_idle(sim_node, case, fields, util,
                                                                                       status, words):
    node = sim_node(simgpu.h100_sxm(2))
    if case == "clock-not-supported":
        simgpu.inject_error(node.state, 1, "nvmlDeviceGetClockInfo", simgpu.NOT_SUPPORTED)
    _busy_job(node, util_pct=util, **fields)
    assert _stuck_events(node) == []
    simgpu.set_gpu(node.state, 1, **fields)  # the epilog's clock reset cleared ApplicationsClocksSetting
    cfg = config.load(str(node.config))
    with NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s) as r:
        snap = r.snapshot([1])
    (res,) = health.judge_stuck_clocks(snap, {1: float(util)}, cfg)
    assert res.status == status and words in res.message, res


def test_stuck_clocks_not_judged_without_the_jobs_utilisation(sim_node, monkeypatch):
    node = sim_node(simgpu.h100_sxm(1))
    monkeypatch.setenv("SIMNVML_STATE", str(node.state))  # the in-process reader's GPUs: this node's
    cfg = config.load(str(node.config))
    simgpu.set_gpu(node.state, 0, **STUCK)
    with NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s) as r:
        snap = r.snapshot([0])
    (res,) = health.judge_stuck_clocks(snap, {0: None}, cfg)
    assert res.status == "SKIP" and "utilisation unknown" in res.message


def test_stuck_clocks_severity_off_records_nothing(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config('[health.severity]\nstuck_clocks = "off"\n')
    _busy_job(node, **STUCK)
    assert _stuck_events(node) == []
    assert not [r for r in check_in_process(node) if r.check == "stuck_clocks"]
