"""slurm_gpu_usage.prom: GPU-seconds allocated and used, and energy, by account, from job_gpus.

The epilog rewrites it after the job's record: sums of this node's database, so the counters
equal what `slurm-gpu report` counts on this node.  Two rules keep them counters:
- Cardinality: with metrics.by_account, an account keeps its series once it has one (else
  "other" would shrink when an account moved out of it), new accounts get one while fewer than
  metrics.max_accounts are named, the rest are summed into account="other".  Without
  by_account, one series per family without the account label.
- Monotonic: a sum that fell a little (a partial row replaced by its complete one) keeps the
  old value; one that fell below half of what the file says is a new database, and the
  counters start again from it (Prometheus reads a drop as a counter reset).
The query reads the covering index job_gpus_by_account (allocated seconds: end - start).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Set, Tuple

from slurm_gpu.metrics.textfile import Samples

ALLOCATED = "slurm_gpu_allocated_seconds_total"
USED = "slurm_gpu_used_seconds_total"
ENERGY = "slurm_gpu_energy_joules_total"
FAMILIES = (ALLOCATED, USED, ENERGY)
OTHER = "other"

_SQL = ("SELECT COALESCE(account, ''), SUM(MAX(0, end_time - start_time)), "
        "SUM(MAX(0, end_time - start_time) * gpu_util_mean_pct / 100.0), SUM(energy_j) "
        "FROM job_gpus GROUP BY 1")


def account_sums(conn: Any) -> Dict[str, Tuple[float, float, float]]:
    """{account: (allocated s, used s, energy J)} of every job_gpus row of the database."""
    return {acct: (alloc or 0.0, used or 0.0, energy or 0.0) for acct, alloc, used, energy in conn.execute(_SQL)}


def usage_samples(sums: Mapping[str, Tuple[float, float, float]], old: Samples, by_account: bool,
                  max_accounts: int) -> Samples:
    new: Samples
    if not by_account:
        totals = [float(sum(v[i] for v in sums.values())) for i in range(3)]
        new = {fam: {(): totals[i]} for i, fam in enumerate(FAMILIES)}
    else:
        named = _named(sums, old, max_accounts)
        per: Dict[str, List[float]] = {}
        for acct, vals in sums.items():
            bucket = per.setdefault(acct if acct in named else OTHER, [0.0, 0.0, 0.0])
            for i in range(3):
                bucket[i] += vals[i]
        new = {fam: {(("account", a),): v[i] for a, v in per.items()} for i, fam in enumerate(FAMILIES)}
    return _monotonic(new, old)


def _named(sums: Mapping[str, Tuple[float, float, float]], old: Samples, max_accounts: int) -> Set[str]:
    """Accounts with a series of their own: those that had one (the biggest, if max_accounts
    was lowered), then the biggest new ones while there is room."""
    size = {a: sums.get(a, (0.0,))[0] for a in sums}
    had = sorted({dict(k).get("account", "") for k in old.get(ALLOCATED, {})} - {OTHER},
                 key=lambda a: (-size.get(a, 0.0), a))
    named = set(had[:max_accounts])
    for acct in sorted(sums, key=lambda a: (-size[a], a)):
        if len(named) >= max_accounts:
            break
        if acct != OTHER:
            named.add(acct)
    return named


def _monotonic(new: Samples, old: Samples) -> Samples:
    """Each series at least what the file said, unless the database is a new one."""
    old_total = sum(old.get(ALLOCATED, {}).values())
    if old_total and sum(new.get(ALLOCATED, {}).values()) < old_total / 2:
        return new  # a new database: the counters start again (a reset to Prometheus)
    return {fam: {labels: max(v, old.get(fam, {}).get(labels, 0.0)) for labels, v in new.get(fam, {}).items()}
            for fam in FAMILIES}
