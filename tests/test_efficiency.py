"""Issue 38: idle GPUs found while the job runs.  Samples from the real prolog's start records and the
simulated driver into a real on-disk SQLite database; the policy as a pure function; the decisions of
`efficiency enforce` mailed through a real SMTP server on 127.0.0.1 (aiosmtpd) with Slurm replaced by a
recording backend (the same flows run under real Slurm in tests/integration/test_efficiency_slurm.py)."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest
import simgpu
from smtpserver import SmtpServer
from test_hooks import deps_for, job_env, rows

from slurm_gpu import config
from slurm_gpu.efficiency import enforce as E
from slurm_gpu.efficiency import mail as M
from slurm_gpu.efficiency import policy as P
from slurm_gpu.efficiency.sample import sample
from slurm_gpu.errors import ConfigError, SlurmError
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.slurm.jobenv import from_env
from slurm_gpu.store import samples as Q
from slurm_gpu.store.node import Store

GIB = 1 << 30


def _store(node):
    return Store(str(node.db), str(node.spool))


def _reader(cfg):
    return NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)


def _start(node, job_id, gpus, **env):
    assert hooks.prolog(from_env(job_env(job_id=job_id, gpus=gpus, **env)), deps_for(node)) == 0


def _end(node, job_id, gpus):
    assert hooks.epilog(from_env(job_env(job_id=job_id, gpus=gpus)), deps_for(node)) == 0


# --------------------------------------------------------------------------- sampling


def test_sample_reads_each_running_jobs_gpus_by_uuid_and_skips_ended_jobs(sim_node):
    node = sim_node(simgpu.h100_sxm(4))
    _start(node, 11, "0,1")
    _start(node, 12, "2")
    _end(node, 12, "2")
    simgpu.set_gpu(node.state, 0, gpu_util=0, memory_used=1 * GIB, energy_mj=1_000_000_000 + 5_000_000)
    simgpu.set_gpu(node.state, 1, gpu_util=87, memory_used=40 * GIB)
    simgpu.set_gpu(node.state, 2, gpu_util=99)  # job 12 ended: nobody's sample
    cfg = config.load(str(node.config))
    conn = _store(node).connect()
    starts = {r["gpu_uuid"]: r for r in rows(node.db, "SELECT * FROM job_starts WHERE job_id = 11")}
    run = sample(cfg, conn, _reader(cfg), node="gpu01", boot=0.0, now=time.time())
    got = {r["gpu_uuid"]: r for r in rows(node.db, "SELECT * FROM job_samples")}
    assert set(got) == set(starts) and len(run.rows) == 2 and run.missing == []
    by_index = {r["gpu_index"]: r for r in got.values()}
    assert by_index[0]["gpu_util_pct"] == 0 and by_index[0]["memory_used_bytes"] == 1 * GIB
    assert by_index[1]["gpu_util_pct"] == 87 and by_index[1]["gpu_util_max_pct"] == 87
    e0 = starts[by_index[0]["gpu_uuid"]]["energy_mj"]
    assert by_index[0]["energy_j"] == pytest.approx((1_000_000_000 + 5_000_000 - e0) / 1000.0)
    assert {r["job_id"] for r in got.values()} == {11} and all(r["span_s"] == 60.0 for r in got.values())


def test_a_start_recorded_before_the_node_booted_is_not_a_running_job(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    _start(node, 21, "0")
    cfg = config.load(str(node.config))
    run = sample(cfg, _store(node).connect(), _reader(cfg), node="gpu01", boot=time.time() + 5)
    assert run.rows == [] and rows(node.db, "SELECT count(*) AS n FROM job_samples") == [{"n": 0}]


def test_a_gpu_that_left_the_bus_is_named_not_sampled_and_the_others_still_are(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    _start(node, 31, "0,1")
    simgpu.inject_error(node.state, 1, "nvmlDeviceGetHandleByIndex", simgpu.GPU_IS_LOST)
    cfg = config.load(str(node.config))
    run = sample(cfg, _store(node).connect(), _reader(cfg), node="gpu01", boot=0.0)
    assert len(run.rows) == 1 and run.rows[0]["gpu_index"] == 0
    assert len(run.missing) == 1 and run.missing[0].startswith("job 31: GPU-")


def _row(t, util, *, job=1, gpu="GPU-a", node="gpu01", span=60.0, mem=None, energy=None):
    return {"cluster": "c", "job_id": job, "restart_count": 0, "node": node, "gpu_uuid": gpu, "gpu_index": 0,
            "time": t, "span_s": span, "samples": 1, "coarse": 0, "gpu_util_pct": util, "gpu_util_max_pct": util,
            "memory_used_bytes": mem, "memory_total_bytes": 80 * GIB, "energy_j": energy}


def test_rows_older_than_the_fine_window_become_ten_minute_rows_with_the_same_figures(tmp_path):
    conn = Store(str(tmp_path / "u.db"), str(tmp_path / "spool")).connect()
    t0 = 1_800_000_000.0  # a multiple of 600
    fine = [_row(t0 + 60 * i, util=i % 3 * 10.0, mem=i * GIB, energy=100.0 * i) for i in range(1, 41)]
    Q.record_samples(conn, fine, fine_before=t0 + 1900, keep_before=0, max_bytes=1e9)
    got = [dict(zip(Q.SAMPLE_COLUMNS, r)) for r in
           conn.execute(f"SELECT {', '.join(Q.SAMPLE_COLUMNS)} FROM job_samples ORDER BY time")]
    coarse = [r for r in got if r["coarse"]]
    # The cut is at t0 + 1800: samples 1..29 fall into three buckets, merged; 30..40 stay fine.
    assert [r["samples"] for r in coarse] == [9, 10, 10] and all(not r["coarse"] for r in got[3:])
    assert [r["time"] for r in got[3:]] == [t0 + 60 * i for i in range(30, 41)]
    merged = fine[:29]
    assert sum(r["span_s"] for r in coarse) == sum(r["span_s"] for r in merged)
    assert sum(r["gpu_util_pct"] * r["span_s"] for r in coarse) == pytest.approx(sum(r["gpu_util_pct"] * 60 for r in merged))
    assert max(r["gpu_util_max_pct"] for r in coarse) == 20.0 and coarse[-1]["memory_used_bytes"] == 29 * GIB
    assert coarse[-1]["energy_j"] == 2900.0
    # Running it again merges nothing twice.
    assert Q.downsample(conn, t0 + 1900) == 0


def test_the_samples_table_stays_under_its_cap_oldest_first(tmp_path):
    conn = Store(str(tmp_path / "u.db"), str(tmp_path / "spool")).connect()
    t0 = 1_800_000_000.0
    Q.record_samples(conn, [_row(t0 + i, 0.0) for i in range(500)], fine_before=0, keep_before=0,
                     max_bytes=100 * Q.ROW_BYTES)
    times = [r[0] for r in conn.execute("SELECT time FROM job_samples ORDER BY time")]
    assert times == [t0 + i for i in range(400, 500)]  # 100 rows: the cap
    out = Q.record_samples(conn, [_row(t0 + 1000, 0.0)], fine_before=0, keep_before=t0 + 450, max_bytes=1e9)
    assert out["deleted"] == 50


# --------------------------------------------------------------------------- the policy


def _policy(**kw):
    base = dict(idle_util_pct=0.0, idle_memory_bytes=0, grace_s=0.0, notify_after_s=600.0, cancel_after_s=1200.0,
                interactive_notify_after_s=600.0, interactive_cancel_after_s=0.0, exempt_accounts=frozenset(),
                exempt_partitions=frozenset(), exempt_qos=frozenset(), exempt_users=frozenset(), max_gap_s=180.0)
    base.update(kw)
    return P.Policy(**base)


def _job(**kw):
    base = dict(cluster="c", job_id=1, restart_count=0, user="alice", account="physics", partition="gpu", qos="normal",
                batch=True, state="RUNNING", num_nodes=1, nodes="gpu01", start_time=0.0)
    base.update(kw)
    return P.JobFacts(**base)


def _series(gpus, minutes, util=lambda g, m: 0.0, node=lambda g: "gpu01"):
    return [_row(60.0 * m, util(g, m), gpu=f"GPU-{g}", node=node(g)) for g in range(gpus) for m in range(1, minutes + 1)]


def test_a_job_idle_on_all_gpus_is_notified_once_then_cancelled_only_after_its_warning_aged():
    p, job = _policy(), _job()
    s = _series(2, 9)
    assert P.judge(s, job, p, {}, 9 * 60, 2).stage == ""  # idle 540 s < 600 s
    s = _series(2, 11)
    j = P.judge(s, job, p, {}, 11 * 60, 2)
    assert (j.stage, j.idle_s, j.idle_gpus) == ("notify", 660.0, 2)
    done = {"notify": {"mail_state": "sent", "mail_time": 11 * 60}}
    assert P.judge(_series(2, 15), job, p, done, 15 * 60, 2).stage == ""
    # Idle 1,260 s, but warned only 540 s ago (600 s are due): not yet.
    j = P.judge(_series(2, 21), job, p, done, 20 * 60, 2)
    assert j.stage == "" and "warned 540 s ago" in j.why
    j = P.judge(_series(2, 22), job, p, done, 22 * 60, 2)
    assert j.stage == "cancel"
    assert P.judge(_series(2, 23), job, p, dict(done, cancel={"cancel_state": "done"}), 23 * 60, 2).stage == ""


def test_a_warning_that_never_went_out_holds_the_cancel_back():
    p, job = _policy(), _job()
    for state in ("failed", "pending", "capped"):
        j = P.judge(_series(1, 60), job, p, {"notify": {"mail_state": state, "mail_time": 60.0}}, 3600, 1)
        assert j.stage == "" and "not mailed" in j.why


def test_one_busy_gpu_on_another_node_means_advice_never_a_cancel():
    p, job = _policy(), _job(num_nodes=2, nodes="gpu[01-02]")
    s = _series(2, 60, util=lambda g, m: 90.0 if g == 1 else 0.0, node=lambda g: f"gpu0{g + 1}")
    j = P.judge(s, job, p, {}, 3600, 2)
    assert (j.stage, j.idle_gpus, j.gpus) == ("advice", 1, 2)
    assert P.judge(s, job, p, {"advice": {}}, 3600, 2).stage == ""


def test_a_gpu_whose_samples_have_not_arrived_leaves_the_job_unjudged():
    p, job = _policy(), _job(num_nodes=2)
    assert P.judge(_series(1, 60), job, p, {}, 3600, 2).stage == ""  # the second GPU never sampled
    s = _series(2, 60)
    stale = [r for r in s if not (r["gpu_uuid"] == "GPU-1" and r["time"] > 3000)]
    j = P.judge(stale, job, p, {}, 3600, 2)
    assert j.stage == "" and "fresh" in j.why


def test_a_gap_in_the_samples_ends_the_idle_stretch():
    p, job = _policy(), _job()
    p = _policy(notify_after_s=1200.0, cancel_after_s=0.0)
    s = [r for r in _series(1, 30) if not 10 * 60 < r["time"] < 15 * 60]  # 4 minutes missing
    j = P.judge(s, job, p, {}, 30 * 60, 1)
    assert j.stage == "" and j.idle_s == pytest.approx(16 * 60)
    assert P.judge(_series(1, 30), job, p, {}, 30 * 60, 1).stage == "notify"


def test_the_grace_period_and_a_single_busy_sample_both_reset_the_window():
    p = _policy(grace_s=900.0)
    assert P.judge(_series(1, 24), _job(), p, {}, 24 * 60, 1).stage == ""  # idle 540 s after the grace
    s = _series(1, 30, util=lambda g, m: 3.0 if m == 25 else 0.0)
    j = P.judge(s, _job(), _policy(), {}, 30 * 60, 1)
    assert j.stage == "" and j.idle_s == 300.0


def test_memory_held_on_the_gpu_is_not_idle_when_the_site_says_so():
    s = [dict(r, memory_used_bytes=30 * GIB) for r in _series(1, 30)]
    assert P.judge(s, _job(), _policy(), {}, 1800, 1).stage == "notify"
    assert P.judge(s, _job(), _policy(idle_memory_bytes=1 * GIB), {}, 1800, 1).stage == ""


def test_exempt_accounts_and_interactive_jobs_are_warned_and_never_cancelled():
    done = {"notify": {"mail_state": "sent", "mail_time": 0.0}}
    for p, job in ((_policy(exempt_accounts=frozenset({"physics"})), _job()),
                   (_policy(exempt_qos=frozenset({"normal"})), _job()),
                   (_policy(), _job(batch=False))):
        assert P.judge(_series(1, 60), job, p, {}, 3600, 1).stage == "notify"
        assert P.judge(_series(1, 60), job, p, done, 3600, 1).stage == ""
    assert P.judge(_series(1, 60), _job(batch=False), _policy(interactive_cancel_after_s=1200.0), done, 3600, 1
                   ).stage == "cancel"


def test_a_mig_slice_has_no_utilisation_so_its_job_is_never_idle():
    s = [dict(r, gpu_util_pct=None, gpu_util_max_pct=None) for r in _series(1, 60)]
    assert P.judge(s, _job(), _policy(), {}, 3600, 1).stage == ""


def test_a_cancel_without_a_warning_before_it_is_a_config_error(sim_node):
    node = sim_node()
    for extra in ("[efficiency]\nnotify_after_s = 0\ncancel_after_s = 600\n",
                  "[efficiency]\nnotify_after_s = 600\ncancel_after_s = 600\n",
                  "[efficiency]\ninteractive_notify_after_s = 0\ninteractive_cancel_after_s = 60\n"):
        node.write_config(extra)
        with pytest.raises(ConfigError) as e:
            P.Policy.from_config(config.load(str(node.config)))
        assert "needs a warning first" in e.value.message and e.value.hint


# --------------------------------------------------------------------------- enforce, with a real SMTP server


class RecordingSlurm:
    def __init__(self, records):
        self.records = records  # job id -> scontrol fields
        self.cancelled = []
        self.summaries = []
        self.fail_cancel = False

    def job_record(self, job_id):
        return self.records.get(job_id)

    def set_running_summary(self, job_id, text):
        self.summaries.append((job_id, text))
        self.records[job_id] = dict(self.records[job_id], AdminComment=text)

    def cancel_with_note(self, job_id, note):
        if self.fail_cancel:
            raise SlurmError("scancel: slurmctld not reachable", "scontrol ping")
        self.cancelled.append((job_id, note))
        self.records[job_id] = dict(self.records[job_id], JobState="CANCELLED")
        return bool(note)


def _record(job_id, **kw):
    base = {"JobId": str(job_id), "UserId": "sgtest(2501)", "Account": "physics", "Partition": "gpu", "QOS": "normal",
            "BatchFlag": "1", "JobState": "RUNNING", "NumNodes": "1", "NodeList": "gpu01", "Restarts": "0",
            "JobName": "train.sh", "MailUser": "(null)", "AdminComment": "(null)"}
    base.update(kw)
    return base


@pytest.fixture
def smtp(tmp_path):
    server = SmtpServer(tmp_path / "smtp").start()
    yield server
    server.stop()


def _idle_node(sim_node, smtp, extra=""):
    node = sim_node(simgpu.h100_sxm(2))
    node.write_config(f'[efficiency]\ngrace_s = 0\nnotify_after_s = 120\ncancel_after_s = 300\nmail_retry_s = 0\n'
                      f'smtp_server = "{smtp.address}"\nmail_domain = "example.org"\nmail_from = "gpu-police@example.org"\n'
                      f'job_url = "https://ood.example.org/jobstats?jobid={{job_id}}"\n' + extra)
    _start(node, 41, "0,1")
    for i in (0, 1):
        simgpu.set_gpu(node.state, i, gpu_util=0, memory_used=2 * GIB)
    cfg = config.load(str(node.config))
    conn = _store(node).connect()
    return node, cfg, conn


def _minutes(cfg, conn, start, minutes):
    """Samples each minute from `start` (the simulated driver's figures at each)."""
    reader = _reader(cfg)
    for m in range(1, minutes + 1):
        sample(cfg, conn, reader, node="gpu01", boot=0.0, now=start + 60.0 * m)
    reader.close()


def test_an_idle_job_gets_one_mail_and_is_cancelled_with_its_reason_after_the_warning(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41)})
    _minutes(cfg, conn, t0, 3)
    out = E.enforce(cfg, conn, slurm, now=t0 + 180, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.mail) for o in out] == [("notify", "sent")]
    (msg,) = smtp.wait_for(1)
    assert msg["To"] == "sgtest@example.org" and msg["From"] == "gpu-police@example.org"
    assert msg["Subject"] == "[slurm-gpu] Job 41: its 2 GPUs have been idle for 3 min"
    body = msg.get_payload(decode=True).decode()
    assert "job 41" in body and "scancel 41" in body and "will be cancelled" in body
    assert "https://ood.example.org/jobstats?jobid=41" in body and body.count("GPU-") == 2
    # Every minute after: no second mail.  Past cancel_after (300 s) and 180 s after the warning: cancelled.
    for m in range(4, 6):
        _minutes(cfg, conn, t0 + 60 * (m - 1), 1)
        assert [o.stage for o in E.enforce(cfg, conn, slurm, now=t0 + 60 * m, booted_at=0.0, node="gpu01")] == [""]
    assert slurm.cancelled == []
    _minutes(cfg, conn, t0 + 300, 1)
    out = E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.cancel, o.mail) for o in out] == [("cancel", "done", "sent")]
    ((job, note),) = slurm.cancelled
    assert job == 41 and note.startswith("slurm-gpu cancelled this job: all GPUs (2) idle")
    assert sorted(m["Subject"] for m in smtp.wait_for(2))[1] == "[slurm-gpu] Job 41: its 2 GPUs have been idle for 3 min"
    assert sorted(m["Subject"] for m in smtp.wait_for(2))[0] == "[slurm-gpu] Job 41 cancelled: its GPUs were idle for 6 min"
    acts = Q.actions(conn)
    assert [(a["stage"], a["mail_state"], a["cancel_state"]) for a in acts] == [("notify", "sent", None),
                                                                               ("cancel", "sent", "done")]
    evidence = json.loads(acts[1]["evidence"])
    assert len(evidence["gpus"]) == 2 and all(g["util_max_pct"] == 0 for g in evidence["gpus"])


