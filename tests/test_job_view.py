"""`slurm-gpu job JOBID` (issue 13): sacct parsing, notes at their thresholds, rendering, JSON,
the exit code of every case, and the admin's fallback to the records (docs/job.md)."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from slurm_gpu import config
from slurm_gpu.cli import job as cli_job
from slurm_gpu.cli import main
from slurm_gpu.errors import ExitCode, InputError, SlurmError
from slurm_gpu.report import jobview
from slurm_gpu.slurm import jobacct
from slurm_gpu.store import summary as sg
from slurm_gpu.store.node import Store

GIB = 1 << 30
START, END = 1_777_629_600, 1_777_633_200  # one hour


def gpu(index=0, util=80.0, mem=40.0, peak_mib=40960, total_mib=81920, node="gpu01", ecc=0, xids=(), mig=False,
        energy=500.0, model="NVIDIA H100 80GB HBM3"):
    return sg.GpuUse(node, index, model, START, END, util, mem, peak_mib, total_mib, energy, ecc, list(xids), mig)


def summ(*gpus, missing=(), job_id=4725):
    nodes = sorted({g.node for g in gpus} | set(missing))
    return sg.Summary("c", job_id, 0, bool(missing), nodes, list(missing), list(gpus))


def sacct_line(raw="4725", jid="4711_3", state="COMPLETED", tres="cpu=8,gres/gpu=4,gres/gpu:h100=4,node=1",
               start=str(START), end=str(END), elapsed="3600", limit="240", nodes="gpu01", nnodes="1", comment=""):
    return "|".join([raw, jid, "alice", "physics", "gpu", state, nnodes, nodes, tres, start, end, elapsed, limit, "0:0",
                     comment]) + "\n"


def record(**kw):
    rec = jobacct.parse_line(sacct_line(**kw))
    assert rec is not None
    return rec


def cfg(**job):
    c = config.defaults()
    return c.replace("job", **job) if job else c


def codes(rec, s, c=None):
    return [n.code for n in jobview.job_notes(rec, s, c or cfg())]


class FakeSacct:
    """The slice of CliBackend the command uses: run(tool, args) -> (rc, out, err)."""

    def __init__(self, out="", rc=0, err=""):
        self.out, self.rc, self.err, self.calls = out, rc, err, []

    def run(self, tool, args, timeout_s=None):
        self.calls.append((tool, list(args)))
        return self.rc, self.out, self.err


@pytest.fixture
def sacct(monkeypatch, tmp_path):
    """A fake sacct at the command's seam (cli.job._backend) and an empty config file."""
    fake = FakeSacct()
    monkeypatch.setattr(cli_job, "_backend", lambda app: fake)
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SLURM_GPU_CONFIG", str(tmp_path / "config.toml"))
    return fake


def invoke(*args, env=None):
    return CliRunner().invoke(main, ["job", *args], env=env)


# ------------------------------------------------------------------ 1. sacct lines

def test_array_task_line_keeps_display_id_and_raw_id():
    rec = record()
    assert (rec.job_id_raw, rec.job_id, rec.user, rec.account, rec.partition) == (4725, "4711_3", "alice", "physics", "gpu")
    assert rec.gpus == 4 and rec.nodes == ["gpu01"] and rec.node_count == 1
    assert (rec.start, rec.end, rec.elapsed_s, rec.time_limit_s) == (START, END, 3600, 14400)
    assert rec.ended and not rec.pending


def test_pipe_inside_admin_comment_is_kept():
    rec = record(comment="JS1:abc|def|ghi")
    assert rec.admin_comment == "JS1:abc|def|ghi" and rec.exit_code == "0:0"


def test_running_job_has_unknown_end_and_is_not_ended():
    rec = record(state="RUNNING", end="Unknown", elapsed="42")
    assert rec.end is None and not rec.ended and rec.elapsed_s == 42


def test_standard_iso_times_parse_like_unix_seconds():
    rec = record(start="2026-05-01T10:00:00", end="2026-05-01T11:00:00")
    assert rec.end - rec.start == 3600


@pytest.mark.parametrize("tres,n", [("cpu=8,gres/gpu=2,node=1", 2), ("cpu=8,gres/gpu:a100=2,node=1", 2),
                                    ("billing=4,cpu=4,gres/gpu:a100=1,gres/gpu:v100=2", 3),
                                    ("cpu=8,mem=16G,node=1", 0), ("", 0)])
