"""What one remediation run works with (docs/remediation.md): its Env (the seams, slurmctld's clock,
a GPU's attempts by serial), its Outcome, and the small acts every step of the ladder shares.

Every step writes its intent before it acts (record_step: a row `started`) and its outcome after
(finish_steps), so a run killed between the two leaves a row the next run closes: the episode is the
state, not the reason string.  Every reason remediate puts on a node goes through hold(), which reads
the node right before it writes: an admin's drain that landed since remediate last looked is never
overwritten (Slurm has no compare-and-set for a reason).
"""
from __future__ import annotations

import subprocess
import time as _time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.config import Config
from slurm_gpu.remediation import budget as B
from slurm_gpu.remediation import remedy as R
from slurm_gpu.slurm import reason as _reason

if TYPE_CHECKING:  # types only: the node database is opened by the engine
    from slurm_gpu.store.node import Store

BUSY_STATES = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
REBOOTING_STATES = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT"})


class Outcome(NamedTuple):
    node: str
    action: str  # none | reset | reboot | rma | manual
    outcome: str  # resumed | requested | rma | left-alone | busy | waiting | refused | breaker-open | failed | healthy
    message: str


class Stop(Exception):
    """A run that ends where it stands (an admin took the node meanwhile, nothing to verify with)."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.message)
        self.outcome = outcome


class Env:
    """What one remediation run works with; everything injected (tests pass fakes at these seams)."""

    def __init__(self, cfg: Config, backend: Any, store: Store, node: str, *, checker: Callable[[Any], Any],
                 reader_factory: Optional[Callable[[], Any]] = None, spawn: Optional[Callable[..., Any]] = None,
                 sleep: Callable[[float], None] = _time.sleep, now: Optional[Callable[[], float]] = None,
                 log: Any = None, dry_run: bool = False,
                 central_history: Optional[Callable[[str], List[Dict[str, Any]]]] = None,
                 local_time: Callable[[], float] = _time.time):
        self.cfg, self.backend, self.store, self.node = cfg, backend, store, node
        self.checker, self.reader_factory = checker, reader_factory
        self.spawn = spawn or subprocess.Popen
        self.sleep, self.log, self.dry_run = sleep, log, dry_run
        self.local_time = local_time
        # slurmctld's clock minus ours (clock()); None until measured, then the run's every time is slurmctld's.
        self.offset: Optional[float] = None
        self.clock_problem = ""
        self._now = now
        self.lock_fd: Optional[int] = None  # the node's lock, for the reset command to inherit
        self.interrupted: List[int] = []  # rows of steps this run found abandoned and closed
        self.resumed_by_verify = ""  # the reason the verification job's resume lifted ('' when none)
        self.verified_by = ""  # how the node was verified, for its rows
        self.verify_failed: List[R.Remedy] = []  # the GPUs the last verification job failed, with their remedy
        self.budget = B.Budget.from_config(cfg)
        self.drain_time: Optional[float] = None  # when the node was drained for the fault remedied (drain_time)
        self.history = SerialHistory(store, central_history, self.say_warning)

    def now(self) -> float:
        """The run's time: slurmctld's clock once measured (clock()), else this node's."""
        if self._now is not None:
            return self._now()
        return self.local_time() + (self.offset or 0.0)

    def clock(self) -> str:
        """Measure this node's clock against slurmctld's (once per run): '' when within
        remediation.clock_slack_s, else why remediate may neither reboot nor resume (one log line, the
        slurm_gpu_clock_skew_seconds gauge).  A test's injected clock is slurmctld's by definition."""
        if self._now is not None or self.offset is not None:
            return self.clock_problem
        slack = float(self.get("clock_slack_s"))
        try:
            before = self.local_time()
            ctld = float(self.backend.ctld_time())
            local = (before + self.local_time()) / 2.0
        except Exception as e:  # slurmctld's clock unknown: nothing may be decided on ours
            self.offset = 0.0
            self.clock_problem = (f"cannot read slurmctld's clock ({getattr(e, 'message', None) or e}): "
                                  "no reboot or resume on this node's clock alone")
            self.say_warning("remediate-clock-unknown", error=self.clock_problem)
            return self.clock_problem
        self.offset = ctld - local
        skew = -self.offset
        _write_skew(self.cfg, round(skew, 1), self.log)
        if abs(skew) > slack + 1.0:  # sdiag's time has whole seconds
            self.clock_problem = (f"this node's clock is {skew:+.0f} s off slurmctld's (remediation.clock_slack_s "
                                  f"{slack:g}): no reboot or resume until it is fixed (chronyc tracking)")
            self.say_warning("remediate-clock-skew", skew_s=round(skew, 1), slack_s=slack)
        return self.clock_problem

    def get(self, key: str) -> Any:
        return self.cfg.get("remediation", key)

    def say(self, event: str, **kw: Any) -> None:
        if self.log is not None:
            self.log.info(event, node=self.node, **kw)

    def say_warning(self, event: str, **kw: Any) -> None:
        if self.log is not None:
            self.log.warning(event, node=self.node, **kw)


