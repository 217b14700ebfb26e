"""A report as one self-contained HTML page: tables, and figures embedded as base64 PNGs."""

from __future__ import annotations

import base64
from html import escape

from hopnet.report.content import ReportContent, Table

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
table.overview td { text-align: left; } table.overview td:first-child { font-weight: 600; }
figure { margin: 1em 0; } figure img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
td.bad { color: #b00; font-weight: 600; }
"""


def _table(table: Table, css_class: str = "") -> str:
    head = "" if not any(table.headers) else (
        "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in table.headers) + "</tr>")
    body = []
    for row in table.rows:
        cells = "".join(f'<td class="bad">{escape(c)}</td>' if c in ("NO",) or c.startswith("failed")
                        else f"<td>{escape(c)}</td>" for c in row)
        body.append(f"<tr>{cells}</tr>")
    attr = f' class="{css_class}"' if css_class else ""
    return f"<table{attr}>{head}{''.join(body)}</table>"


def render_html(content: ReportContent) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{escape(content.title)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{escape(content.title)}</h1>", _table(content.overview, "overview")]
    for section in content.sections:
        parts.append(f"<h2>{escape(section.title)}</h2>")
        parts.extend(f"<p>{escape(p)}</p>" for p in section.paragraphs)
        for figure in section.figures:
            data = base64.b64encode(figure.png).decode("ascii")
            parts.append(f'<figure id="{escape(figure.name)}"><img alt="{escape(figure.title)}" '
                         f'src="data:image/png;base64,{data}"><figcaption>{escape(figure.title)}. '
                         f"{escape(figure.caption)}</figcaption></figure>")
        parts.extend(_table(t) for t in section.tables)
    parts.append("<p><small>Written by <code>hopnet report</code> from the run's event logs "
                 "(see docs/reference/events.md).</small></p></body></html>")
    return "\n".join(parts) + "\n"
