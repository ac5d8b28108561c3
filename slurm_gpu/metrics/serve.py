"""`slurm-gpu exporter`: the textfile metrics over HTTP, for sites without node_exporter.

Each scrape of /metrics reads our files of metrics.textfile_dir (slurm_gpu_*.prom), merges
them into one exposition (a family's # HELP and # TYPE once, whichever files hold its series)
and replaces the node-level values that change between hook runs (spool, unpushed records)
with fresh ones.  Standard library http.server, one request at a time: a scraper asks every
few seconds, and a slow client is cut off after TIMEOUT_S.
"""
from __future__ import annotations

import http.server
import socket
from typing import Any, Callable, Dict, Tuple

from slurm_gpu.metrics.textfile import Samples, listing, parse, read, render

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIMEOUT_S = 10.0


def collect(directory: str, fresh: Callable[[], Samples]) -> str:
    """One exposition of every slurm_gpu_*.prom file of directory, with fresh() replacing
    the families it gives."""
    merged: Samples = {}
    meta: Dict[str, Tuple[str, str]] = {}
    for name in listing(directory):
        if name.startswith("slurm_gpu_") and name.endswith(".prom"):
            for family, series in parse(read(directory, name), meta).items():
                merged.setdefault(family, {}).update(series)
    merged.update(fresh())
    return render(merged, meta)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "slurm-gpu-exporter"
    timeout = TIMEOUT_S
    body: Callable[[], str]  # set by make_server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] != "/metrics":
            self._send(404, "text/plain; charset=utf-8", b"Not found: metrics are at /metrics\n")
            return
        try:
            data = type(self).body().encode("utf-8")
        except Exception as e:  # one bad scrape is an HTTP error, never the end of the exporter
            self._send(500, "text/plain; charset=utf-8", f"slurm-gpu exporter: {type(e).__name__}: {e}\n".encode())
            return
        self._send(200, CONTENT_TYPE, data)

    def _send(self, code: int, ctype: str, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
        pass


def make_server(host: str, port: int, body: Callable[[], str]) -> http.server.HTTPServer:
    """An HTTP server on host:port (port 0: any free one, see server_address) serving body()."""
    handler = type("Handler", (_Handler,), {"body": staticmethod(body)})
    server_cls = http.server.HTTPServer
    if ":" in host:  # an IPv6 address
        server_cls = type("HTTPServer6", (http.server.HTTPServer,), {"address_family": socket.AF_INET6})
    return server_cls((host, port), handler)


def parse_listen(text: str) -> Tuple[str, int]:
    """'127.0.0.1:9466', ':9466' (127.0.0.1), '[::1]:9466' -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)
