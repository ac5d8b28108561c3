"""A copy of this checkout as a release job or a deployment sees it (tests/test_release.py, the Ansible test)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_checkout(dest: Path) -> Path:
    """The checkout's files (tracked and new, not ignored) copied to dest: builds never write
    into the working tree, and build outputs lying in it never reach a wheel."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest
