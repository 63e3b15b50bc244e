"""Rebuild a full (unsharded) state dict from every rank's sharded ``state_dict()`` and metadata.

Works from the metadata alone (no model, no process group): shards are stitched with the same
layout math that split them, padding is dropped, tied aliases are restored under every name, and
buffers get back their original dtypes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Mapping, Sequence

import torch

from ..shard_names import clean_name
from ..sharding import Dim0Layout, FlatLayout, consolidate_dim0


def consolidate_sharded_state_dicts(state_dict_list: Sequence[Mapping[str, torch.Tensor]],
                                    shard_metadata: Mapping[str, Any]) -> "OrderedDict[str, torch.Tensor]":
    """Full state dict keyed by the original module's names, from per-rank dicts in rank order
    (torch_xla's signature)."""
    world_size = shard_metadata["world_size"]
    if len(state_dict_list) != world_size:
        raise ValueError(f"expected {world_size} rank state dicts (metadata world_size), got {len(state_dict_list)}")
    layout: Dict[str, Any] = shard_metadata["layout"]
    full: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for key, info in layout.items():
        shards = [sd[key].detach().cpu() for sd in state_dict_list]
        shapes = [tuple(s) for s in info["shapes"]]
        if info["mode"] == "dim0":
            tensors = [consolidate_dim0(shards, Dim0Layout(shapes[0], world_size))]
        else:
            flat_layout = FlatLayout(tuple(shapes), world_size, 1)
            stitched = torch.cat([s.reshape(-1) for s in shards])
            if stitched.numel() != info["padded_numel"]:
                raise ValueError(f"shards of '{key}' hold {stitched.numel()} elements, metadata says "
                                 f"{info['padded_numel']}")
            tensors = [stitched[off:off + n].view(shape).clone() for off, n, shape in
                       zip(flat_layout.offsets, flat_layout.numels, flat_layout.shapes)]
        for name, tensor in zip(info["names"], tensors):
            full[name] = tensor
            for alias in info.get("aliases", {}).get(name, []):
                full[alias] = tensor
    buffer_info = shard_metadata.get("buffer_info", {})
    for key, value in state_dict_list[0].items():
        if key in layout or "_fsdp_shard" in key:
            continue
        tensor = value.detach().cpu()
        original = buffer_info.get(key, {}).get("_orig_dtype")
        if original is not None:
            tensor = tensor.to(original)
        full[clean_name(key)] = tensor
    return full
