"""The circuit breaker's inputs and outputs around its one decision (policy/breaker.py).

ask(): Slurm's node list (every node, our reasons with the check they name and Slurm's ReasonTime:
the shared state, no service of our own), this node's last `breaker reset`, the decision, one log
line when it is open and the slurm_gpu_breaker_open{check} gauge.  Forgiving: a node list that
cannot be read leaves the breaker closed (the drain then needs slurmctld anyway, and a broken GPU
must not stay in service because we could not count).

The reset is per node: `slurm-gpu breaker reset [--check NAME]` writes the time into
breaker-reset.json beside the node database (store.database's directory); drains older than it no
longer count on this node.  An admin resets the cluster by running it on every node
(`pdsh -a slurm-gpu breaker reset`, docs/remediation.md): nothing travels between nodes.

confirm(): the second count after a drain (policy/breaker.py: nodes deciding at the same moment),
which withdraws this node's own drain when the nodes drained before it fill the share.

On the hook path: standard library and our own modules only.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, Iterable, Optional

from slurm_gpu.config import Config
from slurm_gpu.errors import SlurmGpuError
from slurm_gpu.policy import breaker as P

STATE_NAME = "breaker-reset.json"


def state_path(cfg: Config) -> str:
    return os.path.join(os.path.dirname(cfg.path_value("store", "database")) or ".", STATE_NAME)


def read_resets(cfg: Config) -> Dict[str, float]:
    """check (or P.ANY) -> unix time of the last reset on this node; {} when none or unreadable."""
    try:
        with open(state_path(cfg), "rb") as f:
            data = json.loads(f.read(1 << 16) or b"{}")
        return {str(k): float(v) for k, v in dict(data).items()}
    except (OSError, ValueError, TypeError):
        return {}


def write_reset(cfg: Config, check: str, now: float) -> str:
    """Record a reset of `check` (P.ANY: every check) at `now`; strict: raises OSError.  Returns the path."""
    path = state_path(cfg)
    resets = read_resets(cfg)
    if check == P.ANY:
        resets = {}
    resets[check] = float(now)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(resets, f, sort_keys=True)
    os.replace(tmp, path)
    return path


def ask(cfg: Config, backend: Any, node: str, check: str, now: float, log: Any = None, fault: str = "",
        **ids: Any) -> P.Verdict:
    """May this node be drained (or rebooted) for `check` now (fault: the reason or FAIL text the drain
    would carry; for `xid` it names the codes that count, policy/breaker.py)?  Never raises."""
    b = P.Breaker.from_config(cfg)
    if b.max_drained_pct >= 100:
        return P.decide(b, check, node, (), now)
    try:
        nodes = backend.nodes()
        verdict = P.decide(b, check, node, nodes, now, read_resets(cfg), fault)
    except Exception as e:  # a bug in counting must not keep a broken GPU in service either
        error = e.message if isinstance(e, SlurmGpuError) else f"{type(e).__name__}: {e}"
        _say(log, "warning", "breaker-unknown", node=node, check=check, error=error, **ids)
        return P.Verdict(False, check, "", 0, 0, 0, f"breaker not consulted: {error}")
    if verdict.open:
        _say(log, "warning", "breaker-open", node=node, check=check, message=verdict.text, **ids)
    write_metric(cfg, {check: 1.0 if verdict.open else 0.0}, log)
    return verdict


def confirm(cfg: Config, backend: Any, node: str, check: str, reason: str, log: Any = None,
            sleep: Optional[Callable[[float], None]] = None, clock: Callable[[], float] = time.time,
            withdraw: Optional[Callable[[], None]] = None, **ids: Any) -> P.Verdict:
    """Right after this node drained for `check` with `reason`: wait breaker.settle_s, count again and
    withdraw the drain (resume the node, or `withdraw()`, only while its reason is still `reason`) when
    nodes drained before it already fill the share (policy/breaker.py confirm).  Never raises: a count
    or a withdrawal that fails leaves the node drained (the safe side for its GPUs)."""
    b = P.Breaker.from_config(cfg)
    if b.max_drained_pct >= 100 or b.settle_s <= 0:
        return P.Verdict(False, check, "", 0, 0, 0, "no second count")
    (sleep or time.sleep)(b.settle_s)
    try:
        nodes = backend.nodes()
        verdict = P.confirm(b, check, node, nodes, clock(), read_resets(cfg))
        if not verdict.open:
            return verdict
        me = next(n for n in nodes if n.name == node)
        if me.reason != reason:  # someone changed it meanwhile: theirs now, left alone
            return P.Verdict(False, check, verdict.partition, verdict.drained, verdict.allowed, verdict.total,
                             f"{node}'s reason changed meanwhile ({me.reason}): drain left")
        (withdraw or (lambda: backend.resume(node)))()
    except Exception as e:
        error = e.message if isinstance(e, SlurmGpuError) else f"{type(e).__name__}: {e}"
        _say(log, "warning", "breaker-unknown", node=node, check=check, error=error, **ids)
        return P.Verdict(False, check, "", 0, 0, 0, f"drain kept, second count failed: {error}")
    _say(log, "warning", "breaker-withdrawn", node=node, check=check, message=verdict.text, **ids)
    write_metric(cfg, {check: 1.0}, log)
    return verdict


def ask_all(cfg: Config, backend: Any, node: str, checks: Iterable[str], now: float, log: Any = None,
            faults: Optional[Dict[str, str]] = None, **ids: Any) -> str:
    """The prolog's question for a FAIL of only non-hardware checks: the breaker's text when it is
    open for every one of them (the gate may then be suspended), else ''.  faults: check -> its FAIL
    texts (the XID codes of an `xid` FAIL)."""
    texts = []
    for check in dict.fromkeys(c for c in checks if c):
        v = ask(cfg, backend, node, check, now, log, fault=(faults or {}).get(check, ""), **ids)
        if not v.open:
            return ""
        texts.append(v.text)
    return "; ".join(texts)


def write_metric(cfg: Config, states: Dict[str, float], log: Any = None, clear_others: bool = False) -> None:
    """slurm_gpu_breaker_open{check}: merge these checks' states into slurm_gpu_breaker.prom.  Never raises."""
    try:
        directory = cfg.path_value("metrics", "textfile_dir")
    except (KeyError, AttributeError):
        return
    if not directory:
        return
    from slurm_gpu.metrics.catalog import BREAKER_FILE
    from slurm_gpu.metrics.textfile import ensure_dir, merge

    def change(old: Dict[str, Dict[Any, float]]) -> Dict[str, Dict[Any, float]]:
        series = {k: (0.0 if clear_others else v) for k, v in dict(old.get("slurm_gpu_breaker_open", {})).items()}
        series.update({(("check", c),): float(v) for c, v in states.items()})
        return {"slurm_gpu_breaker_open": series}
    try:
        ensure_dir(directory)
        merge(directory, BREAKER_FILE, change)
    except Exception as e:  # metrics never change a decision
        _say(log, "error", "metrics-write-failed", dir=directory, what="breaker", error=f"{type(e).__name__}: {e}")


def _say(log: Any, level: str, event: str, **kw: Any) -> None:
    if log is None:
        return
    try:
        getattr(log, level)(event, **kw)
    except Exception:
        pass
