"""`slurm-gpu remediate`: close the loop on a node slurm-gpu drained (docs/remediation.md).

This module is the run: the lock, the episode's open steps, and which step the node needs now.
The steps are actions.py's, their verification verify.py's, what they share context.py's.

Acts only on a node whose drain reason is ours (not an admin's manual one, not an RMA), only when
it is idle (Slurm: no job on it; NVML: no process on any GPU), under a per-node lock, and writes
its intent to the node database before each step.  The step comes from the fault -> remedy map
(remedy.py), its cost from the budgets (budget.py):

  reset  -> re-apply persistence, accounting, clocks -> verify (N full healthchecks in a row,
            spaced) -> resume (our reason only).  A failed reset or verification escalates:
  reboot -> `scontrol reboot ASAP nextstate=DOWN reason="slurm-gpu: ..."` (the site's RebootProgram;
            never a reboot of our own); the first run after the boot verifies, then resumes.
  rma    -> the drain stays as `slurm-gpu: RMA: GPU <serial> ...`; `fleet memory` lists the GPU.

While a step is under way the reason's context is `remediate: <step>`, which healthcheck never
resumes (slurm/reason.py auto_resumable), so only a verified node comes back.

The episode is the state, not the reason string (docs/remediation.md, "Episodes"): every run reads
the node's open steps (rows `started`) first.  A reset's child inherits the node's lock and its pid
is kept on the row, so a killed run's reset still holds the node until it ends; a step nobody carries
out any more is closed `interrupted`.  Times are slurmctld's (sdiag): a node whose clock is off by
more than remediation.clock_slack_s neither reboots nor resumes.

A GPU's budgets and lemon rule count its attempts by serial: the node database's, and with
central.url every node's from the central server (SerialHistory: asked only when a GPU is decided
about; a server down or slow leaves this node's rows, with one log line).
"""
from __future__ import annotations

import sqlite3
from typing import Any, Callable, Dict, Optional

from slurm_gpu.config import Config
from slurm_gpu.errors import SlurmGpuError
from slurm_gpu.hooks.nodelock import node_lock
from slurm_gpu.remediation import budget as B
from slurm_gpu.remediation import remedy as R
from slurm_gpu.remediation.actions import act, after_reboot, returned_by_slurm, verify_and_resume
from slurm_gpu.remediation.context import REBOOTING_STATES, Env, Outcome, Stop, alive, central_history, finish_steps, slurm_busy
from slurm_gpu.remediation.verify import clean_verification
from slurm_gpu.slurm import reason as _reason


def remediate(env: Env) -> Outcome:
    """One remediation run on env.node (the `remediate` command and healthcheck with remediation.enabled)."""
    path = env.cfg.path_value("remediation", "lock_file")
    try:
        lock = node_lock(path)
        held = lock.__enter__()
    except OSError as e:
        raise SlurmGpuError(f"cannot take the node's remediation lock {path}: {e.strerror or e}",
                            "run remediate as root (it resets GPUs and changes the node in Slurm), or fix "
                            "remediation.lock_file") from None
    try:
        if not held:
            return Outcome(env.node, "none", "busy", f"{env.node}: {_running_elsewhere(env)}; the node stays as it is")
        env.lock_fd = getattr(held, "fd", None)
        try:
            return _remediate(env)
        except Stop as stop:
            return stop.outcome
    finally:
        lock.__exit__(None, None, None)


def _running_elsewhere(env: Env) -> str:
    """What holds the node's lock, in words: a reset a killed run left (its pid on the row), else a run."""
    try:
        for row in env.store.open_steps(env.node):
            if row["action"] == "reset" and alive(row.get("pid"), row.get("pid_start")):
                return (f"a reset of GPU {row['gpu_index']} (pid {row['pid']}, started "
                        f"{max(0.0, env.now() - float(row['time'])):.0f} s ago) still runs")
    except sqlite3.Error:
        pass
    return "another remediate run holds the node's lock"


