"""Fleet data from the central server: gpu_inventory (latest and history), xid_events, and the
nodes whose latest driver/library mismatch event (health_events) is newer than their inventory.

One consistent snapshot (REPEATABLE READ, START TRANSACTION WITH CONSISTENT SNAPSHOT) for all
queries of a view, as `report --db` does, while nodes push.  Schema v2 or later is needed.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.central.server import Central
from slurm_gpu.errors import CentralError, InputError, mismatch_versions
from slurm_gpu.fleet.model import COUNTERS, Gpu, Mismatch, Point
from slurm_gpu.store.apply import MISMATCH_CHECK

FLEET_SCHEMA = 2
_GPU_COLUMNS = ("node", "gpu_uuid", "time", "gpu_index", "serial", "model", "vbios", "driver_version",
                "cuda_version", "mig_mode") + COUNTERS


def open_snapshot(central: Central) -> None:
    """Check the schema and start the one consistent read of this view."""
    version = central.schema_version()
    where = central.target.describe()
    if version is None:
        raise CentralError(f"central server {where}: no slurm-gpu schema",
                           "run `slurm-gpu central init` there, then `slurm-gpu db push` on the nodes")
    if version < FLEET_SCHEMA:
        raise CentralError(f"central server {where}: schema version {version} has no GPU inventories (needs {FLEET_SCHEMA})",
                           "run `slurm-gpu central init` as the database admin (it migrates), then grant the printed GRANTs")
    central.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    central.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")


def choose_cluster(central: Central, wanted: str) -> str:
    """The cluster to read: `wanted`, or the only one on the server."""
    rows = central.execute("SELECT DISTINCT cluster FROM gpu_inventory UNION SELECT DISTINCT cluster FROM xid_events")
    have = sorted(str(r[0]) for r in rows)
    if wanted:
        return wanted
    if len(have) > 1:
        raise InputError(f"the central server holds several clusters ({', '.join(have)})",
                         "choose one with --cluster NAME (or set cluster_name in the config)")
    return have[0] if have else ""


def _q(cols: Sequence[str]) -> str:
    return ", ".join(f'g."{c}"' for c in cols)


def latest(central: Central, cluster: str) -> List[Gpu]:
    """The newest observation of every GPU UUID each node ever reported."""
    sql = (f"SELECT {_q(_GPU_COLUMNS)} FROM gpu_inventory g JOIN "
           "(SELECT node, gpu_uuid, MAX(time) AS t FROM gpu_inventory WHERE cluster = %s AND withdrawn = 0 "
           " GROUP BY node, gpu_uuid) m "
           "ON g.cluster = %s AND g.node = m.node AND g.gpu_uuid = m.gpu_uuid AND g.time = m.t "
           "ORDER BY g.node, g.gpu_index, g.time")
    out = []
    for row in central.execute(sql, (cluster, cluster)):
        d = dict(zip(_GPU_COLUMNS, row))
        out.append(Gpu(node=d["node"], uuid=d["gpu_uuid"], time=float(d["time"]), index=d["gpu_index"],
                       serial=d["serial"], model=d["model"], vbios=d["vbios"], driver_version=d["driver_version"],
                       cuda_version=d["cuda_version"], mig_mode=d["mig_mode"],
                       counters={c: (None if d[c] is None else int(d[c])) for c in COUNTERS}))
    return out


def history(central: Central, cluster: str, since: float, until: float) -> Dict[Tuple[str, str], List[Point]]:
    """Each GPU's correctable ECC counters observed in [since, until], oldest first."""
    sql = ("SELECT node, gpu_uuid, time, serial, ecc_corrected_aggregate, ecc_corrected_volatile FROM gpu_inventory "
           "WHERE cluster = %s AND withdrawn = 0 AND time >= %s AND time <= %s ORDER BY node, gpu_uuid, time")
    out: Dict[Tuple[str, str], List[Point]] = {}
    for node, uuid, t, serial, agg, vol in central.execute(sql, (cluster, since, until)):
        out.setdefault((node, uuid), []).append(
            Point(float(t), serial, None if agg is None else int(agg), None if vol is None else int(vol)))
    return out


def xid_events(central: Central, cluster: str, since: Optional[float], until: float) -> List[Dict[str, Any]]:
    """XID events of the cluster in the window, oldest first.  A flood (one row of line_count identical
    lines, schema v12) is in the window when any of its lines is, and comes whole."""
    cols = ("node", "time", "gpu_index", "gpu_uuid", "pci_bus_id", "xid", "detail", "line_count", "last_time")
    sql = (f"SELECT {', '.join(cols)} FROM xid_events WHERE cluster = %s AND withdrawn = 0 AND time <= %s"
           + (" AND COALESCE(last_time, time) >= %s" if since is not None else "") + " ORDER BY time, node")
    params: Tuple[Any, ...] = (cluster, until) + ((since,) if since is not None else ())
    return [dict(zip(cols, row)) for row in central.execute(sql, params)]


def mismatches(central: Central, cluster: str) -> Dict[str, Mismatch]:
    """Nodes in the driver/library mismatch state: their latest mismatch event is newer than
    their latest gpu_inventory row (a node fixed since has written rows after it)."""
    sql = ("SELECT e.node, e.time, e.message FROM health_events e WHERE e.cluster = %s AND e.withdrawn = 0 "
           "AND e.check_name = %s AND e.time > COALESCE((SELECT MAX(g.time) FROM gpu_inventory g "
           "WHERE g.cluster = e.cluster AND g.node = e.node AND g.withdrawn = 0), -1) ORDER BY e.node, e.time")
    out: Dict[str, Mismatch] = {}
    for node, t, message in central.execute(sql, (cluster, MISMATCH_CHECK)):
        kernel, library = mismatch_versions(str(message)) or ("", "")
        out[str(node)] = Mismatch(str(node), kernel, library, float(t))  # ordered by time: the latest wins
    return out


REMEDIATION_SCHEMA = 7


def remediations(central: Central, cluster: str) -> List[Dict[str, Any]]:
    """Every remediation attempt of the cluster's nodes (all clusters when cluster is ''), oldest first."""
    from slurm_gpu.central.schema import REMEDIATION_HISTORY_COLUMNS
    version = central.schema_version() or 0
    if version < REMEDIATION_SCHEMA:
        raise CentralError(f"central server {central.target.describe()}: schema version {version} has no remediation "
                           f"attempts (needs {REMEDIATION_SCHEMA})",
                           "run `slurm-gpu central init` as the database admin (it migrates), then the GRANTs it prints")
    cols = ", ".join(f'"{c}"' for c in REMEDIATION_HISTORY_COLUMNS)
    sql = f"SELECT {cols} FROM remediations WHERE withdrawn = 0" + (" AND cluster = %s" if cluster else "") \
        + " ORDER BY time, node, id"
    return [dict(zip(REMEDIATION_HISTORY_COLUMNS, row)) for row in central.execute(sql, (cluster,) if cluster else ())]
