"""What the Slurm command-line tools print, parsed (the tools are run by slurm/cli_backend.py).

* ``scontrol -o show node|job|reservation``: one ``Key=value`` record a line; a value may hold
  spaces, a node's ``Reason`` anything up to Slurm's own `` [user@time]`` suffix, and a reason
  holding a newline continues on the next line (split_records glues it back).
* A job's facts from ``scontrol -o show job`` while slurmctld knows it, and from
  ``sacct --json`` (22.05's plain numbers, 23.02+'s ``{"set", "number"}`` objects) after.

Pure functions of text: no process is run here.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

from slurm_gpu.slurm.model import NodeInfo, gpu_count, split_state, tres_gpu_count
from slurm_gpu.timefmt import SLURM_ISO, slurm_to_unix

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
_REASON_TAIL = re.compile(r" \[([^\[\]@\s]*)@(" + SLURM_ISO + r")\](?=$|\s+[A-Z][A-Za-z_]*=)")


def parse_kv(text: str) -> Dict[str, str]:
    """'A=1 B=two words C=3' -> {'A': '1', 'B': 'two words', 'C': '3'} (values may hold spaces)."""
    out: Dict[str, str] = {}
    matches = list(_KEY.finditer(text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(m.group(1), text[m.end():end].strip())
    return out


def parse_show_line(line: str) -> Dict[str, str]:
    """One ``scontrol -o show node`` line -> dict.  ``Reason`` may contain anything (spaces,
    '=', brackets); it ends at Slurm's own `` [user@time]`` suffix, split into ReasonUser and
    ReasonTime."""
    line = line.rstrip("\n")
    m = re.search(r"(?:^|\s)Reason=", line)
    if not m:
        return parse_kv(line)
    out = parse_kv(line[: m.start()])
    tail = line[m.end():]
    ends = list(_REASON_TAIL.finditer(tail))
    if ends:
        end = ends[-1]
        out["Reason"] = tail[: end.start()]
        out["ReasonUser"] = end.group(1)
        out["ReasonTime"] = end.group(2)
        for k, v in parse_kv(tail[end.end():]).items():
            out.setdefault(k, v)
    else:
        out["Reason"] = tail.strip()
    return out


def node_from_fields(f: Dict[str, str]) -> NodeInfo:
    state = f.get("State", "")
    gres = f.get("Gres", "")
    gres_used = f.get("GresUsed", "")
    used = gpu_count(gres_used) if gres_used else None
    if not used:
        used = tres_gpu_count(f.get("AllocTRES")) or 0
    reason = f.get("Reason", "")
    if reason in ("(null)", "None"):
        reason = ""
    return NodeInfo(
        name=f.get("NodeName", ""),
        state=state,
        states=split_state(state),
        reason=reason,
        reason_user=f.get("ReasonUser", ""),
        reason_time=slurm_to_unix(f.get("ReasonTime")),
        gres="" if gres == "(null)" else gres,
        gres_used="" if gres_used in ("(null)", "N/A") else gres_used,
        gpus_configured=gpu_count(gres) or (tres_gpu_count(f.get("CfgTRES")) or 0),
        gpus_allocated=used,
        partitions=tuple(p for p in f.get("Partitions", "").split(",") if p and p != "(null)"),
    )


def split_records(out: str) -> List[str]:
    """Lines of ``scontrol -o`` output; a line not starting a record (a reason holding a newline
    set by some other tool) is glued back onto the one before."""
    recs: List[str] = []
    for line in out.splitlines():
        if not line.strip():
            continue
        if recs and not re.match(r"^(NodeName|JobId)=", line):
            recs[-1] += " " + line.strip()
        else:
            recs.append(line)
    return recs


def gres_from_tres(tres: str) -> str:
    n = tres_gpu_count(tres)
    return f"gpu:{n}" if n else ""


def blank_null(v: Optional[str]) -> str:
    return "" if v in (None, "(null)", "N/A", "None") else str(v)


def job_from_scontrol(f: Dict[str, str], job_id: int) -> Dict[str, Any]:
    user = re.sub(r"\(\d+\)$", "", f.get("UserId", ""))
    gres = blank_null(f.get("TresPerNode")) or blank_null(f.get("Gres"))
    # 22.05 spells it gres:gpu:1, 25.11 gres/gpu:1 (observed): 'gpu:1' either way
    gres = ",".join(re.sub(r"^gres[:/]", "", item) for item in gres.split(",")) if gres else ""
    return {"job_id": job_id, "user": user, "account": blank_null(f.get("Account")), "partition": blank_null(f.get("Partition")),
            "state": f.get("JobState", ""), "nodes": blank_null(f.get("NodeList")), "gres": gres,
            "tres": blank_null(f.get("AllocTRES")) or blank_null(f.get("TRES")), "start_time": slurm_to_unix(f.get("StartTime")),
            "end_time": slurm_to_unix(f.get("EndTime")), "source": "slurmctld"}


def _num(v: Any) -> Optional[float]:
    """sacct --json numbers: 22.05 plain ints, 23.02+ {"set": bool, "number": int}."""
    if isinstance(v, dict):
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def job_from_sacct_json(data: Dict[str, Any], job_id: int) -> Optional[Dict[str, Any]]:
    for j in data["jobs"]:
        if int(_num(j.get("job_id")) or -1) != job_id:
            continue
        state = j.get("state", {})
        cur = state.get("current") if isinstance(state, dict) else state
        if isinstance(cur, list):
            cur = "+".join(str(c) for c in cur)
        t = j.get("time", {})
        alloc = (j.get("tres") or {}).get("allocated") or []
        parts = []
        for item in alloc:
            typ, name, cnt = item.get("type", ""), item.get("name") or "", _num(item.get("count"))
            if cnt is None:
                continue
            parts.append(f"{typ}/{name}={int(cnt)}" if name else f"{typ}={int(cnt)}")
        tres = ",".join(parts)
        user = j.get("user")
        if not isinstance(user, str):
            user = (j.get("association") or {}).get("user", "")
        return {"job_id": job_id, "user": user or "", "account": j.get("account") or "",
                "partition": j.get("partition") or "", "state": str(cur or ""), "nodes": j.get("nodes") or "",
                "gres": gres_from_tres(tres), "tres": tres, "start_time": _num(t.get("start")),
                "end_time": _num(t.get("end")), "source": "slurmdbd"}
    return None
