"""`slurm-gpu` command line: a thin click shell over the library.

Subcommands live in their own modules and are imported only when invoked, so that
`slurm-gpu check` does not pay for jinja2 or sqlite-utils.  To add a command, add one
line to COMMANDS: name -> "module:function".
"""
from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional

import click

from slurm_gpu import __version__
from slurm_gpu.errors import SlurmGpuError

COMMANDS: Dict[str, str] = {
    "gres-conf": "slurm_gpu.cli.gres:gres_conf",
    "inventory": "slurm_gpu.cli.gres:inventory_cmd",
    "check": "slurm_gpu.cli.check:check",
    "snapshot": "slurm_gpu.cli.check:snapshot",
    "report": "slurm_gpu.cli.report:report_cmd",
    "db": "slurm_gpu.cli.db:db",
    "drain": "slurm_gpu.cli.admin:drain",
    "resume": "slurm_gpu.cli.admin:resume",
    "status": "slurm_gpu.cli.admin:status",
    "healthcheck": "slurm_gpu.cli.admin:healthcheck",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name in COMMANDS:
            mod, attr = COMMANDS[name].split(":")
            return getattr(importlib.import_module(mod), attr)
        return super().get_command(ctx, name)


class AppContext:
    """What every subcommand needs: the config path given on the command line, loaded on demand."""

    def __init__(self, config_path: Optional[str]):
        self.config_path = config_path
        self._config = None

    @property
    def config(self):
        if self._config is None:
            from slurm_gpu import config
            self._config = config.load(self.config_path)
        return self._config


def fail(err: SlurmGpuError) -> "click.exceptions.Exit":
    """Print a domain error as one line plus its hint on stderr and exit with its code."""
    click.echo(f"slurm-gpu: error: {err.message}", err=True)
    if err.hint:
        click.echo(f"hint: {err.hint}", err=True)
    return click.exceptions.Exit(int(err.exit_code))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="PATH", envvar="SLURM_GPU_CONFIG",
              help="Config file (default: $SLURM_GPU_CONFIG, slurm-gpu.toml beside $SLURM_CONF, /etc/slurm-gpu/config.toml).")
@click.version_option(__version__, prog_name="slurm-gpu")
@click.pass_context
def main(ctx: click.Context, config_path: Optional[str]) -> None:
    """GPU health gating, node drain/resume, gres.conf and GPU accounting for Slurm."""
    ctx.obj = AppContext(config_path)


def run() -> None:  # pragma: no cover - console entry for `python -m slurm_gpu`
    main(prog_name="slurm-gpu")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
