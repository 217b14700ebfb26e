"""The Lightning strategy (hopnet.integrations.lightning) in real runs under `hopnet launch`, 2 workers.

Each Lightning worker imports lightning (about 4 CPU-seconds more than torch alone), so the runs are
few and short. The bar for accuracy is the bare-API example's with the same budget (2 workers, 150
iterations of 32 samples, examples/train_digits.py): 0.953 under hop and allreduce, 0.950 under
diloco; the Lightning example measured 0.953, 0.953 and 0.947.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed

from hopnet.errors import ConfigError
from hopnet.data import FixedEpochs
from hopnet.integrations._lightning import elastic_train_loader, rank_path, reduce_stacked, refusal
from support.elastic import assert_joined_late, launch_and_join, launch_and_preempt, worker_returncode
from support.env import clean_env
from support.launch import kill, start_launch, worker_pids
from support.paths import EXAMPLES, ROOT
from support.records import records
from support.wait import wait_until

EXAMPLE = str(EXAMPLES / "lightning_digits.py")
WORKER = str(ROOT / "tests" / "scripts" / "lightning_worker.py")
GATED = str(ROOT / "tests" / "scripts" / "lightning_elastic.py")
"""The example, whose first workers wait at step 20 for the joiner to start (tests/scripts/joiner_gate.py)."""
FP16 = str(ROOT / "tests" / "scripts" / "lightning_fp16.py")
ACCURACY = re.compile(r"^\[rank (\d+)\] held-out accuracy ([0-9.]+) after (\d+) steps", re.MULTILINE)
ELASTIC_STEPS = 400
ELASTIC_BAR = 0.95
"""The example's accuracy after ELASTIC_STEPS steps without a join or leave: 0.969 with 2 workers, 0.967
with 3 (measured); with a join 0.967, with a leave 0.969. The bar is that, less the noise between runs."""
BAR = 0.93
"""The bare-API example's accuracy with the same budget (0.95), less the noise between runs."""


def _accuracies(stdout: str) -> dict[int, float]:
    return {int(rank): float(acc) for rank, acc, _ in ACCURACY.findall(stdout)}


def _checkpointed_run(launch, tmp_path: Path, protocol: str) -> tuple[Path, Path]:
    run_dir, checkpoints = tmp_path / protocol, tmp_path / f"{protocol}-checkpoints"
    result = launch(["--nproc", "2", "--protocol", protocol, "--run-dir", str(run_dir), EXAMPLE,
                     "--iterations", "150", "--checkpoint-dir", str(checkpoints)])
    assert result.returncode == 0, result.stderr
    accuracies = _accuracies(result.stdout)
    assert sorted(accuracies) == [0, 1], result.stdout
    assert min(accuracies.values()) >= BAR, accuracies
    assert len(set(accuracies.values())) == 1, accuracies  # both hold the consensus model
    return run_dir, checkpoints


def test_hop_trains_the_example_checkpoints_every_rank_and_logs_the_waits(launch, tmp_path: Path) -> None:
    run_dir, checkpoints = _checkpointed_run(launch, tmp_path, "hop")
    # Every rank writes its own checkpoint (rank 0 at Lightning's path), hopnet's state inside.
    saved = torch.load(checkpoints / "epoch=1-step=44.ckpt", weights_only=False)
    assert (checkpoints / "epoch=1-step=44.ckpt.rank1").exists() and (checkpoints / "last.ckpt.rank1").exists()
    assert saved["global_step"] == 44 and isinstance(saved["hopnet"], bytes)
    # hopnet's per-step waits, through Lightning's logger (rank 0's CSVLogger).
    logged = (run_dir / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"hopnet/wait_updates_s", "hopnet/wait_tokens_s", "hopnet/mix_s"} <= set(logged), logged
    consensus = records(run_dir, 0, "consensus")
    assert len(consensus) == 1 and consensus[0]["members"] == [0, 1], consensus


@pytest.mark.slow
def test_diloco_trains_and_resumes_from_a_model_checkpoint(launch, tmp_path: Path) -> None:
    _, checkpoints = _checkpointed_run(launch, tmp_path, "diloco")
    resumed = tmp_path / "resumed"
    result = launch(["--nproc", "2", "--protocol", "diloco", "--run-dir", str(resumed), EXAMPLE,
                     "--iterations", "150", "--resume", str(checkpoints / "epoch=1-step=44.ckpt")])
    assert result.returncode == 0, result.stderr
    assert min(_accuracies(result.stdout).values()) >= BAR, result.stdout
    for rank in (0, 1):  # each rank went on from its own checkpoint: after iteration 43, at step 44
        assert [r["iter"] for r in records(resumed, rank, "resumed")] == [43]
        assert records(resumed, rank, "iteration")[0]["iter"] == 44


