"""Real gres.conf files (tests/data/gres_corpus/, sources in its SOURCES.md) read as Slurm reads them.

Every file parses (the `--check` normaliser and the hooks' reader), its source is noted, and
what it means comes out right: Slurm's aliases, case, tabs, inline AutoDetect.  The order of
GPU records is compared with real `slurmd -G` in tests/integration/test_gres_corpus_slurmd.py.
"""
from __future__ import annotations

import gres_corpus as corpus
import pytest

from slurm_gpu.gres import generate as gres
from slurm_gpu.slurm import conf as slurmconf


def test_every_corpus_file_has_its_public_source_noted():
    names = {p.name for p in corpus.files()}
    noted = corpus.sources()
    assert names, "empty corpus"
    assert sorted(names - set(noted)) == [], "add a row to tests/data/gres_corpus/SOURCES.md"
    assert sorted(set(noted) - names) == [], "SOURCES.md names a file that is not in the corpus"
    assert all(source.strip() for source in noted.values())
    assert sum("SchedMD/slurm" in s for s in noted.values()) >= 2 and sum("GitHub" in s for s in noted.values()) >= 5


@pytest.mark.parametrize("name", [p.name for p in corpus.files()])
def test_corpus_file_parses_without_error(name):
    text = (corpus.CORPUS / name).read_text()
    lines = gres.normalise_gres_conf(text, name)
    assert lines, f"{name}: nothing read"
    # the hooks' reader takes it too, for every node it names
    for node in corpus.named_nodes(text) or ["n1"]:
        slurmconf._gres_lines(str(corpus.CORPUS / name), node)


@pytest.mark.parametrize("name, node", corpus.cases())
def test_corpus_node_gets_gpu_records_from_the_hooks_reader(tmp_path, name, node):
    conf = corpus.write_node_config(tmp_path, name, node)
    records, autodetect = slurmconf.node_gres_records(str(conf), node)
    gpu, _ = corpus.node_view((corpus.CORPUS / name).read_text(), node)
    assert not autodetect and len(records) == len(gpu), (records, gpu)


def test_corpus_has_node_cases_for_slurmd():
    # the cluster-wide files must give several nodes, the node-local ones "n1"
    cases = corpus.cases()
    assert ("slurm-man-one-file-positive.conf", "tux3") in cases
    assert ("slurm-man-nvml-except-one.conf", "tux3") in cases
    assert ("yyuzhongpv-gpu-cluster.conf", "n1") in cases
    assert len(cases) >= 12


def test_corpus_cpus_and_inline_autodetect_off_mean_what_cores_and_nothing_mean():
    text = (corpus.CORPUS / "arlk-lambda-slurm.conf").read_text()
    assert gres.check(text, text.replace("CPUs=", "Cores=")) == ""
    text = (corpus.CORPUS / "ai4city-hkust-single-node.conf").read_text()
    assert gres.check(text, "NodeName=bld Name=gpu File=/dev/nvidia[0-7]\n") == ""


def test_corpus_tabs_and_nodename_spelling_read_as_slurm_does():
    text = (corpus.CORPUS / "danielmc81-slurm_config_files.conf").read_text()
    lines = gres.normalise_gres_conf(text, "x")
    assert "NodeName=ibnodo2 Name=gpu Type=m2070q File=/dev/nvidia3" in lines
    assert "NodeName=visualizacion1 Name=gpu Type=gtx1060 File=/dev/nvidia1" in lines
    assert len(lines) == 4 + 4 + 1 + 1 + 1 + 4


def test_corpus_autodetect_applies_per_node_as_slurm_says():
    text = (corpus.CORPUS / "slurm-man-nvml-except-one.conf").read_text()
    lines = gres.normalise_gres_conf(text, "x", ["tux2", "tux3"])
    assert "NodeName=tux2 AutoDetect=nvml" in lines
    assert not any(line.startswith("NodeName=tux3 AutoDetect") for line in lines)
    text = (corpus.CORPUS / "slurm-man-nvml-rsmi-none.conf").read_text()
    lines = gres.normalise_gres_conf(text, "x")
    assert "NodeName=tux9 AutoDetect=rsmi" in lines and "NodeName=tux0 AutoDetect=nvml" in lines
    assert not any("tux12 AutoDetect" in line for line in lines)
