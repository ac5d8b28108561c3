"""How the driver gateway imports nvidia-ml-py: on every Python the root filesystems have."""
from __future__ import annotations

import subprocess
import sys


def test_pynvml_comes_without_ctypes_util_and_ctypes_util_stays_the_real_one():
    """gpu/nvml.py imports pynvml without ctypes.util (10 ms of every hook: subprocess, shutil,
    tempfile); pynvml's find_library still answers, and a later `import ctypes.util` is the real module."""
    code = ("import sys; import slurm_gpu.gpu.nvml as n; assert 'ctypes.util' not in sys.modules, 'imported'; "
            "assert 'subprocess' not in sys.modules, 'subprocess'; import ctypes.util; "
            "assert ctypes.util.find_library.__module__ == 'ctypes.util'; "
            "assert n.pynvml.find_library('c') == ctypes.util.find_library('c'), 'find_library'; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_per_gpu_reads_use_the_one_pynvml_the_gateway_imported():
    """gpu/nvml_read.py imports no pynvml itself: gpu/nvml.py hands it the module it imported, error codes included."""
    from slurm_gpu.gpu import nvml, nvml_read
    assert nvml_read.pynvml is nvml.pynvml
    assert nvml.pynvml.NVML_ERROR_GPU_IS_LOST in nvml_read.FATAL_CODES
    assert nvml.pynvml.NVML_ERROR_NOT_SUPPORTED in nvml_read.UNSUPPORTED_CODES
