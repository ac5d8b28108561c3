"""Orchestration: the flows behind `check`, `healthcheck`, the prolog and the epilog.

Kept light to import: the prolog/epilog path must not pay for click, jinja2 or sqlite-utils.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import health, xid
from .config import Config, node_name
from .errors import InputError, NvmlWriteError, SlurmGpuError
from .health import CheckResult
from .jobenv import JobEnv
from .snapshot import GpuSnapshot, NodeSnapshot


def make_reader(cfg: Config, library: Optional[str] = None):
    from .nvml import NvmlReader
    return NvmlReader(library=library if library is not None else cfg.get("", "nvml_library"),
                      timeout_s=cfg.get("", "nvml_timeout_s"))


def read_xids(cfg: Config, now: Optional[float] = None) -> Tuple[List[xid.XidEvent], str]:
    source = cfg.get("xid", "source").replace("%n", node_name())
    return xid.read_events(source, cfg.get("xid", "window_s"), timeout_s=cfg.get("", "nvml_timeout_s"), now=now)


def check_node(
    cfg: Config,
    indices: Optional[Sequence[int]] = None,
    *,
    idle: "Optional[Iterable[int] | bool]" = None,
    expected_count: Optional[int] = None,
    reader=None,
    snapshot: Optional[NodeSnapshot] = None,
    now: Optional[float] = None,
) -> Tuple[NodeSnapshot, List[CheckResult]]:
    """Read (or take) a snapshot, read XIDs, and judge.  Raises NvmlUnavailable when there is no driver."""
    now = time.time() if now is None else now
    if snapshot is None:
        reader = reader or make_reader(cfg)
        snapshot = reader.snapshot(indices)
        events, problem = read_xids(cfg, now)
    else:
        events, problem = [], ""  # offline evaluation of a saved snapshot: no live kernel log
    results = health.evaluate(snapshot, cfg, gpus=indices, idle=idle, expected_count=expected_count,
                              xid_events=events, xid_problem=problem, now=now)
    return snapshot, results


# --- prolog / epilog -------------------------------------------------------------------------


PROLOG_OK, PROLOG_FAULT = 0, 1


@dataclass
class HookDeps:
    """What a hook talks to; tests inject fakes at these seams (DESIGN.md §2.9)."""

    cfg: Config
    log: Any  # HookLog
    reader: Any = None  # NvmlReader
    store: Any = None  # Store
    slurm: Any = None  # SlurmBackend
    now: Callable[[], float] = time.time
    kill: Callable[[int, int], None] = None  # type: ignore[assignment]
    pid_alive: Callable[[int], bool] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.reader is None:
            self.reader = make_reader(self.cfg)
        if self.store is None:
            from .store import Store
            self.store = Store.from_config(self.cfg)
        if self.kill is None:
            self.kill = os.kill
        if self.pid_alive is None:
            self.pid_alive = _pid_alive

    def backend(self):
        if self.slurm is None:
            from .slurm import get_backend
            self.slurm = get_backend(self.cfg)
        return self.slurm


def _pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie holds no GPU context)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # Field 3 follows the parenthesised command name, which may itself contain ')'.
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


class MissingGpu(InputError):
    """Slurm's GPU index points past the GPUs the driver shows: a node fault, never fail-open."""


def map_job_gpus(job_gpus: Sequence[int], ident: NodeSnapshot) -> Dict[int, int]:
    """Slurm GRES index -> NVML index.

    Slurm numbers a node's GPUs in gres.conf order, i.e. by device file /dev/nvidia<minor>.
    So the k-th GRES index is the GPU with the k-th smallest minor number — which is the NVML
    index on a node whose minors are 0..n-1 in PCI order, but not always (docs/hooks.md).
    """
    by_minor = sorted((g.minor_number.get(g.index), g.index) for g in ident.gpus)
    out: Dict[int, int] = {}
    for k in job_gpus:
        if k >= len(by_minor):
            raise MissingGpu(f"Slurm gave the job GPU {k} but the driver shows only {len(by_minor)} GPUs",
                             "a GPU fell off the bus or gres.conf lists more GPUs than the node has: check nvidia-smi, dmesg")
        out[k] = by_minor[k][1]
    return out


