"""The CLI boundary (slurm_gpu/cli): one place turns errors into exit codes, and options are
spelled and mean the same in every command (issue 11, "One CLI boundary, consistent options")."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import click
import pytest
import simgpu
from click.testing import CliRunner

from slurm_gpu.cli import COMMANDS, main
from slurm_gpu.errors import StoreError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NVML_COMMANDS = [["check"], ["snapshot"], ["inventory"], ["gres-conf"], ["healthcheck"], ["drain"]]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


# ------------------------------------------------------------------ 1. one error boundary

def test_domain_error_from_any_command_becomes_message_hint_and_exit_code_at_the_group(monkeypatch):
    @click.command()
    def boom():
        raise StoreError("the database is on fire", "move it aside")

    monkeypatch.setitem(main.commands, "boom", boom)
    r = CliRunner().invoke(main, ["boom"])
    assert r.exit_code == 5
    assert r.stderr == "slurm-gpu: error: the database is on fire\nhint: move it aside\n"
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_no_command_catches_domain_errors_itself():
    for path in (ROOT / "slurm_gpu" / "cli").glob("*.py"):
        if path.name == "__init__.py":  # the boundary itself
            continue
        text = path.read_text()
        assert "raise fail(" not in text, f"{path.name}: let the error reach the group (LazyGroup.invoke)"
        assert "except SlurmGpuError as e:\n        raise fail" not in text


def test_usage_error_in_report_still_exits_2_with_one_line_and_a_hint(tmp_path):
    r = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "x.db"), "--since", "yesterdy"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("slurm-gpu: error: ") and "\nhint: " in r.stderr


# ------------------------------------------------------------------ 2. --nvml-lib everywhere

@pytest.mark.parametrize("cmd", NVML_COMMANDS, ids=lambda c: c[0])
def test_every_nvml_command_documents_nvml_lib(cmd):
    r = CliRunner().invoke(main, [*cmd, "--help"])
    assert r.exit_code == 0 and "--nvml-lib PATH" in r.output


@pytest.mark.parametrize("where", ["after", "before"])
def test_inventory_ignored_nvml_lib_and_used_the_configs_library(sim_node, sim_lib, where):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config(nvml_library="/nonexistent/libnvidia-ml.so.1")
    args = ["inventory", "--nvml-lib", str(sim_lib)] if where == "after" else ["--nvml-lib", str(sim_lib), "inventory"]
    cp = _cli(*args, env=node.env())
    # The simulated GPUs reach past this machine's CPUs (exit 2 on Cores=); what matters: NVML loaded.
    assert cp.returncode != 3 and "libnvidia-ml" not in cp.stderr, cp.stderr
    assert _cli("inventory", env=node.env()).returncode == 3


def test_snapshot_and_gres_conf_take_nvml_lib(sim_node, sim_lib):
    node = sim_node(simgpu.h100_sxm(1))
    node.write_config(nvml_library="/nonexistent/libnvidia-ml.so.1")
    assert _cli("snapshot", env=node.env()).returncode == 3  # the config's library: not found
    assert _cli("snapshot", "--nvml-lib", str(sim_lib), env=node.env()).returncode == 0
    cp = _cli("gres-conf", "--nvml-lib", str(sim_lib), env=node.env())
    assert cp.returncode != 3 and "libnvidia-ml" not in cp.stderr, cp.stderr


# ------------------------------------------------------------------ 3. one output-options decorator

def test_snapshot_json_advertised_in_docs_did_not_exist(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    plain = _cli("snapshot", env=node.env())
    alias = _cli("snapshot", "--json", env=node.env())
    fmt = _cli("snapshot", "--format", "json", env=node.env())
    assert plain.returncode == alias.returncode == fmt.returncode == 0
    assert json.loads(alias.stdout)["gpus"] and json.loads(fmt.stdout)["gpus"]


def test_check_format_json_is_the_same_as_json(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    a = _cli("check", "--json", env=node.env())
    b = _cli("check", "--format", "json", env=node.env())
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout)["status"] == json.loads(b.stdout)["status"] == "PASS"


@pytest.mark.parametrize("cmd", [["check"], ["snapshot"], ["inventory"], ["status"], ["report"], ["report", "jobs"],
                                 ["report", "job"]], ids=" ".join)
def test_every_data_command_takes_format_and_json(cmd):
    out = CliRunner().invoke(main, [*cmd, "--help"]).output
    assert "--format" in out and "--json" in out, out


# ------------------------------------------------------------------ 4. one meaning per flag

def _all_commands():
    for name in COMMANDS:
        cmd = main.get_command(click.Context(main), name)
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                yield f"{name} {sub.name}", sub
            if name == "report":
                yield name, cmd
        else:
            yield name, cmd


def test_short_flag_n_is_dry_run_in_every_command_not_limit():
    seen = {}
    for name, cmd in _all_commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and "-n" in p.opts and not p.hidden:
                seen[name] = p.opts
    assert seen and all(opts == ["--dry-run", "-n"] for opts in seen.values()), seen


def test_node_option_is_a_filter_and_this_node_is_node_name():
    for name, cmd in _all_commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and "--node" in p.opts and not p.hidden:
                assert name.startswith("report"), f"{name}: --node must filter nodes; this node is --node-name"
    for name in ("healthcheck", "drain", "inventory"):
        assert "--node-name NAME" in CliRunner().invoke(main, [name, "--help"]).output


def test_idle_means_only_idle_jobs_and_check_says_require_idle():
    check_help = CliRunner().invoke(main, ["check", "--help"]).output
    assert "--require-idle" in check_help and not re.search(r"--idle\b", check_help)
    assert "--idle " in CliRunner().invoke(main, ["report", "jobs", "--help"]).output


def test_old_spellings_still_work_check_idle_and_inventory_hostname(sim_node, tmp_path):
    node = sim_node(simgpu.h100_sxm(1))
    new = _cli("check", "--json", "--require-idle", env=node.env())
    old = _cli("check", "--json", "--idle", env=node.env())  # hidden alias
    assert new.returncode == old.returncode == 0, old.stderr
    assert json.loads(new.stdout)["results"] == json.loads(old.stdout)["results"]
    snap = tmp_path / "snap.json"
    snap.write_text(_cli("snapshot", env=node.env()).stdout)
    node.write_config(extra=f'[gres]\ncpu_topology_dir = "{tmp_path}/no-topology"\n')
    cp = _cli("inventory", "--snapshot", str(snap), "--hostname", "gpu77", env=node.env())
    assert cp.returncode == 0 and json.loads(cp.stdout)["hostname"] == "gpu77", cp.stderr
    cp = _cli("inventory", "--snapshot", str(snap), "--node-name", "gpu78", env=node.env())
    assert cp.returncode == 0 and json.loads(cp.stdout)["hostname"] == "gpu78", cp.stderr


def test_report_jobs_dash_n_still_limits_but_warns(tmp_path):
    r = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "none.db"), "jobs", "-n", "3"])
    assert "use --limit N" in r.stderr
    assert "no such option" not in r.stderr


# ------------------------------------------------------------------ 5. messages and docs say what exists

def test_healthcheck_message_named_the_gpu_twice(tmp_path, monkeypatch, capsys):
    from test_store_faults import MemSlurm, _app, store_cfg

    from slurm_gpu.cli import admin as cli_admin
    from slurm_gpu.policy.health import CheckResult
    cfg = store_cfg(tmp_path, tmp_path / "u.db", tmp_path / "spool")
    monkeypatch.setattr(cli_admin, "_backend", lambda app: MemSlurm())
    results = [CheckResult("ecc_uncorrectable", "FAIL", 1, "GPU-ab", "GPU 1 (GPU-ab) uncorrectable ECC errors: 2"),
               CheckResult("gpu_count", "WARN", None, "", "3 GPUs, expected 4")]
    with pytest.raises(SystemExit):
        cli_admin._run_health(_app(cfg), "gpu01", allow_resume=True, dry_run=True, deadline_s=30,
                              checker=lambda info: results)
    out = capsys.readouterr().out
    assert "GPU 1 (GPU-ab) uncorrectable" in out and "GPU 1: GPU 1" not in out
    assert "node: 3 GPUs, expected 4" in out


def test_db_check_on_a_missing_database_says_no_database_not_corruption(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\ndatabase = "{tmp_path}/%n/usage.db"\nspool_dir = "{tmp_path}/spool"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "db", "check"], env={"SLURMD_NODENAME": "gpu09"})
    assert r.exit_code == 1
    assert f"no database at {tmp_path}/gpu09/usage.db" in r.stdout
    assert "corrupt" not in r.output + r.stderr
    assert "%n" in r.stderr and "'gpu09'" in r.stderr


def _doc_texts():
    yield "README.md", (ROOT / "README.md").read_text()
    for p in sorted((ROOT / "docs").glob("*.md")):
        yield f"docs/{p.name}", p.read_text()
    for name, cmd in _all_commands():
        yield f"{name} --help", CliRunner().invoke(main, [*name.split(), "--help"]).output


def test_docs_and_help_name_only_commands_and_options_that_exist():
    commands = dict(_all_commands())
    missing = []
    for where, text in _doc_texts():
        for m in re.finditer(r"slurm-gpu ((?:db|report) )?([a-z][a-z-]+)((?: --?[a-z][a-z-]*)*)", text):
            group, name = (m.group(1) or "").strip(), m.group(2)
            key = f"{group} {name}" if group else name
            if group == "report" and key not in commands:
                key = "report"  # `slurm-gpu report --since ...` etc.
            if key not in commands:
                if group == "db":
                    missing.append(f"{where}: slurm-gpu {key}")
                continue
            opts = {o for p in commands[key].params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}
            opts |= {"--help", "-h", "--config", "--nvml-lib"}
            for opt in (m.group(3) or "").split():
                if opt not in opts:
                    missing.append(f"{where}: slurm-gpu {key} {opt}")
    assert not missing, missing


def test_docs_say_xid_source_kmsg_not_dev_kmsg():
    for where, text in _doc_texts():
        assert not re.search(r"source\s*=\s*\"/dev/kmsg\"", text), where


def test_config_docs_say_which_files_the_hooks_can_see_and_what_percent_n_means():
    text = (ROOT / "docs" / "config.md").read_text()
    assert "SLURM_GPU_CONFIG" in text and "hooks" in text
    assert re.search(r"passes them no `SLURM_GPU_CONFIG`", text)
    assert "short host name" in text and "outside a hook" in text.lower()
