"""`slurm-gpu remediate`: close the loop on a node slurm-gpu drained (docs/remediation.md).

Acts only on a node whose drain reason is ours (not an admin's manual one, not an RMA), only when
it is idle (Slurm: no job on it; NVML: no process on any GPU), under a per-node lock, and writes
its intent to the node database before each step.  The step comes from the fault -> remedy map
(policy/remedy.py), its cost from the budgets (policy/budget.py):

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

import re
import sqlite3
import subprocess
import time as _time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.errors import SlurmGpuError
from slurm_gpu.hooks.nodelock import node_lock
from slurm_gpu.policy import breaker as BRK
from slurm_gpu.policy import budget as B
from slurm_gpu.policy import remedy as R
from slurm_gpu.policy.judge import drain_fault, failures
from slurm_gpu.slurm import reason as _reason

BUSY_STATES = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
# What nvidia-smi --gpu-reset says when a process holds the GPU ("... is currently being used by one or
# more other processes", "in use by another client"): the GPU is busy, not broken.
_IN_USE = re.compile(r"\bin use\b|being used|other process", re.I)
REBOOTING_STATES = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT"})


class Outcome(NamedTuple):
    node: str
    action: str  # none | reset | reboot | rma | manual
    outcome: str  # resumed | requested | rma | left-alone | busy | waiting | refused | breaker-open | failed | healthy
    message: str


class _Stop(Exception):
    """A run that ends where it stands (an admin took the node meanwhile, nothing to verify with)."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.message)
        self.outcome = outcome


class Env:
    """What one remediation run works with; everything injected (tests pass fakes at these seams)."""

    def __init__(self, cfg: Any, backend: Any, store: Any, node: str, *, checker: Callable[[Any], Any],
                 reader_factory: Optional[Callable[[], Any]] = None, spawn: Optional[Callable[..., Any]] = None,
                 sleep: Callable[[float], None] = _time.sleep, now: Optional[Callable[[], float]] = None,
                 log: Any = None, dry_run: bool = False,
                 central_history: Optional[Callable[[str], List[Dict[str, Any]]]] = None,
                 local_time: Callable[[], float] = _time.time):
        self.cfg, self.backend, self.store, self.node = cfg, backend, store, node
        self.checker, self.reader_factory = checker, reader_factory
        self.spawn = spawn or subprocess.Popen
        self.sleep, self.log, self.dry_run = sleep, log, dry_run
        self.local_time = local_time
        # slurmctld's clock minus ours (clock()); None until measured, then the run's every time is slurmctld's.
        self.offset: Optional[float] = None
        self.clock_problem = ""
        self._now = now
        self.lock_fd: Optional[int] = None  # the node's lock, for the reset command to inherit
        self.interrupted: List[int] = []  # rows of steps this run found abandoned and closed
        self.resumed_by_verify = ""  # the reason the verification job's resume lifted ('' when none)
        self.verified_by = ""  # how the node was verified, for its rows
        self.verify_failed: List[R.Remedy] = []  # the GPUs the last verification job failed, with their remedy
        self.budget = B.Budget.from_config(cfg)
        self.drain_time: Optional[float] = None  # when the node was drained for the fault remedied (drain_time)
        self.history = SerialHistory(store, central_history, self.say_warning)

    def now(self) -> float:
        """The run's time: slurmctld's clock once measured (clock()), else this node's."""
        if self._now is not None:
            return self._now()
        return self.local_time() + (self.offset or 0.0)

    def clock(self) -> str:
        """Measure this node's clock against slurmctld's (once per run): '' when within
        remediation.clock_slack_s, else why remediate may neither reboot nor resume (one log line, the
        slurm_gpu_clock_skew_seconds gauge).  A test's injected clock is slurmctld's by definition."""
        if self._now is not None or self.offset is not None:
            return self.clock_problem
        slack = float(self.get("clock_slack_s"))
        try:
            before = self.local_time()
            ctld = float(self.backend.ctld_time())
            local = (before + self.local_time()) / 2.0
        except Exception as e:  # slurmctld's clock unknown: nothing may be decided on ours
            self.offset = 0.0
            self.clock_problem = (f"cannot read slurmctld's clock ({getattr(e, 'message', None) or e}): "
                                  "no reboot or resume on this node's clock alone")
            self.say_warning("remediate-clock-unknown", error=self.clock_problem)
            return self.clock_problem
        self.offset = ctld - local
        skew = -self.offset
        _write_skew(self.cfg, round(skew, 1), self.log)
        if abs(skew) > slack + 1.0:  # sdiag's time has whole seconds
            self.clock_problem = (f"this node's clock is {skew:+.0f} s off slurmctld's (remediation.clock_slack_s "
                                  f"{slack:g}): no reboot or resume until it is fixed (chronyc tracking)")
            self.say_warning("remediate-clock-skew", skew_s=round(skew, 1), slack_s=slack)
        return self.clock_problem

    def get(self, key: str) -> Any:
        return self.cfg.get("remediation", key)

    def say(self, event: str, **kw: Any) -> None:
        if self.log is not None:
            self.log.info(event, node=self.node, **kw)

    def say_warning(self, event: str, **kw: Any) -> None:
        if self.log is not None:
            self.log.warning(event, node=self.node, **kw)


