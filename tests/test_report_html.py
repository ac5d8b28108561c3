"""The HTML report opened in headless Chromium: charts drawn, no console errors, hostile strings inert.

Skipped when Chromium is not installed, except under CI (env CI set), where it must run.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from typing import Tuple

import pytest
from click.testing import CliRunner
from test_report import ROWS, XSS_ACCOUNT, XSS_USER, make_db

from slurm_gpu.cli import main

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    from testbed import unavailable
    unavailable("Chromium not installed (apt-get install -y chromium)")


def open_in_chromium(page: pathlib.Path) -> Tuple[str, str]:
    """(DOM after scripts ran, browser log with console messages)."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-extensions",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def console_messages(log: str) -> list:
    # Chromium prints page console output (errors, CSP violations, uncaught exceptions) as CONSOLE lines.
    return [line for line in log.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("html")
    db = make_db(tmp / "usage.db", ROWS)
    out = {}
    for name, args in (("summary", ["--by", "user"]), ("jobs", ["jobs"]), ("job", ["job", "104"])):
        page = tmp / f"{name}.html"
        cmd = ["report", "--db", str(db), "--format", "html", "-o", str(page)]
        if args[0] in ("jobs", "job"):
            cmd = ["report", args[0], *args[1:], "--db", str(db), "--format", "html", "-o", str(page)]
        else:
            cmd += args
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 0, r.output
        out[name] = page
    return out


@pytest.mark.parametrize("name,charts", [("summary", 3), ("jobs", 2), ("job", 1)])
def test_html_report_renders_charts_without_console_errors(pages, name, charts):
    dom, log = open_in_chromium(pages[name])
    assert console_messages(log) == []
    root = re.search(r"<html[^>]*>", dom).group(0)  # the page script records its state on <html>
    assert 'data-ready="1"' in root, "the page script did not run to its end"
    assert "data-js-errors" not in root
    assert f'data-charts="{charts}"' in root
    assert len(re.findall(r"<svg[^>]*class=\"chart\"", dom)) == charts
    assert "<rect" in dom or "<circle" in dom


def test_html_report_shows_script_in_user_name_as_text(pages):
    html = pages["summary"].read_text()
    dom, log = open_in_chromium(pages["summary"])
    assert console_messages(log) == []  # a blocked inline script would show up here as a CSP violation
    assert "data-pwned" not in re.search(r"<html[^>]*>", dom).group(0), "a user name was executed as a script"
    assert "<title>slurm-gpu report:" in dom  # the onerror payload in the account would have replaced it
    assert "&lt;script&gt;document.documentElement.setAttribute" in dom  # shown as text
    assert "<img" not in dom
    # The raw strings never reach the file unescaped, not even inside SVG labels.
    assert XSS_USER not in html and XSS_ACCOUNT not in html


def test_html_report_job_page_escapes_and_loads_nothing_from_the_network(pages):
    html = pages["job"].read_text()
    assert XSS_USER not in html
    # No external resource: the only URL is the SVG namespace identifier.
    urls = set(re.findall(r"(?:https?:)?//[\w.-]+[^\s\"'<>]*", html))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls
    assert "default-src 'none'" in html


def screenshot(page: pathlib.Path, png: pathlib.Path, size: str = "1300,1500") -> pathlib.Path:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={profile}", f"--window-size={size}", f"--screenshot={png}", page.as_uri()],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and png.exists(), proc.stderr[-2000:]
    return png


def test_html_axis_ticks_for_seconds_long_jobs_are_distinct_not_all_0_00(tmp_path):
    from test_report import _short_job_rows

    db = make_db(tmp_path / "short.db", _short_job_rows())
    page = tmp_path / "short.html"
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--format", "html", "-o", str(page)])
    assert r.exit_code == 0, r.output
    dom, log = open_in_chromium(page)
    assert console_messages(log) == []
    charts = re.findall(r"<figure><figcaption>(.*?)</figcaption>(.*?)</figure>", dom, re.S)
    columns = [(title, svg) for title, svg in charts if "rotate(" in svg]  # the charts with a value axis
    assert len(columns) == 2, [t for t, _ in charts]
    for title, svg in columns:
        ticks = re.findall(r'<text x="56" y="[\d.]+" text-anchor="end" class="axis[^"]*">([^<]*)</text>', svg)
        assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), (title, ticks)
        assert float(ticks[-1].replace(",", "")) > 0, (title, ticks)
    titles = " ".join(t for t, _ in charts)
    assert "GPU-s" in titles and "(Wh)" in titles, titles
    assert ">GPU-s alloc<" in dom and ">energy Wh<" in dom
    png = screenshot(page, tmp_path / "short.png")
    if os.environ.get("REPORT_SCREENSHOT_DIR"):  # to look at it: REPORT_SCREENSHOT_DIR=/tmp pytest -k ticks
        import shutil
        shutil.copy(png, os.path.join(os.environ["REPORT_SCREENSHOT_DIR"], "report-short-jobs.png"))


def test_a_running_jobs_page_charts_each_gpus_last_hour_with_gaps_unjoined(tmp_path, monkeypatch):
    """Issue 38: `slurm-gpu job --format html` on a running job: one chart per GPU of its last hour, a line
    broken where no sample was taken, rendered by headless Chromium without a console error."""
    from test_job_view import FakeSlurm, _live_summary

    from slurm_gpu.cli import job as cli_job
    from slurm_gpu.store import summary as sg
    fake = FakeSlurm(sg.encode(_live_summary(points=[[80] * 60, [None] * 30 + [0] * 25 + [None] * 2 + [0] * 3])))
    monkeypatch.setattr(cli_job, "_backend", lambda app: fake)
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SLURM_GPU_CONFIG", str(tmp_path / "config.toml"))
    r = CliRunner().invoke(main, ["job", "4711_3", "--format", "html"])
    assert r.exit_code == 0, r.output
    page = tmp_path / "job.html"
    page.write_text(r.output)
    dom, log = open_in_chromium(page)
    assert console_messages(log) == []
    root = re.search(r"<html[^>]*>", dom).group(0)
    assert 'data-ready="1"' in root and "data-js-errors" not in root and 'data-charts="2"' in root
    assert "Job 4711_3: figures so far (running)" in dom and "Idle right now" in dom
    charts = re.findall(r'<svg class="chart".*?</svg>', dom, re.S)
    assert len(re.findall("<polyline", charts[0])) == 1  # 60 points, no gap
    assert len(re.findall("<polyline", charts[1])) == 2  # 25 points, a 2-minute gap, 3 points
    urls = set(re.findall(r"(?:https?:)?//[\w.-]+[^\s\"'<>]*", r.output))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls
