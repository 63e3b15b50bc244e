"""``torch.distributed.checkpoint.state_dict``'s functions, for xla_fsdp models: the code of the
FSDP2 tutorials (``get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))``, ``set_state_dict(...)``, ``dcp.save``/``dcp.load`` of those dicts) runs
with ``from xla_fsdp.checkpoints.state_dict_api import ...`` in place of torch's module.

A model that holds no xla_fsdp unit (PyTorch's own ``fully_shard``, which ``xla_fsdp.fully_shard``
is on the torch transport) goes to PyTorch's functions unchanged, so one program serves both.

The same signatures, and PyTorch's semantics for full state dicts: tensors keyed by the original
parameter names, optimizer state and param_groups keyed by them too, on every rank
(``cpu_offload=True``: on rank 0 only, the others get ``{}``); ``set_*`` takes a full dict on every
rank, or on rank 0 only with ``broadcast_from_rank0=True`` (on XLA devices too: it travels through
the model's transport); ``strict`` (default) refuses missing and unexpected keys, ``strict=False``
returns them; ``ignore_frozen_params`` leaves frozen parameters out. What is refused, each with the
way that works: sharded state dicts (``full_state_dict=False``: DTensors in PyTorch; xla_fsdp's flat
shards are not row blocks of the original tensors, so use per-rank files, ``save_sharded_checkpoint``,
which load at any world size, or a DCP folder written offline, ``python -m xla_fsdp.convert --to
dcp``), ``submodules=`` and ``flatten_optimizer_state_dict=True``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.checkpoint.state_dict import StateDictOptions, _init_optim_state
from torch.nn.modules.module import _IncompatibleKeys

from ..unit.base import is_unit, root_unit
from .files import CheckpointError
from .full_state import (full_optim_state_dict, full_state_dict, full_state_keys, load_full_optim_state_dict,
                         load_full_state_dict)

Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]


F = TypeVar("F", bound=Callable[..., Any])


def _upstream_unless_ours(fn: F) -> F:
    """PyTorch's function of the same name for a model without xla_fsdp units."""
    @functools.wraps(fn)
    def call(model, *args: Any, **kwargs: Any) -> Any:
        if not any(is_unit(m) for m in model.modules()):
            return getattr(upstream, fn.__name__)(model, *args, **kwargs)
        return fn(root_unit(model), *args, **kwargs)
    return call  # type: ignore[return-value]


def _options(options: Optional[StateDictOptions], submodules: Any = None) -> StateDictOptions:
    if submodules is not None:
        raise CheckpointError("xla_fsdp's state dict functions give the whole model: leave out submodules= "
                              "(deprecated in PyTorch too) and pick the keys you need from the full dict")
    options = options or StateDictOptions()
    if getattr(options, "flatten_optimizer_state_dict", False):
        raise CheckpointError("xla_fsdp's optimizer state dicts are keyed by parameter name, not flattened: "
                              "leave out flatten_optimizer_state_dict=True")
    if not options.full_state_dict:
        raise CheckpointError(
            "xla_fsdp gives full state dicts here: pass options=StateDictOptions(full_state_dict=True) (tensors "
            "keyed by parameter names, as FSDP2 gives them). For per-rank sharded files use "
            "xla_fsdp.save_sharded_checkpoint (they load at any world size); for a sharded DCP folder, "
            "python -m xla_fsdp.convert --to dcp")
    return options


def _one(optimizers: Optimizers) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    if len(optimizers) != 1:
        raise CheckpointError(f"xla_fsdp's state dict functions take one optimizer, got {len(optimizers)}")
    return optimizers[0]


@_upstream_unless_ours
def get_model_state_dict(model, *, submodules=None, options: Optional[StateDictOptions] = None
                         ) -> Dict[str, torch.Tensor]:
    """The full model state dict (CPU tensors), on every rank or, with ``cpu_offload``, rank 0;
    ``ignore_frozen_params``: without the parameters that do not train."""
    options = _options(options, submodules)
    state = full_state_dict(model, rank0_only=options.cpu_offload)
    if state is None:
        return {}
    if options.ignore_frozen_params:
        frozen = set(full_state_keys(model)[1])
        return {k: v for k, v in state.items() if k not in frozen}
    return dict(state)


@_upstream_unless_ours
def get_optimizer_state_dict(model, optimizers: Optimizers, *, submodules=None,
                             options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """The full optimizer state dict keyed by parameter names. A fresh optimizer's state is
    created first (a step with zero gradients and lr 0, as PyTorch does), so the dict is a complete
    template for ``dcp.load``."""
    options = _options(options, submodules)
    optimizer = _one(optimizers)
    _init_optim_state(optimizer)
    state = full_optim_state_dict(model, optimizer, rank0_only=options.cpu_offload)
    if state is None:
        return {}
    # PyTorch's layout for an optimizer built from parameters(): no param_names (a dcp.load template
    # holding them would ask every checkpoint, FSDP2's included, for them)
    for group in state["param_groups"]:
        group.pop("param_names", None)
    return state


@_upstream_unless_ours
def get_state_dict(model, optimizers: Optimizers, *, submodules=None, options: Optional[StateDictOptions] = None
                   ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def _from_rank0(model, value: Any, options: StateDictOptions) -> Any:
    """Rank 0's dict on every rank, through the model's own transport (on XLA devices not the ``xla``
    process group's ``broadcast_object_list``, which fails inside torch_xla on host tensors)."""
    if not options.broadcast_from_rank0 or model.world_size * model.comms.num_replicas == 1:
        return value
    return model.comms.broadcast_object_from_rank_0(value)


@_upstream_unless_ours
def set_model_state_dict(model, model_state_dict: Dict[str, torch.Tensor], *,
                         options: Optional[StateDictOptions] = None) -> _IncompatibleKeys:
    """As PyTorch's: ``strict`` (the default) refuses missing and unexpected keys, naming them;
    ``strict=False`` loads what is there and returns the rest as missing / unexpected keys (a flat
    shard cannot be loaded in part); ``ignore_frozen_params`` lets frozen parameters be missing."""
    options = _options(options)
    state = _from_rank0(model, model_state_dict, options)
    keys, frozen = full_state_keys(model)
    unexpected = [k for k in state if k not in set(keys)]
    skippable = set(frozen) if options.ignore_frozen_params else set()
    missing = [k for k in keys if k not in state and k not in skippable]
    if options.strict and (missing or unexpected):
        wrong = ([f"lacks {missing[:3]}"] if missing else []) + (
            [f"has keys the model does not: {unexpected[:3]}"] if unexpected else [])
        raise CheckpointError(
            f"set_model_state_dict: the state dict {' and '.join(wrong)} ({len(missing)} missing, {len(unexpected)} "
            "unexpected); pass a dict of the model's keys or options=StateDictOptions(full_state_dict=True, "
            "strict=False)")
    load_full_state_dict(model, state, skip_missing=bool(missing) or bool(skippable))
    return _IncompatibleKeys(missing, unexpected)


@_upstream_unless_ours
def set_optimizer_state_dict(model, optimizers: Optimizers, optim_state_dict: Dict[str, Any], *,
                             options: Optional[StateDictOptions] = None) -> None:
    options = _options(options)
    load_full_optim_state_dict(model, _one(optimizers), _from_rank0(model, optim_state_dict, options))


@_upstream_unless_ours
def set_state_dict(model, optimizers: Optimizers, *, model_state_dict: Dict[str, torch.Tensor],
                   optim_state_dict: Dict[str, Any], options: Optional[StateDictOptions] = None) -> _IncompatibleKeys:
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys
