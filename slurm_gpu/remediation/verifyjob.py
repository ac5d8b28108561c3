"""Active verification through Slurm before a remediated node is resumed (docs/remediation.md,
"Verification job"; [verify] in docs/config.md).

verify_node(), run by `remediate` (under its node lock) on the node itself after a reset or a reboot:

a. a maintenance reservation of that node alone, ``slurm-gpu-verify-NODE`` (Flags=MAINT,IGNORE_JOBS,
   Users=the user remediate runs as), from now for start_timeout_s + timeout_s and some slack; one an
   earlier, crashed run left is emptied and deleted first;
b. ``resume()``: the caller resumes the drained node (a drained node starts no job; the reservation keeps
   every other job off it).  False (the reason is no longer ours) ends the run: reservation deleted;
c. a batch job in the reservation holding the node exclusively and all its GPUs runs ``slurm-gpu
   battery --json`` (hooks/battery.py), its stdout the result file ``verify/NODE-JOBID.json`` in the
   directory of store.database;
d. the job is polled until it ends; one still pending start_timeout_s after it was submitted (or after a
   requeue) is cancelled ("the node did not start the verification job"), one running longer than
   timeout_s (plus OVERRUN_GRACE_S for the battery to report) is cancelled;
e. the result file is read;
f. pass: the reservation is deleted, the node stays resumed.  Anything else: ``drain(text)`` FIRST (the node
   is never open to other users unverified), then the reservation's jobs are cancelled and it is deleted.

A run that dies between (a) and (f) leaves the reservation: clean_leftover() finds it on the next run,
drains the node, cancels its jobs and deletes it.

Only tests that failed on the GPUs are failures (VerifyResult.failures; remediate maps them to the checks
verify_dcgm, verify_nccl, verify_command); a tool error, a job that never started or overran, an empty
battery are not a GPU's fault: ok is False, failures empty, and the node stays drained for a human.

Standard library only (remediate's path); Slurm through the backend's small methods (slurm/model.py).
"""
from __future__ import annotations

import json
import math
import os
import pwd
import re
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import SlurmError
from slurm_gpu.hooks import battery as B
from slurm_gpu.slurm.model import TERMINAL_JOB_STATES

RESERVATION_PREFIX = "slurm-gpu-verify-"
JOB_NAME = "slurm-gpu-verify"
FLAGS = ("MAINT", "IGNORE_JOBS")  # both in scontrol's man page from 22.05 to 26.05
PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
OVERRUN_GRACE_S = 30.0  # past timeout_s: the battery stops its tools at timeout_s and still has to print
HOLD_MIN = 7 * 24 * 60  # a week: until the next remediate run, and longer than any battery
ACCOUNTING_WAIT_S = 15.0  # for slurmdbd to hold the job's end before the reservation goes (_await_accounting)
ACCOUNTING_SETTLE_S = 3.0  # and for slurmctld's last update of the job record after that
RESERVATION_FIRST_SECOND_S = 1.05  # no job in the reservation's first second (verify_node)
RESERVATION_SLACK_S = 300.0  # the reservation outlives the job's limits by this much
KEEP_RESULTS = 20  # result files kept per node (verify/NODE-JOBID.json and .err)
CHECKS = {B.DCGM: "verify_dcgm", B.NCCL: "verify_nccl", B.COMMAND: "verify_command"}  # remedy.py CHECK_REMEDY


class VerifyFailure(NamedTuple):
    """A test of the battery that failed on the node's GPUs."""

    gpu_index: Optional[int]  # None: node-wide (nccl-tests, a site command, a DCGM test naming no GPU)
    tool: str  # dcgm | nccl | command  (check: CHECKS[tool])
    test: str
    detail: str


class VerifyResult(NamedTuple):
    ok: bool
    job_id: Optional[int]  # None: no job was submitted
    failures: List[VerifyFailure]  # empty unless a test failed on the GPUs
    detail: str  # one line: what happened
    elapsed_s: float  # from the reservation to the end (reservation deleted)
    empty: bool = False  # the battery had nothing to run (fails closed; not a GPU fault)
    battery_s: Optional[float] = None  # how long the battery itself ran (its duration_s)


