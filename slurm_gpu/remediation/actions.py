"""The ladder's steps (docs/remediation.md, "The ladder"): reset -> reboot -> RMA.

Each step asks the budgets first (budget.py: resets per GPU, reboots per node, the lemon rule) and
climbs when it did not cure: a reset that fails, or whose verification fails, becomes a reboot; a
fault that survives the reboot becomes an RMA.  A GPU in use is `busy`, never a fault: the processes
are listed again right before a reset or a reboot, and no step escalates for them.

- reset: remediation.reset_command per GPU (an argument list, no shell, a deadline); the command
  inherits the node's lock and its pid is kept on the row, so a run killed meanwhile leaves the reset
  holding the node until it ends.  Then persistence, accounting and clocks as the prolog sets them.
- reboot: Slurm's (`scontrol reboot ASAP nextstate=DOWN`, the site's RebootProgram), claimed through
  the circuit breaker first (hooks/breaker.py, check `reboot`): a reboot cannot be taken back.
- RMA: the drain becomes `slurm-gpu: RMA: GPU <serial> ...` and stays for an admin.
"""
from __future__ import annotations

import re
import subprocess
from typing import Any, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.policy import breaker as BRK
from slurm_gpu.policy.judge import drain_fault, failures
from slurm_gpu.remediation import budget as B
from slurm_gpu.remediation import remedy as R
from slurm_gpu.remediation.context import (
    Env,
    Outcome,
    finish_steps,
    hold,
    proc_start,
    record_step,
    redrain,
    serial_of,
    slurm_busy,
    uuid_of,
)
from slurm_gpu.remediation.verify import resume, verified_how, verify_actively, verify_checks
from slurm_gpu.slurm import reason as _reason

# What nvidia-smi --gpu-reset says when a process holds the GPU ("... is currently being used by one or
# more other processes", "in use by another client"): the GPU is busy, not broken.
_IN_USE = re.compile(r"\bin use\b|being used|other process", re.I)


def act(env: Env, info: Any, run: Any, found: List[R.Remedy]) -> Outcome:
    action = R.node_action(found)
    fault = drain_fault(failures(run))
    if action == R.MANUAL:
        manual = next(r for r in found if r.action == R.MANUAL)
        return Outcome(env.node, "manual", "left-alone", f"{env.node}: {manual.check}: {manual.source}; drain left "
                                                         f"for a human ({info.reason})")
    gpus = [r for r in found if r.gpu_index is not None]
    for r in gpus:
        lemon, why = is_lemon(env, run, r.gpu_index)
        if lemon:
            return rma(env, run, r, why)
    if action == R.RMA:
        return rma(env, run, next(r for r in found if r.action == R.RMA), "")
    if action == R.RESET:
        return try_reset(env, info, run, [r for r in gpus if r.action == R.RESET] or gpus, fault)
    return reboot(env, run, found, fault)


def is_lemon(env: Env, run: Any, gpu_index: Optional[int]) -> Tuple[bool, str]:
    """The lemon rule (budget.py) for one GPU: its attempts by serial (this node's and the server's) and
    the bursts of hardware XIDs this node's kernel log recorded for it (by UUID)."""
    now = env.now()
    xids: List[Dict[str, Any]] = []
    if env.budget.lemon_xid_bursts > 0:
        try:
            xids = env.store.gpu_xids(uuid_of(run, gpu_index), now - env.budget.lemon_window_s)
        except Exception as e:  # evidence for the rule, never a condition of remediating
            env.say_warning("remediate-xids-unreadable", gpu=gpu_index, error=f"{type(e).__name__}: {e}")
    return B.is_lemon(env.budget, env.history.rows(serial_of(run, gpu_index)), now, xids)


