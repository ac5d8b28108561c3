"""The layers of docs/architecture.md hold: import-linter checks the contracts in .importlinter."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

ROOT = Path(__file__).resolve().parents[1]


def test_imports_point_down_and_the_hook_path_stays_light():
    # The interpreter's own first: another installation on PATH may be an older version.
    exe = str(Path(sys.executable).with_name("lint-imports"))
    exe = exe if os.access(exe, os.X_OK) else (shutil.which("lint-imports") or exe)
    if not os.path.exists(exe):
        from testbed import unavailable
        unavailable("import-linter is not installed (pip install -e '.[test]')")
    cp = subprocess.run([exe, "--config", str(ROOT / ".importlinter")], cwd=str(ROOT), capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-2000:]
    assert cp.stdout.count("KEPT") == 5, cp.stdout
