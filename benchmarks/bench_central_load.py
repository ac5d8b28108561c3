"""Load benchmark of the central server: N node identities pushing on the timer's schedule or all at once.

    python3 benchmarks/bench_central_load.py [--nodes 1000] [--rounds 4] [--schedule timer|cron]
        [--workers 2] [--pool 32] [--job-end-every 300] [--backlog-s 600] [--group] [--workdir DIR]

Not run in CI (needs Debian's mariadb-server and root, like tests/test_central.py).  It

1. starts a throwaway MariaDB of its own (tests/mariadb.py: the test harness's options, durability off,
   plus a 1 GiB buffer pool and max_connections 2000), creates a database and runs the real
   `slurm-gpu central init --cluster bench --writers 'n[0001-N]' --password-dir DIR` as an admin
   account, then the statements it printed: one writer account per node (schema v5's per-node
   writers, what docs/central.md recommends; --group: one account for all, `--writers '*' --group`);
2. makes N node databases (one Store migrated once, copied: the schema is the same on every node) and
   a cluster's job stream: jobs end at a mean rate of one per --job-end-every seconds per node
   (Poisson, cluster-wide), 1-8 GPUs on one node (90 %) or 2-4 whole nodes of 8 GPUs ending within a
   second of each other (10 %: a job's nodes end together and push the same job's rows), 1 min-24 h
   long (log-uniform), 200 users (skewed), 40 accounts, 4 partitions of node blocks plus a `preempt`
   partition on every node (20 % of jobs), 3 GPU models (by node block).  The jobs of the last
   --backlog-s seconds are in the node databases at the start (the backlog); the others are written
   through Store.write when their end time has passed, before the identity's next push (the epilog's
   write, not counted in the push's time);
3. pushes through the real push code in-process (what `slurm-gpu db push` runs after its start-up:
   the node database opened, its push lock, the backlog, a new connection to the server with the
   node's account and password, central/push.py's Pusher, the connection closed), many identities per
   worker process (--workers processes, each a pool of --pool threads: at most workers x pool
   pushes at once), each identity on its own schedule:
   - timer: deploy/systemd/slurm-gpu-push.timer, OnUnitActiveSec=30s with RandomizedDelaySec=5s:
     each identity's first push at a random phase in [0, 30) s, each next one 30 + U(0, 5) s after
     the previous one started; a push still running at its next time is skipped (systemd does not
     start an active oneshot again);
   - cron: docs/central.md's `* * * * *`: every identity at the same second, once a minute;
   then, unmeasured, one more push per identity after the last job ends (everything shipped);
4. prints pushes/s, records/s, push time p50/p99/max (all pushes, and those that shipped records),
   how late pushes started behind their schedule (the client pool's queue), batches sent again
   (Pusher.retried), failures, the server's Innodb_row_lock_waits / _time and Innodb_deadlocks
   deltas and what the waiting pushes waited on (information_schema.INNODB_LOCK_WAITS sampled every
   0.5 s: table, index, lock mode, statement), the server's CPU (mariadbd's utime + stime over the
   wall time, in cores) and the clients' CPU; --deadlocks FILE also logs every deadlock;
5. checks the result: the server's job_gpus and jobs (count, energy, GPU-seconds) equal the node
   databases' (every record once: none lost, none counted twice), every node's backlog is empty,
   and the rollups are exact: `central rollup --rebuild`'s comparison (rollups.rebuild: 0 missing,
   extra or different rows in every table) and the reports by user and by partition,gpu-model from
   the rollups equal the reports from the records, CSV byte for byte;
6. removes the server and its files at the end, also on an error or SIGTERM.

The machine that ran docs/benchmarks.md's figures runs the server and every client: the clients'
CPU is taken from the server's.
"""
from __future__ import annotations

import argparse
import heapq
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import mariadb as testdb  # noqa: E402  (tests/mariadb.py: the throwaway server of the tests)

from slurm_gpu.central import push as P  # noqa: E402
from slurm_gpu.central import rollups as R  # noqa: E402
from slurm_gpu.central import server as C  # noqa: E402
from slurm_gpu.store.node import Store  # noqa: E402

