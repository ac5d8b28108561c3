"""`slurm-gpu drain / resume / status / healthcheck`: admin control of node health.

Thin click shells over slurm_gpu.slurm.model (the Slurm adapter) and slurm_gpu.slurm.reason.  Exit codes
(docs/exit-codes.md): 0 done, 1 unhealthy (healthcheck / drain --unhealthy found a FAIL),
2 usage or config error, 4 Slurm error (slurmctld unreachable, unknown node), 6 refused
(resume of a node slurm-gpu did not drain, without --force).
"""
from __future__ import annotations

import getpass
import os
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import click

from slurm_gpu.cli import dry_run_option, node_name_option, nvml_lib_option, output_options, print_error
from slurm_gpu.config import Config
from slurm_gpu.errors import ExitCode, InputError
from slurm_gpu.slurm.model import BatchResult

HEALTHCHECK_DEADLINE_S = 45.0  # Slurm kills HealthCheckProgram after 60 s


# ------------------------------------------------------------------ shared helpers

def _admin_name() -> str:
    """Who asked: the sudo caller if any (Slurm records uid 0 for every sudo drain)."""
    for var in ("SUDO_USER", "LOGNAME", "USER"):
        v = os.environ.get(var)
        if v and v != "root":
            return v
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def this_node(explicit: Optional[str]) -> str:
    """--node-name, else SLURMD_NODENAME (set by slurmd for HealthCheckProgram), else the short host name."""
    from slurm_gpu.config import node_name
    return explicit or node_name()


DEFAULT_MAX_NODES = 1024  # config slurm_max_nodes


def _hostlist_size(expr: str) -> Optional[int]:
    """hostlist.count as a command's input error."""
    from slurm_gpu.slurm import hostlist
    try:
        return hostlist.count(expr)
    except ValueError as e:
        raise InputError(str(e),
                         "check the range for a typo, or split it into ranges of at most "
                         f"{hostlist.SLURM_MAX_RANGE} hosts") from None


def _apply(todo: List[str], dry_run: bool, change: Callable[[List[str]], Any]) -> Any:
    """One batched change of the nodes to change (nothing with --dry-run: reported as done)."""
    if dry_run or not todo:
        return BatchResult(done=list(todo) if dry_run else [])
    return change(todo)


def expand_nodes(args: Sequence[str], backend: Any = None, *, limit: Optional[int] = None,
                 command: str = "drain") -> List[str]:
    """Hostlist expressions (gpu[01-04,07], a,b) -> unique node names in the order given.

    With `limit`: more names than that (counted before anything is expanded) is an InputError
    whose hint says how to raise the limit.
    """
    from slurm_gpu.slurm.hostlist import expand
    sizes = [_hostlist_size(a) for a in args]
    if limit is not None and all(n is not None for n in sizes):
        total = sum(n for n in sizes if n is not None)
        if total > limit:
            shown = " ".join(args)
            if len(shown) > 80:
                shown = shown[:79] + "\u2026"
            raise InputError(f"{shown} names {total} nodes; one {command} may change at most {limit} (slurm_max_nodes)",
                             f"split the list, or raise the cap: --max-nodes {total} for this run, "
                             f"or slurm_max_nodes = {total} in the slurm-gpu config file")
    out: List[str] = []
    seen = set()
    for arg in args:
        try:
            names = expand(arg)
        except ValueError as e:
            raise InputError(f"invalid node list {arg!r}: {e}",
                             "use a Slurm hostlist such as gpu[01-04,07] or gpu01,gpu02") from None
        for n in names:
            if n not in seen:
                seen.add(n)
                out.append(n)
        if limit is not None and len(out) > limit:  # only where a list did not parse for counting
            raise InputError(f"the node list names more than {limit} nodes; one {command} may change at most {limit} "
                             f"(slurm_max_nodes)", "split the list, or raise the cap with --max-nodes N or slurm_max_nodes")
    return out


def _max_nodes(app: Any, override: Optional[int]) -> int:
    if override:
        return int(override)
    return int(getattr(app.config, "slurm_max_nodes", DEFAULT_MAX_NODES))


def _log(app: Any, what: str, node: Optional[str] = None):
    """The command's log (log.file's %n: `node` when given, a --node-name)."""
    from slurm_gpu.hooks.log import HookLog
    try:
        return HookLog.from_config(what, app.config.for_node(node) if node else app.config)
    except Exception:  # logging must never stop an admin action
        return HookLog(what, syslog_on=False)