def test_gpu_count_from_alloc_tres_untyped_or_typed(tres, n):
    assert record(tres=tres).gpus == n


def test_cancelled_by_user_pending_job_never_ran_and_unlimited_limit():
    rec = record(state="CANCELLED by 1000", tres="", start="Unknown", end=str(END), elapsed="0", limit="UNLIMITED",
                 nodes="None assigned", nnodes="0")
    assert rec.base_state == "CANCELLED" and rec.ended and rec.nodes == [] and rec.nodelist == ""
    assert rec.time_limit_s is None and rec.start is None


@pytest.mark.parametrize("text", ["4711", "4711_3", "4711+1", " 4711 "])
def test_job_ids_accepted(text):
    assert jobacct.check_job_id(text) == text.strip()


@pytest.mark.parametrize("text", ["", "47x", "4711_", "4711_3+1", "-1", "4711.batch", "4711_[1-3]", "99999999999",
                                  "4711;rm"])
def test_job_ids_refused_with_one_line_and_a_hint(text):
    with pytest.raises(InputError) as e:
        jobacct.check_job_id(text)
    assert "not a Slurm job id" in e.value.message and "4711_3" in e.value.hint


def test_sacct_is_asked_for_the_allocation_line_with_admin_comment_last():
    fake = FakeSacct(sacct_line())
    jobacct.job_record(fake, "4711_3")
    tool, args = fake.calls[0]
    assert tool == "sacct" and args[:5] == ["-X", "-n", "-P", "-j", "4711_3"]
    assert args[5].startswith("--format=JobIDRaw,JobID,") and args[5].endswith(",AdminComment")


def test_plain_id_of_an_array_asks_for_one_task():
    out = sacct_line(raw="4711", jid="4711_9") + sacct_line(raw="4712", jid="4711_1") + sacct_line(raw="4713", jid="4711_2")
    with pytest.raises(InputError) as e:
        jobacct.job_record(FakeSacct(out), "4711")
    assert "array job of 3 parts" in e.value.message and "slurm-gpu job 4711_9" in e.value.hint


def test_het_component_is_picked_by_its_display_id():
    out = sacct_line(raw="4711", jid="4711+0") + sacct_line(raw="4712", jid="4711+1")
    assert jobacct.job_record(FakeSacct(out), "4711+1").job_id_raw == 4712
    with pytest.raises(InputError, match="heterogeneous job of 2 parts"):
        jobacct.job_record(FakeSacct(out), "4711")


@pytest.mark.parametrize("text, spelled", [("s0KRJ2ZB1C8100", "s0KRJ2ZB1C8100"), ("S0krj2zb1c81oo", "s0KRJ2ZB1C8100"),
                                            (" sEKNKTV3WPV5IL ", "sEKNKTV3WPV511")])
def test_sluids_accepted_in_slurms_own_spelling(text, spelled):
    assert jobacct.check_job_id(text) == spelled  # src/common/sluid.c: any case, O is 0, I and L are 1


@pytest.mark.parametrize("text", ["s0KRJ2ZB1C810", "s0KRJ2ZB1C81000", "s0KRJ2ZB1C81U0", "x0KRJ2ZB1C8100", "sEKNKTV3WPV50;"])
def test_sluids_of_another_shape_are_refused(text):
    with pytest.raises(InputError, match="not a Slurm job id"):
        jobacct.check_job_id(text)


def test_a_sluid_asks_sacct_for_the_sluid_field_and_gets_that_run():
    line = sacct_line(raw="4725", jid="4725", comment="").rsplit("|", 1)[0]
    fake = FakeSacct(line + "|s0KRJ2ZB1C8100|x|y\n")
    rec = jobacct.job_record(fake, "s0krj2zb1c8100")
    assert fake.calls[0][1][4] == "s0KRJ2ZB1C8100" and fake.calls[0][1][5].endswith(",SLUID,AdminComment")
    assert (rec.job_id_raw, rec.sluid, rec.admin_comment) == (4725, "s0KRJ2ZB1C8100", "x|y")
    # a plain id asks for no SLUID field: sacct before 26.05 knows none
    plain = FakeSacct(sacct_line())
    assert jobacct.job_record(plain, "4725").sluid == "" and "SLUID" not in plain.calls[0][1][5]


