"""Benchmark the central MariaDB server: rollups, `report --by` over N records, migration and `db push`.

    python3 benchmarks/bench_central.py [--rows 1000000] [--runs 5] [--buffer-pool 4G] [--workdir DIR]

Not run in CI (needs Debian's mariadb-server and root, like tests/test_central.py).  It

1. starts a throwaway MariaDB (tests/mariadb.py, with a larger InnoDB buffer pool and redo log),
   creates a database and runs the central schema migrations up to v3 (no rollups) as an admin
   account with a password;
2. fills job_gpus with --rows records generated on the server (the SEQUENCE engine's seq_0_to_M,
   INSERT ... SELECT in chunks; the secondary indexes are dropped for the load and re-created
   afterwards exactly as the schema has them: one sorted build each): ~200 users (a few heavy,
   a long tail), 40 accounts, 8 partitions, 1000 nodes, 3 GPU models, jobs of 1/2/4/8 GPUs
   starting over 365 days of 2025 (UTC), 1 min-48 h long (log-uniform), 3 % unknown
   utilisation, 12 % idle jobs;
3. times the migration v3 -> v5 (the rollups built from the records, days in UTC), v5 -> v6 (their
   job counts and peaks, from the rollups' rows) and v6 -> current (the week, month, node and
   partition tables, from the day tables), as `central init` runs them, and prints each table's
   rows and size (information_schema);
4. times, interleaved over --runs runs, medians of, for `--by` user, account,month,
   partition,model,week and node, each over the whole year 2025 and over June 2025 (UTC days):
   - the whole CLI: `python3 -m slurm_gpu.cli --config CFG report --by KEYS --since D0 --until D1
     --tz utc --explain --db URL --format csv` from a fresh venv with a regular install of this
     checkout (`pip install .[central]`: what a site runs, its modules' bytecode compiled; the
     checkout itself, where PYTHONDONTWRITEBYTECODE is set, compiled every module on every run:
     ~80 ms of a report's ~250 ms here) as the reporter account (exactly the GRANTs of
     slurm_gpu.central.server.grants()); the plan it printed is reported;
   - the same aggregation over the records in the `mariadb` command-line client (root over the
     socket): the statements report/plan.py's summary_plan() makes through a CentralSource for the same
     window (the raw plan, what the CLI ran before the rollups: a scan of the window's records),
     with the parameters inlined by PyMySQL's own escaping;
   and checks once, in-process, that the rollup plan's CSV equals the raw plan's byte for byte;
5. writes --push-rounds x 2 node databases (schema v5, the outbox) of --push-jobs 8-GPU job_end
   records each through Store.write and pushes them with `slurm-gpu db push` (the same install) as the writer
   account, alternating apply_batch without the rollup calls (v3's upsert, as before the
   rollups) and with them: job_gpus records per second of each, then a push with nothing to ship;
6. times `central rollup --rebuild` (Central + central.rollups.rebuild) and prints what it corrected:
   exactly the records pushed without the rollup calls;
7. removes the server and its files at the end, also on an error or SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import mariadb as testdb  # noqa: E402  (tests/mariadb.py: the throwaway server of the tests)
from _common import clean_venv  # noqa: E402

from slurm_gpu.central import schema as CS  # noqa: E402
from slurm_gpu.central import server as C  # noqa: E402
from slurm_gpu.central import writers as W  # noqa: E402
from slurm_gpu.report import plan as P  # noqa: E402
from slurm_gpu.report import reports as report  # noqa: E402
from slurm_gpu.report.central import CentralSource, translate  # noqa: E402
from slurm_gpu.report.query import Query  # noqa: E402
from slurm_gpu.store.node import Store  # noqa: E402

YEAR_START = 1735689600  # 2025-01-01T00:00:00Z
YEAR_S = 365 * 86400
BYS = (("user",), ("account", "month"), ("partition", "gpu-model", "week"), ("node",))
# (name, --since, --until, unix seconds of both): whole UTC days of the generated year
WINDOWS = (("year", "2025-01-01", "2026-01-01", YEAR_START, YEAR_START + YEAR_S),
           ("month", "2025-06-01", "2025-07-01", 1748736000, 1751328000))
TARGET_S, TARGET_RATIO = 1.0, 0.05  # issue 27, at 10 M records
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
CLIENT = ["mariadb", "--no-defaults"]


class BenchMariaDB(testdb.MariaDB):
    """tests/mariadb.py's server with extra mariadbd options, its temporary files (a report's
    derived tables) in its own directory, not /tmp."""

    def __init__(self, extra_opts: Sequence[str], workdir: Path):
        super().__init__(workdir, [*extra_opts, f"--tmpdir={workdir / 'tmp'}"])
        self.tmpdir = self.dir / "tmp"

    def start(self, timeout_s: float = 180.0) -> "BenchMariaDB":
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        super().start(timeout_s)
        return self


def client(server: testdb.MariaDB, sql: str, database: str = "", timeout: Optional[float] = None) -> str:
    """Run SQL as root over the socket in the `mariadb` client, in the report's sql_mode."""
    args = CLIENT + [f"--socket={server.socket}", "-u", "root", "-N", "-B"] + ([database] if database else [])
    prelude = f"SET SESSION sql_mode = '{C.SESSION_SQL_MODE}', time_zone = '+00:00';\n"
    r = subprocess.run(args + ["-e", prelude + sql], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"mariadb: {r.stderr.strip()[-2000:]}")
    return r.stdout


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024.0
    return f"{n:.1f} GiB"


