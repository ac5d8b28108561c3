"""The node side of `slurm-gpu fleet` (issue 15): what the GPUs report, inventory files v2, and the
history every healthcheck records (node schema v6) and `db push` ships.

GPUs are the simulated driver (tests/simnvml) read through the real pynvml; the node database is
SQLite on disk; the central server is a real MariaDB (tests/mariadb.py, as in test_central.py).
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import simgpu
from click.testing import CliRunner

from slurm_gpu import config
from slurm_gpu.gpu import snapshot as S
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.gres import inventory
from slurm_gpu.hooks.healthcheck import node_health_cycle
from slurm_gpu.store import observations as obs
from slurm_gpu.store.diagnose import integrity_check
from slurm_gpu.store.node import Store
from slurm_gpu.store.schema import INVENTORY_STATE, MIGRATIONS, SCHEMA_VERSION

HERE = Path(__file__).resolve().parent


def read(node, monkeypatch, indices=None, inventory_=True):
    cfg = config.load(str(node.config))
    monkeypatch.setenv("SIMNVML_STATE", str(node.state))
    reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)
    try:
        return reader.snapshot(indices, inventory=inventory_)
    finally:
        reader.close()


# --- what the GPUs report ----------------------------------------------------------------------------

def test_full_read_reports_vbios_histogram_and_sram_counts(sim_node, monkeypatch):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 1, vbios="96.00.61.00.01", remap_hist_max=2555, remap_hist_partial=3,
                   remap_hist_none=2, sram_aggregate_corrected=9, sram_aggregate_uncorrected=1,
                   sram_volatile_corrected=4)
    g0, g1 = read(node, monkeypatch).gpus
    assert g0.vbios == S.value("96.00.99.00.01") and g1.vbios == S.value("96.00.61.00.01")
    assert g1.remap_histogram.value == S.RemapHistogram(2555, 0, 3, 0, 2) and g1.remap_histogram.value.none == 2
    # the lifetime (aggregate) counts: NVIDIA's SRAM RMA criteria count a GPU's life, not a boot
    assert (g1.sram_corrected.value, g1.sram_uncorrected.value) == (9, 1)
    assert (g0.sram_corrected.value, g0.sram_uncorrected.value) == (0, 0)


def test_not_supported_is_an_unsupported_reading_never_a_failure(sim_node, monkeypatch):
    node = sim_node(simgpu.h100_sxm(2))
    for fn in ("nvmlDeviceGetVbiosVersion", "nvmlDeviceGetRowRemapperHistogram", "nvmlDeviceGetMemoryErrorCounter",
               "nvmlDeviceGetSerial"):
        simgpu.inject_error(node.state, 0, fn, simgpu.NOT_SUPPORTED)
    g0, g1 = read(node, monkeypatch).gpus
    for r in (g0.vbios, g0.remap_histogram, g0.sram_corrected, g0.sram_uncorrected, g0.serial):
        assert r.unsupported and not r.failed and r.function.startswith("nvmlDevice"), r
    assert not g0.unreachable and g1.vbios.ok and g1.remap_histogram.ok


def test_a_corrupted_inforom_on_the_histogram_is_a_failed_reading(sim_node, monkeypatch):
    node = sim_node(simgpu.h100_sxm(1))
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetRowRemapperHistogram", simgpu.CORRUPTED_INFOROM)
    (g,) = read(node, monkeypatch).gpus
    assert g.remap_histogram.failed and "infoROM" in g.remap_histogram.error and g.vbios.ok


def test_the_prolog_read_does_not_ask_the_driver_for_the_fleet_readings(sim_node, monkeypatch):
    # A VBIOS query that hangs past the deadline would make the GPU unreachable: the prolog's
    # read (no inventory) never makes it, so it costs nothing and breaks nothing.
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.inject_hang(node.state, 0, "nvmlDeviceGetVbiosVersion", 30)
    t0 = time.monotonic()
    snap = read(node, monkeypatch, [0, 1], inventory_=False)
    assert time.monotonic() - t0 < 5 and not any(g.unreachable for g in snap.gpus)
    for g in snap.gpus:
        assert (g.vbios, g.remap_histogram, g.sram_corrected) == (S.NOT_READ,) * 3
        assert not S.was_read(g.vbios) and S.was_read(g.temperature_c)


def test_an_old_nvidia_ml_py_without_the_histogram_reads_as_unsupported(sim_node, monkeypatch):
    import pynvml
    monkeypatch.delattr(pynvml, "nvmlDeviceGetRowRemapperHistogram")
    node = sim_node(simgpu.h100_sxm(1))
    (g,) = read(node, monkeypatch).gpus
    assert g.remap_histogram.unsupported and "nvidia-ml-py" in g.remap_histogram.error and not g.unreachable


def test_snapshot_json_carries_the_new_readings_and_their_outcomes(sim_node, monkeypatch):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 0, remap_hist_none=1, remap_hist_max=2559)
    simgpu.inject_error(node.state, 1, "nvmlDeviceGetVbiosVersion", simgpu.NOT_SUPPORTED)
    snap = read(node, monkeypatch)
    doc = json.loads(snap.dumps())
    assert doc["gpus"][0]["remap_histogram"]["value"] == {"max": 2559, "high": 0, "partial": 0, "low": 0, "none": 1}
    again = S.node_from_json(doc)
    for a, b in zip(snap.gpus, again.gpus):
        assert (a.vbios, a.remap_histogram, a.sram_corrected, a.sram_uncorrected) == \
               (b.vbios, b.remap_histogram, b.sram_corrected, b.sram_uncorrected)
    assert isinstance(again.gpus[0].remap_histogram.value, S.RemapHistogram)
    # a snapshot saved by an older slurm-gpu has none of them: not read, not "unsupported"
    for g in doc["gpus"]:
        for k in ("vbios", "remap_histogram", "sram_corrected", "sram_uncorrected"):
            del g[k]
    assert S.node_from_json(doc).gpus[0].vbios == S.NOT_READ


# --- inventory files v2 ----------------------------------------------------------------------------------

def inventory_cli(node, *args):
    # CPU ids as core ids (this machine's CPUs are not the simulated node's): a warning, not our subject
    node.write_config(f'[gres]\ncpu_topology_dir = "{node.tmp / "no-sysfs"}"\n')
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "inventory", "--node-name", "gpu01", *args],
                          env=node.env(), capture_output=True, text=True, timeout=60)


def test_inventory_v2_has_versions_serials_and_vbios_and_no_state_by_default(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.inject_error(node.state, 1, "nvmlDeviceGetVbiosVersion", simgpu.NOT_SUPPORTED)
    res = inventory_cli(node)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["format"] == "slurm-gpu-inventory/2"
    assert (doc["driver_version"], doc["cuda_version"]) == ("550.54.15", "12.4")
    assert "collected_at" not in doc and all("state" not in g for g in doc["gpus"])
    assert doc["gpus"][0]["vbios"] == "96.00.99.00.01" and doc["gpus"][1]["vbios"] is None  # written, null
    assert [g["serial"] for g in doc["gpus"]] == [g["serial"] for g in simgpu.h100_sxm(2)["gpus"]]


def test_inventory_state_has_exactly_the_inventory_columns_and_null_for_unsupported(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.set_gpu(node.state, 0, ecc_aggregate_corrected=12, remapped_corrected=3, remap_hist_max=2558,
                   remap_hist_none=2, sram_aggregate_uncorrected=1)
    simgpu.inject_error(node.state, 1, "nvmlDeviceGetRowRemapperHistogram", simgpu.NOT_SUPPORTED)
    before = time.time()
    res = inventory_cli(node, "--state")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert before - 1 <= doc["collected_at"] <= time.time()
    s0, s1 = (g["state"] for g in doc["gpus"])
    assert list(s0) == list(INVENTORY_STATE) == list(s1)
    assert (s0["ecc_corrected_aggregate"], s0["remapped_rows_correctable"], s0["remap_hist_none"],
            s0["sram_uncorrected"], s0["mig_mode"], s0["remap_failure"]) == (12, 3, 2, 1, 0, 0)
    assert [s1[f"remap_hist_{p}"] for p in ("max", "high", "partial", "low", "none")] == [None] * 5
    assert s1["ecc_corrected_aggregate"] == 0  # a 0 the driver said stays 0
    inv = inventory.from_json(doc, "x")
    assert inv.collected_at == doc["collected_at"] and inv.gpus[0].state == s0 and inv.cuda_version == "12.4"


def test_a_version_1_inventory_is_still_read(tmp_path):
    d = json.loads((HERE / "golden" / "gres" / "inventory" / "hgx001.json").read_text())
    d["format"] = "slurm-gpu-inventory/1"
    for k in ("driver_version", "cuda_version"):
        d.pop(k)
    for g in d["gpus"]:
        g.pop("serial"), g.pop("vbios")
    inv = inventory.from_json(d, "v1.json")
    assert inv.driver_version is None and inv.gpus[0].serial is None and inv.gpus[0].state is None
    assert inv.hardware_facts() == inventory.load(str(HERE / "golden" / "gres" / "inventory" / "hgx001.json")).hardware_facts()


def test_versions_serials_vbios_and_state_do_not_split_a_gres_conf_group():
    base = json.loads((HERE / "golden" / "gres" / "inventory" / "hgx001.json").read_text())
    other = json.loads(json.dumps(base))
    other.update(hostname="hgx002", driver_version="535.161.08", cuda_version="12.2", collected_at=1.7e9)
    for g in other["gpus"]:
        g.update(serial="1650000000000", vbios="96.00.30.00.01", state={k: 1 for k in INVENTORY_STATE})
    a, b = inventory.from_json(base, "a"), inventory.from_json(other, "b")
    assert a.hardware_facts() == b.hardware_facts()
    again = inventory.from_json(json.loads(inventory.dumps(b)), "c")
    assert again.gpus == b.gpus and (again.driver_version, again.collected_at) == ("535.161.08", 1.7e9)


@pytest.mark.parametrize("mutate, field, problem", [
    (lambda d: d.__setitem__("format", "slurm-gpu-inventory/3"), "format", "'slurm-gpu-inventory/2'"),
    (lambda d: d["gpus"][0].__setitem__("state", {"ecc_total": 1}), "gpus[0].state.ecc_total", "unknown counter"),
    (lambda d: d["gpus"][0].__setitem__("state", {"sram_corrected": -1}), "gpus[0].state.sram_corrected",
     "non-negative integer"),
    (lambda d: d["gpus"][1].__setitem__("vbios", 96), "gpus[1].vbios", "expected str"),
    (lambda d: d.__setitem__("collected_at", "yesterday"), "collected_at", "unix seconds"),
])
def test_a_malformed_v2_inventory_names_the_field(mutate, field, problem):
    d = json.loads((HERE / "golden" / "gres" / "inventory" / "hgx001.json").read_text())
    mutate(d)
    with pytest.raises(inventory.InventoryError) as e:
        inventory.from_json(d, "bad.json")
    assert f": {field}: " in e.value.message and problem in e.value.message


# --- node schema v6 ---------------------------------------------------------------------------------------

def test_a_v5_database_file_migrates_to_v6_keeping_its_rows_and_outbox(tmp_path):
    path = tmp_path / "u.db"
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode = WAL")
    for stmts in MIGRATIONS[:5]:  # what slurm-gpu with schema v5 created
        for stmt in stmts:
            c.execute(stmt)
    c.execute("PRAGMA user_version = 5")
    c.execute("INSERT INTO health_events (time, node, source, check_name, status, message, dedupe_key, pushed_version) "
              "VALUES (1.0, 'n1', 'healthcheck', 'ecc', 'FAIL', 'x', 'k1', 1)")
    c.close()
    st = Store(str(path), str(tmp_path / "spool"))
    conn = st.connect()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 11
    assert conn.execute("SELECT status, push_version, pushed_version FROM health_events").fetchall() == [("FAIL", 1, 1)]
    cols = [r[1] for r in conn.execute("PRAGMA table_info(gpu_inventory)")]
    assert cols == ["id", "time", "node", "gpu_index", "gpu_uuid", "serial", "model", "vbios", "driver_version",
                    "cuda_version", *INVENTORY_STATE, "push_version", "pushed_version"]
    assert [r[1] for r in conn.execute("PRAGMA table_info(xid_events)")][:9] == [
        "id", "event_key", "time", "node", "gpu_index", "gpu_uuid", "pci_bus_id", "xid", "detail"]
    # the outbox: a new row waits for `db push`; a shipped one that changes ships again
    conn.execute("INSERT INTO xid_events (event_key, time, node, xid, detail) VALUES ('e', 2.0, 'n1', 79, 'lost')")
    conn.execute("UPDATE xid_events SET pushed_version = push_version")
    conn.execute("UPDATE xid_events SET detail = 'GPU has fallen off the bus'")
    assert conn.execute("SELECT push_version, pushed_version FROM xid_events").fetchone() == (2, 1)
    # v11: a flood's row grows (line count, last time) and ships again
    assert conn.execute("SELECT line_count, last_time FROM xid_events").fetchone() == (1, None)
    conn.execute("UPDATE xid_events SET pushed_version = push_version")
    conn.execute("UPDATE xid_events SET line_count = 7, last_time = 9.0")
    assert conn.execute("SELECT push_version, pushed_version FROM xid_events").fetchone() == (3, 2)
    st.close()
    assert integrity_check(str(path)) == []


# --- what a healthcheck records ------------------------------------------------------------------------------

class Slurm:
    """The node as Slurm sees it: idle, 4 GPUs (the seam healthcheck talks to; no controller here)."""

    timeout_s = 1.0

    def __init__(self):
        self.actions = []

    def node(self, name):
        from slurm_gpu.slurm.model import NodeInfo, split_state
        return NodeInfo(name, "IDLE", split_state("IDLE"), "", "", None, "gpu:h100:4", "", 4, 0)

    def nodes(self, names=None):
        return [self.node("gpu01")]

    def drain(self, name, reason):
        self.actions.append(("drain", reason))

    def resume(self, name):
        self.actions.append(("resume",))


def healthcheck(node, monkeypatch, dry_run=False):
    from slurm_gpu.hooks.healthcheck import default_checker
    cfg = config.load(str(node.config))
    monkeypatch.setenv("SIMNVML_STATE", str(node.state))
    return node_health_cycle(Slurm(), "gpu01", default_checker(cfg), deadline_s=30, dry_run=dry_run, store_cfg=cfg)


def db_rows(node, sql):
    c = sqlite3.connect(node.db)
    try:
        return c.execute(sql).fetchall()
    finally:
        c.close()


def xid_node(sim_node, tmp_path, extra=""):
    node = sim_node(simgpu.h100_sxm(4))
    log = tmp_path / "kern.log"
    now = time.time()
    # application XIDs (never a node fault: the verdict stays PASS), one on no GPU of this node,
    # and an undated line (never placed in time, so never recorded)
    log.write_text(f"{now - 50:.6f} gpu01 kernel: NVRM: Xid (PCI:0000:2a:00): 13, pid=4711, name=python, "
                   "Graphics SM Warp Exception\n"
                   f"{now - 40:.6f} gpu01 kernel: NVRM: Xid (PCI:0000:2a:00): 13, pid=4711, name=python, "
                   "Graphics SM Warp Exception\n"
                   f"{now - 30:.6f} gpu01 kernel: NVRM: Xid (PCI:0000:c1:00): 31, pid=99, name=a.out, MMU Fault\n"
                   "kernel: NVRM: Xid (PCI:0000:18:00): 43, pid=1, Ch 00000008\n")
    node.write_config(f'[xid]\nsource = "file:{log}"\n' + extra)
    return node, log


def test_healthcheck_records_every_gpu_then_only_what_changed(sim_node, tmp_path, monkeypatch):
    node, _ = xid_node(sim_node, tmp_path)
    out = healthcheck(node, monkeypatch)
    assert (out.worst, out.action) == ("PASS", "none"), out.message
    rows = db_rows(node, "SELECT gpu_index, node, model, vbios, driver_version, cuda_version, remap_hist_max, "
                         "sram_corrected, ecc_corrected_aggregate FROM gpu_inventory ORDER BY gpu_index")
    assert rows == [(i, "gpu01", "NVIDIA H100 80GB HBM3", "96.00.99.00.01", "550.54.15", "12.4", 2560, 0, 0)
                    for i in range(4)]
    healthcheck(node, monkeypatch)  # nothing changed, nothing is old: no new row
    assert db_rows(node, "SELECT COUNT(*) FROM gpu_inventory") == [(4,)]
    simgpu.set_gpu(node.state, 2, ecc_aggregate_corrected=17, ecc_volatile_corrected=17)
    healthcheck(node, monkeypatch)
    assert db_rows(node, "SELECT gpu_index, ecc_corrected_aggregate FROM gpu_inventory WHERE id > 4") == [(2, 17)]
    simgpu.set_gpu(node.state, 0, vbios="96.00.61.00.01")  # a firmware update is a change too
    healthcheck(node, monkeypatch)
    assert db_rows(node, "SELECT gpu_index, vbios FROM gpu_inventory WHERE id > 5") == [(0, "96.00.61.00.01")]


def test_healthcheck_records_an_unchanged_gpu_again_once_its_latest_row_is_a_day_old(sim_node, tmp_path, monkeypatch):
    node, _ = xid_node(sim_node, tmp_path)
    healthcheck(node, monkeypatch)
    c = sqlite3.connect(node.db)
    c.execute("UPDATE gpu_inventory SET time = time - 86400 WHERE gpu_index IN (1, 3)")
    c.commit()
    c.close()
    healthcheck(node, monkeypatch)
    assert db_rows(node, "SELECT gpu_index FROM gpu_inventory WHERE id > 4 ORDER BY gpu_index") == [(1,), (3,)]
    node.write_config('[inventory]\nrecord_every_s = 60\n')
    c = sqlite3.connect(node.db)
    c.execute("UPDATE gpu_inventory SET time = time - 61 WHERE id > 4")
    c.commit()
    c.close()
    healthcheck(node, monkeypatch)
    assert db_rows(node, "SELECT COUNT(*) FROM gpu_inventory") == [(8,)]


def test_healthcheck_records_each_xid_once_however_often_it_reads_the_log(sim_node, tmp_path, monkeypatch):
    node, log = xid_node(sim_node, tmp_path)
    healthcheck(node, monkeypatch)
    healthcheck(node, monkeypatch)
    rows = db_rows(node, "SELECT xid, gpu_index, gpu_uuid IS NOT NULL, pci_bus_id, detail, line_count, "
                         "last_time - time FROM xid_events ORDER BY time")
    # the two identical XID 13 lines, 10 s apart, are one event of two lines (issue 39: floods counted)
    assert [r[:6] for r in rows] == [(13, 1, 1, "00000000:2A:00.0", "pid=4711, name=python, Graphics SM Warp Exception", 2),
                                     (31, None, 0, "00000000:C1:00.0", "pid=99, name=a.out, MMU Fault", 1)]
    assert [r[6] for r in rows] == [pytest.approx(10.0), 0.0]
    assert len({k for (k,) in db_rows(node, "SELECT event_key FROM xid_events")}) == 2
    # the same line again (in a kmsg read, dates move with the boot time read each run) grows the event, no new row
    t = db_rows(node, "SELECT MAX(time) FROM xid_events")[0][0]
    with open(log, "a") as f:
        f.write(f"{t + 0.6:.6f} gpu01 kernel: NVRM: Xid (PCI:0000:c1:00): 31, pid=99, name=a.out, MMU Fault\n")
    healthcheck(node, monkeypatch)
    assert db_rows(node, "SELECT xid, line_count FROM xid_events ORDER BY time") == [(13, 2), (31, 2)]


def mismatch_node(sim_node, tmp_path):
    """A node after an unattended driver update: nvmlInit says LIB_RM_VERSION_MISMATCH, the loaded
    kernel module says 535.104.05."""
    node = sim_node(simgpu.h100_sxm(2))
    version = tmp_path / "nvidia-version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    node.write_config(nvidia_version_file=str(version))
    return node


def test_healthcheck_records_a_driver_library_mismatch_once_per_episode_not_once_per_run(sim_node, tmp_path,
                                                                                       monkeypatch):
    """nvmlInit refused, so no inventory row was written and `fleet` could not see the node: the
    mismatch is now a health event (one per episode: every 5-minute run must not add one), and the
    first healthy read afterwards writes inventory rows newer than it (the node is fixed)."""
    node = mismatch_node(sim_node, tmp_path)
    healthcheck(node, monkeypatch)  # healthy: the node's first inventory rows
    simgpu.set_node(node.state, init_error=simgpu.LIB_RM_VERSION_MISMATCH)
    for _ in range(3):
        out = healthcheck(node, monkeypatch)
        assert (out.worst, out.action) == ("FAIL", "drained"), out.message
    rows = db_rows(node, "SELECT check_name, status, source, node, message, time FROM health_events")
    assert len(rows) == 1, rows
    check, status, source, name, message, seen = rows[0]
    assert (check, status, source, name) == ("driver_library_mismatch", "FAIL", "healthcheck", "gpu01")
    assert "kernel module 535.104.05" in message
    (inv_time,) = db_rows(node, "SELECT MAX(time) FROM gpu_inventory")[0]
    assert seen > inv_time
    simgpu.set_node(node.state, init_error=0)  # rebooted
    healthcheck(node, monkeypatch)  # nothing changed on the GPUs, yet the rows are due: newer than the event
    assert db_rows(node, f"SELECT COUNT(*) FROM gpu_inventory WHERE time > {seen!r}") == [(2,)]
    simgpu.set_node(node.state, init_error=simgpu.LIB_RM_VERSION_MISMATCH)  # the same mismatch again: a new episode
    healthcheck(node, monkeypatch)
    assert db_rows(node, "SELECT COUNT(*) FROM health_events") == [(2,)]


def test_a_dry_run_records_nothing(sim_node, tmp_path, monkeypatch):
    node, _ = xid_node(sim_node, tmp_path)
    healthcheck(node, monkeypatch, dry_run=True)
    assert not node.db.exists() or db_rows(node, "SELECT COUNT(*) FROM gpu_inventory") == [(0,)]


def test_a_lost_gpu_gets_no_row_and_the_others_do(sim_node, tmp_path, monkeypatch):
    node, _ = xid_node(sim_node, tmp_path)
    simgpu.lose_gpu(node.state, 3)
    out = healthcheck(node, monkeypatch)
    assert out.worst == "FAIL" and out.action == "drained"
    assert db_rows(node, "SELECT gpu_index FROM gpu_inventory ORDER BY gpu_index") == [(0,), (1,), (2,)]


def test_a_database_that_cannot_be_written_changes_neither_verdict_nor_exit_code(sim_node, tmp_path, monkeypatch):
    node, _ = xid_node(sim_node, tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    node.db = blocker / "usage.db"
    node.write_config(f'[xid]\nsource = "file:{tmp_path / "kern.log"}"\n')
    out = healthcheck(node, monkeypatch)
    assert (out.worst, out.action, out.exit_code) == ("PASS", "none", 0)
    lines = [ln for ln in node.log_text().splitlines() if "inventory-not-recorded" in ln]
    assert len(lines) == 1 and "node=gpu01" in lines[0] and "hint=" in lines[0]


def test_a_database_locked_by_a_hook_delays_the_run_by_seconds_at_most(sim_node, tmp_path, monkeypatch):
    node, _ = xid_node(sim_node, tmp_path)
    st = Store(str(node.db), str(node.spool))
    st.connect()  # the database exists, at the current schema
    st.close()
    text = node.config.read_text().replace("busy_timeout_s = 1.0", "busy_timeout_s = 30.0")
    node.config.write_text(text)
    holder = sqlite3.connect(node.db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # an epilog in the middle of its transaction
    try:
        t0 = time.monotonic()
        out = healthcheck(node, monkeypatch)
        took = time.monotonic() - t0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert (out.worst, out.action) == ("PASS", "none") and took < 10, took
    assert "inventory-not-recorded" in node.log_text() and "locked" in node.log_text()
    healthcheck(node, monkeypatch)  # the next run records what this one missed
    assert db_rows(node, "SELECT COUNT(*) FROM gpu_inventory") == [(4,)]


def test_slurm_gpu_healthcheck_records_through_the_cli(sim_node, tmp_path, monkeypatch):
    from slurm_gpu.cli import main
    from slurm_gpu.slurm import backend as slurm_backend
    node, _ = xid_node(sim_node, tmp_path)
    monkeypatch.setattr(slurm_backend, "get_backend", lambda cfg: Slurm())
    monkeypatch.setenv("SIMNVML_STATE", str(node.state))
    r = CliRunner().invoke(main, ["--config", str(node.config), "healthcheck", "--node", "gpu01", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert not node.db.exists() or db_rows(node, "SELECT COUNT(*) FROM gpu_inventory") == [(0,)]
    r = CliRunner().invoke(main, ["--config", str(node.config), "healthcheck", "--node", "gpu01"])
    assert r.exit_code == 0, r.output
    assert db_rows(node, "SELECT COUNT(*) FROM gpu_inventory") == [(4,)]
    assert db_rows(node, "SELECT COUNT(*), SUM(line_count) FROM xid_events") == [(2, 3)]  # two lines are one event


# --- issue 39, item 3: a flood is one row, grown as it goes on ------------------------------------------

FLOOD = "gpu01 kernel: NVRM: Xid (PCI:0000:2a:00): 95, pid=7, name=python3, Uncontained: FBHUB. RST: Yes, D-RST: No"


def _flood_lines(first: float, n: int, step: float) -> str:
    return "".join(f"{first + i * step:.6f} {FLOOD}\n" for i in range(n))


def test_a_flood_read_twice_by_healthcheck_is_one_row_whose_count_grows_and_ships_again(sim_node, tmp_path, monkeypatch):
    node = sim_node(simgpu.h100_sxm(4))
    log = tmp_path / "kern.log"
    now = time.time()
    log.write_text(_flood_lines(now - 1200, 50_000, 0.02))  # 50,000 lines of XID 95 on GPU 1, over 1,000 s
    node.write_config(f'[xid]\nsource = "file:{log}"\n')
    out = healthcheck(node, monkeypatch, dry_run=False)
    assert out.worst == "FAIL" and "XID 95" in out.message, out.message  # it gates as one line of it did
    q = "SELECT xid, gpu_index, line_count, time, last_time, push_version, pushed_version FROM xid_events"
    [(code, gpu, count, first, last, version, shipped)] = db_rows(node, q)
    assert (code, gpu, count, version, shipped) == (95, 1, 50_000, 1, 0)
    assert first == pytest.approx(now - 1200) and last == pytest.approx(now - 1200 + 49_999 * 0.02)
    healthcheck(node, monkeypatch)  # the same log again: nothing new, nothing to ship again
    assert db_rows(node, q) == [(code, gpu, count, first, last, version, shipped)]
    c = sqlite3.connect(node.db)
    c.execute("UPDATE xid_events SET pushed_version = push_version")  # as `db push` marks it shipped
    c.commit()
    c.close()
    with log.open("a") as f:
        f.write(_flood_lines(now - 150, 20_000, 0.005))  # the flood goes on: 20,000 more
    healthcheck(node, monkeypatch)
    assert db_rows(node, q) == [(95, 1, 70_000, first, pytest.approx(now - 150 + 19_999 * 0.005), 2, 1)]


def _event(t: float, count: int, last: float, runs=(), code: int = 95, message: str = "Uncontained: FBHUB"):
    from slurm_gpu.gpu.xid import XidEvent
    return XidEvent(t, (0, 0x2A, 0), code, message, None, count, last, tuple(runs))


def test_a_flood_whose_start_left_the_window_grows_its_row_by_its_new_lines_only(tmp_path):
    st = Store(str(tmp_path / "n.db"), str(tmp_path / "spool"))
    q = "SELECT time, line_count, last_time FROM xid_events ORDER BY time"
    assert st.record_xids(obs.xid_rows([_event(1000.0, 100, 1099.0, [(1000.0, 1099.0, 100)])], None, "n1")) == 1
    # read again a kmsg rounding away, the flood grown: the same start, so the new count is the whole
    assert st.record_xids(obs.xid_rows([_event(1000.3, 150, 1149.3, [(1000.3, 1149.3, 150)])], None, "n1")) == 1
    assert db_rows_path(st, q) == [(1000.0, 150, 1149.3)]
    # the window moved past the first 50 lines: the reading starts inside the row's lines; 20 lines are new
    assert st.record_xids(obs.xid_rows([_event(1050.0, 120, 1169.0, [(1050.0, 1149.0, 100), (1150.0, 1169.0, 20)])],
                                       None, "n1")) == 1
    assert db_rows_path(st, q) == [(1000.0, 170, 1169.0)]
    # the same reading again adds nothing; the same XID hours later is a flood of its own; so is another code
    assert st.record_xids(obs.xid_rows([_event(1050.0, 120, 1169.0, [(1050.0, 1149.0, 100), (1150.0, 1169.0, 20)])],
                                       None, "n1")) == 0
    assert st.record_xids(obs.xid_rows([_event(9000.0, 10, 9009.0), _event(1000.0, 5, 1004.0, code=94)], None, "n1")) == 2
    assert db_rows_path(st, "SELECT xid, time, line_count, last_time FROM xid_events ORDER BY id") == [
        (95, 1000.0, 170, 1169.0), (95, 9000.0, 10, 9009.0), (94, 1000.0, 5, 1004.0)]
    st.close()


def test_a_flood_recorded_line_by_line_before_v11_is_not_counted_twice(tmp_path):
    """Before v11 every line was a row (last_time NULL): the first aggregated read of the same flood takes
    over its first row and counts only the lines the other rows do not hold already."""
    st = Store(str(tmp_path / "n.db"), str(tmp_path / "spool"))
    c = st.connect()
    for i in range(10):  # as v10 wrote them: one row per line, no line count (1 by the column's default) nor last time
        row = obs.xid_rows([_event(2000.0 + 3 * i, 1, 2000.0 + 3 * i)], None, "n1")[0]
        c.execute("INSERT INTO xid_events (event_key, time, node, pci_bus_id, xid, detail) VALUES (?, ?, ?, ?, ?, ?)",
                  tuple(row[k] for k in ("event_key", "time", "node", "pci_bus_id", "xid", "detail")))
    assert st.record_xids(obs.xid_rows([_event(2000.0, 15, 2042.0)], None, "n1")) == 1
    assert c.execute("SELECT COUNT(*), SUM(line_count), MIN(time), MAX(COALESCE(last_time, time)) FROM xid_events"
                     ).fetchone() == (10, 15, 2000.0, 2042.0)
    assert st.record_xids(obs.xid_rows([_event(2000.0, 25, 2072.0)], None, "n1")) == 1
    assert c.execute("SELECT COUNT(*), SUM(line_count) FROM xid_events").fetchone() == (10, 25)
    st.close()


def db_rows_path(st, sql):
    return st.connect().execute(sql).fetchall()


def test_rows_from_a_snapshot_say_null_for_what_the_driver_did_not_report(sim_node, monkeypatch):
    node = sim_node(simgpu.consumer_gpu(1))
    (row,) = obs.inventory_rows(read(node, monkeypatch), "ws01", 5.0)
    assert row["model"] == "NVIDIA GeForce RTX 4090" and row["vbios"] == "95.02.3C.00.8E" and row["time"] == 5.0
    # no MIG, ECC or remapping on a GeForce board: unknown, never 0
    assert [k for k in INVENTORY_STATE if row[k] is not None] == []
    assert obs.cuda_version(S.value(12040)) == "12.4" and obs.cuda_version(S.value(11080)) == "11.8"
    assert obs.cuda_version(S.unsupported("nvmlSystemGetCudaDriverVersion")) is None


# --- db push ships the history to the central server (a real MariaDB) -------------------------------------

from test_central import Site  # noqa: E402

from slurm_gpu.central import server as C  # noqa: E402


@pytest.fixture(scope="module")
def server(mariadb_server):
    """The session's MariaDB (tests/conftest.py); every test takes a database of its own there."""
    return mariadb_server


