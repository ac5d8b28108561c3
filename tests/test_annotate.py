"""`slurm-gpu central annotate` for one job (cli/central.py _annotate_one), against a stand-in of the
cli backend's accounting calls: a complete summary whose job Slurm holds no energy for (the controller
epilog's energy write failed) gets the energy; one with Slurm's own figure is never overwritten.
The real sacct/sacctmgr path: tests/integration/test_job_summary_slurm.py."""
from __future__ import annotations

from slurm_gpu.cli import central as cli_central
from slurm_gpu.store import summary as S

ROWS = [{"node": "gpu01", "gpu_index": i, "gpu_model": "NVIDIA H100", "start_time": 100.0, "end_time": 3700.0,
         "gpu_util_mean_pct": 80.0, "mem_util_mean_pct": 30.0, "max_memory_bytes": 1 << 30,
         "memory_total_bytes": 80 << 30, "energy_j": 1800.4 + i, "ecc_uncorrected_delta": 0, "xid_events": "[]",
         "parent_gpu_uuid": None, "restart_count": 0} for i in range(2)]


class Accounting:
    """What _annotate_one asks of the cli backend: energies and named_ids (filled by admin_comments)."""

    def __init__(self, energy_j):
        self.energies, self.named_ids = {7: energy_j}, {}
        self.comments, self.energy_set = [], []

    def energy_tres_settable(self):
        return True

    def job_energy_j(self, job_id, cluster=""):
        return self.energies.get(job_id)

    def set_job_energy(self, job_id, cluster, joules, named=""):
        self.energy_set.append((job_id, cluster, joules))
        self.energies[job_id] = joules

    def set_admin_comment(self, job_id, cluster, text, named=""):
        self.comments.append(text)


def _complete_comment():
    return S.fit(S.from_records("c", 7, 0, ["gpu01"], ROWS))


def _annotate(backend, comment, energy=True):
    return cli_central._annotate_one(backend, None, S, lambda srv, cluster, job_id, restart: ROWS, "c", 7, 0, comment,
                                     False, energy)


def test_a_complete_summary_whose_job_has_no_energy_in_slurm_gets_it():
    acct = Accounting(energy_j=0)
    assert _annotate(acct, _complete_comment()) == "energy"
    assert acct.energy_set == [(7, "c", 3602)] and acct.comments == []  # the summary itself is left as it was


def test_slurms_own_energy_is_never_overwritten_and_nothing_is_written_without_energy_tres():
    acct = Accounting(energy_j=5000)
    assert _annotate(acct, _complete_comment()) == "kept" and acct.energy_set == []
    acct = Accounting(energy_j=0)
    assert _annotate(acct, _complete_comment(), energy=False) == "kept" and acct.energy_set == []
