"""Slurm hostlist expressions: ``gpu[001-064,066]``, ``n[1-10],login1``, ``rack[1-2]-gpu[01-02]``.

``expand`` reads them as Slurm does (src/common/hostlist.c, checked against
``scontrol show hostnames`` by tests/integration/test_hostlist_scontrol.py):

* zero padding: a range's width is the length of its low bound, so ``[001-064]`` gives
  ``001``..``064`` and ``[1-10]`` gives ``1``..``10``;
* order: names come in the order written, duplicates kept; with several bracket groups in
  one name the LAST group varies fastest, then the first, the second, ... (Slurm's
  ``_push_range_list`` recursion): ``a[1-2]b[3-4]c[5-6]`` starts ``a1b3c5 a1b3c6 a2b3c5``;
* one range of more than SLURM_MAX_RANGE (65,536) hosts is refused, as Slurm refuses it.

Deliberately more lenient than Slurm: text after the last ``]`` (``n[1-2]x`` gives ``n1x``,
``n2x``; scontrol says "Invalid hostlist"), which admins type and other tools accept.
Deliberately stricter: white space inside a name (Slurm splits on it) and unbalanced
brackets (``n[1-2``, which Slurm takes as a literal host name).

``compress`` writes the shortest form: per prefix one run per zero-padding width, an
unpadded run joining a padded one where it continues it (``n[098-101]``).  The contract
(property-tested): ``expand(compress(names))`` gives each unique name once, in ``sort_key``
order whenever no number is spelled two ways (``n1`` and ``n01``).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Tuple

MAX_NAMES = 1 << 20  # a typo like n[1-999][1-9999] must fail fast, not eat the memory
SLURM_MAX_RANGE = 65536  # Slurm refuses one bracket range of more hosts (src/common/hostlist.c MAX_RANGE)
_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")
_FORBIDDEN = set("[],") | set(" \t\r\n")


class RangeError(ValueError):
    """A bad item in an index-range list: kind is syntax | backwards | too-large | too-wide."""

    def __init__(self, kind: str, item: str, value: str = "") -> None:
        super().__init__(f"{kind}: {item!r}")
        self.kind, self.item, self.value = kind, item, value


_INDEX_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits only (str.isdigit takes '٣')


def split_index_ranges(text: str, strip: Optional[str] = None) -> List[Tuple[str, str, str]]:
    """'0-3,6' -> [('0-3', '0', '3'), ('6', '6', '6')]: the one parser of index-range lists.

    Used for SLURM_JOB_GPUS (slurm/jobenv.py), CPU lists (gres/inventory.py) and the bodies of
    hostlist brackets (here).  Items are stripped of ``strip`` (default: whitespace); digits are
    ASCII only and kept as text (zero padding matters to hostlists).  RangeError('syntax')."""
    out: List[Tuple[str, str, str]] = []
    for raw in text.split(","):
        item = raw.strip(strip)
        m = _INDEX_ITEM.fullmatch(item)
        if not m:
            raise RangeError("syntax", item)
        out.append((item, m.group(1), m.group(2) if m.group(2) is not None else m.group(1)))
    return out


def parse_index_ranges(text: str, *, strip: Optional[str] = None, max_value: Optional[int] = None,
                       max_span: Optional[int] = None) -> Tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6) in order of appearance, each index once; '' -> ().

    RangeError kinds: syntax (not N or N-M), too-large (an index over max_value; never int() on
    a huge digit string), backwards (N-M with M < N), too-wide (more than max_span + 1 indices)."""
    if not text.strip(strip):
        return ()
    out: Dict[int, None] = {}  # ordered and de-duplicated
    for item, lo_s, hi_s in split_index_ranges(text, strip):
        bounds = []
        for digits in (lo_s, hi_s):
            if max_value is not None and (len(digits) > len(str(max_value)) or int(digits) > max_value):
                raise RangeError("too-large", item, digits)
            bounds.append(int(digits))
        lo, hi = bounds
        if hi < lo:
            raise RangeError("backwards", item)
        if max_span is not None and hi - lo > max_span:
            raise RangeError("too-wide", item)
        out.update(dict.fromkeys(range(lo, hi + 1)))
    return tuple(out)


def _split_top(expr: str) -> List[str]:
    """Split on commas outside brackets."""
    parts: List[str] = []
    cur: List[str] = []
    depth = 0
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
            try:
                items = split_index_ranges(body)
            except RangeError:
                return None
            for item, lo_s, hi_s in items:
                lo, hi = int(lo_s), int(hi_s)
                if hi - lo + 1 > SLURM_MAX_RANGE:
                    raise ValueError(f"invalid node list {expr!r}: range {item!r} has {hi - lo + 1} hosts; "
                                     f"Slurm refuses more than {SLURM_MAX_RANGE} in one range")
                n += max(hi - lo + 1, 0)
            n_part *= n
        total += n_part
    return total


def _expand_ranges(body: str, expr: str) -> List[str]:
    out: List[str] = []
    for raw in body.split(","):
        try:
            ((item, lo_s, hi_s),) = split_index_ranges(raw)
        except RangeError:
            raise ValueError(f"hostlist {expr!r}: bad range {raw!r} inside [...] (expected N or N-M, digits only)") from None
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"hostlist {expr!r}: range {raw!r} runs backwards")
        if hi - lo + 1 > SLURM_MAX_RANGE:
            raise ValueError(f"hostlist {expr!r}: range {item!r} has {hi - lo + 1} hosts; "
                             f"Slurm refuses more than {SLURM_MAX_RANGE} in one range")
        width = len(lo_s)
        out.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return out


