"""Entry points of `slurm-gpu-prolog` / `slurm-gpu-epilog` (Slurm's Prolog= / Epilog=).

Exit-code contract (docs/hooks.md):
  0  the job may run (prolog) / the epilog finished (a fault found by the epilog drains the
     node with our reason and still exits 0, so Slurm does not overwrite the reason)
  1  prolog: a GPU of the job FAILed (the node is drained, Slurm requeues the job);
     epilog: a fault was found but the drain could not reach slurmctld (Slurm drains instead)
Our own errors (a bug, a broken config, a malformed environment, the hook deadline) exit 0
when hooks.fail_open is true (default) and 1 otherwise, always with one logged line.

A hook never hangs a node: a watchdog ends the process at the configured deadline.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable

# Deliberately no click, jinja2 or sqlite-utils here: start-up time is part of every job start.
from . import config as config_mod
from .errors import ConfigError, InputError, NvmlUnavailable, SlurmGpuError
from .hooklog import HookLog


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a daemon thread blocked inside the driver must not delay or crash interpreter shutdown.
    os._exit(code)


def run_hook(name: str, flow: Callable, env=None) -> int:
    from . import hooks, jobenv

    env = os.environ if env is None else env
    try:
        cfg = config_mod.load(env=env)
    except ConfigError as e:
        # Without a config we cannot know the site's wishes: fail open (the default) and say why.
        log = HookLog(name)
        log.error("config-error", error=e.message, hint=e.hint)
        return 0
    log = HookLog.from_config(name, cfg)
    fail_code = 0 if cfg.get("hooks", "fail_open") else 1
    deadline = cfg.get("hooks", f"{name}_deadline_s")

    def on_deadline() -> None:
        log.error("deadline-exceeded", deadline_s=deadline, job=env.get("SLURM_JOB_ID"),
                  node=env.get("SLURMD_NODENAME"), exit=fail_code)
        _exit(fail_code)

    watchdog = threading.Timer(deadline, on_deadline)
    watchdog.daemon = True
    watchdog.start()
    try:
        job = jobenv.from_env(env, default_node=config_mod.node_name(), default_cluster=cfg.get("", "cluster_name"))
    except InputError as e:
        log.error("bad-environment", error=e.message, hint=e.hint, job=env.get("SLURM_JOB_ID"), exit=fail_code)
        return fail_code
    try:
        deps = hooks.HookDeps(cfg=cfg, log=log)
        return flow(job, deps)
    except NvmlUnavailable as e:
        # A GPU job on a node whose driver does not answer cannot use its GPUs: that is a node fault.
        log.error("nvml-unavailable", job=job.job_id, node=job.node, error=e.message)
        if not job.gpus:
            return 0
        deps = hooks.HookDeps(cfg=cfg, log=log, reader=object())
        drained = hooks._drain(deps, job, name, f"NVML unavailable: {e.message}")
        return 1 if name == "prolog" or not drained else 0
    except SlurmGpuError as e:
        log.error("internal-error", job=job.job_id, node=job.node, error=e.message, hint=e.hint, exit=fail_code)
        return fail_code
    except Exception as e:  # a bug of ours must not block or drain the cluster (fail_open)
        import traceback
        tb = traceback.format_exc().strip().replace("\n", " | ")
        log.error("internal-error", job=job.job_id, node=job.node, error=f"{type(e).__name__}: {e}", trace=tb,
                  exit=fail_code)
        return fail_code
    finally:
        watchdog.cancel()


def prolog_main() -> None:
    from .hooks import prolog
    _exit(run_hook("prolog", prolog))


def epilog_main() -> None:
    from .hooks import epilog
    _exit(run_hook("epilog", epilog))
