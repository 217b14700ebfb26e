"""A protocol of another package reaches every layer once its declaration is imported: the
flags of `hopnet launch` and `hopnet simulate`, the ``HOPNET_*`` variables, the refusal of
foreign options, the simulator and real worker processes (the launcher and its workers import
it through ``HOPNET_PLUGINS``). The protocol is the walk-through's example package,
``examples/new_protocol/scaled_mean``, here imported as the plugin ``scaled_mean.spec``."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hopnet import ProtocolConfig, registry
from hopnet.cli.main import main as cli
from hopnet.config_checks import check_config_for_graph
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.bootstrap.env_options import config_from_variables
from hopnet.launch.settings import LaunchSpec
from hopnet.launch.spec import validate
from hopnet.sim.engine import ComputeModel, SimSpec, simulate

from support.env import clean_env
from support.launch import run_launch
from support.paths import EXAMPLES

PLUGIN_DIR = EXAMPLES / "new_protocol"
"""The folder holding the example package, as another project's source folder would."""
sys.path.insert(0, str(PLUGIN_DIR))

import scaled_mean.spec  # noqa: E402,F401  (its import registers the protocol)
from scaled_mean.options import NAME, ScaledMeanOptions  # noqa: E402

TOY = NAME


def test_the_declaration_makes_the_options() -> None:
    assert TOY in registry.names()
    config = ProtocolConfig(TOY, scale_by=0.5, seed=3)
    assert config.options == ScaledMeanOptions(scale_by=0.5)
    assert ProtocolConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match=r"--scale-by must be a number >= 0 \(got -1\)"):
        ProtocolConfig(TOY, scale_by=-1)
    with pytest.raises(ConfigError, match=rf"--max-ig: option\(s\) that --protocol {TOY} does not take \(taken by hop\)"):
        ProtocolConfig(TOY, max_ig=4)
    with pytest.raises(ConfigError, match=r"--scale-by: option\(s\) that --protocol hop does not take"):
        ProtocolConfig("hop", scale_by=2)
    variables, explicit = config_from_variables({"HOPNET_PROTOCOL": TOY, "HOPNET_SCALE_BY": "0.25"})
    assert variables.options == ScaledMeanOptions(scale_by=0.25) and set(explicit) == {"protocol", "scale_by"}
    assert check_config_for_graph(config, Graph.ring(3)) == []


def test_the_simulator_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate(SimSpec(Graph.ring(4), ProtocolConfig(TOY, scale_by=2.0), 20, ComputeModel.parse("10")))
    assert [len(times) for times in result.finish_times] == [20] * 4
    assert cli(["simulate", "--protocol", TOY, "--scale-by", "0.5", "--nproc", "3", "--iterations", "5"]) == 0
    out = capsys.readouterr().out
    assert f"protocol:          {TOY}, scale_by=0.5" in out
    assert cli(["simulate", "--protocol", TOY, "--max-ig", "3", "--nproc", "3"]) == 2
    assert capsys.readouterr().err.strip() == (f"hopnet simulate: error: --max-ig: option(s) that --protocol {TOY} "
                                               "does not take (taken by hop)")


TRAINER = textwrap.dedent("""
    import sys
    import torch
    import hopnet

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    worker = hopnet.init(model)
    opt = hopnet.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), worker)
    data = torch.Generator().manual_seed(worker.rank)
    x, y = torch.randn(16, 4, generator=data), torch.randn(16, 1, generator=data)
    for _ in worker.iterations(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.save([p.detach().clone() for p in model.parameters()], sys.argv[1] + f"/final{worker.rank}.pt")
    worker.close()
""")


def reference_run(world_size: int, scale: float, steps: int) -> list[torch.Tensor]:
    """What TRAINER ends with when every rank applies the mean gradient times ``scale``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [torch.Generator().manual_seed(rank) for rank in range(world_size)]
    batches = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for g in data]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        grads = []
        for x, y in batches:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = torch.stack(per_rank).mean(0) * scale
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_replica_groups_refuse_it_in_one_line_as_it_does_not_declare_that_its_lanes_choose_alike() -> None:
    with pytest.raises(ConfigError, match=rf"--protocol {TOY} does not run between replica groups \(its lanes could "
                                          r"choose apart: its declaration does not say between_replicas=True\); "
                                          r"ad-psgd, allreduce, diloco, eager-sgd, hop"):
        validate(LaunchSpec(script=str(EXAMPLES / "train_cnn.py"), nproc=4, replica_size=2, config=ProtocolConfig(TOY)))


@pytest.mark.slow
def test_hopnet_launch_runs_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    env = clean_env(HOPNET_PLUGINS="scaled_mean.spec")  # the launcher and each worker import it
    env["PYTHONPATH"] = os.pathsep.join((str(PLUGIN_DIR), env["PYTHONPATH"]))
    result = run_launch(["--nproc", "3", "--protocol", TOY, "--scale-by", "0.5", "--run-dir",
                         str(tmp_path / "run"), "--no-prefix", str(script), str(tmp_path)], env=env)
    assert result.returncode == 0, result.stderr
    assert f"running {TOY} --scale-by 0.5" in result.stderr + result.stdout
    expected = reference_run(3, 0.5, 5)
    initial = reference_run(3, 0.5, 0)
    assert max(float((e - i).abs().max()) for e, i in zip(expected, initial)) > 1e-3
    for rank in range(3):  # every rank applied the same scaled mean of the gradients
        for mine, theirs in zip(torch.load(tmp_path / f"final{rank}.pt"), expected):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
