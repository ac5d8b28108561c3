"""gres.conf from GPU inventories: type naming, per-node records, grouping, rendering, --check.

What the lines mean follows Slurm's gres.conf(5) and what AutoDetect=nvml (Slurm's gpu_nvml.c)
would find on the node:

* ``Type=``: AutoDetect's naming (NVML name lower-cased, spaces to '_') or short names
  (``h100``); the config's ``gres.type_map`` wins over both.  MIG devices get
  ``<gpu type up to the first '-'>_<profile>`` with the profile as the site's Slurm version
  spells it (``mig_suffix``): up to 23.02.5 from GPU-instance slices and memory rounded to
  GiB (``nvidia_a100_3g.39gb``), from 23.02.6 the NVML profile (``nvidia_a100_3g.40gb``).
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
import re
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm_gpu.errors import InputError
from slurm_gpu.gres.inventory import Inventory, InventoryError, format_cpulist, parse_cpulist
from slurm_gpu.slurm import hostlist

if TYPE_CHECKING:  # types only: jinja2 is imported when a template is rendered
    import jinja2

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


# --- MIG names, as the site's Slurm version derives them --------------------------------------
#
# src/plugins/gpu/nvml/gpu_nvml.c, _handle_mig() (see docs/gres-conf.md for what was checked):
# up to 23.02.5 "_%ug.%lugb" of gpuInstanceSliceCount and roundl(memorySizeMB / 1024);
# from 23.02.6 (commit 04f0e4c3d7, Bug 17705) the NVML MIG device name from "mig_" on, minus
# "mig", with a fallback "_[<ci>c.]<gi>g.<ceil(memorySizeMB / 1024)>gb".

SlurmVersion = Tuple[int, int, int]
MIG_NAMES_FROM_PROFILE = (23, 2, 6)  # first Slurm release that names MIG types from the NVML profile
_PROFILE = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+[a-z0-9.+]+)?$", re.IGNORECASE)
_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def parse_slurm_version(text: str, origin: str = "Slurm version") -> SlurmVersion:
    """'slurm-wlm 22.05.8' / '23.11' / '24.05.4-1' -> (22, 5, 8) / (23, 11, 0) / (24, 5, 4)."""
    m = _VERSION.search(text or "")
    if not m:
        raise InputError(f"{origin} {text.strip()!r} is not a Slurm version",
                         "give it as printed by `slurmd -V`, e.g. 22.05.8 or 23.11.4")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def format_slurm_version(v: SlurmVersion) -> str:
    return f"{v[0]}.{v[1]:02d}.{v[2]}"


def detect_slurm_version(timeout_s: float = 10.0) -> Tuple[Optional[SlurmVersion], str]:
    """(version, how it was found) from `slurmd -V`, `sinfo -V` or `scontrol -V`; (None, why not).

    slurmd answers without a slurm.conf; sinfo and scontrol need one (a head node has it)."""
    tried = []
    for cmd in ("slurmd", "sinfo", "scontrol"):
        try:
            cp = subprocess.run([cmd, "-V"], capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{cmd} -V: {getattr(e, 'strerror', None) or e}")
            continue
        m = _VERSION.search(cp.stdout) if cp.returncode == 0 else None
        if m:
            return parse_slurm_version(m.group(0)), f"{cmd} -V"
        tried.append(f"{cmd} -V: exit {cp.returncode}")
    return None, "; ".join(tried)


def _split_profile(profile: str) -> Tuple[Optional[int], int, int, str]:
    m = _PROFILE.match(profile.strip())
    if not m:
        raise InputError(f"MIG profile {profile!r} is not '[<c>c.]<g>g.<mem>gb[+ext]'",
                         "regenerate the inventory with `slurm-gpu inventory`")
    return (int(m.group(1)) if m.group(1) else None), int(m.group(2)), int(m.group(3)), (m.group(4) or "").lower()


def mig_suffix(mig_name: str, profile: str, memory_mib: Optional[int], slurm_version: SlurmVersion,
               where: str = "") -> str:
    """What Slurm's AutoDetect appends to the GPU type for a MIG device: '_3g.39gb' or '_3g.40gb'."""
    ci, gi, _gb, _ext = _split_profile(profile)
    if tuple(slurm_version) >= MIG_NAMES_FROM_PROFILE:
        name = autodetect_type(mig_name) if mig_name else ""
        k = name.find("mig_")
        if k >= 0:
            return name[k + 3:]
        if memory_mib is None:
            raise InputError(f"{where}MIG device {profile}: no NVML name and no memory size to name it from",
                             "regenerate the inventory with `slurm-gpu inventory` on the node")
        return "_" + (f"{ci}c." if ci is not None and ci != gi else "") + f"{gi}g.{(memory_mib + 1023) // 1024}gb"
    if memory_mib is None:
        raise InputError(f"{where}MIG device {profile}: Slurm {format_slurm_version(slurm_version)} names MIG types "
                         "by their memory, which this inventory does not hold",
                         "regenerate the inventory with this slurm-gpu (`slurm-gpu inventory`), or map the "
                         "type in [gres.type_map]")
    # roundl() of MiB / 1024: halves round away from zero
    return f"_{gi}g.{(2 * memory_mib + 1024) // 2048}gb"


