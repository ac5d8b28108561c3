"""Rollups on the central server (central/rollups.py, report/rollup.py): a report from them equals the
report from the records, byte for byte, against a real MariaDB; apply_batch keeps them exact
through updates and withdrawals; a migration builds them from the records there; a rebuild
finds nothing to correct, or says what it corrected.
"""
from __future__ import annotations

import itertools
import os
import random
import time

import pytest
from test_central import Site, cli, cli_env

from slurm_gpu.central import rollups as R
from slurm_gpu.central import schema as CS
from slurm_gpu.central import server as C
from slurm_gpu.report import reports as Q
from slurm_gpu.report import sql as S
from slurm_gpu.report.calendar import calendar
from slurm_gpu.report.central import CentralSource
from slurm_gpu.report.query import Query
from slurm_gpu.report.sources import FileSource
from slurm_gpu.store.node import Store

pytestmark = [pytest.mark.central, pytest.mark.once_on("trixie")]

BERLIN = {"TZ": "Europe/Berlin"}
T0 = 1_767_225_600  # 2026-01-01T00:00:00Z
NODES = ("n1", "n2", "n3")


@pytest.fixture(scope="module")
def server(mariadb_server):
    """The session's MariaDB (tests/conftest.py); every test takes a database of its own there."""
    return mariadb_server


def _job(rnd: random.Random, j: int, partial: int = 0, shift: float = 0.0):
    node = NODES[j % 3]
    start = float(T0 + rnd.randrange(0, 365 * 86400 - 7 * 86400))
    if rnd.random() < 0.15:  # just before a midnight (UTC or Berlin), so it crosses it
        start = float(T0 + rnd.randrange(1, 364) * 86400 - rnd.choice((600, 3600 + 300, 7200 + 60)))
    dur = float(rnd.choice((30, 601, 3600, 5 * 3600, 26 * 3600, 3 * 86400 + 17))) + rnd.choice((0.0, 0.25))
    gpus = rnd.choice((1, 2, 4))
    user = rnd.choice(("alice", "bob", "Carol", "dave\u00e9", None))
    job = {"cluster": rnd.choice(("c", "c", "d")), "job_id": 5000 + j, "restart_count": rnd.choice((0, 0, 1)),
           "node": node, "user": user, "uid": 1, "account": rnd.choice(("physics", "chem", None)),
           "partition": rnd.choice(("gpu", "long")), "gpu_count": gpus, "start_time": start - shift,
           "end_time": start + dur, "exit_code": "0"}
    rows = []
    for i in range(gpus):
        util = rnd.choice((None, 0.0, 3.0, 47.0, 99.5, 100.0, 131.0))
        rows.append({k: job[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account",
                                         "partition", "start_time", "end_time")} | {
            "gpu_uuid": f"GPU-{node}-{i}", "gpu_index": i,
            "gpu_model": rnd.choice(("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", None)),
            "duration_s": job["end_time"] - job["start_time"],
            "energy_j": None if util is None else rnd.uniform(1e3, 3e6),  # NVML: mJ, fractional J
            "gpu_util_mean_pct": util, "mem_util_mean_pct": None if util is None else util / 4,
            "max_memory_bytes": rnd.choice((None, 1 << 30, 80 << 30)), "process_count": 1, "partial": partial})
    return {"kind": "job_end", "job": dict(job, partial=partial), "gpus": rows}


def _drain(rec):
    j = rec["job"]
    return {"kind": "drain", "drain": {"time": j["end_time"], "node": j["node"], "source": "prolog",
                                       "cluster": j["cluster"], "job_id": j["job_id"],
                                       "restart_count": j["restart_count"], "reason": "slurm-gpu: x", "ok": 1,
                                       "outcome": "drained"}}


def _year(seed: int = 11, n: int = 900):
    """A year of jobs on three nodes: (first push, what changes after it: completions, withdrawals)."""
    rnd = random.Random(seed)
    first, later = {n_: [] for n_ in NODES}, {n_: [] for n_ in NODES}
    for j in range(n):
        kind = rnd.random()
        if kind < 0.06:  # partial, completed later by a record that starts earlier (peak memory may drop)
            state = rnd.getstate()
            rec = _job(rnd, j, partial=1)
            rnd.setstate(state)
            done = _job(rnd, j, shift=float(60 + j * 37 % 20000))
            for g in done["gpus"]:
                g["max_memory_bytes"] = 1 << 20
            first[rec["job"]["node"]].append(rec)
            later[rec["job"]["node"]].append(done)
        elif kind < 0.10:  # partial, withdrawn later (the prolog had failed: the job never ran there)
            rec = _job(rnd, j, partial=1)
            first[rec["job"]["node"]].append(rec)
            later[rec["job"]["node"]].append(_drain(rec))
        else:
            rec = _job(rnd, j)
            first[rec["job"]["node"]].append(rec)
    return first, later


