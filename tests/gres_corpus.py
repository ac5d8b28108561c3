"""The gres.conf corpus (tests/data/gres_corpus/): files, sources, and the node cases to check.

A *case* is (file, node): a node a file gives GPU lines for, with AutoDetect off for it (a
Debian slurmd is built without NVML, so `slurmd -G` cannot run AutoDetect there).  Files
without NodeName= apply to every node; their node is "n1".
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

from slurm_gpu.gres import generate as gres
from slurm_gpu.slurm import conf as slurmconf
from slurm_gpu.slurm import hostlist

CORPUS = Path(__file__).resolve().parent / "data" / "gres_corpus"
SOURCES = CORPUS / "SOURCES.md"


def files() -> List[Path]:
    return sorted(CORPUS.glob("*.conf"))


def sources() -> Dict[str, str]:
    """file name -> source column of SOURCES.md."""
    out = {}
    for line in SOURCES.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+\.conf)`\s*\|\s*([^|]+?)\s*\|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def named_nodes(text: str) -> List[str]:
    """First and last node of every NodeName= hostlist, in file order."""
    out: List[str] = []
    for lineno, line in slurmconf.logical_lines(text):
        pairs = slurmconf.parse_pairs(line, f"line {lineno}")
        if "nodename" in pairs:
            names = hostlist.expand(pairs["nodename"])
            for n in (names[0], names[-1]):
                if n not in out:
                    out.append(n)
    return out


def node_view(text: str, node: str) -> Tuple[List[str], bool]:
    """(normalised GPU lines of the node, whether AutoDetect is on for it)."""
    lines = [line for line in gres.normalise_gres_conf(text, "corpus", [node])
             if line.startswith(f"NodeName={node} ")]
    gpu = [line for line in lines if " Name=gpu" in line]
    return gpu, any(" AutoDetect=" in line for line in lines)


def cases() -> List[Tuple[str, str]]:
    out = []
    for path in files():
        text = path.read_text()
        for node in named_nodes(text) or ["n1"]:
            gpu, autodetect = node_view(text, node)
            if gpu and not autodetect:
                out.append((path.name, node))
    return out


def slurm_conf_gres(gres_conf: Path, node: str) -> str:
    """The slurm.conf Gres= value that matches the node's GPU lines: types in first-seen order."""
    lines, _ = slurmconf._gres_lines(str(gres_conf), node)
    counts: Dict[str, int] = {}
    for ln in lines:
        counts[ln.type] = counts.get(ln.type, 0) + (1 if ln.multiple else len(ln.files))
    return ",".join(f"gpu:{t}:{n}" if t else f"gpu:{n}" for t, n in counts.items())


def write_node_config(dirpath: Path, corpus_file: str, node: str) -> Path:
    """slurm.conf + the corpus file as gres.conf in dirpath; returns the slurm.conf path."""
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "gres.conf").write_bytes((CORPUS / corpus_file).read_bytes())
    gres_value = slurm_conf_gres(dirpath / "gres.conf", node)
    conf = dirpath / "slurm.conf"
    conf.write_text("ClusterName=corpus\nSlurmctldHost=localhost\nGresTypes=gpu,mps,shard,bandwidth,qpu\n"
                    f"DebugFlags=Gres\nNodeName={node} CPUs=2 Gres={gres_value}\nPartitionName=p Nodes={node}\n")
    return conf