def _results_events(results: Sequence[CheckResult], node: str, source: str, job_id: Optional[int], t: float) -> List[Dict[str, Any]]:
    return [{"time": t, "node": node, "source": source, "job_id": job_id, "gpu_index": r.gpu_index,
             "gpu_uuid": r.gpu_uuid or None, "check_name": r.check, "status": r.status, "message": r.message}
            for r in results if r.status in (health.WARN, health.FAIL)]


def _drain(deps: HookDeps, job: JobEnv, source: str, fault: str) -> bool:
    """Drain this node with our reason; record it.  Returns True when Slurm took the drain."""
    from .reason import format_reason
    reason = format_reason(fault, f"{source} job {job.job_id}")
    ok = False
    if deps.cfg.get("hooks", "drain_on_fault"):
        try:
            backend = deps.backend()
            info = backend.node(job.node)
            if info.drained:
                # Keep the first reason: ours from an earlier hook (the epilog after a failed
                # prolog sees the same fault) is the more precise one, and someone else's drain
                # (an admin's maintenance) must not become ours and thus resumable.
                deps.log.warning("already-drained", job=job.job_id, node=job.node, reason=reason,
                                 existing=info.reason)
            else:
                backend.drain(job.node, reason)
                deps.log.warning("drain", job=job.job_id, node=job.node, reason=reason)
            ok = True
        except SlurmGpuError as e:
            deps.log.error("drain-failed", job=job.job_id, node=job.node, reason=reason, error=e.message)
    else:
        deps.log.warning("fault-no-drain", job=job.job_id, node=job.node, reason=reason)
    _write(deps, {"kind": "drain", "drain": {"time": deps.now(), "node": job.node, "source": source,
                                            "job_id": job.job_id, "reason": reason, "ok": int(ok)}}, job)
    return ok


def _write(deps: HookDeps, record: Dict[str, Any], job: JobEnv) -> None:
    try:
        where = deps.store.write(record)
    except SlurmGpuError as e:
        # Last resort: the record goes into the log so an admin can replay it.
        deps.log.error("record-lost-to-log", job=job.job_id, node=job.node, error=e.message,
                       record=json.dumps(record, sort_keys=True))
        return
    if where != "db":
        deps.log.warning("record-spooled", job=job.job_id, node=job.node, kind=record["kind"], file=where[6:])


def _job_gpu_snapshot(deps: HookDeps, job: JobEnv) -> Tuple[NodeSnapshot, List[CheckResult]]:
    """Map the job's GPUs, read them, and judge them (they must be idle)."""
    ident = deps.reader.identities()
    try:
        mapping = map_job_gpus(job.gpus, ident)
    except MissingGpu as e:
        return ident, [CheckResult("gpu_count", health.FAIL, None, "", e.message, e.hint)]
    nvml_indices = sorted(set(mapping.values()))
    now = deps.now()
    events, problem = read_xids(deps.cfg, now)
    snap = deps.reader.snapshot(nvml_indices)
    results = health.evaluate(snap, deps.cfg, gpus=nvml_indices, idle=nvml_indices, xid_events=events,
                              xid_problem=problem, now=now)
    return snap, results


