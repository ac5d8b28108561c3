"""End to end on the real Slurm testbed: jobs on both nodes, `db push` on each node, one report
from the central server (a database on the testbed's own MariaDB, the server slurmdbd uses).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _account(bed, tmp_path, db, user, grants):
    password = secrets.token_urlsafe(16)
    stmts = "".join(f"CREATE OR REPLACE USER '{user}'@'{h}' IDENTIFIED BY '{password}';"
                    + "".join(g.replace("'%'", f"'{h}'") for g in grants) for h in ("127.0.0.1", "localhost"))
    bed.sql(stmts + "FLUSH PRIVILEGES;")
    pw = tmp_path / f"{user}.password"
    pw.write_text(password + "\n")
    os.chmod(pw, 0o600)
    cfg = tmp_path / f"{user}.toml"
    cfg.write_text(f'[central]\nurl = "mysql://{user}@127.0.0.1:{bed.mariadb_port}/{db}"\npassword_file = "{pw}"\n')
    os.chmod(cfg, 0o644)
    return cfg


def test_jobs_on_both_nodes_pushed_from_each_node_report_once_from_the_server(cluster, site, tmp_path):
    jobs = {cluster.sbatch("sleep 2", args=["-p", "gpu", "-w", node, "-A", acct, f"--gres=gpu:{n}"]): node
            for node, acct, n in (("gpu01", "physics", 2), ("gpu02", "chem", 1), ("gpu02", "physics", 2),
                                  ("gpu01", "chem", 1))}
    for j in jobs:
        assert cluster.wait_job(j, timeout=90) == "COMPLETED"
    db = "slurm_gpu_" + secrets.token_hex(3)
    cluster.sql(f"CREATE DATABASE {db} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    admin = _account(cluster, tmp_path, db, "sg_admin", [f"GRANT ALL ON {db}.* TO 'sg_admin'@'%';"])
    env = dict(cluster.env)  # SLURM_CONF: push finds the cluster name there, as on a node
    # One writer account per node: central init registers them, writes their password files and
    # prints the statements, which the database admin runs.
    pw_dir = tmp_path / "writers"
    r = _cli(env, "--config", str(admin), "central", "init", "--cluster", "sgtest", "--writers", "gpu[01-02]",
             "--password-dir", str(pw_dir))
    assert r.returncode == 0, r.stderr
    cluster.sql("\n".join(s for s in r.stdout.splitlines() if "slurm_gpu_reporter" not in s), db)
    grants = [s for s in r.stdout.splitlines() if s.startswith("GRANT")]
    reporter = _account(cluster, tmp_path, db, "slurm_gpu_reporter", [g for g in grants if "slurm_gpu_reporter" in g])
    writers = {}
    for node in ("gpu01", "gpu02"):
        cfg = tmp_path / f"{node}.toml"
        cfg.write_text(f'[central]\nurl = "mysql://slurm_gpu_writer_{node}@127.0.0.1:{cluster.mariadb_port}/{db}"\n'
                       f'password_file = "{pw_dir}/slurm_gpu_writer_{node}.password"\n')
        writers[node] = cfg
    # gpu02's account cannot ship gpu01's records: refused whole, nothing lost.
    r = _cli(env, "--config", str(writers["gpu02"]), "db", "push", "--db", str(site.db("gpu01")))
    assert r.returncode == 6 and "may not write records of node gpu01 in cluster sgtest" in r.stderr, r.stderr
    assert cluster.sql("SELECT COUNT(*) FROM job_gpus", db).strip() == "0"
    for node in ("gpu01", "gpu02"):
        r = _cli(env, "--config", str(writers[node]), "db", "push", "--db", str(site.db(node)))
        assert r.returncode == 0 and "left 0" in r.stdout, r.stdout + r.stderr
        r = _cli(env, "--config", str(writers[node]), "db", "push", "--db", str(site.db(node)))
        assert "shipped nothing" in r.stdout, r.stdout
    r = _cli(env, "--config", str(reporter), "report", "jobs", "--db", "central", "--format", "json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert sorted(row["job_id"] for row in listed) == sorted(jobs)  # every job exactly once
    assert {row["job_id"]: row["gpus"] for row in listed} == {j: n for j, n in zip(jobs, (2, 1, 2, 1))}
    by_node = json.loads(_cli(env, "--config", str(reporter), "report", "--by", "node", "--db", "central",
                              "--format", "json").stdout)
    assert {row["node"]: row["jobs"] for row in by_node} == {"gpu01": 2, "gpu02": 2}
    # The same numbers as the node files themselves.
    files = [a for n in ("gpu01", "gpu02") for a in ("--db", str(site.db(n)))]
    for args in (("--by", "account"), ("jobs",)):
        a = _cli(env, "--config", str(reporter), "report", *args, *files, "--format", "csv")
        b = _cli(env, "--config", str(reporter), "report", *args, "--db", "central", "--format", "csv")
        assert a.returncode == b.returncode == 0 and a.stdout == b.stdout, a.stderr + b.stderr
    cluster.sql(f"DROP DATABASE {db}")
