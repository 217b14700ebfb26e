"""A protocol declared from this file alone reaches every layer: the flags of `hopnet launch`
and `hopnet simulate`, the ``HOPNET_*`` variables, the refusal of foreign options, the
simulator and real worker processes (the launcher and its workers import this module
through ``HOPNET_PLUGINS``)."""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hopnet import ProtocolConfig, registry
from hopnet.cli.main import main as cli
from hopnet.config_checks import check_config_for_graph
from hopnet.errors import ConfigError
from hopnet.graph import Graph
from hopnet.bootstrap.env_options import config_from_variables
from hopnet.options import ProtocolOptions, option
from hopnet.params import FlatGradients
from hopnet.protocols.base import ApplyFn
from hopnet.protocols.gradient import AllRanksGradientProtocol
from hopnet.registry import Averages, ProtocolSpec, register
from hopnet.sim.engine import ComputeModel, SimSpec, simulate

from support.env import clean_env
from support.launch import run_launch

TOY = "toy-scaled-mean"


@dataclass(frozen=True)
class ToyOptions(ProtocolOptions):
    toy_scale: float = option(1.0, minimum=0, metavar="X", help="multiply the averaged gradient by X")


class ToyProtocol(AllRanksGradientProtocol):
    """The mean of every rank's gradient, scaled: all-reduce, then multiply."""

    name = TOY

    def __init__(self, config: ProtocolConfig, options: ToyOptions,
                 grads: FlatGradients | torch.Tensor | None) -> None:
        super().__init__(config, grads)
        self.scale = options.toy_scale

    async def finish_iteration(self, apply: ApplyFn | None, *, last: bool = False) -> None:
        k = self.iteration
        buffer = self.grads.gather() if isinstance(self.grads, FlatGradients) else self.grads
        assert buffer is not None
        await self.node.collective.allreduce(self.everyone, buffer, "mean", tag=f"toy/{k}")
        buffer.mul_(self.scale)  # every .grad is a view into the flat buffer
        if apply is not None:
            apply()
        self.node.iteration_done(k, self)
        if not last:
            self.iteration = k + 1
            self.node.entered(k + 1, self)


register(ProtocolSpec(
    name=TOY,
    summary="a test's protocol: the mean of the gradients, scaled by --toy-scale.",
    options=ToyOptions,
    build=lambda config, options, params, grads: ToyProtocol(config, options, grads),
    averages=Averages.GRADIENTS,
    uses_graph=False,
))


def test_the_declaration_makes_the_options() -> None:
    assert TOY in registry.names()
    config = ProtocolConfig(TOY, toy_scale=0.5, seed=3)
    assert config.options == ToyOptions(toy_scale=0.5)
    assert ProtocolConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match=r"--toy-scale must be a number >= 0 \(got -1\)"):
        ProtocolConfig(TOY, toy_scale=-1)
    with pytest.raises(ConfigError, match=rf"--max-ig: option\(s\) that --protocol {TOY} does not take \(taken by hop\)"):
        ProtocolConfig(TOY, max_ig=4)
    with pytest.raises(ConfigError, match=r"--toy-scale: option\(s\) that --protocol hop does not take"):
        ProtocolConfig("hop", toy_scale=2)
    variables, explicit = config_from_variables({"HOPNET_PROTOCOL": TOY, "HOPNET_TOY_SCALE": "0.25"})
    assert variables.options == ToyOptions(toy_scale=0.25) and set(explicit) == {"protocol", "toy_scale"}
    assert check_config_for_graph(config, Graph.ring(3)) == []


def test_the_simulator_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate(SimSpec(Graph.ring(4), ProtocolConfig(TOY, toy_scale=2.0), 20, ComputeModel.parse("10")))
    assert [len(times) for times in result.finish_times] == [20] * 4
    assert cli(["simulate", "--protocol", TOY, "--toy-scale", "0.5", "--nproc", "3", "--iterations", "5"]) == 0
    out = capsys.readouterr().out
    assert f"protocol:          {TOY}, toy_scale=0.5" in out
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


@pytest.mark.slow
def test_hopnet_launch_runs_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    env = clean_env(HOPNET_PLUGINS=Path(__file__).stem)  # the launcher and each worker import this module
    env["PYTHONPATH"] = os.pathsep.join((str(Path(__file__).resolve().parent), env["PYTHONPATH"]))
    result = run_launch(["--nproc", "3", "--protocol", TOY, "--toy-scale", "0.5", "--run-dir",
                         str(tmp_path / "run"), "--no-prefix", str(script), str(tmp_path)], env=env)
    assert result.returncode == 0, result.stderr
    assert f"running {TOY} --toy-scale 0.5" in result.stderr + result.stdout
    expected = reference_run(3, 0.5, 5)
    initial = reference_run(3, 0.5, 0)
    assert max(float((e - i).abs().max()) for e, i in zip(expected, initial)) > 1e-3
    for rank in range(3):  # every rank applied the same scaled mean of the gradients
        for mine, theirs in zip(torch.load(tmp_path / f"final{rank}.pt"), expected):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
