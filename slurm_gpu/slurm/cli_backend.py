"""The Slurm backend that runs the command-line tools: works with every Slurm version.

* Node facts: ``scontrol -d -o show node [NAME]`` (one line per node; ``-d`` adds GresUsed).
  22.05 has no ``scontrol --json``; the one-line format is stable across versions.
* Drain / resume: ``scontrol update NodeName=X State=DRAIN Reason=<text>`` / ``State=RESUME``.
  The reason is ONE argv element, never passed through a shell.
* Many nodes: ONE ``scontrol -d -o show node <hostlist>`` reads them all (an unknown name is a
  ``Node X not found`` line and exit 1, the others are still printed), ONE
  ``scontrol update NodeName=<hostlist> ...`` changes them all (see SlurmBackend.drain_many).
* Jobs: ``scontrol -o show job`` while slurmctld knows the job, then ``sacct --json``,
  falling back to ``sacct -P`` where ``--json`` is missing or its schema is not understood.
* The verification job (remediation/verifyjob.py): ``scontrol create|delete|show reservation``,
  ``sbatch --parsable``, ``scancel JOB`` / ``scancel --reservation=NAME``, the job's state from
  ``scontrol -o show job``, then ``sacct -X -P``.

Binaries are looked up in ``slurm_bin_dir``, then PATH, then /usr/bin, /usr/local/bin,
/opt/slurm/bin (slurmd runs hooks without PATH).  The environment is passed through —
SLURM_CONF matters — with ``SLURM_TIME_FORMAT=standard`` so timestamps parse.  Every call has
``timeout = slurm_timeout_s``.  What the tools print is parsed in slurm/cli_text.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Sequence, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import NotInAccounting, SlurmError
from slurm_gpu.slurm import hostlist
from slurm_gpu.slurm.cli_text import (
    blank_null,
    gres_from_tres,
    job_from_sacct_json,
    job_from_scontrol,
    node_from_fields,
    parse_kv,
    parse_show_line,
    split_records,
)
from slurm_gpu.slurm.hostlist import compress
from slurm_gpu.slurm.model import (
    NodeInfo,
    NodeLookup,
    SlurmBackend,
    final_job_facts,
    hostlist_batches,
    select_nodes,
    tres_gpu_count,
)
from slurm_gpu.timefmt import slurm_to_unix

FALLBACK_DIRS = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin")
PING_HINT = "check that slurmctld is running and reachable: `scontrol ping` (SLURM_CONF={conf})"
DBD_HINT = ("check that slurmdbd is running and that slurm.conf's AccountingStorageHost/Port reach it: "
            "`sacctmgr show cluster` (SLURM_CONF={conf})")
ADMIN_HINT = "drain/resume need Slurm administrator rights: run as root or as a user with AdminLevel=Operator"

_UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused",
                "communication connection failure", "zero bytes were transmitted", "connect failure",
                "unable to establish controller machine")
# sacct and sacctmgr talk to slurmdbd, not slurmctld: their connection errors name the database.
_DBD_UNREACHABLE = ("_open_persist_conn", "persistinit", "problem talking to the database",
                    "unable to connect to database")
_NO_CONFIG = ("could not establish a configuration source", "unable to process configuration file",
              "unable to read configuration")
_DENIED = ("access/permission denied", "permission denied", "invalid user id", "access denied")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
_NODE_GRES = re.compile(r"\bNodes=(\S+) CPU_IDs=\S* Mem=\S* GRES=(\S*)")
_SDIAG_TIME = re.compile(r"^sdiag output at .*\((\d+)\)\s*$", re.M)
_NOT_FOUND = re.compile(r"^Node (\S+) not found$")  # scontrol show node, per unknown name (on stdout in 22.05)


class CliBackend(SlurmBackend):
    name = "cli"

    def __init__(self, cfg: Optional[Config] = None, *, bin_dir: Optional[str] = None, timeout_s: Optional[float] = None,
                 env: Optional[Dict[str, str]] = None):
        self.bin_dir = bin_dir if bin_dir is not None else (getattr(cfg, "slurm_bin_dir", "") or "")
        self.timeout_s = float(timeout_s if timeout_s is not None else getattr(cfg, "slurm_timeout_s", 10.0))
        self._env = env
        self.named_ids: Dict[int, str] = {}
        self.energies: Dict[int, int] = {}  # raw job id -> ConsumedEnergyRaw (0: none recorded), from admin_comments
        self._bins: Dict[str, str] = {}
        self._sacct_json: Optional[bool] = None  # None: not tried yet

    # ------------------------------------------------------------ process plumbing
    def find(self, tool: str) -> str:
        if tool in self._bins:
            return self._bins[tool]
        tried = []
        if self.bin_dir:
            p = os.path.join(self.bin_dir, tool)
            tried.append(self.bin_dir)
            if os.access(p, os.X_OK):
                self._bins[tool] = p
                return p
        path_env = self._base_env().get("PATH")
        if path_env:
            on_path = shutil.which(tool, path=path_env)
            tried.append("PATH")
            if on_path:
                self._bins[tool] = on_path
                return on_path
        for d in FALLBACK_DIRS:
            p = os.path.join(d, tool)
            tried.append(d)
            if os.access(p, os.X_OK):
                self._bins[tool] = p
                return p
        raise SlurmError(f"{tool} not found (looked in {', '.join(tried)})",
                         "install the Slurm client commands or set slurm_bin_dir in the slurm-gpu config")

    def _base_env(self) -> Dict[str, str]:
        return dict(self._env) if self._env is not None else dict(os.environ)

    def env(self) -> Dict[str, str]:
        env = self._base_env()
        env["SLURM_TIME_FORMAT"] = "standard"  # ISO timestamps whatever the admin's shell prefers
        return env

    def _conf(self) -> str:
        return self._base_env().get("SLURM_CONF") or "default (/etc/slurm/slurm.conf or configless)"

    def run(self, tool: str, args: Sequence[str], timeout_s: Optional[float] = None) -> Tuple[int, str, str]:
        """(exit code, stdout, stderr); raises SlurmError when it cannot run or times out."""
        argv = [self.find(tool)] + [str(a) for a in args]
        t = self.timeout_s if timeout_s is None else timeout_s
        shown = " ".join([tool] + [str(a) for a in args][:4])
        try:
            r = subprocess.run(argv, env=self.env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=t)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"slurmctld not reachable: `{shown}` did not answer within {t:g} s",
                             PING_HINT.format(conf=self._conf()) + "; or raise slurm_timeout_s") from None
        except OSError as e:
            raise SlurmError(f"cannot run {argv[0]}: {e.strerror or e}",
                             "check the Slurm client installation or slurm_bin_dir") from None
        return (r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace"))

    def _raise(self, rc: int, out: str, err: str, what: str, *, node: str = "", job: Optional[int] = None) -> None:
        text = " ".join((err.strip() + " " + out.strip()).split()) or f"exit code {rc}"
        low = text.lower()
        if any(s in low for s in _NO_CONFIG):
            raise SlurmError(f"no usable Slurm configuration: {text}",
                             f"set SLURM_CONF to the site's slurm.conf (now: {self._conf()})")
        if any(s in low for s in _DBD_UNREACHABLE):
            raise SlurmError(f"slurmdbd not reachable: {text}", DBD_HINT.format(conf=self._conf()))
        if any(s in low for s in _UNREACHABLE):
            raise SlurmError(f"slurmctld not reachable: {text}", PING_HINT.format(conf=self._conf()))
        if node and ("invalid node name" in low or "not found" in low):
            raise SlurmError(f"unknown node {node!r}: {text}", "list the cluster's nodes with `sinfo -N`")
        if job is not None and "accounting storage is disabled" in low:
            raise SlurmError(f"unknown job {job}: slurmctld no longer knows it and {text}",
                             "job facts after the job ends need accounting (AccountingStorageType=accounting_storage/slurmdbd)")
        if job is not None and "invalid job id" in low:
            raise SlurmError(f"unknown job {job}: {text}", "the job id may be mistyped or purged from accounting")
        if any(s in low for s in _DENIED):
            raise SlurmError(f"{what}: permission denied: {text}", ADMIN_HINT)
        raise SlurmError(f"{what} failed: {text}", PING_HINT.format(conf=self._conf()))

    # ------------------------------------------------------------ nodes
    @staticmethod
    def _check_name(name: str) -> None:
        # One argv element per name, but "gpu01 State=RESUME" would still confuse scontrol.
        if not isinstance(name, str) or not _NODE_NAME.match(name):
            raise SlurmError(f"invalid node name {name!r}", "node names are letters, digits, '.', '_' and '-'")

    def version(self) -> str:
        for tool in ("scontrol", "sinfo"):
            try:
                rc, out, err = self.run(tool, ["--version"], timeout_s=min(self.timeout_s, 5.0))
            except SlurmError:
                continue
            if rc == 0 and out.strip():
                return out.strip()
        raise SlurmError("cannot determine the Slurm version (`scontrol --version` failed)",
                         "check SLURM_CONF and the Slurm client installation")

    def _show_nodes(self, name: Optional[str]) -> List[NodeInfo]:
        args = ["-d", "-o", "show", "node"] + ([name] if name else [])
        rc, out, err = self.run("scontrol", args)
        if rc != 0:
            self._raise(rc, out, err, "scontrol show node", node=name or "")
        return [node_from_fields(parse_show_line(line)) for line in split_records(out)]

    def node(self, name: str) -> NodeInfo:
        self._check_name(name)
        found = [n for n in self._show_nodes(name) if n.name == name]
        if not found:
            raise SlurmError(f"unknown node {name!r}: scontrol returned no such node", "list the cluster's nodes with `sinfo -N`")
        return found[0]

    def nodes(self, names: Optional[List[str]] = None) -> List[NodeInfo]:
        if names is not None and len(names) == 1:
            return [self.node(names[0])]
        for n in names or []:
            self._check_name(n)
        return select_nodes(self._show_nodes(None), names, "`scontrol show node`")

    def drain(self, name: str, reason: str) -> None:
        self._check_name(name)
        if not reason or not reason.strip():
            raise SlurmError("a drain needs a reason", "pass the text formatted by slurm_gpu.slurm.reason.format_reason")
        rc, out, err = self.run("scontrol", ["update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"])
        if rc != 0:
            self._raise(rc, out, err, f"drain {name}", node=name)

    def resume(self, name: str) -> None:
        self._check_name(name)
        rc, out, err = self.run("scontrol", ["update", f"NodeName={name}", "State=RESUME"])
        if rc != 0:
            self._raise(rc, out, err, f"resume {name}", node=name)

    def ctld_time(self) -> float:
        """slurmctld's clock: the time `sdiag` says its report was made at (`sdiag output at ... (EPOCH)`,
        stamped by slurmctld, not by this node's clock)."""
        rc, out, err = self.run("sdiag", [])
        if rc != 0:
            self._raise(rc, out, err, "sdiag")
        m = _SDIAG_TIME.search(out)
        if not m:
            raise SlurmError("sdiag printed no report time (`sdiag output at ... (EPOCH)`)",
                             "check that sdiag of this Slurm release runs on this node")
        return float(m.group(1))

    def reboot(self, name: str, reason: str) -> None:
        self._check_name(name)
        if not reason or not reason.strip():
            raise SlurmError("a reboot needs a reason", "pass the text formatted by slurm_gpu.slurm.reason.format_reason")
        rc, out, err = self.run("scontrol", ["reboot", "ASAP", "nextstate=DOWN", f"reason={reason}", name])
        if rc != 0:
            self._raise(rc, out, err, f"reboot {name}", node=name)

    # ------------------------------------------------------------ the verification job's reservation and job
    @staticmethod
    def _check_word(kind: str, value: str) -> None:
        # One argv element each, but a value with '=' or a space would still read as another key to scontrol.
        if not isinstance(value, str) or not _NODE_NAME.match(value):
            raise SlurmError(f"invalid {kind} {value!r}", f"{kind}s are letters, digits, '.', '_' and '-'")

    def create_reservation(self, name: str, node: str, duration_min: int, users: Sequence[str],
                           flags: Sequence[str] = ("MAINT", "IGNORE_JOBS")) -> None:
        """``scontrol create reservation ReservationName=NAME Nodes=NODE StartTime=now Duration=MIN Users=U
        Flags=MAINT,IGNORE_JOBS``: MAINT and IGNORE_JOBS exist from 22.05 to 26.05 (scontrol man pages)."""
        self._check_word("reservation name", name)
        self._check_name(node)
        for u in users:
            self._check_word("user name", u)
        args = ["create", "reservation", f"ReservationName={name}", f"Nodes={node}", "StartTime=now",
                f"Duration={max(1, int(duration_min))}", f"Users={','.join(users)}"]
        if flags:
            args.append(f"Flags={','.join(flags)}")
        rc, out, err = self.run("scontrol", args)
        if rc != 0:
            self._raise(rc, out, err, f"create reservation {name}", node=node)

    def delete_reservation(self, name: str) -> bool:
        self._check_word("reservation name", name)
        rc, out, err = self.run("scontrol", ["delete", f"Reservation={name}"])
        if rc == 0:
            return True
        if "reservation is invalid" in (err + out).lower() or "not found" in (err + out).lower():
            return False
        if "in use" in (err + out).lower():
            raise SlurmError(f"reservation {name} still has jobs: {' '.join((err + out).split())}",
                             f"cancel them (scancel --reservation={name}), then delete it")
        self._raise(rc, out, err, f"delete reservation {name}")
        return False

    def reservation(self, name: str) -> Optional[Dict[str, str]]:
        self._check_word("reservation name", name)
        rc, out, err = self.run("scontrol", ["-o", "show", "reservation", name])
        if rc != 0 or not out.strip():
            if "not found" in (err + out).lower() or "invalid" in (err + out).lower() or not (err + out).strip():
                return None
            self._raise(rc, out, err, f"scontrol show reservation {name}")
        for line in out.splitlines():
            fields = parse_kv(line)
            if fields.get("ReservationName") == name:
                return fields
        return None

    def submit_batch(self, options: Sequence[str], script: str) -> int:
        if any(not str(o).startswith("--") for o in options):
            raise SlurmError(f"sbatch options must be --name=value arguments: {list(options)!r}",
                             "this is a bug in slurm-gpu")
        rc, out, err = self.run("sbatch", ["--parsable", *options, script])
        first = out.strip().split(";")[0] if out.strip() else ""
        if rc != 0 or not first.isdigit():
            self._raise(rc, out, err, "sbatch")
        return int(first)

    def job_state(self, job_id: int) -> Tuple[str, str, str]:
        job_id = int(job_id)
        rc, out, err = self.run("scontrol", ["-o", "show", "job", str(job_id)])
        if rc == 0 and out.strip():
            recs = [parse_kv(r) for r in split_records(out)]
            f = next((r for r in recs if r.get("JobId") == str(job_id)), recs[0])
            return f.get("JobState", ""), blank_null(f.get("NodeList")), blank_null(f.get("Reason"))
        if rc != 0 and "invalid job id" not in (err + out).lower():
            self._raise(rc, out, err, f"scontrol show job {job_id}", job=job_id)
        rc, out, err = self.run("sacct", ["-X", "-n", "-P", "-j", str(job_id), "--format=JobIDRaw,State,NodeList,Reason"])
        if rc != 0:
            self._raise(rc, out, err, f"sacct -j {job_id}", job=job_id)
        for line in out.splitlines():
            vals = line.split("|")
            if len(vals) >= 4 and vals[0].strip() == str(job_id):
                return (vals[1].split() or [""])[0], blank_null(vals[2]), blank_null(vals[3])
        raise SlurmError(f"unknown job {job_id}: not in slurmctld nor in accounting (sacct)",
                         "the job id may be mistyped, or accounting (slurmdbd) is not enabled")

    def job_record(self, job_id: int) -> Optional[Dict[str, str]]:
        """`scontrol -o show job JOBID` as its key=value fields (the idle policy's facts of a running job);
        None when slurmctld no longer knows the job."""
        job_id = int(job_id)
        rc, out, err = self.run("scontrol", ["-o", "show", "job", str(job_id)])
        if rc != 0:
            if "invalid job id" in (err + out).lower():
                return None
            self._raise(rc, out, err, f"scontrol show job {job_id}", job=job_id)
        recs = [parse_kv(r) for r in split_records(out)]
        return next((r for r in recs if r.get("JobId") == str(job_id)), None)

    def job_records(self) -> Dict[int, Dict[str, str]]:
        """Every job slurmctld knows, `scontrol -o show job` once, by raw job id: what the central idle policy
        asks about hundreds of running jobs in one call instead of one each."""
        rc, out, err = self.run("scontrol", ["-o", "show", "job"])
        if rc != 0 and "no jobs in the system" not in (err + out).lower():
            self._raise(rc, out, err, "scontrol show job")
        recs = [parse_kv(r) for r in split_records(out)] if rc == 0 else []
        return {int(r["JobId"]): r for r in recs if r.get("JobId", "").isdigit()}

    def set_running_summary(self, job_id: int, text: str) -> None:
        """A running job's GPU figures so far into its AdminComment (the caller checked the field is free or
        ours): `scontrol update`, which slurmctld takes while the job runs (sacctmgr only after it ended)."""
        rc, out, err = self.run("scontrol", ["update", f"JobId={int(job_id)}", f"AdminComment={text}"])
        if rc != 0:
            self._raise(rc, out, err, f"scontrol update JobId={job_id} AdminComment=", job=int(job_id))

    def cancel_with_note(self, job_id: int, note: Optional[str]) -> bool:
        """Cancel a running job (the idle policy), its reason first put into its AdminComment (`note`; the
        caller has checked that the field is free or already ours: sacct then shows it).  True when the note
        was set.  SlurmError when the cancel failed."""
        noted = False
        if note:
            clean = " ".join(note.replace("=", ":").split())[:1000]  # one value: no '=' that parse_kv would split
            rc, out, err = self.run("scontrol", ["update", f"JobId={int(job_id)}", f"AdminComment={clean}"])
            noted = rc == 0
        self.cancel_job(job_id)
        return noted

    def cancel_job(self, job_id: int) -> None:
        rc, out, err = self.run("scancel", [str(int(job_id))])
        if rc != 0 and "invalid job id" not in (err + out).lower() and "already completed" not in (err + out).lower():
            self._raise(rc, out, err, f"scancel {job_id}", job=int(job_id))

    def job_accounted(self, job_id: int) -> bool:
        rc, out, err = self.run("sacct", ["-X", "-n", "-P", "-j", str(int(job_id)), "--format=JobIDRaw,End"])
        if rc != 0:
            self._raise(rc, out, err, f"sacct -j {job_id}", job=int(job_id))
        for line in out.splitlines():
            raw, _, end = line.partition("|")
            if raw.strip() == str(int(job_id)):
                return end.strip() not in ("", "Unknown", "None")
        return False

    def cancel_reservation_jobs(self, name: str) -> None:
        self._check_word("reservation name", name)
        rc, out, err = self.run("scancel", [f"--reservation={name}"])
        if rc != 0 and "invalid" not in (err + out).lower():
            self._raise(rc, out, err, f"scancel --reservation={name}")

    def lookup_nodes(self, names: Sequence[str]) -> NodeLookup:
        """One ``scontrol -d -o show node <hostlist>`` per hostlist batch (one for up to 64k
        nodes with short names).  scontrol prints every known node, a ``Node X not found`` line
        per unknown one and exits 1 when there was one: that exit is not an error here."""
        found: Dict[str, NodeInfo] = {}
        failed: Dict[str, SlurmError] = {}
        good = []
        for n in names:
            try:
                self._check_name(n)
            except SlurmError as e:
                failed[n] = e
            else:
                good.append(n)
        got: Dict[str, NodeInfo] = {}
        for batch in hostlist_batches(good):
            expr = compress(batch)
            rc, out, err = self.run("scontrol", ["-d", "-o", "show", "node", expr])
            not_found: Dict[str, str] = {}
            rest = []
            for line in out.splitlines():
                m = _NOT_FOUND.match(line.strip())
                if m:
                    not_found[m.group(1)] = line.strip()
                else:
                    rest.append(line)
            for line in err.splitlines():
                m = _NOT_FOUND.match(line.strip())
                if m:
                    not_found[m.group(1)] = line.strip()
            if rc != 0 and not not_found:
                self._raise(rc, out, err, "scontrol show node", node=expr if len(batch) == 1 else "")
            wanted = set(batch)
            for rec in split_records("\n".join(rest)):
                info = node_from_fields(parse_show_line(rec))
                if info.name in wanted:
                    got[info.name] = info
            for n in batch:
                if n not in got:
                    failed[n] = SlurmError(f"unknown node {n!r}: {not_found.get(n, 'scontrol returned no such node')}",
                                           "list the cluster's nodes with `sinfo -N`")
        for n in names:
            if n in got:
                found[n] = got[n]
        return NodeLookup(found, {n: failed[n] for n in names if n in failed})

    def _update_nodes(self, names: List[str], state: str, reason: Optional[str] = None) -> None:
        for n in names:
            self._check_name(n)
        expr = compress(names)
        args = ["update", f"NodeName={expr}", f"State={state}"] + ([f"Reason={reason}"] if reason is not None else [])
        rc, out, err = self.run("scontrol", args)
        if rc != 0:
            self._raise(rc, out, err, f"{state.lower()} {expr}", node=expr if len(names) == 1 else "")

    # ------------------------------------------------------------ jobs
    def job_summary_target(self, job_id: int) -> Tuple[str, Optional[List[str]]]:
        """(the job's AdminComment, the nodes that hold GPUs of it) while slurmctld still knows
        the job (EpilogSlurmctld); ('', None) when it does not.

        From `scontrol -d -o show job`: ``Nodes=gpu[01-02] CPU_IDs=0-1 Mem=0 GRES=gpu:h100:2(IDX:0-1)``
        per group of nodes.  While the job is COMPLETING (EpilogSlurmctld) slurmctld has already
        released the GRES (observed on 22.05.8: ``GRES=`` empty, ``NodeList=`` empty): then every
        node of the job with TRES ``gres/gpu=N`` counts."""
        rc, out, err = self.run("scontrol", ["-d", "-o", "show", "job", str(int(job_id))])
        if rc != 0 or not out.strip():
            if "invalid job id" in (err + out).lower():
                return "", None
            self._raise(rc, out, err, f"scontrol show job {job_id}", job=int(job_id))
        line = split_records(out)[0]
        fields = parse_kv(line)
        comment = fields.get("AdminComment", "")
        groups = [(m.group(1), m.group(2)) for m in _NODE_GRES.finditer(line)]
        has_gpus = bool(tres_gpu_count(fields.get("TRES", ""))) or "gpu" in fields.get("JOB_GRES", "")
        if not has_gpus:
            return ("" if comment == "(null)" else comment), []
        gpu_nodes: List[str] = []
        released = all(not gres or gres == "(null)" for _, gres in groups)
        for nodes, gres in groups:
            if released or re.search(r"(?:^|,)gpu[:(]", gres):
                gpu_nodes += hostlist.expand(nodes)
        return ("" if comment == "(null)" else comment), (gpu_nodes or None)

    def set_admin_comment(self, job_id: int, cluster: str, text: str, named: str = "") -> None:
        """Write a finished (or finishing) job's AdminComment in accounting (slurmdbd).

        `sacctmgr modify job` is the path that works once the job completes: slurmctld refuses
        `scontrol update` then ("Job has already finished").  sacctmgr lowercases the value.
        An array task is named ARRAY_TASK and a heterogeneous job's component LEADER+OFFSET
        (`named`): `jobid=N` writes every task of array N and every component of het job N
        (observed on 22.05.8), so the raw id alone could overwrite another task's summary."""
        self._modify_job(job_id, cluster, named, f"AdminComment={text}")

    def _modify_job(self, job_id: int, cluster: str, named: str, setting: str) -> None:
        """`sacctmgr -i modify job where jobid=N|NAMED [cluster=C] set SETTING` (named: set_admin_comment);
        NotInAccounting when sacctmgr modified nothing (ctld._write tries again)."""
        which = named if re.fullmatch(r"\d+[_+]\d+", named or "") else str(int(job_id))
        where = ["where", f"jobid={which}"] + ([f"cluster={cluster}"] if cluster else [])
        rc, out, err = self.run("sacctmgr", ["-i", "modify", "job", *where, "set", setting])
        if "nothing modified" in (out + err).lower() or "didn't affect anything" in (out + err).lower():
            raise NotInAccounting(f"sacctmgr modified nothing for job {job_id}: not in accounting (yet), or this user "
                                  "may not modify jobs", "the user running this must be SlurmUser, root or have "
                                  "AdminLevel=Operator in slurmdbd (sacctmgr modify user NAME set adminlevel=operator)")
        if rc != 0:
            self._raise(rc, out, err, f"sacctmgr modify job {job_id} {setting.split('=', 1)[0]}", job=int(job_id))

    def energy_tres_settable(self) -> bool:
        """Whether this Slurm's sacctmgr sets a finished job's TRES (`set TRES=energy=J`): 25.11 and later
        (RELEASE_NOTES 25.11; 26.05.5 observed), from `sacctmgr --version`."""
        cached = getattr(self, "_energy_settable", None)
        if cached is not None:
            return bool(cached)
        rc, out, err = self.run("sacctmgr", ["--version"], timeout_s=min(self.timeout_s, 5.0))
        m = re.search(r"(\d+)\.(\d+)", out if rc == 0 else "")
        self._energy_settable = m is not None and (int(m.group(1)), int(m.group(2))) >= (25, 11)
        return self._energy_settable

    def job_energy_j(self, job_id: int, cluster: str = "") -> Optional[int]:
        """The job's ConsumedEnergyRaw in accounting (joules; 0 when Slurm measured none), None when
        accounting does not hold the job."""
        rc, out, err = self.run("sacct", ["-X", "-n", "-P", *(["-M", cluster] if cluster else []), "-j",
                                          str(int(job_id)), "--format=JobIDRaw,ConsumedEnergyRaw"])
        if rc != 0:
            self._raise(rc, out, err, f"sacct -j {job_id}", job=int(job_id))
        for line in out.splitlines():
            raw, _, energy = line.partition("|")
            if raw.strip() == str(int(job_id)):
                e = energy.strip()
                return int(e) if e.isdigit() else 0
        return None

    def set_job_energy(self, job_id: int, cluster: str, joules: int, named: str = "") -> None:
        """`sacctmgr -i modify job where jobid=N cluster=C set TRES=energy=J` (25.11+)."""
        self._modify_job(job_id, cluster, named, f"TRES=energy={int(joules)}")

    def admin_comments(self, job_ids: Sequence[int], cluster: str = "") -> Dict[int, str]:
        """{raw job id: AdminComment} of finished jobs from accounting (sacct), 200 jobs per call;
        array tasks and heterogeneous components are noted in ``named_ids`` (raw id -> 4711_3 or
        4711+1, what set_admin_comment needs), and each job's ConsumedEnergyRaw in ``energies``
        (0 when accounting holds none: `central annotate` gives a complete summary's job its energy)."""
        out: Dict[int, str] = {}
        ids = [str(int(j)) for j in job_ids]
        for i in range(0, len(ids), 200):
            chunk = ",".join(ids[i:i + 200])
            rc, text, err = self.run("sacct", ["-X", "-n", "-P", *(["-M", cluster] if cluster else []), "-j", chunk,
                                              "--format=JobIDRaw,JobID,ConsumedEnergyRaw,AdminComment"])
            if rc != 0:
                self._raise(rc, text, err, f"sacct -j {chunk[:40]}")
            for line in text.splitlines():
                raw, _, rest = line.partition("|")
                shown, _, rest = rest.partition("|")
                energy, _, comment = rest.partition("|")  # AdminComment last: a '|' in it stays in it
                if raw.strip().isdigit():
                    out[int(raw)] = comment.strip()
                    self.energies[int(raw)] = int(energy.strip()) if energy.strip().isdigit() else 0
                    if re.fullmatch(r"\d+[_+]\d+", shown.strip()):
                        self.named_ids[int(raw)] = shown.strip()
        return out

    def job(self, job_id: int) -> Dict[str, Any]:
        job_id = int(job_id)
        rc, out, err = self.run("scontrol", ["-o", "show", "job", str(job_id)])
        if rc == 0 and out.strip():
            recs = [parse_kv(r) for r in split_records(out)]
            recs = [r for r in recs if r.get("JobId") == str(job_id)] or recs
            return final_job_facts(job_from_scontrol(recs[0], job_id))
        low = (err + out).lower()
        if rc != 0 and "invalid job id" not in low:
            self._raise(rc, out, err, f"scontrol show job {job_id}", job=job_id)
        return self._sacct_job(job_id)

    def _sacct_job(self, job_id: int) -> Dict[str, Any]:
        if self._sacct_json is not False:
            rc, out, err = self.run("sacct", ["--json", "-j", str(job_id)])
            if rc == 0:
                try:
                    facts = job_from_sacct_json(json.loads(out), job_id)
                    self._sacct_json = True
                    if facts is not None:
                        return final_job_facts(facts)
                    raise SlurmError(f"unknown job {job_id}: not in slurmctld nor in accounting (sacct)",
                                     "the job id may be mistyped, or accounting (slurmdbd) is not enabled")
                except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                    self._sacct_json = False  # schema we do not understand: use -P from now on
            elif "unrecognized option" in (err + out).lower() or "invalid option" in (err + out).lower():
                self._sacct_json = False
            else:
                self._raise(rc, out, err, f"sacct -j {job_id}", job=job_id)
        fields = ["JobID", "User", "Account", "Partition", "State", "NodeList", "AllocTRES", "Start", "End"]
        rc, out, err = self.run("sacct", ["-X", "-n", "-P", "-j", str(job_id), "--format=" + ",".join(fields)])
        if rc != 0:
            self._raise(rc, out, err, f"sacct -j {job_id}", job=job_id)
        for line in out.splitlines():
            vals = line.split("|")
            if len(vals) >= len(fields) and vals[0] == str(job_id):
                d = dict(zip(fields, vals))
                tres = d["AllocTRES"]
                return final_job_facts({"job_id": job_id, "user": d["User"], "account": d["Account"], "partition": d["Partition"],
                               "state": d["State"].split()[0] if d["State"] else "", "nodes": d["NodeList"],
                               "gres": gres_from_tres(tres), "tres": tres, "start_time": slurm_to_unix(d["Start"]),
                               "end_time": slurm_to_unix(d["End"]), "source": "slurmdbd"})
        raise SlurmError(f"unknown job {job_id}: not in slurmctld nor in accounting (sacct)",
                         "the job id may be mistyped, or accounting (slurmdbd) is not enabled")