def test_a_busy_job_gets_nothing_and_a_partly_idle_one_one_advice(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)
    for i in (0, 1):
        simgpu.set_gpu(node.state, i, gpu_util=65)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41)})
    _minutes(cfg, conn, t0, 10)
    assert [o.stage for o in E.enforce(cfg, conn, slurm, now=t0 + 600, booted_at=0.0, node="gpu01")] == [""]
    assert Q.actions(conn) == [] and smtp.messages() == []
    simgpu.set_gpu(node.state, 0, gpu_util=0)  # GPU 0 stops working, GPU 1 goes on
    _minutes(cfg, conn, t0 + 600, 10)
    out = E.enforce(cfg, conn, slurm, now=t0 + 1200, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.mail) for o in out] == [("advice", "sent")]
    assert E.enforce(cfg, conn, slurm, now=t0 + 1260, booted_at=0.0, node="gpu01")[0].stage == ""
    (msg,) = smtp.wait_for(1)
    assert msg["Subject"] == "[slurm-gpu] Job 41: 1 of its 2 GPUs are idle"
    assert "Nothing will be done to this job" in msg.get_payload(decode=True).decode()
    assert slurm.cancelled == []


def test_a_mail_server_that_is_down_loses_no_decision_and_the_mail_goes_out_when_it_is_back(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41, MailUser="alice@lab.example.org")})
    smtp.stop()
    _minutes(cfg, conn, t0, 3)
    began = time.monotonic()
    out = E.enforce(cfg, conn, slurm, now=t0 + 180, booted_at=0.0, node="gpu01")
    assert time.monotonic() - began < 5  # a refused connection, not a hang
    assert [(o.stage, o.mail) for o in out] == [("notify", "failed")]
    (a,) = Q.actions(conn)
    assert a["mail_state"] == "failed" and "SMTP server 127.0.0.1:" in a["mail_error"] and a["mail_tries"] == 1
    # Sampling goes on; the decision is not taken twice; the mail is tried again by the next run.
    _minutes(cfg, conn, t0 + 180, 1)
    out = E.enforce(cfg, conn, slurm, now=t0 + 240, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.mail) for o in out] == [("notify", "failed"), ("", "")]
    # Past cancel_after: no cancel, the warning never went out.
    _minutes(cfg, conn, t0 + 240, 5)
    out = E.enforce(cfg, conn, slurm, now=t0 + 540, booted_at=0.0, node="gpu01")
    assert slurm.cancelled == [] and "not mailed" in out[-1].why
    smtp.start()
    out = E.enforce(cfg, conn, slurm, now=t0 + 600, booted_at=0.0, node="gpu01")
    assert out[0].mail == "sent" and out[0].why == "mail tried again"
    (msg,) = smtp.wait_for(1)
    assert msg["To"] == "alice@lab.example.org"
    (a,) = Q.actions(conn)
    assert (a["mail_state"], a["mail_tries"]) == ("sent", 4)


