"""The type checker and the linter hold the tree: mypy over slurm_gpu/ (the flags of --strict on
every package but cli/, see pyproject.toml) and ruff (pyflakes, import order, line length)
over the package, the tests and the benchmarks, both with zero findings."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

REPO = Path(__file__).resolve().parent.parent


def _run(argv: list) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


def test_mypy_finds_no_type_error_in_slurm_gpu():
    # The cache lives outside the checkout: the version axis runs the same checkout from several
    # root filesystems at once, and each interpreter keeps a cache of its own.
    cache = Path(tempfile.gettempdir()) / f"slurm-gpu-mypy-{sys.version_info[0]}.{sys.version_info[1]}"
    done = _run([sys.executable, "-m", "mypy", "--cache-dir", str(cache)])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_ruff_finds_no_unused_import_unsorted_import_or_overlong_line():
    done = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "slurm_gpu", "tests", "benchmarks"])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
