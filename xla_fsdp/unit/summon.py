"""The full parameters of a wrapped model outside forward and backward: ``summon_full_params``.

Between steps a unit keeps only its shards; the module's parameter attributes hold no data (see
:class:`xla_fsdp.unit.member_slots.FreedParameter`). Programs that read or change the full parameters there (a
re-initialisation with ``model.apply(init_fn)``, Hugging Face's ``post_init``, an in-place edit
under ``torch.no_grad()``, a look at a weight) do it inside this context: every unit gathers its
parameters, in the shards' own dtype, into tensors of their own that the module's attributes
point at; on exit what the module holds then (changed in place, or a new tensor or Parameter
assigned) is written back to each rank's shard, and the module gets its sharded state back.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from . import freeing, gather_group
from .base import is_unit, unit_of
from .member_slots import module_tensor
from .param_names import WRAPPED, named_units
from .runtime import TrainingState


#: the units inside summon_full_params now, each with its ``writeback`` (written only by it)
_SUMMONED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def is_summoned(unit: nn.Module) -> bool:
    return unit in _SUMMONED


def units_under(module: nn.Module, recurse: bool = True) -> List[nn.Module]:
    """The units ``module`` is or holds (itself only, if a unit and not ``recurse``)."""
    if is_unit(module) and not recurse:
        return [unit_of(module)]
    return [unit for _, unit in named_units(module)]


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
    """Gather the full parameters of the units in ``module`` (or of ``module`` alone, with
    ``recurse=False``) for the body of the ``with``; with ``writeback`` their values at exit become
    the shards. A collective: every rank enters it, with the same units. Not inside forward or
    backward."""
    units = units_under(module, recurse)
    for unit in units:
        if unit.training_state is not TrainingState.IDLE:
            raise RuntimeError(f"xla_fsdp: summon_full_params inside forward or backward (a unit is in state "
                               f"{unit.training_state.value}); call it between steps")
    groups = [g for unit in units for g in unit.gather_groups]
    for unit in units:
        unit.take_deferred_values()  # before the first forward (to_empty + init, sync_module_states)
        unit.finish_unshard()  # a prefetch left in flight
    gathered = [gather_group.gather_values(g) for g in groups]  # the same order on every rank
    for group, values in zip(groups, gathered):
        group.set_module_values(values)
    _SUMMONED.update((unit, writeback) for unit in units)
    try:
        yield
    finally:
        for unit in units:
            _SUMMONED.pop(unit, None)
        for group in groups:
            if writeback:
                gather_group.write_back(group, gather_group.module_values(group))
                freeing.after_write_back(group)
            group.install()  # what the module holds between steps, again



def show_summoned_values(unit: nn.Module, groups: List[Any]) -> None:
    """Hook ``state_dict()`` of each module that holds a member of the unit's groups (the wrapper's): inside
    summon_full_params it holds the full tensors the module shows (written back at exit) under its own names.
    So a state dict taken there (the unit's, its module's, a parent's or a part's: PEFT's ``save_pretrained``,
    its ``modules_to_save`` copies) holds whole tensors under the unwrapped model's names; outside it the
    module's parameters are the unit's shards, and the unit's state dict holds those."""
    attrs: Dict[int, List[Any]] = {}
    for group in groups:
        for ref in group.refs:
            for module, attr in ref.slots:
                attrs.setdefault(id(module), [module]).append(attr)
    for module, *names in attrs.values():
        module.register_state_dict_post_hook(functools.partial(_add_summoned_values, weakref.ref(unit), tuple(names)))


