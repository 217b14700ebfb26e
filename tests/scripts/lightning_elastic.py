"""examples/lightning_digits.py for the elastic tests (tests/test_lightning.py): the same script,
whose first workers wait at one step for the joiner to start (joiner_gate.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import lightning_digits as example  # noqa: E402
from joiner_gate import wait_for_the_joiner  # noqa: E402


class GatedStrategy(example.HopnetStrategy):  # type: ignore[misc, valid-type]
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        wait_for_the_joiner(self.lightning_module.trainer.global_step)
        super().on_train_batch_start(batch, batch_idx)


if __name__ == "__main__":
    example.HopnetStrategy = GatedStrategy
    example.main()