CLUSTER = "bench"
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")
PARTITIONS = ("gpu", "long", "short", "large")
TIMER_PERIOD_S, TIMER_DELAY_S, CRON_PERIOD_S = 30.0, 5.0, 60.0  # deploy/systemd, docs/central.md
STATUS = ("Innodb_row_lock_waits", "Innodb_row_lock_time", "Innodb_deadlocks", "Connections")
GPUS_PER_NODE = 8


def node_name(i: int) -> str:
    return f"n{i + 1:04d}"


# --------------------------------------------------------------------------- the cluster's jobs

def job_stream(nodes: int, t_from: float, t_to: float, every_s: float, seed: int) -> List[List[Dict[str, Any]]]:
    """Per node identity, its job_end records ending in [t_from, t_to), in order of their end."""
    rnd = random.Random(seed)
    per: List[List[Dict[str, Any]]] = [[] for _ in range(nodes)]
    rate = nodes / every_s  # job ends per second, cluster-wide
    t, job_id = t_from, 1_000_000
    while True:
        t += rnd.expovariate(rate)
        if t >= t_to:
            break
        job_id += 1
        dur = 60.0 * math.exp(rnd.uniform(0.0, math.log(24 * 60)))
        u = int(200 * rnd.random() ** 2)
        first = rnd.randrange(nodes)
        multi = rnd.random() < 0.10 and nodes >= 4
        hosts = [(first + k) % nodes for k in range(rnd.randint(2, 4))] if multi else [first]
        gpus = GPUS_PER_NODE if multi else rnd.choice((1, 1, 2, 2, 4, 8))
        partition = "preempt" if rnd.random() < 0.2 else PARTITIONS[first * len(PARTITIONS) // nodes]
        idle = rnd.random() < 0.12
        for h in hosts:
            end = t + (rnd.uniform(0, 1.0) if multi else 0.0)
            node = node_name(h)
            model = MODELS[h * len(MODELS) // nodes]
            base = {"cluster": CLUSTER, "job_id": job_id, "restart_count": 0, "node": node, "user": f"user{u:03d}",
                    "account": f"acct{(u * 7) % 40:02d}", "partition": partition}
            job = dict(base, uid=1000 + u, gpu_count=gpus, start_time=end - dur, end_time=end, exit_code="0")
            rows = []
            for g in range(gpus):
                # a mean of samples (not a round figure: two GPUs' means of 2 decimals make rounding ties);
                # energy from NVML's mJ counter
                util = None if rnd.random() < 0.03 else rnd.uniform(0, 4) if idle else rnd.uniform(5, 100)
                rows.append(dict(base, gpu_uuid=f"GPU-{node}-{g}", gpu_index=g, gpu_model=model, start_time=end - dur,
                                 end_time=end, duration_s=dur, energy_j=round((80 + (util or 0) * 6) * dur, 3),
                                 gpu_util_mean_pct=util, mem_util_mean_pct=None if util is None else util / 3,
                                 max_memory_bytes=None if util is None else int(rnd.random() * (80 << 30)),
                                 process_count=1))
            per[h].append({"kind": "job_end", "job": job, "gpus": rows})
    for recs in per:
        recs.sort(key=lambda r: r["job"]["end_time"])
    return per


# --------------------------------------------------------------------------- one worker process

class Push(NamedTuple):
    node: int
    due: float  # when the schedule started it (unix s)
    start: float
    took_s: float
    job_gpus: int
    jobs: int
    retried: int
    error: str


class Identity:
    """A node identity: its database, account and the records still to end."""

    def __init__(self, index: int, db: str, url: str, password: str, records: List[Dict[str, Any]]):
        self.index, self.db, self.password = index, db, password
        self.target = C.parse_url(url)
        self.pending = records
        self.busy = threading.Lock()

    def write_due(self, now: float) -> None:
        """The epilog's writes of the jobs that ended by now (not part of the push)."""
        n = 0
        while n < len(self.pending) and self.pending[n]["job"]["end_time"] <= now:
            n += 1
        if not n:
            return
        store = Store(self.db, self.db + ".spool")
        try:
            for rec in self.pending[:n]:
                if store.write(rec, ingest=False) != "db":
                    raise RuntimeError(f"Store.write of {self.db} spooled a record")
        finally:
            store.close()
        del self.pending[:n]

    def push(self, due: float, timeout_s: float, batch_size: int) -> Push:
        """What `db push` does after its start-up (cli/central.py push: Outbox, lock, backlog, Central, Pusher)."""
        self.write_due(time.time())
        t0, start = time.perf_counter(), time.time()
        shipped: Dict[str, int] = {}
        retried, error = 0, ""
        store = Store(self.db, self.db + ".spool")
        try:
            conn = store.connect()
            with P.push_lock(self.db):
                P.backlog(conn)
                with C.Central(self.target, self.password, timeout_s) as srv:
                    pusher = P.Pusher(conn, srv, CLUSTER, batch_size, max_seconds=50.0)
                    try:
                        result = pusher.run()
                        shipped = result.shipped
                    finally:
                        retried = pusher.retried
        except Exception as e:  # a failed push: counted and described, the records stay for the next
            error = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
        finally:
            store.close()
        return Push(self.index, due, start, time.perf_counter() - t0, shipped.get("job_gpus", 0),
                    shipped.get("jobs", 0), retried, error)


def schedule(n_pushes: int, phase: float, t0: float, kind: str, rnd: random.Random) -> List[float]:
    if kind == "cron":
        return [t0 + k * CRON_PERIOD_S for k in range(n_pushes)]
    out, t = [], t0 + phase
    for _ in range(n_pushes):
        out.append(t)
        t += TIMER_PERIOD_S + rnd.uniform(0.0, TIMER_DELAY_S)
    return out


def worker(w: int, idents: List[Tuple[int, str, str, str, List[Dict[str, Any]]]], args: Dict[str, Any],
           t0: float, out: Any) -> None:
    """One client process: its identities' pushes at their times, at most args['pool'] at once, then
    (unmeasured) the final push of each.  Sends (pushes, skipped, cpu s), then the final pushes' errors."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rnd = random.Random(1000 + w)
    ids = {i: Identity(i, db, url, pw, recs) for i, db, url, pw, recs in idents}
    heap: List[Tuple[float, int]] = []
    for i in ids:
        for due in schedule(args["rounds"], rnd.uniform(0.0, TIMER_PERIOD_S), t0, args["schedule"], rnd):
            heap.append((due, i))
    heapq.heapify(heap)
    pushes: List[Push] = []
    skipped = [0]
    lock = threading.Lock()

    def run(ident: Identity, due: float) -> None:
        try:
            p = ident.push(due, args["timeout_s"], args["batch_size"])
        finally:
            ident.busy.release()
        with lock:
            pushes.append(p)

    with ThreadPoolExecutor(max_workers=args["pool"]) as pool:
        while heap:
            due, i = heapq.heappop(heap)
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            if not ids[i].busy.acquire(blocking=False):
                skipped[0] += 1  # still running since its last start
                continue
            pool.submit(run, ids[i], due)
    cpu = os.times()
    out.send((pushes, skipped[0], cpu.user + cpu.system))
    # Everything that ended by the end of the run, shipped (not part of the load).
    end = t0 + args["span_s"]
    finals: List[str] = []
    for ident in ids.values():
        ident.write_due(math.inf)
    with ThreadPoolExecutor(max_workers=args["pool"]) as pool:
        for p in pool.map(lambda ident: ident.push(end, args["timeout_s"], args["batch_size"]), ids.values()):
            if p.error:
                finals.append(f"{node_name(p.node)}: {p.error}")
    out.send(finals)
    out.close()


# --------------------------------------------------------------------------- the server

def client_sql(server: testdb.MariaDB, sql: str, db: str = "") -> List[List[str]]:
    return server.rows(sql, db) if db else [ln.split("\t") for ln in server.sql(sql).splitlines()]


def status(server: testdb.MariaDB) -> Dict[str, int]:
    names = ", ".join(f"'{n}'" for n in STATUS)
    rows = client_sql(server, f"SELECT VARIABLE_NAME, VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
                              f"WHERE VARIABLE_NAME IN ({names.upper()})")
    got = {n.lower(): int(v) for n, v in rows}
    return {n: got.get(n.lower(), 0) for n in STATUS}


class LockSampler(threading.Thread):
    """Every 0.5 s, the lock waits under way (information_schema.INNODB_LOCK_WAITS): per table,
    index, lock mode and the waiting statement's start, how many times one was seen waiting."""

    SQL = ("SELECT l.lock_table, l.lock_index, l.lock_mode, LEFT(REPLACE(t.trx_query, CHAR(10), ' '), 48) "
           "FROM information_schema.INNODB_LOCK_WAITS w "
           "JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.requested_lock_id "
           "JOIN information_schema.INNODB_TRX t ON t.trx_id = w.requesting_trx_id")

    def __init__(self, server: testdb.MariaDB):
        super().__init__(daemon=True)
        import pymysql
        self.conn = pymysql.connect(unix_socket=str(server.socket), user="root", autocommit=True)
        self.seen: Dict[Tuple[str, ...], int] = {}
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            with self.conn.cursor() as cur:
                cur.execute(self.SQL)
                for row in cur.fetchall():
                    key = tuple(str(c) for c in row)
                    self.seen[key] = self.seen.get(key, 0) + 1
            self.samples += 1

    def stop(self) -> List[str]:
        self.done.set()
        self.join()
        self.conn.close()
        top = sorted(self.seen.items(), key=lambda x: -x[1])[:8]
        return [f"{n / max(1, self.samples):6.2f} waiting on average ({self.samples} samples): {' '.join(k[:3])} ({k[3]})"
                for k, n in top]


def server_cpu_s(server: testdb.MariaDB) -> float:
    assert server.proc is not None
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cli(argv: Sequence[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "SLURM_GPU_CONFIG")}
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *argv], capture_output=True, text=True, env=env)


