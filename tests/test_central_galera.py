"""The central server as a Galera cluster and as a primary with a replica (issue 40, docs/central.md
"Topologies"), on real servers: three Debian galera-4 nodes on 127.0.0.1 (tests/mariadb.py
`GaleraCluster`, one for the module) and a primary/replica pair replicating by GTID (`ReplicaPair`).

- Nodes push to different Galera nodes at once, through their own writer accounts, the same jobs'
  rollup cells: certification failures (error 1213 at COMMIT) are sent again by the push itself,
  and every Galera node then reports the same figures as the node files.
- One Galera node is killed (SIGKILL) while a push runs against it and brought back (IST): after
  the failed push runs again, no record is lost or doubled and the rollups are a rebuild's.
- A Galera node cut off from the others (not synced) answers 1047: one line, nothing lost.
- A report from the read-only replica equals the primary's once it caught up, and says how old
  its newest push is (schema v13's push_clock), also while its SQL thread is stopped.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import mariadb as testdb
import pytest
from test_central import Site, cli, cli_env, job_end

from slurm_gpu.store.node import Store

pytestmark = [pytest.mark.central, pytest.mark.once_on("sid")]

T0 = 1_789_948_800.0  # 2026-09-21 00:00 UTC
WINDOW = ("--since", f"@{T0 - 86400:.0f}", "--until", f"@{T0 + 3 * 86400:.0f}")
UTC = {"TZ": "UTC"}


@pytest.fixture(scope="module")
def galera():
    for cluster in testdb.running_galera():
        print(f"Galera cluster of {len(cluster.nodes)} nodes started in {cluster.startup_s:.1f} s")
        yield cluster


@pytest.fixture(scope="module")
def pair():
    yield from testdb.running_replica()


def _job(j: int, node: str, gpus: int = 4):
    """Job j on `node` (every node has the same job ids: a job on several nodes, sharing its
    rollup cells), 30 min within two days of T0."""
    rec = job_end(j, node=node, gpus=gpus, user=("alice", "bob", "carol")[j % 3], account=("phys", "chem")[j % 2])
    start = T0 + 3600.0 * (j % 40)
    end = start + 1800.0 + j
    rec["job"].update(start_time=start, end_time=end)
    for g in rec["gpus"]:
        g.update(start_time=start, end_time=end, duration_s=end - start, energy_j=float(j + g["gpu_index"]))
    return rec


def _config(path: Path, url: str, password_file: Path, node_db: Path, timeout_s: float = 30.0) -> Path:
    path.write_text(f'cluster_name = "c"\nslurm_conf = "{path.parent}/none.conf"\n'
                    f'[store]\ndatabase = "{node_db}"\nspool_dir = "{node_db.parent}/spool"\n'
                    f'[central]\nurl = "{url}"\npassword_file = "{password_file}"\ntimeout_s = {timeout_s}\n')
    os.chmod(path, 0o644)
    return path


class Node:
    """A compute node's database with `jobs`, pushing through its own writer account to `server`."""

    def __init__(self, site: Site, tmp: Path, name: str, server, jobs, timeout_s: float = 8.0):
        self.name = name
        d = tmp / name
        d.mkdir()
        self.db = d / "usage.db"
        store = Store(str(self.db), str(d / "spool"))
        for j in jobs:
            store.write(_job(j, name))
        store.close()
        account, password = site.writer_of(name)
        self.config = _config(d / "writer.toml", server.url(account, site.db), site.password_file(account, password),
                              self.db, timeout_s)
        self.result = None

    def push(self, batch_size: int = 10):
        self.result = cli_env({"SLURMD_NODENAME": self.name}, "--config", str(self.config), "db", "push",
                              "--batch-size", str(batch_size))
        return self.result


def push_at_once(nodes, batch_size: int = 10):
    threads = [threading.Thread(target=n.push, args=(batch_size,)) for n in nodes]
    for t in threads:
        t.start()
    return threads


def resent(results) -> int:
    return sum(int(n) for r in results for n in re.findall(r"(\d+) batch\(es\) sent again", r.stdout + r.stderr))


def synced(galera, timeout_s: float = 30.0) -> None:
    """Until every running Galera node has committed the same last write set (a node applies the
    others' write sets after they were certified: a read there right after a commit may miss them)."""
    deadline = time.monotonic() + timeout_s
    seen = set()
    while time.monotonic() < deadline:
        seen = {n.status("wsrep_last_committed") for n in galera.nodes if n.running()}
        if len(seen) == 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"Galera nodes did not converge: {seen}")


def wedged(r) -> bool:
    """The push failed on a Galera node that MariaDB wedged or crashed (see `revive`): at its deadline,
    behind the wedged transaction's locks, or on the lost connection; the records stay for the next."""
    return r.returncode == 5 and "nothing was lost" in r.stderr


