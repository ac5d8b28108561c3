"""Issue 26, the remediation history across the cluster: when each remedied fault was drained, the
rows shipped by `db push`, `slurm-gpu fleet remediation`, and a GPU's lemon budget following its
serial from node to node through the central server."""
from __future__ import annotations

import sqlite3

import simgpu
from test_remediation import PROLOG_REASON, MemSlurm, _node, _run

from slurm_gpu.gpu.xid import XidEvent
from slurm_gpu.store import record
from slurm_gpu.store.node import Store


def _drain_times(node):
    conn = sqlite3.connect(str(node.db))
    try:
        return [r[0] for r in conn.execute("SELECT drain_time FROM remediations ORDER BY id")]
    finally:
        conn.close()


class TimedSlurm(MemSlurm):
    """A backend that has Slurm's ReasonTime: a new reason gets the time it was set."""

    def __init__(self, reason_time, **kw):
        super().__init__(**kw)
        self.reason_time, self.clock = reason_time, reason_time

    def node(self, name):
        return super().node(name)._replace(reason_time=self.reason_time)

    def drain(self, name, reason):
        super().drain(name, reason)
        self.clock += 100.0
        self.reason_time = self.clock  # scontrol update sets ReasonTime anew


# ------------------------------------------------------------------ 1. drain_time

def test_remediation_rows_carry_slurms_reason_time_of_the_drain_they_remedy_not_remediates_own_redrain(
        sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1, reset_sticky=1)  # reset fails: reset row, then reboot row
    backend = TimedSlurm(1_700_000_000.0, reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"
    assert _drain_times(node) == [1_700_000_000.0, 1_700_000_000.0]


def test_without_slurms_reason_time_the_drain_time_is_the_node_databases_drain_record(sim_node, tmp_path):
    node = _node(sim_node, tmp_path)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    store = Store(str(node.db), str(tmp_path / "spool"))
    store.write(record.Drains([record.drain("gpu01", "healthcheck", "slurm-gpu: other fault [healthcheck]",
                                            record.DRAINED, 1_600_000_000.0),
                               record.drain("gpu01", "prolog", PROLOG_REASON, record.DRAINED, 1_650_000_000.0,
                                            job_id=4711)]))
    store.close()
    backend = MemSlurm(reason=PROLOG_REASON)  # reason_time None, as a backend without it gives
    assert backend.node("gpu01").reason_time is None
    assert _run(node, backend).outcome == "resumed"
    assert _drain_times(node) == [1_650_000_000.0]


def test_a_run_after_remediates_own_redrain_keeps_the_first_drains_time(sim_node, tmp_path):
    """After a reboot the reason is remediate's own ([remediate: reboot] : reboot complete): its
    ReasonTime is the reboot's, the drain being remedied is the one the attempt rows remember."""
    node = _node(sim_node, tmp_path, "max_resets_per_gpu_per_day = 0\n")
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    backend = TimedSlurm(1_700_000_000.0, reason=PROLOG_REASON)
    assert _run(node, backend).outcome == "requested"  # refused reset row + reboot row
    backend.boot()
    backend.reason_time = 1_700_009_999.0
    out = _run(node, backend)  # the fault survived the boot: RMA row
    assert out.outcome == "rma"
    assert set(_drain_times(node)) == {1_700_000_000.0}


# ------------------------------------------------------------------ 2. shipped by `db push`

def _attempt(store, node="n1", serial="1654922000001", outcome="started", t=1000.0, action="reset", drain=990.0):
    return store.record_remediation({"time": t, "node": node, "gpu_index": 1, "gpu_uuid": "GPU-1", "serial": serial,
                                     "fault_check": "pending_reset", "fault": "GPU 1 pending row remap",
                                     "action": action, "outcome": outcome, "detail": "", "drain_time": drain})


def _unshipped(store):
    return store.connect().execute("SELECT id, outcome FROM remediations WHERE pushed_version < push_version "
                                   "ORDER BY id").fetchall()


def test_a_remediation_row_whose_outcome_comes_after_it_was_shipped_is_in_the_outbox_again(tmp_path):
    store = Store(str(tmp_path / "u.db"), str(tmp_path / "spool"))
    i = _attempt(store)
    assert _unshipped(store) == [(i, "started")]
    store.connect().execute("UPDATE remediations SET pushed_version = push_version")  # what a push marks
    assert _unshipped(store) == []
    store.finish_remediation(i, "resumed", "verified", 1100.0)
    assert _unshipped(store) == [(i, "resumed")]


def test_a_v7_node_database_migrates_to_v8_and_its_remediation_rows_wait_to_be_shipped(tmp_path):
    from slurm_gpu.store.schema import MIGRATIONS
    path = tmp_path / "u.db"
    c = sqlite3.connect(path, isolation_level=None)
    for stmts in MIGRATIONS[:7]:
        for stmt in stmts:
            c.execute(stmt)
    c.execute("PRAGMA user_version = 7")
    c.execute("INSERT INTO remediations (time, node, action, outcome) VALUES (1.0, 'n1', 'reset', 'resumed')")
    c.close()
    store = Store(str(path), str(tmp_path / "spool"))
    assert store.connect().execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert _unshipped(store) == [(1, "resumed")]


# ------------------------------------------------------------------ central server (a real MariaDB)

import pytest  # noqa: E402
from test_central import Site, _forge, assert_forgeries_refused, cli  # noqa: E402

from slurm_gpu.central import server as C  # noqa: E402

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

REM_COLS = "node, id, serial, action, outcome, drain_time"


@pytest.fixture(scope="module")
def server(mariadb_server):
    """The session's MariaDB (tests/conftest.py); every test takes a database of its own there."""
    return mariadb_server


@pytest.fixture
def site(server, tmp_path):
    return Site(server, tmp_path)


@pytest.mark.central
def test_push_ships_remediation_rows_and_ships_a_row_again_when_its_outcome_is_written(site):
    site.init()
    i = _attempt(site.store)
    r = site.push()
    assert r.returncode == 0 and "remediations 1" in r.stdout, r.stdout + r.stderr
    assert site.rows(f"SELECT {REM_COLS} FROM remediations") == [["n1", str(i), "1654922000001", "reset", "started", "990"]]
    site.store.finish_remediation(i, "resumed", "verified", 1100.0)
    r = site.push()
    assert r.returncode == 0 and "remediations 1" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT outcome, detail, finished, row_version FROM remediations") == [
        ["resumed", "verified", "1100", "2"]]
    assert "shipped nothing" in site.push().stdout


