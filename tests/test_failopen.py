"""Hooks fail open for real, and never silently: broken config files, hostile SLURM_* values,
bugs that raise anything at all.  Each test runs the real hook entry (``run_hook`` or the
console entry in a subprocess) and is named after the failure it reproduces.
"""
from __future__ import annotations

import os
import re
import sqlite3
import stat
import subprocess
import sys
import threading
import time

import pytest
import simgpu
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_gpu import config
from slurm_gpu.errors import ConfigError, SlurmError
from slurm_gpu.hooks import main as hookmain
from slurm_gpu.slurm import backend as slurm_backend
from slurm_gpu.slurm import model as slurm

PROLOG = "from slurm_gpu.hooks.main import prolog_main; prolog_main()"


def job_env(gpus="0", **extra):
    env = {"SLURM_JOB_ID": "4711", "SLURM_JOB_GPUS": gpus, "SLURMD_NODENAME": "gpu01", "SLURM_CLUSTER_NAME": "sgtest",
           "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "2501", "SLURM_JOB_RESTART_COUNT": "0"}
    env.update(extra)
    return env


@pytest.fixture
def fallback(tmp_path):
    """The config-independent error log, redirected into the test's directory (a new folder)."""
    return tmp_path / "fallback" / "hooks-error.log"


def hook_env(node, fallback, **extra):
    # A Slurm that cannot be reached, quickly: a drain attempt fails and the prolog exits 1.
    return node.env(**dict(job_env(), SLURM_GPU_FALLBACK_LOG=str(fallback), SLURM_CONF="/nonexistent/slurm.conf",
                           **extra))


def run_prolog(env, code=PROLOG, timeout=60):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def events(path):
    """The event names of the fallback log: '<time> <hook> <event> key=value ...'."""
    return [ln.split()[2] for ln in lines(path)]


def job_starts(node):
    if not node.db.exists():
        return 0
    conn = sqlite3.connect(str(node.db))
    try:
        return conn.execute("SELECT count(*) FROM job_starts").fetchone()[0]
    finally:
        conn.close()


# ------------------------------------------------------------------ 1. fail_open really holds

def test_prolog_fails_open_when_config_path_is_a_directory(sim_node, tmp_path, fallback):
    node = sim_node()
    (tmp_path / "conf.d").mkdir()
    cp = run_prolog(hook_env(node, fallback, SLURM_GPU_CONFIG=str(tmp_path / "conf.d")))
    assert cp.returncode == 0, cp.stderr
    assert "Traceback" not in cp.stderr
    (line,) = lines(fallback)
    assert "config-error" in line and "not a regular file" in line


def test_prolog_fails_open_when_config_path_is_a_fifo(sim_node, tmp_path, fallback):
    node = sim_node()
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)  # nobody ever writes: a blocking open() would wait forever
    t0 = time.monotonic()
    cp = run_prolog(hook_env(node, fallback, SLURM_GPU_CONFIG=str(fifo)), timeout=20)
    assert time.monotonic() - t0 < 10
    assert cp.returncode == 0 and "Traceback" not in cp.stderr
    (line,) = lines(fallback)
    assert "config-error" in line and "not a regular file" in line


def test_prolog_does_not_hang_when_log_file_is_a_fifo(sim_node, tmp_path, fallback):
    node = sim_node()
    fifo = tmp_path / "hooks.fifo"
    os.mkfifo(fifo)
    node.write_config('[log]\nsyslog = false\nfile = "%s"\n' % fifo)
    t0 = time.monotonic()
    cp = run_prolog(hook_env(node, fallback), timeout=20)
    assert cp.returncode == 0 and time.monotonic() - t0 < 10, cp.stderr[-2000:]
    assert "log-file-error" in cp.stderr


