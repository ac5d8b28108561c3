"""Configuration: one TOML file, every key declared here with type, default, range and doc.

Lookup order: explicit path (``--config``), ``$SLURM_GPU_CONFIG``, ``slurm-gpu.toml`` beside
``$SLURM_CONF`` (slurmd passes SLURM_CONF to prolog/epilog), ``/etc/slurm-gpu/config.toml``.
A missing default file means "all defaults"; a missing *explicit* file is an error.

``%n`` in path values is replaced by the Slurm node name (SLURMD_NODENAME, else the short
host name), so a site can keep per-node databases on shared storage.
"""
from __future__ import annotations

import math
import os
import stat
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

from slurm_gpu.checkcatalog import JUDGED
from slurm_gpu.errors import ConfigError

DEFAULT_PATH = "/etc/slurm-gpu/config.toml"
SEVERITIES = ("fail", "warn", "off")
CHECK_NAMES = JUDGED  # what health.severity may set: the judged checks of the catalog (checkcatalog.py)
# A GPU of a job whose mean utilisation stays below this is idle: report.idle_threshold_pct's default,
# the report query's, and the threshold the central rollups are built with (central/rollups.py); a
# report at another threshold reads the records instead of the rollups.
IDLE_THRESHOLD_PCT = 5.0


_Check = Callable[[Any], Optional[str]]  # a key's validator: an error text or None


class Key(NamedTuple):
    type: Any  # python type or tuple of types
    default: Any
    doc: str
    check: Optional[_Check] = None  # returns an error text or None


def _rng(lo: Optional[float] = None, hi: Optional[float] = None) -> _Check:
    def check(v: Any) -> Optional[str]:
        if lo is not None and v < lo:
            return f"must be >= {lo}"
        if hi is not None and v > hi:
            return f"must be <= {hi}"
        return None
    return check


def _choice(*allowed: str) -> _Check:
    def check(v: Any) -> Optional[str]:
        return None if v in allowed else "must be one of " + ", ".join(repr(a) for a in allowed)
    return check


def _int_list(v: Any) -> Optional[str]:
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1000 for x in v):
        return "must be a list of XID numbers (integers 0..999)"
    return None


def _severity_table(v: Any) -> Optional[str]:
    for k, s in v.items():
        if k not in CHECK_NAMES:
            return f"unknown check {k!r} (known: {', '.join(CHECK_NAMES)})"
        if s not in SEVERITIES:
            return f"check {k!r}: severity must be one of fail, warn, off"
    return None


def _xid_source(v: Any) -> Optional[str]:
    if v in ("kmsg", "journal", "none") or (v.startswith("file:") and len(v) > 5):
        return None
    return "must be 'kmsg', 'journal', 'none' or 'file:/path/to/log'"


def _central_url(v: Any) -> Optional[str]:
    """The URL's form only (scheme, no password); connecting is central.server's business."""
    if not v:
        return None
    from urllib.parse import urlsplit
    try:
        u = urlsplit(v)
    except ValueError as e:
        return f"is not a URL ({e})"
    if u.scheme not in ("mysql", "mariadb"):
        return "must start with mysql:// or mariadb:// (MariaDB/MySQL is the supported server)"
    if u.password is not None:
        return "must not contain a password (put it in central.password_file, mode 600)"
    if not u.username or not u.path.strip("/"):
        return "must name a user and a database: mysql://USER@HOST[:PORT]/DATABASE"
    return None


def _str_map(v: Any) -> Optional[str]:
    if not all(isinstance(k, str) and isinstance(x, str) and x for k, x in v.items()):
        return "must map GPU names to non-empty Slurm type strings"
    return None


def _abs_path_or_empty(v: Any) -> Optional[str]:
    if v and not v.startswith("/"):
        return "must be an absolute path, or empty for off"
    return None


def _command(v: Any) -> Optional[str]:
    if not v or not all(isinstance(x, str) and x for x in v):
        return "must be a non-empty list of non-empty strings (the program first)"
    return None


def _one_line(v: Any) -> Optional[str]:
    if len(v) > 500 or any(ord(c) < 32 or ord(c) == 127 for c in v):
        return "must be one line of at most 500 characters"
    return None


def _names(v: Any) -> Optional[str]:
    if not all(isinstance(x, str) and x and x.strip() == x and "," not in x for x in v):
        return "must be a list of names (non-empty strings without commas or spaces around them)"
    return None


def _host_port_or_empty(v: Any) -> Optional[str]:
    if not v:
        return None
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "must be HOST:PORT (e.g. 'mailrelay.example.org:25'), or empty for mail_command"
    return None


