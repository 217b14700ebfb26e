"""No class in hopnet/ grows past 500 lines.

A class that long holds several jobs; its parts belong in modules of their own (issue 30).
Nested classes count inside their outer class and on their own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hopnet"
MAX_CLASS_LINES = 500


def _long_classes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                where = path.relative_to(PACKAGE.parent)
                found.append(f"{where}:{node.lineno} class {node.name} is {lines} lines")
    return found


def test_no_class_is_longer_than_500_lines() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules, f"no modules found under {PACKAGE}"
    too_long = [entry for path in modules for entry in _long_classes(path)]
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(too_long)
