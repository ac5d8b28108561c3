"""A stand-in for pyslurm 25.11, in memory, for testing slurm_gpu.slurm.pyslurm_backend.

pyslurm builds only against the Slurm release it is made for (25.11 on PyPI) and our
machines run Slurm 22.05, so the real module cannot be installed here.  This stand-in
follows the documented pyslurm 25.11 API for the part slurm-gpu uses:

* ``pyslurm.Node.load(name)`` -> Node, raising ``RPCError`` "Node 'x' does not exist"
* ``pyslurm.Nodes.load()`` -> a dict-like collection name -> Node
* ``pyslurm.Nodes(["a", "b"])`` (names or Node objects) and ``Nodes.modify(changes: Node)``:
  ONE slurm_update_node for every node of the collection.  Like slurmctld (22.05.8, observed),
  an unknown name or an invalid state change fails the call but the change is still applied
  to every other node.
* ``Node(name=None, **changes)`` / ``node.modify(changes: Node)`` (slurm_update_node);
  states "DRAIN" (a reason is mandatory), "RESUME", "UNDRAIN", "DOWN"
* Node attributes ``name``, ``state`` ("IDLE+DRAIN"), ``reason``, ``reason_user``,
  ``reason_time`` (unix int or None), ``configured_gres`` ({"gpu:h100": 4}),
  ``allocated_gres`` ({"gpu:h100": {"count": "2", "indexes": "0-1"}})
* ``pyslurm.Job.load(id)`` (user_name, account, partition, state, allocated_nodes,
  gres_per_node, start_time, end_time); ``pyslurm.db.Job.load(id)`` (nodelist, ...)
* ``RPCError(errno=..., msg=...)`` with ``.msg`` and ``.errno``

Test controls (not pyslurm API, underscore-prefixed): ``_reset()``, ``_add_node()``,
``_add_job()``, ``_CONTROLLER`` (``up``: slurmctld reachable; ``hang_s``: delay every RPC),
``_CALLS`` (a log of RPCs).
"""
from __future__ import annotations

import time as _time
from typing import Any, Dict, List, Optional

__version__ = "25.11.0"

SLURM_ERROR = -1
_ERRNO_INVALID_NODE = 2009
_ERRNO_INVALID_STATE = 2012
_ERRNO_INVALID_JOB = 2017
_ERRNO_CONNECT = 1001

_NODES: Dict[str, Dict[str, Any]] = {}
_JOBS: Dict[int, Dict[str, Any]] = {}
_DB_JOBS: Dict[int, Dict[str, Any]] = {}
_CONTROLLER: Dict[str, Any] = {"up": True, "hang_s": 0.0, "uid_name": "root"}
_CALLS: List[str] = []


class PyslurmError(Exception):
    pass


class RPCError(PyslurmError):
    def __init__(self, errno: int = SLURM_ERROR, msg: Optional[str] = None):
        self.errno = errno
        self.msg = msg or f"Slurm error {errno}"
        super().__init__(self.msg)


def _reset() -> None:
    _NODES.clear()
    _JOBS.clear()
    _DB_JOBS.clear()
    _CALLS.clear()
    _CONTROLLER.update(up=True, hang_s=0.0, uid_name="root")


def _add_node(name: str, base: str = "IDLE", flags: Optional[List[str]] = None, reason: Optional[str] = None,
              reason_user: str = "root", reason_time: Optional[int] = None, gres: Optional[Dict[str, Any]] = None,
              gres_used: Optional[Dict[str, Any]] = None) -> None:
    _NODES[name] = {"base": base, "flags": list(flags or []), "reason": reason,
                    "reason_user": reason_user if reason else None,
                    "reason_time": reason_time if reason_time is not None else (int(_time.time()) if reason else None),
                    "gres": dict(gres if gres is not None else {"gpu:h100": 4}),
                    "gres_used": dict(gres_used or {})}


def _add_job(job_id: int, live: bool = True, **facts: Any) -> None:
    (_JOBS if live else _DB_JOBS)[int(job_id)] = dict(facts)


def _rpc(what: str) -> None:
    _CALLS.append(what)
    if _CONTROLLER["hang_s"]:
        _time.sleep(_CONTROLLER["hang_s"])
    if not _CONTROLLER["up"]:
        raise RPCError(_ERRNO_CONNECT, "Unable to contact slurm controller (connect failure)")


_WRITABLE = ("name", "state", "reason", "comment", "extra", "weight", "configured_gres", "available_features",
             "active_features", "address", "hostname", "cpu_binding")


