"""`hopnet report`: read a run directory, write the page (HTML or Markdown) and optionally a trace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hopnet.errors import ConfigError
from hopnet.report.content import build_content
from hopnet.report.diagnosis import Predictor, diagnose
from hopnet.report.diagnosis_view import diagnosis_section
from hopnet.report.rundir import load_run_dir
from hopnet.report.trace import write_trace

FORMATS = ("html", "md")


def default_output(run_dir: Path, fmt: str) -> Path:
    return run_dir / f"report.{fmt}"


def write_report(run_dir: str | Path, out: str | Path | None = None, fmt: str | None = None,
                 trace: str | Path | None = None, predictor: Predictor | None = None,
                 echo: Callable[[str], None] | None = None) -> list[Path]:
    """Write the report of ``run_dir`` and return the files written.

    ``fmt`` is ``html`` (one self-contained page) or ``md`` (a page plus PNGs); without it
    the format follows ``out``'s suffix, else HTML. ``trace`` also writes Chrome trace events.
    The page opens with a diagnosis (:mod:`hopnet.report.diagnosis`); ``predictor`` adds the
    simulator's predictions to it, and ``echo`` is handed its lines.
    """
    if fmt is None:
        fmt = "md" if out is not None and Path(out).suffix.lower() in (".md", ".markdown") else "html"
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose html or md")
    run = load_run_dir(run_dir)
    target = Path(out) if out is not None else default_output(run.path, fmt)
    if target.is_dir():
        target = default_output(target, fmt)
    content = build_content(run)
    diagnosis = diagnose(run, predictor=predictor)
    content.sections.insert(0, diagnosis_section(run, predictor=predictor, diagnosis=diagnosis))
    if echo is not None:
        for line in diagnosis.lines():
            echo(line)
    written: list[Path] = []
    try:
        if fmt == "html":
            from hopnet.report.html import render_html

            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(render_html(content), encoding="utf-8")
            written.append(target)
        else:
            from hopnet.report.markdown import write_markdown

            written.extend(write_markdown(content, target))
        if trace is not None:
            written.append(write_trace(run, trace))
    except OSError as exc:
        raise ConfigError(f"cannot write the report: {exc.strerror or exc} ({exc.filename or target})") from None
    return written