def central_init(server: testdb.MariaDB, work: Path, nodes: int, group: bool) -> Tuple[str, str, str, Path]:
    """The database, `central init` with the writers as a site runs it: (db, admin url, admin password, password dir)."""
    db = server.new_database("load")
    admin = "load_admin"
    admin_pw = server.new_user(admin, [f"GRANT ALL ON {db}.* TO '{admin}'@'%';"])
    pw_file = work / "admin.password"
    pw_file.write_text(admin_pw + "\n")
    os.chmod(pw_file, 0o600)
    cfg = work / "admin.toml"
    cfg.write_text(f'cluster_name = "{CLUSTER}"\nslurm_conf = "{work}/none.conf"\n'
                   f'[central]\nurl = "{server.url(admin, db)}"\npassword_file = "{pw_file}"\ntimeout_s = 600\n')
    writers = ["--writers", "*", "--group", "load_writer"] if group else [
        "--writers", f"n[0001-{nodes:04d}]", "--writer", "load_writer"]
    r = cli(["--config", str(cfg), "central", "init", "--cluster", CLUSTER, *writers, "--reporter", "load_reporter",
             "--hosts", "%", "--password-dir", str(work / "writers"), "--rollup-tz", "utc", "--no-progress"])
    if r.returncode != 0:
        raise RuntimeError(f"central init failed: {r.stderr[-2000:]}")
    server.sql("\n".join(s for s in r.stdout.splitlines() if "'load_reporter'" not in s), db)
    return db, server.url(admin, db), admin_pw, work / "writers"


