"""`slurm-gpu efficiency`: idle GPUs found while the job runs (docs/efficiency.md)."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

import click

from slurm_gpu.cli import dry_run_option, node_name_option, nvml_lib_option, output_options

_ROOT_HINT = "run it from the root timer (deploy/systemd/slurm-gpu-efficiency.timer) or with sudo"


@click.group("efficiency", context_settings={"help_option_names": ["-h", "--help"]})
def efficiency() -> None:
    """Idle GPUs of running jobs: sample them, apply the site's policy, list what was done.

    Each GPU node runs `slurm-gpu efficiency run` every minute (a systemd timer): it samples the
    GPUs of the jobs running there into the node database, then applies the [efficiency] policy:
    a mail to the user of a job whose GPUs stay idle, and where the site wants it a cancel through
    Slurm. See docs/efficiency.md.
    """


def _setup(app: Any, node_name: Optional[str], dry_run: bool, what: str):
    from slurm_gpu.cli.admin import _log, this_node
    from slurm_gpu.errors import SlurmGpuError
    from slurm_gpu.store.node import Store
    name = this_node(node_name)
    if os.geteuid() != 0 and not dry_run:
        raise SlurmGpuError(f"efficiency {what} must run as root: it writes the node database"
                            + (" and cancels jobs through Slurm" if what != "sample" else ""),
                            _ROOT_HINT + ("; --dry-run shows the decisions as any user" if what != "sample" else ""))
    cfg = app.config.for_node(name)
    return name, cfg, Store.from_config(cfg), _log(app, "efficiency", name)


def _sample(cfg: Any, store: Any, name: str, log: Any) -> int:
    """One sample run; returns the exit status (0, or 3 when NVML could not be read)."""
    from slurm_gpu.efficiency.sample import sample
    from slurm_gpu.errors import NvmlUnavailable
    from slurm_gpu.hooks.check import make_reader
    reader = make_reader(cfg)
    try:
        run = sample(cfg, store.connect(), reader, node=name)
    except NvmlUnavailable as e:
        log.error("sample-failed", error=e.message, hint=e.hint)
        click.echo(f"slurm-gpu: error: {e.message}", err=True)
        if e.hint:
            click.echo(f"hint: {e.hint}", err=True)
        return int(e.exit_code)
    finally:
        reader.close()
    jobs = len({(r["cluster"], r["job_id"], r["restart_count"]) for r in run.rows})
    log.info("sample", node=name, gpus=len(run.rows), jobs=jobs, merged=run.counts["merged"] or None,
             deleted=run.counts["deleted"] or None, missing="; ".join(run.missing) or None)
    if run.problem:
        log.warning("metrics-failed", error=run.problem)
        click.echo(f"slurm-gpu: warning: {run.problem}", err=True)
    click.echo(f"sampled {len(run.rows)} GPUs of {jobs} running jobs on {name}"
               + (f"; not read: {'; '.join(run.missing)}" if run.missing else ""))
    return 1 if run.missing else 0


def _enforce(cfg: Any, store: Any, name: str, log: Any, dry_run: bool, db: Optional[str] = None,
             password_file: Optional[str] = None) -> int:
    from slurm_gpu.efficiency.enforce import NoJobs, enforce
    from slurm_gpu.efficiency.sample import booted_at
    from slurm_gpu.slurm.cli_backend import CliBackend
    conn, backend = store.connect(), CliBackend(cfg)
    if db:
        from slurm_gpu.central.server import Central
        from slurm_gpu.efficiency.central import CentralSource, cluster_of
        from slurm_gpu.efficiency.policy import Policy
        cluster = cluster_of(cfg)
        with Central.from_config(cfg, None if db == "central" else db, password_file) as central:
            source = CentralSource(central, conn, cluster, Policy.from_config(cfg).max_gap_s)
            outcomes = enforce(cfg, conn, backend, dry_run=dry_run, node=name, log=log.info, source=source,
                               only_multi_node=cfg.efficiency.decide_on == "node")
    else:
        from slurm_gpu.hooks.check import make_reader
        reader = make_reader(cfg)  # the last look before a cancel (NVML starts only if one is due)
        try:
            outcomes = enforce(cfg, conn, backend, booted_at=booted_at(), dry_run=dry_run, node=name, log=log.info,
                               source=NoJobs() if cfg.efficiency.decide_on == "central" else None, reader=reader)
        finally:
            reader.close()
    for o in outcomes:
        if o.stage or o.error or dry_run:
            click.echo(o.line())
    return 1 if any(o.error or o.mail == "failed" or o.cancel == "failed" for o in outcomes) else 0


@efficiency.command("sample")
@node_name_option("This node's Slurm name (default: $SLURMD_NODENAME, else the short host name).")
@nvml_lib_option
@click.pass_obj
def sample_cmd(app: Any, node_name: Optional[str]) -> None:
    """Sample the GPUs of the jobs running on this node into its database.

    The running jobs and their GPUs are the ones the prolog recorded (by GPU UUID) that no epilog
    has ended, started since the node booted. Per GPU: utilisation, memory used, energy since the
    job started; per MIG slice: memory used. Samples older than efficiency.samples_fine_s are merged
    into 10-minute rows; the table is bounded by samples_keep_days and samples_max_mb.

    \b
    Exit codes: 0 sampled; 1 a running job's GPU could not be read; 2 usage/config error;
    3 NVML unavailable; 5 an unusable node database.
    """
    name, cfg, store, log = _setup(app, node_name, False, "sample")
    sys.exit(_sample(cfg, store, name, log))


@efficiency.command("enforce")
@node_name_option("This host's name: %n in the config, and who decided (default: $SLURMD_NODENAME, else the short host name).")
@click.option("--db", metavar="central|URL", default=None,
              help="Judge the jobs from the central server's samples ('central': central.url; or mysql://USER@HOST/DB, "
                   "a reading account): the jobs on several nodes, or every job with efficiency.decide_on = 'central'.")
@click.option("--password-file", metavar="PATH", default=None,
              help="With --db URL: the file with its password (default: central.password_file).")
@dry_run_option("Print the decisions, the mails' subjects and the cancels; write, mail and cancel nothing.")
@click.pass_obj
def enforce_cmd(app: Any, node_name: Optional[str], db: Optional[str], password_file: Optional[str],
                dry_run: bool) -> None:
    """Apply the [efficiency] policy to the running jobs.

    On a GPU node (no --db): the jobs that run on this node alone, from its samples. With --db
    (a timer on a controller or login node): the jobs whose samples are on the central server,
    each judged on all its nodes' samples. A mail when all of a job's GPUs stayed idle for
    notify_after_s (advice when only some did), a cancel through Slurm after cancel_after_s if
    its user was warned in time and it is not exempt. Each decision is recorded in this host's
    database before it is acted on, once per job and stage; a mail that failed is tried again by
    later runs every mail_retry_s.

    \b
    Exit codes: 0 done (or nothing due); 1 a mail or a cancel failed (recorded, tried again), or
    Slurm could not be asked about a job; 2 usage/config error; 5 the database or the central
    server could not be used.
    """
    name, cfg, store, log = _setup(app, node_name, dry_run, "enforce")
    sys.exit(_enforce(cfg, store, name, log, dry_run, db, password_file))


@efficiency.command("run")
@node_name_option("This node's Slurm name (default: $SLURMD_NODENAME, else the short host name).")
@dry_run_option("Sample as usual; print the policy's decisions and act on none.")
@nvml_lib_option
@click.pass_obj
def run_cmd(app: Any, node_name: Optional[str], dry_run: bool) -> None:
    """`sample`, then `enforce`: what the timer runs on each GPU node every minute.

    The policy runs even when sampling failed (a GPU not read leaves a gap: its job is not judged),
    so that mails waiting for a retry still go out; and sampling goes on under a policy that cannot
    apply (exit 2 after the samples are written). Exit status: the worse of the two.
    """
    name, cfg, store, log = _setup(app, node_name, False, "run")
    code = _sample(cfg, store, name, log)
    sys.exit(max(code, _enforce(cfg, store, name, log, dry_run)))


_ACTION_COLUMNS = ("time", "job_id", "user", "account", "partition", "stage", "idle_s", "gpus", "idle_gpus",
                   "mail_state", "mail_to", "cancel_state", "decided_on")


@efficiency.command("actions")
@click.option("--since", default="now-7days", show_default=True, metavar="TIME",
              help="Only actions decided since then, as sacct -S takes it: now-24hours, 2026-12-01, ...")
@click.option("--stage", "stages", multiple=True, type=click.Choice(["advice", "notify", "cancel"]),
              help="Only these stages (repeatable).")
@click.option("--db", "database", metavar="PATH", help="Node database to read (default: store.database).")
@node_name_option("This node's Slurm name, for %n in store.database (default: $SLURMD_NODENAME, else the short host name).")
@output_options(["table", "json", "csv"])
@click.pass_obj
def actions_cmd(app: Any, since: str, stages: Any, database: Optional[str], node_name: Optional[str], fmt: str) -> None:
    """What the idle policy did on this node: every advice, warning and cancel, with its mail's fate.

    JSON adds each decision's evidence (per GPU: idle time, highest utilisation and memory used,
    energy so far). To undo a decision there is nothing to roll back: a cancelled job is resubmitted
    by its user; an admin who wants a job left alone exempts its account, partition, QOS or user.
    """
    import json

    from slurm_gpu.cli.admin import this_node
    from slurm_gpu.render import render
    from slurm_gpu.report.timespec import parse_time
    from slurm_gpu.store import samples as Q
    from slurm_gpu.store.node import Store
    cfg = app.config.for_node(this_node(node_name))
    t = parse_time(since, now_s=time.time(), option="--since")
    store = Store.from_config(cfg, database=database)
    rows = Q.actions(store.connect(), since=t, stages=stages)
    for r in rows:
        r["evidence"] = json.loads(r["evidence"]) if r.get("evidence") else None
        r.pop("message", None)
    if fmt == "table":
        for r in rows:
            r["time"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(r["time"]))
            r["idle_s"] = None if r["idle_s"] is None else round(r["idle_s"])
        click.echo(render(rows, _ACTION_COLUMNS, "table") if rows else "no actions")
        return
    cols = _ACTION_COLUMNS + ("restart_count", "cluster", "idle_since", "mail_time", "mail_tries", "mail_error",
                              "cancel_error") + (("evidence",) if fmt == "json" else ())
    click.echo(render(rows, cols, fmt))
