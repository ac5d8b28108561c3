"""`slurm-gpu job JOBID`: how a finished job used its GPUs, with advice (docs/job.md).

The job's accounting record comes from `sacct` as the caller (slurm/jobacct.py), its GPU summary
from the job's AdminComment (store/summary.py), written by the controller epilog when the job
ended.  An admin with records (a node database or the central server, `--db`) can build the
summary from them when the AdminComment has none.

Everything below `load` is pure: (JobRecord, Summary, cfg) -> notes, rows, text, JSON.
"""
from __future__ import annotations

import os
import sqlite3
import textwrap
import time
from collections import Counter
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple
from urllib.parse import quote

from slurm_gpu import render
from slurm_gpu.config import Config
from slurm_gpu.errors import ExitCode, SlurmGpuError, StoreError
from slurm_gpu.report.units import format_duration
from slurm_gpu.slurm.jobacct import JobRecord, job_record
from slurm_gpu.store import summary as sg
from slurm_gpu.timefmt import unix_to_local

Rows = List[Dict[str, Any]]
Fallback = Callable[[JobRecord], Tuple[Rows, str, str]]  # job -> (its job_gpus rows, source, where in words)

ANNOTATE_HINT = ("the controller epilog (slurm-gpu-epilog-ctld) writes it when the job ends; an admin can write it "
                 "later with `slurm-gpu central annotate`, or read the records: slurm-gpu job JOBID --db central")
VISIBLE_HINT = ("check the id with `sacct -X -j {job}` or `squeue --me`; where the site sets PrivateData=jobs, "
                "sacct shows only your own jobs (and those of accounts you coordinate)")


# --------------------------------------------------------------------------- outcomes

class JobViewError(SlurmGpuError):
    """Why there is no GPU view of a job; `plain`: an answer, printed without `error:`."""

    plain = False


class JobNotFound(JobViewError):
    exit_code = ExitCode.JOB_NOT_FOUND


class JobWithoutGpus(JobViewError):
    exit_code = ExitCode.JOB_WITHOUT_GPUS
    plain = True


class JobNotEnded(JobViewError):
    exit_code = ExitCode.JOB_NOT_ENDED
    plain = True


class NoSummary(JobViewError):
    exit_code = ExitCode.JOB_NO_SUMMARY
    plain = True


class DamagedSummary(NoSummary):
    plain = False


class ForeignComment(JobViewError):
    exit_code = ExitCode.JOB_FOREIGN_COMMENT


class Note(NamedTuple):
    code: str  # gpu_fault, partial, short, idle, low_util, small_memory, site
    text: str
    level: str  # fault, warn, info


class JobView(NamedTuple):
    record: JobRecord
    summary: sg.Summary
    source: str  # admin_comment, node_database, central
    notes: List[Note]


# --------------------------------------------------------------------------- finding the summary

def load(cfg: Config, backend: Any, job_id: str, fallback: Optional[Fallback] = None) -> JobView:
    """The job's view, or the JobViewError that says why there is none."""
    rec = job_record(backend, job_id)
    if rec is None:
        raise JobNotFound(f"job {job_id} not found, or not visible to you", VISIBLE_HINT.format(job=job_id))
    if not rec.pending and not rec.ended:
        running = running_summary(backend, rec)
        if running is not None:
            return JobView(rec, running, "live", live_notes(rec, running, cfg))
    s, source = resolve(rec, fallback)
    return JobView(rec, s, source, job_notes(rec, s, cfg))


def running_summary(backend: Any, rec: JobRecord) -> Optional[sg.Summary]:
    """A running job's figures so far, from its AdminComment as slurmctld shows it to the caller (`scontrol show
    job`: Slurm's privacy, as sacct's for a finished job); None when there are none (yet)."""
    from slurm_gpu.slurm.cli_text import parse_kv, split_records
    rc, out, _err = backend.run("scontrol", ["-o", "show", "job", str(rec.job_id_raw)])
    recs = [parse_kv(r) for r in split_records(out)] if rc == 0 else []
    fields = next((r for r in recs if r.get("JobId") == str(rec.job_id_raw)), {})
    comment = fields.get("AdminComment", "")
    found = sg.decode_safe(comment) if sg.is_ours(comment) else None
    if found is None or found.live is None or found.job_id != rec.job_id_raw:
        return None
    return found


