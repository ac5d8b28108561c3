"""slurm-gpu: GPU health gating and per-job GPU accounting for Slurm."""
# The one place the version is set: pyproject.toml reads it (dynamic version), `slurm-gpu
# --version` prints it, the release wheel and sdist carry it (tests/test_release.py).
__version__ = "0.1.0"
