"""What `hopnet launch` says while it starts and stops, its one account of a run's time, and
one root cause: a configuration error said once, a script run without a launcher told how to run.

The talk (:mod:`hopnet.launch.talk`) and the split (:mod:`hopnet.report.timeline`) are pure and
tested on made-up timelines; three real runs check what a user sees on a pipe.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from hopnet.launch.run_dir import previous_run_files
from hopnet.launch.talk import ShutdownTalk, StartupTalk, WaitTalk
from hopnet.report.content import build_content
from hopnet.report.rundir import load_run_dir
from hopnet.report.timeline import Phases, log_span, run_phases, split

from support.env import clean_env
from support.launch import run_launch
from support.paths import WORKERS

HOP_WORKER = str(WORKERS / "hop_worker.py")


# ------------------------------------------------------------------------------ the talk
def test_startup_says_ready_once_and_reminds_while_it_waits() -> None:
    talk = StartupTalk(4, started=100.0, remind_s=5.0)
    assert talk.poll(101.0, []) is None  # quiet for the first seconds
    assert talk.poll(105.0, [0, 2]) == ("waiting for the workers to reach hopnet.init: 2/4 ready after 5s "
                                        "(waiting for ranks 1, 3)")
    assert talk.poll(107.0, [0, 2, 3]) is None
    assert talk.poll(110.0, [0, 2, 3]) == ("waiting for the workers to reach hopnet.init: 3/4 ready after 10s "
                                           "(waiting for rank 1)")
    assert talk.poll(110.5, [0, 1, 2, 3], ready_at=110.25) == "4/4 ready after 10.2s"
    assert talk.poll(200.0, [0, 1, 2, 3]) is None


def test_shutdown_says_what_it_waits_for_once_the_first_worker_finished() -> None:
    talk = ShutdownTalk(quiet_s=1.0, remind_s=5.0)
    assert talk.poll(50.0, [0, 1]) is None  # nobody finished: training, not shutdown
    talk.finished(50.0)
    talk.finished(50.5)  # the first end counts
    assert talk.poll(50.9, [1, 2]) is None
    assert talk.poll(51.0, [1, 2]) == "waiting for ranks 1, 2 to exit (1s after the first finished)"
    assert talk.poll(52.0, [2]) is None
    assert talk.poll(56.0, [2]) == "waiting for rank 2 to exit (6s after the first finished)"
    assert talk.poll(70.0, []) is None


def test_a_wait_is_said_when_it_starts_then_reminded() -> None:
    talk = WaitTalk("node 0", remind_s=5.0)
    assert talk.poll(0.0) == "waiting for node 0"
    assert talk.poll(4.9) is None
    assert talk.poll(5.2) == "still waiting (5s) for node 0"
    assert talk.poll(9.0) is None


# ------------------------------------------------------------------------------ the split
def test_split_adds_up_and_clamps_to_the_launch() -> None:
    phases = split(10.0, 20.0, 13.0, 19.0)
    assert (phases.startup_s, phases.training_s, phases.shutdown_s) == (3.0, 6.0, 1.0)
    assert phases.line() == "10.0s (start-up 3.0s, training 6.0s, shutdown 1.0s)"
    never = split(10.0, 14.0, None, None)  # no iteration began: all start-up
    assert (never.startup_s, never.training_s, never.shutdown_s) == (4.0, 0.0, 0.0)
    odd = split(10.0, 20.0, 5.0, 25.0)  # records outside the launch (another clock) stay inside it
    assert odd.startup_s == 0.0 and odd.training_s == 10.0 and odd.shutdown_s == 0.0


def test_run_phases_reads_first_enter_and_last_iteration(tmp_path: Path) -> None:
    def log(rank: int, records: list[dict[str, object]]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in records) + '{"event": "iter'  # a cut last line
        (tmp_path / f"rank{rank}.jsonl").write_text(text)

    log(0, [{"event": "start", "mono": 1.0}, {"event": "enter", "mono": 2.0, "iter": 0},
            {"event": "iteration", "mono": 3.0, "iter": 0}, {"event": "stop", "mono": 3.5}])
    log(1, [{"event": "enter", "mono": 2.5, "iter": 0}, {"event": "iteration", "mono": 4.0, "iter": 0}])
    assert log_span(tmp_path / "rank0.jsonl") == (2.0, 3.0)
    assert log_span(tmp_path / "missing.jsonl") == (None, None)
    phases = run_phases(tmp_path, [0, 1, 2], started=0.5, ended=5.0, exits={0: 3.75, 1: 4.5})
    assert (phases.total_s, phases.startup_s, phases.training_s, phases.shutdown_s) == (4.5, 1.5, 2.0, 1.0)
    assert phases.worker_exit_s == {0: 0.75, 1: 0.5} and phases.launcher_exit_s == 0.5
    again = Phases.from_json(json.loads(json.dumps(phases.to_json())))
    assert again == phases
    assert Phases.from_json({"total_s": "1"}) is None
    near_half = Phases(0.4496, 0.1, 0.2, 0.1496)  # the closing line and launch.json round alike
    assert Phases.from_json(json.loads(json.dumps(near_half.to_json()))).line() == near_half.line()  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ real runs
def test_a_run_on_a_pipe_says_what_it_waits_for_and_one_account_of_its_time(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_launch(["--nproc", "2", "--no-progress", "--run-dir", str(run_dir), HOP_WORKER,
                       "--dim", "50", "--compute-ms", "1", "--iterations", "5"])
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hopnet launch: ")]
    assert "hopnet launch: starting 2 workers" in lines
    ready = [i for i, line in enumerate(lines) if re.fullmatch(r"hopnet launch: 2/2 ready after [\d.]+s", line)]
    assert len(ready) == 1 and lines[ready[0] + 1] == "hopnet launch: running hop", lines
    phases = Phases.from_json(json.loads((run_dir / "launch.json").read_text())["result"]["phases"])
    assert phases is not None and phases.training_s > 0
    assert abs(phases.startup_s + phases.training_s + phases.shutdown_s - phases.total_s) < 0.01
    assert set(phases.worker_exit_s) == {0, 1}
    assert lines[-1] == f"hopnet launch: finished in {phases.line()}; run dir {run_dir.resolve()}"
    overview = dict((row[0], row[1]) for row in build_content(load_run_dir(run_dir)).overview.rows)
    assert overview["wall time"] == f"{phases.line()}, as the launcher said"


INIT_REFUSED = """\
import torch, hopnet
hopnet.init(torch.nn.Linear(2, 2), group_size=2)
"""


def test_a_config_error_every_rank_hits_is_said_once_with_exit_2_and_no_run_dir(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(INIT_REFUSED)
    run_dir = tmp_path / "run"
    proc = run_launch(["--nproc", "3", "--protocol", "partial-reduce", "--no-progress", "--run-dir", str(run_dir),
                       str(script)])
    assert proc.returncode == 2, proc.stderr
    message = "group_size=2 in hopnet.init()"
    assert proc.stderr.count(message) == 1, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"hopnet launch: error: {message}")
    assert "[rank" not in proc.stderr and "per-rank summary" not in proc.stderr and proc.stdout == ""
    assert not run_dir.exists() and previous_run_files(run_dir) == []


def test_a_script_run_without_a_launcher_says_how_to_run_it_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch, hopnet\nhopnet.init(torch.nn.Linear(2, 2))\n")
    proc = subprocess.run([sys.executable, str(script), "--lr", "0.1"], env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"hopnet: error: hopnet.init() takes its rank and peers from a launcher: run "
        f"`hopnet launch --nproc 4 {script} --lr 0.1` (or under torchrun or srun)"]
