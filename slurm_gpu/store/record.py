"""A job's record on the node: what the prolog and epilog count, the one arithmetic of a job's
usage, and the typed records that the hooks and the CLI hand to `Store.write`.

- The counters (energy, ECC, retired pages, remapped rows) and how each is read from a GPU
  snapshot: `read_counters`, used for the prolog's start record and the epilog's end.
- `usage(start, end, accounting, t0, t1)`: the counter deltas, the duration and the mean
  utilisation of one GPU or slice, pure; the epilog calls it with the counters it reads, the
  store (store/node.py) with the end counters a partial row kept when its start record turns up.
- `JobStart`, `JobEnd`, `Health`, `Drains`: the records; `StartCounters`, `JobRow`, `GpuUsage`,
  `HealthEvent` and `Drain` their rows.  The node database's column tuples are their fields.
  `as_dict(record)` is its JSON shape: what the spool and the hook log keep, and what
  `Store.write` also takes back (spool files, `db ingest --from-log`).  XID events stay lists of
  dicts until the SQL boundary (`xid_text`).

Light to import (the hook path builds these): no sqlite3, no json until a record is encoded.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Iterable, List, Mapping, Optional, Self, Sequence, Tuple

# --------------------------------------------------------------------------- the counters

# The counters of a job start (job_starts) and of a partial row's end (end_counters).
COUNTERS = ("energy_mj", "ecc_corrected", "ecc_uncorrected", "retired_pages", "remapped_rows")
# counter -> (job_gpus column of its delta, divisor to the column's unit, digits kept or None)
_DELTAS = (("energy_mj", "energy_j", 1000.0, 3), ("ecc_corrected", "ecc_corrected_delta", 1.0, None),
           ("ecc_uncorrected", "ecc_uncorrected_delta", 1.0, None),
           ("retired_pages", "retired_pages_delta", 1.0, None), ("remapped_rows", "remapped_rows_delta", 1.0, None))


def _sum(*readings: Any) -> Optional[int]:
    vals = [r.get() for r in readings if r.ok]
    return sum(int(v) for v in vals) if vals else None


def read_counters(g: Any, whole_gpu: bool = True) -> Dict[str, Optional[int]]:
    """The counters of a GPU snapshot (gpu/snapshot.GpuSnapshot); None where unknown.  The energy
    counter is the whole GPU's: a MIG slice's share of it is unknown (whole_gpu=False)."""
    return {"energy_mj": g.energy_mj.get() if whole_gpu else None,
            "ecc_corrected": g.ecc_volatile_corrected.get(), "ecc_uncorrected": g.ecc_volatile_uncorrected.get(),
            "retired_pages": _sum(g.retired_pages_sbe, g.retired_pages_dbe),
            "remapped_rows": _sum(g.remapped_rows_corrected, g.remapped_rows_uncorrected)}


def busy(records: Iterable[Any]) -> Busy:
    """Busy seconds of accounting records (gpu/snapshot.AccountingRecord: percent x milliseconds)."""
    recs = list(records)
    return Busy(sum(r.gpu_utilization_pct * r.time_ms / 1000.0 for r in recs),
                sum(r.memory_utilization_pct * r.time_ms / 1000.0 for r in recs))


def _delta(now: Any, then: Any, scale: float, digits: Optional[int]) -> Optional[float]:
    if now is None or then is None or now < then:
        return None  # unknown, or the counter was reset (driver reload) during the job
    d = float(now - then) / scale
    return d if digits is None else round(d, digits)


def _mean(busy_s: Optional[float], duration: float) -> Optional[float]:
    if busy_s is None:
        return None
    return 0.0 if duration <= 0 else round(min(100.0, busy_s / duration), 3)


def usage(start: Optional[Mapping[str, Any]], end: Mapping[str, Any], accounting: Optional[Busy],
          t0: float, t1: float) -> Dict[str, Any]:
    """One GPU's (or slice's) usage from t0 to t1: duration, counter deltas (None where a side is
    unknown or the counter went back), mean utilisation (None without accounting)."""
    duration = max(0.0, t1 - t0)
    out: Dict[str, Any] = {"duration_s": round(duration, 3)}
    for counter, column, scale, digits in _DELTAS:
        out[column] = _delta(end.get(counter), start.get(counter) if start else None, scale, digits)
    out["gpu_util_mean_pct"] = _mean(accounting.gpu_s if accounting else None, duration)
    out["mem_util_mean_pct"] = _mean(accounting.mem_s if accounting else None, duration)
    return out


def end_counters(counters: Mapping[str, Any], accounting: Optional[Busy], xids: Sequence[Mapping[str, Any]],
                 notes: Optional[str]) -> Dict[str, Any]:
    """What a partial row keeps so that its start record can complete it later (job_gpus.end_counters)."""
    return dict(counters, gpu_busy_s=accounting.gpu_s if accounting else None,
                mem_busy_s=accounting.mem_s if accounting else None, xids=list(xids), notes=notes)


def accounting_of(end: Mapping[str, Any]) -> Optional[Busy]:
    """The Busy an end_counters dict kept; None when it kept none."""
    gpu_s, mem_s = end.get("gpu_busy_s"), end.get("mem_busy_s")
    if gpu_s is None and mem_s is None:
        return None
    return Busy(gpu_s, mem_s)


# --------------------------------------------------------------------------- XID events

# The keys of one of a job's XID events, in the order they are written (job_gpus.xid_events); a flood
# (gpu/xid.py: identical lines, one event) adds its line count and last time.
XID_KEYS = ("xid", "time", "message", "gpu_instance", "line_count", "last_time")


def xid_text(xids: Any) -> Optional[str]:
    """job_gpus.xid_events: a job's XID events as JSON text, None for none.  Text stays as it is
    (a record spooled by an older version)."""
    if xids is None or isinstance(xids, str):
        return xids
    if not xids:
        return None
    import json  # on first use: a job without XIDs never needs it
    return json.dumps([{k: x[k] for k in XID_KEYS if k in x} if isinstance(x, dict) else x for x in xids])


def xids_after(xids: Any, t0: float) -> List[Dict[str, Any]]:
    """The XID events (dicts) at or after t0 (a flood's: whose last line is)."""
    return [x for x in xids or () if isinstance(x, dict) and (x.get("last_time") or x.get("time") or 0) >= t0]


# --------------------------------------------------------------------------- rows


class _Row:
    """A typed row or record: its annotated fields in order (`_fields`: a row's are its table's
    columns), those with a class value defaulted.  A plain class, not a dataclass or NamedTuple: it
    is built on every job's start and end (`dataclasses` pulls in `inspect`, ~17 ms; the eight
    NamedTuples took ~9 ms to create)."""

    _fields: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        names = [n for base in reversed(cls.__mro__) for n in vars(base).get("__annotations__", {})
                 if not n.startswith("_")]
        cls._fields = tuple(dict.fromkeys(names))

    def __init__(self, *args: Any, **kw: Any) -> None:
        if len(args) > len(self._fields):
            raise TypeError(f"{type(self).__name__}: {len(args)} values for {len(self._fields)} fields")
        kw.update(zip(self._fields, args))
        unknown = set(kw) - set(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__}: no field {', '.join(sorted(unknown))}")
        for name in self._fields:
            if name in kw:
                setattr(self, name, kw[name])
            elif not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__}: {name} is missing")

    def _asdict(self) -> Dict[str, Any]:
        return {n: getattr(self, n) for n in self._fields}

    def _replace(self, **kw: Any) -> Self:
        return type(self)(**dict(self._asdict(), **kw))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Row) and type(other) is type(self) and self._asdict() == other._asdict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._asdict().items())})"


