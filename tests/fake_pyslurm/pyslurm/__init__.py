"""A stand-in for pyslurm 25.11.2, for testing slurm_gpu.slurm.pyslurm_backend.

It returns what the real module returned on a real cluster (Slurm 25.11.7, pyslurm 25.11.2
built against it; recorded in tests/data/pyslurm-25.11.2.json; test_pyslurm_stand_in_* compares
the shapes):

* ``Nodes.load()``: every node, allocation current.  ``Node.load(name)``: ONE node, with the
  state and allocated TRES as of the last full load: slurmctld 25.11 does not refresh the
  allocation counters for a single-node request (``_slurm_rpc_dump_node_single``).
* ``Node.configured_gres`` ``{"gpu:h100": 2}``; ``Node.allocated_tres`` ``{"cpu": 1, ...}``
  (the node's AllocTRES, ``gres/gpu`` only when AccountingStorageTRES names it:
  ``_set_controller(tres_gres=...)``); ``Node.allocated_gres`` is the gres part of it
  (``{"gpu": 1, "gpu:h100": 1}`` for ONE GPU).  No field of a node has GPU indices.
* ``Jobs.load()`` / ``Job.load(id)``: ``Job.get_resource_layout_per_node()`` ->
  ``{"gpu01": {"cpu_ids": "0", "gres": {"gpu:h100": {"count": 1, "indexes": "0"}}, "memory": None}}``;
  ``Job.gres_per_node`` ``{"gres/gpu": 1}``; ``Job.tres`` a TrackableResources; a running job
  without a time limit ends, for slurmctld, a year after it started.
* ``Nodes([...]).modify(Node(state=..., reason=...))``: ONE update; like slurmctld, an unknown
  name or an invalid state change fails the call but the change applies to every other node.
* ``RPCError(errno=..., msg=...)`` with ``.msg`` and ``.errno``.
* A hung slurmctld (``_set_controller(hang_s=N)``): the RPC waits N seconds inside a C call that
  holds the interpreter lock (libc ``usleep`` through ``ctypes.PyDLL``), as the real RPCs do.

Cluster state lives in a JSON file (``_reset(path)``), not in this process: the backend calls
pyslurm in child processes, as slurmctld's state lives outside the caller.  Test controls are
underscore-prefixed: ``_reset``, ``_add_node``, ``_add_job``, ``_end_job``, ``_set_controller``,
``_calls``, ``_clear_calls``.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import time as _time
from typing import Any, Dict, Iterator, List, Optional

__version__ = "25.11.2"

SLURM_ERROR = -1
_ERRNO_INVALID_NODE = 2009
_ERRNO_INVALID_STATE = 2012
_ERRNO_INVALID_JOB = 2017
_ERRNO_CONNECT = 1001
_STATE_PATH = [""]
_YEAR_S = 365 * 86400


class PyslurmError(Exception):
    pass


class RPCError(PyslurmError):
    def __init__(self, errno: int = SLURM_ERROR, msg: Optional[str] = None):
        self.errno = errno
        self.msg = msg or f"Slurm error {errno}"
        super().__init__(self.msg)


# ------------------------------------------------------------------ the state file
@contextlib.contextmanager
def _state(write: bool = False) -> Iterator[Dict[str, Any]]:
    path = _STATE_PATH[0]
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        st = json.load(f)
        yield st
        if write:
            f.seek(0)
            f.truncate()
            json.dump(st, f)


def _reset(path: str) -> None:
    _STATE_PATH[0] = str(path)
    with open(path, "w") as f:
        json.dump({"nodes": {}, "jobs": {}, "db_jobs": {}, "calls": [],
                   "ctl": {"up": True, "hang_s": 0.0, "uid_name": "root", "tres_gres": True}}, f)


def _set_controller(**kw: Any) -> None:
    with _state(True) as st:
        st["ctl"].update(kw)


def _calls() -> List[str]:
    with _state() as st:
        return list(st["calls"])


def _clear_calls() -> None:
    with _state(True) as st:
        st["calls"] = []


def _add_node(name: str, base: str = "IDLE", flags: Optional[List[str]] = None, reason: Optional[str] = None,
              reason_user: str = "root", reason_time: Optional[int] = None, gres: Optional[Dict[str, int]] = None,
              cpus: int = 2) -> None:
    rec = {"base": base, "flags": list(flags or []), "reason": reason,
           "reason_user": reason_user if reason else None,
           "reason_time": reason_time if reason_time is not None else (int(_time.time()) if reason else None),
           "gres": dict(gres if gres is not None else {"gpu:h100": 4}), "cpus": cpus, "partitions": ["gpu"]}
    with _state(True) as st:
        st["nodes"][name] = rec
        rec["seen"] = _live(st, name)  # what a single-node load shows until the next full load


def _add_job(job_id: int, live: bool = True, node: str = "", gpus: Optional[List[int]] = None, gpu_type: str = "h100",
             **facts: Any) -> None:
    """A job; live and RUNNING on ``node`` with GPU indices ``gpus``, or (live=False) only in slurmdbd."""
    facts = dict(facts)
    facts.setdefault("state", "RUNNING")
    facts.setdefault("time_limit", None)
    if node:
        facts.update(allocated_nodes=node, nodelist=node, gpus=list(gpus or []), gpu_type=gpu_type)
    with _state(True) as st:
        st["jobs" if live else "db_jobs"][str(int(job_id))] = facts


def _end_job(job_id: int, state: str = "COMPLETED") -> None:
    with _state(True) as st:
        st["jobs"][str(int(job_id))].update(state=state, end_time=int(_time.time()))


def _rpc(what: str) -> Dict[str, Any]:
    with _state(True) as st:
        st["calls"].append(what)
        ctl = dict(st["ctl"])
    if ctl["hang_s"]:
        ctypes.PyDLL(None).usleep(int(ctl["hang_s"] * 1e6))  # the lock stays held, as in pyslurm's C calls
    if not ctl["up"]:
        raise RPCError(_ERRNO_CONNECT, "Unable to contact slurm controller (connect failure)")
    return ctl


# ------------------------------------------------------------------ allocation, as slurmctld counts it
def _running_on(st: Dict[str, Any], name: str) -> List[Dict[str, Any]]:
    return [j for j in st["jobs"].values() if j.get("allocated_nodes") == name and j["state"] == "RUNNING"]


def _live(st: Dict[str, Any], name: str) -> Dict[str, Any]:
    """The node's current state and AllocTRES (what a full load reports)."""
    rec = st["nodes"][name]
    jobs = _running_on(st, name)
    cpus = len(jobs)
    base = rec["base"]
    if base in ("IDLE", "MIXED", "ALLOCATED"):
        base = "IDLE" if not cpus else ("ALLOCATED" if cpus >= rec["cpus"] else "MIXED")
    tres: Dict[str, Any] = {}
    if cpus:
        tres = {"cpu": cpus}  # (mem=...M too when jobs ask for memory; the recorded ones did not)
        gpus: Dict[str, int] = {}
        for j in jobs:
            for _ in j.get("gpus", []):
                for key in ("gres/gpu", f"gres/gpu:{j['gpu_type']}"):
                    gpus[key] = gpus.get(key, 0) + 1
        if st["ctl"]["tres_gres"]:
            tres.update(gpus)
    return {"base": base, "alloc_tres": tres}


