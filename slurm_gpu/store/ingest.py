"""The node database's spool: records the database could not take, kept as files until it can.

`Store.spool` writes a record into the spool directory (or, when the database refused the record
itself, into ``<spool>/quarantine/``); `Store.ingest` moves spooled records into the database,
claiming each file by renaming it first and quarantining what the database refuses or what an
unprivileged user could have written; `Store.replay` takes records recovered from a hook log;
`Store.spool_status` is what `slurm-gpu db check` reports.  These are `SpoolIngest`'s, the part of
Store (store/node.py, which keeps the database itself) that handles the spool; the spool files
themselves are opened through store/spool.py.
"""
from __future__ import annotations

import os
import re
import sqlite3
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Tuple

from slurm_gpu.errors import StoreError
from slurm_gpu.store.apply import Incomplete, apply_in_transaction
from slurm_gpu.store.diagnose import describe_error
from slurm_gpu.store.record import KINDS, drains_of
from slurm_gpu.store.spool import (
    CLAIM,
    NAME,
    QUARANTINE,
    STALE_CLAIM_S,
    TMP,
    Untrusted,
    age_s,
    exists,
    open_dir,
    pid_gone,
    quarantine_reason,
    read_json,
    reclaim,
    waiting,
    write_file,
)


def is_record_problem(e: BaseException) -> bool:
    """True when the database works but refuses this record: retrying it later cannot help."""
    if isinstance(e, (sqlite3.IntegrityError, sqlite3.DataError)):
        return True
    if isinstance(e, (sqlite3.Error, OSError, StoreError)):
        return False  # the database (or the disk) is the problem: the record waits in the spool
    return isinstance(e, Exception)  # KeyError, TypeError, AttributeError, ValueError: a malformed record


def _read_record(dfd: int, name: str) -> Dict[str, Any]:
    """A spool file's record (spool.read_json's checks first); ValueError when it is no record."""
    rec = read_json(dfd, name)
    if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
        raise ValueError(f"not a record (kind {rec.get('kind') if isinstance(rec, dict) else type(rec).__name__!r})")
    return rec


def _record_job_id(rec: Dict[str, Any]) -> Optional[int]:
    try:
        kind = rec["kind"]
        if kind == "job_start":
            j = rec["starts"][0]["job_id"]
        elif kind == "job_end":
            j = rec["job"]["job_id"]
        elif kind == "health":
            j = rec["events"][0]["job_id"]
        else:
            j = drains_of(rec)[0]["job_id"]
        return j if isinstance(j, int) and not isinstance(j, bool) and j >= 0 else None
    except (KeyError, IndexError, TypeError):
        return None


class IngestReport:
    """What one pass over the spool did."""

    def __init__(self) -> None:
        self.done = 0
        self.problems: List[str] = []  # one line each, quarantines included
        self.quarantined: List[Tuple[str, str]] = []  # (file, why)
        self.reclaimed = 0  # stranded claims and orphaned temp files put back
        self.left = 0  # files still waiting (a bound was reached or the database stopped taking writes)
        self.total = 0  # files waiting when the pass began (stranded claims put back included)
        self.refused: Optional[StoreError] = None  # the spool directory itself was refused or unusable


class SpoolStatus:
    """What `slurm-gpu db check` reports about the spool directory."""

    def __init__(self) -> None:
        self.waiting: List[str] = []
        self.live_claims: List[str] = []
        self.stale_claims: List[str] = []
        self.orphaned_tmp: List[str] = []
        self.bad: List[str] = []
        self.quarantined: List[Tuple[str, str]] = []  # (file, why it is there, as far as it shows)
        self.problem = ""  # the directory itself cannot be used
        self.hint = ""