def revive(galera) -> list:
    """Restart the Galera nodes that MariaDB 10.11 wedged or crashed under pushes through several
    nodes at once (docs/central.md, Topologies).  Wedged: a write set of another node waits there for
    a gap lock of the staging tables that a local push's COMMIT holds, and that COMMIT waits for
    certification behind it; neither moves, KILL does not end it, the node stays stuck until it
    restarts (about 1 of 10 runs of four nodes pushing the same cells through three Galera nodes at
    schema v13, 1 of 21 with v14's staging fences, 2 of 3 under a load of 10 on two cores).  Crashed:
    mariadbd's segfault (seen once in ~30 runs).  Returns the restarted nodes' indexes."""
    stuck = [i for i, node in enumerate(galera.nodes) if not node.running()]
    for report in galera.crashed():
        print(f"Galera {report}")
    for i, node in enumerate(galera.nodes):
        if i not in stuck:
            rows = [line.split("\t") for line in node.sql("SHOW FULL PROCESSLIST").splitlines()]
            if any(len(f) > 6 and f[6] == "Waiting for certification" and int(f[5]) >= 2 for f in rows):
                stuck.append(i)
    for i in stuck:
        galera.kill(i)
        galera.restart(i)
    return stuck


def ship_the_rest(galera, nodes) -> list:
    """Each push that failed runs again (the timer's next run), after restarting wedged or crashed nodes."""
    restarted = revive(galera) if any(wedged(n.result) for n in nodes) else []
    for n in nodes:
        if n.result.returncode != 0:
            assert n.push().returncode == 0, n.result.stdout + n.result.stderr
    return restarted


def reporter_config(site: Site, server, name: str) -> Path:
    return _config(site.tmp / name, server.url(site.reporter, site.db),
                   site.password_file(site.reporter, site.reporter_pw), site.node_db)


def report(cfg: Path, *args: str):
    return cli_env(UTC, "--config", str(cfg), "report", *args, "--db", "central", *WINDOW, "--format", "csv")


def totals(server, db: str):
    return server.rows("SELECT COUNT(*), COUNT(DISTINCT job_id, node, gpu_uuid), SUM(energy_j) FROM job_gpus; "
                       "SELECT COUNT(*) FROM jobs", db)


def expected(nodes, jobs):
    n = len(nodes) * len(jobs) * 4
    energy = len(nodes) * sum(4 * j + 6 for j in jobs)  # GPUs 0-3 of job j: j, j+1, j+2, j+3
    return [[str(n), str(n), str(energy)], [str(len(nodes) * len(jobs))]]


def rebuild_is_exact(site: Site) -> None:
    r = cli("--config", str(site.config), "central", "rollup", "--rebuild")
    assert r.returncode == 0 and "rollups exact" in r.stderr, r.stdout + r.stderr


# --------------------------------------------------------------------------- Galera


def test_pushes_to_three_galera_nodes_at_once_count_every_record_once_and_every_node_reports_alike(galera, tmp_path):
    site = Site(galera.nodes[0], tmp_path)
    site.init(writers="n[1-4]")
    synced(galera)  # the accounts and GRANTs, made on node 1, reach the others a moment later
    jobs = range(1, 61)
    nodes = [Node(site, tmp_path, f"n{i}", galera.nodes[(i - 1) % 3], jobs) for i in range(1, 5)]
    for t in push_at_once(nodes):
        t.join()
    results = [n.result for n in nodes]
    assert all(r.returncode == 0 or wedged(r) for r in results), [r.stdout + r.stderr for r in results]
    restarted = ship_the_rest(galera, nodes)
    print(f"{resent(results)} batch(es) of 4 x 24 sent again after certification failures; "
          f"wedged and restarted: {restarted}")
    # the same jobs' cells through three nodes at once: some commits lost certification, and were sent again
    assert resent(results) > 0, [r.stdout for r in results]
    synced(galera)
    for server in galera.nodes:
        assert totals(server, site.db) == expected(nodes, jobs)
    files = [a for n in nodes for a in ("--db", str(n.db))]
    for args in (("--by", "user,day"), ("--by", "node"), ("jobs",)):
        want = cli_env(UTC, "--config", str(site.config), "report", *args, *files, *WINDOW, "--format", "csv")
        assert want.returncode == 0 and want.stdout.count("\n") > 2, want.stderr
        for i, server in enumerate(galera.nodes):
            got = report(reporter_config(site, server, f"rep{i}.toml"), *args)
            assert got.returncode == 0, got.stderr
            assert got.stdout == want.stdout, (i, args)
            assert "replica" not in got.stderr
    rebuild_is_exact(site)


