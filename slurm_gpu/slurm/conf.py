"""The node's own Slurm configuration, read as slurmd reads it: which device is GPU GRES index k.

slurmd numbers a node's GPU GRES records (the indices in ``SLURM_JOB_GPUS``) in this order,
observed on Slurm 22.05.8 with ``slurmd -G`` (tests/integration/test_gresmap_slurmd.py
compares this module with it):

1. the types in the order of slurm.conf's ``NodeName=... Gres=gpu:a100:1,gpu:v100:2`` list;
2. within a type, gres.conf line order; ``File=/dev/nvidia[0-3]`` expands ascending into one
   record per file;
3. a ``MultipleFiles=`` line (a MIG slice: the GPU file plus its nvidia-caps files) is one record.

Device minors, type names' alphabetical order and the order of gres.conf lines across types
do not decide it.  With ``AutoDetect=nvml`` (and no explicit File= lines for the node) the
records are the GPUs NVML lists, in NVML order, each MIG device after its parent's earlier
ones; the type order of step 1 still applies (derived from the rule above: Debian's slurmd is
built without NVML, so this case is not observed here).

Standard library only: the prolog imports this on every job start.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.slurm import hostlist

# Slurm's own aliases (src/interfaces/gres.c): these spellings fill the same field.
GRES_KEY_ALIASES = {"files": "file", "cpus": "cores", "link": "links"}
# ... and which spelling Slurm reads when a line has both (s_p_get_string order in
# _parse_gres_config): Cores before CPUs, File before Files, Link before Links.
_GRES_KEY_PRECEDENCE = {"cores": ("cores", "cpus"), "file": ("file", "files"), "links": ("link", "links")}
# Every key gres.conf(5) knows (the _gres_options table plus NodeName), lower case.
GRES_KEYS = frozenset({"nodename", "autodetect", "count", "cpus", "cores", "file", "files", "flags", "link", "links",
                       "multiplefiles", "name", "type"})

_TOKEN = re.compile(r'\s*([A-Za-z][A-Za-z0-9_]*)\s*=\s*("[^"]*"|[^\s"]*)')
_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")
_CAPS = r"^/dev/nvidia-caps/nvidia-cap(\d+)$"  # MIG only: compiled (and cached by re) on first use
_MAX_INCLUDE_DEPTH = 8


class GresConfigError(InputError):
    """The node's slurm.conf/gres.conf cannot be read or does not describe its GPUs."""


class GresRecord(NamedTuple):
    """One GPU GRES record of this node, as slurmd numbers them (``index`` = Slurm's GPU index)."""

    index: int  # type: ignore[assignment]  # a field named like tuple's method
    type: str  # '' when untyped
    files: Tuple[str, ...]  # ('/dev/nvidia2',) or MIG: ('/dev/nvidia0', '.../nvidia-cap12', '.../nvidia-cap13')
    origin: str  # "gres.conf:7" or "autodetect"

    @property
    def gpu_minor(self) -> Optional[int]:
        m = _DEVICE.match(self.files[0]) if self.files else None
        return int(m.group(1)) if m else None

    @property
    def caps_minors(self) -> Tuple[int, ...]:
        return tuple(int(m.group(1)) for m in (re.match(_CAPS, f) for f in self.files[1:]) if m)

    @property
    def is_mig(self) -> bool:
        return bool(self.caps_minors)


# --------------------------------------------------------------------------- file syntax

