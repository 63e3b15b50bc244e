"""Read checkpoints written by torch_xla's own XlaFullyShardedDataParallel.

Its metadata has five keys (``shard_info``, ``flatten_info``, ``buffer_info``, ``world_size``,
``rank``) and no layout section; this module derives xla_fsdp's layout entries from them and from
the shard shapes in rank 0's state dict, so consolidation and resizing treat both alike.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping

import torch

from ..shard_names import clean_name


def torch_xla_layout(metadata: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """Layout entries (see sharding.py) for a torch_xla checkpoint."""
    world_size = metadata["world_size"]
    layout: Dict[str, Any] = {}
    for unit_path, shards in metadata["shard_info"].items():
        prefix = unit_path + "." if unit_path else ""
        for shard_name, info in shards.items():
            key = prefix + shard_name
            if key not in state_dict:
                raise KeyError(f"shard '{key}' named in the metadata is not in the state dict")
            shard = state_dict[key]
            orig_name = info["_orig_name"]
            if "flat_param_" in orig_name.split(".")[-1]:
                names, shapes, _ = metadata["flatten_info"][prefix + orig_name]
                base = prefix + orig_name.rsplit(".", 1)[0] + "."
                entry_names = [clean_name(base + n) for n in names]
                entry_shapes = [list(s) for s in shapes]
                mode = "flat"
            else:
                entry_names = [clean_name(prefix + orig_name)]
                entry_shapes = [list(info["_orig_size"])]
                mode = "dim0" if shard.dim() > 1 else "param"
            layout[key] = {"mode": mode, "names": entry_names, "shapes": entry_shapes, "aliases": {},
                           "padded_numel": shard.numel() * world_size, "shard_shape": list(shard.shape),
                           "requires_grad": True}
    return layout


def is_torch_xla_metadata(metadata: Mapping[str, Any]) -> bool:
    return "layout" not in metadata and "shard_info" in metadata


def pad_multiple_of(metadata: Mapping[str, Any]) -> int:
    """Padding multiple to use when resizing (torch_xla pads flat shards to 128 per rank)."""
    if "shard_size_multiple" in metadata:
        return int(metadata["shard_size_multiple"])
    return 128 if not metadata.get("shard_param_on_dim_0") else 1
