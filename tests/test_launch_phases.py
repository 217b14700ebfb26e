"""The launcher's and hopnet.init's phases, each called alone, in this process (no workers)."""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
import sys
from pathlib import Path

import pytest

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.launch.launcher import Launch, launch, run_launch
from hopnet.launch.outcome import conclude
from hopnet.launch.prepare import launch_record, prepare_run_dir, rendezvous_host, worker_base_env
from hopnet.launch.run_dir import claim_run_dir
from hopnet.launch.settings import LaunchKeywords, settings, spec_from_args, spec_from_keywords
from hopnet.launch.spec import WORKER_ENTRY, LaunchSpec, validate
from hopnet.launch.state import RunState, WorkerState
from hopnet.security import KEY_ENV, CurveKeys, RunSecurity
from hopnet.bootstrap.init import InitSpec, WorkerContext, check_inputs, find_launcher, resolve_options

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "launch_worker.py")
PLAIN = RunSecurity(None, "off: loopback")


# ------------------------------------------------------------------------------ spec
def _annotation(value: object) -> str:
    return value if isinstance(value, str) else getattr(value, "__forward_arg__", repr(value))


def test_the_spec_has_every_argument_of_launch_with_the_same_default() -> None:
    """launch()'s positional arguments are the spec's, and its typed keywords (LaunchKeywords, for
    mypy and IDEs) are every other setting with the type the spec declares."""
    io_only = {"stdout", "stderr"}
    params = {n: p for n, p in inspect.signature(launch).parameters.items()
              if n not in io_only and p.kind is not inspect.Parameter.VAR_KEYWORD}
    fields = inspect.signature(LaunchSpec).parameters
    assert list(params) == ["script", "script_args"]
    assert {n: p.default for n, p in params.items()} == {n: fields[n].default for n in params}
    declared = {f.name: _annotation(f.type) for f in dataclasses.fields(LaunchSpec) if f.name not in params}
    typed = {name: _annotation(kind) for name, kind in LaunchKeywords.__annotations__.items()}
    assert typed == declared


def test_launch_takes_each_setting_by_keyword_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="grace period must be >= 0"):
        launch(SCRIPT, graph="ring:2", grace_s=-1.0, run_dir=tmp_path / "run")
    with pytest.raises(TypeError, match="unexpected keyword argument 'grace'.*did you mean 'grace_s'"):
        launch(SCRIPT, graph="ring:2", grace=1.0)  # type: ignore[call-arg]
    assert not (tmp_path / "run").exists()
    spec = spec_from_keywords(SCRIPT, ["--x"], {"nproc": 3, "max_restarts": 1})
    assert (spec.script_args, spec.nproc, spec.max_restarts, spec.grace_s) == (["--x"], 3, 1, 5.0)


def test_the_command_line_has_a_flag_per_setting_and_translates_back_to_the_spec() -> None:
    from hopnet.cli.launch_cmd import _parse_launch

    flagged = [s for s in settings() if s.has_flag and s.info.group != "arguments"]
    defaults = spec_from_args(_parse_launch(["train.py"]))
    for s in flagged:
        assert getattr(defaults, s.name) == s.default, s.name
    assert (defaults.script, list(defaults.script_args)) == ("train.py", [])
    args = _parse_launch(["--nproc", "3", "--grace", "2", "--no-prefix", "--start-method", "exec", "--resume", "r",
                          "--key-file", "k", "--min-nproc", "2", "--max-nproc", "6", "-m", "pkg.train", "--lr", "1"])
    spec = spec_from_args(args)
    assert (spec.nproc, spec.grace_s, spec.prefix, spec.start_method, spec.resume, spec.key_file, spec.module) == \
        (3, 2.0, False, "exec", True, "k", True)
    assert (spec.min_nproc, spec.max_nproc) == (2, 6)
    assert (spec.script, list(spec.script_args)) == ("pkg.train", ["--lr", "1"])
    assert len({s.flag for s in flagged}) == len(flagged) == 27