# section -> key -> Key ; section "" is the top level.
SCHEMA: Dict[str, Dict[str, Key]] = {
    "": {
        "cluster_name": Key(str, "", "Cluster name recorded with every job; default: SLURM_CLUSTER_NAME, else ClusterName from slurm.conf."),
        "nvml_library": Key(str, "", "Absolute path of libnvidia-ml.so.1 for non-standard driver installs; empty: the system loader finds it."),
        "nvidia_version_file": Key(str, "/proc/driver/nvidia/version", "Where the loaded kernel module states its version; a driver/library mismatch (nvmlInit: LIB_RM_VERSION_MISMATCH) names the version read here."),
        "nvml_timeout_s": Key(float, 5.0, "Deadline for each NVML call made for a check; a call that takes longer makes that GPU FAIL.", _rng(0.1, 300)),
        "slurm_backend": Key(str, "auto", "How to talk to Slurm: 'cli' (scontrol/sinfo/sacct), 'pyslurm', or 'auto' (pyslurm when importable, built for the running Slurm and a verified pair, else cli).", _choice("auto", "cli", "pyslurm")),
        "slurm_conf": Key(str, "/etc/slurm/slurm.conf", "slurm.conf (with gres.conf beside it) that maps Slurm's GPU indices to devices when SLURM_CONF is not set; slurmd always sets it for the hooks."),
        "slurm_bin_dir": Key(str, "", "Directory holding scontrol/sinfo/sacct; empty: search PATH, /usr/bin, /usr/local/bin, /opt/slurm/bin (hooks run without PATH)."),
        "slurm_timeout_s": Key(float, 10.0, "Timeout for every Slurm command or RPC.", _rng(1, 600)),
        "slurm_max_nodes": Key(int, 1024, "Most nodes one `slurm-gpu drain` or `resume` may name (hostlists counted as written, before they are expanded); more is refused before Slurm is contacted. `--max-nodes N` raises it for one run.", _rng(1, 1 << 20)),
    },
    "health": {
        "expected_gpu_count": Key(int, 0, "Number of GPUs this node must show; 0: take it from the GPUs Slurm configured (gres), else do not check.", _rng(0, 64)),
        "required_driver_version": Key(str, "", "Driver version every node must run (e.g. '550.54.15'); a prefix such as '550.' matches a branch; empty: not checked."),
        "max_temperature_c": Key(int, 87, "GPU temperature at or above which the GPU FAILs (H100/H200 slow down near 87-90 C).", _rng(30, 120)),
        "max_retired_pages": Key(int, 60, "Retired pages (SBE + DBE) above which a GPU FAILs (pre-Ampere page retirement; NVIDIA's RMA guidance is 60).", _rng(0, 10000)),
        "idle_memory_used_mib": Key(int, 1024, "Memory used on a GPU that should be idle, above which it is reported as leaked GPU memory.", _rng(0, 1 << 20)),
        "clock_event_mask": Key(int, 0x8 | 0x40 | 0x80, "Clock event reason bits that count as a hardware fault (default HwSlowdown|HwThermalSlowdown|HwPowerBrakeSlowdown = 0xC8).", _rng(0, 0xFFFFFFFFFFFFFFFF)),
        "power_cap_tolerance_pct": Key(float, 5.0, "How far (percent) the enforced power limit may sit below the board's default before power_cap WARNs.", _rng(0, 100)),
        "stuck_clocks_busy_pct": Key(float, 50.0, "Epilog: a job's mean GPU utilisation (driver accounting) from which its GPUs' clocks are judged for stuck_clocks.", _rng(0, 100)),
        "stuck_clocks_ratio_pct": Key(float, 50.0, "Epilog: an SM clock under this percent of its maximum at the end of a busy job, with no clock event reason, is recorded as stuck_clocks.", _rng(1, 100)),
        "stuck_clocks_recent_s": Key(float, 86400.0, "How long healthcheck and `check` WARN on a stuck_clocks event an epilog recorded (seconds).", _rng(0, 90 * 86400)),
        "severity": Key(dict, {}, "Per-check severity override: {check = 'fail'|'warn'|'off'}; checks: " + ", ".join(CHECK_NAMES) + ".", _severity_table),
    },
    "xid": {
        "source": Key(str, "kmsg", "Where to read NVIDIA XID events: 'kmsg' (/dev/kmsg), 'journal' (journalctl -k), 'file:/path' or 'none'.", _xid_source),
        "window_s": Key(int, 3600, "Only XIDs newer than this many seconds count (an old XID must not drain a node forever).", _rng(1, 30 * 86400)),
        "ignore": Key(list, [13, 31, 43, 45], "Application-caused XIDs that are never a node fault.", _int_list),
        "critical": Key(list, [48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140], "XIDs that make a GPU FAIL; any other XID not ignored is a WARN.", _int_list),
    },
    "hooks": {
        "prolog_deadline_s": Key(float, 30.0, "Wall-clock budget of the prolog; keep below Slurm's PrologEpilogTimeout (PrologTimeout from 25.05).", _rng(1, 3600)),
        "epilog_deadline_s": Key(float, 60.0, "Wall-clock budget of the epilog; keep below Slurm's PrologEpilogTimeout (EpilogTimeout from 25.05).", _rng(1, 3600)),
        "epilog_ctld_deadline_s": Key(float, 60.0, "Wall-clock budget of `slurm-gpu-epilog-ctld` (EpilogSlurmctld), waiting for the nodes' records included; it always exits 0.", _rng(1, 3600)),
        "fail_open": Key(bool, True, "On an internal error (a bug, not a GPU fault) log it and let the job run (true) or fail the hook (false)."),
        "drain_on_fault": Key(bool, True, "Drain the node through Slurm when a job's GPU FAILs (else only exit non-zero)."),
        "reset_clocks": Key(bool, True, "Reset application and locked clocks in prolog and epilog."),
        "reset_power_limit": Key(bool, False, "Prolog: put a power limit capped below the board's default back to the default (nvmlDeviceSetPowerManagementLimit), as it resets clocks; off: only the power_cap WARN."),
        "persistence_mode": Key(bool, True, "Turn persistence mode on in the prolog."),
        "accounting_mode": Key(bool, True, "Turn per-process accounting on and clear old PIDs in the prolog."),
        "kill_leftovers": Key(bool, True, "Epilog terminates processes still running on the job's GPUs (TERM, grace, KILL)."),
        "kill_grace_s": Key(float, 5.0, "Seconds between TERM and KILL for leftover processes.", _rng(0, 300)),
        "healthcheck_lock_file": Key(str, "/run/slurm-gpu/healthcheck-%n.lock", "Per-node lock the runs of `healthcheck` and `drain --unhealthy` take turns on (%n: the node checked): slurmd starts HealthCheckProgram every interval even while the last run still goes; a run waits up to 10 s (a quarter of its deadline at most) for the one before, else leaves it to decide."),
    },
    "store": {
        "database": Key(str, "/var/lib/slurm-gpu/usage.db", "SQLite database of this node (%n: node name)."),
        "spool_dir": Key(str, "/var/lib/slurm-gpu/spool", "Records that could not be written wait here as JSON (mode 600) until a hook (at most 200 per epilog) or `slurm-gpu db ingest` takes them; a directory that is a symlink, not owned by root or writable by group/others is refused (%n: node name)."),
        "busy_timeout_s": Key(float, 10.0, "How long a writer waits for a locked database before spooling.", _rng(0, 600)),
    },
    "inventory": {
        "record_every_s": Key(int, 86400, "`healthcheck` records each GPU's inventory (versions, serial, ECC and remap counters, row-remapper histogram) in the node database when it changed, and at least this often when it did not; `db push` ships the history (docs/fleet.md).", _rng(60, 366 * 86400)),
    },
    "log": {
        "syslog": Key(bool, True, "Send hook decisions to syslog (facility daemon, ident slurm-gpu)."),
        "file": Key(str, "", "Also append hook decisions to this file (%n: node name); empty: no file."),
        "level": Key(str, "info", "Minimum level: debug, info, warning, error.", _choice("debug", "info", "warning", "error")),
    },
    "gres": {
        "type_naming": Key(str, "autodetect", "Slurm GPU Type= naming: 'autodetect' (as AutoDetect=nvml: lowercased name, spaces to '_') or 'short' (h100, a100, ...).", _choice("autodetect", "short")),
        "type_map": Key(dict, {}, "Explicit map from NVML device name to Slurm type, applied before type_naming.", _str_map),
        "template_dir": Key(str, "", "Site directory whose templates override the shipped ones; empty: shipped templates only."),
        "mig_minors_path": Key(str, "/proc/driver/nvidia-caps/mig-minors", "Driver file mapping MIG GPU/compute instances to /dev/nvidia-caps minors: `inventory` reads it for MIG GPUs, the hooks to find the MIG slice a Slurm GPU index names."),
        "cpu_topology_dir": Key(str, "/sys/devices/system/cpu", "Where `inventory` reads the CPU topology that turns GPU CPU affinity into Slurm core ids (Cores=); hyper-thread siblings count as one core. Unreadable: CPU ids are used as core ids."),
        "slurm_version": Key(str, "", "Slurm version whose AutoDetect MIG type names `gres-conf` writes (e.g. \"22.05.8\": up to 23.02.5 from memory rounded to GiB, from 23.02.6 the NVML profile); empty: ask `slurmd -V`, `sinfo -V`, `scontrol -V`. `--slurm-version` wins."),
    },
    "report": {
        "idle_threshold_pct": Key(float, IDLE_THRESHOLD_PCT, "A job's GPU whose mean utilisation stays below this is counted idle (`report --idle-threshold`).", _rng(0, 100)),
        "sources": Key(list, [], "Node databases or directories of *.db files that `slurm-gpu report` reads when --db is not given, or one central server ('central' for central.url, or mysql://USER@HOST/DB); empty: this node's store.database.",
                       lambda v: None if all(isinstance(x, str) and x for x in v) else "must be a list of non-empty paths"),
        "tz": Key(str, "utc", "Time zone of report calendar times and day/week/month groups: 'utc' or 'local' (`report --tz`).", _choice("utc", "local")),
    },
    "job_summary": {
        "field": Key(str, "AdminComment", "Where `slurm-gpu-epilog-ctld` and `central annotate` write each job's GPU summary in Slurm's accounting: 'AdminComment', or 'off'. An AdminComment another tool wrote is never overwritten.", _choice("AdminComment", "off")),
        "wait_s": Key(float, 20.0, "How long the controller epilog waits for every node's records to reach the central server before it writes a summary marked partial (`central annotate` completes it).", _rng(0, 3000)),
        "energy_tres": Key(bool, True, "Where Slurm lets sacctmgr set a finished job's TRES (25.11 and later), the controller epilog writes the job's GPU energy measured by slurm-gpu (joules, all its whole GPUs) into the job's `energy` TRES, so `sacct -o ConsumedEnergy` and sreport show it; never over an energy figure Slurm recorded itself, never for a summary that is partial or covers MIG slices."),
    },
    "central": {
        "url": Key(str, "", "The cluster's SQL server that `slurm-gpu db push` ships this node's records to and `report --db central` reads, and where `slurm-gpu remediate` reads a GPU's remediation attempts on every node (its budgets follow its serial, docs/remediation.md), e.g. 'mysql://slurm_gpu_writer@dbhost/slurm_gpu' (MariaDB/MySQL; '?unix_socket=PATH' for a local socket). No password here: see password_file. Empty: no central server.", _central_url),
        "password_file": Key(str, "/etc/slurm-gpu/central.password", "File holding the password of the account in url (one line). Refused unless a regular file owned by root (or by the user running the command) and unreadable by group and others (chmod 600)."),
        "timeout_s": Key(float, 10.0, "Timeout of connecting to the central server and of each read and write; a server that is down, unreachable or hung makes `db push` give up with one line after about this long (and `remediate` go on with this node's remediation rows).", _rng(1, 600)),
        "batch_size": Key(int, 2000, "Records per upsert statement of `db push`.", _rng(1, 100000)),
        "query_timeout_s": Key(float, 600.0, "Longest a report (`report --db mysql://...`) or `central annotate` waits for one answer of the server: a report over 10 million records takes tens of seconds.", _rng(1, 86400)),
    },
    "metrics": {
        "textfile_dir": Key(str, "", "Directory of node_exporter's textfile collector (`--collector.textfile.directory`) that the prolog, the epilog and `healthcheck` write `slurm_gpu_*.prom` files into, created if missing (%n: node name); empty: no metrics. See docs/prometheus.md.", _abs_path_or_empty),
        "dcgm_job_mapping_dir": Key(str, "", "dcgm-exporter's `--hpc-job-mapping-dir`: the prolog adds the job id to the file of each GPU it holds (`<index>`, `<index>.<GPU instance>` for a MIG slice), the epilog removes it, so dcgm-exporter labels GPU metrics `hpc_job` (%n: node name); empty: off.", _abs_path_or_empty),
        "by_account": Key(bool, True, "Usage counters (GPU-seconds allocated and used, energy) by account; false: one node total without the account label."),
        "max_accounts": Key(int, 100, "Most accounts with a usage series of their own on a node; the rest are summed into account=\"other\".", _rng(1, 10000)),
    },
    "job": {
        "idle_pct": Key(float, 5.0, "`slurm-gpu job`: a GPU whose mean utilisation over the job stays below this was idle (note: request fewer GPUs).", _rng(0, 100)),
        "low_util_pct": Key(float, 25.0, "`slurm-gpu job`: mean utilisation of the used GPUs below this gets the low-utilisation note.", _rng(0, 100)),
        "small_memory_fraction": Key(float, 0.25, "`slurm-gpu job`: a peak memory below this fraction of the GPU's memory gets the note that a smaller GPU or a MIG slice would do; 0: never.", _rng(0, 1)),
        "min_runtime_s": Key(int, 300, "`slurm-gpu job`: a job that ran shorter than this is too short to judge: no utilisation or memory advice.", _rng(0, 30 * 86400)),
        "site_note": Key(str, "", "`slurm-gpu job`: a line of the site's own shown under every job's notes, e.g. 'GPU efficiency guide: https://...'; empty: none.", _one_line),
    },
    "efficiency": {
        "sample_every_s": Key(float, 60.0, "How often the site's timer runs `slurm-gpu efficiency run` (or `sample`) on each GPU node (deploy/systemd/slurm-gpu-efficiency.timer; cron: every minute). The policy reads it: a job's samples further apart than 3x this leave a gap that no idle window spans (an unknown minute is never counted idle).", _rng(1, 3600)),
        "decide_on": Key(str, "node", "Where jobs are judged: 'node' (each node's `efficiency run` judges the jobs that run on it alone; `efficiency enforce --db central` on a controller or login node judges the jobs on several nodes) or 'central' (`efficiency enforce --db central` judges every job; the nodes only sample). Without a central server only 'node' works, and jobs on several nodes are never judged.", _choice("node", "central")),
        "idle_util_pct": Key(float, 0.0, "A GPU is idle in a sample when its utilisation (nvmlDeviceGetUtilizationRates: percent of the last sample period a kernel ran) is at most this.", _rng(0, 100)),
        "idle_memory_mib": Key(int, 0, "...and, when above 0, when its memory used is at most this many MiB (a job that holds its data on the GPU is not idle); 0: memory does not count.", _rng(0, 1 << 24)),
        "grace_s": Key(float, 900.0, "Seconds after the job started on the node before its samples count: loading data and compiling are not idleness.", _rng(0, 30 * 86400)),
        "notify_after_s": Key(float, 3600.0, "A batch job whose GPUs (all of them, on all its nodes) stayed idle this long gets one mail; a job with some GPUs idle this long and others busy gets one advice mail (never a cancel); 0: no mail.", _rng(0, 30 * 86400)),
        "cancel_after_s": Key(float, 0.0, "A batch job idle this long is cancelled through Slurm (scancel), if its user was mailed at least cancel_after_s - notify_after_s before (a mail that could not be delivered holds the cancel back); must be above notify_after_s; 0: never cancel.", _rng(0, 30 * 86400)),
        "interactive_notify_after_s": Key(float, 3600.0, "notify_after_s for interactive jobs (salloc, srun without sbatch: Slurm's BatchFlag=0); 0: no mail.", _rng(0, 30 * 86400)),
        "interactive_cancel_after_s": Key(float, 0.0, "cancel_after_s for interactive jobs; 0: never cancelled.", _rng(0, 30 * 86400)),
        "exempt_accounts": Key(list, [], "Accounts whose jobs are mailed at most, never cancelled.", _names),
        "exempt_partitions": Key(list, [], "Partitions whose jobs are mailed at most, never cancelled.", _names),
        "exempt_qos": Key(list, [], "QOS whose jobs are mailed at most, never cancelled.", _names),
        "exempt_users": Key(list, [], "Users whose jobs are mailed at most, never cancelled.", _names),
        "max_mails_per_user_per_day": Key(int, 5, "Most mails one user gets from slurm-gpu in 24 hours; past it a stage is recorded as 'capped' and not mailed (and a job whose warning was not mailed is not cancelled).", _rng(0, 1000)),
        "mail_from": Key(str, "", "Sender address of the mails; empty: slurm-gpu@ and this host's name.", _one_line),
        "mail_domain": Key(str, "", "A job without Slurm's MailUser is mailed to USER@mail_domain; empty: to the bare user name (what Slurm's MailProg gets), which only mail_command can deliver.", _one_line),
        "smtp_server": Key(str, "", "HOST:PORT of the SMTP server the mails go to (plain SMTP, as to a site's relay); empty: mail_command.", _host_port_or_empty),
        "mail_command": Key(list, ["mail", "-s", "{subject}", "{to}"], "Used when smtp_server is empty: the program and its arguments, run without a shell, the message body on its standard input ({subject}, {to}); Slurm's MailProg takes the same arguments.", _command),
        "mail_retry_s": Key(float, 300.0, "A mail that failed (server down, command failed) is tried again after this many seconds, by a later run; each try is logged.", _rng(0, 86400)),
        "job_url": Key(str, "", "A link in every mail, e.g. 'https://ood.example.org/pun/sys/jobstats?jobid={job_id}' (Open OnDemand) or a Grafana dashboard; {job_id}, {cluster}, {user}; empty: none.", _one_line),
        "live_summary_every_s": Key(float, 300.0, "Whoever judges a running job (its node, or the central run) also writes its GPU figures so far, with the last hour per GPU, into its AdminComment this often, so that `slurm-gpu job JOBID` shows a running job to whom Slurm shows the job; never over another tool's AdminComment; 0 or job_summary.field = 'off': never.", _rng(0, 86400)),
        "samples_fine_s": Key(float, 3600.0, "A running job's samples keep their full resolution this long; older ones are merged into one row per 10 minutes and GPU.", _rng(60, 30 * 86400)),
        "samples_keep_days": Key(float, 14.0, "Samples older than this many days are deleted (a job that runs longer keeps its last samples_keep_days).", _rng(0, 3650)),
        "samples_max_mb": Key(float, 64.0, "Cap of the samples in the node database (rows x 215 bytes, measured in benchmarks/bench_efficiency.py); past it the oldest coarse rows go first, then the oldest fine ones. A node busy all the time fills about 1.3 MB per 1,000 GPU-hours.", _rng(1, 1 << 20)),
    },
    "remediation": {
        "enabled": Key(bool, False, "`healthcheck` (HealthCheckProgram) also runs `slurm-gpu remediate` on this node after its check: a node drained by slurm-gpu, idle, is reset, rebooted through Slurm or marked for RMA by the fault -> remedy map (docs/remediation.md). Off: only `slurm-gpu remediate` run by an admin or a timer acts."),
        "reset_command": Key(list, ["nvidia-smi", "--gpu-reset", "-i", "{pci_bus_id}"], "The GPU reset, as an argument list run without a shell; {pci_bus_id} and {index} become the GPU's, %n the node name. Exit 0 is a done reset.", _command),
        "reset_timeout_s": Key(float, 120.0, "Deadline of one reset command; one that overruns is killed and counts as a failed reset.", _rng(1, 3600)),
        "verify_passes": Key(int, 2, "How many full healthchecks in a row must pass after a reset (or the reboot) before the node is resumed.", _rng(1, 20)),
        "verify_interval_s": Key(float, 10.0, "Seconds between the verification passes.", _rng(0, 3600)),
        "max_resets_per_gpu_per_day": Key(int, 2, "Resets one GPU (by serial) may get in 24 hours; one more is escalated to a reboot.", _rng(0, 100)),
        "max_reboots_per_node_per_day": Key(int, 1, "Reboots `remediate` may ask Slurm for per node in 24 hours; past it the node stays drained for a human.", _rng(0, 100)),
        "lemon_window_days": Key(float, 30.0, "A GPU (by serial) that faults again within this many days after lemon_remedies remedies is an RMA case (a lemon).", _rng(0, 3650)),
        "lemon_remedies": Key(int, 3, "Remedies (resets and reboots that were verified) within lemon_window_days after which the next fault of the GPU is an RMA.", _rng(1, 100)),
        "lemon_xid_bursts": Key(int, 3, "A GPU whose kernel log shows this many separate bursts (more than xid.window_s apart) of hardware XIDs (NVIDIA's hardware, memory and NVLink classes among xid.critical) within lemon_window_days, and faults again, is an RMA case; 0: XIDs are not counted.", _rng(0, 1000)),
        "clock_slack_s": Key(float, 60.0, "How far this node's clock may differ from slurmctld's (sdiag's time), either way, before `remediate` refuses to reset, reboot or resume the node (one log line, the slurm_gpu_clock_skew_seconds gauge): drain ages, budget windows and attempt times are all taken on slurmctld's clock, so moving a node's clock cannot reset a budget.", _rng(1, 86400)),
        "lock_file": Key(str, "/run/slurm-gpu/remediate-%n.lock", "Per-node lock held while `remediate` acts (%n: node name): a second run on the node finds it held and leaves."),
    },
    "breaker": {
        "max_drained_pct": Key(float, 10.0, "Circuit breaker (docs/remediation.md): the prolog (except its hardware gate), epilog, healthcheck and `remediate` stop draining a node for a check (and `remediate` stops asking for reboots) once this share of the node's partition is drained by slurm-gpu for that check within window_s; one node per partition and window may always go; 100: off. Why 10: independent GPU faults hit well under 1 % of nodes a day (Llama 3: about 8 interruptions a day on 2,048 nodes), so 10 % failing one check within the window is a common cause (driver rollout, kernel-log storm, our bug), and it is about the spare capacity sites keep (NCSA Delta: 5-20 %).", _rng(1, 100)),
        "window_s": Key(float, 3600.0, "Seconds a drain for a check counts against the breaker (by Slurm's ReasonTime). Why an hour: a rollout or a log storm reaches many nodes within minutes, and a window much longer than the time an admin needs to look would keep a real second fault waiting; past it at most max_drained_pct more nodes per window may go.", _rng(60, 7 * 86400)),
        "settle_s": Key(float, 2.0, "Seconds a node waits after its drain for a check before it counts again and withdraws the drain when nodes drained before it (by Slurm's ReasonTime, then name) already fill the share: nodes that decide at the same moment (slurmctld runs every HealthCheckProgram at once) cannot all see each other's drains first. At least 1 s makes it exact (ReasonTime has whole seconds); 0: no second count (the share may then be passed by nodes deciding together).", _rng(0, 60)),
    },
    "verify": {
        "enabled": Key(bool, False, "After a reset or a reboot, `remediate` runs a verification job through Slurm before it resumes the node: the node is held in a maintenance reservation of its own (slurm-gpu-verify-NODE), resumed, and a batch job holding all its GPUs runs `slurm-gpu battery` (DCGM diag, nccl-tests, the site's commands); a failure or a timeout drains it again (docs/remediation.md, \"Verification job\"). Off: the healthcheck passes alone decide."),
        "dcgm_level": Key(int, 2, "`dcgmi diag -r LEVEL`: 1 takes seconds, 2 about two minutes, 3 about a quarter of an hour, 4 longer (DCGM's documentation); keep timeout_s above it.", _rng(1, 4)),
        "dcgmi": Key(str, "dcgmi", "DCGM's command-line tool, a name looked up in PATH or an absolute path; not found: the DCGM part of the battery is skipped (one line in the result)."),
        "nccl_command": Key(list, ["all_reduce_perf", "-b", "8M", "-e", "256M", "-f", "2", "-g", "{gpus}"], "nccl-tests' all_reduce_perf as an argument list run without a shell ({gpus}: the node's GPU count); the bus bandwidth of its largest message size is compared with nccl_min_busbw_gbps, and any #wrong value fails. Not found, or a node with one GPU: skipped; []: off.",
                          lambda v: None if all(isinstance(x, str) and x for x in v) else "must be a list of non-empty strings (the program first), or [] for off"),
        "nccl_min_busbw_gbps": Key(dict, {}, "Floor of all_reduce_perf's bus bandwidth (GB/s, out-of-place, largest message) per GPU model name as NVML reports it, e.g. {\"NVIDIA H100 80GB HBM3\" = 350.0}; a model not listed: the run must only succeed.",
                                    lambda v: None if all(isinstance(k, str) and k and isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1e6 for k, x in v.items()) else "must map GPU model names to a bus bandwidth in GB/s (a positive number)"),
        "commands": Key(list, [], "The site's own checks, each an argument list run without a shell inside the verification job (e.g. [[\"/opt/site/gpu-burn\", \"60\"]]); exit 0 passes. A battery with nothing to run (no dcgmi, no all_reduce_perf, no commands) fails closed.",
                       lambda v: None if all(isinstance(c, list) and c and all(isinstance(x, str) and x for x in c) for c in v) else "must be a list of commands, each a non-empty list of non-empty strings (the program first)"),
        "start_timeout_s": Key(float, 120.0, "The verification job must start within this many seconds after it was submitted; otherwise it is cancelled and the node drained again (the node refuses jobs).", _rng(5, 3600)),
        "timeout_s": Key(float, 1800.0, "Deadline of the whole battery once the job runs (each tool gets what is left); a job that overruns is cancelled and the node drained again.", _rng(10, 7 * 86400)),
        "partition": Key(str, "", "Partition of the verification job; empty: the partitions the node is in."),
    },
    "fleet": {
        "reserve_pct": Key(float, 20.0, "`fleet capacity`: share of each partition's GPUs (per GPU model) that should stay healthy and idle to absorb failures; the reserve holds when at least ceil(total x reserve_pct / 100) GPUs are idle and not drained or down.", _rng(0, 100)),
        "expected_cuda_version": Key(str, "", "`fleet versions`: CUDA version (as the driver reports it, e.g. '12.4') every node must show; a prefix ending in '.' matches a branch; empty: not pinned. The driver is pinned by health.required_driver_version."),
        "expected_vbios": Key(dict, {}, "`fleet versions`: VBIOS version per GPU model name as NVML reports it, e.g. {\"NVIDIA H100 80GB HBM3\" = \"96.00.74.00.01\"}; a model not listed is not pinned.",
                              lambda v: None if all(isinstance(k, str) and isinstance(x, str) and x for k, x in v.items()) else "must map GPU model names to non-empty VBIOS version strings"),
        "xid_storm_window_s": Key(float, 600.0, "`fleet xids`: the same XID first seen on xid_storm_min_nodes nodes within this many seconds is one fleet event (a storm: a rollout or one job, not broken GPUs).", _rng(1, 86400)),
        "xid_storm_min_nodes": Key(int, 3, "`fleet xids`: how many nodes with the same XID within xid_storm_window_s make a storm.", _rng(2, 100000)),
    },
}


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


