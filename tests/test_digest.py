"""`slurm-gpu report digest`: the weekly digest per user and per account, its week, its trend and its mails.

Its figures must be the report's own: the tests compare them with `slurm-gpu report --by user` (and
`--by account`) for the same window, on real node databases (built as tests/test_report.py builds
them) and on the central server, and with totals computed independently over the inserted rows.
The mails go through a real SMTP server on 127.0.0.1 (tests/smtpserver.py).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import time
from collections import defaultdict
from typing import Any, Dict, List, Sequence

import pytest
from click.testing import CliRunner
from smtpserver import SmtpServer, free_port
from test_report import expected, make_db, rec, ts

from slurm_gpu.cli import main
from slurm_gpu.report import digest as D
from slurm_gpu.report.calendar import calendar

W48 = ("2026-11-23", "2026-11-30")  # Monday to Monday
W47 = ("2026-11-16", "2026-11-23")
GIB = 1 << 30

ROWS: List[Dict[str, Any]] = [
    # 201: two GPUs across the week's start (Sun 20:00 - Mon 04:00): 4 h of each in W47 and in W48; GPU 1 idle.
    rec("c1", 201, "n1", 0, "alice", "physics", "gpu", "2026-11-22T20:00", "2026-11-23T04:00", 80, 40, 2e6, 10 * GIB),
    rec("c1", 201, "n1", 1, "alice", "physics", "gpu", "2026-11-22T20:00", "2026-11-23T04:00", 2, 1, 1e5, GIB),
    rec("c1", 202, "n2", 0, "alice", "physics", "gpu", "2026-11-25T10:00", "2026-11-25T12:00", 50, 20, 1e6, 5 * GIB),
    # bob: 24 GPU-h in W47, 10 GPU-h without a utilisation reading in W48 (never idle, never used).
    *[rec("c1", 203, "n2", g, "bob", "chem", "gpu", "2026-11-17T00:00", "2026-11-17T06:00", 90, 50, 4e6, 20 * GIB)
      for g in range(4)],
    rec("c1", 204, "n2", 1, "bob", "chem", "gpu", "2026-11-26T00:00", "2026-11-26T10:00", None, None, None, None),
    # 205: idle, across the week's end (Sun 22:00 - Mon 02:00): 2 h in W48.
    rec("c1", 205, "n1", 2, "carol", "chem", "long", "2026-11-29T22:00", "2026-11-30T02:00", 1, 0, 1e5, GIB),
    # 206: requeued; its first run idle. One job, one idle job.
    rec("c1", 206, "n1", 3, "dave", "physics", "gpu", "2026-11-24T00:00", "2026-11-24T01:00", 3, 1, 1e5, GIB),
    rec("c1", 206, "n1", 3, "dave", "physics", "gpu", "2026-11-24T01:00", "2026-11-24T03:00", 60, 30, 9e5, 2 * GIB,
        restart=1),
    # Job id 201 again, on another cluster: another job of dave's.
    rec("c2", 201, "n3", 0, "dave", "physics", "gpu", "2026-11-27T08:00", "2026-11-27T09:00", 70, 30, 5e5, GIB),
    # erin: W47 only.
    rec("c1", 207, "n2", 2, "erin", "bio", "gpu", "2026-11-18T09:00", "2026-11-18T10:00", 40, 10, 3e5, GIB),
    # Outside both weeks: never counted.
    rec("c1", 208, "n2", 2, "erin", "bio", "gpu", "2026-11-30T03:00", "2026-11-30T05:00", 40, 10, 3e5, GIB),
]


def node_files(tmp_path: pathlib.Path, rows: Sequence[Dict[str, Any]]) -> List[pathlib.Path]:
    """One node database per node, in one directory (what `report --db DIR` reads)."""
    by_node: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_node[r["node"]].append(r)
    d = tmp_path / "nodes"
    d.mkdir()
    return [make_db(d / f"{node}.db", rs) for node, rs in sorted(by_node.items())]


@pytest.fixture
def nodes(tmp_path: pathlib.Path) -> pathlib.Path:
    node_files(tmp_path, ROWS)
    return tmp_path / "nodes"


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def digest_json(*args: str) -> Dict[str, Any]:
    r = cli("report", "digest", *args, "--format", "json")
    assert r.exit_code == 0, r.output + r.stderr
    return json.loads(r.stdout)


def report_json(by: str, since: str, until: str, *args: str) -> List[Dict[str, Any]]:
    r = cli("report", "--by", by, "--since", since, "--until", until, *args, "--format", "json")
    assert r.exit_code == 0, r.output + r.stderr
    return json.loads(r.stdout)


FIGS = ("jobs", "gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle")


def assert_equals_report(digest: Dict[str, Any], db_args: Sequence[str], this: Sequence[str], before: Sequence[str]) -> None:
    """Every user's and account's figures, this week and the week before, are the report's own, to the digit."""
    for key in ("user", "account"):
        lines = {ln[key]: ln for ln in digest[f"{key}s"]}
        for (since, until), pick in ((this, lambda ln: ln), (before, lambda ln: ln["previous"])):
            rows = report_json(key, since, until, *db_args)
            assert rows, (key, since)
            assert {r[key] for r in rows} == {k for k, ln in lines.items() if pick(ln)["jobs"]}
            for r in rows:
                got = pick(lines[r[key]])
                assert {c: got[c] for c in FIGS} == {c: r[c] for c in FIGS}, (key, since, r[key])


