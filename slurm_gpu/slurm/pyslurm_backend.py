"""The Slurm backend over pyslurm (the C-API bindings), true to pyslurm 25.11.2 on Slurm 25.11.7.

What the real module gives, recorded from a real run (tests/data/pyslurm-25.11.2.json) and
copied by the stand-in the unit tests use (tests/fake_pyslurm):

* ``pyslurm.Nodes.load()``: every node, with the allocation counters slurmctld refreshes for a
  full load.  ``pyslurm.Node.load(name)`` asks for one node, and slurmctld 25.11 skips that
  refresh (``_slurm_rpc_dump_node_single``, src/slurmctld/proc_req.c): its state and allocated
  TRES are stale.  So every read here is a full load, as ``scontrol show node`` is.
* ``Node.configured_gres``: ``{"gpu:h100": 2}``.  ``Node.allocated_gres`` comes from the node's
  allocated TRES, not its GRES: ``{}`` unless ``AccountingStorageTRES`` names ``gres/gpu``, and
  then ``{"gpu": 1, "gpu:h100": 1}`` for ONE GPU.  The GPUs in use, with their indices, come from
  the jobs: ``Job.get_resource_layout_per_node()`` -> ``{node: {"gres": {"gpu:h100": {"count": 1,
  "indexes": "0"}}, ...}}`` for a running job.  A node's ``gres_used`` is built from those in
  scontrol's spelling (``gpu:h100:1(IDX:0)``, ``gpu:h100:0(IDX:N/A)``).
* ``Node.modify(pyslurm.Node(state="DRAIN", reason=...))``; ``pyslurm.Nodes([...]).modify(...)``
  is ONE slurm_update_node for the whole list (drain_many/resume_many).
* ``pyslurm.Job.load(id)`` (slurmctld), ``pyslurm.db.Job.load(id)`` (slurmdbd); failures raise
  ``pyslurm.RPCError`` (``.msg``, ``.errno``).

Every RPC holds the interpreter lock for its whole C call (pyslurm calls libslurm without
releasing it): a deadline thread cannot fire while it waits (slurmctld SIGSTOPped: a 2 s deadline
ended after MessageTimeout, 5.1 s).  So each call runs in a forked child process
(gpu/deadline.py ``call_in_child``) that is killed at ``slurm_timeout_s``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Set, Tuple, TypeVar, cast

from slurm_gpu.errors import SlurmError
from slurm_gpu.gpu.deadline import call_in_child
from slurm_gpu.slurm.model import NodeInfo, NodeLookup, SlurmBackend, final_job_facts, select_nodes, split_state, tres_gpu_count

PING_HINT = "check that slurmctld is running and reachable: `scontrol ping`"
NODES_HINT = "list the cluster's nodes with `sinfo -N`"
_UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused",
                "communication connection failure", "zero bytes were transmitted", "connect failure")
# Job states whose GRES slurmctld still counts on the node (a COMPLETING job's are released).
_HOLDS_GRES = frozenset({"RUNNING", "SUSPENDED"})
_BUSY = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
_T = TypeVar("_T")


def import_pyslurm() -> Tuple[Any, str]:
    """(module, '') or (None, why-not).  A pyslurm built for another Slurm typically fails
    here already (libslurm.so.NN missing), hence OSError as well as ImportError."""
    try:
        import pyslurm
    except (ImportError, OSError) as e:
        return None, str(e) or type(e).__name__
    except Exception as e:  # slurm_init() at import can fail in odd ways (no slurm.conf)
        return None, f"{type(e).__name__}: {e}"
    return pyslurm, ""


def gres_dict_to_str(d: Any) -> str:
    """{'gpu:h100': 4} -> 'gpu:h100:4'; a job's GRES per node {'gres/gpu': 1} -> 'gpu:1'."""
    if not d:
        return ""
    if isinstance(d, str):
        return d
    return ",".join(f"{str(key).replace('gres/', '', 1)}:{val}" for key, val in dict(d).items())


