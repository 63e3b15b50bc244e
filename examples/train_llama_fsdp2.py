"""Train a tiny Llama with PyTorch FSDP2's API: the program of PyTorch's FSDP2 tutorial, on XLA
devices through ``xla_fsdp.fully_shard`` and on gloo/NCCL ranks through PyTorch's own.

    python3 examples/train_llama_fsdp2.py                          # 2 XLA:CPU devices
    torchrun --nproc_per_node 2 examples/train_llama_fsdp2.py      # 2 gloo ranks (PyTorch's fully_shard)
    PJRT_DEVICE=TPU python3 examples/train_llama_fsdp2.py --dim 1024 --n_layers 16 --precision bf16

The model (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) is built from a config on
the meta device; ``fully_shard`` goes on each block and then the root; ``to_empty`` and
``init_weights()`` give the values; each block prefetches the next ``--prefetch`` blocks;
``model.unshard()`` starts the root's gather before the batch; ``clip_grad_norm_`` clips
``model.parameters()``. Tokens are generated (no download). Every ``--ckpt_every`` steps rank 0
writes a DCP checkpoint of the full model, optimizer, LR scheduler and step to OUT_DIR/ckpt (a
new folder, renamed into place when complete); a rerun with ``--resume`` continues from the newest
one and gives the losses the uninterrupted run gives. ``--seed_checkpoint DIR`` starts from the weights in DIR
(written there by the first run that names it): runs on other transports and world sizes then
start alike. Two imports differ from the upstream program, marked below.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass, asdict
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from example_utils import ExampleParser, add_launch_flags, at_least, launch, positive_float

# upstream: from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
import xla_fsdp
from xla_fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
# upstream: from torch.distributed.checkpoint.state_dict import (...)
from xla_fsdp.checkpoints.state_dict_api import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                 set_model_state_dict, set_state_dict)


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 128
    max_seq_len: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(cfg: LlamaConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, (max_seq_len, head_dim / 2)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of x's (batch, seq, heads, head_dim) by its position's angle."""
    seq = x.shape[1]
    cos, sin = cos[:seq].view(1, seq, 1, -1).to(x.dtype), sin[:seq].view(1, seq, 1, -1).to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # deeper blocks start smaller, as torchtitan's

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, cfg) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every value, after ``to_empty`` (the model is built on the meta device)."""
        cos, sin = rope_tables(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.cfg.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# ----------------------------------------------------------------------------- data and schedule
def batch(step: int, cfg: LlamaConfig, global_batch: int) -> torch.Tensor:
    """Step ``step``'s token windows (global_batch, max_seq_len + 1): a noisy counting sequence,
    so the loss has something to learn; the same on every rank and after a resume."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (global_batch, 1), generator=g)
    ids = (start + stride * torch.arange(cfg.max_seq_len + 1)) % cfg.vocab_size
    noise = torch.rand(ids.shape, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, cfg.vocab_size, ids.shape, generator=g), ids)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_folders(ckpt_dir: str) -> List[Tuple[int, str]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(name[5:]), os.path.join(ckpt_dir, name)) for name in os.listdir(ckpt_dir)
             if name.startswith("step_") and name[5:].isdigit()]
    return sorted(found)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP's own warnings that say nothing about this program: "torch.distributed is disabled ...
    assuming ... a single process" comes even with ``no_dist=True`` (one writer, as asked), and its
    file writer calls the deprecated ``tensor.storage()`` (torch 2.9)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def save(ctx, model, opt, scheduler, step: int, folder: str) -> None:
    """The full state on rank 0's host, written by rank 0 into a new folder renamed into place."""
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_master:
        partial = folder + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        extra = {"step": torch.tensor(step), "scheduler": json.dumps(scheduler.state_dict())}
        with _quiet_dcp():
            dcp.save({"model": model_sd, "optim": optim_sd, **extra}, checkpoint_id=partial, no_dist=True)
        os.replace(partial, folder)


def load(model, opt, scheduler, folder: str) -> int:
    """Every rank reads the full state from ``folder`` and keeps its shards; returns the step."""
    full = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=full)  # the templates DCP fills
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0), "scheduler": ""}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=full)
    scheduler.load_state_dict(json.loads(state["scheduler"]))
    return int(state["step"])


def save_weights(ctx, model, folder: str) -> None:
    """The model's full values (a seed checkpoint), written by rank 0 into a new folder renamed into
    place. Weights only: asking for the optimizer's state dict would create its state (one step at
    lr 0, as PyTorch's get_state_dict does) and change AdamW's bias correction."""
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_master:
        partial = folder + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        with _quiet_dcp():
            dcp.save({"model": model_sd}, checkpoint_id=partial, no_dist=True)
        os.replace(partial, folder)


def load_weights(model, folder: str) -> None:
    """The model's values from a checkpoint folder (a seed checkpoint): optimizer and step stay."""
    full = StateDictOptions(full_state_dict=True)
    state = {"model": get_model_state_dict(model, options=full)}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    set_model_state_dict(model, state["model"], options=full)


