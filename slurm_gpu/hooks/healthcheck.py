"""The healthcheck flow: check this node's GPUs and bring its Slurm state in line."""
from __future__ import annotations

import os
import sys
import time as _time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import DriverLibraryMismatch, ExitCode, NvmlUnavailable, SlurmGpuError
from slurm_gpu.gpu.deadline import call_with_deadline
from slurm_gpu.slurm import reason as _reason
from slurm_gpu.slurm.model import SlurmBackend


class HealthOutcome(NamedTuple):
    """What one healthcheck run found and did to the node."""

    node: str
    worst: str  # PASS / WARN / FAIL / SKIP, or TIMEOUT / ERROR when the check did not finish
    # drained | breaker-open (FAIL, drain held by the circuit breaker) | resumed | kept-drained | left-alone | none |
    # would-drain | would-resume | timeout | error | busy (the run before it on the node still runs)
    action: str
    message: str  # one line for the admin (and slurmd's log)
    reason: str = ""  # the drain reason we set, or the one we found
    results: Tuple[Any, ...] = ()
    exit_code: int = 0


def _summarise(results: Any) -> Tuple[str, str]:
    """(worst status, drain fault text) via slurm_gpu.policy.health (imported lazily: it pulls the config)."""
    from slurm_gpu.policy import health
    return health.worst(results), health.drain_fault(results)


def node_health_cycle(
    backend: SlurmBackend,
    node_name: str,
    checker: Any,
    *,
    allow_resume: bool = True,
    dry_run: bool = False,
    deadline_s: float = 45.0,
    context: str = _reason.HEALTHCHECK,
    summarise: Any = _summarise,
    clock: Any = None,
    metrics_cfg: Any = None,
    store_cfg: Any = None,
    breaker_cfg: Any = None,
) -> HealthOutcome:
    """Check this node's GPUs and bring its Slurm state in line — the `healthcheck` flow.

    With ``metrics_cfg`` (the Config; something happens only when it configures metrics), the
    node's metrics are written afterwards: the drain state always, and the GPUs' state and check
    statuses when the checker returned a policy/observed.Observed (results with their snapshot).
    A dry run, a timeout or an error writes none.  With ``store_cfg`` (the Config), an Observed
    of every GPU goes into the node database (record_observations), drain or Slurm error alike,
    and so does a driver/library mismatch (record_mismatch: `fleet versions` names the node).
    With ``breaker_cfg`` (the Config), a drain is first put to the circuit breaker (hooks/breaker.py):
    while it is open for the failing check the node stays in service (action breaker-open).
    """
    kept: List[Any] = []
    refused: List[DriverLibraryMismatch] = []  # nvmlInit's mismatch, for its metric

    def keeping(info: Any) -> Any:
        try:
            run = checker(info)
        except DriverLibraryMismatch as e:
            refused.append(e)
            raise
        kept.append(run)
        return run

    outcome: Optional[HealthOutcome] = None
    try:
        outcome = _cycle(backend, node_name, keeping, allow_resume=allow_resume, dry_run=dry_run,
                         deadline_s=deadline_s, context=context, summarise=summarise, clock=clock,
                         breaker_cfg=breaker_cfg)
    finally:
        if store_cfg is not None and not dry_run:
            _record_run(store_cfg, node_name, kept, refused, outcome)
    if metrics_cfg is not None and not dry_run:
        write_metrics(metrics_cfg, kept[0] if kept else None, outcome, mismatch=refused[0] if refused else None)
    return outcome


def _record_run(cfg: Config, node_name: str, kept: List[Any], refused: List[DriverLibraryMismatch], outcome: Any) -> None:
    """What the check read into the node database, or nvmlInit's mismatch."""
    # A check that overran may still be running: what it read is not this run's.
    if kept and getattr(outcome, "action", "") != "timeout":
        record_observations(cfg, kept[0], node_name)
    if refused:
        record_mismatch(cfg, refused[0], node_name)