class SerialHistory:
    """A GPU's attempts by serial, for its budgets and the lemon rule: the node database's rows merged
    with the central server's (every node's, when central.url is set), one row per attempt (node, row id,
    time), the node's own copy winning.  The server is asked lazily (only when remediate decides about a GPU),
    once per serial and run, within central.timeout_s; a server that is down, unreachable, too slow
    or too old leaves this node's rows alone, with one log line, and the remediation goes on."""

    def __init__(self, store: Any, fetch: Optional[Callable[[str], List[Dict[str, Any]]]],
                 warn: Callable[..., None]):
        self.store, self.fetch, self.warn = store, fetch, warn
        self.central: Dict[str, List[Dict[str, Any]]] = {}
        self.unavailable = ""

    def rows(self, serial: str) -> List[Dict[str, Any]]:
        local = self.store.remediations(serial=serial)
        if not serial or self.fetch is None or self.unavailable:
            return local
        if serial not in self.central:
            try:
                self.central[serial] = self.fetch(serial)
            except Exception as e:  # a central server is a help here, never a condition
                self.unavailable = str(getattr(e, "message", "") or f"{type(e).__name__}: {e}")
                self.warn("remediate-central-unavailable", serial=serial, error=self.unavailable,
                          using="this node's remediation rows only")
                return local
        mine = {_attempt_key(r) for r in local}
        merged = local + [r for r in self.central[serial] if _attempt_key(r) not in mine]
        return sorted(merged, key=lambda r: (float(r.get("time") or 0.0), str(r.get("node")), r.get("id") or 0))


def _attempt_key(r: Dict[str, Any]) -> Tuple[str, Any, float]:
    """One attempt: its node, row id and time (a reimaged node's new database reuses row ids)."""
    return str(r.get("node")), r.get("id"), float(r.get("time") or 0.0)


def central_history(cfg: Any) -> Optional[Callable[[str], List[Dict[str, Any]]]]:
    """One GPU's attempts on every node from the central server (central/server.py, imported only when
    asked: PyMySQL is never loaded by a healthcheck that finds nothing to remediate); None without central.url."""
    if not cfg.get("central", "url"):
        return None

    def fetch(serial: str) -> List[Dict[str, Any]]:
        from slurm_gpu.central.server import Central, remediation_history
        with Central.from_config(cfg) as srv:
            return remediation_history(srv, serial)
    return fetch


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
        except _Stop as stop:
            return stop.outcome
    finally:
        lock.__exit__(None, None, None)


def _running_elsewhere(env: Env) -> str:
    """What holds the node's lock, in words: a reset a killed run left (its pid on the row), else a run."""
    try:
        for row in env.store.open_steps(env.node):
            if row["action"] == "reset" and _alive(row.get("pid"), row.get("pid_start")):
                return (f"a reset of GPU {row['gpu_index']} (pid {row['pid']}, started "
                        f"{max(0.0, env.now() - float(row['time'])):.0f} s ago) still runs")
    except sqlite3.Error:
        pass
    return "another remediate run holds the node's lock"


