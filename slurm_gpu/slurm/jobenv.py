"""Parsing the environment slurmd gives prolog/epilog: strict, with clear errors."""
from __future__ import annotations

import re
from typing import Mapping, NamedTuple, Optional, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.slurm.hostlist import RangeError, parse_index_ranges

_HINT = "this runs as Slurm's Prolog=/Epilog=; slurmd sets these variables"


class JobEnv(NamedTuple):
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
    sluid: str = ""  # SLURM_JOB_SLUID (25.11+): this run's id across clusters (a requeue gets a new one); "" before

    @property
    def key(self) -> str:
        return f"job={self.job_id} restart={self.restart_count} node={self.node}"


_WS = " \t\r\n"
MAX_ID = 2**32 - 1  # job ids, uids and counts are 32-bit in Slurm
MAX_GPU_INDEX = 4095


def _digits(s: str) -> bool:
    """ASCII digits 0-9 only: int() and \\d also take Arabic-Indic or full-width digits, int() even '1_000'."""
    return s.isascii() and s.isdigit()


def _show(raw: str) -> str:
    """A value for an error message: bounded, one line, always encodable."""
    return repr(raw if len(raw) <= 40 else raw[:40] + "...")


def _number(raw: str, limit: int) -> Optional[int]:
    """ASCII digits up to limit, else None; never int() on a long string (int-digit limit)."""
    if not _digits(raw) or len(raw) > len(str(limit)) or int(raw) > limit:
        return None
    return int(raw)


def _int(env: Mapping[str, str], name: str, required: bool = False, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip(_WS) == "":
        if required:
            raise InputError(f"{name} is not set", _HINT)
        return default
    s = raw.strip(_WS)
    if s.startswith("-") and _digits(s[1:]):
        raise InputError(f"{name}={_show(raw)} is negative", _HINT)
    if not _digits(s):
        raise InputError(f"{name}={_show(raw)} is not an integer (ASCII digits 0-9)", _HINT)
    v = _number(s, MAX_ID)
    if v is None:
        raise InputError(f"{name}={_show(raw)} is out of range (0..{MAX_ID})", _HINT)
    return v


_GPU_HINT = "expected node-wide indices like 0,1 or 0-3; check gres.conf"


def parse_job_gpus(raw: Optional[str]) -> Tuple[int, ...]:
    """'0,1' / '0-3,6' -> indices; empty/unset -> () (a job without GPUs)."""
    if raw is None or raw.strip(_WS) in ("", "(null)"):
        return ()
    try:
        return parse_index_ranges(raw, strip=_WS, max_value=MAX_GPU_INDEX, max_span=1024)
    except RangeError as e:
        if e.kind == "syntax":
            raise InputError(f"SLURM_JOB_GPUS={_show(raw)}: {_show(e.item)} is not a GPU index", _GPU_HINT) from None
        if e.kind == "too-large":
            raise InputError(f"SLURM_JOB_GPUS={_show(raw)}: GPU index {_show(e.value)} is out of range (0..{MAX_GPU_INDEX})",
                             _GPU_HINT) from None
        raise InputError(f"SLURM_JOB_GPUS={_show(raw)}: bad range {_show(e.item)}",
                         "expected node-wide indices like 0-3") from None


def _text(env: Mapping[str, str], name: str, default: str = "") -> str:
    """A free-text variable, made storable: bytes that are not UTF-8 (surrogates) become escapes."""
    v = env.get(name) or default
    try:
        v.encode("utf-8")
        return v
    except UnicodeEncodeError:
        return v.encode("utf-8", "backslashreplace").decode("utf-8")


def _node(env: Mapping[str, str], default_node: str) -> str:
    node = env.get("SLURMD_NODENAME") or default_node
    if not node:
        raise InputError("SLURMD_NODENAME is not set", _HINT)
    if _text(env, "SLURMD_NODENAME", default_node) != node or not node.isprintable():
        # A drain must name the node exactly: a name we would have to alter is no Slurm node name.
        raise InputError(f"SLURMD_NODENAME={_show(node)} is not a printable UTF-8 node name", _HINT)
    return node


def from_env(env: Mapping[str, str], default_node: str = "", default_cluster: str = "") -> JobEnv:
    job_id = _int(env, "SLURM_JOB_ID", required=True)
    node = _node(env, default_node)
    return JobEnv(
        job_id=job_id,  # type: ignore[arg-type]
        gpus=parse_job_gpus(env.get("SLURM_JOB_GPUS")),
        node=node,
        cluster=_text(env, "SLURM_CLUSTER_NAME", default_cluster),
        user=_text(env, "SLURM_JOB_USER"),
        uid=_int(env, "SLURM_JOB_UID"),
        account=_text(env, "SLURM_JOB_ACCOUNT"),
        partition=_text(env, "SLURM_JOB_PARTITION"),
        restart_count=_int(env, "SLURM_JOB_RESTART_COUNT", default=0) or 0,
        exit_code=_text(env, "SLURM_JOB_EXIT_CODE") if env.get("SLURM_JOB_EXIT_CODE") is not None else None,
        sluid=_sluid(env.get("SLURM_JOB_SLUID")),
    )


_SLUID = re.compile(r"s[0-9A-Z]{8,24}")


def _sluid(raw: Optional[str]) -> str:
    """SLURM_JOB_SLUID ('s' and base32 capitals, e.g. sEKNKTV3WPV500), or '' when absent or of another
    shape: a later Slurm's new format must not fail every prolog of the fleet, and without a SLUID no
    process in a SLUID-named cgroup is ever taken for the job's (procs.is_the_jobs)."""
    s = (raw or "").strip(_WS)
    return s if _SLUID.fullmatch(s) else ""
