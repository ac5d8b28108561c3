"""Issue 26: a drained GPU is reset, rebooted or sent for RMA without a human, within budgets.

The simulated driver learns what a reset does through a stand-in nvidia-smi (tests/simnvml/nvidia-smi)
that tests put first in remediation.reset_command; Slurm is an in-memory backend that keeps the
node's state and reason as scontrol would."""
from __future__ import annotations

import os
import pathlib
import sqlite3
import subprocess
import sys
import time

import pytest
import simgpu

from slurm_gpu import config
from slurm_gpu.errors import SlurmError
from slurm_gpu.gpu.snapshot import NodeSnapshot
from slurm_gpu.gpu.xid import XidEvent
from slurm_gpu.hooks.healthcheck import node_health_cycle
from slurm_gpu.policy.judge import CheckResult
from slurm_gpu.remediation import actions as ACT
from slurm_gpu.remediation import budget as BUDGET
from slurm_gpu.remediation import engine as REM
from slurm_gpu.remediation import remedy as R
from slurm_gpu.slurm import model as slurm
from slurm_gpu.slurm import reason as _reason

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
NIDX = "nvidia-smi"


# ------------------------------------------------------------------ 1. the fault -> remedy map

def _fail(check, gpu=0):
    return CheckResult(check, "FAIL", gpu, f"GPU-{gpu}", f"GPU {gpu} {check} fault")


@pytest.mark.parametrize("check,want", [("pending_reset", R.RESET), ("ecc_uncorrectable", R.RESET),
                                        ("row_remap_failure", R.RMA), ("retired_pages", R.RMA),
                                        ("responsive", R.REBOOT), ("temperature", R.MANUAL), ("pcie_link", R.MANUAL)])
def test_remedy_map_gives_each_memory_rule_and_lost_gpu_its_step(check, want):
    assert R.remedy_for(_fail(check)).action == want