def live_notes(rec: JobRecord, s: sg.Summary, cfg: Config) -> List[Note]:
    """A running job's notes: how fresh the figures are, GPUs idle right now, then the usual advice."""
    live = s.live or {}
    notes = [Note("live", f"The job is still running: figures so far, from samples up to {_when(live.get('t'))}. "
                          "Its summary is written when it ends.", "info")]
    idle = [(g, float(row[0])) for g, row in zip(s.gpus, live.get("g") or []) if float(row[0] or 0) >= LIVE_IDLE_S]
    if idle:
        names = ", ".join(f"{_gpu_name(g)} {format_duration(sec / 3600.0)}" for g, sec in idle[:6])
        notes.append(Note("idle_now", f"Idle right now (no work for at least {LIVE_IDLE_S // 60} minutes): {names}. "
                                      f"If the job no longer needs its GPUs, end it: scancel {rec.job_id}", "warn"))
    notes += [n for n in job_notes(rec, s._replace(partial=False), cfg) if n.code not in ("short",)]
    return notes


def check_state(rec: JobRecord) -> None:
    """JobNotEnded / JobWithoutGpus when the job has no GPU figures to show (yet)."""
    what = f"job {rec.job_id}"
    if rec.pending:
        raise JobNotEnded(f"{what} is still pending: its GPU summary is written when it ends",
                          f"see it in the queue: squeue -j {rec.job_id}")
    if rec.gpus == 0 and (rec.alloc_tres or rec.ended):
        if rec.start is None and not rec.nodes:
            raise JobWithoutGpus(f"{what} never ran ({rec.state} before it started): it has no GPU figures",
                                 f"its history: sacct -X -j {rec.job_id} --format=JobID,State,Submit,Start,End")
        raise JobWithoutGpus(f"{what} ran without GPUs (AllocTRES: {rec.alloc_tres or 'none'}): nothing to show",
                             "a GPU job asks for them, e.g. sbatch --gres=gpu:1")
    if not rec.ended:
        raise JobNotEnded(f"{what} is still {rec.base_state or 'running'}: its GPU summary is written when it ends",
                          "figures so far appear once the site's efficiency timer has sampled it (docs/efficiency.md); "
                          f"else run slurm-gpu job {rec.job_id} after it ends")


def resolve(rec: JobRecord, fallback: Optional[Fallback] = None) -> Tuple[sg.Summary, str]:
    """(summary, source): the AdminComment's summary, else the records `fallback` finds."""
    check_state(rec)
    comment = rec.admin_comment
    if sg.is_ours(comment):
        try:
            found = sg.decode(comment)
            if found.job_id != rec.job_id_raw:  # copied from another job by hand
                raise DamagedSummary(f"the AdminComment holds the GPU summary of job {found.job_id}, not of this one",
                                     "an admin can write it again: slurm-gpu central annotate --job JOBID")
            return found, "admin_comment"
        except SlurmGpuError as e:
            if fallback is None:
                raise DamagedSummary(f"job {rec.job_id}: {e.message}", e.hint) from None
    elif comment and fallback is None:
        raise ForeignComment(f"job {rec.job_id}: its AdminComment was written by another tool, not slurm-gpu "
                             f"({render.printable(comment[:16])}...)",
                             "ask the administrators: the site uses the field for something else")
    if fallback is None:
        raise NoSummary(f"job {rec.job_id} ended but has no GPU summary (yet)", ANNOTATE_HINT)
    rows, source, where = fallback(rec)
    if not rows:
        raise NoSummary(f"job {rec.job_id} ended but has no GPU summary, and {where} has no records of it",
                        ANNOTATE_HINT)
    restart = max(int(r.get("restart_count") or 0) for r in rows)
    rows = [r for r in rows if int(r.get("restart_count") or 0) == restart]
    cluster = str(rows[0].get("cluster") or "")
    return sg.from_records(cluster, rec.job_id_raw, restart, rec.nodes, rows), source


