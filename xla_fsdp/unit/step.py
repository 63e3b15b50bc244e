"""A unit's step, in the order it runs (FSDP2's ``FSDPState`` hooks over ``FSDPParamGroup``): functions
of a unit's runtime (``runtime.UnitRuntime``). Forward: ``before_forward`` gathers (and prefetches) and,
at the root, starts the step; the module runs; ``after_forward`` frees or keeps the full parameters as
``freeing.py`` says and hooks the outputs (``forward_failed`` instead when the module raised). Backward:
the outputs' hook gathers again (``_pre_backward``), each group's full gradient is reduce-scattered as it
becomes ready (``on_full_grad_ready``, one reduce-scatter left on the wire while the next unit computes),
and the root's backward ends in ``_finalize_backward``. The root's set-up at its first forward is
``root_setup.py``'s."""
from __future__ import annotations

from typing import Any, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.autograd import Variable

from . import freeing, gather_group
from .base import is_unit
from .gather_group import GatherGroup
from .gradients import GradientPlan, map_tensors, modules_of, reachable_edges, tensors_in, used_members
from .offload import land_gradients
from .runtime import (TrainingState, UnitRuntime, accumulate_shard_grad, grad_to_reduce, shard_grad_of,
                      start_groups_reduce)


# ---------------------------------------------------------------------- forward: gather, run, free
class ForwardCall(NamedTuple):
    """What one forward of a unit carries from before the module runs to after it."""
    in_backward: bool  # a checkpoint's recompute, inside backward
    versions: Optional[List[List[int]]]  # what the module held, to tell an in-place edit in forward


def forward(rt: UnitRuntime, args: Any, kwargs: Any) -> Any:
    """One forward of the unit (its root has run ``root_setup.lazy_init``): the wrapper's. ``fully_shard``'s
    runs the same two halves as its module's forward pre- and post-hooks, as FSDP2's do."""
    args, kwargs, call = before_forward(rt, args, kwargs)
    try:
        outputs = rt.run_module(*args, **kwargs)
    except BaseException:
        forward_failed(rt, call)
        raise
    return after_forward(rt, call, outputs)


def before_forward(rt: UnitRuntime, args: Any, kwargs: Any) -> Tuple[Any, Any, ForwardCall]:
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
                _refuse_parameters_added_after_wrapping(rt)
                # Parameters frozen or unfrozen since the last step: every rank must do the same.
                if any([unit.follow_requires_grad() for unit in rt.root.units]):
                    find_trainable_groups(rt)
                schedule.start()
                freeing.root_forward_starts(rt.root)
                begin_gradient_plan(rt)
            freeing.unit_forward_starts(rt.root, rt)
            schedule.record(rt)
            rt.unshard(prefetch=rt.prefetch_target(+1))
            rt.gather_listed(listed, backward=False)
    except BaseException:
        if not in_backward:  # (a refusal, a failed gather): idle and resharded again, as when the module raises
            _abandon_forward(rt)
        raise
    versions = None if in_backward else [gather_group.installed_versions(g) for g in rt.groups]
    return args, kwargs, ForwardCall(in_backward, versions)


def _refuse_reassigned_parameters(rt: UnitRuntime) -> None:
    """A parameter attribute assigned after wrapping (tying ``head.weight = emb.weight`` as Hugging
    Face's ``tie_weights()`` does, or a new ``nn.Parameter``) would be dropped at the next gather and
    training would go on with the unit's own shard: refused at the root's next forward instead."""
    for prefix, unit in zip(rt.root.prefixes, rt.root.units):
        for group in unit.groups:
            found = gather_group.reassigned_slot(group)
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


def _refuse_parameters_added_after_wrapping(rt: UnitRuntime) -> None:
    """A parameter registered in a unit's module after wrapping (PEFT's ``add_adapter``, ``load_adapter`` under a
    new name, a new layer) is no unit's: it would train unsharded with its gradient never averaged over the
    ranks, so the ranks' copies would part. Refused at the root's next forward, on every rank. What each
    module held at wrapping is the unit's ``param_attrs``; a module (re)assigned since holds none."""
    for prefix, unit in zip(rt.root.prefixes, rt.root.units):
        attrs = unit.param_attrs
        for name, module in _modules_down_to_units(unit.module, ""):
            known = attrs.get(module, ())
            for attr, p in module._parameters.items():
                if p is None or attr in known:
                    continue
                raise RuntimeError(
                    f"xla_fsdp: '{prefix}{name}{attr}' is a parameter added after wrapping (PEFT's add_adapter or "
                    "load_adapter under a new name, a new layer): no unit shards it, so its gradient would not be "
                    "averaged over the ranks. Add adapters and layers before wrapping (get_peft_model or "
                    "PeftModel.from_pretrained, then XlaFullyShardedDataParallel or fully_shard)")


