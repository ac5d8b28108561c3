"""`slurm-gpu central init` and `slurm-gpu db push`: the cluster's SQL server (docs/central.md)."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

import click

from slurm_gpu.cli import dry_run_option
from slurm_gpu.errors import ExitCode, InputError, SlurmError
from slurm_gpu.timefmt import unix_to_local

_url_opt = click.option("--url", metavar="URL", default=None,
                        help="mysql://USER@HOST[:PORT]/DATABASE (default: central.url). Never put a password here.")
_pw_opt = click.option("--password-file", metavar="PATH", default=None,
                       help="File with the password of USER, mode 600 (default: central.password_file).")


@click.group()
def central():
    """The cluster's central SQL server (MariaDB/MySQL) that `db push` fills."""


@central.command("init")
@_url_opt
@_pw_opt
@click.option("--check", "check_only", is_flag=True,
              help="Only say whether the schema is current (and, with --writers, the writers registered): "
                   "exit 0 if so, 1 if `central init` would change something.")
@click.option("--cluster", metavar="NAME", default=None,
              help="Slurm cluster (ClusterName) of the nodes named by --writers.")
@click.option("--writers", metavar="HOSTLIST", default=None,
              help="Register writer accounts for these nodes (a Slurm hostlist, e.g. 'gpu[001-128]'): "
                   "each may ship only its own node's records. '*' with --group: every node of the cluster.")
@click.option("--group", metavar="NAME", default="",
              help="One writer account NAME for all nodes of --writers (default: one account per node).")
@click.option("--writer", default="slurm_gpu_writer", show_default=True, metavar="PREFIX",
              help="Per-node writer accounts are named PREFIX_NODE.")
@click.option("--password-dir", metavar="DIR", default="/etc/slurm-gpu/writers", show_default=True,
              help="Where each writer's password file ACCOUNT.password goes (mode 600; an existing one is kept).")
@click.option("--reporter", default="slurm_gpu_reporter", show_default=True, metavar="USER",
              help="Read-only account in the printed GRANTs.")
@click.option("--hosts", default="%", show_default=True, metavar="PATTERN",
              help="Host pattern of the accounts in the printed statements (e.g. '10.1.%').")
@click.option("--rollup-tz", type=click.Choice(["utc", "local"]), default=None,
              help="Zone whose days the rollups add up (default: report.tz): 'local' is this host's zone, "
                   "for reports with --tz local on hosts in the same zone.")
@click.option("--progress/--no-progress", default=None, help="Progress bar of the rollups' build (default: on a terminal).")
@click.pass_obj
def init(app, url, password_file, check_only, cluster, writers, group, writer, password_dir, reporter, hosts,
         rollup_tz, progress):
    """Create or migrate the central schema; register writers; print the accounts' SQL.

    Run as an account that may create tables in the database (the database admin),
    then run the printed statements (`mariadb DATABASE < file`).  Each node ships
    through its own writer account (or its group's), which may write only its own
    node's records of its cluster: `--cluster C --writers 'gpu[001-128]'` registers
    one account per node, writes a password file per account into --password-dir
    (copy each to its node's central.password_file) and prints CREATE USER with the
    password's hash, never the password.  The reporter can only read.
    """
    from slurm_gpu.central import server as C
    from slurm_gpu.central import writers as W
    plan = _writer_plan(W, cluster, writers, group, writer)
    with C.Central.from_config(app.config, url, password_file) as srv:
        version = srv.schema_version()
        if check_only:
            _init_check(srv, C, W, version, cluster, plan, password_dir)
            return
        with _bar(progress, "building rollups") as bar:
            before, after = srv.migrate(rollup_tz or app.config.report.tz, bar.step)
        if before == after:
            click.echo(f"{srv.target.describe()}: schema version {after}, already current (the push's rollup "
                       "procedures made again with this release's statements)", err=True)
        else:
            click.echo(f"{srv.target.describe()}: schema {'created' if before is None else f'migrated from {before}'}"
                       f" at version {after}", err=True)
        added = W.register(srv, cluster, plan) if plan else 0
    click.echo("-- Run as the database admin (docs/central.md):", err=True)
    for stmt in C.grants(srv.target, reporter=reporter, hosts=hosts):
        click.echo(stmt)
    for w in plan:
        click.echo(f"-- {w.account}: {cluster} {','.join(w.nodes)}")
        pw_hash = W.native_hash(W.password_for(password_dir, w.account))
        for stmt in W.account_sql(srv.target.database, w.account, hosts, pw_hash, C.RECORD_TABLES):
            click.echo(stmt)
    if plan:
        click.echo(f"{len(plan)} writer account(s) for cluster {cluster} ({added} new node mapping(s)); their "
                   f"passwords are in {password_dir}/ACCOUNT.password: copy each to its node's central.password_file "
                   "and name the account in that node's central.url", err=True)
    else:
        click.echo("-- no writer registered: nodes ship only through accounts registered with "
                   "`central init --cluster C --writers HOSTLIST`", err=True)