def make_nodes(work: Path, nodes: int) -> List[str]:
    """N node databases: one migrated by Store, copied (the schema is every node's)."""
    template = work / "template.db"
    store = Store(str(template), str(work / "template.spool"))
    store.connect()
    store.close()
    (work / "nodes").mkdir()
    out = []
    for i in range(nodes):
        path = work / "nodes" / f"{node_name(i)}.db"
        shutil.copyfile(template, path)
        out.append(str(path))
    return out


def write_backlog(dbs: Sequence[str], per: List[List[Dict[str, Any]]]) -> int:
    n = 0
    for db, recs in zip(dbs, per):
        if not recs:
            continue
        store = Store(db, db + ".spool")
        for rec in recs:
            if store.write(rec, ingest=False) != "db":
                raise RuntimeError(f"Store.write of {db} spooled a record")
            n += len(rec["gpus"])
        store.close()
    return n


# --------------------------------------------------------------------------- checks

def node_totals(dbs: Sequence[str]) -> Tuple[int, int, float, float, int]:
    """(job_gpus records, unshipped rows, energy J, GPU-seconds, jobs) over every node database, math.fsum'd."""
    n = left = jobs = 0
    energy: List[float] = []
    secs: List[float] = []
    for db in dbs:
        conn = sqlite3.connect(db)
        try:
            rows = conn.execute("SELECT energy_j, end_time - start_time FROM job_gpus").fetchall()
            n += len(rows)
            energy += [r[0] for r in rows if r[0] is not None]
            secs += [r[1] for r in rows]
            jobs += conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
            left += P.backlog(conn).total
        finally:
            conn.close()
    return n, left, math.fsum(energy), math.fsum(secs), jobs