@pytest.fixture
def site(server, tmp_path):
    (tmp_path / "site").mkdir()  # beside the simulated node's files, not among them
    return Site(server, tmp_path / "site")


@pytest.mark.central
def test_push_ships_inventory_history_and_xids_once_with_nulls_kept(site, sim_node, monkeypatch):
    from slurm_gpu.gpu.xid import XidEvent
    site.init()
    node = sim_node(simgpu.h100_sxm(2))
    simgpu.inject_error(node.state, 1, "nvmlDeviceGetVbiosVersion", simgpu.NOT_SUPPORTED)
    snap = read(node, monkeypatch)
    assert site.store.record_inventory(obs.inventory_rows(snap, "n1", 1000.0), 86400, 1000.0) == 2
    events = [XidEvent(1001.0, (0, 0x2A, 0), 79, "pid=0, GPU has fallen off the bus."),
              XidEvent(1002.0, (0, 0xC1, 0), 13, "pid=7, Graphics Exception")]
    assert site.store.record_xids(obs.xid_rows(events, snap, "n1")) == 2
    r = site.push()
    assert r.returncode == 0, r.stderr
    assert "gpu_inventory 2" in r.stdout and "xid_events 2" in r.stdout, r.stdout
    assert site.rows("SELECT cluster, node, gpu_index, vbios, cuda_version, remap_hist_max, sram_uncorrected "
                     "FROM gpu_inventory ORDER BY gpu_index") == [
        ["c", "n1", "0", "96.00.99.00.01", "12.4", "2560", "0"],
        ["c", "n1", "1", "NULL", "12.4", "2560", "0"]]  # unsupported stays NULL on the server
    keys = [k for (k,) in sqlite3.connect(site.node_db).execute("SELECT event_key FROM xid_events ORDER BY time")]
    assert site.rows("SELECT node, gpu_index, xid, pci_bus_id, event_key FROM xid_events ORDER BY time") == [
        ["n1", "1", "79", "00000000:2A:00.0", keys[0]], ["n1", "NULL", "13", "00000000:C1:00.0", keys[1]]]
    r = site.push()
    assert r.returncode == 0 and "shipped nothing" in r.stdout, r.stdout
    # history: a changed GPU adds a row on the node and on the server; nothing is replaced
    simgpu.set_gpu(node.state, 0, ecc_aggregate_corrected=5)
    assert site.store.record_inventory(obs.inventory_rows(read(node, monkeypatch), "n1", 2000.0), 86400, 2000.0) == 1
    r = site.push()
    assert r.returncode == 0 and "gpu_inventory 1" in r.stdout, r.stdout
    assert site.rows("SELECT gpu_index, ecc_corrected_aggregate FROM gpu_inventory ORDER BY time, gpu_index") == [
        ["0", "0"], ["1", "0"], ["0", "5"]]


