"""The driver gateway: the only module that imports pynvml.

Reads every GPU into a frozen `GpuSnapshot` (three outcomes per field; the per-GPU reads are
gpu/nvml_read.py's, which gets pynvml from here), performs the few writes the hooks need, and
puts every call under a deadline: a GPU that fell off the bus can make NVML block, and a hook
must never hang a node.

Deadline model: GPUs are read by daemon worker threads, each recording which NVML call it is
in and since when.  The caller waits; a GPU whose current call exceeds `timeout_s` is
abandoned and reported with ``unreachable = "NVML call X timed out after Ns"`` while the
other GPUs are reported normally.  An abandoned thread stays blocked in C; the process
exits regardless (daemon thread), and that GPU is never touched again by this reader.

Workers take GPUs from a shared queue.  One starts at once; while GPUs still wait, their number
doubles (every `_SLOW_CALL_S` at most) when a call has lasted `_SLOW_CALL_S` (a slow or hung GPU:
the others are read beside it, up to one worker per GPU) or the read has lasted `_BUSY_S` (a
driver slow on every call).  A driver that answers in microseconds (most calls, most of the time)
is read by one thread: eight threads contending for the GIL around every ctypes call cost four
times the reads themselves (measured: 8 simulated GPUs, 22 ms against 5.5 ms read in turn), and
doubling on the clock alone added a second worker to every read that took over 5 ms.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import time
import types
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Collection, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm_gpu.errors import DriverLibraryMismatch, NvmlUnavailable, NvmlWriteError
from slurm_gpu.gpu import nvml_read
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu.deadline import run_with_deadline
from slurm_gpu.gpu.nvml_read import (
    FATAL_CODES,
    UNSUPPORTED_CODES,
    OneGpuReader,
    accounting_records,
    as_text,
    pynvml_version,
    running_processes,
)
from slurm_gpu.gpu.snapshot import NodeSnapshot, Reading


def _find_library_when_called(name: str) -> Optional[str]:
    from ctypes.util import find_library  # the real one, imported at the first call
    return find_library(name)


def _load_pynvml() -> Any:
    """nvidia-ml-py, imported without ctypes.util.  pynvml.py does `from ctypes.util import
    find_library` at its top and never calls it on Linux; ctypes.util imports subprocess, shutil
    and tempfile: 10 ms of every prolog and epilog (-X importtime, docs/benchmarks.md).  During this
    one import a stand-in module gives pynvml a find_library that imports the real one when called;
    then the stand-in is gone, and `import ctypes.util` anywhere gets the real module as always.
    A pynvml that wants more of ctypes.util (ImportError) is imported the ordinary way."""
    if "pynvml" in sys.modules or "ctypes.util" in sys.modules:
        import pynvml as loaded
        return loaded
    stand_in = types.ModuleType("ctypes.util")
    stand_in.find_library = _find_library_when_called  # type: ignore[attr-defined]
    sys.modules["ctypes.util"] = stand_in
    try:
        import pynvml as loaded
    except ImportError:
        loaded = None
    finally:
        if sys.modules.get("ctypes.util") is stand_in:
            del sys.modules["ctypes.util"]
    if loaded is None:
        import pynvml as loaded
    return loaded


if TYPE_CHECKING:
    import pynvml
else:
    pynvml = _load_pynvml()
nvml_read.bind(pynvml)  # the per-GPU reads (gpu/nvml_read.py) go through this one import

# While GPUs wait in the queue, the workers double when a call has lasted _SLOW_CALL_S, or the
# read _BUSY_S: behind a hung GPU, all n GPUs have a worker after about log2(n) * _SLOW_CALL_S.
_SLOW_CALL_S = 0.005
_BUSY_S = 0.02


def _work(queue: "Deque[OneGpuReader]") -> None:
    """A worker thread: read GPUs from the queue until it is empty (popleft is atomic)."""
    while True:
        try:
            reader = queue.popleft()
        except IndexError:
            return
        reader.run()


def _a_call_lasted(readers: List[OneGpuReader], now: float, seconds: float) -> bool:
    """Whether one of these GPUs is in an NVML call that began `seconds` ago or earlier."""
    for r in readers:
        with r.lock:
            if r.current is not None and now - r.started >= seconds:
                return True
    return False


def _run_with_deadline(fn: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """An NVML call under gpu/deadline.py's runner; TimeoutError naming the call when it overruns."""
    return run_with_deadline(fn, timeout_s, f"nvml-{name}", f"NVML call {name} timed out after {timeout_s:g}s")


