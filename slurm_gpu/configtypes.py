"""The configuration's sections as types, for mypy only: generated from SCHEMA in
slurm_gpu/config.py by `python -m slurm_gpu.config --types > slurm_gpu/configtypes.py`;
never edit by hand (tests/test_config_env.py fails until the two agree)."""
from __future__ import annotations

from typing import Any, Dict, List


class Health:
    expected_gpu_count: int
    required_driver_version: str
    max_temperature_c: int
    max_retired_pages: int
    idle_memory_used_mib: int
    clock_event_mask: int
    power_cap_tolerance_pct: float
    stuck_clocks_busy_pct: float
    stuck_clocks_ratio_pct: float
    stuck_clocks_recent_s: float
    severity: Dict[str, Any]


class Xid:
    source: str
    window_s: int
    ignore: List[Any]
    critical: List[Any]


class Hooks:
    prolog_deadline_s: float
    epilog_deadline_s: float
    epilog_ctld_deadline_s: float
    fail_open: bool
    drain_on_fault: bool
    reset_clocks: bool
    reset_power_limit: bool
    persistence_mode: bool
    accounting_mode: bool
    kill_leftovers: bool
    kill_grace_s: float
    healthcheck_lock_file: str


class Store:
    database: str
    spool_dir: str
    busy_timeout_s: float


class Inventory:
    record_every_s: int


class Log:
    syslog: bool
    file: str
    level: str


class Gres:
    type_naming: str
    type_map: Dict[str, Any]
    template_dir: str
    mig_minors_path: str
    cpu_topology_dir: str
    slurm_version: str


class Report:
    idle_threshold_pct: float
    sources: List[Any]
    tz: str


class JobSummary:
    field: str
    wait_s: float
    energy_tres: bool


class Central:
    url: str
    password_file: str
    timeout_s: float
    batch_size: int
    query_timeout_s: float


class Metrics:
    textfile_dir: str
    dcgm_job_mapping_dir: str
    by_account: bool
    max_accounts: int


class Job:
    idle_pct: float
    low_util_pct: float
    small_memory_fraction: float
    min_runtime_s: int
    site_note: str


class Efficiency:
    sample_every_s: float
    decide_on: str
    idle_util_pct: float
    idle_memory_mib: int
    grace_s: float
    notify_after_s: float
    cancel_after_s: float
    interactive_notify_after_s: float
    interactive_cancel_after_s: float
    exempt_accounts: List[Any]
    exempt_partitions: List[Any]
    exempt_qos: List[Any]
    exempt_users: List[Any]
    max_mails_per_user_per_day: int
    mail_from: str
    mail_domain: str
    smtp_server: str
    mail_command: List[Any]
    mail_retry_s: float
    job_url: str
    live_summary_every_s: float
    samples_fine_s: float
    samples_keep_days: float
    samples_max_mb: float


class Remediation:
    enabled: bool
    reset_command: List[Any]
    reset_timeout_s: float
    verify_passes: int
    verify_interval_s: float
    max_resets_per_gpu_per_day: int
    max_reboots_per_node_per_day: int
    lemon_window_days: float
    lemon_remedies: int
    lemon_xid_bursts: int
    clock_slack_s: float
    lock_file: str


class Breaker:
    max_drained_pct: float
    window_s: float
    settle_s: float


class Verify:
    enabled: bool
    dcgm_level: int
    dcgmi: str
    nccl_command: List[Any]
    nccl_min_busbw_gbps: Dict[str, Any]
    commands: List[Any]
    start_timeout_s: float
    timeout_s: float
    partition: str


class Fleet:
    reserve_pct: float
    expected_cuda_version: str
    expected_vbios: Dict[str, Any]
    xid_storm_window_s: float
    xid_storm_min_nodes: int


class Sections:
    """The whole file: the top-level keys, then one attribute per section."""

    cluster_name: str
    nvml_library: str
    nvidia_version_file: str
    nvml_timeout_s: float
    slurm_backend: str
    slurm_conf: str
    slurm_bin_dir: str
    slurm_timeout_s: float
    slurm_max_nodes: int
    health: Health
    xid: Xid
    hooks: Hooks
    store: Store
    inventory: Inventory
    log: Log
    gres: Gres
    report: Report
    job_summary: JobSummary
    central: Central
    metrics: Metrics
    job: Job
    efficiency: Efficiency
    remediation: Remediation
    breaker: Breaker
    verify: Verify
    fleet: Fleet
