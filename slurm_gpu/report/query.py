"""What a report counts: the time window, the filters, the idle threshold and the zone of calendar
keys (Query), and the keys a summary can group by."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from slurm_gpu import groupkeys
from slurm_gpu.config import IDLE_THRESHOLD_PCT
from slurm_gpu.errors import InputError
from slurm_gpu.report.timespec import format_time, time_zone

# --by keys (slurm_gpu/groupkeys.py): name -> SQL expression over job_gpus (time keys come from the calendar join).
GROUP_KEYS: Dict[str, str] = {k.name: f'"{k.column}"' for k in groupkeys.KEYS}
TIME_KEYS = groupkeys.TIME_KEYS
BY_CHOICES = tuple(GROUP_KEYS) + TIME_KEYS


@dataclass(frozen=True)
class Query:
    """What to count: time window (unix seconds, None = open), filters, idle threshold, zone of calendar keys."""

    since_s: Optional[float] = None
    until_s: Optional[float] = None
    users: Tuple[str, ...] = ()
    accounts: Tuple[str, ...] = ()
    partitions: Tuple[str, ...] = ()
    nodes: Tuple[str, ...] = ()
    clusters: Tuple[str, ...] = ()
    idle_threshold_pct: float = IDLE_THRESHOLD_PCT
    tz: str = "utc"
    job_id: Optional[int] = None  # report job JOBID

    def __post_init__(self) -> None:
        if self.since_s is not None and self.until_s is not None and self.until_s <= self.since_s:
            raise InputError(
                f"empty time window: --until ({format_time(self.until_s, self.tz)}) is not after --since "
                f"({format_time(self.since_s, self.tz)})", "give a --since earlier than --until")
        if not 0 <= self.idle_threshold_pct <= 100:
            raise InputError(f"idle threshold {self.idle_threshold_pct:g}% is outside 0..100",
                             "give --idle-threshold between 0 and 100")
        time_zone(self.tz)