def test_digest_figures_equal_report_by_user_and_by_account_for_the_same_week(nodes):
    for db_args in (["--db", str(nodes)], ["--db", str(nodes / "n1.db")]):  # merged files, and one file in place
        d = digest_json("--week", "2026-W48", *db_args)
        assert d["window"] == {"label": "2026-W48", "since": "2026-11-23T00:00:00Z", "until": "2026-11-30T00:00:00Z"}
        assert d["previous"] == {"label": "2026-W47", "since": "2026-11-16T00:00:00Z", "until": "2026-11-23T00:00:00Z"}
        assert_equals_report(d, db_args, W48, W47)
        # The same window given as --since/--until is the same digest.
        assert digest_json("--since", W48[0], "--until", W48[1], *db_args) == d
    # And the numbers are right: plain Python over the inserted rows.
    d = digest_json("--week", "2026-W48", "--db", str(nodes))
    for key in ("user", "account"):
        for (since, until), pick in ((W48, lambda ln: ln), (W47, lambda ln: ln["previous"])):
            want = expected(ROWS, lambda r: (r[key],), ts(since + "T00:00"), ts(until + "T00:00"))
            got = {ln[key]: pick(ln) for ln in d[f"{key}s"] if pick(ln)["jobs"]}
            assert set(got) == {k[0] for k in want}
            for (k,), w in want.items():
                assert got[k]["jobs"] == w["jobs"]
                for c in ("gpu_hours_alloc", "gpu_hours_used", "gpu_hours_idle"):
                    assert got[k][c] == pytest.approx(w[c], abs=1e-6), (key, k, c)