LIVE_IDLE_S = 300  # a running job's GPU idle this long gets the idle-now note

ROW_COLUMNS = ("cluster", "job_id", "restart_count", "node", "gpu_index", "gpu_model", "start_time", "end_time",
               "gpu_util_mean_pct", "mem_util_mean_pct", "max_memory_bytes", "memory_total_bytes", "energy_j",
               "ecc_uncorrected_delta", "xid_events", "parent_gpu_uuid", "sluid")
SLACK_S = 600  # a record's start may precede sacct's Start by the prolog's clock skew


def of_this_run(rec: JobRecord, rows: Rows, cluster: str = "") -> Rows:
    """The rows of this job's run: its cluster (when configured) and its time (a job id reused
    on another cluster, or after the ids wrapped, has records at other times).  A run asked for
    by its SLUID: the rows that carry it, never those of another SLUID (a requeue's other run)."""
    out = [r for r in rows if not cluster or r.get("cluster") == cluster]
    if rec.sluid:
        mine = [r for r in out if r.get("sluid") == rec.sluid]
        if mine:
            return mine
        out = [r for r in out if not r.get("sluid")]  # records of a node before it knew SLUIDs
    if rec.start is not None:
        hi = (rec.end if rec.end is not None else time.time()) + SLACK_S
        out = [r for r in out if r.get("start_time") is None or rec.start - SLACK_S <= float(r["start_time"]) <= hi]
    if len({r.get("cluster") for r in out}) > 1:  # same id and time on two clusters: the one with most records
        best = Counter(r.get("cluster") for r in out).most_common(1)[0][0]
        out = [r for r in out if r.get("cluster") == best]
    return out


def node_db_rows(path: str, job_id: int) -> Rows:
    """A node database's job_gpus rows of a job, read-only (columns a database lacks are None)."""
    if not os.path.isfile(path):
        raise StoreError(f"database {path} does not exist", "give a node database: --db /var/lib/slurm-gpu/usage.db")
    try:
        conn = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=5)
        try:
            have = {r[1] for r in conn.execute("PRAGMA table_info(job_gpus)")}
            if not have:
                raise StoreError(f"database {path} has no job_gpus table: not a slurm-gpu node database",
                                 "give a node database: --db /var/lib/slurm-gpu/usage.db")
            cols = [c for c in ROW_COLUMNS if c in have]
            names = ", ".join(f'"{c}"' for c in cols)
            cur = conn.execute(f"SELECT {names} FROM job_gpus WHERE job_id = ?", (job_id,))
            return [{**dict.fromkeys(ROW_COLUMNS), **dict(zip(cols, row))} for row in cur.fetchall()]
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise StoreError(f"database {path} cannot be read: {e}", "run as a user who may read it (root on the node)") from None


def central_rows(cfg: Config, url: Optional[str], password_file: Optional[str], job_id: int) -> Tuple[Rows, str]:
    from slurm_gpu.central.server import Central

    with Central.from_config(cfg, url, password_file) as central:
        cols = ", ".join(f'"{c}"' for c in ROW_COLUMNS)
        got = central.execute(f'SELECT {cols} FROM job_gpus_current WHERE "job_id" = %s', (job_id,))
        return [dict(zip(ROW_COLUMNS, row)) for row in got], central.target.describe()


def fallback_for(cfg: Config, db: Optional[str], password_file: Optional[str] = None) -> Optional[Fallback]:
    """`--db central`, `--db mysql://...` or `--db PATH` as a Fallback; None without --db."""
    if not db:
        return None
    from slurm_gpu.central.server import is_url

    cluster = cfg.cluster_name

    def from_central(rec: JobRecord) -> Tuple[Rows, str, str]:
        rows, where = central_rows(cfg, None if db == "central" else db, password_file, rec.job_id_raw)
        return of_this_run(rec, rows, cluster), "central", f"the central server {where}"

    def from_node(rec: JobRecord) -> Tuple[Rows, str, str]:
        return of_this_run(rec, node_db_rows(db, rec.job_id_raw), cluster), "node_database", f"node database {db}"

    return from_central if db == "central" or is_url(db) else from_node