class Node:
    """A node record, or (when built by the caller) a set of changes for modify()."""

    _WRITABLE = ("name", "state", "reason", "comment", "extra", "weight", "configured_gres", "available_features",
                 "active_features", "address", "hostname", "cpu_binding")

    def __init__(self, name: Optional[str] = None, **kwargs: Any):
        for k in kwargs:
            if k not in self._WRITABLE:
                raise AttributeError(f"attribute '{k}' of 'pyslurm.core.node.Node' objects is not writable")
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_changes", dict(kwargs))
        object.__setattr__(self, "_rec", {})

    @staticmethod
    def _from(name: str, rec: Dict[str, Any], view: Dict[str, Any]) -> "Node":
        n = Node(name)
        object.__setattr__(n, "_rec", dict(rec, **view))
        return n

    @staticmethod
    def load(name: str) -> "Node":
        _rpc(f"Node.load {name}")
        with _state() as st:
            if name not in st["nodes"]:
                raise RPCError(msg=f"Node '{name}' does not exist")
            rec = st["nodes"][name]
            return Node._from(name, rec, rec["seen"])  # stale: no refresh for one node

    @property
    def name(self) -> Optional[str]:
        return self._name

    @property
    def state(self) -> Optional[str]:
        if "state" in self._changes:
            return self._changes["state"]
        r = self._rec
        return "+".join([r["base"]] + r["flags"]) if r else None

    @property
    def reason(self) -> Optional[str]:
        return self._changes.get("reason", self._rec.get("reason"))

    @property
    def reason_user(self) -> Optional[str]:
        return self._rec.get("reason_user")

    @property
    def reason_time(self) -> Optional[int]:
        return self._rec.get("reason_time")

    @property
    def configured_gres(self) -> Dict[str, Any]:
        return dict(self._rec.get("gres", {}))

    @property
    def allocated_tres(self) -> Dict[str, Any]:
        return dict(self._rec.get("alloc_tres", {}))

    @property
    def allocated_gres(self) -> Dict[str, Any]:
        return {k.replace("gres/", ""): v for k, v in self.allocated_tres.items() if "gres/" in k}

    @property
    def partitions(self) -> List[str]:
        return list(self._rec.get("partitions", []))

    def modify(self, changes: "Node") -> None:
        _rpc(f"Node.modify {self._name} {changes._changes}")
        with _state(True) as st:
            _apply(st, self._name, changes)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._WRITABLE:
            raise AttributeError(name)
        self._changes[name] = value

    def __repr__(self) -> str:
        return f"pyslurm.Node('{self._name}')"