def prolog(job: JobEnv, deps: HookDeps) -> int:
    """Gate the job on its GPUs' health, then reset them and record the job start."""
    log, cfg = deps.log, deps.cfg
    if not job.gpus:
        log.info("no-gpus", job=job.job_id, node=job.node)
        return PROLOG_OK
    snap, results = _job_gpu_snapshot(deps, job)
    t = deps.now()
    for r in results:
        if r.status in (health.FAIL, health.WARN):
            log.event("check", "warning" if r.status == health.WARN else "error", job=job.job_id, node=job.node,
                      gpu=r.gpu_uuid or r.where, check=r.check, status=r.status, message=r.message)
    if health.worst(results) == health.FAIL:
        _drain(deps, job, "prolog", health.drain_fault(results))
        _write(deps, {"kind": "health", "events": _results_events(results, job.node, "prolog", job.job_id, t)}, job)
        return PROLOG_FAULT
    prepared = deps.reader.prepare([g.index for g in snap.gpus],
                                   persistence=cfg.get("hooks", "persistence_mode"),
                                   reset_clocks=cfg.get("hooks", "reset_clocks"),
                                   accounting=cfg.get("hooks", "accounting_mode"))
    starts = []
    for g in snap.gpus:
        uuid = g.uuid_or_index
        outcome = prepared.get(g.index)
        if isinstance(outcome, NvmlWriteError):
            # A GPU that stops answering while we reset it is a fault; other write errors
            # (e.g. no permission) are our environment's problem and must not block the job.
            if deps.reader.is_stuck(g.index):
                _drain(deps, job, "prolog", f"{g.label} stopped responding during reset: {outcome.message}")
                return PROLOG_FAULT
            log.error("reset-failed", job=job.job_id, node=job.node, gpu=uuid, error=outcome.message)
        starts.append({
            "cluster": job.cluster, "job_id": job.job_id, "restart_count": job.restart_count, "node": job.node,
            "gpu_uuid": uuid, "gpu_index": g.index, "start_time": t, "energy_mj": g.energy_mj.get(),
            "ecc_corrected": g.ecc_volatile_corrected.get(), "ecc_uncorrected": g.ecc_volatile_uncorrected.get(),
            "retired_pages": _sum(g.retired_pages_sbe, g.retired_pages_dbe),
            "remapped_rows": _sum(g.remapped_rows_corrected, g.remapped_rows_uncorrected),
        })
        log.info("pass", job=job.job_id, node=job.node, gpu=uuid, index=g.index)
    _write(deps, {"kind": "job_start", "starts": starts}, job)
    warn = _results_events(results, job.node, "prolog", job.job_id, t)
    if warn:
        _write(deps, {"kind": "health", "events": warn}, job)
    return PROLOG_OK


def _sum(*rs: Any) -> Optional[int]:
    vals = [r.get() for r in rs if r.ok]
    return sum(int(v) for v in vals) if vals else None


def _kill_leftovers(deps: HookDeps, job: JobEnv, indices: Sequence[int]) -> Dict[int, List[int]]:
    """TERM, grace period, KILL for processes still on the job's GPUs.  Returns survivors per GPU."""
    cfg, log, r = deps.cfg, deps.log, deps.reader
    found: Dict[int, List[int]] = {}
    for i, procs in r.processes_many(indices).items():
        if isinstance(procs, NvmlWriteError):
            log.error("process-list-failed", job=job.job_id, node=job.node, index=i, error=procs.message)
            continue
        pids = [p.pid for p in procs if p.pid not in (0, 1, os.getpid())]
        if pids:
            found[i] = pids
    if not found:
        return found
    if not cfg.get("hooks", "kill_leftovers"):
        # The site kills nothing: the leftover_processes check reports them instead.
        log.warning("leftover-processes-not-killed", job=job.job_id, node=job.node,
                    pids=",".join(str(p) for ps in found.values() for p in ps))
        return {}
    everyone = sorted({p for ps in found.values() for p in ps})
    log.warning("leftover-processes", job=job.job_id, node=job.node, pids=",".join(map(str, everyone)))
    for sig, wait in ((signal.SIGTERM, cfg.get("hooks", "kill_grace_s")), (signal.SIGKILL, 2.0)):
        alive = [p for p in everyone if deps.pid_alive(p)]
        for p in alive:
            try:
                deps.kill(p, sig)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                log.error("kill-failed", job=job.job_id, node=job.node, pid=p, error=str(e))
        end = time.monotonic() + wait
        while time.monotonic() < end and any(deps.pid_alive(p) for p in alive):
            time.sleep(0.05)
        everyone = [p for p in everyone if deps.pid_alive(p)]
        if not everyone:
            break
    # Ask the driver again: what it still lists and is still alive survived KILL.
    survivors: Dict[int, List[int]] = {}
    for i, procs in r.processes_many(sorted(found)).items():
        if isinstance(procs, NvmlWriteError):
            continue
        left = [p.pid for p in procs if p.pid not in (0, 1, os.getpid()) and deps.pid_alive(p.pid)]
        if left:
            survivors[i] = left
    return survivors