def metrics_enabled(cfg: Any) -> bool:
    """Are metrics on (metrics.textfile_dir or metrics.dcgm_job_mapping_dir set)?  The one answer: the
    hooks ask it before importing anything of slurm_gpu.metrics."""
    try:
        return bool(cfg.get("metrics", "textfile_dir") or cfg.get("metrics", "dcgm_job_mapping_dir"))
    except (KeyError, AttributeError):  # a stand-in config without the section
        return False


if TYPE_CHECKING:
    from slurm_gpu.configtypes import Sections as _Typed  # each section and key with its type, for mypy
else:
    _Typed = object


class Config(_Typed):
    """Validated configuration: ``cfg.health.max_temperature_c`` (typed: slurm_gpu/configtypes.py,
    generated from SCHEMA) or ``cfg.get("health", "max_temperature_c")`` (Any: for a key named at
    run time)."""

    def __init__(self, values: Mapping[str, Mapping[str, Any]], path: Optional[str] = None,
                 node: Optional[str] = None):
        self._values = {s: dict(v) for s, v in values.items()}
        self.path = path
        self.node = node  # the node %n names; None: node_name() (SLURMD_NODENAME, else the host name)

    def for_node(self, node: str) -> "Config":
        """The same values with %n naming `node` (a command's --node-name: its lock, its database, its log)."""
        return Config(self._values, self.path, node)

    def get(self, section: str, key: str) -> Any:
        return self._values[section][key]

    def path_value(self, section: str, key: str) -> str:
        """A path value with %n expanded to the node name."""
        return str(self.get(section, key)).replace("%n", self.node or node_name())

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return _Section(values[name])
        if name in values.get("", {}):
            return values[""][name]
        raise AttributeError(name)

    def replace(self, section: str, **kw: Any) -> "Config":
        vals = {s: dict(v) for s, v in self._values.items()}
        vals[section].update(kw)
        return Config(vals, self.path, self.node)

    def as_dict(self) -> Dict[str, Dict[str, Any]]:
        return {s: dict(v) for s, v in self._values.items()}


