"""The report's group keys (slurm_gpu/groupkeys.py): every table that names `--by` keys is derived
from the catalog, and the databases agree with it: the covering indexes a fresh node database and a
fresh central server have, the columns the rollup tables keep.  Before it, six lists in six modules
named the keys and had to be kept equal by hand (issue 37, item 2)."""
from __future__ import annotations

import dataclasses
import re
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_gpu import groupkeys as G
from slurm_gpu.central import rollups as CR
from slurm_gpu.cli.report import report_cmd
from slurm_gpu.report import query, rollup, tables
from slurm_gpu.report import sql as S
from slurm_gpu.store import schema
from slurm_gpu.store.node import Store

DOCS = Path(G.__file__).parent.parent / "docs"
NAMES = tuple(k.name for k in G.KEYS)


def test_the_catalog_is_consistent():
    assert len(set(NAMES)) == len(NAMES) and len({k.column for k in G.KEYS}) == len(G.KEYS)
    assert not set(NAMES) & set(G.TIME_KEYS)
    bits = [k.null_bit for k in G.KEYS if k.null_bit]
    assert len(set(bits)) == len(bits) and all(b & (b - 1) == 0 for b in bits), bits  # one bit each
    fields = {f.name for f in dataclasses.fields(query.Query)}
    assert all(k.filter_field in fields for k in G.KEYS if k.filter_field)


def test_the_report_modules_derive_their_keys_from_the_catalog():
    assert query.GROUP_KEYS == {k.name: f'"{k.column}"' for k in G.KEYS}
    assert query.BY_CHOICES == NAMES + G.TIME_KEYS and query.TIME_KEYS == G.TIME_KEYS
    assert rollup._KEY_COLUMN == {k.name: k.column for k in G.KEYS}
    assert tables.ONE_GROUP_PER_JOB == {k.name for k in G.KEYS if k.one_per_job}
    assert schema.REPORT_INDEX_KEYS == tuple(k.column for k in G.KEYS if k.indexed)
    assert CR.GROUP_COLUMNS == tuple(k.column for k in sorted(G.KEYS, key=lambda k: k.null_bit) if k.null_bit)
    assert CR.NULL_BITS == {k.column: k.null_bit for k in G.KEYS if k.null_bit}


def test_the_total_counts_jobs_only_where_groups_never_share_one():
    raw = dict.fromkeys(tables.SUM_FIELDS + ("peak_bytes",)) | {"jobs": 3, "alloc_s": 3600.0}
    for by in [(k,) for k in query.BY_CHOICES] + [("user", "account"), ("account", "node"), ("cluster", "month")]:
        shared = any(not k.one_per_job for k in G.KEYS if k.name in by) or any(k in G.TIME_KEYS for k in by)
        assert (tables.total([raw, raw], by)["jobs"] is None) == shared, by


def test_the_reports_filters_are_the_catalogued_ones():
    """report/sql.py filters the records by the Query fields the catalog names, on the key's column."""
    for k in G.KEYS:
        if k.filter_field:
            assert S.filters(query.Query(**{k.filter_field: ("x",)}), {}) == [f'"{k.column}" IN (:{k.column}0)'], k
    every = query.Query(**{k.filter_field: ("x",) for k in G.KEYS if k.filter_field})
    assert len(S.filters(every, {})) == sum(1 for k in G.KEYS if k.filter_field)


def test_the_rollups_null_bits_are_the_ones_their_cells_keep():
    """Every rollup cell on a server holds these bits in `nulls` (central/rollups.py, schema v4): a
    renumbered bit would read another column's NULLs.  A new group column of the rollups is a schema
    change of its own, never a new bit here alone."""
    assert CR.NULL_BITS == {"user": 1, "account": 2, "partition": 4, "gpu_model": 8}


def test_a_grouping_the_rollups_do_not_keep_is_read_from_the_records(monkeypatch):
    """A key added to the catalog alone (docs/architecture.md, "Add a report grouping") is in no
    rollup table: the server's report reads the records for it, as for any grouping the rollups cannot answer."""
    monkeypatch.setattr(G, "KEYS", G.KEYS + (G.GroupKey("qos", "qos"),))
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE meta (name, value)")
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("rollup_zone", "utc"), ("schema_version", "11"),
                                                       ("rollup_idle_threshold_pct", repr(CR.IDLE_THRESHOLD_PCT))])
    conn.execute("CREATE TABLE rollup_day (day)")
    src = SimpleNamespace(query=query.Query(), conn=conn)
    assert rollup.plan(src, ("qos", "month")).reason == "the rollups keep no qos"
    assert rollup.plan(src, ("user", "node", "gpu-model", "month")).reason == "the rollups are empty"  # (kept: on to the days)


def test_docs_and_help_name_every_key():
    assert f"`--by {'|'.join(query.BY_CHOICES)}`" in (DOCS / "report.md").read_text(), \
        "docs/report.md, 'Grouping and filters': the --by list"
    by = next(p for p in report_cmd.params if p.name == "by")
    named = re.findall(r"[\w-]+", by.help or "")
    assert all(k in named for k in query.BY_CHOICES), ("slurm-gpu report --by's help", by.help)


def test_a_fresh_node_database_has_the_catalogued_covering_indexes(tmp_path):
    st = Store(str(tmp_path / "usage.db"), str(tmp_path / "spool"))
    st.connect()  # made and migrated to the current version
    st.close()
    conn = sqlite3.connect(str(tmp_path / "usage.db"))
    try:
        columns = {r[1] for r in conn.execute("PRAGMA table_info(job_gpus)")}
        indexed = {}
        for row in conn.execute("PRAGMA index_list(job_gpus)"):
            if row[1].startswith("job_gpus_by_"):
                indexed[row[1]] = [r[2] for r in conn.execute(f"PRAGMA index_info({row[1]})")]
    finally:
        conn.close()
    assert {k.column for k in G.KEYS} <= columns
    assert {name: cols[0] for name, cols in indexed.items()} == {f"job_gpus_by_{c}": c for c in G.INDEXED}
    assert all(cols[1:] == list(schema.COVERED) for cols in indexed.values()), indexed


@pytest.mark.central
@pytest.mark.once_on("trixie")
def test_a_fresh_central_server_has_the_catalogued_indexes_and_rollup_columns(mariadb_server, tmp_path):
    from test_central import Site
    site = Site(mariadb_server, tmp_path)
    site.init()

    def columns(table):
        return {r[0] for r in site.rows("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                                        f"DATABASE() AND table_name = '{table}'")}

    assert {k.column for k in G.KEYS} <= columns("job_gpus") and {k.column for k in G.KEYS} <= columns("job_gpus_current")
    first = site.rows("SELECT index_name, column_name FROM information_schema.statistics WHERE table_schema = "
                      "DATABASE() AND table_name = 'job_gpus' AND index_name LIKE 'job\\_gpus\\_by\\_%' AND seq_in_index = 1")
    assert dict(map(tuple, first)) == {f"job_gpus_by_{c}": c for c in G.INDEXED}
    for table in ("rollup_day", "rollup_day_node", *CR.COARSE):
        assert rollup._carried(table) <= columns(table), table