# --------------------------------------------------------------------------- advice

def _gpu_name(g: sg.GpuUse) -> str:
    return f"{g.node} GPU {'?' if g.index is None else g.index}"


def _names(gpus: Sequence[sg.GpuUse], most: int = 6) -> str:
    names = [_gpu_name(g) for g in gpus[:most]]
    return ", ".join(names) + (f" and {len(gpus) - most} more" if len(gpus) > most else "")


def _fault(g: sg.GpuUse, critical: Set[int]) -> str:
    parts = []
    if (g.ecc_uncorrected or 0) > 0:
        parts.append(f"{g.ecc_uncorrected} uncorrectable ECC error{'s' if g.ecc_uncorrected != 1 else ''}")
    bad = [x for x in g.xids if x in critical]
    if bad:
        parts.append("XID " + ", ".join(str(x) for x in bad))
    return ", ".join(parts)


def job_notes(rec: JobRecord, s: sg.Summary, cfg: Config) -> List[Note]:
    """Advice from the thresholds of the config's [job] section."""
    j = cfg.get
    idle_pct, low_pct = j("job", "idle_pct"), j("job", "low_util_pct")
    frac, min_run, site = j("job", "small_memory_fraction"), j("job", "min_runtime_s"), j("job", "site_note")
    critical = set(j("xid", "critical"))
    notes: List[Note] = []

    faults = [(g, _fault(g, critical)) for g in s.gpus]
    faults = [(g, why) for g, why in faults if why]
    if faults:
        where = "; ".join(f"{_gpu_name(g)}: {why}" for g, why in faults[:6])
        if rec.base_state == "COMPLETED":
            after = "The job completed; if its results look wrong, run it again."
        else:
            after = "It probably ended the job: that was not your fault. Resubmit the job."
        notes.append(Note("gpu_fault", f"A GPU fault happened during the job ({where}). {after} "
                                       "The node is checked before it runs another job.", "fault"))
    if s.detail != "gpu":
        notes.append(Note("detail", _detail_text(rec, s), "info"))
    if s.partial or s.missing:
        missing = ", ".join(s.missing) or "some nodes"
        notes.append(Note("partial", f"No GPU records arrived from {missing}: the figures cover the other nodes only.",
                          "warn"))
    if rec.elapsed_s < min_run:
        notes.append(Note("short", f"The job ran {format_duration(rec.elapsed_s / 3600.0)}, less than "
                                   f"{format_duration(min_run / 3600.0)}: too short to judge its GPU use.", "info"))
    else:
        notes.extend(_use_notes(rec, s, idle_pct, low_pct, frac))
    if site:
        notes.append(Note("site", site, "info"))
    return notes


def _detail_text(rec: JobRecord, s: sg.Summary) -> str:
    """Why the table has no row per GPU: the job's summary did not fit its AdminComment."""
    what = "one row per node (totals, means and peaks of its GPUs)" if s.detail == "node" else "no GPU figures"
    return (f"The job has more GPUs than its AdminComment holds: the summary keeps {what}. Per-GPU figures are on "
            f"the central server (admins: slurm-gpu job {rec.job_id} --db central).")