def _backend(app: Any):
    from slurm_gpu.slurm.backend import get_backend
    return get_backend(app.config)


def _record_drains(app: Any, drains: List[Any]) -> None:
    """Every drain goes into this node's database (hooks/healthcheck.record_drains); a record that
    cannot be written is said in one line, the drain itself never depends on it."""
    from slurm_gpu.hooks.healthcheck import record_drains
    warning = record_drains(app.config, drains)
    if warning:
        click.echo(warning, err=True)


def _drain_row(node: str, source: str, reason: str, outcome: str, kept: Optional[str] = None) -> Any:
    from slurm_gpu.store.record import drain
    return drain(node, source, reason, outcome, time.time(), kept_reason=kept)


def _when(ts: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else ""


def _who(info: Any) -> str:
    bits = []
    if info.reason_user:
        bits.append(f"by {info.reason_user}")
    if info.reason_time:
        bits.append(f"since {_when(info.reason_time)}")
    return " ".join(bits)


_err_line = print_error  # one node's error in a batch: said, and the batch goes on


# ------------------------------------------------------------------ drain and resume: one batch of named nodes

MAX_NODES_HELP = (f"Allow up to N nodes in this run (default: slurm_max_nodes from the config, {DEFAULT_MAX_NODES} "
                  "if unset); more is refused before Slurm is asked.")


def _summary(total: int, parts: Sequence[Tuple[int, str]], dry_run: bool) -> None:
    if total > 1:
        said = ", ".join(f"{n} {what}" for n, what in parts if n)
        click.echo(f"summary{' (dry run)' if dry_run else ''}: {total} nodes: {said or 'nothing to do'}")


class _Batch(NamedTuple):
    """One drain or resume of named nodes: what was found, left alone, asked for and done."""

    names: List[str]
    look: Any  # NodeLookup
    left: Dict[str, str]  # node -> why the command leaves it alone, in the command's own word
    todo: List[str]  # the nodes to change, in the order given
    result: BatchResult

    @property
    def done(self) -> Set[str]:
        return set(self.result.done)

    @property
    def failed(self) -> int:
        return len(self.look.failed) + len(self.result.failed)

    @property
    def not_tried(self) -> int:
        return len(self.todo) - len(self.done) - len(self.result.failed)

    def with_outcome(self, outcome: str) -> List[str]:
        return [n for n in self.names if self.left.get(n) == outcome]


def _run_batch(backend: Any, names: List[str], dry_run: bool, left_alone: Callable[[Any], Optional[str]],
               change: Callable[[List[str]], Any]) -> _Batch:
    """Read the nodes in one lookup, sort out those to leave alone, change the rest in one batch."""
    look = backend.lookup_nodes(names)
    left: Dict[str, str] = {}
    todo: List[str] = []
    for name in names:
        if name in look.found:
            why = left_alone(look.found[name])
            if why:
                left[name] = why
            else:
                todo.append(name)
    return _Batch(names, look, left, todo, _apply(todo, dry_run, change))


def _say_batch(batch: _Batch, dry_run: bool, say: Callable[[str, Any, str], None]) -> None:
    """One line per node in the order given: errors said as errors, the rest through
    say(name, info, outcome) with outcome the left-alone word, 'would' (dry run) or 'done'."""
    done = batch.done
    for name in batch.names:
        if name in batch.look.failed:
            _err_line(batch.look.failed[name])
        elif name in batch.left or dry_run or name in done:
            say(name, batch.look.found[name], batch.left.get(name) or ("would" if dry_run else "done"))
        elif name in batch.result.failed:
            _err_line(batch.result.failed[name])
    if batch.result.stopped is not None:
        _err_line(batch.result.stopped)


def _log_batch(log: Any, event: str, done_key: str, batch: _Batch, dry_run: bool) -> None:
    if not dry_run and batch.todo:
        r = batch.result
        log.info(event, **{"nodes": len(batch.todo), done_key: len(batch.done), "failed": len(r.failed),
                           "requests": r.requests, "stopped": r.stopped.message if r.stopped else None})


# ------------------------------------------------------------------ drain

@click.command()
@click.argument("nodes", nargs=-1, metavar="[NODE]...")
@click.option("--reason", "-r", metavar="TEXT",
              help="Why (required unless --unhealthy). Stored as 'slurm-gpu: TEXT [manual by USER]'.")
@click.option("--unhealthy", is_flag=True,
              help="Check THIS node's GPUs and drain it only if a check FAILs (one-shot, for cron or by hand; never resumes).")
@node_name_option("With --unhealthy: this node's Slurm name (default: $SLURMD_NODENAME, else the short host name).")
@dry_run_option()
@click.option("--max-nodes", type=click.IntRange(1, 1 << 20), metavar="N", help=MAX_NODES_HELP)
@nvml_lib_option
@click.pass_obj
def drain(app, nodes, reason, unhealthy, node_name, dry_run, max_nodes):
    """Drain nodes with a slurm-gpu reason, so that `slurm-gpu resume` may lift it later.

    NODE accepts Slurm hostlists: gpu[01-04,07]. A node already drained by someone else keeps
    its reason (it is not overwritten, and so never becomes resumable by slurm-gpu).

    All named nodes are read with one `scontrol show node` and drained with one
    `scontrol update NodeName=<hostlist>`; one line per node, then a summary. More than
    slurm_max_nodes nodes (default 1024) is refused before Slurm is asked (--max-nodes N).

    \b
    Examples:
      slurm-gpu drain gpu07 --reason "GPU 3 replaced, burn-in pending"
      slurm-gpu drain 'gpu[001-128]' --reason "rack 7 power work" --dry-run
      slurm-gpu drain --unhealthy          # on a node: drain it if its GPUs FAIL
      slurm-gpu drain --unhealthy --node-name gpu07 --nvml-lib /opt/nvidia/lib64/libnvidia-ml.so.1
    \b
    Exit codes: 0 done (or nothing to do), 1 --unhealthy found a FAIL, 2 usage/config error
    (also: too many nodes), 4 Slurm error (unknown node, slurmctld unreachable).
    """
    if unhealthy:
        if nodes or reason:
            raise InputError("--unhealthy checks this node and writes its own reason: give neither NODE nor --reason",
                             "use --node-name NAME if this node's Slurm name is not its host name")
        _run_health(app, node_name, allow_resume=False, dry_run=dry_run, deadline_s=HEALTHCHECK_DEADLINE_S,
                    context="drain --unhealthy")
        return
    if node_name:
        raise InputError("--node-name is for --unhealthy; list the nodes to drain as arguments",
                         "slurm-gpu drain gpu01 --reason TEXT")
    if not nodes:
        raise InputError("no node given", "slurm-gpu drain NODE... --reason TEXT (or --unhealthy)")
    from slurm_gpu.slurm.reason import sanitize
    if not reason or not sanitize(reason):
        raise InputError("a drain needs a reason (--reason TEXT)", "say why, e.g. --reason \"GPU 3 ECC errors, RMA opened\"")
    sys.exit(int(_drain_nodes(app, nodes, reason, dry_run, max_nodes)))


def _drain_nodes(app: Any, nodes: Sequence[str], reason: str, dry_run: bool, max_nodes: Optional[int]) -> ExitCode:
    """`drain NODE... --reason TEXT`: one lookup, one batched drain, one line per node, a summary."""
    from slurm_gpu.policy.drain import KEEP, decide_drain
    from slurm_gpu.slurm.reason import MANUAL, format_reason
    admin = _admin_name()
    text = format_reason(reason, f"{MANUAL} by {admin}")
    names = expand_nodes(nodes, limit=_max_nodes(app, max_nodes), command="drain")
    backend = _backend(app)
    log = _log(app, "drain")
    # The one drain rule (policy/drain.py): a manual drain re-drains our own reason and never
    # replaces anyone else's.
    batch = _run_batch(backend, names, dry_run,
                       lambda info: "kept" if decide_drain(info, text, manual=True).action == KEEP else None,
                       lambda todo: backend.drain_many(todo, text))

    def say(name: str, info: Any, outcome: str) -> None:
        verb = "re-drain" if info.drained else "drain"
        if outcome == "kept":
            click.echo(f"{name}: already {info.state} {_who(info)}: {info.reason!r} - not ours, reason left as is")
        elif outcome == "would":
            click.echo(f"{name}: would {verb} ({info.state}): {text}")
        else:
            log.info("drain", node=name, reason=text, by=admin, was=info.state)
            click.echo(f"{name}: {verb}ed: {text}")

    _say_batch(batch, dry_run, say)
    if not dry_run:
        done, kept = batch.done, batch.with_outcome("kept")
        _record_drains(app, [_drain_row(n, MANUAL, text, "drained") for n in names if n in done]
                       + [_drain_row(n, MANUAL, text, "failed") for n in names if n in batch.result.failed]
                       + [_drain_row(n, MANUAL, text, "kept", batch.look.found[n].reason or "") for n in kept])
    _summary(len(names), [(len(batch.done), "would be drained" if dry_run else "drained"),
                          (len(batch.left), "left alone (drained by someone else)"), (batch.failed, "failed"),
                          (batch.not_tried, "not tried")], dry_run)
    _log_batch(log, "drain-batch", "drained", batch, dry_run)
    return ExitCode.SLURM_ERROR if (batch.failed or batch.result.stopped is not None) else ExitCode.OK


# ------------------------------------------------------------------ resume

@click.command()
@click.argument("nodes", nargs=-1, required=True, metavar="NODE...")
@click.option("--force", is_flag=True,
              help="Also resume nodes drained or downed by someone else (an admin, Slurm itself). Think twice.")
@dry_run_option()
@click.option("--max-nodes", type=click.IntRange(1, 1 << 20), metavar="N", help=MAX_NODES_HELP)
@click.pass_obj
def resume(app, nodes, force, dry_run, max_nodes):
    """Resume nodes that slurm-gpu drained.

    A node drained for another reason (an admin's 'maintenance', Slurm's 'Prolog error' or
    'Not responding', a reboot) is refused unless --force: one line per refused node names
    the reason and who set it. A node that is not drained is left as it is.

    All named nodes are read with one `scontrol show node` and resumed with one
    `scontrol update NodeName=<hostlist> State=RESUME`; one line per node, then a summary.
    More than slurm_max_nodes nodes (default 1024) is refused before Slurm is asked.

    \b
    Exit codes: 0 done (or nothing to do), 2 usage/config error (also: too many nodes),
    4 Slurm error, 6 at least one node refused.
    """
    names = expand_nodes(nodes, limit=_max_nodes(app, max_nodes), command="resume")
    backend = _backend(app)
    log = _log(app, "resume")
    admin = _admin_name()

    def left_alone(info: Any) -> Optional[str]:
        if not (info.drained or info.down):
            return "idle"
        return "refused" if not info.drained_by_us and not force else None

    def say(name: str, info: Any, outcome: str) -> None:
        if outcome == "idle":
            click.echo(f"{name}: not drained ({info.state}), nothing to do")
        elif outcome == "refused":
            click.echo(f"{name}: refused: {info.state} {_who(info)} with reason {info.reason or '(none)'!r}, "
                       f"not set by slurm-gpu (use --force to resume anyway)", err=True)
        elif outcome == "would":
            click.echo(f"{name}: would resume ({info.state}, reason: {info.reason or '(none)'})")
        else:
            log.info("resume", node=name, was=info.state, reason=info.reason, by=admin,
                     forced=force and not info.drained_by_us)
            click.echo(f"{name}: resumed (was {info.state}: {info.reason or 'no reason'})")

    batch = _run_batch(backend, names, dry_run, left_alone, backend.resume_many)
    _say_batch(batch, dry_run, say)
    refused = batch.with_outcome("refused")
    _summary(len(names), [(len(batch.done), "would be resumed" if dry_run else "resumed"),
                          (len(batch.with_outcome("idle")), "not drained"),
                          (len(refused), "refused (not drained by slurm-gpu)"), (batch.failed, "failed"),
                          (batch.not_tried, "not tried")], dry_run)
    _log_batch(log, "resume-batch", "resumed", batch, dry_run)
    slurm_failed = batch.failed or batch.result.stopped is not None
    sys.exit(int(ExitCode.SLURM_ERROR if slurm_failed else ExitCode.REFUSED if refused else ExitCode.OK))


# ------------------------------------------------------------------ status

STATUS_COLUMNS = ["node", "state", "gpus", "gpus_alloc", "drained_by", "reason", "reason_user", "since"]
STATUS_JSON_COLUMNS = ["node", "state", "states", "gpus_configured", "gpus_allocated", "gres", "gres_used",
                       "drained_by", "reason", "reason_user", "reason_time", "since"]


def status_rows(infos: Sequence[Any]) -> List[dict]:
    rows = []
    for i in infos:
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(i.reason_time)) if i.reason_time else None
        rows.append({
            "node": i.name, "state": i.state, "states": sorted(i.states),
            "gpus": i.gpus_configured, "gpus_alloc": i.gpus_allocated,
            "gpus_configured": i.gpus_configured, "gpus_allocated": i.gpus_allocated,
            "gres": i.gres, "gres_used": i.gres_used,
            "drained_by": i.drain_owner or None,
            "reason": i.reason or None, "reason_user": i.reason_user or None,
            "reason_time": i.reason_time, "since": since,
        })
    return rows