def _warned_then_idle(sim_node, smtp, **record):
    """Job 41 idle on 2 GPUs, warned at its start (t0) and idle 6 minutes since: a cancel is due (300 s)."""
    node, cfg, conn = _idle_node(sim_node, smtp)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41, **record)})
    _minutes(cfg, conn, t0, 3)
    E.enforce(cfg, conn, slurm, now=t0 + 180, booted_at=0.0, node="gpu01")
    Q.update_action(conn, Q.actions(conn)[0]["id"], mail_time=t0)
    _minutes(cfg, conn, t0 + 180, 3)
    return node, cfg, conn, t0, slurm


def test_a_failed_cancel_is_recorded_and_tried_again(sim_node, smtp):
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp)
    slurm.fail_cancel = True
    out = E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.cancel) for o in out] == [("cancel", "failed")]
    slurm.fail_cancel = False
    out = E.enforce(cfg, conn, slurm, now=t0 + 420, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.cancel) for o in out] == [("cancel", "done")] and len(slurm.cancelled) == 1
    assert sorted(m["Subject"].split(":")[0] for m in smtp.wait_for(2)) == ["[slurm-gpu] Job 41", "[slurm-gpu] Job 41 cancelled"]


def test_a_crash_between_the_cancel_decision_and_scancel_is_finished_by_the_next_run_then_mailed(sim_node, smtp):
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp)
    # The run that decided the cancel died right after writing it: no scancel, no notice.
    real = slurm.cancel_with_note
    slurm.cancel_with_note = lambda job_id, note: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01")
    slurm.cancel_with_note = real
    assert [(a["stage"], a["cancel_state"], a["mail_state"]) for a in Q.actions(conn)] == [
        ("notify", None, "sent"), ("cancel", None, "pending")]
    assert len(smtp.wait_for(1)) == 1  # the cancel notice did not go before the cancel
    out = E.enforce(cfg, conn, slurm, now=t0 + 420, booted_at=0.0, node="gpu01")
    assert [(o.stage, o.cancel, o.mail) for o in out] == [("cancel", "done", "sent")] and len(slurm.cancelled) == 1
    assert sorted(m["Subject"].split(":")[0] for m in smtp.wait_for(2)) == ["[slurm-gpu] Job 41", "[slurm-gpu] Job 41 cancelled"]