def test_a_sluid_where_sacct_knows_none_is_one_line_with_a_hint():
    for err in ('sacct: error: Invalid field requested: "SLUID"', "sacct: error: Invalid job id: s0KRJ2ZB1C8100",
                "sacct: fatal: Bad job/step specified: s0KRJ2ZB1C8100"):  # the last: 22.05, seen on this machine
        with pytest.raises(InputError) as e:
            jobacct.job_record(FakeSacct(rc=1, err=err), "s0KRJ2ZB1C8100")
        assert "takes no SLUID" in e.value.message and "numeric job id" in e.value.hint


def test_sacct_failure_is_a_slurm_error_and_invalid_id_is_not_found():
    with pytest.raises(SlurmError, match="sacct failed: sacct: error: Problem talking to the database"):
        jobacct.job_record(FakeSacct(rc=1, err="sacct: error: Problem talking to the database: Connection refused"), "1")
    assert jobacct.job_record(FakeSacct(rc=1, err="sacct: error: Invalid job id: 1"), "1") is None
    assert jobacct.job_record(FakeSacct(""), "1") is None


# ------------------------------------------------------------------ 2. notes at their thresholds

def test_idle_gpus_below_threshold_get_request_fewer_gpus_hint():
    s = summ(gpu(0, util=80), gpu(1, util=4.9), gpu(2, util=5.0), gpu(3, util=0.0))
    notes = {n.code: n.text for n in jobview.job_notes(record(), s, cfg())}
    assert "2 of the job's 4 GPUs were idle" in notes["idle"] and "gpu01 GPU 1, gpu01 GPU 3" in notes["idle"]
    assert "--gres=gpu:2." in notes["idle"]  # GPU 0 and GPU 2 (exactly at the threshold) were used


def test_idle_hint_is_per_node_on_multi_node_jobs():
    s = summ(gpu(0, node="a"), gpu(1, node="a", util=1), gpu(0, node="b"), gpu(1, node="b", util=1))
    text = [n.text for n in jobview.job_notes(record(nnodes="2", nodes="a,b"), s, cfg()) if n.code == "idle"][0]
    assert "--gres=gpu:1 (per node)" in text


def test_all_gpus_idle_says_none_was_used_and_no_low_util_or_memory_note():
    s = summ(gpu(0, util=0, peak_mib=0), gpu(1, util=1, peak_mib=10))
    notes = jobview.job_notes(record(), s, cfg())
    assert [n.code for n in notes] == ["idle"] and "None of the job's 2 GPUs was used" in notes[0].text


def test_no_idle_note_when_every_gpu_is_busy_or_not_measured():
    assert "idle" not in codes(record(), summ(gpu(0, util=50), gpu(1, util=None, mig=True)))


@pytest.mark.parametrize("util,noted", [(24.9, True), (25.0, False), (80.0, False)])
def test_low_utilisation_at_its_threshold(util, noted):
    assert ("low_util" in codes(record(), summ(gpu(0, util=util)))) is noted


def test_low_utilisation_threshold_comes_from_the_config():
    assert "low_util" in codes(record(), summ(gpu(0, util=50.0)), cfg(low_util_pct=60.0))


@pytest.mark.parametrize("peak_mib,noted", [(20479, True), (20480, False), (70000, False)])
def test_small_peak_memory_suggests_smaller_gpu_or_mig(peak_mib, noted):
    notes = {n.code: n.text for n in jobview.job_notes(record(), summ(gpu(0, peak_mib=peak_mib)), cfg())}
    assert ("small_memory" in notes) is noted
    if noted:
        assert "20.0 of 80.0 GiB" in notes["small_memory"] and "MIG slice" in notes["small_memory"]


def test_small_memory_not_said_of_mig_slices_or_when_switched_off():
    assert "small_memory" not in codes(record(), summ(gpu(0, peak_mib=100, mig=True)))
    assert "small_memory" not in codes(record(), summ(gpu(0, peak_mib=100)), cfg(small_memory_fraction=0.0))
    assert "small_memory" not in codes(record(), summ(gpu(0, peak_mib=100, total_mib=None)))


@pytest.mark.parametrize("elapsed,short", [("299", True), ("300", False)])
def test_short_job_is_not_judged(elapsed, short):
    got = codes(record(elapsed=elapsed), summ(gpu(0, util=1.0, peak_mib=10)))
    assert got == (["short"] if short else ["idle"])


