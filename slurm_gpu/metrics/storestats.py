"""Node-level values read from the store: records waiting in the spool, records not yet pushed.

Written by `healthcheck` into the node file and refreshed by `slurm-gpu exporter` at every
scrape.  Not on the hook path (central/push.py is not: the prolog never imports it).  The
database is opened read-only: reading metrics never creates or migrates it.  Without a
central server (central.url empty) nothing is pushed, so no unpushed values are given.
"""
from __future__ import annotations

import os
import sqlite3
from typing import Any
from urllib.parse import quote

from slurm_gpu.config import Config
from slurm_gpu.metrics.textfile import Samples

SPOOL = "slurm_gpu_spool_records"
UNPUSHED = "slurm_gpu_unpushed_records"
OLDEST = "slurm_gpu_unpushed_oldest_timestamp_seconds"


def store_samples(cfg: Config) -> Samples:
    """{family: series} of the spool and the push backlog; a family left out could not be read,
    one given empty is known to have no series (no unshipped record: no oldest time)."""
    out: Samples = {}
    spool = spool_records(cfg)
    if spool is not None:
        out[SPOOL] = {(): float(spool)}
    if cfg.central.url:
        backlog = unpushed(cfg.path_value("store", "database"))
        if backlog is not None:
            total, oldest = backlog
            out[UNPUSHED] = {(): float(total)}
            out[OLDEST] = {(): float(oldest)} if oldest is not None else {}
    return out


def spool_records(cfg: Config) -> Any:
    """Records waiting in the spool (None: the directory cannot be read)."""
    from slurm_gpu.store.node import Store
    status = Store(cfg.path_value("store", "database"), cfg.path_value("store", "spool_dir")).spool_status()
    return None if status.problem else len(status.waiting)


def unpushed(path: str) -> Any:
    """(records waiting for `db push`, time of the oldest or None); None without a database."""
    from slurm_gpu.central.push import backlog
    try:
        conn = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error:
        return None
    try:
        b = backlog(conn)
        return b.total, b.oldest_time
    except sqlite3.Error:  # no database yet, or one older than the outbox (schema v5)
        return None
    finally:
        conn.close()
