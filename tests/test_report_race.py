"""`slurm-gpu report` on a node database that hooks are writing at the same time.

The hooks open the database, write one record and close it; the last connection to close
checkpoints the WAL into the main file and deletes the `-wal` file.  A report that found no
`-wal` file used to read the main file as `immutable=1` (no locks at all) while such a
checkpoint rewrote its pages: 3-4 % of the reports gave wrong totals.  Here real processes
write through slurm_gpu.store.node.Store while reports run, and every report must describe one
committed state of the database.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from click.testing import CliRunner

from slurm_gpu.cli import main
from slurm_gpu.store.node import Store

GPUS_PER_JOB = 4
JOB_S = 3600.0
USERS = ("alice", "bob", "carol")
T0 = 1_790_000_000.0

# One writer process: job after job, each written by a fresh Store that is closed again (as a
# prolog/epilog process does), so every write ends in a checkpoint and the -wal file's removal.
WRITER = r"""
import os, sys, time
sys.path.insert(0, {repo!r})
from slurm_gpu.store.node import Store
sys.path.insert(0, {tests!r})
from test_report_race import job_end
path, spool, first, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
job = first
while not os.path.exists(stop):
    st = Store(path, spool, busy_timeout_s=10.0)
    where = st.write(job_end(job))
    st.close()
    if where != "db":
        print("spooled", job, where, flush=True)
    job += 1
    time.sleep(0.02)  # a busy node: dozens of hook writes a second
"""


def job_end(job_id: int) -> dict:
    """A job_end record as the epilog writes it: GPUS_PER_JOB GPUs, JOB_S seconds each."""
    user = USERS[job_id % len(USERS)]
    start = T0 + job_id * 10.0
    gpus = [{"cluster": "c1", "job_id": job_id, "restart_count": 0, "node": "n1", "gpu_uuid": f"GPU-{g}",
             "gpu_index": g, "gpu_model": "NVIDIA H200", "user": user, "account": "acct", "partition": "gpu",
             "start_time": start, "end_time": start + JOB_S, "duration_s": JOB_S, "energy_j": 1000.0,
             "gpu_util_mean_pct": 50.0, "mem_util_mean_pct": 25.0, "max_memory_bytes": 1 << 30,
             "process_count": 1} for g in range(GPUS_PER_JOB)]
    return {"kind": "job_end",
            "job": {"cluster": "c1", "job_id": job_id, "restart_count": 0, "node": "n1", "user": user,
                    "account": "acct", "partition": "gpu", "gpu_count": GPUS_PER_JOB, "start_time": start,
                    "end_time": start + JOB_S, "exit_code": "0:0"},
            "gpus": gpus, "events": []}


def _problems(args: list, out: str) -> list:
    """What is wrong with one report's JSON: every job complete, every group's hours = 4 h per job."""
    if "csv" in args:
        import csv
        import io
        rows = [{k: (int(v) if k == "jobs" else float(v) if k.startswith("gpu_hours") else v) for k, v in r.items()}
                for r in csv.DictReader(io.StringIO(out))]
    else:
        rows = json.loads(out)
    bad = []
    if args[0] == "jobs":
        for r in rows:
            if r["gpus"] != GPUS_PER_JOB or abs(r["gpu_hours_alloc"] - GPUS_PER_JOB) > 1e-6:
                bad.append(f"job {r['job_id']}: {r['gpus']} GPUs, {r['gpu_hours_alloc']} GPU-h")
        # Each writer's jobs are committed in order: a report sees a prefix of each sequence.
        for first in (1, 1_000_001):
            ids = sorted(r["job_id"] for r in rows if first <= r["job_id"] < first + 1_000_000)
            if ids != list(range(first, first + len(ids))):
                bad.append(f"jobs from {first}: not a committed prefix ({len(ids)} jobs, last {ids[-1:]})")
    else:
        for r in rows:
            if abs(r["gpu_hours_alloc"] - GPUS_PER_JOB * r["jobs"]) > 1e-6:
                bad.append(f"{r}: {r['gpu_hours_alloc']} GPU-h for {r['jobs']} jobs")
    return bad


def test_reports_racing_hook_writers_never_give_wrong_totals(tmp_path: pathlib.Path):
    db, spool = tmp_path / "usage.db", tmp_path / "spool"
    # A database of realistic size, so that a report takes long enough to meet a checkpoint.
    st = Store(str(db), str(spool))
    conn = st.connect()
    conn.execute("BEGIN")
    from slurm_gpu.store.apply import _apply
    for j in range(2_000_001, 2_001_001):
        _apply(conn, job_end(j))
    conn.execute("COMMIT")
    st.close()
    assert not os.path.exists(str(db) + "-wal")  # the state the hooks leave between jobs

    stop = tmp_path / "stop"
    here = pathlib.Path(__file__).resolve().parent
    code = WRITER.format(repo=str(here.parent), tests=str(here))
    writers = [subprocess.Popen([sys.executable, "-c", code, str(db), str(spool), str(first), str(stop)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for first in (1, 1_000_001)]
    reports = (["--by", "user", "--format", "json"], ["jobs", "--format", "json", "--sort", "job_id"],
               ["--by", "account", "--format", "csv"])
    inconsistent, failures = 0, []
    try:
        time.sleep(0.3)  # both writers are writing
        runner = CliRunner()
        for i in range(300):
            args = list(reports[i % len(reports)])
            r = runner.invoke(main, ["report", "--db", str(db), *args])
            problems = [f"exit {r.exit_code}: {r.output[-300:]}"] if r.exit_code != 0 else _problems(args, r.stdout)
            if problems:
                inconsistent += 1
                failures.append((args, problems[:3]))
    finally:
        stop.write_text("")
        outs = [w.communicate(timeout=60) for w in writers]
    written = sum(1 for _ in Store(str(db), str(spool)).connect().execute("SELECT 1 FROM jobs WHERE job_id < 2000000"))
    assert all(w.returncode == 0 for w in writers), outs
    assert written > 50, f"the writers wrote only {written} jobs: no race was exercised"
    assert inconsistent == 0, f"{inconsistent} of 300 reports inconsistent ({written} jobs written): {failures[:5]}"


def test_writer_arriving_during_an_immutable_read_makes_the_report_read_again(tmp_path: pathlib.Path):
    from slurm_gpu.report import reports as report
    from slurm_gpu.report.query import Query
    from slurm_gpu.report.sources import read_consistently

    db, spool = tmp_path / "usage.db", tmp_path / "spool"
    st = Store(str(db), str(spool))
    st.write(job_end(1))
    st.close()
    assert not os.path.exists(str(db) + "-wal")
    here = pathlib.Path(__file__).resolve().parent
    write_one = (f"import sys; sys.path.insert(0, {str(here.parent)!r}); sys.path.insert(0, {str(here)!r})\n"
                 "from slurm_gpu.store.node import Store\nfrom test_report_race import job_end\n"
                 f"st = Store({str(db)!r}, {str(spool)!r}); st.write(job_end(2)); st.close()\n")
    seen = []

    def read(src):
        seen.append((src.reading.frozen, report.summary(src, ["user"]).rows))
        if len(seen) == 1:  # a hook writes (and closes) while this read holds the file
            subprocess.run([sys.executable, "-c", write_one], check=True, timeout=60)
        return seen[-1][1]

    rows = read_consistently([str(db)], Query(), read)
    assert [frozen for frozen, _ in seen] == [True, False]  # the second read went through the WAL
    assert sum(r["jobs"] for r in rows) == 2
    # The writer could not checkpoint under the report's lock: its records wait in the -wal file.
    assert os.path.getsize(str(db) + "-wal") > 0
