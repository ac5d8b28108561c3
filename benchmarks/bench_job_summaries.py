"""Many jobs ending at once: do all their GPU summaries reach AdminComment, and how does slurmdbd fare?

    python3 benchmarks/bench_job_summaries.py [--jobs 100] [--gpus-per-node 50] [--batch 10]
                                              [--wait-s 10] [--before-s 15] [--keep]

Not run in CI (needs root, Slurm, MariaDB: what tests/integration needs).  It builds the testbed of
tests/integration/test_job_summary_slurm.py by hand: a real 2-node Slurm cluster (tests/testbed.py)
whose nodes run the real prolog/epilog on simulated GPUs (--gpus-per-node each, so that every job
holds a GPU of its own at the same time), whose slurmctld runs `slurm-gpu-epilog-ctld` as
EpilogSlurmctld (job_summary.wait_s = --wait-s, the hook deadline left at its default), a central
MariaDB of its own set up with `central init` and its GRANTs, and a thread playing the nodes' push
timer (`db push` of both node databases every second).  Then

1. one warm-up job: the pipeline works, and it is the "old job" whose `sacct` is timed;
2. --jobs 1-GPU jobs (arrays of --batch tasks, submitted batch after batch so that the prologs do
   not all start at once) that, once all run, read a common end instant from a file and sleep
   until it: they end together;
3. `sacct -j OLD -X -n -P` every ~0.5 s: --before-s seconds while the jobs run (before the burst)
   and from the end instant until every job's controller epilog has logged its outcome (during);
   CPU seconds of slurmdbd, its MariaDB and slurmctld over both phases (/proc/PID/stat);
4. prints the window in which the jobs ended (sacct End), how many got a summary in AdminComment
   (and how many partial), the time from job end to the summary's log line (1 s resolution both)
   split into end -> node epilog's record, end -> slurmctld starting the controller epilog (its
   wrapper notes the time) and that start -> summary, the sacct latencies, the CPU, and the count
   of each controller epilog and node hook outcome.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import simgpu  # noqa: E402
from mariadb import MariaDB  # noqa: E402
from testbed import SlurmTestbed  # noqa: E402

from slurm_gpu.store import summary as S  # noqa: E402
from tests.integration.test_hooks_slurm import Site, _script  # noqa: E402
from tests.integration.test_job_summary_slurm import Central, PushTimer  # noqa: E402

LOG_LINE = re.compile(r"^(\S+) pid=\d+ (\w+) (\S+) (\S+)(.*)$")
FINAL_CTLD = {"summary", "summary-skipped", "summary-failed", "deadline-exceeded", "internal-error"}


class BigSite(Site):
    """Site (tests/integration/test_hooks_slurm.py) with `per_node` simulated H100s per node, minors
    as the testbed's gres.conf names them (gpu01 0..n-1, gpu02 n..2n-1), distinct PCI bus ids."""

    def __init__(self, root: Path, per_node: int):
        self.per_node = per_node
        super().__init__(root)

    def reset(self) -> None:
        n = self.per_node
        self.minors = {"gpu01": list(range(n)), "gpu02": list(range(n, 2 * n))}
        for node, minors in self.minors.items():
            shutil.rmtree(self.root / node, ignore_errors=True)
            prof = simgpu.h100_sxm(n, seed=node)
            for i, (g, m) in enumerate(zip(prof["gpus"], minors)):
                g["minor"] = m
                g["pci_bus_id"] = f"00000000:{0x10 + i:02X}:00.0"
            simgpu.write_state(self.state(node), prof)
            (self.root / f"{node}.kmsg").write_text("")

    def node_config(self) -> str:
        """The tests' node config with the defaults where the tests tighten them for speed:
        busy_timeout_s and the prolog/epilog deadlines."""
        cfg = self.config().replace("busy_timeout_s = 1.0", "busy_timeout_s = 10.0")
        return re.sub(r"\[hooks\]\n(?:[a-z_]+ = [^\n]*\n)*", "", cfg)


