"""Sharding math: how parameters are flattened, padded, split across ranks and put back.

Pure functions and a small layout record, with no process group and no device: every rule that
decides which element lives on which rank is here, so it can be tested (and reused by the
checkpoint tools) without running any collective.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

Shape = Tuple[int, ...]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value`` (0 stays 0 only if multiple divides it)."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return int(math.ceil(value / multiple)) * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Where each original tensor sits inside one flat, padded buffer shared by ``world_size`` ranks.

    ``padded_numel`` is a multiple of ``world_size * pad_multiple`` so each rank holds an equal
    ``shard_numel``-element slice; the padding (zeros) lives at the end of the last shards.
    Derived sizes are cached: the training loop asks for them on every gather and gradient.
    """

    shapes: Tuple[Shape, ...]
    world_size: int
    pad_multiple: int

    @functools.cached_property
    def numels(self) -> Tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> Tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @functools.cached_property
    def numel(self) -> int:
        return sum(self.numels)

    @functools.cached_property
    def padded_numel(self) -> int:
        # At least one element per rank so every rank owns a non-empty shard.
        return round_up(max(self.numel, 1), self.world_size * self.pad_multiple)

    @functools.cached_property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @functools.cached_property
    def padding(self) -> int:
        return self.padded_numel - self.numel


@dataclass(frozen=True)
class Dim0Layout:
    """One tensor split along dim 0 into ``world_size`` equal row blocks (rows padded with zeros).

    0-d tensors are treated as shape ``(1,)``.
    """

    shape: Shape
    world_size: int

    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @functools.cached_property
    def row_shape(self) -> Shape:
        return tuple(self.shape[1:])

    @functools.cached_property
    def padded_rows(self) -> int:
        return round_up(max(self.rows, 1), self.world_size)

    @functools.cached_property
    def shard_shape(self) -> Shape:
        return (self.padded_rows // self.world_size,) + self.row_shape

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @functools.cached_property
    def padded_numel(self) -> int:
        return self.padded_rows * math.prod(self.row_shape)

    @functools.cached_property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def flatten_and_pad(tensors: Sequence[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """Concatenate ``tensors`` (flattened) and zero-pad to ``layout.padded_numel``."""
    if tuple(tuple(t.shape) for t in tensors) != layout.shapes:
        raise ValueError("tensors do not match the layout's shapes")
    dtype = tensors[0].dtype if tensors else torch.float32
    device = tensors[0].device if tensors else None
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for t, off, n in zip(tensors, layout.offsets, layout.numels):
        flat[off:off + n].copy_(t.reshape(-1))
    return flat


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal dim-0 slice of ``flat`` (a view; ``flat`` must divide evenly)."""
    if flat.shape[0] % world_size:
        raise ValueError(f"dim 0 of size {flat.shape[0]} does not divide by world size {world_size}")
    size = flat.shape[0] // world_size
    return flat[rank * size:(rank + 1) * size]


def unflatten(flat: torch.Tensor, layout: FlatLayout) -> List[torch.Tensor]:
    """Views of the original tensors inside a full flat buffer (padding ignored)."""
    return [flat[off:off + n].view(shape)
            for off, n, shape in zip(layout.offsets, layout.numels, layout.shapes)]


def pad_dim0(tensor: torch.Tensor, layout: Dim0Layout) -> torch.Tensor:
    """Zero-pad ``tensor`` along dim 0 to ``layout.padded_rows`` rows (0-d becomes 1-d)."""
    t = tensor.reshape(layout.rows, *layout.row_shape)
    if layout.padded_rows == layout.rows:
        return t.clone()
    pad = torch.zeros((layout.padded_rows - layout.rows,) + layout.row_shape, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)


def unpad_dim0(full: torch.Tensor, layout: Dim0Layout) -> torch.Tensor:
    """Drop dim-0 padding rows and restore the original shape (a view)."""
    return full[:layout.rows].view(layout.shape)


def consolidate_flat(shards: Sequence[torch.Tensor], layout: FlatLayout) -> List[torch.Tensor]:
    """Rebuild the original tensors from every rank's flat shard, in rank order."""
    if len(shards) != layout.world_size:
        raise ValueError(f"expected {layout.world_size} shards, got {len(shards)}")
    return [t.clone() for t in unflatten(torch.cat([s.reshape(-1) for s in shards]), layout)]


def consolidate_dim0(shards: Sequence[torch.Tensor], layout: Dim0Layout) -> torch.Tensor:
    """Rebuild one tensor from every rank's dim-0 shard, in rank order."""
    if len(shards) != layout.world_size:
        raise ValueError(f"expected {layout.world_size} shards, got {len(shards)}")
    return unpad_dim0(torch.cat(list(shards), dim=0), layout).clone()


def default_predivide_factor(world_size: int) -> float:
    """A power of two near sqrt(world size): gradients are divided by it before the reduce-scatter
    and by the rest after, so low-precision sums neither overflow nor lose small values."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)
