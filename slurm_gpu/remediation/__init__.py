"""The remediation loop: reset -> reboot through Slurm -> RMA for a node slurm-gpu drained
(docs/remediation.md).

A room of its own above hooks/: it acts on a node from `slurm-gpu remediate` (or the healthcheck
command with remediation.enabled), never from the prolog or epilog, so the hook path imports none
of it (.importlinter).  What a drain of the hook path needs stays below: the circuit breaker
(policy/breaker.py decides, hooks/breaker.py counts) and the node lock (hooks/nodelock.py).

- engine.py: one run: the lock, the episode's open steps, which step the node needs now.
- actions.py: the steps (reset, reboot, RMA) and how a step that did not cure climbs the ladder.
- verify.py: the healthcheck passes, the verification job's outcome, the resume.
- context.py: what a run works with (Env, Outcome, a GPU's attempts by serial) and what steps share.
- verifyjob.py: the verification job through Slurm (reservation, batch job, result).
- remedy.py: the fault -> remedy map.  budget.py: what a step may cost (resets, reboots, lemons).
"""
