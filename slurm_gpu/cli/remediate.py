"""`slurm-gpu remediate`: reset, reboot or RMA a node slurm-gpu drained (docs/remediation.md)."""
from __future__ import annotations

import os
import sys

import click

from slurm_gpu.cli import dry_run_option, node_name_option, nvml_lib_option

# Exit codes (docs/exit-codes.md): 0 resumed, healthy or nothing to do; 1 the node stays drained
# (RMA, budget spent, manual fault, failed verification, reboot requested and under way).
_STAYS_DRAINED = ("rma", "refused", "breaker-open", "failed", "requested", "waiting", "busy")


@click.command()
@node_name_option("This node's Slurm name (default: $SLURMD_NODENAME, else the short host name).")
@dry_run_option("Say which step would be taken; change nothing.")
@nvml_lib_option
@click.pass_obj
def remediate(app, node_name, dry_run):
    """Close the loop on this node when slurm-gpu drained it: reset, reboot or RMA.

    Acts only when the drain reason is slurm-gpu's own automatic one and the node is idle (no
    job per Slurm, no process on any GPU), under a per-node lock. The step comes from the fault
    -> remedy map (docs/hooks.md): a reset runs remediation.reset_command, re-applies
    persistence, accounting and clocks, then verifies (remediation.verify_passes healthchecks in
    a row) and resumes; a failed reset or verification escalates to a reboot through Slurm
    (`scontrol reboot ASAP nextstate=DOWN`), and a fault a reboot did not cure to an RMA drain
    (`slurm-gpu: RMA: GPU <serial> ...`). Budgets: remediation.max_resets_per_gpu_per_day,
    max_reboots_per_node_per_day, lemon_window_days; no reboot while the circuit breaker is open
    for reboots (`slurm-gpu breaker`). Every attempt is a row in the node
    database, shipped by `db push` (`slurm-gpu fleet remediation`); with central.url a GPU's
    budgets and lemon rule count its attempts on every node (read when it acts, within
    central.timeout_s; a server down means this node's rows only).

    Crash-safe: every run reads the node's open steps first (the node database); a reset
    outlives a killed run while holding the node's lock, and a step nobody carries out any more
    is closed `interrupted`. Times are slurmctld's: a node whose clock is more than
    remediation.clock_slack_s off neither resets, reboots nor resumes. A drain is ours only by its exact
    context (`[prolog job N]`, `[healthcheck]`, `[remediate: ...]`), never by the `slurm-gpu:`
    prefix. With verify.enabled a verification job through Slurm precedes every resume.
    --node-name names the node for every %n (lock, database, log).

    \b
    Exit codes: 0 resumed, healthy or nothing for us to do; 1 the node stays drained (RMA,
    budget spent, failed verification, reboot requested, busy, clock off); 2 usage/config error,
    an unusable node database, not root; 4 Slurm error.
    """
    from slurm_gpu.cli.admin import _backend, _log, this_node
    from slurm_gpu.errors import SlurmGpuError
    from slurm_gpu.hooks.healthcheck import default_checker
    from slurm_gpu.remediation.engine import run_on_node
    name = this_node(node_name)
    if os.geteuid() != 0 and not dry_run:
        raise SlurmGpuError("remediate must run as root: it resets GPUs and changes the node in Slurm",
                            "run it with sudo, from a root timer, or let HealthCheckProgram run it (remediation.enabled); "
                            "-n shows the plan as any user")
    cfg = app.config.for_node(name)
    log = _log(app, "remediate", name)
    outcome = run_on_node(cfg, _backend(app), name, default_checker(cfg), log=log, dry_run=dry_run)
    log.info("remediate", node=name, action=outcome.action, outcome=outcome.outcome, message=outcome.message)
    click.echo(outcome.message)
    sys.exit(1 if outcome.outcome in _STAYS_DRAINED else 0)
