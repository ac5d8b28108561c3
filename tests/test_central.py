"""The central SQL server: `central init`, `db push` and its faults, against a real MariaDB.

The session's MariaDB server (Debian's mariadbd on 127.0.0.1, fixture `mariadb_server`); every
test gets its own database, an admin account that ran `central init`, and the writer and reporter
accounts created with exactly the GRANTs that `central init` prints.  The TLS tests have a server
of their own: the shared one must stay without TLS (a client that asks for it is refused there).
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mariadb as testdb
import pytest
from mariadb import MariaDB
from testbed import unavailable

from slurm_gpu.central import schema as CS
from slurm_gpu.central import server as C
from slurm_gpu.errors import CentralError, ExitCode
from slurm_gpu.store.node import Store

pytestmark = [pytest.mark.central, pytest.mark.once_on("trixie")]


@pytest.fixture(scope="module")
def server(mariadb_server):
    """The session's MariaDB (tests/conftest.py); every test takes a database of its own there."""
    return mariadb_server


def job_end(job_id, node="n1", gpus=2, restart=0, user="u", account="a", partial=0, end=11.0):
    job = {"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "user": user, "uid": 1,
           "account": account, "partition": "p", "gpu_count": gpus, "start_time": 1.0, "end_time": end,
           "exit_code": "0"}
    rows = [{"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "gpu_uuid": f"GPU-{i}",
             "gpu_index": i, "gpu_model": "NVIDIA H100", "user": user, "account": account, "partition": "p",
             "start_time": 1.0, "end_time": end, "duration_s": end - 1.0, "energy_j": 5.0 * (i + 1),
             "gpu_util_mean_pct": 50.0, "partial": partial} for i in range(gpus)]
    return {"kind": "job_end", "job": job, "gpus": rows}


class Site:
    """A database on the test server with its three accounts and a node config pointing at it."""

    def __init__(self, server: MariaDB, tmp: Path):
        self.server = server
        self.tmp = tmp
        self.db = server.new_database()
        suffix = self.db.split("_")[-1]
        self.admin, self.writer, self.reporter = f"adm_{suffix}", f"wr_{suffix}", f"rep_{suffix}"
        self.writer_prefix = self.writer
        self.admin_pw = server.new_user(self.admin, [f"GRANT ALL ON {self.db}.* TO '{self.admin}'@'%';"])
        self.node_db = tmp / "usage.db"
        self.store = Store(str(self.node_db), str(tmp / "spool"))
        self.config = self.write_config(self.admin, self.admin_pw)

    def password_file(self, user: str, password: str) -> Path:
        p = self.tmp / f"{user}.password"
        p.write_text(password + "\n")
        os.chmod(p, 0o600)
        return p

    def write_config(self, user: str, password: str, timeout_s: float = 5.0, name: str = "config.toml") -> Path:
        cfg = self.tmp / name
        cfg.write_text(f'cluster_name = "c"\nslurm_conf = "{self.tmp}/none.conf"\n'
                       f'[store]\ndatabase = "{self.node_db}"\nspool_dir = "{self.tmp}/spool"\n'
                       f'[central]\nurl = "{self.server.url(user, self.db)}"\n'
                       f'password_file = "{self.password_file(user, password)}"\ntimeout_s = {timeout_s}\n')
        os.chmod(cfg, 0o644)
        return cfg

    def init(self, writers: str = "n1", clusters=("c",), group: str = "", env=None,
             extra=()) -> subprocess.CompletedProcess:
        """`central init` as the admin, with writer accounts for `writers` (one per node, or the
        group's), then the statements it printed, run as the database admin would."""
        self.password_dir = self.tmp / "writers"
        for cluster in clusters:
            r = cli_env(env or {}, "--config", str(self.config), "central", "init", "--writer", self.writer,
                        "--reporter", self.reporter, "--hosts", "%", "--cluster", cluster, "--writers", writers,
                        "--password-dir", str(self.password_dir), *(("--group", group) if group else ()), *extra)
            assert r.returncode == 0, r.stderr
            self.server.sql("\n".join(s for s in r.stdout.splitlines() if f"'{self.reporter}'" not in s), self.db)
        grants = [s for s in r.stdout.splitlines() if s.startswith("GRANT")]
        self.reporter_pw = self.server.new_user(self.reporter, [g for g in grants if f"'{self.reporter}'" in g])
        self.writer, self.writer_pw = self.account(group) if group else self.writer_of("n1")
        self.writer_config = self.write_config(self.writer, self.writer_pw, name="writer.toml")
        return r

    def writer_of(self, node: str):
        """(account, password) of a node's own writer, from the password file central init wrote."""
        return self.account(f"{self.writer_prefix}_{node}")

    def account(self, name: str):
        return name, (self.password_dir / f"{name}.password").read_text().strip()

    def node_writer_config(self, node: str, d: Path, extra: str = "") -> Path:
        """A config in `d` for node `node`: its own node database there, pushing as its own writer."""
        account, password = self.writer_of(node)
        cfg = d / "writer.toml"
        cfg.write_text(f'cluster_name = "c"\nslurm_conf = "{self.tmp}/none.conf"\n'
                       f'[store]\ndatabase = "{d}/usage.db"\nspool_dir = "{d}/spool"\n'
                       f'[central]\nurl = "{self.server.url(account, self.db)}"\n'
                       f'password_file = "{self.password_file(account, password)}"\n{extra}')
        return cfg

    def push(self, *args: str, config: Path = None) -> subprocess.CompletedProcess:
        return cli("--config", str(config or self.writer_config), "db", "push", *args)

    def rows(self, sql: str):
        return self.server.rows(sql, self.db)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("SLURM_CONF", None)
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def site(server, tmp_path):
    return Site(server, tmp_path)


def test_central_init_creates_the_schema_and_check_says_whether_it_is_current(site):
    r = cli("--config", str(site.config), "central", "init", "--check")
    assert r.returncode == 1 and "no slurm-gpu schema" in r.stdout
    r = site.init()
    assert f"schema created at version {C.SCHEMA_VERSION}" in r.stderr
    assert f"GRANT EXECUTE ON PROCEDURE `{site.db}`.`apply_batch` TO '{site.writer}'@'%';" in r.stdout
    r = cli("--config", str(site.config), "central", "init", "--check")
    assert r.returncode == 0 and "current" in r.stdout, r.stdout + r.stderr
    r = cli("--config", str(site.config), "central", "init")  # again: nothing to do, same grants
    assert r.returncode == 0 and "already current" in r.stderr