class _Section:
    def __init__(self, d: Dict[str, Any]):
        self._d = d

    def __getattr__(self, name: str) -> Any:
        try:
            return self._d[name]
        except KeyError:
            raise AttributeError(name) from None


def defaults() -> Config:
    return Config({s: {k: _copy(key.default) for k, key in keys.items()} for s, keys in SCHEMA.items()})


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


def _type_ok(v: Any, t: Any) -> bool:
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, t)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list", dict: "a table"}


def validate(data: Mapping[str, Any], path: str, errors: Optional[List[ConfigError]] = None) -> Config:
    """Check every key against SCHEMA.

    Strict (``errors`` is None, every command): the first problem raises ConfigError.
    Lenient (a list, the hooks only): each problem is appended and that key keeps its default,
    so a typo in one key does not switch gating and accounting off.
    """
    cfg = defaults().as_dict()
    for section, key, val in _entries(data, path, errors):
        try:
            cfg[section][key] = _checked(section, key, val, path, errors)
        except ConfigError as e:
            _report(e, errors)
    return Config(cfg, path)


_UNKNOWN_HINT = "see docs/config.md for the keys this version knows"


def _report(e: ConfigError, errors: Optional[List[ConfigError]]) -> None:
    if errors is None:
        raise e
    errors.append(e)


