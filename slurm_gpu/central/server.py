"""The cluster's SQL server (MariaDB/MySQL): where every node's records meet (docs/central.md).

Nothing here is on the hook path: the prolog and epilog write the node database only, and
`slurm-gpu db push` (central/push.py) ships it here.  The driver, PyMySQL (the `central` extra),
is imported when a connection is opened, never at module import.

- The URL names user, host, port and database (`mysql://slurm_gpu_writer@dbhost/slurm_gpu`);
  the password comes from a file only root (or the user running the command) can read.  No
  password appears in a URL, a log line, an error message or a process argument.
- Sessions use ANSI_QUOTES and PIPES_AS_CONCAT, UTC, and a binary collation, so that the
  report's SQL reads the same on SQLite and on the server and sorts and groups names alike.
- The schema, its versions and what each added: central/schema.py.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

from slurm_gpu.central import rollup_push
from slurm_gpu.central import writers as W
from slurm_gpu.central.schema import (  # noqa: F401  (the schema's public names, read through this module too)
    CENTRAL_JOB_COLUMNS,
    CENTRAL_JOB_GPU_COLUMNS,
    COLUMNS,
    INVENTORY_COUNTERS,
    KEYS,
    MIGRATIONS,
    RECORD_TABLES,
    REMEDIATION_HISTORY_COLUMNS,
    SCHEMA_VERSION,
    SHIPPED,
    VERSIONED,
    _q,
    stage_sql,
    withdraw_row,
)
from slurm_gpu.central.writers import read_password
from slurm_gpu.config import Config
from slurm_gpu.errors import CentralError, WriterRefused

DEFAULT_PORT = 3306
SESSION_SQL_MODE = "ANSI_QUOTES,PIPES_AS_CONCAT,STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION"
URL_HINT = "central.url looks like mysql://USER@HOST[:PORT]/DATABASE (password in central.password_file)"


class Target(NamedTuple):
    """Where to connect: everything but the password."""

    user: str
    host: str
    port: int
    database: str
    unix_socket: str = ""
    ssl_ca: str = ""

    def describe(self) -> str:
        where = f"{self.host}:{self.port}" if not self.unix_socket else f"{self.host} (socket {self.unix_socket})"
        return f"{self.user}@{where}/{self.database}"


def is_url(text: str) -> bool:
    return text.startswith(("mysql://", "mariadb://"))


def parse_url(url: str) -> Target:
    """mysql://USER@HOST[:PORT]/DATABASE[?unix_socket=PATH&ssl_ca=PATH]; CentralError if malformed."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise CentralError(f"central URL is malformed ({e})", URL_HINT) from None
    if u.scheme not in ("mysql", "mariadb"):
        raise CentralError(f"central URL scheme {u.scheme!r} is not supported", URL_HINT)
    if u.password is not None:
        # Say where, never what: the text after ':' is a secret.
        raise CentralError("central URL contains a password",
                           "remove it from the URL and put it in central.password_file (mode 600)")
    database = unquote(u.path.strip("/"))
    if not u.username or not database or "/" in database:
        raise CentralError(f"central URL {_safe(url)} must name a user and one database", URL_HINT)
    opts = parse_qs(u.query)
    unknown = sorted(set(opts) - {"unix_socket", "ssl_ca"})
    if unknown:
        raise CentralError(f"central URL option {unknown[0]!r} is not known", "known options: unix_socket, ssl_ca")
    return Target(user=unquote(u.username), host=u.hostname or "localhost", port=port or DEFAULT_PORT,
                  database=database, unix_socket=opts.get("unix_socket", [""])[-1], ssl_ca=opts.get("ssl_ca", [""])[-1])


def _safe(url: str) -> str:
    """A URL for a message: whatever stood between '//' and '@' reduced to the user name."""
    try:
        u = urlsplit(url)
        if u.password is not None:
            return url.replace(u.netloc, f"{u.username}:***@{u.hostname}" + (f":{u.port}" if u.port else ""))
    except ValueError:
        return "(unreadable URL)"
    return url


def _driver() -> Any:
    try:
        import pymysql
    except ImportError:
        raise CentralError("the central server needs PyMySQL, which is not installed",
                           "pip install 'slurm-gpu[central]' (or Debian's python3-pymysql)") from None
    return pymysql


def _connect(driver: Any, kw: Dict[str, Any], preferred: bool) -> Any:
    """driver.connect(**kw); `preferred` (no ssl_ca): TLS where the server offers it, unverified,
    as PyMySQL >= 1.2 does by default, but with a context that loads no CA certificates: PyMySQL's
    default one loads the system's bundle (~50 ms of every CLI run against the server, for
    certificates an unverified connection never looks at).  A PyMySQL without that mode as 1.2
    has it connects with its own defaults (before 1.2: in plain text)."""
    if not preferred:
        return driver.connect(**kw)
    conn = driver.connect(**kw, ssl_disabled=True, defer_connect=True)
    if "_ssl_required" in vars(conn):  # PyMySQL's "PREFERRED" mode: encrypt if the server can
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        conn.ssl, conn._ssl_required, conn.ctx = True, False, ctx
    else:
        conn = driver.connect(**kw, defer_connect=True)
    conn.connect()
    return conn