def test_the_servers_job_tables_have_exactly_the_catalogued_columns(site):
    """information_schema after `central init` against central/server.py's lists (tests/test_columns.py
    ties those to the node's records): the server's own columns are the shipping ones, the row version
    and job_gpus' indexed span."""
    site.init()
    extra = {"jobs": ["row_version"], "job_gpus": ["row_version", "span_s"]}
    for table in ("jobs", "job_gpus"):
        have = [r[0] for r in site.rows("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                                        f"DATABASE() AND table_name = '{table}' ORDER BY ordinal_position")]
        assert sorted(have) == sorted(list(C.COLUMNS[table]) + list(C.SHIPPED) + extra[table]), (table, have)


def test_push_ships_every_record_once_and_a_second_push_ships_nothing(site):
    site.init()
    for j in range(1, 6):
        site.store.write(job_end(j))
    site.store.write({"kind": "health", "events": [
        {"time": 5.0, "node": "n1", "source": "healthcheck", "gpu_index": 0, "gpu_uuid": "GPU-0",
         "check_name": "ecc", "status": "FAIL", "message": "uncorrectable ECC errors: 2"}]})
    site.store.write({"kind": "drain", "drain": {"time": 6.0, "node": "n1", "source": "healthcheck",
                                                 "reason": "slurm-gpu: GPU 0 ecc", "ok": 1, "outcome": "drained"}})
    r = site.push()
    assert r.returncode == 0, r.stderr
    assert "shipped jobs 5, job_gpus 10, health_events 1, drains 1; left 0" in r.stdout
    assert site.rows("SELECT COUNT(*), COUNT(DISTINCT job_id), SUM(energy_j) FROM job_gpus") == [["10", "5", "75"]]
    assert site.rows("SELECT cluster, node, check_name, status FROM health_events") == [["c", "n1", "ecc", "FAIL"]]
    assert site.rows("SELECT cluster, outcome FROM drains") == [["c", "drained"]]
    r = site.push()
    assert r.returncode == 0 and "shipped nothing; left 0" in r.stdout
    assert site.rows(CS.staged_rows_sql("job_gpus")) == [["0"]]
    # nothing waiting: no server is contacted, not even one that is down
    cfg = site.writer_config.read_text()
    down = site.tmp / "down.toml"
    down.write_text(cfg.replace(site.server.url(site.writer, site.db), f"mysql://{site.writer}@127.0.0.1:1/{site.db}"))
    r = site.push(config=down)
    assert r.returncode == 0 and "(no server contacted): shipped nothing; left 0" in r.stdout, r.stdout + r.stderr
    site.store.write(job_end(99))
    r = site.push(config=down)
    assert r.returncode == 5 and "unreachable" in r.stderr, r.stdout + r.stderr


def test_a_row_changed_after_shipping_ships_again_in_its_new_form(site):
    site.init()
    site.store.write(job_end(7, partial=1))
    assert site.push().returncode == 0
    assert site.rows("SELECT DISTINCT partial FROM job_gpus") == [["1"]]
    site.store.write(job_end(7))  # the complete record replaces the partial one on the node
    r = site.push()
    assert r.returncode == 0 and "job_gpus 2" in r.stdout
    assert site.rows("SELECT COUNT(*), MAX(partial) FROM job_gpus") == [["2", "0"]]


def test_a_partial_row_the_node_dropped_is_withdrawn_on_the_server(site):
    site.init()
    site.store.write(job_end(8, partial=1))
    assert site.push().returncode == 0
    # The prolog's drain turns up late: the job never ran here; the node drops the partial rows.
    site.store.write({"kind": "drain", "drain": {"time": 6.0, "node": "n1", "source": "prolog", "cluster": "c",
                                                 "job_id": 8, "restart_count": 0, "reason": "slurm-gpu: x", "ok": 1,
                                                 "outcome": "drained"}})
    r = site.push()
    assert r.returncode == 0 and "withdrawn 3" in r.stdout, r.stdout
    assert site.rows("SELECT COUNT(*) FROM job_gpus WHERE withdrawn = 1") == [["2"]]
    assert site.rows("SELECT COUNT(*) FROM job_gpus_current") == [["0"]]
    assert site.rows("SELECT withdrawn FROM jobs") == [["1"]]


def test_a_node_database_restored_from_an_old_backup_doubles_nothing(site):
    site.init()
    for j in range(1, 4):
        site.store.write(job_end(j))
    site.store.close()
    backup = site.tmp / "backup.db"
    r = cli("--config", str(site.writer_config), "db", "backup", str(backup))
    assert r.returncode == 0, r.stderr
    assert site.push().returncode == 0
    for j in range(4, 6):
        site.store.write(job_end(j))
    assert site.push().returncode == 0
    site.store.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{site.node_db}{suffix}").unlink(missing_ok=True)
    os.rename(backup, site.node_db)
    site.store.write(job_end(6))
    r = site.push()
    assert r.returncode == 0, r.stderr
    assert site.rows("SELECT COUNT(*), COUNT(DISTINCT job_id) FROM job_gpus") == [["12", "6"]]
    assert site.rows("SELECT COUNT(*) FROM jobs") == [["6"]]


def test_the_writer_can_neither_read_nor_change_nor_delete_records(site):
    site.init()
    site.store.write(job_end(1))
    assert site.push().returncode == 0
    writer = C.Central(C.parse_url(site.server.url(site.writer, site.db)), site.writer_pw, 5)
    try:
        for sql in ("SELECT * FROM job_gpus", "SELECT * FROM job_gpus_current", "SELECT * FROM stage_job_gpus",
                    "DELETE FROM job_gpus", "UPDATE job_gpus SET energy_j = 0", "DELETE FROM jobs",
                    "SELECT * FROM health_events", "TRUNCATE TABLE drains", "DROP TABLE job_gpus"):
            with pytest.raises(Exception) as e:
                writer.execute(sql)
            assert "denied" in str(e.value), (sql, e.value)
    finally:
        writer.close()
    assert site.rows("SELECT COUNT(*) FROM job_gpus") == [["2"]]
    reporter = C.Central(C.parse_url(site.server.url(site.reporter, site.db)), site.reporter_pw, 5)
    try:
        assert reporter.execute("SELECT COUNT(*) FROM job_gpus_current") == [(2,)]
        with pytest.raises(Exception, match="denied"):
            reporter.execute("DELETE FROM job_gpus")
    finally:
        reporter.close()


def test_a_wrong_password_is_one_line_naming_the_problem_and_no_secret(site):
    site.init()
    site.store.write(job_end(1))
    bad = site.write_config(site.writer, "Wr0ng-S3cret-Pa55", name="bad.toml")
    r = site.push(config=bad)
    assert r.returncode == 5
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("slurm-gpu: error: central server") and "login refused" in lines[0]
    assert lines[1].startswith("hint: ")
    assert "Wr0ng-S3cret-Pa55" not in r.stdout + r.stderr and site.writer_pw not in r.stdout + r.stderr
    assert "left" not in r.stdout
    r = site.push("--status")
    assert r.returncode == 0 and "waiting: 3 (jobs 1, job_gpus 2" in r.stdout


def test_a_password_in_the_url_is_refused_without_being_printed(site):
    cfg = site.tmp / "pw-in-url.toml"
    cfg.write_text(f'[central]\nurl = "mysql://{site.writer}:Hunter2Secret@127.0.0.1/{site.db}"\n')
    os.chmod(cfg, 0o644)
    r = cli("--config", str(cfg), "db", "push", "--status")
    assert r.returncode == 2 and "must not contain a password" in r.stderr
    assert "Hunter2Secret" not in r.stderr + r.stdout


def test_a_password_file_readable_by_others_is_refused(site):
    site.init()
    site.store.write(job_end(1))
    pw = site.tmp / f"{site.writer}.password"
    os.chmod(pw, 0o644)
    r = site.push()
    assert r.returncode == 5 and "readable or writable by group/others (mode 0644)" in r.stderr
    assert "hint: chmod 600" in r.stderr


def test_server_down_while_20_jobs_end_then_the_next_push_ships_them_once(site):
    site.init()
    site.store.write(job_end(100))
    assert site.push().returncode == 0
    site.server.stop()
    try:
        for j in range(1, 21):
            site.store.write(job_end(j, gpus=1))
        t0 = time.monotonic()
        r = site.push()
        took = time.monotonic() - t0
        assert r.returncode == 5 and "unreachable" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 2
        assert took < 5 + 10, took  # timeout_s plus interpreter start
    finally:
        site.server.start()
    r = site.push()
    assert r.returncode == 0 and "job_gpus 20" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT COUNT(*), COUNT(DISTINCT job_id) FROM job_gpus") == [["22", "21"]]
    assert site.push().returncode == 0
    assert site.rows("SELECT COUNT(*) FROM job_gpus") == [["22"]]


def test_a_hung_server_makes_push_give_up_within_its_timeout(site):
    site.init()
    site.store.write(job_end(1))
    cfg = site.write_config(site.writer, site.writer_pw, timeout_s=2.0, name="short.toml")
    site.server.pause()
    try:
        t0 = time.monotonic()
        r = site.push(config=cfg)
        took = time.monotonic() - t0
    finally:
        site.server.resume()
    assert r.returncode == 5 and "not answering" in r.stderr, r.stderr
    assert took < 2.0 * 3 + 5, took  # connect, read and write timeouts, plus start-up
    assert site.push().returncode == 0
    assert site.rows("SELECT COUNT(*) FROM job_gpus") == [["2"]]


def test_a_record_the_server_refuses_stays_behind_and_the_others_ship(site):
    site.init()
    site.store.write(job_end(1))
    site.store.write(job_end(2, user="x" * 300))  # longer than the server's VARCHAR(255)
    site.store.write(job_end(3))
    r = site.push()
    assert r.returncode == 1, r.stdout + r.stderr
    assert "refused by the server: jobs c/2/0/n1" in r.stderr and "Data too long" in r.stderr
    assert site.rows("SELECT job_id FROM jobs ORDER BY job_id") == [["1"], ["3"]]
    assert "left 3" in r.stdout  # the refused job row and its two GPU rows


def test_push_without_schema_says_run_central_init(site):
    site.store.write(job_end(1))
    r = cli("--config", str(site.config), "db", "push")
    assert r.returncode == 5 and "no slurm-gpu schema" in r.stderr and "central init" in r.stderr


def test_push_progress_bar_only_when_asked_or_on_a_terminal(site):
    site.init()
    for j in range(1, 4):
        site.store.write(job_end(j))
    r = site.push("--progress", "--batch-size", "2")
    assert r.returncode == 0 and "pushing" in r.stderr
    site.store.write(job_end(9))
    r = site.push()
    assert r.returncode == 0 and r.stderr == ""


def test_push_status_reads_only_the_node_database(site, tmp_path):
    site.store.write(job_end(1))
    cfg = tmp_path / "nowhere.toml"
    cfg.write_text(f'[store]\ndatabase = "{site.node_db}"\n[central]\nurl = "mysql://u@127.0.0.1:1/x"\n')
    os.chmod(cfg, 0o644)
    r = cli("--config", str(cfg), "db", "push", "--status")
    assert r.returncode == 0 and "waiting: 3" in r.stdout and "last push never" in r.stdout


def test_the_node_outbox_marks_every_change_and_every_deletion(tmp_path):
    """Pure node side: the v5 triggers (no server needed)."""
    st = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    st.write(job_end(1, partial=1))
    conn = sqlite3.connect(st.path)
    assert conn.execute("SELECT push_version, pushed_version FROM job_gpus").fetchall() == [(1, 0), (1, 0)]
    conn.execute("UPDATE job_gpus SET pushed_version = push_version")
    conn.commit()
    st.write(job_end(1))  # completes the rows: a change
    assert conn.execute("SELECT push_version > pushed_version FROM job_gpus").fetchall() == [(1,), (1,)]
    conn.execute("UPDATE job_gpus SET pushed_version = push_version")
    conn.execute("DELETE FROM job_gpus WHERE gpu_index = 0")
    conn.commit()
    assert conn.execute("SELECT tbl, job_id, gpu_uuid FROM push_withdrawn").fetchall() == [("job_gpus", 1, "GPU-0")]
    conn.close()


UNITS = Path(__file__).resolve().parent.parent / "deploy" / "systemd"


def _installed_units(tmp_path: Path) -> Path:
    """The shipped units with ExecStart pointing at this installation's slurm-gpu."""
    import shutil
    # The interpreter's own first: another installation on PATH may be an older version.
    exe = str(Path(sys.executable).with_name("slurm-gpu"))
    exe = exe if os.access(exe, os.X_OK) else (shutil.which("slurm-gpu") or exe)
    out = tmp_path / "units"
    out.mkdir()
    for unit in UNITS.iterdir():
        (out / unit.name).write_text(unit.read_text().replace("/usr/local/bin/slurm-gpu", exe))
    return out


def test_shipped_systemd_units_pass_systemd_analyze_verify(tmp_path):
    import shutil
    if shutil.which("systemd-analyze") is None:
        unavailable("systemd-analyze not found (Debian package systemd)")
    units = _installed_units(tmp_path)
    r = subprocess.run(["systemd-analyze", "verify", *(str(p) for p in sorted(units.iterdir()))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # Warnings about the unit files themselves (not about this machine's other units) fail too.
    assert "slurm-gpu-" not in r.stderr, r.stderr


def test_the_timer_ships_a_record_within_60_seconds_of_the_epilog(site, tmp_path):
    """Period of the timer + the service's own command, run as written, against a real server."""
    import configparser
    import shlex
    units = _installed_units(tmp_path)
    timer = configparser.ConfigParser(strict=False, interpolation=None)
    timer.read(units / "slurm-gpu-push.timer")
    period = timer["Timer"]["OnUnitActiveSec"]
    assert period.endswith("s") and int(period[:-1]) + int(timer["Timer"]["AccuracySec"][:-1]) \
        + int(timer["Timer"]["RandomizedDelaySec"][:-1]) <= 45
    service = configparser.ConfigParser(strict=False, interpolation=None)
    service.read(units / "slurm-gpu-push.service")
    argv = shlex.split(service["Service"]["ExecStart"])
    site.init()
    site.store.write(job_end(77))
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SLURM_GPU_CONFIG=str(site.writer_config)))
    took = time.monotonic() - t0
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr
    assert site.rows("SELECT COUNT(*) FROM job_gpus WHERE job_id = 77") == [["2"]]
    assert took < 15, took


def _mixed_records(seed: int = 7):
    """Jobs over two months, three nodes, users, accounts, models, MIG-less and partial rows,
    unknown utilisation, a record crossing midnight and one with out-of-range utilisation."""
    import random
    rnd = random.Random(seed)
    t0 = 1_790_000_000.0  # 2026-09-21
    out = {"n1": [], "n2": [], "n3": []}
    for j in range(1, 121):
        node = ("n1", "n2", "n3")[j % 3]
        start = t0 + rnd.uniform(0, 60 * 86400)
        dur = rnd.choice((30.0, 600.5, 3600.0, 5 * 3600 + 0.25, 26 * 3600.0))
        gpus = rnd.choice((1, 2, 4))
        user = rnd.choice(("alice", "bob", "Carol", "dave\u00e9", None))
        account = rnd.choice(("physics", "chem", "bio"))
        model = rnd.choice(("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"))
        job = {"cluster": rnd.choice(("c", "c", "d")), "job_id": 1000 + j, "restart_count": rnd.choice((0, 0, 1)),
               "node": node, "user": user, "uid": 1, "account": account, "partition": rnd.choice(("gpu", "long")),
               "gpu_count": gpus, "start_time": start, "end_time": start + dur, "exit_code": "0"}
        rows = []
        for i in range(gpus):
            util = rnd.choice((None, 0.0, 3.2, 47.123, 99.9, 100.0, 131.0))
            rows.append({k: job[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account",
                                             "partition")} | {
                "gpu_uuid": f"GPU-{node}-{i}", "gpu_index": i, "gpu_model": model, "start_time": start,
                "end_time": start + dur, "duration_s": dur, "energy_j": None if util is None else rnd.uniform(1e3, 3e6),
                "gpu_util_mean_pct": util, "mem_util_mean_pct": None if util is None else util / 3,
                "max_memory_bytes": rnd.choice((None, 1 << 30, 80 << 30)), "process_count": 1})
        out[node].append({"kind": "job_end", "job": job, "gpus": rows})
    # Records that cannot be placed in time: both sources must count them in the same note.
    for j, (start, end) in enumerate(((t0 + 500, t0 + 100), (t0 - 4000 * 86400.0, t0), (5e11, 5e11 + 60)), 900):
        g = {"cluster": "c", "job_id": j, "restart_count": 0, "node": "n1", "gpu_uuid": "GPU-bad", "gpu_index": 0,
             "user": "alice", "account": "chem", "partition": "gpu", "start_time": start, "end_time": end,
             "duration_s": end - start, "energy_j": 1.0}
        job = {k: g[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account", "partition",
                                 "start_time", "end_time")}
        out["n1"].append({"kind": "job_end", "job": dict(job, gpu_count=1), "gpus": [g]})
    return out


@pytest.fixture(scope="module")
def pushed(server, tmp_path_factory):
    """The same records in three node files and on the server (pushed by the writer)."""
    tmp = tmp_path_factory.mktemp("equal")
    s = Site(server, tmp)
    s.init(writers="n[1-3]", clusters=("c", "d"), group=f"grp_{s.db[-8:]}")
    files = []
    for node, recs in _mixed_records().items():
        st = Store(str(tmp / f"{node}.db"), str(tmp / f"spool-{node}"))
        for rec in recs:
            st.write(rec)
        st.close()
        files.append(str(tmp / f"{node}.db"))
        r = s.push("--db", files[-1])
        assert r.returncode == 0, r.stderr
    s.reporter_config = s.write_config(s.reporter, s.reporter_pw, name="reporter.toml")
    return s, files


@pytest.mark.parametrize("args", [
    ("--by", "user"), ("--by", "account,month"), ("--by", "gpu-model,week"), ("--by", "node,day"),
    ("--by", "partition", "--since", "2026-10-01", "--until", "2026-10-15T12:30"), ("--by", "cluster,user"),
    ("--by", "month", "--user", "alice,Carol"), ("--by", "account", "--idle-threshold", "10"),
    ("jobs", "--sort", "-energy_kwh"), ("jobs", "--idle", "--limit", "7"), ("jobs", "--since", "now-3650days"),
    ("job", "1005"), ("--by", "day", "--tz", "local", "--since", "2026-10-20", "--until", "2026-10-24"),
])
@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_report_from_the_server_equals_report_from_node_files_byte_for_byte(pushed, args, fmt):
    s, files = pushed
    node_args = [a for f in files for a in ("--db", f)]
    url = s.server.url(s.reporter, s.db)
    env_tz = {"TZ": "Europe/Berlin"}
    a = cli_env(env_tz, "--config", str(s.reporter_config), "report", *args, *node_args, "--format", fmt)
    b = cli_env(env_tz, "--config", str(s.reporter_config), "report", *args, "--db", url, "--format", fmt)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    assert a.stdout.strip(), a.stderr
    assert b.stdout == a.stdout
    assert b.stderr == a.stderr
    if args[0] != "job":
        assert "skipped" in a.stderr or "--since" in args or "--user" in args, a.stderr  # the misplaced records


def test_report_db_central_uses_the_configured_url_and_a_reporter_cannot_be_a_writer(pushed):
    s, files = pushed
    r = cli("--config", str(s.reporter_config), "report", "--by", "account", "--db", "central", "--format", "csv")
    assert r.returncode == 0 and r.stdout.startswith("account,jobs,"), r.stderr
    r = cli("--config", str(s.writer_config), "report", "--by", "account", "--db", "central")
    assert r.returncode == 5 and "permission denied" in r.stderr and "SELECT command denied" in r.stderr
    r = cli("--config", str(s.reporter_config), "report", "--db", "central", "--db", files[0])
    assert r.returncode == 2 and "cannot be combined" in r.stderr


def cli_env(extra_env, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **extra_env)
    env.pop("SLURM_CONF", None)
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_servers_count_of_misplaced_records_reads_the_span_index(pushed):
    s, _files = pushed
    plan = s.server.rows("SET SESSION sql_mode='ANSI_QUOTES'; EXPLAIN SELECT COUNT(*) FROM job_gpus_current "
                         'WHERE "span_s" < 0', s.db)
    assert any("job_gpus_span" in "\t".join(row) for row in plan), plan


def test_a_password_pymysql_cannot_send_is_one_line_saying_so_and_never_printed(site):
    site.init()
    site.store.write(job_end(1))
    bad = site.write_config(site.writer, "S3cret-\u20ac-pw", name="euro.toml")
    r = site.push(config=bad)
    assert r.returncode == 5, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint: "), r.stderr
    assert "latin-1" in lines[0] and "UnicodeEncodeError" not in r.stderr
    assert "S3cret" not in r.stdout + r.stderr and "\u20ac" not in r.stdout + r.stderr


class Trickle:
    """A 'server' on 127.0.0.1 that accepts TCP and sends one byte every 2 s, forever: the header
    of a 65,535-byte handshake packet (sequence 0, so the client keeps reading), then its body."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn):
        import itertools
        data = itertools.chain(b"\xff\xff\x00\x00", itertools.repeat(0x0a))
        with conn:
            while not self.stop.wait(2.0):
                try:
                    conn.sendall(bytes([next(data)]))
                except OSError:
                    return

    def close(self):
        self.stop.set()
        self.sock.close()


def test_a_server_that_trickles_one_byte_every_2s_ends_push_within_its_deadline(site):
    site.init()
    site.store.write(job_end(1))
    trickle = Trickle()
    cfg = site.tmp / "trickle.toml"
    cfg.write_text(f'cluster_name = "c"\n[store]\ndatabase = "{site.node_db}"\nspool_dir = "{site.tmp}/spool"\n'
                   f'[central]\nurl = "mysql://{site.writer}@127.0.0.1:{trickle.port}/{site.db}"\n'
                   f'password_file = "{site.password_file(site.writer, site.writer_pw)}"\ntimeout_s = 3\n')
    os.chmod(cfg, 0o644)
    try:
        t0 = time.monotonic()
        r = cli("--config", str(cfg), "db", "push", "--max-seconds", "5", timeout=40)
        took = time.monotonic() - t0
    finally:
        trickle.close()
    assert r.returncode == 5, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and "no complete answer within 3 s" in lines[0], r.stderr
    assert took < 3 + 5 + 4, took  # the deadline, the budget, interpreter start-up
    print(f"push against a trickling server ended after {took:.1f} s")


def test_a_second_push_of_the_same_node_database_says_so_and_ships_nothing(site):
    import fcntl
    site.init()
    site.store.write(job_end(1))
    site.store.close()
    with open(f"{site.node_db}.push-lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = site.push()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "another `db push` of" in r.stderr and "is running" in r.stderr and r.stdout == ""
    assert site.rows("SELECT COUNT(*) FROM job_gpus") == [["0"]]
    r = site.push()
    assert r.returncode == 0 and "job_gpus 2" in r.stdout


def test_two_concurrent_pushes_ship_3000_records_once_and_count_them_once(site):
    import re
    site.init()
    for j in range(1, 301):
        site.store.write(job_end(j, gpus=10))
    site.store.close()
    args = [sys.executable, "-m", "slurm_gpu.cli", "--config", str(site.writer_config), "db", "push",
            "--batch-size", "50"]
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    shipped = sum(int(m) for out, _ in outs for m in re.findall(r"job_gpus (\d+)", out))
    assert shipped == 3000, outs
    assert site.rows("SELECT COUNT(*) FROM job_gpus") == [["3000"]]


def test_a_node_restored_from_an_old_backup_cannot_replace_a_newer_complete_row(site):
    site.init()
    site.store.write(job_end(7, partial=1, end=5.0))
    site.store.close()
    backup = site.tmp / "old.db"  # taken before the partial rows shipped: it ships them again
    assert cli("--config", str(site.writer_config), "db", "backup", str(backup)).returncode == 0
    assert site.push().returncode == 0
    done = job_end(7, end=11.0)
    for g in done["gpus"]:
        g["energy_j"] = 500.0
    site.store.write(done)  # the late start record completes the rows: version 2
    assert site.push().returncode == 0
    newer = site.rows("SELECT partial, energy_j, end_time FROM job_gpus ORDER BY gpu_index")
    assert newer == [["0", "500", "11"], ["0", "500", "11"]]
    site.store.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{site.node_db}{suffix}").unlink(missing_ok=True)
    os.rename(backup, site.node_db)
    site.store.write(job_end(8))  # the restored node goes on recording
    r = site.push()
    assert r.returncode == 0, r.stdout + r.stderr
    assert site.rows("SELECT partial, energy_j, end_time FROM job_gpus WHERE job_id = 7 ORDER BY gpu_index") == newer
    assert site.rows("SELECT partial, end_time FROM jobs WHERE job_id = 7") == [["0", "11"]]
    assert site.rows("SELECT COUNT(*) FROM job_gpus WHERE job_id = 8") == [["2"]]


def test_central_init_migrates_a_v2_server_in_place_keeping_its_records(site):
    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 10)
    try:
        for stmt in C.MIGRATIONS[0] + C.MIGRATIONS[1]:
            admin.execute(stmt)
        admin.execute("INSERT INTO meta (name, value) VALUES ('schema_version', '2')")
        admin.execute("INSERT INTO job_gpus (cluster, job_id, restart_count, node, gpu_uuid, start_time, end_time, "
                      "duration_s, energy_j, partial, shipped_at) VALUES ('c', 1, 0, 'n1', 'GPU-0', 1, 11, 10, 5, 0, 1)")
        admin.commit()
    finally:
        admin.close()
    r = cli("--config", str(site.config), "central", "init", "--check")
    assert r.returncode == 1 and f"schema version 2, this slurm-gpu needs {C.SCHEMA_VERSION}" in r.stdout, \
        r.stdout + r.stderr
    r = site.init()
    assert f"schema migrated from 2 at version {C.SCHEMA_VERSION}" in r.stderr
    assert site.rows("SELECT energy_j, row_version FROM job_gpus") == [["5", "0"]]
    site.store.write(job_end(1))  # the same record from the node: version 1 beats the server's 0
    site.store.write(job_end(2))
    r = site.push()
    assert r.returncode == 0 and "job_gpus 4" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT job_id, row_version FROM job_gpus ORDER BY job_id, gpu_index") == [
        ["1", "1"], ["1", "1"], ["2", "1"], ["2", "1"]]


def test_a_v10_server_gains_each_runs_sluid_and_pushes_carry_it(site):
    """Schema v11: a server made before it (its tables, staging tables and view without `sluid`) is
    migrated in place; a node's records of a run with a SLUID (25.11+) arrive with it, older ones without."""
    site.init()
    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 10)
    try:  # back to what v10 made
        for t in C.VERSIONED:
            admin.execute(f"ALTER TABLE {t} DROP COLUMN sluid")
            admin.execute(f"ALTER TABLE stage_{t} DROP COLUMN sluid")
        admin.execute("CREATE OR REPLACE VIEW job_gpus_current AS SELECT * FROM job_gpus WHERE withdrawn = 0")
        admin.execute("UPDATE meta SET value = '10' WHERE name = 'schema_version'")
        admin.commit()
    finally:
        admin.close()
    assert site.push().returncode != 0  # a v11 node does not push to a v10 server
    r = site.init()
    assert r.returncode == 0 and f"schema migrated from 10 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    run = job_end(1, gpus=1)
    run["job"]["sluid"] = run["gpus"][0]["sluid"] = "s0KRJ2ZB1C8100"
    site.store.write(run)
    site.store.write(job_end(2, gpus=1))
    assert site.push().returncode == 0
    assert site.rows("SELECT job_id, sluid FROM job_gpus_current ORDER BY job_id") == [["1", "s0KRJ2ZB1C8100"],
                                                                                       ["2", "NULL"]]
    assert site.rows("SELECT job_id, sluid FROM jobs ORDER BY job_id") == [["1", "s0KRJ2ZB1C8100"], ["2", "NULL"]]
    assert site.rows("SELECT COUNT(*) FROM information_schema.statistics WHERE table_schema = DATABASE() "
                     "AND table_name = 'job_gpus' AND index_name = 'job_gpus_sluid'") == [["1"]]


def _forge(site, user, password, rows_by_table):
    """What a compromised node can do with its own writer password: stage rows and CALL apply_batch."""
    w = C.Central(C.parse_url(site.server.url(user, site.db)), password, 10)
    try:
        for table, rows in rows_by_table.items():
            w.executemany(C.stage_sql(table), [("f" * 32,) + r for r in rows])
        w.execute("CALL apply_batch(%s)", ("f" * 32,))
        w.commit()
    finally:
        w.rollback()
        w.close()


def _forged_job(cluster, node, job_id=1):
    job = dict(job_end(job_id, node=node, user="mallory", account="stolen")["job"], cluster=cluster)
    return tuple(job.get(c, 0) for c in C.CENTRAL_JOB_COLUMNS) + (99, 1.0, 0)


def assert_forgeries_refused(site, table, forged, select):
    """n2's writer stages `table` rows of node n1 and of another cluster: each batch is refused whole,
    `select` reads the same after, nothing stays staged.  n2's (account, password)."""
    before = site.rows(select)
    n2_user, n2_pw = site.writer_of("n2")
    for cluster, node in (("c", "n1"), ("other", "n2")):
        with pytest.raises(C.CentralError) as e:
            _forge(site, n2_user, n2_pw, {table: [forged(cluster, node)]})
        assert f"may not write records of node {node} in cluster {cluster}" in e.value.message
        assert e.value.exit_code == ExitCode.REFUSED
    assert site.rows(select) == before
    assert site.rows(CS.staged_rows_sql(table)) == [["0"]]
    return n2_user, n2_pw


def test_a_forged_batch_for_another_node_or_cluster_is_refused_and_changes_nothing(site):
    site.init(writers="n1,n2")  # one account per node
    site.store.write(job_end(1, node="n1"))
    r = site.push()
    assert r.returncode == 0, r.stdout + r.stderr
    n2_user, n2_pw = assert_forgeries_refused(site, "jobs", _forged_job,
                                              "SELECT cluster, job_id, node, user, account FROM jobs ORDER BY node")
    _forge(site, n2_user, n2_pw, {"jobs": [_forged_job("c", "n2", 5)]})  # its own node's row applies
    assert site.rows("SELECT node, user FROM jobs WHERE job_id = 5") == [["n2", "mallory"]]


def test_a_push_of_another_nodes_records_is_refused_whole_and_keeps_them_unshipped(site):
    site.init(writers="n1,n2")
    site.store.write(job_end(1, node="n1"))
    site.store.write(job_end(2, node="n2"))  # this node database holds a row of another node
    site.store.close()
    user, pw = site.writer_of("n1")
    r = site.push(config=site.write_config(user, pw, name="n1.toml"))
    assert r.returncode == int(ExitCode.REFUSED), r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("slurm-gpu: error: ") and lines[1].startswith("hint: "), r.stderr
    assert f"account {user} may not write records of node n2 in cluster c" in lines[0], r.stderr
    assert site.rows("SELECT COUNT(*) FROM jobs") == [["0"]] and site.rows("SELECT COUNT(*) FROM job_gpus") == [["0"]]
    r = cli("--config", str(site.writer_config), "db", "push", "--status")
    assert "waiting: 6" in r.stdout, r.stdout


def test_central_init_migrates_a_v3_server_with_a_shared_writer_to_per_node_writers_in_place(site):
    """v3 -> v5 (through the rollups): the records stay; the old shared writer is refused (nothing lost)
    until it is registered."""
    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 10)
    try:
        for stmt in C.MIGRATIONS[0] + C.MIGRATIONS[1] + C.MIGRATIONS[2]:
            admin.execute(stmt)
        admin.execute("INSERT INTO meta (name, value) VALUES ('schema_version', '3')")
        admin.commit()
    finally:
        admin.close()
    shared = f"sw_{site.db[-8:]}"
    grants = [g for g in C.grants(C.parse_url(site.server.url(site.admin, site.db)), shared, site.reporter)
              if g.startswith("GRANT") and f"'{shared}'" in g
              and not any(t in g for t in ("remediation", "job_samples", "efficiency_actions"))]  # not at v3
    shared_pw = site.server.new_user(shared, grants)
    shared_cfg = site.write_config(shared, shared_pw, name="shared.toml")
    _forge(site, shared, shared_pw, {"jobs": [_forged_job("c", "n1")]})  # v3: the shared writer ships
    r = cli("--config", str(site.config), "central", "init", "--check")
    assert r.returncode == 1 and f"schema version 3, this slurm-gpu needs {C.SCHEMA_VERSION}" in r.stdout, r.stdout
    r = cli("--config", str(site.config), "central", "init")
    assert r.returncode == 0 and f"schema migrated from 3 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    assert "no writer registered" in r.stderr
    assert site.rows("SELECT job_id, node, user, row_version FROM jobs") == [["1", "n1", "mallory", "99"]]
    site.store.write(job_end(2))
    r = site.push(config=shared_cfg)
    assert r.returncode == int(ExitCode.REFUSED) and f"account {shared} may not write" in r.stderr, r.stderr
    assert site.rows("SELECT COUNT(*) FROM jobs") == [["1"]]
    pw_dir = site.tmp / "writers"
    args = ("--config", str(site.config), "central", "init", "--cluster", "c", "--writers", "*", "--group", shared,
            "--password-dir", str(pw_dir))
    r = cli(*args[:4], "--check", *args[4:])
    assert r.returncode == 1 and "1 node(s) not registered, 1 password file(s) missing" in r.stdout, r.stdout
    r = cli(*args)  # the shared account keeps its password: its statements are not run here
    assert r.returncode == 0 and f"-- {shared}: c *" in r.stdout, r.stderr
    r = site.push(config=shared_cfg)
    assert r.returncode == 0 and "jobs 1, job_gpus 2" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT job_id, user FROM jobs ORDER BY job_id") == [["1", "mallory"], ["2", "u"]]
    assert cli(*args[:4], "--check", *args[4:]).returncode == 0