def _proc_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None when gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: Any, start: Any) -> bool:
    """Is the step's process still the one that was started (a reused pid is not)?"""
    if not pid:
        return False
    now = _proc_start(int(pid))
    return now is not None and (start is None or now == int(start))


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
            if _alive(row.get("pid"), row.get("pid_start")):
                return Outcome(env.node, "reset", "busy", f"{env.node}: a reset of GPU {row['gpu_index']} (pid {row['pid']}) "
                                                          f"started {age:.0f} s ago still runs; the node stays drained")
            if row.get("pid") is None and 0 <= age < limit:
                return Outcome(env.node, "reset", "busy", f"{env.node}: a reset of GPU {row['gpu_index']} was started "
                                                          f"{age:.0f} s ago by a run that ended; the node stays drained "
                                                          f"until reset_timeout_s ({limit:g} s) has passed")
            _finish(env, [row["id"]], "interrupted", "the run carrying out the reset ended before it did")
        elif row["action"] == "verify":
            done = _clean_verification(env)
            _finish(env, [row["id"]], "interrupted",
                    "the run carrying out the verification ended" + (f"; {done}" if done else ""))
        elif row["action"] == "reboot":
            issued = info.states & REBOOTING_STATES or " : reboot issued" in (info.reason or "")
            if issued:  # Slurm took it: the reboot's own path (_after_reboot) carries on with the row
                _finish(env, [row["id"]], "requested", "the reboot was issued; the run asking for it ended")
                continue
            _finish(env, [row["id"]], "interrupted", "the run asking for the reboot ended before Slurm took it")
        env.interrupted.append(row["id"])
        env.say_warning("remediate-step-interrupted", action=row["action"], row=row["id"])
    return None


def _clean_verification(env: Env) -> str:
    from slurm_gpu.hooks.verifyjob import clean_leftover

    def drain(text: str) -> None:
        _hold(env, _reason.format_reason(text, "remediate: verify"))
    return clean_leftover(env.cfg, env.backend, env.node, drain, env.log)


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
            return _returned_by_slurm(env, info, rebooted)
    if why:
        return Outcome(env.node, "none", "left-alone", f"{env.node}: {why}")
    if info.states & REBOOTING_STATES:
        return Outcome(env.node, "reboot", "waiting", f"{env.node}: reboot under way ({info.state})")
    busy = _slurm_busy(info)
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
        return _after_reboot(env, info, run, rebooted)
    found = R.remedies(run, getattr(run, "snapshot", None), getattr(run, "xid_events", ()))
    if not found:
        return _verify_and_resume(env, info, "none", [], "no fault found now", run=run)
    return _act(env, info, run, found)


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


def _slurm_busy(info: Any) -> str:
    if info.states & BUSY_STATES or info.gpus_allocated:
        return f"Slurm has a job on it ({info.state}, {info.gpus_allocated} GPUs allocated)"
    return ""


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


def _gpu_reading(run: Any, index: Optional[int], field: str) -> str:
    """One identity reading (serial, uuid) of GPU `index` in the run's snapshot; '' when unknown."""
    for g in getattr(getattr(run, "snapshot", None), "gpus", ()):
        if g.index == index:
            return str(getattr(g, field).get("") or "")
    return ""


def _serial(run: Any, index: Optional[int]) -> str:
    return _gpu_reading(run, index, "serial")


def _act(env: Env, info: Any, run: Any, found: List[R.Remedy]) -> Outcome:
    action = R.node_action(found)
    fault = drain_fault(failures(run))
    if action == R.MANUAL:
        manual = next(r for r in found if r.action == R.MANUAL)
        return Outcome(env.node, "manual", "left-alone", f"{env.node}: {manual.check}: {manual.source}; drain left "
                                                         f"for a human ({info.reason})")
    gpus = [r for r in found if r.gpu_index is not None]
    for r in gpus:
        lemon, why = B.is_lemon(env.budget, env.history.rows(_serial(run, r.gpu_index)), env.now())
        if lemon:
            return _rma(env, run, r, why)
    if action == R.RMA:
        return _rma(env, run, next(r for r in found if r.action == R.RMA), "")
    if action == R.RESET:
        return _try_reset(env, info, run, [r for r in gpus if r.action == R.RESET] or gpus, fault)
    return _reboot(env, run, found, fault)