class Node:
    """A node record, or (when built by the caller) a set of changes for modify()."""

    def __init__(self, name: Optional[str] = None, **kwargs: Any):
        for k in kwargs:
            if k not in _WRITABLE:
                raise AttributeError(f"attribute '{k}' of 'pyslurm.core.node.Node' objects is not writable")
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_changes", dict(kwargs))

    @staticmethod
    def load(name: str) -> "Node":
        _rpc(f"Node.load {name}")
        if name not in _NODES:
            raise RPCError(msg=f"Node '{name}' does not exist")
        return Node(name)

    def _rec(self) -> Dict[str, Any]:
        return _NODES.get(self._name, {})

    @property
    def name(self) -> Optional[str]:
        return self._name

    @property
    def state(self) -> Optional[str]:
        if "state" in self._changes:
            return self._changes["state"]
        r = self._rec()
        return "+".join([r["base"]] + r["flags"]) if r else None

    @property
    def reason(self) -> Optional[str]:
        return self._changes.get("reason", self._rec().get("reason"))

    @property
    def reason_user(self) -> Optional[str]:
        return self._rec().get("reason_user")

    @property
    def reason_time(self) -> Optional[int]:
        return self._rec().get("reason_time")

    @property
    def configured_gres(self) -> Dict[str, Any]:
        return dict(self._rec().get("gres", {}))

    @property
    def allocated_gres(self) -> Dict[str, Any]:
        return dict(self._rec().get("gres_used", {}))

    def modify(self, changes: "Node") -> None:
        _rpc(f"Node.modify {self._name} {changes._changes}")
        _apply(self._name, changes)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _WRITABLE:
            raise AttributeError(name)
        self._changes[name] = value

    def __repr__(self) -> str:
        return f"pyslurm.Node('{self._name}')"


def _apply(name: Optional[str], changes: "Node") -> None:
    rec = _NODES.get(name)
    if rec is None:
        raise RPCError(_ERRNO_INVALID_NODE, "Invalid node name specified")
    state = str(changes._changes.get("state", "")).upper()
    reason = changes._changes.get("reason")
    if state in ("DRAIN", "DOWN"):
        if not reason:
            raise RPCError(SLURM_ERROR, "You must specify a reason when DOWNING or DRAINING a node. Request denied")
        if state == "DRAIN" and "DRAIN" not in rec["flags"]:
            rec["flags"].append("DRAIN")
        if state == "DOWN":
            rec["base"] = "DOWN"
        rec.update(reason=reason, reason_user=_CONTROLLER["uid_name"], reason_time=int(_time.time()))
    elif state in ("RESUME", "UNDRAIN"):
        if "DRAIN" not in rec["flags"] and rec["base"] != "DOWN":
            raise RPCError(_ERRNO_INVALID_STATE, "Invalid node state specified")
        rec["flags"] = [f for f in rec["flags"] if f != "DRAIN"]
        if state == "RESUME" and rec["base"] == "DOWN":
            rec["base"] = "IDLE"
        if rec["base"] != "DOWN":
            rec.update(reason=None, reason_user=None, reason_time=None)
    elif state:
        raise ValueError(f"Invalid Node state: {state}")
    elif reason is not None:
        rec.update(reason=reason, reason_user=_CONTROLLER["uid_name"], reason_time=int(_time.time()))


class Nodes(dict):
    """Collection name -> Node (pyslurm 25.11: a MultiClusterMap; dict-like for the local cluster)."""

    def __init__(self, nodes: Any = None):
        super().__init__()
        if isinstance(nodes, str):
            nodes = nodes.split(",")
        for item in nodes or []:
            n = item if isinstance(item, Node) else Node(str(item))
            self[n.name] = n

    def modify(self, changes: Node) -> None:
        names = list(self.keys())
        _rpc(f"Nodes.modify {','.join(names)} {changes._changes}")
        first: Optional[RPCError] = None
        for name in names:
            try:
                _apply(name, changes)
            except RPCError as e:
                first = first or e
        if first is not None:
            raise first

    @staticmethod
    def load(preload_passwd_info: bool = False) -> "Nodes":
        _rpc("Nodes.load")
        out = Nodes()
        for name in _NODES:
            out[name] = Node(name)
        return out


class _JobBase:
    _ATTRS = ("user_name", "account", "partition", "state", "start_time", "end_time")

    def __init__(self, job_id: int, facts: Dict[str, Any]):
        self.id = job_id
        for a in self._ATTRS:
            setattr(self, a, facts.get(a))


class Job(_JobBase):
    _ATTRS = _JobBase._ATTRS + ("allocated_nodes", "gres_per_node")

    @staticmethod
    def load(job_id: int) -> "Job":
        _rpc(f"Job.load {job_id}")
        if int(job_id) not in _JOBS:
            raise RPCError(_ERRNO_INVALID_JOB, "Invalid job id specified")
        return Job(int(job_id), _JOBS[int(job_id)])


class _DbJob(_JobBase):
    _ATTRS = _JobBase._ATTRS + ("nodelist",)

    @staticmethod
    def load(job_id: int, cluster: Optional[str] = None, with_script: bool = False, with_env: bool = False) -> "_DbJob":
        _CALLS.append(f"db.Job.load {job_id}")
        if int(job_id) not in _DB_JOBS:
            raise RPCError(msg=f"Job {job_id} does not exist")
        return _DbJob(int(job_id), _DB_JOBS[int(job_id)])


class _Db:
    Job = _DbJob


db = _Db()
