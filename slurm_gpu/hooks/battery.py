"""The verification battery: what the verification job runs on a node before it is resumed
(`slurm-gpu battery`, docs/remediation.md "Verification job").

In this order, each an argument list (never a shell) under one deadline (verify.timeout_s):

1. ``dcgmi diag -r LEVEL -j`` when dcgmi is found (see parse_dcgm for the two JSON layouts);
2. nccl-tests' ``all_reduce_perf`` (verify.nccl_command) when found and the node has two GPUs or more
   (see parse_nccl); the out-of-place bus bandwidth of the largest message size against the floor for
   the node's GPU model (verify.nccl_min_busbw_gbps), and every ``#wrong`` value;
3. every site command of verify.commands (exit 0 passes).

The result is one JSON object: ``{"ok", "empty", "tests": [{"tool", "name", "gpu_index", "result",
"detail", "tool_error"}], "duration_s", "gpus", "hint"}``; ``result`` is pass | warn | fail | skip.
A warn passes with its note.  ``tool_error`` marks a failure that says nothing about the GPUs (a tool that
could not run, printed nothing we can read, or overran the deadline): the node still fails verification, but
no GPU is blamed (NVSentinel #1363: tool errors read as hardware faults cordoned healthy nodes).  A battery
with nothing to run fails closed (``empty``), with a hint.

Standard library only: it runs inside the job, and verifyjob.py (on remediate's path) reads its result.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.config import Config

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
DCGM, NCCL, COMMAND = "dcgm", "nccl", "command"
EMPTY_HINT = "install DCGM or nccl-tests, or set verify.commands"
DETAIL_MAX = 400  # characters of one test's detail (a tool's message, not its whole output)


class Test(NamedTuple):
    """One verdict of the battery: a test on one GPU (gpu_index), or node-wide (None)."""

    tool: str  # dcgm | nccl | command
    name: str
    gpu_index: Optional[int]
    result: str  # pass | warn | fail | skip
    detail: str
    tool_error: bool = False  # a failure of the tool, not a verdict on the GPUs

    def to_json(self) -> Dict[str, Any]:
        return {"tool": self.tool, "name": self.name, "gpu_index": self.gpu_index, "result": self.result,
                "detail": self.detail, "tool_error": self.tool_error}


class Settings(NamedTuple):
    """The [verify] keys the battery uses."""

    dcgmi: str = "dcgmi"
    dcgm_level: int = 2
    nccl_command: Tuple[str, ...] = ("all_reduce_perf", "-b", "8M", "-e", "256M", "-f", "2", "-g", "{gpus}")
    nccl_min_busbw_gbps: Tuple[Tuple[str, float], ...] = ()
    commands: Tuple[Tuple[str, ...], ...] = ()
    timeout_s: float = 1800.0

    @classmethod
    def from_config(cls, cfg: Config) -> "Settings":
        def get(key: str) -> Any:
            return cfg.get("verify", key)
        return cls(str(get("dcgmi")), int(get("dcgm_level")), tuple(get("nccl_command")),
                   tuple((str(k), float(v)) for k, v in dict(get("nccl_min_busbw_gbps")).items()),
                   tuple(tuple(c) for c in get("commands")), float(get("timeout_s")))


class Ran(NamedTuple):
    returncode: Optional[int]  # None: killed at the deadline
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], Ran]


def run_argv(argv: Sequence[str], timeout_s: float) -> Ran:
    """Run argv (no shell) in a session of its own; at the deadline the whole session is killed (dcgmi
    starts nvvs, all_reduce_perf may start helpers), and what it printed so far is kept."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout_s))
        return Ran(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        return Ran(None, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def find_program(name: str) -> Optional[str]:
    """An absolute or relative path that is executable, else the name looked up in PATH; None: not found."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return shutil.which(name)


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_MAX else text[:DETAIL_MAX - 3] + "..."


def _last_line(*texts: str) -> str:
    for text in texts:
        lines = [line for line in (text or "").splitlines() if line.strip()]
        if lines:
            return _short(lines[-1])
    return "no output"


# ------------------------------------------------------------------------------------------ DCGM

_STATUS = {"pass": PASS, "warn": WARN, "warning": WARN, "fail": FAIL, "skip": SKIP}


def _first_json_object(text: str) -> Dict[str, Any]:
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in the output")
    value, _ = json.JSONDecoder().raw_decode(text[start:])
    if not isinstance(value, dict):
        raise ValueError("the output is not a JSON object")
    return value


def _status(value: Any) -> Optional[str]:
    """DCGM's status text as ours; None for a test that did not run ("Not Run", "")."""
    return _STATUS.get(str(value or "").strip().lower())


def _int(value: Any) -> Optional[int]:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def _where(entry: Dict[str, Any]) -> Tuple[Optional[int], str]:
    """(GPU index, other entity) of one result: 4.x names an entity (entity_group "GPU" and entity_id),
    3.x a ``gpu_id`` (a string per GPU; in the Deployment category an integer, -1 for the system)."""
    group = entry.get("entity_group")
    if group is not None or "entity_group_id" in entry:
        if str(group) == "GPU" or entry.get("entity_group_id") == 1:
            return _int(entry.get("entity_id")), ""
        return None, f"{group} {entry.get('entity_id', '')}".strip()
    for key in ("gpu_id", "gpu_ids"):
        if key in entry:
            return _int(entry[key]), ""
    return None, ""


def _messages(entry: Dict[str, Any]) -> str:
    """The warnings (with DCGM's error id) of one result, else its info lines."""
    texts = []
    for w in entry.get("warnings") or []:
        if not isinstance(w, dict):  # jsoncpp fills index gaps with null (3.x)
            continue
        msg = w.get("warning") if isinstance(w.get("warning"), str) else w.get("warnings")  # 3.x Deployment: "warnings"
        if msg:
            texts.append(f"{str(msg).strip()} (DCGM error {w['error_id']})" if "error_id" in w else str(msg).strip())
    if texts:
        return _short("; ".join(texts))
    info = entry.get("info")
    if isinstance(info, list):
        info = "; ".join(str(i) for i in info if i)
    return _short(info or "")


def parse_dcgm(text: str) -> List[Test]:
    """The tests of ``dcgmi diag -j`` output, one per test and entity.

    Two layouts, both read from DCGM's source (dcgmi/Diag.cpp, nvvs/include/NvvsJsonStrings.h) and its JSON
    schemas (testing/python3/dcgm_diag_schema.json) at the tags named:

    * DCGM 3.x (v3.3.9): ``{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Deployment" |
      "Integration" | "Hardware" | "Stress", "tests": [{"name": "GPU Memory", "results": [{"gpu_id": "0",
      "status": "Pass" | "Fail" | "Skip", "warnings": [{"warning", "error_id", "error_category",
      "error_severity"}], "info": "..."}]}]}]}, "version", "Driver Version Detected", "GPU Device IDs", ...}``;
      a Deployment test has one result whose ``gpu_id`` (an integer) is set only with an error.
    * DCGM 4.x (v4.0.0 to v4.6.0): ``{"DCGM Diagnostic": {"test_categories": [{"category", "tests":
      [{"name": "memory", "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0,
      "status", "warnings": [...], "info": ["..."]}], "test_summary": {"status", "warnings"}}]}]},
      "entity_groups": [...], "metadata": {"version", "Driver Version Detected"}}``.

    A failed run of dcgmi itself is ``{"DCGM Diagnostic" | "DCGM GPU Diagnostic": {"version",
    "runtime_error": "..."}}``: a tool error.  Both versions print a warning as "Fail" in JSON (4.x:
    HelperDisplayDiagResult without DDR_DISPLAY_WARN); a "Warn" status is read as a warning all the same.
    Raises ValueError for output that is neither."""
    data = _first_json_object(text)
    if "iterations" in data and isinstance(data["iterations"], list) and data["iterations"]:
        data = data["iterations"][-1] or {}  # --iterations N: the last run
    root = data.get("DCGM Diagnostic", data.get("DCGM GPU Diagnostic"))
    if not isinstance(root, dict):
        raise ValueError("no 'DCGM Diagnostic' (4.x) or 'DCGM GPU Diagnostic' (3.x) object")
    if root.get("runtime_error"):
        return [Test(DCGM, "dcgmi diag", None, FAIL, _short(f"dcgmi: {root['runtime_error']}"), tool_error=True)]
    tests: List[Test] = []
    for category in root.get("test_categories") or []:
        if not isinstance(category, dict):
            continue
        for test in category.get("tests") or []:
            if not isinstance(test, dict):
                continue
            tests += _dcgm_test(test)
    return tests


def _dcgm_test(test: Dict[str, Any]) -> List[Test]:
    name = str(test.get("name") or "?")
    out: List[Test] = []
    for entry in test.get("results") or []:
        if not isinstance(entry, dict):
            continue
        status = _status(entry.get("status"))
        if status is None:
            continue
        gpu, other = _where(entry)
        out.append(Test(DCGM, f"{name} ({other})" if other else name, gpu, status, _messages(entry)))
    summary = test.get("test_summary")
    if isinstance(summary, dict):
        status = _status(summary.get("status"))
        # A test that failed with no entity to blame (an error of the system, or of no GPU named).
        if status == FAIL and not any(t.result == FAIL for t in out):
            out.append(Test(DCGM, name, None, FAIL, _messages(summary) or "failed (test summary)"))
        elif status is not None and not out:
            out.append(Test(DCGM, name, None, status, _messages(summary)))
    return out


def run_dcgm(settings: Settings, remaining: Callable[[], float], run: Runner) -> List[Test]:
    exe = find_program(settings.dcgmi)
    if exe is None:
        return [Test(DCGM, "dcgmi diag", None, SKIP, f"{settings.dcgmi} not found: DCGM diagnostic skipped")]
    argv = [exe, "diag", "-r", str(settings.dcgm_level), "-j"]
    ran = run(argv, remaining())
    if ran.returncode is None:
        return [Test(DCGM, f"dcgmi diag -r {settings.dcgm_level}", None, FAIL,
                     f"did not finish within the battery's deadline ({settings.timeout_s:g} s)", tool_error=True)]
    try:
        tests = parse_dcgm(ran.stdout)
    except ValueError as e:
        return [Test(DCGM, f"dcgmi diag -r {settings.dcgm_level}", None, FAIL,
                     _short(f"output not understood ({e}; exit {ran.returncode}): {_last_line(ran.stderr, ran.stdout)}"),
                     tool_error=True)]
    if not tests:
        return [Test(DCGM, f"dcgmi diag -r {settings.dcgm_level}", None, FAIL,
                     f"reported no test (exit {ran.returncode})", tool_error=True)]
    if ran.returncode != 0 and not any(t.result == FAIL for t in tests):
        # dcgmi exits with DCGM_ST_NVVS_ERROR (-30) / _ISOLATE_ERROR (-51) when a test failed: with none
        # failed in its JSON, the exit says something went wrong that the JSON does not show.
        tests.append(Test(DCGM, "dcgmi diag", None, FAIL, _short(f"exit {ran.returncode} though no test failed: "
                                                                 f"{_last_line(ran.stderr)}"), tool_error=True))
    return tests


# ------------------------------------------------------------------------------------------ nccl-tests

class NcclRow(NamedTuple):
    size_bytes: int
    busbw_gbps: Optional[float]  # out-of-place
    wrong: int  # out-of-place + in-place #wrong ("N/A": 0)


class NcclRun(NamedTuple):
    rows: List[NcclRow]
    out_of_bounds: Optional[int]  # the trailer's "Out of bounds values", None when missing
    avg_busbw_gbps: Optional[float]
    models: List[str]  # the GPU model of each device line (# Using devices), in rank order


_DEVICE = re.compile(r"^#\s+Rank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+\S+\s+device\s+\d+\s+\[[^\]]*\]\s+(.+?)\s*$")
_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")


def _float(s: str) -> Optional[float]:
    try:
        return float(s)
    except ValueError:
        return None


def parse_nccl(text: str) -> NcclRun:
    """all_reduce_perf's stdout, as nccl-tests prints it (src/util.cu writeDeviceReport, writeResultHeader,
    writeBenchmarkLine*, writeResultFooter in v2.19; src/common.cu in v2.13: the same columns):

        #  Rank  0 Group  0 Pid   4242 on      gpu01 device  0 [0000:18:00] NVIDIA H100 80GB HBM3
        #       size         count      type   redop    root     time   algbw   busbw  #wrong     time ...
        #        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us) ...
           268435456      67108864     float     sum      -1   1234.5  217.45  380.54       0   1230.1 ...
        # Out of bounds values : 0 OK
        # Avg bus bandwidth    : 290.12

    A row is size count type redop root, then time algbw busbw #wrong out-of-place, then the same in-place
    (with -I 1 each half adds i_min i_max i_p99 i_cv%): the columns are taken from the header line, the
    v2.19 default layout when there is none.  #wrong is "N/A" without data checks (-c 0)."""
    rows: List[NcclRow] = []
    names: List[str] = []
    oob: Optional[int] = None
    avg: Optional[float] = None
    models: List[str] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            m = _DEVICE.match(s)
            if m:
                models.append(m.group(1))
                continue
            words = s.lstrip("#").split()
            if words[:2] == ["size", "count"] and "busbw" in words:
                names = words
                continue
            m = _OOB.match(s)
            if m:
                oob = int(m.group(1))
                continue
            m = _AVG.match(s)
            if m:
                avg = _float(m.group(1))
            continue
        vals = s.split()
        if len(vals) < 13 or not (vals[0].isdigit() and vals[1].isdigit()):
            continue
        rows.append(_row(vals, names))
    return NcclRun(rows, oob, avg, models)


def _row(vals: List[str], names: List[str]) -> NcclRow:
    busbw_at = [i for i, n in enumerate(names) if n == "busbw"] or [7, 11]
    wrong_at = [i for i, n in enumerate(names) if n == "#wrong"] or [8, 12]
    busbw = _float(vals[busbw_at[0]]) if busbw_at[0] < len(vals) else None
    wrong = 0
    for i in wrong_at[:2]:
        if i < len(vals):
            n = _float(vals[i])
            wrong += int(n) if n is not None else 0
    return NcclRow(int(vals[0]), busbw, wrong)


def judge_nccl(nccl: NcclRun, returncode: int, floors: Dict[str, float], stderr: str = "") -> List[Test]:
    """Every #wrong and the out-of-bounds count must be 0; the largest size's out-of-place busbw must reach
    the floor of the node's GPU model (the lowest floor when the devices differ; no floor: not judged)."""
    name = "all_reduce_perf"
    if not nccl.rows:
        return [Test(NCCL, name, None, FAIL, _short(f"printed no result rows (exit {returncode}): "
                                                    f"{_last_line(stderr)}"), tool_error=True)]
    tests: List[Test] = []
    wrong = [r for r in nccl.rows if r.wrong]
    if wrong:
        tests.append(Test(NCCL, name, None, FAIL, f"{sum(r.wrong for r in wrong)} wrong values "
                                                   f"(first at {wrong[0].size_bytes} B): data corrupted in the all-reduce"))
    elif nccl.out_of_bounds:
        tests.append(Test(NCCL, name, None, FAIL, f"{nccl.out_of_bounds} out-of-bounds values"))
    top = max(nccl.rows, key=lambda r: r.size_bytes)
    models = sorted(set(nccl.models))
    known = [floors[m] for m in models if m in floors]
    floor = min(known) if known else None
    where = f"{top.busbw_gbps:g} GB/s bus bandwidth at {top.size_bytes} B" if top.busbw_gbps is not None \
        else f"no bus bandwidth at {top.size_bytes} B"
    model = ", ".join(models) or "GPU model not shown"
    if floor is not None and (top.busbw_gbps is None or top.busbw_gbps < floor):
        tests.append(Test(NCCL, name, None, FAIL, f"{where}, under the floor of {floor:g} GB/s for {model}"))
    elif not tests:
        limit = f"floor {floor:g} GB/s for {model}" if floor is not None else f"no floor for {model}"
        tests.append(Test(NCCL, name, None, PASS, f"{where} ({limit})"))
    if returncode != 0 and not any(t.result == FAIL for t in tests):
        tests.append(Test(NCCL, name, None, FAIL, _short(f"exit {returncode}: {_last_line(stderr)}"), tool_error=True))
    return tests


def run_nccl(settings: Settings, gpus: int, remaining: Callable[[], float], run: Runner) -> List[Test]:
    if not settings.nccl_command:
        return [Test(NCCL, "all_reduce_perf", None, SKIP, "verify.nccl_command is []: nccl-tests off")]
    argv = [a.replace("{gpus}", str(gpus)) for a in settings.nccl_command]
    exe = find_program(argv[0])
    if exe is None:
        return [Test(NCCL, os.path.basename(argv[0]), None, SKIP, f"{argv[0]} not found: nccl-tests skipped")]
    if gpus < 2:
        return [Test(NCCL, os.path.basename(argv[0]), None, SKIP,
                     f"{gpus} GPU{'s' if gpus != 1 else ''}: nothing to all-reduce across")]
    ran = run([exe] + argv[1:], remaining())
    if ran.returncode is None:
        return [Test(NCCL, os.path.basename(argv[0]), None, FAIL,
                     f"did not finish within the battery's deadline ({settings.timeout_s:g} s)", tool_error=True)]
    return judge_nccl(parse_nccl(ran.stdout), ran.returncode, dict(settings.nccl_min_busbw_gbps),
                      ran.stderr or ran.stdout)


# ------------------------------------------------------------------------------------------ site commands

def run_command(command: Sequence[str], gpus: int, settings: Settings, remaining: Callable[[], float],
                run: Runner) -> Test:
    argv = [a.replace("{gpus}", str(gpus)) for a in command]
    name = _short(" ".join(argv))[:120]
    exe = find_program(argv[0])
    if exe is None:
        return Test(COMMAND, name, None, FAIL, f"{argv[0]} not found (verify.commands)", tool_error=True)
    ran = run([exe] + argv[1:], remaining())
    if ran.returncode is None:
        return Test(COMMAND, name, None, FAIL, f"did not finish within the battery's deadline ({settings.timeout_s:g} s)",
                    tool_error=True)
    if ran.returncode != 0:
        return Test(COMMAND, name, None, FAIL, _short(f"exit {ran.returncode}: {_last_line(ran.stderr, ran.stdout)}"))
    return Test(COMMAND, name, None, PASS, _last_line(ran.stdout) if ran.stdout.strip() else "exit 0")


def _one_command(command: Sequence[str], gpus: int, settings: Settings, remaining: Callable[[], float],
                 run: Runner) -> List[Test]:
    return [run_command(command, gpus, settings, remaining, run)]


# ------------------------------------------------------------------------------------------ the battery

def run_battery(settings: Settings, gpus: int, *, run: Runner = run_argv,
                monotonic: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """Run the battery on this node; the result object (module docstring)."""
    start = monotonic()
    deadline = start + settings.timeout_s

    def remaining() -> float:
        return deadline - monotonic()

    tests: List[Test] = []
    ran_any = False
    steps: List[Tuple[str, str, Callable[[], List[Test]]]] = [
        (DCGM, f"dcgmi diag -r {settings.dcgm_level}", lambda: run_dcgm(settings, remaining, run)),
        (NCCL, "all_reduce_perf", lambda: run_nccl(settings, gpus, remaining, run)),
    ] + [(COMMAND, _short(" ".join(c))[:120], functools.partial(_one_command, c, gpus, settings, remaining, run))
         for c in settings.commands]
    for tool, name, step in steps:
        if remaining() <= 0:
            got = [Test(tool, name, None, FAIL, f"not run: the battery's deadline ({settings.timeout_s:g} s) had passed",
                        tool_error=True)]
        else:
            got = step()
        ran_any = ran_any or any(t.result != SKIP for t in got)
        tests += got
    return result_object(tests, empty=not ran_any, duration_s=monotonic() - start, gpus=gpus,
                         dcgm_level=settings.dcgm_level)


def result_object(tests: Sequence[Test], *, empty: bool, duration_s: float, gpus: int,
                  dcgm_level: int) -> Dict[str, Any]:
    ok = not empty and not any(t.result == FAIL for t in tests)
    out: Dict[str, Any] = {"ok": ok, "empty": empty, "tests": [t.to_json() for t in tests],
                           "duration_s": round(duration_s, 3), "gpus": gpus, "dcgm_level": dcgm_level,
                           "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]}
    if empty:
        out["hint"] = f"nothing to run: {EMPTY_HINT}"
    return out


def tests_of(result: Dict[str, Any]) -> List[Test]:
    """The tests of a result object (as read back from the job's output file); entries that are not
    test objects are left out."""
    out = []
    for t in result.get("tests") or []:
        if isinstance(t, dict):
            gpu = t.get("gpu_index")
            out.append(Test(str(t.get("tool", "")), str(t.get("name", "")), gpu if isinstance(gpu, int) else None,
                            str(t.get("result", "")), str(t.get("detail", "")), bool(t.get("tool_error", False))))
    return out


def gpus_from_env(env: Optional[Dict[str, str]] = None, dev_dir: str = "/dev") -> int:
    """The GPUs this process may use: the job's (CUDA_VISIBLE_DEVICES, SLURM_GPUS_ON_NODE), else every
    /dev/nvidiaN of the node (an admin's run by hand)."""
    env = dict(os.environ) if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() and cvd.strip() != "NoDevFiles":
        return len([d for d in cvd.split(",") if d.strip()])
    if (env.get("SLURM_GPUS_ON_NODE") or "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    try:
        return len([n for n in os.listdir(dev_dir) if re.fullmatch(r"nvidia\d+", n)])
    except OSError:
        return 0


def exit_code(result: Dict[str, Any]) -> int:
    """0: ok; 1: a test failed or there was nothing to run (usage errors are 2, the CLI's)."""
    return 0 if result.get("ok") else 1