def test_a_cancel_that_failed_is_dropped_once_the_job_works_again(sim_node, smtp):
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp)
    slurm.fail_cancel = True
    assert [o.cancel for o in E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01")] == ["failed"]
    slurm.fail_cancel = False
    simgpu.set_gpu(node.state, 0, gpu_util=90)  # Slurm was down a while; meanwhile the job got to work
    _minutes(cfg, conn, t0 + 360, 2)
    out = E.enforce(cfg, conn, slurm, now=t0 + 480, booted_at=0.0, node="gpu01")
    assert slurm.cancelled == [] and out[0].why.startswith("a cancel decided earlier is not carried out")
    assert [(a["stage"], a["cancel_state"], a["mail_state"]) for a in Q.actions(conn)] == [
        ("notify", None, "sent"), ("cancel", "dropped", "none")]
    assert len(smtp.wait_for(1)) == 1  # the warning only: no notice of a cancel that never happened


def test_a_gpu_that_gets_to_work_after_the_last_sample_stops_the_cancel_at_the_last_look(sim_node, smtp):
    """The job's first kernel starts between the sample and the scancel: the GPUs are read once more
    right before it, and the cancel is dropped (no scancel, no notice), never carried out later."""
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp)
    simgpu.set_gpu(node.state, 1, gpu_util=97)  # after the last sample
    reader = _reader(cfg)
    try:
        out = E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01", reader=reader)
        assert [(o.stage, o.cancel) for o in out] == [("cancel", "dropped")] and slurm.cancelled == []
        assert "not idle at the last look before the cancel" in out[0].why
        assert [(a["stage"], a["cancel_state"], a["mail_state"]) for a in Q.actions(conn)] == [
            ("notify", None, "sent"), ("cancel", "dropped", "none")]
        simgpu.set_gpu(node.state, 1, gpu_util=0)  # idle again: this start is not cancelled a second time
        _minutes(cfg, conn, t0 + 360, 6)
        E.enforce(cfg, conn, slurm, now=t0 + 720, booted_at=0.0, node="gpu01", reader=reader)
        assert slurm.cancelled == [] and len(smtp.wait_for(1)) == 1
    finally:
        reader.close()