def test_a_job_across_the_weeks_start_or_end_counts_only_its_part_inside(nodes):
    d = digest_json("--week", "2026-W48", "--db", str(nodes))
    users = {ln["user"]: ln for ln in d["users"]}
    # alice: 201's two GPUs 00:00-04:00 (8 GPU-h, GPU 1 idle: 4) + 202 (2 GPU-h at 50 %).
    assert users["alice"]["gpu_hours_alloc"] == 10.0
    assert users["alice"]["gpu_hours_idle"] == 4.0
    assert users["alice"]["gpu_hours_used"] == pytest.approx(4 * 0.8 + 4 * 0.02 + 1.0)
    assert users["alice"]["previous"]["gpu_hours_alloc"] == 8.0  # 201's 20:00-24:00 on Sunday
    assert users["alice"]["previous"]["gpu_hours_idle"] == 4.0
    # carol: 205's 22:00-24:00 on the last Sunday; its 2 h after Monday 00:00 are the next week's.
    assert users["carol"]["gpu_hours_alloc"] == 2.0 and users["carol"]["gpu_hours_idle"] == 2.0
    w49 = {ln["user"]: ln for ln in digest_json("--week", "2026-W49", "--db", str(nodes))["users"]}
    assert w49["carol"]["gpu_hours_alloc"] == 2.0 and w49["carol"]["previous"]["gpu_hours_alloc"] == 2.0
    # 201 is an idle job in both weeks; dave's requeued 206 is one job and one idle job; c2/201 another job.
    assert users["alice"]["idle_jobs"] == 1 and users["alice"]["previous"]["idle_jobs"] == 1
    assert users["alice"]["idle_job_ids"] == [{"cluster": "c1", "job_id": 201}]
    assert (users["dave"]["jobs"], users["dave"]["idle_jobs"]) == (2, 1)
    assert users["bob"]["gpu_hours_alloc"] == 10.0 and users["bob"]["gpu_hours_used"] == 0.0
    assert users["bob"]["gpu_hours_idle"] == 0.0 and users["bob"]["idle_jobs"] == 0  # no reading is never idle
    assert d["users_total"]["gpu_hours_alloc"] == 10.0 + 10.0 + 2.0 + 3.0 + 1.0
    assert d["users_total"]["idle_jobs"] == 3 and d["accounts_total"]["jobs"] == 6


def test_the_default_week_is_the_last_full_one_as_the_reports_calendar_cuts_weeks():
    for now, label in (("2026-12-02T12:00", "2026-W48"), ("2026-11-30T00:00", "2026-W48"),
                       ("2026-11-29T23:59", "2026-W47"), ("2027-01-04T09:00", "2026-W53")):
        w = D.last_full_week(ts(now), "utc")
        assert w.label == label, now
        assert [(w.since_s, w.until_s, w.label)] == calendar(w.since_s, w.until_s, "week", "utc")
    w = D.iso_week("2026-W48", "utc")
    assert (w.since_s, w.until_s) == (ts("2026-11-23T00:00"), ts("2026-11-30T00:00"))
    p = D.previous(w)
    assert (p.since_s, p.until_s, p.label) == (ts("2026-11-16T00:00"), ts("2026-11-23T00:00"), "2026-W47")
    p = D.previous(D.window(ts("2026-11-01T00:00"), ts("2026-12-01T00:00"), "utc"))
    assert (p.label, p.until_s) == ("2026-10-02 to 2026-11-01", ts("2026-11-01T00:00"))
    p = D.previous(D.window(ts("2026-11-01T06:00"), ts("2026-11-01T12:00"), "utc"))
    assert (p.since_s, p.until_s) == (ts("2026-11-01T00:00"), ts("2026-11-01T06:00"))


