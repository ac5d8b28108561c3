"""Simulated NVIDIA GPUs for tests: build the fake libnvidia-ml.so.1 and write its state files.

The C library in tests/simnvml/simnvml.c is loaded by the real pynvml instead of NVIDIA's
driver library.  What it reports comes from a plain-text state file (key=value lines, later
lines override earlier ones) that is re-read at every nvmlInit.  This module builds the
library (cached), writes/edits state files from plain dicts and parses the action log the
library writes for every mutating call.  Reference: docs/testing-simulated-gpus.md.

Stdlib only; importable from any test.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import subprocess
import tempfile
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "simnvml" / "simnvml.c"
BUILD_DIR = HERE / "simnvml" / "build"
LIB_NAME = "libnvidia-ml.so.1"
CFLAGS = ["-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1"]

# --- NVML return codes (nvml.h) ------------------------------------------------------------
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
ALREADY_INITIALIZED = 5
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
INSUFFICIENT_POWER = 8
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
IRQ_ISSUE = 11
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
CORRUPTED_INFOROM = 14
GPU_IS_LOST = 15
RESET_REQUIRED = 16
OPERATING_SYSTEM = 17
LIB_RM_VERSION_MISMATCH = 18
IN_USE = 19
MEMORY = 20
NO_DATA = 21
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999

# --- clock event reason bits ---------------------------------------------------------------
CLOCK_GPU_IDLE = 0x1
CLOCK_APPLICATIONS_CLOCKS_SETTING = 0x2
CLOCK_SW_POWER_CAP = 0x4
CLOCK_HW_SLOWDOWN = 0x8
CLOCK_SYNC_BOOST = 0x10
CLOCK_SW_THERMAL_SLOWDOWN = 0x20
CLOCK_HW_THERMAL_SLOWDOWN = 0x40
CLOCK_HW_POWER_BRAKE_SLOWDOWN = 0x80

MIB = 1 << 20
NOT_AVAILABLE = None  # process memory "not available" (NVML reports 2**64-1, pynvml None)

# Functions a consumer board (GeForce) answers with NOT_SUPPORTED.
CONSUMER_UNSUPPORTED = (
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPages_v2",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRowRemapperHistogram",
    "nvmlDeviceGetMemoryErrorCounter",
    "nvmlDeviceGetAccountingMode",
    "nvmlDeviceGetAccountingBufferSize",
    "nvmlDeviceGetAccountingPids",
    "nvmlDeviceGetAccountingStats",
    "nvmlDeviceSetAccountingMode",
    "nvmlDeviceClearAccountingPids",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2",
    "nvmlDeviceGetGpuFabricInfoV",
)

# NVSwitch fabric states (nvmlGpuFabricState_t) and GPU recovery actions (field 230).
FABRIC_NOT_SUPPORTED, FABRIC_NOT_STARTED, FABRIC_IN_PROGRESS, FABRIC_COMPLETED = 0, 1, 2, 3
FIELD_GPU_RECOVERY_ACTION = 230
RECOVERY_NONE, RECOVERY_GPU_RESET, RECOVERY_NODE_REBOOT, RECOVERY_DRAIN_P2P, RECOVERY_DRAIN_AND_RESET = 0, 1, 2, 3, 4


# --- building the library ------------------------------------------------------------------

def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def build(out_dir: Union[str, os.PathLike, None] = None, default_state: Optional[str] = None) -> pathlib.Path:
    """Compile simnvml.c into <out_dir>/<hash>/libnvidia-ml.so.1 and return that path.

    Cached: the hash covers the source, the flags and `default_state`, so a rebuild happens
    only when one of them changes.  `default_state` is the state path used when SIMNVML_STATE
    is unset (Slurm runs prolog/epilog without our environment); `%n` in it becomes
    $SLURMD_NODENAME, else the short hostname.  Safe to call from concurrent processes.
    """
    src = SOURCE.read_bytes()
    flags = list(CFLAGS)
    if default_state is not None:
        flags.append("-DSIMNVML_DEFAULT_STATE=" + _c_string(str(default_state)))
    # The C library is in the key: a checkout shared with a root filesystem of a newer Debian
    # (.ci/rootfs.sh) must not load a library linked against that Debian's glibc.
    libc = "-".join(platform.libc_ver())
    key = hashlib.sha256(src + b"\0" + "\0".join(flags).encode() + b"\0" + libc.encode()).hexdigest()[:16]
    target_dir = pathlib.Path(out_dir) if out_dir is not None else BUILD_DIR
    target = target_dir / key / LIB_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=str(target.parent))
    os.close(fd)
    try:
        cmd = ["cc", *flags, "-o", tmp, str(SOURCE), "-lpthread"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{res.stderr}")
        os.replace(tmp, target)  # atomic: a concurrent builder never sees a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def environ(state_path: Union[str, os.PathLike], base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of `base` (default os.environ) with SIMNVML_STATE pointing at `state_path`."""
    env = dict(os.environ if base is None else base)
    env["SIMNVML_STATE"] = str(state_path)
    return env