@pytest.mark.slow
def test_allreduce_ends_with_the_parameters_of_lightnings_ddp(launch, tmp_path: Path) -> None:
    """Clipping, two micro-batches of accumulation and a BatchNorm layer, with ``--bucket-mb 0``: the
    gradient is averaged only where the strategy asks for it (before the clip), so a clip of the local
    gradient would part the two (by 0.06 here); the BatchNorm statistics are rank 0's before every
    step, as DDP broadcasts them before every forward pass."""
    flags = ["--iterations", "40", "--clip", "0.3", "--accumulate", "2", "--batchnorm"]  # (accuracy: the hop test's)
    ours, theirs = tmp_path / "hopnet.pt", tmp_path / "ddp.pt"
    result = launch(["--nproc", "2", "--protocol", "allreduce", "--bucket-mb", "0", "--run-dir",
                     str(tmp_path / "run"), EXAMPLE, *flags, "--save", str(ours)])
    assert result.returncode == 0, result.stderr
    # Lightning's DDP in processes forked from the script's (the same DDP as "ddp", without a second
    # interpreter importing torch and Lightning: 6 CPU-s less)
    ddp = subprocess.run([sys.executable, EXAMPLE, "--strategy", "ddp_fork", "--devices", "2", *flags, "--save", str(theirs)],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert ddp.returncode == 0, ddp.stderr
    a, b = torch.load(ours), torch.load(theirs)
    assert a.keys() == b.keys() and "net.1.running_mean" in a
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


@pytest.mark.slow
def test_an_overflow_under_fp16s_gradient_scaler_is_skipped_by_every_rank_as_under_ddp(launch, tmp_path: Path) -> None:
    """Lightning's 16-mixed plugin with a gradient scaler, rank 1's loss infinite at step 4: rank 1's scaler
    skips its step, rank 0's step finds the averaged gradient non-finite and skips it too, and both end
    with the model of Lightning's DDP on the same script. Only rank 1 halves its scale (under DDP both
    do): each rank unscales its own gradient before the average."""
    ours, theirs = tmp_path / "hopnet.pt", tmp_path / "ddp.pt"
    run_dir = tmp_path / "run"
    result = launch(["--nproc", "2", "--protocol", "allreduce", "--bucket-mb", "0", "--run-dir", str(run_dir), FP16,
                     "--save", str(ours)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 scale 16 steps 12" in result.stdout and "rank 1 scale 8 steps 12" in result.stdout, result.stdout
    assert [(r["iter"], r["averaged"]) for r in records(run_dir, 0, "non_finite_gradient")] == [(4, True)]
    ddp = subprocess.run([sys.executable, FP16, "--strategy", "ddp_fork", "--devices", "2", "--save", str(theirs)],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "rank 0 scale 8 steps 12" in ddp.stdout, ddp.stdout
    a, b = torch.load(ours), torch.load(theirs)
    assert a.keys() == b.keys()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-5


@pytest.mark.slow
def test_the_old_namespace_an_agreed_early_stop_and_the_collectives(launch, tmp_path: Path) -> None:
    """pytorch_lightning's Trainer under ad-psgd, stopped early by a decision only rank 0 makes
    (``reduce_boolean_decision(any)``, as EarlyStopping's): both stop at step 30 and end with
    the consensus; then reduce, all_gather, broadcast and barrier agree across the workers."""
    run_dir = tmp_path / "run"
    result = launch(["--nproc", "2", "--protocol", "ad-psgd", "--run-dir", str(run_dir), WORKER,
                     "--namespace", "pytorch_lightning", "--stop-at", "30"])
    assert result.returncode == 0, result.stderr
    lines = sorted(re.findall(r"^\[rank \d\] (accuracy .*)$", result.stdout, re.MULTILINE))
    assert len(lines) == 2 and lines[0] == lines[1], result.stdout
    assert "steps 30 iteration 30 sum 3 gathered [0, 1] broadcast 'from rank 1'" in lines[0], lines
    assert float(lines[0].split()[1]) >= 0.8, lines  # 31 steps of the digits MLP
    assert [r["members"] for r in records(run_dir, 1, "consensus")] == [[0, 1]]


def test_what_lightning_cannot_follow_is_refused_in_one_line() -> None:
    """Checked on the worker hopnet.init returned, before anything trains; each line names the flag."""
    def worker(skip_threshold: int | None = None, checkpointer: object = None, replica_size: int = 1) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(options=SimpleNamespace(skip_threshold=skip_threshold)),
                               checkpointer=checkpointer, replica=SimpleNamespace(size=replica_size))

    assert refusal(worker()) is None
    for flags, flag in [({"skip_threshold": 2}, "--skip-threshold"), ({"checkpointer": object()}, "--checkpoint-every"),
                        ({"replica_size": 2}, "--replica-size")]:
        why = refusal(worker(**flags))
        assert why is not None and flag in why and "\n" not in why, (flags, why)


def test_an_elastic_runs_train_loader_takes_fixed_epochs_of_the_elastic_sampler() -> None:
    """Lightning's loader is rebuilt (by ``update``, Lightning's own in the strategy) on the members'
    elastic sampler, in epochs of one pass by the members; a loader without a batch size is refused in
    one line, and one over an IterableDataset is left as the script built it."""
    registered: dict[str, object] = {}
    worker = SimpleNamespace(rank=1, members=(0, 1), view=0, _states=registered,
                             register_state=registered.__setitem__)
    loader = torch.utils.data.DataLoader(range(100), batch_size=8, shuffle=True)
    rebuilt = elastic_train_loader(worker, loader, lambda dl, sampler: (dl, sampler))  # type: ignore[arg-type]
    assert rebuilt[0] is loader and isinstance(rebuilt[1], FixedEpochs) and len(rebuilt[1]) == 6 * 8
    assert set(registered) == {"lightning_sampler", "lightning_epochs"}
    batches = torch.utils.data.DataLoader(range(100), batch_sampler=[[0, 1]])
    with pytest.raises(ConfigError, match="batch_size") as refused:
        elastic_train_loader(worker, batches, lambda dl, sampler: dl)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    streamed = torch.utils.data.DataLoader(Stream(), batch_size=2)
    assert elastic_train_loader(worker, streamed, lambda dl, sampler: None) is streamed  # type: ignore[arg-type]


def test_reduce_ops_and_each_ranks_checkpoint_file() -> None:
    stacked = torch.tensor([[1.0, 4.0], [3.0, 2.0]])
    assert reduce_stacked(stacked, "mean").tolist() == [2.0, 3.0]
    assert reduce_stacked(stacked, torch.distributed.ReduceOp.SUM).tolist() == [4.0, 6.0]
    assert reduce_stacked(stacked, "max").tolist() == [3.0, 4.0]
    assert reduce_stacked(torch.tensor([[1], [2]]), "avg").tolist() == [1.5]  # as DDP's: the sum, divided
    with pytest.raises(ConfigError, match="reduce_op 'product' is not supported"):
        reduce_stacked(stacked, "product")
    assert rank_path("ckpts/last.ckpt", 0) == "ckpts/last.ckpt"
    assert rank_path("ckpts/last.ckpt", 3) == "ckpts/last.ckpt.rank3"


@pytest.mark.slow
def test_a_lost_worker_is_left_out_of_the_collectives_and_the_consensus(launch, tmp_path: Path) -> None:
    """Under --max-failures the others train on (Hop with a backup worker), and their collectives
    and consensus count the live workers only."""
    run_dir = tmp_path / "run"
    result = launch(["--nproc", "3", "--backup-workers", "1", "--max-failures", "1", "--peer-timeout", "2",
                     "--run-dir", str(run_dir), WORKER, "--iterations", "40", "--die", "2:10"])
    assert result.returncode == 0, result.stderr
    assert "lost rank 2" in result.stderr + result.stdout
    lines = sorted(re.findall(r"^\[rank (\d)\] accuracy .* steps 40 iteration 39 (.*)$", result.stdout, re.MULTILINE))
    assert lines == [(rank, "sum 3 gathered [0, 1] broadcast 'from rank 1'") for rank in "01"], result.stdout
    assert [r["members"] for r in records(run_dir, 0, "consensus")] == [[0, 1]]



@pytest.mark.slow
def test_a_killed_worker_is_replaced_where_its_neighbour_was(tmp_path: Path) -> None:
    """--max-restarts: rank 2 is SIGKILLed mid-run; its replacement takes a neighbour's model, optimizer
    and Trainer state (the loops' progress, the LR schedule's) and goes on from there, not from step 0.
    Every rank then ends at the same iteration, epoch and learning rate (0.1 halved every 50 steps:
    0.0125 after 150), with the accuracy of the run without the kill (0.950 measured under both)."""
    run_dir = tmp_path / "run"
    protocol = "hop"  # (allreduce's replacement through an adapter: tests/test_hf.py; it ran here too, alike)
    proc = start_launch(["--nproc", "3", "--protocol", protocol, "--max-restarts", "1", "--peer-timeout", "3",
                         "--run-dir", str(run_dir), "--no-progress", WORKER, "--iterations", "150", "--lr-step", "50"],
                        new_session=True)
    try:
        pids = worker_pids(run_dir, 3)
        wait_until(lambda: any(r["iter"] >= 30 for r in records(run_dir, 2, "iteration")), 120, interval=0.05,
                   what="rank 2's iteration 30", while_running=proc)
        os.kill(pids[2], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        kill(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rank 2 died (killed by SIGKILL); restarting it (restart 1 of 1)" in err, err[-3000:]
    rejoined = records(run_dir, 2, "rejoined")
    assert len(rejoined) == 1 and rejoined[0]["iter"] > 0, rejoined
    assert [[r["iter"] for r in records(run_dir, rank, "stop")] for rank in range(3)] == [[149]] * 3
    lines = re.findall(r"^\[rank (\d)\] accuracy ([0-9.]+) (epoch \d+ lr \S+ steps 150 iteration 149 .*)$", out,
                       re.MULTILINE)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1", "2"], out
    # The consensus model, the same loop state, and the collectives after fit agree (the replacement
    # counts the gathers from its donor's count).
    assert len({(acc, rest) for _, acc, rest in lines}) == 1, lines
    assert " lr 0.0125 " in lines[0][2] and "sum 6 gathered [0, 1, 2]" in lines[0][2], lines
    assert float(lines[0][1]) >= 0.95 - 0.02, lines


def _steps(stdout: str) -> dict[int, int]:
    return {int(rank): int(steps) for rank, _, steps in ACCURACY.findall(stdout)}


@pytest.mark.slow
def test_a_worker_joins_a_running_fit_at_its_donors_step(tmp_path: Path) -> None:
    """`hopnet join` into a run of 2 (--max-nproc 3): the joiner enters at its strategy's setup, takes a
    member's model, optimizer and Trainer state, and its loop goes on at the donor's global step: it
    ends with the others after ELASTIC_STEPS steps, having computed only those after its join. (On an
    idle machine the first workers ran all 400 steps before a cold joiner reached its setup: they wait
    at step 20 until it has started.)"""
    run_dir = tmp_path / "run"
    ended, joined = launch_and_join(["--nproc", "2", "--max-nproc", "3", "--run-dir", str(run_dir), "--no-progress",
                                     GATED, "--iterations", str(ELASTIC_STEPS)], run_dir,
                                    env=clean_env(GATE_AT_STEP="20", GATE_FOR_RANK="2"))
    assert_joined_late(ended, joined, run_dir, 2, last=ELASTIC_STEPS - 1)
    # (the joiner's own lines come through `hopnet join`, which prefixes nothing)
    mine = re.findall(r"^held-out accuracy ([0-9.]+) after (\d+) steps", joined.stdout, re.MULTILINE)
    assert _steps(ended.stdout) == {0: ELASTIC_STEPS, 1: ELASTIC_STEPS}, ended.stdout[-2000:]
    assert [steps for _, steps in mine] == [str(ELASTIC_STEPS)], joined.stdout[-2000:]
    accuracies = {**_accuracies(ended.stdout), 2: float(mine[0][0])}
    assert min(accuracies.values()) >= ELASTIC_BAR and len(set(accuracies.values())) == 1, accuracies
    assert [r["members"] for r in records(run_dir, 0, "consensus")] == [[0, 1, 2]]


@pytest.mark.slow
def test_a_preempted_worker_leaves_the_fit_and_the_others_finish(tmp_path: Path) -> None:
    """A SIGTERM to rank 2 of 3 (--min-nproc 2) after its iteration 20: it leaves at the next view change
    and exits 0, Lightning's own SIGTERM handling (stop at the next batch) notwithstanding; the
    others finish every step with the accuracy of a run without the leave."""
    run_dir = tmp_path / "run"
    ended = launch_and_preempt(["--nproc", "3", "--min-nproc", "2", "--run-dir", str(run_dir), "--no-progress",
                                EXAMPLE, "--iterations", str(ELASTIC_STEPS)], run_dir, rank=2, after_iteration=20)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert worker_returncode(run_dir, 2) == 0
    (left,) = records(run_dir, 2, "left")
    assert left["iter"] >= 20 and left["line"].startswith("rank 2 left after iteration"), left
    assert _steps(ended.stdout) == {0: ELASTIC_STEPS, 1: ELASTIC_STEPS}, ended.stdout[-2000:]
    accuracies = _accuracies(ended.stdout)
    assert min(accuracies.values()) >= ELASTIC_BAR and len(set(accuracies.values())) == 1, accuracies
    assert [r["members"] for r in records(run_dir, 0, "consensus")] == [[0, 1]]
