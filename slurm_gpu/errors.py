"""Domain errors and the exit-code contract (docs/exit-codes.md)."""
from __future__ import annotations

import enum
import re
from typing import Any, Optional, Tuple


class ExitCode(enum.IntEnum):
    """Documented exit codes of `slurm-gpu` commands."""

    OK = 0  # healthy / done
    UNHEALTHY = 1  # at least one FAIL (check), or a difference found (gres-conf --check)
    USAGE = 2  # bad command line, bad config, bad input file
    NVML_UNAVAILABLE = 3  # no NVIDIA driver / libnvidia-ml.so.1 could not be loaded or initialised
    SLURM_ERROR = 4  # slurmctld unreachable, unknown node, scontrol failed
    STORE_ERROR = 5  # database unusable and nothing could be spooled
    REFUSED = 6  # a safety refusal: resume of a node not drained by slurm-gpu without --force
    JOB_NOT_FOUND = 7  # `job`: no such job, or one the caller may not see (PrivateData=jobs)
    JOB_WITHOUT_GPUS = 8  # `job`: the job ran without GPUs, or never ran
    JOB_NOT_ENDED = 9  # `job`: the job is pending or running; its GPU summary is written when it ends
    JOB_NO_SUMMARY = 10  # `job`: the job ended but has no usable GPU summary (yet)
    JOB_FOREIGN_COMMENT = 11  # `job`: the job's AdminComment belongs to another tool


class SlurmGpuError(Exception):
    """Base of all domain errors.  `hint` is the what-to-do-next line shown to the admin."""

    exit_code = ExitCode.USAGE

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> Any:
        # Pickled with its hint: a call run in a child process (gpu/deadline.py) hands it back.
        return (type(self), (self.message, self.hint))


class ConfigError(SlurmGpuError):
    exit_code = ExitCode.USAGE


class NvmlUnavailable(SlurmGpuError):
    """The NVML library cannot be loaded or initialised: no driver, wrong path, driver not loaded."""

    exit_code = ExitCode.NVML_UNAVAILABLE


class DriverLibraryMismatch(NvmlUnavailable):
    """nvmlInit: LIB_RM_VERSION_MISMATCH (18): the loaded kernel module and the NVML library come from
    different driver versions (a driver update without a reboot).  Every CUDA job fails."""

    def __init__(self, kernel_version: str, library_version: str):
        self.kernel_version, self.library_version = kernel_version, library_version
        super().__init__(f"NVIDIA driver/library version mismatch: kernel module {kernel_version or 'unknown'}, "
                         f"NVML library {library_version or 'unknown'}: reboot the node or reload the nvidia module",
                         "after a driver update the old kernel module is still loaded: drain the node, then reboot it "
                         "(or stop nvidia-persistenced/fabric manager and `rmmod nvidia_uvm nvidia_drm nvidia_modeset "
                         "nvidia && modprobe nvidia`)")


_MISMATCH_VERSIONS = re.compile(r"driver/library version mismatch: kernel module (\S+?), NVML library (\S+?):")


def mismatch_versions(message: str) -> Optional[Tuple[str, str]]:
    """(kernel module, NVML library) versions out of a DriverLibraryMismatch's message (as the
    healthcheck's health event keeps it); "" for one it called unknown; None when it is not one."""
    m = _MISMATCH_VERSIONS.search(message or "")
    if not m:
        return None
    kernel, library = m.groups()
    return ("" if kernel == "unknown" else kernel), ("" if library == "unknown" else library)


class NvmlWriteError(SlurmGpuError):
    """A write (clock reset, persistence, accounting) failed on a GPU."""

    exit_code = ExitCode.UNHEALTHY


class SlurmError(SlurmGpuError):
    exit_code = ExitCode.SLURM_ERROR


class NotInAccounting(SlurmError):
    """slurmdbd does not hold the job yet (slurmctld sends a job's records to it asynchronously)."""


class StoreError(SlurmGpuError):
    exit_code = ExitCode.STORE_ERROR


class CentralError(StoreError):
    """The central SQL server is unreachable, refuses the login, or its schema is not ours/current."""


class WriterRefused(CentralError):
    """The server refused a batch: a row of a node or cluster the writer account may not write."""

    exit_code = ExitCode.REFUSED


class InputError(SlurmGpuError):
    """Malformed user or Slurm input (env var, snapshot file, inventory, time spec)."""

    exit_code = ExitCode.USAGE
