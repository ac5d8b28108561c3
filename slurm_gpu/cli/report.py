"""`slurm-gpu report`: thin click shell over slurm_gpu.report (docs/report.md): the options, their
parsing into a Query, and the one consistent read that builds and renders the table."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import click

from slurm_gpu import render
from slurm_gpu.cli import apply_options, dry_run_option, emit_output, output_file_option, output_options
from slurm_gpu.errors import InputError
from slurm_gpu.report.query import BY_CHOICES, TIME_KEYS

FORMAT_CHOICES = render.FORMATS + ("html",)
_BY_ALIASES = {"gpu_model": "gpu-model", "model": "gpu-model", "users": "user", "accounts": "account",
               "partitions": "partition", "nodes": "node", "days": "day", "weeks": "week", "months": "month",
               "daily": "day", "weekly": "week", "monthly": "month"}


def parse_by(values: Sequence[str]) -> Tuple[str, ...]:
    """`--by account,month` (comma lists, repeatable) -> ('account', 'month'); InputError on unknown keys."""
    out: List[str] = []
    for v in values:
        for part in v.split(","):
            name = part.strip().lower()
            if not name:
                continue
            name = _BY_ALIASES.get(name, name)
            if name not in BY_CHOICES:
                raise InputError(f"unknown --by key {part.strip()!r}", "choose from " + ", ".join(BY_CHOICES)
                                 + " (comma-separated, e.g. --by account,month)")
            if name not in out:
                out.append(name)
    if sum(1 for k in out if k in TIME_KEYS) > 1:
        raise InputError("--by takes at most one of day, week, month", "e.g. --by account,month")
    return tuple(out) or ("user",)


def split_list(values: Sequence[str]) -> Tuple[str, ...]:
    """Comma lists, repeatable options: ('a,b', 'c') -> ('a', 'b', 'c')."""
    return tuple(p.strip() for v in values for p in v.split(",") if p.strip())


_FORMAT_HELP = ("Default: table. table/markdown/html show units that suit the figures "
                "(GPU-h, GPU-min or GPU-s; kWh or Wh; a job's GPU time as [D-]HH:MM:SS) and control "
                "characters in names as escapes; csv/json carry GPU-hours and kWh (6 decimals), csv "
                "quotes text that a spreadsheet would run as a formula. html: one self-contained page "
                "with charts.")


def _common_options(f: Callable, formats: Sequence[str] = FORMAT_CHOICES, format_help: str = _FORMAT_HELP) -> Callable:
    """Options every report command takes; given before or after the subcommand name."""
    opts = [
        click.option("--db", "dbs", multiple=True, metavar="PATH|URL",
                     help="Node database or directory of *.db files (repeatable), or the cluster's central server: "
                          "mysql://USER@HOST[:PORT]/DATABASE, or 'central' for central.url (docs/central.md). "
                          "Default: report.sources from the config, else this node's store.database. Opened "
                          "read-only, consistent while hooks write or nodes push; records found in several files "
                          "count once. Gather node databases with `slurm-gpu db backup`, not cp (a copy without its "
                          "-wal file misses records)."),
        click.option("--password-file", metavar="PATH", default=None,
                     help="For a central server: the file with USER's password, mode 600 (default: "
                          "central.password_file)."),
        click.option("--tz", type=click.Choice(["utc", "local"]), default=None,
                     help="Time zone of calendar times in --since/--until, of day/week/month groups and of "
                          "printed times (default: report.tz, 'utc')."),
        click.option("--idle-threshold", type=float, default=None, metavar="PCT",
                     help="A job's GPU whose mean utilisation is below PCT counts as idle (default: "
                          "report.idle_threshold_pct, 5)."),
        output_options(formats, default=None, extra_help=format_help),
        output_file_option(),
        click.option("--explain", is_flag=True, default=None,
                     help="Say on stderr which plan the summary ran: the central server's rollups (whole days) "
                          "with the records of partial days, or the records, and why (docs/central.md)."),
    ]
    return apply_options(f, opts)


def _window_options(f: Callable) -> Callable:
    opts = [
        click.option("--since", "-S", default=None, metavar="TIME",
                     help="Start of the window: 2026-11-01, 2026-11-01T13:00, now-7days, today, yesterday, ... "
                          "GPU time is clipped to the window (default: all records)."),
        click.option("--until", "-E", default=None, metavar="TIME",
                     help="End of the window (exclusive), same forms as --since (default: open)."),
        click.option("--user", "-u", "users", multiple=True, metavar="LIST", help="Only these users (comma list, repeatable)."),
        click.option("--account", "-A", "accounts", multiple=True, metavar="LIST", help="Only these accounts."),
        click.option("--partition", "-p", "partitions", multiple=True, metavar="LIST", help="Only these partitions."),
        click.option("--node", "-N", "nodes", multiple=True, metavar="LIST", help="Only these nodes."),
        click.option("--cluster", "-M", "clusters", multiple=True, metavar="LIST", help="Only these clusters."),
    ]
    return apply_options(f, opts)


_META_KEY = "slurm_gpu.report.query.group_options"


def _merged(ctx: click.Context, local: Dict[str, Any]) -> Dict[str, Any]:
    """Subcommand options override the same options given on the group (`report --since X jobs`)."""
    out = dict(ctx.meta.get(_META_KEY, {}))
    for k, v in local.items():
        if v is None or v == ():
            out.setdefault(k, v)
        else:
            out[k] = v
    return out


def _config(ctx: click.Context):
    """The config loaded by the top-level group (--config), or the default lookup when run on its own."""
    cfg = getattr(ctx.obj, "config", None) if ctx.obj is not None else None
    if cfg is None:
        from slurm_gpu import config
        cfg = config.load(None)
    return cfg


def _build_query(ctx: click.Context, o: Dict[str, Any], job_id: Optional[int] = None):
    from slurm_gpu.report.query import Query
    from slurm_gpu.report.timespec import parse_time

    cfg = _config(ctx)
    tz = o.get("tz") or cfg.report.tz
    now = time.time()
    since = parse_time(o["since"], now_s=now, tz=tz, option="--since") if o.get("since") else None
    until = parse_time(o["until"], now_s=now, tz=tz, option="--until") if o.get("until") else None
    threshold = o.get("idle_threshold")
    query = Query(
        since_s=since, until_s=until,
        users=split_list(o.get("users") or ()), accounts=split_list(o.get("accounts") or ()),
        partitions=split_list(o.get("partitions") or ()), nodes=split_list(o.get("nodes") or ()),
        clusters=split_list(o.get("clusters") or ()),
        idle_threshold_pct=cfg.report.idle_threshold_pct if threshold is None else threshold,
        tz=tz, job_id=job_id,
    )
    dbs: Sequence[str] = o.get("dbs") or ()
    if not dbs:
        dbs = list(cfg.report.sources) or [cfg.path_value("store", "database")]
    return query, list(dbs)


def _emit(o: Dict[str, Any], text: str) -> None:
    emit_output(o.get("output"), text)


def _render(o: Dict[str, Any], table, src) -> str:
    from slurm_gpu.report.units import human_view

    fmt = o.get("fmt") or "table"
    if fmt == "html":
        from slurm_gpu.report import html as report_html
        return report_html.render_report(table, src, table.kind)
    if fmt in ("json", "csv"):
        return render.render(list(table.rows), table.columns, fmt)
    headers, formats = human_view(table)
    rows = list(table.rows)
    if fmt == "table" and table.kind == "summary" and len(rows) > 1 and table.total:
        rows.append(table.total)
    return render.render(rows, table.columns, fmt, headers, formats)


def _produce(ctx: click.Context, o: Dict[str, Any], build: Callable[[Any], Any], job_id: Optional[int] = None) -> None:
    """Build the table and its text from one consistent read of the databases, then print it."""
    from slurm_gpu.report.sources import read_consistently

    query, dbs = _build_query(ctx, o, job_id=job_id)

    def read(src):
        table = build(src)
        if src.replica_note:
            click.echo(f"slurm-gpu: note: {src.replica_note}", err=True)
        if o.get("explain") and src.plan:
            click.echo(f"slurm-gpu: plan: {src.plan}", err=True)
        return table, _render(o, table, src)

    from slurm_gpu.report.central import is_central, read_central
    if is_central(dbs):
        table, text = read_central(_config(ctx), dbs, query, read, o.get("password_file"))
    else:
        table, text = read_consistently(dbs, query, read)
    for note in table.notes:
        click.echo(f"slurm-gpu: note: {note}", err=True)
    if not table.rows:
        click.echo("slurm-gpu: no GPU records match (check --since/--until, the filters and --db)", err=True)
    _emit(o, text)


def _run(fn: Callable[[], None]) -> None:
    """Errors propagate to the group's one boundary (slurm_gpu.cli.LazyGroup.invoke)."""
    fn()


