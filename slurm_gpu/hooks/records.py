"""What the prolog and epilog record, and how: the job's start counters, its usage rows (partial when
the start record is missing), health events and drains as store/record.py's records; each written to
the node database, else the spool, else the hook log; then the bounded housekeeping of the spool.

`json` is imported where it is used: a job whose records go straight into the database never needs it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from slurm_gpu.errors import SlurmGpuError
from slurm_gpu.gpu import xid
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot
from slurm_gpu.policy import health
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.slurm.gpumap import JobGpu, JobGpuMap
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.store import record as R

if TYPE_CHECKING:
    from slurm_gpu.hooks.deps import HookDeps


def write(deps: HookDeps, record: R.Record, job: JobEnv) -> str:
    """Database, else spool, else — whatever went wrong, even a bug of ours — the hook log and the
    fallback log as one line of complete JSON that `slurm-gpu db ingest --from-log` replays.
    Never raises: the drain decision must still run after a record that fits nowhere."""
    # The job start a record belongs to: re-runs and replays of it are recognised by this.
    record = record._replace(cluster=job.cluster if record.cluster is None else record.cluster,
                             restart_count=job.restart_count if record.restart_count is None else record.restart_count)
    try:
        written = deps.store.write(record, ingest=False)
    except Exception as e:
        _lost_to_log(deps, job, record, e)
        return "log"
    if written.where == "spool":
        deps.job_log(job).warning("record-spooled", kind=record.kind, file=written.path,
                                  reason=deps.store.unavailable or None)
    elif written.where == "quarantine":
        deps.job_log(job).error("record-quarantined", kind=record.kind, file=written.path,
                                hint="the database refused this record; `slurm-gpu db check` lists it")
    return written


def _lost_to_log(deps: HookDeps, job: JobEnv, record: R.Record, e: Exception) -> None:
    error = e.message if isinstance(e, SlurmGpuError) else f"{type(e).__name__}: {e}"
    try:
        data = _dumps(R.as_dict(record), sort_keys=True, default=str)
    except Exception as je:  # a record that JSON cannot hold is a bug: say so, keep what is known
        data = _dumps({"kind": record.kind, "unserialisable": f"{type(je).__name__}: {je}"})
    fields = dict(job=job.job_id, node=job.node, kind=record.kind, error=error,
                  hint="replay with `slurm-gpu db ingest --from-log FILE`", record=data)
    deps.log.error("record-lost-to-log", **fields)
    from slurm_gpu.hooks.log import fallback_path, write_fallback
    write_fallback(fallback_path(), deps.log.hook, "record-lost-to-log", **fields)


# What a hook spends at most on the spool (files, seconds) after its own records and its drain
# decision; a bigger backlog is left for `slurm-gpu db ingest` (docs/hooks.md, "Nothing is
# lost").  The prolog is on the job's start path: it takes a smaller share.
HOOK_INGEST_BOUNDS = {"prolog": (50, 0.25), "epilog": (200, 1.0)}


def housekeeping(deps: HookDeps, job: JobEnv, hook: str) -> None:
    max_files, max_s = HOOK_INGEST_BOUNDS[hook]
    log = deps.job_log(job)
    try:
        rep = deps.store.housekeeping(max_files, max_s, prune=hook == "epilog")
    except Exception as e:  # housekeeping must never change a hook's outcome
        log.error("spool-ingest-failed", error=f"{type(e).__name__}: {e}")
        return
    if rep.refused is not None:  # the spool directory itself: one line naming it, with what to do
        log.error("spool-refused", error=rep.refused.message, hint=rep.refused.hint)
        return
    quarantined = {name for name, _ in rep.quarantined}
    for name, why in rep.quarantined:
        log.error("spool-quarantined", file=name, reason=why, hint="`slurm-gpu db check` lists quarantined files")
    for p in rep.problems:
        if p.split(":", 1)[0] not in quarantined:
            log.error("spool-problem", problem=p)
    if rep.reclaimed:
        log.info("spool-reclaimed", files=rep.reclaimed)
    if rep.left:
        log.warning("spool-backlog", ingested=rep.done, waiting=rep.left, hint="run `slurm-gpu db ingest`")


def results_events(results: Sequence[CheckResult], node: str, source: str, job_id: Optional[int],
                   t: float) -> List[R.HealthEvent]:
    return [R.HealthEvent(time=t, node=node, source=source, job_id=job_id, gpu_index=r.gpu_index,
                          gpu_uuid=r.gpu_uuid or None, check_name=r.check, status=r.status, message=r.message)
            for r in results if r.status in (health.WARN, health.FAIL)]


def find_start(deps: HookDeps, job: JobEnv) -> Any:
    from slurm_gpu.store.node import StartLookup
    try:
        return deps.store.find_start(job.cluster, job.job_id, job.restart_count, job.node)
    except Exception as e:  # a store without find_start, or a bug: the end is still recorded
        return StartLookup({}, False, f"{type(e).__name__}: {e}")


def record_key(g: GpuSnapshot, jg: JobGpu) -> str:
    """What a record is keyed by: the MIG device's UUID for a slice, else the GPU's."""
    return jg.mig.uuid if jg.mig is not None else g.uuid_or_index


def start_row(job: JobEnv, g: GpuSnapshot, jg: JobGpu, uuid: str, t: float) -> R.StartCounters:
    """The prolog's start counters of one GPU or MIG slice (job_starts)."""
    return R.StartCounters(cluster=job.cluster, job_id=job.job_id, restart_count=job.restart_count, node=job.node,
                           gpu_uuid=uuid, gpu_index=g.index, start_time=t, **R.read_counters(g, jg.mig is None))


