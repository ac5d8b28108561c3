"""`slurm-gpu report`: numbers checked against totals computed independently over the inserted rows.

The fixed data set covers what reports get wrong: jobs crossing the window and month
boundaries, a requeued job, a multi-node job, job ids repeated across clusters, GPUs without
utilisation / energy readings, a zero-length record and strings an HTML page must escape.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sqlite3
from calendar import timegm
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest
from click.testing import CliRunner

from slurm_gpu.cli import main
from slurm_gpu.cli.report import parse_by
from slurm_gpu.errors import InputError
from slurm_gpu.report import plan
from slurm_gpu.report import reports as report
from slurm_gpu.report.query import Query
from slurm_gpu.report.sources import open_sources
from slurm_gpu.report.tables import Table
from slurm_gpu.store import schema

GOLDEN = pathlib.Path(__file__).parent / "golden" / "report"
GIB = 1 << 30
XSS_USER = "<script>document.documentElement.setAttribute('data-pwned','1')</script>"
XSS_ACCOUNT = 'acct<img src=x onerror="document.title=1">&"'


def ts(text: str) -> float:
    """'2026-11-01T02:00' (UTC) -> unix seconds."""
    date, _, clock = text.partition("T")
    y, m, d = (int(x) for x in date.split("-"))
    hh, mm = (int(x) for x in (clock or "00:00").split(":"))
    return float(timegm((y, m, d, hh, mm, 0)))


def rec(cluster: str, job: int, node: str, gpu: int, user: Optional[str], account: Optional[str], partition: str,
        start: str, end: str, util: Optional[float], mem: Optional[float], energy_j: Optional[float],
        max_mem: Optional[int], restart: int = 0, model: str = "NVIDIA H200") -> Dict[str, Any]:
    s, e = ts(start), ts(end)
    return {
        "cluster": cluster, "job_id": job, "restart_count": restart, "node": node, "gpu_uuid": f"GPU-{node}-{gpu}",
        "gpu_index": gpu, "gpu_model": model, "user": user, "account": account, "partition": partition,
        "start_time": s, "end_time": e, "duration_s": e - s, "energy_j": energy_j, "gpu_util_mean_pct": util,
        "mem_util_mean_pct": mem, "max_memory_bytes": max_mem, "process_count": 1, "ecc_corrected_delta": 0,
        "ecc_uncorrected_delta": 0, "retired_pages_delta": 0, "remapped_rows_delta": 0, "clock_event_reasons": 0,
        "xid_events": None,
    }


ROWS: List[Dict[str, Any]] = [
    # 101: crosses the Oct/Nov boundary, two GPUs.
    rec("c1", 101, "n1", 0, "alice", "physics", "gpu", "2026-10-31T22:00", "2026-11-01T02:00", 80, 40, 4.32e6, 40 * GIB),
    rec("c1", 101, "n1", 1, "alice", "physics", "gpu", "2026-10-31T22:00", "2026-11-01T02:00", 60, 30, 3.60e6, 60 * GIB),
    # 102: requeued; the first run held its GPU idle.
    rec("c1", 102, "n2", 0, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T12:00", 2, 1, 0.5e6, 1 * GIB),
    rec("c1", 102, "n2", 0, "alice", "physics", "gpu", "2026-11-02T13:00", "2026-11-02T14:00", 90, 70, 1.1e6, 70 * GIB,
        restart=1),
    # 103: two nodes; n2's GPU reports neither utilisation nor energy.
    rec("c1", 103, "n1", 2, "bob", "chem", "gpu", "2026-11-05T00:00", "2026-11-05T06:00", 50, 20, 5.4e6, 30 * GIB),
    rec("c1", 103, "n2", 3, "bob", "chem", "gpu", "2026-11-05T00:00", "2026-11-05T06:00", None, None, None, None),
    # 104: strings that must be escaped; idle GPU, no memory figures.
    rec("c1", 104, "n3", 0, XSS_USER, XSS_ACCOUNT, "debug", "2026-11-10T08:00", "2026-11-10T09:00", 1.5, None, 0.2e6,
        None, model="NVIDIA A100-SXM4-80GB"),
    # 105: four GPUs for 12 days, crosses the Nov/Dec boundary.
    *[rec("c1", 105, "n3", g, "carol", "chem", "long", "2026-11-20T00:00", "2026-12-02T00:00", u, u / 2, 1e8 + g, 80 * GIB)
      for g, u in zip((1, 2, 3, 4), (30.0, 40.0, 50.0, 60.0))],
    # Job id 101 again, on another cluster: a different job.
    rec("c2", 101, "m1", 0, "dave", "physics", "gpu", "2026-11-03T01:00", "2026-11-03T03:00", 70, 35, 1.5e6, 20 * GIB),
    # Zero-length record: no GPU time, never counted.
    rec("c1", 106, "n1", 0, "erin", "bio", "gpu", "2026-11-06T00:00", "2026-11-06T00:00", 10, 10, 0.0, GIB),
]


def make_db(path: pathlib.Path, rows: Iterable[Dict[str, Any]], wal: bool = True,
            version: int = schema.SCHEMA_VERSION) -> pathlib.Path:
    """A node database built with the real migrations and plain sqlite3 (as the epilog's store leaves it)."""
    conn = sqlite3.connect(path)
    for migration in schema.MIGRATIONS[:version]:
        for stmt in migration:
            conn.execute(stmt)
    conn.execute(f"PRAGMA user_version = {version}")
    cols = schema.JOB_GPU_COLUMNS
    conn.executemany(f"INSERT INTO job_gpus ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                     [tuple(r[c] for c in cols) for r in rows])
    conn.commit()
    if wal:
        conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    return path


@pytest.fixture
def db(tmp_path: pathlib.Path) -> pathlib.Path:
    return make_db(tmp_path / "usage.db", ROWS)


# ---------------------------------------------------------------- independent expectation


def month_of(t: float) -> str:
    import time
    return time.strftime("%Y-%m", time.gmtime(t))


def month_bounds(lo: float, hi: float) -> List[Tuple[float, float, str]]:
    import time
    out = []
    y, m = time.gmtime(lo).tm_year, time.gmtime(lo).tm_mon
    while True:
        start = float(timegm((y, m, 1, 0, 0, 0)))
        y2, m2 = (y + 1, 1) if m == 12 else (y, m + 1)
        end = float(timegm((y2, m2, 1, 0, 0, 0)))
        if start >= hi:
            return out
        out.append((start, end, f"{y:04d}-{m:02d}"))
        y, m = y2, m2


def expected(rows: Sequence[Dict[str, Any]], key: Callable[[Dict[str, Any]], Tuple[Any, ...]],
             since: Optional[float] = None, until: Optional[float] = None, threshold: float = 5.0,
             by_month: bool = False) -> Dict[Tuple[Any, ...], Dict[str, Any]]:
    """Plain Python over the inserted rows: the numbers the report must print."""
    lo_all = -1e18 if since is None else since
    hi_all = 1e18 if until is None else until
    acc: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for r in rows:
        s, e = r["start_time"], r["end_time"]
        if e <= s:
            continue
        pieces = [(max(s, lo_all), min(e, hi_all), ())]
        if by_month:
            pieces = [(max(s, lo_all, a), min(e, hi_all, b), (lab,)) for a, b, lab in month_bounds(s, e)]
        for lo, hi, extra in pieces:
            t = hi - lo
            if t <= 0:
                continue
            k = key(r) + extra
            a = acc.setdefault(k, {"jobs": set(), "alloc": 0.0, "used": 0.0, "known": 0.0, "util_w": 0.0,
                                   "mem_w": 0.0, "mem_known": 0.0, "peak": None, "energy": None, "idle": 0.0})
            a["jobs"].add((r["cluster"], r["job_id"]))
            a["alloc"] += t
            u, mu = r["gpu_util_mean_pct"], r["mem_util_mean_pct"]
            if u is not None:
                a["known"] += t
                a["util_w"] += t * u
                a["used"] += t * u / 100
                if u < threshold:
                    a["idle"] += t
            if mu is not None:
                a["mem_known"] += t
                a["mem_w"] += t * mu
            if r["max_memory_bytes"] is not None:
                a["peak"] = max(a["peak"] or 0, r["max_memory_bytes"])
            if r["energy_j"] is not None:
                a["energy"] = (a["energy"] or 0.0) + r["energy_j"] * t / (e - s)
    out = {}
    for k, a in acc.items():
        out[k] = {
            "jobs": len(a["jobs"]),
            "gpu_hours_alloc": a["alloc"] / 3600,
            "gpu_hours_used": a["used"] / 3600,
            "gpu_util_mean_pct": a["util_w"] / a["known"] if a["known"] else None,
            "mem_util_mean_pct": a["mem_w"] / a["mem_known"] if a["mem_known"] else None,
            "peak_memory_gib": a["peak"] / GIB if a["peak"] is not None else None,
            "energy_kwh": a["energy"] / 3.6e6 if a["energy"] is not None else None,
            "gpu_hours_idle": a["idle"] / 3600,
            "gpu_hours_no_util": (a["alloc"] - a["known"]) / 3600,
        }
    return out


def assert_matches(table: Table, want: Dict[Tuple[Any, ...], Dict[str, Any]]) -> None:
    got = {tuple(r[k] for k in table.keys): r for r in table.rows}
    assert set(got) == set(want)
    for k, w in want.items():
        for col, v in w.items():
            if v is None or isinstance(v, int):
                assert got[k][col] == v, (k, col)
            else:
                assert got[k][col] == pytest.approx(v, abs=0.006), (k, col)


def run_summary(paths: Sequence[pathlib.Path], by: Sequence[str], **query: Any) -> Table:
    with open_sources([str(p) for p in paths], Query(**query)) as src:
        return report.summary(src, parse_by(by))


# ---------------------------------------------------------------- numbers


def test_summary_by_user_matches_independent_totals(db):
    table = run_summary([db], ["user"])
    assert_matches(table, expected(ROWS, lambda r: (r["user"],)))


def test_window_clips_gpu_time_and_prorates_energy(db):
    since, until = ts("2026-11-01T00:00"), ts("2026-11-25T00:00")
    table = run_summary([db], ["account"], since_s=since, until_s=until)
    want = expected(ROWS, lambda r: (r["account"],), since, until)
    assert_matches(table, want)
    # Job 101 ran 22:00-02:00 across --since: only its 2 h after midnight count (2 GPUs -> 4 GPU-h).
    physics = {tuple(r[k] for k in table.keys): r for r in table.rows}[("physics",)]
    assert physics["gpu_hours_alloc"] == pytest.approx(4 + 2 + 1 + 2)


def test_by_account_month_splits_records_at_month_boundaries(db):
    table = run_summary([db], ["account,month"])
    assert_matches(table, expected(ROWS, lambda r: (r["account"],), by_month=True))
    months = {r["month"] for r in table.rows if r["account"] == "chem"}
    assert months == {"2026-11", "2026-12"}


def test_null_utilisation_is_left_out_of_means_used_and_idle(db):
    table = run_summary([db], ["user"], users=("bob",))
    (bob,) = table.rows
    assert bob["gpu_hours_alloc"] == pytest.approx(12.0)
    assert bob["gpu_util_mean_pct"] == pytest.approx(50.0)  # not 25: the GPU without a reading is not a zero
    assert bob["gpu_hours_used"] == pytest.approx(3.0)
    assert bob["gpu_hours_no_util"] == pytest.approx(6.0)
    assert bob["gpu_hours_idle"] == 0
    assert bob["energy_kwh"] == pytest.approx(1.5)


def test_requeued_job_counts_once_and_clusters_keep_job_ids_apart(db):
    table = run_summary([db], ["account"])
    jobs = {r["account"]: r["jobs"] for r in table.rows}
    assert jobs["physics"] == 3  # c1/101, c1/102 (two runs), c2/101


def test_idle_threshold_option_changes_idle_hours(db):
    low = run_summary([db], ["user"], idle_threshold_pct=0.0)
    high = run_summary([db], ["user"], idle_threshold_pct=75.0)
    assert all(r["gpu_hours_idle"] == 0 for r in low.rows)
    assert_matches(high, expected(ROWS, lambda r: (r["user"],), threshold=75.0))


def test_filters_and_gpu_model_grouping(db):
    table = run_summary([db], ["gpu-model", "partition"], partitions=("gpu", "debug"), nodes=("n1", "n3", "m1"))
    rows = [r for r in ROWS if r["partition"] in ("gpu", "debug") and r["node"] in ("n1", "n3", "m1")]
    assert_matches(table, expected(rows, lambda r: (r["gpu_model"], r["partition"])))


def _all_reports(db: pathlib.Path) -> list:
    out: list = [run_summary([db], by).rows for by in (["user"], ["account", "month"], ["node", "day"])]
    with open_sources([str(db)], Query()) as src:
        for sort, limit in (("-gpu_hours_alloc", 3), ("gpu_util_mean_pct", None), ("-mem_util_mean_pct", 4),
                            ("user", None)):
            out.append(report.jobs(src, sort=sort, limit=limit).rows)
    return out


def test_parallel_partitions_give_the_single_pass_numbers(db, monkeypatch):
    serial = _all_reports(db)
    monkeypatch.setattr(plan, "PARALLEL_MIN_ROWS", 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    with open_sources([str(db)], Query()) as src:
        assert plan._partitions(src) == 3
    assert _all_reports(db) == serial


@pytest.mark.parametrize("query", [
    {}, {"since": "2026-11-01T01:00"}, {"since": "2026-11-02T11:00", "until": "2026-12-01T12:00"},
    {"until": "2026-11-05T03:00"}, {"users": ("alice", "bob")}, {"accounts": ("chem",)}, {"partitions": ("gpu",)},
    {"clusters": ("c1",)}])
def test_covering_index_plan_gives_the_v1_scan_numbers(tmp_path, monkeypatch, query):
    v1 = make_db(tmp_path / "v1.db", ROWS, version=1)
    v2 = make_db(tmp_path / "v2.db", ROWS)
    groupings = (["user"], ["account"], ["partition"], ["node"], ["gpu-model"], ["account", "month"],
                 ["user", "week"], ["node", "day"], ["month", "gpu-model"], ["account", "user"], ["month"])
    q = {k: (ts(v) if k in ("since", "until") else v) for k, v in query.items()}
    args = Query(since_s=q.pop("since", None), until_s=q.pop("until", None), **q)
    used = 0
    for threads in (1, 3):
        monkeypatch.setattr(plan, "_partitions", lambda src, n=threads: n)
        for by in groupings:
            with open_sources([str(v1)], args) as s1, open_sources([str(v2)], args) as s2:
                assert plan._summary_by_index(s1, by) is None  # v1: no covering index
                used += plan._summary_by_index(s2, by) is not None
                assert report.summary(s2, by).rows == report.summary(s1, by).rows, (by, query, threads)
    assert used > 0


def test_week_and_day_groups_in_local_time_follow_dst(tmp_path, monkeypatch):
    import time
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        # 2026-10-25 is the 25-hour day in Berlin (CEST -> CET at 03:00 local).
        rows = [rec("c1", 1, "n1", 0, "u", "a", "p", "2026-10-24T20:00", "2026-10-26T02:00", 50, 50, 3.6e6, GIB)]
        path = make_db(tmp_path / "dst.db", rows)
        table = run_summary([path], ["day"], tz="local")
        hours = {r["day"]: r["gpu_hours_alloc"] for r in table.rows}
        # 20:00Z = 22:00 CEST; 02:00Z on the 26th = 03:00 CET.
        assert hours == {"2026-10-24": pytest.approx(2.0), "2026-10-25": pytest.approx(25.0),
                         "2026-10-26": pytest.approx(3.0)}
        weeks = run_summary([path], ["week"], tz="local")
        assert [r["week"] for r in weeks.rows] == ["2026-W43", "2026-W44"]
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


# ---------------------------------------------------------------- jobs / job


def test_jobs_idle_lists_only_jobs_that_held_an_idle_gpu(db):
    with open_sources([str(db)], Query()) as src:
        table = report.jobs(src, idle_only=True)
    assert [(r["cluster"], r["job_id"], r["restart"]) for r in table.rows] == [("c1", 102, 0), ("c1", 104, 0)]
    assert table.rows[0]["gpu_hours_idle"] == pytest.approx(2.0)


def test_jobs_sort_and_limit(db):
    with open_sources([str(db)], Query()) as src:
        top = report.jobs(src, sort="-energy_kwh", limit=2)
        asc = report.jobs(src, sort="job_id")
    assert [r["job_id"] for r in top.rows] == [105, 101]
    assert [r["job_id"] for r in asc.rows] == sorted(r["job_id"] for r in asc.rows)
    j105 = top.rows[0]
    assert (j105["gpus"], j105["nodes"], j105["gpu_util_min_pct"]) == (4, 1, 30.0)


def test_jobs_rejects_unknown_sort_column(db):
    with open_sources([str(db)], Query()) as src:
        with pytest.raises(InputError, match="unknown --sort column 'bogus'"):
            report.jobs(src, sort="bogus")


def test_job_shows_every_node_gpu_and_restart(db):
    with open_sources([str(db)], Query(job_id=102, clusters=("c1",))) as src:
        table = report.job(src)
    assert [(r["restart"], r["node"], r["gpu_index"], r["idle"]) for r in table.rows] == [(0, "n2", 0, True),
                                                                                         (1, "n2", 0, False)]


def test_job_unknown_id_is_a_clear_error(db):
    r = CliRunner().invoke(main, ["report", "--db", str(db), "job", "999999"])
    assert r.exit_code == 2
    assert "no GPU records for job 999999" in r.stderr


# ---------------------------------------------------------------- sources


def test_records_in_two_databases_count_once(tmp_path):
    a = make_db(tmp_path / "a.db", ROWS[:8])
    b = make_db(tmp_path / "b.db", ROWS[4:])  # rows 4..7 are in both files
    both = run_summary([a, b], ["account", "month"])
    assert_matches(both, expected(ROWS, lambda r: (r["account"],), by_month=True))
    assert both.rows == run_summary([make_db(tmp_path / "all.db", ROWS)], ["account", "month"]).rows


def test_directory_with_more_files_than_sqlite_can_attach(tmp_path):
    d = tmp_path / "nodes"
    d.mkdir()
    for i, r in enumerate(ROWS):  # one file per record, plus a duplicate of each
        make_db(d / f"node{i:02d}.db", [r])
        make_db(d / f"copy{i:02d}.db", [r], wal=False)
    (d / "notes.txt").write_text("not a database")
    table = run_summary([d], ["user"], since_s=ts("2026-11-01T00:00"))
    assert_matches(table, expected(ROWS, lambda r: (r["user"],), ts("2026-11-01T00:00")))


def _snapshot(d: pathlib.Path) -> Dict[str, Tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(d.iterdir())}


def test_report_never_writes_to_the_databases(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    wal_db = make_db(d / "wal.db", ROWS[:6])
    plain_db = make_db(d / "plain.db", ROWS[5:], wal=False)
    os.chmod(wal_db, 0o444)
    os.chmod(plain_db, 0o444)
    before = _snapshot(d)
    os.chmod(d, 0o555)
    try:
        runner = CliRunner()
        for args in (["--db", str(wal_db)], ["--db", str(d), "--by", "account,month"], ["--db", str(plain_db), "jobs"],
                     ["--db", str(wal_db), "--format", "html"], ["--db", str(d), "job", "105"]):
            r = runner.invoke(main, ["report", *args])
            assert r.exit_code == 0, r.output
    finally:
        os.chmod(d, 0o755)
    # No -shm/-wal/-journal appeared, no byte or mtime changed.
    assert _snapshot(d) == before


def test_live_wal_database_with_unmerged_records_is_read(tmp_path):
    path = make_db(tmp_path / "live.db", ROWS[:2])
    writer = sqlite3.connect(path)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    cols = schema.JOB_GPU_COLUMNS
    writer.executemany(f"INSERT INTO job_gpus ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                       [tuple(r[c] for c in cols) for r in ROWS[2:]])
    writer.commit()  # the rows now live only in the -wal file, the writer stays open
    try:
        table = run_summary([path], ["user"])
        assert_matches(table, expected(ROWS, lambda r: (r["user"],)))
    finally:
        writer.close()


def test_file_that_is_not_a_database_is_a_store_error(tmp_path):
    bad = tmp_path / "junk.db"
    bad.write_bytes(b"definitely not sqlite" * 100)
    r = CliRunner().invoke(main, ["report", "--db", str(bad)])
    assert r.exit_code == 5
    assert r.stderr.startswith(f"slurm-gpu: error: {bad}: not a readable SQLite database")


def test_newer_schema_version_is_refused(tmp_path):
    path = make_db(tmp_path / "new.db", ROWS[:1], wal=False)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    r = CliRunner().invoke(main, ["report", "--db", str(path)])
    assert r.exit_code == 5
    assert "newer than this slurm-gpu understands" in r.stderr


def test_missing_database_path_is_a_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "nope.db")])
    assert r.exit_code == 2
    assert "does not exist" in r.stderr and "hint:" in r.stderr


# ---------------------------------------------------------------- CLI errors


def test_bad_time_spec_is_a_one_line_error_naming_the_value(db):
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--since", "2026-13-45"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("slurm-gpu: error: --since: cannot read time '2026-13-45'")
    assert lines[1].startswith("hint: ") and len(lines) == 2


def test_empty_window_is_rejected(db):
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--since", "2026-11-02", "--until", "2026-11-01"])
    assert r.exit_code == 2
    assert "empty time window" in r.stderr


def test_unknown_by_key_is_rejected(db):
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--by", "account,colour"])
    assert r.exit_code == 2
    assert "unknown --by key 'colour'" in r.stderr and "gpu-model" in r.stderr


def test_two_calendar_keys_are_rejected(db):
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--by", "day,month"])
    assert r.exit_code == 2
    assert "at most one of day, week, month" in r.stderr


def test_options_after_the_subcommand_and_on_the_group_both_work(db):
    a = CliRunner().invoke(main, ["report", "--db", str(db), "--since", "2026-11-03", "jobs", "--format", "json"])
    b = CliRunner().invoke(main, ["report", "jobs", "--db", str(db), "--since", "2026-11-03", "--format", "json"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert a.stdout == b.stdout
    assert {j["job_id"] for j in json.loads(a.stdout)} == {101, 103, 104, 105}


def test_config_sources_and_threshold_are_used_without_options(db, tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[report]\nsources = ["{db}"]\nidle_threshold_pct = 75.0\n')
    os.chmod(cfg, 0o644)
    r = CliRunner().invoke(main, ["--config", str(cfg), "report", "--format", "json"])
    assert r.exit_code == 0, r.output
    got = {row["user"]: row["gpu_hours_idle"] for row in json.loads(r.stdout)}
    want = expected(ROWS, lambda r: (r["user"],), threshold=75.0)
    assert got == {k[0]: pytest.approx(v["gpu_hours_idle"], abs=0.001) for k, v in want.items()}


# ---------------------------------------------------------------- golden outputs

GOLDEN_CASES = {
    "by-account-month": ["--by", "account,month", "--since", "2026-10-01", "--until", "2026-12-01T12:00"],
    "jobs": ["jobs", "--sort", "-gpu_hours_alloc"],
    "job-103": ["job", "103"],
}


@pytest.mark.parametrize("fmt,ext", [("csv", "csv"), ("json", "json"), ("markdown", "md"), ("table", "txt")])
@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_output(db, case, fmt, ext):
    args = GOLDEN_CASES[case]
    if args[0] in ("jobs", "job"):
        argv = ["report", args[0], "--db", str(db), *args[1:], "--format", fmt]
    else:
        argv = ["report", "--db", str(db), *args, "--format", fmt]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    path = GOLDEN / f"{case}.{ext}"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(r.stdout)
    assert r.stdout == path.read_text()


# ---------------------------------------------------------------- issue 10: numbers right or a clear failure


def _cli(*args: str):
    return CliRunner().invoke(main, ["report", *args])


def _short_job_rows() -> List[Dict[str, Any]]:
    """Job 7: two GPUs for 3 s (6 GPU-seconds), 400 J each; job 8: one GPU for 40 s."""
    rows = [rec("c1", 7, "n1", g, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T10:00", 60, 30, 400.0,
                GIB) for g in (0, 1)]
    rows.append(rec("c1", 8, "n1", 2, "bob", "chem", "gpu", "2026-11-02T10:00", "2026-11-02T10:00", 20, 10, 2000.0, GIB))
    for r, secs in zip(rows, (3, 3, 40)):
        r["end_time"] = r["start_time"] + secs
        r["duration_s"] = float(secs)
    return rows


def test_report_jobs_shows_six_gpu_seconds_not_0_002_gpu_hours(tmp_path):
    db = make_db(tmp_path / "short.db", _short_job_rows())
    r = _cli("jobs", "--db", str(db))
    assert r.exit_code == 0, r.output
    head = r.stdout.splitlines()[0]
    fields = next(ln.split() for ln in r.stdout.splitlines() if ln.split()[:2] == ["c1", "7"])
    # cluster job restart user account partition start end nodes gpus | GPU time alloc, used, ...
    assert "GPU time alloc" in head and fields[10:12] == ["00:00:06", "00:00:04"], r.stdout
    # Machine formats keep GPU-hours, precise to well under a second.
    got = {j["job_id"]: j for j in json.loads(_cli("jobs", "--db", str(db), "--format", "json").stdout)}
    assert got[7]["gpu_hours_alloc"] * 3600 == pytest.approx(6.0, abs=0.01)
    assert got[7]["energy_kwh"] * 3.6e6 == pytest.approx(800.0, abs=3.6)  # 6 decimals of a kWh
    # A summary of seconds-long jobs: GPU-seconds and Wh, not a column of 0.00.
    r = _cli("--db", str(db), "--by", "user")
    assert r.exit_code == 0, r.output
    head, _, alice, bob, total = r.stdout.splitlines()
    assert "GPU-s alloc" in head and "energy Wh" in head
    assert alice.split()[2:3] == ["6.00"] and bob.split()[2:3] == ["40.00"] and total.split()[2:3] == ["46.00"]


def _corrupt_middle(path: pathlib.Path) -> None:
    """Overwrite a run of pages in the middle of the file (page 1, the schema, stays intact)."""
    size = path.stat().st_size
    page = 4096
    with open(path, "r+b") as f:
        for p in range(size // page // 3, 2 * size // page // 3):
            f.seek(p * page)
            f.write(bytes((p * 7 + i) % 251 for i in range(page)))


@pytest.mark.parametrize("args", [[], ["--by", "account,month"], ["jobs"], ["--format", "html"], ["job", "105"]])
def test_database_corrupt_in_the_middle_is_an_error_not_a_traceback(tmp_path, args):
    rows = [dict(r, job_id=r["job_id"] * 1000 + i) for i in range(300) for r in ROWS]
    db = make_db(tmp_path / "corrupt.db", rows)
    _corrupt_middle(db)
    if args[:1] == ["job"]:
        argv = ["job", str(105 * 1000 + 150), "--db", str(db)]
    else:
        argv = ["--db", str(db), *args]
    r = _cli(*argv)
    assert isinstance(r.exception, SystemExit), r.exception  # no traceback
    assert r.exit_code == 5, r.output
    assert f"slurm-gpu: error: {db}: cannot read job_gpus" in r.stderr and "hint:" in r.stderr


def _bad_time_rows() -> List[Dict[str, Any]]:
    good = rec("c1", 1, "n1", 0, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T12:00", 50, 25, 3.6e6, GIB)
    bad = []
    for job, (start, end) in enumerate([(1e18, 1e18 + 10), (good["start_time"], 1e18), (good["start_time"], math.inf),
                                        (-math.inf, good["end_time"]), (0.0, good["end_time"]),
                                        (good["end_time"], good["start_time"])], start=2):
        bad.append(dict(good, job_id=job, start_time=start, end_time=end, duration_s=0.0))
    # Valid times, but an energy figure that overflows: never Infinity in JSON.
    bad.append(dict(good, job_id=9, energy_j=math.inf))
    return [good] + bad


@pytest.mark.parametrize("args", [["--format", "json"], ["--by", "user,day", "--format", "json"],
                                  ["--by", "month", "--format", "json"], ["jobs", "--format", "json"],
                                  ["--format", "html"], ["--format", "csv"], []])
def test_timestamps_1e18_inf_and_end_before_start_are_skipped_and_counted(tmp_path, args):
    db = make_db(tmp_path / "times.db", _bad_time_rows())
    r = _cli("--db", str(db), *args) if args[:1] != ["jobs"] else _cli("jobs", "--db", str(db), *args[1:])
    assert r.exit_code == 0, (r.output, r.exception)
    data = re.sub(r"<script.*?</script>", "", r.stdout, flags=re.S)  # the page's own sort code says -Infinity
    assert "Infinity" not in data and "NaN" not in data and "inf" not in data.lower().replace("info", "")
    note = next(ln for ln in r.stderr.splitlines() if "skipped" in ln)
    assert note.startswith("slurm-gpu: note: skipped 6 record(s)"), r.stderr
    assert "1 end before start" in note and "3 end time outside 2000-2099" in note and "2 longer than ten years" in note
    if "json" in args:
        rows = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
        hours = sum(row["gpu_hours_alloc"] for row in rows)
        assert hours == pytest.approx(4.0)  # job 1 and job 9: two hours each
        assert all(row["energy_kwh"] is None or row["energy_kwh"] < 10 for row in rows)


def test_utilisation_over_100_percent_is_clamped_and_said(tmp_path):
    rows = [rec("c1", 1, "n1", 0, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T12:00", 250, 300, 3.6e6, GIB),
            rec("c1", 2, "n1", 1, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T12:00", 50, -20, 3.6e6, GIB)]
    db = make_db(tmp_path / "util.db", rows)
    r = _cli("--db", str(db), "--format", "json")
    assert r.exit_code == 0, r.output
    (alice,) = json.loads(r.stdout)
    assert alice["gpu_util_mean_pct"] == 75.0 and alice["mem_util_mean_pct"] == 50.0
    assert alice["gpu_hours_used"] == pytest.approx(3.0) and alice["gpu_hours_used"] <= alice["gpu_hours_alloc"]
    assert "4.00 GPU-h of GPU time carry a utilisation outside 0-100 %" in r.stderr
    jobs = json.loads(_cli("jobs", "--db", str(db), "--format", "json").stdout)
    assert max(j["gpu_util_mean_pct"] for j in jobs) == 100.0
    detail = json.loads(_cli("job", "1", "--db", str(db), "--format", "json").stdout)
    assert (detail[0]["gpu_util_mean_pct"], detail[0]["mem_util_mean_pct"]) == (100.0, 100.0)


def _live_store_db(tmp_path: pathlib.Path):
    """A node database written by the Store whose records are still in the WAL (a hook holds it open)."""
    from slurm_gpu.store.node import Store

    path = tmp_path / "node" / "usage.db"
    st = Store(str(path), str(tmp_path / "spool"))
    conn = st.connect()
    conn.execute("PRAGMA wal_autocheckpoint=0")
    cols = schema.JOB_GPU_COLUMNS
    conn.executemany(f"INSERT INTO job_gpus ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                     [tuple(r[c] for c in cols) for r in ROWS])
    return path, st


def test_copy_without_its_wal_file_names_the_missing_wal(tmp_path):
    import shutil

    path, st = _live_store_db(tmp_path)
    try:
        copy = tmp_path / "copied.db"
        shutil.copyfile(path, copy)  # what `cp usage.db` does while a hook has it open
    finally:
        st.close()
    assert copy.stat().st_size == 4096
    r = _cli("--db", str(copy))
    assert r.exit_code == 5
    assert "copied.db-wal is missing" in r.stderr and "slurm-gpu db backup" in r.stderr, r.stderr


def test_db_backup_copies_a_live_database_with_the_records_in_its_wal(tmp_path):
    path, st = _live_store_db(tmp_path)
    try:
        copy = tmp_path / "shared" / "n1.db"
        r = CliRunner().invoke(main, ["db", "backup", "--database", str(path), str(copy)])
        assert r.exit_code == 0, r.output
        assert str(copy) in r.stdout
    finally:
        st.close()
    assert not os.path.exists(str(copy) + "-wal")  # one self-contained file
    assert_matches(run_summary([copy], ["user"]), expected(ROWS, lambda r: (r["user"],)))
    again = CliRunner().invoke(main, ["db", "backup", "--database", str(path), str(copy)])
    assert again.exit_code == 2 and "exists" in again.stderr  # never overwrites


def _tiny_records_by_node() -> List[Dict[str, Any]]:
    """Ten nodes, each a 5-second record: rounded per node, utilisation and hours lose their digits."""
    rows = []
    for n in range(10):
        r = rec("c1", 200 + n, f"n{n:02d}", 0, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T10:00",
                10.0 + 2.5 * n, 5.0 + n, 500.0, GIB)
        r["end_time"] = r["start_time"] + 5 + n
        rows.append(r)
    return rows


def test_total_utilisation_comes_from_unrounded_sums(tmp_path):
    rows = _tiny_records_by_node()
    db = make_db(tmp_path / "tiny.db", rows)
    table = run_summary([db], ["node"])
    total = table.total
    secs = [r["end_time"] - r["start_time"] for r in rows]
    exact_util = sum(s * r["gpu_util_mean_pct"] for s, r in zip(secs, rows)) / sum(secs)
    exact_mem = sum(s * r["mem_util_mean_pct"] for s, r in zip(secs, rows)) / sum(secs)
    assert total["gpu_util_mean_pct"] == pytest.approx(exact_util, abs=0.005)
    assert total["mem_util_mean_pct"] == pytest.approx(exact_mem, abs=0.005)
    assert total["gpu_hours_alloc"] * 3600 == pytest.approx(sum(secs), abs=0.01)
    last = _cli("--db", str(db), "--by", "node").stdout.splitlines()[-1].split()
    assert last[0] == "TOTAL" and f"{exact_util:.2f}" in last and f"{sum(secs) / 60:.2f}" in last  # GPU-min


def test_total_row_shows_memory_utilisation_computed_like_its_rows(db, tmp_path):
    r = _cli("--db", str(db), "--by", "user", "--user", "alice,bob")
    total = r.stdout.splitlines()[-1].split()
    want = expected([x for x in ROWS if x["user"] in ("alice", "bob")], lambda x: ("all",))[("all",)]
    assert total[0] == "TOTAL" and total[5] == f"{want['mem_util_mean_pct']:.2f}", r.stdout
    # One user: the TOTAL line of the HTML page repeats the user's figures.
    page = tmp_path / "one.html"
    assert _cli("--db", str(db), "--user", "alice", "--format", "html", "-o", str(page)).exit_code == 0
    import re as _re
    tfoot = _re.search(r"<tfoot>(.*?)</tfoot>", page.read_text(), _re.S).group(1)
    cells = _re.findall(r"<td[^>]*>([^<]*)</td>", tfoot)
    alice = expected([x for x in ROWS if x["user"] == "alice"], lambda x: ("a",))[("a",)]
    assert cells[0] == "TOTAL" and cells[5] == f"{alice['mem_util_mean_pct']:.2f}", cells


HOSTILE = ["=HYPERLINK(\"http://x\",\"y\")", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A2)", "\x1b[31mred\x1b[0m\rX"]


def test_csv_neutralises_spreadsheet_formulas_and_keeps_numbers(tmp_path):
    rows = [rec("c1", 300 + i, "n1", i, name, name, name, "2026-11-02T10:00", "2026-11-02T11:00", 50, 25, 3.6e6, GIB)
            for i, name in enumerate(HOSTILE[:4])]
    rows.append(rec("c1", 399, "n1", 9, "plain", "acct", "gpu", "2026-11-02T10:00", "2026-11-02T11:00", -5.0, 25, 3.6e6, GIB))
    db = make_db(tmp_path / "csv.db", rows)
    import csv as _csv
    import io as _io
    for args in (["--by", "user,account,partition"], ["jobs"]):
        r = _cli(*(args[:1] if args[0] == "jobs" else []), "--db", str(db), *(args if args[0] != "jobs" else []),
                 "--format", "csv")
        assert r.exit_code == 0, r.output
        parsed = list(_csv.reader(_io.StringIO(r.stdout)))
        for row in parsed[1:]:
            for cell in row:
                assert not cell.startswith(("=", "+", "@")) and not (cell.startswith("-") and not _is_number(cell)), row
        texts = {c for row in parsed[1:] for c in row}
        assert {"'" + h for h in HOSTILE[:4]} <= texts
        assert "0.0" in texts  # clamped utilisation; numbers stay plain numbers


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def test_table_output_shows_escape_sequences_as_text(tmp_path):
    rows = [rec("c1", 400, "n1", 0, HOSTILE[4], "acct\u202eevil", "gpu", "2026-11-02T10:00", "2026-11-02T11:00",
                50, 25, 3.6e6, GIB)]
    db = make_db(tmp_path / "esc.db", rows)
    for args in (["--by", "user,account"], ["jobs"], ["job", "400"], ["--by", "user,account", "--format", "markdown"]):
        argv = [args[0], "--db", str(db), *args[1:]] if args[0] in ("jobs", "job") else ["--db", str(db), *args]
        r = _cli(*argv)
        assert r.exit_code == 0, r.output
        assert "\x1b" not in r.stdout and "\r" not in r.stdout and "\u202e" not in r.stdout, repr(r.stdout)
        assert "\\x1b[31mred\\x1b[0m\\x0dX" in r.stdout and "acct\\u202eevil" in r.stdout
