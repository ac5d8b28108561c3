"""gres.conf from GPU inventories: type naming, per-node records, grouping, rendering, --check.

What the lines mean follows Slurm's gres.conf(5) and what AutoDetect=nvml (gpu_nvml.c)
would find on the node:

* ``Type=``: AutoDetect's naming (NVML name lower-cased, spaces to '_') or short names
  (``h100``); the config's ``gres.type_map`` wins over both.  MIG devices get
  ``<gpu type up to the first '-'>_<profile>`` (``nvidia_a100_3g.20gb``), as AutoDetect does.
* ``File=/dev/nvidia<minor>``; a MIG device gets ``MultipleFiles=`` with the parent GPU
  file and the GPU- and compute-instance nvidia-caps files.
* ``Cores=``: Slurm's abstract core ids of the GPU's CPU affinity.
* ``Links=``: direct NvLink counts to each GPU in PCI-bus order, -1 for itself; only when
  the node has direct GPU-GPU links (NVSwitch-only and PCIe nodes give all zeros, which
  carries no information, so the lines stay compressible).

Nodes with equal records share one line: ``NodeName=gpu[001-064,066]``.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from . import hostlist
from .errors import InputError
from .inventory import Inventory, InventoryError, format_cpulist, parse_cpulist

NAMINGS = ("autodetect", "short")
_TYPE_OK = re.compile(r"^[A-Za-z0-9_.+\-]+$")

# Short names for the data-centre GPUs a Slurm site meets.  Anything else needs a
# gres.type_map entry: a guessed name would end up in users' job scripts.
_SHORT = re.compile(
    r"(?<![A-Za-z0-9])(GB200|GH200|B200|B100|H200|H100|H800|H20|A100|A800|A40|A30|A16|A10G|A10|A2|"
    r"L40S|L40|L4|V100S|V100|T4|P100|P40|P4)(?![A-Za-z0-9])",
    re.IGNORECASE,
)


class UnknownGpuType(InputError):
    pass


class GroupMismatch(InputError):
    pass


# --- type naming ---------------------------------------------------------------------------

def autodetect_type(name: str) -> str:
    """Slurm AutoDetect=nvml: the NVML name, lower case, spaces as underscores."""
    return name.strip().lower().replace(" ", "_")


def _check_type(t: str, origin: str) -> str:
    if not _TYPE_OK.match(t):
        raise InputError(f"GPU type {t!r} ({origin}) is not usable in gres.conf / slurm.conf",
                         "use letters, digits and _ . + - only (no spaces, ':' or ',')")
    return t


def gpu_type(name: str, naming: str, type_map: Mapping[str, str], where: str = "") -> str:
    if name in type_map:
        return _check_type(type_map[name], f"gres.type_map[{name!r}]")
    if naming == "autodetect":
        return _check_type(autodetect_type(name), f"NVML name {name!r}")
    m = _SHORT.search(name)
    if not m:
        raise UnknownGpuType(f"{where}no short type name known for GPU {name!r}",
                             f"add it to the config: [gres.type_map] \"{name}\" = \"<type>\", or use --type-naming autodetect")
    return m.group(1).lower()


def mig_type(parent_name: str, mig_name: str, profile: str, naming: str, type_map: Mapping[str, str], where: str = "") -> str:
    if mig_name and mig_name in type_map:
        return _check_type(type_map[mig_name], f"gres.type_map[{mig_name!r}]")
    if parent_name in type_map:
        base = type_map[parent_name]
    elif naming == "autodetect":
        # AutoDetect cuts the GPU name at the first '-' before adding the profile.
        base = autodetect_type(parent_name).split("-", 1)[0]
    else:
        base = gpu_type(parent_name, naming, type_map, where)
    return _check_type(f"{base}_{profile}", f"MIG device of {parent_name!r}")


# --- records -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Record:
    """One gres.conf line without its NodeName."""

    type: str
    files: Tuple[str, ...]  # File= (one or a compressed range) or the MultipleFiles= list
    multiple: bool = False
    cores: str = ""
    links: str = ""

    def render(self) -> str:
        parts = ["Name=gpu", f"Type={self.type}"]
        if self.multiple:
            parts.append("MultipleFiles=" + ",".join(self.files))
        else:
            parts.append("File=" + (self.files[0] if len(self.files) == 1 else _compress_files(self.files)))
        if self.cores:
            parts.append(f"Cores={self.cores}")
        if self.links:
            parts.append(f"Links={self.links}")
        return " ".join(parts)


def _compress_files(files: Sequence[str]) -> str:
    return hostlist.compress(files)


def node_records(inv: Inventory, naming: str, type_map: Mapping[str, str]) -> Tuple[Record, ...]:
    where = f"node {inv.hostname}: "
    devs = inv.devices()
    any_mig = any(d.mig_enabled for d in devs)
    # Links only where they say something: a direct GPU-GPU NvLink somewhere on the node,
    # and no MIG (MIG devices have no NvLink and change what the positions would mean).
    with_links = not any_mig and any(x > 0 for d in devs for x in inv.links(d))
    per_gpu: List[Record] = []
    for d in devs:
        cores = format_cpulist(d.cores)
        gpu_file = f"/dev/nvidia{d.minor}"
        if d.mig_enabled:
            for m in d.mig_devices:
                per_gpu.append(Record(
                    mig_type(d.name, m.name, m.profile, naming, type_map, where),
                    (gpu_file, f"/dev/nvidia-caps/nvidia-cap{m.gi_cap_minor}", f"/dev/nvidia-caps/nvidia-cap{m.ci_cap_minor}"),
                    multiple=True, cores=cores))
        else:
            links = ",".join(str(x) for x in inv.links(d)) if with_links else ""
            per_gpu.append(Record(gpu_type(d.name, naming, type_map, where), (gpu_file,), cores=cores, links=links))
    return _merge(per_gpu)


def node_notes(inv: Inventory, records: Sequence[Record]) -> Tuple[str, ...]:
    out = []
    mig = any(g.mig_enabled for g in inv.gpus)
    if not mig and any(inv.switch_links(g) for g in inv.gpus) and not any(r.links for r in records):
        out.append("NvLink through NVSwitch only: every GPU pair is equally connected, so no Links=")
    if mig:
        out.append("MIG: one line per MIG device; the GPU file plus its GPU/compute instance nvidia-caps files")
    return tuple(out)


def _minor(path: str) -> int:
    return int(path[len("/dev/nvidia"):])


def _merge(records: List[Record]) -> Tuple[Record, ...]:
    """Fold neighbouring single-GPU lines of one type and core set into File=/dev/nvidia[0-3].

    Only neighbours, and only with rising minors, so the device order Slurm derives from
    the file does not change; never lines with Links= (those must name one device).
    """
    out: List[Record] = []
    for r in records:
        prev = out[-1] if out else None
        if (prev is not None and not r.multiple and not prev.multiple and not r.links and not prev.links
                and r.type == prev.type and r.cores == prev.cores
                and _minor(r.files[0]) > _minor(prev.files[-1])):
            out[-1] = Record(prev.type, prev.files + r.files, cores=prev.cores)
        else:
            out.append(r)
    return tuple(out)


# --- grouping ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Group:
    nodes: Tuple[str, ...]
    records: Tuple[Record, ...]
    notes: Tuple[str, ...] = ()  # comment lines for the admin reading the file

    @property
    def nodelist(self) -> str:
        return hostlist.compress(self.nodes)

    def type_counts(self) -> List[Tuple[str, int]]:
        counts: Dict[str, int] = {}
        for r in self.records:
            counts[r.type] = counts.get(r.type, 0) + (1 if r.multiple else len(r.files))
        return list(counts.items())


def _first_difference(a: Any, b: Any, path: str = "") -> Tuple[str, Any, Any]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return (f"{path} (count)" if path else "count", len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return (path, a, b)


def check_declared_groups(invs: Sequence[Inventory], groups: Sequence[str]) -> None:
    """Every node of a declared hostlist must have the same hardware as the group's majority."""
    by_host = {i.hostname: i for i in invs}
    for expr in groups:
        try:
            members = hostlist.expand(expr)
        except ValueError as e:
            raise InputError(f"--group: {e}", "write a Slurm hostlist, e.g. gpu[001-064]") from None
        missing = [h for h in members if h not in by_host]
        if missing:
            raise GroupMismatch(f"group {expr}: no inventory for node(s) {hostlist.compress(missing)}",
                                "collect `slurm-gpu inventory` from those nodes, or narrow --group")
        facts = {h: by_host[h].hardware_facts() for h in members}
        tally: Dict[str, List[str]] = {}
        for h in members:
            tally.setdefault(repr(facts[h]), []).append(h)
        if len(tally) == 1:
            continue
        majority = max(tally.values(), key=len)
        ref = majority[0]
        odd = sorted((h for k, hs in tally.items() if hs is not majority for h in hs), key=hostlist.sort_key)
        field, want, got = _first_difference({"gpus": facts[ref]}, {"gpus": facts[odd[0]]})
        more = f" (and {len(odd) - 1} more: {hostlist.compress(odd[1:])})" if len(odd) > 1 else ""
        raise GroupMismatch(
            f"group {expr}: node {odd[0]} ({by_host[odd[0]].source or 'inventory'}) differs from {ref}: "
            f"{field}: {got!r} instead of {want!r}{more}",
            "fix the node's hardware/MIG setup, or move it out of the --group hostlist")


