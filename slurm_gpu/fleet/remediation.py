"""`fleet remediation`: every GPU's remediation history by serial, across nodes (docs/fleet.md).

Built from `remediations` rows (node schema v7+, central schema v7+: dicts with node, id, time,
gpu_index, gpu_uuid, serial, fault_check, fault, action, outcome, detail, drain_time, finished)
from the central server or from node databases.  A GPU is its serial: one moved to another node
keeps its history.  The lemons are remediation/budget.py's rule applied to the rows, the time from
drain to verified resume is finished - drain_time of the attempts that resumed the node.
"""
from __future__ import annotations

import glob
import os
import sqlite3
import statistics
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from slurm_gpu.errors import InputError, StoreError
from slurm_gpu.fleet.model import names
from slurm_gpu.remediation import budget as B
from slurm_gpu.store.liveread import FileRead, SourceChanged, connect, reread
from slurm_gpu.store.schema import REMEDIATION_COLUMNS

BY = ("serial", "fault")
COLUMNS = {
    "serial": ("serial", "nodes", "node", "gpu_index", "gpu_uuid", "faults", "attempts", "resets", "reboots", "rma",
               "outcomes", "state", "last", "lemon", "lemon_why"),
    "fault": ("fault_check", "attempts", "resumed", "escalated", "failed", "rma", "resumes_timed", "mean_drain_to_resume_s",
              "median_drain_to_resume_s"),
}
TABLE_COLUMNS = {
    "serial": ("serial", "nodes", "gpu_index", "faults", "resets", "reboots", "rma", "outcomes", "state", "last", "lemon"),
    "fault": COLUMNS["fault"],
}
NO_SERIAL = "(no serial)"  # a node-wide step (a reboot for a fault that names no GPU)

# The state of a GPU is its latest attempt's: what an admin does next.
_STATE = {"resumed": "resumed", "started": "pending", "escalated": "pending", "requested": "reboot pending",
          "failed": "failed: drained", "refused": "refused: drained for a human",
          "busy": "busy: drained, retried", "interrupted": "interrupted: drained"}


def _iso(t: Optional[float]) -> Optional[str]:
    return None if t is None else datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def state_of(row: Dict[str, Any]) -> str:
    if row.get("action") == "rma" or row.get("outcome") == "rma":
        return "RMA"
    return _STATE.get(str(row.get("outcome")), str(row.get("outcome")))