@click.command()
@click.argument("nodes", nargs=-1, metavar="[NODE]...")
@click.option("--all", "all_nodes", is_flag=True, help="Include nodes without GPUs.")
@output_options(["table", "csv", "json", "markdown"])
@click.option("--drained", "only_drained", is_flag=True, help="Only drained or down nodes.")
@click.pass_obj
def status(app, nodes, all_nodes, fmt, only_drained):
    """GPU nodes at a glance: state, GPUs configured/allocated, who drained them, why, since when.

    DRAINED_BY is 'slurm-gpu' (resumable with `slurm-gpu resume`), 'other' (an admin or
    Slurm itself: resume refuses it without --force) or empty. NODE accepts hostlists.

    \b
    Exit codes: 0 done, 2 usage/config error, 4 Slurm error.
    """
    from slurm_gpu.render import render
    backend = _backend(app)
    names = expand_nodes(nodes, backend) if nodes else None
    infos = backend.nodes(names)
    if names is None and not all_nodes:
        infos = [i for i in infos if i.gpus_configured > 0]
    if only_drained:
        infos = [i for i in infos if i.drained or i.down]
    rows = status_rows(infos)
    click.echo(render(rows, STATUS_JSON_COLUMNS if fmt == "json" else STATUS_COLUMNS, fmt))


