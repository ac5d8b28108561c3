"""`slurm-gpu fleet`: versions, memory, capacity, XIDs and remediation history across the fleet (docs/fleet.md).

Thin: options, where the data comes from (the central server or a directory of inventory
files; Slurm for partitions and node states), rendering and the exit code.  The views are
slurm_gpu.fleet.*.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import click

from slurm_gpu import render
from slurm_gpu.cli import apply_options, emit_output, output_file_option, output_options
from slurm_gpu.errors import ExitCode, InputError

FORMATS = render.FORMATS + ("html",)


def _source_options(f: Callable) -> Callable:
    opts = [
        click.option("--db", "db", metavar="URL", default=None,
                     help="The central server: mysql://USER@HOST[:PORT]/DATABASE, or 'central' for central.url "
                          "(docs/central.md). Default: central.url when set."),
        click.option("--password-file", metavar="PATH", default=None,
                     help="File with USER's password, mode 600 (default: central.password_file)."),
        click.option("--inventory-dir", metavar="DIR", default=None,
                     help="Read a directory of `slurm-gpu inventory --state` JSON files instead of a server "
                          "(the current state only: no trends, no XIDs)."),
        click.option("--cluster", "-M", metavar="NAME", default=None,
                     help="The cluster's records on the server (default: cluster_name, else the only one)."),
        click.option("--no-slurm", is_flag=True,
                     help="Do not ask Slurm for partitions (groups show partition '(unknown)')."),
        click.option("--progress/--no-progress", default=None,
                     help="Progress bar on stderr while reading inventory files (default: on a terminal)."),
        output_options(FORMATS, extra_help="csv/json carry every column; html: one self-contained page."),
        output_file_option(),
    ]
    return apply_options(f, opts)


def _since_option(default: str) -> Callable:
    return click.option("--since", "-S", default=default, show_default=True, metavar="TIME",
                        help="Start of the window: now-7days, 2026-11-01, yesterday, ... (as `report --since`).")


@click.group("fleet", context_settings={"help_option_names": ["-h", "--help"]})
def fleet() -> None:
    """The fleet view: versions, memory health, spare capacity, XIDs and remediations across all nodes.

    Reads the central server (`--db`, default central.url) or a directory of inventory
    files (`--inventory-dir`); partitions and node states come from Slurm. docs/fleet.md
    says what each view means and what to do about each finding.
    """


def _parse_since(spec: Optional[str], now: float) -> Optional[float]:
    if not spec:
        return None
    from slurm_gpu.report.timespec import parse_time
    return parse_time(spec, now_s=now, tz="utc", option="--since")


def _load(app: Any, o: Dict[str, Any], since: Optional[float], now: float, history: bool):
    """The Fleet (current GPUs, marks, history when asked) from the server or the inventory directory."""
    from slurm_gpu.fleet import model
    if o["inventory_dir"]:
        if o["db"]:
            raise InputError("--db and --inventory-dir exclude each other", "read the server or the files, not both")
        return _load_directory(o["inventory_dir"], o["progress"], now)
    from slurm_gpu.fleet import central as fc
    with _server(app, o) as (srv, cluster):
        gpus, marks = model.current(fc.latest(srv, cluster), now)
        hist = fc.history(srv, cluster, since if since is not None else 0.0, now) if history else None
        return model.Fleet(srv.target.describe() + (f" (cluster {cluster})" if cluster else ""), gpus, marks, hist,
                           mismatched=fc.mismatches(srv, cluster))


class _server:
    """The central server named by --db/central.url, in one consistent snapshot; (Central, cluster)."""

    def __init__(self, app: Any, o: Dict[str, Any]):
        self.app, self.o = app, o

    def __enter__(self):
        from slurm_gpu.central.server import Central
        from slurm_gpu.fleet import central as fc
        cfg = self.app.config
        url = None if self.o["db"] in (None, "central") else self.o["db"]
        if url is None and not cfg.central.url:
            raise InputError("no central server and no inventory directory",
                             "give --db mysql://USER@HOST/DB, set central.url, or use --inventory-dir DIR")
        self.srv = Central.from_config(cfg, url, self.o["password_file"], long_queries=True)
        try:
            fc.open_snapshot(self.srv)
            cluster = fc.choose_cluster(self.srv, self.o["cluster"] or cfg.cluster_name)
        except BaseException:
            self.srv.close()
            raise
        return self.srv, cluster

    def __exit__(self, *exc: Any) -> None:
        self.srv.rollback()
        self.srv.close()


def _load_directory(directory: str, progress: Optional[bool], now: float):
    from slurm_gpu.fleet import inventory, model
    paths = inventory.inventory_files(directory)
    show = sys.stderr.isatty() if progress is None else progress
    if show and paths:
        with click.progressbar(length=len(paths), label="reading inventories", file=sys.stderr) as bar:
            read = inventory.read_directory(paths, bar.update)
    else:
        read = inventory.read_directory(paths)
    current, more = model.current(read.gpus, now)
    fleet_data = model.Fleet(f"{directory} ({len(paths)} inventory files)", current, read.marks + more,
                             mismatched=read.mismatched)
    fleet_data.notes += read.notes
    if not paths:
        fleet_data.notes.append(f"{directory}: no *.json inventory files")
    return fleet_data


def _slurm_nodes(app: Any, o: Dict[str, Any]) -> Tuple[Optional[List[Any]], str]:
    """Slurm's nodes, or (None, why) — a view without partitions still says what it can."""
    if o.get("no_slurm"):
        return None, "--no-slurm"
    from slurm_gpu.errors import SlurmError
    from slurm_gpu.slurm.backend import get_backend
    try:
        return get_backend(app.config).nodes(), ""
    except SlurmError as e:
        return None, e.message