class SpoolIngest:
    """Store's spool: its records written, ingested, replayed, and its state (Store supplies the database)."""

    path: str
    spool_dir: str
    unavailable: str

    if TYPE_CHECKING:  # Store's (store/node.py)
        def connect(self) -> sqlite3.Connection: ...

        def _failed(self, e: BaseException) -> str: ...

    # -- writing into the spool ----------------------------------------------------------------
    def _spool_name(self, record: Dict[str, Any]) -> str:
        job = _record_job_id(record)
        return f"{time.time_ns()}-{os.getpid()}-{'' if job is None else f'j{job}-'}{record['kind']}.json"

    def spool(self, record: Dict[str, Any], reason: str = "", quarantine: bool = False) -> str:
        rec = dict(record)
        rec["_spooled_at"] = time.time()
        rec["_spool_reason"] = reason[:500]
        name = self._spool_name(record)
        import json
        try:
            data = json.dumps(rec, sort_keys=True, default=str).encode("ascii")
            dfd = open_dir(self.spool_dir, 0o700)
            try:
                target = dfd
                if quarantine:
                    target = open_dir(QUARANTINE, 0o700, dir_fd=dfd)
                try:
                    write_file(target, name, data)
                finally:
                    if target != dfd:
                        os.close(target)
            finally:
                os.close(dfd)
        except StoreError as e:
            raise StoreError(f"cannot write {self.path} ({reason}) nor spool: {e.message}", e.hint) from None
        except (OSError, ValueError, TypeError) as e:
            why = describe_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            raise StoreError(f"cannot write {self.path} ({reason}) nor spool to {self.spool_dir}: {why}",
                             "free disk space or fix permissions; the record is in the hook log "
                             "(`slurm-gpu db ingest --from-log FILE` replays it)") from None
        return os.path.join(self.spool_dir, QUARANTINE, name) if quarantine else os.path.join(self.spool_dir, name)

    # -- the spool into the database ----------------------------------------------------------
    def _spool_fd(self) -> Optional[int]:
        """The spool directory's descriptor, or None when there is none yet."""
        try:
            return open_dir(self.spool_dir, create=False)
        except FileNotFoundError:
            return None

    def spooled(self) -> List[str]:
        """Records waiting in the spool (paths, oldest first).  Raises StoreError for an unsafe spool."""
        dfd = self._spool_fd()
        if dfd is None:
            return []
        try:
            return [os.path.join(self.spool_dir, n) for n in waiting(dfd)]
        finally:
            os.close(dfd)

    def ingest_spool(self) -> Tuple[int, List[str]]:
        """Move every spooled record into the database.  Returns (ingested, problems)."""
        rep = self.ingest()
        return rep.done, rep.problems

    def ingest(self, max_files: Optional[int] = None, max_seconds: Optional[float] = None) -> IngestReport:
        """Move spooled records into the database, oldest first, within the bounds given.

        Each file is claimed by renaming it first, so concurrent ingests never take the same
        file twice; claims left by a process that died are put back first.  A file the
        database refuses, or that is not root's own, is quarantined and the next one follows;
        when the database stops taking writes the rest waits for the next ingest.
        """
        rep = IngestReport()
        try:
            dfd = self._spool_fd()
        except (StoreError, OSError) as e:
            rep.refused = e if isinstance(e, StoreError) else StoreError(f"{self.spool_dir}: {describe_error(e)}",
                                                                         "run as root")
            rep.problems.append(rep.refused.message)
            return rep
        if dfd is None:
            return rep
        try:
            return self._ingest_from(dfd, rep, max_files, max_seconds)
        except OSError as e:  # the spool directory itself misbehaves (permissions, I/O error)
            rep.problems.append(f"{self.spool_dir}: {describe_error(e)}")
            return rep
        finally:
            os.close(dfd)

    def _ingest_from(self, dfd: int, rep: IngestReport, max_files: Optional[int],
                     max_seconds: Optional[float]) -> IngestReport:
        rep.reclaimed = reclaim(dfd)
        names = waiting(dfd)
        rep.total = len(names)
        if not names:
            return rep
        if self.unavailable:
            rep.left = len(names)
            return rep
        try:
            conn = self.connect()
        except Exception as e:
            rep.problems.append(f"{self.path}: {self._failed(e)}")
            rep.left = len(names)
            return rep
        end = None if max_seconds is None else time.monotonic() + max_seconds
        for i, name in enumerate(names):
            if (max_files is not None and i >= max_files) or (end is not None and time.monotonic() > end):
                rep.left = len(names) - i
                break
            if not self._ingest_one(dfd, conn, name, rep):
                rep.left = len(names) - i
                break
        return rep

    def _ingest_one(self, dfd: int, conn: sqlite3.Connection, name: str, rep: IngestReport) -> bool:
        """One spool file; False when the database stopped taking writes."""
        claim = f".{name}.{os.getpid()}.claim"
        try:
            os.rename(name, claim, src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            return True  # another process claimed it
        try:
            rec = _read_record(dfd, claim)
        except Untrusted as e:
            self._quarantine(dfd, claim, name, str(e), rep)
            return True
        except (OSError, ValueError) as e:
            bad = name + ".bad"
            os.rename(claim, bad, src_dir_fd=dfd, dst_dir_fd=dfd)
            rep.problems.append(f"{name}: unreadable ({e}); kept as {bad}")
            return True
        try:
            apply_in_transaction(conn, rec)
        except Exception as e:
            if is_record_problem(e):
                self._quarantine(dfd, claim, name, f"refused by the database: {describe_error(e)}", rep)
                return True
            os.rename(claim, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            rep.problems.append(f"{name}: {self._failed(e)}")
            return False
        os.unlink(claim, dir_fd=dfd)
        rep.done += 1
        return True

    def _quarantine(self, dfd: int, claim: str, name: str, why: str, rep: IngestReport) -> None:
        where = f"{os.path.join(self.spool_dir, QUARANTINE, name)}"
        try:
            qfd = open_dir(QUARANTINE, 0o700, dir_fd=dfd)
            try:
                target = name
                if exists(qfd, target):
                    target = f"{time.time_ns()}-{name}"
                    where = os.path.join(self.spool_dir, QUARANTINE, target)
                os.rename(claim, target, src_dir_fd=dfd, dst_dir_fd=qfd)
            finally:
                os.close(qfd)
        except (OSError, StoreError) as e:
            # No quarantine directory: keep it aside in the spool, never retried, never lost.
            os.rename(claim, name + ".bad", src_dir_fd=dfd, dst_dir_fd=dfd)
            where = os.path.join(self.spool_dir, name + ".bad")
            why += f" (quarantine unusable: {e.message if isinstance(e, StoreError) else describe_error(e)})"
        rep.quarantined.append((name, why))
        rep.problems.append(f"{name}: {why}; quarantined as {where}")

    def replay(self, records: Iterable[Dict[str, Any]]) -> IngestReport:
        """Records recovered from a log (`db ingest --from-log`): idempotent, like every write."""
        rep = IngestReport()
        conn = self.connect()
        for n, rec in enumerate(records, 1):
            if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
                rep.problems.append(f"record {n}: not a record")
                continue
            try:
                apply_in_transaction(conn, rec)
            except Exception as e:
                if not is_record_problem(e):
                    raise
                rep.problems.append(f"record {n} ({rec.get('kind')}): refused by the database: {describe_error(e)}")
                continue
            rep.done += 1
        return rep

    def spool_status(self) -> SpoolStatus:
        out = SpoolStatus()
        try:
            dfd = self._spool_fd()
        except StoreError as e:
            out.problem, out.hint = e.message, e.hint
            return out
        except OSError as e:
            out.problem, out.hint = f"{self.spool_dir}: {describe_error(e)}", "run as root"
            return out
        if dfd is None:
            return out
        try:
            for n in sorted(os.listdir(dfd)):
                m = re.match(CLAIM, n)
                t = re.match(TMP, n)
                if n.endswith(".json") and not n.startswith("."):
                    out.waiting.append(n)
                elif m:
                    stale = pid_gone(int(m.group(2))) or age_s(dfd, n) > STALE_CLAIM_S
                    (out.stale_claims if stale else out.live_claims).append(n)
                elif t:
                    if pid_gone(int(t.group(3))):
                        out.orphaned_tmp.append(n)
                elif n.endswith(".bad"):
                    out.bad.append(n)
            try:
                qfd = open_dir(QUARANTINE, create=False, dir_fd=dfd)
            except FileNotFoundError:
                qfd = None
            except (StoreError, OSError) as e:
                out.problem = e.message if isinstance(e, StoreError) else f"{QUARANTINE}: {describe_error(e)}"
                qfd = None
            if qfd is not None:
                try:
                    out.quarantined = [(n, quarantine_reason(qfd, n)) for n in sorted(os.listdir(qfd))]
                finally:
                    os.close(qfd)
        finally:
            os.close(dfd)
        return out

    # -- a job's records still in the spool (Store.find_start) ---------------------------------
    def _spooled_records_of(self, job_id: int, kinds: Tuple[str, ...], budget_s: float) -> Iterator[Dict[str, Any]]:
        dfd = self._spool_fd()
        if dfd is None:
            return
        end = time.monotonic() + budget_s
        try:
            for n in waiting(dfd):
                m = re.match(NAME, n)
                if m is None or m.group(4) not in kinds or (m.group(3) is not None and int(m.group(3)) != job_id):
                    continue
                if time.monotonic() > end:  # a backlog of files named without job ids (older versions)
                    raise Incomplete(f"spool {self.spool_dir} not searched to the end within {budget_s:g} s")
                try:
                    yield _read_record(dfd, n)
                except (OSError, ValueError, Untrusted):
                    continue  # claimed meanwhile, or not ours: never trusted
        finally:
            os.close(dfd)