def _writer_plan(W, cluster, writers, group, prefix):
    """The writer accounts --writers asks for ([] without it)."""
    if writers is None:
        if group:
            raise InputError("--group needs --writers", "e.g. --writers 'gpu[001-128]' --group gpu_nodes")
        return []
    if not cluster:
        raise InputError("--writers needs --cluster", "the nodes' ClusterName, e.g. --cluster mycluster")
    if writers.strip() == W.ANY_NODE:
        nodes = [W.ANY_NODE]
    else:
        from slurm_gpu.slurm.hostlist import expand
        try:
            nodes = expand(writers)
        except ValueError as e:
            raise InputError(f"--writers: {e}", "a Slurm hostlist, e.g. 'gpu[001-064,066],login1'") from None
    return W.plan(nodes, prefix, group)


def _init_check(srv, C, W, version, cluster, plan, password_dir) -> None:
    if version != C.SCHEMA_VERSION:
        have = "no slurm-gpu schema" if version is None else f"schema version {version}"
        click.echo(f"{srv.target.describe()}: {have}, this slurm-gpu needs {C.SCHEMA_VERSION}: run `slurm-gpu central init`")
        sys.exit(int(ExitCode.UNHEALTHY))
    missing = W.unregistered(srv, cluster, plan) if plan else []
    no_file = [w.account for w in plan if not W.password_for(password_dir, w.account, create=False)]
    if missing or no_file:
        click.echo(f"{srv.target.describe()}: schema version {version}, current; {len(missing)} node(s) not registered, "
                   f"{len(no_file)} password file(s) missing: run `slurm-gpu central init` with these --writers")
        sys.exit(int(ExitCode.UNHEALTHY))
    click.echo(f"{srv.target.describe()}: schema version {version}, current")


@central.command("rollup")
@_url_opt
@_pw_opt
@click.option("--rebuild", is_flag=True, required=True, help="Recompute the rollups from the records.")
@click.option("--since", default=None, metavar="TIME",
              help="Only the days from the one holding TIME on (default: all days); forms as `report --since`.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: on a terminal).")
@click.pass_obj
def rollup(app, url, password_file, rebuild, since, progress):
    """Recompute the rollups (per-day sums of `report --by`) and say what differed.

    Run as the admin account that ran `central init`.  Exit 0 when the rollups were
    exact, 1 when rows were corrected (each table's missing, extra and different rows
    are printed).  Pushes wait while it runs (one serializable transaction).
    """
    from slurm_gpu.central import rollups as R
    from slurm_gpu.central import server as C
    from slurm_gpu.report.timespec import parse_time
    since_s = parse_time(since, now_s=time.time(), tz=app.config.report.tz, option="--since") if since else None
    with C.Central.from_config(app.config, url, password_file, long_queries=True) as srv:
        srv.require_current()
        with _bar(progress, "rebuilding rollups") as bar:
            diff = R.rebuild(srv, R.first_day_of(srv, since_s), bar.step)
    corrected = 0
    for table, (missing, extra, other) in diff.items():
        corrected += missing + extra + other
        click.echo(f"{table}: {missing} missing, {extra} extra, {other} different")
    click.echo(f"{srv.target.describe()}: rollups " + ("exact" if not corrected else f"corrected ({corrected} rows)"), err=True)
    if corrected:
        sys.exit(1)


class _bar:
    """click's progress bar over (done, total) steps, on a terminal or when asked; else nothing."""

    def __init__(self, progress: Optional[bool], label: str):
        self.show = sys.stderr.isatty() if progress is None else progress
        self.label = label
        self.bar: Any = None
        self.done = 0

    def step(self, done: int, total: int) -> None:
        if not self.show:
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def __enter__(self) -> "_bar":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _age(oldest: Optional[float]) -> str:
    if oldest is None:
        return "none"
    s = max(0.0, time.time() - oldest)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


@click.command("push")
@click.option("--db", "--database", "database", metavar="PATH",
              help="Node database (default: store.database; %n there is the short host name outside a hook).")
@_url_opt
@_pw_opt
@click.option("--max-seconds", type=click.FloatRange(min=1), default=None, metavar="S",
              help="Stop starting new batches after S seconds (what is left ships next time).")
@click.option("--batch-size", type=click.IntRange(1, 100000), default=None, metavar="N",
              help="Records per upsert (default: central.batch_size).")
