"""Shared fixtures: the simulated driver, per-test state files and config files, the session's MariaDB."""
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
        # The healthcheck's turn lock of its own, not the machine's /run/slurm-gpu (another test's gpu01).
        body += '[hooks]\nhealthcheck_lock_file = "%s"\n' % (self.tmp / "healthcheck-%n.lock") if "[hooks]" not in extra else ""
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


_mariadb_server: Any = None  # the session's server, once a test asked for it


@pytest.fixture(scope="session")
def mariadb_server():
    """One throwaway MariaDB (tests/mariadb.py, started on a copy of the template data directory)
    for every test of the session that needs a plain one, started when the first asks for it and
    stopped at session end.  Each module takes databases (`new_database()`) and accounts
    (`new_user()`, names of its own) there.  A test that stops or pauses it starts or resumes it
    again before it returns (try/finally); `_mariadb_server_left_running` catches one that did not."""
    global _mariadb_server
    import mariadb as testdb
    for server in testdb.running():
        _mariadb_server = server
        try:
            yield server
        finally:
            _mariadb_server = None


@pytest.fixture(autouse=True)
def _mariadb_server_left_running():
    """After every test: the session's MariaDB is running and answering (a test that stopped or
    paused it and failed before it restored it would fail every later module's tests too)."""
    yield
    if _mariadb_server is not None:
        _mariadb_server.ensure_running()


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


# --------------------------------------------------------------------------- where the suite's time goes
# At the end of a run: the 15 slowest modules (setup, call and teardown of their tests added up,
# module fixtures included) and the Slurm clusters the testbed started (tests/testbed.py counts
# them in SLURM_TESTBED_STARTS, child processes included). docs/testbed.md, "Where the time goes".

_MODULE_S: Dict[str, float] = {}


def pytest_configure(config: pytest.Config) -> None:
    import tempfile

    import testbed
    if not os.environ.get(testbed.STARTS_ENV) and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="slurm-gpu-testbed-starts-", suffix=".txt")
        os.close(fd)
        os.environ[testbed.STARTS_ENV] = path
        config._slurm_gpu_starts_file = path  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- once per CI: once_on(SUITE)
# A module that depends on neither Slurm's version nor Python's but needs only what every root
# filesystem has (MariaDB, Slurm) runs once: inside SUITE's root filesystem on the version axis, and on
# the host unless the axis runs beside it (.ci/run exports SLURM_GPU_AXIS_BESIDE=1), where the host's
# run is the one CI waits for (docs/testbed.md, "Markers and the version axis").
AXIS_BESIDE_ENV = "SLURM_GPU_AXIS_BESIDE"


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    here = os.environ.get("SLURM_GPU_ROOTFS") or ""
    beside = os.environ.get(AXIS_BESIDE_ENV) == "1"
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("once_on")
        if mark is None:
            keep.append(item)
            continue
        suite = mark.args[0]
        (keep if (here == suite if here else not beside) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_S[module] = _MODULE_S.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    import testbed
    tr = terminalreporter
    if _MODULE_S:
        tr.write_sep("-", "slowest modules (s)")
        for module, s in sorted(_MODULE_S.items(), key=lambda kv: -kv[1])[:15]:
            tr.write_line(f"{s:8.1f}  {module}")
    starts = testbed.started_clusters()
    if not _MODULE_S and not starts:
        return  # nothing ran (--collect-only)
    tr.write_line(f"Slurm cluster start-ups: {len(starts)}")
    for line in starts:
        pid, seconds, nodes, workdir = (line.split(" ", 3) + ["", "", "", ""])[:4]
        tr.write_line(f"  {seconds:>6} s  {nodes:<28} {workdir}")
    path = getattr(config, "_slurm_gpu_starts_file", None)
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