@pytest.mark.central
def test_an_older_version_of_a_remediation_row_never_replaces_the_servers_newer_one(site):
    """A node database restored from a backup taken before the attempt's outcome ships the intent again."""
    site.init()
    i = _attempt(site.store)
    site.store.finish_remediation(i, "resumed", "verified", 1100.0)
    assert site.push().returncode == 0
    site.store.connect().execute("UPDATE remediations SET outcome = 'started', push_version = 1, pushed_version = 0")
    assert site.push().returncode == 0
    assert site.rows("SELECT outcome, row_version FROM remediations") == [["resumed", "2"]]


@pytest.mark.central
def test_a_reimaged_nodes_new_database_ships_its_attempts_beside_the_old_ones_with_the_same_row_ids(site):
    """Reimaging a node wipes its database: its row ids start at 1 again.  The server keeps the old
    attempts and takes the new ones (an attempt is its node, row id and time), and neither replaces
    the other whatever their versions."""
    site.init()
    old = _attempt(site.store, t=1000.0)
    site.store.finish_remediation(old, "resumed", "verified", 1100.0)  # row version 2 on the server
    assert site.push().returncode == 0
    site.store.close()
    for p in site.tmp.glob("usage.db*"):
        p.unlink()
    fresh = Store(str(site.node_db), str(site.tmp / "spool"))
    new = _attempt(fresh, t=5000.0, drain=4990.0)
    assert new == old
    fresh.close()
    r = site.push()
    assert r.returncode == 0 and "remediations 1" in r.stdout, r.stdout + r.stderr
    assert site.rows(f"SELECT {REM_COLS}, outcome FROM remediations ORDER BY time") == [
        ["n1", str(old), "1654922000001", "reset", "resumed", "990", "resumed"],
        ["n1", str(new), "1654922000001", "reset", "started", "4990", "started"]]


def _forged_attempt(cluster, node, row_id=1):
    return (cluster, node, row_id, 1.0, 0, "GPU-0", "SERIAL-X", "pending_reset", "forged", "reset", "resumed", "",
            0.5, 2.0, 99, 1.0, 0)


