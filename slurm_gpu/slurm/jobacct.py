"""A finished (or running) job's accounting record, read through `sacct` as the caller.

`slurm-gpu job JOBID` runs as any user: what it may see is what Slurm's accounting shows that
user (PrivateData=jobs in slurmdbd.conf hides other users' jobs: sacct then prints nothing).
One ``sacct -X -n -P -j JOBID --format=...`` line per allocation; AdminComment is the last
field and is split off with maxsplit, so a '|' inside it is kept.

Job ids as users type them: ``4711``, an array task ``4711_3`` and a heterogeneous job's
component ``4711+1``; sacct resolves them, and JobIDRaw is the id the GPU summary is keyed by.
From Slurm 26.05 sacct also takes a SLUID (``sEKNKTV3WPV500``): one run of a job (a requeue gets
a new one), on any cluster of a federation; its record then carries the SLUID too.
"""
from __future__ import annotations

import re
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.errors import InputError, SlurmError
from slurm_gpu.slurm.hostlist import expand
from slurm_gpu.slurm.model import TERMINAL_JOB_STATES, tres_gpu_count
from slurm_gpu.timefmt import slurm_to_unix

FIELDS = ("JobIDRaw", "JobID", "User", "Account", "Partition", "State", "NNodes", "NodeList", "AllocTRES", "Start",
          "End", "ElapsedRaw", "TimelimitRaw", "ExitCode", "AdminComment")
JOB_ID = re.compile(r"^(\d+)(?:_(\d+)|\+(\d+))?$")
JOB_ID_HINT = ("give the job id as sacct prints it: 4711, an array task 4711_3, a heterogeneous job component 4711+1, "
               "or a run's SLUID (Slurm 26.05+): sEKNKTV3WPV500")
# A SLUID as Slurm prints and parses it (src/common/sluid.c): 's' and 13 Crockford base32 digits,
# any case, O read as 0 and I or L as 1.
SLUID = re.compile(r"^[sS]([0-9A-HJKMNP-TV-Za-hjkmnp-tv-zOoIiLl]{13})$")
_CROCKFORD = str.maketrans("OIL", "011")
_MAX_ID = (1 << 32) - 1


class JobRecord(NamedTuple):
    job_id_raw: int  # JobIDRaw: the id the GPU summary is keyed by
    job_id: str  # JobID as sacct shows it: 4711, 4711_3, 4711+1
    user: str
    account: str
    partition: str
    state: str  # as sacct prints it, e.g. "CANCELLED by 1000"
    node_count: int
    nodelist: str  # hostlist expression; "" when none was assigned
    nodes: List[str]
    alloc_tres: str
    gpus: int  # GPUs allocated (AllocTRES gres/gpu=N or gres/gpu:TYPE=N); 0 when none
    start: Optional[float]  # unix seconds; None before the job started
    end: Optional[float]  # unix seconds; None while it runs
    elapsed_s: int
    time_limit_s: Optional[int]  # None: unlimited or unknown
    exit_code: str  # "0:0"
    admin_comment: str
    sluid: str = ""  # the run's SLUID when it was asked for by one (Slurm 26.05+), else ""

    @property
    def base_state(self) -> str:
        """'CANCELLED by 1000' -> 'CANCELLED'."""
        return (self.state.split() or [""])[0].rstrip("+").upper()

    @property
    def ended(self) -> bool:
        return self.base_state in TERMINAL_JOB_STATES

    @property
    def pending(self) -> bool:
        return self.base_state == "PENDING"


def check_job_id(text: str) -> str:
    """The job id as typed, validated: digits, optionally `_N` (array task) or `+N` (het component);
    or a SLUID, in Slurm's own spelling ('s' and upper case, O as 0, I and L as 1)."""
    t = (text or "").strip()
    s = SLUID.match(t)
    if s:
        return "s" + s.group(1).upper().translate(_CROCKFORD)
    m = JOB_ID.match(t)
    if not m or any(int(g) > _MAX_ID for g in m.groups() if g is not None):
        raise InputError(f"{text!r} is not a Slurm job id", JOB_ID_HINT)
    return t


def _time(text: str) -> Optional[float]:
    """SLURM_TIME_FORMAT=%s gives unix seconds, 'standard' gives local ISO; Unknown/None -> None."""
    t = text.strip()
    if t.isdigit():
        return float(t) if int(t) > 0 else None
    return slurm_to_unix(t)


def _int(text: str) -> Optional[int]:
    t = text.strip()
    return int(t) if t.isdigit() else None


