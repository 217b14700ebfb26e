"""Train a LLaMA-style byte-level language model on the Python standard library's source.

A decoder in plain torch: pre-norm RMSNorm, rotary positions, causal attention through
``scaled_dot_product_attention``, a SwiGLU MLP, the embedding tied to the output layer. Bytes are
the tokens (a vocabulary of 256), and the text is the running interpreter's own ``.py`` source
with a fixed held-out split (examples/lm_data.py): nothing to download.

    hopnet launch --nproc 2 examples/train_lm.py --preset tiny
    hopnet launch --nproc 4 --protocol diloco --local-steps 10 examples/train_lm.py --preset tiny
    torchrun --nproc-per-node 2 examples/train_lm.py --preset tiny   # hopnet.init reads torchrun's variables

The trainer is a practitioner's: AdamW with weight decay on the matrices only, a linear warm-up
then a cosine decay set from the iteration number every iteration, ``--micro-batches`` of
gradient accumulation (all but the last inside ``optimizer.no_sync()``), clipping of the averaged
gradient (``optimizer.synchronize()`` first), bf16 autocast. Each worker reads its own random
windows (a generator seeded by its rank, saved in checkpoints). Every ``--eval-every`` iterations
and at the end each worker prints its own model's held-out loss and perplexity; at the end the
workers agree on one model (``worker.consensus()``) and the lowest live rank prints that one's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hopnet
from lm_data import heldout_windows, load_corpus, random_windows

# d_model, layers, heads, context, batch (per micro-batch), peak lr, iterations, corpus MB, held-out windows
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=96, layers=2, heads=4, context=64, batch_size=8, lr=3e-3, iterations=200,
                 corpus_mb=2, eval_windows=64, eval_every=50),                      # 0.25M parameters
    "small": dict(d_model=384, layers=6, heads=6, context=256, batch_size=16, lr=1e-3, iterations=2000,
                  corpus_mb=12, eval_windows=128, eval_every=200),                  # 10.7M
    "base": dict(d_model=768, layers=12, heads=12, context=1024, batch_size=8, lr=6e-4, iterations=5000,
                 corpus_mb=12, eval_windows=64, eval_every=500),                    # 85M (GPT-2 small's shape)
    "large": dict(d_model=1024, layers=24, heads=16, context=1024, batch_size=4, lr=3e-4, iterations=5000,
                  corpus_mb=12, eval_windows=64, eval_every=500),                   # 304M (GPT-2 medium's shape)
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for name in ("iterations", "batch_size", "context", "eval_every", "eval_windows", "corpus_mb"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="(default: the preset's)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    parser.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: 10%%)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decays to lr x this")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="max norm of the averaged gradient")
    parser.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast dtype")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU of this worker's local rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (CPU)")
    parser.add_argument("--seed", type=int, default=0, help="same model initialisation on every worker")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.warmup is None:
        args.warmup = max(1, args.iterations // 10)
    return args


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of channels (first half, second half) by its position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, depth: int) -> None:
        super().__init__()
        self.heads = heads
        hidden = 32 * math.ceil(8 * d_model / 3 / 32)  # SwiGLU's 8/3 d, rounded up to a multiple of 32
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        for residual in (self.proj, self.down):  # GPT-2's scaling of the layers that add to the residual
            nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ByteLM(nn.Module):
    def __init__(self, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        self.embed = nn.Embedding(256, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        blocks = [Block(d_model, heads, layers) for _ in range(layers)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(d_model)
        self.out = nn.Linear(d_model, 256, bias=False)
        self.out.weight = self.embed.weight  # tied
        for block in blocks:
            for linear in (block.qkv, block.gate_up):
                nn.init.normal_(linear.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Rotary angles are computed here, not kept as buffers (hopnet would send and average those).
        inv_freq = 10000.0 ** (-torch.arange(0, self.head_dim, 2, device=tokens.device) / self.head_dim)
        angles = torch.outer(torch.arange(tokens.shape[1], device=tokens.device), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.out(self.norm(x))


def build_model(args: argparse.Namespace) -> ByteLM:
    torch.manual_seed(args.seed)
    return ByteLM(args.d_model, args.layers, args.heads)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decoupled weight decay on the matrices (the tied embedding included), none on the norms."""
    params = list(model.parameters())  # each tied tensor once
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr``, then a cosine decay to ``--lr x --min-lr-ratio`` at the last iteration."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.iterations - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    if args.amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(args.device, dtype=torch.bfloat16)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def evaluate(model: nn.Module, heldout: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out windows."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast(args):  # in chunks of 32 windows, each chunk's mean weighted by its size
        sums = [lm_loss(model, x, y) * len(x) for x, y in zip(heldout[0].split(32), heldout[1].split(32))]
        loss = torch.stack(sums).sum().item() / len(heldout[0])
    model.train(was_training)
    return loss


