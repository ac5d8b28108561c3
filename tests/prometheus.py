"""A throwaway Prometheus and node_exporter on 127.0.0.1 for the monitoring tests.

Debian's ``prometheus`` and ``prometheus-node-exporter``, each on a free port with its own
directory (configuration, TSDB, log), started in a session of its own and stopped by pid (the
process group we started), never by name.  ``NodeExporter(textfile_dir)`` serves only the
textfile collector, so it reads no host state; ``Prometheus(targets, rule_files)`` scrapes those
exporters every second, adds a ``cluster`` label to every target (as monitoring/README.md asks
sites to) and evaluates the rules every second.  Its HTTP API is reached with urllib only.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

PROMETHEUS = "prometheus"
NODE_EXPORTER = "prometheus-node-exporter"
PROMTOOL = "promtool"
PACKAGES = {PROMETHEUS: "prometheus", PROMTOOL: "prometheus", NODE_EXPORTER: "prometheus-node-exporter"}
CLUSTER = "sgtest"

# One scrape target: its address and the target labels to add (instance, ...).
Target = Tuple[str, Mapping[str, str]]


class PrometheusUnavailable(Exception):
    pass


class PrometheusError(RuntimeError):
    """The HTTP API answered with an error (bad query, ...)."""


def require(*tools: str) -> None:
    """PrometheusUnavailable unless every tool is on PATH (message names the Debian package)."""
    for tool in tools:
        if shutil.which(tool) is None:
            raise PrometheusUnavailable(f"{tool} not found (Debian package {PACKAGES.get(tool, tool)})")


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Daemon(ABC):
    """One foreground daemon in its own session; ready when GET ``ready_path`` answers 200."""

    tool = ""
    ready_path = "/"

    def __init__(self, workdir: Optional[Path]):
        require(self.tool)
        self.dir = Path(workdir or tempfile.mkdtemp(prefix=f"slurm-gpu-{self.tool}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _unused_port()
        self.log = self.dir / f"{self.tool}.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @abstractmethod
    def argv(self) -> List[str]:
        """The daemon's command line (each kind of daemon says its own)."""

    def start(self, timeout_s: float = 30.0):
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.tool} exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.tool} did not answer within {timeout_s:g}s: {self.log_tail()}")

    def stop(self) -> None:
        """TERM the process group we started, KILL it after 15 s."""
        proc, self.proc = self.proc, None
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            if proc is None or proc.poll() is not None:
                return
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class NodeExporter(_Daemon):
    """node_exporter with only the textfile collector, reading ``textfile_dir``/*.prom."""

    tool = NODE_EXPORTER
    ready_path = "/metrics"

    def __init__(self, textfile_dir: Path, workdir: Optional[Path] = None):
        super().__init__(workdir)
        self.textfile_dir = Path(textfile_dir)

    def argv(self) -> List[str]:
        return [self.tool, f"--web.listen-address={self.address}", "--collector.disable-defaults",
                "--collector.textfile", f"--collector.textfile.directory={self.textfile_dir}"]


class Prometheus(_Daemon):
    """Prometheus scraping ``targets`` ({scrape job name: [(address, target labels)]}) every
    ``interval_s`` with ``cluster`` added to every target, evaluating ``rule_files``."""

    tool = PROMETHEUS
    ready_path = "/-/ready"

    def __init__(self, targets: Mapping[str, Sequence[Target]], rule_files: Sequence[Path] = (),
                 cluster: str = CLUSTER, interval_s: int = 1, workdir: Optional[Path] = None):
        super().__init__(workdir)
        self.config = self.dir / "prometheus.yml"
        scrape_configs = [{"job_name": job, "static_configs": [
            {"targets": [address], "labels": {"cluster": cluster, **labels}} for address, labels in entries]}
            for job, entries in targets.items()]
        config = {"global": {"scrape_interval": f"{interval_s}s", "scrape_timeout": f"{interval_s}s",
                             "evaluation_interval": f"{interval_s}s"},
                  "rule_files": [str(p) for p in rule_files], "scrape_configs": scrape_configs}
        self.config.write_text(json.dumps(config, indent=1))  # JSON is YAML

    def argv(self) -> List[str]:
        return [self.tool, f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address={self.address}", "--storage.tsdb.retention.time=1d"]

    # ------------------------------------------------------------------ HTTP API
    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/PATH?params; the ``data`` of a successful answer, else PrometheusError."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=15) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422/503 carry a JSON error body
            body = json.load(e)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: Optional[float] = None) -> Dict[str, Any]:
        """Instant query: {"resultType": ..., "result": [...]}."""
        params: Dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> Dict[str, Any]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")

    def alerts(self) -> List[Dict[str, Any]]:
        """The alerts of the loaded rules (state pending or firing) with their labels."""
        return self.api("alerts")["alerts"]

    def wait_for(self, expr: str, predicate: Callable[[List[Dict[str, Any]]], bool],
                 timeout: float = 20.0) -> List[Dict[str, Any]]:
        """Poll the instant query until predicate(result) holds; return that result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)["result"]
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} still {result!r} after {timeout:g}s\n{self.log_tail()}")
            time.sleep(0.25)

    def wait_for_alerts(self, predicate: Callable[[List[Dict[str, Any]]], bool],
                        timeout: float = 20.0) -> List[Dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            alerts = self.alerts()
            if predicate(alerts):
                return alerts
            if time.monotonic() > deadline:
                raise TimeoutError(f"alerts still {alerts!r} after {timeout:g}s\n{self.log_tail()}")
            time.sleep(0.25)
