"""Shared fixtures: the simulated driver, per-test state files and config files."""
from __future__ import annotations

import os
import pathlib
import sys
from typing import Any, Dict, Optional

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import simgpu  # noqa: E402


@pytest.fixture(scope="session")
def sim_lib() -> pathlib.Path:
    """The simulated libnvidia-ml.so.1, built once per session with the system C compiler."""
    return simgpu.build()


class SimNode:
    """One simulated node: a state file, the library, and a config file pointing at both."""

    def __init__(self, tmp: pathlib.Path, lib: pathlib.Path, node: Dict[str, Any]):
        self.tmp = tmp
        self.lib = lib
        self.state = tmp / "gpus.state"
        simgpu.write_state(self.state, node)
        self.db = tmp / "usage.db"
        self.spool = tmp / "spool"
        self.config = tmp / "config.toml"
        self.write_config()

    def write_config(self, extra: str = "", **top: Any) -> pathlib.Path:
        top.setdefault("nvml_timeout_s", 2.0)
        top.setdefault("nvml_library", str(self.lib))
        # Never the machine's /etc/slurm: a test that wants Slurm's GPU numbering writes
        # slurm.conf and gres.conf here (without them the hooks fall back to minor order).
        top.setdefault("slurm_conf", str(self.tmp / "slurm.conf"))
        lines = [f"{k} = {_toml(v)}" for k, v in top.items()]
        body = "\n".join(lines) + "\n"
        body += f'[store]\ndatabase = "{self.db}"\nspool_dir = "{self.spool}"\nbusy_timeout_s = 1.0\n'
        body += '[xid]\nsource = "none"\n' if "[xid]" not in extra else ""
        body += '[log]\nsyslog = false\nfile = "%s"\n' % (self.tmp / "hooks.log") if "[log]" not in extra else ""
        body += extra
        self.config.write_text(body)
        os.chmod(self.config, 0o644)
        return self.config

    def env(self, **extra: str) -> Dict[str, str]:
        env = simgpu.environ(self.state, dict(os.environ))
        env["SLURM_GPU_CONFIG"] = str(self.config)
        env.pop("SLURM_CONF", None)
        env.update(extra)
        return env

    def log_text(self) -> str:
        p = self.tmp / "hooks.log"
        return p.read_text() if p.exists() else ""


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


@pytest.fixture(autouse=True)
def _simnvml_state_restored():
    """Tests point the in-process simulated driver at their node through os.environ['SIMNVML_STATE']
    (test_hooks.deps_for); it must not outlive the test: a later test's subprocesses (a testbed's
    client commands) would read that node's GPUs instead of their own."""
    before = os.environ.get("SIMNVML_STATE")
    yield
    if before is None:
        os.environ.pop("SIMNVML_STATE", None)
    else:
        os.environ["SIMNVML_STATE"] = before


@pytest.fixture(autouse=True)
def _fallback_log(tmp_path, monkeypatch):
    """Hooks write config errors to a fixed root-only log; tests keep theirs in tmp_path."""
    monkeypatch.setenv("SLURM_GPU_FALLBACK_LOG", str(tmp_path / "fallback" / "hooks-error.log"))


@pytest.fixture
def sim_node(tmp_path, sim_lib):
    """Factory: sim_node(profile_dict) -> SimNode (default 4x H100)."""
    def make(node: Optional[Dict[str, Any]] = None) -> SimNode:
        return SimNode(tmp_path, sim_lib, node if node is not None else simgpu.h100_sxm(4))
    return make