def _usage(g: GpuSnapshot, start: Optional[Dict[str, Any]], acct: Any, end: float, job: JobEnv,
           xids: List[Dict[str, Any]]) -> Dict[str, Any]:
    start_time = start["start_time"] if start else None
    records = list(acct.value) if acct is not None and acct.ok else None
    if start_time is None:
        # No prolog record (slurm-gpu installed mid-job, or the prolog failed open): fall back
        # to the first process the driver saw; the duration is then a lower bound.
        starts = [rec.start_time_us / 1e6 for rec in records or [] if rec.start_time_us]
        start_time = min(starts) if starts else end
    if records is not None:
        records = [rec for rec in records if not rec.start_time_us or rec.start_time_us / 1e6 >= start_time - 2.0]
    duration = max(0.0, end - start_time)

    def delta(now_v: Optional[int], key: str, scale: float = 1.0) -> Optional[float]:
        then = start.get(key) if start else None
        if now_v is None or then is None or now_v < then:
            return None  # unknown, or the counter was reset (driver reload) during the job
        return (now_v - then) / scale

    def mean(attr: str) -> Optional[float]:
        if records is None:
            return None
        if duration <= 0:
            return 0.0
        busy = sum(getattr(rec, attr) * rec.time_ms / 1000.0 for rec in records)
        return round(min(100.0, busy / duration), 3)

    energy = delta(g.energy_mj.get(), "energy_mj", 1000.0)
    return {
        "cluster": job.cluster, "job_id": job.job_id, "restart_count": job.restart_count, "node": job.node,
        "gpu_uuid": g.uuid_or_index, "gpu_index": g.index, "gpu_model": g.name.get(), "user": job.user,
        "account": job.account, "partition": job.partition, "start_time": start_time, "end_time": end,
        "duration_s": round(duration, 3), "energy_j": None if energy is None else round(energy, 3),
        "gpu_util_mean_pct": mean("gpu_utilization_pct"), "mem_util_mean_pct": mean("memory_utilization_pct"),
        "max_memory_bytes": None if records is None else max(
            [rec.max_memory_bytes for rec in records if rec.max_memory_bytes is not None], default=0),
        "process_count": None if records is None else len(records),
        "ecc_corrected_delta": delta(g.ecc_volatile_corrected.get(), "ecc_corrected"),
        "ecc_uncorrected_delta": delta(g.ecc_volatile_uncorrected.get(), "ecc_uncorrected"),
        "retired_pages_delta": delta(_sum(g.retired_pages_sbe, g.retired_pages_dbe), "retired_pages"),
        "remapped_rows_delta": delta(_sum(g.remapped_rows_corrected, g.remapped_rows_uncorrected), "remapped_rows"),
        "clock_event_reasons": g.clock_event_reasons.get(),
        "xid_events": None if not xids else json.dumps(xids),
    }