def try_reset(env: Env, info: Any, run: Any, targets: List[R.Remedy], fault: str) -> Outcome:
    for r in targets:
        ok, why = B.may_reset(env.budget, env.history.rows(serial_of(run, r.gpu_index)), env.now())
        if not ok:
            record_step(env, run, r, "reset", "refused", why)
            return reboot(env, run, targets, fault, because=f"reset budget spent: {why}")
    if env.dry_run:
        return Outcome(env.node, "reset", "would-reset", f"{env.node}: would reset GPU "
                                                         f"{','.join(str(r.gpu_index) for r in targets)}: {fault}")
    _, taken = redrain(env, fault, "reset")
    if taken:
        return Outcome(env.node, "reset", "left-alone", f"{env.node}: {taken}: no reset; the admin's drain stays")
    again = env.backend.node(env.node)  # a job Slurm placed before our drain took effect
    if slurm_busy(again):
        return Outcome(env.node, "reset", "busy", f"{env.node}: {slurm_busy(again)} after the drain; no reset")
    in_use = _in_use_now(env, [r.gpu_index for r in targets if r.gpu_index is not None])
    if in_use:
        return Outcome(env.node, "reset", "busy", f"{env.node}: {in_use} now; no reset, the node stays drained "
                                                  "and the next run tries again")
    ids = [record_step(env, run, r, "reset", "started") for r in targets]
    failed, busy = reset_gpus(env, run, targets, ids)
    if busy:
        finish_steps(env, ids, "busy", failed)
        return Outcome(env.node, "reset", "busy", f"{env.node}: {failed}: the GPU is in use, not broken; the node stays "
                                                  "drained and the next run tries again")
    if failed:
        finish_steps(env, ids, "escalated", failed)
        return reboot(env, run, targets, fault, because=failed)
    _reapply(env, run)
    verdict = verify_checks(env, info) or verify_actively(env, run, info, fault)
    if verdict:
        finish_steps(env, ids, "escalated", verdict)
        return reboot(env, run, targets, fault, because=f"verification after the reset failed: {verdict}")
    finish_steps(env, ids, "resumed", verified_how(env))
    return resume(env, "reset", f"GPU {','.join(str(r.gpu_index) for r in targets)} reset and verified")


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


def reset_gpus(env: Env, run: Any, targets: List[R.Remedy], ids: Sequence[int]) -> Tuple[str, bool]:
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
            env.store.set_step_process(row, pid=child.pid, pid_start=proc_start(child.pid))
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
    hooks = env.cfg.hooks.persistence_mode, env.cfg.hooks.accounting_mode, \
        env.cfg.hooks.reset_clocks
    reader = env.reader_factory()
    try:
        indices = [g.index for g in run.snapshot.gpus if not g.unreachable]
        reader.prepare(indices, persistence=hooks[0], accounting=hooks[1], reset_clocks=hooks[2])
    finally:
        reader.close()


def reboot(env: Env, run: Any, found: Sequence[R.Remedy], fault: str, because: str = "") -> Outcome:
    ok, why = B.may_reboot(env.budget, env.store.remediations(node=env.node, since=env.now() - B.DAY_S), env.now())
    first = found[0] if found else None
    if not ok:
        record_step(env, run, first, "reboot", "refused", why)
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
        record_step(env, run, first, "reboot", "refused", held)
        return Outcome(env.node, "reboot", "breaker-open", f"{env.node}: needs a reboot ({because or fault}) but {held}: "
                                                           "left drained")
    row = record_step(env, run, first, "reboot", "started", because)
    try:
        env.backend.reboot(env.node, text)
    except Exception as e:  # the intent stays on record with why it did not happen
        finish_steps(env, [row], "failed", f"scontrol reboot: {getattr(e, 'message', e)}")
        raise
    finish_steps(env, [row], "requested", because or fault)
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
    taken = hold(env, text)  # drained already: only the reason (and its time) changes, while it is ours
    if taken:
        return taken
    if BRK.Breaker.from_config(env.cfg).max_drained_pct >= 100:
        return ""
    second = confirm(env.cfg, env.backend, env.node, BRK.REBOOT, text, env.log,
                     withdraw=lambda: env.backend.drain(env.node, before or text))
    return second.text if second.open else ""


def rma(env: Env, run: Any, r: R.Remedy, why: str) -> Outcome:
    serial = serial_of(run, r.gpu_index) or r.gpu_uuid or "?"
    fault = r.fault + (f"; {why}" if why else "")
    text = _reason.rma_reason(serial, fault)
    if env.dry_run:
        return Outcome(env.node, "rma", "would-rma", f"{env.node}: would mark for RMA: {text}")
    record_step(env, run, r, "rma", "rma", why or r.source)
    taken = hold(env, text)
    return Outcome(env.node, "rma", "rma", f"{env.node}: {text}" + (f" (reason not set: {taken})" if taken else ""))


