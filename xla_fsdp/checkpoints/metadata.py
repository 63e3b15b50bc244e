"""Shard metadata: everything needed to rebuild full tensors from per-rank state dicts.

Keeps torch_xla's five keys (so its consumers keep working) and adds a versioned, self-describing
``layout`` section: every shard's original names, shapes, padding, mode and tied aliases.
"""
from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Dict

import torch

METADATA_VERSION = 1


@functools.lru_cache(maxsize=1)
def _library_versions() -> Dict[str, str]:
    versions = {"torch": str(torch.__version__)}  # a plain str: TorchVersion fails torch.load(weights_only=True)
    try:  # from the installed metadata: importing torch_xla just for its version costs seconds
        versions["torch_xla"] = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        pass
    from .._version import __version__
    versions["xla_fsdp"] = __version__
    return versions


def shard_metadata(root) -> Dict[str, Any]:
    from ..shard_names import WRAPPED, clean_name as _clean_name
    from ..unit.base import ShardedUnit

    shard_info: Dict[str, Dict[str, Any]] = {}
    flatten_info: Dict[str, Any] = {}
    buffer_info: Dict[str, Any] = {}
    layout: Dict[str, Any] = {}
    for unit_path, unit in root.named_modules():
        if not isinstance(unit, ShardedUnit):
            continue
        key_prefix = unit_path + "." if unit_path else ""
        name_prefix = _clean_name(unit_path)
        name_prefix = name_prefix + "." if name_prefix else ""
        shard_info[unit_path] = {}
        for group, shard_name in zip(unit._groups, unit._shard_names):
            if group.flat:
                orig_name = f"{WRAPPED}.{group.flat_name}"
                orig_size = torch.Size([group.layout.numel])
                flatten_info[key_prefix + orig_name] = (
                    [f"{WRAPPED}.{n}" for n in group.names], [torch.Size(s) for s in group.layout.shapes],
                    list(group.layout.numels))
            else:
                orig_name = f"{WRAPPED}.{group.refs[0].fqn}"
                orig_size = torch.Size(group.full_shape)
            shard_info[unit_path][shard_name] = {"_orig_size": orig_size, "_orig_name": orig_name}
            layout[key_prefix + shard_name] = {
                "mode": "dim0" if group.dim0 else ("flat" if group.flat else "param"),
                "names": [name_prefix + n for n in group.names],
                "shapes": [list(s) for s in (group.layout.shapes if group.flat or not group.dim0
                                             else [group.layout.shape])],
                "aliases": {name_prefix + r.fqn: [name_prefix + a for a in r.aliases]
                            for r in group.refs if r.aliases},
                "padded_numel": group.layout.padded_numel,
                "shard_shape": list(group.shard.shape),
                "requires_grad": group.requires_grad,
            }
        for buffer_key, info in unit.buffer_info.items():
            buffer_info[f"{key_prefix}{WRAPPED}.{buffer_key}"] = dict(info)
    return {
        "shard_info": shard_info,
        "flatten_info": flatten_info,
        "buffer_info": buffer_info,
        "world_size": root.world_size,
        "rank": root.rank,
        "version": METADATA_VERSION,
        "layout": layout,
        "flatten_parameters": bool(root.flatten_parameters),
        "shard_param_on_dim_0": root._shard_param_on_dim_0,
        "shard_size_multiple": root._shard_size_multiple,
        "sharding_groups": root.comms.groups,
        "sharding_strategy": root.sharding_strategy.name,
        "replica_groups": root.comms.replica_groups,
        "replica_rank": root.comms.replica_rank,
        "transport": root.comms.name,
        "library_versions": dict(_library_versions()),
        # shard state-dict keys in parameters() order: maps optimizer state indices to shards
        "param_keys": [name for name, _ in root.named_parameters()],
    }