# ------------------------------------------------------------------ healthcheck

def _run_health(app, node_name: Optional[str], *, allow_resume: bool, dry_run: bool, deadline_s: float,
                context: str = "healthcheck", checker: Optional[Callable] = None) -> None:
    from slurm_gpu.errors import ConfigError
    from slurm_gpu.hooks import healthcheck as H
    name = this_node(node_name)
    try:
        cfg = app.config.for_node(name)
    except ConfigError as e:
        _config_broken(app, e, name, dry_run=dry_run, deadline_s=deadline_s, context=context)
    backend = _backend(app)
    log = _log(app, "healthcheck", name)
    with H.taking_turns(cfg, name, deadline_s, log) as left_s:
        if left_s is None:
            _say_health(H.busy_outcome(name), log, name)
            sys.exit(0)
        outcome = H.healthcheck_cycle(cfg, backend, name, checker or H.default_checker(cfg), allow_resume=allow_resume,
                                      dry_run=dry_run, deadline_s=left_s, context=context, log=log,
                                      warn=lambda line: click.echo(line, err=True))
        _say_health(outcome, log, name)
        if outcome.action == "timeout":
            # A check thread may still sit inside the driver: do not let it hold up (or crash) the exit.
            os._exit(outcome.exit_code)
        if allow_resume and H.remediates(cfg, outcome, dry_run, checker):
            done = _remediate_after_check(cfg, backend, name, log)
            if done is not None and done.outcome == "resumed":
                sys.exit(0)
    sys.exit(outcome.exit_code)