@pytest.mark.central
def test_a_forged_remediation_batch_for_another_node_is_refused_and_changes_nothing(site):
    """A node's writer must not give another node's GPU a history (a lemon: RMA) or erase one."""
    site.init(writers="n1,n2")
    _attempt(site.store, node="n1")
    assert site.push().returncode == 0
    n2_user, n2_pw = assert_forgeries_refused(site, "remediations", _forged_attempt,
                                              f"SELECT {REM_COLS} FROM remediations ORDER BY node, id")
    _forge(site, n2_user, n2_pw, {"remediations": [_forged_attempt("c", "n2", 5)]})  # its own node's row applies
    assert site.rows("SELECT node, id, fault FROM remediations WHERE node = 'n2'") == [["n2", "5", "forged"]]


@pytest.mark.central
def test_central_init_migrates_a_v6_server_in_place_and_its_writers_then_ship_remediations(site):
    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 30)
    try:
        for stmts in C.MIGRATIONS[:6]:  # what slurm-gpu with central schema v6 created
            for stmt in stmts:
                stmt(admin) if callable(stmt) else admin.execute(stmt)
        admin.execute("INSERT INTO meta (name, value) VALUES ('schema_version', '6')")
        admin.commit()
    finally:
        admin.close()
    assert site.rows("SHOW TABLES LIKE 'remediations'") == []
    r = cli("--config", str(site.config), "central", "init", "--check")
    assert r.returncode == 1 and f"schema version 6, this slurm-gpu needs {C.SCHEMA_VERSION}" in r.stdout, r.stdout
    r = site.init()
    assert f"schema migrated from 6 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    assert site.rows("SHOW INDEX FROM remediations WHERE Key_name = 'remediations_serial'") != []
    _attempt(site.store)
    r = site.push()
    assert r.returncode == 0 and "remediations 1" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------ 3. fleet remediation

SERIAL = "1654922000001"


def _moved_gpu_history(a, b):
    """A GPU reset twice (verified) on n1, moved to n2, faulted again there: RMA as a lemon; and a GPU on n2
    whose reset escalated to a reboot still pending."""
    for t in (1000.0, 5000.0):
        i = _attempt(a, node="n1", t=t, drain=t - 60.0)
        a.finish_remediation(i, "resumed", "verified", t + 30.0)  # 90 s drain to resume
    b.record_remediation({"time": 9000.0, "node": "n2", "gpu_index": 3, "gpu_uuid": "GPU-9", "serial": SERIAL,
                          "fault_check": "ecc_uncorrectable", "fault": "GPU 3 uncorrectable ECC", "action": "rma",
                          "outcome": "rma", "detail": "lemon: faulted again after 2 remedies in 30 days",
                          "drain_time": 8990.0})
    i = _attempt(b, node="n2", serial="777", t=9500.0, drain=9400.0)
    b.finish_remediation(i, "escalated", "reset failed", 9510.0)
    _attempt(b, node="n2", serial="777", t=9511.0, action="reboot", outcome="requested", drain=9400.0)


def _fleet(tmp_path, *args):
    from click.testing import CliRunner

    from slurm_gpu.cli import main
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(f'[store]\ndatabase = "{tmp_path}/none.db"\n[remediation]\nlemon_remedies = 2\n')
    return CliRunner().invoke(main, ["--config", str(cfg), "fleet", "remediation", *args])


def test_fleet_remediation_follows_a_gpu_serial_across_two_node_databases(tmp_path):
    import json
    a, b = (Store(str(tmp_path / f"{n}.db"), str(tmp_path / f"spool-{n}")) for n in ("n1", "n2"))
    _moved_gpu_history(a, b)
    a.close()
    b.close()
    r = _fleet(tmp_path, "--node-db", str(tmp_path / "n1.db"), "--node-db", str(tmp_path / "n2.db"), "--json")
    assert r.exit_code == 1, r.output + r.stderr  # a lemon / RMA
    rows = {x["serial"]: x for x in json.loads(r.stdout)}
    gpu = rows[SERIAL]
    assert (gpu["nodes"], gpu["node"], gpu["resets"], gpu["rma"], gpu["state"], gpu["lemon"]) == (
        "n[1-2]", "n2", 2, 1, "RMA", "yes")
    assert gpu["faults"] == "ecc_uncorrectable,pending_reset" and gpu["outcomes"] == "resumed 2, rma 1"
    assert (rows["777"]["state"], rows["777"]["lemon"], rows["777"]["reboots"]) == ("reboot pending", "no", 1)
    assert f"lemons (next fault: RMA): {SERIAL}" in r.stderr
    r = _fleet(tmp_path, "--node-db", str(tmp_path), "--by", "fault", "--format", "csv")  # a directory of *.db
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("fault_check,attempts,resumed,escalated,failed,rma,resumes_timed,mean_drain")
    fault = {ln.split(",")[0]: ln.split(",") for ln in lines[1:]}
    assert fault["pending_reset"][1:] == ["4", "2", "1", "0", "0", "2", "90.0", "90.0"]
    r = _fleet(tmp_path, "--node-db", str(tmp_path))
    assert r.stdout.splitlines()[0].split()[:3] == ["serial", "nodes", "gpu"], r.stdout


