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
import weakref
from typing import Any, Dict, Iterator, List

import torch.nn as nn

from . import freeing, gather_group
from .base import is_unit, unit_of
from .param_names import named_units
from .runtime import TrainingState


#: the units inside summon_full_params now (written only by it)
_SUMMONED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


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
    _SUMMONED.update(units)
    try:
        yield
    finally:
        for unit in units:
            _SUMMONED.discard(unit)
        for group in groups:
            if writeback:
                gather_group.write_back(group, gather_group.module_values(group))
                freeing.after_write_back(group)
            group.install()  # what the module holds between steps, again



def add_summoned_values(unit_ref: "weakref.ref[nn.Module]", module: nn.Module, state_dict: Dict[str, Any],
                        prefix: str, local_metadata: Any) -> None:
    """The state-dict hook of a unit's module: inside summon_full_params, the full tensors the module shows
    (written back at exit) under its own names. So ``state_dict()`` there (the unit's, its module's, or a
    parent's: PEFT's ``save_pretrained``) holds whole tensors under the unwrapped model's names; outside
    it the module's parameters are the unit's shards and the unit's state dict holds those."""
    unit = unit_ref()
    if unit is None or not is_summoned(unit):
        return
    for group in unit.gather_groups:
        for ref, value in zip(group.refs, gather_group.module_values(group)):
            for name in [ref.fqn] + ref.aliases:
                state_dict[prefix + name] = value.detach()