def mig_type(parent_name: str, mig_name: str, profile: str, naming: str, type_map: Mapping[str, str], where: str = "",
             memory_mib: Optional[int] = None, slurm_version: Optional[SlurmVersion] = None) -> str:
    if mig_name and mig_name in type_map:
        return _check_type(type_map[mig_name], f"gres.type_map[{mig_name!r}]")
    if parent_name in type_map:
        base = type_map[parent_name]
    elif naming == "autodetect":
        # AutoDetect cuts the GPU name at the first '-' before adding the profile.
        base = autodetect_type(parent_name).split("-", 1)[0]
    else:
        base = gpu_type(parent_name, naming, type_map, where)
    if naming == "autodetect":
        if slurm_version is None:
            raise InputError(f"{where}MIG device {profile} of {parent_name!r}: the Slurm version is needed to "
                             "name it as Slurm's AutoDetect does (22.05 and 23.11 spell MIG types differently)",
                             "pass --slurm-version (e.g. 22.05.8), set gres.slurm_version, or run where "
                             "`slurmd -V` works")
        suffix = mig_suffix(mig_name, profile, memory_mib, slurm_version, where)
    else:
        suffix = "_" + profile.lower()
    return _check_type(f"{base}{suffix}", f"MIG device of {parent_name!r}")


def needs_slurm_version(invs: Sequence[Inventory], naming: str, type_map: Mapping[str, str]) -> bool:
    """Whether some MIG device gets its Type= from Slurm's version-dependent AutoDetect rule."""
    if naming != "autodetect":
        return False
    return any(m.name not in type_map for inv in invs for g in inv.gpus if g.mig_enabled for m in g.mig_devices)


def resolve_slurm_version(given: Any, invs: Sequence[Inventory], naming: str,
                          type_map: Mapping[str, str]) -> Optional[SlurmVersion]:
    """The Slurm version MIG type names follow: `given` (a tuple or "22.05.8"), else the one
    `slurmd -V` & co. report; None when no name depends on it.  Never a guess."""
    if isinstance(given, tuple):
        return given
    if given:
        return parse_slurm_version(str(given), "--slurm-version / gres.slurm_version")
    if not needs_slurm_version(invs, naming, type_map):
        return None
    version, how = detect_slurm_version()
    if version is None:
        raise InputError("MIG devices need the Slurm version to be named as Slurm's AutoDetect names them "
                         f"(22.05 and 23.11 spell them differently), and it could not be found ({how})",
                         "pass --slurm-version X.Y.Z or set gres.slurm_version in config.toml "
                         "(the version slurmd runs on these nodes)")
    return version


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


def node_records(inv: Inventory, naming: str, type_map: Mapping[str, str],
                 slurm_version: Optional[SlurmVersion] = None) -> Tuple[Record, ...]:
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
                    mig_type(d.name, m.name, m.profile, naming, type_map, where, m.memory_mib, slurm_version),
                    (gpu_file, f"/dev/nvidia-caps/nvidia-cap{m.gi_cap_minor}", f"/dev/nvidia-caps/nvidia-cap{m.ci_cap_minor}"),
                    multiple=True, cores=cores))
        else:
            links = ",".join(str(x) for x in inv.links(d)) if with_links else ""
            per_gpu.append(Record(gpu_type(d.name, naming, type_map, where), (gpu_file,), cores=cores, links=links))
    return _merge(per_gpu)