def logical_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(first line number, line) as Slurm's parse_config.c _get_next_line() reads them.

    A '#' starts a comment unless escaped (an odd number of backslashes before it); a line
    ending in an odd number of backslashes (white space after them allowed) continues on the
    next one, joined where the backslash was, without adding a space; then every backslash
    escapes the character after it (``\\#`` is '#', ``\\\\`` is one backslash).
    """
    buf = ""
    start = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not buf:
            start = lineno
        line = _strip_comment(raw)
        body = line.rstrip()
        if (len(body) - len(body.rstrip("\\"))) % 2 == 1:
            buf += body[:-1]
            continue
        joined = _unescape(buf + line).strip()
        buf = ""
        if joined:
            yield start, joined
    if buf:
        joined = _unescape(buf).strip()
        if joined:
            yield start, joined


def _strip_comment(line: str) -> str:
    backslashes = 0
    for i, ch in enumerate(line):
        if ch == "#" and backslashes % 2 == 0:
            return line[:i]
        backslashes = backslashes + 1 if ch == "\\" else 0
    return line


def _unescape(line: str) -> str:
    if "\\" not in line:
        return line
    out: List[str] = []
    i = 0
    while i < len(line):
        if line[i] == "\\":
            i += 1
            if i >= len(line):
                break
        out.append(line[i])
        i += 1
    return "".join(out)


def gres_fields(pairs: Dict[str, str]) -> Dict[str, str]:
    """A gres.conf line's pairs with Slurm's aliases folded in: keys 'cores', 'file', 'links'."""
    out = {k: v for k, v in pairs.items() if k not in GRES_KEY_ALIASES and k not in ("cores", "file", "links")}
    for canon, spellings in _GRES_KEY_PRECEDENCE.items():
        for k in spellings:
            if k in pairs:
                out[canon] = pairs[k]
                break
    return out


def parse_pairs(line: str, where: str) -> Dict[str, str]:
    """``Key=value Key = "quoted value"`` -> {lowercased key: value}; anything else is an error."""
    out: Dict[str, str] = {}
    pos = 0
    while pos < len(line):
        m = _TOKEN.match(line, pos)
        if not m:
            rest = line[pos:].strip()
            if not rest:
                break
            raise GresConfigError(f"{where}: expected key=value, got {rest.split()[0]!r}",
                                  "Slurm config lines are space-separated key=value pairs")
        key, value = m.group(1).lower(), m.group(2)
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = value[1:-1]
        out[key] = value
        pos = m.end()
    return out


def _include_paths(arg: str, base_dir: str) -> List[str]:
    path = arg.strip().strip('"')
    if not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    if not any(c in path for c in "*?["):
        return [path]
    import glob  # only for a wildcard Include: fnmatch is not free on every job start
    return sorted(glob.glob(path))


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise GresConfigError(f"cannot read {path}: {e.strerror}",
                              "the hooks read slurm.conf and gres.conf to know which GPU is which") from None


def config_lines(path: str, depth: int = 0) -> Iterator[Tuple[str, str]]:
    """(where, logical line) of a Slurm config file with ``Include`` files inlined."""
    if depth > _MAX_INCLUDE_DEPTH:
        raise GresConfigError(f"{path}: Include nested more than {_MAX_INCLUDE_DEPTH} deep", "look for an Include loop")
    for lineno, line in logical_lines(_read(path)):
        head, _, rest = line.partition(" ")
        if head.lower() == "include" and rest.strip():
            for inc in _include_paths(rest, os.path.dirname(path)):
                yield from config_lines(inc, depth + 1)
            continue
        yield f"{path}:{lineno}", line


def _names(expr: str, where: str) -> List[str]:
    try:
        return hostlist.expand(expr)
    except ValueError as e:
        raise GresConfigError(f"{where}: {e}", "fix the NodeName= hostlist") from None


# --------------------------------------------------------------------------- slurm.conf

def node_gres_types(slurm_conf: str, node: str) -> List[str]:
    """The GPU types of ``node`` in its slurm.conf ``Gres=`` order ('' for untyped ``gpu:4``)."""
    defaults: Dict[str, str] = {}
    found: Optional[Dict[str, str]] = None
    for where, line in config_lines(slurm_conf):
        if not line.lower().startswith("nodename"):
            continue
        pairs = parse_pairs(line, where)
        names = pairs.get("nodename", "")
        if names.upper() == "DEFAULT":
            defaults.update({k: v for k, v in pairs.items() if k != "nodename"})
            continue
        if node in _names(names, where):
            found = dict(defaults)
            found.update(pairs)
            break
    if found is None:
        raise GresConfigError(f"{slurm_conf}: no NodeName line for {node}",
                              "is SLURM_CONF this cluster's slurm.conf, and SLURMD_NODENAME this node?")
    types: List[str] = []
    for name, typ, _count in parse_gres(found.get("gres", "")):
        if name.lower() == "gpu" and typ.lower() not in types:
            types.append(typ.lower())
    return types


# ---------------------------------------------------------------- GRES strings

_MULT = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4, "P": 1024 ** 5}


def gres_count(text: str) -> Optional[int]:
    """A GRES or TRES count as Slurm writes it ('4', '100K' = 102400), or None when it is none."""
    m = re.fullmatch(r"(\d+)([KMGTP]?)", text)
    return int(m.group(1)) * _MULT[m.group(2)] if m else None


def _split_gres(gres: str) -> List[str]:
    """Split at commas outside parentheses: 'gpu:a:2(IDX:0,2),mps:100' -> 2 items."""
    items: List[str] = []
    cur: List[str] = []
    depth = 0
    for ch in gres:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def parse_gres(gres: Optional[str]) -> List[Tuple[str, str, int]]:
    """Slurm GRES text -> [(name, type, count)].

    Handles ``gpu:h100:4(S:0-1)``, ``gpu:h100:2(IDX:0-1)``, ``gpu:4``, ``gpu`` (count 1),
    ``gres/gpu:h100=4`` / ``gres/gpu=2`` (TRES spelling), ``mps:100K``, lists thereof,
    and ``(null)`` / ``N/A`` / ``''`` (nothing).  Unparseable items are skipped.
    """
    out: List[Tuple[str, str, int]] = []
    if not gres or gres.strip() in ("(null)", "N/A", "none", "None"):
        return out
    for item in _split_gres(gres.strip()):
        item = re.sub(r"\(.*\)$", "", item).strip()  # drop (S:0-1) / (IDX:0-1)
        if item.startswith("gres/"):
            item = item[len("gres/"):]
        if item.startswith("gres:"):
            item = item[len("gres:"):]
        if "=" in item:  # TRES spelling: gpu:h100=4
            item = item.replace("=", ":", 1)
        parts = item.split(":")
        name = parts[0]
        if not name:
            continue
        typ, count = "", 1
        rest = parts[1:]
        if rest:
            n = gres_count(rest[-1])
            if n is not None:
                count = n
                rest = rest[:-1]
            elif len(rest) >= 2:
                continue  # name:type:<garbage>
            typ = ":".join(rest)
        out.append((name, typ, count))
    return out


# --------------------------------------------------------------------------- gres.conf

class _GresLine(NamedTuple):
    where: str
    type: str
    files: Tuple[str, ...]
    multiple: bool


def _gres_lines(gres_conf: str, node: str) -> Tuple[List[_GresLine], bool]:
    """This node's GPU lines of gres.conf, and whether AutoDetect=nvml applies to it."""
    lines: List[_GresLine] = []
    autodetect = False
    for where, line in config_lines(gres_conf):
        pairs = gres_fields(parse_pairs(line, where))
        if "nodename" in pairs and node not in _names(pairs["nodename"], where):
            continue
        if "autodetect" in pairs:
            # Slurm: a line of its own sets the global default, a NodeName= line this node's.
            autodetect = pairs["autodetect"].lower() == "nvml"
        if pairs.get("name", "").lower() != "gpu":
            continue
        typ = pairs.get("type", "").lower()
        if "multiplefiles" in pairs:
            files = tuple(f.strip() for f in pairs["multiplefiles"].split(",") if f.strip())
            lines.append(_GresLine(where, typ, files, True))
        elif "file" in pairs:
            try:
                files = tuple(hostlist.expand(pairs["file"]))
            except ValueError as e:
                raise GresConfigError(f"{where}: {e}", "fix the File= expression") from None
            lines.append(_GresLine(where, typ, files, False))
        else:
            # Count= without device files: slurmd has nothing to map to a device.
            lines.append(_GresLine(where, typ, (), False))
    return lines, autodetect


def _same_type(conf_type: str, item_type: str) -> bool:
    return conf_type == "" or item_type == conf_type


_MIG_PROFILE = r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+[a-z0-9.+]+)?$"  # MIG only: compiled on first use


