"""`slurm-gpu inventory` and `slurm-gpu gres-conf`: thin click shells over inventory.py and gres.py."""
from __future__ import annotations

import os
import tempfile
from typing import Optional, Tuple

import click

from slurm_gpu.cli import node_name_option, nvml_lib_option, output_options
from slurm_gpu.errors import ExitCode, InputError


def _local_inventory(cfg, snapshot_path: Optional[str], hostname: Optional[str], state: bool = False):
    """This node's inventory: from the driver, or from a saved `slurm-gpu snapshot` file."""
    import json

    from slurm_gpu import config as config_mod
    from slurm_gpu.gpu.snapshot import SnapshotFormatError, node_from_json
    from slurm_gpu.gres import collect

    if snapshot_path:
        try:
            with open(snapshot_path) as f:
                snap = node_from_json(json.load(f))
        except OSError as e:
            raise InputError(f"snapshot {snapshot_path}: cannot be read: {e.strerror}", "check the path") from None
        except (ValueError, SnapshotFormatError) as e:
            raise InputError(f"snapshot {snapshot_path}: {e}", "write it with `slurm-gpu snapshot > FILE`") from None
        host = hostname or snap.hostname
    else:
        from slurm_gpu.gpu.nvml import NvmlReader

        reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s, cfg.nvidia_version_file)
        try:
            snap = reader.snapshot(inventory=True)
        finally:
            reader.close()
        host = hostname or config_mod.node_name()
    topo_dir = cfg.gres.cpu_topology_dir
    topo = collect.read_cpu_topology(topo_dir)
    if topo is None:
        click.echo(f"slurm-gpu: warning: CPU topology in {topo_dir} unreadable; Cores= uses CPU ids "
                   "(wrong on nodes with hyper-threading)", err=True)
    return collect.inventory_from_snapshot(snap, host, topo, mig_minors_path=cfg.gres.mig_minors_path,
                                           state=state,
                                           warn=lambda text: click.echo(f"slurm-gpu: warning: {text}", err=True))


def _write(path: Optional[str], text: str) -> None:
    if not path:
        click.echo(text, nl=False)
        return
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".slurm-gpu-", dir=d)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # readers (slurmd, config management) never see half a file
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror}", "check the directory exists and is writable") from None


@click.command("inventory")
@click.option("--output", "-o", metavar="FILE", help="Write the inventory to FILE (atomically) instead of stdout.")
@click.option("--snapshot", "snapshot_path", metavar="FILE",
              help="Build the inventory from a saved `slurm-gpu snapshot` file instead of the driver.")
@node_name_option("Slurm node name to record (default: SLURMD_NODENAME, else the short host name; with --snapshot: "
                  "its hostname).", aliases=("--hostname",))
@click.option("--state", is_flag=True,
              help="Also write each GPU's memory-health counters (ECC, retired pages, row remaps and the "
                   "row-remapper histogram, SRAM) and the time they were read (collected_at): what `slurm-gpu "
                   "fleet` reads from a directory of inventories on a cluster without a central server.")
@output_options(["json"], default="json")
@nvml_lib_option
@click.pass_obj
def inventory_cmd(app, output: Optional[str], snapshot_path: Optional[str], node_name: Optional[str], state: bool,
                  fmt: str) -> None:
    """Print this node's GPU facts as JSON (format slurm-gpu-inventory/2).

    Collect one file per node (e.g. `slurm-gpu inventory -o /shared/inv/$(hostname -s).json`)
    and build the cluster's gres.conf with `slurm-gpu gres-conf --inventory /shared/inv`.
    Holds the driver and CUDA versions, GPU names, serials and VBIOS versions, device minors,
    PCI bus ids, CPU affinity and Slurm core ids, NvLink peers and MIG devices with their
    nvidia-caps minors; no readings and no timestamps unless --state.  When the driver refuses
    NVML with a driver/library mismatch, the file is still written (no GPUs, both versions,
    for `slurm-gpu fleet versions`) and the command fails with exit 3.
    """
    import time

    from slurm_gpu import config as config_mod
    from slurm_gpu.errors import DriverLibraryMismatch
    from slurm_gpu.gres import inventory

    try:
        inv = _local_inventory(app.config, snapshot_path, node_name, state)
    except DriverLibraryMismatch as e:
        # Still say so in the file (`slurm-gpu fleet` reads it), then fail as any NVML error does.
        host = node_name or config_mod.node_name()
        _write(output, inventory.dumps(inventory.mismatch_inventory(host, e.kernel_version, e.library_version,
                                                                    time.time())))
        raise
    _write(output, inventory.dumps(inv))


@click.command("gres-conf")
@click.option("--inventory", "inventories", multiple=True, metavar="DIR|FILE",
              help="Node inventories (a directory of *.json, or files; repeatable). Default: this node, read live.")