@pytest.mark.parametrize("changes, message", [
    (dict(config="hop"), "config must be a ProtocolConfig (got str)"),
    (dict(config=ProtocolConfig(backup_workers="7:1")), "--backup-workers: rank 7"),
    (dict(script="no/such/script.py"), "script 'no/such/script.py' not found"),
    (dict(script="not a module", module=True), "-m 'not a module': not a module name"),
    (dict(bind=" "), "--bind ' ': expected a host name or address"),
    (dict(grace_s=-1.0), "grace period must be >= 0 (got -1.0)"),
    (dict(explicit_options=["max_ig", "colour"]), "explicit_options: 'colour' is not a protocol option"),
    (dict(graph="ring:3", nproc=4), "--nproc 4 does not match the graph ring:3 (3 nodes)"),
    (dict(nproc=0), "--nproc must be an integer >= 1 (got 0)"),
    (dict(graph="ring:3", max_failures=3),
     "--max-failures must be an integer from 0 to 2 (there are 3 workers; got 3)"),
    (dict(nnodes=2, node_rank=1), "--nnodes above 1 needs --rdzv-endpoint HOST:PORT"),
    (dict(graph="ring:4", nnodes=2, node_rank=2, rdzv_endpoint="127.0.0.1:1"),
     "--node-rank must be from 0 to 1 (got 2)"),
])
def test_validate_refuses_in_one_line_before_anything_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            changes: dict, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    spec = LaunchSpec(**{"script": SCRIPT, "run_dir": tmp_path / "run", **changes})
    with pytest.raises(ConfigError) as info:
        validate(spec)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_validate_resolves_the_command_the_graph_and_this_machines_ranks() -> None:
    plan = validate(LaunchSpec(SCRIPT, ["--x", "1"], graph="ring:6", bind=" 127.0.0.1 ",
                               explicit_options=["seed", "max_ig"], nnodes=2, node_rank=1,
                               rdzv_endpoint="127.0.0.1:29400"))
    assert plan.command == [*WORKER_ENTRY, SCRIPT, "--x", "1"]
    assert (plan.world_size, list(plan.nodes.ranks), plan.nodes.node_rank) == (6, [3, 4, 5], 1)
    assert plan.bind == "127.0.0.1"
    assert plan.explicit_options == ("max_ig", "seed")
    assert plan.coordinator_name is None and plan.config == ProtocolConfig()
    module = validate(LaunchSpec("pkg.train", module=True))
    assert module.command == [*WORKER_ENTRY, "-m", "pkg.train"] and module.world_size == 4


# ----------------------------------------------------------------------- run directory
def test_prepare_run_dir_writes_the_graph_and_says_the_notes(tmp_path: Path) -> None:
    said: list[str] = []
    plan = validate(LaunchSpec(SCRIPT, graph="ring:3", run_dir=tmp_path / "run", bind="0.0.0.0",
                               config=ProtocolConfig(bulk="torch")))
    keys = RunSecurity(CurveKeys.generate(), "generated")
    with prepare_run_dir(plan, keys, said.append) as claim:
        path = claim.path
    assert path == (tmp_path / "run").resolve()
    assert Graph.from_json(path / "graph.json").n == 3
    assert any(line.startswith("note: CurveZMQ covers the ZeroMQ sockets") for line in said), said
    record = launch_record(plan, keys, path)
    record.write()
    data = json.loads((path / "launch.json").read_text())
    assert (data["world_size"], data["ranks"], data["security"], data["bind"]) == (3, [0, 1, 2], "curve", "0.0.0.0")
    assert data["config"] == data["config_flags"] == json.loads(plan.config.to_json())
    assert rendezvous_host(plan.bind, None) == "127.0.0.1"


def test_prepare_run_dir_refuses_a_run_dir_holding_a_run_unless_overwrite(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already holds a run .* pass --overwrite"):
        prepare_run_dir(validate(LaunchSpec(SCRIPT, run_dir=run)), PLAIN, print)
    said: list[str] = []
    with prepare_run_dir(validate(LaunchSpec(SCRIPT, run_dir=run, overwrite=True)), PLAIN, said.append):
        assert said == [f"--overwrite: removed the previous run's 1 event log from {run}; kept 1 other file"]
        assert sorted(p.name for p in run.iterdir()) == ["graph.json", "launch.lock", "notes.txt"]
        with pytest.raises(ConfigError, match=f"--run-dir {run} is in use by a running launch \\(pid {os.getpid()} on "):
            prepare_run_dir(validate(LaunchSpec(SCRIPT, run_dir=run, overwrite=True)), PLAIN, print)


def test_a_launch_gives_its_run_dir_back_when_a_phase_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Launch) -> None:
        raise RuntimeError("the store would not start")

    monkeypatch.setattr(Launch, "start_store_and_rendezvous", broken)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the store would not start"):
        run_launch(LaunchSpec(SCRIPT, graph="ring:2", run_dir=run, start_method="exec"),
                   stdout=io.StringIO(), stderr=io.StringIO())
    with claim_run_dir(run, overwrite=True) as claim:  # not held by the launch that failed
        assert claim.cleared is not None and "graph.json" in claim.cleared


def test_prepare_run_dir_names_a_fresh_one_under_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plan = validate(LaunchSpec(SCRIPT, graph="ring:3", config=ProtocolConfig(protocol="allreduce")))
    claims = [prepare_run_dir(plan, PLAIN, print) for _ in range(2)]
    first, second = (claim.path for claim in claims)
    for claim in claims:
        claim.release()
    assert first.parent == second.parent == (tmp_path / "runs").resolve()
    assert first.name.endswith("-allreduce-ring-3")
    assert second.name.endswith(("-allreduce-ring-3", "-allreduce-ring-3-2"))
    assert first != second


