"""The central server, a room of its own: the cluster's MariaDB/MySQL database and what talks to it.

server.py (URL, password file, connection, the central schema and its CENTRAL_* columns, GRANTs; the
only importer of PyMySQL), writers.py (per-node writer accounts), rollups.py (per-day sums kept by
every push, built and checked from the records), rollup_push.py (the push's rollup procedures),
push.py (`db push`: the node database as outbox).  The node's own store (SQLite) is slurm_gpu.store,
which nothing here changes but push's outbox marks; the hook path imports nothing of this package.
"""
