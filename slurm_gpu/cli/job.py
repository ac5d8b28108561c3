"""`slurm-gpu job JOBID`: how a finished job used its GPUs, with advice (docs/job.md)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Optional

import click

from slurm_gpu.cli import AppContext, output_options


def _backend(app: AppContext) -> Any:
    """The Slurm command-line backend that runs sacct (tests replace this function)."""
    from slurm_gpu.slurm.cli_backend import CliBackend
    return CliBackend(app.config)


def _color(no_color: bool) -> bool:
    return not no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()


@click.command("job")
@click.argument("job_id", metavar="JOBID")
@output_options(("table", "json", "html"))
@click.option("--no-color", "no_color", is_flag=True, help="No colour (none either when stdout is not a terminal).")
@click.option("--db", metavar="PATH|URL", default=None,
              help="Admins: where there is no summary in the job's AdminComment, build it from the records: a node "
                   "database file, the central server (mysql://USER@HOST/DB), or 'central' for central.url.")
@click.option("--password-file", metavar="PATH", default=None,
              help="With --db for a central server: the file with its password (default: central.password_file).")
@click.pass_context
def job(ctx: click.Context, job_id: str, fmt: str, no_color: bool, db: Optional[str],
        password_file: Optional[str]) -> None:
    """How a finished job used its GPUs, with advice.

    JOBID: 4711, an array task 4711_3, a heterogeneous job component 4711+1, or from Slurm
    26.05 a run's SLUID (sEKNKTV3WPV500: one run of a requeued job, on any cluster). Any user
    may run it: the job is read through sacct, so Slurm decides who sees which job. The summary
    is the one the controller epilog stored in the job's AdminComment when the job ended.

    \b
    Exit codes: 0 shown, 2 usage, 4 Slurm error, 5 database error (--db), 7 not found or not
    visible to you, 8 no GPUs, 9 still pending or running, 10 no summary (yet),
    11 AdminComment of another tool (docs/exit-codes.md).
    """
    from slurm_gpu.report import jobview
    from slurm_gpu.slurm.jobacct import check_job_id

    app = ctx.find_object(AppContext) or AppContext(None)
    jid = check_job_id(job_id)
    cfg = app.config
    try:
        view = jobview.load(cfg, _backend(app), jid, jobview.fallback_for(cfg, db, password_file))
    except jobview.JobViewError as answer:
        if not answer.plain:
            raise  # an error: the group prints it (slurm-gpu: error: ...)
        click.echo(answer.message, err=True)
        if answer.hint:
            click.echo(f"hint: {answer.hint}", err=True)
        raise click.exceptions.Exit(int(answer.exit_code)) from None
    if fmt == "json":
        click.echo(json.dumps(jobview.to_json(view), indent=2))
        return
    if fmt == "html":
        from slurm_gpu.report.html import render_job
        click.echo(render_job(view), nl=False)
        return
    width = shutil.get_terminal_size((120, 24)).columns  # 120 when piped: no terminal to fit
    click.echo(jobview.render_text(view, cfg, width=width, color=_color(no_color)), nl=False)
