"""Everything slurm-gpu asks of Slurm, behind one interface with two backends.

* ``cli`` (:mod:`slurm_gpu.slurm_cli_backend`): ``scontrol`` / ``sacct`` as subprocesses —
  works with every Slurm version; the default.
* ``pyslurm`` (:mod:`slurm_gpu.slurm_pyslurm_backend`): the pyslurm C-API bindings, used when
  importable and built for the running Slurm's major.minor.

``get_backend(cfg)`` picks one according to ``slurm_backend = auto | cli | pyslurm``.
Every failure is a :class:`slurm_gpu.errors.SlurmError` carrying Slurm's own error text and
a hint, raised within ``slurm_timeout_s``.

This module is imported by the prolog/epilog: standard library only, no click.
"""
from __future__ import annotations

import abc
import re
import threading
import time as _time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from . import reason as _reason
from .errors import ExitCode, NvmlUnavailable, SlurmError, SlurmGpuError

DRAIN_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING"})


@dataclass(frozen=True)
class NodeInfo:
    """One node as slurmctld sees it."""

    name: str
    state: str  # Slurm's full state string, e.g. "IDLE+DRAIN", "MIXED", "DOWN+DRAIN"
    states: FrozenSet[str] = field(default_factory=frozenset)  # {"IDLE", "DRAIN"}
    reason: str = ""
    reason_user: str = ""
    reason_time: Optional[float] = None  # unix seconds
    gres: str = ""  # configured, e.g. "gpu:h100:4(S:0-1)"
    gres_used: str = ""  # e.g. "gpu:h100:2(IDX:0-1)"
    gpus_configured: int = 0
    gpus_allocated: int = 0

    @property
    def drained(self) -> bool:
        return bool(self.states & DRAIN_FLAGS)

    @property
    def down(self) -> bool:
        return "DOWN" in self.states

    @property
    def drained_by_us(self) -> bool:
        return self.drained and _reason.is_ours(self.reason)

    @property
    def drain_owner(self) -> str:
        """'slurm-gpu', 'other' or '' (not drained)."""
        if not self.drained:
            return ""
        return "slurm-gpu" if _reason.is_ours(self.reason) else "other"


def split_state(state: str) -> FrozenSet[str]:
    """'IDLE+DRAIN' / 'idle+drain' / 'MIXED*' -> {'IDLE', 'DRAIN'} (Slurm's '*' = not responding)."""
    parts = set()
    for p in re.split(r"[+,\s]+", (state or "").strip()):
        p = p.strip().upper()
        if not p:
            continue
        if p.endswith("*"):
            p = p.rstrip("*")
            parts.add("NOT_RESPONDING")
        # sinfo spells the drain flag as a state: drained / draining / drng
        if p in ("DRAINED", "DRAINING", "DRNG"):
            parts.add("DRAIN")
        parts.add(p)
    return frozenset(parts)


# ---------------------------------------------------------------- GRES strings

_MULT = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4, "P": 1024 ** 5}


def _split_gres(gres: str) -> List[str]:
    """Split at commas outside parentheses: 'gpu:a:2(IDX:0,2),mps:100' -> 2 items."""
    items, depth, cur = [], 0, []
    for ch in gres:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def parse_gres(gres: Optional[str]) -> List[Tuple[str, str, int]]:
    """Slurm GRES text -> [(name, type, count)].

    Handles ``gpu:h100:4(S:0-1)``, ``gpu:h100:2(IDX:0-1)``, ``gpu:4``, ``gpu`` (count 1),
    ``gres/gpu:h100=4`` / ``gres/gpu=2`` (TRES spelling), ``mps:100K``, lists thereof,
    and ``(null)`` / ``N/A`` / ``''`` (nothing).  Unparseable items are skipped.
    """
    out: List[Tuple[str, str, int]] = []
    if not gres or gres.strip() in ("(null)", "N/A", "none", "None"):
        return out
    for item in _split_gres(gres.strip()):
        item = re.sub(r"\(.*\)$", "", item).strip()  # drop (S:0-1) / (IDX:0-1)
        if item.startswith("gres/"):
            item = item[len("gres/"):]
        if item.startswith("gres:"):
            item = item[len("gres:"):]
        if "=" in item:  # TRES spelling: gpu:h100=4
            item = item.replace("=", ":", 1)
        parts = item.split(":")
        name = parts[0]
        if not name:
            continue
        typ, count = "", 1
        rest = parts[1:]
        if rest:
            m = re.fullmatch(r"(\d+)([KMGTP]?)", rest[-1])
            if m:
                count = int(m.group(1)) * _MULT[m.group(2)]
                rest = rest[:-1]
            elif len(rest) >= 2:
                continue  # name:type:<garbage>
            typ = ":".join(rest)
        out.append((name, typ, count))
    return out