def _use_notes(rec: JobRecord, s: sg.Summary, idle_pct: float, low_pct: float, frac: float) -> List[Note]:
    notes: List[Note] = []
    idle = [g for g in s.gpus if g.util_pct is not None and g.util_pct < idle_pct]
    used = [g for g in s.gpus if g not in idle]  # not measured (some MIG slices) counts as used
    if idle and not used:
        what = f"None of the job's {len(s.gpus)} GPUs was used" if len(s.gpus) != 1 else "The job's GPU was not used"
        notes.append(Note("idle", f"{what} (mean utilisation below {idle_pct:g} %). If the program should use a GPU, check "
                                  "that it was built with GPU support and sees the GPUs (CUDA_VISIBLE_DEVICES); "
                                  "a job that runs on CPUs only should not request GPUs.", "warn"))
    elif idle:
        per_node = max(Counter(g.node for g in used).values())
        were = "was" if len(idle) == 1 else "were"
        notes.append(Note("idle", f"{len(idle)} of the job's {len(s.gpus)} GPUs {were} idle the whole job (mean "
                                  f"utilisation below {idle_pct:g} %: {_names(idle)}). Request only the GPUs the "
                                  f"program uses: --gres=gpu:{per_node}"
                                  + (" (per node)" if len({g.node for g in s.gpus}) > 1 else "") + ".", "warn"))
    busy = [g.util_pct for g in used if g.util_pct is not None]
    if busy:
        mean = sum(busy) / len(busy)
        if mean < low_pct:
            notes.append(Note("low_util", f"Mean utilisation of the GPUs in use was {mean:.1f} %, below {low_pct:g} %: "
                                          "they waited most of the time. Common causes: too few data-loading workers, "
                                          "small batches, CPU work between GPU calls; a profiler such as Nsight "
                                          "Systems shows where the time goes.", "warn"))
    sized = [(g.peak_mib, g.total_mib) for g in used if not g.mig and g.peak_mib is not None and g.total_mib]
    if sized and frac > 0:
        peak, total = max(sized, key=lambda pt: pt[0] / pt[1])
        if peak < frac * total:
            notes.append(Note("small_memory", f"Peak GPU memory was {_gib(peak)} of {_gib(total)} GiB "
                                              f"({100.0 * peak / total:.0f} %): a GPU with less memory "
                                              "or a MIG slice would do, and such jobs often start sooner.", "info"))
    return notes


# --------------------------------------------------------------------------- figures

def _gib(mib: Optional[int]) -> str:
    return "n/a" if mib is None else f"{mib / 1024.0:.1f}"


def memory_text(g: sg.GpuUse) -> str:
    if g.peak_mib is None:
        return "n/a" if not g.total_mib else f"n/a / {_gib(g.total_mib)} GiB"
    return f"{_gib(g.peak_mib)} / {_gib(g.total_mib)} GiB" if g.total_mib else f"{_gib(g.peak_mib)} GiB"


def energy_text(wh: Optional[float]) -> str:
    if wh is None:
        return "n/a"
    return f"{wh / 1000.0:.2f} kWh" if wh >= 1000.0 else f"{wh:.1f} Wh"


def events_text(g: sg.GpuUse) -> str:
    parts = []
    if g.ecc_uncorrected:
        parts.append(f"ECC {g.ecc_uncorrected}")
    if g.xids:
        parts.append("XID " + ",".join(str(x) for x in g.xids))
    return " ".join(parts) or "-"


def pct_text(pct: Optional[float]) -> str:
    return "n/a" if pct is None else f"{pct:.1f} %"


def bar(pct: Optional[float], width: int = 20) -> str:
    """'[#######.............]  34.5 %' (the bar of `width` cells, then the number)."""
    if width <= 0:
        return pct_text(pct)
    if pct is None:
        return "[" + " " * width + "]" + "     n/a"
    filled = min(width, max(0, int(round(pct / 100.0 * width))))
    return "[" + "#" * filled + "." * (width - filled) + "]" + f"{pct:6.1f} %".rjust(8)


def total_energy_wh(s: sg.Summary) -> Optional[float]:
    vals = [g.energy_wh for g in s.gpus if g.energy_wh is not None]
    return round(sum(vals), 2) if vals else None


def _when(t: Optional[float]) -> str:
    return "-" if t is None else unix_to_local(t)


