"""The controller epilog's write into accounting (hooks/ctld.py), without slurmctld.

The real path runs in tests/integration/test_job_summary_slurm.py; here the moment it cannot
reproduce at will: slurmdbd has not yet heard of the job when EpilogSlurmctld writes."""
from __future__ import annotations

import pytest

from slurm_gpu.errors import NotInAccounting, SlurmError
from slurm_gpu.hooks import ctld
from slurm_gpu.hooks.main import _Run


class Accounting:
    """set_admin_comment that finds the job only after `late` tries (slurmdbd behind)."""

    def __init__(self, late: int, error: type = NotInAccounting):
        self.late, self.error, self.calls = late, error, []

    def set_admin_comment(self, job_id, cluster, text, named=""):
        self.calls.append((job_id, cluster, text, named))
        if len(self.calls) <= self.late:
            raise self.error(f"sacctmgr modified nothing for job {job_id}: not in accounting (yet)")


def _run(deadline_s: float = 60.0) -> _Run:
    run = _Run(ctld.NAME, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "2"})
    run.deadline_s = deadline_s
    return run


def test_a_job_slurmdbd_has_not_heard_of_yet_is_written_once_it_has():
    """CI: 'sacctmgr modified nothing for job N: not in accounting (yet)' and no summary, 1 run in 3."""
    acct, slept = Accounting(late=3), []
    assert ctld._write(_run(), acct, 7, "c1", "sg1;x", slept.append) == 4
    assert slept == [ctld.WRITE_RETRY_S] * 3
    assert acct.calls[-1] == (7, "c1", "sg1;x", "5_2")


def test_the_write_gives_up_before_the_hooks_deadline():
    acct, slept = Accounting(late=10**6), []
    with pytest.raises(NotInAccounting):
        ctld._write(_run(deadline_s=ctld.WRITE_MARGIN_S + 0.5), acct, 7, "c1", "t", slept.append)
    assert slept == [] and len(acct.calls) == 1


def test_other_sacctmgr_errors_are_not_retried():
    acct, slept = Accounting(late=1, error=SlurmError), []
    with pytest.raises(SlurmError):
        ctld._write(_run(), acct, 7, "c1", "t", slept.append)
    assert slept == [] and len(acct.calls) == 1


# --------------------------------------------------------------------------- energy into accounting

def test_the_jobs_gpu_energy_is_the_sum_of_its_whole_gpus():
    assert ctld.job_energy_j([{"energy_j": 1000.4}, {"energy_j": 2000.3}]) == 3001
    assert ctld.job_energy_j([{"energy_j": 1000.0}, {"energy_j": None}]) is None  # one GPU unknown
    assert ctld.job_energy_j([{"energy_j": 10.0, "parent_gpu_uuid": "GPU-x"}]) is None  # a MIG slice
    assert ctld.job_energy_j([]) is None


class EnergyAccounting:
    def __init__(self, settable=True, there=0, fail=None):
        self.settable, self.there, self.fail, self.set = settable, there, fail, []

    def energy_tres_settable(self):
        return self.settable

    def job_energy_j(self, job_id, cluster=""):
        return self.there

    def set_job_energy(self, job_id, cluster, joules, named=""):
        if self.fail:
            raise self.fail
        self.set.append((job_id, cluster, joules, named))


ROWS = [{"energy_j": 36000.0}, {"energy_j": 36000.4}]


@pytest.mark.parametrize("backend, partial, rows, outcome, written", [
    (EnergyAccounting(), False, ROWS, "written", [(7, "c1", 72000, "5_2")]),
    (EnergyAccounting(settable=False), False, ROWS, "unsupported", []),      # 22.05, 24.11
    (EnergyAccounting(there=5100), False, ROWS, "kept", []),                 # Slurm measured its own
    (EnergyAccounting(there=72000), False, ROWS, "kept", []),                # ours, from an earlier run
    (EnergyAccounting(), True, ROWS, "skipped", []),                         # partial: a sum too low
    (EnergyAccounting(fail=SlurmError("sacctmgr: boom", "hint")), False, ROWS, "failed", []),
])
def test_energy_goes_into_accounting_only_where_slurm_has_none(backend, partial, rows, outcome, written):
    assert ctld._energy_into_accounting(_run(), backend, 7, "c1", partial, rows) == outcome
    assert backend.set == written


def test_admin_comment_and_energy_go_through_one_sacctmgr_modify_job():
    from test_verify import Recorder
    b = Recorder({"jobid=9 ": (0, " Nothing modified\n", "")})
    b.set_admin_comment(7, "c1", "sg1:x", named="5_2")
    b.set_job_energy(7, "c1", 72000)
    assert b.argv == [["sacctmgr", "-i", "modify", "job", "where", "jobid=5_2", "cluster=c1", "set", "AdminComment=sg1:x"],
                      ["sacctmgr", "-i", "modify", "job", "where", "jobid=7", "cluster=c1", "set", "TRES=energy=72000"]]
    b = Recorder({"jobid=9": (0, " Nothing modified\n", "")})
    for write in (lambda: b.set_admin_comment(9, "", "t"), lambda: b.set_job_energy(9, "", 1)):
        with pytest.raises(NotInAccounting, match="modified nothing for job 9"):
            write()
