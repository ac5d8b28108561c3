"""`slurm-gpu fleet`: versions, memory, capacity and XIDs across the fleet (docs/fleet.md).

A simulated fleet of 200 nodes is loaded into the real central schema on a real MariaDB (the
server tests/mariadb.py starts) and every view is checked against expectations computed by
hand from the simulation below; inventory-directory mode reads real inventory files; Slurm's
view comes from `scontrol -o show node` lines parsed by the real backend parser (the real
Slurm testbed is in tests/integration/test_fleet_slurm.py).
"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from mariadb import MariaDB
from testbed import unavailable

from slurm_gpu import config
from slurm_gpu.central import schema as CS
from slurm_gpu.central import server as C
from slurm_gpu.central import writers as W
from slurm_gpu.fleet import capacity, memory, model, versions, xids
from slurm_gpu.fleet import central as fc
from slurm_gpu.fleet.model import Gpu, Point
from slurm_gpu.gpu import xidcatalog
from slurm_gpu.slurm.cli_text import node_from_fields, parse_show_line

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

REPO = Path(__file__).resolve().parents[1]
DAY = 86400.0
NOW = time.time()
H100, V100 = "NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB"
DRIVER, CUDA, VBIOS = "550.54.15", "12.4", "96.00.74.00.01"


def cli(*args: str, env: Dict[str, str] = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("SLURM_CONF", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=str(REPO))


def write_config(tmp: Path, extra: str = "") -> Path:
    p = tmp / "fleet.toml"
    p.write_text(f'slurm_conf = "{tmp}/no-slurm.conf"\nslurm_backend = "cli"\nslurm_timeout_s = 2.0\n{extra}')
    return p


# ------------------------------------------------------------------ the simulated fleet
#
# gpu001-gpu100 in partition train, gpu101-gpu200 in infer, 8 GPUs each (H100; gpu180: V100),
# one inventory a day for 8 days (day 0 = 7 days ago ... day 7 = today).
#   drivers: 550.54.15 everywhere but gpu017 (535.104.05, CUDA 12.2) and gpu042 (550.90.07)
#   VBIOS:   gpu150 GPU 3 differs from its node's other GPUs
#   memory:  gpu010 GPU 2 corrected ECC +10/day, gpu120 GPU 5 +100/day; gpu050 GPU 0 one bank
#            without spare rows (8 uncorrectable remaps); gpu060 GPU 1 remap failure (RMA);
#            gpu180 GPU 4 61 retired pages (RMA, V100); gpu030 GPU 6 remap pending (today),
#            1 correctable remap
#   bad data: gpu090 GPU 3 counter goes down on day 4; gpu095 GPU 2 swapped on day 4 (new
#            UUID and serial); gpu198 last reported 5 days ago; gpu199 and gpu200 never.

def node_name(i: int) -> str:
    return f"gpu{i:03d}"


def slurm_nodes() -> List[Any]:
    out = []
    for i in range(1, 201):
        typ = "v100" if i == 180 else "h100"
        line = (f"NodeName={node_name(i)} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=64 Gres=gpu:{typ}:8(S:0-1) "
                f"GresUsed=gpu:{typ}:0(IDX:N/A) NodeAddr={node_name(i)} State=IDLE "
                f"Partitions={'train' if i <= 100 else 'infer'} CfgTRES=cpu=64,gres/gpu=8")
        out.append(node_from_fields(parse_show_line(line)))
    return out


def _counters(i: int, g: int, day: int) -> Dict[str, Any]:
    v100 = i == 180
    c: Dict[str, Any] = dict.fromkeys(C.INVENTORY_COUNTERS, 0)
    if v100:
        for k in C.INVENTORY_COUNTERS:
            if k.startswith(("remap", "sram")):
                c[k] = None
    else:
        c.update(retired_pages_sbe=None, retired_pages_dbe=None, retired_pages_pending=None, remap_hist_max=1000)
    corr = {(10, 2): 100 + 10 * day, (120, 5): 1000 + 100 * day,
            (90, 3): 500 + 10 * day if day < 4 else day + 1}.get((i, g), 0)
    c.update(ecc_corrected_aggregate=corr, ecc_corrected_volatile=corr)
    if (i, g) == (50, 0):
        c.update(remap_hist_none=1, remap_hist_max=999, remapped_rows_uncorrectable=8)
    if (i, g) == (60, 1):
        c.update(remap_failure=1, remapped_rows_uncorrectable=9)
    if (i, g) == (180, 4):
        c.update(retired_pages_sbe=40, retired_pages_dbe=21)
    if (i, g) == (30, 6) and day == 7:
        c.update(remap_pending=1, remapped_rows_correctable=1)
    return c


def _gpu_row(i: int, g: int, day: int) -> Dict[str, Any]:
    node = node_name(i)
    uuid, serial = f"GPU-{node}-{g}", f"16500{i:03d}{g}"
    if (i, g) == (95, 2) and day >= 4:
        uuid, serial = f"GPU-{node}-{g}-new", "1650099999"
    driver = {17: "535.104.05", 42: "550.90.07"}.get(i, DRIVER)
    vbios = "88.00.80.00.01" if i == 180 else ("96.00.61.00.01" if (i, g) == (150, 3) else VBIOS)
    row = dict(cluster="sim", node=node, gpu_uuid=uuid, time=NOW - (7 - day) * DAY, gpu_index=g, serial=serial,
               model=V100 if i == 180 else H100, vbios=vbios, driver_version=driver,
               cuda_version="12.2" if i == 17 else CUDA, mig_mode=None if i == 180 else 0)
    row.update(_counters(i, g, day))
    if (i, g) == (95, 2) and day >= 4:
        row.update(ecc_corrected_aggregate=0, ecc_corrected_volatile=0)
    elif (i, g) == (95, 2):
        row.update(ecc_corrected_aggregate=50 * day, ecc_corrected_volatile=50 * day)
    return row


def sim_inventory() -> List[Dict[str, Any]]:
    rows = []
    for i in range(1, 199):
        for day in range(8):
            if i == 198 and day > 2:
                continue
            rows += [_gpu_row(i, g, day) for g in range(8)]
    return rows


def sim_xids() -> List[Dict[str, Any]]:
    ev = [("gpu060", 1, 64, 2, "Row Remapper: Failed to remap row"), ("gpu060", 1, 48, 2, "Double Bit ECC"),
          ("gpu077", 0, 154, 1, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"),
          ("gpu101", 7, 79, 3, "GPU has fallen off the bus."), ("gpu101", 7, 79, 2, "GPU has fallen off the bus."),
          ("gpu130", 2, 999, 1, "something new"), ("gpu005", 0, 31, 10, "MMU Fault (too old for the window)")]
    ev += [(node_name(i), 0, 13, 1, "Graphics SM Warp Exception") for i in range(10, 15)]
    rows = []
    for n, (node, g, xid, days_ago, detail) in enumerate(ev):
        rows.append(dict(cluster="sim", node=node, event_key=f"{n:064d}", time=NOW - days_ago * DAY + n, gpu_index=g,
                         gpu_uuid=f"GPU-{node}-{g}", pci_bus_id=f"00000000:{g + 0x18:02x}:00.0", xid=xid,
                         detail=detail, line_count=1, last_time=None))
    return rows


def _insert(srv: C.Central, table: str, rows: List[Dict[str, Any]]) -> None:
    cols = C.COLUMNS[table] + ("shipped_at",)
    sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})"
    for k in range(0, len(rows), 2000):
        srv.executemany(sql, [tuple(r.get(c, NOW) if c == "shipped_at" else r[c] for c in cols)
                              for r in rows[k:k + 2000]])
    srv.commit()


class Server:
    """One database on the test server with the schema, an admin and a reporter (the GRANTs printed)."""

    def __init__(self, m: MariaDB, tmp: Path):
        self.m, self.tmp = m, tmp
        self.db = m.new_database("fleet")
        self.admin_pw = m.new_user("fadm", [f"GRANT ALL ON {self.db}.* TO 'fadm'@'%';"])
        self.admin = self.connect("fadm", self.admin_pw)
        self.admin.migrate()
        grants = [g for g in C.grants(C.parse_url(m.url("fadm", self.db)), "fwr", "frep") if g.startswith("GRANT")]
        self.reporter_pw = m.new_user("frep", [g for g in grants if "'frep'" in g])
        self.writer_pw = m.new_user("fwr", [g for g in grants if "'fwr'" in g])
        # v5: the writer ships the records of every node of cluster 'pushed' (a node group).
        W.register(self.admin, "pushed", [W.Writer("fwr", (W.ANY_NODE,))])

    def connect(self, user: str, password: str) -> C.Central:
        return C.Central(C.parse_url(self.m.url(user, self.db)), password, 10, 120)

    def password_file(self, user: str, password: str) -> Path:
        p = self.tmp / f"{user}.pw"
        p.write_text(password + "\n")
        os.chmod(p, 0o600)
        return p

    def args(self) -> List[str]:
        return ["--db", self.m.url("frep", self.db), "--password-file", str(self.password_file("frep", self.reporter_pw))]


@pytest.fixture(scope="module")
def mariadb(mariadb_server):
    """The session's MariaDB (tests/conftest.py): the fleet's database and its accounts there."""
    return mariadb_server


@pytest.fixture(scope="module")
def sim(mariadb, tmp_path_factory):
    s = Server(mariadb, tmp_path_factory.mktemp("fleet"))
    _insert(s.admin, "gpu_inventory", sim_inventory())
    _insert(s.admin, "xid_events", sim_xids())
    yield s
    s.admin.close()


def sim_fleet(s: Server, since: float = NOW - 8 * DAY) -> model.Fleet:
    """The fleet as the CLI loads it, read by the reporter account, with Slurm's simulated view."""
    srv = s.connect("frep", s.reporter_pw)
    try:
        fc.open_snapshot(srv)
        cluster = fc.choose_cluster(srv, "")
        gpus, marks = model.current(fc.latest(srv, cluster), time.time())
        data = model.Fleet("sim", gpus, marks, fc.history(srv, cluster, since, time.time()))
    finally:
        srv.close()
    return model.with_slurm(data, slurm_nodes())