def epilog(job: JobEnv, deps: HookDeps) -> int:
    """Record what the job did with its GPUs, clean up, and check the GPUs again."""
    log, cfg, r = deps.log, deps.cfg, deps.reader
    if not job.gpus:
        log.info("no-gpus", job=job.job_id, node=job.node)
        return 0
    ident = r.identities()
    try:
        mapping = map_job_gpus(job.gpus, ident)
    except MissingGpu as e:
        log.error("check", job=job.job_id, node=job.node, check="gpu_count", status=health.FAIL, message=e.message)
        return 0 if _drain(deps, job, "epilog", e.message) else 1
    indices = sorted(set(mapping.values()))
    survivors = _kill_leftovers(deps, job, indices)
    acct = r.accounting_many(indices)
    for i, a in list(acct.items()):
        if isinstance(a, NvmlWriteError):
            log.error("accounting-read-failed", job=job.job_id, node=job.node, index=i, error=a.message)
            acct[i] = None
    end = deps.now()
    events, problem = read_xids(cfg, end)
    snap = r.snapshot(indices)
    results = health.evaluate(snap, cfg, gpus=indices, idle=indices, xid_events=events, xid_problem=problem, now=end)
    starts = deps.store.job_starts(job.cluster, job.job_id, job.restart_count, job.node)
    ran_here = bool(starts)
    if not starts:
        # No prolog record: the prolog failed (the job was requeued and never ran here) or
        # slurm-gpu was installed while the job ran.  Without the start counters there is no
        # right number to record — and the driver's accounting may still hold an earlier
        # job's processes, since a failed prolog does not clear them.
        log.warning("no-start-record", job=job.job_id, node=job.node)
    gpu_rows = []
    for g in snap.gpus:
        start = starts.get(g.uuid_or_index)
        t0 = start["start_time"] if start else 0.0
        bus = xid.bus_key(g.pci_bus_id.get(""))
        xids = [{"xid": e.xid, "time": e.time, "message": e.message[:200]} for e in events
                if e.bus == bus and (e.time or 0) >= t0]
        gpu_rows.append(_usage(g, start, acct.get(g.index), end, job, xids))
    if cfg.get("hooks", "reset_clocks"):
        reset = r.prepare([g.index for g in snap.gpus if not g.unreachable], reset_clocks=True)
        for i, outcome in reset.items():
            g = snap.gpu(i)
            if isinstance(outcome, NvmlWriteError):
                log.error("reset-failed", job=job.job_id, node=job.node, gpu=g.uuid_or_index, error=outcome.message)
            else:
                log.info("reset", job=job.job_id, node=job.node, gpu=g.uuid_or_index)
    job_row = {"cluster": job.cluster, "job_id": job.job_id, "restart_count": job.restart_count, "node": job.node,
               "user": job.user, "uid": job.uid, "account": job.account, "partition": job.partition,
               "gpu_count": len(job.gpus), "start_time": min([g["start_time"] for g in gpu_rows], default=end),
               "end_time": end, "exit_code": job.exit_code}
    if cfg.get("hooks", "kill_leftovers"):
        # The kill already happened: what the driver lists now are survivors, judged separately.
        results = [x for x in results if x.check != "leftover_processes"]
    fault = ""
    if survivors:
        g_idx = sorted(survivors)[0]
        g = snap.gpu(g_idx)
        label = g.label if g else f"GPU {g_idx}"
        pids = ",".join(str(p) for ps in survivors.values() for p in ps)
        fault = f"{label} processes survived SIGKILL after the job: pid {pids}"
        results.append(CheckResult("leftover_processes", health.FAIL, g_idx, g.uuid.get("") if g else "", fault,
                                   "processes stuck in the driver (D state) need a GPU reset or reboot"))
    elif health.worst(results) == health.FAIL:
        fault = health.drain_fault(results)
    for x in results:
        if x.status in (health.FAIL, health.WARN):
            log.event("check", "warning" if x.status == health.WARN else "error", job=job.job_id, node=job.node,
                      gpu=x.gpu_uuid or x.where, check=x.check, status=x.status, message=x.message)
    events = _results_events(results, job.node, "epilog", job.job_id, end)
    if ran_here:
        _write(deps, {"kind": "job_end", "job": job_row, "gpus": gpu_rows, "events": events}, job)
    elif events:
        _write(deps, {"kind": "health", "events": events}, job)
    for row in gpu_rows if ran_here else []:
        log.info("record", job=job.job_id, node=job.node, gpu=row["gpu_uuid"], energy_j=row["energy_j"],
                 gpu_util=row["gpu_util_mean_pct"], max_mem=row["max_memory_bytes"],
                 xids=len(json.loads(row["xid_events"])) if row["xid_events"] else 0)
    if fault:
        # Drained with our reason: exit 0 so Slurm does not overwrite it with "Epilog error".
        # If the drain did not reach slurmctld, fail the epilog so that Slurm drains the node.
        return 0 if _drain(deps, job, "epilog", fault) else 1
    return 0
