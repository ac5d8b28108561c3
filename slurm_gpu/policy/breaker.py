"""The circuit breaker for mass drains and reboots: the one place that says whether slurm-gpu may take
one more node out for a check (DESIGN.md §2 item 14; docs/remediation.md, "The circuit breaker").

A bad driver rollout, a kernel-log storm or a bug of ours fails the same check on many nodes at
once; draining them all would take the cluster down for nothing a drain can cure.  So before the
healthcheck, the epilog, the prolog (except its hardware gate) or `remediate` drains or reboots a
node for a check, it asks here with Slurm's node list (the shared state: our reasons name the check,
slurm/reason.py reason_check, and Slurm keeps their time) and this node's last `breaker reset`.

The rule: in each partition of the node, count the OTHER nodes drained by slurm-gpu for that check
whose reason is younger than breaker.window_s (and younger than the last reset).  The breaker is
open when that count has reached max(1, floor(nodes in the partition x max_drained_pct / 100)):
one node per partition and window may always go (a lone broken node in a small partition is not a
storm), and a node already drained by us is never counted against itself.  max_drained_pct 100
turns the breaker off.

Nodes decide at the same moment (slurmctld asks every slurmd for its HealthCheckProgram at once,
and a storm ends many jobs together), so each may count the others before their drains land: the
count before a drain cannot hold the share alone.  So a node that has just drained for a check
confirms it (confirm()) after breaker.settle_s: it ranks the nodes drained by us for the check in
the window by (Slurm's ReasonTime, node name), and withdraws its own drain when the share is filled
by nodes ranked before it.  Exact when settle_s >= 1 s: a drain slurmctld takes after this node's
second read gets a ReasonTime (whole seconds, slurmctld's clock) later than this node's, so it ranks
after it; the last node kept therefore saw every other kept node before it, fewer than the share.
A node may withdraw when a node ranked before it withdraws too (fewer than the share drained): the
next healthcheck or epilog drains it then, the count before the drain having room again.

XID storms (check `xid`): a driver or firmware rollout, or a kernel-log storm, writes the SAME XID on
many nodes; independent broken GPUs write different ones.  So for `xid` a node drained by us counts
only when its reason names an XID code the node being judged fails for too (`XID 79 in kernel log`
in both): a storm of one code is held at the share, while a GPU that falls off the bus during another
code's storm is still drained.  A reason that names no code (cut short, an older version's) is
counted for every code: the safe side.  `slurm-gpu fleet xids --by storm` shows such storms
across the fleet (fleet/xids.py).

Never suspended (HARDWARE): the prolog's gate on the job's own GPUs for a hardware fault.  A job
never starts on a GPU with uncorrectable ECC errors, a failed or pending row remap, one that is lost,
one whose driver asks for recovery or whose NVSwitch fabric is not ready; the prolog fails and Slurm
keeps the job off the node.

Pure and standard library only: the prolog imports it.
"""
from __future__ import annotations

import re
from typing import AbstractSet, Any, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from slurm_gpu import checkcatalog as catalog
from slurm_gpu.config import Config
from slurm_gpu.slurm.reason import is_ours, reason_check

# Checks whose FAIL in the prolog always gates the job (issue 26 item 5): the GPU itself is broken,
# or (nvml: NVML cannot start, e.g. a driver/library mismatch) the driver cannot serve it at all;
# pending_reset: an uncorrectable error's row or page is not retired until a reset, so the next job
# can meet it again; fabric: with the NVSwitch fabric not ready every CUDA program fails at start.
HARDWARE = catalog.HARDWARE  # checkcatalog.py: CheckSpec.hardware
REBOOT = "reboot"  # the "check" of remediate's reboot requests: at most the share of a partition rebooting at once
ANY = "*"  # a reset of every check (`slurm-gpu breaker reset` without --check)
XID = "xid"  # the check whose drains count per XID code (a storm is one code on many nodes)
_XID_CODE = re.compile(r"\bXID (\d{1,4})\b")


class Breaker(NamedTuple):
    max_drained_pct: float
    window_s: float
    settle_s: float = 2.0

    @classmethod
    def from_config(cls, cfg: Config) -> "Breaker":
        return cls(float(cfg.breaker.max_drained_pct), float(cfg.breaker.window_s),
                   float(cfg.breaker.settle_s))


class Verdict(NamedTuple):
    open: bool
    check: str
    partition: str  # the partition judged: the one nearest to (or past) its share ('' when the node is in none)
    drained: int  # other nodes drained by us for the check in the window (in that partition)
    allowed: int  # how many the partition may have
    total: int  # nodes in the partition
    text: str  # one line for the log and the admin