def group_nodes(invs: Sequence[Inventory], naming: str, type_map: Mapping[str, str]) -> List[Group]:
    """Nodes with identical records share one group; groups in natural order of their first node."""
    by_key: Dict[Tuple[Record, ...], List[str]] = {}
    notes: Dict[Tuple[Record, ...], Tuple[str, ...]] = {}
    cache: Dict[str, Tuple[Record, ...]] = {}
    for inv in invs:
        # Identical hardware gives identical facts: render each distinct node shape once.
        fkey = repr(inv.hardware_facts())
        recs = cache.get(fkey)
        if recs is None:
            recs = cache[fkey] = node_records(inv, naming, type_map)
            notes.setdefault(recs, node_notes(inv, recs))
        by_key.setdefault(recs, []).append(inv.hostname)
    groups = [Group(tuple(sorted(hosts, key=hostlist.sort_key)), recs, notes[recs]) for recs, hosts in by_key.items()]
    groups.sort(key=lambda g: hostlist.sort_key(g.nodes[0]))
    return groups


# --- rendering -----------------------------------------------------------------------------

def _template_env(template_dir: str = ""):
    import jinja2  # lazily: hooks import nothing from here, but keep the CLI quick too

    paths: List[str] = []
    if template_dir:
        paths.append(template_dir)
    repo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates")
    if os.path.isdir(repo):
        paths.append(repo)
    try:
        from importlib import resources
        pkg = resources.files("slurm_gpu.templates")
        if os.path.isdir(str(pkg)):
            paths.append(str(pkg))
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    return jinja2.Environment(loader=jinja2.FileSystemLoader(paths), autoescape=False, trim_blocks=True,
                              lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


def render(groups: Sequence[Group], template: str, template_dir: str = "", **context: Any) -> str:
    import jinja2

    try:
        tpl = _template_env(template_dir).get_template(template)
    except jinja2.TemplateNotFound:
        raise InputError(f"template {template} not found (site dir: {template_dir or 'none'})",
                         "the shipped templates come with the package; check gres.template_dir") from None
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"template {e.filename or template}:{e.lineno}: {e.message}", "fix the site template") from None
    try:
        return tpl.render(groups=groups, node_count=sum(len(g.nodes) for g in groups), **context)
    except jinja2.UndefinedError as e:
        raise InputError(f"template {template}: {e.message}", "fix the site template") from None