# ----------------------------------------------------------------------------- training
def build(ctx, args, cfg: LlamaConfig) -> nn.Module:
    with torch.device("meta"):
        model = Llama(cfg)
    if args.precision == "bf16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    model.to_empty(device=ctx.device)
    model.init_weights()
    layers: List[FSDPModule] = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + args.prefetch])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - args.prefetch):i][::-1])
    return model


def train(ctx, args) -> None:
    cfg = LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      hidden_dim=args.hidden_dim, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    model = build(ctx, args, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    ckpt_dir = os.path.join(args.out_dir, "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    found = checkpoint_folders(ckpt_dir)
    start = 0
    if found:
        start = load(model, opt, scheduler, found[-1][1])
        ctx.log(f"resumed from {found[-1][1]} at step {start}")
    elif args.init_from:  # pretrained weights: each rank reads only the rows of its own shards
        xla_fsdp.load_pretrained(model, args.init_from)
        ctx.log(f"initial weights from {args.init_from}")
    elif args.seed_checkpoint and os.path.isdir(args.seed_checkpoint):
        load_weights(model, args.seed_checkpoint)
        ctx.log(f"initial weights from {args.seed_checkpoint}")
    elif args.seed_checkpoint:
        save_weights(ctx, model, args.seed_checkpoint)
        ctx.log(f"wrote the initial weights to {args.seed_checkpoint}")
    metrics_path = os.path.join(args.out_dir, "metrics.json")
    losses: Dict[str, float] = {}
    if start and os.path.exists(metrics_path):
        with open(metrics_path) as f:
            losses = {k: v for k, v in json.load(f)["losses"].items() if int(k) < start}
    per_rank = args.batch_size
    for step in range(start, args.steps):
        tokens = batch(step, cfg, per_rank * ctx.world_size)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        tokens = tokens.to(ctx.device)
        model.unshard()  # the root's gather starts before the batch's forward
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        opt.zero_grad()
        scheduler.step()  # no step marker: on XLA the optimizer step of fully_shard's shards cuts the graph
        losses[str(step)] = ctx.mean(loss.item())
        ctx.log(f"step {step} loss {losses[str(step)]:.5f} lr {scheduler.get_last_lr()[0]:.2e}")
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            if ctx.is_master:  # first: a resume from this checkpoint finds every earlier loss
                write_metrics(metrics_path, losses, cfg, args, ctx)
            save(ctx, model, opt, scheduler, step + 1, os.path.join(ckpt_dir, f"step_{step + 1}"))
            if ctx.is_master:
                for _, old in checkpoint_folders(ckpt_dir)[:-2]:  # keep the newest two
                    shutil.rmtree(old, ignore_errors=True)


def write_metrics(path: str, losses: Dict[str, float], cfg: LlamaConfig, args, ctx) -> None:
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump({"losses": losses, "config": asdict(cfg), "world_size": ctx.world_size,
                   "transport": ctx.transport, "precision": args.precision}, f, indent=1)
    os.replace(partial, path)


def build_parser() -> ExampleParser:
    parser = ExampleParser(__doc__)
    add_launch_flags(parser)
    parser.add_argument("--out_dir", default="/tmp/xla_fsdp_llama", help="checkpoints and metrics.json")
    parser.add_argument("--steps", type=at_least(1), default=8)
    parser.add_argument("--batch_size", type=at_least(1), default=2, help="sequences per rank per step")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--max_norm", type=positive_float, default=1.0, help="gradient clipping")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
    parser.add_argument("--prefetch", type=at_least(0), default=2, help="blocks each block prefetches")
    parser.add_argument("--ckpt_every", type=at_least(1), default=4)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT_DIR/ckpt")
    parser.add_argument("--seed_checkpoint", default=None,
                        help="start from the weights in this folder (the first run naming it writes them)")
    parser.add_argument("--init_from", default=None,
                        help="start from pretrained weights: a safetensors folder (save_pretrained's, with this "
                             "model's names) or file, a consolidated .pth, a DCP folder (xla_fsdp.load_pretrained)")
    for name, default in (("dim", 64), ("n_layers", 4), ("n_heads", 4), ("n_kv_heads", 2), ("hidden_dim", 128),
                          ("vocab_size", 256), ("seq_len", 32)):
        parser.add_argument(f"--{name}", type=at_least(1), default=default)
    return parser


def parse_args(argv: Optional[List[str]] = None):
    return build_parser().parse_args(argv)


def refuse_bad_args(parser: ExampleParser, args) -> None:
    """What the flags' types cannot check, in one line before any rank starts."""
    found = checkpoint_folders(os.path.join(args.out_dir, "ckpt"))
    if found and not args.resume:
        parser.error(f"{args.out_dir}/ckpt holds checkpoints (the newest: step {found[-1][0]}); pass --resume to "
                     "continue from it, or another --out_dir")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or (args.dim // args.n_heads) % 2:
        parser.error("--dim must split into --n_heads heads of even size, shared by --n_kv_heads groups")


if __name__ == "__main__":
    cli = build_parser()
    arguments = cli.parse_args()
    refuse_bad_args(cli, arguments)
    launch(train, arguments)