def server_totals(admin: C.Central) -> Tuple[int, float, float, int]:
    rows = admin.execute("SELECT energy_j, end_time - start_time FROM job_gpus_current WHERE cluster = %s", (CLUSTER,))
    jobs = admin.execute("SELECT COUNT(*) FROM jobs WHERE cluster = %s AND withdrawn = 0", (CLUSTER,))[0][0]
    return (len(rows), math.fsum(float(r[0]) for r in rows if r[0] is not None), math.fsum(float(r[1]) for r in rows),
            int(jobs))


def reports_equal(url: str, password: str) -> List[str]:
    """The summaries by user and by partition,gpu-model from the rollups and from the records
    (bench_central's raw plan, what `report --by` ran before the rollups): CSV byte for byte."""
    import difflib

    import bench_central as BC

    from slurm_gpu import render
    from slurm_gpu.report import reports as report
    from slurm_gpu.report.query import Query
    out = []
    for by in (("user",), ("partition", "gpu-model")):
        texts, plans = [], []
        for raw in (False, True):
            with BC.open_source(url, password, 600, Query(tz="utc"), raw=raw) as src:
                table = report.summary(src, by)
                texts.append(render.render(list(table.rows), table.columns, "csv"))
                plans.append(src.plan)
        ties = BC.last_digit_cells(texts[0], texts[1])
        if ties is None:
            print("\n".join(difflib.unified_diff(texts[1].splitlines(), texts[0].splitlines(), "records", "rollups",
                                                 n=0, lineterm=""))[:3000], file=sys.stderr)
            raise RuntimeError(f"report --by {','.join(by)}: the rollups differ from the records")
        same = "byte for byte" if not ties else f"but {ties} cell(s) one unit off in the last digit (rounding ties)"
        out.append(f"--by {','.join(by)}: rollups = records, CSV {same} ({plans[0]})")
    return out


# --------------------------------------------------------------------------- figures

def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(args: argparse.Namespace, pushes: List[Push], skipped: int, wall_s: float, srv_cpu: float,
              cli_cpu: float, st: Dict[str, int]) -> Dict[str, Any]:
    took = [p.took_s for p in pushes]
    data = [p.took_s for p in pushes if p.job_gpus or p.jobs]
    lag = [max(0.0, p.start - p.due) for p in pushes]
    first, last = min(p.start for p in pushes), max(p.start + p.took_s for p in pushes)
    span = max(last - first, 1e-9)
    records = sum(p.job_gpus for p in pushes)
    return {"nodes": args.nodes, "schedule": args.schedule, "pushes": len(pushes), "pushes_s": len(pushes) / span,
            "data": len(data), "records": records, "records_s": records / span,
            "p50": statistics.median(took), "p99": pct(took, 0.99), "max": max(took),
            "d_p50": statistics.median(data) if data else float("nan"), "d_p99": pct(data, 0.99),
            "lag_p99": pct(lag, 0.99), "lock_waits": st["Innodb_row_lock_waits"],
            "lock_ms": st["Innodb_row_lock_time"], "deadlocks": st["Innodb_deadlocks"],
            "retried": sum(p.retried for p in pushes), "failed": sum(1 for p in pushes if p.error),
            "skipped": skipped, "srv_cpu": srv_cpu / wall_s, "cli_cpu": cli_cpu / wall_s, "wall": wall_s}


COLUMNS = (("nodes", "N", "{:,}"), ("schedule", "sched", "{}"), ("pushes", "pushes", "{:,}"),
           ("pushes_s", "push/s", "{:.1f}"), ("data", "w/ data", "{:,}"), ("records", "records", "{:,}"),
           ("records_s", "rec/s", "{:.1f}"), ("p50", "p50 s", "{:.3f}"), ("p99", "p99 s", "{:.3f}"),
           ("max", "max s", "{:.3f}"), ("d_p50", "data p50", "{:.3f}"), ("d_p99", "data p99", "{:.3f}"),
           ("lag_p99", "late p99", "{:.2f}"), ("lock_waits", "lockwaits", "{:,}"), ("lock_ms", "lock ms", "{:,}"),
           ("deadlocks", "deadlk", "{:,}"), ("retried", "retried", "{:,}"), ("failed", "failed", "{:,}"),
           ("skipped", "skipped", "{:,}"), ("srv_cpu", "srv cores", "{:.2f}"), ("cli_cpu", "cli cores", "{:.2f}"))


