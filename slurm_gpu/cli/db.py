"""`slurm-gpu db check|ingest`: the node database for admins."""
from __future__ import annotations

import os
import sys

import click

from slurm_gpu.errors import ExitCode, SlurmGpuError


@click.group()
def db():
    """Inspect and repair this node's usage database."""


_db_opt = click.option("--db", "--database", "database", metavar="PATH",
                       help="Database file (default: store.database; %n there is the short host name outside a hook).")
_spool_opt = click.option("--spool", metavar="DIR", help="Spool directory (default: store.spool_dir).")


def _names(names, limit=10):
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


@db.command()
@_db_opt
@_spool_opt
@click.pass_obj
def check(app, database, spool):
    """Verify the database's integrity, schema and ownership, and report the spool.

    Reported: records waiting in the spool, claims stranded by an ingest that died,
    temp files of a writer that died, unreadable files (*.bad) and files in
    <spool>/quarantine/ (refused by the database, or not root's own: never ingested).

    Exit 0 when healthy with an empty spool, 1 otherwise.
    """
    from slurm_gpu.store.diagnose import DatabaseProblem, database_problems
    from slurm_gpu.store.maintenance import table_counts
    from slurm_gpu.store.node import Store
    st = Store.from_config(app.config, database, spool)
    if not os.path.lexists(st.path):
        # Not corruption: nothing has written here yet, or %n / --db points elsewhere.
        problems = [DatabaseProblem(f"no database at {st.path}", _missing_hint(app, database))]
    else:
        problems = database_problems(st.path)
    sp = st.spool_status()
    if not problems:
        counts = table_counts(st.path)
        click.echo(f"{st.path}: ok (" + ", ".join(f"{t} {n}" for t, n in counts.items()) + ")")
    for p in problems:
        click.echo(p.text if st.path in p.text else f"{st.path}: {p.text}")
    _say_spool(sp, st.spool_dir)
    hints = [p.hint for p in problems if p.hint] + ([sp.hint] if sp.hint else [])
    if sp.bad or sp.quarantined:
        hints.append("look at the files; delete them, or move a file you checked and fixed back into the spool "
                     "(root-owned, mode 600)")
    for h in dict.fromkeys(hints):
        click.echo(f"hint: {h}", err=True)
    unhealthy = (problems or sp.problem or sp.waiting or sp.stale_claims or sp.orphaned_tmp or sp.bad
                 or sp.quarantined)
    sys.exit(int(ExitCode.UNHEALTHY if unhealthy else ExitCode.OK))


def _say_spool(sp, spool_dir) -> None:
    """One line for each kind of spool file that needs an admin (or an ingest)."""
    if sp.problem:
        click.echo(f"spool: {sp.problem}")
    if sp.waiting:
        click.echo(f"{len(sp.waiting)} record(s) waiting in {spool_dir}: run `slurm-gpu db ingest`")
    if sp.stale_claims:
        click.echo(f"{len(sp.stale_claims)} stranded claim(s) in {spool_dir} (the ingest that claimed them is gone): "
                   f"{_names(sp.stale_claims)}; `slurm-gpu db ingest` puts them back and ingests them")
    if sp.live_claims:
        click.echo(f"{len(sp.live_claims)} record(s) being ingested right now (claimed by a running process)")
    if sp.orphaned_tmp:
        click.echo(f"{len(sp.orphaned_tmp)} spool file(s) whose writer died before finishing: {_names(sp.orphaned_tmp)}; "
                   "`slurm-gpu db ingest` checks and ingests them")
    if sp.bad:
        click.echo(f"{len(sp.bad)} unreadable spool file(s) kept as *.bad in {spool_dir}: {_names(sp.bad)}")
    if sp.quarantined:
        click.echo(f"{len(sp.quarantined)} quarantined spool file(s) in {spool_dir}/quarantine (never ingested):")
        for name, why in sp.quarantined[:20]:
            click.echo(f"  {name}: {why}")
        if len(sp.quarantined) > 20:
            click.echo(f"  ... (+{len(sp.quarantined) - 20})")