def test_a_local_week_across_the_end_of_summer_time_is_monday_to_monday(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        w44 = D.iso_week("2026-W44", "local")  # Mon 26 Oct 2026, the day after the change
        w43 = D.previous(w44)
        assert w43.label == "2026-W43"
        assert w43.until_s - w43.since_s == 7 * 86400 + 3600  # 25 October had 25 hours
        assert w43.since_s == ts("2026-10-18T22:00")  # Monday 19 October, 00:00 CEST
        assert w44.until_s - w44.since_s == 7 * 86400
    finally:
        monkeypatch.undo()
        time.tzset()


def test_the_trend_is_the_signed_change_against_the_week_before(nodes):
    d = digest_json("--week", "2026-W48", "--db", str(nodes))
    users = {ln["user"]: ln for ln in d["users"]}
    change = {u: (ln["gpu_hours_alloc_change"], ln["gpu_hours_idle_change"]) for u, ln in users.items()}
    assert change == {"alice": (2.0, 0.0), "bob": (-14.0, 0.0), "carol": (2.0, 2.0), "dave": (4.0, 1.0),
                      "erin": (-1.0, 0.0)}
    # erin had GPU time only the week before: a line of zeros and her drop.
    assert users["erin"]["jobs"] == 0 and users["erin"]["previous"]["jobs"] == 1
    accounts = {ln["account"]: ln["gpu_hours_alloc_change"] for ln in d["accounts"]}
    assert accounts == {"bio": -1.0, "chem": -12.0, "physics": 6.0}
    r = cli("report", "digest", "--week", "2026-W48", "--db", str(nodes))
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "GPU digest 2026-W48: 2026-11-23T00:00:00Z to 2026-11-30T00:00:00Z"
    bob = next(ln for ln in lines if ln.startswith("bob "))
    assert bob.split() == ["bob", "1", "0", "10.00", "0.00", "0.00", "-14.00", "+0.00"]
    assert next(ln for ln in lines if ln.startswith("chem ")).split()[-2:] == ["-12.00", "+2.00"]
    assert [ln.split()[0] for ln in lines if ln.startswith("TOTAL")] == ["TOTAL", "TOTAL"]


def test_bad_windows_are_one_line_errors(nodes):
    for args, text in ((["--week", "2026-W54"], "--week: cannot read '2026-W54'"),
                       (["--week", "2026-W48", "--since", "2026-11-01"], "--week and --since/--until"),
                       (["--until", "2026-11-01"], "--until without --since"),
                       (["--dry-run"], "--dry-run shows the mails of --mail or --to")):
        r = cli("report", "digest", "--db", str(nodes), *args)
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr.startswith(f"slurm-gpu: error: {text}"), r.stderr
    r = cli("report", "digest", "--db", str(nodes), "--format", "csv")
    assert r.exit_code == 2 and "'csv' is not one of 'table', 'json', 'html'" in r.stderr
    r = cli("report", "--format", "csv", "digest", "--db", str(nodes))  # the group's option, too
    assert r.exit_code == 2
    assert r.stderr.startswith("slurm-gpu: error: --format csv: the digest is printed as table, json, html"), r.stderr


def test_the_html_page_has_both_tables_and_escapes_names(tmp_path):
    evil = "<script>alert(1)</script>"
    rows = [rec("c1", 1, "n1", 0, evil, "acct&<b>", "gpu", "2026-11-24T00:00", "2026-11-24T02:00", 1, 0, 1e5, GIB)]
    node_files(tmp_path, rows)
    r = cli("report", "digest", "--db", str(tmp_path / "nodes"), "--week", "2026-W48", "--format", "html")
    assert r.exit_code == 0, r.stderr
    page = r.stdout
    assert "<h2>By user</h2>" in page and "<h2>By account</h2>" in page
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "acct&amp;&lt;b&gt;" in page
    assert "default-src 'none'" in page and "border-collapse" in page  # the report's own style
    assert page.count('<tr class="total">') == 2


# ---------------------------------------------------------------- mail


def write_config(tmp_path: pathlib.Path, smtp_address: str, domain: str = "example.org") -> pathlib.Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[efficiency]\nsmtp_server = "{smtp_address}"\nmail_domain = "{domain}"\n'
                   'mail_from = "gpu-digest@example.org"\n')
    os.chmod(cfg, 0o644)
    return cfg


@pytest.fixture
def smtp(tmp_path):
    server = SmtpServer(tmp_path / "smtp").start()
    yield server
    server.stop()


def body_of(msg: Any) -> str:
    return msg.get_payload(decode=True).decode()


