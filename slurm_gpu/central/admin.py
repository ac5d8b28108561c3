"""What `db push` and `central annotate` ask of the node database and of the central server
(cli/central.py only prints): the node database as push's outbox (opened, its cluster, its
backlog, shipped, closed) and the jobs that have records on the server."""
from __future__ import annotations

import os
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

from slurm_gpu.central import push as P
from slurm_gpu.config import Config
from slurm_gpu.errors import InputError
from slurm_gpu.store.maintenance import latest_job_cluster
from slurm_gpu.store.node import Store


class Outbox:
    """A node database opened for `db push` (store.database, or --db); close() or a with-block closes it."""

    def __init__(self, cfg: Config, database: Optional[str] = None):
        self._store = Store.from_config(cfg, database)
        self.path = self._store.path
        if not os.path.lexists(self.path):
            raise InputError(f"no database at {self.path}",
                             "nothing has been recorded on this node yet, or --db names another file")
        self._conn = self._store.connect()

    def __enter__(self) -> "Outbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._store.close()

    def backlog(self) -> P.Backlog:
        return P.backlog(self._conn)

    def last_push_time(self) -> Optional[float]:
        return P.last_push_time(self._conn)

    def lock(self) -> ContextManager[None]:
        """One push of this database at a time (P.PushBusy when another holds it)."""
        return P.push_lock(self.path)

    def cluster(self, cfg: Config) -> str:
        """The cluster name for health events and drains, which the node database keeps without it."""
        name = configured_cluster(cfg) or latest_job_cluster(self._conn)
        if name:
            return name
        raise InputError("cannot tell this node's cluster name", "set cluster_name in the config")

    def push(self, srv: Any, cluster: str, batch_size: int, max_seconds: Optional[float],
             progress: Callable[[int], None]) -> P.PushResult:
        return P.Pusher(self._conn, srv, cluster, batch_size, max_seconds, progress=progress).run()


def configured_cluster(cfg: Config) -> str:
    """cluster_name, else SLURM_CLUSTER_NAME, else slurm.conf's ClusterName; '' when none says."""
    return cfg.cluster_name or os.environ.get("SLURM_CLUSTER_NAME", "") or slurm_conf_cluster(
        os.environ.get("SLURM_CONF") or cfg.slurm_conf)


def slurm_conf_cluster(path: str) -> str:
    """ClusterName= of slurm.conf, '' when unreadable or absent."""
    from slurm_gpu.slurm.conf import GresConfigError, config_lines
    try:
        for _where, line in config_lines(path):
            key, _, value = line.partition("=")
            if key.strip().lower() == "clustername":
                return value.split()[0].strip('"') if value.split() else ""
    except GresConfigError:
        pass
    return ""


def jobs_with_records(srv: Any, since_s: Optional[float], job_ids: Sequence[int]) -> List[Tuple[str, int, int]]:
    """(cluster, job id, latest restart) of the jobs with records on the server (`central annotate`)."""
    sql = ('SELECT cluster, job_id, MAX(restart_count) FROM job_gpus_current WHERE 1 = 1'
           + (" AND end_time >= %s" if since_s is not None else "")
           + (f" AND job_id IN ({', '.join(['%s'] * len(job_ids))})" if job_ids else "")
           + " GROUP BY cluster, job_id ORDER BY cluster, job_id")
    params = ((since_s,) if since_s is not None else ()) + tuple(job_ids)
    return [(c, int(j), int(r)) for c, j, r in srv.execute(sql, params)]
