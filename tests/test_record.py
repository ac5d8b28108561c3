"""A job's record (store/record.py): one usage arithmetic for the epilog and the store, one drain shape."""
from __future__ import annotations

import json
import sqlite3

from slurm_gpu.store.node import Store

XIDS = [{"xid": 79, "time": 12.0, "message": "GPU has fallen off the bus"},
        {"xid": 94, "time": 3.0, "message": "contained ECC error", "gpu_instance": 1}]
# What the epilog writes into job_gpus.xid_events for a complete row with those XIDs after t=10.
EPILOG_XID_TEXT = '[{"xid": 79, "time": 12.0, "message": "GPU has fallen off the bus"}]'


def _one(db: str, sql: str):
    c = sqlite3.connect(db)
    try:
        return c.execute(sql).fetchone()
    finally:
        c.close()


def _partial_job_end(end_counters: str) -> dict:
    """The epilog's record without its start record, as it is spooled (the JSON shape)."""
    key = {"cluster": "c", "job_id": 7, "restart_count": 0, "node": "n1"}
    job = dict(key, user="u", uid=1, account="a", partition="p", gpu_count=1, start_time=5.0, end_time=30.0,
               exit_code=0, partial=1)
    gpu = dict(key, gpu_uuid="GPU-0", gpu_index=0, start_time=5.0, end_time=30.0, duration_s=25.0,
               gpu_util_mean_pct=40.0, xid_events=json.dumps(XIDS), partial=1, end_counters=end_counters,
               notes="partial: the prolog's start record was not found")
    return {"kind": "job_end", "job": job, "gpus": [gpu]}


def _start(t0: float = 10.0) -> dict:
    return {"kind": "job_start", "cluster": "c", "restart_count": 0, "starts": [
        {"cluster": "c", "job_id": 7, "restart_count": 0, "node": "n1", "gpu_uuid": "GPU-0", "gpu_index": 0,
         "start_time": t0, "energy_mj": 1_000_000, "ecc_corrected": 5, "ecc_uncorrected": 0, "retired_pages": 0,
         "remapped_rows": 2}]}


def test_a_completed_partial_row_writes_its_xids_as_the_epilog_does(tmp_path):
    # The end counters as the epilog keeps them (sorted keys): their XIDs came back in another key order.
    end = json.dumps({"energy_mj": 6_000_000, "ecc_corrected": 4, "ecc_uncorrected": 0, "retired_pages": 0,
                      "remapped_rows": 3, "gpu_busy_s": 1000.0, "mem_busy_s": 500.0, "xids": XIDS, "notes": None},
                     sort_keys=True)
    st = Store(str(tmp_path / "usage.db"), str(tmp_path / "spool"))
    assert st.write(_partial_job_end(end)) == "db"
    assert st.write(_start()) == "db"
    row = _one(st.path, "SELECT partial, xid_events, energy_j, ecc_corrected_delta, remapped_rows_delta, "
                        "gpu_util_mean_pct, mem_util_mean_pct, duration_s FROM job_gpus")
    # 20 s from the start record; the ECC counter went back (driver reload): unknown, never negative.
    assert row == (0, EPILOG_XID_TEXT, 5000.0, None, 1.0, 50.0, 25.0, 20.0)


def test_a_drain_of_the_cli_and_one_of_a_hook_are_one_record_shape(tmp_path):
    from slurm_gpu.store import record as R
    hook = R.Drains([R.drain("n1", "prolog", "slurm-gpu: GPU 0 ECC", R.DRAINED, 1.0, job_id=7, cluster="c",
                             restart_count=0)])
    cli = R.Drains([R.drain(n, "manual", "slurm-gpu: rack work", R.KEPT, 2.0, kept_reason="maint") for n in ("n2", "n3")])
    assert set(R.as_dict(hook)) >= {"kind", "drains"} and set(R.as_dict(cli)) == {"kind", "drains"}
    st = Store(str(tmp_path / "usage.db"), str(tmp_path / "spool"))
    assert st.write(hook) == "db" and st.write(cli) == "db"
    # A drain spooled by an older version ({"drain": {...}}) is still one drain.
    old = {"kind": "drain", "drain": dict(R.as_dict(hook)["drains"][0], time=3.0)}
    assert st.write(old) == "db"
    c = sqlite3.connect(st.path)
    got = c.execute("SELECT node, ok, outcome, kept_reason, restart_count FROM drains ORDER BY time").fetchall()
    assert got == [("n1", 1, "drained", None, 0), ("n2", 0, "kept", "maint", 0), ("n3", 0, "kept", "maint", 0),
                   ("n1", 1, "drained", None, 0)]


def test_a_write_says_where_the_record_went_without_its_text_being_parsed(tmp_path):
    st = Store(str(tmp_path / "usage.db"), str(tmp_path / "spool"))
    assert st.write(_start()).in_database
    st.unavailable = "database locked past store.busy_timeout_s"
    written = st.write(_start())
    assert (written.where, written.in_database) == ("spool", False)
    assert json.load(open(written.path))["_spool_reason"] == "database locked past store.busy_timeout_s"