def test_a_galera_node_killed_mid_push_loses_and_doubles_nothing_once_the_push_runs_again(galera, tmp_path):
    site = Site(galera.nodes[0], tmp_path)
    site.init(writers="n[1-3]")
    synced(galera)  # the accounts and GRANTs, made on node 1, reach the others a moment later
    jobs = range(1, 101)
    # n1 pushes to Galera node 2, the one that dies; n2 and n3 to node 1, which lives on (one writer
    # node besides the victim: fewer chances of the wedge `revive` undoes).
    victim = galera.nodes[1]
    nodes = [Node(site, tmp_path, "n1", victim, jobs), Node(site, tmp_path, "n2", galera.nodes[0], jobs, 30.0),
             Node(site, tmp_path, "n3", galera.nodes[0], jobs, 30.0)]
    threads = push_at_once(nodes, batch_size=5)
    deadline = time.monotonic() + 60
    # Ten of n1's 80 batches in: kill its Galera node (unless MariaDB crashed it first: the same case).
    while victim.running() and int(victim.rows("SELECT COUNT(*) FROM job_gpus WHERE node = 'n1'", site.db)[0][0]) < 40:
        assert threads[0].is_alive(), (f"n1's push ended before its Galera node was killed: {nodes[0].result}; "
                                       f"node 2's log: {victim._log_tail()}")
        assert time.monotonic() < deadline, "n1's push shipped nothing"
        time.sleep(0.02)
    if victim.running():
        galera.kill(1)
    else:
        print("\n".join(galera.crashed()))
    killed = time.monotonic()
    for t in threads:
        t.join()
    waited = time.monotonic() - killed
    first = [n.result for n in nodes]
    # The push whose server died: one line, exit 5, its records still in the node database.
    assert first[0].returncode == 5 and "unreachable or not answering" in first[0].stderr, first[0].stdout + first[0].stderr
    print(f"killed mid-push: n1 exit {first[0].returncode}; n2, n3 exit {[r.returncode for r in first[1:]]}, "
          f"{resent(first[1:])} batch(es) sent again, done {waited:.1f} s after the kill")
    t0 = time.monotonic()
    galera.restart(1)
    print(f"Galera node 2 back and synced in {time.monotonic() - t0:.1f} s")
    # The survivors pushed through it all (their lost certifications sent again), unless MariaDB wedged node 1.
    assert all(r.returncode == 0 or wedged(r) for r in first[1:]), "\n".join(r.stdout + r.stderr for r in first[1:])
    restarted = ship_the_rest(galera, nodes)  # whatever did not ship ships now (the timer's next run)
    print(f"wedged and restarted: {restarted}")
    assert nodes[0].result.stdout.startswith(f"{nodes[0].db} -> ") and "left 0" in nodes[0].result.stdout
    synced(galera)
    for server in galera.nodes:
        assert totals(server, site.db) == expected(nodes, jobs)
    rebuild_is_exact(site)


def isolate(node, on: int) -> None:
    """Cut a Galera node off from the others (gmcast.isolate), or join it again.  MariaDB 11 loads
    galera as a plugin: the options string can no longer be changed while it runs (error 1210) and
    gmcast.isolate is not among the options it makes variables; there the node leaves by an empty
    wsrep_cluster_address and comes back by its old one (an IST)."""
    if on:
        node.cluster_address = node.sql("SELECT @@wsrep_cluster_address").strip()
        try:
            node.sql("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=1'")
            node.isolated_by = "option"
        except RuntimeError as e:
            if "1210" not in str(e):
                raise
            node.sql("SET GLOBAL wsrep_cluster_address = ''")
            node.isolated_by = "address"
    elif getattr(node, "isolated_by", "") == "address":
        node.sql(f"SET GLOBAL wsrep_cluster_address = '{node.cluster_address}'")
    else:
        node.sql("SET GLOBAL wsrep_provider_options = 'gmcast.isolate=0'")


def test_a_galera_node_cut_off_from_its_cluster_is_one_line_and_the_push_keeps_its_records(galera, tmp_path):
    site = Site(galera.nodes[0], tmp_path)
    site.init(writers="n1")
    synced(galera)  # the accounts and GRANTs, made on node 1, reach the others a moment later
    node = Node(site, tmp_path, "n1", galera.nodes[2], range(1, 4))
    cut = galera.nodes[2]
    isolate(cut, 1)
    try:
        deadline = time.monotonic() + 30
        while cut.status("wsrep_ready") != "OFF":
            assert time.monotonic() < deadline, cut.status("wsrep_cluster_status")
            time.sleep(0.1)
        r = node.push()
        assert r.returncode == 5, r.stdout + r.stderr
        assert "this Galera node is not synced with its cluster and takes no queries" in r.stderr, r.stderr
        assert "WSREP has not yet prepared node for application use" in r.stderr
        assert "hint: " in r.stderr and "nothing was lost" in r.stderr
        assert len([line for line in r.stderr.splitlines() if line.startswith("slurm-gpu: error:")]) == 1
    finally:
        isolate(cut, 0)
        cut.wait_synced(60)
    assert node.push().returncode == 0, node.result.stdout + node.result.stderr
    synced(galera)
    assert galera.nodes[0].rows("SELECT COUNT(*) FROM job_gpus", site.db) == [["12"]]