def _row(env: Env, run: Any, r: Optional[R.Remedy], action: str, outcome: str, detail: str = "") -> int:
    if env.dry_run:
        return 0
    row = {"time": env.now(), "node": env.node, "gpu_index": None if r is None else r.gpu_index,
           "gpu_uuid": "" if r is None else r.gpu_uuid, "serial": _serial(run, None if r is None else r.gpu_index),
           "fault_check": None if r is None else r.check, "fault": None if r is None else r.fault,
           "action": action, "outcome": outcome, "detail": detail, "drain_time": env.drain_time}
    return env.store.record_remediation(row)


def _finish(env: Env, ids: Sequence[int], outcome: str, detail: str) -> None:
    for i in ids:
        if i:
            env.store.finish_remediation(i, outcome, detail, env.now())


def _hold(env: Env, text: str) -> str:
    """Put our `text` on the node remediate acts on: only while its reason is still one of our automatic
    ones, or it is in service (a fault found on it: drained is the safe side).  '' once set, else why
    not: an admin who drained the node since remediate last read it keeps the node and the reason.
    Slurm has no compare-and-set for a reason, so the read comes right before the write."""
    now = env.backend.node(env.node)
    if (now.drained or now.down) and not _reason.is_automatic(now.reason):
        return f"reason changed meanwhile ({now.reason or 'none'})"
    env.backend.drain(env.node, text)
    return ""


def _redrain(env: Env, fault: str, step: str) -> Tuple[str, str]:
    """(our reason for the step, '' or why it was not set: _hold)."""
    text = _reason.format_reason(fault, f"remediate: {step}")
    return text, ("" if env.dry_run else _hold(env, text))


def _try_reset(env: Env, info: Any, run: Any, targets: List[R.Remedy], fault: str) -> Outcome:
    for r in targets:
        ok, why = B.may_reset(env.budget, env.history.rows(_serial(run, r.gpu_index)), env.now())
        if not ok:
            _row(env, run, r, "reset", "refused", why)
            return _reboot(env, run, targets, fault, because=f"reset budget spent: {why}")
    if env.dry_run:
        return Outcome(env.node, "reset", "would-reset", f"{env.node}: would reset GPU "
                                                         f"{','.join(str(r.gpu_index) for r in targets)}: {fault}")
    _, taken = _redrain(env, fault, "reset")
    if taken:
        return Outcome(env.node, "reset", "left-alone", f"{env.node}: {taken}: no reset; the admin's drain stays")
    again = env.backend.node(env.node)  # a job Slurm placed before our drain took effect
    if _slurm_busy(again):
        return Outcome(env.node, "reset", "busy", f"{env.node}: {_slurm_busy(again)} after the drain; no reset")
    in_use = _in_use_now(env, [r.gpu_index for r in targets if r.gpu_index is not None])
    if in_use:
        return Outcome(env.node, "reset", "busy", f"{env.node}: {in_use} now; no reset, the node stays drained "
                                                  "and the next run tries again")
    ids = [_row(env, run, r, "reset", "started") for r in targets]
    failed, busy = _reset_gpus(env, run, targets, ids)
    if busy:
        _finish(env, ids, "busy", failed)
        return Outcome(env.node, "reset", "busy", f"{env.node}: {failed}: the GPU is in use, not broken; the node stays "
                                                  "drained and the next run tries again")
    if failed:
        _finish(env, ids, "escalated", failed)
        return _reboot(env, run, targets, fault, because=failed)
    _reapply(env, run)
    verdict = _verify(env, info) or _verify_actively(env, run, info, fault)
    if verdict:
        _finish(env, ids, "escalated", verdict)
        return _reboot(env, run, targets, fault, because=f"verification after the reset failed: {verdict}")
    _finish(env, ids, "resumed", _verified_how(env))
    return _resume(env, "reset", f"GPU {','.join(str(r.gpu_index) for r in targets)} reset and verified")


def _command(env: Env, run: Any, index: int) -> List[str]:
    bus = ""
    for g in run.snapshot.gpus:
        if g.index == index:
            bus = str(g.pci_bus_id.get(""))
    return [a.replace("{pci_bus_id}", bus).replace("{index}", str(index)).replace("%n", env.node)
            for a in env.get("reset_command")]


