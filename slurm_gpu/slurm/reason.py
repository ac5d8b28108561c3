"""Drain reasons: the one-line, namespaced text slurm-gpu puts on a node it drains.

``slurm-gpu: <fault> [<context>]`` — what went wrong, and who/what noticed it.  The one grammar
of our reasons (docs/remediation.md, "Whose drain is it"): a reason is ours only when it starts
with ``slurm-gpu:`` AND ends in one of our exact contexts, optionally followed by the suffixes
slurmctld appends itself (`` : reboot issued``, `` : reboot complete``, `` : Not responding``):

  automatic  ``[healthcheck]``, ``[drain --unhealthy]``, ``[prolog job N]``, ``[epilog job N]``,
             ``[remediate]``, ``[remediate: <step>]``, each optionally ``; check <name>``
  manual     ``[manual by <admin>]`` (``slurm-gpu drain``: an admin's, never lifted automatically)

Anything else that says ``slurm-gpu:`` (an admin typing ``slurm-gpu: hold for vendor ticket 4711``,
a context we never write) is an admin's, and no flow of ours resumes it: ownership is never read
from the prefix alone.  An admin's "maintenance" drain or Slurm's own "Prolog error" is never
undone by us either.

Reasons are sanitised whatever the fault text contains (it may quote an NVML error string,
a process name or an admin's free text): no control characters or line breaks (they would
break ``scontrol -o`` / ``sinfo -R`` one-line output and log lines), collapsed whitespace and a
bounded length.  Shell metacharacters need no escaping — the reason travels as one argv
element (``Reason=<text>``), never through a shell — but they are harmless either way.

This module is imported by the prolog/epilog: standard library only.
"""
from __future__ import annotations

import re
from typing import Any, Optional

PREFIX = "slurm-gpu:"
ELLIPSIS = "\u2026"
MANUAL = "manual"  # context of drains an admin asked for: never auto-resumed by healthcheck
HEALTHCHECK = "healthcheck"
REMEDIATE = "remediate"  # context of the drains `slurm-gpu remediate` sets while it acts (docs/remediation.md)

CHECK_SEP = "; "  # between the context and the check it names: `[prolog job 7; check xid]`
RMA = "RMA:"  # the fault of remediate's drain for a board to replace: `slurm-gpu: RMA: GPU <serial> ... [remediate]`

_WS = re.compile(r"\s+")
_CHECK_NAME = re.compile(r"[^A-Za-z0-9_.-]")
_CHECK_AT_END = re.compile(r"(?:^|;\s*)check ([A-Za-z0-9_.-]+)$")
# The trailing [context], then whatever slurmctld appended (set_node_reason adds " : reboot issued",
# " : reboot complete", " : Not responding", ...: texts of its own without brackets or colons).
_CONTEXT_AT_END = re.compile(r"\[([^\[\]]*)\](?:\s+:\s+[^\[\]:]+?)*\s*$")
_CHECK_SUFFIX = r"(?:; check [A-Za-z0-9_.-]+)?"
# The contexts the hooks and remediate write (format_reason's callers); nothing else is automatic.
_AUTOMATIC = re.compile(r"(?:healthcheck|drain --unhealthy|(?:prolog|epilog) job \d+|"
                        r"remediate(?:: [a-z][a-z -]*[a-z])?)" + _CHECK_SUFFIX)
_MANUAL_CONTEXT = re.compile(MANUAL + r" by [^\[\];]+")
# Smallest sensible fault budget before we start shortening the context as well.
_MIN_FAULT = 24


def sanitize(text: Any) -> str:
    """One clean line: control/format/separator characters -> space, whitespace collapsed."""
    if text is None:
        return ""
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception:  # a hostile __str__ must not break a drain
            text = repr(type(text))
    import unicodedata  # here: 1 ms of every hook's start, and only a drain writes a reason
    out = []
    for ch in text:
        if ch in "\t\n\r\v\f":
            out.append(" ")
            continue
        cat = unicodedata.category(ch)
        # Cc: C0/C1 controls (incl. ESC, NUL, DEL); Cf: bidi overrides, zero-width;
        # Zl/Zp: U+2028/U+2029 line/paragraph separators; Cs: lone surrogates (not encodable);
        # Co/Cn: private use / unassigned.
        if cat in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
            out.append(" ")
        elif cat == "Zs":
            out.append(" ")
        else:
            out.append(ch)
    return _WS.sub(" ", "".join(out)).strip()


def _cut(text: str, budget: int) -> str:
    if budget <= 0:
        return ""
    if len(text) <= budget:
        return text
    if budget == 1:
        return ELLIPSIS
    return text[: budget - 1].rstrip() + ELLIPSIS