def cpu_ticks(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


class SacctProbe:
    """`sacct -j JOB -X -n -P` every `every` s (start to start) in a thread: (start time, seconds, ok)."""

    def __init__(self, bed: SlurmTestbed, job: int, every: float = 0.5):
        self.argv = ["sacct", "-j", str(job), "-X", "-n", "-P"]
        self.env, self.every = dict(bed.env), every
        self.samples: List[Tuple[float, float, bool]] = []
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop_flag.is_set():
            t0 = time.time()
            try:
                r = subprocess.run(self.argv, env=self.env, capture_output=True, text=True, timeout=60)
                ok = r.returncode == 0 and bool(r.stdout.strip())
            except subprocess.TimeoutExpired:
                ok = False
            self.samples.append((t0, time.time() - t0, ok))
            self.stop_flag.wait(max(0.0, self.every - (time.time() - t0)))

    def between(self, a: float, b: float) -> List[float]:
        return [d for t, d, _ in self.samples if a <= t < b]

    def failures(self, a: float, b: float) -> int:
        return sum(1 for t, _, ok in self.samples if a <= t < b and not ok)


def log_events(path: Path) -> List[Tuple[float, str, str, str, Dict[str, str]]]:
    """(time, level, hook, event, fields) per line of a hook log."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        stamp, level, hook, event, rest = m.groups()
        fields = dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", rest))
        out.append((time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")), level, hook, event, fields))
    return out


def sacct_rows(bed: SlurmTestbed, ids: Sequence[str]) -> Dict[int, Dict[str, str]]:
    """{raw id: {JobID, State, End, AdminComment}} (allocations only)."""
    r = bed.run("sacct", "-X", "-n", "-P", "-j", ",".join(ids), "--format=JobIDRaw,JobID,State,End,AdminComment",
                timeout=120)
    rows = {}
    for line in r.stdout.splitlines():
        parts = line.split("|", 4)
        if len(parts) == 5 and parts[0].isdigit():
            rows[int(parts[0])] = dict(zip(("JobID", "State", "End", "AdminComment"), parts[1:]))
    return rows


def epoch(slurm_time: str) -> Optional[float]:
    try:
        return time.mktime(time.strptime(slurm_time, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def stats(xs: Sequence[float], unit: str = "s", scale: float = 1.0) -> str:
    if not xs:
        return "n/a"
    return (f"median {statistics.median(xs) * scale:.2f} {unit}, max {max(xs) * scale:.2f} {unit} "
            f"(n={len(xs)})")


def wait_for(what: str, test, timeout: float, every: float = 1.0) -> None:
    end = time.monotonic() + timeout
    while not test():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def run(args: argparse.Namespace, work: Path) -> None:
    site = BigSite(work / "site", args.gpus_per_node)
    server = MariaDB(work / "central")
    server.start()
    bed: Optional[SlurmTestbed] = None
    try:
        central = Central(server, work)
        ctld_cfg, ctld_log = work / "ctld.toml", work / "ctld.log"
        wrapper = work / "epilog-ctld.sh"
        # The wrapper also notes when slurmctld started it (the hook logs only its outcome).
        wrapper.write_text(f'#!/bin/sh\necho "$(date +%s.%N) $SLURM_JOB_ID" >> {work / "ctld-start.log"}\n'
                           f"SLURM_GPU_CONFIG={ctld_cfg} exec {_script('slurm-gpu-epilog-ctld')}\n")
        os.chmod(wrapper, 0o755)
        bed = SlurmTestbed(work / "cluster", gpus_per_node=args.gpus_per_node, prolog=_script("slurm-gpu-prolog"),
                           epilog=_script("slurm-gpu-epilog"), slurm_gpu_config=site.node_config(),
                           prolog_epilog_timeout=90, epilog_slurmctld=str(wrapper))
        ctld_cfg.write_text(central.reporter.read_text().replace(
            "[central]", f'slurm_conf = "{bed.slurm_conf}"\n[job_summary]\nwait_s = {args.wait_s}\n'
                         f'[log]\nsyslog = false\nfile = "{ctld_log}"\n[central]'))
        os.chmod(ctld_cfg, 0o644)
        t0 = time.monotonic()
        bed.start()
        print(f"testbed up in {time.monotonic() - t0:.0f} s: 2 nodes x {args.gpus_per_node} simulated GPUs, "
              f"job_summary.wait_s = {args.wait_s}, work directory {work}", flush=True)
        daemons = {name: bed._daemons[name].pid for name in ("slurmdbd", "mariadbd", "slurmctld")}
        with PushTimer(central, site, bed):
            burst(args, bed, site, ctld_log, daemons)
    finally:
        if bed is not None:
            bed.stop()
        server.cleanup()


def burst(args: argparse.Namespace, bed: SlurmTestbed, site: BigSite, ctld_log: Path, daemons: Dict[str, int]) -> None:
    # 1. the old job
    old = bed.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:1"])
    assert bed.wait_job(old, timeout=120) == "COMPLETED"
    wait_for("the warm-up job's summary", lambda: sacct_rows(bed, [str(old)]).get(old, {}).get("AdminComment"), 90)
    first = S.decode(sacct_rows(bed, [str(old)])[old]["AdminComment"])
    print(f"warm-up job {old}: summary written (partial={int(first.partial)}, {len(first.gpus)} GPU)", flush=True)

    # 2. the jobs: wait for a common end instant (ns since the epoch) in a file, then sleep until it
    flag = bed.jobs_dir / "end-at"
    script = (f"F={flag}\nwhile [ ! -s $F ]; do sleep 2; done\n"
              "d=$(( $(cat $F) - $(date +%s%N) ))\n"
              "if [ $d -gt 0 ]; then sleep $(printf '%d.%09d' $((d / 1000000000)) $((d % 1000000000))); fi\n")
    arrays: List[int] = []
    t_submit = time.monotonic()
    for first in range(0, args.jobs, args.batch):
        n = min(args.batch, args.jobs - first)
        arrays.append(bed.sbatch(script, args=["-p", "gpu", "--gres=gpu:1", f"--array=0-{n - 1}"]))
        want = first + n
        wait_for(f"{want} jobs running", lambda: running(bed) >= want and prolog_passes(site) >= want + 1, 180, 0.5)
    print(f"{args.jobs} jobs running ({len(arrays)} arrays) after {time.monotonic() - t_submit:.0f} s", flush=True)
    # slurmdbd learns of the tasks' starts a moment later
    wait_for("sacct to list every job", lambda: len(sacct_rows(bed, [str(a) for a in arrays])) >= args.jobs, 60)
    ids = sorted(sacct_rows(bed, [str(a) for a in arrays]))

    # 3. before the burst, then the burst
    probe = SacctProbe(bed, old)
    end_at = time.time() + 3 + args.before_s  # the jobs poll the file every 2 s
    tmp = flag.with_suffix(".tmp")
    tmp.write_text(f"{int(end_at * 1e9)}\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, flag)
    probe.thread.start()
    before_from = time.time() + 3
    time.sleep(max(0.0, before_from - time.time()))
    cpu0 = {k: cpu_ticks(p) for k, p in daemons.items()}
    time.sleep(max(0.0, end_at - time.time()))
    cpu1 = {k: cpu_ticks(p) for k, p in daemons.items()}
    want = set(ids)

    def all_logged() -> bool:
        return want <= {int(f.get("job", "0")) for _, _, hook, ev, f in log_events(ctld_log)
                        if hook == "epilog_ctld" and ev in FINAL_CTLD and f.get("job", "").isdigit()}
    try:
        wait_for("every job's controller epilog outcome", all_logged, args.wait_s + 180, 0.5)
    except TimeoutError as e:
        print(f"!! {e}", flush=True)
    during_to = time.time()
    cpu2 = {k: cpu_ticks(p) for k, p in daemons.items()}
    time.sleep(1.0)
    probe.stop_flag.set()
    probe.thread.join(timeout=70)

    # 4. results
    rows = sacct_rows(bed, [str(a) for a in arrays])
    ends = {j: epoch(r["End"]) for j, r in rows.items()}
    valid_ends = [e for e in ends.values() if e is not None]
    states = collections.Counter(r["State"].split()[0] for r in rows.values())
    written = partial = foreign = 0
    for r in rows.values():
        c = r["AdminComment"]
        if not c:
            continue
        if not S.is_ours(c):
            foreign += 1
            continue
        written += 1
        partial += int(S.decode(c).partial)
    events = log_events(ctld_log)
    outcome = collections.Counter(ev for _, _, hook, ev, f in events if hook == "epilog_ctld" and f.get("job", "").isdigit()
                                  and int(f["job"]) in want)
    lat = [t - ends[int(f["job"])] for t, _, hook, ev, f in events
           if hook == "epilog_ctld" and ev == "summary" and f.get("job", "").isdigit() and ends.get(int(f["job"]))]
    started = {}
    start_log = ctld_log.with_name("ctld-start.log")
    for line in (start_log.read_text().splitlines() if start_log.exists() else []):
        t, _, job = line.partition(" ")
        if job.strip().isdigit() and int(job) in want:
            started[int(job)] = float(t)
    summary_at = {int(f["job"]): t for t, _, hook, ev, f in events
                  if hook == "epilog_ctld" and ev == "summary" and f.get("job", "").isdigit()}
    to_start = [started[j] - ends[j] for j in started if ends.get(j)]
    start_to_summary = [summary_at[j] - started[j] for j in started if j in summary_at]
    record_lat = [t - ends[int(f["job"])] for node in ("gpu01", "gpu02")
                  for t, _, hook, ev, f in log_events(site.root / node / "hooks.log")
                  if hook == "epilog" and ev == "record" and f.get("job", "").isdigit() and ends.get(int(f["job"]))]
    node_outcomes = collections.Counter(f"{hook} {ev}" for node in ("gpu01", "gpu02")
                                        for _, _, hook, ev, f in log_events(site.root / node / "hooks.log")
                                        if f.get("job", "").isdigit() and int(f["job"]) in want)
    tick = os.sysconf("SC_CLK_TCK")
    before_s, during_s = end_at - before_from, during_to - end_at
    print()
    print(f"jobs: {len(rows)} {dict(states)}; End window {max(valid_ends) - min(valid_ends):.0f} s "
          f"({time.strftime('%H:%M:%S', time.localtime(min(valid_ends)))}-"
          f"{time.strftime('%H:%M:%S', time.localtime(max(valid_ends)))}, 1 s resolution; end instant "
          f"{time.strftime('%H:%M:%S', time.localtime(end_at))}.{int(end_at % 1 * 10)})")
    print(f"summaries in AdminComment: {written}/{len(rows)} ({partial} partial, {foreign} foreign, "
          f"{len(rows) - written - foreign} none)")
    print(f"job End -> summary log line: {stats(lat)}")
    print(f"controller epilog outcomes: {dict(outcome)}")
    print(f"  job End -> node epilog's record line: {stats(record_lat)}")
    print(f"  job End -> slurmctld starts the controller epilog: {stats(to_start)}")
    print(f"  controller epilog start -> summary log line: {stats(start_to_summary)}")
    print(f"node hook outcomes: {dict(node_outcomes)}")
    print(f"sacct -j {old} -X -n -P before ({before_s:.0f} s): {stats(probe.between(before_from, end_at), 'ms', 1000)}"
          f", failures {probe.failures(before_from, end_at)}")
    print(f"sacct -j {old} -X -n -P during ({during_s:.0f} s, end instant -> last controller epilog outcome): "
          f"{stats(probe.between(end_at, during_to), 'ms', 1000)}, failures {probe.failures(end_at, during_to)}")
    for k in daemons:
        b, d = (cpu1[k] - cpu0[k]) / tick, (cpu2[k] - cpu1[k]) / tick
        print(f"{k} CPU: before {b:.2f} s ({100 * b / before_s:.0f} %), during {d:.2f} s "
              f"({100 * d / max(during_s, 1e-9):.0f} %)")
    print(f"load average now: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")


def running(bed: SlurmTestbed) -> int:
    return len(bed.run("squeue", "-h", "-t", "R", "-o", "%A").stdout.split())


def prolog_passes(site: BigSite) -> int:
    return sum(site.log(node).count(" prolog pass job=") for node in ("gpu01", "gpu02"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--gpus-per-node", type=int, default=50, help="simulated GPUs per node (at most 64)")
    ap.add_argument("--batch", type=int, default=10, help="array tasks per submission")
    ap.add_argument("--wait-s", type=float, default=10.0, help="job_summary.wait_s of the controller epilog")
    ap.add_argument("--before-s", type=float, default=15.0, help="sacct timing before the burst")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args(argv)
    if args.jobs > 2 * args.gpus_per_node:
        ap.error("--jobs must not exceed 2 x --gpus-per-node (every job holds a GPU at the same time)")
    work = Path(tempfile.mkdtemp(prefix="slurm-gpu-bench-jobsum-", dir="/tmp"))
    os.chmod(work, 0o755)
    try:
        run(args, work)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
