"""Stitch and re-split one sharded entry of a checkpoint, using only its metadata.

An entry (``shard_metadata['layout'][key]``) says how one shard parameter was built: ``mode``
('flat' = several tensors in one padded buffer, 'param' = one tensor flattened and padded,
'dim0' = one tensor split by rows), the original ``names`` and ``shapes``, and ``padded_numel``.
The same functions serve model parameters and optimizer state of the same shape (Adam moments).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from ..sharding import Dim0Layout, FlatLayout, pad_dim0


def unshard_entry(info: Mapping[str, Any], shards: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The original tensors of one entry from every rank's shard (rank order)."""
    shapes = [tuple(s) for s in info["shapes"]]
    if info["mode"] == "dim0":
        rows = shapes[0][0] if shapes[0] else 1
        full = torch.cat([s.reshape((-1,) + tuple(s.shape[1:])) if s.dim() else s.reshape(1) for s in shards], 0)
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


def reshard_entry(info: Mapping[str, Any], tensors: Sequence[torch.Tensor], world_size: int,
                  pad_multiple: int) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    """Split an entry's original tensors for ``world_size`` ranks: (new entry info, shards)."""
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
