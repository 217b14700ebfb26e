"""examples/hf_trainer_lm.py for the elastic tests (tests/test_hf.py): the same script, whose first
workers wait at one step for the joiner to start (joiner_gate.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_trainer_lm as example  # noqa: E402
from joiner_gate import wait_for_the_joiner  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class Gate(TrainerCallback):
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wait_for_the_joiner(state.global_step)


class GatedTrainer(example.HopnetTrainer):  # type: ignore[misc, valid-type]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(Gate())


if __name__ == "__main__":
    example.HopnetTrainer = GatedTrainer
    example.main()
