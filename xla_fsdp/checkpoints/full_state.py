"""Full (unsharded) model and optimizer state dicts, gathered from or scattered to a live model.

Gathering runs one all-gather per shard (every rank must call); loading a full state dict needs no
communication: each rank cuts its own shard out of the full tensors with the same layout math.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..shard_names import clean_name
from .files import CheckpointError
from ..sharding import split_entry, stitch_entry
from .metadata import full_optimizer_state_dict, is_per_element, learn_per_element, param_order, tensor_shapes
from ..unit.base import takes_root_unit
from ..unit.shard_param import rows_of


def _shard_of_layout(model):
    metadata = model.get_shard_metadata()
    params = {name: rows_of(p) for name, p in model.named_parameters()}  # fully_shard's ShardParams: their rows
    return metadata, params


@takes_root_unit
@torch.no_grad()
def full_state_dict(model, rank0_only: bool = True) -> Optional[Dict[str, torch.Tensor]]:
    """The full model state dict on CPU, keyed by original names (on rank 0 only by default)."""
    metadata, params = _shard_of_layout(model)
    comms, ws = model.comms, model.world_size
    gathered = {}
    for key in metadata["layout"]:
        shard = params[key].detach()
        shard = shard.reshape((-1,) + tuple(shard.shape[1:])).to(comms.device)  # host-offloaded: to the device
        gathered[key] = model.gather_over_ranks(shard)
        comms.sync(why="Here: gathering a full state dict; a torch_xla.sync() of the program's right after the "
                       "draws (an init, a step) keeps them as unwrapped")  # one collective per executed graph
    if rank0_only and model.rank != 0:
        return None
    out: Dict[str, torch.Tensor] = OrderedDict()
    for key, entry in metadata["layout"].items():
        tensors = stitch_entry(entry, list(gathered[key].cpu().chunk(ws)))
        for name, t in zip(entry["names"], tensors):
            out[name] = t
            for alias in entry.get("aliases", {}).get(name, []):
                out[alias] = t
    for key, value in model.state_dict().items():
        # (fully_shard's state_dict() also names a tied parameter by its alias: that is not a buffer)
        if key not in metadata["layout"] and clean_name(key) not in out:
            original = metadata["buffer_info"].get(key, {}).get("_orig_dtype")
            t = value.detach().cpu().clone()
            out[clean_name(key)] = t.to(original) if original is not None else t
    return out


@takes_root_unit
def full_state_keys(model) -> Tuple[List[str], List[str]]:
    """The keys of the model's full state dict (tied names included), and those of its frozen
    parameters (``requires_grad=False`` shards)."""
    metadata, params = _shard_of_layout(model)
    keys: List[str] = []
    frozen: List[str] = []
    for key, entry in metadata["layout"].items():
        names = list(entry["names"]) + [a for n in entry["names"] for a in entry.get("aliases", {}).get(n, [])]
        keys += names
        if not params[key].requires_grad:
            frozen += names
    named = set(keys)
    keys += [clean_name(k) for k in model.state_dict() if k not in metadata["layout"] and clean_name(k) not in named]
    return keys, frozen


@takes_root_unit
@torch.no_grad()
def load_full_state_dict(model, state_dict: Mapping[str, torch.Tensor], skip_missing: bool = False) -> None:
    """Load a full (unsharded) state dict, keyed by original names, into a wrapped model.
    ``skip_missing``: a shard none of whose parameters is in ``state_dict`` keeps its values (a flat
    shard with some of them is still an error: it cannot be loaded in part)."""
    metadata, params = _shard_of_layout(model)
    multiple = metadata["shard_size_multiple"]
    for key, entry in metadata["layout"].items():
        missing = [n for n in entry["names"] if n not in state_dict]
        if missing and skip_missing and len(missing) == len(entry["names"]):
            continue
        if missing:
            raise CheckpointError(f"full state dict lacks {missing[:3]} (needed for shard '{key}')")
        tensors = [state_dict[n].detach().cpu().to(torch.float32) for n in entry["names"]]
        for n, t, shape in zip(entry["names"], tensors, entry["shapes"]):
            if list(t.shape) != list(shape):
                raise CheckpointError(f"'{n}' has shape {list(t.shape)}, the model expects {shape}")
        shard = split_entry(entry, tensors, model.world_size, multiple)[1][model.rank]
        params[key].copy_(shard.view(params[key].shape).to(params[key].device))
    named = {n for e in metadata["layout"].values() for m in e["names"]
             for n in [m] + e.get("aliases", {}).get(m, [])}  # (fully_shard's state_dict() names aliases too)
    buffers = {k: v for k, v in model.state_dict().items()
               if k not in metadata["layout"] and clean_name(k) not in named}
    for key, value in buffers.items():
        name = clean_name(key)
        if name not in state_dict and skip_missing:
            continue
        if name not in state_dict:
            raise CheckpointError(f"full state dict lacks buffer '{name}'")
        value.copy_(state_dict[name].to(value.dtype).to(value.device))


def _optimizer_keys(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


@takes_root_unit
@torch.no_grad()
def full_optim_state_dict(model, optimizer, rank0_only: bool = True) -> Optional[Dict[str, Any]]:
    """Optimizer state keyed by original parameter names, full tensors on CPU, laid out for the
    unwrapped model's optimizer as consolidation lays it out (``metadata.full_optimizer_state_dict``:
    parameters in ``named_parameters()`` order, ``param_names`` in each group)."""
    metadata, _ = _shard_of_layout(model)
    keys = _optimizer_keys(model, optimizer)
    osd = optimizer.state_dict()
    comms, ws = model.comms, model.world_size
    gathered: Dict[int, Dict[str, Any]] = {}
    for idx, key in enumerate(keys):
        entry = metadata["layout"][key]
        st = osd["state"].get(idx, {})
        gathered[idx] = {}
        for f, v in st.items():
            if is_per_element(f, v, entry["shard_shape"]):
                v = model.gather_over_ranks(v.reshape((-1,) + tuple(v.shape[1:])))
                comms.sync()
            gathered[idx][f] = v
    if rank0_only and model.rank != 0:
        return None
    state: Dict[str, Any] = {}
    for idx, key in enumerate(keys):
        entry = metadata["layout"][key]
        per_field = {}
        for f, v in gathered[idx].items():
            original = osd["state"][idx][f]
            if is_per_element(f, original, entry["shard_shape"]):
                per_field[f] = stitch_entry(entry, list(v.cpu().chunk(ws)))
            else:
                per_field[f] = [v.clone() if isinstance(v, torch.Tensor) else v] * len(entry["names"])
        if not per_field:
            continue  # no state yet (frozen, or never stepped): absent, as in torch.optim's own state dicts
        for i, name in enumerate(entry["names"]):
            state[name] = {f: vals[i] for f, vals in per_field.items()}
    order, _ = param_order(metadata, [n for key in keys for n in metadata["layout"][key]["names"]])
    return full_optimizer_state_dict(state, osd["param_groups"], lambda idx: metadata["layout"][keys[idx]]["names"],
                                     order)


@takes_root_unit
@torch.no_grad()
def load_full_optim_state_dict(model, optimizer, full_osd: Mapping[str, Any]) -> None:
    """Load optimizer state keyed by original names (from full_optim_state_dict or consolidation)."""
    metadata, _ = _shard_of_layout(model)
    keys = _optimizer_keys(model, optimizer)
    multiple = metadata["shard_size_multiple"]
    learnt = learn_per_element(tensor_shapes(full_osd["state"]), {n: shape for entry in metadata["layout"].values()
                                                   for n, shape in zip(entry["names"], entry["shapes"])})
    state = {}
    for idx, key in enumerate(keys):
        entry = metadata["layout"][key]
        per_name = [full_osd["state"].get(n) for n in entry["names"]]
        if all(s is None for s in per_name):
            continue
        if any(s is None for s in per_name):
            raise CheckpointError(f"optimizer state covers only part of shard '{key}' ({entry['names']})")
        st = {}
        for f, v in per_name[0].items():
            if is_per_element(f, v, entry["shapes"][0], learnt):
                full = [s[f].detach().cpu() for s in per_name]
                st[f] = split_entry(entry, full, model.world_size, multiple)[1][model.rank].view(entry["shard_shape"])
            else:
                st[f] = v.clone() if isinstance(v, torch.Tensor) else v
        state[idx] = st
    groups = []
    for g, current in zip(full_osd["param_groups"], optimizer.state_dict()["param_groups"]):
        new = {k: v for k, v in g.items() if k not in ("params", "param_names")}  # original names: not the shards'
        new.update((k, current[k]) for k in ("param_names", "params") if k in current)
        groups.append(new)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
