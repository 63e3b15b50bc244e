"""The root's set-up at its first forward (FSDP2's lazy init): the units in its tree get one root
context and their effective freeing policy; the ranks are checked to hold the same parameters and
values given to every storage-only unit. A step's own work is ``step.py``'s."""
from __future__ import annotations

from typing import Any, List, Tuple

import torch

from . import freeing, gather_group
from .root_context import RootContext
from .runtime import UnitRuntime
from .step import find_trainable_groups


def _job_size(comms: Any) -> int:
    """How many ranks ``start_sum_over_ranks`` sums over: every rank of the job."""
    if comms.name == "xla":
        import torch_xla.runtime as xr
        return xr.world_size()
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1


def lazy_init(rt: UnitRuntime, named: List[Tuple[str, Any]]) -> None:
    """At the root's first forward: ``named`` is (original-name prefix, runtime) for the root's
    units, itself first. They get the root's context and their effective freeing policy, once."""
    if rt.state.is_root is not None:
        return
    root = RootContext(units=[u for _, u in named], prefixes=[p for p, _ in named])
    for unit in root.units:
        unit.join_root(root, unit is rt)
    for unit in root.units:
        if getattr(unit.module, "_xla_fsdp_checkpointed", False):
            unit.find_shared_groups(root.units)
    find_trainable_groups(rt)
    for unit in root.units:  # the root rule, once (see unit/freeing.py)
        unit.replace_settings(freeing=freeing.effective(unit.freeing, unit is rt))
    rt.comms.check_construction()
    for unit in root.units:
        unit.take_deferred_values()
    _check_values_given(rt)
    _check_same_parameters_on_every_rank(rt)


def _check_values_given(rt: UnitRuntime) -> None:
    """Units given storage only (``param_init_fn=xla_fsdp.storage_only``) hold zeros until a load
    writes them: a first forward before any load would train from zeros, unlike any unsharded run."""
    empty = [prefix + name for prefix, unit in zip(rt.root.prefixes, rt.root.units) for group in unit.groups
             if gather_group.awaiting_values(group) for name in group.names]
    if empty:
        raise RuntimeError(
            f"xla_fsdp: '{empty[0]}' ({len(empty)} parameters in all) was given storage only "
            "(param_init_fn=xla_fsdp.storage_only) and no values before the first forward. Load them first "
            "(xla_fsdp.load_pretrained(model, path), model.load_state_dict(...), a checkpoint loader), or "
            "leave param_init_fn out to initialize with each module's reset_parameters()")


def _check_same_parameters_on_every_rank(rt: UnitRuntime) -> None:
    """Ranks that built different parameters (a model made before seeding, or from a random
    generator the ranks share, as XLA:CPU device threads do) would train a different model on
    each rank, and replicas (NO_SHARD, hybrid) would drift apart silently. Each group's
    fingerprint, taken at construction, is summed over every rank: equal only if all agree."""
    named = [(prefix + group.names[0], group) for prefix, unit in zip(rt.root.prefixes, rt.root.units)
             for group in unit.groups]
    if not named:
        return
    prints = [gather_group.current_fingerprint(group) for _, group in named]
    zero = torch.zeros((), dtype=torch.float32)
    bits = torch.stack(rt.comms.to_host([p if p is not None else zero for p in prints]))
    # small numbers (sums over ranks stay in int32); 0 for a group loaded since it was built
    own = [b & 0xFFFFF if p is not None else 0 for b, p in zip(bits.view(torch.int32).tolist(), prints)]
    totals = rt.comms.start_sum_over_ranks(own)()
    if totals is None:  # no cheap host channel (XLA across processes): ranks are assumed alike
        return
    everyone = _job_size(rt.comms)
    for (name, _), mine, total in zip(named, own, totals):
        if total != mine * everyone:
            raise RuntimeError(
                f"xla_fsdp: the ranks built different values for parameter '{name}' (and maybe others): each "
                "would train a different model. Build the model the same way on every rank "
                "(torch.manual_seed(N) right before building it; XLA:CPU device threads share one CPU random "
                "generator, so build under a lock), or wrap with sync_module_states=True to take rank 0's "
                "parameters and buffers.")