@pytest.fixture(scope="module")
def year(server, tmp_path_factory):
    """The year in three node files and on a server whose rollups cut Berlin's days."""
    tmp = tmp_path_factory.mktemp("year")
    s = Site(server, tmp)
    _init(s, env=BERLIN, extra=("--rollup-tz", "local"))
    first, later = _year()
    files = []
    for node in NODES:
        st = Store(str(tmp / f"{node}.db"), str(tmp / f"spool-{node}"))
        for batch in (first[node], later[node]):
            for rec in batch:
                st.write(rec)
            r = s.push("--db", str(tmp / f"{node}.db"), "--batch-size", "97")
            assert r.returncode == 0, r.stderr
        st.close()
        files.append(str(tmp / f"{node}.db"))
    return s, files


def _init(s: Site, **kwargs) -> None:
    """`central init` with one writer account for every node of both clusters of the year."""
    s.init(writers="*", clusters=("c", "d"), group=f"{s.writer}_all", **kwargs)
    s.reporter_config = s.write_config(s.reporter, s.reporter_pw, name="reporter.toml")


def _render(table, src, fmt):
    from slurm_gpu.cli.report import _render as render
    return render({"fmt": fmt}, table, src)


def _both(s, files, query, by):
    """Every format of the summary from the node files and from the server: (node texts, server texts, plan)."""
    with FileSource(files, query) as src:
        table = Q.summary(src, by)
        a = [_render(table, src, f) for f in ("table", "csv", "json", "markdown")] + [table.notes]
    central = C.Central(C.parse_url(s.server.url(s.reporter, s.db)), s.reporter_pw, 30)
    with CentralSource(central, query) as src:
        table = Q.summary(src, by)
        b = [_render(table, src, f) for f in ("table", "csv", "json", "markdown")] + [table.notes]
        return a, b, src.plan


def _diff(a: str, b: str) -> str:
    import difflib
    return "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), "records", "rollups", n=0, lineterm=""))


PLAIN = ("user", "account", "partition", "node", "gpu-model", "cluster")
COMBOS = [c for n in range(1, 3) for c in itertools.combinations(PLAIN, n)] + [PLAIN[:3], ("node", "gpu-model", "user")]
WINDOWS = {
    "open": (None, None),
    "edges": (T0 + 78 * 86400 + 5 * 3600 + 1800.5, T0 + 305 * 86400 + 17 * 3600),  # over both DST changes
}


@pytest.fixture
def berlin():
    old = os.environ.get("TZ")
    os.environ["TZ"] = "Europe/Berlin"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


@pytest.mark.parametrize("window", sorted(WINDOWS))
@pytest.mark.parametrize("unit", [None, "day", "week", "month"])
def test_a_report_from_the_rollups_equals_the_report_from_the_records_byte_for_byte(year, berlin, window, unit):
    s, files = year
    since, until = WINDOWS[window]
    for by in COMBOS:
        keys = by + ((unit,) if unit else ())
        for tz in ("local", "utc"):
            a, b, plan = _both(s, files, Query(since_s=since, until_s=until, tz=tz), keys)
            assert b == a, (keys, tz, plan, _diff(a[1], b[1]))
            # The rollups cut Berlin's days: only a --tz utc calendar must read the records.
            assert plan.startswith("rollups") == (tz == "local" or unit is None), (keys, tz, plan)
            if window == "edges" and plan.startswith("rollups"):
                assert "2 partial day(s)" in plan
            if plan.startswith("rollups"):
                coarse = _period_table(keys, unit)
                assert ("month(s) of" in plan or "week(s) of" in plan) == (coarse is not None), (keys, plan)
                assert coarse is None or coarse in plan, (keys, plan)
                assert ("day(s) of rollup_partition_day" in plan) == _by_partition(keys), (keys, plan)


def _by_partition(keys):
    """A summary by `keys` (no filters) reads rollup_partition_day (and no other table's cells)."""
    return not set(keys) & {"user", "account", "node"}


def _period_table(keys, unit):
    """The week or month table a summary by `keys` (no filters) reads for its whole weeks or months."""
    if unit == "day" or _by_partition(keys):
        return None
    if "node" not in keys:
        return "week(s) of rollup_week" if unit == "week" else "month(s) of rollup_month"
    if set(keys) & {"user", "account", "partition"} or unit == "week":
        return None
    return "month(s) of rollup_node_month"