def _cycle(backend: SlurmBackend, node_name: str, checker: Any, *, allow_resume: bool, dry_run: bool,
           deadline_s: float, context: str, summarise: Any, clock: Any, breaker_cfg: Any = None) -> HealthOutcome:
    """node_health_cycle without the metrics.

    checker(NodeInfo) -> results (``CheckResult`` list); it gets the node as Slurm sees it so
    it can expect the configured GPU count.  On FAIL: drain with
    ``slurm-gpu: <fault> [healthcheck]`` unless the node is already drained (whoever drained
    it — an admin's reason is never overwritten).  When healthy and our automatic drain is on
    the node: resume it (``allow_resume``; an admin's manual ``slurm-gpu drain`` is left).
    A drain that is not ours is never touched.

    The whole run stays within ``deadline_s``: the check gets what is left after keeping one
    Slurm timeout in reserve for the drain/resume; a check that overruns changes nothing.
    """
    clock = clock or _time.monotonic
    t0 = clock()
    reserve = float(getattr(backend, "timeout_s", 10.0))
    info = backend.node(node_name)
    budget = _check_budget(deadline_s, reserve, lambda: clock() - t0)
    finished, checked, err = call_with_deadline(lambda: list(checker(info)), budget, "slurm-gpu healthcheck")
    if not finished:
        return HealthOutcome(node_name, "TIMEOUT", "timeout",
                             f"{node_name}: GPU check did not finish within {budget:.0f} s (deadline {deadline_s:g} s); "
                             f"node state left unchanged ({info.state})",
                             exit_code=int(ExitCode.UNHEALTHY))
    results: List[Any] = checked or []
    verdict = _verdict(node_name, info, results, err, summarise)
    if isinstance(verdict, HealthOutcome):
        return verdict
    worst, fault = verdict
    if worst == "FAIL":
        return _drain_unhealthy(backend, info, node_name, fault, context, tuple(results), dry_run, breaker_cfg)
    return _settle_healthy(backend, info, node_name, worst, tuple(results), allow_resume, dry_run)


def _check_budget(deadline_s: float, reserve_s: float, elapsed: Callable[[], float]) -> float:
    """Seconds the GPU check may take: what is left of the deadline after keeping one Slurm
    timeout in reserve for the drain/resume."""
    budget = deadline_s - elapsed() - reserve_s
    if budget < 1.0:
        budget = max(1.0, deadline_s - elapsed()) / 2  # tiny deadlines: split what is left
    return budget


def _verdict(node_name: str, info: Any, results: List[Any], err: Any, summarise: Any) -> Any:
    """(worst status, drain fault) of a finished check, or the outcome of one that failed."""
    if isinstance(err, NvmlUnavailable):
        if info.gpus_configured <= 0:
            return HealthOutcome(node_name, "SKIP", "none",
                                 f"{node_name}: no GPUs configured in Slurm and no NVIDIA driver: nothing to check",
                                 exit_code=int(ExitCode.OK))
        if isinstance(err, DriverLibraryMismatch):
            return "FAIL", err.message  # names both versions and the remedy
        return "FAIL", f"NVIDIA driver unusable ({info.gpus_configured} GPUs configured): {err.message}"
    if isinstance(err, SlurmGpuError):
        return HealthOutcome(node_name, "ERROR", "error", f"{node_name}: check failed: {err.message}; node state left unchanged",
                             exit_code=int(err.exit_code))
    if err is not None:
        return HealthOutcome(node_name, "ERROR", "error",
                             f"{node_name}: internal error in the GPU check: {type(err).__name__}: {err}; "
                             "node state left unchanged",
                             exit_code=int(ExitCode.UNHEALTHY))
    return summarise(results)


def failing_check(results: Any) -> str:
    """The check a FAIL drains for (the first FAIL's); 'nvml' when NVML could not start (no results)."""
    fails = [r for r in results if getattr(r, "status", "") == "FAIL"]
    return str(getattr(fails[0], "check", "") or "") if fails else "nvml"


