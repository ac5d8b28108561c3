"""The registry the family modules fill (policy/checks/__init__.py says how checks run).

Its own module, so that a family imports the decorators without importing the package that
imports the families: no import cycle."""
from __future__ import annotations

from typing import Callable, Dict, List, TypeVar

Check = Callable[..., None]
GPU_CHECKS: List[Check] = []
NODE_CHECKS: Dict[str, List[Check]] = {"before": [], "after": []}
F = TypeVar("F", bound=Check)


def gpu_check(fn: F) -> F:
    GPU_CHECKS.append(fn)
    return fn


def node_check(phase: str) -> Callable[[F], F]:
    def register(fn: F) -> F:
        NODE_CHECKS[phase].append(fn)
        return fn
    return register
