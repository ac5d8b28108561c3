"""`slurm-gpu exporter`: serve the textfile metrics over HTTP (docs/prometheus.md)."""
from __future__ import annotations

import click

from slurm_gpu.cli import AppContext
from slurm_gpu.errors import InputError


@click.command("exporter")
@click.option("--listen", default="127.0.0.1:9466", show_default=True, metavar="HOST:PORT",
              help="Address to serve /metrics on; 127.0.0.1 unless Prometheus scrapes from elsewhere.")
@click.option("--once", is_flag=True, help="Print one exposition to stdout and exit (no server).")
@click.pass_obj
def exporter(app: AppContext, listen: str, once: bool) -> None:
    """Serve this node's slurm-gpu metrics on http://HOST:PORT/metrics, for sites without node_exporter.

    Each scrape merges the slurm_gpu_*.prom files that the prolog, the epilog and healthcheck
    write into metrics.textfile_dir, with fresh counts of spooled and unpushed records. Run it
    as root (or a user that can read the node database), e.g. from a systemd unit. A file it
    cannot read (a symlink, another user's file) is skipped, counted in
    slurm_gpu_exporter_unreadable_files and named once on stderr. Each client has its own
    thread and at most 15 s for its request.

    \b
    Exit codes: 0 stopped, 2 usage/config error (metrics.textfile_dir empty, bad --listen,
    address in use).
    """
    from slurm_gpu.metrics.serve import make_server, parse_listen, scrapes
    from slurm_gpu.metrics.storestats import store_samples
    cfg = app.config
    directory = cfg.path_value("metrics", "textfile_dir")
    if not directory:
        raise InputError("metrics.textfile_dir is empty: the hooks write no metrics to serve",
                         "set [metrics] textfile_dir in the config (docs/prometheus.md)")
    body = scrapes(directory, lambda: store_samples(cfg),
                   lambda text: click.echo(f"slurm-gpu exporter: warning: {text}", err=True))
    if once:
        click.echo(body(), nl=False)
        return
    try:
        host, port = parse_listen(listen)
        server = make_server(host, port, body)
    except (ValueError, OSError) as e:
        raise InputError(f"cannot listen on {listen}: {e}", "give a free HOST:PORT, e.g. 127.0.0.1:9466") from None
    bound = server.server_address
    host, port = str(bound[0]), bound[1]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    click.echo(f"slurm-gpu exporter: serving {directory} on http://{where}/metrics", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