def _drain_unhealthy(backend: SlurmBackend, info: Any, node_name: str, fault: str, context: str,
                     res: Tuple[Any, ...], dry_run: bool, breaker_cfg: Any = None) -> HealthOutcome:
    """FAIL: drain with our reason, unless the node is already drained (whoever drained it) or the
    circuit breaker is open for the check."""
    from slurm_gpu.hooks import drain as D
    check = failing_check(res)
    # hooks/drain.py: the one drain routine (decision, breaker before and after; a failed drain raises
    # with its drain_reason, which the caller records)
    a = D.apply_drain(backend, info, node_name, _reason.format_reason(fault, context, check=check), check,
                      breaker_cfg=breaker_cfg, log=_breaker_log(breaker_cfg) if breaker_cfg is not None else None,
                      now=_time.time(), dry_run=dry_run)
    unhealthy = int(ExitCode.UNHEALTHY)
    if a.outcome == D.KEPT:
        whose = "slurm-gpu" if a.whose == "slurm-gpu" else (info.reason_user or "someone else")
        return HealthOutcome(node_name, "FAIL", "kept-drained",
                             f"{node_name}: FAIL: {fault}; already {info.state} by {whose} "
                             f"({info.reason or 'no reason'}), reason left as is",
                             info.reason, res, unhealthy)
    if a.outcome == D.WOULD_DRAIN:
        return HealthOutcome(node_name, "FAIL", "would-drain", f"{node_name}: FAIL: would drain: {a.reason}", a.reason,
                             res, unhealthy)
    if a.outcome in (D.BREAKER, D.WITHDRAWN):
        said = "not drained" if a.outcome == D.BREAKER else "drain withdrawn"
        return HealthOutcome(node_name, "FAIL", "breaker-open", f"{node_name}: FAIL: {fault}; {said}: {a.why}",
                             "", res, unhealthy)
    return HealthOutcome(node_name, "FAIL", "drained", f"{node_name}: FAIL: drained: {a.reason}", a.reason, res,
                         unhealthy)


def _breaker_log(cfg: Config) -> Any:
    try:
        from slurm_gpu.hooks.log import HookLog
        return HookLog.from_config("healthcheck", cfg)
    except Exception:  # the log itself is broken: the outcome's message still says it
        return None


def _settle_healthy(backend: SlurmBackend, info: Any, node_name: str, worst: str, res: Tuple[Any, ...],
                    allow_resume: bool, dry_run: bool) -> HealthOutcome:
    """PASS / WARN / SKIP: resume our own automatic drain; leave anyone else's alone."""
    if info.drained and _reason.is_ours(info.reason):
        if not allow_resume:
            return HealthOutcome(node_name, worst, "kept-drained",
                                 f"{node_name}: {worst}: healthy, drain left in place ({info.reason})", info.reason, res)
        if not _reason.auto_resumable(info.reason):
            return HealthOutcome(node_name, worst, "kept-drained",
                                 f"{node_name}: {worst}: healthy, but the drain is held by {_reason.owner(info.reason)}, "
                                 f"left in place ({info.reason}); `slurm-gpu resume {node_name}` lifts it", info.reason, res)
        if dry_run:
            return HealthOutcome(node_name, worst, "would-resume", f"{node_name}: {worst}: would resume (was: {info.reason})",
                                 info.reason, res)
        backend.resume(node_name)
        return HealthOutcome(node_name, worst, "resumed", f"{node_name}: {worst}: healthy again, resumed (was: {info.reason})",
                             info.reason, res)
    if info.drained or info.down:
        return HealthOutcome(node_name, worst, "left-alone",
                             f"{node_name}: {worst}: healthy; {info.state} by {info.reason_user or 'someone else'} "
                             f"({info.reason or 'no reason'}) is not ours, left alone", info.reason, res)
    return HealthOutcome(node_name, worst, "none", f"{node_name}: {worst}: healthy ({info.state})", "", res)


def record_observations(cfg: Config, run: Any, node: str) -> None:
    """The fleet's history from a healthcheck that read every GPU (schema v6, store/observations.py):
    each GPU's inventory row when anything in it changed or inventory.record_every_s has passed,
    and every dated XID it read that the database does not hold yet; `db push` ships them.
    Never raises: a database problem is one log line and changes neither verdict nor exit code."""
    snap = getattr(run, "snapshot", None)
    if snap is None or not getattr(run, "all_gpus", False):
        return
    try:
        from slurm_gpu.store import observations as obs
        from slurm_gpu.store.node import Store
        # Best effort: a database busy with the hooks' writes must not hold the run up for long
        # (Slurm kills HealthCheckProgram after 60 s); the next run records what this one missed.
        store = Store(cfg.path_value("store", "database"), cfg.path_value("store", "spool_dir"),
                      min(cfg.store.busy_timeout_s, 2.0))
        try:
            store.record_inventory(obs.inventory_rows(snap, node, snap.taken_at), cfg.inventory.record_every_s,
                                   _time.time())
            store.record_xids(obs.xid_rows(getattr(run, "xid_events", ()), snap, node))
        finally:
            store.close()
    except Exception as e:
        _not_recorded(cfg, node, e)


