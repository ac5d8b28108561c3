"""Benchmark: `slurm-gpu gres-conf --inventory DIR` for 1,000 nodes x 8 GPUs (target: <= 1 s median).

Writes 1,000 inventories in three hardware groups to a temp dir, then times
  * the whole CLI process (interpreter start, imports, config, 1,000 JSON files, render), and
  * the in-process work (inventory.load_all + gres.build + render_gres_conf),
and prints median / min / max of N runs.

    python benchmarks/bench_gres.py [--runs 7] [--nodes 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_gpu.gres import generate as gres
from slurm_gpu.gres import inventory  # noqa: E402


def _gpu(i: int, host: str, name: str, bus: int, cpus: str, cores: str, peers: dict) -> dict:
    return {"index": i, "minor": i, "uuid": f"GPU-{host}-{i:02d}-0000-0000-000000000000", "name": name,
            "pci_bus_id": f"00000000:{bus:02x}:00.0", "cpu_affinity": cpus, "cores": cores,
            "nvlink_peers": peers, "mig_enabled": False, "mig_devices": []}


BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def node(host: str, kind: str) -> dict:
    gpus = []
    for i in range(8):
        sock = i // 4
        cpus = f"{sock * 56}-{sock * 56 + 55},{112 + sock * 56}-{112 + sock * 56 + 55}"  # HT siblings
        cores = f"{sock * 56}-{sock * 56 + 55}"
        if kind == "h100":  # HGX: 18 links to 4 NVSwitches
            peers = {f"00000000:{0x05 + s:02x}:00.0": (5 if s < 2 else 4) for s in range(4)}
            gpus.append(_gpu(i, host, "NVIDIA H100 80GB HBM3", BUSES[i], cpus, cores, peers))
        elif kind == "a100":  # NvLink-bridged pairs: direct links -> Links= on every line
            mate = BUSES[i ^ 1]
            gpus.append(_gpu(i, host, "NVIDIA A100 80GB PCIe", BUSES[i], cpus, cores, {f"00000000:{mate:02x}:00.0": 3}))
        else:
            gpus.append(_gpu(i, host, "NVIDIA L40S", BUSES[i], cpus, cores, {}))
    return {"format": inventory.FORMAT, "hostname": host, "gpus": gpus}


def write_cluster(root: Path, nodes: int) -> None:
    for n in range(1, nodes + 1):
        kind = "h100" if n <= nodes * 6 // 10 else ("a100" if n <= nodes * 9 // 10 else "l40s")
        host = f"gpu{n:04d}"
        (root / f"{host}.json").write_text(json.dumps(node(host, kind), indent=2))


def timed(fn, runs: int):
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def report(label: str, xs) -> None:
    print(f"{label:<40} median {statistics.median(xs) * 1000:7.1f} ms   min {min(xs) * 1000:7.1f} ms   "
          f"max {max(xs) * 1000:7.1f} ms   (n={len(xs)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--nodes", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gres-") as tmp:
        root = Path(tmp) / "inv"
        root.mkdir()
        write_cluster(root, args.nodes)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["SLURM_GPU_CONFIG"] = str(Path(tmp) / "config.toml")
        (Path(tmp) / "config.toml").write_text("")
        argv = [sys.executable, "-m", "slurm_gpu.cli", "gres-conf", "--inventory", str(root), "--type-naming", "short"]
        first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        if first.returncode != 0:
            print(first.stderr, file=sys.stderr)
            return 1
        lines = [l for l in first.stdout.splitlines() if l.startswith("NodeName=")]
        print(f"{args.nodes} nodes x 8 GPUs, {len(os.listdir(root))} inventory files; output: {len(lines)} gres.conf lines")
        for l in lines[:3]:
            print("  " + l)

        def cli() -> None:
            subprocess.run(argv, capture_output=True, env=env, timeout=120, check=True)

        def inproc() -> None:
            invs = inventory.load_all([str(root)])
            gres.render_gres_conf(gres.build(invs, "short", {}), naming="short")

        empty = [sys.executable, "-c", "pass"]
        report("python -c pass (interpreter floor)", timed(lambda: subprocess.run(empty, check=True), args.runs))
        cli_t = timed(cli, args.runs)
        report("slurm-gpu gres-conf --inventory DIR", cli_t)
        report("in-process load_all+build+render", timed(inproc, args.runs))
        verdict = "OK" if statistics.median(cli_t) <= 1.0 else "OVER TARGET"
        print(f"target <= 1000 ms median for the CLI: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