# --------------------------------------------------------------------------- loading

def _h(tag: str, expr: str) -> str:
    """A deterministic pseudo-random number in [0, 1) from expr: CRC32 of tag || CRC32(tag || expr).

    Not one CRC32: it is affine, so CRC32('u' || x) XOR CRC32('t' || x) is one constant for every
    x of a length, and a job's user was a function of its start time (20 groups a day, where a
    cluster has hundreds: too few rollup_day rows).  The decimal text of the inner CRC breaks
    that; MD5 did too, but the merged derived tables evaluate each hash many times per row."""
    return f"(CRC32('{tag}' || CRC32('{tag}' || {expr})) / 4294967296.0)"


def _load_sql(offset: int, count: int) -> str:
    """INSERT ... SELECT of records offset .. offset+count-1 (server side, SEQUENCE engine).

    Records come in blocks of 8 (one node's 8 GPUs); a block holds one job of 8 GPUs, two of 4,
    2+2+4 or 1+1+2+4 GPUs (chosen per block), so jobs have 1, 2, 4 or 8 GPUs, all on one node.
    A job's attributes come from hashes of its id, so every GPU of a job agrees.
    """
    # Level 1: record number i -> block b, slot s, block pattern p -> job (k) and GPU index.
    k = ("CASE p WHEN 0 THEN 0 WHEN 1 THEN s DIV 4 "
         "WHEN 2 THEN CASE WHEN s < 2 THEN 0 WHEN s < 4 THEN 1 ELSE 2 END "
         "ELSE CASE WHEN s < 1 THEN 0 WHEN s < 2 THEN 1 WHEN s < 4 THEN 2 ELSE 3 END END")
    gpu = ("CASE p WHEN 0 THEN s WHEN 1 THEN s MOD 4 "
           "WHEN 2 THEN CASE WHEN s < 4 THEN s MOD 2 ELSE s - 4 END "
           "ELSE CASE WHEN s < 2 THEN 0 WHEN s < 4 THEN s - 2 ELSE s - 4 END END")
    lvl1 = (f"SELECT i, b * 4 + ({k}) + 1000 AS job_id, {gpu} AS gpu "
            f"FROM (SELECT i, i DIV 8 AS b, i MOD 8 AS s, CRC32('p' || (i DIV 8)) MOD 4 AS p "
            f"FROM (SELECT seq + {offset} AS i FROM seq_0_to_{count - 1}) AS q0) AS q1")
    # Level 2: the job's user (skewed: user000 is the heaviest), node, start, duration, idleness;
    # the record's utilisation.
    lvl2 = (f"SELECT i, job_id, gpu, "
            f"FLOOR(200 * POW({_h('u', 'job_id')}, 2)) AS u, "
            f"FLOOR({_h('n', 'job_id')} * 1000) AS node, "
            f"{YEAR_START} + FLOOR({_h('t', 'job_id')} * {YEAR_S}) AS start, "
            f"ROUND(60 * EXP(LN(2880) * {_h('d', 'job_id')}), 1) AS dur, "
            f"{_h('x', 'job_id')} < 0.12 AS idle, "
            f"{_h('r', 'job_id')} < 0.02 AS restart, "
            f"{_h('q', 'job_id')} AS pick, "
            f"{_h('m', 'i')} AS rm, {_h('g', 'i')} AS rg "
            f"FROM ({lvl1}) AS q2")
    lvl3 = (f"SELECT *, CASE WHEN {_h('z', 'i')} < 0.03 THEN NULL WHEN idle THEN ROUND(rg * 4, 2) "
            f"ELSE ROUND(5 + rg * 95, 2) END AS util FROM ({lvl2}) AS q3")
    model = f"ELT(node MOD 3 + 1, {', '.join(repr(m) for m in MODELS)})"
    known = "CASE WHEN util IS NULL THEN NULL ELSE {} END".format  # measured with the utilisation
    values = {
        "cluster": "'bench'", "job_id": "job_id", "restart_count": "restart", "node": "'gpu' || LPAD(node, 4, '0')",
        "gpu_uuid": "'GPU-' || LPAD(node, 4, '0') || '-' || gpu || '-' || LPAD(HEX(CRC32('uuid' || node || '/' || gpu)), 8, '0')",
        "gpu_index": "gpu", "gpu_model": model, "user": "'user' || LPAD(u, 3, '0')",
        "account": "'acct' || LPAD((u * 7) MOD 40, 2, '0')",
        "partition": "'part' || CASE WHEN pick < 0.8 THEN u MOD 8 ELSE FLOOR(pick * 40) MOD 8 END",
        "start_time": "start", "end_time": "start + dur", "duration_s": "dur",
        "energy_j": "ROUND((80 + COALESCE(util, 0) * 6) * dur, 1)", "gpu_util_mean_pct": "util",
        "mem_util_mean_pct": known("ROUND(LEAST(100, util * rm), 2)"),
        "max_memory_bytes": known("FLOOR(rm * 85899345920)"),
        "memory_total_bytes": "ELT(node MOD 3 + 1, 85520809984, 150754820096, 85899345920)",
        "process_count": "1 + FLOOR(rm * 4)", "ecc_corrected_delta": "0", "ecc_uncorrected_delta": "0",
        "retired_pages_delta": "0", "remapped_rows_delta": "0", "clock_event_reasons": "0", "partial": "0",
        "withdrawn": "0", "shipped_at": "start + dur + 30",
    }
    # Columns of this schema version only (others keep their defaults: NULL where not measured).
    cols = [c for c in C.CENTRAL_JOB_GPU_COLUMNS + C.SHIPPED if c in values]
    return (f"INSERT INTO job_gpus ({CS._q(cols)})\n"
            f"SELECT {', '.join(values[c] for c in cols)}\nFROM ({lvl3}) AS q4")


