"""Train a GPT-style language model with FSDP, in the style of PyTorch's multi-node FSDP tutorial:
byte-level text from local files, transformer auto-wrap, mixed precision, periodic sharded
checkpoints and ``--resume auto`` (preemption-safe: the newest complete checkpoint, at any world size).

    python3 examples/train_lm_fsdp.py                                  # 2 XLA:CPU devices, tiny model
    torchrun --nproc_per_node 2 examples/train_lm_fsdp.py              # 2 gloo ranks
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint HOST:29400 \\
        --rdzv_id lm examples/train_lm_fsdp.py --resume auto          # on each of 2 nodes
    python3 examples/train_lm_fsdp.py --model_size 150m --data_files my/*.txt --precision bf16   # TPU host

Without --data_files it trains on a small corpus it writes to OUT_DIR/data. Checkpoints go to
OUT_DIR/ckpt (a folder every node must see); --eval_consolidated scores a consolidated checkpoint
in one process on the same held-out text.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from example_utils import (ExampleParser, add_launch_flags, at_least, existing_file, launch, peak_rss_mib,
                           positive_float, seeded, state_bytes)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int


MODEL_SIZES = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "150m": GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_layers=16, n_heads=12),  # 152.8 M params
}


class Block(nn.Module):
    """Pre-norm attention + MLP: the unit of transformer auto-wrap."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln_attn, self.ln_mlp = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        d = cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, t, 3, self.n_heads, d // self.n_heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


# ---- data: byte-level tokens from text files, read with Hugging Face datasets ----

def write_default_corpus(folder: str, lines: int = 4000) -> str:
    """A small English-like corpus from a fixed grammar (no download): learnable, and the same on
    every rank and node. Each rank writes it atomically, so ranks starting together agree."""
    rng = np.random.default_rng(1234)
    subjects = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the engineer"]
    verbs = ["sees", "likes", "builds", "reads", "follows", "draws", "finds"]
    objects = ["the red house", "a long letter", "the river", "two apples", "the machine", "a quiet song"]
    tails = ["today", "at night", "in the garden", "with care", "again", "before noon"]
    text = "\n".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}."
                     for _ in range(lines)) + "\n"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "corpus.txt")
    tmp = f"{path}.{os.getpid()}.{id(text)}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def load_tokens(files, cache_dir: str) -> np.ndarray:
    import datasets
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("text", data_files=list(files), split="train", cache_dir=cache_dir)
    return np.frombuffer("\n".join(ds["text"]).encode("utf-8"), dtype=np.uint8)