def allowed_nodes(b: Breaker, total: int) -> int:
    """How many nodes of a partition of `total` may be drained for one check in one window."""
    return max(1, int(total * b.max_drained_pct // 100))


def xid_codes(check: str, text: Optional[str]) -> FrozenSet[int]:
    """The XID codes a drain for `check` is about (only `xid` drains have any): read from the fault
    text of a reason or a FAIL (`XID 79 in kernel log: ...`)."""
    if check != XID or not text:
        return frozenset()
    return frozenset(int(c) for c in _XID_CODE.findall(text))


def _drained_for(n: Any, check: str, since: float, codes: AbstractSet[int] = frozenset()) -> bool:
    if not (getattr(n, "drained", False) and is_ours(n.reason)) or reason_check(n.reason) != check:
        return False
    if codes:
        theirs = xid_codes(check, n.reason)
        if theirs and not theirs & codes:
            return False  # another XID: not the same storm
    t = getattr(n, "reason_time", None)
    return t is None or float(t) >= since  # no time known: counted (the safe side)


def decide(b: Breaker, check: str, node: str, nodes: Iterable[Any], now: float,
           resets: Optional[Mapping[str, float]] = None, fault: str = "") -> Verdict:
    """May slurm-gpu drain (or reboot) `node` for `check` now?  nodes: every node as Slurm sees it
    (NodeInfo: name, drained, reason, reason_time, partitions); resets: check (or ANY) -> unix time
    of this node's last `breaker reset`; fault: the reason (or FAIL text) the drain would carry (for
    `xid`, the codes that count: other nodes drained for the same XID)."""
    return _judge(b, check, node, list(nodes), now, resets or {}, second=False, codes=xid_codes(check, fault))


def confirm(b: Breaker, check: str, node: str, nodes: Iterable[Any], now: float,
            resets: Optional[Mapping[str, float]] = None) -> Verdict:
    """After `node` drained for `check` (and settle_s passed): may its drain stay?  Open when, in a
    partition of the node, the nodes drained by us for the check in the window that rank before it by
    (ReasonTime, name) already fill the share: the node then withdraws its drain.  For `xid`, the
    codes are those of the node's own reason."""
    listing = list(nodes)
    me = next((n for n in listing if n.name == node), None)
    codes = xid_codes(check, getattr(me, "reason", "") if me is not None else "")
    return _judge(b, check, node, listing, now, resets or {}, second=True, codes=codes)


def _rank_key(n: Any) -> Tuple[float, str]:
    t = getattr(n, "reason_time", None)
    return (float("-inf") if t is None else float(int(float(t))), str(n.name))  # whole seconds: Slurm's ReasonTime


def _judge(b: Breaker, check: str, node: str, listing: List[Any], now: float, resets: Mapping[str, float],
           second: bool, codes: AbstractSet[int] = frozenset()) -> Verdict:
    """decide() (second=False: count the other nodes drained for the check) and confirm() (second=True:
    count those ranked before this node, itself drained), in the partition nearest to its share."""
    if b.max_drained_pct >= 100:
        return Verdict(False, check, "", 0, 0, len(listing), f"breaker off (max_drained_pct {b.max_drained_pct:g})")
    since = max(now - b.window_s, float(resets.get(check, 0.0)), float(resets.get(ANY, 0.0)))
    me = next((n for n in listing if n.name == node), None)
    if second and (me is None or not _drained_for(me, check, since, codes)):
        return Verdict(False, check, "", 0, 0, len(listing), f"{node} is not drained by slurm-gpu for {check}")
    mine = _rank_key(me) if second else None
    counted = []
    for part in tuple(getattr(me, "partitions", ()) or ()) or ("",):
        members = [n for n in listing if not part or part in (getattr(n, "partitions", ()) or ())]
        drained = sum(1 for n in members if n.name != node and _drained_for(n, check, since, codes)
                      and (mine is None or _rank_key(n) < mine))
        allowed = allowed_nodes(b, len(members))
        counted.append((drained - allowed, part, drained, allowed, len(members)))
    _margin, part, drained, allowed, total = max(counted)  # the partition nearest to (or furthest past) its share
    where = f"partition {part}" if part else "the cluster"
    label = f"{check} ({', '.join(f'XID {c}' for c in sorted(codes))})" if codes else check
    counts = f"{drained} of {total} nodes in {where} drained by slurm-gpu for it{f' before {node}' if second else ''} " \
             f"within {b.window_s:g} s (max_drained_pct {b.max_drained_pct:g} allows {allowed})"
    if drained < allowed:
        return Verdict(False, check, part, drained, allowed, total, f"breaker closed for {label}: {counts}")
    held = f"{node}'s drain withdrawn" if second else f"{node} not drained"
    return Verdict(True, check, part, drained, allowed, total, f"breaker open for {label}: {counts}; {held}")


def gate_suspended(checks: Iterable[str]) -> bool:
    """False when any failing check is a hardware fault: the prolog then gates whatever the breaker says."""
    names = [c for c in checks if c]
    return bool(names) and not any(c in HARDWARE for c in names)
