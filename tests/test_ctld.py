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
