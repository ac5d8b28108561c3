"""Slurm hostlist expressions: ``gpu[001-064,066]``, ``n[1-10],login1``, ``rack[1-2]-gpu[01-02]``.

``expand`` understands what Slurm writes and what admins type; ``compress`` writes the
short form.  The contract (property-tested): ``expand(compress(names))`` returns the
unique names in ``sort_key`` order.

Zero padding follows Slurm: a range's width is the length of its low bound, so
``[001-064]`` gives ``001``..``064`` and ``[1-10]`` gives ``1``..``10``.
"""
from __future__ import annotations

import re
from typing import Iterable, List, Optional, Tuple

MAX_NAMES = 1 << 20  # a typo like n[1-99999999] must fail fast, not eat the memory
_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_FORBIDDEN = set("[],") | set(" \t\r\n")


def _split_top(expr: str) -> List[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {expr!r}: nested '[' is not allowed")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {expr!r}: ']' without a matching '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"hostlist {expr!r}: '[' without a matching ']'")
    parts.append("".join(cur))
    return parts


SLURM_MAX_RANGE = 65536  # Slurm refuses one bracket range of more hosts (src/common/hostlist.c MAX_RANGE)
_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def count(expr: str) -> Optional[int]:
    """How many names ``expand`` would give (duplicates counted), without expanding.

    None when it does not parse (``expand`` then says why).  A bracket range of more than
    SLURM_MAX_RANGE hosts is a ValueError, as Slurm refuses it ("Too many hosts in range").
    """
    try:
        parts = _split_top(expr.strip())
    except ValueError:
        return None
    total = 0
    for part in parts:
        n_part = 1
        for body in _BRACKET.findall(part):
            n = 0
            for item in body.split(","):
                m = _RANGE.match(item.strip())
                if not m:
                    return None
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                if hi - lo + 1 > SLURM_MAX_RANGE:
                    raise ValueError(f"invalid node list {expr!r}: range {item.strip()!r} has {hi - lo + 1} hosts; "
                                     f"Slurm refuses more than {SLURM_MAX_RANGE} in one range")
                n += max(hi - lo + 1, 0)
            n_part *= n
        total += n_part
    return total


def _expand_ranges(body: str, expr: str) -> List[str]:
    out: List[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"hostlist {expr!r}: bad range {item!r} inside [...] (expected N or N-M, digits only)")
        lo_s, hi_s = m.group(1), m.group(2)
        lo, hi = int(lo_s), int(hi_s if hi_s is not None else lo_s)
        if hi < lo:
            raise ValueError(f"hostlist {expr!r}: range {item!r} runs backwards")
        if hi - lo + 1 > MAX_NAMES:
            raise ValueError(f"hostlist {expr!r}: range {item!r} has more than {MAX_NAMES} names")
        width = len(lo_s)
        out.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return out


def _expand_one(part: str, expr: str) -> List[str]:
    if not part:
        raise ValueError(f"hostlist {expr!r}: empty host name (stray comma?)")
    if any(c in part for c in " \t\r\n"):
        raise ValueError(f"hostlist {expr!r}: white space inside a host name")
    names = [""]
    i = 0
    while i < len(part):
        j = part.find("[", i)
        if j < 0:
            if "]" in part[i:]:
                raise ValueError(f"hostlist {expr!r}: ']' without a matching '['")
            names = [n + part[i:] for n in names]
            break
        if "]" in part[i:j]:
            raise ValueError(f"hostlist {expr!r}: ']' without a matching '['")
        k = part.find("]", j)
        if k < 0:
            raise ValueError(f"hostlist {expr!r}: '[' without a matching ']'")
        body = part[j + 1:k]
        if not body:
            raise ValueError(f"hostlist {expr!r}: empty brackets []")
        values = _expand_ranges(body, expr)
        prefix = part[i:j]
        if len(names) * len(values) > MAX_NAMES:
            raise ValueError(f"hostlist {expr!r}: expands to more than {MAX_NAMES} names")
        # Later brackets vary fastest, as Slurm prints rack[1-2]-gpu[01-02].
        names = [n + prefix + v for n in names for v in values]
        i = k + 1
    return names


def expand(expr: str) -> List[str]:
    """All host names of a hostlist expression, in the order written (duplicates kept)."""
    if not isinstance(expr, str):
        raise ValueError(f"hostlist must be a string, got {type(expr).__name__}")
    expr = expr.strip()
    if not expr:
        raise ValueError("hostlist is empty")
    out: List[str] = []
    for part in _split_top(expr):
        out.extend(_expand_one(part, expr))
        if len(out) > MAX_NAMES:
            raise ValueError(f"hostlist {expr!r}: expands to more than {MAX_NAMES} names")
    return out


def _split_name(name: str) -> Tuple[str, Optional[int], str]:
    m = _TRAILING_DIGITS.match(name)
    if not m:
        return name, None, ""
    return m.group(1), int(m.group(2)), m.group(2)


def sort_key(name: str) -> Tuple[str, int, int, str]:
    """Natural order: gpu2 before gpu10; names without a number first within a prefix."""
    prefix, num, digits = _split_name(name)
    if num is None:
        return (prefix, 0, -1, "")
    return (prefix, 1, num, digits)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"host name must be a non-empty string, got {name!r}")
    bad = _FORBIDDEN.intersection(name)
    if bad:
        raise ValueError(f"host name {name!r} contains {''.join(sorted(bad))!r}, which a hostlist cannot hold")


def compress(names: Iterable[str]) -> str:
    """The shortest-form hostlist of `names` (sorted naturally, duplicates dropped)."""
    uniq = set()
    for n in names:
        _check_name(n)
        uniq.add(n)
    ordered = sorted(uniq, key=sort_key)
    out: List[str] = []
    i = 0
    while i < len(ordered):
        prefix, num, digits = _split_name(ordered[i])
        if num is None:
            out.append(ordered[i])
            i += 1
            continue
        # Runs of consecutive numbers that one zero-padding width renders exactly.  On
        # expansion the width is the length of the low bound, so a run keeps the low
        # member's spelling; a later member joins only if it renders identically at that
        # width (07,08,09,10 join; 9 and 010 do not).
        runs: List[List] = []  # [lo, hi, width]
        while i < len(ordered):
            p, n, d = _split_name(ordered[i])
            if p != prefix or n is None:
                break
            if runs and n == runs[-1][1] + 1 and str(n).zfill(runs[-1][2]) == d:
                runs[-1][1] = n
            else:
                runs.append([n, n, len(d)])
            i += 1
        tokens = []
        for lo, hi, width in runs:
            lo_s, hi_s = str(lo).zfill(width), str(hi).zfill(width)
            tokens.append(lo_s if lo == hi else f"{lo_s}-{hi_s}")
        if len(tokens) == 1 and runs[0][0] == runs[0][1]:
            out.append(prefix + tokens[0])
        else:
            out.append(f"{prefix}[{','.join(tokens)}]")
    return ",".join(out)