def reservation_name(node: str) -> str:
    return f"{RESERVATION_PREFIX}{node}"


def result_dir(cfg: Config) -> str:
    """verify/ in the directory of store.database (%n: this node): where the job writes its result."""
    return os.path.join(os.path.dirname(cfg.path_value("store", "database")) or ".", "verify")


def _say(log: Any, level: str, event: str, **kw: Any) -> None:
    if log is not None:
        getattr(log, level)(event, **kw)


def _minutes(seconds: float) -> int:
    return max(1, int(math.ceil(seconds / 60.0)))


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return "root"


# ------------------------------------------------------------------------------------------ the job

def write_script(directory: str, node: str, argv: List[str]) -> str:
    """The batch script: this Python running `slurm-gpu ARGV` from this installation (no shell, the
    arguments a Python literal)."""
    if re.search(r"\s", sys.executable):
        raise SlurmError(f"cannot write a batch script for {sys.executable!r} (a path with white space)",
                         "install slurm-gpu under a path without spaces")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(B.__file__))))
    text = (f"#!{sys.executable}\n"
            f"# slurm-gpu verification job for {node} (slurm_gpu/remediation/verifyjob.py)\n"
            "import sys\n"
            f"sys.path.insert(0, {package_root!r})\n"
            f"sys.argv = {argv!r}\n"
            "from slurm_gpu.cli import run\n"
            "run()\n")
    path = os.path.join(directory, f"{node}.batch")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o700)
    os.replace(tmp, path)
    return path


def _get(cfg: Config, key: str) -> Any:
    return cfg.get("verify", key)


def job_options(cfg: Config, node: str, gpu_count: int, partitions: Tuple[str, ...], directory: str) -> List[str]:
    opts = [f"--reservation={reservation_name(node)}", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--exclusive",
            f"--time={_minutes(float(_get(cfg, 'timeout_s')) + OVERRUN_GRACE_S + 30)}", f"--job-name={JOB_NAME}",
            f"--output={os.path.join(directory, f'{node}-%j.json')}",
            f"--error={os.path.join(directory, f'{node}-%j.err')}", f"--chdir={directory}", "--no-requeue"]
    if gpu_count > 0:
        opts.append(f"--gres=gpu:{gpu_count}")
    partition = _get(cfg, "partition") or ",".join(partitions)
    if partition:
        opts.append(f"--partition={partition}")
    return opts


def read_result(directory: str, node: str, job_id: int) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the battery's result object, '') or (None, why not: the tail of the job's stderr)."""
    path = os.path.join(directory, f"{node}-{job_id}.json")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        start = text.find("{")
        if start < 0:
            raise ValueError("no JSON object")
        value, _ = json.JSONDecoder().raw_decode(text[start:])
        if isinstance(value, dict) and isinstance(value.get("tests"), list):
            return value, ""
        raise ValueError("not a battery result")
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
    try:
        with open(os.path.join(directory, f"{node}-{job_id}.err"), encoding="utf-8", errors="replace") as f:
            err = [line for line in f.read().splitlines() if line.strip()]
    except OSError:
        err = []
    return None, f"{os.path.basename(path)}: {why}" + (f"; stderr: {' '.join(err[-1].split())[:200]}" if err else "")


def _prune(directory: str, node: str, keep: int = KEEP_RESULTS) -> None:
    try:
        names = os.listdir(directory)
    except OSError:
        return
    ids = sorted({int(m.group(1)) for n in names for m in [re.fullmatch(re.escape(node) + r"-(\d+)\.(?:json|err)", n)]
                  if m})
    for job in ids[:-keep] if len(ids) > keep else []:
        for ext in ("json", "err"):
            try:
                os.unlink(os.path.join(directory, f"{node}-{job}.{ext}"))
            except OSError:
                pass


# ------------------------------------------------------------------------------------------ reservation

def _empty_and_delete(backend: Any, name: str, sleep: Callable[[float], None], tries: int = 10) -> bool:
    """Cancel the reservation's jobs and delete it; a job still completing keeps it "in use" a moment."""
    try:
        backend.cancel_reservation_jobs(name)
    except SlurmError:
        pass
    last: Optional[SlurmError] = None
    for i in range(tries):
        try:
            return bool(backend.delete_reservation(name))
        except SlurmError as e:
            last = e
            sleep(min(0.5 * (i + 1), 2.0))
    assert last is not None
    raise last


