"""A throwaway MariaDB server for the central-store tests: Debian's mariadbd on 127.0.0.1.

Started on a free port with its own data directory and socket, root by socket only, stopped by
pid (the process group we started).  `stop()`/`start()` restart it on the same port and data:
the "server down while jobs end" tests need that.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

OPTS = ["--innodb-buffer-pool-size=64M", "--innodb-log-file-size=16M", "--innodb-flush-log-at-trx-commit=0",
        "--innodb-doublewrite=0", "--sync-binlog=0", "--innodb-flush-method=nosync"]


class MariaDBUnavailable(Exception):
    pass


def running(opts: Sequence[str] = ()):
    """A started throwaway server (with mariadbd's `opts` besides OPTS) for a module-scoped fixture
    (`yield from running()`); where Debian's mariadb-server is missing the test skips, except in
    CI where it fails."""
    from testbed import unavailable
    try:
        m = MariaDB(opts=opts)
    except MariaDBUnavailable as e:
        unavailable(str(e))
    m.start()
    yield m
    m.cleanup()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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
        self.log = self.dir / "mariadbd.log"
        self.opts = [*OPTS, *opts]  # (later options win on mariadbd's command line)

    def start(self, timeout_s: float = 60.0) -> "MariaDB":
        if not (self.data / "mysql").exists():
            r = subprocess.run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={self.data}",
                                "--auth-root-authentication-method=socket", "--skip-test-db", *OPTS],
                               capture_output=True, text=True, timeout=180)
            if r.returncode != 0:
                raise RuntimeError(f"mariadb-install-db failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        with open(self.dir / "mariadbd.out", "ab") as out:
            self.proc = subprocess.Popen(
                ["mariadbd", "--no-defaults", "--user=root", f"--datadir={self.data}", f"--socket={self.socket}",
                 f"--port={self.port}", "--bind-address=127.0.0.1", "--skip-name-resolve", "--skip-log-bin",
                 f"--pid-file={self.dir / 'mariadbd.pid'}", f"--log-error={self.log}", *self.opts],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited {self.proc.returncode}: {self._log_tail()}")
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

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server accepts TCP connections (the kernel does) but never answers."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

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
