"""`slurm-gpu` command line: a thin click shell over the library.

Subcommands live in their own modules and are imported only when invoked, so that
`slurm-gpu check` does not pay for jinja2 or the report code.  To add a command, add one
line to COMMANDS: name -> "module:function".

This module is the one error boundary: a SlurmGpuError raised anywhere below a command
becomes `slurm-gpu: error: ...` + `hint: ...` on stderr and its exit code
(docs/exit-codes.md) in LazyGroup.invoke; commands just let domain errors propagate.
It also holds the options every command spells the same way (docs/admin-guide.md,
"Options shared by all commands"): --nvml-lib, --format/--json, --dry-run/-n, --node-name.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Dict, List, Optional, Sequence

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
    "central": "slurm_gpu.cli.central:central",
    "drain": "slurm_gpu.cli.admin:drain",
    "resume": "slurm_gpu.cli.admin:resume",
    "status": "slurm_gpu.cli.admin:status",
    "healthcheck": "slurm_gpu.cli.admin:healthcheck",
    "remediate": "slurm_gpu.cli.remediate:remediate",
    "battery": "slurm_gpu.cli.battery:battery",
    "breaker": "slurm_gpu.cli.breaker:breaker",
    "job": "slurm_gpu.cli.job:job",
    "exporter": "slurm_gpu.cli.metrics:exporter",
    "fleet": "slurm_gpu.cli.fleet:fleet",
    "efficiency": "slurm_gpu.cli.efficiency:efficiency",
}


class LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        """The one place where a domain error becomes its message, hint and exit code."""
        try:
            return super().invoke(ctx)
        except SlurmGpuError as err:
            raise fail(err) from None

    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name in COMMANDS:
            mod, attr = COMMANDS[name].split(":")
            return getattr(importlib.import_module(mod), attr)
        return super().get_command(ctx, name)


class AppContext:
    """What every subcommand needs: the config path given on the command line, loaded on demand."""

    def __init__(self, config_path: Optional[str], nvml_lib: Optional[str] = None):
        self.config_path = config_path
        self._nvml_lib = nvml_lib
        self._config = None

    @property
    def nvml_lib(self) -> Optional[str]:
        return self._nvml_lib

    @nvml_lib.setter
    def nvml_lib(self, path: Optional[str]) -> None:
        self._nvml_lib = path
        self._config = None  # the override is part of the config every command reads

    @property
    def config(self):
        if self._config is None:
            from slurm_gpu import config
            cfg = config.load(self.config_path)
            if self._nvml_lib:
                # --nvml-lib overrides nvml_library for every NVML reader a command makes
                # (check, snapshot, inventory, gres-conf, healthcheck, drain --unhealthy).
                cfg = cfg.replace("", nvml_library=self._nvml_lib)
            self._config = cfg
        return self._config


def print_error(err: SlurmGpuError) -> None:
    """A domain error as docs/exit-codes.md says: one `slurm-gpu: error:` line, then its hint."""
    click.echo(f"slurm-gpu: error: {err.message}", err=True)
    if err.hint:
        click.echo(f"hint: {err.hint}", err=True)


def fail(err: SlurmGpuError) -> "click.exceptions.Exit":
    """Print a domain error and return the Exit with its code (used by LazyGroup.invoke only)."""
    print_error(err)
    return click.exceptions.Exit(int(err.exit_code))


# ------------------------------------------------------------------ shared options

NVML_LIB_HELP = "Load this libnvidia-ml.so.1 (overrides nvml_library in the config)."


def _set_nvml_lib(ctx: click.Context, _param: click.Parameter, value: Optional[str]) -> None:
    if value:
        app = ctx.find_object(AppContext)
        if app is None:  # a command run on its own, outside the group
            app = ctx.obj = AppContext(None)
        app.nvml_lib = value


def nvml_lib_option(f: Callable) -> Callable:
    """`--nvml-lib PATH` on every command that reads NVML (also accepted before the command)."""
    return click.option("--nvml-lib", metavar="PATH", default=None, expose_value=False, is_eager=True,
                        callback=_set_nvml_lib, help=NVML_LIB_HELP)(f)


def output_file_option() -> Callable:
    """`-o/--output FILE`: write the output to a file instead of stdout."""
    return click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
                        help="Write to this file instead of stdout.")


def emit_output(output: Optional[str], text: str) -> None:
    """text to the --output file (with a final newline) or to stdout."""
    if not output:
        click.echo(text)
        return
    from slurm_gpu.errors import InputError
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError as e:
        raise InputError(f"cannot write {output}: {e.strerror}", "choose a writable path for --output") from None


def apply_options(f: Callable, opts: Sequence[Callable]) -> Callable:
    """f decorated with opts, listed in the order --help shows them."""
    for opt in reversed(opts):
        f = opt(f)
    return f


def output_options(formats: Sequence[str], default: Optional[str] = "table", extra_help: str = "") -> Callable:
    """`--format CHOICE` and its alias `--json`, handed to the command as one `fmt` argument.

    The one output-options decorator: every command that prints data takes it with the
    formats that make sense for it (render.py does the rendering)."""
    def deco(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            if kw.pop("as_json", False):
                kw["fmt"] = "json"
            return f(*args, **kw)
        wrapper.__click_params__ = list(getattr(f, "__click_params__", []))  # type: ignore[attr-defined]
        shown_default = f" (default: {default})" if default and len(formats) > 1 else ""
        wrapper = click.option("--json", "as_json", is_flag=True, help="JSON: same as --format json.")(wrapper)
        wrapper = click.option("--format", "fmt", type=click.Choice(list(formats)), default=default,
                               metavar="[" + "|".join(formats) + "]",
                               help=f"Output format{shown_default}.{(' ' + extra_help) if extra_help else ''}")(wrapper)
        return wrapper
    return deco


def dry_run_option(help_text: str = "Print what would change; change nothing.") -> Callable:
    """`--dry-run` / `-n`: the only meaning of -n in slurm-gpu."""
    return click.option("--dry-run", "-n", "dry_run", is_flag=True, help=help_text)


def node_name_option(help_text: str, aliases: Sequence[str] = ("--node",)) -> Callable:
    """`--node-name NAME`: THIS node's Slurm name.  (`--node` is a filter of other nodes, in `report`.)

    The old spellings stay accepted, hidden, so scripts keep working."""
    def deco(f: Callable) -> Callable:
        for alias in aliases:
            f = click.option(alias, "node_name_alias", metavar="NAME", hidden=True)(f)
        f = click.option("--node-name", "node_name", metavar="NAME", help=help_text)(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            alias_value = kw.pop("node_name_alias", None)
            if kw.get("node_name") is None:
                kw["node_name"] = alias_value
            return f(*args, **kw)
        return wrapper
    return deco


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="PATH", envvar="SLURM_GPU_CONFIG",
              help="Config file (default: $SLURM_GPU_CONFIG, slurm-gpu.toml beside $SLURM_CONF, /etc/slurm-gpu/config.toml).")
@click.option("--nvml-lib", "nvml_lib", metavar="PATH", default=None,
              help=NVML_LIB_HELP + " Applies to every command; each NVML command also takes it after its name.")
@click.version_option(__version__, prog_name="slurm-gpu")
@click.pass_context
def main(ctx: click.Context, config_path: Optional[str], nvml_lib: Optional[str]) -> None:
    """GPU health gating, node drain/resume, gres.conf and GPU accounting for Slurm.

    \b
    Options mean the same in every command:
      --format/--json   output format of commands that print data
      -n, --dry-run     change nothing (drain, resume, healthcheck)
      --node-name NAME  THIS node's Slurm name; --node LIST filters nodes (report)
      --nvml-lib PATH   the NVML library (check, snapshot, inventory, gres-conf,
                        healthcheck, drain --unhealthy)
    Errors: one `slurm-gpu: error:` line and a `hint:` line on stderr; exit codes in
    docs/exit-codes.md.
    """
    ctx.obj = AppContext(config_path, nvml_lib)


def run() -> None:  # pragma: no cover - console entry for `python -m slurm_gpu`
    main(prog_name="slurm-gpu")


if __name__ == "__main__":  # pragma: no cover
    run()