def test_filters_and_a_narrow_window_use_the_rollups_and_equal_the_records(year, berlin):
    s, files = year
    day = T0 + 100 * 86400 - 7200  # Berlin's midnight (summer time)
    for q, by in ((Query(users=("alice", "Carol"), tz="local"), ("account", "month")),
                  (Query(nodes=("n2",), accounts=("chem",), tz="local"), ("user", "day")),
                  (Query(since_s=day, until_s=day + 3 * 86400, clusters=("d",), tz="local"), ("partition", "day")),
                  (Query(since_s=day + 3600, until_s=day + 7200, tz="local"), ("user",)),
                  (Query(idle_threshold_pct=10.0, tz="local"), ("user",))):
        a, b, plan = _both(s, files, q, by)
        assert b == a, (q, by, plan)
        rolled = q.idle_threshold_pct == R.IDLE_THRESHOLD_PCT and q.until_s != day + 7200
        assert plan.startswith("rollups") == rolled, (q, plan)


def test_report_explain_says_which_plan_ran(year):
    s, files = year
    url = s.server.url(s.reporter, s.db)
    cfg = str(s.reporter_config)
    r = cli_env(BERLIN, "--config", cfg, "report", "--by", "user", "--db", url, "--explain", "--format", "csv")
    assert r.returncode == 0 and "slurm-gpu: plan: rollups: " in r.stderr, r.stderr
    r = cli_env(BERLIN, "--config", cfg, "report", "--by", "user", "--db", url, "--explain", "--idle-threshold", "9")
    assert "slurm-gpu: plan: records (not the rollups: --idle-threshold 9 is not the rollups' 5.0)" in r.stderr
    r = cli_env(BERLIN, "--config", cfg, "report", "--by", "user", "--db", files[0], "--explain")
    assert "slurm-gpu: plan: " in r.stderr and "rollups" not in r.stderr


def test_pushes_with_updates_and_withdrawals_leave_rollups_a_rebuild_finds_exact(year):
    s, _files = year
    assert s.rows("SELECT COUNT(*) FROM job_gpus WHERE withdrawn = 1") != [["0"]]
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rollup_day: 0 missing, 0 extra, 0 different" in r.stdout
    assert "rollups exact" in r.stderr


def test_a_rebuild_corrects_rollups_that_drifted_and_says_so(server, tmp_path):
    s = Site(server, tmp_path)
    _init(s)
    first, _later = _year(seed=3, n=60)
    for rec in first["n1"]:
        s.store.write(rec)
    assert s.push().returncode == 0
    s.server.sql("UPDATE rollup_day SET alloc_s = alloc_s + 1 LIMIT 2; DELETE FROM rollup_jobs LIMIT 1; "
                 "UPDATE rollup_month SET jobs_later = jobs_later + 1 LIMIT 1; "
                 "UPDATE rollup_node_month SET peak_bytes = 7 LIMIT 1; DELETE FROM rollup_node_day LIMIT 1; "
                 "UPDATE rollup_partition_day SET jobs_first = jobs_first + 1 LIMIT 3;", s.db)
    since = time.strftime("%Y-%m-%d", time.gmtime(T0))
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild", "--since", since)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rollup_day: 0 missing, 0 extra, 2 different" in r.stdout
    assert "rollup_jobs: 1 missing, 0 extra, 0 different" in r.stdout
    assert "rollup_month: 0 missing, 0 extra, 1 different" in r.stdout
    assert "rollup_node_day: 1 missing, 0 extra, 0 different" in r.stdout
    assert "rollup_node_month: 0 missing, 0 extra, 1 different" in r.stdout
    assert "rollup_week: 0 missing, 0 extra, 0 different" in r.stdout
    assert "rollup_partition_day: 0 missing, 0 extra, 3 different" in r.stdout
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr


def test_migrating_a_server_with_records_builds_its_rollups(server, tmp_path):
    s = Site(server, tmp_path)
    srv = C.Central(C.parse_url(s.server.url(s.admin, s.db)), s.admin_pw, 30)
    before = 3  # the schema before the rollups (v4), as an older slurm-gpu left it
    for v in range(before):
        for stmt in C.MIGRATIONS[v]:
            srv.execute(stmt)
    srv.execute("INSERT INTO meta VALUES ('schema_version', %s)", (str(before),))
    srv.commit()
    srv.close()
    _init(s)
    # Records pushed to the old schema: apply_batch without rollups.
    first, _later = _year(seed=5, n=80)
    admin = C.Central(C.parse_url(s.server.url(s.admin, s.db)), s.admin_pw, 30)
    admin.execute(CS._procedure())
    admin.close()
    for rec in first["n2"]:
        s.store.write(rec)
    assert s.push().returncode == 0
    s.server.sql("DELETE FROM rollup_day; DELETE FROM rollup_day_node; DELETE FROM rollup_jobs; "
                 f"DELETE FROM meta WHERE name LIKE 'rollup%'; UPDATE meta SET value = '{before}' "
                 "WHERE name = 'schema_version'; DROP TABLE rollup_days;", s.db)
    r = cli("--config", str(s.config), "central", "init", "--progress", "--writer", s.writer, "--reporter", s.reporter)
    assert r.returncode == 0, r.stderr
    assert f"schema migrated from {before} at version {C.SCHEMA_VERSION}" in r.stderr
    assert "building rollups" in r.stderr  # the progress bar, asked for
    assert s.rows("SELECT COUNT(*) > 0 FROM rollup_day") == [["1"]]
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr


def test_the_rollups_rules_are_the_reports(monkeypatch):
    assert (R.UTIL, R.MEM_UTIL, R.OUT_OF_RANGE) == (S.UTIL, S.MEM_UTIL, S.OUT_OF_RANGE)
    assert R.VALID == (S.valid_sql().replace("+", "").replace(":tmin", repr(S.TIME_MIN_S))
                       .replace(":tmax", repr(S.TIME_MAX_S)).replace(":maxdur", repr(S.MAX_RECORD_S)))
    # The rollups' days are the report calendar's days, in Berlin across both DST changes.
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        days = [d for d in R.day_rows(utc=False) if d[1].startswith("2026")]
        cal = calendar(days[0][2], days[-1][3], "day", "local")
        assert [(a, b, c) for _, c, a, b in days] == cal
        assert sorted({b - a for _, _, a, b in days}) == [82800.0, 86400.0, 90000.0]
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def _one(job_id: int, node: str, start: float, dur: float, models=("H100",), restart: int = 0, partial: int = 0,
         user: str = "alice", partition: str = "gpu"):
    """One job's record on one node: a GPU per model given."""
    job = {"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "user": user, "uid": 1,
           "account": "physics", "partition": partition, "gpu_count": len(models), "start_time": start,
           "end_time": start + dur, "exit_code": "0", "partial": partial}
    rows = [{k: job[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account", "partition",
                                 "start_time", "end_time")} | {
        "gpu_uuid": f"GPU-{node}-{i}", "gpu_index": i, "gpu_model": m, "duration_s": dur, "energy_j": 1000.0 + i,
        "gpu_util_mean_pct": 50.0, "mem_util_mean_pct": 10.0, "max_memory_bytes": (i + 1 + job_id % 7) << 30,
        "process_count": 1, "partial": partial} for i, m in enumerate(models)]
    return {"kind": "job_end", "job": job, "gpus": rows}


D = 86400
# Jobs that a count summed over days or groups would count twice (or miss), by node: (first push, second push).
TRICKY = {
    "n1": ([_one(9001, "n1", T0 + 10 * D - 3600, 2 * D),  # over the window's start (and two midnights)
            _one(9002, "n1", T0 + 20 * D + 100, 3600),  # on two nodes: one job in the total row
            _one(9003, "n1", T0 + 30 * D + 100, 7200, models=("H100", "A100")),  # two models on one node
            _one(9004, "n1", T0 + 40 * D + 100, 3600),  # requeued with a whole day between its runs
            _one(9004, "n1", T0 + 42 * D + 100, 3600, restart=1),
            _one(9005, "n1", T0 + 50 * D + 100, 3600, partial=1),  # withdrawn: never ran
            _one(9006, "n1", T0 + 60 * D + 100, 3 * D, partial=1),  # partial, completed as another partition
            _one(9007, "n1", T0 + 70 * D - 600, 1200, user="bob")],  # across midnight into a partial day
           [_one(9006, "n1", T0 + 59 * D + 100, 5 * D, partition="long"),
            _drain(_one(9005, "n1", T0 + 50 * D + 100, 3600, partial=1))]),
    "n2": ([_one(9002, "n2", T0 + 20 * D + 100, 3600),
            _one(9008, "n2", T0 + 10 * D - 7200, 3 * D, models=("H100", "A100"), user="bob")], []),
}
TRICKY_WINDOWS = ((T0 + 10 * D, T0 + 80 * D), (T0 + 10 * D + 1800.0, T0 + 70 * D + 300.0), (T0 + 11 * D, T0 + 43 * D),
                  (T0 + 21 * D, T0 + 61 * D + 5.0), (None, None))