def _in_use_now(env: Env, indices: Sequence[int]) -> str:
    """Processes listed again right before a reset (or a reboot): '' when none, else which GPU holds one.
    A process that appeared after the check makes the GPU busy, never broken."""
    if env.reader_factory is None or not indices:
        return ""
    try:
        reader = env.reader_factory()
    except Exception:  # no reader: the reset itself refuses a GPU in use, and that refusal is `busy` too
        return ""
    try:
        found = reader.processes_many(list(indices))
    except Exception:
        return ""
    finally:
        reader.close()
    for index in sorted(found):
        procs = found[index]
        if isinstance(procs, tuple) and procs:
            return f"GPU {index} has {len(procs)} process{'es' if len(procs) != 1 else ''} (pid {procs[0].pid})"
    return ""


def _reset_gpus(env: Env, run: Any, targets: List[R.Remedy], ids: Sequence[int]) -> Tuple[str, bool]:
    """Run the reset command per GPU (argv, no shell, a deadline): ('', False) when all succeeded, else
    (why not, busy).  busy: the command refused a GPU in use (nvidia-smi's "in use" answer, or a process
    on it now), which is no fault of the GPU.  The command inherits the node's lock and its pid is kept on
    the attempt's row, so a run killed meanwhile leaves the reset holding the node until it ends.
    A reset fault that names no GPU (a node-wide one) cannot be cured by a GPU reset: it escalates."""
    if not targets:
        return "the fault names no GPU to reset", False
    for r, row in zip(targets, ids):
        if r.gpu_index is None:
            return f"{r.check}: the fault names no GPU to reset", False
        argv = _command(env, run, r.gpu_index)
        env.say("remediate-reset", gpu=r.gpu_index, command=" ".join(argv))
        limit = float(env.get("reset_timeout_s"))
        try:
            child = env.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, pass_fds=(env.lock_fd,) if env.lock_fd is not None else ())
        except OSError as e:
            return f"reset of GPU {r.gpu_index}: cannot run {argv[0]}: {e.strerror or e}", False
        if row:
            env.store.set_step_process(row, pid=child.pid, pid_start=_proc_start(child.pid))
        try:
            out, err = child.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return f"reset of GPU {r.gpu_index} did not finish within {limit:g} s", False
        if child.returncode != 0:
            text = (err or out or "").strip().splitlines()
            why = f"reset of GPU {r.gpu_index} failed (exit {child.returncode}): {text[-1] if text else 'no output'}"
            busy = bool(_IN_USE.search(err or out or "")) or bool(_in_use_now(env, [r.gpu_index]))
            return why, busy
    return "", False


def _reapply(env: Env, run: Any) -> None:
    """Persistence, accounting mode and clocks, as the prolog sets them (a reset puts them back to defaults)."""
    if env.reader_factory is None:
        return
    hooks = env.cfg.get("hooks", "persistence_mode"), env.cfg.get("hooks", "accounting_mode"), \
        env.cfg.get("hooks", "reset_clocks")
    reader = env.reader_factory()
    try:
        indices = [g.index for g in run.snapshot.gpus if not g.unreachable]
        reader.prepare(indices, persistence=hooks[0], accounting=hooks[1], reset_clocks=hooks[2])
    finally:
        reader.close()


def _verify(env: Env, info: Any) -> str:
    """'' when the full healthcheck set passes verify_passes times in a row, spaced; else the first failure."""
    passes = int(env.get("verify_passes"))
    for n in range(passes):
        if n:
            env.sleep(float(env.get("verify_interval_s")))
        found = failures(env.checker(info))
        if found:
            return f"pass {n + 1} of {passes}: {drain_fault(found)}"
    return ""


def _resume(env: Env, action: str, what: str) -> Outcome:
    """Resume only while the reason is still ours (an admin who drained it meanwhile keeps it).  A node the
    verification job already resumed (it ran in its reservation) is not resumed twice."""
    if env.resumed_by_verify:
        _close_interrupted(env)
        return Outcome(env.node, action, "resumed", f"{env.node}: {what}; resumed (was: {env.resumed_by_verify})")
    was, why_not = _resume_now(env)
    if why_not:
        return Outcome(env.node, action, "left-alone", f"{env.node}: {what}; {why_not}, not resumed")
    _close_interrupted(env)
    return Outcome(env.node, action, "resumed", f"{env.node}: {what}; resumed (was: {was})")


