"""Benchmark the central MariaDB server: `report --db mysql://...` over N records, and `db push`.

    python3 benchmarks/bench_central.py [--rows 10000000] [--runs 5] [--buffer-pool 12G] [--workdir DIR]

Not run in CI (needs Debian's mariadb-server and root, like tests/test_central.py).  It

1. starts a throwaway MariaDB (tests/mariadb.py, with a larger InnoDB buffer pool and redo log),
   creates a database and runs the central schema migration as an admin account with a password;
2. fills job_gpus with --rows records generated on the server (the SEQUENCE engine's seq_0_to_M,
   INSERT ... SELECT in chunks; the secondary indexes are dropped for the load and re-created
   afterwards exactly as the schema has them: one sorted build each): ~200 users (a few heavy,
   a long tail), 40 accounts, 8 partitions, 1000 nodes, 3 GPU models, jobs of 1/2/4/8 GPUs
   starting over 365 days, 1 min-48 h long (log-uniform), 3 % unknown utilisation, 12 % idle jobs;
3. times, interleaved over --runs runs, medians of
   - the whole CLI: `python3 -m slurm_gpu.cli --config CFG report --by KEYS --db URL --format csv`
     as the reporter account (exactly the GRANTs of slurm_gpu.store.central.grants());
   - the same aggregation in the `mariadb` command-line client (root over the socket): the
     statements report.summary_plan() makes through a CentralSource, with the parameters
     inlined by PyMySQL's own escaping (for day/week/month with the temporary calendar table,
     created in the same client session) - checked once against the server's general log of a
     CLI run, so they are byte for byte what the CLI sends;
   - in-process open + report.summary() (CentralSource), with where its time goes per statement;
   and prints EXPLAIN of each aggregation;
4. writes a node database (schema v5, the outbox) with 100,000 job_gpus records through
   Store.write (12,500 job_end records of 8 GPUs) and times `slurm-gpu db push` from it as the
   writer account (records per second), then a second push with nothing to ship;
5. removes the server and its files at the end, also on an error or SIGTERM.
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

from slurm_gpu.report import query as report  # noqa: E402
from slurm_gpu.report.central import CentralSource, translate  # noqa: E402
from slurm_gpu.store import central as C  # noqa: E402
from slurm_gpu.store import writers as W  # noqa: E402
from slurm_gpu.store.node import Store  # noqa: E402

YEAR_START = 1735689600  # 2025-01-01T00:00:00Z
YEAR_S = 365 * 86400
BYS = (("user",), ("account", "month"))
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
CLIENT = ["mariadb", "--no-defaults"]


class BenchMariaDB(testdb.MariaDB):
    """tests/mariadb.py's server with extra mariadbd options (later options win on its command
    line).  tests/mariadb.py takes no options, so its module-level OPTS is extended for the
    duration of start() only."""

    def __init__(self, extra_opts: Sequence[str], workdir: Path):
        super().__init__(workdir)
        # The server's temporary files (a report's derived tables) in its own directory, not /tmp.
        self.tmpdir = self.dir / "tmp"
        self.extra_opts = list(extra_opts) + [f"--tmpdir={self.tmpdir}"]

    def start(self, timeout_s: float = 180.0) -> "BenchMariaDB":
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        saved = testdb.OPTS
        testdb.OPTS = list(saved) + self.extra_opts
        try:
            super().start(timeout_s)
        finally:
            testdb.OPTS = saved
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
    """A deterministic pseudo-random number in [0, 1) from expr (CRC32 of tag || expr)."""
    return f"(CRC32('{tag}' || {expr}) / 4294967296.0)"


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
            f"CRC32('n' || job_id) MOD 1000 AS node, "
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
    cols = [c for c in C.JOB_GPU_COLUMNS + C.SHIPPED if c in values]
    return (f"INSERT INTO job_gpus ({C._q(cols)})\n"
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


def open_source(url: str, password: str, timeout_s: float) -> CentralSource:
    central = C.Central(C.parse_url(url), password, timeout_s)
    try:
        return CentralSource(central, report.Query())
    except BaseException:
        central.close()
        raise


def plan_statements(url: str, password: str, timeout_s: float, by: Sequence[str]) -> List[str]:
    """The statements of report.summary_plan(by) on the server (calendar table, then the SELECT)."""
    with open_source(url, password, timeout_s) as src:
        plan = report.summary_plan(src, by)
        assert plan is not None, "no records"
        rec = Recorder(src)
        plan.run(src, rec)
        return [text for text, _ in rec.log]


def in_process(url: str, password: str, timeout_s: float, by: Sequence[str]) -> Tuple[float, List[Tuple[str, float]]]:
    """Seconds of connect + CentralSource + report.summary(), and each statement's seconds."""
    t0 = time.perf_counter()
    with open_source(url, password, timeout_s) as src:
        rec = Recorder(src)
        src.conn = rec  # type: ignore[assignment]  # every statement of summary() goes through it
        report.summary(src, by)
    return time.perf_counter() - t0, rec.log