def _modules_down_to_units(module: nn.Module, prefix: str) -> Iterator[Tuple[str, nn.Module]]:
    """``module`` and its submodules down to (not into) the units inside it, with their name prefixes."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None and not is_unit(child):
            yield from _modules_down_to_units(child, prefix + name + ".")


def find_trainable_groups(rt: UnitRuntime) -> None:
    """The root's list of groups that train, and whether each forward must plan which of them
    get gradients: where ranks could disagree, or a flat shard could be only partly used (see
    gradients.py)."""
    root = rt.root
    root.trainable_groups = [g for u in root.units for g in u.groups if g.requires_grad]
    data_parallel = rt.comms.world_size * rt.comms.num_replicas
    root.plans_gradients = bool(root.trainable_groups) and (
        data_parallel > 1 or any(g.flat and len(g.refs) > 1 for g in root.trainable_groups))


def begin_gradient_plan(rt: UnitRuntime) -> None:
    """The root's forward begins."""
    record = rt.root.plans_gradients and torch.is_grad_enabled() and rt.state.require_backward_grad_sync
    for unit in rt.root.units:
        for group in unit.groups:
            group.begin_forward(record)


# ---------------------------------------------------------------------- forward raised
def forward_failed(rt: UnitRuntime, call: ForwardCall) -> None:
    """The module raised: this unit (the root: every unit) idle and resharded again."""
    if not call.in_backward:
        _abandon_forward(rt)


def _abandon_forward(rt: UnitRuntime) -> None:
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


# ---------------------------------------------------------------------- forward returned: plan, free, hook
def after_forward(rt: UnitRuntime, call: ForwardCall, outputs: Any) -> Any:
    """In-place edits kept, the root's end of forward, the outputs cast and hooked for backward, the
    full parameters freed or kept as the freeing policy says."""
    settings = rt.settings
    in_backward = call.in_backward
    if call.versions is not None:  # parameters the module edited in place: the edit stays, as unsharded
        try:
            for group, before in zip(rt.groups, call.versions):
                gather_group.keep_edits(group, before)
        except BaseException:
            forward_failed(rt, call)
            raise
    if rt.state.is_root and not in_backward:
        rt.root.schedule.end_forward()
        freeing.root_forward_ends(rt.root, rt.root.units, rt.comms.compiles_step)
        end_gradient_plan(rt, outputs)
    if settings.output_dtype is not None:
        outputs = map_tensors(lambda t: t.to(settings.output_dtype) if t.is_floating_point() else t, outputs)
    if in_backward:  # a checkpoint recompute: parameters stay for this backward
        return outputs
    if freeing.cuts_pieces(rt.freeing, torch.is_grad_enabled()):
        rt.cut_pieces(outputs)
    rt.free_after_forward(freeing.after_forward(rt.freeing, torch.is_grad_enabled(), rt.state.is_root))
    rt.state.training_state = TrainingState.IDLE
    if torch.is_grad_enabled():
        outputs = register_pre_backward_hooks(rt, outputs)
    return outputs


def end_gradient_plan(rt: UnitRuntime, outputs: Any) -> None:
    """The root's forward has returned: find the groups its outputs reach and start summing
    that over ranks (the sum is waited for at the first gradient, or at the end of backward)."""
    root, schedule = rt.root, rt.root.schedule
    if root.plan is not None:  # the previous forward had no backward
        root.plan.discard()
    root.plan = None
    if not (torch.is_grad_enabled() and rt.state.require_backward_grad_sync):
        return
    # Walked also where no plan is made (one rank): a program's own reentrant checkpoint must
    # keep the groups it uses gathered until its later backward pass.
    recomputed: List[Any] = []
    leaves: Set[int] = set()
    edges = reachable_edges(outputs, recomputed, leaves)
    # torch_xla's checkpoint is reentrant: what it recomputes is not in this graph. Every
    # parameter the modules of a unit that ran under it hold counts as used (its own, and a
    # tied one its parent owns). So do those of the program's own reentrant checkpoints: the
    # modules its function runs, or, for another function, every unit that ran.
    hidden: Set[int] = set()
    ran = [unit for unit in root.units if schedule.ran_forward(unit)]
    for unit in ran:
        if recomputes_in_a_backward_of_its_own(unit.module, unit.comms.device):
            hidden |= unit.module_ids()
    later: Set[int] = set()
    for function in recomputed:
        modules = modules_of(function)
        later |= modules if modules is not None else set().union(*[unit.module_ids() for unit in ran])
    hidden |= later
    for group in root.trainable_groups:
        group.gradient_in_later_pass = any(id(module) in later for ref in group.refs for module, _ in ref.slots)
    if not root.plans_gradients:
        return
    used = [used_members(g, edges, hidden, leaves) for unit in root.units for g in unit.groups if g.requires_grad]
    for group in root.trainable_groups:
        group.forward_edges.end()
    root.plan = GradientPlan(root.trainable_groups, used, rt.comms.start_sum_over_ranks)