def verify_enabled(cfg: Any) -> bool:
    try:
        return bool(cfg.get("verify", "enabled"))
    except KeyError:  # a stand-in config without the section
        return False


def _verified_how(env: Env) -> str:
    return env.verified_by or "verified"


def _verify_actively(env: Env, run: Any, info: Any, fault: str) -> str:
    """The verification job through Slurm (verify.enabled; hooks/verifyjob.py): '' when it passed (the node
    is then back in service: it was resumed inside the job's reservation) or when it is off; else why not,
    the node drained again before its reservation went.  Each GPU that failed gets a row of its own
    (action verify, by serial: its lemon rule counts it)."""
    if env.dry_run or not verify_enabled(env.cfg):
        return ""
    from slurm_gpu.hooks.verifyjob import verify_node
    row = _row(env, run, None, "verify", "started")
    declined: List[str] = []

    def resume() -> bool:
        was, why = _resume_now(env)
        if why:
            declined.append(why)
            return False
        env.resumed_by_verify = was
        return True

    def drain(text: str) -> None:
        env.resumed_by_verify = ""
        _hold(env, _reason.format_reason(text, "remediate: verify"))

    gpus = int(getattr(info, "gpus_configured", 0) or len(getattr(getattr(run, "snapshot", None), "gpus", ())) or 0)
    result = verify_node(env.cfg, env.backend, env.node, gpus, resume=resume, drain=drain, log=env.log,
                         sleep=env.sleep)
    if result.job_id:
        env.store.set_step_process(row, job_id=int(result.job_id))
    if result.ok:
        battery = "" if result.battery_s is None else f", its battery {result.battery_s:.1f} s"
        env.verified_by = f"verified; verification job {result.job_id} passed in {result.elapsed_s:.1f} s{battery}"
        _finish(env, [row], "resumed", env.verified_by)
        env.say("remediate-verified", job=result.job_id, elapsed_s=round(result.elapsed_s, 1))
        return ""
    if declined:
        _finish(env, [row], "refused", declined[0])
        raise _Stop(Outcome(env.node, "verify", "left-alone", f"{env.node}: verification not started: {declined[0]}"))
    from slurm_gpu.hooks.verifyjob import failure_checks
    found = failure_checks(result)
    if result.empty or not found:
        # Nothing to run, a job the node never started, a tool that could not run: no test failed on the
        # GPUs, so no GPU is blamed and nothing escalates; the node stays drained for a human.
        _finish(env, [row], "failed", result.detail)
        raise _Stop(Outcome(env.node, "verify", "failed", f"{env.node}: not verified: {result.detail}; the node "
                                                           "stays drained"))
    env.verify_failed = []
    for index, check, message in found:
        action, source = R.CHECK_REMEDY.get(check, (R.RESET, "verification job"))
        env.verify_failed.append(R.Remedy(check, index, _uuid(run, index), action, source, message))
        if index is None:
            continue
        env.store.record_remediation({
            "time": env.now(), "node": env.node, "gpu_index": index, "gpu_uuid": _uuid(run, index),
            "serial": _serial(run, index), "fault_check": check, "fault": message[:500],
            "action": "verify", "outcome": "failed", "detail": f"verification job {result.job_id}",
            "drain_time": env.drain_time, "finished": env.now()})
    _finish(env, [row], "failed", result.detail)
    return f"verification job {result.job_id or '(none)'}: {result.detail}"


def _uuid(run: Any, index: Optional[int]) -> str:
    return _gpu_reading(run, index, "uuid")


def _escalate_after_verify(env: Env, run: Any, action: str, what: str, why: str) -> Outcome:
    """A node the passive checks found healthy failed its verification job: the GPUs it names get their
    remedy (the fault -> remedy map; a reset escalates to a reboot, a reboot to an RMA); one that names
    no GPU goes to a reboot."""
    found = list(env.verify_failed)
    info = env.backend.node(env.node)
    gpus = [r for r in found if r.gpu_index is not None]
    for r in gpus:
        lemon, lemon_why = B.is_lemon(env.budget, env.history.rows(_serial(run, r.gpu_index)), env.now())
        if lemon:
            return _rma(env, run, r, lemon_why)
    if gpus and R.node_action(gpus) == R.RESET:
        return _try_reset(env, info, run, gpus, why)
    if gpus and R.node_action(gpus) == R.RMA:
        return _rma(env, run, next(r for r in gpus if r.action == R.RMA), why)
    return _reboot(env, run, found, why, because=f"{what}, but {why}")