def clean_leftover(cfg: Config, backend: Any, node: str, drain: Callable[[str], None], log: Any = None,
                   sleep: Callable[[float], None] = time.sleep) -> str:
    """A reservation slurm-gpu-verify-NODE that an earlier run left (it crashed between reservation and
    verdict): the node may be resumed yet unverified, so it is drained (``drain(text)``), the reservation's
    jobs cancelled and the reservation deleted.  What was done, '' when there was nothing to clean."""
    name = reservation_name(node)
    if backend.reservation(name) is None:
        return ""
    text = f"verification interrupted: reservation {name} left by an earlier run; not verified"
    drain(text)
    _empty_and_delete(backend, name, sleep)
    _say(log, "warning", "verify-leftover-cleaned", node=node, reservation=name)
    return f"{node}: {text}: node drained, its jobs cancelled, the reservation deleted"


# ------------------------------------------------------------------------------------------ the flow

class _Run:
    """One verify_node run: its clock, its log and the end it comes to."""

    def __init__(self, cfg: Config, backend: Any, node: str, log: Any, sleep: Callable[[float], None],
                 monotonic: Callable[[], float]):
        self.cfg, self.backend, self.node, self.log = cfg, backend, node, log
        self.sleep, self.monotonic = sleep, monotonic
        self.start = monotonic()
        self.name = reservation_name(node)
        self.job_id: Optional[int] = None  # once submitted

    def result(self, ok: bool, job_id: Optional[int], failures: List[VerifyFailure], detail: str,
               empty: bool = False, battery_s: Optional[float] = None) -> VerifyResult:
        out = VerifyResult(ok, job_id, failures, detail, round(self.monotonic() - self.start, 3), empty, battery_s)
        _say(self.log, "info" if ok else "warning", "verify-done", node=self.node, ok=ok, job=job_id,
             elapsed_s=out.elapsed_s, detail=detail)
        return out


def verify_node(cfg: Config, backend: Any, node: str, gpu_count: int, *, resume: Callable[[], bool],
                drain: Callable[[str], None], log: Any = None, sleep: Callable[[float], None] = time.sleep,
                monotonic: Callable[[], float] = time.monotonic) -> VerifyResult:
    """Verify `node` (drained, idle, `gpu_count` GPUs) with a job of its own, resume it through `resume()`
    and leave it resumed only when the battery passed (module docstring).  Raises SlurmError only when the
    reservation cannot be made (nothing else changed then); every later failure drains the node."""
    run = _Run(cfg, backend, node, log, sleep, monotonic)
    if backend.reservation(run.name) is not None:
        _say(log, "warning", "verify-stale-reservation", node=node, reservation=run.name)
        _empty_and_delete(backend, run.name, sleep)
    # The reservation outlives any run of ours on purpose: a remediate killed after the resume leaves the
    # node held (sinfo: maint), never open to users unverified, until the next run removes it.
    minutes = max(HOLD_MIN, _minutes(float(_get(cfg, "start_timeout_s")) + float(_get(cfg, "timeout_s"))
                                     + OVERRUN_GRACE_S + RESERVATION_SLACK_S))
    backend.create_reservation(run.name, node, minutes, [_user()], FLAGS)
    created = monotonic()
    _say(log, "info", "verify-reservation", node=node, reservation=run.name, minutes=minutes)
    try:
        resumed = resume()
    except BaseException:
        _empty_and_delete(backend, run.name, sleep)
        raise
    if not resumed:
        _empty_and_delete(backend, run.name, sleep)
        return run.result(False, None, [], "not verified: the drain reason changed meanwhile; left as it is")
    # slurmdbd names a job's reservation only when the reservation began strictly before the job (its
    # join is `resv.time_start < job.time_start`, whole seconds): a job started in the reservation's
    # first second shows Reservation empty in sacct.  Submitting a full second after the reservation was
    # made puts the start in a later second of slurmctld's clock, whatever this node's clock says.
    sleep(max(0.0, RESERVATION_FIRST_SECOND_S - (monotonic() - created)))
    try:
        verdict = _job(run, gpu_count)
    except (SlurmError, OSError) as e:  # slurmctld gone, sbatch refused, the result directory unwritable
        what = e.message if isinstance(e, SlurmError) else f"{getattr(e, 'filename', '') or ''} {e.strerror or e}".strip()
        verdict = run.result(False, run.job_id, [], f"verification job{f' {run.job_id}' if run.job_id else ''}: {what}")
    except BaseException as e:  # a bug of ours must not leave the node open unverified
        _fail_closed(run, drain, f"verification stopped by an error ({type(e).__name__}: {e})")
        raise
    if verdict.ok:
        _await_accounting(run)
        try:
            _empty_and_delete(backend, run.name, sleep)
        except SlurmError as e:  # the node is verified; the reservation lapses by itself
            _say(log, "warning", "verify-reservation-left", node=node, reservation=run.name, error=e.message)
        return verdict._replace(elapsed_s=round(monotonic() - run.start, 3))
    _fail_closed(run, drain, verdict.detail)
    return verdict._replace(elapsed_s=round(monotonic() - run.start, 3))