def test_gpu_fault_that_ended_the_job_is_not_the_users_fault():
    s = summ(gpu(0, ecc=2), gpu(1, xids=[79]))
    text = [n.text for n in jobview.job_notes(record(state="FAILED"), s, cfg()) if n.code == "gpu_fault"][0]
    assert "gpu01 GPU 0: 2 uncorrectable ECC errors" in text and "gpu01 GPU 1: XID 79" in text
    assert "not your fault" in text
    done = [n.text for n in jobview.job_notes(record(), s, cfg()) if n.code == "gpu_fault"][0]
    assert "completed" in done


def test_application_xid_is_no_gpu_fault():
    assert "gpu_fault" not in codes(record(), summ(gpu(0, xids=[13, 31])))


def test_missing_node_records_say_partial_and_site_note_comes_last():
    notes = jobview.job_notes(record(), summ(gpu(0), missing=["gpu02"]), cfg(site_note="Help: https://hpc.example/gpu"))
    assert [n.code for n in notes] == ["partial", "site"]
    assert "gpu02" in notes[0].text and notes[1].text == "Help: https://hpc.example/gpu"


def test_site_note_must_be_one_line():
    with pytest.raises(config.ConfigError, match="job.site_note"):
        config.validate({"job": {"site_note": "a\nb"}}, "t.toml")
    with pytest.raises(config.ConfigError, match="job.idle_pct"):
        config.validate({"job": {"idle_pct": 101}}, "t.toml")


# ------------------------------------------------------------------ 3. figures, bars, JSON

@pytest.mark.parametrize("pct,text", [(34.5, "[#######.............]  34.5 %"), (0.0, "[....................]   0.0 %"),
                                      (100.0, "[####################] 100.0 %"), (130.0, "[####################] 130.0 %"),
                                      (None, "[                    ]     n/a")])
def test_bar(pct, text):
    assert jobview.bar(pct) == text


def test_bar_of_zero_width_is_the_number_only():
    assert jobview.bar(34.5, 0) == "34.5 %"


def test_energy_in_kwh_or_wh_and_memory_as_peak_of_total():
    assert jobview.energy_text(999.9) == "999.9 Wh" and jobview.energy_text(1234.0) == "1.23 kWh"
    assert jobview.memory_text(gpu(peak_mib=6144, total_mib=81920)) == "6.0 / 80.0 GiB"


def view_of(rec=None, s=None, c=None):
    rec = rec or record()
    s = s or summ(gpu(0), gpu(1, util=1.0, ecc=1, xids=[79]))
    return jobview.JobView(rec, s, "admin_comment", jobview.job_notes(rec, s, c or cfg()))


def test_text_has_header_one_line_per_gpu_and_notes():
    text = jobview.render_text(view_of(), cfg(), width=160)
    for label in ("Job ID:", "User:", "Account:", "Partition:", "State:", "Nodes:", "GPUs:", "Start:", "Run time:",
                  "Time limit:", "Exit code:"):
        assert label in text
    assert "4711_3 (raw id 4725)" in text and "01:00:00 (25 % of the time limit)" in text and "04:00:00" in text
    gpu_lines = [line for line in text.splitlines() if line.startswith("gpu01")]
    assert len(gpu_lines) == 2 and "40.0 / 80.0 GiB" in gpu_lines[0]
    assert "ECC 1 XID 79" in gpu_lines[1] and "[####" in gpu_lines[0]
    assert "Notes:" in text and "A GPU fault happened during the job" in text.replace("\n    ", " ")
    assert "\x1b[" not in text


@pytest.mark.parametrize("width,util_bar,mem_bar", [(160, 20, 20), (100, 12, 12), (80, 7, None), (40, None, None)])
def test_width_adapts_memory_bar_goes_first_then_the_utilisation_bar(width, util_bar, mem_bar):
    text = jobview.render_text(view_of(), cfg(), width=width)
    if width >= 80:
        assert all(len(line) <= width for line in text.splitlines())
    line = [ln for ln in text.splitlines() if ln.startswith("gpu01")][0]
    bars = [len(b) for b in re.findall(r"\[([#. ]+)\]", line)]
    assert bars == [b for b in (util_bar, mem_bar) if b is not None]