def _secondary_keys(server: testdb.MariaDB, db: str) -> Tuple[str, List[str]]:
    ddl = client(server, "SHOW CREATE TABLE job_gpus", db).split("\t", 1)[1].replace("\\n", "\n")
    keys = [line.strip().rstrip(",") for line in ddl.splitlines() if line.strip().startswith("KEY ")]
    return ddl, keys


def load(server: testdb.MariaDB, db: str, rows: int, chunk: int) -> Dict[str, float]:
    """Fill job_gpus with `rows` records; returns the seconds of each phase."""
    took: Dict[str, float] = {}
    before, keys = _secondary_keys(server, db)
    names = [re.match(r'KEY "([^"]+)"', k).group(1) for k in keys]  # type: ignore[union-attr]
    t0 = time.perf_counter()
    client(server, "ALTER TABLE job_gpus " + ", ".join(f'DROP INDEX "{n}"' for n in names), db)
    done = 0
    t_ins = time.perf_counter()
    while done < rows:
        n = min(chunk, rows - done)
        client(server, "SET SESSION unique_checks = 0;\n" + _load_sql(done, n), db)
        done += n
        rate = done / (time.perf_counter() - t_ins)
        print(f"# inserted {done:,} / {rows:,} ({rate:,.0f} rows/s)", file=sys.stderr, flush=True)
    took["insert"] = time.perf_counter() - t_ins
    t1 = time.perf_counter()
    client(server, "ALTER TABLE job_gpus " + ", ".join(f"ADD {k}" for k in keys), db)
    took["indexes"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    client(server, "ANALYZE TABLE job_gpus", db)
    took["analyze"] = time.perf_counter() - t2
    took["total"] = time.perf_counter() - t0
    after, _ = _secondary_keys(server, db)
    if after != before:
        raise RuntimeError(f"job_gpus after the load differs from the schema:\n{before}\n---\n{after}")
    return took


def describe_data(server: testdb.MariaDB, db: str) -> str:
    row = client(server, 'SELECT COUNT(*), COUNT(DISTINCT "user"), COUNT(DISTINCT account), COUNT(DISTINCT "partition"), '
                         'COUNT(DISTINCT node), COUNT(DISTINCT gpu_model), COUNT(DISTINCT job_id), '
                         'SUM(gpu_util_mean_pct IS NULL), MIN(duration_s), MAX(duration_s), '
                         'FROM_UNIXTIME(MIN(start_time)), FROM_UNIXTIME(MAX(end_time)) FROM job_gpus', db).split("\t")
    size = client(server, "SELECT data_length, index_length FROM information_schema.tables "
                          f"WHERE table_schema = '{db}' AND table_name = 'job_gpus'").split()
    return (f"{int(row[0]):,} records, {row[1]} users, {row[2]} accounts, {row[3]} partitions, {row[4]} nodes, "
            f"{row[5]} models, {int(row[6]):,} jobs, {int(row[7]):,} NULL util, duration {float(row[8]):.0f}-"
            f"{float(row[9]):.0f} s, {row[10]} .. {row[11].strip()}; table {human_bytes(int(size[0]))} + "
            f"indexes {human_bytes(int(size[1]))}")


# --------------------------------------------------------------------------- the report's SQL

class Recorder:
    """A CentralSource's connection that runs each statement and keeps what the server received
    (PyMySQL's own escaping, as ServerConnection sends it) and how long it took."""

    def __init__(self, src: CentralSource):
        self.conn = src.conn
        self.pymysql = src.central.conn
        self.log: List[Tuple[str, float]] = []

    def _text(self, sql: str, params: Any) -> str:
        args = dict(params) if isinstance(params, dict) else tuple(params or ())
        with self.pymysql.cursor() as cur:
            return cur.mogrify(translate(sql, params), args)

    def execute(self, sql: str, params: Any = None) -> Any:
        t0 = time.perf_counter()
        cur = self.conn.execute(sql, params)
        self.log.append((self._text(sql, params), time.perf_counter() - t0))
        return cur

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        # PyMySQL's executemany of INSERT ... VALUES (...) sends one multi-row INSERT.
        t0 = time.perf_counter()
        self.conn.executemany(sql, rows)
        head, _, values = translate(sql, ()).partition(" VALUES ")
        with self.pymysql.cursor() as cur:
            text = f"{head} VALUES " + ",".join(cur.mogrify(values, tuple(r)) for r in rows)
        self.log.append((text, time.perf_counter() - t0))


def open_source(url: str, password: str, timeout_s: float, query: Query,
                raw: bool = False) -> CentralSource:
    central = C.Central(C.parse_url(url), password, timeout_s)
    try:
        return (RawSource if raw else CentralSource)(central, query)
    except BaseException:
        central.close()
        raise


class RawSource(CentralSource):
    """The server's records without the rollups: the plan `report --by` ran before them."""

    def summary_rows(self, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
        return None


def window_query(window: Tuple[Any, ...]) -> Query:
    return Query(since_s=float(window[3]), until_s=float(window[4]), tz="utc")


def plan_statements(url: str, password: str, timeout_s: float, by: Sequence[str], query: Query) -> List[str]:
    """The statements of summary_plan(by) on the server (calendar table, then the SELECT)."""
    with open_source(url, password, timeout_s, query, raw=True) as src:
        plan = P.summary_plan(src, by)
        assert plan is not None, "no records"
        rec = Recorder(src)
        plan.run(src, rec)
        return [text for text, _ in rec.log]


def last_digit_cells(a: str, b: str) -> Optional[int]:
    """How many cells of two CSV texts differ, where each such cell differs by one unit in its last
    printed digit (a rounding tie decided by the order of the additions); None: another difference."""
    ra, rb = a.splitlines(), b.splitlines()
    if len(ra) != len(rb):
        return None
    n = 0
    for la, lb in zip(ra, rb):
        ca, cb = la.split(","), lb.split(",")
        if len(ca) != len(cb):
            return None
        for x, y in zip(ca, cb):
            if x == y:
                continue
            if "." not in x or "." not in y:
                return None  # a count (jobs) differs: never a rounding tie
            try:
                unit = 10.0 ** -len(x.partition(".")[2])
                if abs(float(x) - float(y)) > unit * 1.001:
                    return None
            except ValueError:
                return None
            n += 1
    return n


def same_figures(url: str, password: str, timeout_s: float, by: Sequence[str], query: Query
                 ) -> Tuple[str, Optional[int]]:
    """(the rollup plan's description, the cells its CSV has other than the raw plan's: see
    last_digit_cells), in-process."""
    from slurm_gpu import render
    out = []
    for raw in (False, True):
        with open_source(url, password, timeout_s, query, raw=raw) as src:
            table = report.summary(src, by)
            out.append((src.plan, render.render(list(table.rows), table.columns, "csv")))
    cells = last_digit_cells(out[0][1], out[1][1])
    if cells is None:
        import difflib
        print("\n".join(difflib.unified_diff(out[1][1].splitlines(), out[0][1].splitlines(), "records", "rollups",
                                             n=0, lineterm=""))[:3000], file=sys.stderr)
    return out[0][0], cells


def run_child(argv: List[str], env: Dict[str, str]) -> Tuple[float, str]:
    """Seconds of argv and its stderr."""
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... failed ({r.returncode}): {r.stderr.decode()[-1500:]}")
    return took, r.stderr.decode()


def short(sql: str, n: int = 70) -> str:
    one = " ".join(sql.split())
    return one if len(one) <= n else one[:n - 3] + "..."


# --------------------------------------------------------------------------- schema v3, migration, sizes

def migrate_to(srv: C.Central, version: int) -> None:
    """The central schema up to `version` only, as Central.migrate() applies each step."""
    for v in range(srv.schema_version() or 0, version):
        for stmt in C.MIGRATIONS[v]:
            stmt(srv) if callable(stmt) else srv.execute(stmt)
        srv.execute("INSERT INTO meta (name, value) VALUES ('schema_version', %s) "
                    "ON DUPLICATE KEY UPDATE value = VALUES(value)", (str(v + 1),))
        srv.commit()


SIZED = ("job_gpus", "rollup_day", "rollup_day_node", "rollup_jobs", "rollup_month", "rollup_week",
         "rollup_node_day", "rollup_node_month", "rollup_partition_day")


def table_sizes(server: testdb.MariaDB, db: str) -> Dict[str, Tuple[int, int, int]]:
    """table -> (rows counted, data bytes, index bytes) after ANALYZE (information_schema)."""
    client(server, "ANALYZE TABLE " + ", ".join(SIZED), db)
    out = {}
    for t in SIZED:
        n = int(client(server, f"SELECT COUNT(*) FROM {t}", db).strip())
        data, index = client(server, "SELECT data_length, index_length FROM information_schema.tables "
                                     f"WHERE table_schema = '{db}' AND table_name = '{t}'").split()
        out[t] = (n, int(data), int(index))
    return out


def print_sizes(sizes: Dict[str, Tuple[int, int, int]], records: int) -> None:
    print(f"{'table':<16} {'rows':>12} {'rows/record':>11} {'data':>11} {'indexes':>11}")
    for t, (n, data, index) in sizes.items():
        print(f"{t:<16} {n:>12,} {n / records:>11.3f} {human_bytes(data):>11} {human_bytes(index):>11}")


def time_migration(server: testdb.MariaDB, url: str, password: str, rows: int) -> float:
    """v3 -> v5 (the rollups built from the records), v5 -> v6 (their job counts and peaks built
    from the rollups' rows), v6 -> current (v8: the week, month and node tables from the day
    tables; v10: the partition table from rollup_day), as `central init` runs them: each timed."""
    with C.Central(C.parse_url(url), password, 3600) as srv:
        t0 = time.perf_counter()
        migrate_to(srv, 5)
        t1 = time.perf_counter()
        migrate_to(srv, 6)
        t2 = time.perf_counter()
        before, after = srv.migrate("utc")
        t3 = time.perf_counter()
        W.register(srv, "push", [W.Writer("bench_writer", ("pushnode",))])  # v5: the node the push phase ships
    assert (before, after) == (6, C.SCHEMA_VERSION), (before, after)
    print(f"migration v3 -> v5 (rollups built from {rows:,} records, one transaction): {t1 - t0:.1f} s", flush=True)
    print(f"migration v5 -> v6 (job counts and peaks built from the rollups): {t2 - t1:.1f} s", flush=True)
    print(f"migration v6 -> v{after} (week, month, node and partition rollups built from the day tables): "
          f"{t3 - t2:.1f} s", flush=True)
    return t3 - t0


# --------------------------------------------------------------------------- reports

Case = Tuple[Tuple[str, ...], Tuple[Any, ...]]  # (--by keys, window)


def cli_argv(python: Path, cfg: Path, url: str, by: Sequence[str], window: Tuple[Any, ...]) -> List[str]:
    keys = ",".join("model" if k == "gpu-model" else k for k in by)
    return [str(python), "-m", "slurm_gpu.cli", "--config", str(cfg), "report", "--by", keys, "--since", window[1],
            "--until", window[2], "--tz", "utc", "--explain", "--db", url, "--format", "csv"]


def prepare_reports(server: testdb.MariaDB, db: str, url: str, password: str, timeout_s: float
                    ) -> Tuple[Dict[Case, str], Dict[Case, str]]:
    """Per case: the raw plan's script for the client, and the rollup plan (checked equal to the raw)."""
    scripts, plans = {}, {}
    for window in WINDOWS:
        for by in BYS:
            query = window_query(window)
            stmts = plan_statements(url, password, timeout_s, by, query)
            scripts[(by, window)] = ";\n".join(stmts) + ";\n"
            described, cells = same_figures(url, password, timeout_s, by, query)
            if cells is None:
                raise RuntimeError(f"--by {','.join(by)} over {window[0]}: rollups and records differ")
            plans[(by, window)] = described
            same = "byte for byte" if not cells else f"but {cells} cell(s) one unit off in the last digit (ties)"
            print(f"# --by {','.join(by)}, {window[0]}: rollup CSV = raw CSV {same}; plan: {described}", flush=True)
    return scripts, plans


def rollup_breakdown(server: testdb.MariaDB, db: str, url: str, password: str, timeout_s: float, runs: int) -> None:
    """Where a year's rollup plan spends its time, in the client (medians of `runs`): the whole
    statement the CLI sends, its per-month sums with the cells' job counts and peaks alone, and its
    distinct job counts alone (the jobs of several groups or with days apart: kind 0)."""
    from slurm_gpu.report import rollup as RP
    window = WINDOWS[0]
    for by in (("user",), ("node",)):
        with open_source(url, password, timeout_s, window_query(window)) as src:
            plan = RP.plan(src, by)
            with src.central.conn.cursor() as cur:
                whole = cur.mogrify(translate(plan.sql, plan.params), plan.params)
        # The year is twelve whole months: the plan reads the month tables only.
        col, table, kind = (('"user"', "rollup_month", "day_kind") if by == ("user",)
                            else ('"node"', "rollup_node_month", "node_kind"))
        d0, d1 = plan.params["r_d0"], plan.params["r_d1"]
        days = f"day BETWEEN {d0} AND {d1}"
        m0, m1 = plan.params.get("r_m0", d0), plan.params.get("r_m1", d1)
        sums = (f"SELECT {col}, SUM(alloc_s), SUM(util_pct_s), SUM(energy_j), "
                f"SUM(jobs_first + CASE WHEN day = {d0} THEN jobs_later ELSE 0 END), MAX(peak_bytes) "
                f"FROM {table} WHERE day BETWEEN {m0} AND {m1} GROUP BY {col}")
        jobs = f"SELECT {col}, COUNT(DISTINCT cluster, job_id) FROM rollup_jobs WHERE {days} AND {kind} = 0 GROUP BY {col}"
        n_mixed = client(server, f"SELECT COUNT(*), COUNT(DISTINCT cluster, job_id) FROM rollup_jobs WHERE {days} "
                                 f"AND {kind} = 0;", db).split()
        took: Dict[str, List[float]] = {}
        for _ in range(runs):
            for name, sql in (("whole", whole), ("sums", sums), ("jobs", jobs)):
                t0 = time.perf_counter()
                client(server, sql + ";", db)
                took.setdefault(name, []).append(time.perf_counter() - t0)
        print(f"# rollup plan of --by {by[0]}, year, in the client: whole statement "
              f"{statistics.median(took['whole']):.3f} s, per-month sums with job counts and peaks alone "
              f"{statistics.median(took['sums']):.3f} s, distinct job counts alone ({n_mixed[0]} rollup_jobs rows of "
              f"{n_mixed[1]} jobs with {kind} 0) {statistics.median(took['jobs']):.3f} s", flush=True)


def time_reports(server: testdb.MariaDB, db: str, scripts: Dict[Case, str], argv: Dict[Case, List[str]],
                 env: Dict[str, str], runs: int, configs: Any) -> Tuple[Dict[Tuple[Case, str], List[float]], Dict[Case, str]]:
    times: Dict[Tuple[Case, str], List[float]] = {}
    said: Dict[Case, str] = {}
    for run in range(runs):
        configs()
        for case in scripts:
            took, err = run_child(argv[case], env)
            times.setdefault((case, "cli"), []).append(took)
            said[case] = next((ln[len("slurm-gpu: plan: "):] for ln in err.splitlines()
                               if ln.startswith("slurm-gpu: plan: ")), "(no plan line)")
            c0 = time.perf_counter()
            client(server, scripts[case], db)
            times.setdefault((case, "client"), []).append(time.perf_counter() - c0)
        print(f"# run {run + 1}/{runs}: " + ", ".join(
            f"{','.join(by)}/{w[0]} {times[((by, w), 'cli')][-1]:.2f}/{times[((by, w), 'client')][-1]:.2f} s"
            for by, w in scripts), file=sys.stderr, flush=True)
    return times, said


def print_reports(rows: int, runs: int, times: Dict[Tuple[Case, str], List[float]], said: Dict[Case, str]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'records':>11} {'--by':<24} {'window':<6} {'CLI s':>7} {'client s':>9} {'ratio':>7}  "
          f"(medians of {runs}; client: the raw GROUP BY of the same window)")
    cases = sorted({c for c, _ in times}, key=lambda c: (WINDOWS.index(c[1]), BYS.index(c[0])))
    for case in cases:
        by, w = case
        cl, sh = med[(case, "cli")], med[(case, "client")]
        miss = [f"> {TARGET_S:g} s" for _ in [0] if cl > TARGET_S] + [f"ratio > {TARGET_RATIO}" for _ in [0]
                                                                      if cl / sh > TARGET_RATIO]
        print(f"{rows:>11,} {','.join(by):<24} {w[0]:<6} {cl:>7.3f} {sh:>9.3f} {cl / sh:>7.3f}"
              f"{'   (missed: ' + ', '.join(miss) + ')' if miss else ''}")
    print("\nplans (`--explain`):")
    for case in cases:
        print(f"  --by {','.join(case[0])}, {case[1][0]}: {said[case]}")


# --------------------------------------------------------------------------- push

def node_records(n_jobs: int, first_job: int, gpus: int = 8, t0: float = 1_790_000_000.0):
    for j in range(n_jobs):
        start = t0 + j * 97.0
        dur = 600.0 + (j * 7919) % 86400
        job = {"cluster": "push", "job_id": first_job + j, "restart_count": 0, "node": "pushnode", "user": f"user{j % 200:03d}",
               "uid": 1000 + j % 200, "account": f"acct{j % 40:02d}", "partition": f"part{j % 8}", "gpu_count": gpus,
               "start_time": start, "end_time": start + dur, "exit_code": "0"}
        rows = [{k: job[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account", "partition")} | {
            "gpu_uuid": f"GPU-pushnode-{i}", "gpu_index": i, "gpu_model": MODELS[0], "start_time": start,
            "end_time": start + dur, "duration_s": dur, "energy_j": 500.0 * dur, "gpu_util_mean_pct": float((j + i) % 101),
            "mem_util_mean_pct": float((j + 3 * i) % 101), "max_memory_bytes": (j % 80) << 30, "process_count": 1}
            for i in range(gpus)]
        yield {"kind": "job_end", "job": job, "gpus": rows}


def write_node_db(path: Path, spool: Path, n_jobs: int, first_job: int) -> float:
    store = Store(str(path), str(spool))
    t0 = time.perf_counter()
    for rec in node_records(n_jobs, first_job):
        where = store.write(rec, ingest=False)
        if where != "db":
            raise RuntimeError(f"Store.write put a record in {where}")
    store.close()
    return time.perf_counter() - t0


def push_once(argv: List[str], env: Dict[str, str], want: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if r.returncode != 0 or want not in r.stdout:
        raise RuntimeError(f"db push ({r.returncode}) said {r.stdout.strip()!r}, expected {want!r}: {r.stderr[-1500:]}")
    return took


def set_apply_batch(admin: C.Central, with_rollups: bool) -> None:
    admin.execute(CS._procedure(with_rollups=with_rollups))
    admin.commit()


def bench_push(args: argparse.Namespace, python: Path, work: Path, wr_cfg: Path, admin: C.Central, env: Dict[str, str],
               configs: Any) -> Dict[bool, List[float]]:
    """Alternate pushes without and with the rollup calls in apply_batch: job_gpus records/s of each."""
    n_gpus = args.push_jobs * 8
    rates: Dict[bool, List[float]] = {False: [], True: []}
    for i in range(args.push_rounds * 2):
        with_rollups = i % 2 == 1
        node_db = work / f"node{i}.db"
        wrote = write_node_db(node_db, work / f"spool{i}", args.push_jobs, 5_000_000 + i * args.push_jobs)
        print(f"# node database {i}: {n_gpus:,} job_gpus written through Store.write in {wrote:.1f} s", flush=True)
        configs()
        set_apply_batch(admin, with_rollups)
        argv = [str(python), "-m", "slurm_gpu.cli", "--config", str(wr_cfg), "db", "push", "--db", str(node_db),
                "--no-progress", "--batch-size", str(args.push_batch_size)]
        took = push_once(argv, env, f"shipped jobs {args.push_jobs}, job_gpus {n_gpus}; left 0")
        rates[with_rollups].append(n_gpus / took)
        again = push_once(argv, env, "shipped nothing; left 0")
        print(f"db push {i + 1} ({'with' if with_rollups else 'without'} the rollups): {n_gpus:,} job_gpus + "
              f"{args.push_jobs:,} jobs in {took:.1f} s = {n_gpus / took:,.0f} job_gpus/s; nothing to ship {again:.2f} s",
              flush=True)
    set_apply_batch(admin, True)
    a, b = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"push medians: without the rollups {a:,.0f} job_gpus/s, with {b:,.0f} job_gpus/s = {b / a:.2f} of it")
    return rates


def time_rebuild(admin: C.Central) -> None:
    from slurm_gpu.central import rollups as R
    t0 = time.perf_counter()
    diff = R.rebuild(admin)
    took = time.perf_counter() - t0
    print(f"central rollup --rebuild: {took:.1f} s; corrected (missing, extra, other) per table: {diff}")


# --------------------------------------------------------------------------- main

def write_config(path: Path, work: Path, url: str, user: str, password: str, timeout_s: float, node_db: Path) -> Path:
    pw = work / f"{user}.password"
    pw.write_text(password + "\n")
    os.chmod(pw, 0o600)
    path.write_text(f'cluster_name = "push"\nslurm_conf = "{work}/none.conf"\n'
                    f'[store]\ndatabase = "{node_db}"\nspool_dir = "{work}/spool"\n'
                    f'[central]\nurl = "{url}"\npassword_file = "{pw}"\ntimeout_s = {timeout_s}\n')
    os.chmod(path, 0o644)
    return path


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="job_gpus records on the server (default 1,000,000)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per measurement (median)")
    ap.add_argument("--chunk", type=int, default=1_000_000, help="records per INSERT ... SELECT")
    ap.add_argument("--buffer-pool", default="4G", help="innodb_buffer_pool_size (default 4G; 12G for 10 M records)")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="central.timeout_s of the CLI's config (its read timeout; the default config has 10)")
    ap.add_argument("--push-jobs", type=int, default=12_500, help="8-GPU job_end records per node database")
    ap.add_argument("--push-batch-size", type=int, default=2000, help="db push --batch-size (central.batch_size's default: 2000)")
    ap.add_argument("--push-rounds", type=int, default=2,
                    help="pairs of pushes (without, with the rollups); 0: no push, no rebuild")
    ap.add_argument("--workdir", default=None,
                    help="directory for the server's data, temporary files, configs and node database, removed "
                         "at the end (default: a new one in /var/tmp: 10 M records take ~10 GB)")
    return ap.parse_args()