@click.option("--status", "status_only", is_flag=True,
              help="Only print what waits to be shipped and its age; contact no server.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: when stderr is a terminal).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing when everything went (for cron and timers).")
@click.pass_obj
def push(app, database, url, password_file, max_seconds, batch_size, status_only, progress, quiet):
    """Ship this node's records to the central server (idempotent upserts).

    Job and GPU usage records, health events and drains that the server does not have
    in their current form go in batches; the node database remembers what was shipped,
    so a second run ships nothing and a restored node database doubles nothing.  When
    the server is down or refuses the login, push exits 5 with one line and keeps every
    record for the next run.  Prints what was shipped, what is left and the age of the
    oldest record left.  Exit 0 when everything was shipped (or only --max-seconds
    stopped it, or nothing waited: then no server is contacted), 5 when the server failed, 1 when
    it refused some records, 6 when
    it refused a batch of another node's or cluster's records (this account may not write them).  A batch
    the server rolled back for another transaction's locks (nodes pushing the same jobs at once) is sent
    again, up to 8 times within --max-seconds.  One push per
    node database runs at a time: a second one says so on stderr and exits 0.  Connecting
    and each exchange end within central.timeout_s in all, however slowly the server answers.
    """
    from slurm_gpu.central.admin import Outbox
    from slurm_gpu.central.push import PushBusy
    cfg = app.config
    with Outbox(cfg, database) as outbox:
        try:
            if status_only:
                _print_backlog(outbox.backlog(), outbox.last_push_time())
                return
            cluster = outbox.cluster(cfg)
            from slurm_gpu.central.server import Central
            show = sys.stderr.isatty() if progress is None else progress
            with outbox.lock():
                before = outbox.backlog()
                if not before.total:
                    # The timer's usual case between job ends: 4,000 nodes every 30 s would be 130 logins a
                    # second for nothing (docs/benchmarks.md, the load of many nodes).
                    from slurm_gpu.central.push import PushResult
                    _print_result(PushResult({}, [], before, False, 0), f"{outbox.path} (no server contacted)", quiet)
                    return
                with Central.from_config(cfg, url, password_file) as srv, \
                        click.progressbar(length=before.total, label="pushing", file=sys.stderr) if show and before.total \
                        else _NoBar() as bar:
                    result = outbox.push(srv, cluster, batch_size or cfg.central.batch_size, max_seconds,
                                         progress=bar.update)
        except PushBusy:
            click.echo(f"slurm-gpu: another `db push` of {outbox.path} is running; this one ships nothing", err=True)
            return
    _print_result(result, f"{outbox.path} -> {srv.target.describe()}", quiet)


def _print_result(result, where: str, quiet: bool) -> None:
    """What shipped and what is left (stdout), the refused records (stderr; exit 1)."""
    shipped = ", ".join(f"{t} {n}" for t, n in result.shipped.items() if n) or "nothing"
    left = result.left
    if not (quiet and not result.refused):
        click.echo(f"{where}: shipped {shipped}; left {left.total}"
                   + (f" (oldest {_age(left.oldest_time)} old)" if left.total else "")
                   + (f"; {result.retried} batch(es) sent again after lock conflicts with other transactions"
                      if result.retried else ""))
    for line in result.refused[:10]:
        click.echo(f"slurm-gpu: refused by the server: {line}", err=True)
    if result.refused:
        click.echo(f"hint: {len(result.refused)} record(s) stay in the node database; fix the server's column sizes "
                   "or the records, then push again", err=True)
        sys.exit(int(ExitCode.UNHEALTHY))


class _NoBar:
    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _print_backlog(b, last: Optional[float]) -> None:
    rows = ", ".join(f"{t} {n}" for t, n in b.rows.items())
    when = "never" if last is None else unix_to_local(last)
    click.echo(f"waiting: {b.total} ({rows}); oldest {_age(b.oldest_time)} old; last push {when}")


@central.command("annotate")
@_url_opt
@_pw_opt
@click.option("--since", metavar="TIME", default=None,
              help="Jobs that ended since TIME (e.g. now-1day, 2026-11-01); required unless --job is given.")
@click.option("--job", "job_ids", multiple=True, type=click.IntRange(min=1), metavar="JOBID",
              help="Only this job (raw job id; repeatable).")
