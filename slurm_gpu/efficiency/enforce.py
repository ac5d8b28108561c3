"""One run of the idle policy (`slurm-gpu efficiency enforce`, docs/efficiency.md).

For each running job start on this node: its facts from Slurm (`scontrol show job`: state, user,
account, partition, QOS, batch or interactive, its nodes, MailUser), its samples, the stage due
(policy.judge).  Without a central server only jobs that run on this node alone are judged here: a
job on several nodes is idle only when all its nodes say so, which no single node can see.

Every decision is written to the node database (efficiency_actions, with its evidence) before it is
acted on, once per job start and stage (a UNIQUE key: a second run, or a run after a crash, finds the
row and does not mail or cancel twice).  A cancel is `scancel` through Slurm, after the reason has
been put into the job's AdminComment where that field is free (sacct shows it).  On the node, the
job's GPUs are read once more right before the scancel (the last look): a job whose GPU got to work
since the last sample, or whose GPUs cannot be read, is not cancelled (busy: the decision is
dropped; unread: it waits for the next run).  A mail that failed
stays 'failed' and is tried again every efficiency.mail_retry_s by later runs; it never holds up
sampling (the sample is written first) and never blocks another job's decision.  --dry-run decides
and prints, and writes, mails and cancels nothing.
"""
from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from slurm_gpu.config import Config, node_name
from slurm_gpu.efficiency import live
from slurm_gpu.efficiency import mail as M
from slurm_gpu.efficiency.policy import CANCEL, JobFacts, Judgement, Policy, judge
from slurm_gpu.errors import SlurmError, SlurmGpuError
from slurm_gpu.store import samples as Q
from slurm_gpu.store import summary as sg
from slurm_gpu.store.samples import RunningStart
from slurm_gpu.store.summary import cancel_note, is_ours
from slurm_gpu.timefmt import slurm_to_unix

DAY_S = 86400.0
BATCH_ASK = 8  # more running jobs than this: one `scontrol show job` for all of them


class Outcome(NamedTuple):
    job_id: int
    stage: str  # advice, notify, cancel, or '' (nothing due)
    why: str
    mail: str = ""  # sent, failed, capped, none, dry-run, ''
    cancel: str = ""  # done, failed, dropped (busy at the last look), dry-run, ''
    error: str = ""

    def line(self) -> str:
        parts = [f"job {self.job_id}: {self.stage or 'nothing due'}", self.why]
        if self.mail:
            parts.append(f"mail {self.mail}")
        if self.cancel:
            parts.append(f"cancel {self.cancel}")
        if self.error:
            parts.append(self.error)
        return " - ".join(parts)


def facts_from_record(rec: Mapping[str, str], cluster: str, job_id: int, started: Optional[float]) -> JobFacts:
    """JobFacts of `scontrol -o show job` fields.  The start: the prolog's where this node has it (the samples'
    clock), else Slurm's StartTime."""
    def name(v: str) -> str:
        return (v or "").split("(")[0]

    def num(v: str) -> int:
        return int(v) if (v or "").isdigit() else 0
    mail_user = rec.get("MailUser", "")
    if started is None:
        started = slurm_to_unix(rec.get("StartTime")) or 0.0
    return JobFacts(cluster=cluster, job_id=job_id, restart_count=num(rec.get("Restarts", "0")),
                    user=name(rec.get("UserId", "")), account=rec.get("Account", ""), partition=rec.get("Partition", ""),
                    qos=rec.get("QOS", ""), batch=rec.get("BatchFlag", "0") == "1", state=rec.get("JobState", ""),
                    num_nodes=num(rec.get("NumNodes", "1")) or 1, nodes=rec.get("NodeList", ""),
                    start_time=started, mail_user="" if mail_user in ("(null)", "") else mail_user,
                    name=rec.get("JobName", ""),
                    admin_comment="" if rec.get("AdminComment", "") in ("(null)", "") else rec.get("AdminComment", ""))


def tres_gpus(rec: Mapping[str, str]) -> int:
    """The GPUs a job holds on all its nodes (`gres/gpu=N` in its TRES); 0 when Slurm does not say."""
    m = re.search(r"(?:^|,)gres/gpu=(\d+)", rec.get("AllocTRES") or rec.get("TRES") or "")
    return int(m.group(1)) if m else 0


