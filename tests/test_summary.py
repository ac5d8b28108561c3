"""A job's GPU summary as kept in its AdminComment (store/summary.py): round trips and limits."""
from __future__ import annotations

import json
import random

import pytest

from slurm_gpu.errors import InputError
from slurm_gpu.store import summary as S


def rows(nodes, gpus, seed=1):
    rnd = random.Random(seed)
    return [dict(node=f"gpu{n:03d}", gpu_index=g, gpu_model="NVIDIA H100 80GB HBM3", start_time=1790000000.4,
                 end_time=1790086400.6, gpu_util_mean_pct=rnd.uniform(0, 100), mem_util_mean_pct=rnd.uniform(0, 60),
                 max_memory_bytes=rnd.randrange(1 << 30, 80 << 30), memory_total_bytes=85520809984,
                 energy_j=rnd.uniform(1e6, 5e7), ecc_uncorrected_delta=0,
                 xid_events=json.dumps([{"xid": 79, "time": 1.0}]) if (n, g) == (0, 0) else None)
            for n in range(nodes) for g in range(gpus)]


@pytest.mark.parametrize("nodes,gpus,limit", [(1, 1, 400), (64, 8, 20_000)])  # measured: 225 and 13,923 bytes
def test_summary_survives_sacctmgr_lowercasing_and_stays_small(nodes, gpus, limit):
    s = S.from_records("c", 4711, 1, [f"gpu{n:03d}" for n in range(nodes)], rows(nodes, gpus))
    text = S.encode(s)
    assert len(text) < limit, len(text)  # slurmdbd keeps AdminComment as TEXT (64 KiB)
    assert text == text.lower() and S.is_ours(text.upper())
    for variant in (text, text.lower(), text.upper()):
        assert S.decode(variant) == s
    assert s.gpus[0].xids == [79] and s.gpus[0].energy_wh == round(rows(1, 1)[0]["energy_j"] / 3600, 2)


def test_nodes_without_records_make_the_summary_partial():
    s = S.from_records("c", 7, 0, ["gpu000", "gpu001"], rows(1, 2))
    assert s.partial and s.missing == ["gpu001"] and len(s.gpus) == 2
    assert S.decode(S.encode(s)).missing == ["gpu001"]
    empty = S.from_records("c", 7, 0, ["gpu000"], [])
    assert empty.partial and empty.gpus == [] and S.decode(S.encode(empty)) == empty


@pytest.mark.parametrize("text", ["JS1:abc", "", "sg1:!!!!", "sg1:" + "a" * 40, "sg1:mzxw6"])
def test_foreign_or_damaged_text_is_one_clear_error(text):
    with pytest.raises(InputError):
        S.decode(text)
    assert S.decode_safe(text) is None


def test_unknown_trailing_columns_of_a_later_version_are_ignored():
    import base64
    import zlib
    doc = {"v": 1, "c": "c", "j": 1, "r": 0, "p": 0, "n": ["n1"], "m": [], "k": ["m"],
           "g": [[0, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [], 0, 1, "future"]]}
    text = "sg1:" + base64.b32encode(zlib.compress(json.dumps(doc).encode())).decode().rstrip("=").lower()
    assert S.decode(text).gpus[0].util_pct == 50.0


def _text(doc):
    import base64
    import zlib
    return "sg1:" + base64.b32encode(zlib.compress(json.dumps(doc).encode())).decode().rstrip("=").lower()


GOOD = {"v": 1, "c": "c", "j": 1, "r": 0, "p": 0, "n": ["n1", "n2"], "m": [], "k": ["m"],
        "g": [[0, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [79], 0]]}


@pytest.mark.parametrize("field,value", [
    ("g", [[0, 0, 0, 1, 2, "50", 10.0, 100, 1000, 1.5, 0, [], 0]]),     # a string for a number
    ("g", [[0, 0, 0, 1, 2, float("nan"), 10.0, 100, 1000, 1.5, 0, [], 0]]),  # NaN
    ("g", [[0, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, float("inf"), 0, [], 0]]),
    ("g", [[-1, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [], 0]]),    # a negative node index
    ("g", [[5, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [], 0]]),     # past the last node
    ("g", [[0, 0, -1, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [], 0]]),    # a negative model index
    ("g", [[True, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [], 0]]),  # a boolean for an index
    ("g", [[0, "0", 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, [], 0]]),
    ("g", [[0, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, ["79"], 0]]),
    ("g", [[0, 0, 0, 1, 2, 50.0, 10.0, 100, 1000, 1.5, 0, 79, 0]]),
    ("g", [{"node": 0}]), ("g", {"0": 1}),
    ("n", [["n1"], "n2"]),                                              # a list as a node name
    ("n", "n1"), ("m", [1]), ("k", [None]), ("c", ["c"]), ("j", "1"), ("j", 1.5), ("r", -1), ("p", "yes"),
])
def test_a_summary_with_valid_syntax_but_wrong_types_is_damaged_not_a_traceback(field, value):
    text = _text(dict(GOOD, **{field: value}))
    with pytest.raises(InputError, match="damaged"):
        S.decode(text)
    assert S.decode_safe(text) is None
    assert S.decode(_text(GOOD)).gpus[0].node == "n1"


def test_a_summary_of_3000_gpus_falls_back_to_per_node_totals_within_the_column():
    s = S.from_records("c", 4711, 0, [f"gpu{n:03d}" for n in range(375)], rows(375, 8))
    assert len(S.encode(s)) > S.MAX_BYTES  # the full form would be cut by slurmdbd
    text = S.fit(s)
    assert len(text) <= S.MAX_BYTES
    back = S.decode(text)
    assert back.detail == "node" and len(back.gpus) == 375 and sum(g.count for g in back.gpus) == 3000
    assert back.gpus[0].xids == [79] and back.gpus[0].index is None
    energy = sum(g.energy_wh for g in s.gpus)
    assert abs(sum(g.energy_wh for g in back.gpus) - energy) < 375 * 0.01
    small = S.from_records("c", 1, 0, ["gpu000"], rows(1, 2))
    assert S.fit(small) == S.encode(small) and S.decode(S.fit(small)).detail == "gpu"


def test_a_summary_too_large_even_per_node_is_a_marker_for_the_central_server():
    s = S.from_records("c", 4711, 0, [f"gpu{n:03d}" for n in range(40)], rows(40, 2))
    text = S.fit(s, limit=len(S.encode(S.per_node(s))) - 1)
    back = S.decode(text)
    assert back.detail == "central" and back.gpus == [] and back.nodes == s.nodes