def test_model_column_only_when_models_differ():
    same = jobview.render_text(view_of(), cfg(), width=160)
    assert "GPUs:       4 (H100 80GB HBM3)" in same and "MODEL" not in same
    mixed = view_of(s=summ(gpu(0), gpu(1, model="NVIDIA A100-SXM4-40GB")))
    text = jobview.render_text(mixed, cfg(), width=160)
    assert "MODEL" in text and "A100-SXM4-40GB" in text and "GPUs:       4\n" in text


def test_colour_only_when_asked():
    text = jobview.render_text(view_of(), cfg(), width=160, color=True)
    assert "\x1b[1;31m" in text and "\x1b[0m" in text


def test_json_has_header_gpus_and_notes_as_code_and_text():
    doc = jobview.to_json(view_of())
    assert set(doc) == {"job", "summary", "gpus", "notes"}
    assert doc["job"]["job_id"] == "4711_3" and doc["job"]["job_id_raw"] == 4725 and doc["job"]["run_time_s"] == 3600
    assert doc["job"]["time_limit_s"] == 14400 and doc["job"]["gpus"] == 4
    assert doc["summary"]["source"] == "admin_comment" and doc["summary"]["energy_wh"] == 1000.0
    assert doc["gpus"][0]["util_pct"] == 80.0 and doc["gpus"][0]["peak_mib"] == 40960
    assert doc["notes"][0] == {"code": "gpu_fault", "text": doc["notes"][0]["text"]}
    json.dumps(doc)


# ------------------------------------------------------------------ 4. every case through the CLI

def ours(s=None):
    return sg.encode(s or summ(gpu(0), gpu(1, util=1.0)))


def test_finished_job_shows_table_exit_0(sacct):
    sacct.out = sacct_line(comment=ours())
    r = invoke("4711_3", env={"COLUMNS": "140"})
    assert r.exit_code == 0, r.output
    assert "Job ID:" in r.stdout and "--gres=gpu:1" in r.stdout and r.stderr == ""
    assert "\x1b[" not in r.stdout  # CliRunner's stdout is no terminal


def test_upper_case_summary_reads_the_same(sacct):
    sacct.out = sacct_line(comment=ours().upper())
    assert invoke("4711_3").exit_code == 0


def test_format_json_and_json_flag(sacct):
    sacct.out = sacct_line(comment=ours())
    a, b = invoke("4711_3", "--format", "json"), invoke("4711_3", "--json")
    assert a.exit_code == b.exit_code == 0 and json.loads(a.stdout) == json.loads(b.stdout)
    assert [n["code"] for n in json.loads(a.stdout)["notes"]] == ["idle"]


def test_no_color_flag_and_no_tty_mean_no_colour(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    assert cli_job._color(False) is True and cli_job._color(True) is False
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)
    assert cli_job._color(False) is False


def plain_answer(r, code, text):
    assert r.exit_code == code, r.output
    assert r.stdout == "" and r.stderr.startswith(text) and "error:" not in r.stderr


def error_answer(r, code, text):
    assert r.exit_code == code, r.output
    assert r.stdout == "" and r.stderr.startswith(f"slurm-gpu: error: {text}") and "\nhint: " in r.stderr


def test_unknown_or_hidden_job_exit_7(sacct):
    sacct.out = ""  # PrivateData=jobs: sacct shows another user's job as nothing at all
    error_answer(invoke("4711"), ExitCode.JOB_NOT_FOUND, "job 4711 not found, or not visible to you")


def test_job_without_gpus_exit_8(sacct):
    sacct.out = sacct_line(tres="cpu=8,mem=16G,node=1")
    plain_answer(invoke("4711_3"), ExitCode.JOB_WITHOUT_GPUS, "job 4711_3 ran without GPUs")


def test_job_cancelled_before_it_started_exit_8(sacct):
    sacct.out = sacct_line(state="CANCELLED by 1000", tres="", start="Unknown", nodes="None assigned", elapsed="0")
    plain_answer(invoke("4711_3"), ExitCode.JOB_WITHOUT_GPUS, "job 4711_3 never ran")


@pytest.mark.parametrize("state,tres,text", [("RUNNING", "cpu=1,gres/gpu=1", "job 4711_3 is still RUNNING"),
                                             ("PENDING", "", "job 4711_3 is still pending")])
def test_running_or_pending_job_exit_9(sacct, state, tres, text):
    sacct.out = sacct_line(state=state, tres=tres, end="Unknown")
    plain_answer(invoke("4711_3"), ExitCode.JOB_NOT_ENDED, text)


