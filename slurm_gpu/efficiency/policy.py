"""The site's idle policy ([efficiency], docs/efficiency.md) as a pure function: a running job's samples
(every GPU on every node it holds), its facts from Slurm and what was done before -> the stage due now.

A GPU is idle in a sample when its utilisation is at most idle_util_pct (and, with idle_memory_mib, its
memory used at most that).  A GPU's idle stretch runs back from its newest sample through consecutive
idle samples; samples further apart than 3 x sample_every_s end it (a minute nobody saw is never counted
idle), and so does the grace period after the job's start.  A job is idle only when every GPU it holds
is idle now and has been for the whole window: its idle time is the shortest of its GPUs' stretches.
A GPU without a fresh sample (not read, a node whose samples have not arrived) makes the job unknown,
never idle.  Stages, at most one of each per job start:
- advice: some GPUs idle for notify_after_s while others work (never a cancel);
- notify: the whole job idle for notify_after_s;
- cancel: the whole job idle for cancel_after_s, its user mailed at least cancel_after_s - notify_after_s
  before (a warning that did not go out holds the cancel back), not exempt, and for an interactive job
  only when interactive_cancel_after_s is set.
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import ConfigError

MIB = 1 << 20
GAP_SAMPLES = 3.0  # samples further apart than this many intervals leave a gap

ADVICE, NOTIFY, CANCEL = "advice", "notify", "cancel"


class Policy(NamedTuple):
    idle_util_pct: float
    idle_memory_bytes: int  # 0: memory does not count
    grace_s: float
    notify_after_s: float
    cancel_after_s: float
    interactive_notify_after_s: float
    interactive_cancel_after_s: float
    exempt_accounts: FrozenSet[str]
    exempt_partitions: FrozenSet[str]
    exempt_qos: FrozenSet[str]
    exempt_users: FrozenSet[str]
    max_gap_s: float

    @classmethod
    def from_config(cls, cfg: Config) -> "Policy":
        e = cfg.efficiency
        for kind, notify, cancel in (("", e.notify_after_s, e.cancel_after_s),
                                     ("interactive_", e.interactive_notify_after_s, e.interactive_cancel_after_s)):
            if cancel and not (notify and cancel > notify):
                raise ConfigError(
                    f"efficiency.{kind}cancel_after_s = {cancel:g} needs a warning first: "
                    f"{kind}notify_after_s is {notify:g}",
                    f"set efficiency.{kind}notify_after_s above 0 and below {kind}cancel_after_s, or "
                    f"{kind}cancel_after_s = 0 (never cancel)")
        return cls(float(e.idle_util_pct), int(e.idle_memory_mib) * MIB, float(e.grace_s), float(e.notify_after_s),
                   float(e.cancel_after_s), float(e.interactive_notify_after_s), float(e.interactive_cancel_after_s),
                   frozenset(e.exempt_accounts), frozenset(e.exempt_partitions), frozenset(e.exempt_qos),
                   frozenset(e.exempt_users), GAP_SAMPLES * float(e.sample_every_s))

    def thresholds(self, batch: bool) -> Tuple[float, float]:
        """(notify after, cancel after) in seconds for a batch or an interactive job; 0: never."""
        return ((self.notify_after_s, self.cancel_after_s) if batch
                else (self.interactive_notify_after_s, self.interactive_cancel_after_s))

    def exemption(self, job: "JobFacts") -> str:
        """Why the job may never be cancelled ('' when it may)."""
        for what, value, names in (("account", job.account, self.exempt_accounts),
                                   ("partition", job.partition, self.exempt_partitions),
                                   ("qos", job.qos, self.exempt_qos), ("user", job.user, self.exempt_users)):
            if value and value in names:
                return f"exempt {what} {value}"
        return ""


class JobFacts(NamedTuple):
    """A running job as Slurm shows it (`scontrol show job`), for the policy and the mail."""

    cluster: str
    job_id: int
    restart_count: int
    user: str
    account: str
    partition: str
    qos: str
    batch: bool  # BatchFlag=1: sbatch; 0: salloc or srun outside a batch job (interactive)
    state: str
    num_nodes: int
    nodes: str
    start_time: float  # Slurm's StartTime (unix)
    mail_user: str = ""
    name: str = ""
    admin_comment: str = ""


class GpuStretch(NamedTuple):
    node: str
    gpu_uuid: str
    gpu_index: Optional[int]
    newest: float  # time of its newest sample
    idle_since: Optional[float]  # start of its idle stretch; None: busy (or unknown) now
    util_max_pct: Optional[float]  # over the stretch
    memory_max_bytes: Optional[int]
    energy_j: Optional[float]  # since the job's start, at the newest sample


class Judgement(NamedTuple):
    stage: str  # ADVICE, NOTIFY, CANCEL or '' (nothing due)
    why: str  # one line: what was found and why this stage (or none)
    idle_since: Optional[float]  # of the whole job (None: not idle as a whole)
    idle_s: float  # the whole job's idle time (0 when not idle as a whole)
    gpus: int
    idle_gpus: int  # GPUs idle for at least the notify threshold
    stretches: Tuple[GpuStretch, ...]

    def evidence(self) -> List[Dict[str, Any]]:
        return [{"node": s.node, "gpu": s.gpu_uuid, "index": s.gpu_index,
                 "idle_s": round(s.newest - s.idle_since, 1) if s.idle_since is not None else 0.0,
                 "util_max_pct": s.util_max_pct, "memory_max_bytes": s.memory_max_bytes,
                 "energy_j": None if s.energy_j is None else round(s.energy_j, 1)} for s in self.stretches]


def _idle(row: Mapping[str, Any], p: Policy) -> bool:
    util = row.get("gpu_util_max_pct")
    if util is None or util > p.idle_util_pct:
        return False
    if p.idle_memory_bytes:
        mem = row.get("memory_used_bytes")
        return mem is not None and mem <= p.idle_memory_bytes
    return True


def _max(values: Sequence[Any]) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def stretch(rows: Sequence[Mapping[str, Any]], p: Policy, not_before: float) -> GpuStretch:
    """One GPU's idle stretch from its rows (oldest first) back to `not_before` (the grace period's end)."""
    newest = rows[-1]
    since: Optional[float] = None
    taken: List[Mapping[str, Any]] = []
    later_start: Optional[float] = None  # the start of the row after the current one
    for row in reversed(rows):
        if not _idle(row, p):
            break
        end, start = float(row["time"]), float(row["time"]) - float(row["span_s"])
        if later_start is not None and later_start - end > p.max_gap_s:
            break
        taken.append(row)
        since = max(start, not_before)
        later_start = start
        if start <= not_before:
            break
    if since is not None and since >= float(newest["time"]):
        since = None  # the whole stretch lies in the grace period
    return GpuStretch(str(newest["node"]), str(newest["gpu_uuid"]), newest.get("gpu_index"), float(newest["time"]),
                      since, _max([r.get("gpu_util_max_pct") for r in taken]) if since is not None else None,
                      _max([r.get("memory_used_bytes") for r in taken]) if since is not None else None,
                      newest.get("energy_j"))


def judge(samples: Sequence[Mapping[str, Any]], job: JobFacts, p: Policy, done: Mapping[str, Mapping[str, Any]],
          now: float, gpus_expected: int) -> Judgement:
    """The stage due now for one running job.  `samples`: all its rows on all its nodes (any order);
    `done`: its earlier actions by stage; `gpus_expected`: the GPUs (and MIG slices) it holds on all nodes."""
    by_gpu: Dict[Tuple[str, str], List[Mapping[str, Any]]] = {}
    for r in sorted(samples, key=lambda r: float(r["time"])):
        by_gpu.setdefault((str(r["node"]), str(r["gpu_uuid"])), []).append(r)
    not_before = job.start_time + p.grace_s
    stretches = tuple(stretch(rows, p, not_before) for _, rows in sorted(by_gpu.items()))
    notify_after, cancel_after = p.thresholds(job.batch)

    def result(stage: str, why: str, since: Optional[float] = None, idle_s: float = 0.0) -> Judgement:
        idle_gpus = sum(1 for s in stretches if s.idle_since is not None and notify_after
                        and s.newest - s.idle_since >= notify_after)
        return Judgement(stage, why, since, idle_s, max(gpus_expected, len(stretches)), idle_gpus, stretches)

    if job.state != "RUNNING":
        return result("", f"job is {job.state or 'gone'}, not RUNNING")
    if not notify_after:
        return result("", "no mail for " + ("batch" if job.batch else "interactive") + " jobs (notify_after_s = 0)")
    stale = [s for s in stretches if now - s.newest > p.max_gap_s]
    if len(stretches) < gpus_expected or stale:
        return result("", f"samples of {len(stretches) - len(stale)} of {max(gpus_expected, len(stretches))} GPUs "
                          "are fresh: the job is not judged")
    if not stretches:
        return result("", "no samples yet")
    idle = [s for s in stretches if s.idle_since is not None]
    if len(idle) == len(stretches):
        since = max(s.idle_since for s in idle if s.idle_since is not None)
        idle_s = min(s.newest for s in idle) - since
        exempt = p.exemption(job)
        notified = done.get(NOTIFY)
        if cancel_after and idle_s >= cancel_after and CANCEL not in done:
            warned_at = notified.get("mail_time") if notified and notified.get("mail_state") == "sent" else None
            if exempt:
                why = f"idle {idle_s:.0f} s, not cancelled: {exempt}"
            elif warned_at is None:
                why = f"idle {idle_s:.0f} s, not cancelled: the user's warning was not mailed (yet)"
            elif now - float(warned_at) < cancel_after - notify_after:
                why = (f"idle {idle_s:.0f} s, not cancelled: warned {now - float(warned_at):.0f} s ago, "
                       f"{cancel_after - notify_after:.0f} s are due")
            else:
                return result(CANCEL, f"all GPUs ({len(stretches)}) idle {idle_s:.0f} s (cancel after {cancel_after:.0f} s)",
                              since, idle_s)
            if NOTIFY in done:
                return result("", why, since, idle_s)
        if idle_s >= notify_after and NOTIFY not in done:
            return result(NOTIFY, f"all GPUs ({len(stretches)}) idle {idle_s:.0f} s (notify after {notify_after:.0f} s)",
                          since, idle_s)
        return result("", f"all GPUs idle {idle_s:.0f} s", since, idle_s)
    long_idle = [s for s in idle if s.idle_since is not None and s.newest - s.idle_since >= notify_after]
    if long_idle and ADVICE not in done and NOTIFY not in done:
        return result(ADVICE, f"{len(long_idle)} of {len(stretches)} GPUs idle at least {notify_after:.0f} s, "
                              "the others busy: advice, never a cancel")
    return result("", f"{len(stretches) - len(idle)} of {len(stretches)} GPUs busy")