def _detected_type(conf_type: str, detected: str) -> bool:
    """Does a slurm.conf type name this detected GPU (``autodetect_type`` of its NVML name)?

    Slurm takes a configured type that is a substring of the name AutoDetect derives.  For a
    MIG slice that name depends on the Slurm version (src/plugins/gpu/nvml/gpu_nvml.c): from
    23.02.6 the NVML profile (``nvidia_a100_3g.40gb``, ``..._1c.3g.40gb``, ``..._1g.10gb+me``),
    up to 23.02.5 GPU-instance slices and memory rounded to GiB (``nvidia_a100_3g.39gb``, also
    for the 1c. and +me variants).  The hooks do not know the version, so a configured MIG
    profile (the part after the last '_') matches the detected profile when it is spelled the
    same, or when it has the older form with the same GPU-instance slices and a memory within
    10 % (1 GB at least) of the profile's: distinct profiles of one slice count differ by 2x."""
    if conf_type == "" or conf_type in detected:
        return True
    conf = re.match(_MIG_PROFILE, conf_type.rsplit("_", 1)[-1])
    k = detected.rfind("_mig_")
    det = re.match(_MIG_PROFILE, detected[k + 5:] if k >= 0 else detected.rsplit("_", 1)[-1])
    if not conf or not det:
        return False
    if conf.group(0) == det.group(0):
        return True
    if conf.group(1) or conf.group(4) or conf.group(2) != det.group(2):
        return False
    gb_conf, gb_det = int(conf.group(3)), int(det.group(3))
    return abs(gb_conf - gb_det) <= max(1.0, 0.1 * gb_det)


