"""A decoder-only transformer too big for one rank, built on the meta device and materialized one
FSDP unit at a time (``param_init_fn``), so no rank ever holds the full model.

    python3 examples/train_large_transformer_meta.py                 # 2 XLA:CPU devices, 8 x 512 layers
    python3 examples/train_large_transformer_meta.py --layers 24 --d_model 2048 --num_devices 4
    torchrun --nproc_per_node 4 examples/train_large_transformer_meta.py --transport torch

Reports the full fp32 model + gradients + AdamW state against --rank_budget_mib, and what each
rank actually holds.
"""
from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from example_utils import (ExampleParser, add_launch_flags, at_least, compilations, launch, peak_rss_mib,
                           positive_float, seeded, state_bytes)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def init_unit(module: nn.Module) -> None:
    """param_init_fn: give this unit's own (meta) parameters storage and GPT-style values.
    Nested units were materialized and sharded already, so they are skipped."""
    from xla_fsdp.unit.construction import owned_modules
    for _, m in owned_modules(module):
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        with torch.no_grad():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def parse_args(argv=None):
    p = ExampleParser(__doc__)
    p.add_argument("--layers", type=at_least(1), default=8)
    p.add_argument("--d_model", type=at_least(1), default=512)
    p.add_argument("--heads", type=at_least(1), default=8)
    p.add_argument("--vocab", type=at_least(2), default=8192)
    p.add_argument("--seq", type=at_least(1), default=128)
    p.add_argument("--batch_size", type=at_least(1), default=2, help="per rank")
    p.add_argument("--num_steps", type=at_least(1), default=4)
    p.add_argument("--rank_budget_mib", type=positive_float, default=400.0,
                   help="memory one rank may give to parameters + gradients + optimizer state")
    add_launch_flags(p)
    return p.parse_args(argv)


def train(ctx, args):
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.wrap import transformer_auto_wrap_policy

    with torch.device("meta"):
        model = LM(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    full_mib = n_params * 4 * 4 / 2 ** 20  # fp32 params + grads + AdamW exp_avg + exp_avg_sq
    with seeded(0):  # param_init_fn draws the weights unit by unit
        model = FSDP(
            model,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            param_init_fn=init_unit,
            transport=args.transport,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(ctx.rank)
    start = None
    for step in range(args.num_steps):
        if step == 1:
            start = time.perf_counter()
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq + 1), generator=g)
        x, y = ids[:, :-1].to(ctx.device), ids[:, 1:].to(ctx.device)
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        ctx.sync()
        ctx.log(f"step {step}: loss {loss.item():.4f}")
    b = state_bytes(model, opt)
    rank_mib = sum(b.values()) / 2 ** 20
    elapsed = time.perf_counter() - start if start else float("nan")
    ctx.log(f"SUMMARY example=large_transformer params={n_params} full_state_mib={full_mib:.0f} "
            f"rank_state_mib={rank_mib:.0f} rank_budget_mib={args.rank_budget_mib:.0f} "
            f"fits_unsharded={full_mib <= args.rank_budget_mib} fits_sharded={rank_mib <= args.rank_budget_mib} "
            f"world_size={ctx.world_size} steps/s={(args.num_steps - 1) / elapsed:.3f} "
            f"peak_rss_mib={peak_rss_mib():.0f} compilations={compilations(ctx)} final_loss={loss.item():.6f}")
    assert math.isfinite(loss.item())


if __name__ == "__main__":
    launch(train, parse_args())