def test_ended_job_without_summary_exit_10_with_annotate_hint(sacct):
    sacct.out = sacct_line(comment="")
    r = invoke("4711_3")
    plain_answer(r, ExitCode.JOB_NO_SUMMARY, "job 4711_3 ended but has no GPU summary (yet)")
    assert "slurm-gpu central annotate" in r.stderr


def test_damaged_summary_is_an_error_exit_10(sacct):
    sacct.out = sacct_line(comment="sg1:notbase32!!")
    error_answer(invoke("4711_3"), ExitCode.JOB_NO_SUMMARY, "job 4711_3: the job's GPU summary is damaged")


def test_summary_of_another_job_is_not_shown_as_this_ones(sacct):
    sacct.out = sacct_line(comment=sg.encode(summ(gpu(0), job_id=1234)))
    error_answer(invoke("4711_3"), ExitCode.JOB_NO_SUMMARY, "job 4711_3: the AdminComment holds the GPU summary of job 1234")


def test_admin_comment_of_another_tool_exit_11(sacct):
    sacct.out = sacct_line(comment="JS1:H4sIAAAAAAAAA6tWKkktLlGyUlAqS8wpTtVRSs7PS8tMBwBbqDzRGAAAAA==")
    error_answer(invoke("4711_3"), ExitCode.JOB_FOREIGN_COMMENT, "job 4711_3: its AdminComment was written by another tool")


def test_bad_job_id_exit_2_without_asking_slurm(sacct):
    error_answer(invoke("4711.batch"), ExitCode.USAGE, "'4711.batch' is not a Slurm job id")
    assert sacct.calls == []


def test_sacct_failure_exit_4(sacct):
    sacct.rc, sacct.err = 1, "sacct: error: Problem talking to the database: Connection refused"
    error_answer(invoke("4711"), ExitCode.SLURM_ERROR, "sacct failed")


# ------------------------------------------------------------------ 5. the admin's fallback to the records

def job_end(job_id=4725, node="gpu01", start=START, end=END, restart=0, utils=(80.0, 2.0)):
    job = {"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "user": "alice", "uid": 1000,
           "account": "physics", "partition": "gpu", "gpu_count": len(utils), "start_time": start, "end_time": end,
           "exit_code": "0"}
    rows = [{"cluster": "c", "job_id": job_id, "restart_count": restart, "node": node, "gpu_uuid": f"GPU-{node}-{i}",
             "gpu_index": i, "gpu_model": "NVIDIA A100-SXM4-40GB", "start_time": start, "end_time": end,
             "duration_s": end - start, "energy_j": 3.6e6, "gpu_util_mean_pct": u, "mem_util_mean_pct": u / 2,
             "max_memory_bytes": 4 * GIB, "memory_total_bytes": 40 * GIB, "ecc_uncorrected_delta": 0,
             "xid_events": "[]"} for i, u in enumerate(utils)]
    return {"kind": "job_end", "job": job, "gpus": rows}


@pytest.fixture
def node_db(tmp_path):
    st = Store(str(tmp_path / "usage.db"), str(tmp_path / "spool"))
    assert st.write(job_end()) == "db"
    # the id, reused
    assert st.write(job_end(node="gpu09", start=START - 86400 * 30, end=END - 86400 * 30, utils=(99.0,))) == "db"
    st.close()
    return st.path