def _remediate(env: Env) -> Outcome:
    info = env.backend.node(env.node)
    env.clock()  # every time of this run on slurmctld's clock; a skew refuses below, before any act
    open_step = _open_steps(env, info)
    if open_step is not None:
        return open_step
    if env.interrupted:
        info = env.backend.node(env.node)
    env.drain_time = drain_time(env, info)
    why = _not_ours(info)
    if why and not (info.drained or info.down or info.states & REBOOTING_STATES):
        rebooted = _pending_reboot(env)
        if rebooted is not None:
            return returned_by_slurm(env, info, rebooted)
    if why:
        return Outcome(env.node, "none", "left-alone", f"{env.node}: {why}")
    if info.states & REBOOTING_STATES:
        return Outcome(env.node, "reboot", "waiting", f"{env.node}: reboot under way ({info.state})")
    busy = slurm_busy(info)
    if busy:
        return Outcome(env.node, "none", "busy", f"{env.node}: {busy}; nothing done")
    problem = env.clock()
    if problem:
        return Outcome(env.node, "none", "refused", f"{env.node}: {problem}; left drained")
    run = env.checker(info)
    held = _gpu_processes(run)
    if held:
        return Outcome(env.node, "none", "busy", f"{env.node}: {held}; nothing done")
    rebooted = _pending_reboot(env)
    if rebooted is not None:
        return after_reboot(env, info, run, rebooted)
    found = R.remedies(run, getattr(run, "snapshot", None), getattr(run, "xid_events", ()))
    if not found:
        return verify_and_resume(env, info, "none", [], "no fault found now", run=run)
    return act(env, info, run, found)


def _open_steps(env: Env, info: Any) -> Optional[Outcome]:
    """The episode first: steps left `started` by an earlier run.  A step whose process still lives, or
    one too young to tell (a reset whose pid was never written), keeps the node drained (an Outcome);
    the others are closed `interrupted` (a verification's reservation cleaned up first), and the run goes on."""
    if env.dry_run:
        return None
    limit = float(env.get("reset_timeout_s"))
    for row in env.store.open_steps(env.node):
        age = env.now() - float(row["time"])
        if row["action"] == "reset":
            if alive(row.get("pid"), row.get("pid_start")):
                return Outcome(env.node, "reset", "busy", f"{env.node}: a reset of GPU {row['gpu_index']} (pid {row['pid']}) "
                                                          f"started {age:.0f} s ago still runs; the node stays drained")
            if row.get("pid") is None and 0 <= age < limit:
                return Outcome(env.node, "reset", "busy", f"{env.node}: a reset of GPU {row['gpu_index']} was started "
                                                          f"{age:.0f} s ago by a run that ended; the node stays drained "
                                                          f"until reset_timeout_s ({limit:g} s) has passed")
            finish_steps(env, [row["id"]], "interrupted", "the run carrying out the reset ended before it did")
        elif row["action"] == "verify":
            done = clean_verification(env)
            finish_steps(env, [row["id"]], "interrupted",
                    "the run carrying out the verification ended" + (f"; {done}" if done else ""))
        elif row["action"] == "reboot":
            issued = info.states & REBOOTING_STATES or " : reboot issued" in (info.reason or "")
            if issued:  # Slurm took it: the reboot's own path (after_reboot) carries on with the row
                finish_steps(env, [row["id"]], "requested", "the reboot was issued; the run asking for it ended")
                continue
            finish_steps(env, [row["id"]], "interrupted", "the run asking for the reboot ended before Slurm took it")
        env.interrupted.append(row["id"])
        env.say_warning("remediate-step-interrupted", action=row["action"], row=row["id"])
    return None


def _not_ours(info: Any) -> str:
    if not (info.drained or info.down):
        return f"not drained ({info.state}): nothing to remediate"
    if not _reason.is_ours(info.reason):
        return f"drained by someone else ({info.reason or 'no reason'}): left alone"
    if _reason.is_manual(info.reason):
        return f"drained manually through slurm-gpu ({info.reason}): left for the admin"
    if is_rma(info.reason):
        return f"waiting for RMA ({info.reason}): left alone"
    return ""


is_rma = _reason.is_rma  # one parser of the RMA reason (slurm/reason.py), which rma_reason writes


