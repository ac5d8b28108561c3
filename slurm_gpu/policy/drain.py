"""The one drain decision: may slurm-gpu put its reason on this node now?

Asked by the one drain routine of the prolog, the epilog, ``healthcheck`` and ``drain --unhealthy``
(``hooks/drain.py`` apply_drain), and by the admin's ``slurm-gpu drain`` (``manual=True``).  Pure: it
takes what Slurm says about the node (anything with ``drained``, ``down`` and ``reason``,
e.g. ``slurm_gpu.slurm.model.NodeInfo``) and the reason we would set, and returns what to do.

The table (docs/admin-guide.md, "Drain reasons"):

==========================================  ============  ==========
node as Slurm sees it                       automatic     manual
==========================================  ============  ==========
not drained, not down                       drain         drain
drained/down, reason ours (``slurm-gpu:``)  keep          re-drain
drained, reason not ours (admin, Slurm)     keep          keep
down (not drained), reason not ours         keep          drain
==========================================  ============  ==========

*automatic*: a hook or ``healthcheck`` found a fault.  The first reason stays — ours from an
earlier hook is the more precise one, and someone else's must never become ours (and thus
resumable by ``healthcheck``).  *manual*: an admin ran ``slurm-gpu drain --reason``; the admin's
newer text replaces our own earlier one, an admin's or Slurm's drain is left as it is, and a
node that is merely DOWN gets the DRAIN flag so it stays out of service when it comes back.

Standard library only: the prolog imports this on every job start.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from slurm_gpu.slurm.reason import is_ours

DRAIN = "drain"  # not drained yet: set our reason
REDRAIN = "redrain"  # drained by us before: replace our reason with the new one
KEEP = "keep"  # already drained/down: leave the state and the reason as they are


class DrainDecision(NamedTuple):
    action: str  # DRAIN | REDRAIN | KEEP
    reason: str  # the reason to set (DRAIN/REDRAIN) or the one kept (KEEP)
    whose: str  # owner of the existing drain: "slurm-gpu", "other", or "" when none


def decide_drain(node: Any, new_reason: str, *, manual: bool = False) -> DrainDecision:
    """What to do with ``node`` when slurm-gpu wants it drained with ``new_reason``."""
    drained = bool(getattr(node, "drained", False))
    down = bool(getattr(node, "down", False))
    existing = getattr(node, "reason", "") or ""
    if not (drained or down):
        return DrainDecision(DRAIN, new_reason, "")
    ours = is_ours(existing)
    whose = "slurm-gpu" if ours else "other"
    if manual:
        if ours:
            return DrainDecision(REDRAIN, new_reason, whose)
        if not drained:  # DOWN only: an admin's explicit drain keeps it out when it returns
            return DrainDecision(DRAIN, new_reason, whose)
    return DrainDecision(KEEP, existing, whose)