def test_fleet_remediation_counts_the_xid_bursts_of_a_gpus_current_node_as_remediate_does(tmp_path):
    """Serial 777 (GPU-1 on n2) had three bursts of XID 79 on n2: a lemon, as `remediate` there would
    judge it; the same bursts recorded on n1 (where it is not now) or of XID 119 (a driver's) are not."""
    import json
    import time as _time

    from slurm_gpu.store import observations as obs
    a, b = (Store(str(tmp_path / f"{n}.db"), str(tmp_path / f"spool-{n}")) for n in ("n1", "n2"))
    _moved_gpu_history(a, b)
    now, day = _time.time(), 86400.0

    def bursts(store, node, code):
        rows = obs.xid_rows([XidEvent(now - k * day, (0, 0x18, 0), code, f"burst {k}", None, 1, now - k * day, ())
                             for k in (1, 2, 3)], None, node)
        assert store.record_xids([dict(r, gpu_uuid="GPU-1", gpu_index=1) for r in rows]) == 3
    bursts(a, "n1", 79)
    bursts(b, "n2", 119)
    a.close()
    b.close()
    r = _fleet(tmp_path, "--node-db", str(tmp_path), "--json")
    assert {x["serial"]: x for x in json.loads(r.stdout)}["777"]["lemon"] == "no", r.stdout
    b = Store(str(tmp_path / "n2.db"), str(tmp_path / "spool-n2"))
    bursts(b, "n2", 79)
    b.close()
    r = _fleet(tmp_path, "--node-db", str(tmp_path), "--json")
    gpu = {x["serial"]: x for x in json.loads(r.stdout)}["777"]
    assert gpu["lemon"] == "yes" and "3 bursts of hardware XIDs (79)" in gpu["lemon_why"], gpu


def test_fleet_remediation_without_a_source_says_what_to_give(tmp_path):
    r = _fleet(tmp_path)
    assert r.exit_code != 0 and "slurm-gpu: error: no central server and no node database" in r.stderr, r.stderr
    assert "hint: " in r.stderr and "--node-db" in r.stderr


def _push_nodes(site):
    """n1's and n2's node databases pushed by their own writers; the reporter's --db arguments."""
    site.init(writers="n1,n2")
    n2 = Store(str(site.tmp / "n2.db"), str(site.tmp / "spool-n2"))
    _moved_gpu_history(site.store, n2)
    n2.close()
    site.store.close()
    for node, db in (("n1", site.node_db), ("n2", site.tmp / "n2.db")):
        user, pw = site.writer_of(node)
        r = site.push("--db", str(db), config=site.write_config(user, pw, name=f"{node}.toml"))
        assert r.returncode == 0 and "remediations" in r.stdout, r.stdout + r.stderr
    return ["--db", site.server.url(site.reporter, site.db),
            "--password-file", str(site.password_file(site.reporter, site.reporter_pw))]