def _nodes(nodelist: str) -> List[str]:
    if not nodelist or nodelist.lower().startswith("none") or nodelist == "(null)":
        return []
    try:
        return expand(nodelist)
    except ValueError:
        return [nodelist]


def fields_for(job_id: str) -> Tuple[str, ...]:
    """sacct's fields for this id: FIELDS, and the SLUID (before AdminComment, which stays last)
    when a SLUID is asked for: older sacct know no such field, and are asked for none."""
    return FIELDS[:-1] + ("SLUID", FIELDS[-1]) if SLUID.match(job_id) else FIELDS


def parse_line(line: str, fields: Sequence[str] = FIELDS) -> Optional[JobRecord]:
    """One `sacct -P` line in `fields` order -> JobRecord; None for a line that is not one."""
    parts = line.rstrip("\r\n").split("|", len(fields) - 1)
    if len(parts) < len(fields) or not parts[0].strip().isdigit():
        return None
    f = dict(zip(fields, parts))
    nodes = _nodes(f["NodeList"].strip())
    limit = _int(f["TimelimitRaw"])  # minutes; UNLIMITED / Partition_Limit -> None
    return JobRecord(
        job_id_raw=int(f["JobIDRaw"]), job_id=f["JobID"].strip(), user=f["User"].strip(),
        account=f["Account"].strip(), partition=f["Partition"].strip(), state=f["State"].strip(),
        node_count=_int(f["NNodes"]) or 0, nodelist=f["NodeList"].strip() if nodes else "", nodes=nodes,
        alloc_tres=f["AllocTRES"].strip(), gpus=tres_gpu_count(f["AllocTRES"]) or 0,
        start=_time(f["Start"]), end=_time(f["End"]), elapsed_s=_int(f["ElapsedRaw"]) or 0,
        time_limit_s=None if limit is None else limit * 60, exit_code=f["ExitCode"].strip(),
        admin_comment=f["AdminComment"].strip(), sluid=f.get("SLUID", "").strip())


def parse_sacct(out: str, fields: Sequence[str] = FIELDS) -> List[JobRecord]:
    return [r for r in (parse_line(line, fields) for line in out.splitlines() if line.strip()) if r is not None]


def pick(records: List[JobRecord], job_id: str) -> Optional[JobRecord]:
    """The record the user asked for; InputError when a plain id names a whole array or het job."""
    if not records:
        return None
    for r in records:
        if r.job_id == job_id or (r.sluid and r.sluid.upper() == job_id.upper()):
            return r
    if SLUID.match(job_id):
        return None  # sacct answered with runs of other SLUIDs: not the one asked for
    if len(records) == 1:
        return records[0]  # e.g. a pending array shown as 4711_[3-10] when 4711_5 was asked for
    kind = "an array job" if any("_" in r.job_id for r in records) else "a heterogeneous job"
    sep = "_" if kind == "an array job" else "+"
    first = next((r.job_id for r in records if sep in r.job_id and "[" not in r.job_id), records[0].job_id)
    raise InputError(f"job {job_id} is {kind} of {len(records)} parts: name one",
                     f"for example: slurm-gpu job {first} (list them: sacct -X -j {job_id} --format=JobID,State)")


def job_record(backend: Any, job_id: str) -> Optional[JobRecord]:
    """The job's allocation record as the caller may see it; None when sacct shows nothing
    (no such job, or PrivateData hides it).  `backend` has ``run(tool, args, timeout_s)``."""
    job_id = check_job_id(job_id)
    fields = fields_for(job_id)
    rc, out, err = backend.run("sacct", ["-X", "-n", "-P", "-j", job_id, "--format=" + ",".join(fields)])
    if rc != 0:
        text = " ".join((err.strip() + " " + out.strip()).split()) or f"exit code {rc}"
        # 22.05: "fatal: Bad job/step specified: s..."; a sacct that knows the id but not the field: "Invalid field"
        if SLUID.match(job_id) and any(w in text.lower() for w in ("sluid", "invalid job id", "bad job/step")):
            raise InputError(f"this Slurm's sacct takes no SLUID ({text})",
                             "SLUIDs are Slurm 26.05's: give the numeric job id (sacct -X -o JobID,Submit)")
        if "invalid job id" in text.lower():
            return None
        hint = ("job accounting is needed (AccountingStorageType=accounting_storage/slurmdbd)"
                if "storage is disabled" in text.lower() else "is slurmdbd running and reachable? try `sacct -X -j JOBID`")
        raise SlurmError(f"sacct failed: {text}", hint)
    return pick(parse_sacct(out, fields), job_id)