def _remediate_after_check(cfg: Config, backend: Any, name: str, log: Any) -> Any:
    """healthcheck's remediation (remediation.enabled): its outcome, or None when it could not run (one line,
    logged; the healthcheck's own verdict, already given to Slurm, is the exit code).  With verify.enabled
    it runs as a `slurm-gpu remediate` of its own, in a session of its own: a verification job outlasts
    what slurmd allows a HealthCheckProgram, and slurmd must not kill it half-way."""
    from slurm_gpu.errors import SlurmGpuError
    from slurm_gpu.hooks import healthcheck as H
    from slurm_gpu.remediation.engine import run_on_node
    from slurm_gpu.remediation.verify import verify_enabled
    if verify_enabled(cfg):
        return _remediate_detached(cfg, name, log)
    try:
        done = run_on_node(cfg, backend, name, H.default_checker(cfg), log=log)
    except SlurmGpuError as e:
        log.error("remediate-failed", node=name, error=e.message)
        click.echo(f"slurm-gpu: error: remediation did not run: {e.message} (hint: {e.hint})", err=True)
        return None
    except Exception as e:  # the healthcheck's verdict must reach Slurm whatever remediation does
        log.error("remediate-failed", node=name, error=f"{type(e).__name__}: {e}")
        click.echo(f"slurm-gpu: error: remediation did not run: {type(e).__name__}: {e}", err=True)
        return None
    log.info("remediate", node=name, action=done.action, outcome=done.outcome, message=done.message)
    click.echo(done.message)
    return done


