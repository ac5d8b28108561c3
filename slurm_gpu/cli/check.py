"""`slurm-gpu check` and `slurm-gpu snapshot`."""
from __future__ import annotations

import json
import sys
from typing import List, Optional

import click

from slurm_gpu.cli import nvml_lib_option, output_options
from slurm_gpu.errors import ExitCode, InputError


def parse_gpu_list(text: Optional[str]) -> Optional[List[int]]:
    """'0,3' or '0-3,6' -> [0, 3] / [0, 1, 2, 3, 6]; None/'' -> None (all GPUs)."""
    if text is None or text.strip() == "":
        return None
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if lo > hi or lo < 0:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                v = int(part)
                if v < 0:
                    raise ValueError
                out.append(v)
        except ValueError:
            raise InputError(f"invalid GPU list {text!r}: {part!r} is not an index or range",
                             "give node-wide GPU indices like 0,3 or 0-3") from None
    return sorted(set(out))


@click.command()
@click.option("--gpus", metavar="LIST", help="Only these node-wide GPU indices, e.g. 0,3 or 0-3 (default: all).")
@click.option("--require-idle", "idle", is_flag=True,
              help="The GPUs must be idle: also FAIL on compute processes and leaked memory (the prolog does this).")
@click.option("--idle", "idle_alias", is_flag=True, hidden=True)  # old spelling of --require-idle
@output_options(["table", "json"])
@click.option("--verbose", "-v", is_flag=True, help="Show every check, not only problems.")
@click.option("--snapshot", "snapshot_file", metavar="FILE", type=click.Path(dir_okay=False),
              help="Judge a saved `slurm-gpu snapshot` offline instead of the live GPUs.")
@click.option("--expected-count", type=click.IntRange(0, 64), default=None,
              help="GPUs the node must show (default: health.expected_gpu_count).")
@nvml_lib_option
@click.pass_obj
def check(app, gpus, idle, idle_alias, fmt, verbose, snapshot_file, expected_count):
    """Check this node's GPUs and report PASS/WARN/FAIL/SKIP per check.

    \b
    Exit codes: 0 healthy (WARN allowed), 1 at least one FAIL, 2 usage or
    config error, 3 NVML unavailable (no driver / library).
    """
    from slurm_gpu.gpu.snapshot import SnapshotFormatError, node_from_json
    from slurm_gpu.hooks import check as hooks

    cfg = app.config
    indices = parse_gpu_list(gpus)
    snap = None
    if snapshot_file:
        try:
            with open(snapshot_file, encoding="utf-8") as f:
                snap = node_from_json(json.load(f))
        except OSError as e:
            raise InputError(f"cannot read snapshot {snapshot_file}: {e.strerror}", "check the path") from None
        except (ValueError, SnapshotFormatError) as e:
            raise InputError(f"{snapshot_file}: not a valid snapshot: {e}",
                             "create one with `slurm-gpu snapshot > FILE`") from None
    reader = None if snap is not None else hooks.make_reader(cfg)
    snap, results = hooks.check_node(cfg, indices, idle=True if (idle or idle_alias) else None,
                                     expected_count=expected_count, reader=reader, snapshot=snap)

    from slurm_gpu.policy.health import FAIL, worst
    verdict = worst(results)
    if fmt == "json":
        click.echo(json.dumps({"hostname": snap.hostname, "status": verdict if verdict != "SKIP" else "PASS",
                               "results": [r.to_json() for r in results]}, indent=2))
    else:
        _print_human(snap, results, verbose)
    sys.exit(int(ExitCode.UNHEALTHY if verdict == FAIL else ExitCode.OK))


def _print_human(snap, results, verbose: bool) -> None:
    from slurm_gpu.policy.health import FAIL, PASS, SKIP, WARN, worst
    from slurm_gpu.render import table

    rows = []
    for g in snap.gpus:
        mine = [r for r in results if r.gpu_index == g.index]
        w = worst(mine)
        rows.append({
            "gpu": g.index,
            "uuid": (g.uuid.get() or "?")[:20],
            "name": g.name.get() or "?",
            "temp_c": g.temperature_c.get(),
            "mem_used_mib": None if g.memory_used_bytes.get() is None else g.memory_used_bytes.get() // (1024 * 1024),
            "status": w if w != SKIP else PASS,
            "problems": sum(1 for r in mine if r.status in (WARN, FAIL)),
        })
    click.echo(f"{snap.hostname}: driver {snap.driver_version.describe()}, {snap.gpu_count.describe()} GPUs")
    if rows:
        click.echo(table(rows, ["gpu", "uuid", "name", "temp_c", "mem_used_mib", "status", "problems"]))
    shown = [r for r in results if verbose or r.status in (WARN, FAIL)]
    if shown:
        click.echo("")
    for r in shown:
        click.echo(f"{r.status:4}  {r.check:18}  {r.message if r.gpu_index is not None else 'node: ' + r.message}")
        if r.hint and r.status in (WARN, FAIL):
            click.echo(f"      {'':18}  hint: {r.hint}")
    overall = worst(results)
    click.echo("")
    click.echo(f"overall: {'PASS' if overall in (PASS, SKIP) else overall}"
               f" ({sum(r.status == FAIL for r in results)} FAIL, {sum(r.status == WARN for r in results)} WARN,"
               f" {sum(r.status == SKIP for r in results)} SKIP)")


@click.command()
@click.option("--gpus", metavar="LIST", help="Only these node-wide GPU indices (default: all).")
@output_options(["json"], default="json")
@nvml_lib_option
@click.pass_obj
def snapshot(app, gpus, fmt):
    """Print everything NVML reports about this node's GPUs as JSON.

    Save it for support or to try a policy change offline: `slurm-gpu check --snapshot FILE`.
    """
    from slurm_gpu.hooks import check as hooks
    reader = hooks.make_reader(app.config)
    snap = reader.snapshot(parse_gpu_list(gpus), inventory=True)
    click.echo(snap.dumps())
