"""The Slurm backend over pyslurm (the C-API bindings), written against pyslurm 25.11's API.

pyslurm is built against one Slurm major.minor only (its setup checks the headers), and PyPI
carries only 25.11; the Slurm on our build machines is 22.05 (Debian 12).  So this backend
is exercised in tests against a stand-in module (tests/fake_pyslurm) that follows pyslurm's
documented API:

* ``pyslurm.Node.load(name)`` -> Node; ``pyslurm.Nodes.load()`` -> collection of Node
* ``Node.modify(pyslurm.Node(state="DRAIN", reason=...))``; state "RESUME" lifts a drain
* ``pyslurm.Nodes(["gpu01", "gpu02"]).modify(pyslurm.Node(...))``: ONE slurm_update_node for
  the whole collection (pyslurm sends the names as one hostlist), used by drain_many/resume_many
* Node attributes ``name``, ``state`` ("IDLE+DRAIN"), ``reason``, ``reason_user``,
  ``reason_time`` (unix or None), ``configured_gres`` / ``allocated_gres`` (dicts such as
  ``{"gpu:h100": 4}`` / ``{"gpu:h100": {"count": "2", "indexes": "0-1"}}``)
* ``pyslurm.Job.load(id)`` (slurmctld), ``pyslurm.db.Job.load(id)`` (slurmdbd)
* failures raise ``pyslurm.RPCError`` (``.msg``, ``.errno``)

An RPC cannot be interrupted from Python, so each call runs in a daemon thread and we stop
waiting after ``slurm_timeout_s`` (the thread is abandoned; the process exits soon after).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.gpu.deadline import call_with_deadline
from slurm_gpu.errors import SlurmError
from slurm_gpu.slurm.model import NodeInfo, NodeLookup, SlurmBackend, select_nodes, split_state

PING_HINT = "check that slurmctld is running and reachable: `scontrol ping`"
_UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused",
                "communication connection failure", "zero bytes were transmitted", "connect failure")


def import_pyslurm() -> Tuple[Any, str]:
    """(module, '') or (None, why-not).  A pyslurm built for another Slurm typically fails
    here already (libslurm.so.NN missing), hence OSError as well as ImportError."""
    try:
        import pyslurm  # type: ignore
    except (ImportError, OSError) as e:
        return None, str(e) or type(e).__name__
    except Exception as e:  # slurm_init() at import can fail in odd ways (no slurm.conf)
        return None, f"{type(e).__name__}: {e}"
    return pyslurm, ""


def gres_dict_to_str(d: Any) -> str:
    """{'gpu:h100': 4} -> 'gpu:h100:4'; {'gpu:h100': {'count': '2', 'indexes': '0-1'}} -> 'gpu:h100:2(IDX:0-1)'."""
    if not d:
        return ""
    if isinstance(d, str):
        return d
    parts = []
    for key, val in dict(d).items():
        if isinstance(val, dict):
            cnt = val.get("count", 0)
            idx = val.get("indexes")
            parts.append(f"{key}:{cnt}" + (f"(IDX:{idx})" if idx not in (None, "") else ""))
        else:
            parts.append(f"{key}:{val}")
    return ",".join(parts)


def gres_dict_gpus(d: Any) -> int:
    total = 0
    if not d or isinstance(d, str):
        from slurm_gpu.slurm.model import gpu_count
        return gpu_count(d) if isinstance(d, str) else 0
    for key, val in dict(d).items():
        if str(key).split(":")[0] != "gpu":
            continue
        cnt = val.get("count", 0) if isinstance(val, dict) else val
        try:
            total += int(cnt)
        except (TypeError, ValueError):
            pass
    return total


class PyslurmBackend(SlurmBackend):
    name = "pyslurm"

    def __init__(self, module: Any, timeout_s: float = 10.0):
        self.ps = module
        self.timeout_s = float(timeout_s)

    # ------------------------------------------------------------ plumbing
    def _call(self, what: str, fn: Callable[[], Any], *, node: str = "", job: Optional[int] = None) -> Any:
        finished, value, error = call_with_deadline(fn, self.timeout_s, f"pyslurm {what}")
        if not finished:
            raise SlurmError(f"slurmctld not reachable: {what} did not answer within {self.timeout_s:g} s",
                             PING_HINT + "; or raise slurm_timeout_s")
        if error is not None:
            self._raise(error, what, node=node, job=job)
        return value

    def _raise(self, e: BaseException, what: str, *, node: str = "", job: Optional[int] = None) -> None:
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
            raise SlurmError(f"unknown node {node!r}: {text}", "list the cluster's nodes with `sinfo -N`") from None
        if job is not None and ("invalid job id" in low or "does not exist" in low or "no job" in low):
            raise SlurmError(f"unknown job {job}: {text}", "the job id may be mistyped or purged") from None
        if "permission denied" in low or "access denied" in low:
            raise SlurmError(f"{what}: permission denied: {text}",
                             "drain/resume need Slurm administrator rights") from None
        raise SlurmError(f"{what} failed: {text}", PING_HINT) from None

    def _info(self, n: Any) -> NodeInfo:
        state = str(getattr(n, "state", "") or "")
        rt = getattr(n, "reason_time", None)
        cfg_gres = getattr(n, "configured_gres", None)
        used_gres = getattr(n, "allocated_gres", None)
        return NodeInfo(
            name=str(n.name),
            state=state,
            states=split_state(state),
            reason=str(getattr(n, "reason", "") or ""),
            reason_user=str(getattr(n, "reason_user", "") or ""),
            reason_time=float(rt) if isinstance(rt, (int, float)) and rt > 0 else None,
            gres=gres_dict_to_str(cfg_gres),
            gres_used=gres_dict_to_str(used_gres),
            gpus_configured=gres_dict_gpus(cfg_gres),
            gpus_allocated=gres_dict_gpus(used_gres),
            partitions=tuple(str(p) for p in (getattr(n, "partitions", None) or ())),
        )

    # ------------------------------------------------------------ interface
    def node(self, name: str) -> NodeInfo:
        n = self._call(f"pyslurm.Node.load({name!r})", lambda: self.ps.Node.load(name), node=name)
        if n is None or str(getattr(n, "name", "")) != name:
            raise SlurmError(f"unknown node {name!r}: Node '{name}' does not exist", "list the cluster's nodes with `sinfo -N`")
        return self._info(n)

    def nodes(self, names: Optional[List[str]] = None) -> List[NodeInfo]:
        if names is not None and len(names) == 1:
            return [self.node(names[0])]
        coll = self._call("pyslurm.Nodes.load()", lambda: self.ps.Nodes.load())
        items = list(coll.values()) if hasattr(coll, "values") else list(coll)
        return select_nodes([self._info(n) for n in items], names)

    def lookup_nodes(self, names: Sequence[str]) -> NodeLookup:
        """One node: pyslurm.Node.load; more: one pyslurm.Nodes.load() for all of them."""
        if len(names) <= 1:
            return super().lookup_nodes(names)
        coll = self._call("pyslurm.Nodes.load()", lambda: self.ps.Nodes.load())
        items = list(coll.values()) if hasattr(coll, "values") else list(coll)
        wanted = set(names)
        by_name = {str(n.name): self._info(n) for n in items if str(getattr(n, "name", "")) in wanted}
        return NodeLookup({n: by_name[n] for n in names if n in by_name},
                          {n: SlurmError(f"unknown node {n!r}: Node '{n}' does not exist",
                                         "list the cluster's nodes with `sinfo -N`") for n in names if n not in by_name})

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

    def version(self) -> str:
        return str(getattr(self.ps, "__version__", ""))

    def job(self, job_id: int) -> Dict[str, Any]:
        job_id = int(job_id)
        rpc = getattr(self.ps, "RPCError", Exception)

        def live() -> Any:
            try:
                return self.ps.Job.load(job_id)
            except rpc as e:
                if "invalid job id" in str(getattr(e, "msg", None) or e).lower():
                    return None
                raise

        j = self._call(f"pyslurm.Job.load({job_id})", live, job=job_id)
        if j is not None:
            return {"job_id": job_id, "user": j.user_name or "", "account": j.account or "",
                    "partition": j.partition or "", "state": j.state or "", "nodes": j.allocated_nodes or "",
                    "gres": gres_dict_to_str(getattr(j, "gres_per_node", None)), "tres": "",
                    "start_time": _t(j.start_time), "end_time": _t(j.end_time), "source": "slurmctld"}
        d = self._call(f"pyslurm.db.Job.load({job_id})", lambda: self.ps.db.Job.load(job_id), job=job_id)
        return {"job_id": job_id, "user": d.user_name or "", "account": d.account or "",
                "partition": d.partition or "", "state": d.state or "", "nodes": getattr(d, "nodelist", "") or "",
                "gres": "", "tres": "", "start_time": _t(d.start_time), "end_time": _t(d.end_time),
                "source": "slurmdbd"}


def _t(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None
