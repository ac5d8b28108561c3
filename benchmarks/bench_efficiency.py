"""`slurm-gpu efficiency sample` (issue 38) on one node of 8 simulated H100 GPUs, each held by a running
one-GPU job (8 prologs, jobs 100-107 on GPUs 0-7): what a sample run costs, how fast the samples grow the
node database, and how many Prometheus series the running jobs' metrics make.

1. Cost: the whole process, `slurm-gpu efficiency sample --node-name bench01`, without and with
   `[metrics] textfile_dir`, alternated with `python3 -c pass` of the same interpreter: medians of the
   wall time and of the child's CPU time (user + sys, its rusage from os.wait4); then sample() alone,
   in-process (a fresh NVML session per call, as each process has), on the running jobs' rows and with
   the samples table at its cap (samples_max_mb / ROW_BYTES rows of ended jobs).
2. Growth: sample() in-process with `now` stepping 60 s over --hours simulated hours (default 125: 8 GPUs
   x 125 h = 1,000 GPU-job-hours), each GPU's utilisation, memory used and energy changing every minute,
   the default samples_fine_s (3600 s) merging older rows into 10-minute rows.  The database file
   (page_count x page_size after a TRUNCATE checkpoint) per 1,000 GPU-job-hours, from hour 2 on (the
   fine hour is then a constant), and the bytes per sample row: fine rows from a second run with
   samples_fine_s = 30 days (nothing merged), coarse rows from the first; per B-tree from dbstat (the
   table and each of its indexes, pages counted whole), against ROW_BYTES in slurm_gpu/store/samples.py.
3. Series: the slurm_gpu_efficiency.prom one CLI run writes (one action row added first, so that the
   actions family shows), counted, and scaled to 1,000 such nodes.

Usage: python3 benchmarks/bench_efficiency.py [--venv] [--hours H] [--fine-hours H] [runs]
  --venv   run with a fresh virtual environment's regular install (see bench_hooks.py)
"""
from __future__ import annotations

import os
import random
import sqlite3
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

from _common import SimNode, args_or_clean_venv, console_script, simgpu
from bench_hooks import job_env

NODE = "bench01"
GPUS = 8
GIB = 1 << 30


