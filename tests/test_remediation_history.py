"""Issue 26, the remediation history across the cluster: when each remedied fault was drained, the
rows shipped by `db push`, `slurm-gpu fleet remediation`, and a GPU's lemon budget following its
serial from node to node through the central server."""
from __future__ import annotations

import sqlite3

import simgpu
from test_remediation import PROLOG_REASON, MemSlurm, _node, _run

from slurm_gpu.slurm import model as slurm
from slurm_gpu.store import record
from slurm_gpu.store.node import Store


def _drain_times(node):
    conn = sqlite3.connect(str(node.db))
    try:
        return [r[0] for r in conn.execute("SELECT drain_time FROM remediations ORDER BY id")]
    finally:
        conn.close()


class TimedSlurm(MemSlurm):
    """A backend that has Slurm's ReasonTime: a new reason gets the time it was set."""

    def __init__(self, reason_time, **kw):
        super().__init__(**kw)
        self.reason_time, self.clock = reason_time, reason_time

    def node(self, name):
        return super().node(name)._replace(reason_time=self.reason_time)

    def drain(self, name, reason):
        super().drain(name, reason)
        self.clock += 100.0
        self.reason_time = self.clock  # scontrol update sets ReasonTime anew


# ------------------------------------------------------------------ 1. drain_time

def test_remediation_rows_carry_slurms_reason_time_of_the_drain_they_remedy_not_remediates_own_redrain(
        sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1, reset_sticky=1)  # reset fails: reset row, then reboot row
    backend = TimedSlurm(1_700_000_000.0, reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"
    assert _drain_times(node) == [1_700_000_000.0, 1_700_000_000.0]


def test_without_slurms_reason_time_the_drain_time_is_the_node_databases_drain_record(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    store = Store(str(node.db), str(tmp_path / "spool"))
    store.write(record.Drains([record.drain("gpu01", "healthcheck", "slurm-gpu: other fault [healthcheck]",
                                            record.DRAINED, 1_600_000_000.0),
                               record.drain("gpu01", "prolog", PROLOG_REASON, record.DRAINED, 1_650_000_000.0,
                                            job_id=4711)]))
    store.close()
    backend = MemSlurm(reason=PROLOG_REASON)  # reason_time None, as a backend without it gives
    assert backend.node("gpu01").reason_time is None
    assert _run(node, backend).outcome == "resumed"
    assert _drain_times(node) == [1_650_000_000.0]


def test_a_run_after_remediates_own_redrain_keeps_the_first_drains_time(sim_node, tmp_path):
    """After a reboot the reason is remediate's own ([remediate: reboot] : reboot complete): its
    ReasonTime is the reboot's, the drain being remedied is the one the attempt rows remember."""
    node = _node(sim_node, tmp_path, "max_resets_per_gpu_per_day = 0\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = TimedSlurm(1_700_000_000.0, reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"  # refused reset row + reboot row
    backend.boot()
    backend.reason_time = 1_700_009_999.0
    out = _run(node, backend)  # the fault survived the boot: RMA row
    assert out.outcome == "rma"
    assert set(_drain_times(node)) == {1_700_000_000.0}