_LOADED: Dict[str, Any] = {}


def _load_library(path: str) -> None:
    """Load a specific libnvidia-ml.so.1 so that pynvml's CDLL('libnvidia-ml.so.1') reuses it (same SONAME)."""
    if not path or path in _LOADED:
        return
    if not os.path.exists(path):
        raise NvmlUnavailable(f"NVML library {path} does not exist",
                              "fix nvml_library in the config (or --nvml-lib), or leave it empty to use the system driver")
    try:
        _LOADED[path] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NvmlUnavailable(f"cannot load NVML library {path}: {e}",
                              "point nvml_library at the driver's libnvidia-ml.so.1") from None
    # pynvml loads by SONAME; if it already holds another library, point it at ours.
    if getattr(pynvml, "nvmlLib", None) is not None and getattr(pynvml.nvmlLib, "_name", path) != path:
        cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
        if not isinstance(cache, dict):
            raise NvmlUnavailable(f"this nvidia-ml-py ({pynvml_version()}) cannot be pointed at {path}: "
                                  "it has no function-pointer cache to reset",
                                  "load the configured library before any other NVML use, or pin nvidia-ml-py 12.x/13.x")
        pynvml.nvmlLib = _LOADED[path]
        cache.clear()


KERNEL_VERSION_FILE = "/proc/driver/nvidia/version"
_VERSION = re.compile(r"(\d+\.\d+(?:\.\d+)?)")


def kernel_module_version(path: str = KERNEL_VERSION_FILE) -> str:
    """The loaded kernel module's version from the first line of /proc/driver/nvidia/version
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..." or "... Open Kernel
    Module for x86_64  550.54.15  Release Build ..."); "" when unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.readline()
    except OSError:
        return ""
    m = re.search(r"Kernel Module(?: for \S+)?\s+" + _VERSION.pattern, line)
    return m.group(1) if m else ""


def library_version(maps: str = "/proc/self/maps") -> str:
    """The version of the NVML library this process loaded, from its file name
    (libnvidia-ml.so.550.54.15, the file libnvidia-ml.so.1 links to); "" when it has none."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "libnvidia-ml.so" in line}
    except OSError:
        return ""
    for path in sorted(paths):
        m = re.search(r"libnvidia-ml\.so\." + _VERSION.pattern + "$", os.path.realpath(path))
        if m:
            return m.group(1)
    return ""


_NO_DRIVER_HINT = ("is the NVIDIA driver installed and loaded (nvidia-smi)? For a non-standard install set "
                   "nvml_library in /etc/slurm-gpu/config.toml or pass --nvml-lib PATH")