def _apply(st: Dict[str, Any], name: Optional[str], changes: "Node") -> None:
    rec = st["nodes"].get(name)
    if rec is None:
        raise RPCError(_ERRNO_INVALID_NODE, "Invalid node name specified")
    state = str(changes._changes.get("state", "")).upper()
    reason = changes._changes.get("reason")
    who = {"reason_user": st["ctl"]["uid_name"], "reason_time": int(_time.time())}
    if state in ("DRAIN", "DOWN"):
        if not reason:
            raise RPCError(SLURM_ERROR, "You must specify a reason when DOWNING or DRAINING a node. Request denied")
        if state == "DRAIN" and "DRAIN" not in rec["flags"]:
            rec["flags"].append("DRAIN")
        if state == "DOWN":
            rec["base"] = "DOWN"
        rec.update(reason=reason, **who)
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
        rec.update(reason=reason, **who)
    rec["seen"] = dict(rec["seen"], base=rec["base"])  # the update itself is seen by a single-node load


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
        with _state(True) as st:
            for name in names:
                try:
                    _apply(st, name, changes)
                except RPCError as e:
                    first = first or e
        if first is not None:
            raise first

    @staticmethod
    def load(preload_passwd_info: bool = False) -> "Nodes":
        _rpc("Nodes.load")
        out = Nodes()
        with _state(True) as st:
            for name, rec in st["nodes"].items():
                rec["seen"] = _live(st, name)  # a full load refreshes every node's counters
                out[name] = Node._from(name, rec, rec["seen"])
        return out


class _TrackableResource:
    """pyslurm.db.tres.TrackableResource (GPU for gres/gpu): the part read here, ``count``."""

    def __init__(self, count: int):
        self.count = count


class _Tres:
    """pyslurm.db.TrackableResources: to_dict(flatten_limits=True) as recorded: every name maps
    to a TrackableResource, Slurm's own names without a value to None."""

    def __init__(self, d: Dict[str, int]):
        self._d = dict(d)

    def to_dict(self, recursive: bool = False, flatten_limits: bool = False) -> Dict[str, Any]:
        out: Dict[str, Any] = {"billing": None, "cpu": None, "energy": None, "mem": None, "node": None,
                               "pages": None, "raw_str": None, "vmem": None}
        out.update((k, _TrackableResource(v)) for k, v in self._d.items())
        return out