# Table and markdown headings where the column name read with spaces says less.
_HEADERS = {"drained_slurm_gpu": "drained (slurm-gpu)", "drained_admin": "drained (admin)", "reserve_pct": "reserve %"}


def _emit(o: Dict[str, Any], title: str, rows: List[Dict[str, Any]], columns: Sequence[str],
          table_columns: Sequence[str] = (), notes: Sequence[str] = (),
          flag: Optional[Callable[[Dict[str, Any]], bool]] = None) -> None:
    """Notes on stderr; the rows in the chosen format on stdout or --output."""
    fmt = o.get("fmt") or "table"
    for note in notes:
        click.echo(f"slurm-gpu: note: {note}", err=True)
    if fmt == "html":
        from slurm_gpu.fleet.html import page
        text = page(title, rows, columns, notes, flag)
    elif fmt in ("json", "csv"):
        text = render.render(rows, columns, fmt)
    else:
        cols = table_columns or columns
        text = render.render(rows, cols, fmt, headers=[_HEADERS.get(c, c.replace("_", " ")) for c in cols])
    emit_output(o.get("output"), text)


def _exit(failed: bool) -> None:
    if failed:
        sys.exit(int(ExitCode.UNHEALTHY))


@fleet.command("versions")
@_source_options
@click.pass_obj
def versions_cmd(app: Any, **o: Any) -> None:
    """Driver, CUDA and VBIOS versions per partition and GPU model.

    Shows each group's majority version, names every outlier node and every node whose
    GPUs disagree with each other, and every node that differs from a pinned version
    (health.required_driver_version, fleet.expected_cuda_version, fleet.expected_vbios), and
    every node whose kernel module and NVML library come from different driver versions (a
    "driver/library mismatch" row per partition, naming both versions: reboot those nodes).
    Exit 1 when any group is inconsistent, differs from a pinned version or has a mismatched
    node (for cron or CI), 0 when all agree.
    """
    from slurm_gpu.fleet import model, versions
    now = time.time()
    data = _load(app, o, None, now, history=False)
    model.with_slurm(data, *_slurm_nodes(app, o))
    cfg = app.config
    pins = versions.Pins(cfg.health.required_driver_version, cfg.fleet.expected_cuda_version,
                         cfg.fleet.expected_vbios)
    rows = versions.versions_view(data, pins)
    _emit(o, f"GPU versions: {data.source}", rows, versions.COLUMNS,
          ("partition", "model", "component", "nodes", "majority", "pinned", "status", "outliers", "off_pin",
           "gpus_disagree", "unknown"), _notes(data), lambda r: r["status"] != versions.CONSISTENT)
    _exit(versions.failing(rows))


def _notes(data: Any) -> List[str]:
    return [f"source: {data.source}"] + list(data.notes)


@fleet.command("memory")
@_since_option("now-7days")
@_source_options
@click.pass_obj
def memory_cmd(app: Any, since: Optional[str], **o: Any) -> None:
    """GPU memory health against NVIDIA's limits: RMA list, resets, ranked early warnings.

    Per GPU: row remaps (512 per GPU), banks with few or no spare rows (row-remapper
    histogram), pending remaps that need a GPU reset, retired pages (pre-A100), SRAM
    errors, and with --db the growth of correctable ECC errors since --since. Bad data
    (a node that never reported, a swapped GPU, a counter that went down) is listed as
    such, never as a trend. Exit 1 when a GPU meets NVIDIA's RMA criteria, else 0.
    """
    from slurm_gpu.fleet import memory, model
    now = time.time()
    start = _parse_since(since, now)
    data = _load(app, o, start, now, history=not o["inventory_dir"])
    model.with_slurm(data, *_slurm_nodes(app, o))
    if o["inventory_dir"]:
        data.notes.append("inventory files hold the current state only: no correctable-ECC growth rates")
    rows = memory.memory_view(data, app.config.health.max_retired_pages)
    _emit(o, f"GPU memory health: {data.source}", rows, memory.COLUMNS, memory.TABLE_COLUMNS, _notes(data),
          lambda r: r["list"] in (memory.RMA, memory.RESET))
    _exit(any(r["list"] == memory.RMA for r in rows))


