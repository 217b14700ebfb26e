"""The Hugging Face integrations (the ``hf`` extra): ``HopnetTrainer`` trains examples/hf_trainer_lm.py as
the bare API trains the same model (tests/workers/bare_lm.py), its checkpoints hold hopnet's state and
resume, and ``Sync`` runs a protocol in an Accelerate script."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hopnet import checkpoint

from support.elastic import assert_joined_late, launch_and_join, launch_and_preempt, worker_returncode
from support.env import clean_env
from support.launch import kill, start_launch, worker_pids
from support.paths import EXAMPLES, WORKERS
from support.ports import free_port
from support.records import LogFollower, records
from support.wait import wait_until

LM = str(EXAMPLES / "hf_trainer_lm.py")
BARE = str(WORKERS / "bare_lm.py")
SYNC = str(WORKERS / "accelerate_sync.py")
GATED = str(WORKERS.parent / "scripts" / "hf_elastic.py")
SYNC_ELASTIC = str(WORKERS.parent / "scripts" / "accelerate_elastic.py")
"""The example, whose first workers wait at step 10 for the joiner to start (tests/scripts/joiner_gate.py)."""
LOSS = re.compile(r"^\[rank (\d+)\] held-out loss ([0-9.]+)", re.MULTILINE)
STEPS = re.compile(r"^(?:\[rank (\d+)\] )?held-out loss ([0-9.]+) \(consensus model, (\d+) steps", re.MULTILINE)
ELASTIC_STEPS = 40
ELASTIC_LOSS = 2.908
"""The held-out loss of the example after ELASTIC_STEPS steps under hop without a join or leave: 2.9075
with 2 workers, 2.9085 with 3. Measured with a join (2 + 1 at iteration 7, 14): 2.8987, 2.8994; with a leave
(3 - 1 after iteration 16): 2.8961. The bound is the noise of the data's order (the elastic sampler's
division differs from DistributedSampler's)."""