class NvmlReader:
    """A session with the driver: `snapshot()` for checks, the write methods for hooks."""

    def __init__(self, library: str = "", timeout_s: float = 5.0, version_file: str = KERNEL_VERSION_FILE):
        self.library = library
        self.version_file = version_file  # the kernel module's version (a driver/library mismatch names it)
        self.timeout_s = timeout_s
        self._initialised = False
        self._stuck: Dict[int, str] = {}  # GPUs abandoned because a call hung: never touch them again
        self._handles: Dict[int, Any] = {}

    # -- session ---------------------------------------------------------------------------
    def open(self) -> "NvmlReader":
        if self._initialised:
            return self
        _load_library(self.library)
        try:
            _run_with_deadline(pynvml.nvmlInit, self.timeout_s, "nvmlInit")
        except TimeoutError as e:
            raise NvmlUnavailable(f"{e}: the driver does not answer",
                                  "check dmesg for NVIDIA XID errors; the node may need a reboot") from None
        except pynvml.NVMLError as e:
            code = getattr(e, "value", None)
            if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise NvmlUnavailable("NVML library libnvidia-ml.so.1 not found", _NO_DRIVER_HINT) from None
            if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
                raise DriverLibraryMismatch(kernel_module_version(self.version_file), library_version()) from None
            raise NvmlUnavailable(f"NVML initialisation failed: {e}", _NO_DRIVER_HINT) from None
        self._initialised = True
        return self

    def close(self) -> None:
        if self._initialised and not self._stuck:
            try:
                _run_with_deadline(pynvml.nvmlShutdown, self.timeout_s, "nvmlShutdown")
            except (TimeoutError, pynvml.NVMLError):
                pass
        self._initialised = False

    def __enter__(self) -> "NvmlReader":
        return self.open()

    def __exit__(self, *_: Any) -> None:
        self.close()

    def _node_readings(self) -> Tuple[Reading[str], Reading[int], Reading[int]]:
        """Driver version, CUDA driver version and GPU count, in one thread under one deadline."""
        calls = (("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion, as_text),
                 ("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion, int),
                 ("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount, int))

        def read_all() -> Tuple[Reading[Any], ...]:
            out = []
            for name, fn, convert in calls:
                try:
                    out.append(S.value(convert(fn())))
                except pynvml.NVMLError as e:
                    code = getattr(e, "value", None)
                    out.append(S.unsupported(name, str(e)) if code in UNSUPPORTED_CODES else S.failed(name, str(e)))
            return tuple(out)

        try:
            got: Tuple[Reading[str], Reading[int], Reading[int]] = _run_with_deadline(
                read_all, self.timeout_s, "nvmlSystemGetDriverVersion")
            return got
        except TimeoutError as e:
            return tuple(S.failed(name, str(e)) for name, _, _ in calls)  # type: ignore[return-value]

    # -- reads -----------------------------------------------------------------------------
    def identities(self) -> NodeSnapshot:
        """A cheap read of every GPU's UUID, minor number and PCI bus id (to map Slurm's indices)."""
        return self.snapshot(None, ident_only=True)

    def usage(self, indices: Optional[Sequence[int]] = None) -> NodeSnapshot:
        """What a running job's sample needs (`slurm-gpu efficiency sample`): each GPU's identity,
        memory, power, energy and utilisation, and its MIG slices' memory; nothing else is read."""
        return self.snapshot(indices, usage_only=True)

    def snapshot(self, indices: Optional[Sequence[int]] = None, ident_only: bool = False,
                 inventory: bool = False, usage_only: bool = False) -> NodeSnapshot:
        """Read the node; `indices` limits per-GPU reads (node-wide facts are always read).

        `inventory` also reads what only inventories and node checks need (VBIOS, row-remapper
        histogram, SRAM ECC counts); without it those readings are NOT_READ (the prolog)."""
        self.open()
        taken = time.time()
        driver, cuda, count = self._node_readings()
        n = count.value if count.ok else 0
        wanted = sorted(set(range(n) if indices is None else indices))
        readers = self._parallel(wanted, ident_only=ident_only, count=n, inventory=inventory, usage_only=usage_only)
        for r in readers:
            h = getattr(r, "handle", None)
            if h is not None and not r.unreachable:
                self._handles[r.index] = h
        gpus = tuple(r.snapshot() for r in readers)
        return NodeSnapshot(hostname=os.uname().nodename.split(".")[0], taken_at=taken, driver_version=driver,
                            cuda_driver_version=cuda, gpu_count=count, gpus=gpus)

    def _parallel(self, indices: Sequence[int], body: Optional[Callable[[OneGpuReader], Any]] = None,
                  ident_only: bool = False, count: Optional[int] = None, inventory: bool = False,
                  usage_only: bool = False) -> List[OneGpuReader]:
        """Read each GPU (or run `body` on it) in worker threads, under the per-call deadline."""
        readers = [OneGpuReader(i, ident_only, body, inventory, usage_only) for i in indices]
        queue: Deque[OneGpuReader] = deque()
        for r in readers:
            if r.index in self._stuck:
                r.unreachable = self._stuck[r.index]
                r.done.set()
            elif count is not None and r.index >= count:
                r.unreachable = f"no GPU with index {r.index} (the driver reports {count})"
                r.done.set()
            else:
                queue.append(r)
        self._wait(readers, queue)
        return readers

    def _wait(self, readers: List[OneGpuReader], queue: Deque[OneGpuReader]) -> None:
        """Until every GPU is done or abandoned: add workers while GPUs wait in the queue, and
        abandon a GPU whose current call is past the deadline."""
        workers = 0
        started = time.monotonic()
        grow_at = 0.0
        pending = [r for r in readers if not r.done.is_set()]
        while pending:
            now = time.monotonic()
            if queue and now >= grow_at:
                if workers == 0 or now - started >= _BUSY_S or _a_call_lasted(pending, now, _SLOW_CALL_S):
                    for _ in range(min(len(queue), max(1, workers))):  # doubling
                        threading.Thread(target=_work, args=(queue,), name=f"nvml-worker{workers}", daemon=True).start()
                        workers += 1
                grow_at = now + _SLOW_CALL_S
            pending, wake = self._abandon_overdue(pending, now)
            if pending:
                if queue:
                    wake = min(wake, grow_at)
                # The last GPU queued is, nearly always, the last one done.
                pending[-1].done.wait(max(0.001, min(wake - time.monotonic(), 0.05)))

    def _abandon_overdue(self, pending: List[OneGpuReader], now: float) -> Tuple[List[OneGpuReader], float]:
        """(GPUs still being read, when the next of their current calls is due)."""
        due = now + self.timeout_s
        still: List[OneGpuReader] = []
        for r in pending:
            if r.done.is_set():
                continue
            with r.lock:
                current, started = r.current, r.started
            if current is not None and now - started >= self.timeout_s:
                msg = f"NVML call {current} timed out after {self.timeout_s:g}s"
                r.unreachable = msg
                self._stuck[r.index] = msg
                continue
            if current is not None:
                due = min(due, started + self.timeout_s)
            still.append(r)
        return still, due

    def _on_gpus(self, indices: Sequence[int], task: Callable[[OneGpuReader, Any], Any]) -> Dict[int, Any]:
        """Run task(worker, handle) on each GPU in parallel: {index: result}, or NvmlWriteError for that GPU."""
        self.open()

        def body(w: OneGpuReader) -> Any:
            h = self._handles.get(w.index)
            if h is None:
                h = w.call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, w.index)
            return task(w, h)

        out: Dict[int, Any] = {}
        for w in self._parallel(sorted(set(indices)), body):
            if w.unreachable:
                out[w.index] = NvmlWriteError(f"GPU {w.index}: {w.unreachable}",
                                              "the GPU may have fallen off the bus; check dmesg for XID 79")
            elif isinstance(w.error, pynvml.NVMLError):
                out[w.index] = NvmlWriteError(f"GPU {w.index}: {w.current or 'NVML call'} failed: {w.error}",
                                              _write_hint(w.error))
            elif w.error is not None:
                out[w.index] = w.error
            else:
                out[w.index] = w.result
        return out

    # -- per-GPU reads for the hooks --------------------------------------------------------
    def processes_many(self, indices: Sequence[int]) -> Dict[int, Any]:
        """{index: tuple[Process] | NvmlWriteError}: compute processes on each GPU."""
        return self._on_gpus(indices, running_processes)

    def accounting_many(self, indices: Sequence[int]) -> Dict[int, Any]:
        """{index: Reading[tuple[AccountingRecord]] | NvmlWriteError}: the driver's per-process accounting
        (gpu/nvml_read.py's AccountingRecord)."""
        return self._on_gpus(indices, accounting_records)

    # -- writes (strict: a failure is an NvmlWriteError naming the GPU and the NVML error) ---
    def prepare(self, indices: Sequence[int], *, persistence: bool = False, reset_clocks: bool = False,
                accounting: bool = False, power_cap_tolerance_pct: Optional[float] = None,
                in_place: Optional[Mapping[int, Collection[str]]] = None) -> Dict[int, Any]:
        """Put GPUs into a known state, all GPUs in parallel.

        Returns {index: {operation: done} | NvmlWriteError}; done is False when the GPU does
        not support the operation (nothing to reset is not an error).  `in_place` names, per
        GPU, the set-operations whose state a read of this GPU moments ago already showed
        (persistence or accounting on): those are reported done without a driver write.
        """
        p = pynvml
        ops: List[Tuple[str, Callable[..., Any], Tuple[Any, ...]]] = []
        if persistence:
            ops.append(("nvmlDeviceSetPersistenceMode", p.nvmlDeviceSetPersistenceMode, (p.NVML_FEATURE_ENABLED,)))
        if reset_clocks:
            ops += [("nvmlDeviceResetApplicationsClocks", p.nvmlDeviceResetApplicationsClocks, ()),
                    ("nvmlDeviceResetGpuLockedClocks", p.nvmlDeviceResetGpuLockedClocks, ()),
                    ("nvmlDeviceResetMemoryLockedClocks", p.nvmlDeviceResetMemoryLockedClocks, ())]
        if power_cap_tolerance_pct is not None:
            # A limit capped below the board's default goes back to the default (nothing of ours lowers it).
            ops.append(("nvmlDeviceSetPowerManagementLimit", _reset_power_limit, (power_cap_tolerance_pct,)))
        if accounting:
            # Accounting must be on before the job's first process starts; PIDs of earlier
            # jobs would be mistaken for this job's, so they are cleared.
            ops += [("nvmlDeviceSetAccountingMode", p.nvmlDeviceSetAccountingMode, (p.NVML_FEATURE_ENABLED,)),
                    ("nvmlDeviceClearAccountingPids", p.nvmlDeviceClearAccountingPids, ())]

        def task(w: OneGpuReader, h: Any) -> Dict[str, bool]:
            done: Dict[str, bool] = {}
            shown = in_place.get(w.index, ()) if in_place else ()
            for name, fn, args in ops:
                if name in shown and name in _SET_ONLY_IF_OFF:
                    done[name] = True
                    continue
                if name == "nvmlDeviceClearAccountingPids" and not done.get("nvmlDeviceSetAccountingMode"):
                    continue
                try:
                    w.call(name, fn, h, *args)
                    done[name] = True
                except p.NVMLError as e:
                    if getattr(e, "value", None) in (p.NVML_ERROR_NOT_SUPPORTED, p.NVML_ERROR_FUNCTION_NOT_FOUND):
                        done[name] = False
                        continue
                    raise NvmlWriteError(f"GPU {w.index}: {name} failed: {e}", _write_hint(e)) from None
            return done
        return self._on_gpus(indices, task)

    def is_stuck(self, index: int) -> bool:
        return index in self._stuck


# Writes that only turn a mode on: with the mode already on (read just before), they change nothing.
# The clock and power resets and the clearing of accounting PIDs are done every time.
_SET_ONLY_IF_OFF = frozenset({"nvmlDeviceSetPersistenceMode", "nvmlDeviceSetAccountingMode"})


def _reset_power_limit(h: Any, tolerance_pct: float) -> bool:
    """Set the enforced power limit back to the default when it is capped beyond the tolerance; True when set."""
    p = pynvml
    limit, default = int(p.nvmlDeviceGetEnforcedPowerLimit(h)), int(p.nvmlDeviceGetPowerManagementDefaultLimit(h))
    if limit >= default * (1 - tolerance_pct / 100.0):
        return False
    p.nvmlDeviceSetPowerManagementLimit(h, default)
    return True


def _write_hint(e: Exception) -> str:
    code = getattr(e, "value", None)
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return "GPU settings need root: run the hook as root (slurmd does)"
    if code in FATAL_CODES:
        return "the GPU needs a reset or the node a reboot; drain it and check dmesg"
    return "see `slurm-gpu check` for the GPU's state"

