"""Issue 26 item 5 on real Slurm: three of four nodes fail the same check within the window and
`healthcheck` drains only the configured share (max_drained_pct 50 of a 4-node partition: 2); the
third reports, keeps its node in service and says so in slurm_gpu_breaker_open.  After
`slurm-gpu breaker reset` on that node its next healthcheck drains it.  The count comes from Slurm's
own node list (`scontrol -o show node`: our reasons with their check, Slurm's ReasonTime).  Only
testbed APIs: the same test runs on every Slurm the testbed has."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import simgpu
from prometheus import NodeExporter, Prometheus, PrometheusUnavailable, require
from testbed import unavailable

from slurm_gpu.metrics import textfile

from .sites import healthcheck_wrapper

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
                 f'[hooks]\nhealthcheck_lock_file = "{tmp}/%n/healthcheck.lock"\n'
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


def test_an_xid_storm_on_three_nodes_drains_only_the_share_and_another_xid_on_the_fourth_still_drains(
        four, tmp_path, sim_lib):
    """A driver rollout's XID 119 on three of four nodes: two drained (the share), the third held; the
    fourth node's GPU falls off the bus (XID 79) meanwhile: its own fault, drained although two xid
    drains are in the window (issue 39 item 4)."""
    os.chmod(tmp_path, 0o755)
    cfg = _config(tmp_path, sim_lib)
    cfg.write_text(cfg.read_text().replace('source = "none"', f'source = "file:{tmp_path}/%n/kern.log"'))
    now = time.time()
    states = {}
    for n in NODES:
        states[n] = tmp_path / f"{n}.state"
        simgpu.write_state(states[n], simgpu.h100_sxm(4, seed=n))
        (tmp_path / n).mkdir(exist_ok=True)
        os.chmod(tmp_path / n, 0o755)
        xid = "79, pid=0, GPU has fallen off the bus." if n == "gpu04" else "119, pid=4242, Timeout waiting for RPC from GSP!"
        (tmp_path / n / "kern.log").write_text(f"{now - 30:.6f} {n} kernel: NVRM: Xid (PCI:0000:28:00): {xid}\n")
    outs = {n: _cli(four, cfg, states[n], n, "healthcheck", "--node", n) for n in NODES}
    assert all(o.returncode == 1 for o in outs.values()), {n: o.stdout + o.stderr for n, o in outs.items()}
    assert "not drained: breaker open for xid (XID 119): 2 of 4 nodes in partition gpu" in outs["gpu03"].stdout, \
        outs["gpu03"].stdout + outs["gpu03"].stderr
    for n in ("gpu01", "gpu02", "gpu04"):
        four.wait_node_state(n, lambda i: "DRAIN" in i.get("State", ""))
        assert _reason(four, n).endswith("[healthcheck; check xid]"), _reason(four, n)
    assert "XID 79" in _reason(four, "gpu04") and "XID 119" in _reason(four, "gpu01")
    assert _reason(four, "gpu03") == "" and "DRAIN" not in four.node_info("gpu03")["State"]
    st = _cli(four, cfg, states["gpu03"], "gpu03", "breaker", "status", "--node", "gpu03")
    assert "xid (XID 119): OPEN" in st.stdout and "xid (XID 79): closed" in st.stdout, st.stdout + st.stderr


# ------------------------------------------------------------------ slurmd's HealthCheckProgram, Prometheus

RULES = REPO / "monitoring" / "alerts" / "slurm-gpu.rules.yml"


def _rules_firing_at_once(tmp: Path) -> Path:
    """The shipped rules with SlurmGpuBreakerOpen's `for:` cut to 1 s: its expression, labels and
    annotations as shipped; its 5-minute delay is what monitoring/alerts' promtool unit tests check."""
    lines = RULES.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == "- alert: SlurmGpuBreakerOpen")
    hold = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("for:"))
    lines[hold] = lines[hold][:lines[hold].index("for:")] + "for: 1s\n"
    out = tmp / "rules.yml"
    out.write_text("".join(lines))
    return out