class Busy(_Row):
    """What the driver's per-process accounting says a GPU was busy: utilisation x time, in seconds."""

    gpu_s: Optional[float]
    mem_s: Optional[float]


class _JobKey(_Row):
    """One job start on one node: the key of every job table (a requeued job is a new start)."""

    cluster: str
    job_id: int
    restart_count: int
    node: str


class _GpuKey(_JobKey):
    """...and one GPU or MIG slice of it."""

    gpu_uuid: str  # the MIG device's UUID for a slice
    gpu_index: int


class StartCounters(_GpuKey):
    """One GPU's (or MIG slice's) counters at the job's start: a job_starts row."""

    start_time: float
    energy_mj: Optional[int] = None
    ecc_corrected: Optional[int] = None
    ecc_uncorrected: Optional[int] = None
    retired_pages: Optional[int] = None
    remapped_rows: Optional[int] = None


class JobRow(_JobKey):
    """A job start on one node: a jobs row."""

    user: Optional[str]
    uid: Optional[int]
    account: Optional[str]
    partition: Optional[str]
    gpu_count: int
    start_time: float
    end_time: float
    exit_code: Optional[int]
    partial: int = 0
    sluid: Optional[str] = None  # SLURM_JOB_SLUID (25.11+): this run's id, new on a requeue; None before


class GpuUsage(_GpuKey):
    """What a job did with one GPU or MIG slice: a job_gpus row.  The columns up to xid_events are
    the ones reports read (JOB_GPU_COLUMNS: databases of every version read alike)."""

    gpu_model: Optional[str]
    user: Optional[str]
    account: Optional[str]
    partition: Optional[str]
    start_time: float
    end_time: float
    duration_s: float
    energy_j: Optional[float] = None
    gpu_util_mean_pct: Optional[float] = None
    mem_util_mean_pct: Optional[float] = None
    max_memory_bytes: Optional[int] = None  # NULL, never 0, when no process reported it
    process_count: Optional[int] = None
    ecc_corrected_delta: Optional[float] = None
    ecc_uncorrected_delta: Optional[float] = None
    retired_pages_delta: Optional[float] = None
    remapped_rows_delta: Optional[float] = None
    clock_event_reasons: Optional[int] = None
    xid_events: Tuple[Dict[str, Any], ...] = ()
    parent_gpu_uuid: Optional[str] = None
    notes: Optional[str] = None
    partial: int = 0
    end_counters: Optional[Dict[str, Any]] = None
    memory_total_bytes: Optional[int] = None
    sluid: Optional[str] = None  # as in JobRow: `slurm-gpu job SLUID` finds this run's rows by it


