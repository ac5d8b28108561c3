"""Issue 26 item 5 on real Slurm: three of four nodes fail the same check within the window and
`healthcheck` drains only the configured share (max_drained_pct 50 of a 4-node partition: 2); the
third reports, keeps its node in service and says so in slurm_gpu_breaker_open.  After
`slurm-gpu breaker reset` on that node its next healthcheck drains it.  The count comes from Slurm's
own node list (`scontrol -o show node`: our reasons with their check, Slurm's ReasonTime).  Only
testbed APIs: the same test runs on every Slurm the testbed has."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import simgpu

from slurm_gpu.metrics import textfile

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent.parent
NODES = ("gpu01", "gpu02", "gpu03", "gpu04")


@pytest.fixture
def four(slurm_testbed_factory):
    return slurm_testbed_factory(nodes=NODES)


def _config(tmp: Path, lib: Path) -> Path:
    p = tmp / "slurm-gpu.toml"
    p.write_text(f'slurm_backend = "cli"\nslurm_timeout_s = 10.0\nnvml_library = "{lib}"\nnvml_timeout_s = 2.0\n'
                 f'[store]\ndatabase = "{tmp}/%n/usage.db"\nspool_dir = "{tmp}/%n/spool"\n'
                 f'[log]\nsyslog = false\nfile = "{tmp}/%n/hooks.log"\n[xid]\nsource = "none"\n'
                 f'[metrics]\ntextfile_dir = "{tmp}/%n/prom"\n[breaker]\nmax_drained_pct = 50\nwindow_s = 3600\n')
    os.chmod(p, 0o644)
    return p


def _cli(bed, cfg: Path, state: Path, node: str, *args: str) -> "subprocess.CompletedProcess[str]":
    env = simgpu.environ(state, bed.env)
    env.update(SLURM_GPU_CONFIG=str(cfg), SLURMD_NODENAME=node, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], env=env, capture_output=True, text=True,
                          timeout=90, cwd=str(REPO))


def _reason(bed, node: str) -> str:
    out = bed.run("sinfo", "-h", "-N", "-n", node, "-o", "%E").stdout.splitlines()
    return "" if not out or out[0].strip() == "none" else out[0].strip()


def _breaker_open(tmp: Path, node: str):
    samples = textfile.parse(textfile.read(str(tmp / node / "prom"), "slurm_gpu_breaker.prom"))
    return {dict(k)["check"]: v for k, v in samples.get("slurm_gpu_breaker_open", {}).items()}


def test_three_of_four_nodes_failing_one_check_drain_only_the_configured_share(four, tmp_path, sim_lib):
    os.chmod(tmp_path, 0o755)
    cfg = _config(tmp_path, sim_lib)
    states = {}
    for n in NODES:
        states[n] = tmp_path / f"{n}.state"
        simgpu.write_state(states[n], simgpu.h100_sxm(4, seed=n))
    for n in NODES[:3]:
        simgpu.set_gpu(states[n], 1, ecc_volatile_uncorrected=2)
    outs = {n: _cli(four, cfg, states[n], n, "healthcheck", "--node", n) for n in NODES}
    for n in NODES[:3]:
        assert outs[n].returncode == 1, (n, outs[n].stdout, outs[n].stderr)
    assert outs["gpu04"].returncode == 0, outs["gpu04"].stdout + outs["gpu04"].stderr
    assert "drained" in outs["gpu01"].stdout and "drained" in outs["gpu02"].stdout
    assert "not drained: breaker open for ecc_uncorrectable: 2 of 4 nodes in partition gpu" in outs["gpu03"].stdout, \
        outs["gpu03"].stdout + outs["gpu03"].stderr
    for n in ("gpu01", "gpu02"):
        assert _reason(four, n).endswith("[healthcheck; check ecc_uncorrectable]"), _reason(four, n)
        assert "DRAIN" in four.node_info(n)["State"]
    assert _reason(four, "gpu03") == "" and "DRAIN" not in four.node_info("gpu03")["State"]
    assert _breaker_open(tmp_path, "gpu03") == {"ecc_uncorrectable": 1.0}
    assert "breaker-open" in (tmp_path / "gpu03" / "hooks.log").read_text()

    st = _cli(four, cfg, states["gpu03"], "gpu03", "breaker", "status", "--node", "gpu03")
    assert st.returncode == 0 and "ecc_uncorrectable: OPEN" in st.stdout, st.stdout + st.stderr
    r = _cli(four, cfg, states["gpu03"], "gpu03", "breaker", "reset", "--check", "ecc_uncorrectable")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _breaker_open(tmp_path, "gpu03") == {"ecc_uncorrectable": 0.0}
    again = _cli(four, cfg, states["gpu03"], "gpu03", "healthcheck", "--node", "gpu03")
    assert again.returncode == 1 and "drained" in again.stdout, again.stdout + again.stderr
    four.wait_node_state("gpu03", lambda i: "DRAIN" in i.get("State", ""))
    assert _reason(four, "gpu03").endswith("[healthcheck; check ecc_uncorrectable]")
