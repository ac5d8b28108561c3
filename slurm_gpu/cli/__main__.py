"""`python -m slurm_gpu.cli`."""
from slurm_gpu.cli import run

run()