def test_a_gpu_that_cannot_be_read_at_the_last_look_holds_the_cancel_until_a_later_run_reads_it(sim_node, smtp):
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp)
    simgpu.inject_error(node.state, 0, "nvmlDeviceGetHandleByIndex", simgpu.GPU_IS_LOST)  # lost after the last sample
    reader = _reader(cfg)
    try:
        out = E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01", reader=reader)
        assert [(o.stage, o.cancel) for o in out] == [("cancel", "failed")] and slurm.cancelled == []
        assert "could not be read again before the cancel" in out[0].error
    finally:
        reader.close()
    simgpu.clear_error(node.state, 0, "nvmlDeviceGetHandleByIndex")
    reader = _reader(cfg)
    try:
        _minutes(cfg, conn, t0 + 360, 1)
        out = E.enforce(cfg, conn, slurm, now=t0 + 420, booted_at=0.0, node="gpu01", reader=reader)
        assert [(o.stage, o.cancel, o.mail) for o in out] == [("cancel", "done", "sent")] and len(slurm.cancelled) == 1
    finally:
        reader.close()


def test_another_tools_admin_comment_is_not_overwritten_by_the_cancel_reason(sim_node, smtp):
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp, AdminComment="jobstats:abc")
    E.enforce(cfg, conn, slurm, now=t0 + 360, booted_at=0.0, node="gpu01")
    assert slurm.cancelled == [(41, None)]


def test_the_daily_cap_stops_mails_and_the_cap_holds_back_the_cancel(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp, "max_mails_per_user_per_day = 0\n")
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41)})
    _minutes(cfg, conn, t0, 10)
    assert [o.mail for o in E.enforce(cfg, conn, slurm, now=t0 + 600, booted_at=0.0, node="gpu01")] == ["capped"]
    assert E.enforce(cfg, conn, slurm, now=t0 + 660, booted_at=0.0, node="gpu01")[0].stage == ""
    assert slurm.cancelled == [] and smtp.messages() == []


def test_multi_node_jobs_are_left_to_the_central_server_and_requeued_jobs_are_not_judged(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    _minutes(cfg, conn, t0, 10)
    for rec, why in ((_record(41, NumNodes="2", NodeList="gpu[01-02]"), "runs on 2 nodes"),
                     (_record(41, Restarts="1"), "requeued")):
        out = E.enforce(cfg, conn, RecordingSlurm({41: rec}), now=t0 + 600, booted_at=0.0, node="gpu01")
        assert out[0].stage == "" and why in out[0].why
    assert Q.actions(conn) == [] and smtp.messages() == []


def test_dry_run_decides_and_prints_but_writes_mails_and_cancels_nothing(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41)})
    _minutes(cfg, conn, t0, 10)
    out = E.enforce(cfg, conn, slurm, now=t0 + 600, booted_at=0.0, node="gpu01", dry_run=True)
    assert out[0].stage == "notify" and out[0].mail.startswith("dry-run to sgtest@example.org: [slurm-gpu] Job 41")
    assert Q.actions(conn) == [] and smtp.messages() == [] and slurm.cancelled == []