def node_notes(inv: Inventory, records: Sequence[Record], naming: str = "",
               slurm_version: Optional[SlurmVersion] = None) -> Tuple[str, ...]:
    out = []
    mig = any(g.mig_enabled for g in inv.gpus)
    if not mig and any(inv.switch_links(g) for g in inv.gpus) and not any(r.links for r in records):
        out.append("NvLink through NVSwitch only: every GPU pair is equally connected, so no Links=")
    if mig:
        out.append("MIG: one line per MIG device; the GPU file plus its GPU/compute instance nvidia-caps files")
        if naming == "autodetect" and slurm_version is not None:
            how = ("the NVML profile name" if tuple(slurm_version) >= MIG_NAMES_FROM_PROFILE
                   else "GPU-instance slices and memory rounded to GiB")
            out.append(f"MIG Type= as slurm {format_slurm_version(slurm_version)} AutoDetect names it: from {how}")
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


def group_nodes(invs: Sequence[Inventory], naming: str, type_map: Mapping[str, str],
                slurm_version: Optional[SlurmVersion] = None) -> List[Group]:
    """Nodes with identical records share one group; groups in natural order of their first node."""
    by_key: Dict[Tuple[Record, ...], List[str]] = {}
    notes: Dict[Tuple[Record, ...], Tuple[str, ...]] = {}
    cache: Dict[str, Tuple[Record, ...]] = {}
    for inv in invs:
        # Identical hardware gives identical facts: render each distinct node shape once.
        fkey = repr(inv.hardware_facts())
        recs = cache.get(fkey)
        if recs is None:
            recs = cache[fkey] = node_records(inv, naming, type_map, slurm_version)
            notes.setdefault(recs, node_notes(inv, recs, naming, slurm_version))
        by_key.setdefault(recs, []).append(inv.hostname)
    groups = [Group(tuple(sorted(hosts, key=hostlist.sort_key)), recs, notes[recs]) for recs, hosts in by_key.items()]
    groups.sort(key=lambda g: hostlist.sort_key(g.nodes[0]))
    return groups


# --- rendering -----------------------------------------------------------------------------

def _template_env(template_dir: str = "") -> jinja2.Environment:
    from slurm_gpu.render import template_env  # the one Jinja environment (jinja2 imported lazily)
    return template_env(template_dir)


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


# --- reading an existing gres.conf (for --check) ----------------------------------------------
#
# One parser of Slurm's syntax: slurmconf.logical_lines / parse_pairs / gres_fields (comments,
# '\\' continuations, spaces around '=', key case, the CPUs/Cores, File/Files, Link/Links
# aliases), as src/common/parse_config.c and src/interfaces/gres.c read the file.

_CANON = {"nodename": "NodeName", "name": "Name", "type": "Type", "file": "File", "multiplefiles": "MultipleFiles",
          "cores": "Cores", "links": "Links", "count": "Count", "flags": "Flags", "autodetect": "AutoDetect"}


@dataclass(frozen=True)
class _Normalised:
    lines: Tuple[Tuple[str, str], ...]  # (node, normalised line), sorted
    line_nodes: Tuple[Tuple[str, Tuple[str, ...]], ...]  # (where, nodes a NodeName= line names)


# Bounds of what --check expands (issue 39): no node has more GPUs than this, and no gres.conf of a
# real cluster more node-device lines (4,000 nodes x 8 GPUs is 32,000).
MAX_GPUS_PER_NODE = 64
MAX_NORMALISED_LINES = 1 << 20


def normalise_gres_conf(text: str, source: str = "gres.conf", all_nodes: Sequence[str] = ()) -> List[str]:
    """One sorted line per node and device, by what the lines mean to Slurm.

    Spelling, order, Slurm's aliases, continuations, hostlists and File ranges do not
    matter.  A line without NodeName applies to every node: to `all_nodes` when given (a
    node-local gres.conf checked against this node), else it stays as NodeName=*.
    AutoDetect becomes one ``NodeName=<node> AutoDetect=<mode>`` line for each node where it
    is in effect; AutoDetect=off, the default, leaves no trace.
    """
    return [line for _, line in _normalise(text, source, all_nodes).lines]


