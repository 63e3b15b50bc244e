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
from typing import Iterator, List

import torch.nn as nn

from . import freeing, gather_group
from .base import is_unit, unit_of
from .param_names import named_units
from .runtime import TrainingState


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
    try:
        yield
    finally:
        for group in groups:
            if writeback:
                gather_group.write_back(group, gather_group.module_values(group))
                freeing.after_write_back(group)
            group.install()  # what the module holds between steps, again
