"""A dead worker replaced live (`hopnet launch --max-restarts K`), with real processes: the
launcher starts a new process for the rank, which takes a neighbour's model and iteration
(:mod:`hopnet.runtime.rejoin`) while the others train on, and the run ends with every rank.

Every run here is examples/train_digits.py on 4 workers; the victim is signalled once its own
event log shows it past an iteration, so the fault always lands mid-run. The launcher's own side
(the budget, the flag, the records, the death watch) is in test_restarts_launcher.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from hopnet.analysis import incarnations, load_run

from support.launch import kill, launch_in_process, recorded_worker_pids, start_launch, worker_pids
from support.paths import EXAMPLES
from support.records import LogFollower, all_records, coordinator_records
from support.processes import alive
from support.wait import wait_until

DIGITS = str(EXAMPLES / "train_digits.py")
WORLD = 4
ITERATIONS = 300
KILL_AT = 80
"""The victim is signalled once it logged this iteration (of :data:`ITERATIONS`)."""
RECORD_WAIT_S = 120.0
"""How long a test waits for a record in a worker's log."""
STOPPED_ITERATIONS = 1000
TRAINING = frozenset({"enter", "iteration", "p_reduce", "group"})
"""Records of a worker that trains: none may come before a replacement's ``rejoined``."""
VICTIMS = {"partial-reduce": 2, "prague": 2, "ad-psgd": 1, "hop": 2, "allreduce": 2, "pipe-sgd": 2, "eager-sgd": 2}
FLAGS: dict[str, tuple[str, ...]] = {"hop": ("--backup-workers", "1")}
"""Extra launch flags per protocol: Hop with a backup worker, whose neighbours go on while the victim
is away (under the strict protocols, allreduce, pipe-sgd and eager-sgd, they wait for it)."""
TRAINING_FIRST = {"ad-psgd": (0, 2)}
"""Under ad-psgd on a ring the odd ranks are passive: they wait for nobody and run far ahead of
the actives. The victim is a passive, signalled once the actives train too, so that the fault
lands mid-run for its donor (an active neighbour) as well."""
COORDINATED = frozenset({"partial-reduce", "prague"})

Record = dict[str, Any]


@contextmanager
def _launched(tmp_path: Path, protocol: str, *flags: str,
              iterations: int = ITERATIONS) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """`hopnet launch` of the digits example with ``--max-restarts 1``, in a process group of its
    own that the test ends whatever happens."""
    run_dir = tmp_path / "run"
    proc = start_launch(["--nproc", str(WORLD), "--protocol", protocol, "--max-restarts", "1", *flags,
                         "--no-progress", "--run-dir", str(run_dir), DIGITS, "--iterations", str(iterations)],
                        new_session=True)
    try:
        yield proc, run_dir
    finally:
        kill(proc)


def _signal_in_iteration(proc: subprocess.Popen[str], run_dir: Path, rank: int, sig: signal.Signals,
                         training: tuple[int, ...] = ()) -> int:
    """Send ``sig`` to ``rank``'s worker once its log shows iteration :data:`KILL_AT` (and, before
    that, each rank of ``training`` shows one past its first); its pid."""
    for other in training:
        log = LogFollower(run_dir / f"rank{other}.jsonl")
        wait_until(lambda: log.first_new(lambda r: r.get("event") == "iteration" and r.get("iter", -1) >= 1),
                   RECORD_WAIT_S, interval=0.02, what=f"rank {other}'s iteration 1 in {log.path}", while_running=proc)
    log = LogFollower(run_dir / f"rank{rank}.jsonl")
    wait_until(lambda: log.first_new(lambda r: r.get("event") == "iteration" and r.get("iter", -1) >= KILL_AT),
               RECORD_WAIT_S, interval=0.02, what=f"rank {rank}'s iteration {KILL_AT} in {log.path}",
               while_running=proc)
    pid = worker_pids(run_dir, WORLD)[rank]
    os.kill(pid, sig)
    return pid


def _events(recs: list[Record], event: str) -> list[Record]:
    return [r for r in recs if r.get("event") == event]