def test_the_mail_command_gets_slurms_mailprog_arguments_and_the_body_on_stdin(tmp_path, sim_node):
    node = sim_node()
    got = tmp_path / "mailprog.out"
    prog = tmp_path / "mailprog"
    prog.write_text(f'#!/bin/sh\necho "$@" > {got}\ncat >> {got}\n')
    prog.chmod(0o755)
    node.write_config(f'[efficiency]\nmail_command = ["{prog}", "-s", "{{subject}}", "{{to}}"]\n')
    cfg = config.load(str(node.config))
    assert M.send(cfg, M.Message("alice", "[slurm-gpu] Job 7: x", "hello\n")) == "mailprog"
    assert got.read_text() == "-s [slurm-gpu] Job 7: x alice\nhello\n"
    prog.write_text("#!/bin/sh\necho 'send-mail: fatal: no relay' >&2\nexit 75\n")
    with pytest.raises(M.MailError) as e:
        M.send(cfg, M.Message("alice", "s", "b"))
    assert e.value.message == f"mail command {prog} exited 75: send-mail: fatal: no relay"


# --------------------------------------------------------------------------- the commands


def test_efficiency_run_samples_then_applies_the_policy_and_actions_lists_it(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)
    env = node.env()
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "efficiency", "sample", "--node-name", "gpu01"],
                        env=env, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "sampled 2 GPUs of 1 running jobs on gpu01"
    # A decision recorded by enforce, listed for the admin.
    Q.add_action(conn, {"time": time.time(), "cluster": "sgtest", "job_id": 41, "restart_count": 0, "decided_on": "gpu01",
                        "user": "sgtest", "stage": "notify", "idle_s": 3600.0, "gpus": 2, "idle_gpus": 2,
                        "evidence": json.dumps({"why": "x", "gpus": []}), "mail_state": "sent", "mail_to": "a@b"})
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "efficiency", "actions", "--json"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    (a,) = json.loads(cp.stdout)
    assert (a["job_id"], a["stage"], a["mail_state"], a["evidence"]) == (41, "notify", "sent", {"why": "x", "gpus": []})
    node.write_config("[efficiency]\nnotify_after_s = 0\ncancel_after_s = 60\n")
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "efficiency", "run", "--node-name", "gpu01"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and cp.stderr.startswith("slurm-gpu: error: efficiency.cancel_after_s = 60 needs a warning")
    # The samples were written all the same: a policy that cannot apply does not stop sampling.
    assert sqlite3.connect(str(node.db)).execute("SELECT count(*) FROM job_samples").fetchone()[0] == 4
    assert os.path.exists(node.db)


def test_running_jobs_gpus_reach_prometheus_one_series_per_gpu_and_vanish_with_the_job(sim_node, tmp_path):
    from test_metrics import client_parse, promtool_check
    node = sim_node(simgpu.h100_sxm(4))
    textfile = tmp_path / "textfile"
    node.write_config(f'[metrics]\ntextfile_dir = "{textfile}"\n[efficiency]\ngrace_s = 0\nsample_every_s = 60\n')
    _start(node, 51, "0,1")
    simgpu.set_gpu(node.state, 0, gpu_util=0, memory_used=3 * GIB)
    simgpu.set_gpu(node.state, 1, gpu_util=42, memory_used=9 * GIB)
    cfg = config.load(str(node.config))
    conn = _store(node).connect()
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    reader = _reader(cfg)
    for m in range(1, 6):
        run = sample(cfg, conn, reader, node="gpu01", boot=0.0, now=t0 + 60 * m)
        assert run.problem == ""
    text = (textfile / "slurm_gpu_efficiency.prom").read_text()
    promtool_check(text)
    got = client_parse(text)
    by_gpu = {dict(k)["gpu"]: v for k, v in got["slurm_gpu_running_job_gpu_utilization_ratio"].items()}
    assert by_gpu == {"0": 0.0, "1": 0.42}
    mem = {dict(k)["gpu"]: v for k, v in got["slurm_gpu_running_job_memory_used_bytes"].items()}
    assert mem == {"0": 3 * GIB, "1": 9 * GIB}
    idle = {dict(k)["gpu"]: v for k, v in got["slurm_gpu_running_job_gpu_idle_seconds"].items()}
    assert idle == {"0": 300.0, "1": 0.0}
    assert all(dict(k)["modelName"] == "NVIDIA H100 80GB HBM3" for k in got["slurm_gpu_running_job_gpu_idle_seconds"])
    _end(node, 51, "0,1")
    sample(cfg, conn, reader, node="gpu01", boot=0.0, now=t0 + 360)
    reader.close()
    assert "slurm_gpu_running_job" not in (textfile / "slurm_gpu_efficiency.prom").read_text()


def test_a_running_jobs_figures_so_far_go_into_its_admin_comment_every_so_often_never_over_another_tools(sim_node, smtp):
    from slurm_gpu.store import summary as sg
    node, cfg, conn = _idle_node(sim_node, smtp, "live_summary_every_s = 120\n")
    simgpu.set_gpu(node.state, 1, gpu_util=70, memory_used=30 * GIB)
    t0 = rows(node.db, "SELECT start_time FROM job_starts")[0]["start_time"]
    slurm = RecordingSlurm({41: _record(41)})
    _minutes(cfg, conn, t0, 3)
    E.enforce(cfg, conn, slurm, now=t0 + 180, booted_at=0.0, node="gpu01")
    ((job, text),) = slurm.summaries
    s = sg.decode(text)
    assert job == 41 and s.job_id == 41 and s.partial and s.live is not None and s.live["t"] == pytest.approx(t0 + 180, abs=0.1)
    assert [(g.node, g.index, g.util_pct, g.peak_mib) for g in s.gpus] == [("gpu01", 0, 0.0, 2048),
                                                                         ("gpu01", 1, 70.0, 30720)]
    (idle0, points0), (idle1, points1) = s.live["g"]
    assert (idle0, idle1) == (180, 0) and len(points0) == 60
    assert points0[-3:] == [0, 0, 0] and points1[-3:] == [70, 70, 70] and points1[:-3] == [None] * 57
    # Not again before live_summary_every_s; again after it.
    _minutes(cfg, conn, t0 + 180, 1)
    E.enforce(cfg, conn, slurm, now=t0 + 240, booted_at=0.0, node="gpu01")
    assert len(slurm.summaries) == 1
    _minutes(cfg, conn, t0 + 240, 1)
    E.enforce(cfg, conn, slurm, now=t0 + 300, booted_at=0.0, node="gpu01")
    assert len(slurm.summaries) == 2 and sg.decode(slurm.summaries[1][1]).live["t"] == pytest.approx(t0 + 300, abs=0.1)
    # Another tool's AdminComment (jobstats) is never overwritten.
    slurm.records[41]["AdminComment"] = "jobstats:xyz"
    _minutes(cfg, conn, t0 + 300, 3)
    E.enforce(cfg, conn, slurm, now=t0 + 480, booted_at=0.0, node="gpu01")
    assert len(slurm.summaries) == 2