# ------------------------------------------------------------------ central schema v2

@pytest.mark.central
def test_central_init_migrates_a_v1_server_and_check_reports_it(mariadb, tmp_path):
    db = mariadb.new_database("v1")
    pw = mariadb.new_user("v1adm", [f"GRANT ALL ON {db}.* TO 'v1adm'@'%';"])
    srv = C.Central(C.parse_url(mariadb.url("v1adm", db)), pw, 10)
    for stmt in C.MIGRATIONS[0]:
        srv.execute(stmt)
    srv.execute("INSERT INTO meta (name, value) VALUES ('schema_version', '1')")
    srv.commit()
    pwf = tmp_path / "adm.pw"
    pwf.write_text(pw)
    os.chmod(pwf, 0o600)
    cfg = write_config(tmp_path, f'[central]\nurl = "{mariadb.url("v1adm", db)}"\npassword_file = "{pwf}"\n')
    r = cli("--config", str(cfg), "central", "init", "--check")
    assert r.returncode == 1 and f"schema version 1, this slurm-gpu needs {C.SCHEMA_VERSION}" in r.stdout, r.stdout + r.stderr
    r = cli("--config", str(cfg), "fleet", "versions", "--no-slurm")
    assert r.returncode == 5 and "schema version 1 has no GPU inventories" in r.stderr, r.stderr
    r = cli("--config", str(cfg), "central", "init", "--cluster", "sim", "--writers", "*", "--group", "slurm_gpu_writer",
            "--password-dir", str(tmp_path / "writers"))
    assert r.returncode == 0 and f"schema migrated from 1 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    assert f"GRANT INSERT ON `{db}`.`stage_gpu_inventory` TO 'slurm_gpu_writer'@'%';" in r.stdout
    assert f"GRANT INSERT ON `{db}`.`stage_xid_events` TO 'slurm_gpu_writer'@'%';" in r.stdout
    r = cli("--config", str(cfg), "central", "init", "--check")
    assert r.returncode == 0 and f"schema version {C.SCHEMA_VERSION}, current" in r.stdout
    srv.close()