def drain_time(env: Env, info: Any) -> Optional[float]:
    """When the node was drained for the fault being remedied: what "drain to resume" is measured from.

    A reason of remediate's own (a step under way, `[remediate: reboot] : reboot complete`) was set
    by an earlier run of this episode: its ReasonTime is that re-drain's, so the drain time is the
    one the node's latest attempt row keeps.  Otherwise Slurm's ReasonTime of the drain (the CLI and
    pyslurm backends read it), and without one the node database's record of that drain (the
    drains table: the newest drain of the node with this reason, else its newest drain of ours)."""
    reason = getattr(info, "reason", "") or ""
    if _reason.reason_context(reason).startswith(_reason.REMEDIATE):
        kept = [r["drain_time"] for r in env.store.remediations(node=env.node) if r.get("drain_time") is not None]
        if kept:
            return float(kept[-1])
    if getattr(info, "reason_time", None):
        return float(info.reason_time)
    return env.store.drain_time(env.node, reason) if _reason.is_ours(reason) else None


def _gpu_processes(run: Any) -> str:
    snap = getattr(run, "snapshot", None)
    for g in getattr(snap, "gpus", ()):
        procs = g.processes.get(()) if g.processes.ok else ()
        if procs:
            return f"GPU {g.index} has {len(procs)} process{'es' if len(procs) != 1 else ''} (pid {procs[0].pid})"
    return ""


def _pending_reboot(env: Env) -> Optional[Dict[str, Any]]:
    rows = env.store.remediations(node=env.node, since=env.now() - B.DAY_S)
    last = [r for r in rows if r["action"] == "reboot"]
    return last[-1] if last and last[-1]["outcome"] == "requested" else None


def run_on_node(cfg: Config, backend: Any, node: str, checker: Callable[[Any], Any], *, log: Any = None,
                dry_run: bool = False) -> Outcome:
    """remediate() with the node database, the NVML reader for re-applying settings, and afterwards the
    slurm_gpu_remediation_total counters (when metrics are on; they never change the outcome)."""
    from slurm_gpu.hooks.check import make_reader
    from slurm_gpu.store.node import Store
    store = Store.from_config(cfg)
    try:
        env = Env(cfg, backend, store, node, checker=checker, reader_factory=lambda: make_reader(cfg), log=log,
                  dry_run=dry_run, central_history=central_history(cfg))
        try:
            store.connect()  # the episode is read from it first: no database, no remediation
            outcome = remediate(env)
        except (sqlite3.Error, OSError) as e:
            raise _database_error(store.path, e) from None
        except SlurmGpuError as e:
            if type(e).__name__ == "StoreError":
                raise _database_error(store.path, e) from None
            raise
        if not dry_run:
            _write_counters(cfg, store, log)
        return outcome
    finally:
        store.close()


def _database_error(path: str, e: BaseException) -> SlurmGpuError:
    """A node database remediate cannot use, as one line with a hint (exit 2): no step is taken without
    the episode's rows, so nothing was done."""
    from slurm_gpu.store.diagnose import describe_error
    if isinstance(e, PermissionError):
        return SlurmGpuError(f"node database {path}: permission denied; nothing done",
                             "run remediate as root (it resets GPUs and changes the node in Slurm)")
    return SlurmGpuError(f"node database {path}: {describe_error(e)}; nothing done",
                         "`slurm-gpu db check` says what is wrong; move a corrupt file aside (the next hook starts "
                         "a new one) or fix store.database, then run remediate again")


def _write_counters(cfg: Config, store: Any, log: Any) -> None:
    directory = cfg.path_value("metrics", "textfile_dir")
    if not directory:
        return
    try:
        from slurm_gpu.metrics.hookwrite import write_remediation
        from slurm_gpu.metrics.textfile import ensure_dir
        ensure_dir(directory)
        write_remediation(directory, store.connect())
    except Exception as e:  # metrics never change what remediate did
        if log is not None:
            log.warning("metrics-write-failed", directory=directory, error=f"{type(e).__name__}: {e}")
