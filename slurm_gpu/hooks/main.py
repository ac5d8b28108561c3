"""Entry points of `slurm-gpu-prolog` / `slurm-gpu-epilog` (Slurm's Prolog= / Epilog=).

Exit-code contract (docs/hooks.md):
  0  the job may run (prolog) / the epilog finished (a fault found by the epilog drains the
     node with our reason and still exits 0, so Slurm does not overwrite the reason)
  1  prolog: a GPU of the job FAILed (the node is drained, Slurm requeues the job);
     epilog: a fault was found but the drain could not reach slurmctld (Slurm drains instead)
Our own errors (a bug, an unreadable config, a malformed environment, the hook deadline) exit 0
when hooks.fail_open is true (default) and 1 otherwise, always with one logged line, which
also goes to the config-independent fallback log (hooklog.FALLBACK_LOG).

A config that parses but has bad keys does not stop the hook: those keys take their defaults,
each error is logged, and the job is gated as usual (docs/hooks.md, "Configuration errors").

A hook never hangs a node: a watchdog, armed before anything is read, ends the process at the
deadline.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional, Tuple

from slurm_gpu import config as config_mod

# Deliberately no click, jinja2 or sqlite-utils here: start-up time is part of every job start.
from slurm_gpu.config import Config
from slurm_gpu.errors import ConfigError, DriverLibraryMismatch, InputError, NvmlUnavailable, SlurmGpuError
from slurm_gpu.hooks.log import HookLog, fallback_path, write_fallback

Flow = Callable[[Any, Any], int]


def _exit(code: int) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # os._exit: a daemon thread blocked inside the driver must not delay or crash interpreter shutdown.
        os._exit(code)


def _default_deadline(name: str) -> float:
    """The schema default: the watchdog runs before the config (which may hang or lie) is read."""
    return float(config_mod.SCHEMA["hooks"][f"{name}_deadline_s"].default)


def _raw(env: Mapping[str, str], key: str) -> Optional[str]:
    """An environment value for a log line before it is validated: bounded in length."""
    v = env.get(key)
    return v if v is None or len(v) <= 64 else v[:64] + "..."


class _Run:
    """One hook run: what the watchdog and the error handlers need, filled in as it is learnt."""

    def __init__(self, name: str, env: Mapping[str, str]):
        self.name = name
        self.env = env
        self.started = time.monotonic()
        self.fail_code = 0  # until the config says otherwise: fail open
        self.deadline_s = _default_deadline(name)
        self.log = HookLog(name)
        self.fallback = fallback_path(env)
        self.job: Any = _raw(env, "SLURM_JOB_ID")
        self.node: Any = _raw(env, "SLURMD_NODENAME")
        self._timer: Optional[threading.Timer] = None

    def arm(self, deadline_s: float) -> None:
        """(Re)start the watchdog so that it fires deadline_s after the hook started."""
        self.disarm()
        self.deadline_s = deadline_s
        self._timer = threading.Timer(max(0.0, deadline_s - (time.monotonic() - self.started)), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        # The log line may block too (syslog, a log.file that is a FIFO): exit shortly anyway.
        backstop = threading.Timer(2.0, _exit, (self.fail_code,))
        backstop.daemon = True
        backstop.start()
        self.fail_open("deadline-exceeded", deadline_s=self.deadline_s)
        _exit(self.fail_code)

    def configure(self, cfg: Config) -> None:
        self.log = HookLog.from_config(self.name, cfg)
        self.fail_code = 0 if cfg.hooks.fail_open else 1
        self.arm(cfg.get("hooks", f"{self.name}_deadline_s"))

    def problem(self, event: str, **fields: Any) -> None:
        """One line to the hook log and one to the fallback log; never raises."""
        fields = dict(job=self.job, node=self.node, **fields)
        try:
            self.log.error(event, **fields)
        except BaseException:  # the fallback line below still says what happened
            pass
        trouble = write_fallback(self.fallback, self.name, event, **fields)
        if trouble:
            _last_words(f"slurm-gpu {self.name} fallback-log-error error={trouble!r}")

    def fail_open(self, event: str, **fields: Any) -> int:
        self.problem(event, **fields, exit=self.fail_code)
        return self.fail_code


def _last_words(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode("utf-8", "backslashreplace"))
    except BaseException:
        pass


def _describe(e: BaseException) -> Tuple[str, str]:
    import traceback
    try:  # frames only: the header line reads like a crash to anyone grepping for "Traceback"
        trace = "".join(traceback.format_tb(e.__traceback__)).strip().replace("\n", " | ")
        return f"{type(e).__name__}: {e}", trace
    except BaseException:  # even a broken __str__ must leave a line
        return type(e).__name__, ""


def run_hook(name: str, flow: Optional[Flow] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Run the prolog or epilog flow (default: slurm_gpu.hooks.flows.<name>) and return its exit code.

    Nothing escapes: whatever is raised, even KeyboardInterrupt or SystemExit, ends as one
    logged line and the fail_open exit code.
    """
    run = _Run(name, os.environ if env is None else env)
    try:
        run.arm(run.deadline_s)
        return _run(run, flow)
    except BaseException as e:  # a bug of ours must not block or drain the cluster (fail_open)
        error, trace = _describe(e)
        return run.fail_open("internal-error", error=error, trace=trace)
    finally:
        run.disarm()


