"""Reports from the central SQL server (`report --db mysql://...`): the same queries as on node files.

report/sql.py and report/plan.py write their SQL once, for SQLite and the server alike: double-quoted names and
`||` (the server's session runs with ANSI_QUOTES and PIPES_AS_CONCAT, central/server.py), and
the few spellings that differ come from the source (LEAST/GREATEST for two-argument MIN/MAX,
FLOOR, the calendar's temporary table).  This module adds the server's source: one read-only
transaction with a consistent snapshot, so a report is one committed state of the server
while nodes push, as it is of a node file while hooks write.
"""
from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from slurm_gpu.central.schema import SCHEMA_VERSION
from slurm_gpu.central.server import Central, is_url
from slurm_gpu.config import Config
from slurm_gpu.errors import CentralError
from slurm_gpu.report.query import Query
from slurm_gpu.report.sources import ReportSource

# Single-quoted SQL string literals ('' is an escaped quote): left alone by the translation.
_LITERAL = re.compile(r"'(?:[^']|'')*'")
_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def translate(sql: str, params: Union[Mapping[str, Any], Sequence[Any], None]) -> str:
    """SQLite's placeholders (:name, ?) as PyMySQL's (%(name)s, %s); a literal % doubled."""
    out = []
    pos = 0
    for m in _LITERAL.finditer(sql):
        out.append(_translate_code(sql[pos:m.start()], params))
        out.append(m.group(0).replace("%", "%%"))
        pos = m.end()
    out.append(_translate_code(sql[pos:], params))
    return "".join(out)


def _translate_code(code: str, params: Union[Mapping[str, Any], Sequence[Any], None]) -> str:
    code = code.replace("%", "%%")
    if isinstance(params, Mapping):
        return _NAMED.sub(r"%(\1)s", code)
    return code.replace("?", "%s")


def _plain(v: Any) -> Any:
    """SUM over integers comes back as Decimal: the report's arithmetic is float and int."""
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    return v


class _Cursor:
    """The rows of one statement, read at once (the server's result is complete when it returns)."""

    def __init__(self, description: Any, rows: Sequence[Tuple[Any, ...]]):
        self.description = description
        self._rows = [tuple(_plain(v) for v in row) for row in rows]

    def fetchone(self) -> Optional[Tuple[Any, ...]]:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> List[Tuple[Any, ...]]:
        return list(self._rows)

    def __iter__(self) -> Iterator[Tuple[Any, ...]]:
        return iter(self._rows)


class ServerConnection:
    """The slice of sqlite3.Connection that the report's planner uses, on the central server."""

    def __init__(self, central: Central):
        self.central = central

    def execute(self, sql: str, params: Union[Mapping[str, Any], Sequence[Any], None] = None) -> _Cursor:
        args: Union[Dict[str, Any], Tuple[Any, ...]] = dict(params) if isinstance(params, Mapping) else tuple(params or ())
        try:
            with self.central.conn.cursor() as cur:
                cur.execute(translate(sql, params), args)
                return _Cursor(cur.description, cur.fetchall() if cur.description else ())
        except Exception as e:
            raise self.central.error(e) from None

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        try:
            with self.central.conn.cursor() as cur:
                cur.executemany(translate(sql, ()), [tuple(r) for r in rows])
        except Exception as e:
            raise self.central.error(e) from None


TEMP_TABLE_BYTES = 64 << 20  # a report session's in-memory temporary tables (the server's default: 16 MB)


