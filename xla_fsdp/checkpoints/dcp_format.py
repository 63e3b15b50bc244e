"""PyTorch Distributed Checkpoint (DCP) directories to and from xla_fsdp rank files, offline: no
process group, no model, one tensor in memory at a time.

``export_dcp`` writes what ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives and
``dcp.save`` stores: ``{model_key: {name: tensor}, optim_key: {"state": {name: {...}},
"param_groups": [{..., "params": [name, ...]}]}}`` keyed by the original parameter names, so
PyTorch FSDP2, DDP or a plain model restores it with ``dcp.load`` at any world size. The DCP writer
asks its planner for each tensor as it writes it; the planner here builds that tensor then, from
memory-mapped slices of the rank files. ``import_dcp`` reads a DCP checkpoint (FSDP2's; torchtitan's,
model keys at the top level and optimizer state flattened; ours) one tensor at a time and writes
rank files for any world size, one parameter per shard; ``load_sharded_checkpoint`` reads those
into any wrapping by name.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .dcp_reader import dcp_failure, single_process
from .files import (DEFAULT_SUFFIX, CheckpointError, as_disk_full, new_folders_removed_on_error, prepare_output,
                    refuse_overwriting_inputs, stored_bytes)
from .importing import import_rank_files, inputs_of
from .metadata import full_optimizer_state_dict, is_per_element, param_order
from .reader import MISSING_OPTIMIZER_KEYS, ShardedCheckpoint
from .resized_load import NameIndex, read_full
from .sources import DCPSource


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default planner, except that a tensor given as a meta placeholder is built by its
    loader when the writer asks for its data: the state dict never holds the model."""

    def __init__(self, loaders: Dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self._loaders = loaders

    def lookup_object(self, index):
        if index.fqn in self._loaders:
            return self._loaders[index.fqn]()
        return super().lookup_object(index)


def _nest(path: str, value: Any) -> Dict[str, Any]:
    """``"app.model", v`` -> ``{"app": {"model": v}}`` (DCP joins nested keys with dots)."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    for k, v in b.items():
        a[k] = _merge(a[k], v) if isinstance(a.get(k), dict) and isinstance(v, dict) else v
    return a


def _fresh_output_dir(out_dir: str, overwrite: bool) -> str:
    """A temporary folder beside ``out_dir`` (created with its parents), after the overwrite rule:
    an empty folder or an earlier DCP checkpoint there is replaced, anything else only with
    ``overwrite``."""
    if os.path.isfile(out_dir) and not overwrite:
        raise CheckpointError(f"the output '{out_dir}' is a file: give a folder for the DCP checkpoint, or pass "
                              "--overwrite (overwrite=True) to replace the file")
    if not os.path.isfile(out_dir):
        prepare_output(out_dir, "dcp", overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir))
    return tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)


def _put_in_place(tmp: str, out_dir: str) -> None:
    """Move the finished folder to ``out_dir``; what was there goes only once it is in place."""
    old = None
    if os.path.lexists(out_dir):
        old = f"{out_dir}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        else:
            os.unlink(old)


def export_dcp(ckpt_prefix: str, out_dir: str, model_key: str = "model", optim_key: Optional[str] = "optim",
               ckpt_suffix: str = DEFAULT_SUFFIX, overwrite: bool = False) -> str:
    """Write the checkpoint at ``ckpt_prefix`` as a DCP directory ``out_dir`` (model state, and
    optimizer state when the rank files hold it and ``optim_key`` is given); returns ``out_dir``.
    Written to a temporary folder beside it and renamed when complete; an earlier DCP checkpoint
    at ``out_dir`` is replaced then, a folder holding anything else only with ``overwrite``."""
    src = ShardedCheckpoint(ckpt_prefix, ckpt_suffix)
    refuse_overwriting_inputs([out_dir], [f.path for f in src.files])
    ckpts = src.rank_dicts()
    index = NameIndex(src.layout)

    def model_chunk(key, rank):
        return ckpts[rank]["model"][key].reshape(-1)

    loaders: Dict[str, Callable[[], torch.Tensor]] = {}
    model_sd: Dict[str, Any] = {}
    for name, dtype, shape in src.model_specs():
        if name in index.where:
            model_sd[name] = torch.empty(shape, dtype=dtype, device="meta")
            loaders[f"{model_key}.{name}"] = (lambda name=name, dtype=dtype, shape=shape:
                                              read_full(index, src.layout, model_chunk, name, shape, dtype))
    # the unwrapped model's named_parameters() order, which DCP's metadata keeps: an import reads the
    # model's parameter order from it (layout order is the wrapped model's: root units' entries first)
    order, _ = param_order(src.metadata, list(model_sd))
    model_sd = {name: model_sd[name] for name in order}
    buffers = dict(src.iter_buffers())
    model_sd.update(buffers)
    state_dict = _nest(model_key, model_sd)
    if optim_key and all(c.get("optimizer") is not None for c in ckpts):
        optim_sd = _optimizer_placeholders(src, ckpts, index, optim_key, loaders)
        state_dict = _merge(state_dict, _nest(optim_key, optim_sd))
    with new_folders_removed_on_error([out_dir]):
        _write_dcp(src, state_dict, loaders, out_dir, overwrite)
    return out_dir


def _write_dcp(src: ShardedCheckpoint, state_dict: Dict[str, Any], loaders: Dict[str, Callable[[], torch.Tensor]],
               out_dir: str, overwrite: bool) -> None:
    tmp = _fresh_output_dir(out_dir, overwrite)
    try:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        with single_process():
            dcp.save(state_dict, storage_writer=writer, planner=_StreamingSavePlanner(loaders), no_dist=True)
        _put_in_place(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # DCP wraps its writer's OSError, or reports torch's zip writer's "unexpected pos"
        full = as_disk_full(e, out_dir, stored_bytes(state_dict))
        if full is not None:
            raise full from None
        if isinstance(e, (Exception, CheckpointException)):
            raise dcp_failure(e, f"writing the DCP checkpoint '{out_dir}' failed") from None
        raise
    finally:
        src.release()


def _optimizer_placeholders(src: ShardedCheckpoint, ckpts, index: NameIndex, optim_key: str,
                            loaders: Dict[str, Callable[[], torch.Tensor]]) -> Dict[str, Any]:
    """get_optimizer_state_dict's layout: state and param_groups keyed by original names."""
    keys = src.optimizer_param_keys
    if keys is None:
        raise CheckpointError(MISSING_OPTIMIZER_KEYS)
    position = {key: i for i, key in enumerate(keys)}
    state: Dict[str, Dict[str, Any]] = {}
    for key in keys:
        fields = ckpts[0]["optimizer"]["state"].get(position[key])
        if not fields:
            continue
        entry = src.layout[key]
        for name, shape in zip(entry["names"], entry["shapes"]):
            shape = tuple(shape)
            st: Dict[str, Any] = {}
            for field, value in fields.items():
                if is_per_element(field, value, entry["shard_shape"]):
                    st[field] = torch.empty(shape, dtype=value.dtype, device="meta")

                    def chunk(k, rank, field=field):
                        return ckpts[rank]["optimizer"]["state"][position[k]][field].reshape(-1)
                    loaders[f"{optim_key}.state.{name}.{field}"] = (
                        lambda name=name, shape=shape, dtype=value.dtype, chunk=chunk:
                        read_full(index, src.layout, chunk, name, shape, dtype))
                else:
                    st[field] = value.clone() if isinstance(value, torch.Tensor) else value
            state[name] = st
    # as get_optimizer_state_dict gives it for a plain model's optimizer built from model.parameters():
    # parameters in named_parameters() order, no param_names
    order, _ = param_order(src.metadata, [n for key in keys for n in src.layout[key]["names"]])
    return full_optimizer_state_dict(state, ckpts[0]["optimizer"]["param_groups"],
                                     lambda i: src.layout[keys[i]]["names"], order, param_names=False)


def import_dcp(dcp_dir: str, world_size: int, out_prefix: str, model_key: Optional[str] = None,
               optim_key: Optional[str] = None, overwrite: bool = False) -> List[str]:
    """Write rank files for ``world_size`` ranks at ``out_prefix`` from the DCP checkpoint in
    ``dcp_dir``: one shard per parameter (padded flat), buffers whole on every rank, and the
    optimizer state found under ``optim_key`` (default: ``optim`` or ``optimizer``, beside the
    model's ``model`` or ``app.model``). Returns the paths."""
    if world_size < 1:
        raise CheckpointError(f"world size must be >= 1, got {world_size}")
    source = DCPSource(dcp_dir, model_key, optim_key)
    try:
        return import_rank_files(source.import_plan(), world_size, out_prefix, inputs_of(dcp_dir), overwrite)
    finally:
        source.close()