def _missing_hint(app, database) -> str:
    hint = "it is created by the first hook run or `slurm-gpu db ingest`"
    if not database and "%n" in str(app.config.store.database):
        from slurm_gpu.config import node_name
        hint += (f"; store.database contains %n, which outside a hook is {node_name()!r} ($SLURMD_NODENAME, "
                 "else the short host name): give --db PATH or set SLURMD_NODENAME to look at another node's")
    return hint


@db.command()
@_db_opt
@_spool_opt
@click.option("--from-log", "from_log", metavar="FILE", type=click.Path(dir_okay=False),
              help="Also replay the records a hook could write nowhere else: the `record-lost-to-log` lines of a "
                   "hook log, the fallback log (/var/log/slurm-gpu/hooks-error.log) or syslog. Replaying twice "
                   "adds nothing.")
@click.pass_obj
def ingest(app, database, spool, from_log):
    """Write spooled records into the database (creating or migrating it when needed).

    Stranded claims of an ingest that died are put back first; a file the database refuses
    or that is not root's own is moved to <spool>/quarantine/ and the others go on.
    """
    from slurm_gpu.store.diagnose import describe_error
    from slurm_gpu.store.node import Store
    st = None
    replay_problems = []
    try:
        st = Store.from_config(app.config, database, spool)
        if from_log:
            done, found, replay_problems = _replay(st, from_log)
            click.echo(f"{done} record(s) replayed from {from_log} ({found} found)")
            for p in replay_problems:
                click.echo(f"problem: {p}", err=True)
        rep = st.ingest()
        if rep.refused is not None:
            raise rep.refused
    except SlurmGpuError:
        raise  # the group prints it and exits with its code
    except Exception as e:  # sqlite3.Error, OSError: name it, no traceback
        where = st.path if st is not None else "the database"
        click.echo(f"slurm-gpu: error: cannot open {where}: {describe_error(e)}", err=True)
        click.echo("hint: check `slurm-gpu db check`; move a corrupt database aside", err=True)
        sys.exit(int(ExitCode.STORE_ERROR))
    click.echo(f"ingested {rep.done} of {rep.total} spooled record(s) into {st.path}"
               + (f" ({rep.reclaimed} stranded claim(s) put back)" if rep.reclaimed else "")
               + (f"; {rep.left} still waiting" if rep.left else ""))
    for p in rep.problems:
        click.echo(f"problem: {p}", err=True)
    failed = bool(rep.problems) or bool(replay_problems)
    sys.exit(int(ExitCode.OK if not failed else ExitCode.STORE_ERROR))


def _replay(st, path):
    from slurm_gpu.errors import InputError
    from slurm_gpu.store.diagnose import records_from_log
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            found = list(records_from_log(f))
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}", "give the hook log file (log.file) or the fallback log")
    records = [rec for _, rec in found if isinstance(rec, dict)]
    problems = [f"{path}:{n}: record does not parse: {rec}" for n, rec in found if not isinstance(rec, dict)]
    rep = st.replay(records)
    return rep.done, len(found), problems + rep.problems


@db.command("backup")
@_db_opt
@click.argument("dest", metavar="DEST")
@click.pass_obj
def backup(app, database, dest):
    """Copy the database to DEST safely, records still in its -wal file included.

    One consistent snapshot through SQLite's backup API, read-only (hooks may be writing);
    DEST is one self-contained file (no -wal needed) that `slurm-gpu report --db` reads.
    Gather node databases for a report this way, not with cp or rsync: a copy without the
    -wal file misses records.  DEST is never overwritten.
    """
    from slurm_gpu.store.backup import copy_database
    path = database or app.config.path_value("store", "database")
    n = copy_database(path, dest)
    click.echo(f"copied {path} to {dest} ({n} GPU records)")


def _register_push() -> None:
    from slurm_gpu.cli.central import push
    db.add_command(push)


_register_push()
