"""The circuit breaker for mass drains (issue 26 item 5; policy/breaker.py, hooks/breaker.py).

Slurm is an in-memory cluster here that implements the whole backend (nodes with partitions, drain
with Slurm's ReasonTime, resume, reboot, job); the prolog and epilog run on simulated GPUs.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, List

import simgpu
from click.testing import CliRunner

from slurm_gpu import config
from slurm_gpu.errors import SlurmError
from slurm_gpu.hooks import breaker as HB
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.hooks.healthcheck import node_health_cycle
from slurm_gpu.metrics import textfile
from slurm_gpu.policy import breaker as P
from slurm_gpu.policy.judge import CheckResult
from slurm_gpu.slurm import model as slurm
from slurm_gpu.slurm.jobenv import from_env
from slurm_gpu.slurm.reason import format_reason, reason_check, reason_context

sys.path.insert(0, os.path.dirname(__file__))
from test_hooks import deps_for, job_env, rows  # noqa: E402


class MemCluster(slurm.SlurmBackend):
    """slurmctld's node table in memory: state flags, reason, ReasonTime (set by drain and reboot, as
    Slurm does) and partitions."""

    name = "mem"
    timeout_s = 1.0

    def __init__(self, names: List[str], partitions=("gpu",), clock=time.time):
        self.clock = clock
        self.table: Dict[str, dict] = {n: {"flags": {"IDLE"}, "reason": "", "time": None, "parts": tuple(partitions)}
                                       for n in names}
        self.actions: List[tuple] = []

    def node(self, name):
        if name not in self.table:
            raise SlurmError(f"unknown node {name}", "sinfo -N")
        t = self.table[name]
        return slurm.NodeInfo(name, "+".join(sorted(t["flags"])), frozenset(t["flags"]), t["reason"],
                              "root" if t["reason"] else "", t["time"], "gpu:h100:4", "", 4, 0, t["parts"])

    def nodes(self, names=None):
        return [self.node(n) for n in (names or self.table)]

    def drain(self, name, reason):
        t = self.table[name]
        t["flags"].add("DRAIN")
        t["reason"], t["time"] = reason, self.clock()
        self.actions.append(("drain", name, reason))

    def resume(self, name):
        t = self.table[name]
        t["flags"] -= {"DRAIN", "DOWN"}
        t["reason"], t["time"] = "", None
        self.actions.append(("resume", name))

    def reboot(self, name, reason):
        t = self.table[name]
        t["flags"] |= {"DRAIN", "REBOOT_REQUESTED"}
        t["reason"], t["time"] = reason, self.clock()
        self.actions.append(("reboot", name, reason))

    def job(self, job_id):
        raise SlurmError(f"unknown job {job_id}", "")

    def drained(self) -> List[str]:
        return [a[1] for a in self.actions if a[0] == "drain"]


def _cfg(tmp_path, pct=50.0, window=3600.0, extra="", settle=0.01):
    p = tmp_path / "breaker.toml"
    p.write_text(f'[store]\ndatabase = "{tmp_path / "db" / "usage.db"}"\n[breaker]\nmax_drained_pct = {pct}\n'
                 f'window_s = {window}\nsettle_s = {settle}\n'
                 f'[metrics]\ntextfile_dir = "{tmp_path / "prom"}"\n[log]\nsyslog = false\n' + extra)
    os.chmod(p, 0o644)
    return config.load(str(p))


def _fail(check="xid", message="XID 119 GSP RPC timeout"):
    return lambda info: [CheckResult(check, "FAIL", 0, "GPU-1", message, "")]


def _breaker_metric(tmp_path) -> Dict[str, float]:
    samples = textfile.parse(textfile.read(str(tmp_path / "prom"), "slurm_gpu_breaker.prom"))
    return {dict(labels)["check"]: v for labels, v in samples.get("slurm_gpu_breaker_open", {}).items()}


def _node(name, reason="", when=None, parts=("gpu",), state="IDLE+DRAIN"):
    return slurm.NodeInfo(name, state, slurm.split_state(state), reason, "root", when, "gpu:h100:4", "", 4, 0, parts)


# ------------------------------------------------------------------ the reason names the check

def test_reason_names_the_check_so_the_breaker_can_count_it_from_slurm():
    r = format_reason("GPU 1 uncorrectable ECC errors: 2", "prolog job 7", check="ecc_uncorrectable")
    assert r == "slurm-gpu: GPU 1 uncorrectable ECC errors: 2 [prolog job 7; check ecc_uncorrectable]"
    assert reason_check(r) == "ecc_uncorrectable" and reason_context(r).startswith("prolog job 7")
    assert reason_check(format_reason("x", "manual by alice")) == "" and reason_check("maintenance") == ""
    assert reason_check(format_reason("x", "healthcheck", check="xid; rm -rf")) == "xidrm-rf"  # only name characters


# ------------------------------------------------------------------ the one decision

NOW = 1_800_000_000.0
B = P.Breaker(50.0, 3600.0)


def test_breaker_opens_once_the_partition_share_is_drained_for_that_check():
    xid = format_reason("XID 119", "healthcheck", check="xid")
    nodes = [_node("n1", xid, NOW - 60), _node("n2", xid, NOW - 30), _node("n3", state="IDLE"), _node("n4", state="IDLE")]
    v = P.decide(B, "xid", "n3", nodes, NOW)
    assert v.open and (v.drained, v.allowed, v.total, v.partition) == (2, 2, 4, "gpu"), v
    assert "breaker open for xid: 2 of 4 nodes in partition gpu" in v.text
    assert not P.decide(B, "temperature", "n3", nodes, NOW).open  # another check has its own count
    assert not P.decide(B, "xid", "n1", nodes, NOW).open  # n1 itself is not counted against itself
    assert P.decide(B, "xid", "n1", nodes, NOW).drained == 1


def test_breaker_forgets_drains_older_than_the_window_or_the_last_reset():
    xid = format_reason("XID 119", "healthcheck", check="xid")
    nodes = [_node("n1", xid, NOW - 7200), _node("n2", xid, NOW - 30), _node("n3", state="IDLE"), _node("n4", state="IDLE")]
    assert not P.decide(B, "xid", "n3", nodes, NOW).open  # n1's drain is past the window
    nodes[0] = _node("n1", xid, NOW - 60)
    assert P.decide(B, "xid", "n3", nodes, NOW).open
    assert not P.decide(B, "xid", "n3", nodes, NOW, {"xid": NOW - 45}).open  # reset after n1's drain
    assert not P.decide(B, "xid", "n3", nodes, NOW, {P.ANY: NOW - 10}).open
    assert P.decide(B, "xid", "n3", nodes, NOW, {"temperature": NOW - 10}).open


def test_breaker_counts_only_our_drains_and_unknown_times_count():
    xid = format_reason("XID 119", "healthcheck", check="xid")
    nodes = [_node("n1", "maintenance", NOW), _node("n2", "slurm-gpu: old reason without check [healthcheck]", NOW),
             _node("n3", xid, None), _node("n4", state="IDLE")]
    v = P.decide(P.Breaker(25.0, 3600.0), "xid", "n4", nodes, NOW)
    assert v.open and v.drained == 1  # n3: ReasonTime unknown counts (the safe side); n1, n2 do not


def test_breaker_always_lets_one_node_go_in_a_small_partition():
    nodes = [_node("n1", state="IDLE"), _node("n2", state="IDLE"), _node("n3", state="IDLE")]
    assert P.allowed_nodes(P.Breaker(10.0, 3600.0), 3) == 1
    assert not P.decide(P.Breaker(10.0, 3600.0), "xid", "n1", nodes, NOW).open


def test_breaker_judges_each_partition_of_the_node():
    xid = format_reason("XID 119", "healthcheck", check="xid")
    nodes = [_node("a1", xid, NOW, ("small",)), _node("b1", state="IDLE", parts=("small", "big"))] + \
        [_node(f"c{i}", state="IDLE", parts=("big",)) for i in range(8)]
    v = P.decide(B, "xid", "b1", nodes, NOW)
    assert v.open and v.partition == "small" and (v.drained, v.allowed, v.total) == (1, 1, 2)


def test_breaker_is_off_at_100_pct():
    xid = format_reason("XID 119", "healthcheck", check="xid")
    nodes = [_node("n1", xid, NOW), _node("n2", state="IDLE")]
    assert not P.decide(P.Breaker(100.0, 3600.0), "xid", "n2", nodes, NOW).open


def test_prolog_gate_is_never_suspended_for_a_hardware_fault():
    for check in ("ecc_uncorrectable", "row_remap_failure", "pending_reset", "responsive", "gpu_count",
                  "recovery_action", "fabric", "nvml"):
        assert not P.gate_suspended([check]) and not P.gate_suspended(["temperature", check])
    assert P.gate_suspended(["temperature", "xid"]) and not P.gate_suspended([])


# ------------------------------------------------------------------ healthcheck on a cluster

def test_healthcheck_on_three_of_four_nodes_failing_one_check_drains_only_the_configured_share(tmp_path):
    cfg = _cfg(tmp_path, pct=50.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"])
    outs = [node_health_cycle(cluster, n, _fail(), breaker_cfg=cfg) for n in ("gpu01", "gpu02", "gpu03")]
    assert [o.action for o in outs] == ["drained", "drained", "breaker-open"], outs
    assert cluster.drained() == ["gpu01", "gpu02"]
    assert reason_check(cluster.node("gpu01").reason) == "xid"
    assert "not drained: breaker open for xid (XID 119): 2 of 4 nodes in partition gpu" in outs[2].message
    assert outs[2].exit_code != 0 and not cluster.node("gpu03").drained
    assert _breaker_metric(tmp_path) == {"xid": 1.0}
    # Another check is not held by this one's storm.
    assert node_health_cycle(cluster, "gpu03", _fail("temperature", "temperature 95 C"), breaker_cfg=cfg).action == "drained"
    assert _breaker_metric(tmp_path) == {"xid": 1.0, "temperature": 0.0}


def test_driver_rollout_that_breaks_nvml_on_many_nodes_drains_only_the_share(tmp_path):
    from slurm_gpu.errors import DriverLibraryMismatch

    def mismatch(info):
        raise DriverLibraryMismatch("550.54.15", "560.35.03")
    cfg = _cfg(tmp_path, pct=25.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"])
    outs = [node_health_cycle(cluster, n, mismatch, breaker_cfg=cfg).action for n in ("gpu01", "gpu02", "gpu03")]
    assert outs == ["drained", "breaker-open", "breaker-open"]
    assert reason_check(cluster.node("gpu01").reason) == "nvml" and _breaker_metric(tmp_path) == {"nvml": 1.0}


def test_breaker_reset_lets_the_next_drain_for_the_check_go(tmp_path):
    cfg = _cfg(tmp_path, pct=25.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"])
    assert node_health_cycle(cluster, "gpu01", _fail(), breaker_cfg=cfg).action == "drained"
    assert node_health_cycle(cluster, "gpu02", _fail(), breaker_cfg=cfg).action == "breaker-open"
    time.sleep(0.01)
    HB.write_reset(cfg, "xid", time.time())
    assert HB.read_resets(cfg).keys() == {"xid"}
    assert node_health_cycle(cluster, "gpu02", _fail(), breaker_cfg=cfg).action == "drained"
    assert node_health_cycle(cluster, "gpu03", _fail(), breaker_cfg=cfg).action == "breaker-open"


def _three_at_once(cluster, cfg, nodes, when):
    """Nodes deciding at the same moment: every count before any drain lands, then the drains."""
    reason = format_reason("XID 119 GSP RPC timeout", "healthcheck", check="xid")
    assert not any(HB.ask(cfg, cluster, n, "xid", when).open for n in nodes)
    for n in nodes:
        cluster.drain(n, reason)
    return reason


def test_nodes_deciding_at_the_same_moment_all_drained_past_the_share_withdraw_to_it(tmp_path):
    clock = [1_000_000.25]
    cfg = _cfg(tmp_path, pct=50.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"], clock=lambda: clock[0])
    reason = _three_at_once(cluster, cfg, ["gpu03", "gpu01", "gpu02"], clock[0])
    clock[0] += 2.0
    outs = {n: HB.confirm(cfg, cluster, n, "xid", reason, sleep=lambda s: None, clock=lambda: clock[0])
            for n in ("gpu02", "gpu03", "gpu01")}
    # Same ReasonTime second: ranked by name; the share (2) is gpu01 and gpu02.
    assert {n: v.open for n, v in outs.items()} == {"gpu01": False, "gpu02": False, "gpu03": True}
    assert [n for n in cluster.table if cluster.node(n).drained] == ["gpu01", "gpu02"]
    assert ("resume", "gpu03") in cluster.actions and _breaker_metric(tmp_path) == {"xid": 1.0}
    assert "2 of 4 nodes in partition gpu drained by slurm-gpu for it before gpu03" in outs["gpu03"].text


def test_a_drain_that_lands_after_a_nodes_second_count_ranks_after_it():
    b = P.Breaker(50.0, 3600.0, 2.0)
    xid = format_reason("XID 119", "healthcheck", check="xid")
    # gpu03 drained at 100.9 and counted again at 102.9 seeing gpu01 only: it keeps its drain.
    idle = [_node("gpu02", state="IDLE"), _node("gpu04", state="IDLE")]
    seen = [_node("gpu01", xid, 100.0), _node("gpu03", xid, 100.0)]
    assert not P.confirm(b, "xid", "gpu03", seen + idle, 103.0).open
    # gpu02's drain landed after that (ReasonTime 102, later than gpu03's 100 whatever the names): it goes.
    later = seen + [_node("gpu02", xid, 102.0), idle[1]]
    assert P.confirm(b, "xid", "gpu02", later, 105.0).open
    assert not P.confirm(b, "xid", "gpu03", later, 105.0).open and not P.confirm(b, "xid", "gpu01", later, 105.0).open


def test_second_count_leaves_a_drain_whose_reason_someone_changed_meanwhile(tmp_path):
    clock = [2_000_000.0]
    cfg = _cfg(tmp_path, pct=50.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"], clock=lambda: clock[0])
    reason = _three_at_once(cluster, cfg, ["gpu01", "gpu02", "gpu03"], clock[0])
    cluster.table["gpu03"]["reason"] = "admin: bad fan"
    v = HB.confirm(cfg, cluster, "gpu03", "xid", reason, sleep=lambda s: None, clock=lambda: clock[0] + 2)
    assert not v.open and cluster.node("gpu03").drained and ("resume", "gpu03") not in cluster.actions


def test_second_count_that_cannot_read_the_node_list_keeps_the_drain(tmp_path):
    cfg = _cfg(tmp_path, pct=50.0)
    cluster = MemCluster(["gpu01", "gpu02"])
    cluster.drain("gpu01", format_reason("XID 119", "healthcheck", check="xid"))

    def broken(names=None):
        raise SlurmError("slurmctld down", "")
    cluster.nodes = broken  # type: ignore[method-assign]
    v = HB.confirm(cfg, cluster, "gpu01", "xid", cluster.node("gpu01").reason, sleep=lambda s: None)
    assert not v.open and cluster.node("gpu01").drained


def test_healthcheck_waits_settle_s_and_withdraws_its_drain_past_the_share(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, pct=25.0, settle=2.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"])
    cluster.drain("gpu02", format_reason("XID 119", "healthcheck", check="xid"))  # lands while gpu01 decides
    slept: List[float] = []
    monkeypatch.setattr(HB.time, "sleep", slept.append)
    real_nodes = cluster.nodes
    calls = [0]

    def nodes(names=None):  # gpu01's first count misses gpu02's drain; its second sees it
        calls[0] += 1
        listing = real_nodes(names)
        return [n for n in listing if n.name != "gpu02"] if calls[0] == 1 else listing
    cluster.nodes = nodes  # type: ignore[method-assign]
    cluster.table["gpu02"]["time"] -= 5  # drained earlier than gpu01
    out = node_health_cycle(cluster, "gpu01", _fail(), breaker_cfg=cfg)
    assert slept == [2.0]
    assert out.action == "breaker-open" and "drain withdrawn" in out.message and not cluster.node("gpu01").drained


def test_breaker_that_cannot_read_the_node_list_lets_the_drain_go(tmp_path):
    cfg = _cfg(tmp_path, pct=25.0)

    class NoList(MemCluster):
        def nodes(self, names=None):
            raise SlurmError("slurmctld not reachable: Unable to contact slurm controller", "scontrol ping")

    cluster = NoList(["gpu01", "gpu02"])
    cluster.drain("gpu02", format_reason("XID 119", "healthcheck", check="xid"))
    assert node_health_cycle(cluster, "gpu01", _fail(), breaker_cfg=cfg).action == "drained"


# ------------------------------------------------------------------ prolog and epilog

def _hook_node(sim_node, tmp_path, pct=50.0):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config(f"[breaker]\nmax_drained_pct = {pct}\n[health]\nmax_temperature_c = 90\n"
                      f'[metrics]\ntextfile_dir = "{tmp_path / "prom"}"\n')
    return node


def _storm(check: str) -> MemCluster:
    """gpu02 and gpu03 drained for `check` a minute ago; gpu01 (this node) and gpu04 in service."""
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"], clock=lambda: time.time() - 60)
    for n in ("gpu02", "gpu03"):
        cluster.drain(n, format_reason("storm", "healthcheck", check=check))
    cluster.actions.clear()
    return cluster


def test_prolog_never_starts_a_job_on_uncorrectable_ecc_while_the_breaker_is_open(sim_node, tmp_path):
    node = _hook_node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, ecc_volatile_uncorrected=2)
    cluster = _storm("ecc_uncorrectable")
    assert P.decide(P.Breaker(50.0, 3600.0), "ecc_uncorrectable", "gpu01", cluster.nodes(), time.time()).open
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps_for(node, slurm=cluster)) == 1
    assert cluster.drained() == ["gpu01"] and reason_check(cluster.node("gpu01").reason) == "ecc_uncorrectable"


def test_prolog_lets_the_job_start_when_the_breaker_is_open_for_a_non_hardware_check(sim_node, tmp_path):
    node = _hook_node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 0, temperature=95)
    cluster = _storm("temperature")
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps_for(node, slurm=cluster)) == 0
    assert cluster.drained() == [] and "gate-suspended" in node.log_text() and "breaker open for temperature" in node.log_text()
    assert _breaker_metric(tmp_path) == {"temperature": 1.0}


def test_prolog_drains_for_a_non_hardware_check_while_the_breaker_is_closed(sim_node, tmp_path):
    node = _hook_node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 0, temperature=95)
    cluster = _storm("xid")  # a storm of another check
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps_for(node, slurm=cluster)) == 1
    assert cluster.drained() == ["gpu01"] and reason_check(cluster.node("gpu01").reason) == "temperature"


def test_epilog_keeps_the_node_in_service_and_exits_0_while_the_breaker_is_open(sim_node, tmp_path):
    node = _hook_node(sim_node, tmp_path)
    deps = deps_for(node, slurm=_storm("gpu_count"))
    # Slurm gave the job GPU 2 of a node whose driver shows 2: the epilog would drain for gpu_count.
    assert hooks.epilog(from_env(job_env(gpus="0,1,2")), deps) == 0  # no "Epilog error" drain by Slurm either
    assert deps.slurm.drained() == [] and "breaker-open" in node.log_text()
    assert _breaker_metric(tmp_path) == {"gpu_count": 1.0}
    assert rows(node.db, "SELECT source, ok, outcome FROM drains") == [{"source": "epilog", "ok": 0, "outcome": "breaker"}]


def test_epilog_drains_once_the_storm_is_past_the_window(sim_node, tmp_path):
    node = _hook_node(sim_node, tmp_path)
    cluster = _storm("gpu_count")
    for n in ("gpu02", "gpu03"):
        cluster.table[n]["time"] = time.time() - 7200
    assert hooks.epilog(from_env(job_env(gpus="0,1,2")), deps_for(node, slurm=cluster)) == 0
    assert cluster.drained() == ["gpu01"] and reason_check(cluster.node("gpu01").reason) == "gpu_count"
    assert _breaker_metric(tmp_path) == {"gpu_count": 0.0}


# ------------------------------------------------------------------ remediate's reboots

def test_remediate_asks_no_reboot_while_the_share_of_the_partition_is_rebooting(tmp_path):
    from slurm_gpu.remediation import actions as ACT
    from slurm_gpu.remediation.context import Env
    cfg = _cfg(tmp_path, pct=25.0)
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"])
    cluster.reboot("gpu02", format_reason("GSP error", "remediate: reboot", check=P.REBOOT))
    cluster.drain("gpu01", format_reason("XID 79 fallen off the bus", "healthcheck", check="xid"))
    env = Env(cfg, cluster, _NoStore(), "gpu01", checker=lambda info: [])
    out = ACT.reboot(env, [], [], "XID 79 fallen off the bus")
    assert out.outcome == "breaker-open" and "breaker open for reboot" in out.message, out
    assert [a[0] for a in cluster.actions] == ["reboot", "drain"] and env.store.rows[-1]["outcome"] == "refused"


def test_two_nodes_asking_for_a_reboot_at_once_reboot_only_the_share(tmp_path):
    from slurm_gpu.remediation import actions as ACT
    from slurm_gpu.remediation.context import Env
    cfg = _cfg(tmp_path, pct=25.0)
    t0 = float(int(time.time()))
    cluster = MemCluster(["gpu01", "gpu02", "gpu03", "gpu04"], clock=lambda: t0)
    fault = format_reason("XID 79 fallen off the bus", "healthcheck", check="xid")
    for n in ("gpu01", "gpu02"):
        cluster.drain(n, fault)
    # gpu01 has claimed its reboot (its reason is the reboot's) in the same second gpu02 counts,
    # and gpu02's first count did not see it yet.
    cluster.drain("gpu01", format_reason("XID 79 fallen off the bus", "remediate: reboot", check=P.REBOOT))
    real_nodes, calls = cluster.nodes, [0]

    def nodes(names=None):
        calls[0] += 1
        listing = real_nodes(names)
        return [n if n.name != "gpu01" else _node("gpu01", fault, t0) for n in listing] if calls[0] == 1 else listing
    cluster.nodes = nodes  # type: ignore[method-assign]
    env = Env(cfg, cluster, _NoStore(), "gpu02", checker=lambda info: [])
    out = ACT.reboot(env, [], [], "XID 79 fallen off the bus")
    assert out.outcome == "breaker-open" and "gpu02's drain withdrawn" in out.message, out
    assert not any(a[0] == "reboot" for a in cluster.actions)
    assert cluster.node("gpu02").reason == fault and cluster.node("gpu02").drained  # its own reason back
    assert env.store.rows[-1]["outcome"] == "refused"


class _NoStore:
    def __init__(self):
        self.rows: List[dict] = []

    def remediations(self, **kw):
        return []

    def record_remediation(self, row):
        self.rows.append(row)
        return len(self.rows)

    def finish_remediation(self, *a):
        pass


# ------------------------------------------------------------------ the admin's reset

def test_breaker_reset_command_records_the_reset_and_clears_the_gauge(tmp_path):
    from slurm_gpu.cli import main
    cfg = _cfg(tmp_path)
    HB.write_metric(cfg, {"xid": 1.0, "temperature": 1.0})
    r = CliRunner().invoke(main, ["--config", cfg.path, "breaker", "reset", "--check", "xid"])
    assert r.exit_code == 0, r.output
    assert "xid" in r.output and str(tmp_path / "db" / "breaker-reset.json") in r.output
    assert HB.read_resets(cfg).keys() == {"xid"} and _breaker_metric(tmp_path) == {"xid": 0.0, "temperature": 1.0}
    r = CliRunner().invoke(main, ["--config", cfg.path, "breaker", "reset"])
    assert r.exit_code == 0, r.output
    assert HB.read_resets(cfg).keys() == {P.ANY} and _breaker_metric(tmp_path) == {"xid": 0.0, "temperature": 0.0}


# ------------------------------------------------------------------ XID storms: one code on many nodes

def test_an_xid_storm_holds_its_own_code_at_the_share_but_another_codes_broken_gpu_is_still_drained():
    storm = format_reason("XID 119 in kernel log: NVRM: Xid (PCI:0000:3a:00): 119, GSP RPC timeout", "healthcheck",
                          check="xid")
    nodes = [_node("n1", storm, NOW - 60), _node("n2", storm, NOW - 30)] + \
        [_node(f"n{i}", state="IDLE") for i in range(3, 5)]
    v = P.decide(B, "xid", "n3", nodes, NOW, fault="XID 119 in kernel log: GSP RPC timeout")
    assert v.open and v.drained == 2 and "breaker open for xid (XID 119): 2 of 4 nodes" in v.text, v
    # a GPU off the bus on n4 during the XID 119 storm is its own fault: drained
    v = P.decide(B, "xid", "n4", nodes, NOW, fault="XID 79 in kernel log: GPU has fallen off the bus")
    assert not v.open and v.drained == 0, v
    # a drain whose reason names no code (cut short, an older version's) counts for every code
    nodes[0] = _node("n1", format_reason("XID storm, no code", "healthcheck", check="xid"), NOW - 60)
    assert P.decide(B, "xid", "n4", nodes, NOW, fault="XID 79 in kernel log: x").drained == 1
    # without the fault text (an older caller) every xid drain counts, as before
    assert P.decide(B, "xid", "n4", nodes, NOW).drained == 2


def test_the_second_count_after_an_xid_drain_ranks_only_nodes_drained_for_the_same_code():
    x79 = format_reason("XID 79 in kernel log: fallen off the bus", "healthcheck", check="xid")
    x119 = format_reason("XID 119 in kernel log: GSP RPC timeout", "healthcheck", check="xid")
    nodes = [_node("n1", x119, NOW - 60), _node("n2", x119, NOW - 50), _node("n3", x79, NOW - 10),
             _node("n4", x119, NOW - 5)]
    assert not P.confirm(B, "xid", "n3", nodes, NOW).open  # n1, n2 drained earlier, but for XID 119
    v = P.confirm(B, "xid", "n4", nodes, NOW)
    assert v.open and v.drained == 2 and "n4's drain withdrawn" in v.text, v


def test_the_prolog_gate_asks_the_breaker_with_the_xid_codes_it_fails_for(tmp_path):
    x119 = format_reason("XID 119 in kernel log: GSP RPC timeout", "healthcheck", check="xid")
    cfg = _cfg(tmp_path, pct=50.0)
    listing = [_node("n1", x119, time.time() - 60), _node("n2", x119, time.time() - 50),
               _node("n3", state="IDLE"), _node("n4", state="IDLE")]

    class Backend:
        def nodes(self):
            return listing
    assert "XID 119" in HB.ask_all(cfg, Backend(), "n3", ["xid"], time.time(),
                                   faults={"xid": "XID 119 in kernel log: GSP RPC timeout"})
    assert HB.ask_all(cfg, Backend(), "n3", ["xid"], time.time(),
                      faults={"xid": "XID 48 in kernel log: DBE"}) == ""