def test_mail_sends_each_user_their_own_figures(nodes, tmp_path, smtp):
    cfg = write_config(tmp_path, smtp.address)
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--mail")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""  # mailing prints no digest unless --format or -o asks
    assert f"2026-W48: 4 of 4 mail(s) sent (smtp {smtp.address})" in r.stderr
    msgs = {m["To"]: m for m in smtp.wait_for(4)}
    # erin had no GPU time this week: no mail.
    assert sorted(msgs) == ["alice@example.org", "bob@example.org", "carol@example.org", "dave@example.org"]
    alice = msgs["alice@example.org"]
    assert alice["From"] == "gpu-digest@example.org"
    assert alice["Subject"] == "[slurm-gpu] Your GPU use in 2026-W48: 10.00 GPU-h, 4.00 idle"
    body = body_of(alice)
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in body.splitlines() if ln.startswith("  GPU-h ") or
            ln.startswith("  jobs")]
    assert rows == [["GPU-h allocated", "10.00", "8.00", "+2.00"], ["GPU-h used", "4.28", "3.28"],
                    ["GPU-h idle", "4.00", "4.00", "+0.00"], ["jobs", "2", "1"], ["jobs with idle GPUs", "1", "1"]]
    assert "Jobs that held GPUs idle: 201\n" in body
    assert "Details: slurm-gpu report --user alice --since 2026-11-23 --until 2026-11-30\n" in body
    assert "bob" not in body and "carol" not in body
    bob = body_of(msgs["bob@example.org"])
    assert ["GPU-h allocated", "10.00", "24.00", "-14.00"] in [re.split(r"\s{2,}", ln.strip()) for ln in bob.splitlines()]
    assert "Jobs that held GPUs idle" not in bob
    dave = body_of(msgs["dave@example.org"])
    assert "Jobs that held GPUs idle: 206\n" in dave
    assert ["jobs", "2", "0"] in [re.split(r"\s{2,}", ln.strip()) for ln in dave.splitlines()]


def test_mail_to_addresses_sends_the_whole_digest_instead(nodes, tmp_path, smtp):
    cfg = write_config(tmp_path, smtp.address)
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--mail",
            "--to", "admins@example.org", "--to", "physics-pi@example.org")
    assert r.exit_code == 0, r.stderr
    msgs = smtp.wait_for(2)
    assert sorted(m["To"] for m in msgs) == ["admins@example.org", "physics-pi@example.org"]
    text = cli("report", "digest", "--db", str(nodes), "--week", "2026-W48").stdout
    for m in msgs:
        assert m["Subject"] == "[slurm-gpu] GPU digest 2026-W48"
        assert body_of(m).startswith(text.rstrip("\n") + "\n\n-- \n")
        assert "By user" in body_of(m) and "By account" in body_of(m)


def test_mail_server_down_is_one_line_per_mail_and_exit_1(nodes, tmp_path):
    port = free_port()  # nothing listens there
    cfg = write_config(tmp_path, f"127.0.0.1:{port}")
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--mail")
    assert r.exit_code == 1
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("slurm-gpu: error:")]
    assert [ln.split(":")[2].strip() for ln in errors] == [f"mail to {u}@example.org" for u in ("alice", "bob", "carol",
                                                                                                  "dave")]
    assert all(f"SMTP server 127.0.0.1:{port}: ConnectionRefusedError" in ln for ln in errors)
    assert r.stderr.splitlines()[-1] == "slurm-gpu: digest 2026-W48: 0 of 4 mail(s) sent, 4 failed"


def test_a_user_that_cannot_be_mailed_fails_alone_and_the_others_go(tmp_path, smtp):
    rows = ROWS + [rec("c1", 300, "n1", 0, "-oQ/tmp/x", "bio", "gpu", "2026-11-24T00:00", "2026-11-24T01:00", 50, 1,
                       1e5, GIB)]
    node_files(tmp_path, rows)
    cfg = write_config(tmp_path, smtp.address)
    r = cli("--config", str(cfg), "report", "digest", "--db", str(tmp_path / "nodes"), "--week", "2026-W48", "--mail")
    assert r.exit_code == 1
    assert "slurm-gpu: error: user name '-oQ/tmp/x' is not a plain user name: not mailed\n" in r.stderr
    assert "4 of 5 mail(s) sent" in r.stderr
    assert len(smtp.wait_for(4)) == 4


def test_dry_run_prints_the_mails_and_sends_nothing(nodes, tmp_path, smtp):
    cfg = write_config(tmp_path, smtp.address)
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--mail", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("\nTo: ") + r.stdout.startswith("To: ") == 4
    assert "To: alice@example.org\nSubject: [slurm-gpu] Your GPU use in 2026-W48: 10.00 GPU-h, 4.00 idle\n" in r.stdout
    assert "slurm-gpu: dry run: 4 mail(s) not sent" in r.stderr
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--to", "a@example.org",
            "-n")
    assert r.exit_code == 0 and r.stdout.startswith("To: a@example.org\nSubject: [slurm-gpu] GPU digest 2026-W48")
    time.sleep(0.5)
    assert smtp.messages() == []


