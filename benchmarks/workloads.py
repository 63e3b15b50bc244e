"""The benchmark workloads: same seed, same data and same global batch for every contender.

Sample ``i`` of step ``s`` comes from its own generator, and rank ``r`` of ``ws`` ranks trains on
samples ``r*b .. r*b+b-1`` (``b`` per rank, fixed: weak scaling), so contenders at one world size see
identical global batches.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str                 # "lm" | "resnet"
    batch: int                # per rank
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    vocab: int = 8192
    seq: int = 256
    image: int = 64
    classes: int = 100
    scan: bool = False        # lm: the blocks run as one loop (torch_xla's scan_layers)

    def describe(self) -> Dict:
        return asdict(self)


FULL = {
    "transformer": Workload("transformer", "lm", batch=2),
    "resnet18": Workload("resnet18", "resnet", batch=8),
}
QUICK = {  # the same shapes of computation, small enough for a < 5 minute run
    "transformer": Workload("transformer", "lm", batch=2, d_model=128, layers=2, heads=4, vocab=1024, seq=64),
    "resnet18": Workload("resnet18", "resnet", batch=4, image=32),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class DecoderLM(nn.Module):
    def __init__(self, w: Workload):
        super().__init__()
        self.emb = nn.Embedding(w.vocab, w.d_model)
        self.pos = nn.Embedding(w.seq, w.d_model)
        self.blocks = nn.ModuleList([Block(w.d_model, w.heads) for _ in range(w.layers)])
        self.ln = nn.LayerNorm(w.d_model)
        self.head = nn.Linear(w.d_model, w.vocab, bias=False)
        self.scan = w.scan

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        if self.scan:  # one block traced, run as an XLA While loop over the stacked blocks' parameters
            from torch_xla.experimental.scan_layers import scan_layers
            x = scan_layers(self.blocks, x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln(x))


def build_model(w: Workload, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if w.kind == "lm":
        return DecoderLM(w)
    import torchvision
    return torchvision.models.resnet18(num_classes=w.classes)


def unit_classes(w: Workload) -> Tuple[type, ...]:
    """The per-block wrapping every FSDP contender uses."""
    if w.kind == "lm":
        return (Block,)
    from torchvision.models.resnet import BasicBlock
    return (BasicBlock,)


def make_optimizer(w: Workload, params) -> torch.optim.Optimizer:
    if w.kind == "lm":
        return torch.optim.AdamW(params, lr=1e-4)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def batch(w: Workload, step: int, rank: int, per_rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for i in range(rank * per_rank, (rank + 1) * per_rank):
        g = torch.Generator().manual_seed(100_003 * step + i)
        if w.kind == "lm":
            ids = torch.randint(0, w.vocab, (w.seq + 1,), generator=g)
            xs.append(ids[:-1])
            ys.append(ids[1:])
        else:
            xs.append(torch.randn(3, w.image, w.image, generator=g))
            ys.append(torch.randint(0, w.classes, (), generator=g))
    return torch.stack(xs), torch.stack(ys)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