def _await_accounting(run: _Run) -> None:
    """Until slurmdbd holds the end of the verification job, for ACCOUNTING_WAIT_S at most.  Deleting a
    reservation clears the reservation of every job slurmctld still holds that used it; a job whose end
    slurmctld had not yet sent to slurmdbd is then recorded with no reservation at all (observed on 22.05:
    sacct Reservation empty, id_resv 0 in the job table), and the record of the node's verification
    would no longer say where it ran."""
    if run.job_id is None:
        return
    until = run.monotonic() + ACCOUNTING_WAIT_S
    while run.monotonic() < until:
        try:
            if run.backend.job_accounted(run.job_id):
                # slurmctld updates the record once more a moment after the end (observed: 1-2 s;
                # with 3 s of settling 6 of 6 records kept the reservation, without it 2 of 6 lost it).
                run.sleep(ACCOUNTING_SETTLE_S)
                return
        except SlurmError:
            pass
        run.sleep(0.5)
    _say(run.log, "warning", "verify-job-not-accounted", node=run.node, job=run.job_id, waited_s=ACCOUNTING_WAIT_S)


def _fail_closed(run: _Run, drain: Callable[[str], None], text: str) -> None:
    """Drain first, then the reservation goes: the node is never open to other users unverified.  A drain
    that fails (it raises) leaves the reservation in place: it keeps other jobs off the node until it
    lapses, and the next run's clean_leftover drains the node."""
    drain(text)
    _await_accounting(run)
    _empty_and_delete(run.backend, run.name, run.sleep)


def _job(run: _Run, gpu_count: int) -> VerifyResult:
    cfg, backend, node = run.cfg, run.backend, run.node
    directory = result_dir(cfg)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    _prune(directory, node)
    argv = ["slurm-gpu"] + (["--config", cfg.path] if cfg.path else []) + \
        ["battery", "--json", "--gpus", str(gpu_count)]
    script = write_script(directory, node, argv)
    partitions = tuple(getattr(backend.node(node), "partitions", ())) if not _get(cfg, "partition") else ()
    job_id = run.job_id = backend.submit_batch(job_options(cfg, node, gpu_count, partitions, directory), script)
    _say(run.log, "info", "verify-job", node=node, job=job_id)
    end = _wait(run, job_id)
    if end:
        return run.result(False, job_id, [], end + _drained_meanwhile(backend, node))
    result, why = read_result(directory, node, job_id)
    if result is None:
        state = backend.job_state(job_id)
        return run.result(False, job_id, [], f"verification job {job_id} left no result ({state[0]}"
                                             f"{', ' + state[2] if state[2] else ''}): {why}"
                                             + _drained_meanwhile(backend, node))
    return _judge(run, job_id, result)


