"""Everything slurm-gpu asks of Slurm, behind one interface with two backends.

* ``cli`` (:mod:`slurm_gpu.slurm.cli_backend`): ``scontrol`` / ``sacct`` as subprocesses —
  works with every Slurm version; the default.
* ``pyslurm`` (:mod:`slurm_gpu.slurm.pyslurm_backend`): the pyslurm C-API bindings, used when
  importable and built for the running Slurm's major.minor.

``slurm_gpu.slurm.backend.get_backend(cfg)`` picks one according to ``slurm_backend = auto | cli | pyslurm``.
Every failure is a :class:`slurm_gpu.errors.SlurmError` carrying Slurm's own error text and
a hint, raised within ``slurm_timeout_s``.

This module is imported by the prolog/epilog: standard library only, no click.
"""
from __future__ import annotations

import abc
import re
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.errors import SlurmError, SlurmGpuError
from slurm_gpu.slurm import reason as _reason
from slurm_gpu.slurm.conf import gres_count, parse_gres

DRAIN_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING"})


class NodeInfo(NamedTuple):
    """One node as slurmctld sees it (a NamedTuple, not a dataclass: the prolog imports this
    module, see gpu/snapshot.py)."""

    name: str
    state: str  # Slurm's full state string, e.g. "IDLE+DRAIN", "MIXED", "DOWN+DRAIN"
    states: FrozenSet[str] = frozenset()  # {"IDLE", "DRAIN"}
    reason: str = ""
    reason_user: str = ""
    reason_time: Optional[float] = None  # unix seconds
    gres: str = ""  # configured, e.g. "gpu:h100:4(S:0-1)"
    gres_used: str = ""  # e.g. "gpu:h100:2(IDX:0-1)"
    gpus_configured: int = 0
    gpus_allocated: int = 0
    partitions: Tuple[str, ...] = ()  # the partitions the node is in (`fleet capacity`)

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
        n = gres_count(v.strip())
        if n is None:
            continue
        if k == "gres/gpu":
            total = n
        elif k.startswith("gres/gpu:"):
            typed += n
    if total is not None:
        return total
    return typed if typed else None


# A job's accounting record is complete only in one of these states and with an end time:
# slurmdbd gets the job's start and its end in separate messages, and sacct can be read in
# between (then the state is still RUNNING and fields may be missing).
TERMINAL_JOB_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                                 "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"})


def final_job_facts(facts: Dict[str, Any]) -> Dict[str, Any]:
    """Mark whether the record is the job's final one (terminal state and an end time)."""
    state = (str(facts.get("state") or "").split() or [""])[0].split("+")[0]
    facts["final"] = state in TERMINAL_JOB_STATES and bool(facts.get("end_time"))
    return facts



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
    from slurm_gpu.slurm.hostlist import compress, sort_key
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
    """An error that every other node of a batch would meet too: slurmctld or slurmdbd
    unreachable, no usable configuration, no Slurm commands, no administrator rights.  Anything
    else (an unknown node, a node in a state the change does not apply to) concerns single nodes."""
    m = e.message
    return (m.startswith(("slurmctld not reachable", "slurmdbd not reachable", "no usable Slurm configuration", "cannot run "))
            or "not found (looked in" in m or ": permission denied:" in m)


class NodeLookup(NamedTuple):
    """The state of named nodes, read in as few requests as the backend can."""

    found: Dict[str, NodeInfo]  # name -> state, in the order asked
    failed: Dict[str, SlurmError]  # name -> why not (unknown node, invalid name)


class BatchResult:
    """What ``drain_many`` / ``resume_many`` did."""

    def __init__(self, done: Optional[List[str]] = None, failed: Optional[Dict[str, SlurmError]] = None,
                 stopped: Optional[SlurmError] = None, requests: int = 0):
        self.done: List[str] = [] if done is None else done  # now in the state asked for
        self.failed: Dict[str, SlurmError] = {} if failed is None else failed  # name -> why not
        # Ended the run early (see ends_batch): names in neither list were not tried.
        self.stopped = stopped
        self.requests = requests  # update requests sent to slurmctld

    def __repr__(self) -> str:
        return (f"BatchResult(done={self.done!r}, failed={self.failed!r}, stopped={self.stopped!r}, "
                f"requests={self.requests!r})")


class SlurmBackend(abc.ABC):
    """What slurm-gpu needs from Slurm.  All methods raise SlurmError on failure."""

    name = "abstract"
    why = ""  # how get_backend chose it (shown by `slurm-gpu status -v` and in logs)
    # ONE update request setting State (and Reason) on every node of a hostlist batch
    # (see hostlist_batches): (names, state, reason) -> None.  None: drain/resume per node.
    _update_nodes: Optional[Callable[[List[str], str, Optional[str]], None]] = None

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

    def reboot(self, name: str, reason: str) -> None:
        """`scontrol reboot ASAP nextstate=DOWN reason=<reason> <name>`: Slurm runs the site's RebootProgram once
        the node is idle and brings it back DOWN with the reason (remediation verifies, then resumes)."""
        raise SlurmError(f"the {self.name} backend cannot ask Slurm for a reboot", "set slurm_backend = \"cli\"")

    # ------------------------------------------------------------ the verification job (remediation/verifyjob.py)
    def _no_verify(self, what: str) -> SlurmError:
        return SlurmError(f"the {self.name} backend cannot {what}", "set slurm_backend = \"cli\"")

    def create_reservation(self, name: str, node: str, duration_min: int, users: Sequence[str],
                           flags: Sequence[str] = ("MAINT", "IGNORE_JOBS")) -> None:
        """A reservation of one node from now on for `duration_min` minutes that only `users` may use."""
        raise self._no_verify("create a reservation")

    def delete_reservation(self, name: str) -> bool:
        """Delete it; False when Slurm does not know it (any other refusal raises)."""
        raise self._no_verify("delete a reservation")

    def reservation(self, name: str) -> Optional[Dict[str, str]]:
        """The reservation's fields as Slurm shows them (ReservationName, Nodes, Flags, ...), None when unknown."""
        raise self._no_verify("read a reservation")

    def submit_batch(self, options: Sequence[str], script: str) -> int:
        """`sbatch --parsable OPTIONS SCRIPT` (each option one argument): the job id."""
        raise self._no_verify("submit a batch job")

    def job_state(self, job_id: int) -> Tuple[str, str, str]:
        """(state, nodes, reason) of a job, from slurmctld while it knows the job, then from accounting."""
        raise self._no_verify("read a job's state")

    def cancel_job(self, job_id: int) -> None:
        """scancel JOB (a job that has ended already is no error)."""
        raise self._no_verify("cancel a job")

    def cancel_reservation_jobs(self, name: str) -> None:
        """scancel every job in the reservation (none is no error)."""
        raise self._no_verify("cancel a reservation's jobs")

    def job_accounted(self, job_id: int) -> bool:
        """Whether slurmdbd holds the job's end (sacct shows its End): slurmctld sends it a moment after."""
        raise self._no_verify("read a job's accounting")

    def ctld_time(self) -> float:
        """slurmctld's clock now (unix time), as slurmctld reports it: remediate's drain ages and budget
        windows are taken on it."""
        raise self._no_verify("read slurmctld's clock")

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

    def drain_many(self, names: Sequence[str], reason: str) -> BatchResult:
        """Drain every named node with one reason: one update request per hostlist batch."""
        if not reason or not reason.strip():
            raise SlurmError("a drain needs a reason", "pass the text formatted by slurm_gpu.slurm.reason.format_reason")
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
        if self._update_nodes is None:
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