def test_worker_env_carries_the_run_key_and_never_a_stale_one(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = validate(LaunchSpec(SCRIPT, graph="ring:2", env_extra={"EXTRA": "1"}))
    env, _ = worker_base_env(plan, PLAIN, {KEY_ENV: "stale", "PYTHONPATH": "elsewhere"})
    assert KEY_ENV not in env and env["EXTRA"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["elsewhere"]
    keys = CurveKeys.generate()
    env, _ = worker_base_env(plan, RunSecurity(keys, "generated"), {})
    assert env[KEY_ENV] == keys.to_text()


# ------------------------------------------------------------------------ state and end
def _state(codes: dict[int, int]) -> RunState:
    state = RunState()
    for rank in range(4):
        state.started(rank)
    for rank, code in codes.items():
        state.ended(rank, code)
    return state


def test_worker_states_follow_exits_and_stops() -> None:
    state = _state({2: 3, 0: 0})
    state.stopping([1, 3])
    state.ended(1, -15)
    assert [state.workers[r].state for r in range(4)] == [
        WorkerState.SUCCEEDED, WorkerState.STOPPED, WorkerState.FAILED, WorkerState.STOPPED]
    assert state.exit_order == [2, 0]  # only ends of their own
    assert state.lost == {2: 3} and state.stopped == {1, 3} and state.pending == [3]
    state.reaped({3: -9, 1: 0})
    assert state.returncodes == {0: 0, 1: -15, 2: 3, 3: -9}


def test_conclude_lost_within_max_failures_is_a_success(tmp_path: Path) -> None:
    state = _state({2: 3, 0: 0, 1: 0, 3: 0})
    conclude(state, tmp_path, max_failures=1, world_size=4)
    assert state.returncode == 0 and state.failed_rank is None
    assert state.summary == "lost rank 2 (2: exit code 3); the other 3 workers finished"


def test_conclude_blames_a_failure_from_the_logs(tmp_path: Path) -> None:
    state = _state({2: 3})
    state.first_failure = 2
    state.stopping([0, 1, 3])
    conclude(state, tmp_path, max_failures=0, world_size=4, machine="hostA, node 1")
    assert state.returncode == 1 and state.failed_rank == 2 and state.reason == "exit code 3"
    assert state.summary is not None and state.summary.endswith(" [rank 2 runs on hostA, node 1]")


def test_conclude_after_a_dead_coordinator_and_after_a_signal(tmp_path: Path) -> None:
    state = _state({1: 1, 3: -9})
    state.coordinator_exit = -9
    state.fail(None, "coordinator died", "the coordinator (x) at tcp://h:1 died (killed by SIGKILL)")
    conclude(state, tmp_path, max_failures=0, world_size=4)
    assert state.summary == ("the coordinator (x) at tcp://h:1 died (killed by SIGKILL); "
                             "then ranks 1, 3 failed (1: exit code 1, 3: killed by SIGKILL)")
    signalled = _state({2: 1})
    signalled.signal = 2
    conclude(signalled, tmp_path, max_failures=0, world_size=4)
    assert signalled.summary is None and signalled.returncode == 0


# --------------------------------------------------------------------------- hopnet.init
def _context(**changes: object) -> WorkerContext:
    fields: dict = dict(rank=0, world_size=4, graph=Graph.ring(4), flags=ProtocolConfig(max_ig=3),
                        explicit=("max_ig",), bind_host="127.0.0.1", store_endpoint="127.0.0.1:1", curve=None)
    fields.update(changes)
    return WorkerContext(**fields)


def test_find_launcher_without_one_says_how_to_start_the_script() -> None:
    with pytest.raises(ConfigError, match=r"from a launcher: run `hopnet launch --nproc 4 \S+.*` \(or under torchrun "
                                          r"or srun\)"):
        find_launcher(None, {})


def test_resolve_options_keeps_the_launchers_refusals() -> None:
    context = _context()
    assert resolve_options(InitSpec(options={"seed": 7}), context) == ProtocolConfig(max_ig=3, seed=7)
    with pytest.raises(ConfigError, match=r"--max-ig 3 on the command line, max_ig=4 in hopnet.init\(\)"):
        resolve_options(InitSpec(options={"max_ig": 4}), context)
    with pytest.raises(ConfigError, match="in the config passed to hopnet.init"):
        resolve_options(InitSpec(config=ProtocolConfig(max_ig=5)), context)
    with pytest.raises(ConfigError, match="--max-ig must be an integer >= 1"):
        resolve_options(InitSpec(options={"seed": 1, "max_ig": 0}), _context(explicit=()))


def test_check_inputs_refuses_model_and_params_together() -> None:
    import torch

    spec = InitSpec(model=torch.nn.Linear(2, 1), params=torch.zeros(3))
    with pytest.raises(ConfigError, match="pass either model or params, not both"):
        check_inputs(spec, _context(), ProtocolConfig())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
