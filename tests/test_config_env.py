"""Config file validation, Slurm hook environment parsing and kernel-log XID parsing."""
from __future__ import annotations

import os
import pathlib

import pytest

from slurm_gpu import config
from slurm_gpu.errors import ConfigError, InputError
from slurm_gpu.gpu.xid import bus_key, parse_line
from slurm_gpu.slurm.jobenv import from_env, parse_job_gpus

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


@pytest.mark.parametrize("text", [
    "[hooks]\nprolog_deadline_s = nan\n", "nvml_timeout_s = inf\n", "[report]\nidle_threshold_pct = -nan\n",
    "[store]\nbusy_timeout_s = " + "9" * 400 + "\n",
], ids=["nan", "inf", "-nan", "400-digits"])
def test_nan_and_inf_are_refused_for_float_keys(tmp_path, text):
    # nan passes every range check (all comparisons are false): a nan deadline ended hooks at once.
    with pytest.raises(ConfigError, match="must be a finite number"):
        config.load(write(tmp_path, text))


def test_config_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a regular file"):
        config.load(str(tmp_path))


def test_lenient_load_collects_every_error_and_keeps_defaults_for_those_keys_only(tmp_path):
    path = write(tmp_path, "colour = 1\nnvml_timeout_s = 3\n[health]\nmax_temperature_c = 500\nmax_retired_pages = 7\n"
                           "[helth]\nx = 1\n[hooks]\nprolog_deadline_s = nan\n")
    cfg, errors = config.load(path, lenient=True)
    assert [e.message.split(": ", 1)[1] for e in errors] == [
        "unknown key 'colour'", "key 'health.max_temperature_c' must be <= 120 (got 500)", "unknown key 'helth'",
        "key 'hooks.prolog_deadline_s' must be a finite number (got nan)"]
    assert (cfg.nvml_timeout_s, cfg.health.max_retired_pages) == (3.0, 7)  # the good keys count
    assert (cfg.health.max_temperature_c, cfg.hooks.prolog_deadline_s) == (87, 30.0)  # the bad ones: defaults
    with pytest.raises(ConfigError, match="unknown key 'colour'"):
        config.load(path)  # commands stay strict


def test_lenient_load_keeps_the_valid_entries_of_a_table(tmp_path):
    path = write(tmp_path, '[health.severity]\npcie_link = "warn"\ntempurature = "off"\n')
    cfg, errors = config.load(path, lenient=True)
    assert cfg.health.severity == {"pcie_link": "warn"}
    (e,) = errors
    assert "unknown check 'tempurature'" in e.message


def test_lenient_load_still_raises_when_the_file_is_not_toml(tmp_path):
    with pytest.raises(ConfigError, match="invalid TOML"):
        config.load(write(tmp_path, "[health\n"), lenient=True)


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


def test_the_typed_sections_are_the_schema():
    """mypy reads each key's type from slurm_gpu/configtypes.py: a key added to SCHEMA without
    regenerating it would be an attribute mypy does not know, one retyped would lie."""
    typed = pathlib.Path(config.__file__).with_name("configtypes.py").read_text()
    assert typed == config.types_source(), "regenerate: python -m slurm_gpu.config --types > slurm_gpu/configtypes.py"


def test_a_section_read_as_an_attribute_is_the_value_get_returns():
    cfg = config.defaults().replace("remediation", verify_passes=5)
    for section, keys in config.SCHEMA.items():
        for key in keys:
            got = getattr(cfg, key) if not section else getattr(getattr(cfg, section), key)
            assert got == cfg.get(section, key)
    assert cfg.remediation.verify_passes == 5


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


@pytest.mark.parametrize("var,value", [
    ("SLURM_JOB_ID", "\u0664\u0665"), ("SLURM_JOB_ID", "1_000"), ("SLURM_JOB_ID", "+45"), ("SLURM_JOB_ID", "\uff14\uff15"),
    ("SLURM_JOB_UID", "1_000"), ("SLURM_JOB_RESTART_COUNT", "\u0661"), ("SLURM_JOB_ID", "9" * 10_000),
], ids=["arabic-indic", "underscore", "plus", "full-width", "uid-underscore", "restart-arabic-indic", "10000-digits"])
def test_only_ascii_digits_make_a_job_number(var, value):
    # int() takes Arabic-Indic or full-width digits and underscores; Slurm never writes them.
    env = {"SLURM_JOB_ID": "5", "SLURMD_NODENAME": "n1", var: value}
    with pytest.raises(InputError, match=var) as e:
        from_env(env)
    assert len(e.value.message) < 200


@pytest.mark.parametrize("raw,needle", [("\u0663", "not a GPU index"), ("0,1_0", "not a GPU index"),
                                        ("4096", "out of range"), ("1" * 10_000, "out of range"),
                                        ("0-99999", "out of range")],
                         ids=["arabic-indic", "underscore", "4096", "10000-digits", "huge-range"])
def test_gpu_indices_are_small_ascii_numbers(raw, needle):
    with pytest.raises(InputError, match=needle) as e:
        parse_job_gpus(raw)
    assert len(e.value.message) < 200
    assert parse_job_gpus("4095") == (4095,)


def test_non_utf8_node_name_is_refused_and_other_text_is_escaped():
    env = {"SLURM_JOB_ID": "5", "SLURMD_NODENAME": "gpu\udcff", "SLURM_CLUSTER_NAME": "c"}
    with pytest.raises(InputError, match="SLURMD_NODENAME"):
        from_env(env)
    j = from_env(dict(env, SLURMD_NODENAME="gpu01", SLURM_JOB_USER="al\udcffice"))
    assert j.user == "al\\udcffice"
    j.user.encode("utf-8")  # storable


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