def test_job_counts_from_the_rollups_count_no_job_twice(server, tmp_path):
    s = Site(server, tmp_path)
    _init(s)
    files = _push_tricky(s, tmp_path)
    assert s.rows("SELECT COUNT(*) FROM job_gpus WHERE withdrawn = 1") == [["1"]]
    # The counts the pushes kept are the counts built from the records (each kind of job is there).
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
    # From a Sunday: its week began in January, whose month cell is left as it is (not rebuilt twice).
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild", "--since", "2026-02-01")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
    assert s.rows("SELECT day_kind, COUNT(DISTINCT job_id) FROM rollup_jobs GROUP BY day_kind") == \
        [["0", "3"], ["1", "4"], ["2", "3"], ["3", "1"]]  # 3: the two-node job's second node
    for since, until in TRICKY_WINDOWS:
        for by in (("user",), ("node",), ("partition",), ("gpu-model",), ("user", "node"), ("user", "gpu-model"),
                   ("user", "day"), ("user", "week"), ("node", "month"), ("month",), ("partition", "day")):
            for q in (Query(since_s=since, until_s=until, tz="utc"),
                      Query(since_s=since, until_s=until, tz="utc", nodes=("n1",)),
                      Query(since_s=since, until_s=until, tz="utc", nodes=("n1", "n2"))):
                a, b, plan = _both(s, files, q, by)
                assert b == a, (by, since, until, q.nodes, plan, _diff(a[1], b[1]))
                assert plan.startswith("rollups"), plan
    # The counts themselves, as a person would count: one job on two nodes is one job in the total.
    a, _b, _plan = _both(s, files, Query(since_s=T0 + 20 * D, until_s=T0 + 21 * D, tz="utc"), ("user",))
    assert a[1].splitlines()[1].split(",")[:2] == ["alice", "1"], a[1]


def _push_tricky(s: Site, tmp_path) -> list:
    files = []
    for node, pushes in TRICKY.items():
        st = Store(str(tmp_path / f"{node}.db"), str(tmp_path / f"spool-{node}"))
        for batch in pushes:
            for rec in batch:
                st.write(rec)
            assert s.push("--db", str(tmp_path / f"{node}.db")).returncode == 0
        st.close()
        files.append(str(tmp_path / f"{node}.db"))
    return files


def test_migrating_a_v5_server_builds_the_job_counts_from_its_rollups(server, tmp_path):
    s = Site(server, tmp_path)
    _init(s)
    files = _push_tricky(s, tmp_path)
    # The server as v5 left it: rollups without job counts, peaks or kinds.
    drop = ", ".join(f"DROP COLUMN {c}" for c in R.JOB_FIGURES)
    s.server.sql(f"ALTER TABLE rollup_day {drop}; ALTER TABLE rollup_day_node {drop}; "
                 "ALTER TABLE rollup_jobs DROP INDEX rollup_jobs_cell, DROP INDEX rollup_jobs_mixed, "
                 "DROP INDEX rollup_jobs_node_mixed, DROP COLUMN day_kind, DROP COLUMN node_kind, "
                 "ADD KEY rollup_jobs_day (day); UPDATE meta SET value = '5' WHERE name = 'schema_version';", s.db)
    # Not yet migrated: the report reads the records and says why.
    q = Query(since_s=TRICKY_WINDOWS[0][0], until_s=TRICKY_WINDOWS[0][1], tz="utc")
    a, b, plan = _both(s, files, q, ("user",))
    assert b == a and plan.startswith("records (not the rollups: schema v5's rollups have no job counts"), plan
    r = cli("--config", str(s.config), "central", "init", "--writer", s.writer, "--reporter", s.reporter)
    assert r.returncode == 0, r.stderr
    assert f"schema migrated from 5 at version {C.SCHEMA_VERSION}" in r.stderr
    assert s.rows("SELECT SUM(jobs_first) FROM rollup_day") == [["4"]]
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
    for since, until in TRICKY_WINDOWS[:2]:
        for by in (("user",), ("node", "day"), ("gpu-model", "month")):
            a, b, plan = _both(s, files, Query(since_s=since, until_s=until, tz="utc"), by)
            assert b == a and plan.startswith("rollups"), (by, plan, _diff(a[1], b[1]))


