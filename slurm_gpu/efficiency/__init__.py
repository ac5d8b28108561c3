"""Idle GPUs found while the job runs (docs/efficiency.md).

- sample.py: each GPU node samples its running jobs' GPUs into the node database (a timer).
- policy.py: the site's [efficiency] policy as a pure function of a job's samples and facts.
- mail.py: the message to the job's user, sent by SMTP or through a mail command.
- enforce.py: the decisions of one run (mail, cancel through Slurm), each recorded before it is acted on.
"""