def usage_rows(deps: HookDeps, job: JobEnv, gmap: JobGpuMap, snap: NodeSnapshot, events: Sequence[xid.XidEvent],
               acct: Dict[int, Any], end: float) -> List[R.GpuUsage]:
    """One usage row per GPU or slice, against the prolog's start counters (docs/hooks.md,
    "Nothing is lost": the rule for a missing start record)."""
    lookup = find_start(deps, job)
    starts = lookup.starts
    if not starts and lookup.prolog_failed:
        # The prolog failed on this node (its drain is recorded): Slurm requeued the job and it
        # never ran here.  The driver's accounting may still hold an earlier job's processes,
        # since a failed prolog does not clear them: no usage is recorded.
        deps.job_log(job).info("no-usage-prolog-failed")
        return []
    if not starts:
        # The job ran here (no failed prolog on record) but its start counters are unknown:
        # slurm-gpu installed mid-job, a prolog that failed open, a start record lost, or a
        # database that cannot be read right now.  What the end tells is kept, marked partial.
        deps.job_log(job).warning("start-record-unreadable" if lookup.unreadable else "no-start-record",
                                  error=lookup.unreadable or None, note="recording what the end tells, marked partial")
    rows = []
    for jg in gmap.gpus:
        g = snap.gpu_at(jg.nvml_index)
        start = starts.get(record_key(g, jg))
        xids = _job_xids(events, g, jg, start["start_time"] if start else 0.0)
        row = _usage(g, jg, start, acct.get(g.index), end, job, xids)
        if start is None:
            row = _mark_partial(row, g, jg, acct.get(g.index), lookup.unreadable)
        rows.append(row)
    return rows


MIG_NOT_MEASURED = ("MIG slice: energy, utilisation and peak memory are counted by NVML for the whole GPU, "
                    "not per instance; not recorded")


def _usage(g: GpuSnapshot, jg: JobGpu, start: Optional[Dict[str, Any]], acct: Any, end: float, job: JobEnv,
           xids: List[Dict[str, Any]]) -> R.GpuUsage:
    start_time = start["start_time"] if start else None
    records = list(acct.value) if acct is not None and acct.ok and jg.mig is None else None
    if start_time is None:
        # No prolog record (slurm-gpu installed mid-job, or the prolog failed open): fall back
        # to the first process the driver saw; the duration is then a lower bound.
        starts = [rec.start_time_us / 1e6 for rec in records or [] if rec.start_time_us]
        start_time = min(starts) if starts else end
    if records is not None:
        records = [rec for rec in records if not rec.start_time_us or rec.start_time_us / 1e6 >= start_time - 2.0]
    mig = jg.mig
    peaks = [rec.max_memory_bytes for rec in records or [] if rec.max_memory_bytes is not None]
    return R.GpuUsage(
        cluster=job.cluster, job_id=job.job_id, restart_count=job.restart_count, node=job.node,
        gpu_uuid=record_key(g, jg), gpu_index=g.index,
        gpu_model=mig.name or g.name.get() if mig is not None else g.name.get(), user=job.user,
        account=job.account, partition=job.partition, start_time=start_time, end_time=end,
        **R.usage(start, R.read_counters(g, mig is None), None if records is None else R.busy(records), start_time, end),
        max_memory_bytes=max(peaks) if peaks else None,
        memory_total_bytes=mig.memory_total_bytes if mig is not None else g.memory_total_bytes.get(),
        process_count=None if records is None else len(records), clock_event_reasons=g.clock_event_reasons.get(),
        xid_events=tuple(xids), parent_gpu_uuid=g.uuid_or_index if mig is not None else None,
        notes=MIG_NOT_MEASURED if mig is not None else None, sluid=job.sluid or None)