def _run(launch, run_dir: Path, protocol: str, script: str, *args: str, options: tuple[str, ...] = (),
         nproc: int = 2) -> list[float]:
    """``nproc`` workers; each rank's held-out loss, in rank order (the consensus model's: the same on each)."""
    result = launch(["--nproc", str(nproc), "--protocol", protocol, *options, "--run-dir", str(run_dir), script,
                     *args], env=clean_env(HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {int(rank): float(loss) for rank, loss in LOSS.findall(result.stdout)}
    assert sorted(losses) == list(range(nproc)), result.stdout[-2000:]
    return [losses[rank] for rank in range(nproc)]


def _kill_at(args: list[str], run_dir: Path, *, rank: int, nproc: int,
             iteration: int) -> tuple[subprocess.Popen[str], str, str]:
    """`hopnet launch ARGS`, ``rank`` SIGKILLed once it logged ``iteration``; the launcher, its stdout and stderr."""
    proc = start_launch(args, env=clean_env(HF_HUB_OFFLINE="1"), new_session=True)
    try:
        log = LogFollower(run_dir / f"rank{rank}.jsonl")
        wait_until(lambda: log.first_new(lambda r: r.get("event") == "iteration" and r.get("iter", -1) >= iteration),
                   180, interval=0.02, what=f"rank {rank}'s iteration {iteration}", while_running=proc)
        os.kill(worker_pids(run_dir, nproc)[rank], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        kill(proc)
    return proc, out, err


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["hop", "allreduce", "diloco"])
def test_the_trainer_ends_where_the_bare_api_ends(launch, tmp_path: Path, protocol: str) -> None:
    """The same model, batches, AdamW, schedule, clipping and bf16, through the Trainer and through
    the loop of docs/guides/embedding.md. With 2 workers every sum has one order, and the two runs
    measured bit for bit equal under all three protocols; the bounds leave room for float noise."""
    steps = ["--steps", "24"]
    options = ("--local-steps", "8") if protocol == "diloco" else ()
    out = tmp_path / "out"
    trained = _run(launch, tmp_path / "hf", protocol, LM, *steps, "--output-dir", str(out), options=options)
    bare = _run(launch, tmp_path / "bare", protocol, BARE, str(tmp_path / "bare.pt"), *steps, options=options)
    assert trained[0] == trained[1] and bare[0] == bare[1]  # each is the consensus model
    assert trained[0] < 3.6, trained  # it learned (log 256 = 5.5 at the start; about 3.3 measured)
    assert abs(trained[0] - bare[0]) <= 1e-3, (trained, bare)
    assert _largest_difference(load_file(out / "model.safetensors"), torch.load(tmp_path / "bare.pt")) <= 1e-5


def test_checkpoints_hold_hopnets_state_and_resume_mid_round(launch, tmp_path: Path) -> None:
    """DiLoCo's rounds of 8 steps, a checkpoint at step 12 (mid-round: the outer optimizer's anchor
    and momentum are in hopnet's state only). Resumed from it, the run ends where the uninterrupted
    one ended (measured bit for bit)."""
    out = tmp_path / "out"
    args = ("--steps", "24", "--save-steps", "12", "--output-dir", str(out))
    options = ("--local-steps", "8")
    whole = _run(launch, tmp_path / "whole", "diloco", LM, *args, options=options)
    for rank in (0, 1):
        folder = out / f"rank{rank}" / "checkpoint-12"
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {
            p.name for p in folder.iterdir()}
        saved = checkpoint.read(folder / "hopnet" / checkpoint.checkpoint_name(rank, 11))
        assert (saved["iteration"], saved["rank"], saved["protocol"]) == (11, rank, "diloco")
        assert {checkpoint.PROTOCOL_STATE, checkpoint.OPTIMIZER_STATE} <= set(saved["states"])
    ended = load_file(out / "model.safetensors")
    for rank in (0, 1):
        shutil.rmtree(out / f"rank{rank}" / "checkpoint-24")  # the newest that both saved is now 12
    resumed = _run(launch, tmp_path / "resumed", "diloco", LM, *args, "--resume", options=options)
    assert [r["iter"] for r in records(tmp_path / "resumed", 0, "resumed")] == [11]
    assert resumed == whole
    assert _largest_difference(load_file(out / "model.safetensors"), ended) <= 1e-6


@pytest.mark.slow
def test_a_killed_trainer_is_lost_and_the_others_finish_with_one_model(tmp_path: Path) -> None:
    """`--max-failures 1` under Hop with a backup worker, rank 2 of 3 SIGKILLed after its iteration 5 of
    40: the launcher reports it lost, the other two Trainers run every step, and their consensus (the
    saved model) is one model, near the loss of a run without the kill."""
    run_dir = tmp_path / "run"
    proc, out, err = _kill_at(["--nproc", "3", "--backup-workers", "1", "--max-failures", "1", "--peer-timeout", "2",
                               "--no-progress", "--run-dir", str(run_dir), LM, "--steps", str(ELASTIC_STEPS)],
                              run_dir, rank=2, nproc=3, iteration=5)
    assert proc.returncode == 0, err[-3000:]
    assert "lost rank 2" in err + out, err[-2000:]
    assert [[r["iter"] for r in records(run_dir, rank, "stop")][-1] for rank in range(2)] == [ELASTIC_STEPS - 1] * 2
    ends = _ends(out)
    assert sorted(ends) == [0, 1] and {steps for _, steps in ends.values()} == {ELASTIC_STEPS}, out[-2000:]
    assert len({loss for loss, _ in ends.values()}) == 1 and abs(ends[0][0] - ELASTIC_LOSS) <= 0.05, ends


@pytest.mark.slow
def test_a_replacement_trainer_goes_on_where_its_neighbour_was(launch, tmp_path: Path) -> None:
    """`--max-restarts 1` under allreduce, rank 1 of 2 killed at its iteration 8 of 30: its replacement takes
    a neighbour's model, optimizer, LR schedule and TrainerState, and its Trainer skips the batches
    already seen. The run ends where the run without the kill ends, measured bit for bit (the
    replacement computes the dead worker's gradients). (Under Hop the same adapter path ran within
    noise of the run without a kill: 2.9068 against 2.9088; not repeated here, for the suite's time.)"""
    protocol = "allreduce"
    args = [LM, "--steps", "30"]
    whole = _run(launch, tmp_path / "whole", protocol, *args, nproc=2)
    run_dir = tmp_path / "run"
    proc, out, err = _kill_at(["--nproc", "2", "--protocol", protocol, "--max-restarts", "1", "--peer-timeout", "3",
                               "--no-progress", "--run-dir", str(run_dir), *args, "--output-dir", str(tmp_path / "out")],
                              run_dir, rank=1, nproc=2, iteration=8)
    assert proc.returncode == 0, err[-3000:]
    assert "hopnet launch: rank 1 died (killed by SIGKILL); restarting it (restart 1 of 1)" in err.splitlines()
    (rejoined,) = records(run_dir, 1, "rejoined")
    assert rejoined["iter"] > 0
    assert [[r["iter"] for r in records(run_dir, rank, "stop")][-1] for rank in range(2)] == [29] * 2
    losses = {int(rank): float(loss) for rank, loss in LOSS.findall(out)}
    assert sorted(losses) == [0, 1] and len(set(losses.values())) == 1, out[-2000:]
    assert abs(losses[0] - whole[0]) <= 1e-3, (losses, whole)


@pytest.mark.parametrize("protocol", ["allreduce", "hop"])
def test_sync_runs_the_protocol_in_an_accelerate_script(launch, tmp_path: Path, protocol: str) -> None:
    """Each rank on its own data, two accumulation steps per optimizer step: under allreduce the
    ranks stay identical (the gradient is averaged), under Hop they part; after the context every
    rank holds the mean of the models it ended with."""
    result = launch(["--nproc", "2", "--protocol", protocol, "--run-dir", str(tmp_path / "run"), SYNC,
                     str(tmp_path)], env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("optimizer steps 12, iterations 12, consensus of [0, 1]") == 2, result.stdout
    own = [torch.load(tmp_path / f"own{r}.pt") for r in (0, 1)]
    final = [torch.load(tmp_path / f"final{r}.pt") for r in (0, 1)]
    parted = (own[0] - own[1]).abs().max().item()
    assert parted == 0.0 if protocol == "allreduce" else parted > 1e-4
    for model in final:
        assert torch.allclose(model, (own[0] + own[1]) / 2, atol=1e-6)


def test_sync_under_max_failures_leaves_a_killed_worker_behind(launch, tmp_path: Path) -> None:
    """Hop with a backup worker, 3 ranks, rank 2 SIGKILLed after its step 10 of 30 (``--max-failures 1``):
    the other two run every step, and the consensus is the mean of their two models."""
    result = launch(["--nproc", "3", "--backup-workers", "1", "--max-failures", "1", "--peer-timeout", "2",
                     "--run-dir", str(tmp_path / "run"), SYNC, str(tmp_path), "--steps", "30", "--die", "2:10"],
                    env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lost rank 2" in result.stderr, result.stderr[-2000:]
    assert result.stdout.count("optimizer steps 30, iterations 30, consensus of [0, 1]") == 2, result.stdout
    own = [torch.load(tmp_path / f"own{r}.pt") for r in (0, 1)]
    for rank in (0, 1):
        assert torch.allclose(torch.load(tmp_path / f"final{rank}.pt"), (own[0] + own[1]) / 2, atol=1e-6)


def test_sync_under_max_restarts_hands_the_replacement_its_neighbours_step(launch, tmp_path: Path) -> None:
    """allreduce, rank 1 of 2 SIGKILLed after its step 10 of 30 (``--max-restarts 1``): its replacement
    takes rank 0's model and optimizer at that step and runs the 20 steps left, and both end with one
    model. (Which batches it reads is the script's: this one reads its loader from the start.)"""
    run_dir = tmp_path / "run"
    result = launch(["--nproc", "2", "--protocol", "allreduce", "--max-restarts", "1", "--peer-timeout", "3",
                     "--run-dir", str(run_dir), SYNC, str(tmp_path), "--steps", "30", "--die", "1:10"], env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hopnet launch: 1 restart: rank 1 (killed by SIGKILL)" in result.stderr, result.stderr[-2000:]
    (rejoined,) = records(run_dir, 1, "rejoined")
    assert rejoined["iter"] == 10, rejoined
    assert "[rank 0] optimizer steps 30, iterations 30, consensus of [0, 1]" in result.stdout, result.stdout
    assert "[rank 1] optimizer steps 20, iterations 20, consensus of [0, 1]" in result.stdout, result.stdout
    own = [torch.load(tmp_path / f"own{r}.pt") for r in (0, 1)]
    assert torch.equal(own[0], own[1])


@pytest.mark.slow
def test_sync_takes_a_joiner_at_its_donors_step(tmp_path: Path) -> None:
    """`hopnet join` into an Accelerate script's run of 2 (--max-nproc 3) under Hop: the joiner enters the
    run in ``Sync``'s entry, before its loop, takes a member's model, optimizer, schedule and sampler (the
    last two registered after the join), runs the iterations left, and every rank ends at the last one
    with the consensus of the three. (The first workers wait at iteration 5 until the joiner started.)"""
    run_dir = tmp_path / "run"
    ended, joined = launch_and_join(["--nproc", "2", "--max-nproc", "3", "--run-dir", str(run_dir), "--no-progress",
                                     SYNC_ELASTIC, "--steps", "30"], run_dir,
                                    env=clean_env(GATE_AT_STEP="5", GATE_FOR_RANK="2"))
    assert_joined_late(ended, joined, run_dir, 2, last=29)
    pattern = r"rank (\d) ran (\d+) iterations, last (\d+), consensus of \[0, 1, 2\]"
    ends = {int(rank): (int(ran), int(last)) for rank, ran, last in re.findall(pattern, joined.stdout + ended.stdout)}
    joined_at = records(run_dir, 2, "joined")[0]["iter"]
    assert ends == {0: (30, 29), 1: (30, 29), 2: (30 - joined_at, 29)}, (ends, joined_at)


def _ddp_reference(steps: int, *, autocast: bool, skip: int | None = None) -> torch.Tensor:
    """tests/workers/accelerate_sync.py's model after ``steps`` optimizer steps of both ranks' averaged,
    accumulated, clipped gradient, AdamW and the schedule, in one process; step ``skip`` (its gradient
    overflowed) neither steps the optimizer nor the schedule, as under DDP and a gradient scaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    data = []
    for rank in (0, 1):
        x = torch.randn(steps * 2 * 8, 8, generator=torch.Generator().manual_seed(100 + rank))
        data.append((x, x.sum(dim=1, keepdim=True).sin()))
    for step in range(steps):
        optimizer.zero_grad()
        if step == skip:
            continue
        for x, y in data:
            for micro in (2 * step, 2 * step + 1):
                rows = slice(8 * micro, 8 * micro + 8)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x[rows])
                (torch.nn.functional.mse_loss(out.float(), y[rows]) / 2 / 2).backward()  # accumulation, mean of 2 ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def test_sync_under_allreduce_steps_as_ddp_would(launch, tmp_path: Path) -> None:
    """The averaged gradient of both ranks' accumulated micro-batches, clipped, then AdamW and the
    schedule: recomputed here in one process, from the same data, the same model results."""
    result = launch(["--nproc", "2", "--protocol", "allreduce", "--run-dir", str(tmp_path / "run"), SYNC,
                     str(tmp_path), "--steps", "4"], env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.allclose(torch.load(tmp_path / "own0.pt"), _ddp_reference(4, autocast=True), atol=1e-5)


def test_sync_with_a_gradient_scaler_skips_an_overflowed_step_on_every_rank_as_ddp_would(
        launch, tmp_path: Path) -> None:
    """fp16's gradient scaler (torch's CPU one here, as Accelerate makes a CUDA one on a GPU): rank 1's
    loss is infinite in step 2. Both ranks skip that step, Accelerate reports it skipped on both (so the
    prepared schedule does not step), both halve their scale, and the model is DDP's without step 2."""
    result = launch(["--nproc", "2", "--protocol", "allreduce", "--run-dir", str(tmp_path / "run"), SYNC,
                     str(tmp_path), "--steps", "4", "--scaler", "--overflow", "1:2"], env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} skipped steps [2], scale 32768.0" in result.stdout, result.stdout
    expected = _ddp_reference(4, autocast=False, skip=2)
    for rank in (0, 1):
        assert torch.allclose(torch.load(tmp_path / f"own{rank}.pt"), expected, atol=1e-5)


@pytest.mark.slow
def test_the_trainer_sees_one_process_under_torchrun(tmp_path: Path) -> None:
    """torchrun's variables make the Trainer distributed (DDP); under HopnetTrainer it sees one process,
    and hopnet's allreduce keeps the two ranks' models identical."""
    env = {**clean_env(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
           "HOPNET_RUN_DIR": str(tmp_path / "run"), "HOPNET_PROTOCOL": "allreduce"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", LM, "--steps", "10",
           "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"held-out loss ([0-9.]+) .*the Trainer saw (\d+) process", result.stdout)
    assert len(lines) == 2 and lines[0] == lines[1] and lines[0][1] == "1", result.stdout[-2000:]
    assert (tmp_path / "out" / "model.safetensors").exists()


# (transformers and Accelerate imported in the tests that use them: at the module's top every test
# process would import them to collect it, 3 CPU-s apiece)
def test_single_process_hides_the_launchers_variables_and_puts_them_back(monkeypatch) -> None:
    from hopnet.integrations.accelerate import LAUNCHER_VARIABLES, single_process

    for name in LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "2")
    with single_process():
        assert not any(name in os.environ for name in LAUNCHER_VARIABLES)
    assert all(os.environ[name] == "2" for name in LAUNCHER_VARIABLES)


def test_resume_picks_the_newest_step_every_rank_saved(tmp_path: Path) -> None:
    from hopnet.integrations.transformers import resume_folder

    def save(rank: int, step: int, complete: bool = True) -> None:
        folder = tmp_path / f"rank{rank}" / f"checkpoint-{step}" / "hopnet"
        folder.mkdir(parents=True)
        if complete:  # the hopnet state is written last: without it the step is not a checkpoint
            (folder / checkpoint.checkpoint_name(rank, step - 1)).write_bytes(b"")

    for rank, step in [(0, 10), (1, 10), (0, 20), (1, 20), (0, 30)]:
        save(rank, step)
    save(1, 30, complete=False)
    assert resume_folder(str(tmp_path), True, 1, 2) == str(tmp_path / "rank1" / "checkpoint-20")
    assert resume_folder(str(tmp_path), "elsewhere/checkpoint-10", 0, 2) == str(tmp_path / "rank0" / "checkpoint-10")
    assert resume_folder(str(tmp_path), False, 0, 2) is None
    with pytest.raises(ValueError, match="every rank"):
        resume_folder(str(tmp_path), True, 0, 3)


def test_the_trainer_refuses_what_it_cannot_run(monkeypatch) -> None:
    from hopnet.integrations.transformers import HopnetTrainer

    with pytest.raises(Exception, match="model_init"):
        HopnetTrainer(model_init=lambda: None)
    monkeypatch.setenv(checkpoint.CHECKPOINT_EVERY, "10")
    with pytest.raises(Exception, match="save_steps"):
        HopnetTrainer(model=torch.nn.Linear(1, 1))


def _ends(stdout: str, joiner: int | None = None) -> dict[int, tuple[float, int]]:
    """Each rank's held-out loss and the Trainer's global step at the end (the joiner's line, through
    `hopnet join`, has no rank prefix)."""
    return {int(rank) if rank else joiner: (float(loss), int(steps))  # type: ignore[misc]
            for rank, loss, steps in STEPS.findall(stdout)}


@pytest.mark.slow
def test_a_worker_joins_a_running_trainer_at_its_donors_step(tmp_path: Path) -> None:
    """`hopnet join` into a run of 2 (--max-nproc 3): the joiner enters in ``train()``, takes a member's
    model, optimizer, schedule and TrainerState, and its Trainer goes on at the donor's global step. (The
    first workers wait at step 10 until the joiner has started: on an idle machine they ran all 40 steps
    before a cold joiner reached ``train()``.)"""
    run_dir = tmp_path / "run"
    ended, joined = launch_and_join(["--nproc", "2", "--max-nproc", "3", "--run-dir", str(run_dir), "--no-progress",
                                     GATED, "--steps", str(ELASTIC_STEPS)], run_dir,
                                    env=clean_env(HF_HUB_OFFLINE="1", GATE_AT_STEP="10", GATE_FOR_RANK="2"))
    assert_joined_late(ended, joined, run_dir, 2, last=ELASTIC_STEPS - 1)
    ends = {**_ends(ended.stdout), **_ends(joined.stdout, joiner=2)}
    assert sorted(ends) == [0, 1, 2] and {steps for _, steps in ends.values()} == {ELASTIC_STEPS}, (ends, joined.stdout)
    assert len({loss for loss, _ in ends.values()}) == 1 and abs(ends[0][0] - ELASTIC_LOSS) <= 0.05, ends


@pytest.mark.slow
def test_a_preempted_trainer_leaves_and_the_others_finish(tmp_path: Path) -> None:
    """A SIGTERM to rank 2 of 3 (--min-nproc 2) after its iteration 5: it leaves at the next view change
    and exits 0; the others finish every step, near the loss of a run without the leave."""
    run_dir = tmp_path / "run"
    ended = launch_and_preempt(["--nproc", "3", "--min-nproc", "2", "--run-dir", str(run_dir), "--no-progress",
                                LM, "--steps", str(ELASTIC_STEPS)], run_dir, rank=2, after_iteration=5,
                               env=clean_env(HF_HUB_OFFLINE="1"))
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert worker_returncode(run_dir, 2) == 0
    (left,) = records(run_dir, 2, "left")
    assert left["iter"] >= 5 and left["line"].startswith("rank 2 left after iteration"), left
    ends = _ends(ended.stdout)
    assert sorted(ends) == [0, 1] and {steps for _, steps in ends.values()} == {ELASTIC_STEPS}, ends
    assert len({loss for loss, _ in ends.values()}) == 1 and abs(ends[0][0] - ELASTIC_LOSS) <= 0.05, ends
