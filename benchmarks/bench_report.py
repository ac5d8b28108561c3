"""Benchmark `slurm-gpu report` over 100 k and 1 M job-GPU records.

    python benchmarks/bench_report.py [--sizes 100000,1000000] [--runs 5] [--dir /tmp/slurm-gpu-bench]

Builds node databases with the real schema (a year of jobs: ~500 users, 50 accounts,
10 partitions, 300 nodes x 8 GPUs; files left by an older schema are migrated), then times, as medians over --runs runs:

- in-process: open + `report.summary()` for `--by user` and `--by account,month`;
- whole CLI: `python -m slurm_gpu.cli report --db FILE --by ... --format csv` as a child process;
- the same aggregation as one SELECT (report/plan.py's summary_plan, the plan used where its
  per-group index queries do not apply; parameters inlined) in the sqlite3 shell
  (/usr/bin/sqlite3) on the same file;

and the peak RSS of the CLI child (os.wait4 rusage) at each size.  Targets: <= 1 s median
each, <= 2x of the sqlite3 shell, flat memory from 100 k to 1 M.
"""
from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from slurm_gpu.report import plan as P  # noqa: E402
from slurm_gpu.report import reports as report  # noqa: E402
from slurm_gpu.report.query import Query  # noqa: E402
from slurm_gpu.report.sources import open_sources  # noqa: E402
from slurm_gpu.store import schema  # noqa: E402
from slurm_gpu.store.liveread import readonly_uri  # noqa: E402

YEAR_START = 1735689600.0  # 2025-01-01T00:00:00Z
YEAR_S = 365 * 86400
SQLITE3 = "/usr/bin/sqlite3"


def build_db(path: str, n_records: int, seed: int = 42) -> None:
    """A node database with about n_records job_gpus rows and a realistic spread."""
    if os.path.exists(path):
        os.unlink(path)
    rng = random.Random(seed)
    users = [f"user{i:03d}" for i in range(500)]
    accounts = [f"acct{i:02d}" for i in range(50)]
    user_account = {u: accounts[rng.randrange(50)] for u in users}
    # A few heavy users, a long tail (what real clusters look like).
    user_weights = [1.0 / (1 + i) ** 0.8 for i in range(500)]
    partitions = [f"part{i}" for i in range(10)]
    nodes = [f"gpu{i:03d}" for i in range(300)]
    models = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"]
    node_model = {n: models[i % 3] for i, n in enumerate(nodes)}
    uuids = {n: [f"GPU-{i:03d}{g:01d}0000-0000-0000-0000-{rng.getrandbits(48):012x}" for g in range(8)]
             for i, n in enumerate(nodes)}
    conn = sqlite3.connect(path)
    for stmt in schema.MIGRATIONS[0]:
        conn.execute(stmt)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("PRAGMA synchronous=OFF")

    def rows():
        job_id = 1000
        made = 0
        while made < n_records:
            job_id += 1
            user = rng.choices(users, user_weights)[0]
            gpus = rng.choice((1, 1, 1, 2, 2, 4, 4, 8))
            n_nodes = rng.choice((2, 4)) if gpus == 8 and rng.random() < 0.2 else 1
            start = YEAR_START + rng.random() * YEAR_S
            dur = min(rng.lognormvariate(8.0, 1.5), 172800.0) + 30
            end = start + dur
            part = partitions[hash(user) % 10] if rng.random() < 0.8 else rng.choice(partitions)
            restart = 1 if rng.random() < 0.02 else 0
            idle = rng.random() < 0.12
            for node in rng.sample(nodes, n_nodes):
                for g in rng.sample(range(8), gpus):
                    util = None if rng.random() < 0.03 else (rng.random() * 4 if idle else 5 + rng.random() * 95)
                    mem = None if util is None else min(100.0, util * rng.random())
                    power_w = 80 + (util or 0) * 6
                    yield ("bench", job_id, restart, node, uuids[node][g], g, node_model[node], user,
                           user_account[user], part, start, end, dur, power_w * dur, util, mem,
                           rng.randrange(1 << 37), 1 + rng.randrange(4), 0, 0, 0, 0, 0, None)
                    made += 1

    cols = schema.JOB_GPU_COLUMNS
    conn.executemany(f"INSERT OR IGNORE INTO job_gpus ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", rows())
    conn.commit()
    conn.close()
    migrate(path)  # later indexes built over the filled table: a sort each, faster than growing them row by row
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")  # as node databases are kept
    conn.close()