@pytest.mark.central
def test_push_carries_a_floods_count_and_its_growth_to_the_server(site, sim_node, monkeypatch):
    site.init()
    q = "SELECT xid, gpu_index, line_count, time, last_time FROM xid_events"
    assert site.store.record_xids(obs.xid_rows([_event(1000.0, 800_000, 4600.0)], None, "n1")) == 1
    r = site.push()
    assert r.returncode == 0 and "xid_events 1" in r.stdout, r.stdout + r.stderr
    assert site.rows(q) == [["95", "NULL", "800000", "1000", "4600"]]
    # the flood goes on: its row grows on the node and ships again; the server's row is updated, not doubled
    assert site.store.record_xids(obs.xid_rows([_event(1000.0, 900_000, 5000.0)], None, "n1")) == 1
    r = site.push()
    assert r.returncode == 0 and "xid_events 1" in r.stdout, r.stdout + r.stderr
    assert site.rows(q) == [["95", "NULL", "900000", "1000", "5000"]]
    r = site.push()
    assert r.returncode == 0 and "shipped nothing" in r.stdout, r.stdout


@pytest.mark.central
def test_a_v11_server_gains_the_xid_line_count_and_rows_shipped_before_are_one_line(site):
    """Central schema v12: a server made at v11 (xid_events and its staging table without the columns)
    is migrated in place by ADD COLUMN IF NOT EXISTS; one made at v12 has them from CREATE TABLE."""
    site.init()
    assert site.store.record_xids(obs.xid_rows([_event(1000.0, 1, 1000.0)], None, "n1")) == 1
    assert site.push().returncode == 0
    admin = C.Central(C.parse_url(site.server.url(site.admin, site.db)), site.admin_pw, 10)
    try:  # back to what v11 made
        for t in ("xid_events", "stage_xid_events"):
            admin.execute(f"ALTER TABLE {t} DROP COLUMN line_count, DROP COLUMN last_time")
        admin.execute("UPDATE meta SET value = '11' WHERE name = 'schema_version'")
        admin.commit()
    finally:
        admin.close()
    assert site.store.record_xids(obs.xid_rows([_event(1000.0, 40, 1039.0)], None, "n1")) == 1
    assert site.push().returncode != 0  # a node of v12 does not push to a v11 server
    r = site.init()
    assert r.returncode == 0 and f"schema migrated from 11 at version {C.SCHEMA_VERSION}" in r.stderr, r.stderr
    assert site.rows("SELECT line_count, last_time FROM xid_events") == [["1", "NULL"]]
    r = site.push()
    assert r.returncode == 0 and "xid_events 1" in r.stdout, r.stdout + r.stderr
    assert site.rows("SELECT line_count, last_time FROM xid_events") == [["40", "1039"]]