def test_a_rollup_rebuild_on_one_galera_node_is_exact_on_all(galera, tmp_path):
    """`central rollup --rebuild` runs in one serializable transaction on the node it connects to;
    what it corrects reaches the other nodes as one write set."""
    site = Site(galera.nodes[0], tmp_path)
    site.init(writers="n1")
    synced(galera)  # the accounts and GRANTs, made on node 1, reach the others a moment later
    node = Node(site, tmp_path, "n1", galera.nodes[1], range(1, 11))
    assert node.push().returncode == 0
    synced(galera)
    galera.nodes[2].sql("UPDATE rollup_day SET alloc_s = alloc_s + 1 LIMIT 1", site.db)
    r = cli("--config", str(site.config), "central", "rollup", "--rebuild")
    assert r.returncode == 1 and "rollup_day: 0 missing, 0 extra, 1 different" in r.stdout, r.stdout + r.stderr
    synced(galera)
    for i, server in enumerate(galera.nodes):
        cfg = _config(tmp_path / f"admin{i}.toml", server.url(site.admin, site.db),
                      site.password_file(site.admin, site.admin_pw), site.node_db)
        r = cli("--config", str(cfg), "central", "rollup", "--rebuild")
        assert r.returncode == 0 and "rollups exact" in r.stderr, (i, r.stdout + r.stderr)


# --------------------------------------------------------------------------- a primary and its replica


def test_a_report_from_the_replica_equals_the_primarys_once_caught_up_and_says_how_old_it_is(pair, tmp_path):
    site = Site(pair.primary, tmp_path)
    site.init(writers="n1")
    node = Node(site, tmp_path, "n1", pair.primary, range(1, 21))
    assert node.push().returncode == 0, node.result.stderr
    on_primary = reporter_config(site, pair.primary, "primary.toml")
    on_replica = reporter_config(site, pair.replica, "replica.toml")
    pair.caught_up()
    a, b = report(on_primary, "--by", "user,day"), report(on_replica, "--by", "user,day")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert b.stdout == a.stdout and a.stdout.count("\n") > 2
    assert "replica" not in a.stderr
    (note,) = [line for line in b.stderr.splitlines() if "replica" in line]
    assert re.fullmatch(rf"slurm-gpu: note: central server {site.reporter}@127\.0\.0\.1:{pair.replica.port}/{site.db} "
                        r"is a replica: its newest push is \d+ s old \(pushes reach the primary first; a report there "
                        r"has them all\)", note), note

    # The replica stops applying: the primary moves on, the replica's report shows the older state and says so.
    pair.replica.sql("STOP SLAVE SQL_THREAD")
    try:
        time.sleep(2.5)
        store = Store(str(node.db), str(node.db.parent / "spool"))
        for j in range(21, 31):
            store.write(_job(j, "n1"))
        store.close()
        assert node.push().returncode == 0
        a, b = report(on_primary, "--by", "user,day"), report(on_replica, "--by", "user,day")
        assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
        assert b.stdout != a.stdout
        (note,) = [line for line in b.stderr.splitlines() if "replica" in line]
        m = re.search(r"is a replica whose replication is not applying changes: its newest push is (\d+) s old", note)
        assert m and int(m.group(1)) >= 2, note
    finally:
        pair.replica.sql("START SLAVE SQL_THREAD")
    pair.caught_up()
    a, b = report(on_primary, "--by", "user,day"), report(on_replica, "--by", "user,day")
    assert b.stdout == a.stdout
    m = re.search(r"is a replica: its newest push is (\d+) s old", b.stderr)
    assert m and int(m.group(1)) < 2, b.stderr
    # The replica takes no push: one line that says where pushes go.
    account, password = site.writer_of("n1")
    wrong = _config(tmp_path / "to-replica.toml", pair.replica.url(account, site.db),
                    site.password_file(account, password), node.db)
    store = Store(str(node.db), str(node.db.parent / "spool"))
    store.write(_job(31, "n1"))
    store.close()
    r = cli_env({"SLURMD_NODENAME": "n1"}, "--config", str(wrong), "db", "push")
    assert r.returncode == 5 and "is read-only" in r.stderr and "the primary" in r.stderr, r.stdout + r.stderr