@click.group("report", invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--by", "by", multiple=True, metavar="KEYS",
              help=f"Group by {', '.join(BY_CHOICES[:-1])} or {BY_CHOICES[-1]}; comma list "
                   "(e.g. --by account,month), at most one of day/week/month. Default: user.")
@_window_options
@_common_options
@click.pass_context
def report_cmd(ctx: click.Context, by: Tuple[str, ...], **opts: Any) -> None:
    """GPU accounting: GPU-hours allocated and used, utilisation, memory, energy and idle GPUs.

    Without a subcommand: one row per group (--by) and a TOTAL line computed from the exact
    sums. `report jobs` lists jobs, `report job JOBID` shows one job per node and GPU. GPU time
    runs from the prolog's start to the epilog's start (Slurm's allocation). Records whose
    times cannot be placed (end before start, 1e18, inf) are skipped and utilisation outside
    0-100 % is clamped, each said in a note on stderr. Columns are explained in docs/report.md.

    \b
    Examples:
      slurm-gpu report --db /shared/slurm-gpu/ --since now-30days --by account,month
      slurm-gpu report jobs --idle --since yesterday --format csv
      slurm-gpu report --since 2026-11-01 --until 2026-12-01 --format html -o nov.html
    """
    ctx.meta[_META_KEY] = dict(opts)
    if ctx.invoked_subcommand is not None:
        if by:
            raise InputError(f"--by applies to the summary, not to 'report {ctx.invoked_subcommand}'",
                             "drop --by, or use --sort/--limit with 'report jobs'")
        return

    def go() -> None:
        from slurm_gpu.report import reports as report
        keys = parse_by(by)
        _produce(ctx, opts, lambda src: report.summary(src, keys))

    _run(go)