def test_many_running_jobs_are_asked_of_slurm_in_one_call_not_one_each(sim_node, smtp):
    node, cfg, conn = _idle_node(sim_node, smtp)

    class ManyJobs:
        multi_node = True

        def candidates(self, now):
            return [E.Candidate("sgtest", 100 + i, 0, None, 1) for i in range(20)]

        def samples(self, c, since):
            return []

        def totals(self, c):
            return []

        def done(self, c):
            return {}

    slurm = RecordingSlurm({100 + i: _record(100 + i, JobState="RUNNING") for i in range(20)})
    asked = []
    slurm.job_record = lambda job_id: asked.append(job_id) or slurm.records.get(job_id)
    slurm.job_records = lambda: dict(slurm.records)
    out = E.enforce(cfg, conn, slurm, source=ManyJobs(), node="ctl")
    assert asked == [] and len(out) == 20 and all("not judged" in o.why or "fresh" in o.why for o in out)


def test_report_jobs_idle_lists_what_the_policy_did_from_one_file_several_and_an_old_one(tmp_path):
    """Issue 38: every action appears in `slurm-gpu report jobs --idle` (node files; the central server: the
    same query, tests/test_central.py)."""
    from test_report import make_db, rec

    from slurm_gpu.store import schema as node_schema
    idle = [rec("c1", 7, "n1", 0, "alice", "physics", "gpu", "2026-11-02T10:00", "2026-11-02T12:00", 0.0, 0, 1e5, GIB)]
    busy = [rec("c1", 8, "n2", 0, "bob", "chem", "gpu", "2026-11-02T10:00", "2026-11-02T12:00", 50.0, 0, 1e5, GIB)]
    a, b = make_db(tmp_path / "n1.db", idle), make_db(tmp_path / "n2.db", busy)
    old = make_db(tmp_path / "old.db", [dict(idle[0], job_id=9)], version=node_schema.SCHEMA_VERSION - 1)
    conn = sqlite3.connect(a)
    for stage, mail, cancel in (("notify", "sent", None), ("cancel", "sent", "done")):
        Q.add_action(conn, {"time": 1.0, "cluster": "c1", "job_id": 7, "restart_count": 0, "decided_on": "n1",
                            "stage": stage, "mail_state": mail, "cancel_state": cancel})
    Q.add_action(conn, {"time": 1.0, "cluster": "c1", "job_id": 7, "restart_count": 1, "decided_on": "n1",
                        "stage": "notify", "mail_state": "failed"})  # another run of job 7: not this record's
    conn.commit()
    conn.close()
    (tmp_path / "empty.toml").write_text("")
    for dbs in ([a], [a, b, old], [a, str(tmp_path / "n1-copy.db")]):
        if len(dbs) == 2:
            import shutil
            shutil.copy(a, dbs[1])  # the same node file twice: its actions count once
        args = [x for d in dbs for x in ("--db", str(d))]
        env = dict(os.environ, SLURM_GPU_CONFIG=str(tmp_path / "empty.toml"))
        cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "report", "jobs", "--idle", *args, "--json"],
                            capture_output=True, text=True, timeout=60, env=env)
        assert cp.returncode == 0, cp.stderr
        got = {r["job_id"]: r["idle_policy"] for r in json.loads(cp.stdout)}
        assert got[7] == "notify sent, cancel done", (dbs, got)
        assert 8 not in got and got.get(9, None) is None


def test_a_live_summary_is_due_over_an_earlier_runs_final_summary_never_over_this_runs():
    from slurm_gpu.efficiency import live
    from slurm_gpu.store import summary as sg
    final = sg.encode(sg.Summary("c", 41, 0, False, ["gpu01"], [], [], "gpu"))
    assert live.due(final, 60, 1000.0, restart=1) and not live.due(final, 60, 1000.0, restart=0)
    running = sg.encode(sg.Summary("c", 41, 1, True, ["gpu01"], [], [], "gpu", {"t": 950.0, "g": []}))
    assert not live.due(running, 60, 1000.0, 1) and live.due(running, 60, 1010.0, 1)
    assert not live.due("jobstats:x", 60, 1000.0)
    assert not live.due(sg.cancel_note("all GPUs (1) idle 9 s (cancel after 8 s)"), 60, 1000.0)
    # An admin's text that only starts like our note is not ours: neither overwritten here nor by the summary.
    look_alike = "slurm-gpu cancelled this job: no, I did (admin, ticket 4711)"
    assert not sg.is_ours(look_alike) and not live.due(look_alike, 60, 1000.0)
    assert sg.is_ours(sg.cancel_note("all GPUs (1) idle 9 s (cancel after 8 s)"))
    assert live.due("", 60, 1000.0) and live.due("sg1:damaged!", 60, 1000.0)