@pytest.mark.central
def test_the_writer_ships_inventories_and_xids_through_apply_batch_and_cannot_read_them(sim):
    w = sim.connect("fwr", sim.writer_pw)
    inv = dict(_gpu_row(1, 0, 7), cluster="pushed", time=NOW)
    xid = dict(sim_xids()[0], cluster="pushed")
    try:
        for table, row in (("gpu_inventory", inv), ("xid_events", xid)):
            w.executemany(C.stage_sql(table), [("b" * 32,) + tuple(row[c] for c in C.COLUMNS[table]) + (NOW, 0)])
        w.execute("CALL apply_batch(%s)", ("b" * 32,))
        w.commit()
        for sql in ("SELECT * FROM gpu_inventory", "SELECT * FROM xid_events", "DELETE FROM gpu_inventory"):
            with pytest.raises(Exception, match="denied"):
                w.execute(sql)
    finally:
        w.close()
    got = sim.admin.execute("SELECT remap_hist_max, vbios, driver_version FROM gpu_inventory WHERE cluster = 'pushed'")
    assert got == [(1000, VBIOS, DRIVER)]
    assert sim.admin.execute("SELECT xid, detail FROM xid_events WHERE cluster = 'pushed'") == [(64, xid["detail"])]
    assert sim.admin.execute(CS.staged_rows_sql("gpu_inventory")) == [(0,)]
    sim.admin.execute("DELETE FROM gpu_inventory WHERE cluster = 'pushed'")
    sim.admin.execute("DELETE FROM xid_events WHERE cluster = 'pushed'")
    sim.admin.commit()


# ------------------------------------------------------------------ the 200-node fleet, by hand

@pytest.mark.central
def test_versions_of_the_simulated_fleet_name_every_outlier_and_mixed_node(sim):
    rows = versions.versions_view(sim_fleet(sim), versions.Pins())
    got = {(r["partition"], r["model"], r["component"]): r for r in rows}
    drv = got[("train", H100, "driver")]
    assert (drv["nodes"], drv["majority"], drv["majority_nodes"], drv["status"]) == (100, DRIVER, 98, "inconsistent")
    assert drv["outliers"] == "535.104.05: gpu017; 550.90.07: gpu042"
    cuda = got[("train", H100, "cuda")]
    assert (cuda["majority"], cuda["outliers"], cuda["status"]) == (CUDA, "12.2: gpu017", "inconsistent")
    assert got[("train", H100, "vbios")]["status"] == "consistent"
    assert got[("infer", H100, "driver")]["status"] == "consistent" and got[("infer", H100, "driver")]["nodes"] == 97
    vb = got[("infer", H100, "vbios")]
    assert vb["status"] == "inconsistent" and vb["outliers"] is None and vb["majority_nodes"] == 96
    assert vb["gpus_disagree"].startswith("gpu150 (GPU 0=96.00.74.00.01, GPU 1=96.00.74.00.01, GPU 2=96.00.74.00.01, "
                                          "GPU 3=96.00.61.00.01, ")
    assert got[("infer", V100, "vbios")]["majority"] == "88.00.80.00.01"
    never = [r for r in rows if r["status"] == "never reported"]
    assert [(r["partition"], r["unknown"]) for r in never] == [("infer", "gpu[199-200]")]
    assert versions.failing(rows)


@pytest.mark.central
def test_pinned_versions_name_the_nodes_that_differ(sim):
    data = sim_fleet(sim)
    rows = versions.versions_view(data, versions.Pins(DRIVER, "", {V100: "88.00.80.00.02"}))
    got = {(r["partition"], r["model"], r["component"]): r for r in rows}
    assert got[("train", H100, "driver")]["status"] == "inconsistent; differs from pinned"
    assert got[("train", H100, "driver")]["off_pin"] == "535.104.05: gpu017; 550.90.07: gpu042"
    assert got[("infer", V100, "vbios")]["off_pin"] == "all 1 nodes (88.00.80.00.01)"
    assert got[("infer", H100, "vbios")]["pinned"] is None  # H100 VBIOS not pinned
    branch = {(r["partition"], r["component"]): r for r in versions.versions_view(data, versions.Pins("550."))
              if r["model"] == H100}
    assert branch[("train", "driver")]["off_pin"] == "535.104.05: gpu017"