def _check_finished_with_every_rank(run_dir: Path, code: int, out: str, err: str) -> dict[int, list[Record]]:
    assert code == 0, f"{out}\n{err}"
    logs = load_run(run_dir)
    assert sorted(logs) == list(range(WORLD))
    for rank, recs in logs.items():
        assert _events(incarnations(recs)[-1], "stop"), f"rank {rank} did not finish"
    result = json.loads((run_dir / "launch.json").read_text())["result"]
    assert result["lost_ranks"] == [] and set(result["worker_returncodes"].values()) == {0}
    (consensus,) = [r for r in _events(logs[0], "eval") if r.get("consensus")]
    assert consensus["accuracy"] >= 0.95, consensus
    return logs


def _check_replacement(run_dir: Path, logs: dict[int, list[Record]], victim: int) -> Record:
    """The replacement took its donor's model before it trained; every survivor admitted it."""
    first, second = incarnations(logs[victim])
    assert second[0].get("restart") == 1  # the replacement's start record says it continues the run
    (rejoined,) = _events(second, "rejoined")
    before = second[:second.index(rejoined)]
    assert not [r for r in before if r.get("event") in TRAINING], before
    assert rejoined["restart"] == 1 and rejoined["peer"] != victim
    (handed,) = [r for r in _events(logs[rejoined["peer"]], "handed_over") if r["peer"] == victim]
    assert rejoined["fingerprint"] == rejoined["donor_fingerprint"] == handed["fingerprint"]
    assert rejoined["fingerprint"] != rejoined["initial_fingerprint"]  # not its own initial weights
    assert rejoined["iter"] == handed["iter"] > 0  # the donor's iteration (ad-psgd's actives lag the passives)
    for rank in set(range(WORLD)) - {victim}:
        assert [(r["peer"], r["restart"]) for r in _events(logs[rank], "peer_rejoined")] == [(victim, 1)], rank
    return rejoined