def _order_by_type(types: Sequence[str], items: Sequence[Tuple[str, Tuple[str, ...], str]],
                   match: Callable[[str, str], bool] = _same_type, keep_unmatched: bool = False) -> List[GresRecord]:
    """Apply the observed numbering: slurm.conf type order, then the items' own order."""
    taken: List[int] = []
    for t in types or [""]:
        taken += [k for k, it in enumerate(items) if match(t, it[0]) and k not in taken]
    if keep_unmatched:
        taken += [k for k in range(len(items)) if k not in taken]
    ordered = [items[k] for k in taken]
    return [GresRecord(i, typ, files, origin) for i, (typ, files, origin) in enumerate(ordered)]


def node_gres_records(slurm_conf: str, node: str) -> Tuple[List[GresRecord], bool]:
    """(records in Slurm's index order, autodetect).  With autodetect the caller builds the
    records from NVML (``autodetect_records``); the list is then empty."""
    types = node_gres_types(slurm_conf, node)
    if not types:
        raise GresConfigError(f"{slurm_conf}: node {node} has no gpu in its Gres=",
                              "a job on it cannot have GPUs; is this the right slurm.conf?")
    gres_conf = os.path.join(os.path.dirname(slurm_conf), "gres.conf")
    if not os.path.exists(gres_conf):
        raise GresConfigError(f"{gres_conf} does not exist", "GPU GRES need a gres.conf beside slurm.conf")
    lines, autodetect = _gres_lines(gres_conf, node)
    if any(not ln.files for ln in lines):
        bad = next(ln for ln in lines if not ln.files)
        raise GresConfigError(f"{bad.where}: GPU line without File= or MultipleFiles=",
                              "give every GPU line its device files (or use AutoDetect=nvml)")
    if autodetect and not lines:
        return [], True
    items: List[Tuple[str, Tuple[str, ...], str]] = []
    for ln in lines:
        if ln.multiple:
            items.append((ln.type, ln.files, ln.where))
        else:
            items.extend((ln.type, (f,), ln.where) for f in ln.files)
    return _order_by_type(types, items), False


def autodetect_records(slurm_conf: str, node: str,
                       detected: Sequence[Tuple[str, Tuple[str, ...]]]) -> List[GresRecord]:
    """Records for AutoDetect=nvml from (type, files) in NVML order (see the module docstring)."""
    types = node_gres_types(slurm_conf, node)
    return _order_by_type(types, [(t, files, "autodetect") for t, files in detected], _detected_type, True)


def autodetect_type(name: str) -> str:
    """Slurm AutoDetect's Type= for an NVML name: lowercased, spaces to '_' ('NVIDIA H100 80GB HBM3')."""
    return re.sub(r"\s+", "_", name.strip().lower())


# --------------------------------------------------------------------------- MIG

def read_mig_minors(path: str) -> Dict[int, Tuple[int, int, Optional[int]]]:
    """/proc/driver/nvidia-caps/mig-minors -> {caps minor: (gpu minor, gpu instance, compute instance or None)}."""
    out: Dict[int, Tuple[int, int, Optional[int]]] = {}
    pat = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access$")
    for lineno, line in logical_lines(_read(path)):
        parts = line.split()
        m = pat.match(parts[0]) if len(parts) == 2 and parts[1].isdigit() else None
        if m:
            out[int(parts[1])] = (int(m.group(1)), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))
    return out