class SerialHistory:
    """A GPU's attempts by serial, for its budgets and the lemon rule: the node database's rows merged
    with the central server's (every node's, when central.url is set), one row per attempt (node, row id,
    time), the node's own copy winning.  The server is asked lazily (only when remediate decides about a GPU),
    once per serial and run, within central.timeout_s; a server that is down, unreachable, too slow
    or too old leaves this node's rows alone, with one log line, and the remediation goes on."""

    def __init__(self, store: Store, fetch: Optional[Callable[[str], List[Dict[str, Any]]]],
                 warn: Callable[..., None]):
        self.store, self.fetch, self.warn = store, fetch, warn
        self.central: Dict[str, List[Dict[str, Any]]] = {}
        self.unavailable = ""

    def rows(self, serial: str) -> List[Dict[str, Any]]:
        local = self.store.remediations(serial=serial)
        if not serial or self.fetch is None or self.unavailable:
            return local
        if serial not in self.central:
            try:
                self.central[serial] = self.fetch(serial)
            except Exception as e:  # a central server is a help here, never a condition
                self.unavailable = str(getattr(e, "message", "") or f"{type(e).__name__}: {e}")
                self.warn("remediate-central-unavailable", serial=serial, error=self.unavailable,
                          using="this node's remediation rows only")
                return local
        mine = {_attempt_key(r) for r in local}
        merged = local + [r for r in self.central[serial] if _attempt_key(r) not in mine]
        return sorted(merged, key=lambda r: (float(r.get("time") or 0.0), str(r.get("node")), r.get("id") or 0))


def _attempt_key(r: Dict[str, Any]) -> Tuple[str, Any, float]:
    """One attempt: its node, row id and time (a reimaged node's new database reuses row ids)."""
    return str(r.get("node")), r.get("id"), float(r.get("time") or 0.0)


def central_history(cfg: Config) -> Optional[Callable[[str], List[Dict[str, Any]]]]:
    """One GPU's attempts on every node from the central server (central/server.py, imported only when
    asked: PyMySQL is never loaded by a healthcheck that finds nothing to remediate); None without central.url."""
    if not cfg.central.url:
        return None

    def fetch(serial: str) -> List[Dict[str, Any]]:
        from slurm_gpu.central.server import Central, remediation_history
        with Central.from_config(cfg) as srv:
            return remediation_history(srv, serial)
    return fetch


def _write_skew(cfg: Config, skew_s: float, log: Any) -> None:
    directory = cfg.path_value("metrics", "textfile_dir") if cfg is not None else ""
    if not directory:
        return
    try:
        from slurm_gpu.metrics.hookwrite import write_clock_skew
        from slurm_gpu.metrics.textfile import ensure_dir
        ensure_dir(directory)
        write_clock_skew(directory, skew_s)
    except Exception as e:  # metrics never change what remediate does
        if log is not None:
            log.warning("metrics-write-failed", directory=directory, error=f"{type(e).__name__}: {e}")


def proc_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None when gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: Any, start: Any) -> bool:
    """Is the step's process still the one that was started (a reused pid is not)?"""
    if not pid:
        return False
    now = proc_start(int(pid))
    return now is not None and (start is None or now == int(start))


def slurm_busy(info: Any) -> str:
    if info.states & BUSY_STATES or info.gpus_allocated:
        return f"Slurm has a job on it ({info.state}, {info.gpus_allocated} GPUs allocated)"
    return ""


def _gpu_reading(run: Any, index: Optional[int], field: str) -> str:
    """One identity reading (serial, uuid) of GPU `index` in the run's snapshot; '' when unknown."""
    for g in getattr(getattr(run, "snapshot", None), "gpus", ()):
        if g.index == index:
            return str(getattr(g, field).get("") or "")
    return ""


def serial_of(run: Any, index: Optional[int]) -> str:
    return _gpu_reading(run, index, "serial")


def uuid_of(run: Any, index: Optional[int]) -> str:
    return _gpu_reading(run, index, "uuid")


def record_step(env: Env, run: Any, r: Optional[R.Remedy], action: str, outcome: str, detail: str = "") -> int:
    """A step's row in the node database (table remediations), written before the step acts: its id
    (0 in a dry run, which writes nothing)."""
    if env.dry_run:
        return 0
    row = {"time": env.now(), "node": env.node, "gpu_index": None if r is None else r.gpu_index,
           "gpu_uuid": "" if r is None else r.gpu_uuid, "serial": serial_of(run, None if r is None else r.gpu_index),
           "fault_check": None if r is None else r.check, "fault": None if r is None else r.fault,
           "action": action, "outcome": outcome, "detail": detail, "drain_time": env.drain_time}
    return env.store.record_remediation(row)


def finish_steps(env: Env, ids: Sequence[int], outcome: str, detail: str) -> None:
    """The steps' outcome on their rows, once known (a 0 id, a dry run's, is skipped)."""
    for i in ids:
        if i:
            env.store.finish_remediation(i, outcome, detail, env.now())


def hold(env: Env, text: str) -> str:
    """Put our `text` on the node remediate acts on: only while its reason is still one of our automatic
    ones, or it is in service (a fault found on it: drained is the safe side).  '' once set, else why
    not: an admin who drained the node since remediate last read it keeps the node and the reason.
    Slurm has no compare-and-set for a reason, so the read comes right before the write."""
    now = env.backend.node(env.node)
    if (now.drained or now.down) and not _reason.is_automatic(now.reason):
        return f"reason changed meanwhile ({now.reason or 'none'})"
    env.backend.drain(env.node, text)
    return ""


def redrain(env: Env, fault: str, step: str) -> Tuple[str, str]:
    """(our reason for the step, '' or why it was not set: hold)."""
    text = _reason.format_reason(fault, f"remediate: {step}")
    return text, ("" if env.dry_run else hold(env, text))
