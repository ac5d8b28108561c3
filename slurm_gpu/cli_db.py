"""`slurm-gpu db check|ingest|info`: the node database for admins."""
from __future__ import annotations

import sys

import click

from .cli import fail
from .errors import ExitCode, SlurmGpuError


@click.group()
def db():
    """Inspect and repair this node's usage database."""


def _store(app, database, spool):
    from .store import Store
    cfg = app.config
    return Store(database or cfg.path_value("store", "database"), spool or cfg.path_value("store", "spool_dir"),
                 cfg.get("store", "busy_timeout_s"))


_db_opt = click.option("--database", metavar="PATH", help="Database file (default: store.database).")
_spool_opt = click.option("--spool", metavar="DIR", help="Spool directory (default: store.spool_dir).")


@db.command()
@_db_opt
@_spool_opt
@click.pass_obj
def check(app, database, spool):
    """Verify the database's integrity and schema, and report spooled records.

    Exit 0 when healthy with an empty spool, 1 otherwise.
    """
    from .store import integrity_check
    try:
        st = _store(app, database, spool)
    except SlurmGpuError as e:
        raise fail(e)
    problems = integrity_check(st.path)
    waiting = st.spooled()
    bad = [p for p in _listdir(st.spool_dir) if p.endswith(".bad")]
    if not problems:
        counts = _counts(st.path)
        click.echo(f"{st.path}: ok (" + ", ".join(f"{t} {n}" for t, n in counts.items()) + ")")
    for p in problems:
        click.echo(f"{st.path}: {p}")
    if waiting:
        click.echo(f"{len(waiting)} record(s) waiting in {st.spool_dir}: run `slurm-gpu db ingest`")
    if bad:
        click.echo(f"{len(bad)} unreadable spool file(s) kept as *.bad in {st.spool_dir}")
    if problems:
        click.echo("hint: a corrupt database keeps spooling records; move it aside (records are kept in the spool),"
                   " then `slurm-gpu db ingest` creates a fresh one", err=True)
    sys.exit(int(ExitCode.UNHEALTHY if problems or waiting or bad else ExitCode.OK))


def _listdir(d):
    import os
    try:
        return os.listdir(d)
    except OSError:
        return []


def _counts(path):
    # sqlite-utils is fine here: this is an admin command, not the hook path.
    import sqlite3

    import sqlite_utils
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        dbh = sqlite_utils.Database(conn)
        return {t: dbh[t].count for t in dbh.table_names() if not t.startswith("sqlite_")}
    finally:
        conn.close()


@db.command()
@_db_opt
@_spool_opt
@click.pass_obj
def ingest(app, database, spool):
    """Write spooled records into the database (creating or migrating it when needed)."""
    try:
        st = _store(app, database, spool)
        n_before = len(st.spooled())
        done, problems = st.ingest_spool()
    except SlurmGpuError as e:
        raise fail(e)
    except Exception as e:  # sqlite3.Error, OSError: name it, no traceback
        click.echo(f"slurm-gpu: error: cannot open {st.path}: {e}", err=True)
        click.echo("hint: check `slurm-gpu db check`; move a corrupt database aside", err=True)
        sys.exit(int(ExitCode.STORE_ERROR))
    click.echo(f"ingested {done} of {n_before} spooled record(s) into {st.path}")
    for p in problems:
        click.echo(f"problem: {p}", err=True)
    sys.exit(int(ExitCode.OK if not problems else ExitCode.STORE_ERROR))