def _remediate_detached(cfg: Config, name: str, log: Any) -> None:
    import subprocess
    argv = [sys.executable, "-m", "slurm_gpu.cli"] + (["--config", cfg.path] if cfg.path else []) + \
        ["remediate", "--node-name", name]
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True, close_fds=True)
    except OSError as e:
        log.error("remediate-failed", node=name, error=str(e))
        click.echo(f"slurm-gpu: error: remediation did not start: {e}", err=True)
        return None
    log.info("remediate-detached", node=name, pid=child.pid)
    click.echo(f"{name}: remediation (with a verification job) handed to `slurm-gpu remediate` (pid {child.pid})")
    return None


def _config_broken(app: Any, e: Any, name: str, *, dry_run: bool, deadline_s: float, context: str) -> None:
    """One line for the admin, what the drain cycle did (hooks/healthcheck.broken_config_cycle), the config's exit code."""
    from slurm_gpu.hooks.healthcheck import broken_config_cycle
    line, done, error = broken_config_cycle(app.config_path, e, name, dry_run=dry_run, deadline_s=deadline_s,
                                            context=context, say=lambda text: click.echo(text, err=True))
    if done:
        click.echo(done)
    if error:
        click.echo(f"slurm-gpu: error: {error}", err=True)
    sys.exit(int(e.exit_code))


def _say_health(outcome: Any, log: Any, name: str) -> None:
    """The WARN and FAIL lines, the decision log's event and the one-line verdict."""
    for r in outcome.results:
        if getattr(r, "status", "") in ("WARN", "FAIL"):
            # A GPU's message already starts with its label ('GPU 1 (GPU-8f2c…) ...'): name it once.
            click.echo(f"{r.status:4}  {r.check:18}  {r.message if r.gpu_index is not None else 'node: ' + r.message}")
    level = "error" if outcome.action in ("timeout", "error") else "warning" if outcome.worst == "FAIL" else "info"
    log.event(outcome.action, level, node=name, status=outcome.worst, reason=outcome.reason or None,
              message=outcome.message)
    if outcome.action in ("timeout", "error"):
        click.echo(f"slurm-gpu: error: {outcome.message}", err=True)
    else:
        click.echo(outcome.message)
    sys.stdout.flush()
    sys.stderr.flush()


@click.command()
@node_name_option("This node's Slurm name (default: $SLURMD_NODENAME, set by slurmd; else the short host name).")
@dry_run_option("Check and print what would change; change nothing.")
@click.option("--deadline", "deadline_s", type=click.FloatRange(5, 3600), default=HEALTHCHECK_DEADLINE_S,
              show_default=True, help="Whole-run budget in seconds (Slurm kills HealthCheckProgram after 60 s).")
@nvml_lib_option
@click.pass_obj
def healthcheck(app, node_name, dry_run, deadline_s):
    """Check this node's GPUs and drain/resume it in Slurm: the HealthCheckProgram mode.

    On a FAIL the node is drained with 'slurm-gpu: <fault> [healthcheck; check <check>]' unless
    it is already drained (whoever drained it: an admin's reason is never overwritten) or the
    circuit breaker is open for the check: breaker.max_drained_pct of the node's partition
    drained for it within breaker.window_s (`slurm-gpu breaker`). When the GPUs are
    healthy again and the drain is slurm-gpu's own automatic one (healthcheck, prolog,
    epilog), the node is resumed. Drains by anyone else, and manual `slurm-gpu drain`s, are
    never touched. If the check does not finish in time nothing is changed.

    slurm.conf runs a program without arguments: use the `slurm-gpu-healthcheck` executable
    (docs/admin-guide.md).

    \b
    Exit codes: 0 healthy (WARN allowed; resumed if it was our drain), 1 FAIL (drained now,
    already drained or held by the breaker) or the check overran --deadline, 2 usage/config error,
    4 Slurm error (slurmctld unreachable, node unknown to Slurm).
    """
    _run_health(app, node_name, allow_resume=True, dry_run=dry_run, deadline_s=deadline_s)


def healthcheck_main() -> None:  # pragma: no cover - console entry `slurm-gpu-healthcheck`
    """HealthCheckProgram= takes a path and passes no arguments: this is `slurm-gpu healthcheck`."""
    from slurm_gpu.cli import main
    main(args=["healthcheck", *sys.argv[1:]], prog_name="slurm-gpu-healthcheck")