def gpu_count(gres: Optional[str]) -> int:
    """Number of GPUs in a GRES text (sum over types)."""
    return sum(c for n, _t, c in parse_gres(gres) if n == "gpu")


def tres_gpu_count(tres: Optional[str]) -> Optional[int]:
    """GPUs in a TRES text ('cpu=4,gres/gpu=2,gres/gpu:h100=2') or None when not mentioned.

    Slurm lists both the untyped total and per-type counts; the untyped total wins.
    """
    if not tres:
        return None
    total, typed = None, 0
    for item in tres.split(","):
        k, _, v = item.partition("=")
        k = k.strip()
        m = re.fullmatch(r"(\d+)([KMGTP]?)", v.strip())
        if not m:
            continue
        n = int(m.group(1)) * _MULT[m.group(2)]
        if k == "gres/gpu":
            total = n
        elif k.startswith("gres/gpu:"):
            typed += n
    if total is not None:
        return total
    return typed if typed else None


# ---------------------------------------------------------------- the interface

def select_nodes(infos: List["NodeInfo"], names: Optional[List[str]], source: str = "") -> List["NodeInfo"]:
    """The requested nodes out of a full listing, in the requested order; unknown names are an error."""
    if names is None:
        return infos
    by_name = {i.name: i for i in infos}
    missing = [n for n in names if n not in by_name]
    if missing:
        where = f": not in {source}" if source else ""
        raise SlurmError(f"unknown node{'s' if len(missing) > 1 else ''} {', '.join(missing)}{where}",
                         "list the cluster's nodes with `sinfo -N`")
    return [by_name[n] for n in names]


# ---------------------------------------------------------------- many nodes at once

UPDATE_MAX_NODES = 65536  # Slurm refuses a hostlist range of more hosts (src/common/hostlist.c MAX_RANGE)
UPDATE_MAX_CHARS = 60 * 1024  # one hostlist argument stays well below Linux's 128 KiB per argv element


def hostlist_batches(names: Sequence[str], max_nodes: int = UPDATE_MAX_NODES,
                     max_chars: int = UPDATE_MAX_CHARS) -> List[List[str]]:
    """`names` (unique) in natural order, cut into batches that each fit ONE hostlist argument:
    at most ``max_nodes`` names and a compressed hostlist of at most ``max_chars`` characters
    (a batch too long when compressed is halved until it fits).  gpu[0001-9999] is one batch."""
    from .hostlist import compress, sort_key
    ordered = sorted(names, key=sort_key)
    batches: List[List[str]] = []

    def add(chunk: List[str]) -> None:
        if len(chunk) > 1 and len(compress(chunk)) > max_chars:
            mid = len(chunk) // 2
            add(chunk[:mid])
            add(chunk[mid:])
        elif chunk:
            batches.append(chunk)

    for i in range(0, len(ordered), max_nodes):
        add(ordered[i:i + max_nodes])
    return batches


def ends_batch(e: SlurmGpuError) -> bool:
    """An error that every other node of a batch would meet too: slurmctld unreachable, no
    usable configuration, no Slurm commands, no administrator rights.  Anything else (an
    unknown node, a node in a state the change does not apply to) concerns single nodes."""
    m = e.message
    return (m.startswith(("slurmctld not reachable", "no usable Slurm configuration", "cannot run "))
            or "not found (looked in" in m or ": permission denied:" in m)


class NodeLookup(NamedTuple):
    """The state of named nodes, read in as few requests as the backend can."""

    found: Dict[str, NodeInfo]  # name -> state, in the order asked
    failed: Dict[str, SlurmError]  # name -> why not (unknown node, invalid name)


@dataclass
class BatchResult:
    """What ``drain_many`` / ``resume_many`` did."""

    done: List[str] = field(default_factory=list)  # now in the state asked for
    failed: Dict[str, SlurmError] = field(default_factory=dict)  # name -> why not
    stopped: Optional[SlurmError] = None  # ended the run early (see ends_batch): names in neither list were not tried
    requests: int = 0  # update requests sent to slurmctld