def main() -> int:
    args = arguments()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on a kill too
    server = BenchMariaDB([f"--innodb-buffer-pool-size={args.buffer_pool}", "--innodb-log-file-size=2G",
                           "--innodb-log-buffer-size=64M", "--innodb-sort-buffer-size=64M",
                           "--max-allowed-packet=256M"],
                          Path(args.workdir) if args.workdir else
                          Path(tempfile.mkdtemp(prefix="slurm-gpu-bench-central-", dir="/var/tmp")))
    try:
        return bench(server, args)
    finally:
        server.cleanup()  # the server and everything under its directory (configs, node database)


def setup(server: BenchMariaDB) -> Tuple[str, Dict[str, Tuple[str, str]]]:
    """The database at schema v3 and its admin account: db, {"admin": (url, password)}."""
    db = server.new_database("bench")
    admin = "bench_admin"
    admin_pw = server.new_user(admin, [f"GRANT ALL ON {db}.* TO '{admin}'@'%';"])
    with C.Central(C.parse_url(server.url(admin, db)), admin_pw, 60) as srv:
        migrate_to(srv, 3)
    return db, {"admin": (server.url(admin, db), admin_pw)}


def accounts(server: BenchMariaDB, db: str, admin_url: str) -> Dict[str, Tuple[str, str]]:
    """The writer and reporter with the GRANTs `central init` prints for the current schema (after
    the migration: they name tables a v3 server does not have)."""
    writer, reporter = "bench_writer", "bench_reporter"
    grants = [g for g in C.grants(C.parse_url(admin_url), writer, reporter) if g.startswith("GRANT")]
    reporter_pw = server.new_user(reporter, [g for g in grants if f"'{reporter}'" in g])
    writer_pw = server.new_user(writer, [g for g in grants if f"'{writer}'" in g])
    return {"writer": (server.url(writer, db), writer_pw), "reporter": (server.url(reporter, db), reporter_pw)}