class TokenWindows:
    """Fixed windows of ``seq_len + 1`` tokens, visited in a seeded order per epoch. Sample ``g`` of
    the run is the same whatever the world size, so a run resumed at another world size sees the
    data the uninterrupted run would have seen."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.count = (len(tokens) - 1) // seq_len
        if self.count < 1:
            raise SystemExit(f"error: the text holds {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
        self._orders = {}

    def sample(self, g: int) -> np.ndarray:
        epoch, i = divmod(g, self.count)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng(self.seed + epoch).permutation(self.count)}
        start = int(self._orders[epoch][i]) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def batch(self, first: int, size: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(first + j) for j in range(size)]).astype(np.int64))


_DATA_LOCK = threading.Lock()
_DATA = {}


def split_data(args, cfg: GPTConfig):
    """Training and held-out windows. XLA:CPU ranks are threads of one process: they read the text
    once, one at a time (datasets' progress-bar bookkeeping is not thread-safe)."""
    key = (tuple(args.data_files or ()), args.out_dir, cfg.seq_len, args.seed)
    with _DATA_LOCK:
        if key not in _DATA:
            _DATA[key] = _read_and_split(args, cfg)
        return _DATA[key]


def _read_and_split(args, cfg: GPTConfig):
    files = sorted(f for pattern in args.data_files for f in glob.glob(pattern)) if args.data_files else [
        write_default_corpus(os.path.join(args.out_dir, "data"))]
    if not files:
        raise SystemExit(f"error: --data_files {' '.join(args.data_files)} matches no file")
    tokens = load_tokens(files, os.path.join(args.out_dir, "data", "cache"))
    cut = int(len(tokens) * 0.9)
    return TokenWindows(tokens[:cut], cfg.seq_len, args.seed), TokenWindows(tokens[cut:], cfg.seq_len, args.seed)


def eval_loss(model, windows: TokenWindows, count: int, device) -> float:
    """Mean loss over the first ``count`` held-out windows (every rank scores the same ones)."""
    model.eval()
    total = 0.0
    n = min(count, windows.count)
    with torch.no_grad():
        for first in range(0, n, 4):
            ids = torch.stack([torch.from_numpy(windows.tokens[j * windows.seq_len:(j + 1) * windows.seq_len + 1]
                                                .astype(np.int64)) for j in range(first, min(first + 4, n))])
            total += lm_loss(model, ids.to(device)).item() * ids.shape[0]
    model.train()
    return total / n


# ---- training ----

def parse_args(argv=None):
    p = ExampleParser(__doc__)
    p.add_argument("--model_size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--data_files", nargs="+", default=None, help="text files or globs (default: a generated corpus)")
    p.add_argument("--out_dir", default="runs/lm", help="data cache and checkpoints (shared by every node)")
    p.add_argument("--num_steps", type=at_least(1), default=60)
    p.add_argument("--global_batch_size", type=at_least(1), default=8, help="over all ranks; each rank takes its share")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--warmup_steps", type=at_least(0), default=10)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="bf16 compute (fp32 master weights and reductions): default on TPU, fp32 elsewhere")
    p.add_argument("--cpu_offload", action="store_true",
                   help="keep master weights, gradients and AdamW state in host memory; the step runs there")
    p.add_argument("--sharding_strategy", default="FULL_SHARD",
                   choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"],
                   help="HYBRID_*: shard within a node, replicate across nodes")
    p.add_argument("--ckpt_every", type=at_least(0), default=20,
                   help="save a sharded checkpoint every N steps (0: never)")
    p.add_argument("--keep", type=at_least(0), default=2, help="complete checkpoints to keep")
    p.add_argument("--resume", choices=["auto", "never"], default="never",
                   help="auto: continue from the newest complete checkpoint in OUT_DIR/ckpt, if any")
    p.add_argument("--stop_after_step", type=at_least(1), default=None,
                   help="leave after this step (as a preempted job would; resume with --resume auto)")
    p.add_argument("--log_every", type=at_least(1), default=10)
    p.add_argument("--eval_windows", type=at_least(1), default=16)
    p.add_argument("--eval_consolidated", type=existing_file, default=None, metavar="PATH",
                   help="only score a consolidated checkpoint (python -m xla_fsdp.consolidate_sharded_ckpts) "
                        "on the held-out text, in this process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init_from", default=None, metavar="PATH",
                   help="start from pretrained weights (unless resuming): a consolidated checkpoint, a safetensors "
                        "folder or file with this model's names, a DCP folder (xla_fsdp.load_pretrained)")
    add_launch_flags(p)
    return p.parse_args(argv)


def train(ctx, args):
    import xla_fsdp
    from xla_fsdp import ShardingStrategy
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.wrap import transformer_auto_wrap_policy
    from tqdm import tqdm

    cfg = MODEL_SIZES[args.model_size]
    if args.global_batch_size % ctx.world_size:
        raise SystemExit(f"error: --global_batch_size {args.global_batch_size} does not split over "
                         f"{ctx.world_size} ranks; give a multiple of {ctx.world_size}")
    local_batch = args.global_batch_size // ctx.world_size
    bf16 = args.precision == "bf16" or (args.precision == "auto" and ctx.device.type == "xla"
                                        and os.environ.get("PJRT_DEVICE", "").upper() == "TPU")
    train_data, eval_data = split_data(args, cfg)
    with seeded(args.seed):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 sharding_strategy=ShardingStrategy[args.sharding_strategy],
                 compute_dtype=torch.bfloat16 if bf16 else None, cpu_offload=args.cpu_offload,
                 transport=ctx.transport)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        warmup_cosine, warmup=args.warmup_steps, total=args.num_steps))
    ckpt_dir = os.path.join(args.out_dir, "ckpt")
    start, samples_seen = 0, 0
    resumed = xla_fsdp.resume_training(model, optimizer, ckpt_dir, lr_scheduler=schedule) \
        if args.resume == "auto" else None
    if resumed is not None:
        start, samples_seen = resumed.step, resumed.data_state["samples_seen"]
        ctx.log(f"resumed from {resumed.prefix} (step {resumed.step}, saved at world size "
                f"{resumed.saved_world_size}, now {ctx.world_size})")
    elif args.init_from:  # pretrained weights: each rank reads only the rows of its own shards
        xla_fsdp.load_pretrained(model, args.init_from)
        ctx.log(f"initial weights from {args.init_from}")
    end = args.num_steps if args.stop_after_step is None else min(args.num_steps, args.stop_after_step)
    # a bar on the first rank only (the others' threads share tqdm's class-level bookkeeping)
    bar = tqdm(range(start, end), initial=start, total=args.num_steps, desc="train", file=sys.stderr,
               mininterval=1.0) if ctx.is_master else None
    timed_steps, t0, loss = 0, None, None
    for step in bar if bar is not None else range(start, end):
        first = samples_seen + ctx.rank * local_batch  # this rank's share of the global batch
        samples_seen += args.global_batch_size
        ids = train_data.batch(first, local_batch).to(ctx.device)
        loss = lm_loss(model, ids)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        ctx.sync()
        if step == start:
            t0 = time.perf_counter()  # from the second step: the first compiles on XLA
        else:
            timed_steps += 1
        if (step + 1) % args.log_every == 0 or step + 1 == end:
            mean = ctx.mean(loss.item())
            if bar is not None:
                bar.set_postfix(loss=f"{mean:.4f}")
                bar.write(f"step {step + 1}: loss {mean:.6f}", file=sys.stdout)  # above the bar, not through it
            else:
                ctx.log(f"step {step + 1}: loss {mean:.6f}")
        if args.ckpt_every and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.num_steps):
            xla_fsdp.save_training_checkpoint(model, optimizer, ckpt_dir, step + 1, lr_scheduler=schedule,
                                              data_state={"samples_seen": samples_seen},
                                              keep=args.keep)
    if bar is not None:
        bar.close()
    # only what was measured: no step, no loss or speed; stopped early, no eval (not "nan")
    measured = []
    if timed_steps:
        tokens_per_s = timed_steps * args.global_batch_size * cfg.seq_len / (time.perf_counter() - t0)
        measured.append(f"tokens/s={tokens_per_s:.0f}")
    if loss is not None:
        measured.append(f"final_loss={ctx.mean(loss.item()):.6f}")
    if start >= end:
        ctx.log(f"nothing to train: the run is at step {start}, and it ends at step {end} "
                + ("(--num_steps): it is finished; raise --num_steps to train on" if end == args.num_steps
                   else "(--stop_after_step)"))
    if end == args.num_steps:
        measured.append(f"eval_loss={eval_loss(model, eval_data, args.eval_windows, ctx.device):.6f}")
    else:
        ctx.log(f"stopped after step {end} of {args.num_steps} (--stop_after_step): no evaluation; run again with "
                "--resume auto to continue")
    state_mib = sum(state_bytes(model, optimizer).values()) / 2 ** 20
    ctx.log(f"SUMMARY example=lm model_size={args.model_size} params={n_params} world_size={ctx.world_size} "
            f"strategy={args.sharding_strategy} precision={'bf16' if bf16 else 'fp32'} cpu_offload={args.cpu_offload} "
            f"start_step={start} end_step={end} {' '.join(measured)} "
            f"rank_state_mib={state_mib:.2f} peak_rss_mib={peak_rss_mib():.0f}")


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def eval_consolidated(args) -> None:
    """Score a consolidated checkpoint in one process, without FSDP: the same held-out windows."""
    cfg = MODEL_SIZES[args.model_size]
    _, eval_data = split_data(args, cfg)
    model = GPT(cfg)
    loaded = torch.load(args.eval_consolidated, weights_only=True, map_location="cpu")
    if isinstance(loaded, dict) and "shard_metadata" in loaded:  # one rank's file of a sharded checkpoint
        prefix = re.sub(r"_rank-\d{8}-of-\d{8}\.pth$", "", args.eval_consolidated)
        raise SystemExit(f"error: '{args.eval_consolidated}' is one rank's file of a sharded checkpoint, not a "
                         "consolidated one; consolidate it first: python -m xla_fsdp.consolidate_sharded_ckpts "
                         f"--ckpt_prefix {prefix} --save_path model.pth, then --eval_consolidated model.pth")
    state = loaded["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) - {"head.weight"} or unexpected:  # the tied head may be stored once, as tok.weight
        raise SystemExit(f"error: '{args.eval_consolidated}' does not fit --model_size {args.model_size} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    print(f"SUMMARY example=lm_eval params={sum(p.numel() for p in model.parameters())} "
          f"eval_loss={eval_loss(model, eval_data, args.eval_windows, torch.device('cpu')):.6f}", flush=True)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.eval_consolidated:
        eval_consolidated(arguments)
    else:
        launch(train, arguments)
