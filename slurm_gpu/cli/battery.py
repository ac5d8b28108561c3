"""`slurm-gpu battery`: the verification battery on this node (hooks/battery.py)."""
from __future__ import annotations

import json
import sys

import click

from slurm_gpu.cli import output_options


@click.command()
@output_options(["table", "json"])
@click.option("--gpus", "gpus", type=click.IntRange(0, 1024), default=None, metavar="N",
              help="GPUs of the node ({gpus} in verify.nccl_command and verify.commands; default: the job's, "
                   "CUDA_VISIBLE_DEVICES or SLURM_GPUS_ON_NODE, else every /dev/nvidiaN).")
@click.pass_obj
def battery(app, fmt, gpus):
    """Run the verification battery on THIS node: DCGM diagnostic, nccl-tests, the site's commands.

    What `remediate`'s verification job runs (verify.enabled; docs/remediation.md, "Verification
    job"); an admin can run it by hand on an idle node. In order, each without a shell, under
    verify.timeout_s: `dcgmi diag -r verify.dcgm_level -j` (when dcgmi is found), all_reduce_perf
    (verify.nccl_command, when found and the node has 2 GPUs or more) against
    verify.nccl_min_busbw_gbps, then each of verify.commands. Nothing to run fails closed.

    \b
    Exit codes: 0 every test passed (warnings allowed), 1 a test failed or
    there was nothing to run, 2 usage or config error.
    """
    from slurm_gpu.hooks import battery as B

    settings = B.Settings.from_config(app.config)
    count = B.gpus_from_env() if gpus is None else gpus
    result = B.run_battery(settings, count)
    if fmt == "json":
        click.echo(json.dumps(result, indent=2))
    else:
        _print_human(result)
    sys.exit(B.exit_code(result))


def _print_human(result) -> None:
    from slurm_gpu.render import table

    rows = [{"result": t["result"].upper() + (" (tool)" if t.get("tool_error") else ""), "tool": t["tool"],
             "test": t["name"], "gpu": t["gpu_index"], "detail": t["detail"]} for t in result["tests"]]
    if rows:
        click.echo(table(rows, ["result", "tool", "test", "gpu", "detail"]))
    verdict = "PASS" if result["ok"] else "FAIL"
    click.echo(f"{result['node']}: {verdict}, {result['gpus']} GPUs, {result['duration_s']:.1f} s")
    if result.get("hint"):
        click.echo(f"hint: {result['hint']}", err=True)