def test_watchdog_is_armed_before_the_config_is_read(tmp_path, fallback, monkeypatch):
    fired = threading.Event()
    codes = []

    def fake_exit(code):
        codes.append(code)
        fired.set()

    def stuck_load(*a, **kw):  # like a config file on a hung NFS mount
        fired.wait(10)
        raise ConfigError("config read interrupted", "")

    monkeypatch.setattr(hookmain, "_exit", fake_exit)
    monkeypatch.setattr(hookmain, "_default_deadline", lambda name: 0.3, raising=False)
    monkeypatch.setattr(config, "load", stuck_load)
    t0 = time.monotonic()
    hookmain.run_hook("prolog", lambda job, deps: 0, env=dict(job_env(), SLURM_GPU_FALLBACK_LOG=str(fallback)))
    assert time.monotonic() - t0 < 5 and codes == [0]
    assert any("deadline-exceeded" in ln for ln in lines(fallback))


def test_prolog_fails_open_on_a_ten_thousand_digit_gpu_index(sim_node, fallback):
    node = sim_node()
    cp = run_prolog(hook_env(node, fallback, SLURM_JOB_GPUS="1" * 10_000))
    assert cp.returncode == 0 and "Traceback" not in cp.stderr, cp.stderr[-2000:]
    (line,) = lines(fallback)
    assert "bad-environment" in line and "out of range" in line and len(line) < 1000


@pytest.mark.parametrize("var,value", [("SLURM_JOB_ID", "47\udcff11"), ("SLURMD_NODENAME", "gpu\udcff01")])
def test_prolog_fails_open_on_non_utf8_job_id_or_node_name_with_syslog_on(sim_node, fallback, var, value):
    node = sim_node()
    node.write_config('[log]\nsyslog = true\nfile = "%s"\n' % (node.tmp / "hooks.log"))
    cp = run_prolog(hook_env(node, fallback, **{var: value}))  # subprocess passes it as the byte 0xff
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert "Traceback" not in cp.stderr
    (line,) = lines(fallback)
    assert "bad-environment" in line and "\\udcff" in line
    assert "bad-environment" in node.log_text()


def test_nan_prolog_deadline_is_refused_and_the_prolog_still_checks_the_gpus(sim_node, fallback):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config("[hooks]\nprolog_deadline_s = nan\n", slurm_timeout_s=2.0)
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=2)
    cp = run_prolog(hook_env(node, fallback))
    assert cp.returncode == 1, (cp.stderr[-2000:], node.log_text())  # the faulty GPU was found
    assert "ecc_uncorrectable" in node.log_text()
    (line,) = [ln for ln in lines(fallback) if "config-error" in ln]
    assert "hooks.prolog_deadline_s" in line and "finite" in line


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3), GeneratorExit(), RuntimeError("boom")])
def test_anything_raised_by_the_flow_fails_open_with_one_line(sim_node, fallback, exc):
    node = sim_node()

    def flow(job, deps):
        raise exc

    env = hook_env(node, fallback)
    assert hookmain.run_hook("prolog", flow, env=env) == 0
    (line,) = lines(fallback)
    assert "internal-error" in line and type(exc).__name__ in line and "job=4711" in line
    node.write_config("[hooks]\nfail_open = false\n")
    assert hookmain.run_hook("prolog", flow, env=env) == 1


def test_prolog_fails_open_when_the_hooks_module_cannot_be_imported(sim_node, fallback):
    node = sim_node()
    code = "import sys; sys.modules['slurm_gpu.hooks.flows'] = None; " + PROLOG  # as if hooks.py were broken
    cp = run_prolog(hook_env(node, fallback), code=code)
    assert cp.returncode == 0 and "Traceback (most recent call last)" not in cp.stderr, cp.stderr[-2000:]
    assert len(cp.stderr.splitlines()) == 1
    (line,) = lines(fallback)
    assert "internal-error" in line and "slurm_gpu.hooks.flows" in line


# ------------------------------------------------------------------ 2. ASCII digits only

@pytest.mark.parametrize("var,value", [("SLURM_JOB_ID", "\u0664\u0665"), ("SLURM_JOB_ID", "1_000"),
                                       ("SLURM_JOB_ID", "+45"), ("SLURM_JOB_UID", "\uff11"),
                                       ("SLURM_JOB_RESTART_COUNT", "\u0661"), ("SLURM_JOB_GPUS", "0,\u0663")])