def test_recovery_action_and_xid_154_follow_the_driver_and_the_catalog_follows_its_bucket():
    from slurm_gpu.gpu.snapshot import GpuSnapshot, value
    bus = "00000000:18:00.0"
    g = GpuSnapshot(index=0, pci_bus_id=value(bus), recovery_action=value(2))
    snap = NodeSnapshot(hostname="gpu01", taken_at=1.0, gpus=(g,))
    assert R.remedy_for(_fail("recovery_action"), snap).action == R.REBOOT
    ev154 = XidEvent(1.0, (0, 0x18, 0), 154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")
    ev79 = XidEvent(1.0, (0, 0x18, 0), 79, "GPU has fallen off the bus.")
    ev13 = XidEvent(1.0, (0, 0x18, 0), 13, "Graphics Exception")
    assert R.remedy_for(_fail("xid"), snap, [ev154]).action == R.RESET
    assert R.remedy_for(_fail("xid"), snap, [ev154, ev79]).action == R.REBOOT
    assert R.remedy_for(_fail("xid"), snap, [ev13]).action == R.NONE


def test_node_action_leaves_a_manual_fault_to_a_human_else_takes_the_strongest_step():
    reset, rma, manual = (R.remedy_for(_fail(c)) for c in ("pending_reset", "row_remap_failure", "temperature"))
    assert R.node_action([reset]) == R.RESET
    assert R.node_action([reset, rma]) == R.RMA
    assert R.node_action([reset, manual]) == R.MANUAL
    assert R.node_action([]) == R.NONE


def test_docs_hooks_shows_the_remedy_map_as_generated():
    assert R.markdown_table() in (DOCS / "hooks.md").read_text(), "regenerate the table from remediation/remedy.py"


def test_healthcheck_never_resumes_a_drain_remediate_owns():
    assert _reason.auto_resumable("slurm-gpu: GPU 0 pending row remap [prolog job 7]")
    assert not _reason.auto_resumable("slurm-gpu: GPU 0 pending row remap [remediate: reset]")
    assert not _reason.auto_resumable("slurm-gpu: RMA: GPU 1654 row remapping failed [remediate]")


# ------------------------------------------------------------------ 2. what a reset does to the simulated GPU

def _smi(node, bus, *extra):
    return subprocess.run([sys.executable, str(simgpu.STAND_IN_NVIDIA_SMI), "--state", str(node.state),
                           "--gpu-reset", "-i", bus, *extra], capture_output=True, text=True)


def test_simulated_reset_applies_a_pending_remap_clears_volatile_ecc_and_the_recovery_action(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, remapped_pending=1, remapped_uncorrected=3, remapped_failure=0,
                   ecc_volatile_uncorrected=2, ecc_aggregate_uncorrected=2, **{"field.230": 1})
    bus = simgpu.read_state(node.state)["gpu.1.pci_bus_id"]
    r = _smi(node, bus)
    assert r.returncode == 0, r.stderr
    s = simgpu.read_state(node.state)
    assert (s["gpu.1.remapped_pending"], s["gpu.1.ecc_volatile_uncorrected"], s["gpu.1.field.230"]) == ("0", "0", "0")
    assert (s["gpu.1.remapped_uncorrected"], s["gpu.1.ecc_aggregate_uncorrected"], s["gpu.1.resets"]) == ("3", "2", "1")
    assert "gpu.0.resets" not in s


def test_simulated_reset_keeps_a_remap_failure_and_refuses_a_gpu_in_use(sim_node):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.set_gpu(node.state, 0, remapped_failure=1)
    bus = simgpu.read_state(node.state)["gpu.0.pci_bus_id"]
    assert _smi(node, bus).returncode == 0
    assert simgpu.read_state(node.state)["gpu.0.remapped_failure"] == "1"
    simgpu.set_gpu(node.state, 0, procs=[(os.getpid(), 1 << 30)])
    r = _smi(node, bus)
    assert r.returncode == 255 and "being used by some other process" in r.stderr


# ------------------------------------------------------------------ 3. remediate against an in-memory Slurm

class MemSlurm(slurm.SlurmBackend):
    """One node as slurmctld keeps it: state flags and reason; reboot() records the request."""
    name = "mem"
    timeout_s = 1.0

    def __init__(self, node="gpu01", state="IDLE+DRAIN", reason="", gpus_allocated=0):
        self.name_, self.flags, self.reason, self.gpus_allocated = node, set(slurm.split_state(state)), reason, gpus_allocated
        self.actions = []

    def node(self, name):
        state = "+".join(sorted(self.flags))
        return slurm.NodeInfo(name, state, frozenset(self.flags), self.reason, "root" if self.reason else "", None,
                              "gpu:h100:2", "", 2, self.gpus_allocated)

    def nodes(self, names=None):
        return [self.node(self.name_)]

    def drain(self, name, reason):
        self.flags.add("DRAIN")
        self.reason = reason
        self.actions.append(("drain", reason))

    def resume(self, name):
        self.flags -= {"DRAIN", "DOWN"}
        self.flags.add("IDLE")
        self.reason = ""
        self.actions.append(("resume",))

    def reboot(self, name, reason):
        self.flags |= {"DRAIN", "REBOOT_REQUESTED"}
        self.reason = reason
        self.actions.append(("reboot", reason))

    def boot(self):
        """What slurmctld does to a node it rebooted with nextstate=DOWN (node_mgr.c, set_node_reason
        appends): " : reboot issued" when it sends the reboot, and when the node registers again
        DOWN, DRAIN cleared, " : reboot complete" (seen on 22.05, 24.11 and 26.05's testbeds)."""
        self.flags = {"DOWN"}
        self.reason += " : reboot issued : reboot complete"

    def job(self, job_id):
        raise SlurmError("no jobs here", "")

    ctld_offset = 0.0  # slurmctld's clock minus this node's (faketime on the node: negative)

    def ctld_time(self):
        return time.time() + self.ctld_offset


def _node(sim_node, tmp_path, extra=""):
    node = sim_node(simgpu.h100_sxm(2))
    cmd = [sys.executable, str(simgpu.STAND_IN_NVIDIA_SMI), "--state", str(node.state), "--gpu-reset", "-i", "{pci_bus_id}"]
    node.write_config("[remediation]\nreset_command = [%s]\nverify_interval_s = 0\nlock_file = \"%s\"\n%s"
                      '[metrics]\ntextfile_dir = "%s"\n' % (", ".join(f'"{a}"' for a in cmd), tmp_path / "rem.lock",
                                                           extra, tmp_path / "prom"))
    os.environ["SIMNVML_STATE"] = str(node.state)
    return node


def _run(node, backend, **kw):
    from slurm_gpu.hooks.healthcheck import default_checker
    cfg = config.load(str(node.config))
    return REM.run_on_node(cfg, backend, "gpu01", default_checker(cfg), **kw)


def _rows(node):
    conn = sqlite3.connect(str(node.db))
    try:
        return [dict(zip(("action", "outcome", "gpu_index", "serial"), r)) for r in
                conn.execute("SELECT action, outcome, gpu_index, serial FROM remediations ORDER BY id")]
    finally:
        conn.close()


PROLOG_REASON = "slurm-gpu: GPU 1 (GPU-5157…) pending row remap: needs a GPU reset [prolog job 4711]"


def test_remediate_resets_a_pending_remap_gpu_verifies_and_resumes(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert (out.action, out.outcome) == ("reset", "resumed"), out
    assert simgpu.read_state(node.state)["gpu.1.resets"] == "1" and "gpu.0.resets" not in simgpu.read_state(node.state)
    assert backend.actions[0][0] == "drain" and backend.actions[0][1].endswith("[remediate: reset]")
    assert backend.actions[-1] == ("resume",) and "DRAIN" not in backend.flags
    assert _rows(node) == [{"action": "reset", "outcome": "resumed", "gpu_index": 1,
                            "serial": simgpu.read_state(node.state)["gpu.1.serial"]}]
    # persistence, accounting and clocks re-applied after the reset
    fns = {a["function"] for a in simgpu.read_actions(node.state) if a["gpu"] == 1}
    assert {"nvmlDeviceSetPersistenceMode", "nvmlDeviceSetAccountingMode"} <= fns
    prom = (tmp_path / "prom" / "slurm_gpu_remediation.prom").read_text()
    assert 'slurm_gpu_remediation_total{action="reset",outcome="resumed"} 1' in prom


def test_remediate_marks_a_remap_failure_for_rma_and_leaves_it_drained(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 0, remapped_failure=1)
    backend = MemSlurm(reason="slurm-gpu: GPU 0 row remapping failed [healthcheck]")
    out = _run(node, backend)
    serial = simgpu.read_state(node.state)["gpu.0.serial"]
    assert out.outcome == "rma" and backend.reason.startswith(f"slurm-gpu: RMA: GPU {serial} ")
    assert "DRAIN" in backend.flags and "gpu.0.resets" not in simgpu.read_state(node.state)
    assert _rows(node)[-1]["outcome"] == "rma"
    again = _run(node, backend)  # an RMA waits for the board: never touched again
    assert again.outcome == "left-alone" and "RMA" in again.message


def test_reset_that_does_not_cure_escalates_to_a_reboot_through_slurm_then_verifies_after_the_boot(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1, reset_sticky=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert (out.action, out.outcome) == ("reboot", "requested"), out
    assert backend.actions[-1][0] == "reboot" and backend.reason.endswith("[remediate: reboot; check reboot]")
    assert [r["outcome"] for r in _rows(node)] == ["escalated", "requested"]
    assert _run(node, backend).outcome == "waiting"  # Slurm has not rebooted it yet
    backend.boot()
    simgpu.set_gpu(node.state, 1, remapped_pending=0, reset_sticky=0)  # the reboot applied the remap
    after = _run(node, backend)
    assert (after.action, after.outcome) == ("reboot", "resumed"), after
    assert backend.flags == {"IDLE"} and [r["outcome"] for r in _rows(node)] == ["escalated", "resumed"]


def test_a_fault_that_survives_the_reboot_goes_to_rma(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1, reset_sticky=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"
    backend.boot()
    out = _run(node, backend)
    assert out.outcome == "rma" and "RMA: GPU" in backend.reason and "survived the reboot" in backend.reason


@pytest.mark.parametrize("reason,words", [
    ("maintenance by alice", "someone else"),
    ("slurm-gpu: bad cable [manual by alice]", "manually"),
])
def test_remediate_leaves_drains_that_are_not_its_own(sim_node, tmp_path, reason, words):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=reason)
    out = _run(node, backend)
    assert out.outcome == "left-alone" and words in out.message and backend.actions == []
    assert "gpu.1.resets" not in simgpu.read_state(node.state)


def test_remediate_does_nothing_while_slurm_has_a_job_or_a_process_holds_a_gpu(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(state="MIXED+DRAIN", reason=PROLOG_REASON, gpus_allocated=1)
    assert _run(node, backend).outcome == "busy" and backend.actions == []
    backend = MemSlurm(reason=PROLOG_REASON)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        simgpu.set_gpu(node.state, 0, procs=[(sleeper.pid, 1 << 30)])
        out = _run(node, backend)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert out.outcome == "busy" and "process" in out.message and backend.actions == []
    assert "gpu.1.resets" not in simgpu.read_state(node.state)


def test_two_remediate_runs_on_one_node_do_not_both_act(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    with REM.node_lock(str(tmp_path / "rem.lock")) as held:
        assert held
        out = _run(node, backend)
    assert out.outcome == "busy" and "lock" in out.message and backend.actions == []


def test_a_job_slurm_placed_before_the_drain_took_effect_stops_the_reset(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)

    class Racing(MemSlurm):
        def drain(self, name, reason):
            super().drain(name, reason)
            self.gpus_allocated, self.flags = 1, {"MIXED", "DRAIN"}  # the job started meanwhile

    backend = Racing(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert out.outcome == "busy" and "gpu.1.resets" not in simgpu.read_state(node.state)


def test_reset_budget_spent_escalates_to_a_reboot_and_reboot_budget_spent_leaves_it_for_a_human(sim_node, tmp_path):
    node = _node(sim_node, tmp_path, "max_resets_per_gpu_per_day = 0\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert out.outcome == "requested" and "gpu.1.resets" not in simgpu.read_state(node.state)
    backend.boot()
    simgpu.set_gpu(node.state, 1, remapped_pending=0)
    assert _run(node, backend).outcome == "resumed"
    backend.drain("gpu01", PROLOG_REASON)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    out = _run(node, backend)  # one reboot per node per day by default
    assert out.outcome == "refused" and "max_reboots_per_node_per_day" in out.message
    assert backend.actions[-1][0] == "drain"


def test_a_gpu_that_faults_again_after_its_remedies_is_a_lemon_and_goes_to_rma(sim_node, tmp_path):
    node = _node(sim_node, tmp_path, "lemon_remedies = 2\nmax_resets_per_gpu_per_day = 5\n")
    backend = MemSlurm(reason=PROLOG_REASON)
    for _ in range(2):
        simgpu.set_gpu(node.state, 1, remapped_pending=1)
        backend.drain("gpu01", PROLOG_REASON)
        assert _run(node, backend).outcome == "resumed"
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend.drain("gpu01", PROLOG_REASON)
    out = _run(node, backend)
    assert out.outcome == "rma" and "lemon" in backend.reason


def _xid_bursts(node, gpu_index, codes_at):
    """Record XID rows of the node's GPU as the checks would (by its UUID), at these (time, code)s."""
    from slurm_gpu.store import observations as obs
    from slurm_gpu.store.node import Store
    uuid = simgpu.read_state(node.state)[f"gpu.{gpu_index}.uuid"]
    st = Store(str(node.db), str(node.db.parent / "spool"))
    rows = []
    for t, code in codes_at:
        rows += [dict(r, gpu_uuid=uuid, gpu_index=gpu_index) for r in obs.xid_rows(
            [XidEvent(t, (0, 0x28, 0), code, f"pid=0, XID {code} at {t}", None, 1, t, ())], None, "gpu01")]
    assert st.record_xids(rows) == len(codes_at)
    st.close()


def test_a_gpu_with_three_bursts_of_hardware_xids_that_faults_again_is_a_lemon(sim_node, tmp_path):
    """Issue 39 item 4: bursts of XIDs of one GPU feed the lemon rule (lemon_xid_bursts 3): three bursts of
    XID 79/48 a day apart, the GPU faults again: RMA, though no remedy of ours was counted."""
    node = _node(sim_node, tmp_path, "lemon_remedies = 10\n")
    day = 86400.0
    now = time.time()
    # bursts: two lines 10 min apart are one burst (xid.window_s 3600), then two more a day apart
    _xid_bursts(node, 1, [(now - 3 * day, 79), (now - 3 * day + 600, 48), (now - 2 * day, 79), (now - day, 48)])
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert out.outcome == "rma" and "3 bursts of hardware XIDs (48, 79)" in out.message, out
    assert backend.reason.startswith("slurm-gpu: RMA:") and "lemon" in backend.reason, backend.reason


def test_driver_and_application_xid_bursts_never_make_a_lemon(sim_node, tmp_path):
    """A driver rollout's XID 119 and a job's XID 13 land on every GPU: they never count as the board's."""
    node = _node(sim_node, tmp_path, "lemon_remedies = 10\n")
    now, day = time.time(), 86400.0
    _xid_bursts(node, 1, [(now - k * day, code) for k in (2, 3, 4, 5) for code in (119, 13)])
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "resumed"
    # another GPU's three hardware bursts: a lemon at 3, not at 4; lemon_xid_bursts 0 turns the count off
    _xid_bursts(node, 0, [(now - 3 * day, 79), (now - day, 79), (now - 2 * day, 95)])
    b = BUDGET.Budget.from_config(config.load(str(node.config)))
    assert b.burst_codes and 119 not in b.burst_codes and 13 not in b.burst_codes and 79 in b.burst_codes
    uuid0 = simgpu.read_state(node.state)["gpu.0.uuid"]
    from slurm_gpu.store.node import Store
    rows = Store(str(node.db), str(node.db.parent / "spool")).gpu_xids(uuid0, now - 30 * day)
    assert BUDGET.xid_bursts(b, rows, now) == (3, (79, 95))
    assert BUDGET.is_lemon(b._replace(lemon_xid_bursts=4), [], now, rows) == (False, "")
    assert BUDGET.is_lemon(b._replace(lemon_xid_bursts=0), [], now, rows) == (False, "")
    assert BUDGET.is_lemon(b, [], now, rows)[0]


def test_a_reset_fault_that_names_no_gpu_runs_no_reset_command_and_escalates():
    """A node-wide reset fault (an XID whose bus id matches no GPU) has nothing to reset: the
    reset step must say so (so remediate escalates) instead of running nothing and verifying."""
    ran = []
    env = type("E", (), {"spawn": lambda self, *a, **k: ran.append(a), "say": lambda self, *a, **k: None,
                         "get": lambda self, k: 10.0, "node": "gpu01"})()
    node_wide = R.Remedy("xid", None, "", R.RESET, "NVIDIA XID catalog", "XID 48 on an unknown GPU")
    assert ACT.reset_gpus(env, None, [node_wide], [0])[0].endswith("names no GPU to reset")
    assert ACT.reset_gpus(env, None, [], []) == ("the fault names no GPU to reset", False)
    assert ran == []


def test_dry_run_says_the_step_and_changes_nothing(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    out = _run(node, backend, dry_run=True)
    assert out.outcome == "would-reset" and backend.actions == [] and _rows(node) == []


def test_healthcheck_during_a_reset_does_not_resume_the_node(sim_node, tmp_path):
    backend = MemSlurm(reason="slurm-gpu: GPU 1 pending row remap [remediate: reset]")
    out = node_health_cycle(backend, "gpu01", lambda info: [CheckResult("pending_reset", "PASS", 1, "u", "ok")])
    assert out.action == "kept-drained" and backend.actions == []


def _cli(monkeypatch, node, backend, *args):
    from click.testing import CliRunner

    from slurm_gpu.cli import main
    from slurm_gpu.slurm import backend as slurm_backend
    monkeypatch.setattr(slurm_backend, "get_backend", lambda cfg: backend)
    return CliRunner().invoke(main, ["--config", str(node.config), *args, "--node", "gpu01"])


def test_healthcheck_with_remediation_enabled_resets_and_resumes_the_node_it_found_drained(sim_node, tmp_path,
                                                                                         monkeypatch):
    node = _node(sim_node, tmp_path, "enabled = true\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    r = _cli(monkeypatch, node, backend, "healthcheck")
    assert r.exit_code == 0 and "reset and verified; resumed" in r.output, r.output
    assert backend.flags == {"IDLE"}


def test_healthcheck_without_remediation_keeps_the_drain_and_remediate_command_acts(sim_node, tmp_path, monkeypatch):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    r = _cli(monkeypatch, node, backend, "healthcheck")
    assert r.exit_code == 1 and "DRAIN" in backend.flags and "gpu.1.resets" not in simgpu.read_state(node.state)
    r = _cli(monkeypatch, node, backend, "remediate")
    assert r.exit_code == 0 and "resumed" in r.output, r.output


def test_docs_remediation_shows_the_same_remedy_map():
    assert R.markdown_table() in (DOCS / "remediation.md").read_text()


def test_a_verification_that_fails_after_the_reboot_puts_our_reason_back(sim_node, tmp_path, monkeypatch):
    """Slurm's "reboot complete" must not stay the reason of a node whose check failed after our
    reboot: nothing of ours would then ever look at it again."""
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1, reset_sticky=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"
    backend.boot()
    simgpu.set_gpu(node.state, 1, remapped_pending=0, reset_sticky=0)
    monkeypatch.setattr(ACT, "verify_checks", lambda env, info: "pass 2 of 2: GPU 1 pending row remap")
    out = _run(node, backend)
    assert (out.action, out.outcome) == ("reboot", "failed"), out
    assert backend.reason.startswith("slurm-gpu: ") and "[remediate: verify after reboot]" in backend.reason


@pytest.mark.parametrize("cured", [True, False])
def test_a_node_slurm_returned_to_service_after_our_reboot_is_checked_and_drained_when_still_faulty(sim_node, tmp_path,
                                                                                                   cured):
    """ReturnToService=2 returns a rebooted node to service on its next registration although the
    reboot asked nextstate=DOWN (seen on the 24.11 testbed): remediate still checks it."""
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1, reset_sticky=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"
    backend.boot()
    backend.flags, backend.reason = {"IDLE"}, ""  # Slurm's own return to service
    if cured:
        simgpu.set_gpu(node.state, 1, remapped_pending=0, reset_sticky=0)
    out = _run(node, backend)
    assert (out.action, out.outcome) == ("reboot", "resumed" if cured else "failed"), out
    assert [r["outcome"] for r in _rows(node)] == ["escalated", "resumed" if cured else "failed"]
    if cured:
        assert backend.flags == {"IDLE"} and backend.reason == ""
    else:
        assert "DRAIN" in backend.flags and backend.reason.endswith("[remediate: verify after reboot]")
    assert _run(node, backend).outcome != "requested"  # the reboot is not asked for twice


# --- the healthcheck's runs on one node take turns (issue 34: slurmd starts the next run while one still goes)

class _Lines:
    def __init__(self):
        self.lines = []

    def warning(self, event, **fields):
        self.lines.append((event, fields))


def _hc_cfg(path):
    from slurm_gpu.config import defaults
    return defaults().replace("hooks", healthcheck_lock_file=str(path))


def test_a_healthcheck_waits_its_turn_behind_the_run_before_it_on_the_node(tmp_path):
    import threading

    from slurm_gpu.hooks.healthcheck import taking_turns
    cfg, log = _hc_cfg(tmp_path / "hc-%n.lock"), _Lines()
    before = REM.node_lock(str(tmp_path / "hc-gpu01.lock"))
    assert before.__enter__()
    threading.Timer(0.5, before.__exit__, (None, None, None)).start()
    t0 = time.monotonic()
    with taking_turns(cfg, "gpu01", 45.0, log) as left_s:
        waited = time.monotonic() - t0
        assert left_s is not None and 0.4 < waited < 5 and 45.0 - waited - 0.2 < left_s <= 45.0 - waited + 0.01
    with taking_turns(cfg, "gpu02", 45.0, log) as other:  # another node's runs never wait on gpu01's
        assert other is not None and other > 44.5
    assert log.lines == []


def test_a_healthcheck_whose_turn_does_not_come_leaves_the_node_to_the_run_before(tmp_path):
    from slurm_gpu.hooks.healthcheck import busy_outcome, taking_turns
    cfg, log = _hc_cfg(tmp_path / "hc-%n.lock"), _Lines()
    with REM.node_lock(str(tmp_path / "hc-gpu01.lock")) as held:
        assert held
        t0 = time.monotonic()
        with taking_turns(cfg, "gpu01", 2.0, log) as left_s:  # waits a quarter of its deadline
            assert left_s is None and 0.4 < time.monotonic() - t0 < 3
    out = busy_outcome("gpu01")
    assert (out.action, out.exit_code) == ("busy", 0) and "still runs" in out.message


def test_a_healthcheck_lock_that_cannot_be_opened_is_logged_and_the_check_still_runs(tmp_path):
    from slurm_gpu.hooks.healthcheck import taking_turns
    (tmp_path / "file").write_text("")
    cfg, log = _hc_cfg(tmp_path / "file" / "hc-%n.lock"), _Lines()  # a directory that is a file
    with taking_turns(cfg, "gpu01", 45.0, log) as left_s:
        assert left_s == 45.0
    assert [e for e, _ in log.lines] == ["healthcheck-lock-unavailable"]
    assert log.lines[0][1]["path"].endswith("/file/hc-gpu01.lock") and log.lines[0][1]["hint"]


# ------------------------------------------------------------------ issue 35: crash, clock, look-alike, busy, bad input

def test_a_killed_runs_started_reset_is_closed_interrupted_and_the_resumed_gpu_is_not_pending(sim_node, tmp_path):
    """Row 2: the intent row of a killed run stayed `started` forever and `fleet remediation` showed the
    healthy, resumed GPU as pending."""
    from slurm_gpu.fleet.remediation import state_of
    node = _node(sim_node, tmp_path)
    backend = MemSlurm(reason="slurm-gpu: GPU 1 pending row remap [remediate: reset]")
    conn = sqlite3.connect(str(node.db)) if node.db.exists() else None
    if conn is None:
        from slurm_gpu.store.node import Store
        Store(str(node.db), str(tmp_path / "spool")).connect().close()
        conn = sqlite3.connect(str(node.db))
    serial = simgpu.read_state(node.state)["gpu.1.serial"]
    conn.execute("INSERT INTO remediations (time, node, gpu_index, gpu_uuid, serial, action, outcome, pid, pid_start) "
                 "VALUES (?, 'gpu01', 1, '', ?, 'reset', 'started', 999999999, 1)", (time.time() - 5, serial))
    conn.commit()
    conn.close()
    out = _run(node, backend)
    assert (out.outcome, backend.actions[-1]) == ("resumed", ("resume",)), out
    (row,) = [r for r in _rows(node)]
    assert row["outcome"] == "resumed" and state_of(row) == "resumed"


def test_a_reset_started_moments_ago_by_a_run_that_died_before_its_pid_was_written_keeps_the_node(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    backend = MemSlurm(reason="slurm-gpu: GPU 1 pending row remap [remediate: reset]")
    from slurm_gpu.store.node import Store
    s = Store(str(node.db), str(tmp_path / "spool"))
    s.record_remediation({"time": time.time(), "node": "gpu01", "gpu_index": 1, "gpu_uuid": "", "action": "reset",
                          "outcome": "started"})
    s.close()
    out = _run(node, backend)
    assert out.outcome == "busy" and "reset_timeout_s" in out.message and backend.actions == [], out


@pytest.mark.parametrize("offset_s", [-7200.0, -90000.0, 3 * 3600.0])
def test_a_node_clock_off_slurmctlds_neither_resets_reboots_nor_resumes(sim_node, tmp_path, offset_s):
    """Row 4 (the testbed test runs it under faketime): budgets and breaker compared this node's clock with
    slurmctld's ReasonTime."""
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    backend.ctld_offset = offset_s
    out = _run(node, backend)
    assert out.outcome == "refused" and "off slurmctld's" in out.message and backend.actions == [], out
    assert "gpu.1.resets" not in simgpu.read_state(node.state) and _rows(node) == []
    prom = (tmp_path / "prom" / "slurm_gpu_remediation.prom").read_text()
    (value,) = [float(x.split()[1]) for x in prom.splitlines() if x.startswith("slurm_gpu_clock_skew_seconds ")]
    assert abs(value + offset_s) < 1, prom
    backend.ctld_offset = 30.0  # within remediation.clock_slack_s
    assert _run(node, backend).outcome == "resumed"


def test_attempt_times_are_slurmctlds_so_a_clock_moved_later_cannot_reset_a_budget(sim_node, tmp_path):
    node = _node(sim_node, tmp_path, "max_resets_per_gpu_per_day = 1\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    backend.ctld_offset = 40.0
    assert _run(node, backend).outcome == "resumed"
    conn = sqlite3.connect(str(node.db))
    (t,) = conn.execute("SELECT time FROM remediations").fetchone()
    conn.close()
    assert abs(t - (time.time() + 40.0)) < 5, "the attempt's time is slurmctld's, not this node's"


def test_an_admins_look_alike_reason_is_left_alone_by_remediate_and_healthcheck(sim_node, tmp_path):
    """Row 5: ownership was read from the `slurm-gpu:` prefix."""
    node = _node(sim_node, tmp_path)
    text = "slurm-gpu: hold for vendor ticket 4711, do not resume"
    backend = MemSlurm(reason=text)
    out = _run(node, backend)
    assert out.outcome == "left-alone" and backend.actions == [], out
    hc = node_health_cycle(backend, "gpu01", lambda info: [CheckResult("pending_reset", "PASS", 1, "u", "ok")])
    assert hc.action == "left-alone" and backend.actions == [] and backend.reason == text


def test_a_process_that_appears_after_the_check_makes_the_reset_busy_never_a_reboot(sim_node, tmp_path):
    """Row 6: the reset refused "in use" and that refusal was escalated to a reboot."""
    from slurm_gpu.hooks.healthcheck import default_checker
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    cfg = config.load(str(node.config))
    check = default_checker(cfg)

    def checker_then_a_process_appears(info):
        run = check(info)
        simgpu.set_gpu(node.state, 1, procs=[(os.getpid(), 1 << 30)])
        return run
    out = REM.run_on_node(cfg, backend, "gpu01", checker_then_a_process_appears)
    assert (out.action, out.outcome) == ("reset", "busy") and "no reset" in out.message, out
    assert all(a[0] != "reboot" for a in backend.actions) and "DRAIN" in backend.flags
    assert "gpu.1.resets" not in simgpu.read_state(node.state)


def test_a_reset_refused_in_use_is_busy_and_costs_no_budget(sim_node, tmp_path, monkeypatch):
    node = _node(sim_node, tmp_path, "max_resets_per_gpu_per_day = 1\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = MemSlurm(reason=PROLOG_REASON)
    from slurm_gpu.hooks import check as CHECK
    from slurm_gpu.hooks.healthcheck import default_checker
    real = CHECK.make_reader

    class NoLister:  # the listing before the reset finds nothing: only the command's refusal tells
        def __init__(self, cfg):
            self.r = real(cfg)

        def processes_many(self, indices):
            simgpu.set_gpu(node.state, 1, procs=[(os.getpid(), 1 << 30)])  # it appears right after
            return {i: () for i in indices}

        def __getattr__(self, name):
            return getattr(self.r, name)
    monkeypatch.setattr(CHECK, "make_reader", lambda cfg, library=None: NoLister(cfg))
    cfg = config.load(str(node.config))
    out = REM.run_on_node(cfg, backend, "gpu01", default_checker(cfg))
    assert (out.action, out.outcome) == ("reset", "busy") and "in use, not broken" in out.message, out
    assert [r["outcome"] for r in _rows(node)] == ["busy"]
    simgpu.set_gpu(node.state, 1, procs=[])
    monkeypatch.setattr(CHECK, "make_reader", real)
    again = _run(node, backend)  # the budget of one reset a day is still there
    assert (again.action, again.outcome) == ("reset", "resumed"), again


def test_a_corrupt_node_database_is_one_line_and_exit_2_for_remediate_and_healthcheck(sim_node, tmp_path, monkeypatch):
    """Row 7: a sqlite3.DatabaseError traceback, and remediation silently never ran."""
    node = _node(sim_node, tmp_path, "enabled = true\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    node.db.parent.mkdir(parents=True, exist_ok=True)
    node.db.write_bytes(b"this is not a database" * 100)
    backend = MemSlurm(reason=PROLOG_REASON)
    r = _cli(monkeypatch, node, backend, "remediate")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("slurm-gpu: error:")]
    assert len(lines) == 1 and str(node.db) in lines[0] and "nothing done" in lines[0], r.output
    assert backend.actions == []
    hc = _cli(monkeypatch, node, backend, "healthcheck")
    assert "Traceback" not in hc.output and "remediation did not run" in hc.output, hc.output
    assert hc.exit_code == 1  # the healthcheck's own verdict (FAIL) still reaches Slurm


def test_remediate_run_as_a_user_is_one_line_and_exit_2(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    env = dict(os.environ, SLURM_GPU_CONFIG=str(node.config))
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                        "slurm_gpu.cli", "remediate", "--node-name", "gpu01"], env=env, capture_output=True, text=True,
                       cwd="/")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "must run as root" in r.stderr, r.stdout + r.stderr


def test_node_name_names_every_percent_n_path():
    cfg = config.defaults().for_node("gpu04")
    assert cfg.path_value("remediation", "lock_file") == "/run/slurm-gpu/remediate-gpu04.lock"
    assert cfg.replace("store", database="/x/%n.db").path_value("store", "database") == "/x/gpu04.db"


class AdminDrainsRightAfterTheFirstLook(MemSlurm):
    """slurmctld where an admin drains the node for maintenance just after remediate first read it."""

    ADMIN = "maintenance: PSU swap [alice]"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.looks = 0

    def node(self, name):
        info = super().node(name)
        self.looks += 1
        if self.looks == 1:
            self.reason = self.ADMIN  # after this answer: the admin's drain lands before remediate's next step
        return info


def test_an_admins_drain_that_lands_after_remediates_first_look_is_never_overwritten_or_resumed(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = AdminDrainsRightAfterTheFirstLook(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert backend.reason == backend.ADMIN and "DRAIN" in backend.flags, (out, backend.actions)
    assert not [a for a in backend.actions if a[0] in ("drain", "resume")], backend.actions
    assert "gpu.1.resets" not in simgpu.read_state(node.state), out
