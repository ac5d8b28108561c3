"""Parsing the environment slurmd gives prolog/epilog (DESIGN.md §3): strict, with clear errors."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from .errors import InputError

_HINT = "this runs as Slurm's Prolog=/Epilog=; slurmd sets these variables"


@dataclass(frozen=True)
class JobEnv:
    job_id: int
    gpus: Tuple[int, ...]  # node-wide GRES indices from SLURM_JOB_GPUS, in the job's order
    node: str
    cluster: str
    user: str = ""
    uid: Optional[int] = None
    account: str = ""
    partition: str = ""
    restart_count: int = 0
    exit_code: Optional[str] = None  # epilog only: SLURM_JOB_EXIT_CODE as given

    @property
    def key(self) -> str:
        return f"job={self.job_id} restart={self.restart_count} node={self.node}"


def _int(env: Mapping[str, str], name: str, required: bool = False, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if required:
            raise InputError(f"{name} is not set", _HINT)
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        raise InputError(f"{name}={raw!r} is not an integer", _HINT) from None
    if v < 0:
        raise InputError(f"{name}={raw!r} is negative", _HINT)
    return v


_GPU_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_job_gpus(raw: Optional[str]) -> Tuple[int, ...]:
    """'0,1' / '0-3,6' -> indices; empty/unset -> () (a job without GPUs)."""
    if raw is None or raw.strip() in ("", "(null)"):
        return ()
    out = []
    for item in raw.split(","):
        m = _GPU_ITEM.match(item.strip())
        if not m:
            raise InputError(f"SLURM_JOB_GPUS={raw!r}: {item.strip()!r} is not a GPU index",
                             "expected node-wide indices like 0,1 or 0-3; check gres.conf")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo or hi - lo > 1024:
            raise InputError(f"SLURM_JOB_GPUS={raw!r}: bad range {item.strip()!r}", "expected node-wide indices like 0-3")
        out.extend(range(lo, hi + 1))
    seen = set()
    return tuple(x for x in out if not (x in seen or seen.add(x)))


def from_env(env: Mapping[str, str], default_node: str = "", default_cluster: str = "") -> JobEnv:
    job_id = _int(env, "SLURM_JOB_ID", required=True)
    node = env.get("SLURMD_NODENAME") or default_node
    if not node:
        raise InputError("SLURMD_NODENAME is not set", _HINT)
    return JobEnv(
        job_id=job_id,  # type: ignore[arg-type]
        gpus=parse_job_gpus(env.get("SLURM_JOB_GPUS")),
        node=node,
        cluster=env.get("SLURM_CLUSTER_NAME") or default_cluster,
        user=env.get("SLURM_JOB_USER", ""),
        uid=_int(env, "SLURM_JOB_UID"),
        account=env.get("SLURM_JOB_ACCOUNT", ""),
        partition=env.get("SLURM_JOB_PARTITION", ""),
        restart_count=_int(env, "SLURM_JOB_RESTART_COUNT", default=0) or 0,
        exit_code=env.get("SLURM_JOB_EXIT_CODE"),
    )
