"""A report as a Markdown page with its figures as PNG files beside it."""

from __future__ import annotations

from pathlib import Path

from hopnet.report.content import ReportContent, Table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(table: Table) -> str:
    headers = table.headers if any(table.headers) else [""] * len(table.headers)
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |",
             "|" + "|".join(" --- " for _ in headers) + "|"]
    lines.extend("| " + " | ".join(_cell(c) for c in row) + " |" for row in table.rows)
    return "\n".join(lines)


def write_markdown(content: ReportContent, path: Path) -> list[Path]:
    """Write ``path`` (the page) and one ``<stem>-<figure>.png`` per figure beside it; return all files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    parts = [f"# {content.title}", "", _table(content.overview)]
    for section in content.sections:
        parts += ["", f"## {section.title}", ""]
        for paragraph in section.paragraphs:
            parts += [paragraph, ""]
        for figure in section.figures:
            image = path.with_name(f"{path.stem}-{figure.name}.png")
            image.write_bytes(figure.png)
            written.append(image)
            parts += [f"![{figure.title}]({image.name})", "", f"*{figure.title}.* {figure.caption}", ""]
        for table in section.tables:
            parts += [_table(table), ""]
    path.write_text("\n".join(parts).rstrip() + "\n", encoding="utf-8")
    return [path, *written]