def _slow_drains(tmp: Path) -> Path:
    """A slurmctld that takes its time over drains (as a busy one does with a thousand nodes asking at
    once): a stand-in scontrol, first in slurm_bin_dir, holds each drain 2 s before the real one runs,
    so every failing node has counted before any drain lands."""
    real = shutil.which("scontrol")
    assert real, "scontrol not installed"
    bindir = tmp / "slow-bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(f'#!/bin/sh\ncase "$*" in *State=DRAIN*) sleep 2;; esac\nexec {real} "$@"\n')
    (bindir / "scontrol").chmod(0o755)
    return bindir


def _drained(bed) -> set:
    return {n for n in NODES if "DRAIN" in bed.node_info(n).get("State", "")}


def test_slurmd_healthchecks_failing_on_three_of_four_nodes_at_once_drain_the_share_and_the_alert_fires(
        slurm_testbed_factory, tmp_path, sim_lib):
    """The real chain: slurmctld asks every slurmd for its HealthCheckProgram at the same moment
    (HealthCheckInterval), so the three failing nodes decide at once, each from Slurm's node list,
    and none sees the others' drains before its own (slurmctld slow to take drains); still only the
    share (2 of 4) stays drained, the third withdraws its drain and reports through its gauge,
    node_exporter serves it and the shipped SlurmGpuBreakerOpen rule fires in Prometheus."""
    try:
        require("prometheus", "prometheus-node-exporter")
    except PrometheusUnavailable as e:
        unavailable(str(e))
    os.chmod(tmp_path, 0o755)
    states = tmp_path / "states"
    states.mkdir()
    for n in NODES:
        simgpu.write_state(states / f"{n}.state", simgpu.h100_sxm(4, seed=n))
    cfg = _config(tmp_path, sim_lib)
    cfg.write_text(f'slurm_bin_dir = "{_slow_drains(tmp_path)}"\n' + cfg.read_text())
    bed = slurm_testbed_factory(nodes=NODES)
    exporters = []
    for n in NODES:
        (tmp_path / n / "prom").mkdir(parents=True, exist_ok=True)
        os.chmod(tmp_path / n, 0o755)
        exporters.append(NodeExporter(tmp_path / n / "prom", tmp_path / f"ne-{n}").start())
    prom = Prometheus({"node": [(e.address, {"instance": n}) for n, e in zip(NODES, exporters)]},
                      rule_files=[_rules_firing_at_once(tmp_path)], workdir=tmp_path / "prometheus").start()
    try:
        bed.use_hooks(health_check_program=str(healthcheck_wrapper(tmp_path, cfg, states, bed.slurm_conf)))
        # Every node healthy first: each has had a healthcheck (its log says so) and none is drained.
        deadline = time.monotonic() + 30
        while not all((tmp_path / n / "hooks.log").exists() for n in NODES):
            assert time.monotonic() < deadline, "slurmd ran no HealthCheckProgram"
            time.sleep(0.2)
        assert _drained(bed) == set()
        for n in NODES[:3]:  # one moment: the next round of healthchecks finds all three failing
            simgpu.set_gpu(states / f"{n}.state", 1, ecc_volatile_uncorrected=2)
        firing = prom.wait_for_alerts(lambda alerts: any(a["labels"].get("alertname") == "SlurmGpuBreakerOpen"
                                                         and a["state"] == "firing" for a in alerts), timeout=60)
        alert = next(a for a in firing if a["labels"].get("alertname") == "SlurmGpuBreakerOpen")
        assert alert["labels"]["check"] == "ecc_uncorrectable" and alert["labels"]["cluster"] == "sgtest", alert
        # Several rounds later the share still holds: two drained, the third in service and reporting.
        time.sleep(6)
        drained = _drained(bed)
        assert len(drained) == 2 and drained < set(NODES[:3]), drained
        (held,) = set(NODES[:3]) - drained
        for n in drained:
            assert _reason(bed, n).endswith("[healthcheck; check ecc_uncorrectable]"), _reason(bed, n)
        assert _breaker_open(tmp_path, held) == {"ecc_uncorrectable": 1.0}
        assert prom.query(f'slurm_gpu_breaker_open{{instance="{held}",check="ecc_uncorrectable"}} == 1')["result"]
        # It had drained too (its count saw none of the others'), counted again and withdrew its drain.
        assert "breaker-withdrawn" in (tmp_path / held / "hooks.log").read_text()
        assert "DRAIN" not in bed.node_info("gpu04")["State"]
    finally:
        prom.cleanup()
        for e in exporters:
            e.cleanup()