def _run(run: _Run, flow: Optional[Flow]) -> int:
    try:
        cfg, errors = config_mod.load(env=run.env, lenient=True)
    except ConfigError as e:
        # Unreadable or not TOML at all: nothing of the site's wishes is known. Fail open, loudly.
        return run.fail_open("config-error", error=e.message, hint=e.hint)
    run.configure(cfg)
    for err in errors:  # the hook goes on with the default for each of these keys
        run.problem("config-error", error=err.message, hint=f"{err.hint}; fix the file, then run `slurm-gpu check`")
    from slurm_gpu.slurm import jobenv
    try:
        job = jobenv.from_env(run.env, default_node=config_mod.node_name(), default_cluster=cfg.cluster_name)
    except InputError as e:
        return run.fail_open("bad-environment", error=e.message, hint=e.hint)
    run.job, run.node = job.job_id, job.node
    from slurm_gpu.hooks import flows
    flow = flow or getattr(flows, run.name)  # hooks/prolog.py or hooks/epilog.py, the other not imported
    try:
        return flow(job, flows.HookDeps(cfg=cfg, log=run.log, started=flows.process_start_time()))
    except NvmlUnavailable as e:
        return _nvml_unavailable(run, cfg, job, e, config_broken=bool(errors))
    except SlurmGpuError as e:
        return run.fail_open("internal-error", error=e.message, hint=e.hint)


NVML_CHECK = "nvml"  # the check a drain for an unusable driver names (reason, circuit breaker)


def _nvml_unavailable(run: _Run, cfg: Config, job: Any, e: NvmlUnavailable, config_broken: bool) -> int:
    if not job.gpus:
        run.log.error("nvml-unavailable", job=job.job_id, node=job.node, error=e.message)
        return 0
    if config_broken:
        # nvml_library may be the broken (defaulted) key: our config, not the node, may be at fault.
        return run.fail_open("nvml-unavailable", error=e.message,
                             hint="the config has errors (config-error above); fix them first")
    # A GPU job on a node whose driver does not answer cannot use its GPUs: that is a node fault.
    run.log.error("nvml-unavailable", job=job.job_id, node=job.node, error=e.message)
    from slurm_gpu.hooks.check import mismatch_metric
    from slurm_gpu.hooks.deps import HookDeps, NoGpus
    from slurm_gpu.hooks.drain import drain
    deps = HookDeps(cfg=cfg, log=run.log, reader=NoGpus(e))
    # A mismatch is named as such (its message names both versions and the remedy); any other
    # failure to start NVML keeps the generic prefix.
    fault = e.message if isinstance(e, DriverLibraryMismatch) else f"NVML unavailable: {e.message}"
    mismatch_metric(cfg, run.log, run.name, e)
    # The epilog asks the circuit breaker (a driver rollout is the storm it is for); the prolog
    # gates: a job whose GPUs the driver cannot serve never starts (policy/breaker.py HARDWARE).
    drained = drain(deps, job, run.name, fault, check=NVML_CHECK, breaker=run.name == "epilog")
    return 1 if run.name == "prolog" or not drained else 0


def _main(name: str) -> None:
    try:
        code = run_hook(name)
    except BaseException as e:  # run_hook's own handler failed: still one line, still fail open
        code = 0
        _last_words(f"slurm-gpu {name} internal-error error={type(e).__name__} exit=0")
    _exit(code)


def prolog_main() -> None:
    _main("prolog")


def epilog_main() -> None:
    _main("epilog")


def config_problem(explicit: Optional[str], err: ConfigError) -> Tuple[str, str]:
    """For `slurm-gpu healthcheck` on a config it cannot load: (one line for the admin, drain fault).

    The drain fault is "" when the hooks still gate jobs (bad keys take their defaults) and a
    text when they cannot read the file at all and fail open, i.e. GPU gating is off.
    """
    try:
        _cfg, errors = config_mod.load(explicit, lenient=True)
    except ConfigError:
        return (f"{err.message} - the prolog/epilog cannot use this file and fail open: GPU gating and accounting "
                f"are OFF on this node, draining it until the file is fixed (then run `slurm-gpu check`)",
                f"config unusable, GPU gating off: {err.message}")
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return (f"{err.message}{more} - the prolog/epilog still gate jobs, with the default for each broken key; "
            f"fix the file and run `slurm-gpu check`", "")