@pytest.mark.central
def test_fleet_remediation_from_the_central_server_keeps_a_moved_gpus_history(site):
    import json
    reader = _push_nodes(site)
    r = cli("--config", str(site.config), "fleet", "remediation", *reader, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    gpu = {x["serial"]: x for x in json.loads(r.stdout)}[SERIAL]
    assert (gpu["nodes"], gpu["resets"], gpu["state"], gpu["lemon"]) == ("n[1-2]", 2, "RMA", "yes")
    r = cli("--config", str(site.config), "fleet", "remediation", *reader, "--by", "fault", "--json")
    fault = {x["fault_check"]: x for x in json.loads(r.stdout)}["pending_reset"]
    assert (fault["resumes_timed"], fault["mean_drain_to_resume_s"], fault["median_drain_to_resume_s"]) == (2, 90.0, 90.0)


# ------------------------------------------------------------------ 4. a GPU's lemon history follows its serial

class Log:
    def __init__(self):
        self.lines = []

    def info(self, event, **kw):
        self.lines.append(("info", event, kw))

    def warning(self, event, **kw):
        self.lines.append(("warning", event, kw))


def _node_b(sim_node, tmp_path, central=""):
    """Node B (gpu01 in the simulated cluster): a pending-remap GPU 1, lemon_remedies 2."""
    node = _node(sim_node, tmp_path, "lemon_remedies = 2\nmax_resets_per_gpu_per_day = 5\n" + central)
    simgpu.set_gpu(node.state, 1, remapped_pending=1)
    return node, simgpu.read_state(node.state)["gpu.1.serial"]


def _two_verified_resets_on_node_a(store, serial):
    import time as _t
    for t in (1000.0, 5000.0):
        now = _t.time() - 86400.0 + t  # yesterday and today: within the lemon window (30 days)
        i = _attempt(store, node="n1", serial=serial, t=now, drain=now - 60.0)
        store.finish_remediation(i, "resumed", "verified", now + 30.0)


@pytest.mark.central
def test_a_gpu_with_two_verified_resets_on_node_a_that_faults_on_node_b_goes_to_rma_there(site, sim_node, tmp_path):
    site.init(writers="n1,gpu01")
    (tmp_path / "b").mkdir()
    node, serial = _node_b(sim_node, tmp_path / "b", "[central]\nurl = \"PLACEHOLDER\"\n")
    _two_verified_resets_on_node_a(site.store, serial)
    r = site.push()
    assert r.returncode == 0 and "remediations 2" in r.stdout, r.stdout + r.stderr
    user, pw = site.writer_of("gpu01")
    text = node.config.read_text().replace('url = "PLACEHOLDER"', f'url = "{site.server.url(user, site.db)}"\n'
                                           f'password_file = "{site.password_file(user, pw)}"\ntimeout_s = 5')
    node.config.write_text(text)
    backend = MemSlurm(reason=PROLOG_REASON)
    out = _run(node, backend)
    assert out.outcome == "rma" and "lemon" in backend.reason, out
    assert backend.reason.startswith(f"slurm-gpu: RMA: GPU {serial} ")
    assert "gpu.1.resets" not in simgpu.read_state(node.state)  # no third reset of a lemon


def test_without_the_central_server_node_b_counts_only_its_own_rows_and_resets(sim_node, tmp_path):
    """The same GPU, but no central.url: node B knows nothing of node A's resets."""
    node, serial = _node_b(sim_node, tmp_path)
    out = _run(node, MemSlurm(reason=PROLOG_REASON))
    assert (out.action, out.outcome) == ("reset", "resumed"), out


def test_a_central_server_that_is_down_leaves_node_bs_rows_logs_one_line_and_remediates(sim_node, tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    pw = tmp_path / "central.password"
    pw.write_text("secret-pw\n")
    pw.chmod(0o600)
    node, serial = _node_b(sim_node, tmp_path, f'[central]\nurl = "mysql://w@127.0.0.1:{port}/sg"\n'
                                               f'password_file = "{pw}"\ntimeout_s = 2\n')
    log = Log()
    out = _run(node, MemSlurm(reason=PROLOG_REASON), log=log)
    assert (out.action, out.outcome) == ("reset", "resumed"), out
    warned = [ln for ln in log.lines if ln[0] == "warning"]
    assert [w[1] for w in warned] == ["remediate-central-unavailable"], log.lines
    assert "unreachable" in warned[0][2]["error"] and "secret-pw" not in str(log.lines)


def test_central_rows_merge_with_the_nodes_own_once_per_node_and_id():
    from slurm_gpu.remediation.context import SerialHistory

    class Rows:
        def remediations(self, serial):
            return [{"node": "n2", "id": 1, "time": 30.0, "outcome": "started"}]

    fetched = []

    def fetch(serial):
        fetched.append(serial)
        return [{"node": "n1", "id": 1, "time": 10.0}, {"node": "n2", "id": 1, "time": 30.0, "outcome": "resumed"}]

    h = SerialHistory(Rows(), fetch, lambda *a, **k: None)
    assert [(r["node"], r["id"], r.get("outcome")) for r in h.rows("S")] == [("n1", 1, None), ("n2", 1, "started")]
    h.rows("S")
    assert fetched == ["S"]  # asked once per serial and run