def print_table(rows: Sequence[Dict[str, Any]]) -> None:
    cells = [[fmt.format(r[k]) for k, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, (_, h, _) in enumerate(COLUMNS)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(COLUMNS, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


# --------------------------------------------------------------------------- main

def bench(server: testdb.MariaDB, args: argparse.Namespace) -> Dict[str, Any]:
    work = server.dir / "load"
    work.mkdir(mode=0o700)
    t = time.perf_counter()
    server.start(timeout_s=180)
    db, admin_url, admin_pw, pw_dir = central_init(server, work, args.nodes, args.group)
    print(f"# MariaDB {client_sql(server, 'SELECT VERSION()')[0][0]} on {os.cpu_count()} CPUs (server and clients "
          f"share them); central init with {'one group writer' if args.group else f'{args.nodes:,} per-node writers'}"
          f" in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    dbs = make_nodes(work, args.nodes)
    period = CRON_PERIOD_S if args.schedule == "cron" else TIMER_PERIOD_S + TIMER_DELAY_S / 2
    span_s = args.rounds * period
    now = time.time()
    t0 = now + args.start_in_s  # the first push's time: after the setup below
    backlog = job_stream(args.nodes, t0 - args.start_in_s - args.backlog_s, t0 - args.start_in_s,
                         args.job_end_every, seed=1)
    arriving = job_stream(args.nodes, t0 - args.start_in_s, t0 + span_s, args.job_end_every, seed=2)
    n_back = write_backlog(dbs, backlog)
    n_jobs = sum(len(r) for r in arriving)
    print(f"# {args.nodes:,} node databases, backlog {n_back:,} job_gpus records ({sum(len(r) for r in backlog):,} "
          f"job ends of the last {args.backlog_s:g} s), then {n_jobs:,} job ends over {span_s:.0f} s "
          f"(one per {args.job_end_every:g} s per node); set up in {time.perf_counter() - t:.1f} s", flush=True)
    if time.time() > t0 - 2:
        raise RuntimeError(f"the setup took longer than --start-in-s {args.start_in_s:g}: raise it")

    def password(i: int) -> str:
        name = "load_writer" if args.group else f"load_writer_{node_name(i)}"
        return (pw_dir / f"{name}.password").read_text().strip()

    def url(i: int) -> str:
        return server.url("load_writer" if args.group else f"load_writer_{node_name(i)}", db)

    shared = {"rounds": args.rounds, "schedule": args.schedule, "pool": args.pool, "timeout_s": args.timeout_s,
              "batch_size": args.batch_size, "span_s": span_s}
    procs, pipes = [], []
    before, cpu0 = status(server), server_cpu_s(server)
    sampler = LockSampler(server)
    sampler.start()
    ctx = mp.get_context("fork")
    for w in range(args.workers):
        mine = [(i, dbs[i], url(i), password(i), arriving[i]) for i in range(w, args.nodes, args.workers)]
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(w, mine, shared, t0, b), daemon=True)
        p.start()
        procs.append(p)
        pipes.append(a)
    print(f"# {args.workers} worker process(es) x {args.pool} threads, {args.schedule} schedule, {args.rounds} "
          f"push(es) per identity from {time.strftime('%H:%M:%S', time.gmtime(t0))} UTC", flush=True)
    pushes: List[Push] = []
    skipped, cli_cpu, finals = 0, 0.0, []
    results = [a.recv() for a in pipes]  # the measured pushes; then the final ones
    wall = time.time() - t0
    after, cpu1 = status(server), server_cpu_s(server)
    for line in sampler.stop():
        print(f"# lock waits: {line}")
    for ps, sk, cpu in results:
        pushes += ps
        skipped += sk
        cli_cpu += cpu
    for a in pipes:
        finals += a.recv()
    for p in procs:
        p.join()
    row = summarize(args, pushes, skipped, wall, cpu1 - cpu0, cli_cpu, {k: after[k] - before[k] for k in STATUS})
    errors: Dict[str, int] = {}
    for p in pushes:
        if p.error:
            errors[p.error[:160]] = errors.get(p.error[:160], 0) + 1
    for e, n in sorted(errors.items(), key=lambda x: -x[1])[:5]:
        print(f"# failed {n}x: {e}")
    for f in finals[:5]:
        print(f"# final push failed: {f}")

    # every record once, the rollups exact
    n, left, energy, secs, jobs = node_totals(dbs)
    with C.Central(C.parse_url(admin_url), admin_pw, 3600) as admin:
        sn, senergy, ssecs, sjobs = server_totals(admin)
        same = (n, jobs) == (sn, sjobs) and math.isclose(energy, senergy, rel_tol=1e-12) \
            and math.isclose(secs, ssecs, rel_tol=1e-12) and left == 0
        print(f"# node databases: {n:,} job_gpus, {jobs:,} jobs, {energy:.6e} J, {secs:.6e} GPU-s, {left} unshipped; "
              f"server: {sn:,} job_gpus, {sjobs:,} jobs, {senergy:.6e} J, {ssecs:.6e} GPU-s: "
              f"{'equal' if same else 'DIFFERENT'}", flush=True)
        t = time.perf_counter()
        diff = R.rebuild(admin)
    exact = all(v == (0, 0, 0) for v in diff.values())
    print(f"# rollups: a rebuild from the records ({time.perf_counter() - t:.1f} s) found "
          f"{'nothing to correct: exact' if exact else diff}", flush=True)
    for line in reports_equal(admin_url, admin_pw):
        print(f"# {line}")
    row.update(exact=exact and same and not finals)
    return row


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000, help="node identities (default 1,000)")
    ap.add_argument("--rounds", type=int, default=4, help="pushes per identity (default 4)")
    ap.add_argument("--schedule", choices=("timer", "cron"), default="timer",
                    help="timer: every 30 s + U(0,5) s from a random phase; cron: all at once, every 60 s")
    ap.add_argument("--workers", type=int, default=2, help="client processes (default 2)")
    ap.add_argument("--pool", type=int, default=32, help="pushes at once per client process (default 32)")
    ap.add_argument("--job-end-every", type=float, default=300.0,
                    help="mean seconds between job ends per node (default 300: 3.3 a second at 1,000 nodes)")
    ap.add_argument("--backlog-s", type=float, default=600.0, help="job ends already waiting at the start (default 600 s)")
    ap.add_argument("--batch-size", type=int, default=2000, help="central.batch_size (default 2000)")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="central.timeout_s (default 10, the config's)")
    ap.add_argument("--group", action="store_true", help="one group writer account instead of one per node")
    ap.add_argument("--start-in-s", type=float, default=0.0,
                    help="seconds from the job stream's start to the first push, for the setup (default 20 + 0.02 x N)")
    ap.add_argument("--buffer-pool", default="1G", help="innodb_buffer_pool_size (default 1G)")
    ap.add_argument("--deadlocks", metavar="FILE", default=None,
                    help="log every deadlock (innodb_print_all_deadlocks) and copy the server's log to FILE at the end")
    ap.add_argument("--workdir", default=None, help="directory of the server and node databases (removed at the end)")
    return ap.parse_args()


def main() -> int:
    args = arguments()
    if not args.start_in_s:
        args.start_in_s = 20.0 + args.nodes * 0.02  # the node databases' copies and backlog
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on a kill too
    server = testdb.MariaDB(Path(args.workdir) if args.workdir else
                            Path(tempfile.mkdtemp(prefix="slurm-gpu-bench-load-", dir="/var/tmp")),
                            [f"--innodb-buffer-pool-size={args.buffer_pool}", "--max-connections=2000",
                             *(["--innodb-print-all-deadlocks=ON"] if args.deadlocks else [])])
    try:
        row = bench(server, args)
    finally:
        if args.deadlocks and server.log.exists():
            shutil.copyfile(server.log, args.deadlocks)
        server.cleanup()
    print()
    print_table([row])
    print(f"\n# {row['wall']:.0f} s of wall time; records lost or counted twice: "
          f"{'none, rollups exact' if row['exact'] else 'SEE ABOVE'}")
    return 0 if row["exact"] and not row["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