def _rows_by_list(rows: List[Dict[str, Any]]) -> Dict[str, List[Tuple[str, Any]]]:
    out: Dict[str, List[Tuple[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["list"], []).append((r["node"], r["gpu_index"]))
    return out


@pytest.mark.central
def test_memory_of_the_simulated_fleet_ranks_rma_resets_and_early_warnings(sim):
    rows = memory.memory_view(sim_fleet(sim), 60)
    lists = _rows_by_list(rows)
    assert lists["RMA"] == [("gpu060", 1), ("gpu180", 4)]
    assert lists["reset"] == [("gpu030", 6)]
    assert lists["early-warning"] == [("gpu050", 0), ("gpu120", 5), ("gpu010", 2), ("gpu030", 6)]
    assert lists["data"] == [("gpu090", 3), ("gpu095", 2), ("gpu198", None), ("gpu199", None), ("gpu200", None)]
    by = {(r["list"], r["node"], r["gpu_index"]): r for r in rows}
    assert "row-remapping failure flag set" in by[("RMA", "gpu060", 1)]["reason"]
    assert by[("RMA", "gpu180", 4)]["reason"].startswith("61 retired pages: at or above 60")
    ew = by[("early-warning", "gpu050", 0)]
    assert ew["reason"] == ("1 memory bank with no spare row left (row-remapper histogram); "
                            "8 of 512 rows remapped for uncorrectable errors")
    assert (ew["banks_no_spare"], ew["remapped_uncorrectable"]) == (1, 8)
    assert by[("early-warning", "gpu120", 5)]["ecc_corrected_per_day"] == pytest.approx(100.0, abs=0.01)
    assert by[("early-warning", "gpu010", 2)]["ecc_corrected_per_day"] == pytest.approx(10.0, abs=0.01)
    assert "went down from 530 to 5" in by[("data", "gpu090", 3)]["reason"]
    assert by[("data", "gpu090", 3)].get("ecc_corrected_per_day") is None
    assert by[("data", "gpu095", 2)]["reason"].startswith(
        "GPU swapped: GPU-gpu095-2 (serial 165000952) replaced by GPU-gpu095-2-new (serial 1650099999)")
    assert by[("data", "gpu198", None)]["reason"] == "stale: the newest report is 5.0 days old"
    assert by[("data", "gpu199", None)]["reason"].startswith("never reported")
    assert [r["rank"] for r in rows if r["list"] == "early-warning"] == [1, 2, 3, 4]


@pytest.mark.central
def test_a_window_after_a_swap_gives_the_new_gpu_no_trend_from_the_old_one(sim):
    rows = memory.memory_view(sim_fleet(sim, since=NOW - 2.5 * DAY), 60)
    assert not [r for r in rows if r["node"] == "gpu095" and r["list"] != "data"]
    assert ("gpu010", 2) in _rows_by_list(rows)["early-warning"]  # 10/day in any window


@pytest.mark.central
def test_fleet_memory_cli_json_csv_and_exit_1_for_rma(sim):
    r = cli("fleet", "memory", *sim.args(), "--no-slurm", "-S", "now-8days", "--format", "json")
    assert r.returncode == 1, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["node"], x["gpu_index"]) for x in rows if x["list"] == "RMA"] == [("gpu060", 1), ("gpu180", 4)]
    assert "partitions could not be read from Slurm (--no-slurm)" in r.stderr
    assert not [x for x in rows if x["node"] in ("gpu199", "gpu200")]  # no Slurm: cannot be named
    r = cli("fleet", "memory", *sim.args(), "--no-slurm", "--format", "csv")
    header = next(csv.reader(io.StringIO(r.stdout)))
    assert tuple(header) == memory.COLUMNS and r.returncode == 1


@pytest.mark.central
def test_fleet_versions_cli_exit_1_when_inconsistent_and_html_is_one_page(sim):
    r = cli("fleet", "versions", *sim.args(), "--no-slurm", "--json")
    assert r.returncode == 1, r.stderr
    rows = json.loads(r.stdout)
    drv = [x for x in rows if x["component"] == "driver" and x["model"] == H100][0]
    assert drv["partition"] == "(unknown)" and drv["outliers"] == "535.104.05: gpu017; 550.90.07: gpu042"
    r = cli("fleet", "versions", *sim.args(), "--no-slurm", "--format", "html")
    assert r.stdout.startswith("<!DOCTYPE html>") and r.stdout.count("<table>") == 1 and "gpu017" in r.stdout


