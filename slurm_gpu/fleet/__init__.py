"""`slurm-gpu fleet`: the view across all nodes (docs/fleet.md).

Versions, memory health, spare capacity and XIDs across the fleet, from the central server's
`gpu_inventory` and `xid_events` (history, so trends) or from a directory of `slurm-gpu
inventory` files (the current state only), with partitions and node states read from Slurm.
Pure functions over typed rows; the CLI (cli/fleet.py) reads, renders and sets the exit code.
"""
