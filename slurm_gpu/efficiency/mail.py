"""The idle policy's mail to a job's user: the text, and its delivery by SMTP or a mail command.

Plain text, one message per job and stage.  It names the job, its GPUs and their figures, says what to
do (the advice `slurm-gpu job` gives), what happens next, and links the site's page for the job
(efficiency.job_url).  Delivery: `smtp_server` (plain SMTP to the site's relay, as Slurm's own mails
go through the local MTA), else `mail_command` run without a shell with the body on its standard input,
the arguments of Slurm's MailProg (`mail -s SUBJECT USER`).  A failure is an exception with one line
(MailError); the caller records it and tries again later.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

from slurm_gpu.config import Config
from slurm_gpu.efficiency.policy import ADVICE, CANCEL, NOTIFY, JobFacts
from slurm_gpu.errors import SlurmGpuError

MAIL_TIMEOUT_S = 20.0


class MailError(SlurmGpuError):
    """A mail that did not go out (server down or refusing, command failed)."""


class Message(NamedTuple):
    to: str
    subject: str
    body: str


def address(cfg: Config, job: JobFacts) -> str:
    """Where the job's mails go: Slurm's MailUser, else USER@mail_domain, else the bare user name."""
    if job.mail_user and job.mail_user != "(null)":
        return job.mail_user
    domain = cfg.efficiency.mail_domain
    return f"{job.user}@{domain}" if domain else job.user


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 120:
        return f"{s} s"
    h, m = divmod(s // 60, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min"


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _bytes(b: Optional[int]) -> str:
    return "n/a" if b is None else f"{b / (1 << 30):.1f} GiB"


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.0f} %"


def _energy(j: Optional[float]) -> str:
    return "n/a" if j is None else f"{j / 1000:.1f} kJ"


def gpu_table(evidence: Sequence[Mapping[str, Any]]) -> List[str]:
    rows = [("node", "GPU", "idle for", "utilisation (max)", "memory used (max)", "energy so far")]
    for e in evidence:
        idx = "" if e.get("index") is None else f"{e['index']} "
        rows.append((str(e["node"]), f"{idx}{str(e['gpu'])[:20]}", _duration(float(e.get("idle_s") or 0.0)),
                     _pct(e.get("util_max_pct")), _bytes(e.get("memory_max_bytes")), _energy(e.get("energy_j"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def compose(cfg: Config, job: JobFacts, stage: str, action: Mapping[str, Any], evidence: Sequence[Mapping[str, Any]],
            *, cancel_after_s: float = 0.0, notify_after_s: float = 0.0, exempt: str = "") -> Message:
    """The mail of one stage.  action: the efficiency_actions row (idle_s, idle_since, gpus, idle_gpus)."""
    idle_s = float(action.get("idle_s") or 0.0)
    gpus, idle_gpus = int(action.get("gpus") or 0), int(action.get("idle_gpus") or 0)
    name = f' ("{job.name}")' if job.name else ""
    where = f"on cluster {job.cluster}, account {job.account}, partition {job.partition}"
    if stage == CANCEL:
        subject = (f"[slurm-gpu] Job {job.job_id} cancelled: its {'GPU was' if gpus == 1 else 'GPUs were'} idle for "
                   f"{_duration(idle_s)}")
        head = [f"Your job {job.job_id}{name} {where} was cancelled through Slurm because "
                f"{'its GPU' if gpus == 1 else f'none of its {gpus} GPUs'} did {'no' if gpus == 1 else 'any'} work "
                f"for {_duration(idle_s)}, after the warning you were sent."]
        nxt = ["Its output files are where the job wrote them. Before you submit it again, make sure it uses its GPUs "
               "(see below)."]
    elif stage == NOTIFY:
        its = "its GPU has" if gpus == 1 else f"its {gpus} GPUs have"
        subject = f"[slurm-gpu] Job {job.job_id}: {its} been idle for {_duration(idle_s)}"
        head = [f"Your job {job.job_id}{name} {where} holds {_gpus(gpus)} that {'has' if gpus == 1 else 'have'} done "
                f"no work for {_duration(idle_s)} (since {_utc(float(action.get('idle_since') or 0.0))})."]
        if cancel_after_s and not exempt:
            # Not before it has been idle cancel_after_s, nor before this warning is cancel - notify old (policy.py).
            earliest = time.time() + max(cancel_after_s - idle_s, cancel_after_s - notify_after_s)
            nxt = [f"If its GPUs stay idle, the job will be cancelled once they have been idle for "
                   f"{_duration(cancel_after_s)} (not before {_utc(earliest)}).",
                   "If the job no longer needs them, please end it now: scancel " + str(job.job_id)]
        else:
            nxt = ["If the job no longer needs them, please end it now: scancel " + str(job.job_id),
                   "Other users are waiting for GPUs."]
    elif stage == ADVICE:
        subject = f"[slurm-gpu] Job {job.job_id}: {idle_gpus} of its {gpus} GPUs are idle"
        head = [f"Your job {job.job_id}{name} {where} uses only some of its GPUs: {idle_gpus} of {gpus} have done "
                "no work for at least the time below, while the others are busy."]
        nxt = ["Nothing will be done to this job. Next time, request only the GPUs your program uses "
               "(--gres=gpu:N or --gpus=N), or make it use all of them (e.g. one rank per GPU)."]
    else:
        raise ValueError(stage)
    advice = ["What helps:",
              "- A job that waits (for input, for a license, for you) can give its GPUs back: end it and submit again "
              "when it can use them.",
              "- Check that your program finds the GPUs (CUDA_VISIBLE_DEVICES, the framework's device setting) and "
              "prints the device it runs on.",
              f"- `slurm-gpu job {job.job_id}` shows the figures of its GPUs."]
    url = cfg.efficiency.job_url
    link = [f"Details: {url.format(job_id=job.job_id, cluster=job.cluster, user=job.user)}"] if url else []
    if cfg.job.site_note:
        link.append(cfg.job.site_note)
    body = "\n".join([f"Hello {job.user},", "", *head, "", *gpu_table(evidence), "", *nxt, "", *advice, "", *link,
                      "", "-- ", f"slurm-gpu on {socket.gethostname()}, for the administrators of {job.cluster}", ""])
    return Message(address(cfg, job), subject, body)


def sender(cfg: Config) -> str:
    return cfg.efficiency.mail_from or f"slurm-gpu@{socket.getfqdn()}"


def send(cfg: Config, msg: Message, *, timeout_s: float = MAIL_TIMEOUT_S) -> str:
    """Deliver one message; returns how ('smtp HOST:PORT' or the command's name).  MailError on failure."""
    server = cfg.efficiency.smtp_server
    if server:
        return _smtp(cfg, server, msg, timeout_s)
    return _command(cfg.efficiency.mail_command, msg, timeout_s)


def _smtp(cfg: Config, server: str, msg: Message, timeout_s: float) -> str:
    import smtplib
    from email.message import EmailMessage
    from email.utils import formatdate, make_msgid
    if "@" not in msg.to:
        raise MailError(f"cannot mail {msg.to!r} by SMTP: no domain",
                        "set efficiency.mail_domain, or let users set --mail-user")
    m = EmailMessage()
    m["From"], m["To"], m["Subject"] = sender(cfg), msg.to, msg.subject
    m["Date"], m["Message-ID"] = formatdate(localtime=False), make_msgid(domain="slurm-gpu")
    m["Auto-Submitted"] = "auto-generated"  # RFC 3834: no vacation replies
    m.set_content(msg.body)
    host, _, port = server.rpartition(":")
    try:
        with smtplib.SMTP(host, int(port), timeout=timeout_s) as s:
            refused = s.send_message(m)
    except (OSError, smtplib.SMTPException) as e:
        raise MailError(f"SMTP server {server}: {type(e).__name__}: {e}".replace("\n", " "),
                        "is efficiency.smtp_server up and does it relay for this host?") from None
    if refused:
        raise MailError(f"SMTP server {server} refused {', '.join(refused)}", "check the address")
    return f"smtp {server}"


def _command(template: Sequence[str], msg: Message, timeout_s: float) -> str:
    argv = [a.replace("{subject}", msg.subject).replace("{to}", msg.to) for a in template]
    env: Dict[str, str] = {"PATH": os.environ.get("PATH") or "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    try:
        cp = subprocess.run(argv, input=msg.body.encode(), capture_output=True, timeout=timeout_s, env=env,
                            close_fds=True)
    except FileNotFoundError:
        raise MailError(f"mail command {argv[0]!r} not found",
                        "install a mailer (Debian: bsd-mailx) or set efficiency.smtp_server") from None
    except subprocess.TimeoutExpired:
        raise MailError(f"mail command {argv[0]} did not finish within {timeout_s:.0f} s", "check the local MTA") from None
    except OSError as e:
        raise MailError(f"mail command {argv[0]}: {e.strerror}", "check efficiency.mail_command") from None
    if cp.returncode != 0:
        err = (cp.stderr or cp.stdout).decode(errors="replace").strip().splitlines()
        raise MailError(f"mail command {argv[0]} exited {cp.returncode}" + (f": {err[-1][:200]}" if err else ""),
                        "check the local MTA and efficiency.mail_command")
    return os.path.basename(argv[0])
