"""Choosing how to talk to Slurm: the command-line tools or pyslurm."""
from __future__ import annotations

import re
from typing import Callable, Dict, Optional, Tuple

from slurm_gpu.config import Config
from slurm_gpu.errors import SlurmError
from slurm_gpu.slurm.model import SlurmBackend


def slurm_major_minor(version_text: str) -> Optional[Tuple[int, int]]:
    """'slurm 22.05.8' / '25.11.0' / 'slurm-wlm 24.11.5' / '25.5.0' -> (major, minor)."""
    m = re.search(r"(\d+)\.(\d+)", version_text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# Slurm major.minor -> the oldest pyslurm release proven to give what the cli backend gives on
# that Slurm (every backend call compared on a real cluster: docs/admin-guide.md#pyslurm).
# `auto` picks pyslurm only for these pairs.
PYSLURM_VERIFIED: Dict[Tuple[int, int], Tuple[int, ...]] = {(25, 11): (25, 11, 2)}


def _release(version_text: str) -> Tuple[int, ...]:
    m = re.match(r"\s*(\d+(?:\.\d+)*)", version_text or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def get_backend(cfg: Config) -> SlurmBackend:
    """The backend ``cfg.slurm_backend`` asks for: 'cli', 'pyslurm' or 'auto'.

    auto: pyslurm when it imports, its version's major.minor equals the running Slurm's
    (``scontrol --version``) AND that pair is in PYSLURM_VERIFIED; otherwise the command-line
    tools.  'pyslurm' takes any pyslurm built for the running Slurm.  pyslurm is only imported
    when the site has it installed, so the common path costs nothing.
    """
    from slurm_gpu.slurm.cli_backend import CliBackend

    choice = getattr(cfg, "slurm_backend", "auto") or "auto"
    cli = CliBackend(cfg)
    if choice == "cli":
        cli.why = "slurm_backend = 'cli'"
        return cli
    from slurm_gpu.slurm import pyslurm_backend as pb

    mod, err = pb.import_pyslurm()
    if mod is None:
        if choice == "pyslurm":
            raise SlurmError(f"slurm_backend = 'pyslurm' but pyslurm cannot be imported: {err}",
                             "install pyslurm built for your Slurm version, or set slurm_backend = 'auto' or 'cli'")
        cli.why = f"auto: pyslurm not importable ({err})"
        return cli
    py_ver = slurm_major_minor(str(getattr(mod, "__version__", "")))
    try:
        slurm_ver = slurm_major_minor(cli.version())
    except SlurmError as e:
        slurm_ver, verr = None, e.message
    else:
        verr = ""
    verified = PYSLURM_VERIFIED.get(slurm_ver) if slurm_ver else None
    release = _release(str(getattr(mod, "__version__", "")))
    if py_ver is not None and py_ver == slurm_ver and choice == "auto" and (verified is None or release < verified):
        cli.why = (f"auto: pyslurm {getattr(mod, '__version__', '?')} on Slurm {slurm_ver[0]}.{slurm_ver[1]:02d} is not "
                   "verified against the command-line tools; using them")
        return cli
    if py_ver is not None and py_ver == slurm_ver:
        backend = pb.PyslurmBackend(mod, timeout_s=float(getattr(cfg, "slurm_timeout_s", 10.0)))
        backend.why = f"{choice}: pyslurm {getattr(mod, '__version__', '?')} matches Slurm {slurm_ver[0]}.{slurm_ver[1]:02d}"
        return backend
    fmt: Callable[[Optional[Tuple[int, int]]], str] = lambda v: f"{v[0]}.{v[1]:02d}" if v else "unknown"  # noqa: E731
    detail = f"pyslurm {getattr(mod, '__version__', '?')} is for Slurm {fmt(py_ver)}, running Slurm is {fmt(slurm_ver)}"
    if verr:
        detail += f" ({verr})"
    if choice == "pyslurm":
        raise SlurmError(f"slurm_backend = 'pyslurm' but {detail}",
                         "install the pyslurm release matching your Slurm major.minor, or set slurm_backend = 'auto'")
    cli.why = f"auto: {detail}; using the command-line tools"
    return cli


# ---------------------------------------------------------------- health -> node state