def test_non_ascii_digits_are_not_a_job_id(sim_node, fallback, var, value):
    node = sim_node()
    ran = []
    code = hookmain.run_hook("prolog", lambda job, deps: ran.append(job) or 0, env=hook_env(node, fallback, **{var: value}))
    assert code == 0 and ran == []
    (line,) = lines(fallback)
    assert "bad-environment" in line and var in line


_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=30) | st.sampled_from(["", "0", "4095", "1" * 5000, "\udcff"])


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={k: _ANY_TEXT for k in (
    "SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURMD_NODENAME", "SLURM_JOB_UID", "SLURM_JOB_RESTART_COUNT", "SLURM_JOB_USER")}))
def test_any_environment_is_a_job_or_one_input_error(env):
    from slurm_gpu.errors import InputError
    from slurm_gpu.slurm.jobenv import MAX_GPU_INDEX, MAX_ID, from_env
    try:
        job = from_env(env, default_node="n1")
    except InputError as e:
        assert len(e.message) < 300 and "\n" not in e.message
        e.message.encode("utf-8")
        return
    assert 0 <= job.job_id <= MAX_ID and all(0 <= g <= MAX_GPU_INDEX for g in job.gpus)
    job.node.encode("utf-8"), job.user.encode("utf-8")


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(exclude_categories=()), max_size=40))
def test_any_value_makes_one_printable_log_line(value):
    from slurm_gpu.hooks.log import HookLog
    line = HookLog("prolog", syslog_on=False, level="error").info("x", job=value, node=value)
    assert line.isprintable() and len(line.splitlines()) == 1
    line.encode("utf-8")


# ------------------------------------------------------------------ 3. config errors are loud, gating goes on

def test_unknown_config_key_no_longer_switches_gating_off(sim_node, fallback):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config("[health]\nmax_temprature_c = 95\n", slurm_timeout_s=2.0)
    simgpu.set_gpu(node.state, 0, ecc_volatile_uncorrected=2)
    cp = run_prolog(hook_env(node, fallback))
    assert cp.returncode == 1, (cp.stderr[-2000:], node.log_text())  # gated with the defaults
    (line,) = lines(fallback)
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S* prolog config-error job=4711 node=gpu01 ", line), line
    assert "unknown key 'health.max_temprature_c'" in line and "hint=" in line


def test_bad_config_value_uses_that_keys_default_and_records_the_job(sim_node, fallback):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config("[health]\nmax_temperature_c = 500\n[hooks]\nprolog_deadline_s = 'long'\n")
    cp = run_prolog(hook_env(node, fallback))
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert job_starts(node) == 1  # accounting still on
    errs = lines(fallback)
    assert len(errs) == 2 and "health.max_temperature_c" in errs[0] and "hooks.prolog_deadline_s" in errs[1]
    assert node.log_text().count("config-error") == 2


def test_unparseable_config_fails_open_and_says_so_in_the_fallback_log(sim_node, fallback):
    node = sim_node()
    node.config.write_text("[health\n")
    cp = run_prolog(hook_env(node, fallback))
    assert cp.returncode == 0 and "Traceback" not in cp.stderr
    (line,) = lines(fallback)
    assert "config-error" in line and "invalid TOML" in line and "hint=" in line


def test_fallback_log_is_root_only_and_created_with_its_directory(sim_node, fallback):
    node = sim_node()
    node.config.write_text("colour = 1\n")
    run_prolog(hook_env(node, fallback, SLURM_JOB_GPUS=""))
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o600
    assert stat.S_IMODE(fallback.parent.stat().st_mode) in (0o700, 0o755)


def test_fallback_log_never_follows_a_symlink(sim_node, tmp_path, fallback):
    node = sim_node()
    node.config.write_text("[health\n")
    target = tmp_path / "elsewhere"
    target.write_text("")
    fallback.parent.mkdir()
    fallback.symlink_to(target)
    cp = run_prolog(hook_env(node, fallback))
    assert cp.returncode == 0 and target.read_text() == ""
    assert "fallback" in cp.stderr and "Traceback" not in cp.stderr