def _entries(data: Mapping[str, Any], path: str, errors: Optional[List[ConfigError]]) -> Iterator[Tuple[str, str, Any]]:
    """(section, key, value) of every known key, in file order; unknown keys are reported."""
    for name, v in data.items():
        if name in SCHEMA and name != "" and isinstance(v, dict):
            section, items = name, v
        elif name in SCHEMA[""]:
            section, items = "", {name: v}
        else:
            _report(ConfigError(f"{path}: unknown key '{name}'", _UNKNOWN_HINT), errors)
            continue
        for key, val in items.items():
            if key in SCHEMA[section]:
                yield section, key, val
            else:
                dotted = f"{section}.{key}" if section else key
                _report(ConfigError(f"{path}: unknown key '{dotted}'", _UNKNOWN_HINT), errors)


def _checked(section: str, key: str, val: Any, path: str, errors: Optional[List[ConfigError]]) -> Any:
    spec = SCHEMA[section][key]
    dotted = f"{section}.{key}" if section else key
    if not _type_ok(val, spec.type):
        raise ConfigError(f"{path}: key '{dotted}' must be {_TYPE_NAMES.get(spec.type, spec.type)}, got {val!r}",
                          f"default is {spec.default!r}")
    if spec.type is float:
        number = _finite(val)
        if number is None:  # nan passes every range check (all comparisons are false)
            raise ConfigError(f"{path}: key '{dotted}' must be a finite number (got {val!r})", f"default is {spec.default!r}")
        val = number
    problem = spec.check(val) if spec.check else None
    if problem and errors is not None and isinstance(val, dict):
        return _good_entries(spec, val, dotted, path, errors)
    if problem:
        raise ConfigError(f"{path}: key '{dotted}' {problem} (got {_shown(val)!r})", f"default is {spec.default!r}")
    return val