# --- state file serialisation ----------------------------------------------------------------

def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    s = str(v)
    if "\n" in s or "\r" in s:
        raise ValueError(f"state values cannot contain newlines: {s!r}")
    return s


def cpu_list(cpus: Iterable[int]) -> str:
    """[0,1,2,3,8] -> '0-3,8' (the cpu_affinity syntax)."""
    out: List[str] = []
    ids = sorted(set(int(c) for c in cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def _procs(v: Any) -> str:
    if isinstance(v, str):
        return v
    items = []
    for p in v:
        p = tuple(p)
        mem = "-" if len(p) < 2 or p[1] is None else str(int(p[1]))
        items.append(":".join([str(int(p[0])), mem] + [str(int(x)) for x in p[2:4]]))
    return ",".join(items)


_ACCT_FIELDS = ("pid", "gpu_util", "mem_util", "max_mem_bytes", "time_ms", "start_time_us", "is_running")


def _acct(v: Any) -> str:
    if isinstance(v, str):
        return v
    recs = []
    for r in v:
        if isinstance(r, Mapping):
            unknown = set(r) - set(_ACCT_FIELDS)
            if unknown:
                raise ValueError(f"unknown accounting field(s) {sorted(unknown)}; known: {_ACCT_FIELDS}")
            vals = [r.get(f, 0) for f in _ACCT_FIELDS]
        else:
            vals = list(r) + [0] * (len(_ACCT_FIELDS) - len(r))
        recs.append(":".join("-" if x is None else _scalar(int(x) if isinstance(x, bool) else x) for x in vals))
    return ";".join(recs)


def gpu_lines(index: int, gpu: Mapping[str, Any]) -> List[str]:
    """The state lines for one GPU dict (keys as in the state file without 'gpu.<i>.')."""
    p = f"gpu.{index}."
    lines: List[str] = []
    for k, v in gpu.items():
        if k == "errors":
            lines += [f"{p}error.{fn}={int(code)}" for fn, code in v.items()]
        elif k == "hangs":
            lines += [f"{p}hang.{fn}={_scalar(s)}" for fn, s in v.items()]
        elif k == "nvlinks":
            lines.append(f"{p}nvlink_count={len(v)}")
            for li, link in enumerate(v):
                for lk, lv in link.items():
                    lines.append(f"{p}nvlink.{li}.{lk}={_scalar(lv)}")
        elif k == "mig":
            lines.append(f"{p}mig_count={len(v)}")
            for mi, mig in enumerate(v):
                for mk, mv in mig.items():
                    if mk == "procs":
                        mv = _procs(mv)
                    lines.append(f"{p}mig.{mi}.{mk}={_scalar(mv)}")
        elif k == "procs":
            lines.append(f"{p}procs={_procs(v)}")
        elif k == "acct":
            lines.append(f"{p}acct={_acct(v)}")
        elif k == "cpu_affinity" and not isinstance(v, str):
            lines.append(f"{p}cpu_affinity={cpu_list(v)}")
        else:
            lines.append(f"{p}{k}={_scalar(v)}")
    return lines


def _top_lines(fields: Mapping[str, Any]) -> List[str]:
    lines: List[str] = []
    for k, v in fields.items():
        if k == "errors":
            lines += [f"error.{fn}={int(code)}" for fn, code in v.items()]
        elif k == "hangs":
            lines += [f"hang.{fn}={_scalar(s)}" for fn, s in v.items()]
        else:
            lines.append(f"{k}={_scalar(v)}")
    return lines


def node_lines(node: Mapping[str, Any]) -> List[str]:
    gpus: Sequence[Mapping[str, Any]] = node.get("gpus", ())
    lines = _top_lines({k: v for k, v in node.items() if k != "gpus"})
    if "gpu_count" not in node:
        lines.append(f"gpu_count={len(gpus)}")
    for i, g in enumerate(gpus):
        lines += gpu_lines(i, g)
    return lines


def write_state(path: Union[str, os.PathLike], node: Mapping[str, Any]) -> pathlib.Path:
    """Write a whole node (see the profiles below) atomically: temp file + rename."""
    path = pathlib.Path(path)
    text = "# simnvml state, written by tests/simgpu.py\n" + "\n".join(node_lines(node)) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".simnvml-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def append_lines(path: Union[str, os.PathLike], lines: Sequence[str]) -> None:
    """Append override lines with a single O_APPEND write (atomic against the library's appends)."""
    data = "".join(line + "\n" for line in lines).encode()
    fd = os.open(str(path), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def set_node(path: Union[str, os.PathLike], **fields: Any) -> None:
    """Override node-level keys: set_node(p, driver_version='535.1', errors={...})."""
    append_lines(path, _top_lines(fields))


def set_gpu(path: Union[str, os.PathLike], index: int, **fields: Any) -> None:
    """Override fields of GPU `index`: set_gpu(p, 0, temperature=90, procs=[(pid, 2**30)])."""
    append_lines(path, gpu_lines(index, fields))


def inject_error(path: Union[str, os.PathLike], index: int, function: str, code: int) -> None:
    """Make `function` (e.g. 'nvmlDeviceGetTemperature') on GPU `index` return `code`."""
    append_lines(path, [f"gpu.{index}.error.{function}={int(code)}"])


def clear_error(path: Union[str, os.PathLike], index: int, function: str) -> None:
    append_lines(path, [f"gpu.{index}.error.{function}=0"])


def inject_hang(path: Union[str, os.PathLike], index: int, function: str, seconds: float) -> None:
    """Make `function` on GPU `index` sleep `seconds` before answering (a hung GPU)."""
    append_lines(path, [f"gpu.{index}.hang.{function}={_scalar(seconds)}"])


def lose_gpu(path: Union[str, os.PathLike], index: int) -> None:
    """Every call on GPU `index` (its handle lookup included) returns GPU_IS_LOST from now on."""
    append_lines(path, [f"gpu.{index}.lost=1"])


def read_state(path: Union[str, os.PathLike]) -> Dict[str, str]:
    """The effective key -> value map of a state file (later lines win), as the library sees it."""
    out: Dict[str, str] = {}
    for raw in pathlib.Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        if k.strip():
            out[k.strip()] = v.strip()
    return out


def action_log_path(path: Union[str, os.PathLike]) -> pathlib.Path:
    """The action log of state file `path` (its action_log key, else '<path>.actions')."""
    p = pathlib.Path(path)
    if p.name.endswith(".actions"):
        return p
    try:
        al = read_state(p).get("action_log", "")
    except FileNotFoundError:
        al = ""
    return pathlib.Path(al) if al else p.with_name(p.name + ".actions")


def _num(s: str) -> Any:
    try:
        return int(s, 0)
    except ValueError:
        return s


def read_actions(path: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """Parse the action log of state file `path` (or the log itself).

    Each line `<time> gpu=<i> uuid=<uuid> <function> [k=v ...]` becomes
    {'time': float, 'gpu': int, 'uuid': str, 'function': str, 'args': {k: v}}.
    """
    log = action_log_path(path)
    if not log.exists():
        return []
    out: List[Dict[str, Any]] = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        rec: Dict[str, Any] = {"time": float(parts[0]), "gpu": int(parts[1].split("=", 1)[1]),
                               "uuid": parts[2].split("=", 1)[1], "function": parts[3], "args": {}}
        for kv in parts[4:]:
            k, _, v = kv.partition("=")
            rec["args"][k] = _num(v)
        out.append(rec)
    return out


# --- ready-made nodes ---------------------------------------------------------------------------

def _hex(seed: str, *parts: Any) -> str:
    return hashlib.sha256(":".join([seed, *map(str, parts)]).encode()).hexdigest()


def gpu_uuid(seed: str, model: str, index: int, prefix: str = "GPU") -> str:
    h = _hex(seed, model, index)
    return f"{prefix}-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _serial(seed: str, model: str, index: int) -> str:
    return "1" + str(int(_hex(seed, model, index, "serial")[:12], 16))[-12:].rjust(12, "0")


def _node(gpus: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {
        "driver_version": "550.54.15",
        "cuda_driver_version": 12040,
        "nvml_version": "12.550.54.15",
        "gpus": gpus,
    }


def _affinity(i: int, n: int, cpus: int, sockets: int = 2) -> str:
    per = cpus // sockets
    s = min(i * sockets // max(n, 1), sockets - 1)
    return f"{s * per}-{s * per + per - 1}"


# Made-up but well-formed VBIOS versions and DRAM bank counts (the row-remapper histogram's
# "max" of a GPU with every spare row left) per profile model.
_VBIOS = {"h100_sxm": "96.00.99.00.01", "h200": "96.00.A5.00.01", "a100_pcie": "92.00.45.00.06",
          "rtx4090": "95.02.3C.00.8E", "a100_sxm_mig": "92.00.36.00.02"}
_BANKS = {"a100_pcie": 640, "a100_sxm_mig": 640}


def _healthy(model: str, name: str, i: int, n: int, seed: str, bus: int, memory_total: int,
             pci_device_id: int, pci_subsystem_id: int, cpus: int = 112) -> Dict[str, Any]:
    return {
        "name": name,
        "uuid": gpu_uuid(seed, model, i),
        "serial": _serial(seed, model, i),
        "vbios": _VBIOS.get(model, "96.00.99.00.01"),
        "minor": i,
        "pci_bus_id": f"00000000:{bus:02X}:00.0",
        "pci_device_id": f"0x{pci_device_id:08X}",
        "pci_subsystem_id": f"0x{pci_subsystem_id:08X}",
        "memory_total": memory_total,
        "memory_used": 4 * MIB,
        "temperature": 35,
        "power_mw": 70000,
        "energy_mj": 1_000_000_000 + i * 1_000_003,
        "gpu_util": 0,
        "mem_util": 0,
        "ecc_mode": 1,
        "ecc_volatile_corrected": 0,
        "ecc_volatile_uncorrected": 0,
        "ecc_aggregate_corrected": 0,
        "ecc_aggregate_uncorrected": 0,
        "retired_pages_sbe": 0,
        "retired_pages_dbe": 0,
        "retired_pages_pending": 0,
        "remapped_corrected": 0,
        "remapped_uncorrected": 0,
        "remapped_pending": 0,
        "remapped_failure": 0,
        "remap_hist_max": _BANKS.get(model, 2560),
        "remap_hist_high": 0,
        "remap_hist_partial": 0,
        "remap_hist_low": 0,
        "remap_hist_none": 0,
        "sram_volatile_corrected": 0,
        "sram_volatile_uncorrected": 0,
        "sram_aggregate_corrected": 0,
        "sram_aggregate_uncorrected": 0,
        "clock_event_reasons": f"0x{CLOCK_GPU_IDLE:x}",
        "persistence_mode": 1,
        "pstate": 0,
        "accounting_mode": 1,
        "acct": [],
        "procs": [],
        "mig_mode": 0,
        "mig_mode_pending": 0,
        "cpu_affinity": _affinity(i, n, cpus),
    }


_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


# An HGX board whose fabric manager registered the GPU with the NVSwitch fabric.
_HGX_FABRIC = {"fabric_state": FABRIC_COMPLETED, "fabric_status": SUCCESS, "fabric_clique_id": 1,
               "fabric_cluster_byte": 0x5A}


def _hgx_bus(i: int) -> int:
    return _HGX_BUSES[i] if i < len(_HGX_BUSES) else 0x10 + i


def h100_sxm(n: int = 8, seed: str = "node") -> Dict[str, Any]:
    """An HGX H100 node: 18 NvLinks up per GPU (to 4 NVSwitches), PCIe gen5 x16, ECC on,
    persistence on, accounting on, two sockets of 56 CPUs each."""
    gpus = []
    for i in range(n):
        g = _healthy("h100_sxm", "NVIDIA H100 80GB HBM3", i, n, seed, _hgx_bus(i), 81559 * MIB, 0x233010DE, 0x16C110DE)
        g.update(pcie_gen_cur=5, pcie_gen_max=5, pcie_width_cur=16, pcie_width_max=16, **_HGX_FABRIC,
                 nvlinks=[{"state": 1, "remote_bus_id": f"00000000:{0x05 + l % 4:02X}:00.0"} for l in range(18)])
        gpus.append(g)
    return _node(gpus)


def h200(n: int = 4, seed: str = "node") -> Dict[str, Any]:
    """An HGX H200 node (141 GB HBM3e): 18 NvLinks up, PCIe gen5 x16."""
    gpus = []
    for i in range(n):
        g = _healthy("h200", "NVIDIA H200", i, n, seed, _hgx_bus(i), 143771 * MIB, 0x233510DE, 0x18BE10DE)
        g.update(pcie_gen_cur=5, pcie_gen_max=5, pcie_width_cur=16, pcie_width_max=16, power_mw=75000, **_HGX_FABRIC,
                 nvlinks=[{"state": 1, "remote_bus_id": f"00000000:{0x05 + l % 4:02X}:00.0"} for l in range(18)])
        gpus.append(g)
    return _node(gpus)


def a100_pcie(n: int = 4, seed: str = "node") -> Dict[str, Any]:
    """A PCIe A100 40GB node: no NvLink (nvlink calls NOT_SUPPORTED), PCIe gen4 x16."""
    buses = (0x17, 0x65, 0xCA, 0xE3)
    gpus = []
    for i in range(n):
        bus = buses[i] if i < len(buses) else 0x20 + i
        g = _healthy("a100_pcie", "NVIDIA A100-PCIE-40GB", i, n, seed, bus, 40960 * MIB, 0x20F110DE, 0x145F10DE, cpus=64)
        g.update(pcie_gen_cur=4, pcie_gen_max=4, pcie_width_cur=16, pcie_width_max=16, power_mw=35000,
                 nvlink_count=0, power_default_limit_mw=250000)
        gpus.append(g)
    return _node(gpus)


def consumer_gpu(n: int = 1, seed: str = "node") -> Dict[str, Any]:
    """A workstation with GeForce RTX 4090s: no ECC (SRAM counts included), retired pages,
    remapped rows or their histogram, accounting, MIG or NvLink (all NOT_SUPPORTED); energy,
    temperature, serial and VBIOS work."""
    gpus = []
    for i in range(n):
        g = _healthy("rtx4090", "NVIDIA GeForce RTX 4090", i, n, seed, 0x01 + i * 0x20, 24564 * MIB, 0x268410DE, 0x16F310DE,
                     cpus=32)
        for k in ("ecc_mode", "ecc_volatile_corrected", "ecc_volatile_uncorrected", "ecc_aggregate_corrected",
                  "ecc_aggregate_uncorrected", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending",
                  "remapped_corrected", "remapped_uncorrected", "remapped_pending", "remapped_failure",
                  "remap_hist_max", "remap_hist_high", "remap_hist_partial", "remap_hist_low", "remap_hist_none",
                  "sram_volatile_corrected", "sram_volatile_uncorrected", "sram_aggregate_corrected",
                  "sram_aggregate_uncorrected", "accounting_mode", "acct", "mig_mode", "mig_mode_pending"):
            del g[k]
        g.update(pcie_gen_cur=4, pcie_gen_max=4, pcie_width_cur=16, pcie_width_max=16, power_mw=20000, pstate=8,
                 power_default_limit_mw=450000, fan_count=1, **{"fan.0.speed_pct": 30, "fan.0.target_pct": 30},
                 persistence_mode=0, errors={fn: NOT_SUPPORTED for fn in CONSUMER_UNSUPPORTED})
        gpus.append(g)
    return _node(gpus)


def mig_gpu(n: int = 1, seed: str = "node") -> Dict[str, Any]:
    """A100-SXM4-40GB GPUs with MIG on and three MIG devices each (3g.20gb, 2g.10gb, 1g.5gb)."""
    layout = (("3g.20gb", 1, 19968), ("2g.10gb", 5, 9856), ("1g.5gb", 13, 4864))
    gpus = []
    for i in range(n):
        g = _healthy("a100_sxm_mig", "NVIDIA A100-SXM4-40GB", i, n, seed, _hgx_bus(i), 40960 * MIB, 0x20B010DE, 0x134F10DE)
        g.update(pcie_gen_cur=4, pcie_gen_max=4, pcie_width_cur=16, pcie_width_max=16, mig_mode=1, mig_mode_pending=1,
                 nvlinks=[{"state": 1, "remote_bus_id": f"00000000:{0x05 + l % 6:02X}:00.0"} for l in range(12)],
                 mig=[{"uuid": gpu_uuid(seed, "a100_mig", f"{i}.{k}", prefix="MIG"), "gi_id": gi, "ci_id": 0,
                       "memory_total": mib * MIB, "name": f"NVIDIA A100-SXM4-40GB MIG {prof}"}
                      for k, (prof, gi, mib) in enumerate(layout)])
        gpus.append(g)
    return _node(gpus)


PROFILES = {"h100_sxm": h100_sxm, "h200": h200, "a100_pcie": a100_pcie, "consumer_gpu": consumer_gpu, "mig_gpu": mig_gpu}


def dead_pid() -> int:
    """A pid that does not exist on this machine right now (a reaped child's)."""
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    pid = proc.pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:  # reused by someone else already: fall back to above pid_max
        pass
    return 2**31 - 2  # > any pid_max, so kill() reports ESRCH



# --- what a GPU reset does (the stand-in nvidia-smi, tests/simnvml/nvidia-smi) ------------------

# NVIDIA, "GPU Memory Error Management": a pending row remap / page retirement takes effect at the
# next GPU reset, and the volatile ECC counters start again from zero; the remapping-failure flag,
# the aggregate counters and the remapped rows stay (they live in the InfoROM).  The driver's
# recovery action returns to NONE once the action it asked for was done.
RESET_CLEARS = ("remapped_pending", "retired_pages_pending", "ecc_volatile_corrected", "ecc_volatile_uncorrected",
                "sram_volatile_corrected", "sram_volatile_uncorrected", f"field.{FIELD_GPU_RECOVERY_ACTION}")
STAND_IN_NVIDIA_SMI = pathlib.Path(__file__).resolve().parent / "simnvml" / "nvidia-smi"


def gpu_by_bus_id(state: Dict[str, str], bus_id: str) -> Optional[int]:
    """The index of the GPU with this PCI bus id ('00000000:18:00.0' or '0000:18:00.0', any case)."""
    def norm(b: str) -> str:
        dom, _, rest = b.strip().lower().partition(":")
        return f"{int(dom, 16):08x}:{rest}" if dom else b.lower()
    want = norm(bus_id)
    for i in range(int(state.get("gpu_count", "0"), 0)):
        have = state.get(f"gpu.{i}.pci_bus_id", f"00000000:{0x18 + 16 * i:02X}:00.0")
        if norm(have) == want:
            return i
    return None


def _live_procs(value: str) -> List[int]:
    pids = []
    for entry in filter(None, (value or "").split(",")):
        pid = int(entry.split(":")[0])
        try:
            os.kill(pid, 0)
            pids.append(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            pids.append(pid)
    return pids


def reset_gpu(path: Union[str, os.PathLike], index: int) -> Optional[str]:
    """Do to GPU `index` of state file `path` what `nvidia-smi --gpu-reset` does; returns why it refused
    (a process holds the GPU, the GPU is lost) or None.  `gpu.<i>.reset_sticky=1` makes the fault
    survive the reset (a GPU a reset does not cure: escalation tests); `gpu.<i>.resets` counts them."""
    state = read_state(path)
    key = f"gpu.{index}."
    if state.get(key + "lost", "0") != "0":
        return f"GPU {index}: Unable to determine the device handle for GPU: GPU is lost"
    holders = _live_procs(state.get(key + "procs", ""))
    if holders:
        return (f"GPU {index}: Unable to reset this GPU because it's being used by some other process "
                f"(pids {','.join(map(str, holders))})")
    lines = [f"{key}resets={int(state.get(key + 'resets', '0'), 0) + 1}"]
    if state.get(key + "reset_sticky", "0") == "0":
        lines += [f"{key}{k}=0" for k in RESET_CLEARS]
    append_lines(path, lines)
    log = action_log_path(path)
    with open(log, "a") as f:
        f.write(f"{time.time():.6f} gpu={index} uuid={state.get(key + 'uuid', '-')} nvidia-smi--gpu-reset\n")
    return None


# --- the verification battery's tools (tests/simnvml/dcgmi, tests/simnvml/all_reduce_perf) -------

STAND_IN_DCGMI = pathlib.Path(__file__).resolve().parent / "simnvml" / "dcgmi"
STAND_IN_ALL_REDUCE_PERF = pathlib.Path(__file__).resolve().parent / "simnvml" / "all_reduce_perf"
DEFAULT_BUSBW_GBPS = 360.0  # all_reduce_perf's bus bandwidth at large sizes when no GPU lowers it


def state_from_env(env: Optional[Mapping[str, str]] = None) -> str:
    """$SIMNVML_STATE for a stand-in tool, '%n' in it the node (SLURMD_NODENAME in a job, else the short
    host name): one setting serves every node of a cluster whose jobs inherit the submitter's environment."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or platform.node().split(".")[0]
    return env.get("SIMNVML_STATE", "").replace("%n", node)


def diag_failures(state: Mapping[str, str], index: int) -> List[str]:
    """The DCGM tests `gpu.<i>.diag_fail` makes fail on GPU i (comma-separated names, lowercase)."""
    return [t.strip().lower() for t in state.get(f"gpu.{index}.diag_fail", "").split(",") if t.strip()]


def nccl_busbw_gbps(state: Mapping[str, str], indices: Sequence[int]) -> float:
    """The bus bandwidth all_reduce_perf reaches at large sizes over these GPUs: the slowest one's
    `gpu.<i>.nvlink_busbw_gbps`, DEFAULT_BUSBW_GBPS when none sets it."""
    values = [float(state[f"gpu.{i}.nvlink_busbw_gbps"]) for i in indices if f"gpu.{i}.nvlink_busbw_gbps" in state]
    return min(values) if values else DEFAULT_BUSBW_GBPS
