"""Small models and data for the equivalence tests (deterministic from a seed)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=12, hidden=24, d_out=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class TinyParams(nn.Module):
    """Parameters with fewer elements than the world size (a scalar and a 1-element bias)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 1)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.out = nn.Linear(1, 5)

    def forward(self, x):
        return self.out(self.fc(x) * self.scale)


class FrozenMLP(MLP):
    def __init__(self):
        super().__init__()
        self.fc1.weight.requires_grad_(False)


class TiedMLP(nn.Module):
    """Input projection and output head share one weight (inside one unit)."""

    def __init__(self, d=12):
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, d, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.inp(x))))[:, :5]


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class Block(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        # No bias: the key bias gets an exactly-zero gradient (softmax shift invariance), which
        # AdamW would turn into rounding noise of size lr.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, -1e9).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Decoder-only transformer with an Embedding (integer inputs)."""

    def __init__(self, vocab=32, d=16, layers=2, seq=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class ReorderLM(TinyLM):
    """Three blocks, run in reverse order on odd steps (``set_step``): the order of units changes
    from step to step, so prefetching by the previous forward's order guesses wrong."""

    def __init__(self):
        super().__init__(layers=3)
        self.reverse = False

    def set_step(self, step: int) -> None:
        self.reverse = step % 2 == 1

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for blk in (reversed(self.blocks) if self.reverse else self.blocks):
            x = blk(x)
        return self.head(self.ln(x))


class TiedLM(TinyLM):
    """GPT-2's tie: the output head's weight is the embedding's. Auto-wrapping the embedding and the
    head as units of their own splits the tie across units."""

    def __init__(self):
        super().__init__()
        self.head.weight = self.emb.weight


def seq() -> nn.Sequential:
    """Three Linear layers of one shape: optimizer state given to the wrong one loads without error."""
    return nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12))


MODELS = {
    "mlp": MLP,
    "seq": seq,
    "tiny": TinyParams,
    "frozen": FrozenMLP,
    "tied": TiedMLP,
    "convbn": ConvBN,
    "lm": TinyLM,
    "lm_reorder": ReorderLM,
    "lm_tied": TiedLM,
}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def batch(name: str, step: int, rank: int, per_rank: int = 4):
    """Rank ``rank``'s slice of global batch ``step``; sample i has its own generator."""
    xs, ys = [], []
    for i in range(rank * per_rank, (rank + 1) * per_rank):
        g = torch.Generator().manual_seed(10_000 * step + i)
        if name.startswith("lm"):
            ids = torch.randint(0, 32, (9,), generator=g)
            xs.append(ids[:-1])
            ys.append(ids[1:])
        elif name == "convbn":
            xs.append(torch.randn(3, 6, 6, generator=g))
            ys.append(torch.randint(0, 5, (), generator=g))
        else:
            xs.append(torch.randn(12, generator=g))
            ys.append(torch.randint(0, 5, (), generator=g))
    return torch.stack(xs), torch.stack(ys)


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name.startswith("lm"):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return F.cross_entropy(out.float(), y)