def _shown(val: Any) -> Any:
    """A value for an error message: a password in a URL (user:secret@host) is never printed."""
    if isinstance(val, str) and "://" in val and "@" in val:
        scheme, _, rest = val.partition("://")
        creds, at, host = rest.rpartition("@")
        if at and ":" in creds:
            return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return val


def _finite(val: Any) -> Optional[float]:
    try:
        f = float(val)
    except OverflowError:  # a TOML integer with hundreds of digits
        return None
    return f if math.isfinite(f) else None


def _good_entries(spec: Key, table: Dict[str, Any], dotted: str, path: str, errors: List[ConfigError]) -> Dict[str, Any]:
    """Lenient tables keep their valid entries: one misspelt check must not undo the other overrides."""
    kept = {}
    for k, v in table.items():
        problem = spec.check({k: v}) if spec.check else None
        if problem:
            errors.append(ConfigError(f"{path}: key '{dotted}' {problem} (got {{{k!r}: {v!r}}})", "that entry is ignored"))
        else:
            kept[k] = v
    return kept


def _check_ownership(path: str, st: os.stat_result) -> None:
    """Hooks run as root: a config file others can write would let them steer root's actions."""
    if os.geteuid() != 0:
        return
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid != 0:
        raise ConfigError(
            f"{path}: refusing a config file writable by non-root users (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
            f"chown root:root {path} && chmod 644 {path}",
        )


