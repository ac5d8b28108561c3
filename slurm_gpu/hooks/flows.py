"""Orchestration: the flows behind `check`, `healthcheck`, the prolog and the epilog.

Kept light to import: the prolog/epilog path must not pay for click, jinja2 or sqlite-utils,
and `json` is imported where it is used: a job without XIDs, partial records or lost records
never needs it.
"""
from __future__ import annotations

import os
import re
import signal
import time
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

from slurm_gpu.policy import health
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu import xid
from slurm_gpu.config import Config, node_name
from slurm_gpu.errors import NvmlWriteError, SlurmGpuError
from slurm_gpu.slurm.gpumap import JobGpu, JobGpuMap, MissingGpu, map_job_gpus  # noqa: F401  (MissingGpu: re-exported)
from slurm_gpu.policy.health import CheckResult
from slurm_gpu.slurm.jobenv import JobEnv
from slurm_gpu.gpu.snapshot import GpuSnapshot, NodeSnapshot
from slurm_gpu.store import record as R


def make_reader(cfg: Config, library: Optional[str] = None):
    from slurm_gpu.gpu.nvml import NvmlReader
    return NvmlReader(library=library if library is not None else cfg.get("", "nvml_library"),
                      timeout_s=cfg.get("", "nvml_timeout_s"), version_file=cfg.get("", "nvidia_version_file"))


def mismatch_metric(cfg: Config, log: Any, hook: str, e: Exception) -> None:
    """A driver/library mismatch as a metric (never raises: metrics never change a hook's outcome)."""
    from slurm_gpu.errors import DriverLibraryMismatch
    if not isinstance(e, DriverLibraryMismatch):
        return
    from slurm_gpu.metrics import hookwrite
    if hookwrite.enabled(cfg):
        hookwrite.mismatch(cfg, log, hook, node_name(), e.kernel_version, e.library_version, time.time())


def read_xids(cfg: Config, now: Optional[float] = None) -> xid.XidReading:
    source = cfg.get("xid", "source").replace("%n", node_name())
    return xid.read(source, cfg.get("xid", "window_s"), timeout_s=cfg.get("", "nvml_timeout_s"), now=now)


def scope_xids(events: Sequence[xid.XidEvent], snap: NodeSnapshot,
               instances: Mapping[int, FrozenSet[int]]) -> List[xid.XidEvent]:
    """On a GPU the job holds only MIG slices of, an XID the driver tagged with another GPU
    instance (a contained error: GPU-I in the line) is that slice's business, not this job's."""
    if not instances:
        return list(events)
    other: set = set()
    for g in snap.gpus:
        mine = instances.get(g.index)
        if mine is not None:
            bus = xid.bus_key(g.pci_bus_id.get(""))
            other |= {(bus, e.gpu_instance) for e in events
                      if e.bus == bus and e.gpu_instance is not None and e.gpu_instance not in mine}
    return [e for e in events if (e.bus, e.gpu_instance) not in other]


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
        snapshot = reader.snapshot(indices, inventory=True)  # not the prolog's read: VBIOS, remap histogram too
        events, problem, undated = read_xids(cfg, now)
        recorded, recorded_problem = recorded_stuck_clocks(cfg, now)
    else:
        events, problem, undated = [], "", 0  # offline evaluation of a saved snapshot: no live kernel log
        recorded, recorded_problem = None, ""
    results = health.evaluate(snapshot, cfg, gpus=indices, idle=idle, expected_count=expected_count,
                              xid_events=events, xid_problem=problem, xid_undated=undated, now=now,
                              recorded_events=recorded, recorded_problem=recorded_problem)
    return snapshot, CheckRun(results, snapshot, events, all_gpus=indices is None)


def recorded_stuck_clocks(cfg: Config, now: float) -> Tuple[Optional[List[Dict[str, Any]]], str]:
    """(the stuck_clocks events epilogs recorded within health.stuck_clocks_recent_s, problem):
    read-only and quick; a database that cannot be read is a problem said, never a crash."""
    if not health.Judge(cfg).enabled("stuck_clocks"):
        return None, ""
    from slurm_gpu.store.node import describe_error, recent_health_events
    since = now - float(cfg.get("health", "stuck_clocks_recent_s"))
    try:
        return recent_health_events(cfg.path_value("store", "database"), "stuck_clocks", since), ""
    except Exception as e:  # a locked, corrupt or foreign file: the other checks still run
        return [], describe_error(e)


class CheckRun(list):
    """check_node's results (a list of CheckResult), with what they were judged on: the
    snapshot and the XIDs.  `healthcheck` gets only results from its checker; from a CheckRun it
    also writes the GPUs' state into its metrics (hooks/healthcheck.py, write_metrics)."""

    def __init__(self, results: Iterable[CheckResult], snapshot: Optional[NodeSnapshot] = None,
                 xid_events: Sequence[xid.XidEvent] = (), all_gpus: bool = False):
        super().__init__(results)
        self.snapshot = snapshot
        self.xid_events = xid_events
        self.all_gpus = all_gpus  # the snapshot holds every GPU of the node


# --- prolog / epilog -------------------------------------------------------------------------


PROLOG_OK, PROLOG_FAULT = 0, 1