def _rma_after_verify(env: Env, run: Any, why: str) -> Outcome:
    found = env.verify_failed
    gpu = found[0] if found else R.Remedy("verify", None, "", R.RMA, "verification job", why)
    return _rma(env, run, gpu, "the fault survived the reboot (verification job)")


def _resume_now(env: Env) -> Tuple[str, str]:
    """State=RESUME when the reason is still one of our automatic ones and the clocks agree:
    (the reason it had, '') or ('', why not)."""
    now = env.backend.node(env.node)
    if not _reason.is_automatic(now.reason):
        return "", f"reason changed meanwhile ({now.reason or 'none'})"
    if env.clock():
        return "", env.clock()
    env.backend.resume(env.node)
    return now.reason or "", ""


def _close_interrupted(env: Env) -> None:
    """A killed run's steps of this episode, once the node is verified and back: resumed, not pending."""
    _finish(env, env.interrupted, "resumed", "interrupted; then verified and resumed by a later run")


def _verify_and_resume(env: Env, info: Any, action: str, ids: Sequence[int], what: str,
                       rebooted: bool = False, run: Any = None) -> Outcome:
    if env.dry_run:
        return Outcome(env.node, action, "would-verify", f"{env.node}: {what}: would verify and resume")
    verdict = _verify(env, info)
    if verdict:
        _finish(env, ids, "failed", verdict)
        if rebooted:  # the reason says what is wrong now, not "reboot ... : reboot complete"
            _redrain(env, verdict, "verify after reboot")
        return Outcome(env.node, action, "failed", f"{env.node}: {what}, but verification failed: {verdict}")
    active = _verify_actively(env, run, info, what)
    if active:
        _finish(env, ids, "failed", active)
        if rebooted and run is not None:  # a fault that shows only under load survived the reboot: RMA
            return _rma_after_verify(env, run, active)
        return _escalate_after_verify(env, run, action, what, active)
    _finish(env, ids, "resumed", _verified_how(env))
    return _resume(env, action, f"{what}; verified")


def _reboot(env: Env, run: Any, found: Sequence[R.Remedy], fault: str, because: str = "") -> Outcome:
    ok, why = B.may_reboot(env.budget, env.store.remediations(node=env.node, since=env.now() - B.DAY_S), env.now())
    first = found[0] if found else None
    if not ok:
        _row(env, run, first, "reboot", "refused", why)
        return Outcome(env.node, "reboot", "refused", f"{env.node}: needs a reboot ({because or fault}) but {why}: "
                                                      "left drained for a human")
    if env.dry_run:
        return Outcome(env.node, "reboot", "would-reboot", f"{env.node}: would ask Slurm to reboot: {because or fault}")
    in_use = _in_use_now(env, [g.index for g in getattr(getattr(run, "snapshot", None), "gpus", ()) if not g.unreachable])
    if in_use:
        return Outcome(env.node, "reboot", "busy", f"{env.node}: needs a reboot ({because or fault}) but {in_use} now: "
                                                   "no reboot under a running process; the node stays drained")
    text = _reason.format_reason(fault, "remediate: reboot", check=BRK.REBOOT)
    held = _reboot_breaker(env, text)
    if held:
        _row(env, run, first, "reboot", "refused", held)
        return Outcome(env.node, "reboot", "breaker-open", f"{env.node}: needs a reboot ({because or fault}) but {held}: "
                                                           "left drained")
    row = _row(env, run, first, "reboot", "started", because)
    try:
        env.backend.reboot(env.node, text)
    except Exception as e:  # the intent stays on record with why it did not happen
        _finish(env, [row], "failed", f"scontrol reboot: {getattr(e, 'message', e)}")
        raise
    _finish(env, [row], "requested", because or fault)
    return Outcome(env.node, "reboot", "requested", f"{env.node}: reboot requested through Slurm: {text}")