@fleet.command("capacity")
@click.option("--reserve-pct", type=click.FloatRange(0, 100), default=None, metavar="PCT",
              help="Reserve target in percent of each group's GPUs (default: fleet.reserve_pct, 20).")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="table", metavar="[" + "|".join(FORMATS) + "]",
              help="Output format (default: table).")
@click.option("--json", "as_json", is_flag=True, help="JSON: same as --format json.")
@output_file_option()
@click.pass_obj
def capacity_cmd(app: Any, reserve_pct: Optional[float], fmt: str, as_json: bool, output: Optional[str]) -> None:
    """GPUs per partition and model from live Slurm, against the reserve target.

    Total, allocated, idle, drained by slurm-gpu, drained by an admin, down; the reserve
    target is ceil(total x reserve_pct / 100) healthy idle GPUs. Exit 1 when the reserve
    does not hold in some partition (or the cluster), 0 when it holds everywhere; 4 when
    Slurm cannot be read.
    """
    from slurm_gpu.fleet import capacity
    from slurm_gpu.slurm.backend import get_backend
    pct = app.config.fleet.reserve_pct if reserve_pct is None else reserve_pct
    nodes = get_backend(app.config).nodes()
    rows = capacity.capacity_view(nodes, pct)
    notes = [] if rows else ["Slurm lists no GPUs (no node has gpu GRES)"]
    o = {"fmt": "json" if as_json else fmt, "output": output}
    _emit(o, "GPU capacity", rows, capacity.COLUMNS, notes=notes, flag=lambda r: r["reserve_holds"] == "no")
    _exit(capacity.failing(rows))


@fleet.command("xids")
@_since_option("now-7days")
@click.option("--by", type=click.Choice(["gpu", "node", "code", "storm"]), default="gpu", show_default=True,
              help="One row per code and GPU, per code and node, per code, or per storm (the same code on many "
                   "nodes at once: one fleet event).")
@click.option("--storm-window", "storm_window", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="A storm: the same XID first seen on --storm-nodes nodes within this many seconds "
                   "(default: fleet.xid_storm_window_s, 600).")
@click.option("--storm-nodes", "storm_nodes", type=click.IntRange(min=2), default=None, metavar="N",
              help="How many nodes make a storm (default: fleet.xid_storm_min_nodes, 3).")
@_source_options
@click.pass_obj
def xids_cmd(app: Any, since: Optional[str], by: str, storm_window: Optional[float], storm_nodes: Optional[int],
             **o: Any) -> None:
    """XID events by code, node and GPU, classified with NVIDIA's catalog and its action.

    Classes: application, hardware, driver/firmware, NVLink, memory; a code slurm-gpu's
    catalog does not know is shown as unknown. For XID 154 the action is the recovery
    action the driver logged. A flood of identical lines (same GPU, code and text) is one event
    on the node; EVENTS counts its lines, FIRST and LAST are its first and last line. The same
    XID first seen on 3 or more nodes within 10 minutes is one fleet event, a storm (a driver or
    firmware rollout, one job across its nodes, not that many broken GPUs): --by storm lists
    them with their likely cause, the other views name them in a note. Needs the central server
    (inventory files hold no XIDs).
    """
    from slurm_gpu.fleet import central as fc
    from slurm_gpu.fleet import xids
    if o["inventory_dir"]:
        raise InputError("inventory files hold no XID events", "read them from the central server: --db URL")
    window = float(app.config.fleet.xid_storm_window_s if storm_window is None else storm_window)
    min_nodes = int(app.config.fleet.xid_storm_min_nodes if storm_nodes is None else storm_nodes)
    now = time.time()
    start = _parse_since(since, now)
    with _server(app, o) as (srv, cluster):
        events = fc.xid_events(srv, cluster, start, now)
        source = srv.target.describe()
    storms = xids.storms(events, window, min_nodes)
    rows = storms if by == "storm" else xids.xids_view(events, by)
    notes = [f"source: {source}"]
    unknown = xids.unknown_codes(rows)
    if unknown:
        notes.append(f"XID {', '.join(map(str, unknown))} not in slurm-gpu's catalog: see NVIDIA's XID catalog")
    if by != "storm":
        notes += xids.storm_notes(storms, window)
    if not rows:
        notes.append("no XID events in the window (check --since and --cluster)" if by != "storm" else
                     f"no storm in the window: no XID on {min_nodes} or more nodes within {window:g} s")
    _emit(o, f"XID events since {since}: {source}", rows, xids.COLUMNS[by], notes=notes,
          flag=lambda r: r["class"] not in ("application",))


