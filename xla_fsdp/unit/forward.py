"""The forward half of a unit's step, as functions of its runtime (``runtime.UnitRuntime``): the
root's lazy set-up at its first forward (the units in its tree, the same-parameters check across
ranks, which groups train), then each forward: gather (and prefetch the next unit), run the module,
free or keep the full parameters, and hook the outputs for backward (the backward half is
backward.py)."""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from . import backward, freeing, group_values
from .schedule import TrainingState
from .step_state import RootContext
from .tensor_tree import map_tensors


def _job_size(comms: Any) -> int:
    """How many ranks ``start_sum_over_ranks`` sums over: every rank of the job."""
    if comms.name == "xla":
        import torch_xla.runtime as xr
        return xr.world_size()
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1


# ---------------------------------------------------------------------- lazy root set-up
def lazy_init(rt: Any, named: List[Tuple[str, Any]]) -> None:
    """At the root's first forward: ``named`` is (original-name prefix, runtime) for the root's
    units, itself first. They get the root's context and their effective freeing policy, once."""
    if rt.state.is_root is not None:
        return
    rt.state.is_root = True
    root = RootContext(units=[u for _, u in named], prefixes=[p for p, _ in named])
    for unit in root.units:
        if unit is not rt:
            if unit.state.is_root:
                raise RuntimeError("xla_fsdp: a nested unit already ran as a root; call the "
                                   "outermost wrapper only")
            unit.state.is_root = False
        unit.root = root
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


def _check_values_given(rt: Any) -> None:
    """Units given storage only (``param_init_fn=xla_fsdp.storage_only``) hold zeros until a load
    writes them: a first forward before any load would train from zeros, unlike any unsharded run."""
    empty = [prefix + name for prefix, unit in zip(rt.root.prefixes, rt.root.units) for group in unit.groups
             if group_values.awaiting_values(group) for name in group.names]
    if empty:
        raise RuntimeError(
            f"xla_fsdp: '{empty[0]}' ({len(empty)} parameters in all) was given storage only "
            "(param_init_fn=xla_fsdp.storage_only) and no values before the first forward. Load them first "
            "(xla_fsdp.load_pretrained(model, path), model.load_state_dict(...), a checkpoint loader), or "
            "leave param_init_fn out to initialize with each module's reset_parameters()")


def _check_same_parameters_on_every_rank(rt: Any) -> None:
    """Ranks that built different parameters (a model made before seeding, or from a random
    generator the ranks share, as XLA:CPU device threads do) would train a different model on
    each rank, and replicas (NO_SHARD, hybrid) would drift apart silently. Each group's
    fingerprint, taken at construction, is summed over every rank: equal only if all agree."""
    named = [(prefix + group.names[0], group) for prefix, unit in zip(rt.root.prefixes, rt.root.units)
             for group in unit.groups]
    if not named:
        return
    prints = [group_values.current_fingerprint(group) for _, group in named]
    zero = torch.zeros((), dtype=torch.float32)
    bits = torch.stack([(p if p is not None else zero).to(rt.comms.device) for p in prints]).cpu()
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


def find_trainable_groups(rt: Any) -> None:
    """The root's list of groups that train, and whether each forward must plan which of them
    get gradients: where ranks could disagree, or a flat shard could be only partly used (see
    gradient_usage.py)."""
    root = rt.root
    root.trainable_groups = [g for u in root.units for g in u.groups if g.requires_grad]
    data_parallel = rt.comms.world_size * rt.comms.num_replicas
    root.plans_gradients = bool(root.trainable_groups) and (
        data_parallel > 1 or any(g.flat and len(g.refs) > 1 for g in root.trainable_groups))


# ---------------------------------------------------------------------- forward
class ForwardCall(NamedTuple):
    """What one forward of a unit carries from before the module runs to after it."""
    in_backward: bool  # a checkpoint's recompute, inside backward
    versions: Optional[List[List[int]]]  # what the module held, to tell an in-place edit in forward


def forward(rt: Any, args: Any, kwargs: Any) -> Any:
    """One forward of the unit (its root has run :func:`lazy_init`): the wrapper's. ``fully_shard``'s
    runs the same two halves as its module's forward pre- and post-hooks, as FSDP2's do."""
    args, kwargs, call = before_forward(rt, args, kwargs)
    try:
        outputs = rt.run_module(*args, **kwargs)
    except BaseException:
        forward_failed(rt, call)
        raise
    return after_forward(rt, call, outputs)


