"""slurm-gpu: GPU health gating and per-job GPU accounting for Slurm."""
__version__ = "0.1.0"
