"""Real gres.conf files (tests/data/gres_corpus/) under real `slurmd -G` (every Slurm version of the testbed).

For every node a corpus file gives GPU lines for (AutoDetect off for it: Debian's slurmd has no
NVML), slurmd parses the file verbatim with a matching slurm.conf `Gres=` and prints its GPU
records in index order; `slurmconf.node_gres_records` (what the hooks use to map Slurm's GPU
indices to devices) must name the same device files in the same order.  Device files are
created with mknod as root and removed afterwards (tests/integration/test_gres_slurmd.py).
Cores=/CPUs= beyond this machine's CPUs make slurmd log an error but keep the record; they do
not change the order.
"""
from __future__ import annotations

import gres_corpus as corpus
import pytest

from slurm_gpu.slurm import conf as slurmconf
from slurm_gpu.slurm import hostlist

from .sites import need_slurmd, slurmd_order

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize("name, node", corpus.cases())
def test_corpus_gpu_order_equals_slurmds(tmp_path, device_files, slurmd_munge, name, node):
    need_slurmd()
    conf = corpus.write_node_config(tmp_path / "etc", name, node)
    ours, autodetect = slurmconf.node_gres_records(str(conf), node)
    assert not autodetect
    needed = [f for r in ours for f in r.files]
    device_files(sorted(set(needed), key=hostlist.sort_key))
    assert [",".join(r.files) for r in ours] == slurmd_order(conf.parent, node, slurmd_munge)


def test_continuation_inside_a_value_is_joined_as_slurmd_joins_it(tmp_path, device_files, slurmd_munge):
    # parse_config.c joins a '\' continuation where the backslash was, without a space, and
    # '\#' is a literal '#': slurmd reads File=/dev/nvidia[0-1] here, and so must we.
    need_slurmd()
    device_files(["/dev/nvidia0", "/dev/nvidia1"])
    (tmp_path / "gres.conf").write_text("Name=gpu Type=t4 File=/dev/nvi\\\ndia[0-1] # comment \\#1\n")
    (tmp_path / "slurm.conf").write_text("ClusterName=t\nSlurmctldHost=localhost\nGresTypes=gpu\nDebugFlags=Gres\n"
                                         "NodeName=n1 CPUs=2 Gres=gpu:t4:2\nPartitionName=p Nodes=n1\n")
    ours, _ = slurmconf.node_gres_records(str(tmp_path / "slurm.conf"), "n1")
    assert [",".join(r.files) for r in ours] == slurmd_order(tmp_path, "n1", slurmd_munge) == ["/dev/nvidia0", "/dev/nvidia1"]