class HealthEvent(_Row):
    """A WARN or FAIL a hook or healthcheck saw: a health_events row.  `key` names a lasting state
    (seen again, it is the same event: store/node.py's dedupe key)."""

    time: float
    node: str
    source: str
    job_id: Optional[int]
    gpu_index: Optional[int]
    gpu_uuid: Optional[str]
    check_name: str
    status: str
    message: str
    key: Optional[str] = None


class Drain(_Row):
    """A drain and what came of it (docs/hooks.md, drains table): a drains row.  cluster and
    restart_count are None for a drain of no job start (`slurm-gpu drain`)."""

    time: float
    node: str
    source: str
    job_id: Optional[int]
    reason: str
    ok: int
    cluster: Optional[str]
    restart_count: Optional[int]
    outcome: str
    kept_reason: Optional[str] = None


# outcome of a drain: DRAINED (ok=1), KEPT (already drained, that reason kept), BREAKER (the circuit
# breaker kept the node in service), FAILED (slurmctld not reached), OFF (hooks.drain_on_fault = false)
DRAINED, KEPT, BREAKER, FAILED, OFF = "drained", "kept", "breaker", "failed", "off"


def drain(node: str, source: str, reason: str, outcome: str, at: float, *, kept_reason: Optional[str] = None,
          job_id: Optional[int] = None, cluster: Optional[str] = None, restart_count: Optional[int] = None) -> Drain:
    """The one builder of a drain row (hooks and `slurm-gpu drain`): ok follows the outcome."""
    return Drain(time=at, node=node, source=source, job_id=job_id, reason=reason, ok=int(outcome == DRAINED),
                 cluster=cluster, restart_count=restart_count, outcome=outcome, kept_reason=kept_reason)


JOB_KEY = _JobKey._fields
START_COLUMNS = StartCounters._fields
JOB_WRITE_COLUMNS = JobRow._fields
JOB_GPU_WRITE_COLUMNS = GpuUsage._fields
JOB_GPU_COLUMNS = JOB_GPU_WRITE_COLUMNS[:JOB_GPU_WRITE_COLUMNS.index("xid_events") + 1]
HEALTH_COLUMNS = HealthEvent._fields[:-1] + ("dedupe_key",)  # the key goes into dedupe_key
DRAIN_COLUMNS = Drain._fields + ("dedupe_key",)


# --------------------------------------------------------------------------- records


_BELONGS = ("cluster", "restart_count")


class _Record(_Row):
    """A record carries the job start it belongs to: re-runs and replays are known by it.  Its
    own fields come first (a record is built with them positionally), these last."""

    kind = ""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._fields = tuple(n for n in cls._fields if n not in _BELONGS) + _BELONGS

    cluster: Optional[str] = None
    restart_count: Optional[int] = None

class JobStart(_Record):
    """The prolog's record: the start counters of the job's GPUs and slices."""

    starts: Sequence[StartCounters]
    kind = "job_start"


class JobEnd(_Record):
    """The epilog's record: the job row, one usage row per GPU or slice, the health events; one transaction."""

    job: JobRow
    gpus: Sequence[GpuUsage]
    events: Sequence[HealthEvent] = ()
    kind = "job_end"


class Health(_Record):
    """Health events without a job's usage (a failed prolog, the prolog's WARNs, healthcheck)."""

    events: Sequence[HealthEvent]
    kind = "health"


class Drains(_Record):
    """Drains: a hook's one, or the nodes of one `slurm-gpu drain`."""

    drains: Sequence[Drain]
    kind = "drain"


def _encode(v: Any) -> Any:
    """A row or a list of rows as JSON-able dicts; what a drain or an event does not say is left out."""
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    d = v._asdict()
    if isinstance(v, HealthEvent) and d["key"] is None:
        del d["key"]
    if isinstance(v, Drain):  # a drain of no job start says none
        for k in ("cluster", "restart_count"):
            if d[k] is None:
                del d[k]
    if isinstance(v, GpuUsage):
        d["xid_events"] = list(d["xid_events"])
    return d


Record = Any  # JobStart | JobEnd | Health | Drains, or a record's dict (spool files, log replays)
KINDS = ("job_start", "job_end", "health", "drain")


def as_dict(record: Record) -> Dict[str, Any]:
    """A record's JSON shape (a dict passes as it is)."""
    if isinstance(record, dict):
        return record
    out: Dict[str, Any] = {"kind": record.kind}
    for name in record._fields:
        v = getattr(record, name)
        if name not in ("cluster", "restart_count"):
            out[name] = _encode(v)
        elif v is not None:
            out[name] = v
    return out


def drains_of(rec: Mapping[str, Any]) -> List[Any]:
    """The drains of a drain record's dict: {"drains": [...]}, or {"drain": {...}} as written before
    one shape (spool files and logs of older versions)."""
    if rec.get("drains") is not None:
        return list(rec["drains"])
    return [rec["drain"]]
