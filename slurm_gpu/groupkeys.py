"""Every key `slurm-gpu report --by` groups by, declared once.

Each `GroupKey` holds what is known about one key; the tables the rest of the package reads are
derived from it (tests/test_groupkeys.py ties them, and the databases' real indexes, to it):

- report/query.py: `GROUP_KEYS` (the key's SQL over job_gpus) and `BY_CHOICES`, with `TIME_KEYS`;
- report/tables.py: the keys whose groups never share a job (the TOTAL line's job count);
- report/rollup.py: the keys' columns in the rollup tables, and which table carries a grouping;
- store/schema.py `REPORT_INDEX_KEYS`: the keys with a covering index on job_gpus (`indexed`), on
  the nodes and on the central server alike.  The migrations that made those indexes keep their
  own frozen lists: an index added later is a migration of its own on both;
- central/rollups.py `GROUP_COLUMNS` and `NULL_BITS`: the rollups' group columns (`null_bit`).  The
  bits are in every rollup cell the server keeps (`nulls`): never renumbered.

A new key over a column job_gpus already has: one `GroupKey` here, not indexed and not in the
rollups (reports by it read the records), and its name in docs/report.md (docs/architecture.md,
"Add a report grouping").  Standard library only: store/schema.py imports it on the hook path.
"""
from __future__ import annotations

from typing import Dict, Tuple


class GroupKey:
    """One `--by` key.  A plain class, as checkcatalog.CheckSpec: the hook path imports this module."""

    __slots__ = ("name", "column", "one_per_job", "indexed", "null_bit", "filter_field")

    def __init__(self, name: str, column: str, one_per_job: bool = False, indexed: bool = False, null_bit: int = 0,
                 filter_field: str = "") -> None:
        self.name = name  # the --by word, and the report's column title
        self.column = column  # job_gpus' column (the node's and the server's)
        self.one_per_job = one_per_job  # a job lies in one group: groups never share a job
        self.indexed = indexed  # job_gpus has the covering index job_gpus_by_<column> (node schema v2, central v1)
        self.null_bit = null_bit  # a group column of the rollups, with this bit in `nulls` (0: not one)
        self.filter_field = filter_field  # the Query field that filters by it ('': none)

    def __repr__(self) -> str:
        return f"GroupKey({self.name!r}, {self.column!r})"


KEYS: Tuple[GroupKey, ...] = (  # in the order --by lists them
    GroupKey("user", "user", one_per_job=True, indexed=True, null_bit=1, filter_field="users"),
    GroupKey("account", "account", one_per_job=True, indexed=True, null_bit=2, filter_field="accounts"),
    GroupKey("partition", "partition", one_per_job=True, indexed=True, null_bit=4, filter_field="partitions"),
    GroupKey("node", "node", indexed=True, filter_field="nodes"),  # a job on two nodes is in two groups
    GroupKey("gpu-model", "gpu_model", indexed=True, null_bit=8),
    GroupKey("cluster", "cluster", one_per_job=True, filter_field="clusters"),
)
# Calendar keys: buckets of the report's zone (report/calendar.py), not columns; at most one a report.
TIME_KEYS: Tuple[str, ...] = ("day", "week", "month")

COLUMN: Dict[str, str] = {k.name: k.column for k in KEYS}
INDEXED: Tuple[str, ...] = tuple(k.column for k in KEYS if k.indexed)