def resolve_path(explicit: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], bool]:
    """Return (path, must_exist)."""
    env = os.environ if env is None else env
    if explicit:
        return explicit, True
    if env.get("SLURM_GPU_CONFIG"):
        return env["SLURM_GPU_CONFIG"], True
    if env.get("SLURM_CONF"):
        beside = os.path.join(os.path.dirname(env["SLURM_CONF"]), "slurm-gpu.toml")
        if os.path.exists(beside):
            return beside, True
    return DEFAULT_PATH, False


def _toml_loads(text: str) -> Dict[str, Any]:
    import tomllib  # lazily: only a hook that finds a config file pays for it
    return tomllib.loads(text)


_MAX_BYTES = 1 << 20  # a config is a few KiB; anything this big is not ours


def load(explicit: Optional[str] = None, env: Optional[Mapping[str, str]] = None, *, lenient: bool = False) -> Any:
    """The validated Config; ConfigError names the file and the key.

    ``lenient=True`` (the prolog/epilog only) returns ``(Config, [ConfigError, ...])``: a file
    that parses as TOML but has bad keys gives their defaults plus the list of errors. A file
    that cannot be read or parsed still raises.
    """
    path, must_exist = resolve_path(explicit, env)
    assert path is not None
    raw = _read(path, must_exist)
    if raw is None:
        return (defaults(), []) if lenient else defaults()
    data = _parse(raw, path)
    if not lenient:
        return validate(data, path)
    errors: List[ConfigError] = []
    return validate(data, path, errors), errors