class HookDeps:
    """What a hook talks to; tests inject fakes at these seams.  Whatever is not given is the real thing."""

    def __init__(self, cfg: Config, log: Any, *, reader: Any = None, store: Any = None, slurm: Any = None,
                 now: Callable[[], float] = time.time, kill: Optional[Callable[[int, int], None]] = None,
                 pid_alive: Optional[Callable[[int], bool]] = None,
                 owns: Optional[Callable[[int, JobEnv], bool]] = None, slurm_conf: str = "",
                 started: Optional[float] = None):
        self.cfg = cfg
        self.log = log  # HookLog
        self.reader = make_reader(cfg) if reader is None else reader  # NvmlReader
        if store is None:
            from slurm_gpu.store.node import Store
            store = Store.from_config(cfg)
        self.store = store  # Store
        self.slurm = slurm  # SlurmBackend, chosen when first needed (backend())
        self.now = now
        self.kill = os.kill if kill is None else kill
        self.pid_alive = _pid_alive if pid_alive is None else pid_alive
        # (pid, job) -> does the process belong to the job?  Only those are ever killed.
        self.owns = process_belongs_to_job if owns is None else owns
        # Default: $SLURM_CONF (slurmd sets it), else the config's slurm_conf.
        self.slurm_conf = slurm_conf or os.environ.get("SLURM_CONF") or cfg.get("", "slurm_conf")
        # Unix time slurmd started this hook process (hooks/main.py sets it; None: deps.now() when
        # the flow begins).  Python's start-up and imports come before the flow's first clock read.
        self.started = started

    def backend(self):
        if self.slurm is None:
            from slurm_gpu.slurm.backend import get_backend
            self.slurm = get_backend(self.cfg)
        return self.slurm


def process_start_time(pid: str = "self") -> Optional[float]:
    """Unix time a process started (/proc: start ticks after boot; boot from uptime, 10 ms
    precision, unlike /proc/stat's whole-second btime).  None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


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


_JOB_CGROUP = rb"(?m)/job_(\d+)(?:/|$)"  # compiled on first use: only the epilog, only with leftovers


UNKNOWN_JOB = -1  # process_identity: the process's job cannot be told (environment unreadable or empty)


def process_identity(pid: int) -> Tuple[Optional[int], Optional[int]]:
    """(real uid, Slurm job id) of a live process; None where the system does not show it.

    The job id comes from the process's cgroup (task/cgroup puts it under .../job_<id>/) or,
    without one, from its SLURM_JOB_ID (root may read every environment). An environment that
    cannot be read, or reads empty, gives UNKNOWN_JOB: a process in the middle of execve()
    shows an empty one to a reader that comes too soon (a parent that started it with vfork(),
    as Python's subprocess does, runs on once the old memory is released, before the new stack
    is set up: seen every time under Python 3.14, now and then under load on 3.11), and so does
    one started with no environment at all - neither can be told to be the job's."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            uid = next((int(line.split()[1]) for line in f if line.startswith(b"Uid:")), None)
    except (OSError, ValueError, IndexError):
        return None, None
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            m = re.search(_JOB_CGROUP, f.read())
        if m:
            return uid, int(m.group(1))
    except OSError:
        pass
    return uid, _job_from_environ(pid)


def _job_from_environ(pid: int) -> Optional[int]:
    for attempt in range(2):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            return UNKNOWN_JOB
        if raw:
            for item in raw.split(b"\0"):
                if item.startswith(b"SLURM_JOB_ID=") and item[13:].isdigit():
                    return int(item[13:])
            return None
        if attempt == 0:
            time.sleep(0.02)  # an execve() under way finishes setting up its stack in microseconds
    return UNKNOWN_JOB


def process_belongs_to_job(pid: int, job: JobEnv) -> bool:
    """The job's own process: the job's uid, and no other job id where the system shows one.

    A process of another uid (a job sharing the GPU through shards/MPS, a system agent), of
    another job of the same user, or whose job cannot be told is never ours to kill."""
    uid, job_id = process_identity(pid)
    if uid is None or job.uid is None or uid != job.uid or job_id == UNKNOWN_JOB:
        return False
    return job_id is None or job_id == job.job_id


def map_gpus(deps: "HookDeps", job: JobEnv) -> JobGpuMap:
    """Slurm's GPU indices of the job -> GPUs (and MIG instances) through the node's Slurm config."""
    return map_job_gpus(job.gpus, deps.reader.identities(), deps.cfg, job.node, deps.slurm_conf, deps.log)


def scope_to_instances(snap: NodeSnapshot, instances: Mapping[int, FrozenSet[int]]) -> NodeSnapshot:
    """On a GPU the job holds only MIG slices of, judge only those slices: other jobs may run on
    the rest.  Processes of other GPU instances are dropped; memory in use is the job's slices'."""
    if not instances:
        return snap
    gpus = []
    for g in snap.gpus:
        mine = instances.get(g.index)
        if mine is None:
            gpus.append(g)
            continue
        procs = g.processes
        if procs.ok:
            procs = S.value(tuple(p for p in procs.value if p.gpu_instance_id in mine))
        migs = [m for m in (g.mig_devices.get(()) or ()) if m.gpu_instance_id in mine]
        used = [m.memory_used_bytes for m in migs]
        mem = S.value(sum(used)) if migs and None not in used else S.unsupported(
            "nvmlDeviceGetMemoryInfo", "memory in use of a MIG instance not reported")
        gpus.append(g._replace(processes=procs, memory_used_bytes=mem))
    return snap._replace(gpus=tuple(gpus))