class SlurmBackend(abc.ABC):
    """What slurm-gpu needs from Slurm.  All methods raise SlurmError on failure."""

    name = "abstract"
    why = ""  # how get_backend chose it (shown by `slurm-gpu status -v` and in logs)
    # True: _update_nodes sends ONE request for a whole hostlist; False: drain/resume per node.
    batch_updates = False

    @abc.abstractmethod
    def node(self, name: str) -> NodeInfo:
        """One node; SlurmError('unknown node ...') when Slurm does not know it."""

    @abc.abstractmethod
    def nodes(self, names: Optional[List[str]] = None) -> List[NodeInfo]:
        """The named nodes (in that order), or every node when names is None."""

    @abc.abstractmethod
    def drain(self, name: str, reason: str) -> None:
        """Set DRAIN with this reason (caller formats it with reason.format_reason)."""

    @abc.abstractmethod
    def resume(self, name: str) -> None:
        """State=RESUME: clears DRAIN (and DOWN)."""

    @abc.abstractmethod
    def job(self, job_id: int) -> Dict[str, Any]:
        """Job facts: job_id, user, account, partition, state, nodes, gres, tres,
        start_time, end_time (unix or None), source ('slurmctld' or 'slurmdbd')."""

    # ------------------------------------------------------------ many nodes
    def lookup_nodes(self, names: Sequence[str]) -> NodeLookup:
        """The state of every named node; unknown names are reported, not raised.  Raises
        SlurmError only for what ends the whole lookup (see ends_batch).  This default asks
        node by node; the real backends override it with one request."""
        found: Dict[str, NodeInfo] = {}
        failed: Dict[str, SlurmError] = {}
        for n in names:
            try:
                found[n] = self.node(n)
            except SlurmError as e:
                if ends_batch(e):
                    raise
                failed[n] = e
        return NodeLookup(found, failed)

    def _update_nodes(self, names: List[str], state: str, reason: Optional[str] = None) -> None:
        """ONE update request setting State=state (and Reason) on every node of `names` (a
        hostlist's worth, see hostlist_batches).  Only backends with batch_updates implement it."""
        raise NotImplementedError

    def drain_many(self, names: Sequence[str], reason: str) -> BatchResult:
        """Drain every named node with one reason: one update request per hostlist batch."""
        if not reason or not reason.strip():
            raise SlurmError("a drain needs a reason", "pass the text formatted by slurm_gpu.reason.format_reason")
        return self._change_many(list(names), "DRAIN", reason)

    def resume_many(self, names: Sequence[str]) -> BatchResult:
        """State=RESUME on every named node (the caller checked they are drained or down)."""
        return self._change_many(list(names), "RESUME", None)

    def _change_one(self, name: str, state: str, reason: Optional[str]) -> None:
        if state == "DRAIN":
            self.drain(name, reason or "")
        else:
            self.resume(name)

    def _change_many(self, names: List[str], state: str, reason: Optional[str]) -> BatchResult:
        res = BatchResult()
        if not self.batch_updates:
            self._one_by_one(names, state, reason, res)
            return res
        for batch in hostlist_batches(names):
            res.requests += 1
            try:
                self._update_nodes(batch, state, reason)
            except SlurmError as e:
                if ends_batch(e):
                    res.stopped = e
                    return res
                # Slurm (22.05.8, observed) fails the whole request for one unknown name or one
                # node in a state the change does not apply to, yet applies it to all the others.
                self._settle(batch, state, reason, e, res)
                if res.stopped is not None:
                    return res
            else:
                res.done.extend(batch)
        return res

    def _one_by_one(self, names: Sequence[str], state: str, reason: Optional[str], res: BatchResult) -> None:
        for n in names:
            res.requests += 1
            try:
                self._change_one(n, state, reason)
            except SlurmError as e:
                if ends_batch(e):
                    res.stopped = e
                    return
                res.failed[n] = e
            else:
                res.done.append(n)

    def _settle(self, batch: List[str], state: str, reason: Optional[str], err: SlurmError, res: BatchResult) -> None:
        """After a failed batch request: read the batch once, keep what got there, redo the rest
        node by node.  When no node got there and none is unknown, Slurm refused the request
        itself (not one node of it): every node gets that error, without a request per node."""
        try:
            look = self.lookup_nodes(batch)
        except SlurmError as e:
            res.stopped = e
            return
        res.failed.update((n, look.failed[n]) for n in batch if n in look.failed)
        todo = []
        for n in batch:
            info = look.found.get(n)
            if info is None:
                continue
            there = (info.drained and info.reason == reason) if state == "DRAIN" else not (info.drained or info.down)
            if there:
                res.done.append(n)
            else:
                todo.append(n)
        if len(todo) == len(batch):
            res.failed.update((n, err) for n in todo)
            return
        self._one_by_one(todo, state, reason, res)

    def expand_hostlist(self, expr: str) -> List[str]:
        """Expand a Slurm hostlist expression (gpu[01-04,07])."""
        try:
            from .hostlist import expand  # written alongside; pure Python
        except ImportError:  # pragma: no cover - only before hostlist.py exists
            raise SlurmError(f"cannot expand hostlist {expr!r}: no hostlist module", "list the nodes one by one")
        try:
            return list(expand(expr))
        except SlurmError:
            raise
        except Exception as e:
            raise SlurmError(f"invalid hostlist expression {expr!r}: {e}", "e.g. gpu[01-04,07] or gpu01,gpu02")


