"""Slurm: the job's environment, hostlists, the node's Slurm config, the data model and backends."""
