"""Which job holds which GPU: slurm_gpu_job_<job>.prom and dcgm-exporter's job-mapping files.

The prolog writes the job's info file (`slurm_gpu_job_info`, one series per GPU or MIG slice)
and adds the job id to dcgm-exporter's mapping file of each GPU it holds; the epilog removes
both.  Mapping files follow dcgm-exporter's `--hpc-job-mapping-dir` convention
(internal/pkg/transformation/hpc.go in NVIDIA/dcgm-exporter): a file named by the GPU index,
or `<GPU index>.<GPU instance id>` for a MIG slice, holding one job id per line; the exporter
re-reads the directory at every scrape and labels that GPU's metrics `hpc_job`.  Both kinds of
file are replaced atomically but not fsync'd: they describe running jobs, which a crash ends anyway.

Files of jobs whose epilog never ran (a node that rebooted, a killed slurmd) are removed by
the next epilog or healthcheck (cleanup()): older than the last boot, or older than
STALE_AFTER_S and no slurmstepd of the job is running on this node.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, List, Optional, Sequence, Set, Tuple

from slurm_gpu.metrics.catalog import JOB_FILE_PREFIX
from slurm_gpu.metrics.node import gpu_labels
from slurm_gpu.metrics.textfile import DirLock, Samples, listing, read, remove, render, write_atomic

STALE_AFTER_S = 600.0  # a prolog's files get this long before a job without a slurmstepd is stale
MAPPING_NAME = re.compile(r"^\d+(\.\d+)?$")  # the names dcgm-exporter reads (hpc.go, validGPUFile)
_JOB_FILE = re.compile(re.escape(JOB_FILE_PREFIX) + r"(\d+)\.prom$")
_STEPD = re.compile(rb"^slurmstepd: \[(\d+)\.")


def job_file(job_id: int) -> str:
    return f"{JOB_FILE_PREFIX}{int(job_id)}.prom"


def mapping_name(jg: Any) -> str:
    """dcgm-exporter's name for a GPU (`<index>`) or a MIG slice (`<index>.<GPU instance id>`)."""
    return f"{jg.nvml_index}.{jg.mig.gpu_instance_id}" if jg.mig is not None else str(jg.nvml_index)


def job_samples(job: Any, held: Sequence[Tuple[Any, Any]]) -> Samples:
    """slurm_gpu_job_info of each (GpuSnapshot, JobGpu) the job holds."""
    series = {}
    for g, jg in held:
        labels = gpu_labels(g) + (("GPU_I_ID", "" if jg.mig is None else str(jg.mig.gpu_instance_id)),
                                  ("slurm_job", str(job.job_id)), ("user", job.user or ""),
                                  ("account", job.account or ""), ("partition", job.partition or ""))
        series[labels] = 1.0
    return {"slurm_gpu_job_info": series}


def write_job(directory: str, job: Any, held: Sequence[Tuple[Any, Any]]) -> None:
    write_atomic(directory, job_file(job.job_id), render(job_samples(job, held)), sync=False)


def map_job(directory: str, job_id: int, names: Iterable[str]) -> None:
    """Add the job id to the mapping file of each GPU or slice (created when missing)."""
    line = str(int(job_id))
    with DirLock(directory):
        for name in sorted(set(names)):
            lines = _lines(directory, name)
            if line not in lines:
                write_atomic(directory, name, "".join(f"{x}\n" for x in lines + [line]), sync=False)


def unmap_jobs(directory: str, gone: Callable[[str, float], bool]) -> int:
    """Remove the job ids for which gone(id, file's mtime) holds from every mapping file; a
    file left empty is removed (an empty file hides the GPU's metrics from older dcgm-exporters)."""
    removed = 0
    with DirLock(directory):
        for name in listing(directory):
            if not MAPPING_NAME.match(name):
                continue
            try:
                mtime = os.stat(os.path.join(directory, name), follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            lines = _lines(directory, name)
            keep = [x for x in lines if not gone(x, mtime)]
            if keep == lines:
                continue
            removed += len(lines) - len(keep)
            if keep:
                write_atomic(directory, name, "".join(f"{x}\n" for x in keep), sync=False)
            else:
                remove(directory, name)
    return removed


def _lines(directory: str, name: str) -> List[str]:
    return [x.strip() for x in read(directory, name).splitlines() if x.strip()]


# --- jobs that are gone ------------------------------------------------------------------------


def running_jobs(proc: str = "/proc") -> Optional[Set[str]]:
    """Job ids with a slurmstepd on this node (`slurmstepd: [4711.batch]` etc.); None when
    /proc cannot be read (then nothing is judged gone)."""
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return None
    out: Set[str] = set()
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                m = _STEPD.match(f.read(64))
        except OSError:
            continue
        if m:
            out.add(m.group(1).decode())
    return out


def boot_time() -> Optional[float]:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class Liveness:
    """Whether a job is gone, asked once per cleanup: /proc is scanned only when a file is old
    enough to be judged at all."""

    def __init__(self, now: float, running: Optional[Callable[[], Optional[Set[str]]]] = None,
                 booted: Optional[float] = None):
        self.now = now
        self._running = running or running_jobs
        self._jobs: Any = False  # not asked yet
        self.booted = boot_time() if booted is None else booted

    def gone(self, job_id: str, mtime: float) -> bool:
        if self.booted is not None and mtime < self.booted:
            return True  # no job survives a reboot
        if self.now - mtime < STALE_AFTER_S:
            return False
        if self._jobs is False:
            self._jobs = self._running()
        return self._jobs is not None and job_id not in self._jobs


def stale_job_files(directory: str, live: Liveness, keep: str = "") -> List[Tuple[str, str]]:
    """(file, job id) of job info files whose job is gone."""
    out = []
    for name in listing(directory):
        m = _JOB_FILE.match(name)
        if not m or m.group(1) == keep:
            continue
        try:
            mtime = os.stat(os.path.join(directory, name), follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if live.gone(m.group(1), mtime):
            out.append((name, m.group(1)))
    return out