def test_central_init_writes_each_writers_password_file_once_and_prints_only_its_hash(site):
    r = site.init(writers="n[1-2]")
    files = sorted(site.password_dir.iterdir())
    assert [f.name for f in files] == [f"{site.writer_prefix}_n1.password", f"{site.writer_prefix}_n2.password"]
    for f in files:
        st = f.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
        password = f.read_text().strip()
        assert password not in r.stdout + r.stderr
        assert f"AS '{C.W.native_hash(password)}';" in r.stdout
    again = cli("--config", str(site.config), "central", "init", "--cluster", "c", "--writers", "n[1-2]",
                "--writer", site.writer_prefix, "--password-dir", str(site.password_dir))
    assert again.returncode == 0 and [f.read_text() for f in files] == [f.read_text() for f in files]
    assert [s for s in again.stdout.splitlines() if "IDENTIFIED" in s and "_n" in s] == \
        [s for s in r.stdout.splitlines() if "IDENTIFIED" in s and "_n" in s]
    bad = cli("--config", str(site.config), "central", "init", "--cluster", "c", "--writers", "*")
    assert bad.returncode == 2 and "needs --group" in bad.stderr, bad.stderr


# --------------------------------------------------------------------------- TLS

def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> Path:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"))
    return d / f"{name}.pem"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A server with TLS on, its certificate (for IP 127.0.0.1) signed by a test CA; and another CA.
    A server of its own, not the session's: with TLS on there, every other test's client would
    talk TLS (PyMySQL >= 1.2 takes it where offered), and the last test here needs a server without."""
    d = tmp_path_factory.mktemp("tls")
    ca, other = _ca(d, "site-ca"), _ca(d, "other-ca")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=central", "-keyout", str(d / "server.key"),
             "-out", str(d / "server.csr"))
    (d / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(ca), "-CAkey", str(d / "site-ca.key"),
             "-CAcreateserial", "-days", "2", "-extfile", str(d / "san.ext"), "-out", str(d / "server.pem"))
    for server in testdb.running([f"--ssl-ca={ca}", f"--ssl-cert={d / 'server.pem'}", f"--ssl-key={d / 'server.key'}"]):
        db = server.new_database()
        pw = server.new_user("tls_user", [f"GRANT SELECT ON {db}.* TO 'tls_user'@'%';"])
        yield server, db, pw, ca, other


def _cipher(central: C.Central) -> str:
    return str(central.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")[0][1])


def test_without_ssl_ca_tls_is_the_drivers_default_and_no_ca_bundle_is_loaded(tls, monkeypatch):
    """No ssl_ca: PyMySQL's default (>= 1.2: TLS where the server offers it, unverified), which
    loaded the system's CA bundle on every connection (~50 ms of each report) for nothing."""
    import ssl

    import pymysql
    server, db, pw, _ca_pem, _other = tls
    plain = pymysql.connect(host="127.0.0.1", port=server.port, user="tls_user", password=pw, database=db)
    try:
        with plain.cursor() as cur:
            cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            drivers = cur.fetchone()[1]
    finally:
        plain.close()
    loaded = []
    monkeypatch.setattr(ssl.SSLContext, "load_default_certs", lambda self, *a: loaded.append(a))
    with C.Central(C.parse_url(server.url("tls_user", db)), pw, 10) as central:
        assert _cipher(central) == drivers and (drivers != "") == ("_ssl_required" in vars(plain))
        assert central.execute("SELECT 1") == [(1,)]
    assert loaded == []