def _normalise(text: str, source: str, all_nodes: Sequence[str]) -> _Normalised:
    from slurm_gpu.slurm import conf as slurmconf

    default_nodes = list(all_nodes) or ["*"]
    out: List[Tuple[str, str]] = []
    line_nodes: List[Tuple[str, Tuple[str, ...]]] = []
    autodetect: Dict[Optional[str], str] = {None: "off"}  # None: the global default; else a node's own
    named: List[str] = []
    for lineno, line in slurmconf.logical_lines(text):
        where = f"{source}:{lineno}"
        fields = _line_fields(line, where)
        nodes, files, multi = _pop_device_lists(fields, where)
        if nodes is not None:
            line_nodes.append((where, tuple(nodes)))
            named.extend(nodes)
        mode = fields.pop("autodetect", None)
        if mode is not None:
            # Slurm: on a NodeName= line it is that node's setting; alone it is the global
            # default; on a Name= line without NodeName it is ignored ("In-line AutoDetect
            # requires NodeName to take effect").
            if nodes is not None:
                autodetect.update((n, mode.lower()) for n in nodes)
            elif "name" not in fields:
                autodetect[None] = mode.lower()
        if "name" not in fields:
            if fields or (mode is None):
                raise InputError(f"{where}: a line without Name=", "every GRES line names its GRES (Name=gpu)")
            continue
        if fields["name"].lower() == "gpu" and len(files) > MAX_GPUS_PER_NODE:
            raise InputError(f"{where}: File= names {len(files):,} GPU devices on one line; a node has at most "
                             f"{MAX_GPUS_PER_NODE} GPUs", "one File=/dev/nvidiaN per GPU, e.g. File=/dev/nvidia[0-7]")
        node_list = nodes if nodes is not None else default_nodes
        if len(out) + len(node_list) * max(1, len(files)) > MAX_NORMALISED_LINES:
            raise InputError(f"{where}: NodeName= x File= expands to {len(node_list) * max(1, len(files)):,} node-device "
                             f"lines (more than {MAX_NORMALISED_LINES:,} in the file)",
                             "check the NodeName= and File= ranges of this line")
        out.extend(_device_lines(node_list, _gres_keys(fields, files), files, multi))
    for node in dict.fromkeys(list(default_nodes) + named):
        mode = autodetect.get(node, autodetect[None])
        if mode != "off":
            out.append((node, f"NodeName={node} AutoDetect={mode}"))
    out.sort(key=lambda nl: (hostlist.sort_key(nl[0]), nl[1]))
    return _Normalised(tuple(out), tuple(line_nodes))


def _line_fields(line: str, where: str) -> Dict[str, str]:
    """A logical line's keys (lower case, Slurm's aliases folded) and values; InputError for an
    Include or an unknown key."""
    from slurm_gpu.slurm import conf as slurmconf

    head = line.split(None, 1)[0].lower()
    if head == "include" or head.startswith("include="):
        raise InputError(f"{where}: Include is not followed by --check", "check the included file on its own")
    pairs = slurmconf.parse_pairs(line, where)
    for k in pairs:
        if k not in slurmconf.GRES_KEYS:
            raw = next((m for m in re.findall(r"([A-Za-z][A-Za-z0-9_.]*)\s*=", line) if m.lower() == k), k)
            raise InputError(f"{where}: unknown key {raw!r}",
                             "gres.conf(5) keys: NodeName, Name, Type, File(s), MultipleFiles, Cores/CPUs, "
                             "Links/Link, Count, Flags, AutoDetect")
    return slurmconf.gres_fields(pairs)


def _pop_device_lists(fields: Dict[str, str], where: str) -> Tuple[Optional[List[str]], List[str], List[str]]:
    """(NodeName= nodes or None, File= devices, MultipleFiles= devices sorted), taken out of
    `fields` and expanded; Cores= is rewritten in one spelling."""
    try:
        nodes = hostlist.expand(fields.pop("nodename")) if "nodename" in fields else None
        files = hostlist.expand(fields.pop("file")) if "file" in fields else []
        multi = sorted(hostlist.expand(fields.pop("multiplefiles"))) if "multiplefiles" in fields else []
    except ValueError as e:
        raise InputError(f"{where}: {e}", "fix the line; see gres.conf(5)") from None
    if "cores" in fields:
        try:
            fields["cores"] = format_cpulist(parse_cpulist(fields["cores"]))
        except ValueError as e:
            raise InputError(f"{where}: Cores={fields['cores'][:40]}: {e}",
                             "Cores= lists the node's CPU ids, e.g. Cores=0-27; see gres.conf(5)") from None
    return nodes, files, multi