def format_reason(fault: str, context: str = "", max_len: int = 256, check: str = "") -> str:
    """``slurm-gpu: <fault> [<context>]``, sanitised and at most ``max_len`` characters.

    ``check``: the health check the drain is for, kept at the end of the context
    (``[healthcheck; check xid]``): the circuit breaker (policy/breaker.py) counts the nodes
    drained for one check from Slurm's node list with reason_check().

    A long fault is cut with '…' while the ``[context]`` is kept (it says who drained the
    node); only when even that does not fit is the context shortened too.  Never raises.
    """
    try:
        max_len = max(int(max_len), len(PREFIX) + 2)
    except Exception:
        max_len = 256
    try:
        f = sanitize(fault) or "unspecified fault"
        # Brackets in the context would confuse reason_context(); keep it a plain phrase.
        c = sanitize(context).replace("[", "(").replace("]", ")")
        tag = _CHECK_NAME.sub("", str(check or ""))
        if tag:
            c = f"{c}{CHECK_SEP if c else ''}check {tag}"
        head = PREFIX + " "
        if c:
            ctx_part = f" [{c}]"
            room = max_len - len(head) - len(ctx_part)
            if room < _MIN_FAULT:
                # Shorten the context so the fault keeps at least _MIN_FAULT characters.
                fault_room = min(len(f), _MIN_FAULT)
                ctx_room = max_len - len(head) - fault_room - 3  # " [" + "]"
                if ctx_room >= 1:
                    c = _cut(c, ctx_room)
                    ctx_part = f" [{c}]"
                else:
                    ctx_part = ""
                room = max_len - len(head) - len(ctx_part)
            return head + _cut(f, room) + ctx_part
        return head + _cut(f, max_len - len(head))
    except Exception:  # pragma: no cover - belt and braces: a drain must never fail on text
        return PREFIX + " unspecified fault"


def _context(reason: Optional[str]) -> str:
    """The trailing ``[context]`` of a text that starts with our prefix ('' when none), unvalidated."""
    if not reason or not isinstance(reason, str) or not reason.lstrip().startswith(PREFIX):
        return ""
    m = _CONTEXT_AT_END.search(reason)
    return m.group(1).strip() if m else ""


def is_automatic(reason: Optional[str]) -> bool:
    """A drain the hooks or remediate set: our prefix and one of our exact automatic contexts."""
    return bool(_AUTOMATIC.fullmatch(_context(reason)))


def is_manual(reason: Optional[str]) -> bool:
    """Our reason, set by an admin through ``slurm-gpu drain`` (context ``manual by <admin>``)."""
    return bool(_MANUAL_CONTEXT.fullmatch(_context(reason)))


def is_ours(reason: Optional[str]) -> bool:
    """A reason slurm-gpu wrote: an automatic one or a ``slurm-gpu drain`` (manual).  A text that merely
    starts with ``slurm-gpu:`` is not (an admin may type that prefix): the context decides."""
    return is_automatic(reason) or is_manual(reason)


def reason_context(reason: Optional[str]) -> str:
    """The trailing ``[context]`` of one of our reasons ('' when the reason is not ours)."""
    return _context(reason) if is_ours(reason) else ""


def reason_check(reason: Optional[str]) -> str:
    """The check one of our reasons names (``[... ; check xid]``), '' when none (older reasons, manual drains)."""
    m = _CHECK_AT_END.search(reason_context(reason))
    return m.group(1) if m else ""


def rma_reason(serial: str, fault: str) -> str:
    """remediate's drain for a board to replace: never lifted by a flow of ours (is_rma)."""
    return format_reason(f"{RMA} GPU {serial} {fault}", REMEDIATE)


def _fault(reason: Optional[str]) -> str:
    """What follows our prefix (the fault, then the context)."""
    text = (reason or "").lstrip()
    return text[len(PREFIX):].lstrip() if text.startswith(PREFIX) else ""


def is_rma(reason: Optional[str]) -> bool:
    """remediate's RMA drain (rma_reason): an automatic reason whose fault says RMA.  An admin's text
    that merely starts so (no context of ours, or `[manual by ...]`) is not."""
    return is_automatic(reason) and _fault(reason).startswith(RMA)


def owner(reason: Optional[str]) -> str:
    """Who holds one of our drains, in words for an admin: 'an admin (manual)', 'an RMA' (the board
    waits for replacement), 'remediate' (a step under way) or 'the hooks' (an automatic drain)."""
    if is_manual(reason):
        return "an admin (manual)"
    if is_rma(reason):
        return "an RMA"
    if reason_context(reason).startswith(REMEDIATE):
        return "remediate"
    return "the hooks"


def auto_resumable(reason: Optional[str]) -> bool:
    """A drain that ``healthcheck`` may lift once the GPUs are healthy again.

    Only our own automatic drains (healthcheck, prolog, epilog): an admin's manual
    ``slurm-gpu drain --reason ...`` stays until the admin runs ``slurm-gpu resume``, and
    so do remediate's own (a step under way, an RMA).
    """
    if not is_automatic(reason):
        return False
    # `slurm-gpu remediate` owns these: mid-step (context "remediate: reset") only its verification may
    # resume the node, and an RMA (fault "RMA: ...") waits for the board's replacement.
    return not (reason_context(reason).startswith(REMEDIATE) or is_rma(reason))