class Candidate(NamedTuple):
    """A running job start whose samples a source holds."""

    cluster: str
    job_id: int
    restart_count: int
    started: Optional[float]  # the prolog's start on this node (node source); None: take Slurm's
    gpus: int  # GPUs (and MIG slices) it holds as far as the source knows; 0: unknown


class NodeSource:
    """This node's database: the job starts the prolog recorded here, their samples and actions."""

    multi_node = False  # a job on several nodes is judged where all their samples meet

    def __init__(self, conn: Any, node: str, booted_at: float, reader: Any = None, span_s: float = 60.0):
        self.conn, self.node, self.booted_at = conn, node, booted_at
        self.reader, self.span_s = reader, span_s  # reader: NVML, for the last look before a cancel

    def candidates(self, now: float) -> List[Candidate]:
        out: Dict[Tuple[str, int, int], List[RunningStart]] = {}
        for s in Q.running_starts(self.conn, self.node, self.booted_at):
            out.setdefault((s.cluster, s.job_id, s.restart_count), []).append(s)
        return [Candidate(*key, min(s.start_time for s in starts), len(starts)) for key, starts in sorted(out.items())]

    def samples(self, c: Candidate, since: float) -> List[Dict[str, Any]]:
        return Q.job_samples(self.conn, c.cluster, c.job_id, c.restart_count, since=since)

    def totals(self, c: Candidate) -> List[Dict[str, Any]]:
        return Q.job_totals(self.conn, c.cluster, c.job_id, c.restart_count)

    def done(self, c: Candidate) -> Dict[str, Dict[str, Any]]:
        return Q.actions_of(self.conn, c.cluster, c.job_id, c.restart_count)

    def look(self, c: Candidate, now: float) -> Optional[List[Dict[str, Any]]]:
        """The job's GPUs read now, as sample rows (not recorded); None without a reader.  Raises
        LookFailed when one of them cannot be read."""
        if self.reader is None:
            return None
        from slurm_gpu.efficiency.sample import sample_rows
        starts = [s for s in Q.running_starts(self.conn, self.node, self.booted_at)
                  if (s.cluster, s.job_id, s.restart_count) == (c.cluster, c.job_id, c.restart_count)]
        try:
            rows, missing = sample_rows(starts, self.reader.usage(), now, self.span_s)
        except SlurmGpuError as e:
            raise LookFailed(e.message) from None
        if missing:
            raise LookFailed("; ".join(missing))
        return rows


class LookFailed(Exception):
    """The last look before a cancel could not read a GPU of the job."""


class NoJobs:
    """A node whose jobs the central server judges (efficiency.decide_on = "central"): only its mails to retry."""

    multi_node = False

    def candidates(self, now: float) -> List[Candidate]:
        return []


def _no_log(event: str, **fields: Any) -> None:
    pass


