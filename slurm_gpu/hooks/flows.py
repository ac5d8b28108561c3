"""The hooks' flows by name: what hooks/main.py runs (`flows.prolog`, `flows.epilog`) and what the
test suite calls (`from slurm_gpu.hooks import flows as hooks`).  The code lives in its rooms
(docs/architecture.md): prolog.py, epilog.py, check.py (reading and judging), deps.py (HookDeps),
procs.py (process identity, TERM/KILL), records.py (what is recorded; the spool's housekeeping),
drain.py, observe.py (the metrics side channel, HookExit).

A name's module is imported when the name is first asked for: the prolog never loads the epilog."""
from __future__ import annotations

import importlib
from typing import Any, List

_HOMES = {
    "prolog": "prolog", "PROLOG_OK": "prolog", "PROLOG_FAULT": "prolog",
    "epilog": "epilog",
    "HookDeps": "deps", "map_gpus": "deps",
    "HookExit": "observe",
    "Observed": "check", "check_node": "check", "make_reader": "check", "mismatch_metric": "check",
    "UNKNOWN_JOB": "procs", "process_belongs_to_job": "procs", "process_identity": "procs",
    "process_start_time": "procs",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"slurm_gpu.hooks.{home}"), name)


def __dir__() -> List[str]:
    return sorted(_HOMES)