def bench(server: BenchMariaDB, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    server.start()
    work = server.dir / "bench"
    work.mkdir(mode=0o700)
    version = client(server, "SELECT VERSION(), @@innodb_buffer_pool_size").split()
    print(f"# MariaDB {version[0]} on {os.cpu_count()} CPUs, buffer pool {human_bytes(int(version[1]))}, "
          f"started in {time.perf_counter() - t0:.1f} s; data in {server.dir}", flush=True)
    python = clean_venv(server.dir / "install", "central")
    print(f"# the CLI: a regular install into {python.parent.parent} (pip, its bytecode compiled)", flush=True)
    db, acct = setup(server)

    took = load(server, db, args.rows, args.chunk)
    print(f"loaded {args.rows:,} records into schema v3 in {took['total']:.1f} s (insert {took['insert']:.1f} s = "
          f"{args.rows / took['insert']:,.0f} rows/s, {len(_secondary_keys(server, db)[1])} secondary indexes "
          f"{took['indexes']:.1f} s, ANALYZE {took['analyze']:.1f} s)", flush=True)
    print(f"# {describe_data(server, db)}", flush=True)
    time_migration(server, *acct["admin"], args.rows)
    acct.update(accounts(server, db, acct["admin"][0]))
    print_sizes(table_sizes(server, db), args.rows)

    rep_cfg, wr_cfg = work / "reporter.toml", work / "writer.toml"

    def configs() -> None:
        # Written again before each use: a long run must not depend on files in /tmp surviving
        # (a first 10 M run in /tmp lost its configs, then a server temp file, to a /tmp sweeper).
        work.mkdir(mode=0o700, exist_ok=True)
        for cfg, role in ((rep_cfg, "reporter"), (wr_cfg, "writer")):
            url, password = acct[role]
            write_config(cfg, work, url, f"bench_{role}", password, args.timeout_s, work / "node.db")
    configs()
    env = dict(os.environ)
    env.pop("SLURM_CONF", None)
    env.pop("SLURM_GPU_CONFIG", None)
    scripts, _ = prepare_reports(server, db, *acct["reporter"], args.timeout_s)
    argv = {case: cli_argv(python, rep_cfg, acct["reporter"][0], *case) for case in scripts}
    times, said = time_reports(server, db, scripts, argv, env, args.runs, configs)
    print_reports(args.rows, args.runs, times, said)
    rollup_breakdown(server, db, *acct["reporter"], args.timeout_s, args.runs)

    if args.push_rounds:
        print()
        with C.Central(C.parse_url(acct["admin"][0]), acct["admin"][1], 3600) as admin:
            bench_push(args, python, work, wr_cfg, admin, env, configs)
            time_rebuild(admin)
        print_sizes(table_sizes(server, db), args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
