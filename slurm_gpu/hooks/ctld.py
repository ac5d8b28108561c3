"""`slurm-gpu-epilog-ctld`: Slurm's EpilogSlurmctld, the job's GPU summary into its AdminComment.

slurmctld runs it once per job (each array task and heterogeneous component is a job of its
own, with its raw id in SLURM_JOB_ID) as SlurmUser, while the job is COMPLETING, with an
environment that lacks SLURM_CONF (observed on 22.05.8): the Slurm commands get the config's
`slurm_conf`.  Steps: which nodes hold the job's GPUs (`scontrol -d show job`), whether the
AdminComment is free (never overwrite another tool's: asked of slurmctld first, and of accounting
again right before writing, since slurmctld does not show what was set through sacctmgr), the nodes' records from the central
server (waiting up to job_summary.wait_s for every node's push), then `sacctmgr modify job`
(store/summary.py explains the encoding).  A summary whose records did not all arrive is
marked partial; `slurm-gpu central annotate` completes it later.

It never fails a job and never hangs slurmctld: the watchdog is armed before anything is read,
every outcome is one log line, and it always exits 0.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import CentralError, SlurmGpuError
from slurm_gpu.hooks.main import _describe, _exit, _Run

NAME = "epilog_ctld"
WRITE_RETRY_S = 1.0  # between tries of a write slurmdbd is not ready for (_write)
WRITE_MARGIN_S = 5.0  # of the hook's deadline left when the write gives up


def _int(env: Mapping[str, str], key: str) -> Optional[int]:
    v = (env.get(key) or "").strip()
    return int(v) if v.isascii() and v.isdigit() and len(v) < 19 else None


def run_ctld(env: Optional[Mapping[str, str]] = None, sleep: Callable[[float], None] = time.sleep) -> str:
    """The controller epilog; returns the outcome word that was logged (for tests)."""
    run = _Run(NAME, os.environ if env is None else env)
    try:
        run.arm(run.deadline_s)
        return _ctld(run, sleep)
    except BaseException as e:  # our bug must not touch the job or slurmctld
        error, trace = _describe(e)
        run.problem("internal-error", error=error, trace=trace)
        return "internal-error"
    finally:
        run.disarm()


def _ctld(run: _Run, sleep: Callable[[float], None]) -> str:
    from slurm_gpu import config as config_mod
    from slurm_gpu.errors import ConfigError
    try:
        cfg, errors = config_mod.load(env=run.env, lenient=True)
    except ConfigError as e:
        run.problem("config-error", error=e.message, hint=e.hint)
        return "config-error"
    run.configure(cfg)
    run.fail_code = 0  # whatever happens: the job is done, slurmctld must not see a failure
    for err in errors:
        run.problem("config-error", error=err.message, hint=err.hint)
    job_id = _int(run.env, "SLURM_JOB_ID")
    if job_id is None:
        run.problem("bad-environment", error=f"SLURM_JOB_ID={run.job!r} is not a job id")
        return "bad-environment"
    if cfg.job_summary.field == "off":
        return "off"
    if not cfg.central.url:
        run.log.info("summary-skipped", job=job_id, why="no central server (central.url) on the controller")
        return "no-central"
    try:
        return _summarise(run, cfg, job_id, sleep)
    except SlurmGpuError as e:
        run.problem("summary-failed", error=e.message, hint=e.hint)
        return "failed"


def _summarise(run: _Run, cfg: Config, job_id: int, sleep: Callable[[float], None]) -> str:
    from slurm_gpu.slurm.cli_backend import CliBackend
    from slurm_gpu.store import summary as S
    env = dict(run.env)
    env.setdefault("SLURM_CONF", cfg.slurm_conf)  # slurmctld does not pass it
    backend = CliBackend(cfg, env=env)
    cluster = run.env.get("SLURM_CLUSTER_NAME") or cfg.cluster_name
    restart = _int(run.env, "SLURM_JOB_RESTART_COUNT") or 0
    comment, gpu_nodes = backend.job_summary_target(job_id)
    if comment and not S.is_ours(comment):
        run.log.info("summary-skipped", job=job_id, why="AdminComment belongs to another tool")
        return "foreign"
    if gpu_nodes is not None and not gpu_nodes:
        run.log.info("summary-skipped", job=job_id, why="the job has no GPUs")
        return "no-gpus"
    try:
        rows = _wait_for_rows(cfg, cluster, job_id, restart, gpu_nodes, run, sleep)
    except CentralError as e:
        # The server is down: a summary marked partial (no figures yet) tells the user that it
        # is coming; `central annotate` writes the figures once the server is back.
        run.problem("central-unavailable", error=e.message, hint="slurm-gpu central annotate completes the summary later")
        rows = []
    if not rows and not gpu_nodes:
        run.log.warning("summary-skipped", job=job_id, why="no records of the job on the central server",
                        hint="slurm-gpu central annotate --since ... writes it once they arrive")
        return "no-records"
    summary = S.from_records(cluster, job_id, restart, gpu_nodes or sorted({r["node"] for r in rows}), rows)
    text = S.fit(summary)  # what slurmdbd would cut is never stored: per node, or a marker
    # slurmctld does not show an AdminComment set through sacctmgr (jobstats does that): ask
    # accounting, the store that is written, right before writing (sacctmgr may have lowercased it).
    now = backend.admin_comments([job_id], cluster).get(job_id, "")
    if now and not S.is_ours(now):
        run.log.info("summary-skipped", job=job_id, why="AdminComment belongs to another tool (in accounting)")
        return "foreign"
    tries = _write(run, backend, job_id, cluster, text, sleep)
    if cfg.job_summary.energy_tres:
        _energy_into_accounting(run, backend, job_id, cluster, summary.partial, rows)
    run.log.info("summary", job=job_id, tries=tries if tries > 1 else None, gpus=len(summary.gpus), bytes=len(text),
                 partial=int(summary.partial),
                 detail=S.decode(text).detail,
                 missing=",".join(summary.missing) or None)
    return "partial" if summary.partial else "written"


def job_energy_j(rows: List[Dict[str, Any]]) -> Optional[int]:
    """The job's GPU energy in joules from its records: every whole GPU's energy_j, summed.  None when a
    record lacks it or covers a MIG slice (the GPU's energy is not the slice's job's alone)."""
    if not rows or any(r.get("parent_gpu_uuid") or r.get("energy_j") is None for r in rows):
        return None
    return int(round(sum(float(r["energy_j"]) for r in rows)))


def energy_into_accounting(backend: Any, job_id: int, cluster: str, partial: bool, rows: List[Dict[str, Any]],
                           named: str = "") -> Tuple[str, Dict[str, Any]]:
    """The job's measured GPU energy into its `energy` TRES where Slurm allows it (25.11+): what sacct shows
    as ConsumedEnergy.  Never over a figure Slurm recorded.  (outcome, fields for the log line): written,
    kept, skipped, unsupported; SlurmError when Slurm refuses."""
    joules = None if partial else job_energy_j(rows)
    if joules is None:
        return "skipped", {"why": "partial summary, MIG slices or a GPU without energy"}
    if not backend.energy_tres_settable():
        return "unsupported", {"why": "Slurm before 25.11 cannot set a finished job's TRES"}
    there = backend.job_energy_j(job_id, cluster)
    if there:
        return "kept", {"why": "already ours" if there == joules else f"Slurm recorded {there} J itself",
                        "energy_j": joules}
    backend.set_job_energy(job_id, cluster, joules, named=named)
    return "written", {"energy_j": joules, "tres": "energy"}


def _energy_into_accounting(run: _Run, backend: Any, job_id: int, cluster: str, partial: bool,
                            rows: List[Dict[str, Any]]) -> str:
    """energy_into_accounting with its one log line."""
    from slurm_gpu.errors import SlurmError
    try:
        outcome, fields = energy_into_accounting(backend, job_id, cluster, partial, rows, _named(run.env))
    except SlurmError as e:
        run.problem("energy-failed", error=e.message, hint=e.hint)
        return "failed"
    run.log.info("energy" if outcome == "written" else "energy-skipped", job=job_id, **fields)
    return outcome


def _write(run: _Run, backend: Any, job_id: int, cluster: str, text: str, sleep: Callable[[float], None]) -> int:
    """Write the summary; how many tries it took.  slurmctld hands a job's records to slurmdbd
    asynchronously: under load the EpilogSlurmctld can run before slurmdbd holds the job, and sacctmgr
    then modifies nothing.  Tried again every second until WRITE_MARGIN_S before the hook's deadline."""
    from slurm_gpu.errors import NotInAccounting
    tries = 0
    while True:
        tries += 1
        try:
            backend.set_admin_comment(job_id, cluster, text, named=_named(run.env))
            return tries
        except NotInAccounting:
            left = run.deadline_s - (time.monotonic() - run.started) - WRITE_MARGIN_S
            if left < WRITE_RETRY_S:
                raise
            sleep(WRITE_RETRY_S)


def _named(env: Mapping[str, str]) -> str:
    """ARRAY_TASK of an array task, LEADER+OFFSET of a heterogeneous job's component, else ''."""
    array, task = _int(env, "SLURM_ARRAY_JOB_ID"), _int(env, "SLURM_ARRAY_TASK_ID")
    if array is not None and task is not None:
        return f"{array}_{task}"
    leader, offset = _int(env, "SLURM_HET_JOB_ID"), _int(env, "SLURM_HET_JOB_OFFSET")
    return f"{leader}+{offset}" if leader is not None and offset is not None else ""


def _wait_for_rows(cfg: Config, cluster: str, job_id: int, restart: int, gpu_nodes: Optional[List[str]],
                   run: _Run, sleep: Callable[[float], None]) -> List[Dict[str, Any]]:
    """The job's rows once every GPU node has pushed, or what arrived by job_summary.wait_s."""
    from slurm_gpu.central.server import Central, job_rows
    # Leave the write ~10 s of the hook's own deadline.
    left_for_hook = run.deadline_s - (time.monotonic() - run.started) - 10.0
    until = time.monotonic() + max(0.0, min(cfg.job_summary.wait_s, left_for_hook))
    with Central.from_config(cfg) as central:
        while True:
            central.rollback()  # a new snapshot: see what the nodes pushed since the last look
            rows = job_rows(central, cluster, job_id, restart)
            have = {r["node"] for r in rows}
            if gpu_nodes is not None and have >= set(gpu_nodes) and rows:
                return rows
            left = until - time.monotonic()
            if left <= 0:
                return rows
            sleep(min(2.0, left))


def epilog_ctld_main() -> None:
    try:
        run_ctld()
    finally:
        _exit(0)
