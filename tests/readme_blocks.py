"""The fenced code examples of README.md and docs/**/*.md, and how each one is exercised.

Used by tests/test_readme.py (every example must work) and bench/threads.py (the
embedding snippet's speed). A block's mode comes from an HTML comment on the line
before its opening fence (blank lines between are allowed), invisible on GitHub:

``<!-- readme-test: launch -->``
    Python that runs inside a worker: it is appended to :data:`LAUNCH_PRELUDE` (which
    defines the placeholders ``build_model``, ``loss_fn``, ``x``, ``y`` and
    ``checkpoint_path``, a checkpoint of a model and an AdamW optimizer) and run
    under `hopnet launch` with 2 workers. Add ``nproc=N`` to change the count, ``protocol=NAME``
    to pass ``--protocol NAME``.
``<!-- readme-test: invalid -->``
    JSON that must be *rejected* by ``hopnet graph validate`` (an example of an error).
``<!-- readme-test: fragment REASON -->``
    Python lines taken out of a larger program (protocol code with a top-level
    ``await``, a run directory that must exist): not run, but compiled, and every
    ``import`` / ``from ... import`` in it must resolve, so a renamed API breaks the
    test. The reason (where the same calls run for real) is required.

Without a comment a ``python`` block runs stand-alone in an empty directory, and a
``json`` block must parse; one that has ``nodes`` and ``edges`` must be a valid graph.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""The README and every page of the docs site, in every folder of ``docs/``."""
LANGUAGES = ("python", "json")

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*readme-test:\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    mode: str = "run"
    args: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def id(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{where}:{self.line}:{self.lang}:{self.mode}"


def fenced_blocks(path: Path, languages: tuple[str, ...] = LANGUAGES) -> list[Block]:
    """The fenced blocks of ``path`` in ``languages``, each with its readme-test mode."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        lang, start = fence.group(1).lower(), i
        end = start + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{start + 1}: unclosed code fence")
        if lang in languages:
            block = Block(path, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n")
            _apply_mark(block, lines, start)
            blocks.append(block)
        i = end + 1
    return blocks


def _apply_mark(block: Block, lines: list[str], fence_index: int) -> None:
    j = fence_index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    mark = _MARK.match(lines[j]) if j >= 0 else None
    if not mark:
        return
    mode, rest = mark.group(1), mark.group(2)
    where = f"{block.path}:{j + 1}"
    if mode not in ("launch", "invalid", "fragment"):
        raise ValueError(f"{where}: unknown readme-test mode {mode!r} (launch, invalid, fragment)")
    if mode == "fragment" and not rest:
        raise ValueError(f"{where}: readme-test: fragment needs a reason")
    block.mode = mode
    if mode == "fragment":
        block.reason = rest
    else:
        for item in rest.split():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{where}: expected key=value, got {item!r}")
            block.args[key] = value


def all_blocks() -> list[Block]:
    return [b for doc in DOCUMENTS for b in fenced_blocks(doc)]


LAUNCH_PRELUDE = '''\
# --- readme-test harness: the placeholders of the README's worker snippets ---------
import os as _os

import torch as _torch

_torch.manual_seed(0)                                     # the same model on every worker
_W_TRUE = _torch.linspace(-1.0, 1.0, 8).unsqueeze(1)


def build_model():
    return _torch.nn.Linear(8, 1)


loss_fn = _torch.nn.MSELoss()
_g = _torch.Generator().manual_seed(100 + int(_os.environ["HOPNET_RANK"]))
x = _torch.randn(64, 8, generator=_g)                     # this worker's own data
y = x @ _W_TRUE + 0.01 * _torch.randn(64, 1, generator=_g)
checkpoint_path = _os.path.join(_os.environ["HOPNET_RUN_DIR"], f"checkpoint-rank{_os.environ['HOPNET_RANK']}.pt")
_resumed = build_model()                                  # a checkpoint to resume from: trained a little
_resumed_opt = _torch.optim.AdamW(_resumed.parameters(), lr=0.05)
loss_fn(_resumed(x), y).backward()
_resumed_opt.step()
_torch.save({"model": _resumed.state_dict(), "optimizer": _resumed_opt.state_dict()}, checkpoint_path)
# --- the README's block ---------------------------------------------------------------
'''


def launch_script(block: Block, prelude: str = LAUNCH_PRELUDE) -> str:
    """A worker script: the harness that defines the placeholders, then the block."""
    return prelude + block.text