def test_node_database_builds_the_summary_when_admin_comment_has_none(sacct, node_db):
    sacct.out = sacct_line(comment="", tres="cpu=8,gres/gpu=2")
    r = invoke("4711_3", "--db", node_db, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["summary"]["source"] == "node_database"
    assert [(g["index"], g["util_pct"], g["peak_mib"], g["total_mib"]) for g in doc["gpus"]] == \
        [(0, 80.0, 4096, 40960), (1, 2.0, 4096, 40960)]  # the run a month before is another job
    assert {n["code"] for n in doc["notes"]} >= {"idle", "small_memory"}
    assert doc["gpus"][0]["energy_wh"] == 1000.0


def test_node_database_fallback_also_replaces_a_foreign_comment(sacct, node_db):
    sacct.out = sacct_line(comment="JS1:something", tres="cpu=8,gres/gpu=2")
    r = invoke("4711_3", "--db", node_db, env={"COLUMNS": "140"})
    assert r.exit_code == 0, r.output
    assert "Source:" in r.stdout and "node database records" in r.stdout


def test_node_database_without_the_job_exit_10(sacct, node_db):
    sacct.out = sacct_line(raw="999", jid="999", comment="")
    r = invoke("999", "--db", node_db)
    plain_answer(r, ExitCode.JOB_NO_SUMMARY, f"job 999 ended but has no GPU summary, and node database {node_db}")


def test_missing_node_database_is_a_store_error(sacct, tmp_path):
    sacct.out = sacct_line(comment="")
    error_answer(invoke("4711_3", "--db", str(tmp_path / "nope.db")), ExitCode.STORE_ERROR, "database")


def test_records_of_other_clusters_and_latest_restart():
    rec = record()
    rows = [{"cluster": "c", "restart_count": 0, "node": "gpu01", "gpu_index": 0, "start_time": START - 100},
            {"cluster": "c", "restart_count": 1, "node": "gpu01", "gpu_index": 0, "start_time": START + 10,
             "gpu_util_mean_pct": 50.0},
            {"cluster": "other", "restart_count": 0, "node": "x", "gpu_index": 0, "start_time": START}]
    got = jobview.of_this_run(rec, rows, cluster="c")
    assert len(got) == 2
    s, source = jobview.resolve(rec, lambda r: (got, "central", "the central server"))
    assert source == "central" and s.restart == 1 and [g.util_pct for g in s.gpus] == [50.0]


def test_a_run_asked_for_by_its_sluid_gets_its_own_rows_not_its_requeues():
    line = sacct_line(raw="4725", jid="4725").rsplit("|", 1)
    rec = jobacct.parse_line(line[0] + "|s0KRJ2ZB1C8100|" + line[1], jobacct.fields_for("s0KRJ2ZB1C8100"))
    first = {"cluster": "c", "restart_count": 0, "node": "gpu01", "gpu_index": 0, "start_time": START,
             "gpu_util_mean_pct": 10.0, "sluid": "s0KRJ2ZB1C8100"}
    requeued = dict(first, restart_count=1, gpu_util_mean_pct=90.0, sluid="s0KRJ2ZB1C8200")
    got = jobview.of_this_run(rec, [first, requeued], cluster="c")
    assert got == [first]
    s, _ = jobview.resolve(rec, lambda r: (got, "central", "the central server"))
    assert s.restart == 0 and [g.util_pct for g in s.gpus] == [10.0]
    # Rows of a node before it knew SLUIDs still count by their time; another SLUID's never.
    old = dict(first, sluid=None)
    assert jobview.of_this_run(rec, [old, requeued], cluster="c") == [old]


def test_central_fallback_queries_job_gpus_current_with_parameters(monkeypatch):
    from slurm_gpu.central import server as store_central

    seen = {}

    class FakeCentral:
        target = type("T", (), {"describe": lambda self: "db@host/slurm_gpu"})()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def execute(self, sql, params=()):
            seen["sql"], seen["params"] = sql, params
            return [("c", 4725, 0, "gpu01", 0, "A100", START, END, 70.0, 30.0, GIB, 40 * GIB, 3.6e6, 0, "[]", None, None)]

    monkeypatch.setattr(store_central.Central, "from_config", classmethod(lambda cls, cfg, url, pw: FakeCentral()))
    fb = jobview.fallback_for(cfg(), "central")
    rows, source, where = fb(record())
    assert 'FROM job_gpus_current WHERE "job_id" = %s' in seen["sql"] and seen["params"] == (4725,)
    assert source == "central" and "db@host" in where and rows[0]["memory_total_bytes"] == 40 * GIB


def test_help_names_the_exit_codes_and_formats():
    out = CliRunner().invoke(main, ["job", "--help"]).output
    assert "--format" in out and "--json" in out and "--no-color" in out and "--db" in out


@pytest.mark.parametrize("row", [[0, 0, 0, 1, 2, "80", 10.0, 100, 1000, 1.5, 0, [], 0],
                                 [-1, 0, 0, 1, 2, 80.0, 10.0, 100, 1000, 1.5, 0, [], 0]])
def test_summary_with_wrong_types_or_a_negative_node_index_is_damaged_exit_10(sacct, row):
    import base64
    import json
    import zlib
    doc = {"v": 1, "c": "c", "j": 4725, "r": 0, "p": 0, "n": ["gpu01", "gpu02"], "m": [], "k": ["m"], "g": [row]}
    text = "sg1:" + base64.b32encode(zlib.compress(json.dumps(doc).encode())).decode().rstrip("=").lower()
    sacct.out = sacct_line(comment=text)
    r = invoke("4711_3")
    error_answer(r, ExitCode.JOB_NO_SUMMARY, "job 4711_3: the job's GPU summary is damaged")
    assert "Traceback" not in r.stderr and "gpu02" not in r.stdout


# ------------------------------------------------------------------ a running job: its figures so far (issue 38)

def _live_summary(job_id=4725, idle=(0, 900), points=None):
    gpus = [sg.GpuUse(node="gpu01", index=i, model=None, start=START, end=START + 1800, util_pct=u, mem_util_pct=None,
                      peak_mib=pk, total_mib=81559, energy_wh=e, ecc_uncorrected=None, xids=[], mig=False)
            for i, u, pk, e in ((0, 72.5, 30000, 250.0), (1, 0.0, 500, 40.0))]
    pts = points or [[80] * 60, [None] * 30 + [0] * 30]
    return sg.Summary("c", job_id, 0, True, ["gpu01"], [], gpus, "gpu",
                      {"t": START + 1800.0, "g": [[idle[0], pts[0]], [idle[1], pts[1]]]})


class FakeSlurm:
    """sacct shows the running job; scontrol shows it with its AdminComment (as slurmctld shows it to the caller)."""

    def __init__(self, comment):
        self.comment, self.calls = comment, []

    def run(self, tool, args, timeout_s=None):
        self.calls.append((tool, list(args)))
        if tool == "sacct":
            return 0, sacct_line(state="RUNNING", end="Unknown", tres="cpu=2,gres/gpu=2,node=1"), ""
        return 0, f"JobId=4725 JobName=train UserId=alice(1000) JobState=RUNNING AdminComment={self.comment} NumNodes=1\n", ""


def test_a_running_job_shows_its_figures_so_far_with_the_last_hour_and_what_is_idle_now(monkeypatch, tmp_path):
    fake = FakeSlurm(sg.encode(_live_summary()))
    monkeypatch.setattr(cli_job, "_backend", lambda app: fake)
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SLURM_GPU_CONFIG", str(tmp_path / "config.toml"))
    r = invoke("4711_3")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "GPUs (so far: means since the job started):" in out and "LAST HOUR" in out and "IDLE FOR" in out
    assert "MODEL" not in out  # a running job's samples do not name the model
    line0 = next(ln for ln in out.splitlines() if ln.startswith("gpu01") and ln.split()[1] == "0")
    line1 = next(ln for ln in out.splitlines() if ln.startswith("gpu01") and ln.split()[1] == "1")
    assert "busy" in line0 and "▇" * 30 in line0  # 80 %
    assert "00:15:00" in line1 and line1.endswith("·" * 15 + "▁" * 15)  # half the hour unseen, half at 0 %
    assert "The job is still running: figures so far" in out and "Idle right now" in out and "scancel 4711_3" in out
    assert ("scontrol", ["-o", "show", "job", "4725"]) in fake.calls
    j = json.loads(invoke("4711_3", "--json").output)
    assert j["summary"]["source"] == "live" and j["live"]["gpus"][1]["idle_s"] == 900
    assert j["live"]["gpus"][0]["last_hour_util_pct"] == [80] * 60


def test_a_running_job_without_figures_so_far_or_with_another_jobs_is_still_exit_9(monkeypatch, tmp_path):
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SLURM_GPU_CONFIG", str(tmp_path / "config.toml"))
    for comment in ("", "jobstats:abc", sg.encode(_live_summary(job_id=9999)), sg.encode(_live_summary()._replace(live=None))):
        fake = FakeSlurm(comment)
        monkeypatch.setattr(cli_job, "_backend", lambda app, fake=fake: fake)
        plain_answer(invoke("4711_3"), ExitCode.JOB_NOT_ENDED, "job 4711_3 is still RUNNING")


def test_a_damaged_live_part_is_refused_not_shown():
    doc = sg.encode(_live_summary())
    s = _live_summary()
    bad = s._replace(live={"t": START, "g": [[0, [1, 2]]]})  # one row for two GPUs
    with pytest.raises(InputError):
        sg.decode(sg.encode(bad))
    assert sg.decode(doc).live["g"][1][0] == 900
