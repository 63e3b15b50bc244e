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
from ..sharding import stitch_entry


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
        try:
            tensors = [t.clone() for t in stitch_entry(info, shards)]
        except ValueError as e:
            raise ValueError(f"shards of '{key}': {e}") from None
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