def gres_gpus(d: Any) -> int:
    """GPUs in a configured-GRES dict ({'gpu:h100': 2, 'gpu:a100': 1} -> 3)."""
    total = 0
    for key, val in dict(d or {}).items():
        if str(key).split(":")[0] == "gpu" and isinstance(val, int) and not isinstance(val, bool):
            total += val
    return total


def parse_indexes(text: Any) -> Set[int]:
    """Slurm's index list '0-1,3' -> {0, 1, 3}; 'N/A' or '' -> set()."""
    out: Set[int] = set()
    for part in str(text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def format_indexes(idx: Set[int]) -> str:
    """{0, 1, 3} -> '0-1,3' (Slurm's bit_fmt); set() -> 'N/A'."""
    if not idx:
        return "N/A"
    runs: List[List[int]] = []
    for i in sorted(idx):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def gres_used_text(configured: Dict[str, Any], used: Dict[str, Set[int]]) -> str:
    """scontrol -d's GresUsed for one node: every configured GRES with what jobs hold of it."""
    return ",".join(f"{key}:{len(used.get(key, ()))}(IDX:{format_indexes(used.get(key, set()))})"
                    for key in dict(configured or {}))


def _values(coll: Any) -> List[Any]:
    return list(coll.values()) if hasattr(coll, "values") else list(coll)


def _t(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


class PyslurmBackend(SlurmBackend):
    name = "pyslurm"

    def __init__(self, module: Any, timeout_s: float = 10.0,
                 runner: Callable[[Callable[[], Any], float, str], Tuple[bool, Any, Optional[BaseException]]]
                 = call_in_child):
        self.ps = module
        self.timeout_s = float(timeout_s)
        self._runner = runner

    # ------------------------------------------------------------ plumbing
    def _call(self, what: str, fn: Callable[[], _T], *, node: str = "", job: Optional[int] = None) -> _T:
        """fn() in a child process (see the module docstring), its errors as SlurmError: fn must
        return plain data (NodeInfo, dicts), never pyslurm objects."""
        def guarded() -> _T:
            try:
                return fn()
            except SlurmError:
                raise
            except Exception as e:
                self._raise(e, what, node=node, job=job)

        finished, value, error = self._runner(guarded, self.timeout_s, f"pyslurm {what}")
        if not finished:
            raise SlurmError(f"slurmctld not reachable: {what} did not answer within {self.timeout_s:g} s",
                             PING_HINT + "; or raise slurm_timeout_s")
        if error is not None:
            raise error
        return cast(_T, value)  # what fn() returned, carried back from the child process

    def _raise(self, e: BaseException, what: str, *, node: str = "", job: Optional[int] = None) -> NoReturn:
        rpc = getattr(self.ps, "RPCError", None)
        if rpc is not None and isinstance(e, rpc):
            text = str(getattr(e, "msg", None) or e)
        elif isinstance(e, (ValueError, TypeError, AttributeError, KeyError)):
            text = f"{type(e).__name__}: {e}"
        else:
            raise e
        low = text.lower()
        if any(s in low for s in _UNREACHABLE):
            raise SlurmError(f"slurmctld not reachable: {text}", PING_HINT) from None
        if node and ("does not exist" in low or "invalid node name" in low or "not found" in low):
            raise SlurmError(f"unknown node {node!r}: {text}", NODES_HINT) from None
        if job is not None and ("invalid job id" in low or "does not exist" in low or "no job" in low):
            raise SlurmError(f"unknown job {job}: {text}", "the job id may be mistyped or purged") from None
        if "permission denied" in low or "access denied" in low:
            raise SlurmError(f"{what}: permission denied: {text}",
                             "drain/resume need Slurm administrator rights") from None
        raise SlurmError(f"{what} failed: {text}", PING_HINT) from None

    # ------------------------------------------------------------ reading nodes (in the child)
    def _gres_in_use(self) -> Dict[str, Dict[str, Set[int]]]:
        """node -> GRES key -> indices held by running jobs (one pyslurm.Jobs.load())."""
        used: Dict[str, Dict[str, Set[int]]] = {}
        for j in _values(self.ps.Jobs.load()):
            if str(getattr(j, "state", "") or "") not in _HOLDS_GRES:
                continue
            for node, layout in (j.get_resource_layout_per_node() or {}).items():
                for key, val in dict((layout or {}).get("gres") or {}).items():
                    if isinstance(val, dict):
                        used.setdefault(str(node), {}).setdefault(str(key), set()).update(
                            parse_indexes(val.get("indexes")))
        return used

    def _info(self, n: Any, used: Dict[str, Set[int]]) -> NodeInfo:
        state = str(getattr(n, "state", "") or "")
        rt = getattr(n, "reason_time", None)
        cfg_gres = dict(getattr(n, "configured_gres", None) or {})
        held = sum(len(v) for k, v in used.items() if k.split(":")[0] == "gpu")
        if not held and not used:  # no job layout: allocated TRES, its untyped gres/gpu total
            tres = ",".join(f"{k}={v}" for k, v in dict(getattr(n, "allocated_tres", None) or {}).items())
            held = tres_gpu_count(tres) or 0
        return NodeInfo(
            name=str(n.name),
            state=state,
            states=split_state(state),
            reason=str(getattr(n, "reason", "") or ""),
            reason_user=str(getattr(n, "reason_user", "") or ""),
            reason_time=float(rt) if isinstance(rt, (int, float)) and rt > 0 else None,
            gres=gres_dict_to_str(cfg_gres),
            gres_used=gres_used_text(cfg_gres, used),
            gpus_configured=gres_gpus(cfg_gres),
            gpus_allocated=held,
            partitions=tuple(str(p) for p in (getattr(n, "partitions", None) or ())),
        )

    def _load_infos(self) -> List[NodeInfo]:
        nodes = _values(self.ps.Nodes.load())
        busy = any(split_state(str(getattr(n, "state", "") or "")) & _BUSY for n in nodes)
        used = self._gres_in_use() if busy else {}
        return [self._info(n, used.get(str(n.name), {})) for n in nodes]

    # ------------------------------------------------------------ interface
    def node(self, name: str) -> NodeInfo:
        found = [i for i in self._call("pyslurm.Nodes.load()", self._load_infos, node=name) if i.name == name]
        if not found:
            raise SlurmError(f"unknown node {name!r}: Node '{name}' does not exist", NODES_HINT)
        return found[0]

    def nodes(self, names: Optional[List[str]] = None) -> List[NodeInfo]:
        if names is not None and len(names) == 1:
            return [self.node(names[0])]
        return select_nodes(self._call("pyslurm.Nodes.load()", self._load_infos), names)

    def lookup_nodes(self, names: Sequence[str]) -> NodeLookup:
        """One full load (one child process) for any number of names."""
        by_name = {i.name: i for i in self._call("pyslurm.Nodes.load()", self._load_infos)}
        return NodeLookup({n: by_name[n] for n in names if n in by_name},
                          {n: SlurmError(f"unknown node {n!r}: Node '{n}' does not exist", NODES_HINT)
                           for n in names if n not in by_name})

    def _update_nodes(self, names: List[str], state: str, reason: Optional[str] = None) -> None:
        from slurm_gpu.slurm.hostlist import compress
        changes: Dict[str, Any] = {"state": state}
        if reason is not None:
            changes["reason"] = reason
        expr = compress(names)

        def go() -> None:
            self.ps.Nodes(list(names)).modify(self.ps.Node(**changes))
        self._call(f"{state.lower()} {expr}", go, node=expr if len(names) == 1 else "")

    def _modify(self, name: str, what: str, **changes: Any) -> None:
        def go() -> None:
            node = self.ps.Node.load(name)
            node.modify(self.ps.Node(**changes))
        self._call(what, go, node=name)

    def drain(self, name: str, reason: str) -> None:
        if not reason or not reason.strip():
            raise SlurmError("a drain needs a reason", "pass the text formatted by slurm_gpu.slurm.reason.format_reason")
        self._modify(name, f"drain {name}", state="DRAIN", reason=reason)

    def resume(self, name: str) -> None:
        self._modify(name, f"resume {name}", state="RESUME")

    def ctld_time(self) -> float:
        """slurmctld's clock through `sdiag` (the command-line tools): pyslurm has no call for it."""
        from slurm_gpu.slurm.cli_backend import CliBackend
        return CliBackend(None, timeout_s=self.timeout_s).ctld_time()

    def version(self) -> str:
        return str(getattr(self.ps, "__version__", ""))

    # ------------------------------------------------------------ jobs
    def job(self, job_id: int) -> Dict[str, Any]:
        job_id = int(job_id)
        facts = self._call(f"pyslurm.Job.load({job_id})", lambda: self._live_job(job_id), job=job_id)
        if facts is None:
            facts = self._call(f"pyslurm.db.Job.load({job_id})", lambda: self._db_job(job_id), job=job_id)
        return final_job_facts(facts)

    def _live_job(self, job_id: int) -> Optional[Dict[str, Any]]:
        try:
            j = self.ps.Job.load(job_id)
        except self.ps.RPCError as e:
            if "invalid job id" in str(getattr(e, "msg", None) or e).lower():
                return None
            raise
        end = _t(j.end_time)
        if getattr(j, "time_limit", None) is None and end is not None and end > time.time():
            end = None  # scontrol's EndTime=Unknown: no time limit, slurmctld's end is a placeholder
        return {"job_id": job_id, "user": j.user_name or "", "account": j.account or "",
                "partition": j.partition or "", "state": j.state or "", "nodes": j.allocated_nodes or "",
                "gres": gres_dict_to_str(getattr(j, "gres_per_node", None)),
                "tres": tres_text(getattr(j, "allocated_tres", None)),
                "start_time": _t(j.start_time), "end_time": end, "source": "slurmctld"}

    def _db_job(self, job_id: int) -> Dict[str, Any]:
        try:
            d = self.ps.db.Job.load(job_id)
        except self.ps.RPCError as e:  # pyslurm 25.11.2 without slurmdbd: "Failed to open onnection to slurmdbd"
            text = str(getattr(e, "msg", None) or e)
            if "slurmdbd" not in text.lower():
                raise
            raise SlurmError(f"unknown job {job_id}: slurmctld no longer knows it and {text}",
                             "job facts after the job ends need accounting "
                             "(AccountingStorageType=accounting_storage/slurmdbd)") from None
        tres = tres_text(getattr(d, "allocated_tres", None))
        n = tres_gpu_count(tres)
        return {"job_id": job_id, "user": d.user_name or "", "account": d.account or "",
                "partition": d.partition or "", "state": d.state or "", "nodes": getattr(d, "nodelist", "") or "",
                "gres": f"gpu:{n}" if n else "", "tres": tres, "start_time": _t(d.start_time),
                "end_time": _t(d.end_time), "source": "slurmdbd"}


# Slurm's own TRES ids come first, in id order (cpu=1, mem=2, ... pages=8); gres and the rest follow.
_TRES_ORDER = ("cpu", "mem", "energy", "node", "billing", "fs/disk", "vmem", "pages")


def _mem_text(mb: int) -> str:
    """Memory in MB as Slurm prints it in TRES text: 1000M, 2G (whole multiples of 1024 go up)."""
    for unit in ("M", "G", "T", "P"):
        if mb % 1024 or unit == "P":
            return f"{mb}{unit}"
        mb //= 1024
    return f"{mb}P"


def tres_text(tres: Any) -> str:
    """pyslurm's TrackableResources -> Slurm's TRES text as scontrol and sacct print it:
    'cpu=1,node=1,billing=1,gres/gpu=1,gres/gpu:h100=1'.  Its to_dict(flatten_limits=True)
    maps each name to a TrackableResource (or GPU) with a ``count``, or to None."""
    if not tres:
        return ""
    if isinstance(tres, str):
        return tres
    d = tres if isinstance(tres, dict) else tres.to_dict(flatten_limits=True)
    counts = {}
    for k, v in d.items():
        n = getattr(v, "count", v)
        if k != "raw_str" and isinstance(n, int) and not isinstance(n, bool) and n > 0:
            counts[k] = n
    keys = [k for k in _TRES_ORDER if k in counts] + [k for k in counts if k not in _TRES_ORDER]
    return ",".join(f"{k}={_mem_text(counts[k]) if k == 'mem' else counts[k]}" for k in keys)