class Enforcer:
    def __init__(self, cfg: Config, conn: Any, backend: Any, *, node: Optional[str] = None, dry_run: bool = False,
                 send: Callable[[Config, M.Message], str] = M.send, log: Callable[..., None] = _no_log,
                 source: Any = None, only_multi_node: bool = False, reader: Any = None):
        self.cfg, self.conn, self.backend = cfg, conn, backend
        self.reader = reader  # NVML, for the last look before a cancel on this node
        self.node = node or cfg.node or node_name()
        self.dry_run = dry_run
        self.send = send
        self.log = log
        self.policy = Policy.from_config(cfg)
        self.source = source
        self.only_multi_node = only_multi_node  # a central run where the nodes judge their own single-node jobs
        self._records: Optional[Dict[int, Dict[str, str]]] = None  # every job, asked once (run)

    # -- the run -----------------------------------------------------------------------------
    def run(self, now: float, booted_at: float) -> List[Outcome]:
        out = [] if self.dry_run else self.retry_mails(now)
        source = self.source or NodeSource(self.conn, self.node, booted_at, self.reader,
                                           float(self.cfg.efficiency.sample_every_s))
        candidates = source.candidates(now)
        self._records = None
        if len(candidates) > BATCH_ASK and hasattr(self.backend, "job_records"):
            try:  # one `scontrol show job` for all, not one per job (the central run sees every running job)
                self._records = self.backend.job_records()
            except SlurmError as e:
                return out + [Outcome(0, "", "Slurm could not be asked", error=e.message)]
        for c in candidates:
            try:
                o = self.one_job(source, c, now)
            except SlurmError as e:
                o = Outcome(c.job_id, "", "Slurm could not be asked", error=e.message)
            if o is not None:
                out.append(o)
        return out

    def one_job(self, source: Any, c: Candidate, now: float) -> Optional[Outcome]:
        rec = self._records.get(c.job_id) if self._records is not None else self.backend.job_record(c.job_id)
        if rec is None:
            return Outcome(c.job_id, "", "slurmctld does not know the job (ended)")
        job = facts_from_record(rec, c.cluster, c.job_id, c.started)
        if job.restart_count != c.restart_count:
            return Outcome(c.job_id, "", f"the job was requeued (restart {job.restart_count}, sampled {c.restart_count})")
        if job.num_nodes > 1 and not source.multi_node:
            return Outcome(c.job_id, "", f"runs on {job.num_nodes} nodes ({job.nodes}): judged where all nodes' samples "
                                         "meet (the central server), not on one node")
        if job.num_nodes == 1 and self.only_multi_node:
            return None  # its node judges it (efficiency.decide_on = "node")
        notify_after, cancel_after = self.policy.thresholds(job.batch)
        lookback = max(notify_after, cancel_after, live.POINTS * live.POINT_S) + 2 * self.policy.max_gap_s + Q.COARSE_STEP_S
        rows = source.samples(c, now - lookback)
        done = source.done(c)
        gpus = max(tres_gpus(rec), c.gpus)
        j = judge(rows, job, self.policy, done, now, gpus)

        def last_look() -> Tuple[str, str]:
            return self._last_look(source, c, job, rows, gpus, cancel_after, now)
        if job.state == "RUNNING" and not self.dry_run:
            self._live_summary(source, c, job, rows, j, now)
            unfinished = self._unfinished_cancel(done, job, j, cancel_after, last_look)
            if unfinished is not None:
                return unfinished
        if not j.stage:
            return Outcome(job.job_id, "", j.why)
        return self.act(job, j, now, last_look)

    def _last_look(self, source: Any, c: Candidate, job: JobFacts, rows: List[Dict[str, Any]], gpus: int,
                   cancel_after: float, now: float) -> Tuple[str, str]:
        """Right before a scancel: ('', '') when the job's GPUs, read again now, leave it idle past
        cancel_after; ('busy', why) when one got to work since the last sample; ('unread', why) when one
        cannot be read (never cancelled on a reading not taken).  A source without a reader (the
        central server's: the newest pushed samples are all it has) looks no further."""
        look = getattr(source, "look", None)
        try:
            fresh = look(c, now) if look is not None else None
        except LookFailed as e:
            return "unread", f"its GPUs could not be read again before the cancel: {e}"
        if fresh is None:
            return "", ""
        again = {(str(r["node"]), str(r["gpu_uuid"]), float(r["time"])) for r in fresh}
        merged = [r for r in rows if (str(r["node"]), str(r["gpu_uuid"]), float(r["time"])) not in again] + fresh
        j = judge(merged, job, self.policy, {}, now, gpus)
        if j.idle_since is None or j.idle_s < cancel_after:
            return "busy", f"not idle at the last look before the cancel: {j.why}"
        return "", ""

    def _unfinished_cancel(self, done: Mapping[str, Mapping[str, Any]], job: JobFacts, j: Judgement,
                           cancel_after: float, last_look: Callable[[], Tuple[str, str]]) -> Optional[Outcome]:
        """A cancel this host decided that is not done: it failed (Slurm refused or was down), or a crash came
        between the decision and the scancel.  It is carried out only while the job is still idle past
        cancel_after (a job its user woke up meanwhile is left alone), then its mail goes."""
        action = done.get(CANCEL)
        if action is None or action.get("id") is None or action.get("cancel_state") in ("done", "dropped"):
            return None  # dropped: final, whatever the job does later (no second cancel of this start)
        if j.idle_since is None or j.idle_s < cancel_after or self.policy.exemption(job):
            return self._drop(job, action, j.why, f"a cancel decided earlier is not carried out: {j.why}")
        o = self._cancel(job, action, j.why, last_look)
        if o.cancel == "done" and action.get("mail_state") in ("pending", "failed"):
            saved = json.loads(action.get("message") or "{}")
            if saved.get("subject"):
                o = o._replace(mail=self._mail(int(action["id"]), M.Message(str(action["mail_to"]), saved["subject"],
                                                                           saved["body"]), time.time(),
                                               int(action.get("mail_tries") or 0)))
        return o

    def _live_summary(self, source: Any, c: Candidate, job: JobFacts, rows: List[Dict[str, Any]], j: Judgement,
                      now: float) -> None:
        """The job's figures so far into its AdminComment (efficiency/live.py), when due; a failure is logged."""
        every = float(self.cfg.efficiency.live_summary_every_s)
        if not every or self.cfg.job_summary.field != "AdminComment":
            return
        if not live.due(job.admin_comment, every, now, job.restart_count):
            return
        text = sg.fit(live.summary(job, source.totals(c), [r for r in rows if float(r["time"]) > now - 3600], j, now))
        try:
            self.backend.set_running_summary(job.job_id, text)
        except SlurmError as e:
            self.log("efficiency-live-summary-failed", job=job.job_id, error=e.message)

    # -- acting --------------------------------------------------------------------------------
    def _drop(self, job: JobFacts, action: Mapping[str, Any], cause: str, why: str) -> Outcome:
        """A cancel decided but not to be carried out: dropped, its notice never goes (mail_state none);
        the stage stays taken, so this start is never cancelled by a second decision."""
        if action.get("cancel_state") != "dropped":
            Q.update_action(self.conn, int(action["id"]), cancel_state="dropped", cancel_error=cause, mail_state="none")
            self.log("efficiency-cancel-dropped", job=job.job_id, why=cause)
        return Outcome(job.job_id, "", why)

    def act(self, job: JobFacts, j: Judgement, now: float,
            last_look: Callable[[], Tuple[str, str]] = lambda: ("", "")) -> Outcome:
        notify_after, cancel_after = self.policy.thresholds(job.batch)
        exempt = self.policy.exemption(job)
        row: Dict[str, Any] = {
            "time": now, "cluster": job.cluster, "job_id": job.job_id, "restart_count": job.restart_count,
            "decided_on": self.node, "user": job.user, "account": job.account, "partition": job.partition,
            "stage": j.stage, "idle_since": j.idle_since, "idle_s": j.idle_s, "gpus": j.gpus, "idle_gpus": j.idle_gpus,
            "evidence": json.dumps({"why": j.why, "gpus": j.evidence()}, separators=(",", ":")), "mail_tries": 0}
        msg = M.compose(self.cfg, job, j.stage, row, j.evidence(), cancel_after_s=cancel_after,
                        notify_after_s=notify_after, exempt=exempt)
        row["mail_to"] = msg.to
        if self.dry_run:
            return Outcome(job.job_id, j.stage, j.why, mail=f"dry-run to {msg.to}: {msg.subject}",
                           cancel="dry-run" if j.stage == CANCEL else "")
        row["mail_state"] = "pending"
        row["message"] = json.dumps({"subject": msg.subject, "body": msg.body})  # tried again from here
        row_id = Q.add_action(self.conn, row)
        if row_id is None:
            return Outcome(job.job_id, j.stage, "already decided by another run")
        self.log("efficiency-decision", job=job.job_id, stage=j.stage, user=job.user, idle_s=round(j.idle_s),
                 gpus=j.gpus, idle_gpus=j.idle_gpus, why=j.why)
        cancel = ""
        if j.stage == CANCEL:
            o = self._cancel(job, {"id": row_id}, j.why, last_look)
            if o.cancel != "done":  # the notice says it was cancelled: it waits for the cancel
                return o if o.cancel == "dropped" else Outcome(job.job_id, j.stage, j.why, mail="pending",
                                                               cancel=o.cancel, error=o.error)
            cancel = o.cancel
        mail = self._mail(row_id, msg, now)
        return Outcome(job.job_id, j.stage, j.why, mail=mail, cancel=cancel)

    def _cancel(self, job: JobFacts, action: Mapping[str, Any], why: str,
                last_look: Callable[[], Tuple[str, str]] = lambda: ("", "")) -> Outcome:
        seen, because = last_look()
        if seen == "busy":
            return self._drop(job, action, because, because)._replace(stage=CANCEL, cancel="dropped")
        if seen == "unread":  # tried again by the next run, with another look
            Q.update_action(self.conn, int(action["id"]), cancel_state="failed", cancel_error=because)
            self.log("efficiency-cancel-failed", job=job.job_id, error=because)
            return Outcome(job.job_id, CANCEL, why, cancel="failed", error=because)
        # The reason goes where sacct shows it, unless another tool owns the field (never overwritten).
        note = cancel_note(why)
        try:
            self.backend.cancel_with_note(job.job_id, note if not job.admin_comment or is_ours(job.admin_comment) else None)
        except SlurmError as e:
            Q.update_action(self.conn, int(action["id"]), cancel_state="failed", cancel_error=e.message)
            self.log("efficiency-cancel-failed", job=job.job_id, error=e.message)
            return Outcome(job.job_id, CANCEL, why, cancel="failed", error=e.message)
        Q.update_action(self.conn, int(action["id"]), cancel_state="done", cancel_error=None)
        self.log("efficiency-cancelled", job=job.job_id, user=job.user)
        return Outcome(job.job_id, CANCEL, why, cancel="done")

    def _mail(self, row_id: int, msg: M.Message, now: float, tries: int = 0) -> str:
        cap = int(self.cfg.efficiency.max_mails_per_user_per_day)
        if Q.mails_since(self.conn, msg.to, now - DAY_S) >= cap:
            Q.update_action(self.conn, row_id, mail_state="capped", mail_time=now, mail_error=None)
            self.log("efficiency-mail-capped", to=msg.to, cap=cap)
            return "capped"
        try:
            how = self.send(self.cfg, msg)
        except M.MailError as e:
            Q.update_action(self.conn, row_id, mail_state="failed", mail_tries=tries + 1, mail_time=now,
                            mail_error=e.message)
            self.log("efficiency-mail-failed", to=msg.to, tries=tries + 1, error=e.message)
            return "failed"
        Q.update_action(self.conn, row_id, mail_state="sent", mail_tries=tries + 1, mail_time=now, mail_error=None)
        self.log("efficiency-mail-sent", to=msg.to, via=how)
        return "sent"

    def retry_mails(self, now: float) -> List[Outcome]:
        """Mails that failed (or were never tried: a crash between the decision and the send), again."""
        out = []
        for a in Q.pending_mails(self.conn, now - float(self.cfg.efficiency.mail_retry_s)):
            saved = json.loads(a["message"] or "{}")
            if not saved.get("subject") or (a["stage"] == CANCEL and a["cancel_state"] != "done"):
                continue  # a cancel's notice goes once the cancel is done (_unfinished_cancel), never before
            msg = M.Message(a["mail_to"], saved["subject"], saved["body"])
            state = self._mail(int(a["id"]), msg, now, int(a["mail_tries"] or 0))
            out.append(Outcome(int(a["job_id"]), a["stage"], "mail tried again", mail=state))
        return out


def enforce(cfg: Config, conn: Any, backend: Any, *, now: Optional[float] = None, booted_at: float = 0.0,
            dry_run: bool = False, node: Optional[str] = None, send: Callable[[Config, M.Message], str] = M.send,
            log: Callable[..., None] = _no_log, source: Any = None, only_multi_node: bool = False,
            reader: Any = None) -> List[Outcome]:
    """One run: this node's jobs (source None: its database; reader: NVML for the last look before a
    cancel), or those of a source such as the central server's (efficiency/central.py).  Decisions are
    recorded in `conn` (this host's node database) either way."""
    return Enforcer(cfg, conn, backend, node=node, dry_run=dry_run, send=send, log=log, source=source,
                    only_multi_node=only_multi_node, reader=reader).run(time.time() if now is None else now, booted_at)

