"""Replica groups without processes: which process is which, the shards, the refusals, the
launcher's arithmetic, and the lanes' agreement (two gloo members in one process)."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import timedelta
from unittest import mock
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.launch.outcome import conclude
from hopnet.launch.replicas import end_replica, restart_replica
from hopnet.launch.restarts import RestartBudget
from hopnet.launch.settings import LaunchSpec
from hopnet.launch.spec import validate
from hopnet.launch.state import RunState
from hopnet.launch.worker_logs import peer_process, worker_log
from hopnet.model_state import ModelState
from hopnet.replica.agreement import LaneAgreement
from hopnet.replica.layout import ReplicaLayout
from hopnet.replica.shards import bounds, lane_state
from hopnet.replica.support import replica_refusal

from support.paths import EXAMPLES

CNN = str(EXAMPLES / "train_cnn.py")


def test_processes_are_numbered_replica_by_replica_and_log_where_their_lane_does(tmp_path: Path) -> None:
    layout = ReplicaLayout(size=4, mode="fsdp", processes=8)
    assert (layout.replicas, layout.replica_of(6), layout.member_of(6), layout.process(1, 2)) == (2, 1, 2, 6)
    assert list(layout.members(1)) == [4, 5, 6, 7]
    assert [layout.log_name(p) for p in (0, 3, 4)] == ["rank0.jsonl", "lane3/rank0.jsonl", "rank1.jsonl"]
    assert layout.describe(1) == "replica 1 (ranks 4, 5, 6, 7)"
    (tmp_path / "launch.json").write_text(json.dumps({"replicas": {"size": 4, "mode": "fsdp"}}))
    assert worker_log(tmp_path, 6) == tmp_path / "lane2" / "rank1.jsonl"
    assert peer_process(tmp_path, 6, 0) == 2  # member 2's peer "replica 0" is replica 0's member 2


@pytest.mark.parametrize("environ, size", [({}, 1), ({"HOPNET_REPLICA_SIZE": "2"}, 2),
                                           ({"HOPNET_REPLICA_MODE": "fsdp", "LOCAL_WORLD_SIZE": "4"}, 4)])
def test_the_variables_name_the_size_and_mode_alone_makes_a_machine_one_replica(environ: dict, size: int) -> None:
    assert ReplicaLayout.from_environ(environ, 8).size == size


@pytest.mark.parametrize("kwargs, message", [
    (dict(size=3, processes=8), "--replica-size 3 does not divide the 8 processes"),
    (dict(size=2, mode="zero", processes=8), "--replica-mode 'zero': expected one of ddp, fsdp"),
])
def test_a_bad_layout_is_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplicaLayout(**kwargs)


@pytest.mark.parametrize("numel, parts", [(10, 3), (2, 4), (7, 1), (0, 2)])
def test_the_shards_cover_every_element_once(numel: int, parts: int) -> None:
    covered = [i for m in range(parts) for i in range(*bounds(numel, parts, m))]
    assert covered == list(range(numel))


def test_a_lane_state_is_views_of_its_slice_split_into_parameters_and_buffers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))  # 8 + 4 params, 4 buffers
    state = ModelState.of(model)
    (flat,) = state.flats
    lanes = [lane_state(state, 2, m) for m in range(2)]
    assert [lane.flats[0].numel() for lane in lanes] == [8, 8]
    assert sum(p.numel() for lane in lanes for p in lane.params) == 12
    assert sum(b.numel() for lane in lanes for b in lane.buffers) == 4
    lanes[1].flats[0].fill_(3.0)  # a view: written into the model
    assert torch.equal(flat[8:], torch.full((8,), 3.0)) and model[1].running_var.eq(3.0).all()


@pytest.mark.parametrize("options, refused", [
    (dict(protocol="hop", backup_workers=1), None),
    (dict(protocol="diloco"), None),
    (dict(protocol="hop", staleness=2), None),
    (dict(protocol="diloco", outer_quorum=1), None),
    (dict(protocol="prague"), None),
    (dict(protocol="partial-reduce"), None),
    (dict(protocol="ad-psgd"), None),
    (dict(protocol="eager-sgd", eager_mode="majority"), None),
])
def test_every_protocol_runs_between_replicas(options: dict, refused: str | None) -> None:
    """(A protocol of another package that does not declare it is refused: test_protocol_registry.py.)"""
    refusal = replica_refusal(ProtocolConfig(**options))
    assert refusal is None if refused is None else refused in refusal


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc=4, replica_size=2, max_failures=2), "--max-failures must be an integer from 0 to 1 (there are 2 "
                                                    "replicas"),
    (dict(nproc=6, replica_size=4), "--replica-size 4 does not divide --nproc 6"),
    (dict(graph="ring:3", nproc=4, replica_size=2), "--nproc 4 makes 2 replicas of 2 processes, but the graph has 3"),
    (dict(nproc=4, replica_mode="fsdp"), "--replica-mode needs --replica-size R on one machine"),
    (dict(nproc=4, replica_size=2, max_restarts=1, config=ProtocolConfig(protocol="eager-sgd")),
     "--max-restarts: --protocol eager-sgd cannot bring back a replica group yet"),
    (dict(nproc=4, replica_size=2, max_nproc=5), "--min-nproc 2/--max-nproc 5: an elastic run of replica groups "
                                                 "grows and shrinks by whole replicas; give multiples of "
                                                 "--replica-size 2"),
    (dict(nproc=4, replica_size=2, min_nproc=1), "give multiples of --replica-size 2"),
    (dict(nproc=4, replica_size=2, max_nproc=6, config=ProtocolConfig(protocol="prague")),
     "--min-nproc/--max-nproc: --protocol prague cannot change the membership of replica groups yet; allreduce, "
     "diloco, hop, notify-ack, pipe-sgd can"),
    (dict(nproc=4, replica_size=2, max_nproc=6, config=ProtocolConfig(protocol="eager-sgd")),
     "--protocol eager-sgd cannot change the membership of replica groups yet"),
])
def test_the_launcher_refuses_what_replica_groups_cannot_run_before_anything_starts(kwargs: dict,
                                                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(LaunchSpec(script=CNN, **kwargs))


def test_max_restarts_brings_back_replica_groups_under_hop() -> None:
    plan = validate(LaunchSpec(script=CNN, nproc=4, replica_size=2, max_restarts=1))
    assert (plan.replicas.size, plan.graph.n) == (2, 2)


def test_an_elastic_run_of_replica_groups_counts_its_members_in_replicas() -> None:
    plan = validate(LaunchSpec(script=CNN, nproc=4, replica_size=2, min_nproc=2, max_nproc=8))
    assert plan.elastic is not None and (plan.elastic.min_nproc, plan.elastic.max_nproc) == (1, 4)
    assert validate(LaunchSpec(script=CNN, nproc=4, replica_size=2, max_nproc=6)).elastic.min_nproc == 1


def test_the_graph_has_a_node_per_replica_and_a_replica_goes_where_its_node_goes() -> None:
    plan = validate(LaunchSpec(script=CNN, nproc=8, replica_size=4))
    assert (plan.graph.n, plan.world_size, plan.replicas.mode) == (2, 8, "ddp")
    machine = validate(LaunchSpec(script=CNN, nproc=8, replica_mode="fsdp", nnodes=2, node_rank=1,
                                  rdzv_endpoint="127.0.0.1:29999"))
    assert (machine.replicas.size, list(machine.nodes.ranks)) == (4, [4, 5, 6, 7])


def test_max_failures_counts_replicas_not_processes(tmp_path: Path) -> None:
    state = RunState()
    for rank in range(4):
        state.started(rank)
    state.ended(2, -9)
    state.ended(3, -9)
    state.ended(0, 0)
    state.ended(1, 0)
    conclude(state, tmp_path, max_failures=1, world_size=4, replica_size=2)
    assert state.failed_rank is None and state.summary is not None and "lost ranks 2, 3" in state.summary


def _members(size: int) -> list[LaneAgreement]:
    store = dist.HashStore()
    groups: list = [None] * size

    def make(member: int) -> None:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=20)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[member] = dist.ProcessGroupGloo(store, member, size, opts)

    threads = [threading.Thread(target=make, args=(m,)) for m in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [LaneAgreement(group, candidates=4) for group in groups]


def test_the_lanes_agree_on_what_they_all_have_and_on_the_largest_need() -> None:
    lanes = _members(2)

    async def both(haves: list[set[int]], needs: list[int]) -> list[tuple[frozenset[int], bool]]:
        return list(await asyncio.gather(*(lane.common(have, need) for lane, have, need in zip(lanes, haves, needs))))

    first = asyncio.run(both([{0, 2, 3}, {2, 3}], [2, 1]))
    assert first == [(frozenset({2, 3}), True)] * 2
    short = asyncio.run(both([{0, 2}, {2}], [1, 2]))  # one lane still waits for a second sender
    assert short == [(frozenset({2}), False)] * 2
    assert asyncio.run(_least(lanes, [5, 3])) == [3, 3]  # a skip goes as far as the most cautious lane


async def _least(lanes: list[LaneAgreement], values: list[int]) -> list[int]:
    return list(await asyncio.gather(*(lane.least(value) for lane, value in zip(lanes, values))))


class _Ended:
    """A worker process as the launcher sees it: its pid and, once it ended, its exit status."""

    def __init__(self, pid: int, code: int | None) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code


@pytest.mark.parametrize("sibling_code, cause", [(-9, 3), (None, 2), (1, 2)])
def test_a_member_failing_after_its_sibling_was_killed_is_never_the_replicas_cause(sibling_code: int | None,
                                                                                  cause: int) -> None:
    """Rank 2 exits 1 (its collectives with rank 3 broke). Killed by a signal, rank 3 ended the replica and
    rank 2 failed with it; running, rank 3 is stopped with rank 2; ended with an error, rank 2 stays the cause."""
    layout = ReplicaLayout(size=2, processes=4)
    procs = {0: _Ended(10, None), 1: _Ended(11, None), 2: _Ended(12, 1), 3: _Ended(13, sibling_code)}
    said: list[str] = []
    killed: list[int] = []
    with_replica: dict[int, int] = {}
    with mock.patch("hopnet.launch.replicas.kill_group", lambda pid, sig: killed.append(pid)):
        counted = end_replica(layout, 2, 1, procs, pending=[0, 1, 3] if sibling_code is None else [0, 1],
                              with_replica=with_replica, say=said.append, grace_s=0.05)
    assert counted == (cause == 2)
    if cause == 3:
        assert with_replica == {2: 3} and said == ["rank 3 ended replica 1 (ranks 2, 3): rank 2 failed with it"]
    elif sibling_code is None:
        assert with_replica == {3: 2} and killed == [13]
        assert said == ["rank 2 ended replica 1 (ranks 2, 3): stopping rank 3 with it"]
    else:
        assert with_replica == {} and killed == [] and said == []


def test_a_restart_decided_by_a_killed_sibling_names_it_and_each_member_restarts_once() -> None:
    """Under --max-restarts rank 2 exits 1 first (its collectives with rank 3 broke) while rank 3 was
    killed by a signal: rank 3's death decides the replica's restart, rank 2 comes back with its
    replica, and rank 3, handled next, takes the restart it decided: one unit of the budget."""
    layout = ReplicaLayout(size=2, processes=4)
    procs = {0: _Ended(10, None), 1: _Ended(11, None), 2: _Ended(12, 1), 3: _Ended(13, -9)}
    budget = RestartBudget(1)
    with mock.patch("hopnet.launch.replicas.kill_group", lambda pid, sig: None):
        second = restart_replica(budget, layout, 2, 1, "exit code 1", ending=False, pending=[0, 1, 3], procs=procs,
                                 say=lambda line: None, grace_s=0.05)
        third = restart_replica(budget, layout, 3, -9, "killed by SIGKILL", ending=False, pending=[0, 1], procs=procs,
                                say=lambda line: None, grace_s=0.05)
    assert second is not None and third is not None
    assert second.line() == "rank 2 died (with its replica (killed by SIGKILL in rank 3)); restarting it (restart 1 of 1)"
    assert third.line() == "rank 3 died (killed by SIGKILL); restarting it (restart 1 of 1)"
    assert budget.used == 1


UNITS_SCRIPT = """
import json, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from hopnet.replica.fsdp import UNIT_NUMEL, shard_model

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
big = int(UNIT_NUMEL ** 0.5) + 1
model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(big, big)), nn.Linear(8, 8),
                      nn.Linear(big, big), nn.BatchNorm1d(8))
shard_model(model, dist.group.WORLD, torch.device("cpu"))
print(json.dumps(sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp_units_are_the_large_modules_and_the_root_holds_the_small_ones() -> None:
    """A layer of 2^20 trainable elements or more is a unit of its own; the small ones (and a
    container holding a large one beside small ones) are left to the root's unit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", UNITS_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == ["", "1.1", "3"]
