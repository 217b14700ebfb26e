"""Train a tiny causal language model with the Hugging Face Trainer, under hopnet.

The model is a 2-layer Llama of width 64 built from its config (random weights: nothing is
downloaded); the text is the Python standard library's own source, read as bytes (256 tokens),
with a fixed held-out split. ``HopnetTrainer`` is the only change to a Trainer script:

    hopnet launch --nproc 2 examples/hf_trainer_lm.py
    hopnet launch --nproc 2 --protocol diloco --local-steps 10 examples/hf_trainer_lm.py --steps 80
    hopnet launch --nproc 2 examples/hf_trainer_lm.py --save-steps 20 --output-dir runs/lm
    hopnet launch --nproc 2 examples/hf_trainer_lm.py --save-steps 20 --output-dir runs/lm --resume

Every rank prints the held-out loss of the model it ends with: the consensus model, the same
on every rank; ``--output-dir`` also gets that model (``save_model``, from the lowest rank).
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model comes from a config: never ask the Hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from hopnet.integrations.transformers import HopnetTrainer  # noqa: E402

CORPUS_FILES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "inspect.py", "typing.py",
                "pathlib.py", "functools.py", "json/decoder.py", "json/encoder.py", "textwrap.py")
"""Standard-library modules whose source is the corpus (any Python has them)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (hopnet iterations)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up, then cosine)")
    parser.add_argument("--clip", type=float, default=1.0, help="max norm of the averaged gradient")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint every N steps (0: none)")
    parser.add_argument("--output-dir", default=None, help="default: the run directory's hf/, else a temporary one")
    parser.add_argument("--resume", action="store_true", help="go on from the newest checkpoint every rank saved")
    parser.add_argument("--seed", type=int, default=0, help="the same model initialisation on every worker")
    return parser.parse_args()


def corpus() -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return b"".join((stdlib / name).read_bytes() for name in CORPUS_FILES)


class Sequences(Dataset):
    """Windows of bytes (one row each): the model predicts each next byte."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}


def splits(seq_len: int) -> tuple[Sequences, Sequences]:
    """The training set, and a fixed held-out set: every 20th window of the corpus."""
    tokens = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)
    held = torch.arange(len(windows)) % 20 == 0
    return Sequences(windows[~held]), Sequences(windows[held][:96])


def build_model(seed: int, seq_len: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq_len,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # several workers share this machine's cores
    train, test = splits(args.seq_len)
    run_dir = os.environ.get("HOPNET_RUN_DIR")
    output_dir = args.output_dir or (str(Path(run_dir) / "hf") if run_dir else "/tmp/hopnet-hf-lm")
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=96, gradient_accumulation_steps=args.accumulation,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
        weight_decay=0.01, max_grad_norm=args.clip, bf16=args.precision == "bf16", use_cpu=True,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        logging_steps=10, report_to="none", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0)
    trainer = HopnetTrainer(model=build_model(args.seed, args.seq_len), args=training, train_dataset=train,
                            eval_dataset=test)
    trainer.train(resume_from_checkpoint=args.resume or None)
    loss = trainer.evaluate()["eval_loss"]  # the consensus model: the same on every rank
    print(f"held-out loss {loss:.4f} (consensus model, {trainer.state.global_step} steps; "
          f"the Trainer saw {trainer.args.world_size} process)", flush=True)
    trainer.save_model()


if __name__ == "__main__":
    main()
