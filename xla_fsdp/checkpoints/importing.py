"""Rank files for any world size from full tensors elsewhere: a DCP checkpoint, or pretrained weights
(a Hugging Face folder, a .safetensors file, a consolidated .pth). One algorithm over a source, one
full tensor in memory at a time: each parameter becomes one shard (padded flat, one per parameter, so
``load_sharded_checkpoint`` reads the files into any wrapping by name), other entries are whole on
every rank, and the optimizer state the source holds is split as its parameter is."""
from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..shard_names import SHARD_PREFIX, SHARD_SEPARATOR
from ..sharding import param_entry, split_entry
from .files import CheckpointError, new_folders_removed_on_error, prepare_output, rank_path, refuse_overwriting_inputs
from .metadata import imported_metadata, is_per_element, learn_per_element
from .rank_writer import RankFiles


class ImportedOptimizer(NamedTuple):
    """A source's optimizer state keyed by parameter name."""
    groups: List[Dict[str, Any]]  # the param groups, ``params`` as parameter names
    field_shapes: Dict[str, Dict[str, Optional[List[int]]]]  # name -> field -> its shape (None: no tensor)
    read: Callable[[str, str], Any]  # (name, field) -> the value


class ImportPlan(NamedTuple):
    """What a source gives an import."""
    entries: Sequence[str]  # the model's entries in the order written
    params: Sequence[str]  # those that become shards, in the model's parameter order
    read: Callable[[str], Any]  # name -> the full value
    optimizer: Optional[ImportedOptimizer]
    origin: str  # the metadata's ``imported_from``
    what: str  # the source, for ``unverified_source``: its checksums are of the values as read


def import_rank_files(plan: ImportPlan, world_size: int, out_prefix: str, inputs: Sequence[str],
                      overwrite: bool = False) -> List[str]:
    """Write ``out_prefix``'s rank files for ``world_size`` ranks from ``plan``; returns their paths."""
    if world_size < 1:
        raise CheckpointError(f"world size must be >= 1, got {world_size}")
    out_paths = [rank_path(out_prefix, r, world_size) for r in range(world_size)]
    refuse_overwriting_inputs(out_paths, inputs)
    with new_folders_removed_on_error(out_paths):
        for path in out_paths:  # folders created; an earlier output replaced, anything else only with overwrite
            prepare_output(path, "torch", overwrite)
        keys = {n: SHARD_PREFIX + n.replace(".", SHARD_SEPARATOR) for n in plan.params}
        layout: Dict[str, Any] = {}
        with RankFiles(out_paths) as out:
            for name in plan.entries:  # one full tensor in memory at a time
                full = plan.read(name)
                if name in keys:
                    entry, shards = split_full(full, world_size)
                    layout[keys[name]] = dict(entry, names=[name])
                    out.add_model(keys[name], shards)
                else:
                    out.add_model(name, [full] * world_size)
                del full
            optimizer_keys = None
            if plan.optimizer is not None:
                optimizer_keys = [keys[p] for g in plan.optimizer.groups for p in g["params"]]
                _import_optimizer(plan.optimizer, {n: layout[keys[n]]["shapes"][0] for n in plan.params}, out)
            run_id = uuid.uuid4().hex[:16]
            out.finish(lambda r: imported_metadata(
                world_size=world_size, rank=r, layout=layout, run_id=run_id, param_keys=list(keys.values()),
                model_param_order=list(plan.params), optimizer_param_keys=optimizer_keys, imported_from=plan.origin,
                unverified_source=plan.what))
    return out_paths


def split_full(full: torch.Tensor, world_size: int) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    """One parameter's layout entry and its shards, padded flat."""
    return split_entry(param_entry(full.shape), [full], world_size, 1)


def _import_optimizer(opt: ImportedOptimizer, shape_of: Dict[str, List[int]], out: RankFiles) -> None:
    """Optimizer state into the rank files: per-element fields split as their parameter is, others
    (``step``) copied; indices in the param groups' order, as ``torch.optim`` numbers them."""
    world_size = len(out.paths)
    order = [p for g in opt.groups for p in g["params"]]
    learnt = learn_per_element({n: opt.field_shapes.get(n, {}) for n in order}, shape_of)  # nothing read for it
    for i, name in enumerate(order):
        for field in opt.field_shapes.get(name, {}):
            value = opt.read(name, field)
            if is_per_element(field, value, shape_of[name], learnt):
                out.add_optimizer(i, field, split_full(value, world_size)[1])
            else:
                out.add_optimizer(i, field, [value] * world_size)
    param_groups, start = [], 0
    for g in opt.groups:
        param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                             "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    out.set_param_groups(param_groups)


def inputs_of(path: str) -> List[str]:
    """The files an import reads (never written over)."""
    return [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
