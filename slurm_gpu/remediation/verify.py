"""Verification before a remediated node goes back into service (docs/remediation.md, "The ladder",
step 2; "Verification job").

A reset or a reboot has cured nothing until the node proves it: the full healthcheck set must pass
remediation.verify_passes times in a row, spaced (verify_checks); with verify.enabled, the
verification job then runs the battery through Slurm (verify_actively, verifyjob.py), each GPU it fails
getting a row of its own for the lemon rule.  Only then is the node resumed (resume), and only while
its reason is still one of ours: an admin who drained it meanwhile keeps it.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from slurm_gpu.config import Config
from slurm_gpu.policy.judge import drain_fault, failures
from slurm_gpu.remediation import remedy as R
from slurm_gpu.remediation.context import Env, Outcome, Stop, finish_steps, hold, record_step, serial_of, uuid_of
from slurm_gpu.slurm import reason as _reason


def verify_enabled(cfg: Config) -> bool:
    try:
        return bool(cfg.verify.enabled)
    except KeyError:  # a stand-in config without the section
        return False


def verify_checks(env: Env, info: Any) -> str:
    """'' when the full healthcheck set passes verify_passes times in a row, spaced; else the first failure."""
    passes = int(env.get("verify_passes"))
    for n in range(passes):
        if n:
            env.sleep(float(env.get("verify_interval_s")))
        found = failures(env.checker(info))
        if found:
            return f"pass {n + 1} of {passes}: {drain_fault(found)}"
    return ""


def verify_actively(env: Env, run: Any, info: Any, fault: str) -> str:
    """The verification job through Slurm (verify.enabled; verifyjob.py): '' when it passed (the node
    is then back in service: it was resumed inside the job's reservation) or when it is off; else why not,
    the node drained again before its reservation went.  Each GPU that failed gets a row of its own
    (action verify, by serial: its lemon rule counts it)."""
    if env.dry_run or not verify_enabled(env.cfg):
        return ""
    from slurm_gpu.remediation.verifyjob import verify_node
    row = record_step(env, run, None, "verify", "started")
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
        hold(env, _reason.format_reason(text, "remediate: verify"))

    gpus = int(getattr(info, "gpus_configured", 0) or len(getattr(getattr(run, "snapshot", None), "gpus", ())) or 0)
    result = verify_node(env.cfg, env.backend, env.node, gpus, resume=resume, drain=drain, log=env.log,
                         sleep=env.sleep)
    if result.job_id:
        env.store.set_step_process(row, job_id=int(result.job_id))
    if result.ok:
        battery = "" if result.battery_s is None else f", its battery {result.battery_s:.1f} s"
        env.verified_by = f"verified; verification job {result.job_id} passed in {result.elapsed_s:.1f} s{battery}"
        finish_steps(env, [row], "resumed", env.verified_by)
        env.say("remediate-verified", job=result.job_id, elapsed_s=round(result.elapsed_s, 1))
        return ""
    if declined:
        finish_steps(env, [row], "refused", declined[0])
        raise Stop(Outcome(env.node, "verify", "left-alone", f"{env.node}: verification not started: {declined[0]}"))
    from slurm_gpu.remediation.verifyjob import failure_checks
    found = failure_checks(result)
    if result.empty or not found:
        # Nothing to run, a job the node never started, a tool that could not run: no test failed on the
        # GPUs, so no GPU is blamed and nothing escalates; the node stays drained for a human.
        finish_steps(env, [row], "failed", result.detail)
        raise Stop(Outcome(env.node, "verify", "failed", f"{env.node}: not verified: {result.detail}; the node "
                                                          "stays drained"))
    env.verify_failed = []
    for index, check, message in found:
        action, source = R.CHECK_REMEDY.get(check, (R.RESET, "verification job"))
        env.verify_failed.append(R.Remedy(check, index, uuid_of(run, index), action, source, message))
        if index is None:
            continue
        env.store.record_remediation({
            "time": env.now(), "node": env.node, "gpu_index": index, "gpu_uuid": uuid_of(run, index),
            "serial": serial_of(run, index), "fault_check": check, "fault": message[:500],
            "action": "verify", "outcome": "failed", "detail": f"verification job {result.job_id}",
            "drain_time": env.drain_time, "finished": env.now()})
    finish_steps(env, [row], "failed", result.detail)
    return f"verification job {result.job_id or '(none)'}: {result.detail}"


def clean_verification(env: Env) -> str:
    from slurm_gpu.remediation.verifyjob import clean_leftover

    def drain(text: str) -> None:
        hold(env, _reason.format_reason(text, "remediate: verify"))
    return clean_leftover(env.cfg, env.backend, env.node, drain, env.log)


def resume(env: Env, action: str, what: str) -> Outcome:
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
    finish_steps(env, env.interrupted, "resumed", "interrupted; then verified and resumed by a later run")


def verified_how(env: Env) -> str:
    return env.verified_by or "verified"
