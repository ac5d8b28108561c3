"""What the prolog, the epilog and `healthcheck` write for Prometheus; never raises.

The flows fill an Observed (policy/observed.py) as they go and call prolog()/epilog()/healthcheck() at their end.
Metrics never change a hook's outcome and cost it a few milliseconds: a directory that cannot
be written is one logged line per run (`metrics-write-failed`, naming the directory), and the
hook goes on.  Off unless metrics.textfile_dir or metrics.dcgm_job_mapping_dir is set.
On the hook path: standard library and our own modules only (no prometheus_client).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from slurm_gpu.config import Config, metrics_enabled
from slurm_gpu.metrics import jobs as J
from slurm_gpu.metrics import node as N
from slurm_gpu.metrics.catalog import NODE_FILE, REMEDIATION_FILE, USAGE_FILE
from slurm_gpu.metrics.textfile import Labels, ensure_dir, merge, remove
from slurm_gpu.policy.observed import Observed

enabled = metrics_enabled  # are metrics on? (config.py: the one answer)



class _Writer:
    """One hook run's writes: the first failure per directory is logged, once."""

    def __init__(self, cfg: Config, log: Any, hook: str, **ids: Any):
        self.textfile = cfg.path_value("metrics", "textfile_dir")
        self.mapping = cfg.path_value("metrics", "dcgm_job_mapping_dir")
        self.cfg, self.log, self.hook, self.ids = cfg, log, hook, ids
        self.failed: Dict[str, str] = {}

    def do(self, directory: str, what: str, fn: Callable[[], Any]) -> Any:
        if not directory or directory in self.failed:
            return None
        try:
            ensure_dir(directory)
            return fn()
        except Exception as e:  # metrics never change a hook's outcome
            self.failed[directory] = str(e)
            self._say(directory, what, e)
            return None

    def _say(self, directory: str, what: str, e: Exception) -> None:
        key = "metrics.textfile_dir" if directory == self.textfile else "metrics.dcgm_job_mapping_dir"
        try:
            if isinstance(e, OSError):
                hint = getattr(e, "hint", "") or f"{key} must be a directory root can write"
                self.log.error("metrics-write-failed", **self.ids, dir=directory, what=what, error=e.strerror or str(e),
                               hint=f"{hint}; the hook itself is not affected")
            else:  # a bug of ours
                self.log.error("metrics-failed", **self.ids, dir=directory, what=what, error=f"{type(e).__name__}: {e}",
                               hint="the hook itself is not affected")
        except Exception:
            pass


def _node_update(obs: Observed, source: str, now: float) -> N.NodeUpdate:
    up = N.NodeUpdate(source, now)
    snap = obs.snapshot
    if snap is not None:
        on = set(obs.persistence_on)
        for g in snap.gpus:
            up.gpu(g, persistence=True if g.index in on else None)
        if obs.all_gpus:
            up.node_gpus(snap)
        up.driver(snap)
    if obs.mismatch is not None or snap is not None:
        kernel, library = obs.mismatch or ("", "")
        up.replace({MISMATCH: {(("kernel_version", kernel), ("library_version", library)): 0.0 if obs.mismatch is None
                               else 1.0}})
    if obs.results:
        up.results(obs.results, snap)
    up.xids(obs.xid_events)
    if obs.drain is not None:
        up.drain(*obs.drain)
    up.ran(source)
    return up


MISMATCH = "slurm_gpu_driver_library_mismatch"


def mismatch(cfg: Config, log: Any, hook: str, node: str, kernel: str, library: str, now: float) -> None:
    """nvmlInit refused with LIB_RM_VERSION_MISMATCH: the one series says so, with both versions."""
    w = _Writer(cfg, log, hook, node=node)
    obs = Observed()
    obs.mismatch = (kernel, library)
    w.do(w.textfile, "node", lambda: write_node(w.textfile, _node_update(obs, hook, now)))


def write_node(directory: str, up: N.NodeUpdate) -> None:
    """Merge one writer's view into the node file, under the directory's lock."""
    merge(directory, NODE_FILE, lambda old: N.apply(old, up))


