"""The epilog's leftover processes: whose a process is (/proc), and the TERM/KILL loop for the job's own.

Only the job's own processes are ever signalled: another user's or job's, or one whose job cannot be
told, stays, and the health checks report it (leftover_processes)."""
from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

from slurm_gpu.errors import NvmlWriteError
from slurm_gpu.slurm.gpumap import JobGpuMap
from slurm_gpu.slurm.jobenv import JobEnv

if TYPE_CHECKING:
    from slurm_gpu.hooks.deps import HookDeps


def process_start_time(pid: str = "self") -> Optional[float]:
    """Unix time a process started (/proc: start ticks after boot; boot from uptime, 10 ms
    precision, unlike /proc/stat's whole-second btime).  None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _proc_file(pid: int, name: str) -> bytes:
    """/proc/<pid>/<name>, whole (OSError when the process or the file is gone or unreadable)."""
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie holds no GPU context)."""
    try:
        stat = _proc_file(pid, "stat")
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # Field 3 follows the parenthesised command name, which may itself contain ')'.
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


# A job's directory in a process's cgroup path: job_<id> (cgroup v1; v2 up to 25.11, and 26.05 with
# CgroupJobIdPaths=yes), or the job's SLUID right above a step directory (cgroup/v2 from 26.05:
# .../slurmstepd.scope/sEKNKTV3WPV500/step_batch/...).  Compiled on first use: only the epilog, only
# with leftovers.
_JOB_CGROUP = rb"(?m)/job_(\d{1,10})(?:/|$)"
_SLUID_CGROUP = rb"(?m)/(s[0-9A-Z]{8,24})/(?:step_|task_|user(?:/|$))"


UNKNOWN_JOB = -1  # process_identity: the process's job cannot be told (environment unreadable or empty)
JobMark = Union[int, str, None]  # a job id, a SLUID (str), UNKNOWN_JOB, or None: nothing shows a job


def job_in_cgroup(text: bytes) -> JobMark:
    """The job a /proc/PID/cgroup names: its id, its SLUID (26.05's cgroup/v2 paths), or None."""
    m = re.search(_JOB_CGROUP, text)
    if m:
        return int(m.group(1))
    m = re.search(_SLUID_CGROUP, text)
    return m.group(1).decode("ascii") if m else None


def process_identity(pid: int) -> Tuple[Optional[int], JobMark]:
    """(real uid, the job) of a live process; None where the system does not show it.

    The job comes from the process's cgroup (job_<id>, or the SLUID directory of 26.05's cgroup/v2)
    or, without one, from its SLURM_JOB_ID (root may read every environment). An environment that
    cannot be read, or reads empty, gives UNKNOWN_JOB: a process in the middle of execve()
    shows an empty one to a reader that comes too soon (a parent that started it with vfork(),
    as Python's subprocess does, runs on once the old memory is released, before the new stack
    is set up: seen every time under Python 3.14, now and then under load on 3.11), and so does
    one started with no environment at all - neither can be told to be the job's."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            uid = next((int(line.split()[1]) for line in f if line.startswith(b"Uid:")), None)
    except (OSError, ValueError, IndexError):
        return None, None
    try:
        mark = job_in_cgroup(_proc_file(pid, "cgroup"))
        if mark is not None:
            return uid, mark
    except OSError:
        pass
    return uid, _job_from_environ(pid)


def _job_from_environ(pid: int) -> Optional[int]:
    for attempt in range(2):
        try:
            raw = _proc_file(pid, "environ")
        except OSError:
            return UNKNOWN_JOB
        if raw:
            for item in raw.split(b"\0"):
                if item.startswith(b"SLURM_JOB_ID=") and item[13:].isdigit():
                    return int(item[13:])
            return None
        if attempt == 0:
            time.sleep(0.02)  # an execve() under way finishes setting up its stack in microseconds
    return UNKNOWN_JOB


def is_the_jobs(uid: Optional[int], mark: JobMark, job: JobEnv) -> bool:
    """Whether a process of `uid` marked `mark` (process_identity) is the job's own: the job's uid and
    the job's id or SLUID shown.  Nothing shown (no job cgroup, no SLURM_JOB_ID), a job that cannot be
    told, a SLUID where the job has none: never the job's."""
    if uid is None or job.uid is None or uid != job.uid:
        return False
    if isinstance(mark, str):
        return bool(job.sluid) and mark == job.sluid
    return mark is not None and mark != UNKNOWN_JOB and mark == job.job_id


def process_belongs_to_job(pid: int, job: JobEnv) -> bool:
    """The job's own process (is_the_jobs).  A process of another uid (a job sharing the GPU through
    shards/MPS, a system agent), of another job of the same user, or whose job cannot be told is never
    ours to kill."""
    return is_the_jobs(*process_identity(pid), job)