def _without_pids(snap: NodeSnapshot, pids: Iterable[int]) -> NodeSnapshot:
    drop = set(pids)
    if not drop:
        return snap
    gpus = tuple(g._replace(processes=S.value(tuple(p for p in g.processes.value if p.pid not in drop)))
                 if g.processes.ok else g for g in snap.gpus)
    return snap._replace(gpus=gpus)


def _results_events(results: Sequence[CheckResult], node: str, source: str, job_id: Optional[int],
                    t: float) -> List[R.HealthEvent]:
    return [R.HealthEvent(time=t, node=node, source=source, job_id=job_id, gpu_index=r.gpu_index,
                          gpu_uuid=r.gpu_uuid or None, check_name=r.check, status=r.status, message=r.message)
            for r in results if r.status in (health.WARN, health.FAIL)]


def _drain_node(deps: HookDeps, job: JobEnv, source: str, fault: str, check: str = "",
                breaker: bool = False) -> Tuple[bool, R.Drain]:
    """Drain this node with our reason (naming the check).  Returns (the hook may exit 0: the node
    is drained now, or the circuit breaker keeps it in service), the drain record).

    The record says what really happened (docs/hooks.md, drains table): `drained` (ok=1);
    `kept` when the node was already drained and Slurm kept that reason (ok=0, kept_reason);
    `breaker` when the circuit breaker, asked first (breaker=True: the epilog), was open for the
    check (ok=0); `failed` when slurmctld could not be reached; `off` with hooks.drain_on_fault = false."""
    from slurm_gpu.policy.drain import KEEP, decide_drain
    from slurm_gpu.slurm.reason import format_reason
    reason = format_reason(fault, f"{source} job {job.job_id}", check=check)
    drained, outcome, kept = False, "off", None
    if deps.cfg.get("hooks", "drain_on_fault"):
        try:
            backend = deps.backend()
            info = backend.node(job.node)
            decision = decide_drain(info, reason)  # policy/drain.py: the one rule
            if decision.action == KEEP:
                # Already drained or down: the first reason stays (policy/drain.py).
                deps.log.warning("already-drained", job=job.job_id, node=job.node, reason=reason,
                                 existing=info.reason)
                outcome, kept = "kept", info.reason or ""
            elif breaker and _breaker_open(deps, job, check):
                outcome = "breaker"
            else:
                backend.drain(job.node, decision.reason)
                deps.log.warning("drain", job=job.job_id, node=job.node, reason=reason)
                outcome = "drained"
            drained = True
        except SlurmGpuError as e:
            deps.log.error("drain-failed", job=job.job_id, node=job.node, reason=reason, error=e.message)
            outcome = "failed"
    else:
        deps.log.warning("fault-no-drain", job=job.job_id, node=job.node, reason=reason)
    return drained, R.drain(job.node, source, reason, outcome, deps.now(), kept_reason=kept, job_id=job.job_id,
                            cluster=job.cluster, restart_count=job.restart_count)


def _breaker_open(deps: HookDeps, job: JobEnv, check: str) -> bool:
    """Ask the circuit breaker (hooks/breaker.py) before a drain for `check`; True: do not drain."""
    from slurm_gpu.hooks.breaker import ask
    return ask(deps.cfg, deps.backend(), job.node, check, deps.now(), deps.log, job=job.job_id).open


def _drain(deps: HookDeps, job: JobEnv, source: str, fault: str, seen: Any = None, check: str = "",
           breaker: bool = False) -> bool:
    """Drain this node with our reason; record it.  Returns True when the node is drained now (or
    the breaker, asked when breaker=True, keeps it in service).
    seen (metrics' Observed, when metrics are on) learns the drain state and the check."""
    drained, d = _drain_node(deps, job, source, fault, check, breaker)
    _write(deps, R.Drains([d]), job)
    _seen_drain(seen, d, check)
    return drained


def _seen_drain(seen: Any, d: Optional[R.Drain], check: str) -> None:
    """The node's drain state as the metrics say it: drained by us for this check, already
    drained by us (cause known to an earlier writer), or drained by someone else."""
    if seen is None or d is None:
        return
    from slurm_gpu.slurm.reason import is_ours
    if d.outcome == R.DRAINED:
        seen.drain = ("set", check)
    elif d.outcome == R.KEPT:
        seen.drain = ("ours", check) if is_ours(d.kept_reason) else ("clear", "")


def _fault_check(results: Sequence[CheckResult]) -> str:
    """The check whose FAIL leads the drain reason (health.drain_fault's first)."""
    fails = health.failures(results)
    return fails[0].check if fails else ""


def _observer(deps: HookDeps, job: JobEnv) -> Any:
    """An Observed for the metrics when the config asks for metrics and the job has GPUs, else None
    (the metrics package is then not even imported)."""
    try:
        wanted = deps.cfg.get("metrics", "textfile_dir") or deps.cfg.get("metrics", "dcgm_job_mapping_dir")
    except (KeyError, AttributeError):  # a stand-in config without the section
        return None
    if not job.gpus or not wanted:
        return None
    from slurm_gpu.metrics.hookwrite import Observed
    return Observed()


