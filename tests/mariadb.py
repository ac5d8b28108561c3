"""Throwaway MariaDB servers for the tests: Debian's mariadbd on 127.0.0.1, root by socket only.

* **One server per session** for the unit tests: the session fixture `mariadb_server`
  (tests/conftest.py) starts it the first time a test asks for it and stops it at session end;
  each module takes databases and accounts of its own on it (`new_database()`, `new_user()` with
  names no other module uses).  A server with other options (the TLS one in test_central.py) is a
  server of its own (`running(opts)`).
* **No `mariadb-install-db` per server**: a server's data directory is a copy of a template
  (`data_template()`) that `mariadb-install-db` writes once per machine, under
  /var/tmp/slurm-gpu-mariadb-template-<version>-<key> (keyed by mariadbd's version and the
  options it was written with; built aside and renamed into place, so a concurrent run never sees
  half of one).  tests/testbed.py copies it for its clusters' servers too.
* Each server has a free port, its own directory and socket, and is stopped by pid (the process
  group we started).  `stop()`/`start()` restart it on the same port and data, `pause()`/`resume()`
  SIGSTOP/SIGCONT it: the "server down" tests.  A test that stops or pauses the shared server
  restarts/resumes it itself (try/finally); `ensure_running()`, run after every test
  (tests/conftest.py), is the safety net for one that failed half-way.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

# The redo log's size is part of the data directory: a server started with another size than its
# data directory was written with rewrites the log first ("Resizing redo log").  Every server
# here, the testbed's included, runs with this one, so one template serves them all.
LOG_FILE_SIZE = "--innodb-log-file-size=16M"
# Durability is worthless for a throwaway database.
FAST = ["--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0", "--sync-binlog=0",
        "--innodb-flush-method=nosync"]
OPTS = ["--innodb-buffer-pool-size=64M", LOG_FILE_SIZE, *FAST]
# What mariadb-install-db writes the template with (part of the template's key); bump RECIPE when
# the way it is built changes.
INSTALL_OPTS = ["--auth-root-authentication-method=socket", "--skip-test-db"]
RECIPE = 1
TEMPLATE_ROOT = Path("/var/tmp")
TEMPLATE_PREFIX = "slurm-gpu-mariadb-template-"


class MariaDBUnavailable(Exception):
    pass


def running(opts: Sequence[str] = ()):
    """A started throwaway server of its own (with mariadbd's `opts` besides OPTS) for a
    module-scoped fixture (`yield from running()`); where Debian's mariadb-server is missing the
    test skips, except in CI where it fails.  Tests that need no options of their own use the
    session's server instead (fixture `mariadb_server`)."""
    yield from _started(lambda: MariaDB(opts=opts))


def _started(make):
    """make()'s server(s), started, for a module fixture's `yield from`; cleaned up after.  Where a tool
    is missing (MariaDBUnavailable) the test skips, except in CI where it fails (testbed.unavailable)."""
    from testbed import unavailable
    try:
        thing = make()
    except MariaDBUnavailable as e:
        unavailable(str(e))
    try:
        thing.start()
        yield thing
    finally:
        thing.cleanup()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------ the template data directory

_session_root: Optional[Path] = None


def _template_root() -> Path:
    """/var/tmp, where the template outlives the session; a directory of this process's own
    (removed at exit) where /var/tmp is not writable."""
    global _session_root
    if os.access(TEMPLATE_ROOT, os.W_OK | os.X_OK):
        return TEMPLATE_ROOT
    if _session_root is None:
        _session_root = Path(tempfile.mkdtemp(prefix="slurm-gpu-mariadb-templates-"))
        atexit.register(shutil.rmtree, _session_root, True)
    return _session_root


@functools.lru_cache(maxsize=None)
def _server_version() -> str:
    r = subprocess.run(["mariadbd", "--no-defaults", "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or " Ver " not in r.stdout:
        raise RuntimeError(f"mariadbd --version failed: {r.stdout[-500:]}{r.stderr[-500:]}")
    # Without the program's name, which is however it was called (a path, a wrapper).
    return r.stdout.split(" Ver ", 1)[1].strip()


def data_template(log_file_size: Optional[str] = LOG_FILE_SIZE) -> Path:
    """The data directory `mariadb-install-db` writes (root by socket, no test database) with the
    redo log size `log_file_size` (a `--innodb-log-file-size=` option; None: mariadbd's default),
    built at most once per machine, mariadbd version and options; copy it, never start a server
    on it."""
    version = _server_version()
    install = [*INSTALL_OPTS, *([log_file_size] if log_file_size else [])]
    key = hashlib.sha256(repr((RECIPE, version, install)).encode()).hexdigest()[:12]
    release = re.sub(r"[^A-Za-z0-9.+-]", "_", version.split()[0])[:40]
    root = _template_root()
    name = f"{TEMPLATE_PREFIX}{release}-{key}"
    final = root / name
    if _whole(final):
        return final
    _remove_stale_builds(root)
    if final.exists():  # emptied in part (a /var/tmp cleaner): out of the way, rebuilt below
        try:
            os.rename(final, root / f".{name}.broken-{secrets.token_hex(4)}")
        except OSError:
            pass
    build = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        r = subprocess.run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={build}", *install,
                            *FAST], capture_output=True, text=True, timeout=180)
        if r.returncode != 0 or not (build / "mysql").is_dir():
            raise RuntimeError(f"mariadb-install-db failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        # nosync above: the files reach the disk before the name says the template is whole.
        for d, _dirs, files in os.walk(build):
            for f in files:
                _fsync(Path(d) / f)
            _fsync(Path(d))
        try:
            os.rename(build, final)
        except OSError as e:
            if not _whole(final):  # not a concurrent run's template: a real failure
                raise RuntimeError(f"cannot put the MariaDB template in place ({e}): remove {final}") from e
        _fsync(root)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final


def _whole(template: Path) -> bool:
    return all((template / f).exists() for f in ("mysql", "ibdata1", "ib_logfile0", "aria_log_control"))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_builds(root: Path) -> None:
    """Half-built templates of runs that were killed during mariadb-install-db (over an hour old)."""
    for p in root.glob(f".{TEMPLATE_PREFIX}*"):
        try:
            if time.time() - p.stat().st_mtime > 3600:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def copy_template(data: Path, opts: Sequence[str]) -> Path:
    """Make `data` a fresh data directory for a server started with `opts` (mariadbd options:
    the template with the same redo log size).  Returns the template it copied."""
    sizes = [o for o in opts if o.startswith("--innodb-log-file-size=")]
    template = data_template(sizes[-1] if sizes else None)
    if data.exists():
        shutil.rmtree(data)
    data.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(template, data, symlinks=True)
    return template


# ------------------------------------------------------------------ a server

class MariaDB:
    def __init__(self, workdir: Optional[Path] = None, opts: Sequence[str] = ()):
        for tool in ("mariadbd", "mariadb-install-db", "mariadb", "mariadb-admin"):
            if shutil.which(tool) is None:
                raise MariaDBUnavailable(f"{tool} not found (Debian package mariadb-server)")
        if os.geteuid() != 0:
            raise MariaDBUnavailable("the test MariaDB runs as root (--user=root)")
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="slurm-gpu-mariadb-"))
        self.data = self.dir / "data"
        self.socket = self.dir / "mysqld.sock"
        self.port = _free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.paused = False
        self.log = self.dir / "mariadbd.log"
        self.opts = [*OPTS, *opts]  # (later options win on mariadbd's command line)

    def start(self, timeout_s: float = 60.0) -> "MariaDB":
        """Start mariadbd (on a copy of the template the first time; on the same data and port
        after `stop()`) and return once it answers on its socket and its TCP port."""
        template = None
        if not (self.data / "mysql").exists():
            template = copy_template(self.data, self.opts)
        with open(self.dir / "mariadbd.out", "ab") as out:
            self.proc = subprocess.Popen(
                ["mariadbd", "--no-defaults", "--user=root", f"--datadir={self.data}", f"--socket={self.socket}",
                 f"--port={self.port}", "--bind-address=127.0.0.1", "--skip-name-resolve", "--skip-log-bin",
                 f"--pid-file={self.dir / 'mariadbd.pid'}", f"--log-error={self.log}", *self.opts],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.paused = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited {self.proc.returncode}"
                                   f"{f' (data copied from {template})' if template else ''}: {self._log_tail()}")
            ok = subprocess.run(["mariadb-admin", "--no-defaults", f"--socket={self.socket}", "ping"],
                                capture_output=True, timeout=10).returncode == 0
            if ok and self._tcp_up():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"mariadbd did not answer within {timeout_s:g}s: {self._log_tail()}")

    def _tcp_up(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """TERM (KILL after 30 s) the server; `start()` brings it back on the same port and data."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if self.paused:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped process would not act on TERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the server accepts TCP connections (the kernel does) but never answers."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> bool:
        """Resume a paused server, start a stopped (or crashed) one: the state every test must
        leave the shared server in.  True when there was something to do."""
        if self.running():
            if not self.paused:
                return False
            self.resume()
            return True
        self.stop()  # (reaps a crashed one)
        self.start()
        return True

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def sql(self, statements: str, database: str = "") -> str:
        """Run SQL as root over the socket; the tab-separated output without headers.  The SQL goes
        through stdin, never the command line: it may hold an account's password."""
        args = ["mariadb", "--no-defaults", f"--socket={self.socket}", "-u", "root", "-N", "-B"]
        if database:
            args.append(database)
        r = subprocess.run(args, input=statements, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"mariadb: {r.stderr.strip()}")
        return r.stdout

    def rows(self, query: str, database: str) -> List[List[str]]:
        return [line.split("\t") for line in self.sql(query, database).splitlines()]

    def new_database(self, prefix: str = "sg") -> str:
        name = f"{prefix}_{secrets.token_hex(4)}"
        self.sql(f"CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        return name

    def new_user(self, name: str, grants: List[str] = ()) -> str:
        """A user on 127.0.0.1 and localhost with a random password; returns the password."""
        password = secrets.token_urlsafe(18)
        stmts = []
        for host in ("127.0.0.1", "localhost"):
            stmts.append(f"CREATE OR REPLACE USER '{name}'@'{host}' IDENTIFIED BY '{password}';")
            stmts += [g.replace("'%'", f"'{host}'") for g in grants]
        self.sql("".join(stmts) + "FLUSH PRIVILEGES;")
        return password

    def url(self, user: str, database: str) -> str:
        return f"mysql://{user}@127.0.0.1:{self.port}/{database}"


# ------------------------------------------------------------------ Galera and a replica (issue 40)

GALERA_PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")


def _free_ports(n: int) -> List[int]:
    """n distinct free ports (held open together while chosen, so none is picked twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class GaleraNode(MariaDB):
    """One node of a `GaleraCluster`: its own data directory (the template's copy), port, socket
    and the group communication (gmcast), IST and SST ports, all on 127.0.0.1."""

    def __init__(self, cluster: "GaleraCluster", index: int, opts: Sequence[str] = ()):
        super().__init__(cluster.dir / f"node{index}", [*opts, f"--tmpdir={cluster.dir / f'node{index}' / 'tmp'}"])
        (self.dir / "tmp").mkdir(parents=True)
        self.cluster = cluster
        self.index = index
        self.dir.mkdir(parents=True, exist_ok=True)
        self.gmcast, self.ist, self.sst = _free_ports(3)
        self.base_opts = list(self.opts)

    def galera_opts(self, bootstrap: bool) -> List[str]:
        peers = ",".join(f"127.0.0.1:{n.gmcast}" for n in self.cluster.nodes)
        provider = (f"gmcast.listen_addr=tcp://127.0.0.1:{self.gmcast};ist.recv_addr=127.0.0.1:{self.ist};"
                    "gcache.size=64M;gcs.fc_limit=256;evs.suspect_timeout=PT3S;evs.inactive_timeout=PT6S;"
                    "evs.keepalive_period=PT0.5S;evs.inactive_check_period=PT0.5S;pc.wait_prim_timeout=PT10S")
        return ["--wsrep-on=ON", f"--wsrep-provider={GALERA_PROVIDER}", f"--wsrep-cluster-name={self.cluster.name}",
                f"--wsrep-cluster-address=gcomm://{peers}", f"--wsrep-node-name=node{self.index}",
                f"--wsrep-node-address=127.0.0.1:{self.gmcast}", f"--wsrep-node-incoming-address=127.0.0.1:{self.port}",
                f"--wsrep-sst-receive-address=127.0.0.1:{self.sst}", f"--wsrep-provider-options={provider}",
                "--wsrep-sst-method=rsync", "--binlog-format=ROW", "--default-storage-engine=InnoDB",
                "--innodb-autoinc-lock-mode=2", f"--server-id={self.index}", "--wsrep-slave-threads=2",
                *(["--wsrep-new-cluster"] if bootstrap else [])]

    def start(self, timeout_s: float = 60.0, bootstrap: bool = False) -> "GaleraNode":  # type: ignore[override]
        self.opts = [*self.base_opts, *self.galera_opts(bootstrap)]
        if not (self.data / "mysql").exists():
            copy_template(self.data, self.opts)
            for d in (self.cluster.dir, self.dir):
                os.chmod(d, 0o711)
        elif self.saved_position() is None:
            # After a crash: from the position InnoDB has, so that a survivor's gcache fills the gap (IST).
            self.opts.append(f"--wsrep-start-position={self.recover()}")
        # A joiner's SST arrives through an rsync daemon, which, started by root, runs as nobody:
        # the data directory (and the way to it) must be that user's.
        nobody = pwd.getpwnam("nobody")
        for d, dirs, files in os.walk(self.data):
            for name in [d, *(os.path.join(d, f) for f in dirs + files)]:
                os.lchown(name, nobody.pw_uid, nobody.pw_gid)
        try:
            super().start(timeout_s)
        except RuntimeError as e:
            # galera-4 26.4.23 now and then fails its group connection at start ("Failed to read
            # thread schedparams: System error: 3 (No such process)"): once more, then it counts.
            if "Failed to read thread schedparams" not in str(e):
                raise
            self.proc = None
            super().start(timeout_s)
        self.wait_synced(timeout_s)
        return self

    def saved_position(self) -> Optional[str]:
        """The position a clean shutdown wrote to grastate.dat (UUID:seqno); None after a crash."""
        try:
            state = dict(line.split(":", 1) for line in (self.data / "grastate.dat").read_text().splitlines()
                         if ":" in line and not line.startswith("#"))
        except OSError:
            return None
        uuid, seqno = state.get("uuid", "").strip(), state.get("seqno", "-1").strip()
        return None if seqno == "-1" or not uuid else f"{uuid}:{seqno}"

    def recover(self) -> str:
        """The cluster position (UUID:seqno) this node's InnoDB holds: `mariadbd --wsrep-recover`,
        what galera_recovery runs before systemd starts a crashed node.  Read from its log as soon
        as it is there, and the process then stopped: it sometimes never exits after writing it."""
        log = self.dir / "recover.log"
        log.unlink(missing_ok=True)
        proc = subprocess.Popen(["mariadbd", "--no-defaults", "--user=root", f"--datadir={self.data}",
                                 f"--socket={self.dir / 'recover.sock'}", "--skip-networking", f"--log-error={log}",
                                 *self.opts, "--wsrep-recover"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                found = re.findall(r"WSREP: Recovered position: (\S+)", log.read_text(errors="replace")
                                   if log.exists() else "")
                if found:
                    return found[-1]
                if proc.poll() is not None:
                    raise RuntimeError(f"mariadbd --wsrep-recover exited {proc.returncode} without a position")
                time.sleep(0.1)
            raise RuntimeError("mariadbd --wsrep-recover found no position within 120 s")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def status(self, name: str) -> str:
        out = self.sql(f"SHOW GLOBAL STATUS LIKE '{name}'").split("\t")
        return out[1].strip() if len(out) > 1 else ""

    def wait_synced(self, timeout_s: float = 60.0) -> None:
        """Until this node is Synced, ready, and sees every running node of the cluster."""
        want = str(sum(1 for n in self.cluster.nodes if n.running()))
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"Galera node{self.index} exited {self.proc.returncode}: {self._log_tail()}")
            try:
                state = (self.status("wsrep_local_state_comment"), self.status("wsrep_ready"),
                         self.status("wsrep_cluster_size"))
            except RuntimeError:
                state = ("(not answering)",)
            if state == ("Synced", "ON", want):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Galera node{self.index} not synced within {timeout_s:g}s ({state}): {self._log_tail()}")

    def kill(self) -> None:
        """SIGKILL the node's process group (mariadbd and an SST's rsync): a crash, not a shutdown."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
        self.paused = False

    def stop(self) -> None:
        """Stopped by pid: SIGKILL (a throwaway node needs no clean shutdown; a Galera node's
        clean shutdown waits on the others)."""
        self.kill()


class GaleraCluster:
    """Three (or `size`) Galera nodes on 127.0.0.1 (Debian's galera-4): the first bootstraps the
    cluster (--wsrep-new-cluster), the others join it by a state transfer (SST, rsync);
    `kill(i)`/`restart(i)` crash a node and bring it back (IST from a survivor's gcache, from the
    position `mariadbd --wsrep-recover` finds)."""

    def __init__(self, size: int = 3, opts: Sequence[str] = ()):
        for tool in ("rsync", "wsrep_sst_rsync"):
            if shutil.which(tool) is None:
                raise MariaDBUnavailable(f"{tool} not found (Debian packages galera-4, rsync)")
        if not GALERA_PROVIDER.exists():
            raise MariaDBUnavailable(f"{GALERA_PROVIDER} not found (Debian package galera-4)")
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-gpu-galera-"))
        self.name = f"sg_{secrets.token_hex(4)}"
        self.nodes: List[GaleraNode] = []
        for i in range(1, size + 1):
            self.nodes.append(GaleraNode(self, i, opts))
        self.startup_s = 0.0

    def start(self) -> "GaleraCluster":
        """Bootstrap the first node; the others join one after the other, each by a state
        transfer (rsync, ~4 s a node here: two joining at once wait for the one donor anyway)."""
        t0 = time.monotonic()
        self.nodes[0].start(bootstrap=True)
        for node in self.nodes[1:]:
            node.start(timeout_s=120)
        for node in self.nodes:
            node.wait_synced()
        self.startup_s = time.monotonic() - t0
        return self

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def restart(self, i: int, timeout_s: float = 120.0) -> None:
        """Bring a killed node back: it rejoins (IST, or SST when the gcache lacks what it missed)."""
        self.nodes[i].start(timeout_s=timeout_s)
        for node in self.nodes:
            node.wait_synced(timeout_s)

    def crashed(self) -> List[str]:
        """The log tails of nodes that died without being killed here (mariadbd's own crash report)."""
        return [f"node{n.index} exited {n.proc.returncode}:\n{n._log_tail(60)}" for n in self.nodes
                if n.proc is not None and n.proc.poll() is not None]

    def cleanup(self) -> None:
        for report in self.crashed():
            print(f"Galera {report}", file=sys.stderr)
        for node in reversed(self.nodes):
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def running_galera(size: int = 3):
    """A started Galera cluster for a module-scoped fixture (`yield from running_galera()`): skips
    where galera-4, rsync or mariadb-server is missing, except in CI where it fails."""
    yield from _started(lambda: GaleraCluster(size))


class ReplicaPair:
    """A primary and a replica replicating from it (binary log, GTID: MASTER_USE_GTID=slave_pos),
    both on 127.0.0.1 from the template; the replica runs read_only.  Its replication account's
    password goes through the replica's stdin (CHANGE MASTER TO), never a command line."""

    def __init__(self, opts: Sequence[str] = ()):
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-gpu-replica-"))
        self.primary = MariaDB(self.dir / "primary", [*opts, f"--log-bin={self.dir / 'primary' / 'binlog'}",
                                                       "--server-id=1", "--binlog-format=ROW", "--log-basename=primary",
                                                       f"--tmpdir={self.dir / 'primary' / 'tmp'}"])
        self.replica = MariaDB(self.dir / "replica", [*opts, "--server-id=2", "--read-only=ON",
                                                       "--log-basename=replica", "--skip-slave-start",
                                                       f"--tmpdir={self.dir / 'replica' / 'tmp'}"])
        for server in (self.primary, self.replica):
            (server.dir / "tmp").mkdir(parents=True)

    def start(self) -> "ReplicaPair":
        self.primary.start()
        self.replica.start()
        password = secrets.token_urlsafe(18)
        # Not in the binary log: the replica starts from the template too, it never needs this account.
        self.primary.sql("SET SESSION sql_log_bin = 0; "
                         f"CREATE USER 'repl'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                         "GRANT REPLICATION SLAVE ON *.* TO 'repl'@'127.0.0.1';")
        self.replica.sql(f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={self.primary.port}, "
                         f"MASTER_USER='repl', MASTER_PASSWORD='{password}', MASTER_USE_GTID=slave_pos, "
                         "MASTER_CONNECT_RETRY=1; START SLAVE;")
        return self

    def gtid(self, server: MariaDB, variable: str) -> str:
        return server.sql(f"SELECT @@{variable}").strip()

    def caught_up(self, timeout_s: float = 60.0) -> None:
        """Until the replica has applied everything the primary has written (its GTID position)."""
        want = self.gtid(self.primary, "gtid_binlog_pos")
        r = self.replica.sql(f"SELECT MASTER_GTID_WAIT('{want}', {timeout_s:g})").strip()
        if r != "0":
            raise RuntimeError(f"the replica did not reach the primary's GTID {want} within {timeout_s:g}s "
                               f"(it has {self.gtid(self.replica, 'gtid_slave_pos')})")

    def cleanup(self) -> None:
        self.replica.cleanup()
        self.primary.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)


def running_replica(opts: Sequence[str] = ()):
    """A started primary/replica pair for a module-scoped fixture (skips, or fails in CI, as `running`)."""
    yield from _started(lambda: ReplicaPair(opts))