@report_cmd.command("jobs")
@click.option("--sort", default=None, metavar="COL",
              help="Sort by this column, smallest first; -COL for largest first (default: -gpu_hours_alloc, "
                   "with --idle -gpu_hours_idle). Columns: job_id, user, account, start, end, gpus, "
                   "gpu_hours_alloc, gpu_hours_used, gpu_util_mean_pct, gpu_util_min_pct, energy_kwh, gpu_hours_idle, ...")
@click.option("--limit", type=int, default=None, metavar="N", help="Show only the first N jobs.")
@click.option("-n", "limit_n", type=int, default=None, hidden=True)  # old spelling; -n is --dry-run elsewhere
@click.option("--idle", "idle_only", is_flag=True,
              help="Only jobs that held at least one GPU below the idle threshold (for efficiency emails).")
@_window_options
@_common_options
@click.pass_context
def jobs_cmd(ctx: click.Context, sort: Optional[str], limit: Optional[int], limit_n: Optional[int], idle_only: bool,
             **opts: Any) -> None:
    """List jobs with their GPU figures (one row per job run; GPU time clipped to the window).

    The table shows a job's GPU time as [D-]HH:MM:SS, exact to the second; csv/json in GPU-hours.
    """
    if limit is None and limit_n is not None:
        click.echo("slurm-gpu: warning: `report jobs -n N` is deprecated (-n means --dry-run in slurm-gpu): "
                   "use --limit N", err=True)
        limit = limit_n
    o = _merged(ctx, opts)

    def go() -> None:
        from slurm_gpu.report import reports as report
        _produce(ctx, o, lambda src: report.jobs(src, sort=sort, limit=limit, idle_only=idle_only))

    _run(go)