def render_gres_conf(groups: Sequence[Group], template_dir: str = "", naming: str = "autodetect") -> str:
    return render(groups, "gres.conf.j2", template_dir, naming=naming)


def render_slurm_conf_lines(groups: Sequence[Group], template_dir: str = "") -> str:
    return render(groups, "gres-slurm-conf.j2", template_dir)


# --- parsing an existing gres.conf (for --check) -------------------------------------------

_CANON = {"nodename": "NodeName", "name": "Name", "type": "Type", "file": "File", "multiplefiles": "MultipleFiles",
          "cores": "Cores", "links": "Links", "count": "Count", "flags": "Flags", "autodetect": "AutoDetect"}


def normalise_gres_conf(text: str, source: str = "gres.conf", all_nodes: Sequence[str] = ()) -> List[str]:
    """One sorted line per node and device: spelling, order, hostlists and File ranges do not matter.

    A line without NodeName applies to every node: to `all_nodes` when given (a node-local
    gres.conf checked against this node), else it stays as NodeName=*.
    """
    out: List[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields: Dict[str, str] = {}
        for tok in line.split():
            key, sep, val = tok.partition("=")
            if not sep or not key:
                raise InputError(f"{source}:{lineno}: expected key=value, got {tok!r}",
                                 "gres.conf lines are space-separated key=value pairs (gres.conf(5))")
            k = _CANON.get(key.lower(), key.lower())
            if k in fields:
                raise InputError(f"{source}:{lineno}: {k} given twice", "keep one of them")
            fields[k] = val
        try:
            nodes = hostlist.expand(fields.pop("NodeName")) if "NodeName" in fields else (list(all_nodes) or ["*"])
            files = hostlist.expand(fields.pop("File")) if "File" in fields else []
            multi = sorted(hostlist.expand(fields.pop("MultipleFiles"))) if "MultipleFiles" in fields else []
            if "Cores" in fields:
                fields["Cores"] = format_cpulist(parse_cpulist(fields["Cores"]))
        except ValueError as e:
            raise InputError(f"{source}:{lineno}: {e}", "fix the line; see gres.conf(5)") from None
        if "Name" in fields:
            fields["Name"] = fields["Name"].lower()
        if "Links" in fields:
            fields["Links"] = ",".join(x.strip() for x in fields["Links"].split(","))
        if files and fields.get("Count") == str(len(files)):
            del fields["Count"]  # implied by File
        rest = " ".join(f"{k}={fields[k]}" for k in sorted(fields, key=lambda k: (k != "Name", k != "Type", k)))
        for node in nodes:
            if files:
                out.extend(f"NodeName={node} {rest} File={f}".replace("  ", " ") for f in files)
            elif multi:
                out.append(f"NodeName={node} {rest} MultipleFiles={','.join(multi)}".replace("  ", " "))
            else:
                out.append(f"NodeName={node} {rest}".strip())
    out.sort(key=lambda s: (hostlist.sort_key(s.split(" ", 1)[0][len("NodeName="):]), s))
    return out


def check(existing_text: str, generated_text: str, existing_name: str = "gres.conf") -> str:
    """A unified diff of the normalised forms; empty when the files mean the same."""
    new = normalise_gres_conf(generated_text, "generated")
    nodes = sorted({line.split(" ", 1)[0][len("NodeName="):] for line in new} - {"*"}, key=hostlist.sort_key)
    old = normalise_gres_conf(existing_text, existing_name, nodes)
    if old == new:
        return ""
    return "".join(difflib.unified_diff([s + "\n" for s in old], [s + "\n" for s in new],
                                        fromfile=f"{existing_name} (normalised)", tofile="generated (normalised)", n=1))


# --- the whole flow ------------------------------------------------------------------------

def build(invs: Sequence[Inventory], naming: str, type_map: Mapping[str, str],
          declared_groups: Sequence[str] = ()) -> List[Group]:
    if naming not in NAMINGS:
        raise InputError(f"unknown type naming {naming!r}", "use 'autodetect' or 'short'")
    if not invs:
        raise InventoryError("no inventories given", "pass --inventory DIR with one JSON file per node")
    check_declared_groups(invs, declared_groups)
    return group_nodes(invs, naming, type_map)