def mismatch_event(e: DriverLibraryMismatch, node: str, now: float, since: Any) -> Any:
    """The health event of nvmlInit's LIB_RM_VERSION_MISMATCH: one per episode, not one per run.
    Its key holds both versions and the time of the node's newest inventory row (`since`): the
    same mismatch seen again keeps its first time; after a healthy read (a new inventory row)
    it is a new event.  The message names both versions (errors.mismatch_versions reads them)."""
    from slurm_gpu.store.apply import MISMATCH_CHECK
    from slurm_gpu.store.record import HealthEvent
    return HealthEvent(time=now, node=node, source="healthcheck", job_id=None, gpu_index=None, gpu_uuid=None,
                       check_name=MISMATCH_CHECK, status="FAIL", message=e.message,
                       key=f"{e.kernel_version}|{e.library_version}|after {since!r}")


def record_mismatch(cfg: Config, e: DriverLibraryMismatch, node: str) -> None:
    """The mismatch as a health event in the node database (`db push` ships it; `fleet versions`
    lists the node while the event is newer than its inventory).  Never raises."""
    try:
        from slurm_gpu.store.node import Store
        from slurm_gpu.store.record import Health
        store = Store(cfg.path_value("store", "database"), cfg.path_value("store", "spool_dir"),
                      min(cfg.store.busy_timeout_s, 2.0))
        try:
            since: Any
            try:
                since = store.latest_inventory_time(node)
            except Exception:  # unreadable: the event is still written (spooled if need be)
                since = "unknown"
            store.write(Health([mismatch_event(e, node, _time.time(), since)]))
        finally:
            store.close()
    except Exception as err:
        _not_recorded(cfg, node, err, "mismatch-not-recorded")


def _not_recorded(cfg: Config, node: str, e: Exception, event: str = "inventory-not-recorded") -> None:
    from slurm_gpu.store.diagnose import describe_error
    error = describe_error(e)
    hint = "the next healthcheck tries again; `slurm-gpu db check` looks at the database"
    try:
        from slurm_gpu.hooks.log import HookLog
        HookLog.from_config("healthcheck", cfg).error(event, node=node, error=error, hint=hint)
    except Exception:  # the log itself is broken: stderr, which slurmd keeps
        sys.stderr.write(f"slurm-gpu healthcheck {event} node={node} error={error!r}\n")


# What the node's drain state is after each action, for slurm_gpu_node_drained (metrics/node.py).
_CLEARED = ("resumed", "left-alone", "none", "breaker-open")


def _drain_state(outcome: HealthOutcome) -> Any:
    """(state, check) for NodeUpdate.drain, or None when the outcome says nothing sure.  A FAIL
    without results is a driver that cannot be used at all: the GPUs do not respond."""
    fails = [r for r in outcome.results if getattr(r, "status", "") == "FAIL"]
    check = fails[0].check if fails else ("responsive" if outcome.worst == "FAIL" else "")
    if outcome.action == "drained":
        return ("set", check)
    if outcome.action == "kept-drained":
        return ("ours", check) if _reason.is_ours(outcome.reason) else ("clear", "")
    if outcome.action in _CLEARED:
        return ("clear", "")
    return None