@dry_run_option("Say which summaries would be written; write nothing.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: on a terminal).")
@click.pass_obj
def annotate(app, url, password_file, since, job_ids, dry_run, progress):
    """Write or complete jobs' GPU summaries in Slurm's accounting (AdminComment).

    For a cron job on the database host: jobs whose summary is missing (the controller
    epilog was not configured, or the records came later) or marked partial get one from
    the records now on the central server. An AdminComment written by another tool is
    left alone. With job_summary.energy_tres on Slurm 25.11 and later, a complete summary's
    GPU energy also goes into the job's energy TRES where Slurm recorded none, also for a job
    whose summary was already complete (the controller epilog's energy write failed). Needs
    the reporter account and Slurm's sacct/sacctmgr as an operator.
    """
    from slurm_gpu.central.admin import jobs_with_records
    from slurm_gpu.central.server import Central, job_rows
    from slurm_gpu.report.timespec import parse_time
    from slurm_gpu.slurm.cli_backend import CliBackend
    from slurm_gpu.store import summary as S
    cfg = app.config
    if since is None and not job_ids:
        raise InputError("say which jobs: --since TIME or --job JOBID", "e.g. slurm-gpu central annotate --since now-1day")
    if cfg.job_summary.field == "off":
        raise InputError("job_summary.field is 'off' in the config", "set it to 'AdminComment' to write summaries")
    since_s = parse_time(since, option="--since") if since else None
    backend = CliBackend(cfg)
    energy = bool(cfg.job_summary.energy_tres) and not dry_run and backend.energy_tres_settable()
    with Central.from_config(cfg, url, password_file, long_queries=True) as srv:
        jobs = jobs_with_records(srv, since_s, job_ids)
        comments = _admin_comments(backend, jobs)
        counts = {"written": 0, "completed": 0, "partial": 0, "kept": 0, "energy": 0, "foreign": 0, "unknown": 0,
                  "failed": 0}
        failures = []
        show = sys.stderr.isatty() if progress is None else progress
        with click.progressbar(jobs, label="annotating", file=sys.stderr) if show and jobs else _NoBar() as bar:
            for cluster, job_id, restart in (bar if show and jobs else jobs):
                if (cluster, job_id) not in comments:
                    counts["unknown"] += 1  # records of a job accounting does not know (purged, other slurmdbd)
                    continue
                try:
                    outcome = _annotate_one(backend, srv, S, job_rows, cluster, job_id, restart,
                                            comments[(cluster, job_id)], dry_run, energy)
                except SlurmError as e:
                    outcome = "failed"
                    failures.append(e)
                counts[outcome] += 1
    verb = "would write" if dry_run else "wrote"
    kept = counts["kept"] + counts["energy"]
    given = f" ({counts['energy']} given their GPU energy in Slurm's accounting)" if counts["energy"] else ""
    click.echo(f"{len(jobs)} job(s): {verb} {counts['written']} new and {counts['completed']} completed summaries; "
               f"{counts['partial']} still partial, {kept} already complete{given}, "
               f"{counts['foreign']} with another tool's AdminComment (left alone), "
               f"{counts['unknown']} not in Slurm's accounting, {counts['failed']} failed")
    if failures:
        raise failures[0]


def _admin_comments(backend, jobs):
    """{(cluster, job id): AdminComment} from accounting, per cluster."""
    out = {}
    by_cluster = {}
    for cluster, job_id, _restart in jobs:
        by_cluster.setdefault(cluster, []).append(job_id)
    for cluster, ids in by_cluster.items():
        for job_id, comment in backend.admin_comments(ids, cluster).items():
            out[(cluster, job_id)] = comment
    return out


def _annotate_one(backend, srv, S, job_rows, cluster, job_id, restart, comment, dry_run, energy=False) -> str:
    nodes = None
    if comment:
        if not S.is_ours(comment):
            return "foreign"
        try:
            old = S.decode(comment)
        except InputError:
            old = None  # damaged: written again from the records
        if old is not None and not old.partial and old.restart == restart:
            if energy and backend.energies.get(job_id) == 0:
                # complete, but Slurm holds no energy: the controller epilog's energy write failed
                from slurm_gpu.hooks.ctld import energy_into_accounting
                done, _ = energy_into_accounting(backend, job_id, cluster, False, job_rows(srv, cluster, job_id, restart),
                                                 backend.named_ids.get(job_id, ""))
                return "energy" if done == "written" else "kept"
            return "kept"
        if old is not None and old.restart == restart:
            nodes = old.nodes
    rows = job_rows(srv, cluster, job_id, restart)
    summary = S.from_records(cluster, job_id, restart, nodes or sorted({r["node"] for r in rows}), rows)
    if comment and S.is_ours(comment) and summary.partial and S.decode_safe(comment) == S.decode(S.fit(summary)):
        return "partial"
    if not dry_run:
        named = backend.named_ids.get(job_id, "")
        backend.set_admin_comment(job_id, cluster, S.fit(summary), named=named)
        if energy and not summary.partial:
            from slurm_gpu.hooks.ctld import energy_into_accounting
            energy_into_accounting(backend, job_id, cluster, summary.partial, rows, named)
    if summary.partial:
        return "partial"
    return "completed" if comment else "written"