def recomputes_in_a_backward_of_its_own(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``checkpoint_module`` made ``module`` recompute in a nested backward pass: torch_xla's
    checkpoint (XLA devices) is reentrant; PyTorch's non-reentrant one (eager devices) recomputes
    inside the pass that needs the activations. A nested pass on eager devices is the program's own
    reentrant checkpoint, which a later pass may follow."""
    return bool(getattr(module, "_xla_fsdp_checkpointed", False)) and device.type == "xla"


# ---------------------------------------------------------------------- backward: gather again
def register_pre_backward_hooks(rt: UnitRuntime, outputs: Any) -> Any:
    def hook(grad: torch.Tensor) -> None:
        _pre_backward(rt, grad)

    for t in tensors_in(outputs):
        if t.requires_grad:
            t.register_hook(hook)
    return outputs


def _pre_backward(rt: UnitRuntime, grad: torch.Tensor) -> None:
    if rt.state.backward_began:  # the first of its outputs' gradients gathers; the rest pass
        return
    rt.state.training_state = TrainingState.BACKWARD_PRE
    if rt.state.is_root:
        rt.root.backward_task = torch._C._current_graph_task_id()
        Variable._execution_engine.queue_callback(lambda: _finalize_backward(rt))
    listed = rt.listed_prefetch(backward=True)
    if rt.settings.optimization_barrier_in_backward:
        # Make the re-gather depend on the incoming gradient, so XLA does not hoist every
        # unit's gather to the start of backward.
        rt.comms.optimization_barrier(rt.barrier_sources(listed) + [grad])
    previous = rt.prefetch_target(-1)
    if previous is not None and previous.state.backward_began:
        previous = None  # its backward already ran (the root's, first): nothing left to gather for
    rt.unshard(backward=True, prefetch=previous, refill_saved=True)
    rt.gather_listed(listed, backward=True)


# ------------------------------------------------------------- backward: reduce-scatter as gradients become ready
@torch.no_grad()
def on_full_grad_ready(rt: UnitRuntime, group: GatherGroup, full: torch.Tensor, final: bool = False) -> None:
    """All gradient for ``group`` has been accumulated into ``full.grad``: reduce-scatter it.
    ``final``: the end of backward, where nothing more can arrive."""
    if rt.state.training_state is TrainingState.BACKWARD_PRE:
        # (a unit without a pre-backward, inside the program's reentrant checkpoint, stays IDLE)
        rt.state.training_state = TrainingState.BACKWARD_POST
    grad = full.grad
    if grad is None:
        return
    if not rt.state.require_backward_grad_sync:
        return  # no_sync: keep accumulating the full gradient
    if not final and (_more_gradient_may_come(rt) or _rest_may_come_in_a_later_pass(rt, group)
                      or group.gradient_in_later_pass):
        return  # stays in full.grad: the outer backward, or the end of backward, reduces it
    group.grad_incomplete = False
    full.grad = None
    s = rt.settings
    if rt.comms.world_size == 1 and rt.comms.num_replicas == 1:
        # Nothing to reduce (one rank): straight into the shard gradient, no bookkeeping.
        padded = grad_to_reduce(group, grad, s.gradient_predivide_factor, s.fp32_reduce_scatter)
        accumulate_shard_grad(group, shard_grad_of(group, padded, s.gradient_postdivide_factor))
        rt.reshard_after_gradient(group)
        return
    if _holds_gradients(rt):
        held = rt.root.plan.held  # twice for a module recomputed twice (reentrant checkpoint)
        held[id(group)] = held[id(group)] + grad if id(group) in held else grad
        rt.reshard_after_gradient(group)
        return
    if s.optimization_barrier_in_backward:
        rt.comms.optimization_barrier([grad])
    rt.state.pending_grads.append((group, grad))
    # Coalescing transports wait for the unit's other gradients and reduce them all in one collective.
    if not rt.comms.coalesces or len(rt.state.pending_grads) == rt.num_grad_groups:
        _reduce_pending(rt)


def _more_gradient_may_come(rt: UnitRuntime) -> bool:
    """This gradient arrived in a nested backward (a reentrant checkpoint running the backward
    of what it recomputed) that is not this unit's own recompute: the group is shared with a
    checkpointed unit (a tied weight its parent owns), or the program's own reentrant checkpoint
    ran inside the module (another call of it, or the outer backward, may still add to it).
    Reducing now would free ``full`` under that second gradient."""
    task = rt.root.backward_task
    return (task is not None and torch._C._current_graph_task_id() != task
            and not recomputes_in_a_backward_of_its_own(rt.module, rt.comms.device))


def _rest_may_come_in_a_later_pass(rt: UnitRuntime, group: GatherGroup) -> bool:
    """A nested backward (a checkpoint's recompute) left some of ``group``'s flattened members
    without gradient: a reentrant checkpoint inside the module may still compute theirs in a pass of
    its own. Only in nested passes, which run alike on every rank; in the root's pass a member
    without gradient is one this rank's forward did not use, and its group reduces now, in the
    same order as on the ranks that used it."""
    return group.grad_incomplete and torch._C._current_graph_task_id() != rt.root.backward_task


def _holds_gradients(rt: UnitRuntime) -> bool:
    """Whether ranks used different groups this step, so gradients wait for the end of backward."""
    plan = rt.root.plan
    if plan is None:
        return False
    plan.resolve()
    return not plan.uniform


def _reduce_pending(rt: UnitRuntime) -> None:
    """Start the reduce-scatter of the gradients waiting for their unit (all of them, or at the
    end of backward those of parameters that got gradients while others of the unit did not),
    free their full parameters, and finish the reduce-scatter started before it: one stays on
    the wire while the next unit's backward computes."""
    if not rt.state.pending_grads:
        return
    groups, grads = zip(*rt.state.pending_grads)
    rt.state.pending_grads = []
    started = _start_reduce(rt, list(groups), list(grads))
    for group in groups:
        rt.reshard_after_gradient(group)
    _finish_reduces(rt)
    rt.root.reduces_in_flight.extend(started)


def _start_reduce(rt: UnitRuntime, groups: List[GatherGroup], grads: List[torch.Tensor]) -> List[Any]:
    s = rt.settings
    return start_groups_reduce(groups, grads, s.gradient_predivide_factor, s.gradient_postdivide_factor,
                               s.fp32_reduce_scatter, s.solo_collective_numel)


def _finish_reduces(rt: UnitRuntime) -> None:
    """Wait for the started reduce-scatters, oldest first, and accumulate their shard gradients."""
    in_flight = rt.root.reduces_in_flight
    while in_flight:
        in_flight.pop(0).finish()


# ---------------------------------------------------------------------- end of the root's backward
def _finalize_backward(rt: UnitRuntime) -> None:
    """Runs once at the end of the root's backward: free what backward left gathered."""
    root = rt.root
    for unit in root.units:  # gradients left in full.grad by nested backward passes
        if unit.state.require_backward_grad_sync:
            for group in unit.groups:
                if group.requires_grad and group.full.grad is not None:
                    on_full_grad_ready(unit, group, group.full, final=True)
    root.backward_task = None
    plan, root.plan = root.plan, None
    if plan is not None:
        plan.resolve()  # also when no gradient arrived: every rank takes part in the sum
        if not plan.uniform:
            _reduce_agreed(rt, plan)
    for unit in root.units:  # same order on every rank: collectives still pair up
        _reduce_pending(unit)
    _finish_reduces(rt)
    for unit in root.units:
        unit.finish_unshard()  # a prefetch for a unit that did not run backward
        if freeing.at_backward_end(unit.freeing, unit.state.require_backward_grad_sync):
            unit.reshard()
        unit.state.training_state = TrainingState.IDLE
    # Host offload: gradient shards reach their host .grad (after the full parameters are freed:
    # on XLA this runs the step, and a live full parameter would be one more output of it).
    offloads = [u.offload for u in root.units if u.offload is not None]
    if offloads:
        land_gradients(offloads, rt.comms.sync)
    if rt.settings.sync_on_finalization:
        rt.comms.sync(keep_rng=False)  # the program's step marker: the seed advances as at its own


def _reduce_agreed(rt: UnitRuntime, plan: GradientPlan) -> None:
    """Ranks used different groups: reduce, in tree order on every rank, each group some rank
    has a gradient for, with zeros where this rank has none. Which ranks have one is summed
    again here (the forward's graph walk decided only that gradients had to wait)."""
    held = plan.held
    present = [int(id(g) in held) for g in plan.groups]
    counts = rt.comms.start_sum_over_ranks(present)() or present
    index = {id(g): i for i, g in enumerate(plan.groups)}
    for unit in rt.root.units:
        groups = [g for g in unit.groups if g.requires_grad and counts[index[id(g)]] > 0]
        if not groups:
            continue
        grads = [held.pop(id(g), None) for g in groups]
        grads = [
            gr if gr is not None else torch.zeros(g.full_shape, dtype=g.compute_dtype, device=unit.comms.device)
            for g, gr in zip(groups, grads)
        ]
        started = _start_reduce(unit, groups, grads)
        _finish_reduces(rt)
        rt.root.reduces_in_flight.extend(started)