def _read(path: str, must_exist: bool) -> Optional[bytes]:
    """The file's bytes; None for a missing default file."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (the hook would hang); it is
        # refused below like any other file that is not a regular one.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(f"config file {path} does not exist", "create it or drop --config / SLURM_GPU_CONFIG") from None
        return None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}", "check its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"config file {path} is not a regular file", "point it at a TOML file")
        _check_ownership(path, st)
        raw = _read_all(fd)
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}", "check the file and its disk") from None
    finally:
        os.close(fd)
    if len(raw) > _MAX_BYTES:
        raise ConfigError(f"config file {path} is larger than {_MAX_BYTES} bytes", "point it at the TOML config file")
    return raw


def _read_all(fd: int) -> bytes:
    chunks: List[bytes] = []
    size = 0
    while size <= _MAX_BYTES:
        chunk = os.read(fd, _MAX_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, path: str) -> Dict[str, Any]:
    try:
        return _toml_loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text", "save the file as UTF-8") from None
    except Exception as e:  # tomllib.TOMLDecodeError, int-digit limits
        raise ConfigError(f"{path}: invalid TOML: {e}", "check the syntax at the line named") from None


def reference_markdown() -> str:
    """The config reference, generated from SCHEMA (docs/config.md embeds it; a test keeps them equal)."""
    lines: List[str] = []
    for section, keys in SCHEMA.items():
        lines.append(f"### `[{section}]`" if section else "### Top level")
        lines.append("")
        lines.append("| key | type | default | meaning |")
        lines.append("| --- | --- | --- | --- |")
        for k, spec in keys.items():
            tname = getattr(spec.type, "__name__", str(spec.type))
            default = spec.default
            if isinstance(default, str):
                default = f'"{default}"'
            elif isinstance(default, bool):
                default = str(default).lower()
            elif k == "clock_event_mask":
                default = hex(default)
            lines.append(f"| `{k}` | {tname} | `{default}` | {spec.doc} |")
        lines.append("")
    return "\n".join(lines)


_TYPE_SPELLING = {str: "str", int: "int", float: "float", bool: "bool", list: "List[Any]", dict: "Dict[str, Any]"}


def _class_name(section: str) -> str:
    return "".join(part.capitalize() for part in section.split("_"))


def types_source() -> str:
    """slurm_gpu/configtypes.py, generated from SCHEMA: one class per section whose attributes
    are the section's keys with their types, so that ``cfg.remediation.verify_passes`` is an
    int to mypy (Config takes these attributes under TYPE_CHECKING; at run time they are read
    through Config.__getattr__).  tests/test_config_env.py keeps the file equal to this."""
    out = ['"""The configuration\'s sections as types, for mypy only: generated from SCHEMA in',
           "slurm_gpu/config.py by `python -m slurm_gpu.config --types > slurm_gpu/configtypes.py`;",
           'never edit by hand (tests/test_config_env.py fails until the two agree)."""',
           "from __future__ import annotations", "", "from typing import Any, Dict, List", ""]
    for section, keys in SCHEMA.items():
        if not section:
            continue
        out += ["", f"class {_class_name(section)}:"]
        out += [f"    {k}: {_TYPE_SPELLING[spec.type]}" for k, spec in keys.items()]
        out.append("")
    out += ["", "class Sections:", '    """The whole file: the top-level keys, then one attribute per section."""', ""]
    out += [f"    {k}: {_TYPE_SPELLING[spec.type]}" for k, spec in SCHEMA[""].items()]
    out += [f"    {section}: {_class_name(section)}" for section in SCHEMA if section]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys
    print(types_source() if sys.argv[1:] == ["--types"] else reference_markdown(), end="")