def _job_xids(events: Sequence[xid.XidEvent], g: GpuSnapshot, jg: JobGpu, t0: float) -> List[Dict[str, Any]]:
    """XIDs of the job's GPU since its start; on a MIG slice, those of its instance or of the whole GPU.
    A flood (one event of many identical lines, gpu/xid.py) is listed once, with its line count and
    last time; it belongs to the job when its last line came after the start (its first may not)."""
    bus = xid.bus_key(g.pci_bus_id.get(""))
    gi = jg.mig.gpu_instance_id if jg.mig is not None else None
    out = []
    for e in events:
        inst = e.gpu_instance
        if e.bus != bus or (e.last or 0) < t0 or (gi is not None and inst is not None and inst != gi):
            continue
        flood = {"line_count": e.line_count, "last_time": e.last_time} if e.line_count > 1 else {}
        out.append({"xid": e.xid, "time": e.time, "message": e.message[:200],
                    **({"gpu_instance": inst} if inst is not None else {}), **flood})
    return out


PARTIAL_NOTE = ("partial: the prolog's start record was not found{why}; start_time is the first process's start "
                "(a lower bound), counter deltas are unknown and utilisation is over that shorter time; the "
                "processes may include an earlier job's")


def _mark_partial(row: R.GpuUsage, g: GpuSnapshot, jg: JobGpu, acct: Any, unreadable: str) -> R.GpuUsage:
    """A usage row without its start record: marked partial, with the end counters kept so that
    the store completes the row if the start record turns up (spool, `db ingest --from-log`)."""
    records = list(acct.value) if acct is not None and acct.ok and jg.mig is None else None
    note = PARTIAL_NOTE.format(why=" (database unreadable)" if unreadable else "")
    kept = R.end_counters(R.read_counters(g, jg.mig is None), None if records is None else R.busy(records),
                          row.xid_events, row.notes)
    return row._replace(partial=1, end_counters=kept, notes=note if not row.notes else f"{note}; {row.notes}")


def record_usage(deps: HookDeps, job: JobEnv, gpu_rows: List[R.GpuUsage], events: List[R.HealthEvent],
                 end: float) -> None:
    """The job's record (job row, GPU rows, health events) in one write; without usage, the events."""
    if not gpu_rows:
        if events:
            write(deps, R.Health(events), job)
        return
    job_row = R.JobRow(cluster=job.cluster, job_id=job.job_id, restart_count=job.restart_count, node=job.node,
                       user=job.user, uid=job.uid, account=job.account, partition=job.partition,
                       gpu_count=len(job.gpus), start_time=min([g.start_time for g in gpu_rows], default=end),
                       end_time=end, exit_code=job.exit_code, partial=int(any(g.partial for g in gpu_rows)),
                       sluid=job.sluid or None)
    write(deps, R.JobEnd(job_row, gpu_rows, events), job)
    for row in gpu_rows:
        deps.job_log(job).info("record", gpu=row.gpu_uuid, energy_j=row.energy_j, gpu_util=row.gpu_util_mean_pct,
                               max_mem=row.max_memory_bytes, xids=len(row.xid_events),
                               partial=1 if row.partial else None)


def _dumps(v: Any, **kw: Any) -> str:
    import json  # on first use (module docstring)
    return json.dumps(v, **kw)