# ------------------------------------------------------------------- refused options
@pytest.mark.parametrize(("flags", "why"), [
    (("--protocol", "hop", "--serial"), "--protocol hop --serial cannot replace a dead worker"),
    (("--protocol", "prague", "--group-generator", "static"),
     "--protocol prague --group-generator static cannot replace a dead worker"),
], ids=["hop-serial", "prague-static"])
def test_options_that_cannot_take_a_replacement_are_refused_before_anything_starts(
        tmp_path: Path, flags: tuple[str, ...], why: str) -> None:
    result = launch_in_process([*flags, "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), DIGITS])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"hopnet launch: error: --max-restarts: {why}"), line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ real processes
@pytest.mark.slow
@pytest.mark.parametrize(("protocol", "flags"), [
    *((p, FLAGS.get(p, ())) for p in sorted(VICTIMS)),
    ("pipe-sgd", ("--pipeline-k", "1")),  # K = 1 reduces in the step's own coroutine, not a task
], ids=[*sorted(VICTIMS), "pipe-sgd-k1"])
def test_a_killed_worker_is_replaced_from_a_neighbours_model(tmp_path: Path, protocol: str,
                                                             flags: tuple[str, ...]) -> None:
    victim = VICTIMS[protocol]
    with _launched(tmp_path, protocol, *flags) as (proc, run_dir):
        old_pid = _signal_in_iteration(proc, run_dir, victim, signal.SIGKILL, TRAINING_FIRST.get(protocol, ()))
        out, err = proc.communicate(timeout=180)
    logs = _check_finished_with_every_rank(run_dir, proc.returncode, out, err)
    _check_replacement(run_dir, logs, victim)
    record = json.loads((run_dir / "launch.json").read_text())
    (restart,) = record["restarts"]
    assert (restart["rank"], restart["restart"], restart["reason"], restart["old_pid"]) == (
        victim, 1, "killed by SIGKILL", old_pid)
    assert restart["new_pid"] == int(record["worker_pids"][str(victim)])
    assert f"hopnet launch: rank {victim} died (killed by SIGKILL); restarting it (restart 1 of 1)" in err.splitlines()
    if protocol in COORDINATED:  # the coordinator counted the rank out, then in again
        assert [r["worker"] for r in coordinator_records(run_dir, "worker_replaced")] == [victim]
        assert [r["worker"] for r in coordinator_records(run_dir, "worker_rejoined")] == [victim]


@pytest.mark.slow
def test_a_stopped_worker_is_declared_dead_killed_and_replaced(tmp_path: Path) -> None:
    victim = 2
    # The others train on while it is silent (groups of 3 out of 4): enough iterations that they are
    # still training when it is declared dead and its replacement comes (see the report on a
    # replacement that comes after every other worker finished).
    with _launched(tmp_path, "partial-reduce", "--peer-timeout", "2",
                   iterations=STOPPED_ITERATIONS) as (proc, run_dir):
        stopped = _signal_in_iteration(proc, run_dir, victim, signal.SIGSTOP)  # never continued
        out, err = proc.communicate(timeout=180)
    assert not alive(stopped)
    logs = _check_finished_with_every_rank(run_dir, proc.returncode, out, err)
    _check_replacement(run_dir, logs, victim)
    (restart,) = json.loads((run_dir / "launch.json").read_text())["restarts"]
    assert (restart["rank"], restart["old_pid"]) == (victim, stopped)
    assert restart["reason"].startswith("went silent: declared dead by rank "), restart


@pytest.mark.slow
@pytest.mark.parametrize("max_failures", [0, 1])
def test_a_replacement_killed_past_the_budget_is_a_loss(tmp_path: Path, max_failures: int) -> None:
    victim = 2
    with _launched(tmp_path, "partial-reduce", "--max-failures", str(max_failures)) as (proc, run_dir):
        first = _signal_in_iteration(proc, run_dir, victim, signal.SIGKILL)
        log = LogFollower(run_dir / f"rank{victim}.jsonl")
        wait_until(lambda: log.first_new(lambda r: r.get("event") == "rejoined"), RECORD_WAIT_S, interval=0.02,
                   what=f"rank {victim}'s rejoined record in {log.path}", while_running=proc)
        second = recorded_worker_pids(run_dir)[victim]
        assert second != first
        os.kill(second, signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    lines = err.splitlines()
    assert f"hopnet launch: rank {victim} died (killed by SIGKILL); restarting it (restart 1 of 1)" in lines
    result = json.loads((run_dir / "launch.json").read_text())["result"]
    if max_failures == 0:
        assert proc.returncode != 0, err
        assert any(line.startswith(f"hopnet launch: rank {victim} died (killed by SIGKILL) while ")
                   for line in lines), err  # the blame line, past the budget
        assert result["failed_rank"] == victim
    else:
        assert proc.returncode == 0, err
        assert any(line.startswith(f"hopnet launch: lost rank {victim} ") for line in lines), err
        assert result["lost_ranks"] == [victim]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["allreduce", "pipe-sgd"])
def test_a_batchnorm_trainer_ends_with_one_model_after_a_replacement(tmp_path: Path, protocol: str) -> None:
    """examples/train_cnn.py (BatchNorm, AdamW, a cosine LR schedule stepped after the optimizer): every
    rank must finish with the same floating-point state. Found wrong before: a death in the buffers'
    round, after the step was applied, left the replacement an iteration behind, running it alone
    until --timeout; a survivor found a step behind by the resync sent the gradient of its void
    iteration into the others' next round; a replacement that resynced before its trainer's first
    step started with its LR schedule a step behind, and with its donor's optimizer state, not the
    furthest rank's."""
    run_dir = tmp_path / "run"
    proc = start_launch(["--nproc", str(WORLD), "--protocol", protocol, "--max-restarts", "1", "--timeout", "30",
                         "--no-progress", "--run-dir", str(run_dir), str(EXAMPLES / "train_cnn.py"),
                         "--iterations", "70"], new_session=True)
    try:
        log = LogFollower(run_dir / "rank2.jsonl")
        wait_until(lambda: log.first_new(lambda r: r.get("event") == "iteration" and r.get("iter", -1) >= 20),
                   RECORD_WAIT_S, interval=0.02, what=f"iteration 20 in {log.path}", while_running=proc)
        os.kill(worker_pids(run_dir, WORLD)[2], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        kill(proc)
    assert proc.returncode == 0, f"{out}\n{err}"
    finals = [torch.load(run_dir / f"final_rank{rank}.pt") for rank in range(WORLD)]
    for name, tensor in finals[0].items():
        if tensor.is_floating_point():
            assert all(torch.equal(tensor, other[name]) for other in finals[1:]), name
    rates: dict[int, set[float]] = {}  # the learning rate each iteration ran with, on every rank
    for record in all_records(run_dir, "iteration"):
        if "lr" in record:
            rates.setdefault(record["iter"], set()).add(record["lr"])
    assert len(rates) > 60 and all(len(seen) == 1 for seen in rates.values()), \
        {k: seen for k, seen in rates.items() if len(seen) > 1}
