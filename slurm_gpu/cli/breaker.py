"""`slurm-gpu breaker`: the circuit breaker for mass drains (docs/remediation.md, "The circuit breaker")."""
from __future__ import annotations

import time

import click

from slurm_gpu.cli import node_name_option


@click.group()
def breaker():
    """The circuit breaker that stops mass drains and reboots.

    Before the prolog (except its hardware gate), the epilog, healthcheck or `remediate` drains or
    reboots a node for a check, it counts the nodes of the node's partition that slurm-gpu drained
    for that check within breaker.window_s (Slurm's node list is the shared state). Once
    breaker.max_drained_pct of the partition is reached, no more drains for that check: logged,
    and slurm_gpu_breaker_open{check} is 1. It closes when the window passes or after `reset`.
    """


@breaker.command("status")
@node_name_option("The node whose partitions are judged (default: this node).")
@click.pass_obj
def status(app, node_name):
    """For each check slurm-gpu drained nodes for: drained, allowed, open or closed, for this node."""
    from slurm_gpu.cli.admin import _backend, this_node
    from slurm_gpu.hooks.breaker import read_resets
    from slurm_gpu.policy import breaker as P
    from slurm_gpu.slurm.reason import reason_check
    name, cfg = this_node(node_name), app.config
    nodes = _backend(app).nodes()
    b, resets, now = P.Breaker.from_config(cfg), read_resets(cfg), time.time()
    checks = sorted({reason_check(n.reason) for n in nodes if n.drained} - {""})
    click.echo(f"{name}: max_drained_pct {b.max_drained_pct:g}, window_s {b.window_s:g}"
               + (f", reset {', '.join(sorted(resets))}" if resets else ""))
    for check in checks:
        # xid: one line per XID code nodes are drained for (a storm is one code on many nodes)
        codes = sorted(set().union(*(P.xid_codes(check, n.reason) for n in nodes
                                     if n.drained and reason_check(n.reason) == check)))
        for fault in [f"XID {c}" for c in codes] or [""]:
            v = P.decide(b, check, name, nodes, now, resets, fault)
            click.echo(f"{check}{f' ({fault})' if fault else ''}: {'OPEN' if v.open else 'closed'}: {v.text}")
    if not checks:
        click.echo("no node is drained by slurm-gpu for a named check")


@breaker.command("reset")
@click.option("--check", "check", default="", metavar="NAME", help="Reset this check only (default: every check).")
@click.pass_obj
def reset(app, check):
    """Close the breaker on THIS node: drains before now no longer count here.

    The reset is per node (a file beside the node database, store.database's directory): nothing
    travels between nodes. Run it on every node of the partition, e.g. `pdsh -a slurm-gpu breaker
    reset`, after you have looked at the drains that opened it (`sinfo -R`).
    """
    from slurm_gpu.errors import StoreError
    from slurm_gpu.hooks.breaker import write_metric, write_reset
    from slurm_gpu.policy.breaker import ANY
    cfg = app.config
    try:
        path = write_reset(cfg, check or ANY, time.time())
    except OSError as e:
        raise StoreError(f"cannot record the breaker reset: {e.strerror or e}",
                         "run it as root; the file lives beside store.database") from None
    write_metric(cfg, {check: 0.0} if check else {}, clear_others=not check)
    click.echo(f"breaker reset for {check or 'every check'}: recorded in {path}")