def general_log_of(server: testdb.MariaDB, db: str, argv: List[str], env: Dict[str, str], user: str) -> List[str]:
    """The statements the server received from `user` while argv ran."""
    client(server, "SET GLOBAL log_output = 'TABLE'; TRUNCATE TABLE mysql.general_log; SET GLOBAL general_log = 1")
    try:
        run_child(argv, env)
    finally:
        client(server, "SET GLOBAL general_log = 0")
    out = subprocess.run(CLIENT + [f"--socket={server.socket}", "-u", "root", "-N", "-B", "--raw", "-e",
                                   "SELECT HEX(argument) FROM mysql.general_log WHERE command_type = 'Query' AND thread_id IN "
                                   "(SELECT thread_id FROM mysql.general_log WHERE command_type = 'Connect' "
                                   f"AND argument LIKE '{user}@%') ORDER BY event_time"],
                         capture_output=True, text=True, check=True).stdout
    return [bytes.fromhex(h).decode("utf-8") for h in out.split()]


def run_child(argv: List[str], env: Dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... failed ({r.returncode}): {r.stderr.decode()[-1500:]}")
    return took


def short(sql: str, n: int = 70) -> str:
    one = " ".join(sql.split())
    return one if len(one) <= n else one[:n - 3] + "..."


# --------------------------------------------------------------------------- push

def node_records(n_jobs: int, gpus: int = 8, t0: float = 1_790_000_000.0):
    for j in range(n_jobs):
        start = t0 + j * 97.0
        dur = 600.0 + (j * 7919) % 86400
        job = {"cluster": "push", "job_id": 5_000_000 + j, "restart_count": 0, "node": "pushnode", "user": f"user{j % 200:03d}",
               "uid": 1000 + j % 200, "account": f"acct{j % 40:02d}", "partition": f"part{j % 8}", "gpu_count": gpus,
               "start_time": start, "end_time": start + dur, "exit_code": "0"}
        rows = [{k: job[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account", "partition")} | {
            "gpu_uuid": f"GPU-pushnode-{i}", "gpu_index": i, "gpu_model": MODELS[0], "start_time": start,
            "end_time": start + dur, "duration_s": dur, "energy_j": 500.0 * dur, "gpu_util_mean_pct": float((j + i) % 101),
            "mem_util_mean_pct": float((j + 3 * i) % 101), "max_memory_bytes": (j % 80) << 30, "process_count": 1}
            for i in range(gpus)]
        yield {"kind": "job_end", "job": job, "gpus": rows}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000, help="job_gpus records on the server (default 10,000,000)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per measurement (median)")
    ap.add_argument("--chunk", type=int, default=1_000_000, help="records per INSERT ... SELECT")
    ap.add_argument("--buffer-pool", default="12G", help="innodb_buffer_pool_size (default 12G)")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="central.timeout_s of the CLI's config (its read timeout; the default config has 10)")
    ap.add_argument("--push-jobs", type=int, default=12_500, help="8-GPU job_end records in the node database")
    ap.add_argument("--workdir", default=None,
                    help="directory for the server's data, temporary files, configs and node database, removed "
                         "at the end (default: a new one in /var/tmp: 10 M records take ~10 GB)")
    args = ap.parse_args()

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


