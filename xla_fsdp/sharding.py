"""Sharding math: how parameters are flattened, padded, split across ranks and stitched back.

Pure functions and a small layout record, with no process group and no device: every rule that
decides which element lives on which rank is here, so it can be tested without running any
collective, and the units, the checkpoint tools and the DCP converter split and stitch with the same
code. A checkpoint's layout *entry* (``shard_metadata['layout'][key]``) records how one shard parameter
was built: ``mode`` ('flat' = several tensors in one padded buffer, 'param' = one tensor flattened and
padded, 'dim0' = one tensor split by rows), the original ``names`` and ``shapes``, and ``padded_numel``;
:func:`split_entry` and :func:`stitch_entry` work from it alone, for parameters and for optimizer state
of the same shape (Adam moments).
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

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


def stitch_entry(info: Mapping[str, Any], shards: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The original tensors of one layout entry from every rank's shard (rank order)."""
    shapes = [tuple(s) for s in info["shapes"]]
    if info["mode"] == "dim0":
        rows = shapes[0][0] if shapes[0] else 1
        full = torch.cat([s if s.dim() else s.reshape(1) for s in shards], 0)  # a 0-d parameter: one row
        return [full[:rows].reshape(shapes[0]).clone()]
    stitched = torch.cat([s.reshape(-1) for s in shards])
    if stitched.numel() != info["padded_numel"]:
        raise ValueError(f"shards hold {stitched.numel()} elements, metadata says {info['padded_numel']}")
    if len(shapes) == 1:  # one tensor: a view of the freshly stitched buffer, no extra copy
        return [stitched[:math.prod(shapes[0])].view(shapes[0])]
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(stitched[offset:offset + n].view(shape).clone())
        offset += n
    return out


def split_entry(info: Mapping[str, Any], tensors: Sequence[torch.Tensor], world_size: int,
                pad_multiple: int) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    """Split a layout entry's original tensors for ``world_size`` ranks: (the new entry, shards)."""
    new = copy.deepcopy(dict(info))
    shapes = [tuple(s) for s in info["shapes"]]
    if info["mode"] == "dim0":
        layout = Dim0Layout(shapes[0], world_size)
        padded = pad_dim0(tensors[0], layout)
        new["padded_numel"] = layout.padded_numel
        new["shard_shape"] = list(layout.shard_shape)
        return new, [c.clone() for c in padded.chunk(world_size, 0)]
    layout = FlatLayout(tuple(shapes), world_size, pad_multiple)
    flat = torch.zeros(layout.padded_numel, dtype=tensors[0].dtype)
    for t, off, n in zip(tensors, layout.offsets, layout.numels):
        flat[off:off + n] = t.reshape(-1)
    new["padded_numel"] = layout.padded_numel
    new["shard_shape"] = [layout.shard_numel]
    return new, [c.clone() for c in flat.chunk(world_size)]


def param_entry(shape: Sequence[int]) -> Dict[str, Any]:
    """The layout entry of one unflattened parameter of ``shape`` (padded and shapes filled in by
    :func:`split_entry`)."""
    return {"mode": "param", "shapes": [list(shape)], "aliases": {}, "requires_grad": True}


def default_predivide_factor(world_size: int) -> float:
    """A power of two near sqrt(world size): gradients are divided by it before the reduce-scatter
    and by the rest after, so low-precision sums neither overflow nor lose small values."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)