def test_without_mail_domain_a_user_is_mailed_by_bare_name_which_smtp_cannot_deliver(nodes, tmp_path, smtp):
    cfg = write_config(tmp_path, smtp.address, domain="")
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--mail", "-n")
    assert r.exit_code == 0 and "To: alice\n" in r.stdout
    r = cli("--config", str(cfg), "report", "digest", "--db", str(nodes), "--week", "2026-W48", "--mail")
    assert r.exit_code == 1
    assert "slurm-gpu: error: mail to alice: cannot mail 'alice' by SMTP: no domain" in r.stderr


# ---------------------------------------------------------------- the central server


def _job_ends(rows: Sequence[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """The rows as the epilog's job_end records, per node."""
    runs: Dict[tuple, List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        runs[(r["node"], r["cluster"], r["job_id"], r["restart_count"])].append(r)
    out: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for (node, _c, _j, _r), gpus in sorted(runs.items()):
        g0 = gpus[0]
        job = {k: g0[k] for k in ("cluster", "job_id", "restart_count", "node", "user", "account", "partition")}
        job.update(uid=1, gpu_count=len(gpus), start_time=g0["start_time"], end_time=g0["end_time"], exit_code="0")
        out[node].append({"kind": "job_end", "job": job, "gpus": [dict(g) for g in gpus]})
    return out


@pytest.mark.central
def test_the_digest_from_the_central_server_equals_its_report_and_the_node_files(mariadb_server, tmp_path):
    from test_central import Site, cli_env

    from slurm_gpu.store.node import Store

    s = Site(mariadb_server, tmp_path)
    s.init(writers="n[1-3]", clusters=("c1", "c2"), group=f"grp_{s.db[-8:]}")
    files = []
    for node, recs in _job_ends(ROWS).items():
        st = Store(str(tmp_path / f"{node}.db"), str(tmp_path / f"spool-{node}"))
        for r in recs:
            st.write(r)
        st.close()
        files.append(str(tmp_path / f"{node}.db"))
        p = s.push("--db", files[-1])
        assert p.returncode == 0, p.stderr
    reporter = s.write_config(s.reporter, s.reporter_pw, name="reporter.toml")
    url = s.server.url(s.reporter, s.db)

    def run(*args: str) -> str:
        r = cli_env({}, "--config", str(reporter), "report", *args)
        assert r.returncode == 0, r.stderr
        return r.stdout

    central = run("digest", "--week", "2026-W48", "--db", url, "--format", "json")
    from_files = run("digest", "--week", "2026-W48", *[a for f in files for a in ("--db", f)], "--format", "json")
    assert central == from_files
    d = json.loads(central)
    assert {ln["user"]: ln["gpu_hours_alloc"] for ln in d["users"]} == {"alice": 10.0, "bob": 10.0, "carol": 2.0,
                                                                         "dave": 4.0, "erin": 0.0}
    for key in ("user", "account"):
        lines = {ln[key]: ln for ln in d[f"{key}s"]}
        for (since, until), pick in ((W48, lambda ln: ln), (W47, lambda ln: ln["previous"])):
            rows = json.loads(run("--by", key, "--since", since, "--until", until, "--db", url, "--format", "json"))
            assert {r[key] for r in rows} == {k for k, ln in lines.items() if pick(ln)["jobs"]}
            for r in rows:
                assert {c: pick(lines[r[key]])[c] for c in FIGS} == {c: r[c] for c in FIGS}, (key, since)
    r = cli_env({}, "--config", str(reporter), "report", "digest", "--week", "2026-W48", "--db", url, "--explain")
    assert r.returncode == 0 and "slurm-gpu: plan: 2026-W48 by user: rollups: 7 day(s)" in r.stderr, r.stderr