def header_lines(view: JobView) -> List[Tuple[str, str]]:
    rec, s = view.record, view.summary
    p = render.printable
    job = rec.job_id if rec.job_id == str(rec.job_id_raw) else f"{rec.job_id} (raw id {rec.job_id_raw})"
    limit = "UNLIMITED" if rec.time_limit_s is None else format_duration(rec.time_limit_s / 3600.0)
    run = format_duration(rec.elapsed_s / 3600.0)
    if rec.time_limit_s:
        run += f" ({100.0 * rec.elapsed_s / rec.time_limit_s:.0f} % of the time limit)"
    nodes = f"{rec.node_count}" + (f" ({p(rec.nodelist)})" if rec.nodelist else "")
    lines = [("Job ID", p(job)), ("User", p(rec.user)), ("Account", p(rec.account)), ("Partition", p(rec.partition)),
             ("State", p(rec.state)), ("Nodes", nodes),
             ("GPUs", f"{rec.gpus}" + (f" ({one_model(s)})" if one_model(s) else "")), ("Start", _when(rec.start)),
             ("Run time", run), ("Time limit", limit), ("Exit code", p(rec.exit_code)),
             ("GPU energy", energy_text(total_energy_wh(s)))]
    if view.source == "live":
        lines.append(("Source", "figures so far, sampled while the job runs"))
    elif view.source != "admin_comment":
        lines.append(("Source", f"{view.source.replace('_', ' ')} records (no summary in AdminComment)"))
    return lines


def _model(g: sg.GpuUse) -> str:
    m = render.printable(g.model or "-")
    return (m[len("NVIDIA "):] if m.startswith("NVIDIA ") else m) + (" (MIG)" if g.mig else "")


def one_model(s: sg.Summary) -> Optional[str]:
    """The model of every GPU of the job (shown once, in the header), or None when they differ."""
    models = {_model(g) for g in s.gpus}
    return models.pop() if len(models) == 1 and models != {"-"} else None


def _unknown_models(s: sg.Summary) -> bool:
    """No GPU's model is known (a running job's samples do not carry it): no model column."""
    return all(_model(g) == "-" for g in s.gpus)


def _gpu_rows(s: sg.Summary, util_bw: int, mem_bw: int) -> List[Dict[str, Any]]:
    live = (s.live or {}).get("g") or [None] * len(s.gpus)
    return [{"node": render.printable(g.node),
             "gpu": f"{g.count} GPUs" if g.count > 1 else "-" if g.index is None else g.index, "model": _model(g),
             "util": bar(g.util_pct, util_bw), "mem": bar(g.mem_util_pct, mem_bw), "peak": memory_text(g),
             "energy": energy_text(g.energy_wh), "events": events_text(g),
             "idle": "-" if row is None else format_duration(float(row[0] or 0) / 3600.0) if row[0] else "busy",
             "hour": "" if row is None else sparkline(row[1])} for g, row in zip(s.gpus, live)]


GPU_COLUMNS = ("node", "gpu", "model", "util", "mem", "peak", "energy", "events")
GPU_HEADERS = ("NODE", "GPU", "MODEL", "GPU UTIL", "MEM UTIL", "PEAK MEMORY", "ENERGY", "EVENTS")
# A running job's table: no memory utilisation (not sampled) nor events (known at the end), but the idle time and
# the last hour, a character per two minutes.
LIVE_COLUMNS = ("node", "gpu", "model", "util", "peak", "energy", "idle", "hour")
LIVE_HEADERS = ("NODE", "GPU", "MODEL", "GPU UTIL", "PEAK MEMORY", "ENERGY SO FAR", "IDLE FOR", "LAST HOUR")
_BLOCKS = "▁▂▃▄▅▆▇█"  # 0 % to 100 %


def sparkline(points: Sequence[Optional[float]], per_char: int = 2) -> str:
    """Utilisation points (0-100, None unseen) as block characters, `per_char` points to a character (their
    mean); a character with no point seen is '·'."""
    out = []
    for i in range(0, len(points), per_char):
        seen = [p for p in points[i:i + per_char] if p is not None]
        level = max(0.0, min(100.0, sum(seen) / len(seen))) if seen else None
        out.append("·" if level is None else _BLOCKS[int(round(level * (len(_BLOCKS) - 1) / 100.0))])
    return "".join(out)
# Bar widths (GPU utilisation, memory utilisation) from the richest layout to the poorest:
# both bars shrink to 10 cells, then the memory bar goes, then the utilisation bar shrinks and goes.
LAYOUTS = [(w, w) for w in range(20, 9, -1)] + [(w, 0) for w in range(20, 4, -1)] + [(0, 0)]


def gpu_table(s: sg.Summary, width: int) -> Tuple[str, int]:
    """The per-GPU table in the richest layout that fits `width`; (text, utilisation bar width).
    The model column is left out when every GPU is the same model (the header names it)."""
    all_cols, all_heads = (LIVE_COLUMNS, LIVE_HEADERS) if s.live is not None else (GPU_COLUMNS, GPU_HEADERS)
    cols = [c for c in all_cols if c != "model" or (one_model(s) is None and not _unknown_models(s))]
    heads = [h for c, h in zip(all_cols, all_heads) if c in cols]
    for util_bw, mem_bw in LAYOUTS:
        text = render.table(_gpu_rows(s, util_bw, mem_bw), cols, heads)
        if max(len(line) for line in text.splitlines()) <= width:
            break
    return text, util_bw


_SGR = {"fault": "\x1b[1;31m", "warn": "\x1b[33m", "good": "\x1b[32m"}


def _style(text: str, level: str, color: bool) -> str:
    """`text` in the colour of its level (ANSI SGR), when colour is on."""
    start = _SGR.get(level) if color else None
    return f"{start}{text}\x1b[0m" if start else text


def _util_level(pct: Optional[float], cfg: Config) -> str:
    if pct is None:
        return "info"
    if pct < cfg.job.idle_pct:
        return "fault"
    return "warn" if pct < cfg.job.low_util_pct else "good"


def render_text(view: JobView, cfg: Config, width: int = 100, color: bool = False) -> str:
    """The table format: header, one line per GPU, notes (wrapped to `width`)."""
    width = max(40, width)
    out = [f"{k + ':':<12}{v}" for k, v in header_lines(view)]
    out += ["", "GPUs (so far: means since the job started):" if view.summary.live is not None
            else "GPUs (means over the job):"]
    table, bw = gpu_table(view.summary, width)
    lines = table.splitlines()
    out += lines[:2]
    for line, g in zip(lines[2:], view.summary.gpus):
        cell = bar(g.util_pct, bw)
        out.append(line.replace(cell, _style(cell, _util_level(g.util_pct, cfg), color), 1))
    if not view.summary.gpus:
        out.append("(no GPU records)")
    out += ["", "Notes:"]
    for n in view.notes or [Note("ok", "Nothing to improve that these figures show.", "info")]:
        text = textwrap.fill(render.printable(n.text), width=width, initial_indent="  * ", subsequent_indent="    ")
        out.append(_style(text, n.level, color))
    return "\n".join(out) + "\n"


def to_json(view: JobView) -> Dict[str, Any]:
    """The same data for scripts: times in unix seconds, memory in MiB, energy in Wh."""
    rec, s = view.record, view.summary
    return {
        "job": {"job_id": rec.job_id, "job_id_raw": rec.job_id_raw, "user": rec.user, "account": rec.account,
                "partition": rec.partition, "state": rec.state, "exit_code": rec.exit_code,
                "node_count": rec.node_count, "nodes": rec.nodes, "gpus": rec.gpus, "start": rec.start,
                "end": rec.end, "run_time_s": rec.elapsed_s, "time_limit_s": rec.time_limit_s},
        "summary": {"source": view.source, "cluster": s.cluster, "restart": s.restart, "partial": s.partial,
                    "nodes_missing": s.missing, "energy_wh": total_energy_wh(s)},
        "gpus": [g._asdict() for g in s.gpus],
        "notes": [{"code": n.code, "text": n.text} for n in view.notes],
        **({"live": {"as_of": s.live["t"], "gpus": [{"idle_s": row[0], "last_hour_util_pct": row[1]}
                                                     for row in s.live.get("g") or []]}} if s.live is not None else {}),
    }
