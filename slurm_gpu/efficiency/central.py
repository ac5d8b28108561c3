"""The idle policy where every node's samples meet: the central server (`slurm-gpu efficiency enforce --db
central`, a timer on a controller or login node; docs/efficiency.md).

The running jobs are those with a sample on the server newer than the policy's gap; each is judged on the
samples of all its nodes, so that a job on several nodes is idle only when all of them say so.  The
decisions are recorded in this host's own node database (decided_on: this host), which its `db push`
ships; what was done before is read from both (a stage decided by another host counts).  With
efficiency.decide_on = "node" this run judges only the jobs on several nodes (each node judges its own);
with "central" it judges every job and the nodes only sample.
"""
from __future__ import annotations

from typing import Any, Dict, List

from slurm_gpu.central.admin import configured_cluster
from slurm_gpu.central.schema import CENTRAL_ACTION_COLUMNS
from slurm_gpu.config import Config
from slurm_gpu.efficiency.enforce import Candidate
from slurm_gpu.errors import InputError
from slurm_gpu.store import samples as Q
from slurm_gpu.store.schema import SAMPLE_COLUMNS

_ACTION_READ = ("node", "id", "time", "stage", "mail_state", "mail_time", "cancel_state", "mail_to")


class CentralSource:
    multi_node = True

    def __init__(self, central: Any, conn: Any, cluster: str, max_gap_s: float):
        self.central, self.conn, self.cluster, self.max_gap_s = central, conn, cluster, max_gap_s

    def candidates(self, now: float) -> List[Candidate]:
        rows = self.central.execute(
            "SELECT job_id, restart_count, COUNT(DISTINCT node, gpu_uuid) FROM job_samples "
            "WHERE cluster = %s AND time >= %s GROUP BY job_id, restart_count ORDER BY job_id, restart_count",
            (self.cluster, now - self.max_gap_s))
        return [Candidate(self.cluster, int(j), int(r), None, int(n)) for j, r, n in rows]

    def samples(self, c: Candidate, since: float) -> List[Dict[str, Any]]:
        cols = ", ".join(f'"{col}"' for col in SAMPLE_COLUMNS)
        got = self.central.execute(
            f"SELECT {cols} FROM job_samples WHERE cluster = %s AND job_id = %s AND restart_count = %s AND time >= %s "
            "ORDER BY time, node, gpu_uuid", (c.cluster, c.job_id, c.restart_count, since))
        return [dict(zip(SAMPLE_COLUMNS, r)) for r in got]

    def totals(self, c: Candidate) -> List[Dict[str, Any]]:
        got = self.central.execute(Q.totals_sql("%s"), (c.cluster, c.job_id, c.restart_count))
        return [dict(zip(Q.TOTAL_COLUMNS, r)) for r in got]

    def done(self, c: Candidate) -> Dict[str, Dict[str, Any]]:
        """This host's actions on the job, and those another host shipped (this host's win: they are newer)."""
        cols = ", ".join(f'"{col}"' for col in _ACTION_READ)
        assert set(_ACTION_READ) <= set(CENTRAL_ACTION_COLUMNS)
        there = self.central.execute(
            f"SELECT {cols} FROM efficiency_actions WHERE cluster = %s AND job_id = %s AND restart_count = %s",
            (c.cluster, c.job_id, c.restart_count))
        out: Dict[str, Dict[str, Any]] = {}
        for r in there:
            row = dict(zip(_ACTION_READ, r))
            row["decided_on"], row["id"] = row.pop("node"), None  # not a row of this host's database
            out[str(row["stage"])] = row
        out.update(Q.actions_of(self.conn, c.cluster, c.job_id, c.restart_count))
        return out


def cluster_of(cfg: Config) -> str:
    """The cluster whose jobs this host judges: cluster_name, SLURM_CLUSTER_NAME, else slurm.conf's ClusterName."""
    name = configured_cluster(cfg)
    if not name:
        raise InputError("cannot tell which cluster's jobs to judge", "set cluster_name in the config")
    return name