def write_metrics(cfg: Config, run: Any, outcome: HealthOutcome, now: Any = None, mismatch: Any = None) -> None:
    """The node file after a healthcheck: the drain state, the spool and the push backlog, and
    with an Observed (run) every GPU and every check; with a DriverLibraryMismatch (mismatch)
    slurm_gpu_driver_library_mismatch with both versions.  Never raises; nothing when the run did
    not finish or metrics are off."""
    state = _drain_state(outcome)
    if state is None:
        return
    try:
        from slurm_gpu.config import metrics_enabled
        if not metrics_enabled(cfg):
            return
        from slurm_gpu.hooks.log import HookLog
        from slurm_gpu.metrics import hookwrite
        from slurm_gpu.metrics.storestats import store_samples
        from slurm_gpu.policy.observed import Observed
        obs = Observed()
        if run is not None:  # what the checker returned: an Observed (check_node), or bare results
            obs = Observed(run, getattr(run, "snapshot", None), getattr(run, "xid_events", ()),
                           getattr(run, "all_gpus", False))
        obs.drain = state
        if mismatch is not None:
            obs.mismatch = (mismatch.kernel_version, mismatch.library_version)
        hookwrite.healthcheck(cfg, HookLog.from_config("healthcheck", cfg), outcome.node, obs,
                              _time.time() if now is None else now, extra=lambda: store_samples(cfg))
    except Exception as e:  # metrics never change the healthcheck's verdict or exit code
        sys.stderr.write(f"slurm-gpu healthcheck metrics-failed error={type(e).__name__}: {e}\n")


# --- `slurm-gpu healthcheck` around the cycle: the checker, the drains' record, remediation, a broken
# config (cli/admin.py only prints what these decide)


def default_checker(cfg: Config) -> Callable[[Any], List[Any]]:
    """The real GPU check: hooks/check.check_node, expecting the GPU count Slurm has configured.

    When Slurm has no GPU of the node allocated, every GPU must be idle: leftover processes
    and leaked memory count (a prolog drain for leaked memory is then not resumed while the
    memory is still held).  With jobs running, those two checks are left out.
    """
    def check(info: Any) -> List[Any]:
        from slurm_gpu.hooks.check import check_node
        from slurm_gpu.slurm.gpumap import configured_gpus
        idle = True if getattr(info, "gpus_allocated", 1) == 0 else None
        # Slurm counts MIG slices as GPUs; the driver counts physical GPUs: take the number of
        # GPUs gres.conf names when it can be read.
        conf = os.environ.get("SLURM_CONF") or cfg.slurm_conf
        expected = configured_gpus(conf, info.name) or info.gpus_configured or None
        _snap, results = check_node(cfg, expected_count=expected, idle=idle)
        return results
    return check


def record_drains(cfg: Config, drains: Sequence[Any]) -> str:
    """Drains (store/record.Drain) into this node's database, like the hooks' own; '' when written,
    else the warning line.  A drain of several nodes run from one machine is recorded in that
    machine's database (store.database).  Never raises: the drain itself never depends on this."""
    if not drains:
        return ""
    try:
        from slurm_gpu.store.node import Store
        from slurm_gpu.store.record import Drains
        st = Store.from_config(cfg)
        written = st.write(Drains(list(drains)), ingest=False)
    except Exception as e:
        msg = e.message if isinstance(e, SlurmGpuError) else f"{type(e).__name__}: {e}"
        return f"slurm-gpu: warning: drain not recorded in the node database: {msg}"
    if not written.in_database:
        return (f"slurm-gpu: warning: drain record kept in {written.path} ({st.unavailable or 'refused'}); "
                "`slurm-gpu db ingest` writes it to the database")
    return ""


def healthcheck_cycle(cfg: Config, backend: SlurmBackend, name: str, checker: Any, *, allow_resume: bool, dry_run: bool,
                      deadline_s: float, context: str, log: Any, warn: Callable[[str], None]) -> HealthOutcome:
    """One cycle of `healthcheck` (or `drain --unhealthy`, context) and the record of the drain it tried.

    Only drains tried are recorded: a node found already drained is seen again at every
    HealthCheckInterval, and a row each time would bury the drains that happened.  A Slurm error
    is logged and raised (the CLI prints it), its failed drain recorded first; `warn` gets the line
    of a record that could not be written."""
    from slurm_gpu.store.record import DRAINED, FAILED, drain
    try:
        outcome = node_health_cycle(backend, name, checker, allow_resume=allow_resume, dry_run=dry_run,
                                    deadline_s=deadline_s, context=_reason_context(context), metrics_cfg=cfg,
                                    store_cfg=cfg, breaker_cfg=cfg if context == "healthcheck" else None)
    except SlurmGpuError as e:
        log.error("slurm-error", node=name, error=e.message)
        drain_reason = getattr(e, "drain_reason", None)
        if drain_reason:
            _warn_unless_recorded(cfg, [drain(name, context, drain_reason, FAILED, _time.time())], warn)
        raise
    if outcome.action == "drained":
        _warn_unless_recorded(cfg, [drain(name, context, outcome.reason, DRAINED, _time.time())], warn)
    return outcome