class _JobBase:
    _ATTRS = ("user_name", "account", "partition", "state", "start_time", "end_time", "time_limit")

    def __init__(self, job_id: int, facts: Dict[str, Any]):
        self.id = job_id
        self._facts = facts
        for a in self._ATTRS:
            setattr(self, a, facts.get(a))


def _job_tres(facts: Dict[str, Any]) -> Optional[_Tres]:
    if facts.get("state") != "RUNNING" and "tres" not in facts:
        return None
    gpus = len(facts.get("gpus", []))
    d: Dict[str, Any] = {"billing": 1, "cpu": 1, "node": 1}
    if gpus:
        d.update({"gres/gpu": gpus, f"gres/gpu:{facts.get('gpu_type', 'h100')}": gpus})
    return _Tres(facts.get("tres", d))


class Job(_JobBase):
    _ATTRS = _JobBase._ATTRS + ("allocated_nodes",)

    def __init__(self, job_id: int, facts: Dict[str, Any]):
        super().__init__(job_id, facts)
        start = facts.get("start_time")
        if self.end_time is None and start and facts.get("time_limit") is None and facts["state"] == "RUNNING":
            self.end_time = start + _YEAR_S  # slurmctld's end for a job without a time limit
        gpus = facts.get("gpus", [])
        self.gres_per_node = {"gres/gpu": len(gpus)} if gpus else {}  # TresPerNode=gres/gpu:1
        self.allocated_tres = _job_tres(dict(facts, state="RUNNING")) if facts.get("gpus") is not None else None
        self.tres = self.allocated_tres if facts["state"] == "RUNNING" else None  # else the requested TRES

    def get_resource_layout_per_node(self) -> Dict[str, Any]:
        f = self._facts
        if not f.get("allocated_nodes"):
            return {}
        gpus = f.get("gpus", [])
        gres = {f"gpu:{f['gpu_type']}": {"count": len(gpus), "indexes": ",".join(map(str, gpus))}} if gpus else {}
        return {f["allocated_nodes"]: {"cpu_ids": "0", "gres": gres, "memory": None}}

    @staticmethod
    def load(job_id: int) -> "Job":
        _rpc(f"Job.load {job_id}")
        with _state() as st:
            facts = st["jobs"].get(str(int(job_id)))
        if facts is None:
            raise RPCError(_ERRNO_INVALID_JOB, "Invalid job id specified")
        return Job(int(job_id), facts)


class Jobs(dict):
    @staticmethod
    def load(preload_passwd_info: bool = False, frozen: bool = False) -> "Jobs":
        _rpc("Jobs.load")
        out = Jobs()
        with _state() as st:
            for jid, facts in st["jobs"].items():
                out[int(jid)] = Job(int(jid), facts)
        return out


class _DbJob(_JobBase):
    _ATTRS = _JobBase._ATTRS + ("nodelist",)

    def __init__(self, job_id: int, facts: Dict[str, Any]):
        super().__init__(job_id, facts)
        self.allocated_tres = _job_tres(dict(facts, state="RUNNING"))

    @staticmethod
    def load(job_id: int, cluster: Optional[str] = None, with_script: bool = False, with_env: bool = False) -> "_DbJob":
        with _state(True) as st:
            st["calls"].append(f"db.Job.load {job_id}")
            facts = st["db_jobs"].get(str(int(job_id)))
            if not st["ctl"].get("slurmdbd", True):  # recorded without accounting, typo included
                raise RPCError(msg="Failed to open onnection to slurmdbd")
        if facts is None:
            raise RPCError(msg=f"Job {job_id} does not exist on Cluster sgtest")
        return _DbJob(int(job_id), facts)


class _Db:
    Job = _DbJob


db = _Db()