@pytest.mark.central
def test_fleet_xids_classify_by_nvidia_catalog_and_mark_unknown_codes(sim):
    r = cli("fleet", "xids", *sim.args(), "--by", "code", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = {x["xid"]: x for x in json.loads(r.stdout)}
    assert sorted(rows) == [13, 48, 64, 79, 154, 999]  # XID 31 is older than the window
    assert (rows[13]["class"], rows[13]["events"], rows[13]["nodes"], rows[13]["node_list"]) == (
        "application", 5, 5, "gpu[010-014]")
    assert (rows[79]["class"], rows[79]["events"], rows[79]["nodes"]) == ("hardware", 2, 1)
    assert rows[48]["class"] == rows[64]["class"] == "memory"
    assert rows[154]["action"].startswith("driver asks: GPU reset")
    assert rows[999]["class"] == "unknown" and "NVIDIA's catalog" in rows[999]["action"]
    assert "XID 999 not in slurm-gpu's catalog" in r.stderr
    r = cli("fleet", "xids", *sim.args(), "-S", "now-30days", "--format", "csv")
    got = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(got) == 11 and tuple(got[0]) == xids.COLUMNS["gpu"]
    assert [(x["xid"], x["node"], x["gpu_index"], x["events"]) for x in got if x["xid"] == "79"] == [("79", "gpu101", "7", "2")]


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@pytest.mark.central
def test_fleet_xids_counts_a_floods_lines_and_shows_its_first_and_last_line(sim):
    """Issue 39: 800,000 identical lines of XID 95 on one GPU are one row on the server (line_count): the
    view's events count lines, from the flood's first line to its last, even one begun before --since."""
    def row(n, node, g, t, count, last, detail="pid=7, Uncontained: FBHUB. RST: Yes, D-RST: No"):
        return dict(cluster="flood", node=node, event_key=f"f{n:063d}", time=t, gpu_index=g, gpu_uuid=f"GPU-{node}-{g}",
                    pci_bus_id=f"00000000:{g + 0x18:02x}:00.0", xid=95, detail=detail, line_count=count, last_time=last)
    rows = [row(1, "gpu001", 3, NOW - 2 * DAY, 800_000, NOW - 2 * DAY + 3000),
            row(2, "gpu001", 3, NOW - 2 * DAY + 10, 28, NOW - 2 * DAY + 2990, "pid=8, Uncontained: LTC TAG"),
            row(3, "gpu002", 0, NOW - 3600, 1, None),
            row(4, "gpu003", 1, NOW - 9 * DAY, 50, NOW - 2 * DAY)]  # begun before the window, still going in it
    _insert(sim.admin, "xid_events", rows)
    try:
        r = cli("fleet", "xids", *sim.args(), "-M", "flood", "--format", "json")
        assert r.returncode == 0, r.stderr
        got = [(x["node"], x["gpu_index"], x["events"], x["first"], x["last"]) for x in json.loads(r.stdout)]
        assert got == [("gpu001", 3, 800_028, _iso(NOW - 2 * DAY), _iso(NOW - 2 * DAY + 3000)),
                       ("gpu002", 0, 1, _iso(NOW - 3600), _iso(NOW - 3600)),
                       ("gpu003", 1, 50, _iso(NOW - 9 * DAY), _iso(NOW - 2 * DAY))]
        r = cli("fleet", "xids", *sim.args(), "-M", "flood", "--by", "code", "--format", "json")
        assert [(x["xid"], x["events"], x["nodes"]) for x in json.loads(r.stdout)] == [(95, 800_079, 3)]
    finally:
        sim.admin.execute("DELETE FROM xid_events WHERE cluster = 'flood'")
        sim.admin.commit()


# ------------------------------------------------------------------ inventory-directory mode

def inventory_doc(host: str, driver: str = DRIVER, vbios: Tuple[str, ...] = (VBIOS,) * 4, state: bool = True,
                  **gpu_state: Dict[int, Dict[str, int]]) -> Dict[str, Any]:
    gpus = []
    for i, vb in enumerate(vbios):
        g = {"index": i, "minor": i, "uuid": f"GPU-{host}-{i}", "name": H100, "pci_bus_id": f"00000000:{0x18 + i:02x}:00.0",
             "serial": f"S-{host}-{i}", "vbios": vb}
        if state:
            s = dict.fromkeys(C.INVENTORY_COUNTERS, 0)
            s.update(mig_mode=0, retired_pages_sbe=None, retired_pages_dbe=None, retired_pages_pending=None)
            s.update(gpu_state.get("states", {}).get(i, {}))
            g["state"] = s
        gpus.append(g)
    return {"format": "slurm-gpu-inventory/2", "hostname": host, "driver_version": driver, "cuda_version": CUDA,
            "collected_at": NOW - 60, "gpus": gpus}


def write_docs(d: Path, docs: List[Dict[str, Any]]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        (d / f"{doc['hostname']}.json").write_text(json.dumps(doc))
    return d


def test_inventory_dir_versions_exit_0_when_all_agree_and_1_with_an_outlier(tmp_path):
    cfg = write_config(tmp_path)
    inv = write_docs(tmp_path / "inv", [inventory_doc(f"n{i}") for i in range(1, 4)])
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 0, r.stderr
    assert {x["status"] for x in json.loads(r.stdout)} == {"consistent"}
    write_docs(inv, [inventory_doc("n4", driver="535.104.05")])
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 1
    drv = [x for x in json.loads(r.stdout) if x["component"] == "driver"][0]
    assert (drv["majority"], drv["outliers"]) == (DRIVER, "535.104.05: n4")


def test_a_pinned_driver_in_the_config_fails_versions_even_when_all_agree(tmp_path):
    inv = write_docs(tmp_path / "inv", [inventory_doc(f"n{i}") for i in range(1, 3)])
    cfg = write_config(tmp_path, '[health]\nrequired_driver_version = "560."\n')
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--format", "csv")
    assert r.returncode == 1
    drv = [x for x in csv.DictReader(io.StringIO(r.stdout)) if x["component"] == "driver"][0]
    assert (drv["pinned"], drv["status"], drv["off_pin"]) == ("560.", "differs from pinned", f"all 2 nodes ({DRIVER})")


def test_inventory_dir_marks_v1_files_and_broken_files_and_never_guesses_versions(tmp_path):
    old = {"format": "slurm-gpu-inventory/1", "hostname": "n9", "gpus": [
        {"index": 0, "minor": 0, "uuid": "GPU-n9-0", "name": H100, "pci_bus_id": "00000000:18:00.0", "cpus": "0-3",
         "cores": "0-3", "nvlink_peers": {}, "mig_enabled": False, "mig_devices": []}]}
    inv = write_docs(tmp_path / "inv", [inventory_doc("n1"), old])
    (inv / "broken.json").write_text("{not json")
    (inv / "other.json").write_text('{"format": "something-else/1"}')
    cfg = write_config(tmp_path)
    r = cli("--config", str(cfg), "fleet", "memory", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 0, r.stderr
    data = [(x["node"], x["reason"]) for x in json.loads(r.stdout) if x["list"] == "data"]
    assert ("n9", "n9.json: inventory format 1 has no versions or counters (write it again with "
                  "`slurm-gpu inventory --state`)") in data
    assert any(n == "broken.json" and "unreadable inventory file" in w for n, w in data)
    assert any(n == "other.json" and "unreadable inventory file" in w and "format: expected" in w
               and "got 'something-else/1'" in w for n, w in data)
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--json")
    drv = [x for x in json.loads(r.stdout) if x["component"] == "driver"][0]
    assert (drv["majority"], drv["unknown"], drv["status"]) == (DRIVER, "n9", "consistent")


def test_inventory_dir_memory_reads_the_state_and_says_there_are_no_trends(tmp_path):
    inv = write_docs(tmp_path / "inv", [
        inventory_doc("n1", states={2: {"remap_failure": 1}}),
        inventory_doc("n2", states={0: {"remap_hist_none": 2, "remap_hist_low": 1}, 3: {"remap_pending": 1}}),
        inventory_doc("n3", state=False)])
    r = cli("--config", str(write_config(tmp_path)), "fleet", "memory", "--inventory-dir", str(inv), "--no-slurm",
            "--format", "json")
    assert r.returncode == 1, r.stderr
    rows = json.loads(r.stdout)
    assert _rows_by_list(rows) == {"RMA": [("n1", 2)], "reset": [("n2", 3)], "early-warning": [("n2", 0)],
                                   "data": [("n3", None)]}
    assert "2 memory banks with no spare row left" in rows[2]["reason"]
    assert "no correctable-ECC growth rates" in r.stderr


def test_fleet_xids_needs_the_server_and_says_so_in_one_line(tmp_path):
    inv = write_docs(tmp_path / "inv", [inventory_doc("n1")])
    r = cli("--config", str(write_config(tmp_path)), "fleet", "xids", "--inventory-dir", str(inv))
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["slurm-gpu: error: inventory files hold no XID events",
                                     "hint: read them from the central server: --db URL"]


def test_without_a_source_fleet_says_what_to_give(tmp_path):
    r = cli("--config", str(write_config(tmp_path)), "fleet", "versions", "--no-slurm")
    assert r.returncode == 2 and "no central server and no inventory directory" in r.stderr


def test_unreachable_slurm_is_said_and_the_view_still_comes(tmp_path):
    inv = write_docs(tmp_path / "inv", [inventory_doc("n1")])
    r = cli("--config", str(write_config(tmp_path)), "fleet", "versions", "--inventory-dir", str(inv),
            env={"SLURM_CONF": str(tmp_path / "missing.conf")})
    assert r.returncode == 0, r.stderr
    assert "slurm-gpu: note: partitions could not be read from Slurm (" in r.stderr
    assert "(unknown)" in r.stdout.splitlines()[2]


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path):
    inv = write_docs(tmp_path / "inv", [inventory_doc(f"n{i}") for i in range(5)])
    cfg = write_config(tmp_path)
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm")
    assert "reading inventories" not in r.stderr
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--progress")
    assert "reading inventories" in r.stderr and r.returncode == 0


# ------------------------------------------------------------------ pure pieces

def _pts(*values, serials=None):
    return [Point(NOW + k * DAY, (serials or ["S"] * len(values))[k], v, v) for k, v in enumerate(values)]


def test_growth_is_a_rate_only_for_clean_counters():
    assert memory.growth(_pts(10, 20, 40)).per_day == pytest.approx(15.0)
    assert memory.growth(_pts(10)).per_day is None
    down = memory.growth(_pts(10, 20, 3, 9))
    assert down.per_day is None and "went down from 20 to 3" in down.mark
    swapped = memory.growth(_pts(10, 20, serials=["A", "B"]))
    assert swapped.per_day is None and "serial changed" in swapped.mark
    unsupported = [Point(NOW, "S", None, None), Point(NOW + DAY, "S", None, None)]
    assert memory.growth(unsupported) == memory.Growth(None, None, 0.0, "")
    gap = [Point(NOW, "S", 5, 5), Point(NOW + DAY, "S", None, None)]
    assert "missing from some reports" in memory.growth(gap).mark
    vol_only = [Point(NOW, "S", None, 1), Point(NOW + 2 * DAY, "S", None, 9)]
    assert memory.growth(vol_only).per_day == pytest.approx(4.0)


def node(state: str, reason: str = "", gres: str = "gpu:h100:4(S:0-1)", used: str = "gpu:h100:0(IDX:N/A)",
         parts: str = "gpu", name: str = "n1") -> Any:
    line = (f"NodeName={name} Arch=x86_64 Gres={gres} GresUsed={used} State={state} Partitions={parts} "
            + (f"Reason={reason} [root@2026-11-30T10:00:00]" if reason else ""))
    return node_from_fields(parse_show_line(line))


def test_capacity_puts_every_gpu_in_exactly_one_state():
    assert capacity.node_gpus(node("MIXED", used="gpu:h100:1(IDX:0)"))["h100"] == dict(
        total=4, allocated=1, idle=3, drained_slurm_gpu=0, drained_admin=0, down=0)
    ours = node("MIXED+DRAIN", "slurm-gpu: GPU 3 (GPU-8f2c) uncorrectable ECC errors: 2 [prolog job 4711]",
                used="gpu:h100:1(IDX:0)")
    assert capacity.node_gpus(ours)["h100"]["drained_slurm_gpu"] == 3 and capacity.node_gpus(ours)["h100"]["allocated"] == 1
    assert capacity.node_gpus(node("IDLE+DRAIN", "disk swap"))["h100"]["drained_admin"] == 4
    assert capacity.node_gpus(node("DOWN+DRAIN", "slurm-gpu: lost"))["h100"]["down"] == 4
    assert capacity.node_gpus(node("IDLE*"))["h100"]["down"] == 4
    two = capacity.node_gpus(node("IDLE", gres="gpu:a100:1,gpu:v100:2", used="gpu:a100:0(IDX:N/A),gpu:v100:1(IDX:2)"))
    assert (two["a100"]["idle"], two["v100"]["allocated"], two["v100"]["idle"]) == (1, 1, 1)


def test_capacity_rows_per_partition_and_cluster_against_the_reserve():
    nodes = [node("IDLE", name="n1", parts="a,b"), node("ALLOCATED", used="gpu:h100:4(IDX:0-3)", name="n2", parts="a"),
             node("IDLE+DRAIN", "slurm-gpu: GPU 1 xid 79 [healthcheck]", name="n3", parts="a"), node("IDLE", name="n4", parts="b",
                                                                                    gres="gpu:a100:8")]
    rows = {(r["partition"], r["model"]): r for r in capacity.capacity_view(nodes, 20.0)}
    a = rows[("a", "h100")]
    assert (a["total"], a["allocated"], a["idle"], a["drained_slurm_gpu"], a["reserve_target"], a["reserve_holds"]) == (
        12, 4, 4, 4, 3, "yes")
    assert rows[("b", "h100")]["total"] == 4 and rows[("b", "a100")]["idle"] == 8
    assert rows[("(cluster)", "h100")]["total"] == 12 and rows[("(cluster)", "h100")]["nodes"] == 3
    tight = {(r["partition"], r["model"]): r for r in capacity.capacity_view(nodes, 50.0)}
    assert (tight[("a", "h100")]["reserve_holds"], tight[("a", "h100")]["shortfall"]) == ("no", 2)
    assert capacity.failing(list(tight.values())) and not capacity.failing(list(rows.values()))
    assert capacity.reserve_target(10, 20.0) == 2 and capacity.reserve_target(7, 20.0) == 2


def test_a_driver_library_mismatch_is_a_failing_row_per_partition_naming_nodes_and_both_versions():
    fleet = model.with_slurm(model.Fleet("t", [Gpu(node_name(i), f"GPU-{i}", NOW, 0, model=H100, driver_version=DRIVER)
                                               for i in (1, 2, 150)]), slurm_nodes())
    fleet.mismatched = {n: model.Mismatch(n, k, lib, NOW) for n, k, lib in (
        ("gpu003", "535.104.05", DRIVER), ("gpu004", "535.104.05", DRIVER), ("gpu010", "", "550.90.07"),
        ("gpu150", "535.104.05", DRIVER))}
    rows = versions.versions_view(fleet, versions.Pins())
    got = [(r["partition"], r["nodes"], r["outliers"]) for r in rows if r["status"] == versions.MISMATCH]
    assert got == [("infer", 1, f"kernel module 535.104.05, NVML library {DRIVER}: gpu150"),
                   ("train", 3, f"kernel module 535.104.05, NVML library {DRIVER}: gpu[003-004]; "
                                "kernel module unknown, NVML library 550.90.07: gpu010")]
    assert versions.failing(rows)
    silent = fleet.never_reported()
    assert "gpu005" in silent and not {"gpu003", "gpu010"} & set(silent)  # a mismatched node did say something
    assert not versions.failing([r for r in rows if r["status"] != versions.MISMATCH])


def test_a_versions_tie_is_said_and_takes_the_highest_version():
    gpus = [model.Gpu(f"n{i}", f"G{i}", NOW, 0, model=H100, driver_version=v)
            for i, v in enumerate(["535.104.05", "550.54.15"])]
    row = [r for r in versions.versions_view(model.Fleet("t", gpus), versions.Pins()) if r["component"] == "driver"][0]
    assert (row["majority"], row["status"], row["outliers"]) == ("550.54.15", "inconsistent (no majority: tie)",
                                                                 "535.104.05: n0")


def test_the_xid_catalog_knows_every_xid_the_config_judges_and_reads_xid_154():
    cfg = config.defaults()
    for xid in cfg.get("xid", "critical") + cfg.get("xid", "ignore"):
        assert xidcatalog.describe(xid).known, xid
    assert {xidcatalog.describe(x).kind for x in cfg.get("xid", "ignore")} == {xidcatalog.APPLICATION}
    assert xidcatalog.describe(74).kind == xidcatalog.NVLINK and xidcatalog.describe(79).kind == xidcatalog.HARDWARE
    assert xidcatalog.recovery_action("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)") == 2
    assert xidcatalog.action_for(154, "recovery action changed from 0x1 to 0x0").startswith("driver asks: none")
    assert "nvidia-smi -q" in xidcatalog.action_for(154, "no action here")
    assert not xidcatalog.describe(4242).known and "4242" in xidcatalog.describe(4242).action


# ------------------------------------------------------------------ end to end: the real inventory writer

@pytest.fixture(scope="module")
def simlib():
    import shutil

    import simgpu
    if shutil.which("cc") is None:
        unavailable("no C compiler for the simulated NVML library")
    return simgpu, simgpu.build()


def _inventory_state(simlib, tmp: Path, host: str, change=None, exit_code: int = 0) -> Path:
    simgpu, lib = simlib
    node = simgpu.PROFILES["h100_sxm"](n=4, seed=host)
    if change:
        change(node)
    state = simgpu.write_state(tmp / f"{host}.state", node)
    env = simgpu.environ(state)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    version = tmp / "nvidia-version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.104.05  Release Build\n")
    cfg = write_config(tmp, f'nvml_library = "{lib}"\nnvidia_version_file = "{version}"\n'
                            f'[gres]\ncpu_topology_dir = "{tmp / "no-sysfs"}"\n')
    out = tmp / "inv" / f"{host}.json"
    out.parent.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), "inventory", "--state",
                        "--hostname", host, "--output", str(out)], capture_output=True, text=True, env=env,
                       timeout=60, cwd=str(tmp))
    assert r.returncode == exit_code, r.stderr
    return out.parent