@report_cmd.command("job")
@click.argument("job_id", metavar="JOBID")
@click.option("--cluster", "-M", "clusters", multiple=True, metavar="LIST", help="Only records of these clusters.")
@_common_options
@click.pass_context
def job_cmd(ctx: click.Context, job_id: str, **opts: Any) -> None:
    """Show one job per node and GPU (every restart), with its counters and XID events."""
    o = _merged(ctx, opts)
    # A window given on the group does not hide records of the job asked for by id.
    o["since"] = o["until"] = None
    for k in ("users", "accounts", "partitions", "nodes"):
        o[k] = ()

    def go() -> None:
        from slurm_gpu.report import reports as report
        try:
            jid = int(job_id)
            if jid < 0:
                raise ValueError
        except ValueError:
            raise InputError(f"job id {job_id!r} is not a number",
                             "give the numeric Slurm job id, e.g. report job 4711") from None
        _produce(ctx, o, report.job, job_id=jid)

    _run(go)


DIGEST_FORMATS = ("table", "json", "html")
MANY_MAILS = 5  # more mails than this get a progress bar, when stderr is a terminal


def _digest_options(f: Callable) -> Callable:
    return _common_options(f, DIGEST_FORMATS,
                           "Default: table (both tables; GPU time in GPU-h, GPU-min or GPU-s, whichever suits). json: "
                           "users and accounts with their figures in GPU-hours (6 decimals), the change and the window "
                           "before's figures. html: one self-contained page with the two tables.")


@report_cmd.command("digest")
@click.option("--week", metavar="YYYY-Www", default=None,
              help="This ISO week, Monday 00:00 to Monday 00:00 in --tz (e.g. 2026-W48). Default: the last full "
                   "week; --since/--until give any other window (--until default: now).")
@click.option("--mail", "mail_users", is_flag=True,
              help="Mail each user with GPU time in the window their own figures, to USER@efficiency.mail_domain "
                   "(without mail_domain: the bare user name, which only efficiency.mail_command delivers), through "
                   "efficiency.smtp_server or efficiency.mail_command. With --mail or --to the digest is printed only when "
                   "--format or -o is given.")
@click.option("--to", "to", multiple=True, metavar="ADDRESS",
              help="Mail the whole digest (both tables, plain text) to ADDRESS instead of the users' mails "
                   "(repeatable): the admins, account coordinators.")
