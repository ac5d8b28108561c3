"""One renderer for every tabular output: table, csv, json, markdown (html: see report_html).

Rows are plain dicts; columns name the keys to show, in order.  Data goes to stdout,
diagnostics to stderr: callers print what these functions return.

Data is not trusted (user, account and partition names come from job environments):
- table and Markdown show control characters (ANSI escape sequences, carriage returns,
  C1 controls, bidirectional overrides) as visible escapes such as ``\\x1b``: nothing in the
  data reaches a terminal as a control sequence;
- CSV prefixes a text cell that starts with ``=``, ``+``, ``-``, ``@``, tab or carriage return
  with ``'`` so that spreadsheets show it as text instead of running it as a formula; numbers
  are written as numbers;
- JSON never carries Infinity or NaN (non-finite numbers become null).
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:  # types only: jinja2 is imported when a template is first rendered
    import jinja2

FORMATS = ("table", "csv", "json", "markdown")
Formats = Optional[Mapping[str, Callable[[Any], str]]]

# C0 controls but tab, DEL, C1 controls, and the Unicode format characters that reorder or hide text.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def printable(s: str) -> str:
    """`s` with every control character shown as an escape (\\x1b, \\u202e); tabs become spaces."""
    s = s.replace("\t", " ")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", s)


def _cell(v: Any, fmt: Optional[Callable[[Any], str]] = None) -> str:
    if fmt is not None:
        return fmt(v)
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if math.isfinite(v) else "-"
    return str(v)


def table(rows: Sequence[Dict[str, Any]], columns: Sequence[str], headers: Sequence[str] = (),
          formats: Formats = None) -> str:
    formats = formats or {}
    heads = [printable(h) for h in (list(headers) or [c.replace("_", " ") for c in columns])]
    cells = [[printable(_cell(r.get(c), formats.get(c))) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    numeric = [all(_is_num(r.get(c)) for r in rows) and rows for c in columns]

    def fmt(vals: List[str]) -> str:
        out = []
        for i, v in enumerate(vals):
            out.append(v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(heads), "  ".join("-" * w for w in widths)]
    lines += [fmt(c) for c in cells]
    return "\n".join(lines)


def _is_num(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def csv_safe(v: Any) -> Any:
    """A CSV cell: None empty, numbers as they are, text that a spreadsheet would run as a formula quoted."""
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return ""
    if isinstance(v, str) and v.startswith(_FORMULA_START):
        return "'" + v
    return v


def to_csv(rows: Iterable[Dict[str, Any]], columns: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([csv_safe(r.get(c)) for c in columns])
    return buf.getvalue().rstrip("\n")


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def to_json(rows: Iterable[Dict[str, Any]], columns: Sequence[str]) -> str:
    return json.dumps([{c: _finite(r.get(c)) for c in columns} for r in rows], indent=2, allow_nan=False)


def _md_escape(s: str) -> str:
    # Markdown passes raw HTML through: a user or job string must not become markup where it is pasted.
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return printable(s.replace("|", "\\|").replace("\n", " "))


def to_markdown(rows: Sequence[Dict[str, Any]], columns: Sequence[str], headers: Sequence[str] = (),
                formats: Formats = None) -> str:
    formats = formats or {}
    heads = list(headers) or list(columns)
    lines = ["| " + " | ".join(_md_escape(h) for h in heads) + " |", "|" + "|".join(" --- " for _ in heads) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_md_escape(_cell(r.get(c), formats.get(c))) for c in columns) + " |")
    return "\n".join(lines)


def render(rows: Sequence[Dict[str, Any]], columns: Sequence[str], fmt: str = "table", headers: Sequence[str] = (),
           formats: Formats = None) -> str:
    """`formats` (column -> function of the value) applies to the human formats, table and markdown."""
    if fmt == "table":
        return table(rows, columns, headers, formats)
    if fmt == "csv":
        return to_csv(rows, columns)
    if fmt == "json":
        return to_json(rows, columns)
    if fmt == "markdown":
        return to_markdown(rows, columns, headers, formats)
    raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def template_env(site_dir: str = "", *, html: bool = False) -> jinja2.Environment:
    """The one Jinja environment factory (gres.conf from gres/generate.py, the HTML report from
    report/html.py): a site template directory first, then the shipped ``slurm_gpu/templates``;
    undefined variables are errors.  ``html``: autoescaped; otherwise config text, verbatim, with
    block tags trimmed and the trailing newline kept.  jinja2 is imported here, lazily: nothing
    on the hook path calls this."""
    return _template_env(site_dir or "", bool(html))


_ENVS: Dict[Tuple[str, bool], jinja2.Environment] = {}


def _template_env(site_dir: str, html: bool) -> jinja2.Environment:
    key = (site_dir, html)
    if key in _ENVS:
        return _ENVS[key]
    import os

    import jinja2

    paths: List[str] = [site_dir] if site_dir else []
    shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
    if os.path.isdir(shipped):
        paths.append(shipped)
    try:
        from importlib import resources
        pkg = str(resources.files("slurm_gpu.templates"))
        if os.path.isdir(pkg) and pkg not in paths:
            paths.append(pkg)
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    if html:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader([p for p in paths if os.path.isdir(p)]),
                                 autoescape=True, undefined=jinja2.StrictUndefined)
    else:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(paths), autoescape=False, trim_blocks=True,
                                 lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    _ENVS[key] = env
    return env