class CentralSource(ReportSource):
    """The cluster's records on the central server, read as a node file is (report/sources.py)."""

    LEAST, GREATEST = "LEAST", "GREATEST"
    PLUS = ""  # the server's planner needs no hint (and a unary plus on a name would be a no-op)
    SPAN = '"span_s"'  # MariaDB 10.11 uses an index on a virtual column only when the query names it

    def __init__(self, central: Central, query: Query):
        self.central = central
        self.query = query
        self.conn = ServerConnection(central)
        self.table = "job_gpus_current"  # without the rows nodes withdrew
        self.files = [central.target.describe()]
        version = central.schema_version()
        if version is None:
            raise CentralError(f"central server {central.target.describe()}: no slurm-gpu schema",
                               "run `slurm-gpu central init` there first, then `slurm-gpu db push` on the nodes")
        if version > SCHEMA_VERSION:
            raise CentralError(f"central server {central.target.describe()}: schema version {version} is newer "
                               f"than this slurm-gpu ({SCHEMA_VERSION})", "upgrade slurm-gpu on this host")
        self.replica_note = replica_note(central, version)
        # A rollup plan's per-day derived tables (a year of rollup_partition_day: 8,760 rows of four
        # VARCHAR(255) names and thirteen DECIMALs, ~22 MB as MEMORY's fixed-width rows) went to
        # disk past the default 16 MB, which doubled their cost; 64 MB keeps them in memory.
        self.conn.execute(f"SET SESSION max_heap_table_size = {TEMP_TABLE_BYTES}, tmp_table_size = {TEMP_TABLE_BYTES}")
        # One snapshot for every query of the report, however many nodes push meanwhile.
        self.conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        self.conn.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")

    def floor(self, expr: str) -> str:
        return f"FLOOR({expr})"

    def has_actions(self) -> bool:
        return (self.central.schema_version() or 0) >= 12  # efficiency_actions (central schema v12)

    def covering_keys(self) -> FrozenSet[str]:
        return frozenset()  # the server's planner picks its own indexes; the summary's own plan is the rollups

    def use_end_index(self) -> bool:
        return False  # (the server's planner decides; SQLite's needs the hint)

    def parallel_connect(self) -> None:
        return None  # the snapshot lives in this session's one transaction

    def unchanged(self) -> bool:
        return True  # one transaction with a consistent snapshot: pushes meanwhile are not seen

    def summary_rows(self, by: Sequence[str]) -> Optional[List[Dict[str, Any]]]:
        from slurm_gpu.report.rollup import summary_rows
        return summary_rows(self, by)

    def install_calendar(self, conn: Any, buckets: Sequence[Tuple[float, float, str]]) -> None:
        try:
            conn.execute("DROP TEMPORARY TABLE IF EXISTS cal")
            conn.execute("CREATE TEMPORARY TABLE cal (idx INT NOT NULL, b_start DOUBLE NOT NULL, b_end DOUBLE NOT NULL, "
                         "label VARCHAR(64) NOT NULL, KEY (b_start)) ENGINE=MEMORY")
        except CentralError as e:
            if getattr(e, "driver_code", None) != 1044:
                raise
            t = self.central.target
            raise CentralError(f"central server {t.describe()}: {t.user} may not create the temporary calendar table "
                               "of a day/week/month report",
                               f"GRANT CREATE TEMPORARY TABLES ON `{t.database}`.* TO '{t.user}' "
                               "(as `slurm-gpu central init` prints)") from None
        conn.executemany("INSERT INTO cal VALUES (?, ?, ?, ?)", [(i,) + tuple(b) for i, b in enumerate(buckets)])

    def close(self) -> None:
        self.central.rollback()
        self.central.close()


def replica_note(central: Central, version: int) -> Optional[str]:
    """One line when the server is a replica (read_only, or running replication threads): how old
    its newest push is (schema v13's push_clock, in the primary's time, replicated), so a report
    there says how far behind it may be.  Reads only what any account may: a variable, the global
    status and a table the reporter SELECTs.  None on a primary, a Galera node or a lone server."""
    try:
        read_only = int(central.execute("SELECT @@read_only")[0][0] or 0)
        status = {str(k).lower(): str(v) for k, v in central.execute("SHOW GLOBAL STATUS LIKE 'Slave%running'")}
    except CentralError:
        return None  # a server without these (not MariaDB/MySQL as we know it): no note
    threads = int(status.get("slaves_running", "0") or 0)
    if not read_only and not threads:
        return None
    where = central.target.describe()
    applying = "" if threads else " whose replication is not applying changes"
    if version < 13:
        return (f"central server {where} is a replica{applying}; its schema (v{version}) records no push times: "
                "run `slurm-gpu central init` on the primary to see how far behind it is")
    newest, now = central.execute("SELECT MAX(pushed_at), UNIX_TIMESTAMP(NOW(6)) FROM push_clock")[0]
    if newest is None:
        return f"central server {where} is a replica{applying}: no push has reached it yet (pushes reach the primary first)"
    age = max(0.0, float(now) - float(newest))
    text = f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.1f} h"
    return (f"central server {where} is a replica{applying}: its newest push is {text} old "
            "(pushes reach the primary first; a report there has them all)")


def is_central(dbs: Sequence[str]) -> bool:
    """--db names the central server: one URL, or the word 'central' (central.url of the config)."""
    return any(d == "central" or is_url(d) for d in dbs)


def read_central(cfg: Config, dbs: Sequence[str], query: Query, fn: Callable[[CentralSource], Any],
                 password_file: Optional[str] = None) -> Any:
    """fn(source) on the central server named by --db."""
    if len(dbs) != 1:
        from slurm_gpu.errors import InputError
        raise InputError("--db: a central server cannot be combined with other sources",
                         "report from the server alone (it holds every pushed node), or from node files")
    url = None if dbs[0] == "central" else dbs[0]
    central = Central.from_config(cfg, url, password_file, long_queries=True)
    try:
        src = CentralSource(central, query)
    except BaseException:
        central.close()
        raise
    with src:
        return fn(src)
