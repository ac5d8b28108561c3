"""Prometheus metrics: the textfile writer, what the hooks write, dcgm-exporter's job mapping,
the exporter, and the reference in docs/prometheus.md (slurm_gpu/metrics/, docs/prometheus.md).

Every file written here is read back by prometheus_client's parser and by Debian's
`promtool check metrics`.  The hooks run in-process on simulated GPUs, as in test_hooks.py.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import simgpu
from test_hooks import deps_for, job_env, rows

from slurm_gpu import config
from slurm_gpu.gpu.snapshot import MigDevice
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.hooks.healthcheck import node_health_cycle
from slurm_gpu.metrics import catalog
from slurm_gpu.metrics import jobs as J
from slurm_gpu.metrics import textfile as T
from slurm_gpu.metrics import usage as U
from slurm_gpu.metrics.serve import collect, make_server, parse_listen
from slurm_gpu.slurm.gpumap import JobGpu
from slurm_gpu.slurm.jobenv import from_env

ROOT = Path(__file__).resolve().parents[1]
NODE = catalog.NODE_FILE
CAMEL_CASE_LINT = re.compile(r"^\S+ label names should be written in 'snake_case' not 'camelCase'$")


# ------------------------------------------------------------------ helpers


def promtool_check(text: str) -> None:
    """`promtool check metrics` accepts text: it parses (exit 0, or 3 for lint findings) and
    the only finding is camelCase label names (UUID, modelName, GPU_I_ID: dcgm-exporter's names)."""
    exe = shutil.which("promtool")
    if exe is None:
        from testbed import unavailable
        unavailable("promtool not found (Debian package prometheus)")
    cp = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    findings = [line for line in (cp.stdout + cp.stderr).splitlines() if line.strip()]
    assert cp.returncode in (0, 3), (cp.returncode, findings[:5])
    assert all(CAMEL_CASE_LINT.match(line) for line in findings), [f for f in findings if not CAMEL_CASE_LINT.match(f)][:5]


def client_parse(text: str) -> dict:
    """{sample name: {frozenset(labels): value}} through prometheus_client's parser; a family's
    HELP/TYPE appear once and no series twice."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = frozenset(s.labels.items())
            assert key not in out.setdefault(s.name, {}), f"duplicate series {s.name}{s.labels}"
            out[s.name][key] = s.value
    for kind in ("HELP", "TYPE"):
        names = re.findall(rf"^# {kind} (\S+)", text, re.M)
        assert len(names) == len(set(names)), f"# {kind} twice: {names}"
    return out


def check_dir(directory: Path) -> None:
    """Every *.prom file we wrote is valid for promtool and prometheus_client, mode 0644, and no
    temporary file is left behind."""
    for p in directory.iterdir():
        assert not p.name.endswith(".tmp"), p
        if p.suffix == ".prom":
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
            text = p.read_text()
            client_parse(text)
            promtool_check(text)


def value(text: str, name: str, **labels: str):
    """The value of the one series of name whose labels include these; None when absent."""
    hits = [v for k, v in T.parse(text).get(name, {}).items() if all(dict(k).get(a) == b for a, b in labels.items())]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def metrics_node(sim_node, profile=None, mapping=True, extra=""):
    node = sim_node(profile or simgpu.h100_sxm(4))
    tf, mp = node.tmp / "textfile", node.tmp / "dcgm"
    body = f'[metrics]\ntextfile_dir = "{tf}"\n' + (f'dcgm_job_mapping_dir = "{mp}"\n' if mapping else "")
    node.write_config(extra=body + extra)
    return node, tf, mp


def uuid_of(node, i):
    return simgpu.read_state(node.state)[f"gpu.{i}.uuid"]


# ------------------------------------------------------------------ 1. the writer


def test_label_values_are_escaped_and_read_back_by_prometheus_client_and_promtool(tmp_path):
    nasty = 'back\\slash "quoted"\nnew line, comma'
    samples = {"slurm_gpu_job_info": {(("gpu", "0"), ("UUID", "GPU-x"), ("modelName", "M"), ("GPU_I_ID", ""),
                                       ("job", "1"), ("user", nasty), ("account", "a"), ("partition", "p")): 1.0}}
    text = T.render(samples)
    assert 'user="back\\\\slash \\"quoted\\"\\nnew line, comma"' in text
    assert T.parse(text) == samples  # our own reader gives back what we wrote
    got = client_parse(text)
    (labels,) = got["slurm_gpu_job_info"]
    assert dict(labels)["user"] == nasty
    promtool_check(text)


def test_help_and_type_once_per_family_no_timestamps_catalog_order(tmp_path):
    gpu = (("gpu", "0"), ("UUID", "GPU-a"), ("modelName", "M"))
    text = T.render({"slurm_gpu_persistence_mode": {gpu: 1.0, (("gpu", "10"), ("UUID", "b"), ("modelName", "M")): 0},
                     "slurm_gpu_check_timestamp_seconds": {(("source", "prolog"),): 1700000000.25},
                     "slurm_gpu_spool_records": {(): 3}})
    lines = text.splitlines()
    assert lines[0] == "# HELP slurm_gpu_check_timestamp_seconds " + catalog.BY_NAME["slurm_gpu_check_timestamp_seconds"].help
    assert lines[1] == "# TYPE slurm_gpu_check_timestamp_seconds gauge"
    assert 'slurm_gpu_check_timestamp_seconds{source="prolog"} 1700000000.25' in lines
    assert "slurm_gpu_spool_records 3" in lines
    # GPU 10 after GPU 0, and every sample line is "name{labels} value": no timestamp.
    persistence = [line for line in lines if line.startswith("slurm_gpu_persistence_mode")]
    assert persistence[1].startswith('slurm_gpu_persistence_mode{gpu="10"')
    assert all(len(re.sub(r"\{.*\}", "", line).split()) == 2 for line in lines if not line.startswith("#"))
    client_parse(text)
    promtool_check(text)


def test_atomic_replace_leaves_no_temporary_file_and_mode_0644(tmp_path):
    old = os.umask(0o077)
    try:
        T.write_atomic(str(tmp_path), "a.prom", "x 1\n")
        first = (tmp_path / "a.prom").stat().st_ino
        T.write_atomic(str(tmp_path), "a.prom", "x 2\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.prom").read_text() == "x 2\n"
    assert (tmp_path / "a.prom").stat().st_ino != first  # replaced by rename, never rewritten in place
    assert stat.S_IMODE((tmp_path / "a.prom").stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["a.prom"]


GPU0 = (("gpu", "0"), ("UUID", "GPU-a"), ("modelName", "M"))


def _merge_add(directory, value):
    T.merge(str(directory), "slurm_gpu_node.prom",
            lambda old: {**old, "slurm_gpu_persistence_mode": {GPU0: value}, "slurm_gpu_spool_records": {(): value}})


def test_merge_reads_its_sidecar_and_gives_what_parsing_the_file_gives(tmp_path, monkeypatch):
    T.merge(str(tmp_path), "slurm_gpu_node.prom", lambda old: {"slurm_gpu_persistence_mode": {GPU0: 1.0}})
    parsed = []
    monkeypatch.setattr(T, "parse", lambda *a, **k: parsed.append(1) or {})
    _merge_add(tmp_path, 0.0)  # the old samples come from the sidecar: parse() is not called
    assert parsed == []
    monkeypatch.undo()
    text = (tmp_path / "slurm_gpu_node.prom").read_text()
    assert T.parse(text) == {"slurm_gpu_persistence_mode": {GPU0: 0.0}, "slurm_gpu_spool_records": {(): 0.0}}
    sidecar = tmp_path / ".slurm_gpu_node.prom.state"
    assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [".slurm-gpu.lock", ".slurm_gpu_node.prom.state", "slurm_gpu_node.prom"]


def test_merge_parses_the_file_when_it_changed_behind_the_sidecar_or_the_sidecar_is_not_trustworthy(tmp_path):
    d, prom = str(tmp_path), tmp_path / "slurm_gpu_node.prom"
    sidecar = tmp_path / ".slurm_gpu_node.prom.state"
    # An admin edited the file by hand (a new series): the sidecar describes the old file.
    T.merge(d, prom.name, lambda old: {"slurm_gpu_persistence_mode": {GPU0: 1.0}})
    prom.write_text(prom.read_text() + 'slurm_gpu_unpushed_records 7\n')
    T.merge(d, prom.name, lambda old: old)
    assert T.parse(prom.read_text())["slurm_gpu_unpushed_records"] == {(): 7.0}
    # A corrupt sidecar, then one writable by others, then one that is a symlink: each ignored.
    for spoil in ("corrupt", "mode", "symlink"):
        T.merge(d, prom.name, lambda old: {**old, "slurm_gpu_spool_records": {(): 1.0}})
        if spoil == "corrupt":
            sidecar.write_bytes(b"\xff\x00garbage")
        elif spoil == "mode":
            import marshal
            _v, ident, samples, raw = marshal.loads(sidecar.read_bytes())
            sidecar.write_bytes(marshal.dumps((_v, ident, {"slurm_gpu_spool_records": {(): 99.0}}, raw)))
            sidecar.chmod(0o666)
        else:
            forged = tmp_path / "forged"
            forged.write_bytes(sidecar.read_bytes())
            sidecar.unlink()
            sidecar.symlink_to(forged)
        T.merge(d, prom.name, lambda old: old)
        got = T.parse(prom.read_text())
        assert got["slurm_gpu_spool_records"] == {(): 1.0}, spoil  # from the text, not the sidecar
        assert got["slurm_gpu_unpushed_records"] == {(): 7.0}, spoil
        assert not sidecar.is_symlink() and stat.S_IMODE(sidecar.stat().st_mode) == 0o600, spoil  # replaced


def test_every_catalog_family_is_named_and_documented_like_prometheus_wants():
    for f in catalog.FAMILIES:
        assert f.name.startswith("slurm_gpu_") and re.fullmatch(r"[a-z_]+", f.name)
        assert f.name.endswith("_total") == (f.type == "counter"), f.name
        assert f.help and "\n" not in f.help
    assert len({f.name for f in catalog.FAMILIES}) == len(catalog.FAMILIES)


def test_docs_prometheus_reference_equals_the_generated_one():
    text = (ROOT / "docs" / "prometheus.md").read_text()
    assert catalog.reference_markdown() in text, "regenerate docs/prometheus.md: python3 -c 'from slurm_gpu.metrics " \
                                                 "import catalog; print(catalog.reference_markdown())'"
    assert "monitoring/README.md" in text and "--hpc-job-mapping-dir" in text and "--collector.textfile.directory" in text
    assert "DCGM_FI_DEV_GPU_UTIL * on(UUID) group_left(slurm_job, user, account) slurm_gpu_job_info" in text


# ------------------------------------------------------------------ 2. prolog, epilog on simulated GPUs


def test_prolog_writes_gpu_state_check_status_and_job_info_of_the_jobs_gpus(sim_node):
    node, tf, mp = metrics_node(sim_node)
    assert hooks.prolog(from_env(job_env(gpus="0,2")), deps_for(node)) == 0
    text = (tf / NODE).read_text()
    u0, u2 = uuid_of(node, 0), uuid_of(node, 2)
    assert value(text, "slurm_gpu_check_status", UUID=u0, check="ecc_uncorrectable", status="PASS") == 1
    assert value(text, "slurm_gpu_check_status", UUID=u0, check="ecc_uncorrectable", status="FAIL") == 0
    assert value(text, "slurm_gpu_check_status", gpu="", check="gpu_count", status="SKIP") == 1
    assert value(text, "slurm_gpu_ecc_errors_total", gpu="2", UUID=u2, modelName="NVIDIA H100 80GB HBM3",
                 type="uncorrected", counter="volatile") == 0
    assert value(text, "slurm_gpu_persistence_mode", UUID=u0) == 1
    assert value(text, "slurm_gpu_clock_event_reason", UUID=u0, reason="gpu_idle") == 1
    assert value(text, "slurm_gpu_clock_event_reason", UUID=u0, reason="hw_slowdown") == 0
    assert value(text, "slurm_gpu_check_status", gpu="1", check="responsive", status="PASS") is None  # not the job's
    assert value(text, "slurm_gpu_node_drained", reason="") == 0
    assert value(text, "slurm_gpu_last_run_timestamp_seconds", hook="prolog") == pytest.approx(time.time(), abs=30)
    assert value(text, "slurm_gpu_check_timestamp_seconds", source="prolog") == pytest.approx(time.time(), abs=30)
    info = (tf / "slurm_gpu_job_4711.prom").read_text()
    assert value(info, "slurm_gpu_job_info", gpu="0", UUID=u0, GPU_I_ID="", slurm_job="4711", user="alice",
                 account="physics", partition="gpu") == 1
    assert len(T.parse(info)["slurm_gpu_job_info"]) == 2
    check_dir(tf)


def test_prolog_on_injected_uncorrectable_ecc_says_fail_counts_it_and_shows_the_drain(sim_node):
    node, tf, mp = metrics_node(sim_node)
    simgpu.set_gpu(node.state, 1, ecc_volatile_uncorrected=2, ecc_aggregate_uncorrected=5)
    deps = deps_for(node)
    assert hooks.prolog(from_env(job_env(gpus="0,1")), deps) == 1  # the verdict is the hook's, metrics or not
    text = (tf / NODE).read_text()
    u1 = uuid_of(node, 1)
    assert value(text, "slurm_gpu_check_status", UUID=u1, check="ecc_uncorrectable", status="FAIL") == 1
    assert value(text, "slurm_gpu_check_status", UUID=u1, check="ecc_uncorrectable", status="PASS") == 0
    assert value(text, "slurm_gpu_ecc_errors_total", UUID=u1, type="uncorrected", counter="volatile") == 2
    assert value(text, "slurm_gpu_ecc_errors_total", UUID=u1, type="uncorrected", counter="aggregate") == 5
    assert T.parse(text)["slurm_gpu_node_drained"] == {(("reason", "ecc_uncorrectable"),): 1.0}
    assert not (tf / "slurm_gpu_job_4711.prom").exists()  # the job does not start here
    assert not mp.exists() or not any(mp.glob("[0-9]*"))
    check_dir(tf)


def test_a_later_writer_keeps_what_an_earlier_one_wrote_about_other_gpus(sim_node):
    node, tf, _ = metrics_node(sim_node)
    assert hooks.prolog(from_env(job_env(job_id=1, gpus="0")), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 0, ecc_volatile_corrected=7)  # GPU 0 changes, but job 2 does not look at it
    assert hooks.prolog(from_env(job_env(job_id=2, gpus="3")), deps_for(node)) == 0
    text = (tf / NODE).read_text()
    for i in (0, 3):
        assert value(text, "slurm_gpu_check_status", UUID=uuid_of(node, i), check="responsive", status="PASS") == 1
    assert value(text, "slurm_gpu_ecc_errors_total", UUID=uuid_of(node, 0), type="corrected", counter="volatile") == 0
    assert {p.name for p in tf.glob("slurm_gpu_job_*.prom")} == {"slurm_gpu_job_1.prom", "slurm_gpu_job_2.prom"}
    # The epilog of job 1 reads GPU 0 again: its value is the new one, GPU 3's stays.
    assert hooks.epilog(from_env(job_env(job_id=1, gpus="0")), deps_for(node)) == 0
    text = (tf / NODE).read_text()
    assert value(text, "slurm_gpu_ecc_errors_total", UUID=uuid_of(node, 0), type="corrected", counter="volatile") == 7
    assert value(text, "slurm_gpu_persistence_mode", UUID=uuid_of(node, 3)) == 1
    assert {p.name for p in tf.glob("slurm_gpu_job_*.prom")} == {"slurm_gpu_job_2.prom"}
    check_dir(tf)


def test_job_info_appears_with_the_prolog_and_vanishes_with_the_epilog(sim_node):
    node, tf, _ = metrics_node(sim_node)
    env = job_env(gpus="1,2")
    assert hooks.prolog(from_env(env), deps_for(node)) == 0
    assert (tf / "slurm_gpu_job_4711.prom").exists()
    assert hooks.epilog(from_env(dict(env, SLURM_JOB_EXIT_CODE="0")), deps_for(node)) == 0
    assert not (tf / "slurm_gpu_job_4711.prom").exists()
    text = (tf / NODE).read_text()
    assert value(text, "slurm_gpu_last_run_timestamp_seconds", hook="epilog") is not None
    assert value(text, "slurm_gpu_check_timestamp_seconds", source="epilog") is not None
    check_dir(tf)


def test_usage_counters_equal_the_node_database_sums(sim_node):
    node, tf, _ = metrics_node(sim_node)
    t0 = 1_800_000_000.0
    clock = {"t": t0}
    for job_id, account, gpus, util in ((11, "physics", "0,1", 50), (12, "chem", "2", 80), (13, "physics", "3", 10)):
        env = job_env(job_id=job_id, gpus=gpus, SLURM_JOB_ACCOUNT=account)
        clock["t"] = t0
        assert hooks.prolog(from_env(env), deps_for(node, now=lambda: clock["t"])) == 0
        for i in map(int, gpus.split(",")):
            simgpu.set_gpu(node.state, i, energy_mj=1_000_000_000 + i * 1_000_003 + 9_000_000 * job_id,
                           acct=[dict(pid=100 + i, gpu_util=util, mem_util=5, max_mem_bytes=1 << 30, time_ms=100_000,
                                      start_time_us=int((t0 + 1) * 1e6), is_running=0)])
        clock["t"] = t0 + 100 * job_id
        assert hooks.epilog(from_env(env), deps_for(node, now=lambda: clock["t"])) == 0
    text = (tf / catalog.USAGE_FILE).read_text()
    sums = rows(node.db, "SELECT account, SUM(duration_s) AS alloc, SUM(duration_s * gpu_util_mean_pct / 100) AS used, "
                         "SUM(energy_j) AS energy FROM job_gpus GROUP BY account")
    assert {r["account"] for r in sums} == {"physics", "chem"}
    for r in sums:
        assert value(text, "slurm_gpu_allocated_seconds_total", account=r["account"]) == pytest.approx(r["alloc"], abs=0.01)
        assert value(text, "slurm_gpu_used_seconds_total", account=r["account"]) == pytest.approx(r["used"], abs=0.01)
        assert value(text, "slurm_gpu_energy_joules_total", account=r["account"]) == pytest.approx(r["energy"], abs=0.01)
    assert value(text, "slurm_gpu_used_seconds_total", account="chem") > 0
    check_dir(tf)


def test_usage_accounts_are_bounded_sticky_and_never_go_down():
    sums = {"a": (100.0, 50.0, 10.0), "b": (300.0, 0.0, 0.0), "c": (200.0, 20.0, 1.0)}
    first = U.usage_samples(sums, {}, by_account=True, max_accounts=2)
    alloc = {dict(k)["account"]: v for k, v in first[U.ALLOCATED].items()}
    assert alloc == {"b": 300.0, "c": 200.0, "other": 100.0}  # the biggest named, the rest summed
    # "a" grows past the others: it stays in "other" (named accounts keep their series, so
    # "other" never shrinks), and a sum that fell a little keeps the old value.
    later = U.usage_samples({"a": (900.0, 60.0, 11.0), "b": (299.0, 0.0, 0.0), "c": (250.0, 20.0, 1.0)},
                            first, by_account=True, max_accounts=2)
    alloc = {dict(k)["account"]: v for k, v in later[U.ALLOCATED].items()}
    assert alloc == {"b": 300.0, "c": 250.0, "other": 900.0}
    # A new, much smaller database: the counters start again (Prometheus reads it as a reset).
    reset = U.usage_samples({"b": (10.0, 0.0, 0.0)}, later, by_account=True, max_accounts=2)
    assert {dict(k)["account"]: v for k, v in reset[U.ALLOCATED].items()} == {"b": 10.0}
    total = U.usage_samples(sums, first, by_account=False, max_accounts=2)
    assert total[U.ALLOCATED] == {(): 600.0} and total[U.ENERGY] == {(): 11.0}


def test_xids_are_counted_once_per_event_and_only_go_up(sim_node):
    node, tf, _ = metrics_node(sim_node)
    log = node.tmp / "kern.log"
    now = time.time()
    # GPU 0 of h100_sxm sits on bus 0x18.
    log.write_text(f"{now - 60:.6f} host kernel: NVRM: Xid (PCI:0000:18:00): 43, pid=1, Ch 00000001\n"
                   f"{now - 50:.6f} host kernel: NVRM: Xid (PCI:0000:18:00): 43, pid=2, Ch 00000001\n")
    node.write_config(extra=f'[metrics]\ntextfile_dir = "{tf}"\n[xid]\nsource = "file:{log}"\n')
    u0 = uuid_of(node, 0)
    assert hooks.prolog(from_env(job_env(job_id=1, gpus="0")), deps_for(node)) == 0
    assert value((tf / NODE).read_text(), "slurm_gpu_xid_errors_total", UUID=u0, xid="43") == 2
    assert hooks.epilog(from_env(job_env(job_id=1, gpus="0")), deps_for(node)) == 0  # the same lines again
    assert value((tf / NODE).read_text(), "slurm_gpu_xid_errors_total", UUID=u0, xid="43") == 2
    with log.open("a") as f:
        f.write(f"{now - 5:.6f} host kernel: NVRM: Xid (PCI:0000:18:00): 31, pid=3, MMU Fault\n")
    assert hooks.prolog(from_env(job_env(job_id=2, gpus="1")), deps_for(node)) == 0  # GPU 0 not looked at
    assert value((tf / NODE).read_text(), "slurm_gpu_xid_errors_total", UUID=u0, xid="31") is None
    assert hooks.prolog(from_env(job_env(job_id=3, gpus="0")), deps_for(node)) == 0
    text = (tf / NODE).read_text()
    assert value(text, "slurm_gpu_xid_errors_total", UUID=u0, xid="31") == 1
    assert value(text, "slurm_gpu_xid_errors_total", UUID=u0, xid="43") == 2
    assert value(text, "slurm_gpu_xid_last_timestamp_seconds", UUID=u0) == pytest.approx(now - 5, abs=0.01)
    check_dir(tf)


def test_unwritable_directory_is_one_log_line_and_the_exit_code_is_unchanged(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    blocker = node.tmp / "not-a-dir"
    blocker.write_text("a file where the directory should be\n")
    node.write_config(extra=f'[metrics]\ntextfile_dir = "{blocker}/tf"\ndcgm_job_mapping_dir = "{blocker}/dcgm"\n')
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    assert hooks.epilog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    simgpu.set_gpu(node.state, 1, ecc_volatile_uncorrected=1)
    assert hooks.prolog(from_env(job_env(job_id=4712, gpus="1")), deps_for(node)) == 1
    lines = [line for line in node.log_text().splitlines() if "metrics" in line]
    # One line per directory per run: prolog (2 dirs), epilog (2), failing prolog (textfile only:
    # no job starts, so the mapping directory is not written).
    assert len(lines) == 5, lines
    assert all("metrics-write-failed" in line and "not-a-dir" in line for line in lines), lines
    assert rows(node.db, "SELECT COUNT(*) AS n FROM job_gpus") == [{"n": 1}]  # the job's record is there


def test_metrics_off_by_default_does_not_even_import_the_package(sim_node):
    node = sim_node(simgpu.h100_sxm(2))
    code = ("import sys; from slurm_gpu.hooks.main import run_hook; rc = run_hook('prolog'); "
            "print(rc, 'slurm_gpu.metrics' in sys.modules, 'prometheus_client' in sys.modules)")
    cp = subprocess.run([sys.executable, "-c", code], env=node.env(**job_env(gpus="0")), capture_output=True,
                        text=True, timeout=60)
    assert cp.stdout.split() == ["0", "False", "False"], cp.stderr[-2000:]
    tf = node.tmp / "tf"
    node.write_config(extra=f'[metrics]\ntextfile_dir = "{tf}"\n')
    cp = subprocess.run([sys.executable, "-c", code], env=node.env(**job_env(gpus="1", SLURM_JOB_ID="2")),
                        capture_output=True, text=True, timeout=60)
    assert cp.stdout.split() == ["0", "True", "False"], cp.stderr[-2000:]  # never prometheus_client on the hook path
    assert (tf / NODE).exists() and (tf / "slurm_gpu_job_2.prom").exists()


# ------------------------------------------------------------------ 3. dcgm-exporter's job mapping


def test_dcgm_mapping_files_appear_and_vanish_with_the_jobs(sim_node):
    node, tf, mp = metrics_node(sim_node)
    assert hooks.prolog(from_env(job_env(job_id=21, gpus="0,2")), deps_for(node)) == 0
    assert hooks.prolog(from_env(job_env(job_id=22, gpus="2")), deps_for(node)) == 0  # a GPU shared (shards)
    names = sorted(p.name for p in mp.iterdir() if not p.name.startswith("."))
    assert names == ["0", "2"]
    assert (mp / "0").read_text() == "21\n" and (mp / "2").read_text() == "21\n22\n"
    assert all(stat.S_IMODE((mp / n).stat().st_mode) == 0o644 for n in names)
    assert hooks.epilog(from_env(job_env(job_id=21, gpus="0,2")), deps_for(node)) == 0
    assert sorted(p.name for p in mp.iterdir() if not p.name.startswith(".")) == ["2"]
    assert (mp / "2").read_text() == "22\n"
    assert hooks.epilog(from_env(job_env(job_id=22, gpus="2")), deps_for(node)) == 0
    assert [p.name for p in mp.iterdir() if not p.name.startswith(".")] == []


def test_dcgm_mapping_name_of_a_mig_slice_is_gpu_dot_gpu_instance_and_job_info_has_gpu_i_id():
    mig = MigDevice(index=0, uuid="MIG-abc", gpu_instance_id=5, compute_instance_id=0, memory_total_bytes=10 << 30)
    whole, sliced = JobGpu(0, 3, "/dev/nvidia3"), JobGpu(1, 3, "/dev/nvidia3", mig)
    assert J.mapping_name(whole) == "3" and J.mapping_name(sliced) == "3.5"
    assert J.MAPPING_NAME.match("3.5") and not J.MAPPING_NAME.match(".slurm-gpu.lock")
    g = simgpu_snapshot(3)
    job = types.SimpleNamespace(job_id=7, user="bob", account=None, partition="mig")
    info = J.job_samples(job, [(g, sliced)])["slurm_gpu_job_info"]
    (labels,) = info
    assert dict(labels) == {"gpu": "3", "UUID": "GPU-parent", "modelName": "NVIDIA A100-SXM4-40GB", "GPU_I_ID": "5",
                            "slurm_job": "7", "user": "bob", "account": "", "partition": "mig"}


def simgpu_snapshot(index):
    from slurm_gpu.gpu import snapshot as S
    return S.GpuSnapshot(index, uuid=S.value("GPU-parent"), name=S.value("NVIDIA A100-SXM4-40GB"))


def test_stale_job_files_and_mapping_lines_go_once_the_job_is_gone(tmp_path):
    tf, mp = tmp_path / "tf", tmp_path / "dcgm"
    tf.mkdir()
    mp.mkdir()
    now = time.time()
    for job_id, age in ((31, 3600), (32, 3600), (33, 60)):
        p = tf / J.job_file(job_id)
        p.write_text("")
        os.utime(p, (now - age, now - age))
    (mp / "0").write_text("31\n32\n")
    os.utime(mp / "0", (now - 3600, now - 3600))
    live = J.Liveness(now, running=lambda: {"32"}, booted=now - 86400)
    assert [job for _, job in J.stale_job_files(str(tf), live)] == ["31"]  # 32 runs, 33 is too young to judge
    assert J.unmap_jobs(str(mp), live.gone) == 1 and (mp / "0").read_text() == "32\n"
    rebooted = J.Liveness(now, running=lambda: {"32", "33"}, booted=now - 30)
    assert [job for _, job in J.stale_job_files(str(tf), rebooted)] == ["31", "32", "33"]  # no job survives a reboot


def test_running_jobs_are_read_from_slurmstepd_command_lines(tmp_path):
    for pid, cmd in (("100", b"slurmstepd: [4711.batch]\0"), ("101", b"slurmstepd: [4712.extern]"),
                     ("102", b"python3\0train.py"), ("self", b"slurmstepd: [1.0]")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(cmd)
    assert J.running_jobs(str(tmp_path)) == {"4711", "4712"}
    assert J.running_jobs(str(tmp_path / "missing")) is None


# ------------------------------------------------------------------ 4. healthcheck


class _Backend:
    timeout_s = 1.0

    def __init__(self, reason=""):
        self.reason, self.actions = reason, []

    def node(self, name):
        from slurm_gpu.slurm.model import NodeInfo, split_state
        state = "IDLE+DRAIN" if self.reason else "IDLE"
        return NodeInfo(name, state, split_state(state), self.reason, "root" if self.reason else "",
                        1.7e9 if self.reason else None, "gpu:h100:4", "", 4, 0)

    def drain(self, name, reason):
        self.actions.append(("drain", reason))
        self.reason = reason

    def resume(self, name):
        self.actions.append(("resume",))
        self.reason = ""


def _healthcheck(node, backend, **kw):
    from slurm_gpu.hooks.healthcheck import default_checker
    cfg = config.load(str(node.config))
    os.environ["SIMNVML_STATE"] = str(node.state)
    return node_health_cycle(backend, "gpu01", kw.pop("checker", None) or default_checker(cfg), deadline_s=30,
                             metrics_cfg=cfg, **kw)


def test_healthcheck_writes_every_gpu_the_drain_and_the_spool(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    simgpu.set_gpu(node.state, 3, ecc_volatile_uncorrected=1)
    backend = _Backend()
    assert _healthcheck(node, backend).action == "drained"
    text = (tf / NODE).read_text()
    assert all(value(text, "slurm_gpu_check_status", UUID=uuid_of(node, i), check="responsive", status="PASS") == 1
               for i in range(4))
    assert value(text, "slurm_gpu_check_status", UUID=uuid_of(node, 3), check="ecc_uncorrectable", status="FAIL") == 1
    assert T.parse(text)["slurm_gpu_node_drained"] == {(("reason", "ecc_uncorrectable"),): 1.0}
    assert value(text, "slurm_gpu_check_timestamp_seconds", source="healthcheck") is not None
    assert value(text, "slurm_gpu_spool_records") == 0
    assert value(text, "slurm_gpu_unpushed_records") is None  # no central server configured
    # Still drained by us at the next run (cause unknown to Slurm's reason): the check stays.
    assert _healthcheck(node, backend).action == "kept-drained"
    assert T.parse((tf / NODE).read_text())["slurm_gpu_node_drained"] == {(("reason", "ecc_uncorrectable"),): 1.0}
    simgpu.set_gpu(node.state, 3, ecc_volatile_uncorrected=0)
    assert _healthcheck(node, backend).action == "resumed"
    text = (tf / NODE).read_text()
    assert T.parse(text)["slurm_gpu_node_drained"] == {(("reason", ""),): 0.0}
    assert value(text, "slurm_gpu_check_status", UUID=uuid_of(node, 3), check="ecc_uncorrectable", status="PASS") == 1
    check_dir(tf)


def test_healthcheck_writes_the_driver_library_mismatch_with_both_versions(sim_node):
    """The prolog and epilog wrote slurm_gpu_driver_library_mismatch; healthcheck, the run that sees
    a node without jobs, did not: its series stayed 0 on a node every job would fail on."""
    from slurm_gpu.errors import DriverLibraryMismatch

    def mismatch(info):
        raise DriverLibraryMismatch("550.54.15", "560.35.03")

    node, tf, _ = metrics_node(sim_node, mapping=False)
    assert _healthcheck(node, _Backend()).action == "none"
    assert T.parse((tf / NODE).read_text())["slurm_gpu_driver_library_mismatch"] == {
        (("kernel_version", ""), ("library_version", "")): 0.0}
    backend = _Backend()
    assert _healthcheck(node, backend, checker=mismatch).action == "drained"
    text = (tf / NODE).read_text()
    assert T.parse(text)["slurm_gpu_driver_library_mismatch"] == {
        (("kernel_version", "550.54.15"), ("library_version", "560.35.03")): 1.0}
    assert "driver/library version mismatch" in backend.reason
    assert _healthcheck(node, backend).action == "resumed"  # rebooted: one series again, 0
    assert T.parse((tf / NODE).read_text())["slurm_gpu_driver_library_mismatch"] == {
        (("kernel_version", ""), ("library_version", "")): 0.0}
    check_dir(tf)


def test_healthcheck_drain_for_an_unusable_driver_shows_in_the_metrics(sim_node):
    from slurm_gpu.errors import NvmlUnavailable

    def no_driver(info):
        raise NvmlUnavailable("NVML Shared Library Not Found", "install the driver")

    node, tf, _ = metrics_node(sim_node, mapping=False)
    assert _healthcheck(node, _Backend()).action == "none"  # GPU series in the file from a good run
    backend = _Backend()
    assert _healthcheck(node, backend, checker=no_driver).action == "drained"
    text = (tf / NODE).read_text()
    assert T.parse(text)["slurm_gpu_node_drained"] == {(("reason", "responsive"),): 1.0}
    assert value(text, "slurm_gpu_last_run_timestamp_seconds", hook="healthcheck") == pytest.approx(time.time(), abs=30)
    assert value(text, "slurm_gpu_check_status", UUID=uuid_of(node, 0), check="responsive", status="PASS") == 1  # kept
    assert _healthcheck(node, backend, checker=no_driver).action == "kept-drained"
    assert T.parse((tf / NODE).read_text())["slurm_gpu_node_drained"] == {(("reason", "responsive"),): 1.0}
    check_dir(tf)


def test_versions_and_remap_banks_come_from_healthcheck_and_survive_a_prologs_quick_read(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    simgpu.set_gpu(node.state, 2, vbios="96.00.11.00.01", remap_hist_max=2555, remap_hist_none=1)
    assert _healthcheck(node, _Backend()).action == "none"  # a bank without spare rows: WARN, no drain
    text = (tf / NODE).read_text()
    u2 = uuid_of(node, 2)
    assert value(text, "slurm_gpu_row_remap_banks", UUID=u2, availability="none") == 1
    assert value(text, "slurm_gpu_row_remap_banks", UUID=u2, availability="max") == 2555
    assert value(text, "slurm_gpu_vbios_info", UUID=u2, vbios="96.00.11.00.01") == 1
    assert value(text, "slurm_gpu_check_status", UUID=u2, check="remap_spare_rows", status="WARN") == 1
    vbios = {dict(k)["vbios"] for k in T.parse(text)["slurm_gpu_vbios_info"]}
    assert len(vbios) == 2 and value(text, "slurm_gpu_check_status", gpu="", check="vbios_consistency", status="WARN") == 1
    (driver,) = T.parse(text)["slurm_gpu_driver_info"]
    assert dict(driver) == {"driver_version": "550.54.15", "cuda_version": "12.4"}  # simgpu.h100_sxm's driver
    # The prolog does not read the histogram or the VBIOS: what healthcheck wrote stays.
    assert hooks.prolog(from_env(job_env(gpus="2")), deps_for(node)) == 0
    after = (tf / NODE).read_text()
    for name in ("slurm_gpu_row_remap_banks", "slurm_gpu_vbios_info", "slurm_gpu_driver_info"):
        assert T.parse(after)[name] == T.parse(text)[name], name
    assert value(after, "slurm_gpu_check_status", UUID=u2, check="remap_spare_rows", status="WARN") == 1
    check_dir(tf)


def test_healthcheck_dry_run_writes_nothing_and_another_admins_drain_is_not_ours(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    assert _healthcheck(node, _Backend(), dry_run=True).action == "none"
    assert not (tf / NODE).exists()
    assert _healthcheck(node, _Backend(reason="bad fan")).action == "left-alone"
    assert T.parse((tf / NODE).read_text())["slurm_gpu_node_drained"] == {(("reason", ""),): 0.0}


def test_healthcheck_forgets_gpus_no_longer_on_the_node(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    assert _healthcheck(node, _Backend()).action == "none"
    gone = uuid_of(node, 3)
    simgpu.write_state(node.state, simgpu.h100_sxm(3))  # GPU 3 went back to the vendor
    _healthcheck(node, _Backend())
    text = (tf / NODE).read_text()
    assert gone not in text and uuid_of(node, 2) in text


def test_healthcheck_counts_unpushed_records_with_a_central_server(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False, extra='[central]\nurl = "mysql://w@db.invalid/slurm_gpu"\n')
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    assert hooks.epilog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    _healthcheck(node, _Backend())
    text = (tf / NODE).read_text()
    assert value(text, "slurm_gpu_unpushed_records") >= 2  # the job and its GPU row at least
    assert value(text, "slurm_gpu_unpushed_oldest_timestamp_seconds") == pytest.approx(time.time(), abs=60)


# ------------------------------------------------------------------ 5. the exporter


def test_exporter_serves_one_valid_exposition_over_http_on_localhost(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    assert hooks.prolog(from_env(job_env(job_id=41, gpus="0")), deps_for(node)) == 0
    assert hooks.prolog(from_env(job_env(job_id=42, gpus="1")), deps_for(node)) == 0
    (tf / "other_tool.prom").write_text("# HELP other_metric not ours\n# TYPE other_metric gauge\nother_metric 1\n")
    fresh = {"slurm_gpu_spool_records": {(): 4.0}}
    server = make_server("127.0.0.1", 0, lambda: collect(str(tf), lambda: fresh))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = r.read().decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
    got = client_parse(body)
    promtool_check(body)
    assert len(got["slurm_gpu_job_info"]) == 2  # both job files, one family
    assert body.count("# TYPE slurm_gpu_job_info ") == 1
    assert got["slurm_gpu_spool_records"] == {frozenset(): 4.0}
    assert "other_metric" not in body  # only our files


def test_exporter_command_prints_one_exposition_and_refuses_without_textfile_dir(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    run = [sys.executable, "-m", "slurm_gpu.cli", "--config", str(node.config), "exporter", "--once"]
    cp = subprocess.run(run, capture_output=True, text=True, timeout=60, env=node.env())
    assert cp.returncode == 0, cp.stderr
    assert "slurm_gpu_job_info{" in cp.stdout and "slurm_gpu_spool_records 0" in cp.stdout
    promtool_check(cp.stdout)
    node.write_config()
    cp = subprocess.run(run, capture_output=True, text=True, timeout=60, env=node.env())
    assert cp.returncode == 2 and "metrics.textfile_dir is empty" in cp.stderr


def test_exporter_listen_address_parsing():
    assert parse_listen("127.0.0.1:9466") == ("127.0.0.1", 9466)
    assert parse_listen(":9466") == ("127.0.0.1", 9466)
    assert parse_listen("[::1]:9466") == ("::1", 9466)
    for bad in ("9466", "host:", "host:99999"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_exporter_port_in_use_is_a_usage_error(sim_node):
    node, tf, _ = metrics_node(sim_node, mapping=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(node.config), "exporter",
                             "--listen", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60, env=node.env())
    assert cp.returncode == 2 and "cannot listen on" in cp.stderr