def prolog(cfg: Config, log: Any, job: Any, obs: Observed, now: float) -> None:
    w = _Writer(cfg, log, "prolog", job=job.job_id, node=job.node)
    w.do(w.textfile, "node", lambda: write_node(w.textfile, _node_update(obs, "prolog", now)))
    if obs.held:
        w.do(w.textfile, "job", lambda: J.write_job(w.textfile, job, obs.held))
        w.do(w.mapping, "dcgm-mapping", lambda: J.map_job(w.mapping, job.job_id, [J.mapping_name(jg) for _, jg in obs.held]))


def epilog(cfg: Config, log: Any, job: Any, obs: Observed, now: float, store: Any = None,
           live: Optional[J.Liveness] = None) -> None:
    w = _Writer(cfg, log, "epilog", job=job.job_id, node=job.node)
    mine = str(job.job_id)
    w.do(w.textfile, "job", lambda: remove(w.textfile, J.job_file(job.job_id)))
    w.do(w.mapping, "dcgm-mapping", lambda: J.unmap_jobs(w.mapping, lambda x, _t: x == mine))
    w.do(w.textfile, "node", lambda: write_node(w.textfile, _node_update(obs, "epilog", now)))
    if store is not None and not getattr(store, "unavailable", ""):
        w.do(w.textfile, "usage", lambda: write_usage(cfg, w.textfile, store.connect()))
    cleanup(w, live or J.Liveness(time.time()))  # file times are the wall clock's


def healthcheck(cfg: Config, log: Any, node: str, obs: Observed, now: float, extra: Any = None,
                live: Optional[J.Liveness] = None) -> None:
    """extra: () -> samples of node-level values (spool, unpushed records) merged in too."""
    w = _Writer(cfg, log, "healthcheck", node=node)
    up = _node_update(obs, "healthcheck", now)
    if extra is not None and w.textfile:
        try:
            up.replace(extra())
        except Exception as e:  # a database that cannot be read leaves those values out
            log.warning("metrics-store-unreadable", node=node, error=f"{type(e).__name__}: {e}")
    w.do(w.textfile, "node", lambda: write_node(w.textfile, up))
    cleanup(w, live or J.Liveness(time.time()))


def write_usage(cfg: Config, directory: str, conn: Any) -> None:
    from slurm_gpu.metrics.usage import account_sums, usage_samples
    sums = account_sums(conn)
    merge(directory, USAGE_FILE,
          lambda old: usage_samples(sums, old, cfg.metrics.by_account, cfg.metrics.max_accounts))


def write_remediation(directory: str, conn: Any) -> None:
    """slurm_gpu_remediation_total{action,outcome}: the node database's attempts, counted (rows are never
    deleted, so the sums only grow)."""
    counts: Dict[Labels, float] = {(("action", str(a)), ("outcome", str(o))): float(n)
              for a, o, n in conn.execute("SELECT action, outcome, COUNT(*) FROM remediations GROUP BY 1, 2")}
    merge(directory, REMEDIATION_FILE, lambda old: dict(old, slurm_gpu_remediation_total=counts))


def write_clock_skew(directory: str, skew_s: float) -> None:
    """slurm_gpu_clock_skew_seconds: this node's clock minus slurmctld's, as remediate measured it."""
    merge(directory, REMEDIATION_FILE, lambda old: dict(old, slurm_gpu_clock_skew_seconds={(): float(skew_s)}))


def cleanup(w: _Writer, live: J.Liveness) -> None:
    """Job info files and mapping lines of jobs that are gone (their epilog never ran)."""
    def files() -> None:
        for name, job_id in J.stale_job_files(w.textfile, live):
            remove(w.textfile, name)
            w.log.info("metrics-stale-job", job=job_id, file=name)
    w.do(w.textfile, "stale jobs", files)
    w.do(w.mapping, "stale dcgm mapping", lambda: J.unmap_jobs(w.mapping, live.gone))