@dry_run_option("With --mail or --to: print the mails that would be sent (To, Subject, body); send nothing.")
@_window_options
@_digest_options
@click.pass_context
def digest_cmd(ctx: click.Context, week: Optional[str], mail_users: bool, to: Tuple[str, ...], dry_run: bool,
               **opts: Any) -> None:
    """Weekly digest: per user and per account, GPU-hours allocated, used and idle, jobs and idle jobs,
    and the change against the week before.

    The window is the last full week (Monday 00:00 to Monday 00:00 in report.tz), --week, or
    --since/--until; the comparison is the window of the same length just before it. Each
    window is read as `slurm-gpu report --by user` (and `--by account`) reads it, from the same
    sources (--db, report.sources, the central server and its rollups): a user's GPU-hours are
    exactly that report's for the same window. Idle jobs are those `report jobs --idle` lists
    (at least one GPU below the idle threshold). Explained in docs/report.md, "Weekly digest".

    \b
    Examples:
      slurm-gpu report digest --db central
      slurm-gpu report digest --week 2026-W48 --format html -o w48.html
      slurm-gpu report digest --mail --dry-run
      slurm-gpu report digest --db central --mail     (from cron, on Mondays)
      slurm-gpu report digest -A physics --to physics-pi@example.org

    \b
    Exit codes: 0 digest printed or every mail sent; 1 a mail could not be sent (one line each
    on stderr; the others were sent); 2 bad option or time; 5 a database that cannot be read.
    """
    o = _merged(ctx, opts)

    def go() -> None:
        from slurm_gpu.report import digest as D
        from slurm_gpu.report.central import is_central, read_central
        from slurm_gpu.report.sources import read_consistently
        from slurm_gpu.report.timespec import parse_time

        fmt = o.get("fmt")
        if fmt is not None and fmt not in DIGEST_FORMATS:
            raise InputError(f"--format {fmt}: the digest is printed as {', '.join(DIGEST_FORMATS)}",
                             "use --format table, json or html (or `report --by user --format csv`)")
        if dry_run and not (mail_users or to):
            raise InputError("--dry-run shows the mails of --mail or --to", "add --mail or --to ADDRESS")
        cfg = _config(ctx)
        tz = o.get("tz") or cfg.report.tz
        since, until = o.get("since"), o.get("until")
        now = time.time()
        if week and (since or until):
            raise InputError("--week and --since/--until both give the window", "give one of them")
        if week:
            w = D.iso_week(week, tz)
        elif since:
            w = D.window(parse_time(since, now_s=now, tz=tz, option="--since"),
                         parse_time(until, now_s=now, tz=tz, option="--until") if until else now, tz)
        elif until:
            raise InputError("--until without --since: a digest needs both ends of its window",
                             "give --since too, or --week YYYY-Www")
        else:
            w = D.last_full_week(now, tz)
        query, dbs = _build_query(ctx, dict(o, since=None, until=None))

        def read(q, fn):
            if is_central(dbs):
                return read_central(cfg, dbs, q, fn, o.get("password_file"))
            return read_consistently(dbs, q, fn)

        d = D.collect(read, query, w)
        if o.get("explain"):
            for plan in d.plans:
                click.echo(f"slurm-gpu: plan: {plan}", err=True)
        for note in d.notes:
            click.echo(f"slurm-gpu: note: {note}", err=True)
        if d.empty():
            click.echo(f"slurm-gpu: no GPU records match in {w.label} or the window before "
                       "(check --week/--since/--until, the filters and --db)", err=True)
        mailing = D.admin_messages(d, to) if to else D.user_messages(cfg, d, query) if mail_users else None
        if mailing is None or fmt or o.get("output"):
            text = D.to_json(d) if fmt == "json" else D.to_html(d, now) if fmt == "html" else D.to_text(d)
            _emit(o, text)
        if mailing is None:
            return
        if dry_run:
            for line in mailing.refused:
                click.echo(f"slurm-gpu: error: {line}", err=True)
            if mailing.messages:
                click.echo(D.dry_run_text(mailing.messages))
            click.echo(f"slurm-gpu: dry run: {len(mailing.messages)} mail(s) not sent", err=True)
            if mailing.refused:
                ctx.exit(1)
            return
        if not _send_all(cfg, mailing, w.label):
            ctx.exit(1)

    _run(go)


def _send_all(cfg: Any, mailing: Any, label: str) -> bool:
    """Send every message; a failure is one line on stderr and the others still go.  True: all went."""
    import contextlib
    import sys

    from slurm_gpu.efficiency.mail import MailError, send

    errors = [f"slurm-gpu: error: {line}" for line in mailing.refused]
    for line in errors:
        click.echo(line, err=True)
    msgs = list(mailing.messages)
    show = sys.stderr.isatty() and len(msgs) > MANY_MAILS
    held: List[str] = []  # failures while the bar is drawn: printed after it
    sent, how = 0, ""
    bar_cm = click.progressbar(msgs, label="mailing", file=sys.stderr) if show else contextlib.nullcontext(msgs)
    with bar_cm as bar:
        for msg in bar:
            try:
                how = send(cfg, msg)
                sent += 1
            except MailError as e:
                line = f"slurm-gpu: error: mail to {msg.to}: {e.message}"
                errors.append(line)
                if show:
                    held.append(line)
                else:
                    click.echo(line, err=True)
    for line in held:
        click.echo(line, err=True)
    failed = len(msgs) - sent + len(mailing.refused)
    click.echo(f"slurm-gpu: digest {label}: {sent} of {len(msgs) + len(mailing.refused)} mail(s) sent"
               + (f" ({how})" if how else "") + (f", {failed} failed" if failed else ""), err=True)
    return not failed
