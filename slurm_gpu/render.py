"""One renderer for every tabular output: table, csv, json, markdown (html: see report_html).

Rows are plain dicts; columns name the keys to show, in order.  Data goes to stdout,
diagnostics to stderr: callers print what these functions return.
"""
from __future__ import annotations

import csv
import io
import json
from typing import Any, Dict, Iterable, List, Sequence

FORMATS = ("table", "csv", "json", "markdown")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table(rows: Sequence[Dict[str, Any]], columns: Sequence[str], headers: Sequence[str] = ()) -> str:
    heads = list(headers) or [c.replace("_", " ") for c in columns]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
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


def to_csv(rows: Iterable[Dict[str, Any]], columns: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
    return buf.getvalue().rstrip("\n")


def to_json(rows: Iterable[Dict[str, Any]], columns: Sequence[str]) -> str:
    return json.dumps([{c: r.get(c) for c in columns} for r in rows], indent=2)


def _md_escape(s: str) -> str:
    # Markdown passes raw HTML through: a user or job string must not become markup where it is pasted.
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(rows: Sequence[Dict[str, Any]], columns: Sequence[str], headers: Sequence[str] = ()) -> str:
    heads = list(headers) or list(columns)
    lines = ["| " + " | ".join(_md_escape(h) for h in heads) + " |", "|" + "|".join(" --- " for _ in heads) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_md_escape(_cell(r.get(c))) for c in columns) + " |")
    return "\n".join(lines)


def render(rows: Sequence[Dict[str, Any]], columns: Sequence[str], fmt: str = "table", headers: Sequence[str] = ()) -> str:
    if fmt == "table":
        return table(rows, columns, headers)
    if fmt == "csv":
        return to_csv(rows, columns)
    if fmt == "json":
        return to_json(rows, columns)
    if fmt == "markdown":
        return to_markdown(rows, columns, headers)
    raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
