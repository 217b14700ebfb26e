"""hopnet scripts under torchrun and srun: the variables, the nodelist, and two real runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.env import clean_env
from support.paths import EXAMPLES
from support.records import consensus_error, coordinator_records, records
from support.ports import free_port
from hopnet.errors import ConfigError
from hopnet.bootstrap.env_options import config_from_variables
from hopnet.bootstrap.external import detect, parse_nodelist
from hopnet.protocols.hop.options import HopOptions

REPO = Path(__file__).resolve().parent.parent
DIGITS = str(EXAMPLES / "train_digits.py")
ACCURACY = re.compile(r"final held-out accuracy ([0-9.]+)")


# ------------------------------------------------------------------------- nodelists
@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[8-10],b", ["a8", "a9", "a10", "b"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x1,y[3],z", ["x1", "y3", "z"]),
])
def test_nodelist_expands_slurm_syntax(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[01-03", "node01]", "node[a-b]", "node[3-1]", "a,,b"])
def test_nodelist_refuses_malformed_lists(text: str) -> None:
    with pytest.raises(ConfigError, match="node list"):
        parse_nodelist(text)


# ------------------------------------------------------------------------- variables
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}
SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "123456"}


def test_torchrun_variables_give_rank_world_and_the_agent_store() -> None:
    env = detect(TORCHRUN)
    assert env is not None and env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (5, 8, 1, 1)
    assert env.store_endpoint == "10.0.0.1:29500" and env.agent_store and not env.hosts_store
    assert env.key_prefix == "hopnet/job7.2/"


def test_plain_master_variables_make_rank_0_host_the_store() -> None:
    env = detect({**TORCHRUN, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": ""})
    assert env is not None and env.hosts_store


def test_slurm_variables_give_rank_world_and_the_first_host() -> None:
    env = detect(SLURM)
    assert env is not None and env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (2, 4, 0, 1)
    assert env.master_addr == "node07" and env.master_port == 20000 + 123456 % 20000
    assert detect({**SLURM, "SLURM_STEP_NODELIST": "gpu[3-4]", "MASTER_PORT": "4000"}).store_endpoint == "gpu3:4000"
    assert detect({**SLURM, "SLURM_PROCID": "0"}).hosts_store


def test_no_launcher_variables_is_no_external_launcher() -> None:
    assert detect({"HOME": "/root"}) is None


@pytest.mark.parametrize("environ, message", [
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT is not set"),
    ({**TORCHRUN, "RANK": "8"}, r"RANK=8 is out of range \(WORLD_SIZE=8"),
    ({**TORCHRUN, "WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS is not set"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_STEP_NODELIST / SLURM_JOB_NODELIST"),
    ({**SLURM, "SLURM_LOCALID": "-1"}, "SLURM_LOCALID=-1 is out of range"),
])
def test_missing_or_inconsistent_variables_are_one_line_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        detect(environ)
    assert "\n" not in str(info.value)


def test_protocol_options_from_variables_count_as_explicit() -> None:
    config, explicit = config_from_variables({"HOPNET_MAX_IG": "4", "HOPNET_BACKUP_WORKERS": "1",
                                              "HOPNET_STALENESS": "none", "HOPNET_SLOWDOWN": "rank=1:2"})
    options = config.options_as(HopOptions)
    assert (options.max_ig, options.backup_workers, options.staleness, config.slowdown) == (4, 1, None, ["rank=1:2"])
    assert set(explicit) == {"max_ig", "backup_workers", "staleness", "slowdown"}
    with pytest.raises(ConfigError, match="HOPNET_TOKEN_QUEUES='maybe'"):
        config_from_variables({"HOPNET_TOKEN_QUEUES": "maybe"})


# ------------------------------------------------------------------------- real runs

def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _digits_under_torchrun(tmp_path: Path, run_dir: Path, **variables: str) -> str:
    """train_digits.py on 4 processes under torchrun's c10d rendezvous, to its end: its output."""
    env = {**clean_env(PYTHONUNBUFFERED="1"), "HOPNET_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", **variables}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           DIGITS, "--iterations", "70", "--eval-every", "1000"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        _kill(proc)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_digits_under_simulated_srun(tmp_path: Path) -> None:
    """Three plain processes with the variables srun sets: the store on the first host of the
    nodelist, the graph and the options from HOPNET_* variables, the default run directory, and
    the coordinator of a group protocol hosted by rank 0."""
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(3):
            env = {**clean_env(PYTHONUNBUFFERED="1"), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(rank),
                   "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost,node[2-3]",
                   "MASTER_PORT": str(port), "HOPNET_GRAPH": "complete:3", "HOPNET_PROTOCOL": "prague",
                   "HOPNET_GROUP_GENERATOR": "random", "HOPNET_GROUP_SIZE": "2",
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, DIGITS, "--iterations", "50", "--eval-every", "1000"],
                                          env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            _kill(p)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    accuracies = [float(ACCURACY.search(o).group(1)) for o in outputs]
    assert min(accuracies) >= 0.8, accuracies
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1, run_dirs  # rank 0 named it, the others learnt it through the store
    logs = sorted(p.name for p in run_dirs[0].glob("rank*.jsonl"))
    assert logs == ["rank0.jsonl", "rank1.jsonl", "rank2.jsonl"]
    start = records(run_dirs[0], 2)[0]
    assert start["config"]["group_size"] == 2 and start["config"]["protocol"] == "prague"
    coordinator = coordinator_records(run_dirs[0])
    stop = coordinator[-1]
    assert stop["event"] == "stop" and stop["groups_formed"] > 0 and stop["workers_left"] == [0, 1, 2]


@pytest.mark.slow
def test_digits_under_torchrun_in_replica_groups(tmp_path: Path) -> None:
    """torchrun with 4 processes and HOPNET_REPLICA_SIZE=2: 2 replicas (a ring of 2), DDP inside each, so
    a replica's processes end with one model; each replica's first process logs for it. Under Partial
    Reduce, whose controller hears one process per replica and the others through it: a follower whose
    relay thread was still in gloo's receive when the interpreter exited (as scripts under torchrun
    end) aborted with std::terminate in 2 of 6 runs."""
    run_dir = tmp_path / "run"
    out = _digits_under_torchrun(tmp_path, run_dir, HOPNET_REPLICA_SIZE="2", HOPNET_PROTOCOL="partial-reduce",
                                 HOPNET_GROUP_SIZE="2")
    assert min(float(a) for a in ACCURACY.findall(out)) >= 0.9, out[-3000:]
    assert "terminate called" not in out
    assert json.loads((run_dir / "graph.json").read_text())["nodes"] == 2
    assert (run_dir / "coordinator.jsonl").exists()
    models = [torch.load(run_dir / f"final_rank{r}.pt") for r in range(4)]  # each process's own, before the consensus
    assert torch.equal(models[0], models[1]) and torch.equal(models[2], models[3])  # a replica's members: one model
    assert consensus_error(run_dir, 4) < 1e-3
    assert sorted(p.name for p in run_dir.glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
    assert sorted(p.name for p in (run_dir / "lane1").glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
    start = records(run_dir, 1)[0]
    assert (start["replica"], start["member"], start["replica_size"]) == (1, 0, 2)
