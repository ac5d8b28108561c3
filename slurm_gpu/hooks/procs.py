"""The epilog's leftover processes: whose a process is (/proc), and the TERM/KILL loop for the job's own.

Only the job's own processes are ever signalled: another user's or job's, or one whose job cannot be
told, stays, and the health checks report it (leftover_processes)."""
from __future__ import annotations

import os
import re
import signal
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

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


_JOB_CGROUP = rb"(?m)/job_(\d+)(?:/|$)"  # compiled on first use: only the epilog, only with leftovers


UNKNOWN_JOB = -1  # process_identity: the process's job cannot be told (environment unreadable or empty)


def process_identity(pid: int) -> Tuple[Optional[int], Optional[int]]:
    """(real uid, Slurm job id) of a live process; None where the system does not show it.

    The job id comes from the process's cgroup (task/cgroup puts it under .../job_<id>/) or,
    without one, from its SLURM_JOB_ID (root may read every environment). An environment that
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
        m = re.search(_JOB_CGROUP, _proc_file(pid, "cgroup"))
        if m:
            return uid, int(m.group(1))
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


def process_belongs_to_job(pid: int, job: JobEnv) -> bool:
    """The job's own process: the job's uid, and no other job id where the system shows one.

    A process of another uid (a job sharing the GPU through shards/MPS, a system agent), of
    another job of the same user, or whose job cannot be told is never ours to kill."""
    uid, job_id = process_identity(pid)
    if uid is None or job.uid is None or uid != job.uid or job_id == UNKNOWN_JOB:
        return False
    return job_id is None or job_id == job.job_id


def leftovers(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Tuple[Dict[int, List[int]], Dict[int, List[int]]]:
    """({GPU: pids of the job's own processes}, {GPU: pids of anyone else's}) on the job's GPUs.

    On a GPU the job holds only MIG slices of, processes in other slices are not looked at."""
    mine: Dict[int, List[int]] = {}
    others: Dict[int, List[int]] = {}
    instances = gmap.instances()
    for i, procs in deps.reader.processes_many(gmap.nvml_indices).items():
        if isinstance(procs, NvmlWriteError):
            deps.job_log(job).error("process-list-failed", index=i, error=procs.message)
            continue
        for p in procs:
            if p.pid in (0, 1, os.getpid()):
                continue
            if i in instances and p.gpu_instance_id not in instances[i]:
                continue
            (mine if deps.owns(p.pid, job) else others).setdefault(i, []).append(p.pid)
    return mine, others


def kill_leftovers(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Tuple[Dict[int, List[int]], List[int]]:
    """TERM, grace period, KILL for the job's own processes still on its GPUs.

    Returns (survivors per GPU, every pid of the job that was found).  Processes of other
    users or jobs are never signalled: the health checks report them (leftover_processes)."""
    cfg, log = deps.cfg, deps.job_log(job)
    found, others = leftovers(deps, job, gmap)
    if others:
        log.warning("leftover-processes-not-ours", pids=",".join(str(p) for ps in others.values() for p in ps),
                    note="another user's or job's processes are never killed")
    if not found:
        return {}, []
    everyone = sorted({p for ps in found.values() for p in ps})
    if not cfg.get("hooks", "kill_leftovers"):
        # The site kills nothing: the leftover_processes check reports them instead.
        log.warning("leftover-processes-not-killed", pids=",".join(map(str, everyone)))
        return {}, []
    log.warning("leftover-processes", pids=",".join(map(str, everyone)))
    targets = list(everyone)
    for sig, wait in ((signal.SIGTERM, cfg.get("hooks", "kill_grace_s")), (signal.SIGKILL, 2.0)):
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