@click.option("--type-naming", type=click.Choice(["autodetect", "short"]),
              help="Type= names: 'autodetect' as Slurm's AutoDetect=nvml (nvidia_h100_80gb_hbm3) or 'short' (h100). "
                   "Default: gres.type_naming; gres.type_map entries always win.")
@click.option("--slurm-version", metavar="X.Y.Z",
              help="Slurm version whose AutoDetect MIG type names to write (autodetect naming): up to 23.02.5 "
                   "nvidia_a100_3g.39gb (memory rounded to GiB), from 23.02.6 nvidia_a100_3g.40gb (the NVML profile). "
                   "Default: gres.slurm_version, else `slurmd -V` / `sinfo -V` / `scontrol -V` on this machine.")
@click.option("--group", "groups", multiple=True, metavar="HOSTLIST",
              help="Nodes that must have identical GPUs, e.g. gpu[001-064] (repeatable); a node that differs is an error.")
@click.option("--slurm-conf-lines", is_flag=True,
              help="Print the matching slurm.conf `NodeName=... Gres=gpu:<type>:<n>` lines instead of gres.conf.")
@click.option("--check", "check_file", metavar="FILE",
              help="Compare FILE with what would be generated by what the lines mean to Slurm (order, key case, "
                   "Slurm's aliases CPUs/Cores File/Files Link/Links, '\\' continuations, hostlist and File= ranges, "
                   "AutoDetect=off do not matter); only lines for the nodes checked are compared, and lines for other "
                   "nodes are counted.  Prints a unified diff; exit 1 when they differ, 0 when they match.")
@click.option("--output", "-o", metavar="FILE", help="Write the result to FILE (atomically) instead of stdout.")
@click.option("--snapshot", "snapshot_path", metavar="FILE", hidden=True)
@nvml_lib_option
@click.pass_obj
def gres_conf(app, inventories: Tuple[str, ...], type_naming: Optional[str], slurm_version: Optional[str],
              groups: Tuple[str, ...], slurm_conf_lines: bool, check_file: Optional[str], output: Optional[str],
              snapshot_path: Optional[str]) -> None:
    """Generate gres.conf (or slurm.conf Gres= lines) from the GPUs NVML sees.

    Without --inventory, reads this node's GPUs.  With --inventory, builds one file for the
    cluster and groups nodes with identical GPUs into hostlists (NodeName=gpu[001-064,066]).
    Lines carry Type=, File=/dev/nvidiaN (MIG: MultipleFiles= with the nvidia-caps files),
    Cores= from the GPU's CPU affinity and Links= from direct NvLinks.  MIG types follow the
    naming of the site's Slurm version (--slurm-version).  See docs/gres-conf.md.

    Exit codes: 0 done / --check matches, 1 --check differs, 2 bad input, 3 no NVML.
    """
    from slurm_gpu.gres import generate as gres
    from slurm_gpu.gres import inventory

    if check_file and (output or slurm_conf_lines):
        raise InputError("--check compares and writes nothing", "drop --output/--slurm-conf-lines, or run twice")
    cfg = app.config
    naming = type_naming or cfg.gres.type_naming
    if inventories:
        invs = inventory.load_all(inventories)
    else:
        invs = [_local_inventory(cfg, snapshot_path, None)]
    groups_out = gres.build(invs, naming, cfg.gres.type_map, groups,
                            slurm_version or cfg.gres.slurm_version or None)
    tdir = cfg.gres.template_dir
    if slurm_conf_lines:
        _write(output, gres.render_slurm_conf_lines(groups_out, tdir))
        return
    text = gres.render_gres_conf(groups_out, tdir, naming)
    if not check_file:
        _write(output, text)
        return
    try:
        with open(check_file) as f:
            existing = f.read()
    except OSError as e:
        raise InputError(f"cannot read {check_file}: {e.strerror}", "pass the gres.conf to compare") from None
    result = gres.compare(existing, text, check_file)
    if result.other_lines:
        click.echo(f"slurm-gpu: {result.other_lines} line(s) of {check_file} are for other nodes "
                   f"({_abbrev(result.other_nodes)}); compared only the lines for {_abbrev(result.nodes)}", err=True)
    if result.diff:
        click.echo(result.diff, nl=False)
        n = sum(1 for line in result.diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---")))
        click.echo(f"slurm-gpu: {check_file} differs from the hardware ({n} normalised lines)", err=True)
        raise click.exceptions.Exit(int(ExitCode.UNHEALTHY))
    click.echo(f"slurm-gpu: {check_file} matches the hardware", err=True)


def _abbrev(nodes, limit: int = 80) -> str:
    from slurm_gpu.slurm import hostlist

    text = hostlist.compress(nodes) if nodes else "none"
    return text if len(text) <= limit else text[:limit - 3] + "..."