def test_a_clock_that_jumps_never_makes_a_job_idle_sooner():
    """The node's clock set forward or back between samples: a forward jump is a gap (the stretch starts
    again after it), a backward one leaves the newest sample in the future (nothing grows until the clock
    passes it); neither brings a cancel forward."""
    p, job = _policy(), _job()
    warned = {"notify": {"mail_state": "sent", "mail_time": 600.0}}
    forward = _series(1, 15) + [_row(7200.0 + 60 * m, 0.0, gpu="GPU-0") for m in range(1, 10)]
    j = P.judge(forward, job, p, warned, 7200.0 + 540, 1)
    assert j.stage == "" and j.idle_s == pytest.approx(540)  # not 15 min + 2 h
    backward = _series(1, 25) + [_row(60.0 * m, 0.0, gpu="GPU-0") for m in range(1, 5)]  # rows again at 1-4 min
    j = P.judge(backward, job, p, warned, 300.0, 1)
    assert j.stage == "" and "not cancelled: warned -300 s ago" in j.why, j.why


# What a run killed at any moment must leave: the script one run of the enforcer is, with Slurm a file.
_KILLED_RUN = r"""
import json, os, sys, time
from slurm_gpu import config
from slurm_gpu.efficiency import enforce as E
from slurm_gpu.gpu.nvml import NvmlReader
from slurm_gpu.store.node import Store
cfg_path, db, spool, slurm_file, cancels, now = sys.argv[1:7]

class FileSlurm:
    def job_record(self, job_id):
        return json.load(open(slurm_file))[str(job_id)]
    def set_running_summary(self, job_id, text):
        return None  # the running job's figures are not what this test watches (test_efficiency's own tests do)
    def cancel_with_note(self, job_id, note):
        with open(cancels, "a") as f:  # what scancel did, before the job's state says so
            f.write(f"{time.time()} {job_id}\n"); f.flush(); os.fsync(f.fileno())
        records = json.load(open(slurm_file))
        records[str(job_id)]["JobState"] = "CANCELLED"
        json.dump(records, open(slurm_file + ".tmp", "w")); os.replace(slurm_file + ".tmp", slurm_file)
        return True

cfg = config.load(cfg_path)
reader = NvmlReader(cfg.nvml_library, cfg.nvml_timeout_s)
print("ready", flush=True)  # imports done: what follows is the run itself
for o in E.enforce(cfg, Store(db, spool).connect(), FileSlurm(), now=float(now), booted_at=0.0, node="gpu01",
                   reader=reader):
    print(o.line())
"""


def test_enforce_killed_at_any_moment_of_the_run_that_cancels_recovers_with_one_cancel_and_its_notice(
        sim_node, smtp, tmp_path):
    """A crash at any line of the run that cancels: from the same state (a cancel due), that run is
    killed (SIGKILL) at 8 random moments of its length (seeded, printed), each followed by the timer's
    next two runs.  Each time: one decision per stage, cancel done and its notice sent; scancel at most
    twice (the killed run's and one more); the notice never delivered before the first scancel."""
    import random
    import signal
    node, cfg, conn, t0, slurm = _warned_then_idle(sim_node, smtp)
    conn.close()
    pristine = tmp_path / "pristine.db"

    def copy(src, dst) -> None:  # the WAL's pages included
        a, b = sqlite3.connect(str(src)), sqlite3.connect(str(dst))
        a.backup(b)
        a.close()
        b.close()
    copy(node.db, pristine)
    slurm_file, cancels = tmp_path / "slurm.json", tmp_path / "cancels.log"
    env = dict(os.environ, SIMNVML_STATE=str(node.state))
    argv = [sys.executable, "-c", _KILLED_RUN, str(node.config), str(node.db), str(node.spool), str(slurm_file),
            str(cancels), str(t0 + 360)]

    def fresh() -> None:
        for suffix in ("", "-wal", "-shm"):
            (node.db.parent / (node.db.name + suffix)).unlink(missing_ok=True)
        copy(pristine, node.db)
        slurm_file.write_text(json.dumps({"41": _record(41)}))
        cancels.unlink(missing_ok=True)
    def started() -> "subprocess.Popen[str]":
        p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.communicate(timeout=30)
        return p
    fresh()
    p = started()
    began = time.monotonic()
    out, err = p.communicate(timeout=60)
    whole = time.monotonic() - began  # from the imports' end to the exit: the run's own moments
    assert p.returncode == 0 and "cancel" in out, out + err
    seed = int(os.environ.get("SLURM_GPU_KILL_SEED") or time.time())
    rng = random.Random(seed)
    print(f"\nSLURM_GPU_KILL_SEED={seed}; the run itself {whole * 1000:.0f} ms")
    for n in range(8):
        fresh()
        notices_before = sum("cancelled" in m["Subject"] for m in smtp.messages())
        p = started()
        at = rng.uniform(0.0, 1.0) * whole
        time.sleep(at)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
        for _ in range(2):  # the timer's next runs
            r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
        db = sqlite3.connect(str(node.db))
        acts = db.execute("SELECT stage, cancel_state, mail_state FROM efficiency_actions ORDER BY id").fetchall()
        db.close()
        assert acts == [("notify", None, "sent"), ("cancel", "done", "sent")], (n, at, acts)
        cancelled = [float(line.split()[0]) for line in cancels.read_text().splitlines()]
        assert 1 <= len(cancelled) <= 2, (n, at, cancelled)
        notices = [m for m in smtp.wait_for(notices_before + 1) if "cancelled" in m["Subject"]]
        new = sorted(m.get_date() for m in notices)[notices_before:]  # Maildir: when the server delivered it
        assert new and new[0] >= min(cancelled) - 1.0, (n, at, new, cancelled)  # (file times: whole seconds)
        assert len(new) <= 2, (n, at, new)  # sent, then killed before it was marked sent: once more
        print(f"kill {n} at {at * 1000:.0f} ms (exit {p.returncode}): scancels {len(cancelled)}, notices {len(new)}")
