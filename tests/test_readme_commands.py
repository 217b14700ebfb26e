"""Every `hopnet launch` and `hopnet simulate` command shown in README.md and docs/**/*.md parses,
and its protocol options pass the same checks the launcher runs before it starts anything: a
flag renamed or a combination refused (`--skip-threshold` without `--max-jump`) breaks this
test, not a reader's first try. Nothing is launched; the example scripts named must exist."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from hopnet.cli.main import build_parser
from hopnet.config import config_from_args
from hopnet.config_checks import check_config_for_graph
from hopnet.launch.spec import resolve_graph

from readme_blocks import DOCUMENTS, ROOT, fenced_blocks

CHECKED = ("launch", "simulate")
SHELL_LINE = re.compile(r"^\s*([A-Z_]+=\S*\s+)*hopnet\s")
"""A line that runs `hopnet` (after environment assignments)."""


def _commands(text: str) -> list[list[str]]:
    """The `hopnet launch|simulate` commands of a shell block, continuations joined, comments,
    environment assignments and chained commands split off. A block laid out as two columns (the
    commands of two machines side by side) is left out: its lines are no shell lines."""
    if any("\\ " in line for line in text.splitlines()):
        return []  # two commands side by side (one machine per column), not a shell line
    joined = text.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            if not SHELL_LINE.match(part):
                continue
            words = shlex.split(part, comments=True)
            if any(word.startswith("[") for word in words):
                continue  # a synopsis, not a command
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # HOPNET_GRAPH=ring:8 hopnet launch ...
            if len(words) >= 2 and words[0] == "hopnet" and words[1] in CHECKED:
                commands.append(words[1:])
    return commands


def _shown_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCUMENTS:
        for block in fenced_blocks(path, ("bash", "sh", "")):
            for words in _commands(block.text):
                found.append((f"{path.relative_to(ROOT)}:{block.line}", words))
    return found


SHOWN = _shown_commands()


def test_the_documents_show_commands_of_both_kinds() -> None:
    kinds = {words[0] for _, words in SHOWN}
    assert kinds == set(CHECKED), kinds
    assert len(SHOWN) >= 20


def _parse(words: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(words)
    except SystemExit:
        raise AssertionError(f"hopnet {' '.join(words)}: {err.getvalue().strip()}") from None


@pytest.mark.parametrize(("where", "words"), SHOWN, ids=[f"{w}:{' '.join(c[:3])}" for w, c in SHOWN])
def test_a_documented_command_parses_and_passes_the_launchers_checks(where: str, words: list[str]) -> None:
    args = _parse(words)
    if words[0] == "launch":
        if args.resume is not None:
            return  # names a run directory of the reader's
        script = args.script
        assert script is not None, f"{where}: no SCRIPT"
        if script.startswith("examples/"):
            assert (ROOT / script).is_file(), f"{where}: {script} does not exist"
    config = config_from_args(args)
    graph, _ = resolve_graph(args.graph, args.nproc if isinstance(args.nproc, int) else None)
    check_config_for_graph(config, graph)