def _drained_meanwhile(backend: Any, node: str) -> str:
    """When the job did not run: a drain Slurm or a hook set meanwhile says why (a prolog that refused it)."""
    try:
        info = backend.node(node)
    except SlurmError:
        return ""
    return f"; node drained meanwhile: {info.reason}" if info.drained and info.reason else ""


def _wait(run: _Run, job_id: int) -> str:
    """Poll the job until it ends: '' when it ended by itself, else why it was cancelled."""
    start_timeout, timeout = float(_get(run.cfg, "start_timeout_s")), float(_get(run.cfg, "timeout_s"))
    pending_since: Optional[float] = run.monotonic()
    running_since: Optional[float] = None
    errors = 0
    while True:
        try:
            state, _nodes, reason = run.backend.job_state(job_id)
            errors = 0
        except SlurmError:
            errors += 1  # slurmctld busy for a moment: the deadlines below still hold
            if errors >= 5:
                raise
            state, reason = "", ""
        base = (state.split() or [""])[0].split("+")[0].upper()
        now = run.monotonic()
        if base in TERMINAL_JOB_STATES:
            return ""
        if base in PENDING_STATES:
            pending_since = now if pending_since is None else pending_since
            running_since = None
            if now - pending_since > start_timeout:
                run.backend.cancel_job(job_id)
                return (f"the node did not start the verification job {job_id} within {start_timeout:g} s "
                        f"({base}{', ' + reason if reason and reason != 'None' else ''}): cancelled")
        elif base:
            pending_since = None
            running_since = now if running_since is None else running_since
            if base != "COMPLETING" and now - running_since > timeout + OVERRUN_GRACE_S:
                run.backend.cancel_job(job_id)
                return f"the verification job {job_id} ran past verify.timeout_s ({timeout:g} s): cancelled"
        waited = now - run.start
        run.sleep(0.5 if waited < 60 else 2.0 if waited < 600 else 5.0)


def _judge(run: _Run, job_id: int, result: Dict[str, Any]) -> VerifyResult:
    tests = B.tests_of(result)
    battery_s = result.get("duration_s") if isinstance(result.get("duration_s"), (int, float)) else None
    if result.get("empty"):
        return run.result(False, job_id, [], f"verification job {job_id}: {result.get('hint') or B.EMPTY_HINT}",
                          empty=True, battery_s=battery_s)
    failures = [VerifyFailure(t.gpu_index, t.tool, t.name, t.detail) for t in tests
                if t.result == B.FAIL and not t.tool_error]
    tool_errors = [t for t in tests if t.result == B.FAIL and t.tool_error]
    if failures:
        first = failures[0]
        where = f"GPU {first.gpu_index}" if first.gpu_index is not None else "node"
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return run.result(False, job_id, failures, f"verification job {job_id} failed: {where} {first.tool} "
                                                   f"{first.test}: {first.detail}{more}", battery_s=battery_s)
    if tool_errors or not result.get("ok"):
        t = tool_errors[0] if tool_errors else None
        what = f"{t.tool} {t.name}: {t.detail}" if t else "the battery did not pass"
        return run.result(False, job_id, [], f"verification job {job_id} could not verify: {what}",
                          battery_s=battery_s)
    notes = [t for t in tests if t.result == B.WARN]
    ran = sorted({t.tool for t in tests if t.result != B.SKIP})
    return run.result(True, job_id, [], f"verification job {job_id} passed ({', '.join(ran)}"
                                        f"{f'; {len(notes)} warnings' if notes else ''})", battery_s=battery_s)


def failure_checks(result: VerifyResult) -> List[Tuple[Optional[int], str, str]]:
    """(GPU index or None, check name, message) per failure: what remediate drains for and escalates."""
    return [(f.gpu_index, CHECKS.get(f.tool, "verify_command"), f"{f.test}: {f.detail}") for f in result.failures]