def _write_metrics(deps: HookDeps, job: JobEnv, hook: str, seen: Any) -> None:
    """The hook's metrics, last: a few milliseconds, never an exception (metrics/hookwrite.py)."""
    from slurm_gpu.metrics import hookwrite
    t0 = time.monotonic()
    try:
        if hook == "prolog":
            hookwrite.prolog(deps.cfg, deps.log, job, seen, deps.now())
        else:
            hookwrite.epilog(deps.cfg, deps.log, job, seen, deps.now(), store=deps.store)
    except Exception as e:  # a bug in the metrics must not change the hook's outcome
        deps.log.error("metrics-failed", job=job.job_id, node=job.node, error=f"{type(e).__name__}: {e}")
    deps.log.event("metrics", "debug", job=job.job_id, node=job.node, ms=round((time.monotonic() - t0) * 1000, 2))


def _write(deps: HookDeps, record: R.Record, job: JobEnv) -> str:
    """Database, else spool, else — whatever went wrong, even a bug of ours — the hook log and the
    fallback log as one line of complete JSON that `slurm-gpu db ingest --from-log` replays.
    Never raises: the drain decision must still run after a record that fits nowhere."""
    # The job start a record belongs to: re-runs and replays of it are recognised by this.
    record.cluster = job.cluster if record.cluster is None else record.cluster
    record.restart_count = job.restart_count if record.restart_count is None else record.restart_count
    try:
        written = deps.store.write(record, ingest=False)
    except Exception as e:
        _lost_to_log(deps, job, record, e)
        return "log"
    if written.where == "spool":
        deps.log.warning("record-spooled", job=job.job_id, node=job.node, kind=record.kind, file=written.path,
                         reason=getattr(deps.store, "unavailable", "") or None)
    elif written.where == "quarantine":
        deps.log.error("record-quarantined", job=job.job_id, node=job.node, kind=record.kind, file=written.path,
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
    write_fallback(fallback_path(), getattr(deps.log, "hook", "hook"), "record-lost-to-log", **fields)


# What a hook spends at most on the spool (files, seconds) after its own records and its drain
# decision; a bigger backlog is left for `slurm-gpu db ingest` (docs/hooks.md, "Nothing is
# lost").  The prolog is on the job's start path: it takes a smaller share.
HOOK_INGEST_BOUNDS = {"prolog": (50, 0.25), "epilog": (200, 1.0)}


def _housekeeping(deps: HookDeps, job: JobEnv, hook: str) -> None:
    max_files, max_s = HOOK_INGEST_BOUNDS[hook]
    try:
        rep = deps.store.housekeeping(max_files, max_s, prune=hook == "epilog")
    except Exception as e:  # housekeeping must never change a hook's outcome
        deps.log.error("spool-ingest-failed", job=job.job_id, node=job.node, error=f"{type(e).__name__}: {e}")
        return
    if rep.refused is not None:  # the spool directory itself: one line naming it, with what to do
        deps.log.error("spool-refused", job=job.job_id, node=job.node, error=rep.refused.message, hint=rep.refused.hint)
        return
    quarantined = {name for name, _ in rep.quarantined}
    for name, why in rep.quarantined:
        deps.log.error("spool-quarantined", job=job.job_id, node=job.node, file=name, reason=why,
                       hint="`slurm-gpu db check` lists quarantined files")
    for p in rep.problems:
        if p.split(":", 1)[0] not in quarantined:
            deps.log.error("spool-problem", job=job.job_id, node=job.node, problem=p)
    if rep.reclaimed:
        deps.log.info("spool-reclaimed", job=job.job_id, node=job.node, files=rep.reclaimed)
    if rep.left:
        deps.log.warning("spool-backlog", job=job.job_id, node=job.node, ingested=rep.done, waiting=rep.left,
                         hint="run `slurm-gpu db ingest`")


def _find_start(deps: HookDeps, job: JobEnv) -> Any:
    from slurm_gpu.store.node import StartLookup
    try:
        return deps.store.find_start(job.cluster, job.job_id, job.restart_count, job.node)
    except Exception as e:  # a store without find_start, or a bug: the end is still recorded
        return StartLookup({}, False, f"{type(e).__name__}: {e}")


def _job_gpu_snapshot(deps: HookDeps, job: JobEnv, seen: Any = None
                      ) -> Tuple[Optional[JobGpuMap], NodeSnapshot, List[CheckResult]]:
    """Map the job's GPUs, read them, and judge them (they must be idle)."""
    try:
        gmap = map_gpus(deps, job)
    except MissingGpu as e:
        results = [CheckResult("gpu_count", health.FAIL, None, "", e.message, e.hint)]
        _seen_check(seen, None, results, ())
        return None, NodeSnapshot(node_name(), deps.now()), results
    now = deps.now()
    snap, results, events = _read_and_judge(deps, gmap, now, now)
    _seen_check(seen, snap, results, events)
    return gmap, snap, results


def _seen_check(seen: Any, snap: Optional[NodeSnapshot], results: Sequence[CheckResult],
                events: Sequence[xid.XidEvent]) -> None:
    if seen is not None:
        seen.snapshot, seen.results, seen.xid_events = snap, results, events


def _read_and_judge(deps: HookDeps, gmap: JobGpuMap, xids_at: float, judged_at: float, killed: Iterable[int] = ()
                    ) -> Tuple[NodeSnapshot, List[CheckResult], List[xid.XidEvent]]:
    """(snapshot, results, XIDs in the kernel log): the job's GPUs read and judged; they must be
    idle, except for the job's processes that were just killed."""
    events, problem, undated = read_xids(deps.cfg, xids_at)
    indices = gmap.nvml_indices
    snap = deps.reader.snapshot(indices)
    judged = scope_to_instances(_without_pids(snap, killed), gmap.instances())
    results = health.evaluate(judged, deps.cfg, gpus=indices, idle=indices, expected_count=gmap.configured,
                              xid_events=scope_xids(events, snap, gmap.instances()), xid_problem=problem,
                              xid_undated=undated, now=judged_at)
    return snap, results, events


def _log_results(log: Any, job: JobEnv, results: Sequence[CheckResult]) -> None:
    """One line per WARN or FAIL."""
    for r in results:
        if r.status in (health.FAIL, health.WARN):
            log.event("check", "warning" if r.status == health.WARN else "error", job=job.job_id, node=job.node,
                      gpu=r.gpu_uuid or r.where, check=r.check, status=r.status, message=r.message)


def _record_key(g: GpuSnapshot, jg: JobGpu) -> str:
    """What a record is keyed by: the MIG device's UUID for a slice, else the GPU's."""
    return jg.mig.uuid if jg.mig is not None else g.uuid_or_index


def prolog(job: JobEnv, deps: HookDeps) -> int:
    """Gate the job on its GPUs' health, then reset them and record the job start."""
    return _with_metrics(job, deps, "prolog", _prolog)


def _with_metrics(job: JobEnv, deps: HookDeps, hook: str, flow: Callable[[JobEnv, HookDeps, Any], int]) -> int:
    """Run the flow; then, when metrics are configured, write what it saw (never changes the code)."""
    seen = _observer(deps, job)
    code = flow(job, deps, seen)
    if seen is not None:
        _write_metrics(deps, job, hook, seen)
    return code


def _prolog(job: JobEnv, deps: HookDeps, seen: Any) -> int:
    log = deps.log
    if not job.gpus:
        log.info("no-gpus", job=job.job_id, node=job.node)
        return PROLOG_OK
    # GPU time starts when the prolog does: Slurm's allocation (PrologFlags=Alloc) began then,
    # and sreport/sacct count the prolog's run time as the job's.
    t = deps.started if deps.started is not None else deps.now()
    gmap, snap, results = _job_gpu_snapshot(deps, job, seen)
    _log_results(log, job, results)
    if health.worst(results) == health.FAIL and (gmap is None or not _gate_suspended(deps, job, results)):
        _drain(deps, job, "prolog", health.drain_fault(results), seen, _fault_check(results))
        _write(deps, R.Health(_results_events(results, job.node, "prolog", job.job_id, t)), job)
        _housekeeping(deps, job, "prolog")
        return PROLOG_FAULT
    assert gmap is not None  # a mapping failure is a FAIL above
    prepared = _prepare(deps, job, gmap)
    starts = []
    for jg in gmap.gpus:
        g = snap.gpu(jg.nvml_index)
        uuid = _record_key(g, jg)
        outcome = prepared.get(g.index)
        if isinstance(outcome, NvmlWriteError):
            # A GPU that stops answering while we reset it is a fault; other write errors
            # (e.g. no permission) are our environment's problem and must not block the job.
            if deps.reader.is_stuck(g.index):
                _drain(deps, job, "prolog", f"{g.label} stopped responding during reset: {outcome.message}", seen, "responsive")
                _housekeeping(deps, job, "prolog")
                return PROLOG_FAULT
            log.error("reset-failed", job=job.job_id, node=job.node, gpu=uuid, error=outcome.message)
        starts.append(_start_row(job, g, jg, uuid, t))
        log.info("pass", job=job.job_id, node=job.node, gpu=uuid, index=g.index, slurm_index=jg.slurm_index)
    _write(deps, R.JobStart(starts), job)
    warn = _results_events(results, job.node, "prolog", job.job_id, t)
    if warn:
        _write(deps, R.Health(warn), job)
    _housekeeping(deps, job, "prolog")
    _seen_start(seen, deps, gmap, snap, prepared)
    return PROLOG_OK


def _gate_suspended(deps: HookDeps, job: JobEnv, results: Sequence[CheckResult]) -> bool:
    """A FAIL of only non-hardware checks while the circuit breaker is open for each of them: the job
    starts and the node stays in service (logged).  A hardware fault of the job's GPUs (policy/breaker.py
    HARDWARE) always gates: a job never starts on a broken GPU."""
    from slurm_gpu.policy.breaker import gate_suspended
    checks = [r.check for r in health.failures(results)]
    if not deps.cfg.get("hooks", "drain_on_fault") or not gate_suspended(checks):
        return False
    from slurm_gpu.hooks.breaker import ask_all
    try:
        backend = deps.backend()
    except SlurmGpuError:
        return False
    why = ask_all(deps.cfg, backend, job.node, checks, deps.now(), deps.log, job=job.job_id)
    if why:
        deps.log.warning("gate-suspended", job=job.job_id, node=job.node, fault=health.drain_fault(results), message=why)
    return bool(why)


def _start_row(job: JobEnv, g: GpuSnapshot, jg: JobGpu, uuid: str, t: float) -> R.StartCounters:
    """The prolog's start counters of one GPU or MIG slice (job_starts)."""
    return R.StartCounters(cluster=job.cluster, job_id=job.job_id, restart_count=job.restart_count, node=job.node,
                           gpu_uuid=uuid, gpu_index=g.index, start_time=t, **R.read_counters(g, jg.mig is None))


def _seen_start(seen: Any, deps: HookDeps, gmap: JobGpuMap, snap: NodeSnapshot, prepared: Dict[int, Any]) -> None:
    """For the metrics: the GPUs (and slices) the job now holds, and where persistence is on now."""
    if seen is None:
        return
    seen.held = [(snap.gpu(jg.nvml_index), jg) for jg in gmap.gpus]
    if deps.cfg.get("hooks", "persistence_mode"):
        seen.persistence_on = [i for i, out in prepared.items()
                               if isinstance(out, dict) and out.get("nvmlDeviceSetPersistenceMode")]


def _prepare(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Dict[int, Any]:
    """Persistence, clock reset and accounting on the job's whole GPUs.

    A GPU the job holds MIG slices of is shared with whoever holds the others: resetting its
    clocks or clearing its accounting would change their job, so only persistence is set."""
    cfg = deps.cfg
    sliced = set(gmap.instances())
    whole = [i for i in gmap.nvml_indices if i not in sliced]
    out = deps.reader.prepare(whole, persistence=cfg.get("hooks", "persistence_mode"),
                              reset_clocks=cfg.get("hooks", "reset_clocks"),
                              accounting=cfg.get("hooks", "accounting_mode"),
                              power_cap_tolerance_pct=cfg.get("health", "power_cap_tolerance_pct")
                              if cfg.get("hooks", "reset_power_limit") else None) if whole else {}
    if sliced:
        deps.log.info("mig-gpu-shared", job=job.job_id, node=job.node, gpus=",".join(map(str, sorted(sliced))),
                      note="clocks and accounting of a GPU with MIG slices are left alone")
        if cfg.get("hooks", "persistence_mode"):
            out.update(deps.reader.prepare(sorted(sliced), persistence=True))
    return out


def _leftovers(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Tuple[Dict[int, List[int]], Dict[int, List[int]]]:
    """({GPU: pids of the job's own processes}, {GPU: pids of anyone else's}) on the job's GPUs.

    On a GPU the job holds only MIG slices of, processes in other slices are not looked at."""
    mine: Dict[int, List[int]] = {}
    others: Dict[int, List[int]] = {}
    instances = gmap.instances()
    for i, procs in deps.reader.processes_many(gmap.nvml_indices).items():
        if isinstance(procs, NvmlWriteError):
            deps.log.error("process-list-failed", job=job.job_id, node=job.node, index=i, error=procs.message)
            continue
        for p in procs:
            if p.pid in (0, 1, os.getpid()):
                continue
            if i in instances and p.gpu_instance_id not in instances[i]:
                continue
            (mine if deps.owns(p.pid, job) else others).setdefault(i, []).append(p.pid)
    return mine, others


def _kill_leftovers(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Tuple[Dict[int, List[int]], List[int]]:
    """TERM, grace period, KILL for the job's own processes still on its GPUs.

    Returns (survivors per GPU, every pid of the job that was found).  Processes of other
    users or jobs are never signalled: the health checks report them (leftover_processes)."""
    cfg, log = deps.cfg, deps.log
    found, others = _leftovers(deps, job, gmap)
    if others:
        log.warning("leftover-processes-not-ours", job=job.job_id, node=job.node,
                    pids=",".join(str(p) for ps in others.values() for p in ps),
                    note="another user's or job's processes are never killed")
    if not found:
        return {}, []
    everyone = sorted({p for ps in found.values() for p in ps})
    if not cfg.get("hooks", "kill_leftovers"):
        # The site kills nothing: the leftover_processes check reports them instead.
        log.warning("leftover-processes-not-killed", job=job.job_id, node=job.node, pids=",".join(map(str, everyone)))
        return {}, []
    log.warning("leftover-processes", job=job.job_id, node=job.node, pids=",".join(map(str, everyone)))
    targets = list(everyone)
    for sig, wait in ((signal.SIGTERM, cfg.get("hooks", "kill_grace_s")), (signal.SIGKILL, 2.0)):
        alive = [p for p in targets if deps.pid_alive(p)]
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
        targets = [p for p in targets if deps.pid_alive(p)]
        if not targets:
            break
    # Ask the driver again: what it still lists and is still alive survived KILL.
    survivors: Dict[int, List[int]] = {}
    for i, procs in deps.reader.processes_many(sorted(found)).items():
        if isinstance(procs, NvmlWriteError):
            continue
        left = [p.pid for p in procs if p.pid in everyone and deps.pid_alive(p.pid)]
        if left:
            survivors[i] = left
    return survivors, everyone


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
        gpu_uuid=_record_key(g, jg), gpu_index=g.index,
        gpu_model=mig.name or g.name.get() if mig is not None else g.name.get(), user=job.user,
        account=job.account, partition=job.partition, start_time=start_time, end_time=end,
        **R.usage(start, R.read_counters(g, mig is None), None if records is None else R.busy(records), start_time, end),
        max_memory_bytes=max(peaks) if peaks else None,
        memory_total_bytes=mig.memory_total_bytes if mig is not None else g.memory_total_bytes.get(),
        process_count=None if records is None else len(records), clock_event_reasons=g.clock_event_reasons.get(),
        xid_events=xids, parent_gpu_uuid=g.uuid_or_index if mig is not None else None,
        notes=MIG_NOT_MEASURED if mig is not None else None)


def _dumps(v: Any, **kw: Any) -> str:
    import json  # on first use (module docstring)
    return json.dumps(v, **kw)


def _job_xids(events: Sequence[xid.XidEvent], g: GpuSnapshot, jg: JobGpu, t0: float) -> List[Dict[str, Any]]:
    """XIDs of the job's GPU since its start; on a MIG slice, those of its instance or of the whole GPU."""
    bus = xid.bus_key(g.pci_bus_id.get(""))
    gi = jg.mig.gpu_instance_id if jg.mig is not None else None
    out = []
    for e in events:
        inst = e.gpu_instance
        if e.bus != bus or (e.time or 0) < t0 or (gi is not None and inst is not None and inst != gi):
            continue
        out.append({"xid": e.xid, "time": e.time, "message": e.message[:200],
                    **({"gpu_instance": inst} if inst is not None else {})})
    return out


def _read_accounting(deps: HookDeps, job: JobEnv, gmap: JobGpuMap) -> Dict[int, Any]:
    """The driver's per-process accounting of the job's whole GPUs (MIG slices have none per instance)."""
    whole = [i for i in gmap.nvml_indices if i not in gmap.instances()]
    acct = deps.reader.accounting_many(whole) if whole else {}
    for i, a in list(acct.items()):
        if isinstance(a, NvmlWriteError):
            deps.log.error("accounting-read-failed", job=job.job_id, node=job.node, index=i, error=a.message)
            acct[i] = None
    return acct


def _reset_after(deps: HookDeps, job: JobEnv, gmap: JobGpuMap, snap: NodeSnapshot) -> None:
    if not deps.cfg.get("hooks", "reset_clocks"):
        return
    sliced = gmap.instances()
    whole = [g.index for g in snap.gpus if not g.unreachable and g.index not in sliced]
    if not whole:
        return
    for i, outcome in deps.reader.prepare(whole, reset_clocks=True).items():
        g = snap.gpu(i)
        if isinstance(outcome, NvmlWriteError):
            deps.log.error("reset-failed", job=job.job_id, node=job.node, gpu=g.uuid_or_index, error=outcome.message)
        else:
            deps.log.info("reset", job=job.job_id, node=job.node, gpu=g.uuid_or_index)


def _epilog_fault(results: List[CheckResult], survivors: Dict[int, List[int]], snap: NodeSnapshot) -> str:
    """The drain fault of the epilog ('' when healthy); a SIGKILL survivor comes first."""
    if survivors:
        g_idx = sorted(survivors)[0]
        g = snap.gpu(g_idx)
        label = g.label if g else f"GPU {g_idx}"
        pids = ",".join(str(p) for ps in survivors.values() for p in ps)
        fault = f"{label} processes survived SIGKILL after the job: pid {pids}"
        results.append(CheckResult("leftover_processes", health.FAIL, g_idx, g.uuid.get("") if g else "", fault,
                                   "processes stuck in the driver (D state) need a GPU reset or reboot"))
        return fault
    return health.drain_fault(results) if health.worst(results) == health.FAIL else ""


def epilog(job: JobEnv, deps: HookDeps) -> int:
    """Record what the job did with its GPUs, clean up, and check the GPUs again."""
    return _with_metrics(job, deps, "epilog", _epilog)


def _epilog(job: JobEnv, deps: HookDeps, seen: Any) -> int:
    if not job.gpus:
        deps.log.info("no-gpus", job=job.job_id, node=job.node)
        return 0
    # The job ended when the epilog started: what the epilog spends is not the job's GPU time.
    end = deps.started if deps.started is not None else deps.now()
    try:
        gmap = map_gpus(deps, job)  # which GPUs (and MIG slices) are the job's
    except MissingGpu as e:
        deps.log.error("check", job=job.job_id, node=job.node, check="gpu_count", status=health.FAIL, message=e.message)
        _seen_check(seen, None, [CheckResult("gpu_count", health.FAIL, None, "", e.message, e.hint)], ())
        return 0 if _drain(deps, job, "epilog", e.message, seen, "gpu_count", breaker=True) else 1
    # The job's own processes go; everyone else's stay and are judged.
    survivors, killed = _kill_leftovers(deps, job, gmap)
    acct = _read_accounting(deps, job, gmap)
    snap, results, events = _read_and_judge(deps, gmap, deps.now(), end, killed)
    _reset_after(deps, job, gmap, snap)
    # Judge and drain before anything is stored: a GPU fault reaches Slurm whatever the storage does.
    fault = _epilog_fault(results, survivors, snap)
    _log_results(deps.log, job, results)
    check = "leftover_processes" if survivors else _fault_check(results)
    drained, drain_record = _drain_node(deps, job, "epilog", fault, check, breaker=True) if fault else (True, None)
    _seen_check(seen, snap, results, events)
    _seen_drain(seen, drain_record, check)
    rows = _usage_rows(deps, job, gmap, snap, events, acct, end)
    results.extend(_stuck_clocks(deps, job, snap, rows))  # a health event, never a drain
    _record_usage(deps, job, rows, _results_events(results, job.node, "epilog", job.job_id, end), end)
    if drain_record is not None:
        _write(deps, R.Drains([drain_record]), job)
    # Housekeeping last, bounded: a spool backlog never delays the drain or this job's record.
    _housekeeping(deps, job, "epilog")
    # Drained with our reason: exit 0 so Slurm does not overwrite it with "Epilog error".
    # If the drain did not reach slurmctld, fail the epilog so that Slurm drains the node.
    return 0 if drained else 1


def _stuck_clocks(deps: HookDeps, job: JobEnv, snap: NodeSnapshot, rows: List[R.GpuUsage]) -> List[CheckResult]:
    """The job's whole GPUs judged for clocks stuck low on the job's utilisation; only WARN/FAIL
    are kept (the metrics' steady stuck_clocks status is healthcheck's, from these events)."""
    util = {r.gpu_index: r.gpu_util_mean_pct for r in rows if r.parent_gpu_uuid is None}
    found = [r for r in health.judge_stuck_clocks(snap, util, deps.cfg) if r.status in (health.WARN, health.FAIL)]
    _log_results(deps.log, job, found)
    return found


def _usage_rows(deps: HookDeps, job: JobEnv, gmap: JobGpuMap, snap: NodeSnapshot, events: Sequence[xid.XidEvent],
                acct: Dict[int, Any], end: float) -> List[R.GpuUsage]:
    """One usage row per GPU or slice, against the prolog's start counters (docs/hooks.md,
    "Nothing is lost": the rule for a missing start record)."""
    lookup = _find_start(deps, job)
    starts = lookup.starts
    if not starts and lookup.prolog_failed:
        # The prolog failed on this node (its drain is recorded): Slurm requeued the job and it
        # never ran here.  The driver's accounting may still hold an earlier job's processes,
        # since a failed prolog does not clear them: no usage is recorded.
        deps.log.info("no-usage-prolog-failed", job=job.job_id, node=job.node)
        return []
    if not starts:
        # The job ran here (no failed prolog on record) but its start counters are unknown:
        # slurm-gpu installed mid-job, a prolog that failed open, a start record lost, or a
        # database that cannot be read right now.  What the end tells is kept, marked partial.
        deps.log.warning("start-record-unreadable" if lookup.unreadable else "no-start-record", job=job.job_id,
                         node=job.node, error=lookup.unreadable or None,
                         note="recording what the end tells, marked partial")
    rows = []
    for jg in gmap.gpus:
        g = snap.gpu(jg.nvml_index)
        start = starts.get(_record_key(g, jg))
        xids = _job_xids(events, g, jg, start["start_time"] if start else 0.0)
        row = _usage(g, jg, start, acct.get(g.index), end, job, xids)
        if start is None:
            _mark_partial(row, g, jg, acct.get(g.index), lookup.unreadable)
        rows.append(row)
    return rows


def _record_usage(deps: HookDeps, job: JobEnv, gpu_rows: List[R.GpuUsage], events: List[R.HealthEvent],
                  end: float) -> None:
    """The job's record (job row, GPU rows, health events) in one write; without usage, the events."""
    if not gpu_rows:
        if events:
            _write(deps, R.Health(events), job)
        return
    job_row = R.JobRow(cluster=job.cluster, job_id=job.job_id, restart_count=job.restart_count, node=job.node,
                       user=job.user, uid=job.uid, account=job.account, partition=job.partition,
                       gpu_count=len(job.gpus), start_time=min([g.start_time for g in gpu_rows], default=end),
                       end_time=end, exit_code=job.exit_code, partial=int(any(g.partial for g in gpu_rows)))
    _write(deps, R.JobEnd(job_row, gpu_rows, events), job)
    for row in gpu_rows:
        deps.log.info("record", job=job.job_id, node=job.node, gpu=row.gpu_uuid, energy_j=row.energy_j,
                      gpu_util=row.gpu_util_mean_pct, max_mem=row.max_memory_bytes, xids=len(row.xid_events),
                      partial=1 if row.partial else None)


PARTIAL_NOTE = ("partial: the prolog's start record was not found{why}; start_time is the first process's start "
                "(a lower bound), counter deltas are unknown and utilisation is over that shorter time; the "
                "processes may include an earlier job's")


def _mark_partial(row: R.GpuUsage, g: GpuSnapshot, jg: JobGpu, acct: Any, unreadable: str) -> None:
    """A usage row without its start record: marked partial, with the end counters kept so that
    the store completes the row if the start record turns up (spool, `db ingest --from-log`)."""
    records = list(acct.value) if acct is not None and acct.ok and jg.mig is None else None
    note = PARTIAL_NOTE.format(why=" (database unreadable)" if unreadable else "")
    row.end_counters = R.end_counters(R.read_counters(g, jg.mig is None), None if records is None else R.busy(records),
                                      row.xid_events, row.notes)
    row.partial, row.notes = 1, note if not row.notes else f"{note}; {row.notes}"