def slurm_major_minor(version_text: str) -> Optional[Tuple[int, int]]:
    """'slurm 22.05.8' / '25.11.0' / 'slurm-wlm 24.11.5' / '25.5.0' -> (major, minor)."""
    m = re.search(r"(\d+)\.(\d+)", version_text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def get_backend(cfg: Any) -> SlurmBackend:
    """The backend ``cfg.slurm_backend`` asks for: 'cli', 'pyslurm' or 'auto'.

    auto: pyslurm when it imports AND its version's major.minor equals the running Slurm's
    (``scontrol --version``); otherwise the command-line tools.  pyslurm is only imported
    when the site has it installed, so the common path costs nothing.
    """
    from .slurm_cli_backend import CliBackend

    choice = getattr(cfg, "slurm_backend", "auto") or "auto"
    cli = CliBackend(cfg)
    if choice == "cli":
        cli.why = "slurm_backend = 'cli'"
        return cli
    from . import slurm_pyslurm_backend as pb

    mod, err = pb.import_pyslurm()
    if mod is None:
        if choice == "pyslurm":
            raise SlurmError(f"slurm_backend = 'pyslurm' but pyslurm cannot be imported: {err}",
                             "install pyslurm built for your Slurm version, or set slurm_backend = 'auto' or 'cli'")
        cli.why = f"auto: pyslurm not importable ({err})"
        return cli
    py_ver = slurm_major_minor(str(getattr(mod, "__version__", "")))
    try:
        slurm_ver = slurm_major_minor(cli.version())
    except SlurmError as e:
        slurm_ver, verr = None, e.message
    else:
        verr = ""
    if py_ver is not None and py_ver == slurm_ver:
        backend = pb.PyslurmBackend(mod, timeout_s=float(getattr(cfg, "slurm_timeout_s", 10.0)))
        backend.why = f"{choice}: pyslurm {getattr(mod, '__version__', '?')} matches Slurm {slurm_ver[0]}.{slurm_ver[1]:02d}"
        return backend
    fmt = lambda v: f"{v[0]}.{v[1]:02d}" if v else "unknown"  # noqa: E731
    detail = f"pyslurm {getattr(mod, '__version__', '?')} is for Slurm {fmt(py_ver)}, running Slurm is {fmt(slurm_ver)}"
    if verr:
        detail += f" ({verr})"
    if choice == "pyslurm":
        raise SlurmError(f"slurm_backend = 'pyslurm' but {detail}",
                         "install the pyslurm release matching your Slurm major.minor, or set slurm_backend = 'auto'")
    cli.why = f"auto: {detail}; using the command-line tools"
    return cli


# ---------------------------------------------------------------- health -> node state

@dataclass(frozen=True)
class HealthOutcome:
    """What one healthcheck run found and did to the node."""

    node: str
    worst: str  # PASS / WARN / FAIL / SKIP, or TIMEOUT / ERROR when the check did not finish
    action: str  # drained | resumed | kept-drained | left-alone | none | would-drain | would-resume | timeout | error
    message: str  # one line for the admin (and slurmd's log)
    reason: str = ""  # the drain reason we set, or the one we found
    results: Tuple[Any, ...] = ()
    exit_code: int = 0


def _summarise(results: Any) -> Tuple[str, str]:
    """(worst status, drain fault text) via slurm_gpu.health (imported lazily: it pulls the config)."""
    from . import health
    return health.worst(results), health.drain_fault(results)


def node_health_cycle(
    backend: SlurmBackend,
    node_name: str,
    checker: Any,
    *,
    allow_resume: bool = True,
    dry_run: bool = False,
    deadline_s: float = 45.0,
    context: str = _reason.HEALTHCHECK,
    summarise: Any = _summarise,
    clock: Any = None,
) -> HealthOutcome:
    """Check this node's GPUs and bring its Slurm state in line — the `healthcheck` flow.

    checker(NodeInfo) -> results (``CheckResult`` list); it gets the node as Slurm sees it so
    it can expect the configured GPU count.  On FAIL: drain with
    ``slurm-gpu: <fault> [healthcheck]`` unless the node is already drained (whoever drained
    it — an admin's reason is never overwritten).  When healthy and our automatic drain is on
    the node: resume it (``allow_resume``; an admin's manual ``slurm-gpu drain`` is left).
    A drain that is not ours is never touched.

    The whole run stays within ``deadline_s``: the check gets what is left after keeping one
    Slurm timeout in reserve for the drain/resume; a check that overruns changes nothing.
    """
    clock = clock or _time.monotonic
    t0 = clock()
    reserve = float(getattr(backend, "timeout_s", 10.0))
    info = backend.node(node_name)

    budget = deadline_s - (clock() - t0) - reserve
    if budget < 1.0:
        budget = max(1.0, deadline_s - (clock() - t0)) / 2  # tiny deadlines: split what is left
    box: Dict[str, Any] = {}

    def run_check() -> None:
        try:
            box["results"] = list(checker(info))
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    th = threading.Thread(target=run_check, name="slurm-gpu healthcheck", daemon=True)
    th.start()
    th.join(budget)
    if th.is_alive():
        return HealthOutcome(node_name, "TIMEOUT", "timeout",
                             f"{node_name}: GPU check did not finish within {budget:.0f} s (deadline {deadline_s:g} s); "
                             f"node state left unchanged ({info.state})",
                             exit_code=int(ExitCode.UNHEALTHY))
    err = box.get("error")
    results: List[Any] = box.get("results", [])
    if isinstance(err, NvmlUnavailable):
        if info.gpus_configured <= 0:
            return HealthOutcome(node_name, "SKIP", "none",
                                 f"{node_name}: no GPUs configured in Slurm and no NVIDIA driver: nothing to check",
                                 exit_code=int(ExitCode.OK))
        worst, fault = "FAIL", f"NVIDIA driver unusable ({info.gpus_configured} GPUs configured): {err.message}"
    elif isinstance(err, SlurmGpuError):
        return HealthOutcome(node_name, "ERROR", "error", f"{node_name}: check failed: {err.message}; node state left unchanged",
                             exit_code=int(err.exit_code))
    elif err is not None:
        return HealthOutcome(node_name, "ERROR", "error",
                             f"{node_name}: internal error in the GPU check: {type(err).__name__}: {err}; node state left unchanged",
                             exit_code=int(ExitCode.UNHEALTHY))
    else:
        worst, fault = summarise(results)
    res = tuple(results)

    if worst == "FAIL":
        if info.drained or info.down:
            whose = "slurm-gpu" if _reason.is_ours(info.reason) else (info.reason_user or "someone else")
            return HealthOutcome(node_name, worst, "kept-drained",
                                 f"{node_name}: FAIL: {fault}; already {info.state} by {whose} ({info.reason or 'no reason'}), reason left as is",
                                 info.reason, res, int(ExitCode.UNHEALTHY))
        text = _reason.format_reason(fault, context)
        if dry_run:
            return HealthOutcome(node_name, worst, "would-drain", f"{node_name}: FAIL: would drain: {text}", text, res,
                                 int(ExitCode.UNHEALTHY))
        try:
            backend.drain(node_name, text)
        except SlurmGpuError as e:
            e.drain_reason = text  # type: ignore[attr-defined]  # the caller records the failed drain
            raise
        return HealthOutcome(node_name, worst, "drained", f"{node_name}: FAIL: drained: {text}", text, res,
                             int(ExitCode.UNHEALTHY))

    # Healthy (PASS / WARN / SKIP).
    if info.drained and _reason.is_ours(info.reason):
        if not allow_resume:
            return HealthOutcome(node_name, worst, "kept-drained",
                                 f"{node_name}: {worst}: healthy, drain left in place ({info.reason})", info.reason, res)
        if not _reason.auto_resumable(info.reason):
            return HealthOutcome(node_name, worst, "kept-drained",
                                 f"{node_name}: {worst}: healthy, but drained manually through slurm-gpu ({info.reason}); "
                                 f"`slurm-gpu resume {node_name}` lifts it", info.reason, res)
        if dry_run:
            return HealthOutcome(node_name, worst, "would-resume", f"{node_name}: {worst}: would resume (was: {info.reason})",
                                 info.reason, res)
        backend.resume(node_name)
        return HealthOutcome(node_name, worst, "resumed", f"{node_name}: {worst}: healthy again, resumed (was: {info.reason})",
                             info.reason, res)
    if info.drained or info.down:
        return HealthOutcome(node_name, worst, "left-alone",
                             f"{node_name}: {worst}: healthy; {info.state} by {info.reason_user or 'someone else'} "
                             f"({info.reason or 'no reason'}) is not ours, left alone", info.reason, res)
    return HealthOutcome(node_name, worst, "none", f"{node_name}: {worst}: healthy ({info.state})", "", res)