def verify_and_resume(env: Env, info: Any, action: str, ids: Sequence[int], what: str,
                      rebooted: bool = False, run: Any = None) -> Outcome:
    if env.dry_run:
        return Outcome(env.node, action, "would-verify", f"{env.node}: {what}: would verify and resume")
    verdict = verify_checks(env, info)
    if verdict:
        finish_steps(env, ids, "failed", verdict)
        if rebooted:  # the reason says what is wrong now, not "reboot ... : reboot complete"
            redrain(env, verdict, "verify after reboot")
        return Outcome(env.node, action, "failed", f"{env.node}: {what}, but verification failed: {verdict}")
    active = verify_actively(env, run, info, what)
    if active:
        finish_steps(env, ids, "failed", active)
        if rebooted and run is not None:  # a fault that shows only under load survived the reboot: RMA
            return rma_after_verify(env, run, active)
        return escalate_after_verify(env, run, action, what, active)
    finish_steps(env, ids, "resumed", verified_how(env))
    return resume(env, action, f"{what}; verified")


def escalate_after_verify(env: Env, run: Any, action: str, what: str, why: str) -> Outcome:
    """A node the passive checks found healthy failed its verification job: the GPUs it names get their
    remedy (the fault -> remedy map; a reset escalates to a reboot, a reboot to an RMA); one that names
    no GPU goes to a reboot."""
    found = list(env.verify_failed)
    info = env.backend.node(env.node)
    gpus = [r for r in found if r.gpu_index is not None]
    for r in gpus:
        lemon, lemon_why = is_lemon(env, run, r.gpu_index)
        if lemon:
            return rma(env, run, r, lemon_why)
    if gpus and R.node_action(gpus) == R.RESET:
        return try_reset(env, info, run, gpus, why)
    if gpus and R.node_action(gpus) == R.RMA:
        return rma(env, run, next(r for r in gpus if r.action == R.RMA), why)
    return reboot(env, run, found, why, because=f"{what}, but {why}")


def rma_after_verify(env: Env, run: Any, why: str) -> Outcome:
    found = env.verify_failed
    gpu = found[0] if found else R.Remedy("verify", None, "", R.RMA, "verification job", why)
    return rma(env, run, gpu, "the fault survived the reboot (verification job)")


def after_reboot(env: Env, info: Any, run: Any, row: Dict[str, Any]) -> Outcome:
    """The first run after the reboot Slurm did for us: verify, then resume; a fault that survived it is an RMA."""
    if not failures(run):
        return verify_and_resume(env, info, "reboot", [row["id"]], "rebooted", rebooted=True, run=run)
    finish_steps(env, [row["id"]], "escalated", drain_fault(failures(run)))
    found = R.remedies(run, run.snapshot, getattr(run, "xid_events", ()))
    gpu = next((r for r in found if r.gpu_index is not None), found[0])
    return rma(env, run, gpu, "the fault survived the reboot")


def returned_by_slurm(env: Env, info: Any, row: Dict[str, Any]) -> Outcome:
    """Our reboot is done but Slurm put the node back in service itself (ReturnToService=2 returns a
    DOWN node on its next registration, nextstate=DOWN or not): check it now, drain it if it fails."""
    what = f"{env.node}: returned to service by Slurm after our reboot, before our verification"
    if env.dry_run:
        return Outcome(env.node, "reboot", "would-verify", f"{what}: would check it")
    found = failures(env.checker(info))
    if found:
        finish_steps(env, [row["id"]], "failed", drain_fault(found))
        text = _reason.format_reason(drain_fault(found), "remediate: verify after reboot")
        taken = hold(env, text)
        done = f"drained again: {text}" if not taken else f"not drained by us: {taken}"
        return Outcome(env.node, "reboot", "failed", f"{what}; the check failed: {done}")
    finish_steps(env, [row["id"]], "resumed", "returned to service by Slurm; checked")
    return Outcome(env.node, "reboot", "resumed", f"{what}; checked: healthy")