def _expand_one(part: str, expr: str) -> List[str]:
    if not part:
        raise ValueError(f"hostlist {expr!r}: empty host name (stray comma?)")
    if any(c in part for c in " \t\r\n"):
        raise ValueError(f"hostlist {expr!r}: white space inside a host name")
    texts: List[str] = []  # literal text between the bracket groups (len(groups) + 1 pieces)
    groups: List[List[str]] = []
    i = 0
    while True:
        j = part.find("[", i)
        if j < 0:
            if "]" in part[i:]:
                raise ValueError(f"hostlist {expr!r}: ']' without a matching '['")
            texts.append(part[i:])
            break
        if "]" in part[i:j]:
            raise ValueError(f"hostlist {expr!r}: ']' without a matching '['")
        k = part.find("]", j)
        if k < 0:
            raise ValueError(f"hostlist {expr!r}: '[' without a matching ']'")
        body = part[j + 1:k]
        if not body:
            raise ValueError(f"hostlist {expr!r}: empty brackets []")
        texts.append(part[i:j])
        groups.append(_expand_ranges(body, expr))
        i = k + 1
    total = 1
    for group in groups:
        total *= len(group)
    if total > MAX_NAMES:
        raise ValueError(f"hostlist {expr!r}: expands to more than {MAX_NAMES} names")
    if not groups:
        return [part]
    if len(groups) == 1:
        return [texts[0] + v + texts[1] for v in groups[0]]
    if len(groups) == 2:
        return [texts[0] + a + texts[1] + b + texts[2] for a in groups[0] for b in groups[1]]
    # Slurm's order: the last group varies fastest, then the first, the second, ... up to
    # the last but one, which varies slowest.
    order = [len(groups) - 1] + list(range(len(groups) - 1))  # fastest first
    out: List[str] = []
    for combo in _odometer([len(groups[g]) for g in order]):
        pick = [0] * len(groups)
        for pos, g in enumerate(order):
            pick[g] = combo[pos]
        out.append("".join(texts[n] + groups[n][pick[n]] for n in range(len(groups))) + texts[-1])
    return out


def _odometer(sizes: List[int]) -> Iterable[List[int]]:
    """All index tuples, sizes[0]'s index turning fastest."""
    if any(n == 0 for n in sizes):
        return
    idx = [0] * len(sizes)
    while True:
        yield idx
        pos = 0
        while pos < len(sizes):
            idx[pos] += 1
            if idx[pos] < sizes[pos]:
                break
            idx[pos] = 0
            pos += 1
        if pos == len(sizes):
            return


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
    """The shortest-form hostlist of `names` (duplicates dropped), prefixes in natural order."""
    uniq = set()
    for name in names:
        _check_name(name)
        uniq.add(name)
    ordered = sorted(uniq, key=sort_key)
    out: List[str] = []
    i = 0
    while i < len(ordered):
        prefix, num, _ = _split_name(ordered[i])
        if num is None:
            out.append(ordered[i])
            i += 1
            continue
        spelled: List[str] = []
        while i < len(ordered):
            p, n, d = _split_name(ordered[i])
            if p != prefix or n is None:
                break
            spelled.append(d)
            i += 1
        tokens = _runs(spelled)
        if len(tokens) == 1 and "-" not in tokens[0]:
            out.append(prefix + tokens[0])
        else:
            out.append(f"{prefix}[{','.join(tokens)}]")
    return ",".join(out)


def _runs(digit_strings: List[str]) -> List[str]:
    """Range tokens covering exactly these numbers, each spelled as given.

    On expansion a range's width is the length of its low bound.  A zero-padded number
    (``07``) fits only a range of its own width; an unpadded one (``10``) fits any range
    whose width is not longer than it.  So: one run per padding width, unpadded numbers in
    runs of their own, and an unpadded run that starts right where a padded run of width w
    ends (``099`` then ``100``) continues that run (``098-101``) instead of opening another.
    """
    padded: Dict[int, List[int]] = {}
    natural: List[int] = []
    for d in digit_strings:
        if len(d) > 1 and d[0] == "0":
            padded.setdefault(len(d), []).append(int(d))
        else:
            natural.append(int(d))
    nat_runs = _consecutive(sorted(natural))
    runs: List[Tuple[int, int, int]] = []  # (lo, hi, width)
    for width, values in padded.items():
        for lo, hi in _consecutive(sorted(values)):
            first_unpadded = 10 ** (width - 1)
            if hi == first_unpadded - 1:
                cont = next((r for r in nat_runs if r[0] == first_unpadded), None)
                if cont is not None:
                    nat_runs.remove(cont)
                    hi = cont[1]
            runs.append((lo, hi, width))
    runs += [(lo, hi, 1) for lo, hi in nat_runs]
    runs.sort(key=lambda r: (r[0], str(r[0]).zfill(r[2])))
    out = []
    for lo, hi, width in runs:
        lo_s, hi_s = str(lo).zfill(width), str(hi).zfill(width)
        out.append(lo_s if lo == hi else f"{lo_s}-{hi_s}")
    return out


def _consecutive(values: List[int]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for v in values:
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out