def test_migrating_a_v6_server_builds_its_month_and_node_rollups_from_its_days(server, tmp_path):
    s = Site(server, tmp_path)
    _init(s)
    files = _push_tricky(s, tmp_path)
    # The server as v6 left it: day tables only, rollup_days without months.
    s.server.sql("DROP TABLE rollup_month, rollup_week, rollup_node_day, rollup_node_month, rollup_partition_day; "
                 "ALTER TABLE rollup_days DROP INDEX rollup_days_month, DROP COLUMN month_day, "
                 "DROP INDEX rollup_days_week, DROP COLUMN week_day; "
                 "UPDATE meta SET value = '6' WHERE name = 'schema_version';", s.db)
    r = cli("--config", str(s.config), "central", "init", "--writer", s.writer, "--reporter", s.reporter)
    assert r.returncode == 0, r.stderr
    assert f"schema migrated from 6 at version {C.SCHEMA_VERSION}" in r.stderr
    for t, days in (("rollup_month", "rollup_day"), ("rollup_week", "rollup_day"), ("rollup_node_day", "rollup_day_node"),
                    ("rollup_node_month", "rollup_day_node"), ("rollup_partition_day", "rollup_day")):
        # (the node tables count a job per node)
        assert s.rows(f"SELECT SUM(jobs_first), SUM(records) FROM {t}") == \
            s.rows(f"SELECT SUM(jobs_first), SUM(records) FROM {days}"), t
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
    # Whole months (January to March) with whole and partial days at both edges.
    q = Query(since_s=T0 - 5 * D + 3600.0, until_s=T0 + 95 * D + 7200.0, tz="utc")
    for by, table in ((("user",), "rollup_month"), (("node",), "rollup_node_month"), (("node", "month"), "rollup_node_month"),
                      (("account", "month"), "rollup_month"), (("user", "node"), "rollup_day_node"),
                      (("account", "week"), "rollup_week"), (("partition", "week"), "rollup_partition_day"),
                      (("gpu-model", "month"), "rollup_partition_day")):
        a, b, plan = _both(s, files, q, by)
        assert b == a, (by, plan, _diff(a[1], b[1]))
        assert f" of {table} " in plan + " " and "2 partial day(s)" in plan, (by, plan)


def test_migrating_a_v9_server_builds_its_partition_rollups_from_its_days(server, tmp_path):
    s = Site(server, tmp_path)
    _init(s)
    files = _push_tricky(s, tmp_path)
    want = s.rows("SELECT day, \"partition\", gpu_model, nulls & 12, SUM(alloc_s), SUM(records), SUM(jobs_first), "
                  "SUM(jobs_later), MAX(peak_bytes) FROM rollup_day WHERE records <> 0 GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4")
    s.server.sql("DROP TABLE rollup_partition_day; UPDATE meta SET value = '9' WHERE name = 'schema_version';", s.db)
    q = Query(since_s=T0 - 5 * D + 3600.0, until_s=T0 + 95 * D + 7200.0, tz="utc")
    a, b, plan = _both(s, files, q, ("partition", "week"))
    assert b == a and "of rollup_week" in plan, plan  # (a v9 server: its week table)
    r = cli("--config", str(s.config), "central", "init", "--writer", s.writer, "--reporter", s.reporter)
    assert r.returncode == 0, r.stderr
    assert f"schema migrated from 9 at version {C.SCHEMA_VERSION}" in r.stderr
    assert s.rows("SELECT day, \"partition\", gpu_model, nulls, alloc_s, records, jobs_first, jobs_later, peak_bytes "
                  "FROM rollup_partition_day ORDER BY 1, 2, 3, 4") == want
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollup_partition_day: 0 missing, 0 extra, 0 different" in r.stdout, r.stdout + r.stderr
    for by in (("partition", "week"), ("gpu-model",), ("cluster", "day")):
        a, b, plan = _both(s, files, q, by)
        assert b == a and "of rollup_partition_day" in plan, (by, plan, _diff(a[1], b[1]))