def test_fleet_reads_what_inventory_state_writes_from_the_simulated_driver(simlib, tmp_path):
    def worn(node):
        node["gpus"][2].update(remap_hist_none=1, remap_hist_max=2559, remapped_uncorrected=8)
        node["gpus"][3].update(remapped_failure=1)
    _inventory_state(simlib, tmp_path, "sim01")
    inv = _inventory_state(simlib, tmp_path, "sim02", worn)
    cfg = write_config(tmp_path)
    r = cli("--config", str(cfg), "fleet", "memory", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 1, r.stderr
    rows = json.loads(r.stdout)
    assert _rows_by_list(rows) == {"RMA": [("sim02", 3)], "early-warning": [("sim02", 2)]}
    assert rows[1]["banks_no_spare"] == 1 and rows[1]["remapped_uncorrectable"] == 8
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 0, r.stderr
    assert {(x["component"], x["status"]) for x in json.loads(r.stdout)} == {
        ("driver", "consistent"), ("cuda", "consistent"), ("vbios", "consistent")}


def test_an_inventory_written_during_a_driver_library_mismatch_fails_fleet_versions_and_gres_conf(simlib, tmp_path):
    """nvmlInit refused (LIB_RM_VERSION_MISMATCH): `inventory` wrote no file, so the node simply
    vanished from `fleet versions --inventory-dir` (exit 0).  Now the file says so, the command
    still fails (exit 3, the NVML error), fleet names the node and gres-conf refuses the file."""
    _inventory_state(simlib, tmp_path, "sim01")
    inv = _inventory_state(simlib, tmp_path, "sim02", lambda node: node.update(init_error=18), exit_code=3)
    doc = json.loads((inv / "sim02.json").read_text())
    assert (doc["gpus"], doc["driver_version"]) == ([], None) and doc["collected_at"] > NOW - 60
    assert doc["driver_library_mismatch"] == {"kernel_version": "535.104.05", "library_version": None}
    cfg = write_config(tmp_path)
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 1, r.stderr
    rows = [x for x in json.loads(r.stdout) if x["status"] == "driver/library mismatch"]
    assert [(x["nodes"], x["outliers"]) for x in rows] == [(1, "kernel module 535.104.05, NVML library unknown: sim02")]
    assert "lists no GPUs" not in r.stderr
    r = cli("--config", str(cfg), "gres-conf", "--inventory", str(inv))
    assert r.returncode == 2 and "driver/library mismatch: kernel module 535.104.05" in r.stderr, r.stderr
    assert "hint: reboot the node" in r.stderr
    # rebooted: the next file has GPUs again, and the newest file of a host wins
    (inv / "sim02-old.json").write_text(json.dumps(doc))
    _inventory_state(simlib, tmp_path, "sim02")
    r = cli("--config", str(cfg), "fleet", "versions", "--inventory-dir", str(inv), "--no-slurm", "--json")
    assert r.returncode == 0 and "driver/library mismatch" not in r.stdout, r.stdout + r.stderr


def test_nested_json_a_fifo_and_a_symlink_to_dev_zero_are_marks_and_the_other_nodes_are_shown(tmp_path):
    # Before: RecursionError traceback, a hang on the FIFO, MemoryError reading /dev/zero.
    import resource
    inv = write_docs(tmp_path / "inv", [inventory_doc("n1"), inventory_doc("n2"), inventory_doc("n3", driver="535.104.05")])
    (inv / "deep.json").write_text("[" * 200000 + "]" * 200000)
    os.mkfifo(inv / "fifo.json")
    os.symlink("/dev/zero", inv / "zero.json")
    with open(inv / "huge.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: larger than any inventory, costs no disk
    cfg = write_config(tmp_path)

    def limit_memory():  # a guard: reading /dev/zero must end in this test, not eat the machine
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    e = dict(os.environ)
    e.pop("SLURM_CONF", None)

    def fleet(*args):
        r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(cfg), "fleet", *args, "--inventory-dir",
                            str(inv), "--no-slurm", "--json"], capture_output=True, text=True, timeout=60, env=e,
                           cwd=str(REPO), preexec_fn=limit_memory)
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        return r
    r = fleet("memory")
    assert r.returncode == 0, r.stderr
    data = {x["node"]: x["reason"] for x in json.loads(r.stdout) if x["list"] == "data"}
    assert "nested too deeply" in data["deep.json"], data
    assert "not a regular file" in data["fifo.json"], data
    assert "a symbolic link" in data["zero.json"], data
    assert "larger than" in data["huge.json"], data
    r = fleet("versions")
    assert r.returncode == 1, r.stderr  # the other nodes are read: n3's driver is the outlier
    drv = [x for x in json.loads(r.stdout) if x["component"] == "driver"][0]
    assert (drv["majority"], drv["outliers"]) == (DRIVER, "535.104.05: n3")


