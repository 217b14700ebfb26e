"""examples/train_lm.py, the byte-level decoder on the stdlib's source: its data split, its model, and
short real runs under `hopnet launch` whose held-out loss falls well below where it started."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from support.paths import EXAMPLES

sys.path.insert(0, str(EXAMPLES))

import lm_data  # noqa: E402
from train_lm import ByteLM  # noqa: E402

LM = str(EXAMPLES / "train_lm.py")
EVAL = re.compile(r"^\[rank (\d+)\] iteration (\d+) held-out loss ([0-9.]+) perplexity ([0-9.]+)$", re.MULTILINE)
OWN = re.compile(r"^\[rank (\d+)\] held-out loss ([0-9.]+) perplexity [0-9.]+ \(this worker's model", re.MULTILINE)
CONSENSUS = re.compile(r"^\[rank 0\] consensus model held-out loss ([0-9.]+) perplexity [0-9.]+$", re.MULTILINE)


def _tree(root: Path) -> dict[str, bytes]:
    """A stdlib-like tree: the files the corpus takes, and the ones it must leave out."""
    kept = {f"mod{i}.py": f"# module {i}\n".encode() * 50 for i in range(40)}
    kept |= {f"pkg/sub{i}.py": f"# sub {i}\n".encode() * 50 for i in range(20)}
    skipped = {"site-packages/numpy/core.py": b"x", "test/test_os.py": b"x", "pkg/tests/helper.py": b"x",
               "idlelib/idle_test/htest.py": b"x", "test_grammar.py": b"x", "pkg/readme.txt": b"x"}
    for name, content in (kept | skipped).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return kept


def test_the_split_is_deterministic_disjoint_and_leaves_out_tests_and_site_packages(tmp_path: Path) -> None:
    kept = _tree(tmp_path)
    assert lm_data.corpus_files(tmp_path) == sorted(kept)
    train, heldout = lm_data.load_corpus(10**6, root=tmp_path, heldout_percent=30)
    again = lm_data.load_corpus(10**6, root=tmp_path, heldout_percent=30)
    assert torch.equal(train, again[0]) and torch.equal(heldout, again[1])
    train_text, heldout_text = bytes(train.tolist()), bytes(heldout.tolist())
    for name, content in kept.items():  # each file whole in exactly the split its path's hash names
        held = lm_data.is_heldout(name, 30)
        assert (content in heldout_text, content in train_text) == (held, not held), name
    assert 0 < len(heldout) < len(train)
    assert len(train) + len(heldout) == sum(len(c) + 1 for c in kept.values())
    capped, _ = lm_data.load_corpus(2000, root=tmp_path, heldout_percent=30)
    assert 2000 <= len(capped) < 2000 + 600  # files whole, until the cap is reached


def test_the_real_stdlib_gives_both_splits_and_the_same_held_out_windows() -> None:
    files = lm_data.corpus_files()
    assert len(files) > 100 and not any("site-packages" in f or f.startswith("test/") for f in files)
    held = [f for f in files if lm_data.is_heldout(f)]
    assert 0 < len(held) < len(files) / 5
    train, heldout = lm_data.load_corpus(200_000)
    x, y = lm_data.heldout_windows(heldout, 32, 8)
    assert x.shape == y.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, lm_data.heldout_windows(lm_data.load_corpus(200_000)[1], 32, 8)[0])


def test_the_model_is_causal_and_its_embedding_tied() -> None:
    torch.manual_seed(0)
    model = ByteLM(32, 2, 4)
    assert model.out.weight is model.embed.weight
    tokens = torch.randint(256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.allclose(before[:, :10], after[:, :10], atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["allreduce", "hop", "diloco"])
def test_two_workers_bring_the_held_out_loss_well_down(launch, tmp_path: Path, protocol: str) -> None:
    """30 iterations of the tiny preset, at half its batch: from ~5.3 (uniform over bytes) to ~3.2."""
    flags = ["--local-steps", "5"] if protocol == "diloco" else []
    result = launch(["--nproc", "2", "--protocol", protocol, *flags, "--run-dir", str(tmp_path / "run"), LM,
                     "--preset", "tiny", "--iterations", "30", "--eval-every", "15", "--batch-size", "4",
                     "--eval-windows", "32"])
    assert result.returncode == 0, result.stderr[-3000:]
    evals = {(int(r), int(i)): float(loss) for r, i, loss, _ in EVAL.findall(result.stdout)}
    own = {int(r): float(loss) for r, loss in OWN.findall(result.stdout)}
    (consensus,) = map(float, CONSENSUS.findall(result.stdout))
    assert sorted(own) == [0, 1] and evals[(0, 0)] == evals[(1, 0)] > 5.0, result.stdout
    assert max(own.values()) < evals[(0, 0)] - 1.2 and consensus < evals[(0, 0)] - 1.2, result.stdout
    if protocol == "allreduce":  # one model on every worker, as under DDP
        assert own[0] == own[1] == consensus, result.stdout