def migrate(path: str) -> int:
    """Bring a database built by an older version of this script to the current schema (as a hook would)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version < schema.SCHEMA_VERSION:
            conn.execute("BEGIN")
            for migration in schema.MIGRATIONS[version:]:
                for stmt in migration:
                    conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION}")
            conn.execute("COMMIT")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return version
    finally:
        conn.close()


def median_s(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def in_process(path: str, by: Sequence[str]) -> None:
    with open_sources([path], Query()) as src:
        report.summary(src, by)


def inline_sql(path: str, by: Sequence[str]) -> str:
    """The SELECT report/plan.py runs (unpartitioned), parameters inlined, with its calendar table, for the shell."""
    with open_sources([path], Query()) as src:
        plan = P.summary_plan(src, by)
    assert plan is not None
    sql = plan.sql
    for name, value in sorted(plan.params.items(), key=lambda kv: -len(kv[0])):
        sql = sql.replace(f":{name}", repr(value) if not isinstance(value, str) else "'" + value.replace("'", "''") + "'")
    prelude = ""
    if plan.buckets:
        # The shell builds the same calendar table (tiny: a year of months is 12 rows).
        values = ", ".join(f"({i}, {a!r}, {b!r}, '{lab}')" for i, (a, b, lab) in enumerate(plan.buckets))
        prelude = ("CREATE TEMP TABLE cal (idx INTEGER NOT NULL, b_start REAL NOT NULL, b_end REAL NOT NULL, "
                   "label TEXT NOT NULL);\n"
                   f"INSERT INTO temp.cal VALUES {values};\nCREATE INDEX temp.cal_start ON cal (b_start);\n")
    return prelude + sql + ";\n"


def run_child(argv: List[str], stdin: bytes = b"") -> Tuple[float, int]:
    """Run a child, return (seconds, peak RSS KiB) of that child alone."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stdin is not None
    p.stdin.write(stdin)
    p.stdin.close()
    _, status, usage = os.wait4(p.pid, 0)
    elapsed = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read().decode() if p.stderr else ""
    if p.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({p.returncode}): {err.strip()}")
    return elapsed, usage.ru_maxrss


def child_median(argv: List[str], runs: int, stdin: bytes = b"") -> Tuple[float, int]:
    results = [run_child(argv, stdin) for _ in range(runs)]
    return statistics.median(r[0] for r in results), max(r[1] for r in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/slurm-gpu-bench")
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    env_py = [sys.executable, "-m", "slurm_gpu.cli"]
    results: Dict[int, Dict[str, object]] = {}
    print(f"{'records':>9} {'--by':<14} {'in-proc s':>9} {'1-thread':>9} {'CLI s':>7} {'sqlite3 s':>9} {'ratio':>6} "
          f"{'1-thr rat':>8} {'CLI RSS MiB':>11}", flush=True)
    for n in sizes:
        path = os.path.join(args.dir, f"report-{n}.db")
        if args.rebuild or not os.path.exists(path):
            t0 = time.perf_counter()
            build_db(path, n)
            print(f"# built {path} in {time.perf_counter() - t0:.1f} s ({os.path.getsize(path) / 1e6:.0f} MB)", file=sys.stderr)
        else:
            t0 = time.perf_counter()
            old = migrate(path)
            if old < schema.SCHEMA_VERSION:
                print(f"# migrated {path} from schema v{old} in {time.perf_counter() - t0:.1f} s "
                      f"({os.path.getsize(path) / 1e6:.0f} MB)", file=sys.stderr)
        for by in (("user",), ("account", "month")):
            label = ",".join(by)
            inproc = median_s(lambda: in_process(path, by), args.runs)
            cli_s, rss_kib = child_median(env_py + ["report", "--db", path, "--by", label, "--format", "csv"], args.runs)
            sql = inline_sql(path, by).encode()
            # Same open mode as the report (mode=ro, immutable for a checkpointed WAL file).
            shell_s, _ = child_median([SQLITE3, readonly_uri(path)], args.runs, sql)
            saved = P.PARALLEL_MIN_ROWS
            P.PARALLEL_MIN_ROWS = 1 << 62
            try:
                serial = median_s(lambda: in_process(path, by), args.runs)
            finally:
                P.PARALLEL_MIN_ROWS = saved
            ratio = inproc / shell_s
            results.setdefault(n, {})[label] = (inproc, cli_s, shell_s, rss_kib)
            print(f"{n:>9} {label:<14} {inproc:>9.3f} {serial:>9.3f} {cli_s:>7.3f} {shell_s:>9.3f} {ratio:>6.2f} "
                  f"{serial / shell_s:>8.2f} {rss_kib / 1024:>11.1f}", flush=True)
    if len(sizes) >= 2:
        small, big = min(sizes), max(sizes)
        for label in ("user", "account,month"):
            a = results[small][label][3]
            b = results[big][label][3]
            print(f"peak RSS {label}: {a / 1024:.1f} MiB at {small} -> {b / 1024:.1f} MiB at {big} (x{b / a:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
