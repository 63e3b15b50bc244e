"""Rewrite a world-size-N checkpoint for M ranks, model and optimizer state, without the model."""
from __future__ import annotations

import copy
import os
import uuid
from typing import Any, Dict, List

import torch

from .reader import MISSING_OPTIMIZER_KEYS, ShardedCheckpoint
from .files import (DEFAULT_SUFFIX, CheckpointError, FileSet, prepare_output, rank_path, refuse_overwriting_inputs,
                    tensor_checksum)
from ..sharding import split_entry, stitch_entry
from .metadata import is_per_element
from .migrate import pad_multiple_of


def resize_checkpoint(ckpt_prefix: str, world_size: int, out_prefix: str,
                       ckpt_suffix: str = DEFAULT_SUFFIX, overwrite: bool = False) -> List[str]:
    """Write ``out_prefix``'s rank files for ``world_size`` ranks; returns their paths.

    Each output rank is assembled alone (its model shards, optimizer state and metadata), so memory
    holds one output file at a time. Adam moments and any state shaped like a shard are resized
    like the parameters; scalars such as ``step`` are copied.
    """
    if world_size < 1:
        raise CheckpointError(f"world size must be >= 1, got {world_size}")
    if os.path.realpath(out_prefix) == os.path.realpath(ckpt_prefix):
        raise CheckpointError(f"out_prefix '{out_prefix}' is the input's prefix '{ckpt_prefix}': choose another "
                              "(inputs are never overwritten, and one prefix holds one checkpoint)")
    src = ShardedCheckpoint(ckpt_prefix, ckpt_suffix)
    outputs = [rank_path(out_prefix, r, world_size) for r in range(world_size)]
    refuse_overwriting_inputs(outputs, [f.path for f in src.files])
    for path in outputs:  # folders created; an earlier output replaced, anything else only with overwrite
        prepare_output(path, "torch", overwrite)
    multiple = pad_multiple_of(src.metadata)
    run_id = uuid.uuid4().hex[:16]
    has_opt = all(c.get("optimizer") is not None for c in src.rank_dicts())
    opt_keys = src.optimizer_param_keys
    if has_opt and opt_keys is None:
        raise CheckpointError(MISSING_OPTIMIZER_KEYS)
    paths = []
    with FileSet() as outputs:  # all files or none: a failed write leaves no partial set
        for rank in range(world_size):
            model: Dict[str, torch.Tensor] = {}
            layout: Dict[str, Any] = {}
            for key, entry in src.layout.items():
                new_entry, shards = split_entry(entry, stitch_entry(entry, src.shards(key)), world_size, multiple)
                model[key] = shards[rank]
                layout[key] = new_entry
            for key in src.buffer_keys:
                model[key] = src.shards(key)[0].clone()
            optimizer = None
            if has_opt:
                osds = [c["optimizer"] for c in src.rank_dicts()]
                state = {}
                for idx, key in enumerate(opt_keys):
                    entry = src.layout[key]
                    per_rank = src.optimizer_states(idx)
                    st = {}
                    for field, value in per_rank[0].items():
                        if is_per_element(field, value, entry["shard_shape"]):
                            full = stitch_entry(entry, [p[field] for p in per_rank])
                            st[field] = split_entry(entry, full, world_size, multiple)[1][rank]
                        else:
                            st[field] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                    if st:
                        state[idx] = st
                optimizer = {"state": state, "param_groups": copy.deepcopy(osds[0]["param_groups"])}
            metadata = copy.deepcopy(src.metadata)
            metadata.update(world_size=world_size, rank=rank, layout=layout, run_id=run_id, version=1,
                            shard_size_multiple=multiple, resharded_from=src.world_size,
                            optimizer_param_keys=opt_keys)
            metadata["checksums"] = {
                "model": {k: tensor_checksum(v) for k, v in model.items()},
                "optimizer": {f"{i}.{f}": tensor_checksum(v) for i, st in (optimizer or {}).get("state", {}).items()
                              for f, v in st.items() if isinstance(v, torch.Tensor)}}
            path = rank_path(out_prefix, rank, world_size)
            outputs.torch_save({"model": model, "shard_metadata": metadata, "optimizer": optimizer}, path)
            paths.append(path)
            src.release()
    return paths