def _reason_context(context: str) -> str:
    return _reason.HEALTHCHECK if context == "healthcheck" else context


def _warn_unless_recorded(cfg: Config, drains: Sequence[Any], warn: Callable[[str], None]) -> None:
    line = record_drains(cfg, drains)
    if line:
        warn(line)


# How long a healthcheck waits for the run before it on the same node (at most a quarter of its deadline).
TURN_WAIT_MAX_S = 10.0


@contextmanager
def taking_turns(cfg: Config, node: str, deadline_s: float, log: Any) -> Iterator[Optional[float]]:
    """The runs of one node's healthcheck (and `drain --unhealthy`) take turns, under the node's lock
    (hooks.healthcheck_lock_file, %n: the node checked).  slurmd starts HealthCheckProgram every
    HealthCheckInterval whether or not the last run ended; two at once would act on readings taken
    in the other order, so a slow run could resume a node on a healthy reading older than the
    fault a later run found and drained for.  Yields the seconds left of the deadline once this
    run holds the lock, or None when the run before still holds it after TURN_WAIT_MAX_S (that run
    acts; this one leaves).  A lock that cannot be opened is logged and the run goes on unlocked:
    a broken /run must not keep a faulty GPU in service."""
    from slurm_gpu.hooks.nodelock import node_lock
    path = str(cfg.hooks.healthcheck_lock_file).replace("%n", node)
    wait_s = min(TURN_WAIT_MAX_S, deadline_s / 4)
    t0 = _time.monotonic()
    try:
        lock = node_lock(path, wait_s)
        held = lock.__enter__()
    except OSError as e:
        log.warning("healthcheck-lock-unavailable", node=node, path=path, error=e.strerror or str(e),
                    hint="runs of this node's healthcheck may overlap; check hooks.healthcheck_lock_file")
        yield deadline_s
        return
    try:
        yield deadline_s - (_time.monotonic() - t0) if held else None
    finally:
        lock.__exit__(None, None, None)


def busy_outcome(node: str) -> HealthOutcome:
    """The run left because the one before it on this node still runs: it changes nothing."""
    return HealthOutcome(node, "SKIP", "busy", f"{node}: the healthcheck before this one still runs; it decides")


def remediates(cfg: Config, outcome: HealthOutcome, dry_run: bool, checker: Any) -> bool:
    """healthcheck runs `remediate` after its own cycle when remediation.enabled, on a node it left drained by us."""
    return (not dry_run and checker is None and cfg.remediation.enabled
            and outcome.action in ("drained", "kept-drained", "left-alone") and bool(outcome.reason))


def broken_config_cycle(config_path: Optional[str], e: Any, name: str, *, dry_run: bool, deadline_s: float,
                        context: str, say: Callable[[str], None]) -> Tuple[str, str, str]:
    """`healthcheck` on a config it cannot load: `say` gets the admin's error line first; returns
    (that line, what the drain cycle said or "", why it could not drain or "").  A drain only
    while the hooks here run ungated (docs/hooks.md, "Configuration errors"): the file is then
    unusable, and Slurm is reached with the default settings."""
    from slurm_gpu.config import defaults
    from slurm_gpu.hooks.log import fallback_path, write_fallback
    from slurm_gpu.hooks.main import config_problem
    from slurm_gpu.policy.health import CheckResult
    from slurm_gpu.slurm.backend import get_backend
    line, fault = config_problem(config_path, e)
    say(f"slurm-gpu: error: {line}")
    write_fallback(fallback_path(), "healthcheck", "config-error", node=name, error=e.message, hint=e.hint)
    if not fault:
        return line, "", ""
    try:
        outcome = node_health_cycle(get_backend(defaults()), name, lambda info: [CheckResult("config", "FAIL", None, "", fault)],
                                    allow_resume=False, dry_run=dry_run, deadline_s=deadline_s,
                                    context=_reason_context(context))
    except SlurmGpuError as se:
        return line, "", f"could not drain: {se.message}"
    return line, outcome.message, ""
