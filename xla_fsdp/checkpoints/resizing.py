"""Rewrite a world-size-N checkpoint for M ranks, model and optimizer state, without the model."""
from __future__ import annotations

import copy
import math
import os
import uuid
from typing import Any, Dict, List


from .reader import MISSING_OPTIMIZER_KEYS, ShardedCheckpoint
from .files import DEFAULT_SUFFIX, CheckpointError, prepare_output, rank_path, refuse_overwriting_inputs
from ..sharding import split_entry, stitch_entry
from .metadata import is_per_element, resized_metadata
from .rank_writer import RankFiles
from .migrate import pad_multiple_of


def resize_checkpoint(ckpt_prefix: str, world_size: int, out_prefix: str,
                       ckpt_suffix: str = DEFAULT_SUFFIX, overwrite: bool = False) -> List[str]:
    """Write ``out_prefix``'s rank files for ``world_size`` ranks; returns their paths.

    Every output file is written side by side (``rank_writer``), so memory holds one full tensor at a
    time. Adam moments and any state shaped like a shard are resized
    like the parameters; scalars such as ``step`` are copied, and so is rank 0's ``extra``.
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
    layout: Dict[str, Any] = {}
    model0 = src.rank_dicts()[0]["model"]  # each output holds at least its share of the parameters' bytes
    size = sum(math.prod(shape) * model0[k].element_size() for k, e in src.layout.items()
               for shape in e["shapes"]) // world_size
    with RankFiles(outputs, size) as out:  # all files or none: a failed write leaves no partial set
        for key, entry in src.layout.items():  # one full tensor in memory at a time
            layout[key], shards = split_entry(entry, stitch_entry(entry, src.shards(key)), world_size, multiple)
            out.add_model(key, shards)
        for key in src.buffer_keys:
            out.add_model(key, [src.shards(key)[0].clone()] * world_size)
        if has_opt:
            for idx, key in enumerate(opt_keys):
                entry = src.layout[key]
                per_rank = src.optimizer_states(idx)
                for field, value in per_rank[0].items():
                    if is_per_element(field, value, entry["shard_shape"]):
                        full = stitch_entry(entry, [p[field] for p in per_rank])
                        out.add_optimizer(idx, field, split_entry(entry, full, world_size, multiple)[1])
                    else:
                        out.add_optimizer(idx, field, [value] * world_size)
            out.set_param_groups(copy.deepcopy(src.rank_dicts()[0]["optimizer"]["param_groups"]))
        extra = src.rank_dicts()[0].get("extra")
        if extra is not None:  # the program's own entries, as a load resized from these files returns them
            out.set_extra(extra)
        out.finish(lambda rank: resized_metadata(src.metadata, world_size=world_size, rank=rank, layout=layout,
                                                 run_id=run_id, shard_size_multiple=multiple,
                                                 optimizer_param_keys=opt_keys, resharded_from=src.world_size))
    src.release()
    return outputs
