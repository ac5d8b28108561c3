"""Whose process is it: the job a /proc/PID/cgroup names, and the rule the epilog kills by
(hooks/procs.py).  The real processes under real slurmd: tests/integration/test_cgroup_processes_slurm.py."""
from __future__ import annotations

import time

import pytest
import simgpu

from slurm_gpu.hooks import procs
from slurm_gpu.hooks.procs import UNKNOWN_JOB, is_the_jobs, job_in_cgroup
from slurm_gpu.slurm.jobenv import from_env

# Observed on this machine's Slurm 22.05 (cgroup/v1, the testbed's own cgroup namespace), and the
# same process read from outside that namespace.
V1_2205 = b"""9:name=systemd:/
8:pids:/
6:freezer:/slurm_gpu01/uid_2501/job_1/step_batch
5:devices:/slurm_gpu01/uid_2501/job_1/step_batch
4:memory:/slurm_gpu01/uid_2501/job_1/step_batch/task_0
2:cpuacct:/slurm_gpu01/uid_2501/job_1/step_batch/task_0
0::/
"""
V1_OUTSIDE = b"6:freezer:/slurm-gpu-testbed-4242-1/slurm_gpu01/uid_2501/job_12/step_0\n"
# cgroup/v2 as documented, not observed on real daemons here (these machines have cgroup v1 only):
# up to 25.11, and 26.05 with CgroupJobIdPaths=yes, the job directory is job_<id>; 26.05's default
# names it by the SLUID (cgroup.conf(5), 26.05).
V2_JOBID = b"0::/system.slice/slurmstepd.scope/job_123/step_batch/user/task_0\n"
V2_SLUID = b"0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_batch/user/task_0\n"
V2_SLUID_EXTERN = b"0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_extern/slurm_processes\n"


@pytest.mark.parametrize("text, mark", [
    (V1_2205, 1), (V1_OUTSIDE, 12), (V2_JOBID, 123), (V2_SLUID, "sEKNKTV3WPV500"),
    (V2_SLUID_EXTERN, "sEKNKTV3WPV500"),
    (b"0::/system.slice/slurmd.service\n", None),
    (b"0::/system.slice/slurmstepd.scope/system\n", None),
    (b"0::/user.slice/user-2501.slice/session-3.scope\n", None),
    (b"4:memory:/process_api/9efeaee4edf9934c42b71e27b500348d\n", None),
    (b"6:freezer:/slurm_gpu01/uid_2501/job_1x/step_0\n", None),
    (b"", None),
])
def test_the_job_a_cgroup_path_names(text, mark):
    assert job_in_cgroup(text) == mark


def _job(job_id=12, uid=2501, sluid=None):
    env = {"SLURM_JOB_ID": str(job_id), "SLURMD_NODENAME": "gpu01", "SLURM_JOB_UID": str(uid)}
    if sluid is not None:
        env["SLURM_JOB_SLUID"] = sluid
    return from_env(env)


@pytest.mark.parametrize("uid, mark, job, ours", [
    (2501, 12, _job(), True),
    (2501, 13, _job(), False),                     # the user's other job
    (2502, 12, _job(), False),                     # another user's process that claims the job id
    (None, 12, _job(), False),
    (2501, None, _job(), False),                   # nothing places it: never killed (issue 36)
    (2501, UNKNOWN_JOB, _job(), False),            # environment unreadable or empty
    (2501, "sEKNKTV3WPV500", _job(sluid="sEKNKTV3WPV500"), True),
    (2501, "sEKNKTV3WPV501", _job(sluid="sEKNKTV3WPV500"), False),
    (2501, "sEKNKTV3WPV500", _job(), False),       # a SLUID path but Slurm gave the hook none
    (2501, 12, _job(sluid="sEKNKTV3WPV500"), True),
])
def test_only_the_jobs_own_process_is_the_jobs(uid, mark, job, ours):
    assert is_the_jobs(uid, mark, job) is ours


@pytest.mark.parametrize("raw, sluid", [
    ("sEKNKTV3WPV500", "sEKNKTV3WPV500"), (" sEKNKTV3WPV500\n", "sEKNKTV3WPV500"), ("", ""),
    ("12345", ""), ("sekn", ""), ("s" + "A" * 40, ""), ("sEKN/../x", ""),
])
def test_a_sluid_of_another_shape_is_no_sluid_and_no_error(raw, sluid):
    assert _job(sluid=raw).sluid == sluid


# Field 9 of /proc/PID/stat (flags); PF_EXITING is 0x4.  The command name may hold ") ".
STAT = b"4242 (sleep) x) R 1 4242 4242 0 -1 %d 100 0 0 0 1 2 0 0 20 0 1 0 5000 1000 10\n"


@pytest.mark.parametrize("flags, exiting", [(0x400004, True), (0x400000, False), (0x404044, True)])
def test_a_process_in_do_exit_is_told_by_its_stat_flags(monkeypatch, flags, exiting):
    monkeypatch.setattr(procs, "_proc_file", lambda pid, name: STAT % flags)
    assert procs.process_exiting(4242) is exiting


def test_a_process_gone_when_read_is_not_exiting():
    assert procs.process_exiting(simgpu.dead_pid()) is False


class Dying:
    """pid_alive of a process that ends `after` seconds from now (None: never)."""

    def __init__(self, after):
        self.end = None if after is None else time.monotonic() + after

    def pid_alive(self, pid):
        return self.end is None or time.monotonic() < self.end


def test_the_epilog_waits_for_a_process_slurm_is_ending(monkeypatch):
    """24.11 and 26.05: the epilog met the job's own process half-exited (environment empty, so it could
    not be placed) and drained a healthy node for it."""
    monkeypatch.setattr(procs, "process_exiting", lambda pid: True)
    deps, t0 = Dying(0.3), time.monotonic()
    procs._await_exits(deps, [4242])
    assert 0.3 <= time.monotonic() - t0 < 2 and not deps.pid_alive(4242)


def test_a_process_stuck_in_exit_is_waited_for_a_bounded_time(monkeypatch):
    monkeypatch.setattr(procs, "process_exiting", lambda pid: True)
    monkeypatch.setattr(procs, "EXIT_WAIT_S", 0.3)
    t0 = time.monotonic()
    procs._await_exits(Dying(None), [4242])
    assert 0.3 <= time.monotonic() - t0 < 2


def test_a_live_process_not_exiting_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(procs, "process_exiting", lambda pid: False)
    t0 = time.monotonic()
    procs._await_exits(Dying(None), [4242])
    assert time.monotonic() - t0 < 0.1