def _tls_failure(e: BaseException) -> bool:
    """The driver's error came from TLS: the server's certificate or its lack of TLS (PyMySQL wraps
    a failed handshake as "can't connect")."""
    import ssl
    chain = [e, e.__cause__, e.__context__, getattr(e, "original_exception", None)]
    return _code(e) == 2026 or any(isinstance(x, ssl.SSLError) for x in chain)


def _code(e: BaseException) -> Optional[int]:
    """The server's or client's error number (1045 access denied, 2003 cannot connect, ...)."""
    args = getattr(e, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def describe_error(e: BaseException, target: Target, password: str = "") -> Tuple[str, str]:
    """(one line, hint) for a driver error: what happened at which server, never the password."""
    code = _code(e)
    text = str(e.args[1]) if len(getattr(e, "args", ())) > 1 else str(e)
    if password:
        text = text.replace(password, "***")
    where = target.describe()
    if code in (1045, 1698):
        return (f"central server {where}: login refused for {target.user} ({text})",
                "check the user in central.url and the password in central.password_file; `central init` prints the GRANTs")
    if code in (1044, 1049):
        return (f"central server {where}: no access to database {target.database} ({text})",
                "run `slurm-gpu central init` as the database admin, then the GRANTs it prints")
    if code in (1142, 1143, 1227):
        return (f"central server {where}: permission denied ({text})",
                "the account lacks a GRANT that `slurm-gpu central init` prints")
    refused, why = W.refusal(code, text, target.user)
    if refused:
        return f"central server {where}: {refused}", why
    if code in (1020, 1205, 1213):
        return (f"central server {where}: another transaction held the rows this one needed ({text})",
                "other pushes (on Galera also a commit of the same rows through another node), a `central rollup "
                "--rebuild` or a long admin transaction; nothing was lost: the records stay in the node database "
                "for the next push")
    if code == 1290 and "read-only" in text:
        return (f"central server {where}: is read-only, a replica or a server set read_only ({text})",
                "pushes go to the primary (central.url); a replica serves reports only; nothing was lost: "
                "the records stay in the node database for the next push")
    if code == 1180 and "provider status" in text:
        return (f"central server {where}: the Galera cluster did not take this commit ({text})",
                "the node was cut off from its cluster for a moment (another node died, the network split) or the write "
                "set was refused; nothing was lost: the records stay in the node database for the next push")
    if code == 1047 and "WSREP" in text:
        # A Galera node outside the primary component (joining, donating, cut off) refuses every
        # statement until it is synced again: another try there fails alike, so the push stops.
        return (f"central server {where}: this Galera node is not synced with its cluster and takes no queries ({text})",
                "it is joining, donating a state transfer or cut off from the others (SHOW STATUS LIKE "
                "'wsrep_local_state_comment' there); point central.url at a synced node or a proxy that picks one; "
                "nothing was lost: the records stay in the node database for the next push")
    if _tls_failure(e):
        return (f"central server {where}: TLS failed ({text})",
                "central.url's ssl_ca must name the CA that signed the server's certificate, the certificate must "
                "name the URL's host, and the server must have TLS on (SHOW VARIABLES LIKE 'have_ssl')")
    if code in (2003, 2002, 2006, 2013, 2055) or isinstance(e, (OSError, TimeoutError)):
        return (f"central server {where}: unreachable or not answering ({text})",
                "is the server up and reachable from here? nothing was lost: records stay in the node database for the next push")
    return f"central server {where}: {type(e).__name__}: {text}", "see the server's log"


class DeadlineExceeded(TimeoutError):
    """An exchange with the server did not finish in time (a socket's own timeouts bound each read,
    not the whole answer: a server that trickles a byte a second never trips them)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Interrupt whatever blocks in this block after `seconds` (SIGALRM: main thread only, and only
    when no other timer of the process is armed; elsewhere the driver's per-read timeouts remain)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def _expired(signum: int, frame: Any) -> None:
        raise DeadlineExceeded(f"no complete answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_password(password: str, path: str) -> None:
    """PyMySQL sends a password as latin-1: say so, instead of an encoding error (never the password)."""
    try:
        password.encode("latin-1")
    except UnicodeEncodeError as e:
        raise CentralError(f"central.password_file {path}: the password has a character PyMySQL cannot send "
                           f"(position {e.start + 1}: not latin-1)",
                           "choose a password of ASCII letters, digits and punctuation, set it with "
                           "ALTER USER ... IDENTIFIED BY, and write it into the file") from None


class Central:
    """One connection to the central server, with ANSI SQL (double-quoted names, || concatenation)."""

    def __init__(self, target: Target, password: str, timeout_s: float = 10.0, read_timeout_s: Optional[float] = None):
        """timeout_s bounds connecting and each write; read_timeout_s (default: timeout_s) each
        answer — a report over millions of records may take minutes (central.query_timeout_s)."""
        self.target = target
        self.timeout_s = timeout_s
        self.answer_s = read_timeout_s if read_timeout_s is not None else timeout_s
        self._password = password
        self._expired = 0.0  # the deadline that ran out, for the message
        self.driver = _driver()
        kw: Dict[str, Any] = dict(user=target.user, password=password, database=target.database,
                                  connect_timeout=max(1, int(round(timeout_s))),
                                  read_timeout=read_timeout_s if read_timeout_s is not None else timeout_s,
                                  write_timeout=timeout_s, charset="utf8mb4", autocommit=False,
                                  init_command=f"SET SESSION sql_mode='{SESSION_SQL_MODE}', time_zone='+00:00'")
        if target.unix_socket:
            kw["unix_socket"] = target.unix_socket
        else:
            kw.update(host=target.host, port=target.port)
        if target.ssl_ca:
            kw["ssl"] = {"ca": target.ssl_ca}
        try:
            with self._deadline(timeout_s):
                self.conn = _connect(self.driver, kw, preferred=not target.ssl_ca)
        except Exception as e:  # the driver's errors, socket errors, timeouts
            raise self.error(e) from None

    @contextlib.contextmanager
    def _deadline(self, seconds: float) -> Iterator[None]:
        """One exchange within `seconds` in all; remembers that it ran out (for the message)."""
        try:
            with deadline(seconds):
                yield
        except DeadlineExceeded:
            self._expired = seconds
            raise
        except Exception as e:  # the driver wraps the interrupted read in its own error
            if isinstance(e.__context__, DeadlineExceeded) or isinstance(e.__cause__, DeadlineExceeded):
                self._expired = seconds
            raise

    @classmethod
    def from_config(cls, cfg: Config, url: Optional[str] = None, password_file: Optional[str] = None,
                    long_queries: bool = False) -> "Central":
        url = url or cfg.central.url
        if not url:
            raise CentralError("no central server configured", "set central.url in the config (docs/central.md)")
        target = parse_url(url)
        path = password_file or cfg.central.password_file
        password = read_password(path)
        check_password(password, path)
        return cls(target, password,
                   cfg.central.timeout_s,
                   cfg.central.query_timeout_s if long_queries else None)

    def error(self, e: BaseException) -> CentralError:
        message, hint = describe_error(e, self.target, self._password)
        if self._expired:
            message = (f"central server {self.target.describe()}: not answering: no complete answer within {self._expired:g} s "
                       "(the server or the network is too slow, or this is not a MariaDB/MySQL server)")
            self._expired = 0.0
        refused = W.refusal(_code(e), str(getattr(e, "args", ("", ""))[-1]), self.target.user)[0]
        err = (WriterRefused if refused else CentralError)(message, hint)
        err.driver_code = _code(e)  # type: ignore[attr-defined]
        return err

    def execute(self, sql: str, params: Sequence[Any] = ()) -> List[Tuple[Any, ...]]:
        try:
            with self._deadline(self.answer_s), self.conn.cursor() as cur:
                cur.execute(sql, tuple(params) if params else None)
                return list(cur.fetchall()) if cur.description else []
        except Exception as e:
            raise self.error(e) from None

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        try:
            with self._deadline(self.answer_s), self.conn.cursor() as cur:
                cur.executemany(sql, [tuple(r) for r in rows])
        except Exception as e:
            raise self.error(e) from None

    def commit(self) -> None:
        try:
            with self._deadline(self.answer_s):
                self.conn.commit()
        except Exception as e:
            raise self.error(e) from None

    def rollback(self) -> None:
        try:
            self.conn.rollback()
        except Exception:
            pass  # the connection is gone: the server rolls back by itself

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass

    def __enter__(self) -> "Central":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- schema ------------------------------------------------------------------------------
    def schema_version(self) -> Optional[int]:
        """The central schema's version; None when the database has no slurm-gpu schema yet."""
        try:
            with self.conn.cursor() as cur:
                cur.execute("SELECT value FROM meta WHERE name = 'schema_version'")
                row = cur.fetchone()
        except Exception as e:
            if getattr(e, "args", (None,))[0] == 1146:  # table doesn't exist
                return None
            raise self.error(e) from None
        return int(row[0]) if row else None

    def wait_for_locks_within_answer(self) -> None:
        """Lock waits end (error 1205, the transaction can be sent again) well before this session's
        read deadline would end the exchange: InnoDB's default wait is 50 s, central.timeout_s 10."""
        self.execute(f"SET SESSION innodb_lock_wait_timeout = {max(1, int(self.answer_s / 2))}")

    def require_current(self) -> None:
        version = self.schema_version()
        if version != SCHEMA_VERSION:
            have = "no slurm-gpu schema" if version is None else f"schema version {version}"
            raise CentralError(f"central server {self.target.describe()}: {have}, this slurm-gpu needs {SCHEMA_VERSION}",
                               "run `slurm-gpu central init` as the database admin"
                               + ("" if version is None or version < SCHEMA_VERSION else "; or upgrade slurm-gpu here"))

    def migrate(self, rollup_tz: str = "utc", progress: Optional[Callable[[int, int], None]] = None
                ) -> Tuple[Optional[int], int]:
        """Create or upgrade the schema: (version before, version after); on a current one, make
        the push's rollup procedures again.  `rollup_tz` ('utc' or 'local': this host's zone) cuts
        the rollups' days; `progress(done, total)` follows their build."""
        self.migrate_options = (rollup_tz, progress)
        before = self.schema_version()
        if before is not None and before > SCHEMA_VERSION:
            raise CentralError(f"central schema version {before} is newer than this slurm-gpu ({SCHEMA_VERSION})",
                               "upgrade slurm-gpu on this host")
        for v in range(before or 0, SCHEMA_VERSION):
            for stmt in MIGRATIONS[v]:
                stmt(self) if callable(stmt) else self.execute(stmt)
            self.execute("INSERT INTO meta (name, value) VALUES ('schema_version', %s) "
                         "ON DUPLICATE KEY UPDATE value = VALUES(value)", (str(v + 1),))
            self.commit()
        if before == SCHEMA_VERSION:
            # A release may improve the push's rollup statements (central/rollup_push.py) within a
            # schema version: they are made again here, and the nodes, which need the server's
            # version to be theirs, keep pushing without an upgrade.
            for ddl in rollup_push.procedures():
                self.execute(ddl)
            self.commit()
        return before, SCHEMA_VERSION


def grants(target: Target, writer: Optional[str] = None, reporter: str = "slurm_gpu_reporter",
           hosts: str = "%") -> List[str]:
    """The reporter's statements, and a writer's (placeholder password) when one is named.

    A writer may insert into the staging tables, run apply_batch and read the schema version:
    it can neither read nor change nor delete records, and since v4 apply_batch applies only
    rows of the (cluster, node)s `writer_nodes` gives it (central/writers.py, which also prints
    per-node accounts with their password hashes).  The reporter reads (and makes the session's
    temporary calendar table of day/week/month reports)."""
    db = target.database.replace("`", "``")
    out = [f"CREATE USER IF NOT EXISTS '{reporter}'@'{hosts}' IDENTIFIED BY '<reporter password>';",
           # Day/week/month reports join a temporary calendar table of the session.
           f"GRANT SELECT, SHOW VIEW, CREATE TEMPORARY TABLES ON `{db}`.* TO '{reporter}'@'{hosts}';"]
    if writer:
        sql = W.account_sql(target.database, writer, hosts, "<hash>", RECORD_TABLES)
        out += [f"CREATE USER IF NOT EXISTS '{writer}'@'{hosts}' IDENTIFIED BY '<writer password>';"] + sql[2:]
    return out


def job_rows(central: Central, cluster: str, job_id: int, restart: Optional[int] = None) -> List[Dict[str, Any]]:
    """A job's usage rows on the server (all restarts, or one): what a summary is built from."""
    cols = ("node", "gpu_index", "gpu_model", "start_time", "end_time", "gpu_util_mean_pct", "mem_util_mean_pct",
            "max_memory_bytes", "memory_total_bytes", "energy_j", "ecc_uncorrected_delta", "xid_events",
            "parent_gpu_uuid", "restart_count")
    sql = f"SELECT {_q(cols)} FROM job_gpus_current WHERE cluster = %s AND job_id = %s"
    params: Tuple[Any, ...] = (cluster, int(job_id))
    if restart is not None:
        sql += " AND restart_count = %s"
        params += (int(restart),)
    return [dict(zip(cols, row)) for row in central.execute(sql + " ORDER BY node, gpu_index", params)]


def remediation_history(central: Central, serial: str) -> List[Dict[str, Any]]:
    """One GPU's remediation attempts on every node (schema v7's procedure: a writer may call it)."""
    return [dict(zip(REMEDIATION_HISTORY_COLUMNS, row))
            for row in central.execute("CALL remediation_history(%s)", (serial,))]
