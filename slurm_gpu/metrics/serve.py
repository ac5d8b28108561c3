"""`slurm-gpu exporter`: the textfile metrics over HTTP, for sites without node_exporter.

Each scrape of /metrics reads our files of metrics.textfile_dir (slurm_gpu_*.prom), merges
them into one exposition (a family's # HELP and # TYPE once, whichever files hold its series)
and replaces the node-level values that change between hook runs (spool, unpushed records)
with fresh ones.  A file it cannot read (a symlink, a directory, a file of another user's) is
skipped and counted (slurm_gpu_exporter_unreadable_files): one bad file never fails a scrape.

Standard library http.server, a thread per connection so that clients never wait for each
other, at most MAX_CLIENTS at once (more are closed at once), and each request ends at
DEADLINE_S however slowly its client sends: a client that trickles a header line every few
seconds cannot hold the exporter.
"""
from __future__ import annotations

import errno
import http.server
import os
import socket
import socketserver
import threading
from typing import Any, Callable, Dict, Optional, Tuple, Type

from slurm_gpu.metrics.textfile import Samples, listing, parse, read, render

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIMEOUT_S = 10.0  # one read from the client
DEADLINE_S = 15.0  # the whole request, from connect to the last byte sent
MAX_CLIENTS = 16
UNREADABLE = "slurm_gpu_exporter_unreadable_files"


def collect(directory: str, fresh: Callable[[], Samples], skipped: Optional[Dict[str, str]] = None) -> str:
    """One exposition of every slurm_gpu_*.prom file of directory, with fresh() replacing
    the families it gives.  A file that cannot be read is left out and counted; skipped, when
    given, receives {file name: why}."""
    merged: Samples = {}
    meta: Dict[str, Tuple[str, str]] = {}
    bad: Dict[str, str] = {}
    for name in listing(directory):
        if name.startswith("slurm_gpu_") and name.endswith(".prom"):
            try:
                text = read(directory, name)
            except OSError as e:  # ELOOP for a symlink: never followed
                bad[name] = "a symbolic link (not followed)" if e.errno == errno.ELOOP else (e.strerror or str(e))
                continue
            for family, series in parse(text, meta).items():
                merged.setdefault(family, {}).update(series)
    merged[UNREADABLE] = {(): float(len(bad))}
    merged.update(fresh())
    if skipped is not None:
        skipped.update(bad)
    return render(merged, meta)


def scrapes(directory: str, fresh: Callable[[], Samples], warn: Callable[[str], None]) -> Callable[[], str]:
    """collect() for each scrape; warn() names a file the first time it is skipped (and again
    when the reason changes), not at every scrape."""
    told: Dict[str, str] = {}
    lock = threading.Lock()  # scrapes run in their own threads

    def body() -> str:
        skipped: Dict[str, str] = {}
        text = collect(directory, fresh, skipped)
        with lock:
            for name, why in sorted(skipped.items()):
                if told.get(name) != why:
                    warn(f"{os.path.join(directory, name)} skipped: {why}")
            told.clear()
            told.update(skipped)
        return text
    return body


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


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """A thread per connection, at most max_clients at once, each cut off at deadline_s."""

    daemon_threads = True  # a client still connected never keeps the exporter from stopping

    def __init__(self, address: Tuple[str, int], handler: Any, deadline_s: float, max_clients: int):
        super().__init__(address, handler)
        self.deadline_s = deadline_s
        self.slots = threading.BoundedSemaphore(max_clients)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.slots.acquire(blocking=False)  # False: the connection is closed at once

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # The deadline shuts the socket down: a read or write blocked on the client returns.
        cut = threading.Timer(self.deadline_s, _shut, (request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self.slots.release()


class _Server6(_Server):
    """_Server on an IPv6 address."""

    address_family = socket.AF_INET6


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def make_server(host: str, port: int, body: Callable[[], str], deadline_s: float = DEADLINE_S,
                max_clients: int = MAX_CLIENTS) -> http.server.HTTPServer:
    """An HTTP server on host:port (port 0: any free one, see server_address) serving body()."""
    handler = type("Handler", (_Handler,), {"body": staticmethod(body)})
    server_cls: Type[_Server] = _Server6 if ":" in host else _Server  # ":": an IPv6 address
    return server_cls((host, port), handler, deadline_s, max_clients)


def parse_listen(text: str) -> Tuple[str, int]:
    """'127.0.0.1:9466', ':9466' (127.0.0.1), '[::1]:9466' -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)
