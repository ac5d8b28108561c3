"""One self-contained HTML page for a fleet view: a title, the notes, the table (escaped)."""
from __future__ import annotations

import html
import math
from typing import Any, Callable, Dict, Optional, Sequence

_STYLE = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
          "th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}"
          "th{background:#eee}td.num{text-align:right}.bad{background:#fdd}p.note{color:#555}")


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def page(title: str, rows: Sequence[Dict[str, Any]], columns: Sequence[str], notes: Sequence[str] = (),
         flag: Optional[Callable[[Dict[str, Any]], bool]] = None) -> str:
    """`flag(row)` true: the row is shaded (a finding that needs an admin)."""
    head = "".join(f"<th>{html.escape(c.replace('_', ' '))}</th>" for c in columns)
    body = []
    for r in rows:
        shaded = flag is not None and flag(r)
        cells = "".join(f'<td{" class=num" if isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) else ""}>'
                        f"{html.escape(_cell(r.get(c)))}</td>" for c in columns)
        body.append(f'<tr{" class=bad" if shaded else ""}>{cells}</tr>')
    notes_html = "".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{notes_html}"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></body></html>")