@fleet.command("remediation")
@click.option("--by", type=click.Choice(list(("serial", "fault"))), default="serial", show_default=True,
              help="One row per GPU serial (its history across nodes, state, lemon), or per fault class (check) "
                   "with the mean and median time from drain to verified resume.")
@click.option("--node-db", "node_dbs", multiple=True, metavar="PATH",
              help="Read these node databases (store.database of each node, or a directory of *.db files; "
                   "repeatable) instead of a server.")
@click.option("--db", "db", metavar="URL", default=None,
              help="The central server: mysql://USER@HOST[:PORT]/DATABASE, or 'central' for central.url "
                   "(docs/central.md). Default: central.url when set.")
@click.option("--password-file", metavar="PATH", default=None,
              help="File with USER's password, mode 600 (default: central.password_file).")
@click.option("--cluster", "-M", metavar="NAME", default=None,
              help="The cluster's records on the server (default: cluster_name, else the only one).")
@output_options(render.FORMATS, extra_help="csv/json carry every column.")
@output_file_option()
@click.pass_obj
def remediation_cmd(app: Any, by: str, node_dbs: Sequence[str], **o: Any) -> None:
    """Remediation history per GPU serial across nodes: faults, remedies, outcomes, state, lemons.

    A GPU is its serial: one moved to another node keeps its history (nodes is the hostlist
    of every node it was remedied on). state is its latest attempt's: resumed, pending, reboot
    pending, failed or refused (drained), RMA. lemon: the GPU has had remediation.lemon_remedies
    verified remedies, or its node's kernel log remediation.lemon_xid_bursts bursts of hardware
    XIDs, within lemon_window_days, so its next fault goes to RMA (or it went there for it).
    --by fault: per fault class, the attempts, outcomes and the mean and median time from the
    node's drain to its verified resume. Reads the central server (`--db`, default
    central.url) or node databases (`--node-db`). Exit 1 when a GPU is a lemon or waits for
    RMA, else 0.
    """
    from slurm_gpu.fleet import remediation as FR
    from slurm_gpu.remediation.budget import Budget
    now = time.time()
    budget = Budget.from_config(app.config)
    rows, xid_rows, source = _remediation_rows(app, node_dbs, o, now - budget.lemon_window_s)
    view = FR.by_serial(rows, budget, now, xid_rows)
    notes = [f"source: {source}"]
    if FR.lemons(view):
        notes.append(f"lemons (next fault: RMA): {', '.join(FR.lemons(view))}")
    if not rows:
        notes.append("no remediation attempts (check --cluster, or that the nodes ran `db push`)")
    out = view if by == "serial" else FR.by_fault(rows)
    _emit(o, f"Remediation by {by}: {source}", out, FR.COLUMNS[by], FR.TABLE_COLUMNS[by], notes)
    _exit(any(r["lemon"] == "yes" or r["state"] == "RMA" for r in view))


def _remediation_rows(app: Any, node_dbs: Sequence[str], o: Dict[str, Any], xids_since: float
                      ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], str]:
    """The attempts and the XID rows since xids_since (the lemon rule's bursts) from the node databases
    or the server, and where they came from."""
    from slurm_gpu.fleet import remediation as FR
    if node_dbs:
        if o["db"]:
            raise InputError("--db and --node-db exclude each other", "read the server or the node databases, not both")
        files = FR.node_files(node_dbs)
        return ([r for f in files for r in FR.node_rows(f)], [x for f in files for x in FR.node_xids(f, xids_since)],
                f"{len(files)} node database(s)")
    from slurm_gpu.fleet import central as fc
    if o["db"] in (None, "central") and not app.config.central.url:
        raise InputError("no central server and no node database",
                         "give --db mysql://USER@HOST/DB, set central.url, or use --node-db PATH")
    with _server(app, o) as (srv, cluster):
        return (fc.remediations(srv, cluster), fc.xid_events(srv, cluster, xids_since, time.time()) if cluster else [],
                srv.target.describe() + (f" (cluster {cluster})" if cluster else ""))