def test_nvml_failure_under_a_broken_config_fails_open_instead_of_draining(sim_node, fallback):
    # A misspelt nvml_library key leaves the default library path: NVML may not load because of
    # our config, not because of the node. That must not drain nodes.
    node = sim_node()
    node.write_config(nvml_libary="/opt/nvidia/libnvidia-ml.so.1", slurm_timeout_s=2.0)
    node.state.unlink()  # the simulated driver answers DRIVER_NOT_LOADED
    cp = run_prolog(hook_env(node, fallback))
    assert cp.returncode == 0, (cp.stderr[-2000:], node.log_text())
    assert events(fallback) == ["config-error", "nvml-unavailable"]
    assert "prolog drain" not in node.log_text()


# ------------------------------------------------------------------ 3c. healthcheck tells Slurm

class FakeSlurm(slurm.SlurmBackend):
    name = "fake"
    timeout_s = 1.0

    def __init__(self, state="IDLE", reason=""):
        self.info = slurm.NodeInfo("gpu01", state, slurm.split_state(state), reason, "root" if reason else "",
                                   1700000000.0 if reason else None, "gpu:h100:4", "", 4, 0)
        self.actions = []

    def node(self, name):
        return self.info

    def nodes(self, names=None):
        return [self.info]

    def drain(self, name, reason):
        self.actions.append(("drain", name, reason))

    def resume(self, name):
        self.actions.append(("resume", name))

    def job(self, job_id):
        raise SlurmError("no jobs here", "")


def healthcheck(monkeypatch, cfg_path, backend, fallback):
    from slurm_gpu.cli import main
    monkeypatch.setattr(slurm_backend, "get_backend", lambda cfg: backend)
    monkeypatch.setenv("SLURM_GPU_FALLBACK_LOG", str(fallback))
    return CliRunner().invoke(main, ["--config", str(cfg_path), "healthcheck", "--node", "gpu01"])


def test_healthcheck_with_a_config_typo_exits_2_with_one_line_and_does_not_drain(sim_node, monkeypatch, fallback):
    node = sim_node()
    node.write_config("[health]\nmax_temprature_c = 95\n")
    backend = FakeSlurm()
    r = healthcheck(monkeypatch, node.config, backend, fallback)
    assert r.exit_code == 2
    (err,) = r.stderr.splitlines()
    assert "max_temprature_c" in err and "slurm-gpu check" in err and "default" in err
    assert backend.actions == []
    assert "config-error" in lines(fallback)[0]


def test_healthcheck_drains_while_the_config_is_unusable_and_resumes_once_fixed(sim_node, monkeypatch, fallback):
    node = sim_node(simgpu.h100_sxm(4))
    good = node.config.read_text()
    node.config.write_text("[health\n")
    backend = FakeSlurm()
    r = healthcheck(monkeypatch, node.config, backend, fallback)
    assert r.exit_code == 2
    (err,) = r.stderr.splitlines()
    assert "invalid TOML" in err and "OFF" in err
    ((what, name, reason),) = backend.actions
    assert (what, name) == ("drain", "gpu01")
    assert reason.startswith("slurm-gpu: config ") and "gating off" in reason and reason.endswith("[healthcheck; check config]")
    # Fixed: the next healthcheck finds its own drain and lifts it.
    node.config.write_text(good)
    monkeypatch.setenv("SIMNVML_STATE", str(node.state))
    backend = FakeSlurm("IDLE+DRAIN", reason)
    r = healthcheck(monkeypatch, node.config, backend, fallback)
    assert r.exit_code == 0, r.output
    assert backend.actions == [("resume", "gpu01")]


def test_slurm_gpu_check_is_still_strict_about_config_errors(sim_node):
    from slurm_gpu.cli import main
    node = sim_node()
    node.write_config(colour=1)
    r = CliRunner().invoke(main, ["--config", str(node.config), "check"])
    assert r.exit_code == 2 and "unknown key 'colour'" in r.stderr