def test_three_nodes_pushing_the_same_jobs_at_once_leave_rollups_a_rebuild_finds_exact(server, tmp_path):
    """Every job runs on all three nodes, so every push touches the cells, rollup_jobs rows and job
    counts the other two are changing: the nodes push at once, in small batches, twice (the second
    time completing partial records), and the rollups must be what a rebuild computes."""
    import re
    import subprocess
    import sys
    s = Site(server, tmp_path)
    _init(s)
    rnd = random.Random(5)
    first, later = {n: [] for n in NODES}, {n: [] for n in NODES}
    for j in range(120):
        start = float(T0 + rnd.randrange(0, 40) * D + rnd.choice((100, D - 900)))
        dur = float(rnd.choice((600, 3 * 3600, 2 * D)))
        models = rnd.choice((("H100",), ("H100", "A100")))
        partial = int(rnd.random() < 0.3)
        for node in NODES:
            first[node].append(_one(7000 + j, node, start, dur, models=models, user=rnd.choice(("alice", "bob")),
                                    partial=partial))
            if partial:
                later[node].append(_one(7000 + j, node, start - 300, dur + 300, models=models, user="alice"))
    stores = {n: Store(str(tmp_path / f"{n}.db"), str(tmp_path / f"spool-{n}")) for n in NODES}
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    for round_ in (first, later):
        for n in NODES:
            for rec in round_[n]:
                stores[n].write(rec)
        procs = [subprocess.Popen([sys.executable, "-m", "slurm_gpu.cli", "--config", str(s.writer_config), "db", "push",
                                   "--db", str(tmp_path / f"{n}.db"), "--batch-size", "5"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for n in NODES]
        outs = [p.communicate(timeout=300) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        again = sum(int(m) for out, _ in outs for m in re.findall(r"(\d+) batch\(es\) sent again", out))
        print(f"{again} batch(es) of {sum(len(r) for r in round_.values())} records' pushes sent again after a lock conflict")
    for st in stores.values():
        st.close()
    assert s.rows("SELECT COUNT(*) FROM job_gpus WHERE partial = 1") == [["0"]]
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr


def test_a_push_that_waits_on_a_rebuilds_locks_gives_up_in_time_with_one_line_and_keeps_its_records(server, tmp_path):
    """A transaction that holds the rollups (a rebuild, an admin's open session) makes a push's lock
    wait end within its read deadline: InnoDB's own 50 s would outlast central.timeout_s (5 s here),
    and the push would die as 'not answering'.  It sends the batch again, then stops with one line;
    the next push ships everything."""
    import pymysql
    s = Site(server, tmp_path)
    _init(s)
    s.store.write(_one(9101, "n1", T0 + 10 * D, 3600, partial=1))
    assert s.push().returncode == 0
    s.store.write(_one(9101, "n1", T0 + 10 * D - 3600, 7200))  # completed: its rows in rollup_jobs change
    holder = pymysql.connect(unix_socket=str(server.socket), user="root", database=s.db, autocommit=False)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM rollup_jobs WHERE job_id = 9101 FOR UPDATE")
        t0 = time.monotonic()
        r = s.push("--max-seconds", "3")
        took = time.monotonic() - t0
    finally:
        holder.rollback()
        holder.close()
    assert r.returncode == 5, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and "another transaction held the rows this one needed" in lines[0], r.stderr
    assert "nothing was lost" in lines[1], r.stderr
    print(f"the push gave up after {took:.1f} s")
    assert took < 3 + 2 + 2 + 4, took  # the budget, one lock wait (timeout_s / 2), a pause, start-up
    r = s.push()
    assert r.returncode == 0 and "job_gpus 1; left 0" in r.stdout, r.stdout + r.stderr
    assert s.rows("SELECT SUM(alloc_s) FROM rollup_day") == [["7200.00000000000000000000"]]


def _rows_read(server) -> int:
    """Rows the server has read so far (every session): index walks, scans, lookups."""
    import pymysql
    conn = pymysql.connect(unix_socket=str(server.socket), user="root")
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN ('Handler_read_next', 'Handler_read_rnd_next', "
                        "'Handler_read_key', 'Handler_read_prev')")
            return sum(int(v) for _, v in cur.fetchall())
    finally:
        conn.close()


def test_a_batch_whose_jobs_rows_leave_cells_reads_those_cells_not_the_clusters_rows(server, tmp_path):
    """A partial record completed later (or a job's GPUs split over two batches) takes its job's
    rows out of cells, whose peaks are then found again from the rows left there.  The server read
    every rollup_jobs, rollup_day and rollup_node_day row of the cluster for each such cell, and
    rollup_node_day and rollup_node_month end to end (~2.6 s for a batch of 2,000 such records on a
    100,000-record server): what the push reads must not grow with the server's other jobs."""
    s = Site(server, tmp_path)
    _init(s)
    for j in range(600):  # other jobs of the cluster, on 60 days
        s.store.write(_one(20000 + j, "n1", T0 + (j % 60) * D + 7200 + j, 3600, user=("alice", "bob")[j % 2]))
    s.store.write(_one(9301, "n1", T0 + 10 * D - 3600, 2 * D, partial=1))
    assert s.push().returncode == 0
    s.store.write(_one(9301, "n1", T0 + 10 * D - 7200, 2 * D + 3600))  # completed: its old rows leave their cells
    before = _rows_read(server)
    r = s.push()
    read = _rows_read(server) - before
    assert r.returncode == 0 and "job_gpus 1; left 0" in r.stdout, r.stdout + r.stderr
    print(f"the completing push read {read} rows")
    assert read < 2000, read  # 3 days' cells of one job; the cluster's rollup_jobs alone hold 600+ rows
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr


def test_records_of_more_than_nine_days_and_their_updates_leave_rollups_a_rebuild_finds_exact(server, tmp_path):
    """A push cuts a record of up to ~9 days into its days by their keys, and a longer one by the
    days' range: a job whose GPUs' records take both ways adds both to the same rows."""
    s = Site(server, tmp_path)
    _init(s)
    long_short = _one(9401, "n1", T0 + 5 * D + 100, 12 * D, models=("H100", "A100"), partial=1)
    long_short["gpus"][1]["end_time"] = long_short["gpus"][1]["start_time"] + 2 * D  # the second GPU's: 2 days
    long_short["gpus"][1]["duration_s"] = 2 * D
    for rec in (long_short, _one(9402, "n1", T0 + 40 * D - 600, 200 * D, partial=1),
                _one(9403, "n1", T0 + 3 * D, 9 * D + 3000), _one(9404, "n1", T0 + 3 * D - 100, 10 * D + 200)):
        s.store.write(rec)
    assert s.push().returncode == 0
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
    s.store.write(_one(9401, "n1", T0 + 4 * D, 13 * D, models=("H100", "A100")))  # both completed, longer
    s.store.write(_one(9402, "n1", T0 + 40 * D - 600, 3 * D))  # completed: now short
    assert s.push().returncode == 0
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
    assert s.rows("SELECT COUNT(DISTINCT day) FROM rollup_jobs WHERE job_id = 9401") == [["13"]]  # days 4-16


def test_central_init_on_a_current_server_makes_the_push_procedures_again(server, tmp_path):
    """A release that improves the push's statements within a schema version: `central init`
    makes them again (the nodes keep pushing at that version without an upgrade)."""
    s = Site(server, tmp_path)
    _init(s)
    import pymysql
    conn = pymysql.connect(unix_socket=str(server.socket), user="root", database=s.db)
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE OR REPLACE PROCEDURE rollups_before(IN b CHAR(32)) MODIFIES SQL DATA DO 0")
    finally:
        conn.close()
    r = cli("--config", str(s.config), "central", "init")
    assert r.returncode == 0 and "already current" in r.stderr and "procedures made again" in r.stderr, r.stderr
    body = s.rows(f"SELECT ROUTINE_DEFINITION FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = '{s.db}' "
                  "AND ROUTINE_NAME = 'rollups_before'")
    assert "rollup_jobday" in body[0][0], body
    s.store.write(_one(9501, "n1", T0 + 10 * D, 3600))
    assert s.push().returncode == 0
    assert s.rows("SELECT SUM(records) FROM rollup_day") == [["1"]]


def test_a_multi_node_jobs_second_node_does_not_wait_on_other_groups_cells_of_its_day(server, tmp_path):
    """A job's second node pushes its rows: its batch rewrites the job's rows of the first node as they
    were, so no cell's peak can drop and none is taken again.  Taking them again read every
    rollup_day cell of the day for rollup_partition_day's peaks, with shared locks: under load every
    push of that day waited on the others' (benchmarks/bench_central_load.py, cron: most deadlocks).
    Here another transaction holds another group's cell of the day; the push must not wait on it."""
    import pymysql
    s = Site(server, tmp_path)
    _init(s)
    s.store.write(_one(9601, "n1", T0 + 10 * D + 100, 3600))
    s.store.write(_one(9602, "n1", T0 + 10 * D + 200, 3600, user="bob"))
    assert s.push().returncode == 0
    n2 = Store(str(tmp_path / "n2.db"), str(tmp_path / "spool-n2"))
    n2.write(_one(9601, "n2", T0 + 10 * D + 100, 3600))
    n2.close()
    holder = pymysql.connect(unix_socket=str(server.socket), user="root", database=s.db, autocommit=False)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT cluster, day, gkey FROM rollup_day WHERE `user` = 'bob'")
            cell = cur.fetchone()
            cur.execute("SELECT 1 FROM rollup_day WHERE cluster = %s AND day = %s AND gkey = %s FOR UPDATE", cell)
        t0 = time.monotonic()
        r = s.push("--db", str(tmp_path / "n2.db"), "--max-seconds", "3")
        took = time.monotonic() - t0
    finally:
        holder.rollback()
        holder.close()
    assert r.returncode == 0 and "job_gpus 1; left 0" in r.stdout and "sent again" not in r.stdout, r.stdout + r.stderr
    assert took < 2.5, took  # no lock wait (timeout_s / 2 = 2.5 s)
    r = cli("--config", str(s.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr
