"""Every JSON and Python example in README.md and docs/**/*.md works as printed.

The blocks are found by tests/readme_blocks.py, which also documents the markers: by
default a ``python`` block runs stand-alone (in an empty directory) and must exit 0;
a ``json`` block must parse, and one with ``nodes`` and ``edges`` must pass
``Graph.from_json`` and ``hopnet graph validate``. A block preceded by
``<!-- readme-test: launch -->`` is worker code: it runs after a harness that defines
its placeholders (``build_model``, ``loss_fn``, ``x``, ``y``) under `hopnet launch` with
2 workers, and must finish with exit 0 having trained (its reported loss falls).
New blocks are picked up automatically; one that cannot run stand-alone needs a marker.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hopnet import Graph
from hopnet.analysis import load_run
from hopnet.cli.main import main as cli_main

from support.env import clean_env
from support.launch import run_launch
from readme_blocks import ROOT, Block, all_blocks, fenced_blocks, launch_script

BLOCKS = all_blocks()


def _is_graph(data: object) -> bool:
    return isinstance(data, dict) and "nodes" in data and "edges" in data


def _hopnet_graph_validate(path: Path) -> tuple[int, str]:
    """`hopnet graph validate PATH` through the command's entry point in this process (no
    interpreter start per block): its exit status and what it wrote on stderr."""
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        code = cli_main(["graph", "validate", str(path)])
    return code, stderr.getvalue()


def check_json_block(block: Block, tmp_path: Path) -> None:
    try:
        data = json.loads(block.text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{block.id}: not valid JSON: {exc}") from None
    if not _is_graph(data):
        return
    path = tmp_path / "example.json"
    path.write_text(block.text)
    code, stderr = _hopnet_graph_validate(path)
    if block.mode == "invalid":
        assert code != 0, f"{block.id}: meant as an invalid graph, but validates"
        return
    assert code == 0, f"{block.id}: hopnet graph validate: {stderr.strip()}"
    Graph.from_json(data)


def check_fragment_block(block: Block) -> None:
    """Compile the fragment (top-level ``await`` allowed) and resolve every import in it."""
    tree = compile(block.text, block.id, "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block.id}: {node.module} has no {alias.name}"


def check_python_block(block: Block, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.id} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"


def check_launch_block(block: Block, tmp_path: Path) -> None:
    nproc = int(block.args.get("nproc", "2"))
    script = tmp_path / "readme_worker.py"
    script.write_text(launch_script(block))
    run_dir = tmp_path / "run"
    protocol = ["--protocol", block.args["protocol"]] if "protocol" in block.args else []
    result = run_launch(["--nproc", str(nproc), *protocol, "--timeout", "120", "--run-dir", str(run_dir),
                         str(script)], timeout=600)
    assert result.returncode == 0, f"{block.id} failed under hopnet launch:\n{result.stderr[-3000:]}"
    events = load_run(run_dir)
    assert sorted(events) == list(range(nproc))
    for rank, records in events.items():
        losses = [r["loss"] for r in records if r.get("event") == "iteration" and "loss" in r]
        assert len(losses) >= 20, f"{block.id}: rank {rank} reported {len(losses)} losses"
        tenth = max(1, len(losses) // 10)
        first, last = sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth
        assert last < 0.5 * first, f"{block.id}: rank {rank} did not train (loss {first:.4g} -> {last:.4g})"


def _params(lang: str, slow_modes: tuple[str, ...] = ()) -> list:
    params = []
    for b in BLOCKS:
        if b.lang != lang:
            continue
        marks = [pytest.mark.slow] if b.mode in slow_modes else []
        params.append(pytest.param(b, id=b.id, marks=marks))
    return params


@pytest.mark.parametrize("block", _params("json"))
def test_json_example(block: Block, tmp_path: Path) -> None:
    check_json_block(block, tmp_path)


@pytest.mark.parametrize("block", _params("python", slow_modes=("launch",)))
def test_python_example(block: Block, tmp_path: Path) -> None:
    if block.mode == "launch":
        check_launch_block(block, tmp_path)
    elif block.mode == "fragment":
        check_fragment_block(block)
    else:
        check_python_block(block, tmp_path)


# ---------------------------------------------------------------------------- the machinery itself
def test_the_readme_examples_are_all_found() -> None:
    readme = [b for b in BLOCKS if b.path.name == "README.md"]
    assert any(b.mode == "launch" and "hopnet.init(model)" in b.text for b in readme)  # the embedding snippet
    assert any(b.lang == "python" and "Graph.ring(8)" in b.text for b in readme)
    assert any(b.lang == "json" and _is_graph(json.loads(b.text)) for b in readme)
    assert any(b.path == ROOT / "docs" / "reference" / "graph-schema.md" for b in BLOCKS)


BROKEN = """\
# A page

<!-- readme-test: launch nproc=3 -->

```python
raise SystemExit(3)
```

```json
{"nodes": 4, "undirected": true, "edges": [[0, 1], [1, 2], [2, 3], [3, 0]],
 "weights": [[0, 1, 0.5], [1, 1, 0.5]]}
```

```python
raise SystemExit(3)
```
"""


def test_a_broken_example_fails_its_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(BROKEN)
    launch_block, graph_block, python_block = fenced_blocks(page)
    assert (launch_block.mode, launch_block.args, launch_block.line) == ("launch", {"nproc": "3"}, 5)
    with pytest.raises(AssertionError, match="weights given for some in-edges"):
        check_json_block(graph_block, tmp_path)  # the README's old graph example
    with pytest.raises(AssertionError, match=r"failed \(exit 3\)"):
        check_python_block(python_block, tmp_path)


def test_a_fragment_naming_an_api_that_is_gone_fails() -> None:
    good = Block(Path("doc.md"), 1, "python", "from hopnet.report.rundir import load_run_dir\n"
                 "await node.collective.allreduce((0, 1), t, 'mean', tag='x')\n", mode="fragment")
    check_fragment_block(good)
    gone = Block(Path("doc.md"), 1, "python", "from hopnet.report.rundir import load_a_run_that_is_gone\n",
                 mode="fragment")
    with pytest.raises(AssertionError, match="has no load_a_run_that_is_gone"):
        check_fragment_block(gone)