def _seen(pids: List[int]) -> str:
    """What placed each process, for the log line: pid:uid/job (job: an id, a SLUID, 'none' when nothing
    shows one, 'unknown' when its environment could not be read, 'gone' when the process ended)."""
    out = []
    for pid in pids[:20]:
        uid, mark = process_identity(pid)
        job = "gone" if uid is None else "none" if mark is None else "unknown" if mark == UNKNOWN_JOB else str(mark)
        out.append(f"{pid}:{'-' if uid is None else uid}/{job}")
    return ",".join(out)


PF_EXITING = 0x4  # include/linux/sched.h: the process is in do_exit()
EXIT_WAIT_S = 5.0  # how long the epilog waits for processes already exiting before it judges them


def process_exiting(pid: int) -> bool:
    """True while the process is exiting (PF_EXITING in /proc/PID/stat's flags): killed and tearing down,
    its environment already gone, its GPU context being released."""
    try:
        stat = _proc_file(pid, "stat")
        return bool(int(stat[stat.rfind(b")") + 2:].split()[6]) & PF_EXITING)
    except (OSError, ValueError, IndexError):
        return False


def _await_exits(deps: HookDeps, pids: List[int]) -> None:
    """Processes Slurm is ending as the epilog starts (proctrack/cgroup kills the job's cgroup then: on
    24.11 and 26.05 the epilog met the job's own process half-exited, its environment empty, and drained
    a healthy node for it) are waited for, EXIT_WAIT_S at most.  One still exiting after that is stuck
    in the driver, and judged like any other."""
    dying = [p for p in pids if process_exiting(p)]
    end = time.monotonic() + EXIT_WAIT_S
    while dying and time.monotonic() < end:
        time.sleep(0.05)
        dying = [p for p in dying if deps.pid_alive(p)]


def leftovers(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Tuple[Dict[int, List[int]], Dict[int, List[int]]]:
    """({GPU: pids of the job's own processes}, {GPU: pids of anyone else's}) on the job's GPUs; processes
    that end meanwhile are in neither.

    On a GPU the job holds only MIG slices of, processes in other slices are not looked at."""
    mine: Dict[int, List[int]] = {}
    others: Dict[int, List[int]] = {}
    instances = gmap.instances()
    listed: Dict[int, List[int]] = {}
    for i, procs in deps.reader.processes_many(gmap.nvml_indices).items():
        if isinstance(procs, NvmlWriteError):
            deps.job_log(job).error("process-list-failed", index=i, error=procs.message)
            continue
        for p in procs:
            if p.pid in (0, 1, os.getpid()):
                continue
            if i in instances and p.gpu_instance_id not in instances[i]:
                continue
            listed.setdefault(i, []).append(p.pid)
    _await_exits(deps, sorted({p for ps in listed.values() for p in ps}))
    for i, pids in listed.items():
        for pid in pids:
            if not deps.pid_alive(pid):
                continue
            (mine if deps.owns(pid, job) else others).setdefault(i, []).append(pid)
    return mine, others


def kill_leftovers(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Tuple[Dict[int, List[int]], List[int]]:
    """TERM, grace period, KILL for the job's own processes still on its GPUs.

    Returns (survivors per GPU, every pid of the job that was found).  Processes of other
    users or jobs are never signalled: the health checks report them (leftover_processes)."""
    cfg, log = deps.cfg, deps.job_log(job)
    found, others = leftovers(deps, job, gmap)
    if others:
        pids = [p for ps in others.values() for p in ps]
        log.warning("leftover-processes-not-ours", pids=",".join(map(str, pids)), seen=_seen(pids),
                    note="another user's or job's processes, and ones nothing places, are never killed")
    if not found:
        return {}, []
    everyone = sorted({p for ps in found.values() for p in ps})
    if not cfg.hooks.kill_leftovers:
        # The site kills nothing: the leftover_processes check reports them instead.
        log.warning("leftover-processes-not-killed", pids=",".join(map(str, everyone)))
        return {}, []
    log.warning("leftover-processes", pids=",".join(map(str, everyone)))
    import signal  # here, not at the top: its IntEnum costs every prolog 1.7 ms, and few prologs kill
    targets = list(everyone)
    for sig, wait in ((signal.SIGTERM, cfg.hooks.kill_grace_s), (signal.SIGKILL, 2.0)):
        alive = [p for p in targets if deps.pid_alive(p)]
        for p in alive:
            try:
                deps.kill(p, sig)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                log.error("kill-failed", pid=p, error=str(e))
        end = time.monotonic() + wait
        while time.monotonic() < end and any(deps.pid_alive(p) for p in alive):
            time.sleep(0.05)
        targets = [p for p in targets if deps.pid_alive(p)]
        if not targets:
            break
    # Ask the driver again: what it still lists and is still alive survived KILL.
    survivors: Dict[int, List[int]] = {}
    for i, procs in deps.reader.processes_many(sorted(found)).items():
        if isinstance(procs, NvmlWriteError):
            continue
        left = [p.pid for p in procs if p.pid in everyone and deps.pid_alive(p.pid)]
        if left:
            survivors[i] = left
    return survivors, everyone