def bench(server: BenchMariaDB, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    server.start()
    work = server.dir / "bench"
    work.mkdir(mode=0o700)
    version = client(server, "SELECT VERSION(), @@innodb_buffer_pool_size").split()
    print(f"# MariaDB {version[0]} on {os.cpu_count()} CPUs, buffer pool {human_bytes(int(version[1]))}, "
          f"started in {time.perf_counter() - t0:.1f} s; data in {server.dir}", flush=True)
    db = server.new_database("bench")
    admin, writer, reporter = "bench_admin", "bench_writer", "bench_reporter"
    admin_pw = server.new_user(admin, [f"GRANT ALL ON {db}.* TO '{admin}'@'%';"])
    with C.Central(C.parse_url(server.url(admin, db)), admin_pw, 60) as srv:
        before, after = srv.migrate()
        W.register(srv, "push", [W.Writer(writer, ("pushnode",))])  # v4: the node the push phase ships
    assert (before, after) == (None, C.SCHEMA_VERSION), (before, after)
    grants = [g for g in C.grants(C.parse_url(server.url(admin, db)), writer, reporter) if g.startswith("GRANT")]
    reporter_pw = server.new_user(reporter, [g for g in grants if f"'{reporter}'" in g])
    writer_pw = server.new_user(writer, [g for g in grants if f"'{writer}'" in g])
    rep_url, wr_url = server.url(reporter, db), server.url(writer, db)

    # -- 2. load ---------------------------------------------------------------------------
    took = load(server, db, args.rows, args.chunk)
    print(f"loaded {args.rows:,} records in {took['total']:.1f} s (insert {took['insert']:.1f} s = "
          f"{args.rows / took['insert']:,.0f} rows/s, {len(_secondary_keys(server, db)[1])} secondary indexes "
          f"{took['indexes']:.1f} s, ANALYZE {took['analyze']:.1f} s)", flush=True)
    print(f"# {describe_data(server, db)}", flush=True)

    # -- 3. report: CLI vs the mariadb client vs in-process -------------------------------------
    node_db = work / "node.db"
    rep_cfg, wr_cfg = work / "reporter.toml", work / "writer.toml"

    def configs() -> None:
        # Written again before each use: a long run must not depend on files in /tmp surviving
        # (a first 10 M run in /tmp lost its configs, then a server temp file, to a /tmp sweeper).
        work.mkdir(mode=0o700, exist_ok=True)
        write_config(rep_cfg, work, rep_url, reporter, reporter_pw, args.timeout_s, node_db)
        write_config(wr_cfg, work, wr_url, writer, writer_pw, args.timeout_s, node_db)
    configs()
    env = dict(os.environ)
    env.pop("SLURM_CONF", None)
    env.pop("SLURM_GPU_CONFIG", None)
    cli = {by: [sys.executable, "-m", "slurm_gpu.cli", "--config", str(rep_cfg), "report", "--by", ",".join(by),
                "--db", rep_url, "--format", "csv"] for by in BYS}
    scripts: Dict[Tuple[str, ...], str] = {}
    for by in BYS:
        stmts = plan_statements(rep_url, reporter_pw, args.timeout_s, by)
        # What the CLI sends (its first run, also warming the buffer pool) must contain them verbatim.
        seen = general_log_of(server, db, cli[by], env, reporter)
        missing = [s for s in stmts if s not in seen]
        if missing:
            raise RuntimeError(f"--by {','.join(by)}: the CLI did not send {short(missing[0], 200)!r}; it sent:\n"
                               + "\n".join(short(s, 200) for s in seen))
        others = [s for s in seen if s not in stmts]
        print(f"# --by {','.join(by)}: the client's {len(stmts)} statement(s) = the CLI's (general log); "
              f"the CLI also sent {len(others)} other statement(s)", flush=True)
        scripts[by] = ";\n".join(stmts) + ";\n"
        explain = stmts[:-1] + ["EXPLAIN " + stmts[-1]]
        print(f"# EXPLAIN --by {','.join(by)}:\n" + "\n".join(
            "#   " + line for line in client(server, ";\n".join(explain) + ";", db).splitlines()), flush=True)

    times: Dict[Tuple[Tuple[str, ...], str], List[float]] = {}
    breakdown: Dict[Tuple[str, ...], List[List[Tuple[str, float]]]] = {by: [] for by in BYS}
    for run in range(args.runs):
        configs()
        for by in BYS:
            times.setdefault((by, "cli"), []).append(run_child(cli[by], env))
            c0 = time.perf_counter()
            client(server, scripts[by], db)
            times.setdefault((by, "client"), []).append(time.perf_counter() - c0)
            s, log = in_process(rep_url, reporter_pw, args.timeout_s, by)
            times.setdefault((by, "inproc"), []).append(s)
            breakdown[by].append(log)
        print(f"# run {run + 1}/{args.runs}: " + ", ".join(
            f"{','.join(by)} CLI {times[(by, 'cli')][-1]:.2f} s client {times[(by, 'client')][-1]:.2f} s"
            for by in BYS), file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'records':>11} {'--by':<14} {'CLI s':>8} {'client s':>9} {'in-proc s':>9} {'CLI/client':>10}  (median of {args.runs})")
    for by in BYS:
        cl, sh, ip = med[(by, "cli")], med[(by, "client")], med[(by, "inproc")]
        print(f"{args.rows:>11,} {','.join(by):<14} {cl:>8.2f} {sh:>9.2f} {ip:>9.2f} {cl / sh:>10.2f}"
              f"{'' if cl / sh <= 1.5 else '   (target <= 1.5)'}")
    for by in BYS:
        n = len(breakdown[by][0])
        per = [statistics.median(run[i][1] for run in breakdown[by]) for i in range(n)]
        print(f"\nin-process --by {','.join(by)}: statement medians (s)")
        for i in range(n):
            print(f"  {per[i]:8.3f}  {short(breakdown[by][0][i][0], 100)}")

    # -- 4. push -------------------------------------------------------------------------------
    configs()
    store = Store(str(node_db), str(work / "spool"))
    t1 = time.perf_counter()
    for rec in node_records(args.push_jobs):
        where = store.write(rec, ingest=False)
        if where != "db":
            raise RuntimeError(f"Store.write put a record in {where}")
    store.close()
    n_gpus = args.push_jobs * 8
    print(f"\n# node database: {args.push_jobs:,} job_end records ({n_gpus:,} job_gpus) written through Store.write "
          f"in {time.perf_counter() - t1:.1f} s ({os.path.getsize(node_db) / 1e6:.0f} MB)", flush=True)
    push = [sys.executable, "-m", "slurm_gpu.cli", "--config", str(wr_cfg), "db", "push", "--db", str(node_db),
            "--no-progress"]
    configs()
    t2 = time.perf_counter()
    r = subprocess.run(push, env=env, capture_output=True, text=True)
    first = time.perf_counter() - t2
    if r.returncode != 0:
        raise RuntimeError(f"db push failed ({r.returncode}): {r.stderr[-1500:]}")
    want = f"shipped jobs {args.push_jobs}, job_gpus {n_gpus}; left 0"
    if want not in r.stdout:
        raise RuntimeError(f"db push said {r.stdout.strip()!r}, expected {want!r}")
    on_server = client(server, "SELECT COUNT(*) FROM job_gpus WHERE cluster = 'push'", db).strip()
    assert int(on_server) == n_gpus, on_server
    again = []
    for _ in range(args.runs):
        t3 = time.perf_counter()
        r = subprocess.run(push, env=env, capture_output=True, text=True)
        again.append(time.perf_counter() - t3)
        if r.returncode != 0 or "shipped nothing; left 0" not in r.stdout:
            raise RuntimeError(f"second db push: {r.returncode} {r.stdout.strip()} {r.stderr[-500:]}")
    print(f"db push of {n_gpus:,} job_gpus + {args.push_jobs:,} jobs into a table of {args.rows:,}: {first:.1f} s = "
          f"{n_gpus / first:,.0f} job_gpus/s ({(n_gpus + args.push_jobs) / first:,.0f} rows/s, batches of "
          f"2000); second push (nothing to ship): median {statistics.median(again):.2f} s of {len(again)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