def _reboot_breaker(env: Env, text: str) -> str:
    """The circuit breaker for reboots (policy/breaker.py, check `reboot`): its text when open, else ''.
    remediate's other drains re-drain a node already drained by us: they add nothing to its count.
    A reboot cannot be taken back, so the node claims its place first: its reason becomes the reboot's
    (it counts for `reboot` now), and after breaker.settle_s the second count (confirm) either lets
    the reboot go or puts the node's reason back (nodes deciding at the same moment, the healthcheck
    running remediate on every node at once)."""
    from slurm_gpu.hooks.breaker import ask, confirm
    verdict = ask(env.cfg, env.backend, env.node, BRK.REBOOT, env.now(), env.log)
    if verdict.open:
        return verdict.text
    before = env.backend.node(env.node).reason
    taken = _hold(env, text)  # drained already: only the reason (and its time) changes, while it is ours
    if taken:
        return taken
    if BRK.Breaker.from_config(env.cfg).max_drained_pct >= 100:
        return ""
    second = confirm(env.cfg, env.backend, env.node, BRK.REBOOT, text, env.log,
                     withdraw=lambda: env.backend.drain(env.node, before or text))
    return second.text if second.open else ""


def _after_reboot(env: Env, info: Any, run: Any, row: Dict[str, Any]) -> Outcome:
    """The first run after the reboot Slurm did for us: verify, then resume; a fault that survived it is an RMA."""
    if not failures(run):
        return _verify_and_resume(env, info, "reboot", [row["id"]], "rebooted", rebooted=True, run=run)
    _finish(env, [row["id"]], "escalated", drain_fault(failures(run)))
    found = R.remedies(run, run.snapshot, getattr(run, "xid_events", ()))
    gpu = next((r for r in found if r.gpu_index is not None), found[0])
    return _rma(env, run, gpu, "the fault survived the reboot")


def _returned_by_slurm(env: Env, info: Any, row: Dict[str, Any]) -> Outcome:
    """Our reboot is done but Slurm put the node back in service itself (ReturnToService=2 returns a
    DOWN node on its next registration, nextstate=DOWN or not): check it now, drain it if it fails."""
    what = f"{env.node}: returned to service by Slurm after our reboot, before our verification"
    if env.dry_run:
        return Outcome(env.node, "reboot", "would-verify", f"{what}: would check it")
    found = failures(env.checker(info))
    if found:
        _finish(env, [row["id"]], "failed", drain_fault(found))
        text = _reason.format_reason(drain_fault(found), "remediate: verify after reboot")
        taken = _hold(env, text)
        done = f"drained again: {text}" if not taken else f"not drained by us: {taken}"
        return Outcome(env.node, "reboot", "failed", f"{what}; the check failed: {done}")
    _finish(env, [row["id"]], "resumed", "returned to service by Slurm; checked")
    return Outcome(env.node, "reboot", "resumed", f"{what}; checked: healthy")


def _rma(env: Env, run: Any, r: R.Remedy, why: str) -> Outcome:
    serial = _serial(run, r.gpu_index) or r.gpu_uuid or "?"
    fault = r.fault + (f"; {why}" if why else "")
    text = _reason.rma_reason(serial, fault)
    if env.dry_run:
        return Outcome(env.node, "rma", "would-rma", f"{env.node}: would mark for RMA: {text}")
    _row(env, run, r, "rma", "rma", why or r.source)
    taken = _hold(env, text)
    return Outcome(env.node, "rma", "rma", f"{env.node}: {text}" + (f" (reason not set: {taken})" if taken else ""))


def _write_skew(cfg: Any, skew_s: float, log: Any) -> None:
    directory = cfg.path_value("metrics", "textfile_dir") if cfg is not None else ""
    if not directory:
        return
    try:
        from slurm_gpu.metrics.hookwrite import write_clock_skew
        from slurm_gpu.metrics.textfile import ensure_dir
        ensure_dir(directory)
        write_clock_skew(directory, skew_s)
    except Exception as e:  # metrics never change what remediate does
        if log is not None:
            log.warning("metrics-write-failed", directory=directory, error=f"{type(e).__name__}: {e}")


def run_on_node(cfg: Any, backend: Any, node: str, checker: Callable[[Any], Any], *, log: Any = None,
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


def _write_counters(cfg: Any, store: Any, log: Any) -> None:
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