def before_forward(rt: Any, args: Any, kwargs: Any) -> Tuple[Any, Any, ForwardCall]:
    """Gather (and prefetch), the root's start of a step; the inputs cast to the compute dtype."""
    settings = rt.settings
    # Called from inside backward: a checkpoint recompute. Use the backward gather and keep
    # the parameters until their gradients are reduced.
    in_backward = torch._C._current_graph_task_id() != -1
    if not in_backward:
        rt.assert_state(TrainingState.IDLE)
        rt.state.training_state = TrainingState.FORWARD
    try:
        if settings.compute_dtype != torch.float32 and settings.cast_forward_inputs:
            cast = lambda t: t.to(settings.compute_dtype) if t.is_floating_point() else t
            args, kwargs = map_tensors(cast, args), map_tensors(cast, kwargs)
        listed = [] if in_backward else rt.listed_prefetch(backward=False)
        if settings.optimization_barrier_in_forward:
            rt.comms.optimization_barrier(rt.barrier_sources(listed))
        schedule = rt.root.schedule
        if in_backward:
            rt.unshard(backward=True)
        else:
            if rt.state.is_root:
                _refuse_reassigned_parameters(rt)
                # Parameters frozen or unfrozen since the last step: every rank must do the same.
                if any([unit.follow_requires_grad() for unit in rt.root.units]):
                    find_trainable_groups(rt)
                schedule.start()
                freeing.root_forward_starts(rt.root)
                backward.begin_gradient_plan(rt)
            freeing.unit_forward_starts(rt.root, rt)
            schedule.record(rt)
            rt.unshard(prefetch=rt.prefetch_target(+1))
            rt.gather_listed(listed, backward=False)
    except BaseException:
        if not in_backward:  # (a refusal, a failed gather): idle and resharded again, as when the module raises
            _abandon_forward(rt)
        raise
    versions = None if in_backward else [group_values.installed_versions(g) for g in rt.groups]
    return args, kwargs, ForwardCall(in_backward, versions)


def forward_failed(rt: Any, call: ForwardCall) -> None:
    """The module raised: this unit (the root: every unit) idle and resharded again."""
    if not call.in_backward:
        _abandon_forward(rt)


def after_forward(rt: Any, call: ForwardCall, outputs: Any) -> Any:
    """In-place edits kept, the root's end of forward, the outputs cast and hooked for backward, the
    full parameters freed or kept as the freeing policy says."""
    settings = rt.settings
    in_backward = call.in_backward
    if call.versions is not None:  # parameters the module edited in place: the edit stays, as unsharded
        try:
            for group, before in zip(rt.groups, call.versions):
                group_values.keep_edits(group, before)
        except BaseException:
            forward_failed(rt, call)
            raise
    if rt.state.is_root and not in_backward:
        rt.root.schedule.end_forward()
        freeing.root_forward_ends(rt.root, rt.root.units, rt.comms.compiles_step)
        backward.end_gradient_plan(rt, outputs)
    if settings.output_dtype is not None:
        outputs = map_tensors(lambda t: t.to(settings.output_dtype) if t.is_floating_point() else t, outputs)
    if in_backward:  # a checkpoint recompute: parameters stay for this backward
        return outputs
    if freeing.cuts_pieces(rt.freeing, torch.is_grad_enabled()):
        rt.cut_pieces(outputs)
    rt.free_after_forward(freeing.after_forward(rt.freeing, torch.is_grad_enabled(), rt.state.is_root))
    rt.state.training_state = TrainingState.IDLE
    if torch.is_grad_enabled():
        outputs = backward.register_pre_backward_hooks(rt, outputs)
    return outputs


def _abandon_forward(rt: Any) -> None:
    """The module raised during forward: leave this unit (the root: every unit) idle and
    resharded, so the next forward starts clean instead of failing on a unit stuck in forward."""
    units = rt.root.units if rt.state.is_root else [rt]
    for unit in units:
        unit.finish_unshard()
        unit.reshard()
        unit.state.training_state = TrainingState.IDLE
    if rt.state.is_root:
        rt.root.schedule.start()
        freeing.forward_abandoned(rt.root)


def _refuse_reassigned_parameters(rt: Any) -> None:
    """A parameter attribute assigned after wrapping (tying ``head.weight = emb.weight`` as Hugging
    Face's ``tie_weights()`` does, or a new ``nn.Parameter``) would be dropped at the next gather and
    training would go on with the unit's own shard: refused at the root's next forward instead."""
    for prefix, unit in zip(rt.root.prefixes, rt.root.units):
        for group in unit.groups:
            found = group_values.reassigned_slot(group)
            if found is None:
                continue
            name, value = found
            source = getattr(value, "_xla_fsdp_name", None)
            what = f"the parameter '{source}'" if source is not None else f"a {type(value).__name__} of its own"
            raise RuntimeError(
                f"xla_fsdp: '{prefix}{name}' was given {what} after wrapping, but the unit computes with its own "
                f"shard of '{prefix}{name}': training would ignore the assignment. To tie parameters (tie_weights(), "
                "post_init), tie them before wrapping: tied parameters then share one shard. To give a parameter "
                "new values, assign or copy them inside `with XlaFullyShardedDataParallel.summon_full_params(model):`.")