def test_storms_merge_overlapping_windows_and_never_count_one_node_twice():
    def ev(node, t, code=119, count=1):
        return {"node": node, "time": t, "xid": code, "gpu_index": 0, "gpu_uuid": f"GPU-{node}", "pci_bus_id": None,
                "detail": "GSP RPC timeout", "line_count": count, "last_time": None}
    # one node repeating the code is no storm, however often
    assert xids.storms([ev("a", t) for t in range(0, 3000, 60)], 600, 3) == []
    # a rollout reaching a node every 5 minutes: each 10-minute window holds 3 of them: one storm of 6 nodes
    rolling = [ev(f"n{i}", i * 300.0) for i in range(6)]
    got = xids.storms(rolling + [ev("x", 100.0, code=79)], 600, 3)
    assert [(s["xid"], s["nodes"], s["first"], s["last"]) for s in got] == [
        (119, 6, xids._iso(0.0), xids._iso(1500.0))]
    assert xids.storms([ev(f"n{i}", i * 301.0) for i in range(6)], 600, 3) == []  # a node every 5 min 1 s: none
    # two bursts an hour apart are two storms; a flood's lines count in events, its node once
    bursts = [ev("a", 0.0, count=500), ev("b", 10.0), ev("c", 20.0), ev("a", 3600.0), ev("b", 3601.0), ev("d", 3602.0)]
    got = xids.storms(bursts, 600, 3)
    assert [(s["nodes"], s["events"], s["gpus"]) for s in got] == [(3, 502, 3), (3, 3, 3)]
    assert "XID 119 on 3 nodes (a,b,c) within 10 min" in xids.storm_notes(got, 600)[0]
    # the cause follows the code's class
    app = xids.storms([ev(n, 0.0, code=13) for n in "abc"], 600, 3)
    assert "one job across these nodes" in app[0]["cause"] and "common cause" in \
        xids.storms([ev(n, 0.0, code=79) for n in "abc"], 600, 3)[0]["cause"]