def dedupe(rows: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per attempt (node, id, time: a reimaged node's new database reuses ids), the one written
    last (finished, else time) winning; oldest first."""
    best: Dict[Tuple[str, Any, float], Dict[str, Any]] = {}
    for r in rows:
        key = (str(r.get("node")), r.get("id"), float(r.get("time") or 0.0))
        have = best.get(key)
        if have is None or (r.get("finished") or 0.0) >= (have.get("finished") or 0.0):
            best[key] = r
    return sorted(best.values(), key=lambda r: (float(r.get("time") or 0.0), str(r.get("node")), r.get("id") or 0))


def attempts(rows: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """dedupe()'s rows without the node-wide steps of verification jobs (action verify, no GPU): those are
    how an episode ended, not a GPU's attempt; a verification that failed on a GPU has a row of that GPU."""
    return [r for r in dedupe(rows) if not (r.get("action") == "verify" and r.get("gpu_index") is None)]


def _counts(rows: Sequence[Dict[str, Any]]) -> str:
    seen: Dict[str, int] = {}
    for r in rows:
        seen[str(r.get("outcome"))] = seen.get(str(r.get("outcome")), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))


def by_serial(rows: Iterable[Dict[str, Any]], budget: B.Budget, now: float,
              xids: Iterable[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """One row per GPU serial: where it was, its faults, remedies, outcomes, current state, lemon.
    xids: xid_events rows (node, gpu_uuid, xid, time, last_time); a GPU's bursts are those its latest
    node recorded for its UUID, as `remediate` on that node counts them."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in attempts(rows):
        groups.setdefault(str(r.get("serial") or NO_SERIAL), []).append(r)
    bursts: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for x in xids:
        if x.get("gpu_uuid"):
            bursts.setdefault((str(x["node"]), str(x["gpu_uuid"])), []).append(x)
    out = []
    for serial, rs in groups.items():
        last = rs[-1]
        mine = bursts.get((str(last["node"]), str(last.get("gpu_uuid") or "")), [])
        lemon, why = B.is_lemon(budget, rs, now, mine) if serial != NO_SERIAL else (False, "")
        rma_lemon = [r for r in rs if r.get("action") == "rma" and "lemon" in str(r.get("detail") or "")]
        if rma_lemon and not lemon:
            lemon, why = True, str(rma_lemon[-1].get("detail"))
        issued = [r for r in rs if r.get("outcome") in B.ISSUED]
        out.append({"serial": serial, "nodes": names(str(r["node"]) for r in rs), "node": last["node"],
                    "gpu_index": last.get("gpu_index"), "gpu_uuid": last.get("gpu_uuid") or None,
                    "faults": ",".join(sorted({str(r.get("fault_check")) for r in rs if r.get("fault_check")})),
                    "attempts": len(rs), "resets": sum(1 for r in issued if r.get("action") == "reset"),
                    "reboots": sum(1 for r in issued if r.get("action") == "reboot"),
                    "rma": sum(1 for r in rs if r.get("action") == "rma"), "outcomes": _counts(rs),
                    "state": state_of(last), "last": _iso(last.get("time")), "lemon": "yes" if lemon else "no",
                    "lemon_why": why or None})
    out.sort(key=lambda r: (r["lemon"] != "yes", r["state"] != "RMA", r["serial"]))
    return out


def by_fault(rows: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per fault class (check): attempts and outcomes, and the mean and median time from the
    drain to the verified resume over the episodes (node, drain time) that resumed."""
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in attempts(rows):
        groups.setdefault(str(r.get("fault_check") or "(none)"), []).append(r)
    out = []
    for check, rs in sorted(groups.items()):
        episodes: Dict[Tuple[str, float], float] = {}
        for r in rs:
            if r.get("outcome") == "resumed" and r.get("drain_time") is not None and r.get("finished") is not None:
                key = (str(r["node"]), float(r["drain_time"]))
                episodes[key] = max(episodes.get(key, 0.0), float(r["finished"]) - float(r["drain_time"]))
        spans = list(episodes.values())
        out.append({"fault_check": check, "attempts": len(rs),
                    **{k: sum(1 for r in rs if r.get("outcome") == k) for k in ("resumed", "escalated", "failed")},
                    "rma": sum(1 for r in rs if r.get("action") == "rma"), "resumes_timed": len(spans),
                    "mean_drain_to_resume_s": round(statistics.mean(spans), 1) if spans else None,
                    "median_drain_to_resume_s": round(statistics.median(spans), 1) if spans else None})
    return out


def lemons(view: Sequence[Dict[str, Any]]) -> List[str]:
    return [r["serial"] for r in view if r.get("lemon") == "yes"]


# --------------------------------------------------------------------------- node databases

def node_files(paths: Sequence[str]) -> List[str]:
    """Node database files as given; a directory gives its *.db files."""
    out: List[str] = []
    for p in paths:
        found = sorted(glob.glob(os.path.join(glob.escape(p), "*.db"))) if os.path.isdir(p) else [p]
        if not found or not os.path.exists(found[0]):
            raise InputError(f"--node-db {p}: no such file, or a directory without *.db files",
                             "give node databases (store.database of each node) or a directory of them")
        out.extend(found)
    return out


def node_rows(path: str) -> List[Dict[str, Any]]:
    """The remediations rows of one node database, read-only and consistently; [] before schema v7."""
    return _node_read(path, "SELECT id, " + ", ".join(REMEDIATION_COLUMNS) + " FROM remediations ORDER BY time, id",
                      (), "remediations")


def node_xids(path: str, since: float) -> List[Dict[str, Any]]:
    """The xid_events rows (node, gpu_uuid, xid, time, last_time) of one node database whose last line is
    at or after since: the lemon rule's bursts."""
    return _node_read(path, "SELECT node, gpu_uuid, xid, time, last_time FROM xid_events "
                            "WHERE COALESCE(last_time, time) >= ? ORDER BY time", (since,), "XID events")


def _node_read(path: str, sql: str, params: Tuple[Any, ...], what: str) -> List[Dict[str, Any]]:
    def once(live: bool) -> List[Dict[str, Any]]:
        reading = FileRead(path, live=live)
        conn = connect(reading.uri, path)
        try:
            try:
                cur = conn.execute(sql, params)
                rows = [dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()]
            except sqlite3.DatabaseError as e:
                if not reading.unchanged():
                    raise SourceChanged(path) from None
                if "no such table" in str(e) or "no such column" in str(e):
                    return []
                raise StoreError(f"{path}: cannot read its {what} ({e})", "`slurm-gpu db check --database FILE`") from None
            if not reading.unchanged():
                raise SourceChanged(path)
            return rows
        finally:
            conn.close()
            reading.release()
    return reread(once, lambda: StoreError(f"{path}: kept changing while it was read", "run the command again"))