def run(argv: List[str], env: Dict[str, str]) -> Tuple[float, float]:
    """(wall seconds, CPU seconds: user + sys) of one run."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    took = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{argv} exited {code}: {p.stderr.read().decode()[-500:] if p.stderr else ''}")
    if p.stderr:
        p.stderr.close()
    return took, usage.ru_utime + usage.ru_stime


def start_jobs(node: SimNode, extra: str = "") -> None:
    """8 one-GPU jobs started by the real prolog (job_starts rows); `extra` appended to the config."""
    if extra:
        node.config.write_text(node.config.read_text() + extra)
    prolog = console_script("slurm-gpu-prolog")
    for g in range(GPUS):
        subprocess.run(prolog, env=job_env(node, 100 + g, str(g)), check=True)


def db_bytes(conn: sqlite3.Connection) -> int:
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return conn.execute("PRAGMA page_count").fetchone()[0] * conn.execute("PRAGMA page_size").fetchone()[0]


def btree_bytes(conn: sqlite3.Connection) -> Dict[str, int]:
    """{B-tree name: bytes of its pages} of job_samples and its indexes (dbstat)."""
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'job_samples' "
                                        "AND type IN ('table', 'index') ORDER BY type DESC, name")]
    got = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat WHERE name IN (%s) GROUP BY name"
                            % ", ".join("?" * len(names)), names).fetchall())
    return {n: int(got.get(n) or 0) for n in names}


def cost(runs: int) -> None:
    node = SimNode(GPUS)
    try:
        start_jobs(node)
        metrics = node.dir / "config-metrics.toml"
        metrics.write_text(node.config.read_text() + f'[metrics]\ntextfile_dir = "{node.dir}/prom"\n')
        sample = console_script("slurm-gpu") + ["efficiency", "sample", "--node-name", NODE]
        cmds = {"python3 -c pass": [sys.executable, "-c", "pass"], "efficiency sample": sample,
                "efficiency sample, metrics on": sample}
        envs = {"python3 -c pass": node.env(), "efficiency sample": node.env(),
                "efficiency sample, metrics on": node.env(SLURM_GPU_CONFIG=str(metrics))}
        res: Dict[str, List[Tuple[float, float]]] = {k: [] for k in cmds}
        for i in range(runs + 1):
            for name, argv in cmds.items():
                got = run(argv, envs[name])
                if i:  # the first round warms the page cache
                    res[name].append(got)
        w0, c0 = (statistics.median(x[k] for x in res["python3 -c pass"]) for k in (0, 1))
        print(f"{'one run, 8 GPUs of 8 running jobs':34} {'wall':>9} {'ratio':>6} {'CPU u+s':>9} {'ratio':>6}")
        for name in cmds:
            w, c = (statistics.median(x[k] for x in res[name]) for k in (0, 1))
            print(f"{name:34} {w * 1000:6.1f} ms {w / w0:6.2f} {c * 1000:6.1f} ms {c / c0:6.2f}   (n={runs})")
        rows = sqlite3.connect(str(node.dir / "usage.db")).execute("SELECT count(*) FROM job_samples").fetchone()[0]
        assert rows == 2 * (runs + 1) * GPUS, rows
        in_process(node, runs)
        series(node, metrics, sample)
    finally:
        node.cleanup()


def in_process(node: SimNode, runs: int) -> None:
    from slurm_gpu import config
    from slurm_gpu.efficiency.sample import sample
    from slurm_gpu.hooks.check import make_reader
    from slurm_gpu.store import samples as Q
    from slurm_gpu.store.node import Store

    os.environ["SIMNVML_STATE"] = str(node.state)
    cfg = config.load(str(node.config)).for_node(NODE)
    conn = Store.from_config(cfg).connect()

    def timed() -> float:
        reader = make_reader(cfg)
        t0 = time.perf_counter()
        got = sample(cfg, conn, reader, node=NODE)
        took = time.perf_counter() - t0
        reader.close()
        assert len(got.rows) == GPUS and not got.missing, got
        return took

    plain = [timed() for _ in range(runs)]
    # The table at its cap: coarse rows of 2,000 ended jobs' GPUs from the past 14 days.
    cap = int(cfg.efficiency.samples_max_mb * 1e6 // Q.ROW_BYTES)
    now = time.time()
    cols = ", ".join(Q.SAMPLE_COLUMNS)
    template = dict(zip(Q.SAMPLE_COLUMNS, conn.execute(f"SELECT {cols} FROM job_samples LIMIT 1").fetchone()))
    old = [dict(template, job_id=10_000 + i % 2000, time=now - 13 * 86400 + i, coarse=1, samples=10, span_s=600.0,
                gpu_util_pct=(i * 37) % 1000 / 10.0) for i in range(cap)]
    conn.execute("BEGIN")
    Q.insert_samples(conn, old)
    conn.execute("COMMIT")
    full = [timed() for _ in range(runs)]
    left = conn.execute("SELECT count(*) FROM job_samples").fetchone()[0]
    print(f"{'sample() in-process':34} {statistics.median(plain) * 1000:6.1f} ms   (n={runs}, a fresh NVML session each)")
    print(f"{'sample(), table at its cap':34} {statistics.median(full) * 1000:6.1f} ms   "
          f"(n={runs}, {left:,} rows = {cfg.efficiency.samples_max_mb:g} MB / ROW_BYTES {Q.ROW_BYTES})")


def series(node: SimNode, metrics, sample: List[str]) -> None:
    from slurm_gpu.store import samples as Q
    from slurm_gpu.store.node import Store
    conn = Store(str(node.dir / "usage.db"), str(node.dir / "spool")).connect()
    Q.add_action(conn, {"time": time.time(), "cluster": "bench", "job_id": 100, "restart_count": 0, "decided_on": NODE,
                        "stage": "notify", "mail_state": "sent"})
    conn.commit()
    run(sample, node.env(SLURM_GPU_CONFIG=str(metrics)))
    text = (node.dir / "prom" / "slurm_gpu_efficiency.prom").read_text()
    fams: Dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            fams[line.split()[2]] = 0
        elif line and not line.startswith("#"):
            fams[line.split("{")[0].split()[0]] += 1
    per_gpu = sum(n for f, n in fams.items() if f != "slurm_gpu_efficiency_actions_total")
    print(f"slurm_gpu_efficiency.prom: {len(fams)} families, {sum(fams.values())} series: "
          + ", ".join(f"{f} {n}" for f, n in fams.items()))
    print(f"1,000 nodes x {GPUS} GPUs: {per_gpu * 1000:,} per-GPU series + at most 15 x 1,000 action series "
          f"= at most {per_gpu * 1000 + 15_000:,}")


def _states(pristine: bytes, minute: int, rng: random.Random, profile: List[Tuple[float, int]]) -> bytes:
    """The GPUs' state at a minute: utilisation around each job's mean, memory, energy growing."""
    lines: List[str] = []
    for g, (mean, mem_gib) in enumerate(profile):
        util = 0 if mean == 0 else max(0, min(100, int(rng.gauss(mean, 12))))
        lines += simgpu.gpu_lines(g, {"gpu_util": util, "memory_used": mem_gib * GIB + rng.randrange(1 << 30),
                                      "energy_mj": 1_000_000_000 + g * 1_000_003 + minute * 60 * (100 + 6 * util) * 1000})
    return pristine + ("\n".join(lines) + "\n").encode()


def simulate(hours: int, fine_s: float) -> Dict[str, Any]:
    """sample() every simulated minute for `hours`; sizes and rows at 2 h and at the end."""
    from slurm_gpu import config
    from slurm_gpu.efficiency.sample import sample
    from slurm_gpu.hooks.check import make_reader
    from slurm_gpu.store.node import Store

    node = SimNode(GPUS)
    try:
        start_jobs(node, f"[efficiency]\nsamples_fine_s = {fine_s:g}\n")
        os.environ["SIMNVML_STATE"] = str(node.state)
        cfg = config.load(str(node.config)).for_node(NODE)
        conn = Store.from_config(cfg).connect()
        reader = make_reader(cfg)
        pristine = node.state.read_bytes()
        rng = random.Random(38)
        profile = [(0.0, 1), (0.0, 30), (35.0, 20), (60.0, 40), (75.0, 60), (90.0, 70), (97.0, 78), (50.0, 10)]
        t0 = time.time()
        out: Dict[str, Any] = {"empty": db_bytes(conn)}
        took = time.perf_counter()
        for minute in range(1, hours * 60 + 1):
            node.state.write_bytes(_states(pristine, minute, rng, profile))
            reader.close()  # the next read starts a fresh NVML session: the state file is read again
            got = sample(cfg, conn, reader, now=t0 + 60.0 * minute, boot=0.0, node=NODE)
            assert len(got.rows) == GPUS, got
            if minute in (120, hours * 60):
                key = "2h" if minute == 120 else "end"
                fine, coarse = conn.execute("SELECT SUM(coarse = 0), SUM(coarse = 1) FROM job_samples").fetchone()
                out[key] = (db_bytes(conn), fine, coarse or 0)
        reader.close()
        out["seconds"] = time.perf_counter() - took
        out["btrees"] = btree_bytes(conn)
        out["freelist"] = conn.execute("PRAGMA freelist_count").fetchone()[0]
        # The same rows once `db push` shipped them: the outbox's partial index (if any) empties.
        if "push_version" in [r[1] for r in conn.execute("PRAGMA table_info(job_samples)")]:
            conn.execute("UPDATE job_samples SET pushed_version = push_version")
            conn.commit()
        out["btrees_pushed"] = btree_bytes(conn)
        return out
    finally:
        node.cleanup()


def growth(hours: int, fine_hours: int) -> None:
    from slurm_gpu.store import samples as Q

    g = simulate(hours, 3600.0)
    (s2, _, c2), (s1, f1, c1) = g["2h"], g["end"]
    gpu_hours = GPUS * (hours - 2)
    print(f"\ngrowth: {hours} h x {GPUS} GPUs = {hours * GPUS:,} GPU-job-hours, one sample a minute "
          f"({g['seconds']:.0f} s for {hours * 60:,} sample() calls); samples_fine_s 3600")
    print(f"  rows at the end: {f1:,} fine + {c1:,} coarse; database {s1 / 1e6:.2f} MB "
          f"({(s1 - g['empty']) / 1e6:.2f} MB over the 8 job starts alone), free pages {g['freelist']}")
    print(f"  from hour 2 on: {(s1 - s2) / gpu_hours * 1000 / 1e6:.2f} MB per 1,000 GPU-job-hours "
          f"({(c1 - c2) / gpu_hours:.1f} coarse rows per GPU-hour, {(s1 - s2) / (c1 - c2):.0f} bytes of file each)")
    f = simulate(fine_hours, 30 * 86400.0)
    (_, ff, _), fb = f["end"], f["btrees"]
    rows_end = f1 + c1
    print(f"\nbytes per sample row by B-tree (dbstat; fine: {fine_hours} h with nothing merged, {ff:,} rows; "
          f"mixed: the {hours} h run's {rows_end:,} rows, {c1:,} of them coarse)")
    print(f"  {'B-tree':28} {'fine':>7} {'mixed':>7} {'pushed, fine':>13} {'pushed, mixed':>14}")
    for name in fb:
        print(f"  {name:28} {fb[name] / ff:7.1f} {g['btrees'][name] / rows_end:7.1f} "
              f"{f['btrees_pushed'][name] / ff:13.1f} {g['btrees_pushed'][name] / rows_end:14.1f}")
    print(f"  {'all':28} {sum(fb.values()) / ff:7.1f} {sum(g['btrees'].values()) / rows_end:7.1f} "
          f"{sum(f['btrees_pushed'].values()) / ff:13.1f} {sum(g['btrees_pushed'].values()) / rows_end:14.1f}"
          f"   (ROW_BYTES = {Q.ROW_BYTES})")


if __name__ == "__main__":
    argv = args_or_clean_venv(__file__)
    opts = {"--hours": 125, "--fine-hours": 24}
    for opt in opts:
        if opt in argv:
            i = argv.index(opt)
            opts[opt] = int(argv[i + 1])
            del argv[i:i + 2]
    cost(int(argv[0]) if argv else 21)
    growth(opts["--hours"], opts["--fine-hours"])