@pytest.mark.central
def test_fleet_versions_names_a_node_with_a_driver_library_mismatch_until_it_is_fixed(site, sim_node, tmp_path,
                                                                                   monkeypatch):
    """On a node whose driver refuses NVML no inventory row is written, so `fleet versions` saw
    nothing wrong: the healthcheck's mismatch event, pushed, now names the node and both versions
    (exit 1) until a healthy read writes inventory rows newer than the event."""
    node = mismatch_node(sim_node, tmp_path)
    site.node_db = node.db  # push this node's database
    site.init(writers="*", group=f"grp_{site.db.split('_')[-1]}")
    reader = ["--db", site.server.url(site.reporter, site.db),
              "--password-file", str(site.password_file(site.reporter, site.reporter_pw))]

    def versions():
        r = site.push()
        assert r.returncode == 0, r.stderr
        r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(site.config), "fleet", "versions",
                            *reader, "--no-slurm", "--json"], capture_output=True, text=True, timeout=120)
        return r.returncode, [x for x in json.loads(r.stdout) if x["status"] == "driver/library mismatch"]

    healthcheck(node, monkeypatch)
    assert versions() == (0, [])
    simgpu.set_node(node.state, init_error=simgpu.LIB_RM_VERSION_MISMATCH)
    healthcheck(node, monkeypatch)
    healthcheck(node, monkeypatch)
    code, rows = versions()
    assert code == 1
    assert [(r["partition"], r["component"], r["nodes"], r["outliers"]) for r in rows] == [
        ("(unknown)", "driver", 1, "kernel module 535.104.05, NVML library unknown: gpu01")]
    assert site.rows("SELECT COUNT(*) FROM health_events WHERE check_name = 'driver_library_mismatch'") == [["1"]]
    simgpu.set_node(node.state, init_error=0)  # rebooted
    healthcheck(node, monkeypatch)
    assert versions() == (0, [])