def test_ssl_ca_of_the_servers_ca_connects_over_verified_tls(tls):
    server, db, pw, ca, _other = tls
    with C.Central(C.parse_url(server.url("tls_user", db) + f"?ssl_ca={ca}"), pw, 10) as central:
        assert _cipher(central) != ""


def test_a_server_certificate_another_ca_signed_is_one_line_saying_tls_failed(tls):
    server, db, pw, _ca_pem, other = tls
    with pytest.raises(C.CentralError) as e:
        C.Central(C.parse_url(server.url("tls_user", db) + f"?ssl_ca={other}"), pw, 10)
    assert "TLS failed" in str(e.value) and "CERTIFICATE_VERIFY_FAILED" in str(e.value), str(e.value)
    assert "ssl_ca" in e.value.hint and pw not in str(e.value) + e.value.hint
    assert "\n" not in str(e.value)


def test_ssl_ca_for_a_server_without_tls_is_one_line_saying_tls_failed(site, tls):
    _server, _db, _pw, ca, _other = tls
    with pytest.raises(C.CentralError) as e:
        C.Central(C.parse_url(site.server.url(site.admin, site.db) + f"?ssl_ca={ca}"), site.admin_pw, 10)
    assert "TLS failed" in str(e.value) and "have_ssl" in e.value.hint, str(e.value)


