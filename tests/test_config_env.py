"""Config file validation, Slurm hook environment parsing and kernel-log XID parsing."""
from __future__ import annotations

import os
import pathlib

import pytest

from slurm_gpu import config
from slurm_gpu.errors import ConfigError, InputError
from slurm_gpu.jobenv import from_env, parse_job_gpus
from slurm_gpu.xid import bus_key, parse_line

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def write(tmp_path, text, mode=0o644):
    p = tmp_path / "config.toml"
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


def test_defaults_when_default_file_absent(monkeypatch):
    monkeypatch.delenv("SLURM_GPU_CONFIG", raising=False)
    monkeypatch.setattr(config, "DEFAULT_PATH", "/nonexistent/slurm-gpu.toml")
    cfg = config.load(env={})
    assert cfg.get("health", "max_temperature_c") == 87 and cfg.nvml_timeout_s == 5.0


@pytest.mark.parametrize("text,needle", [
    ("colour = 1\n", "unknown key 'colour'"),
    ("[health]\nmax_temp = 3\n", "unknown key 'health.max_temp'"),
    ("[health]\nmax_temperature_c = \"hot\"\n", "key 'health.max_temperature_c' must be an integer"),
    ("[health]\nmax_temperature_c = 500\n", "key 'health.max_temperature_c' must be <= 120"),
    ("nvml_timeout_s = 0\n", "key 'nvml_timeout_s' must be >= 0.1"),
    ("slurm_backend = \"rest\"\n", "must be one of 'auto', 'cli', 'pyslurm'"),
    ("[xid]\nsource = \"syslog\"\n", "key 'xid.source' must be"),
    ("[xid]\nignore = [13, \"x\"]\n", "key 'xid.ignore' must be a list of XID numbers"),
    ("[health.severity]\ntempurature = \"warn\"\n", "unknown check 'tempurature'"),
    ("[hooks]\nfail_open = 1\n", "key 'hooks.fail_open' must be true or false"),
    ("[health\n", "invalid TOML"),
])
def test_bad_config_is_one_line_naming_key_and_file(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        config.load(path)
    assert needle in e.value.message and path in e.value.message and "\n" not in e.value.message


def test_explicit_missing_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(str(tmp_path / "nope.toml"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership rule applies to root only")
def test_root_refuses_group_or_world_writable_config(tmp_path):
    path = write(tmp_path, "nvml_timeout_s = 3\n", mode=0o666)
    with pytest.raises(ConfigError, match="writable by non-root") as e:
        config.load(path)
    assert "chmod 644" in e.value.hint
    os.chmod(path, 0o644)
    os.chown(path, 1234, 0)
    with pytest.raises(ConfigError, match="owner uid 1234"):
        config.load(path)


def test_config_beside_slurm_conf_is_found(tmp_path):
    (tmp_path / "slurm.conf").write_text("")
    write(tmp_path, "")
    (tmp_path / "slurm-gpu.toml").write_text("[health]\nmax_temperature_c = 80\n")
    os.chmod(tmp_path / "slurm-gpu.toml", 0o644)
    cfg = config.load(env={"SLURM_CONF": str(tmp_path / "slurm.conf")})
    assert cfg.get("health", "max_temperature_c") == 80


def test_percent_n_expands_to_slurm_node_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu17")
    cfg = config.load(write(tmp_path, '[store]\ndatabase = "/var/lib/slurm-gpu/%n/usage.db"\n'))
    assert cfg.path_value("store", "database") == "/var/lib/slurm-gpu/gpu17/usage.db"


def test_docs_config_reference_lists_every_key():
    text = (DOCS / "config.md").read_text()
    assert config.reference_markdown() in text, "regenerate docs/config.md: python -m slurm_gpu.config"


# --- Slurm hook environment --------------------------------------------------------------------

def test_job_gpus_parsing():
    assert parse_job_gpus("0,1") == (0, 1)
    assert parse_job_gpus("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_job_gpus("") == () and parse_job_gpus(None) == ()
    for bad in ("0,x", "3-1", "-1", "0;rm -rf /"):
        with pytest.raises(InputError, match="SLURM_JOB_GPUS"):
            parse_job_gpus(bad)


@pytest.mark.parametrize("env,needle", [
    ({}, "SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a' is not an integer"),
    ({"SLURM_JOB_ID": "5", "SLURM_JOB_RESTART_COUNT": "x"}, "SLURM_JOB_RESTART_COUNT='x'"),
    ({"SLURM_JOB_ID": "5", "SLURM_JOB_UID": "-3"}, "SLURM_JOB_UID='-3' is negative"),
])
def test_malformed_environment_names_the_variable(env, needle):
    env = dict(env, SLURMD_NODENAME="n1")
    with pytest.raises(InputError) as e:
        from_env(env)
    assert needle in e.value.message


def test_full_environment():
    j = from_env({"SLURM_JOB_ID": "4711", "SLURM_JOB_GPUS": "2,3", "SLURMD_NODENAME": "gpu01",
                  "SLURM_CLUSTER_NAME": "c", "SLURM_JOB_USER": "alice", "SLURM_JOB_UID": "1000",
                  "SLURM_JOB_ACCOUNT": "phys", "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_RESTART_COUNT": "2",
                  "SLURM_JOB_EXIT_CODE": "256"})
    assert (j.job_id, j.gpus, j.node, j.restart_count, j.uid, j.exit_code) == (4711, (2, 3), "gpu01", 2, 1000, "256")


# --- XID lines ----------------------------------------------------------------------------------

def test_xid_line_formats():
    kmsg = parse_line("3,1234,5000000,-;NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.", boot_time=100.0)
    assert (kmsg.time, kmsg.bus, kmsg.xid) == (105.0, (0, 0x18, 0), 79)
    unix = parse_line("1795000000.5 host kernel: NVRM: Xid (PCI:0000:2a:00): 48, pid=1, DBE")
    assert (unix.time, unix.bus, unix.xid) == (1795000000.5, (0, 0x2A, 0), 48)
    iso = parse_line("2026-11-29T10:00:00+01:00 host kernel: NVRM: Xid (PCI:0001:9a:00): 94, Contained ECC")
    assert iso.time == 1795946400 - 3600 and iso.bus == (1, 0x9A, 0)
    assert parse_line("1795000000.5 host kernel: usb 1-1: new device") is None
    assert bus_key("00000000:18:00.0") == bus_key("0000:18:00")
