"""The node database (SQLite): schema and migrations, writes, spool, the record, the live read. The
central server has its own room: slurm_gpu.central."""