# --------------------------------------------------------------------------- issue 38: samples and actions


def _sample(t, util, *, job=7, gpu="GPU-a", coarse=0, span=60.0, samples=1):
    return {"cluster": "c", "job_id": job, "restart_count": 0, "node": "n1", "gpu_uuid": gpu, "gpu_index": 0,
            "time": t, "span_s": span, "samples": samples, "coarse": coarse, "gpu_util_pct": util,
            "gpu_util_max_pct": util, "memory_used_bytes": 1 << 30, "memory_total_bytes": 80 << 30, "energy_j": t / 10}


def test_running_jobs_samples_ship_and_a_coarse_row_replaces_its_fine_rows_on_the_server(site):
    from slurm_gpu.store import samples as Q
    site.init()
    conn = site.store.connect()
    t0 = float(int(time.time()) // 600 * 600 - 3600)  # an hour ago, on a 10-minute boundary
    Q.record_samples(conn, [_sample(t0 + 60 * i, 0.0) for i in range(1, 16)], fine_before=0, keep_before=0, max_bytes=1e9)
    r = site.push()
    assert r.returncode == 0 and "job_samples 15" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT COUNT(*), SUM(coarse) FROM job_samples") == [["15", "0"]]
    # The node merges the first 10 minutes (9 fine rows: t0+60 .. t0+540) into one coarse row: on the server too.
    Q.record_samples(conn, [], fine_before=t0 + 600, keep_before=0, max_bytes=1e9)
    r = site.push()
    assert r.returncode == 0 and "job_samples 1" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT coarse, COUNT(*), SUM(samples), SUM(span_s) FROM job_samples GROUP BY coarse ORDER BY coarse") == \
        [["0", "6", "6", "360"], ["1", "1", "9", "540"]]
    # Pushed twice (a node restored from a backup): nothing doubled.
    conn.execute("UPDATE job_samples SET pushed_version = 0")
    assert site.push().returncode == 0
    assert site.rows("SELECT COUNT(*) FROM job_samples") == [["7"]]
    # Samples older than the server keeps them go with the next push of that node.
    Q.record_samples(conn, [_sample(time.time() - CS.SAMPLES_KEPT_S - 60, 5.0, job=8),
                            _sample(time.time(), 5.0, job=8)], fine_before=0, keep_before=0, max_bytes=1e9)
    assert site.push().returncode == 0
    assert site.rows("SELECT job_id, COUNT(*) FROM job_samples GROUP BY job_id ORDER BY job_id") == [["7", "7"], ["8", "1"]]


def test_an_idle_policy_action_ships_and_its_later_outcome_replaces_it_on_the_server(site):
    from slurm_gpu.store import samples as Q
    site.init()
    conn = site.store.connect()
    row_id = Q.add_action(conn, {"time": 1_800_000_000.0, "cluster": "c", "job_id": 7, "restart_count": 0,
                                 "decided_on": "n1", "user": "alice", "account": "physics", "partition": "gpu",
                                 "stage": "notify", "idle_s": 3600.0, "gpus": 2, "idle_gpus": 2, "evidence": "{}",
                                 "mail_to": "alice@example.org", "mail_state": "pending", "mail_tries": 0,
                                 "message": '{"subject": "s", "body": "private"}'})
    assert site.push().returncode == 0
    assert site.rows("SELECT node, id, stage, mail_state FROM efficiency_actions") == [["n1", str(row_id), "notify", "pending"]]
    Q.update_action(conn, row_id, mail_state="sent", mail_tries=1, mail_time=1_800_000_060.0)
    r = site.push()
    assert r.returncode == 0 and "efficiency_actions 1" in r.stdout, r.stdout
    assert site.rows("SELECT mail_state, mail_tries, row_version FROM efficiency_actions") == [["sent", "1", "2"]]
    # The message itself never leaves the host that sent it.
    cols = [r[0] for r in site.rows("SELECT column_name FROM information_schema.columns "
                                    f"WHERE table_schema = '{site.db}' AND table_name = 'efficiency_actions'")]
    assert "message" not in cols and "body" not in cols


def test_report_jobs_idle_on_the_central_server_lists_what_the_idle_policy_did(site):
    """Issue 38: `report jobs --idle --db central` shows the policy's actions shipped by the deciding host."""
    import json

    from slurm_gpu.store import samples as Q
    site.init()
    rec = job_end(7, end=1_800_003_600.0)  # a date a report can place (2000-2099)
    rec["job"]["start_time"] = 1_800_000_000.0
    for g in rec["gpus"]:
        g.update(gpu_util_mean_pct=0.0, start_time=1_800_000_000.0, duration_s=3600.0)  # held idle
    site.store.write(rec)
    conn = site.store.connect()
    Q.add_action(conn, {"time": 5.0, "cluster": "c", "job_id": 7, "restart_count": 0, "decided_on": "n1",
                        "stage": "notify", "mail_state": "sent"})
    assert site.push().returncode == 0
    reporter = site.write_config(site.reporter, site.reporter_pw, name="reporter.toml")
    r = cli("--config", str(reporter), "report", "jobs", "--idle", "--db", "central", "--since", "@1799990000",
            "--json")
    assert r.returncode == 0, r.stderr
    (job,) = json.loads(r.stdout)
    assert (job["job_id"], job["idle_policy"]) == (7, "notify sent")


@pytest.fixture(scope="module")
def snapshot_server():
    """MariaDB with innodb_snapshot_isolation on, the default from 11.6.2 (Debian 13's 11.8): a
    locking read of a row that another transaction changed after this one's snapshot fails with
    1020 "Record has changed since last read" instead of waiting."""
    yield from testdb.running(["--innodb-snapshot-isolation=ON"])


def test_four_nodes_pushing_the_same_cells_at_once_under_snapshot_isolation_count_every_record_once(snapshot_server, tmp_path):
    import re
    import threading
    site = Site(snapshot_server, tmp_path)
    assert site.rows("SELECT @@innodb_snapshot_isolation") == [["1"]]
    nodes = [f"n{i}" for i in range(1, 5)]
    site.init(writers="n[1-4]")
    configs = []
    for node in nodes:  # one node database each, every job on the same day, partition and model: the same cells
        d = tmp_path / node
        d.mkdir()
        store = Store(str(d / "usage.db"), str(d / "spool"))
        for j in range(1, 121):
            store.write(job_end(j, node=node, gpus=4))
        store.close()
        configs.append(site.node_writer_config(node, d, "timeout_s = 60\n"))
    results = [None] * len(nodes)

    def push(i):
        results[i] = cli_env({"SLURMD_NODENAME": nodes[i]}, "--config", str(configs[i]), "db", "push",
                             "--batch-size", "10")

    threads = [threading.Thread(target=push, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.returncode == 0 for r in results), [r.stdout + r.stderr for r in results]
    shipped = sum(int(m) for r in results for m in re.findall(r"job_gpus (\d+)", r.stdout))
    assert shipped == 4 * 120 * 4
    assert site.rows("SELECT COUNT(*), SUM(energy_j) FROM job_gpus") == [["1920", str(4 * 120 * 50)]]
    # the same cells, at once: the server rolled some batches back, and they were sent again
    assert sum(int(n) for r in results for n in re.findall(r"(\d+) batch\(es\) sent again", r.stdout + r.stderr)) > 0


def test_three_nodes_with_the_same_xid_within_ten_minutes_are_one_storm_in_fleet_xids(site):
    """Issue 39 item 4: the same XID on three nodes within 10 minutes, each read from its kernel log
    line, recorded in its node database and pushed by its own writer, is one fleet event; the same
    code on a fourth node two hours later and another code on one node are not part of it."""
    import json

    from slurm_gpu.gpu.xid import parse_line
    from slurm_gpu.store import observations as obs
    site.init(writers="n[1-4]")
    now = time.time()
    lines = {"n1": [(now - 7200, 119)], "n2": [(now - 7100, 119), (now - 7050, 79)], "n3": [(now - 6800, 119)],
             "n4": [(now - 60, 119)]}
    for node, events in lines.items():
        d = site.tmp / node
        store = Store(str(d / "usage.db"), str(d / "spool"))
        text = [f"{t:.6f} {node} kernel: NVRM: Xid (PCI:0000:18:00): {code}, pid=1, Timeout waiting for RPC from GSP!"
                for t, code in events]
        assert store.record_xids(obs.xid_rows([parse_line(s) for s in text], None, node)) == len(events)
        store.close()
        cfg = site.node_writer_config(node, d)
        r = cli_env({"SLURMD_NODENAME": node}, "--config", str(cfg), "db", "push")
        assert r.returncode == 0 and f"xid_events {len(events)}" in r.stdout, r.stdout + r.stderr
    report = [*("--db", site.server.url(site.reporter, site.db)),
              *("--password-file", str(site.password_file(site.reporter, site.reporter_pw))), "-M", "c"]
    r = cli("--config", str(site.config), "fleet", "xids", *report, "--by", "storm", "--format", "json")
    assert r.returncode == 0, r.stderr
    storms = json.loads(r.stdout)
    assert [(s["xid"], s["nodes"], s["node_list"], s["events"]) for s in storms] == [(119, 3, "n[1-3]", 3)], storms
    assert "driver or firmware rollout" in storms[0]["cause"]
    r = cli("--config", str(site.config), "fleet", "xids", *report, "--format", "json")
    assert len(json.loads(r.stdout)) == 5  # every GPU's row is still there
    assert "note: XID 119 on 3 nodes (n[1-3]) within 10 min from" in r.stderr and "one fleet event" in r.stderr
    r = cli("--config", str(site.config), "fleet", "xids", *report, "--by", "storm", "--storm-nodes", "4",
            "--storm-window", "7200", "--format", "json")  # two hours hold the fourth node's too
    assert [(s["xid"], s["node_list"]) for s in json.loads(r.stdout)] == [(119, "n[1-4]")], r.stdout + r.stderr
    r = cli("--config", str(site.config), "fleet", "xids", *report, "--by", "storm", "--storm-nodes", "5")
    assert r.returncode == 0 and "no storm in the window: no XID on 5 or more nodes within 600 s" in r.stderr, r.stderr


def test_a_v12_server_gains_the_push_clock_and_each_push_sets_its_nodes_row(site):
    """Schema v13 (docs/central.md, Topologies): `push_clock` holds the server's time of each node's
    newest applied batch (what a replica's report reads); a v12 server is migrated in place."""
    site.init(writers="n[1-2]")
    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 10)
    try:  # back to what v12 made
        admin.execute("DROP TABLE push_clock")
        admin.execute(C.MIGRATIONS[11][-1])  # v12's apply_batch
        admin.execute("UPDATE meta SET value = '12' WHERE name = 'schema_version'")
        admin.commit()
    finally:
        admin.close()
    site.store.write(job_end(1))
    assert site.push().returncode == 5  # a v13 node does not push to a v12 server
    r = site.init(writers="n[1-2]")
    assert r.returncode == 0 and f"schema migrated from 12 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    assert site.rows("SELECT COUNT(*) FROM push_clock") == [["0"]]
    before = time.time()
    r = site.push()
    assert r.returncode == 0 and "job_gpus 2" in r.stdout, r.stdout + r.stderr
    ((cluster, node, pushed_at),) = site.rows("SELECT cluster, node, pushed_at FROM push_clock")
    assert (cluster, node) == ("c", "n1") and before - 5 < float(pushed_at) < time.time() + 5
    # Another node's push adds its own row (never the same row: pushes of two nodes do not wait on each other).
    account, password = site.writer_of("n2")
    cfg = site.write_config(account, password, name="n2.toml")
    site.store.write(job_end(2, node="n2"))
    r = cli_env({"SLURMD_NODENAME": "n2"}, "--config", str(cfg), "db", "push")
    assert r.returncode == 0, r.stdout + r.stderr
    assert site.rows("SELECT node FROM push_clock ORDER BY node") == [["n1"], ["n2"]]


def _stage_a_jobs_row(central: C.Central, batch: str, job_id: int, node: str) -> None:
    """What a push sends for one jobs row of an existing job (a newer version of it): its staged row, then apply_batch."""
    row = dict(zip(CS.COLUMNS["jobs"], ("c", job_id, 0, node, "u", 1, "a", "p", 2, 1.0, 11.0, "7", 0, None)))
    central.executemany(CS.stage_sql("jobs"), [(batch, *(row.get(c, 99) for c in CS.staged_columns("jobs")),
                                                time.time(), 0)])
    central.execute("CALL apply_batch(%s)", (batch,))


def test_a_v13_server_gains_staging_fences_and_a_push_no_longer_waits_on_another_in_flight(site):
    """Schema v14: a batch's statements lock the gaps around its staged rows until the commit, and in
    staging tables holding only the batches in flight those gaps were the whole table: every other
    push's staged INSERT waited for that commit (bench_central_load.py, 1,000 nodes at the same
    second).  Fences keep each batch's gaps to its 1/4,096 of the batch ids; a v13 server gains them."""
    site.init(writers="n[1-2]")
    site.store.write(job_end(1))
    assert site.push().returncode == 0
    account, password = site.writer_of("n2")
    n2_cfg = site.write_config(account, password, name="n2.toml")
    site.store.write(job_end(2, node="n2"))
    assert cli_env({"SLURMD_NODENAME": "n2"}, "--config", str(n2_cfg), "db", "push").returncode == 0

    def second_push_waits() -> bool:
        n1_account, n1_password = site.writer_of("n1")
        first = C.Central(C.parse_url(site.server.url(n1_account, site.db)), n1_password, 10)
        second = C.Central(C.parse_url(site.server.url(account, site.db)), password, 10)
        try:
            _stage_a_jobs_row(first, "a" * 32, 1, "n1")  # in flight: applied, not committed
            second.execute("SET SESSION innodb_lock_wait_timeout = 1")
            try:
                _stage_a_jobs_row(second, "b" * 32, 2, "n2")
                second.commit()
            except CentralError as e:
                assert getattr(e, "driver_code", None) == 1205, e.message
                return True
            first.commit()
            return False
        finally:
            first.close()
            second.close()

    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 10)
    try:  # back to what v13 made
        for t in CS.RECORD_TABLES:
            admin.execute(f"TRUNCATE TABLE stage_{t}")  # (deleted fences would bound the gaps until purged)
        admin.execute("UPDATE meta SET value = '13' WHERE name = 'schema_version'")
        admin.commit()
    finally:
        admin.close()
    assert second_push_waits()
    r = site.init(writers="n[1-2]")
    assert r.returncode == 0 and f"schema migrated from 13 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    for t in CS.RECORD_TABLES:
        assert site.rows(f"SELECT COUNT(*) FROM stage_{t}") == [[str(CS.STAGE_FENCES)]], t
        assert site.rows(CS.staged_rows_sql(t)) == [["0"]], t
    assert not second_push_waits()
    assert site.rows("SELECT job_id, exit_code FROM jobs ORDER BY job_id") == [["1", "7"], ["2", "7"]]
    site.store.write(job_end(3))
    r = site.push()
    assert r.returncode == 0 and "job_gpus 2" in r.stdout, r.stdout + r.stderr