def _add_summoned_values(unit_ref: "weakref.ref[nn.Module]", names: Tuple[str, ...], module: nn.Module,
                         state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    unit = unit_ref()
    if unit is None:
        return
    if is_summoned(unit):
        for name in names:
            state_dict[prefix + name] = module_tensor(module, name).detach()
    elif not prefix:  # asked of this module itself (a parent's state_dict() names it by its prefix)
        raise RuntimeError(
            f"xla_fsdp: state_dict() of a {type(module).__name__} inside a sharded unit, outside summon_full_params: "
            f"the unit holds its {', '.join(names)} as shards, so it would leave them out. Take it inside `with "
            "XlaFullyShardedDataParallel.summon_full_params(model):` (PEFT's save_pretrained and "
            "get_peft_model_state_dict too: they ask it of modules_to_save copies), or take the model's full "
            "state dict (xla_fsdp.checkpoints.full_state_dict(model))")


def full_load_refused(what: str) -> RuntimeError:
    """The one line for full tensors loaded into a sharded unit between steps."""
    return RuntimeError(
        f"xla_fsdp: load_state_dict got {what} outside summon_full_params, where the unit holds only this rank's "
        "shards: load full tensors inside `with XlaFullyShardedDataParallel.summon_full_params(model):` (PEFT's "
        "set_peft_model_state_dict and load_adapter too: they name what state_dict() names), or with "
        "xla_fsdp.checkpoints.load_full_state_dict(model, state_dict)")


def copy_into_shown(unit: nn.Module, key: str, value: Any, target: torch.Tensor) -> bool:
    """A full tensor loaded inside summon_full_params: copied into the one the module shows (the shard at exit);
    False if its shape is not the parameter's."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
        return False
    if not _SUMMONED.get(unit, True):
        raise RuntimeError(f"xla_fsdp: load_state_dict got '{key}' inside summon_full_params(writeback=False), "
                           "whose exit drops what it loads: load inside summon_full_params(model) (writeback=True)")
    with torch.no_grad():
        target.copy_(value)
    return True


def _holds_shards(unit: nn.Module, state_dict: Dict[str, Any], prefix: str) -> bool:
    """Whether ``state_dict`` names one of the unit's shards (torch_xla's state dict): then it is loaded as such."""
    return any(prefix + name in state_dict for name in unit._parameters)


def route_into_module(unit: nn.Module, state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
    """The load pre-hook of a unit (the wrapper). Its state dict is its shards; inside summon_full_params it is
    its module's (what ``state_dict()`` gives there: full tensors, the unwrapped model's names), so every key is
    sent on to the module (``load_full_values`` takes the unit's own). Between steps any other key under the
    unit is refused, not ignored as ``strict=False`` would: it cannot be loaded there."""
    shards = _holds_shards(unit, state_dict, prefix)
    inner = prefix + WRAPPED + "."
    if not is_summoned(unit):
        stray = next((key for key in state_dict if key.startswith(prefix) and key[len(prefix):] not in unit._parameters
                      and not key.startswith(inner)), None)
        if stray is not None:
            raise full_load_refused(f"'{stray}' for the sharded unit '{prefix.rstrip('.')}'")
        return
    if shards:
        raise RuntimeError(f"xla_fsdp: load_state_dict got this rank's shards of the unit '{prefix.rstrip('.')}' "
                           "inside summon_full_params, whose exit writes the full parameters back over them: load "
                           "shards (torch_xla's state dict) outside summon_full_params, full tensors inside it")
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    for name, shard in unit._parameters.items():  # (written back at exit: as they are, not missing)
        state_dict[prefix + name] = shard


def load_full_values(unit_ref: "weakref.ref[nn.Module]", module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                     local_metadata: Any, strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                     error_msgs: List[str]) -> None:
    """The load pre-hook of a unit's module: inside summon_full_params, full tensors under its names (PEFT's
    ``set_peft_model_state_dict`` and ``load_adapter`` load so, on the module or a parent) are copied into the
    tensors the module shows, which become the shards at exit; a name not given is missing under the unwrapped
    model's name, as unwrapped. Between steps they are refused: the unit holds shards."""
    unit = unit_ref()
    if unit is None:
        return
    given = [(group, i, prefix + name) for group in unit.gather_groups for i, ref in enumerate(group.refs)
             for name in [ref.fqn] + ref.aliases]
    if not is_summoned(unit):
        first = next((key for _, _, key in given if key in state_dict), None)
        if first is not None:
            raise full_load_refused(f"'{_unwrapped(first)}'")
        return
    values = {id(group): gather_group.module_values(group) for group in unit.gather_groups}
    for group, i, key in given:
        if key not in state_dict:
            missing_keys.append(_unwrapped(key))
            continue
        value, target = state_dict.pop(key), values[id(group)][i]
        if not copy_into_shown(unit, key, value, target):
            error_msgs.append(f"size mismatch for {_unwrapped(key)}: copying a param with shape "
                              f"{getattr(value, 'shape', type(value).__name__)} from checkpoint, the shape in "
                              f"current model is {target.shape}.")


def unwrapped_load_names(unit: nn.Module, incompatible_keys: Any) -> None:
    """The load post-hook of a unit (the wrapper): inside summon_full_params the missing and unexpected keys are
    named as in the unwrapped model (``route_into_module`` sent its keys through the wrapper)."""
    if is_summoned(unit):
        for keys in incompatible_keys:
            keys[:] = [_unwrapped(k) for k in keys]


def _unwrapped(key: str) -> str:
    return key.replace(WRAPPED + ".", "")
