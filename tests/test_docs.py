"""The docs site: the README stays short, the generated reference pages cover what the code
declares, the environment page lists every variable the code reads, and the site builds in
strict mode (a broken link or a page missing from the nav fails)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hopnet import registry
from hopnet.cli.main import build_parser
from hopnet.config import run_fields

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "hooks" / "reference.py"
VARIABLE = re.compile(r"HOPNET_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")
"""A whole variable name (``HOPNET_CHECKPOINT_*``, a family named in prose, is none)."""
README_MAX_LINES = 200


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _reference()


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs on the site (docs/)"


def _variables_read_by_hopnet() -> dict[str, str]:
    """Every ``HOPNET_*`` name in hopnet's source, with a file that names it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "hopnet").rglob("*.py")):
        for name in VARIABLE.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def _environment_page() -> str:
    return reference.environment_markdown((ROOT / "docs" / reference.ENVIRONMENT_PAGE).read_text(encoding="utf-8"))


def test_the_environment_page_lists_every_variable_hopnet_reads() -> None:
    page = set(VARIABLE.findall(_environment_page()))
    read = _variables_read_by_hopnet()
    assert len(read) >= 20, sorted(read)  # the scan found the launcher's variables
    missing = {name: where for name, where in read.items() if name not in page}
    assert not missing, f"docs/{reference.ENVIRONMENT_PAGE} does not list {missing}"


def test_the_environment_page_lists_every_option_variable() -> None:
    page = set(VARIABLE.findall(_environment_page()))
    options = [*run_fields(), *registry.protocol_option_fields()]
    assert {reference.variable_name(f.name) for f in options} <= page


def _all_flags(parser: argparse.ArgumentParser) -> list[str]:
    flags = [s for action in parser._actions for s in action.option_strings if s not in ("-h", "--help")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags += _all_flags(sub)
    return flags


def test_the_cli_page_has_every_subcommand_and_flag() -> None:
    parser = build_parser()
    page = reference.cli_markdown(parser)
    commands = [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                for name in action.choices]
    assert {"launch", "simulate", "report", "graph", "keygen"} <= set(commands)
    for name in commands:
        assert f"## `hopnet {name}`" in page
    flags = _all_flags(parser)
    assert "--backup-workers" in flags and "--compute-ms" in flags  # protocol flags and simulate's own
    missing = [flag for flag in flags if not re.search(rf"[` ]{re.escape(flag)}[ `,]", page)]
    assert not missing, missing


def test_the_options_page_has_every_protocol_and_option() -> None:
    page = reference.options_markdown(["protocols/hop.md"])
    for spec in registry.specs():
        assert f"## `{spec.name}`" in page
        for f in spec.option_fields():
            assert f"`{f.flag}`" in page and f"`{reference.variable_name(f.name)}`" in page
    assert "[hop](../protocols/hop.md)" in page


def test_a_table_cell_keeps_its_code_and_escapes_the_rest() -> None:
    assert reference.cell("a|b `x|y<z>` <t>\n *s*") == "a\\|b `x|y<z>` &lt;t&gt; \\*s\\*"


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """What CI runs: every page in the nav exists, every link between pages and to a heading resolves,
    the generated pages render."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "--backup-workers" in cli
    environment = (tmp_path / "site" / "reference" / "environment" / "index.html").read_text(encoding="utf-8")
    assert "HOPNET_MAX_IG" in environment and reference.OPTION_VARIABLES_MARKER not in environment