def _gres_keys(fields: Dict[str, str], files: Sequence[str]) -> str:
    """The keys between NodeName= and File=, in one spelling: Name=, Type=, then the others by name."""
    fields["name"] = fields["name"].lower()
    if "links" in fields:
        fields["links"] = ",".join(x.strip() for x in fields["links"].split(","))
    if "flags" in fields:
        fields["flags"] = ",".join(sorted(f.strip().lower() for f in fields["flags"].split(",") if f.strip()))
    if files and fields.get("count") == str(len(files)):
        del fields["count"]  # implied by File
    order = ("name", "type")
    keys = sorted(fields, key=lambda k: (k not in order, order.index(k) if k in order else 0, _CANON.get(k, k)))
    return " ".join(f"{_CANON.get(k, k)}={fields[k]}" for k in keys)


def _device_lines(nodes: Sequence[str], rest: str, files: Sequence[str], multi: Sequence[str]) -> List[Tuple[str, str]]:
    """(node, line) for every node and device of one gres.conf line."""
    out: List[Tuple[str, str]] = []
    for node in nodes:
        if files:
            out.extend((node, f"NodeName={node} {rest} File={f}") for f in files)
        elif multi:
            out.append((node, f"NodeName={node} {rest} MultipleFiles={','.join(multi)}"))
        else:
            out.append((node, f"NodeName={node} {rest}"))
    return out


@dataclass(frozen=True)
class CheckResult:
    diff: str  # unified diff of the normalised forms; empty when the files mean the same
    nodes: Tuple[str, ...]  # the nodes compared (those the generated file describes)
    other_lines: int  # NodeName= lines of the existing file for none of those nodes
    other_nodes: Tuple[str, ...]  # the nodes those lines name


def compare(existing_text: str, generated_text: str, existing_name: str = "gres.conf") -> CheckResult:
    """Compare by meaning, only for the nodes the generated file describes.

    A cluster-wide gres.conf checked on one node (or against some nodes' inventories) has
    lines for other nodes: they are counted, not reported as differences."""
    new = _normalise(generated_text, "generated", ())
    nodes = tuple(sorted({n for n, _ in new.lines} - {"*"}, key=hostlist.sort_key))
    old = _normalise(existing_text, existing_name, nodes)
    checked = set(nodes)
    if checked:
        others = [(w, ns) for w, ns in old.line_nodes if not checked.intersection(ns)]
        old_lines = [line for n, line in old.lines if n in checked]
    else:
        others, old_lines = [], [line for _, line in old.lines]
    other_nodes = tuple(sorted({n for _, ns in others for n in ns}, key=hostlist.sort_key))
    new_lines = [line for _, line in new.lines]
    diff = ""
    if old_lines != new_lines:
        diff = "".join(difflib.unified_diff([s + "\n" for s in old_lines], [s + "\n" for s in new_lines],
                                            fromfile=f"{existing_name} (normalised)", tofile="generated (normalised)", n=1))
    return CheckResult(diff, nodes, len(others), other_nodes)


def check(existing_text: str, generated_text: str, existing_name: str = "gres.conf") -> str:
    """A unified diff of the normalised forms (for the generated file's nodes); empty when they mean the same."""
    return compare(existing_text, generated_text, existing_name).diff


# --- the whole flow ------------------------------------------------------------------------

def build(invs: Sequence[Inventory], naming: str, type_map: Mapping[str, str],
          declared_groups: Sequence[str] = (), slurm_version: Any = None) -> List[Group]:
    """Groups of nodes with their records.  `slurm_version` (tuple or "22.05.8"; None: ask
    `slurmd -V` & co. when a MIG type depends on it) decides MIG type names."""
    if naming not in NAMINGS:
        raise InputError(f"unknown type naming {naming!r}", "use 'autodetect' or 'short'")
    if not invs:
        raise InventoryError("no inventories given", "pass --inventory DIR with one JSON file per node")
    check_declared_groups(invs, declared_groups)
    return group_nodes(invs, naming, type_map, resolve_slurm_version(slurm_version, invs, naming, type_map))