def setup(args: argparse.Namespace, rank_variable: str) -> tuple[ByteLM, torch.device]:
    """The model on this worker's device, and the thread count: the same for hopnet and bench/lm_ddp.py."""
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get(rank_variable, "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return build_model(args).to(device), device


def data(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    train, heldout = load_corpus(args.corpus_mb * 1_000_000)
    x, y = heldout_windows(heldout, args.context, args.eval_windows)
    return train, (x.to(device), y.to(device))


def report_line(loss: float) -> str:
    return f"held-out loss {loss:.4f} perplexity {math.exp(min(loss, 50.0)):.2f}"


def main() -> None:
    args = parse_args()
    model, device = setup(args, "HOPNET_LOCAL_RANK" if "HOPNET_LOCAL_RANK" in os.environ else "LOCAL_RANK")
    worker = hopnet.init(model)
    optimizer = hopnet.DistributedOptimizer(
        torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95)), worker)
    train, heldout = data(args, device)
    generator = torch.Generator().manual_seed(args.seed * 100_003 + worker.rank)  # this worker's windows
    worker.register_state("windows", generator)  # checkpointed: a resumed worker reads on where it was
    if worker.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.preset}: {params / 1e6:.2f}M parameters, {len(train) / 1e6:.1f} MB of training text, "
              f"{args.batch_size * args.micro_batches * args.context} tokens per iteration per worker", flush=True)
    print(f"iteration 0 {report_line(evaluate(model, heldout, args))}", flush=True)

    model.train()
    began = time.monotonic()
    for step in worker.iterations(args.iterations):
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        total = 0.0
        for micro in range(args.micro_batches):
            x, y = (t.to(device) for t in random_windows(train, args.context, args.batch_size, generator))
            last = micro == args.micro_batches - 1
            with contextlib.nullcontext() if last else optimizer.no_sync():  # hopnet defers the backward pass, so it goes inside
                with autocast(args):
                    loss = lm_loss(model, x, y) / args.micro_batches
                loss.backward()
            total += loss.item()
        optimizer.synchronize()  # the average gradient is in .grad from here on (gradient protocols)
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with optimizer.skip_synchronize():
            optimizer.step()
        worker.report(loss=round(total, 5), lr=lr)
        if (step + 1) % args.eval_every == 0 and step + 1 < args.iterations:
            elapsed = time.monotonic() - began
            own = evaluate(model, heldout, args)
            worker.record("eval", iter=step, loss=own, elapsed=elapsed)
            print(f"iteration {step + 1} {report_line(own)}", flush=True)

    elapsed = time.monotonic() - began
    own = evaluate(model, heldout, args)
    worker.record("eval", iter=worker.iteration, loss=own, elapsed=elapsed, final=True)
    consensus = worker.consensus()  # every live worker now holds the mean of the live workers' models
    agreed = evaluate(model, heldout, args)
    worker.record("eval", iter=worker.iteration, loss=agreed, consensus=True)
    print(f"{report_line(own)} (this worker's model, {worker.steps} steps, {elapsed:.1f} s)", flush=True)
    if worker.rank == consensus.members[0]:
        print(f"consensus model {report_line(agreed)}", flush=True)
    worker.close()


if __name__ == "__main__":
    main()
