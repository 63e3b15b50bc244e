"""A unit's step hooks, in the order they run (FSDP2's ``FSDPState``): they register and call the step
methods of the unit's runtime (``runtime.UnitRuntime``, the param group), which are the only writers of
a unit's step state, and, at the root, the root context's (``root_context.RootContext``), the only
writer of what the root's units share. Forward: ``before_forward`` starts the root's step
(``_root_pre_forward``) and calls the unit's ``pre_forward``; the module runs; ``after_forward`` ends
the root's forward (the gradient plan) and calls ``post_forward``, then hooks the outputs
(``forward_failed`` instead when the module raised). Backward: the outputs' hook calls ``pre_backward``,
each group's gradient hook ``post_backward`` (registered by the runtime), and the root's backward ends
in ``_finalize_backward``. The root's set-up at its first forward is ``root_setup.py``'s."""
from __future__ import annotations

from typing import Any, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn as nn

from . import gather_group
from .base import is_unit
from .gradients import GradientPlan, map_tensors, modules_of, reachable_edges, tensors_in, used_members
from .offload import land_gradients
from .runtime import TrainingState, UnitRuntime, recomputes_in_a_backward_of_its_own


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
    """The inputs cast to the compute dtype, the root's start of a step, the unit's ``pre_forward``."""
    settings = rt.settings
    # Called from inside backward: a checkpoint recompute. Use the backward gather and keep
    # the parameters until their gradients are reduced.
    in_backward = torch._C._current_graph_task_id() != -1
    if not in_backward:
        rt.assert_state(TrainingState.IDLE)
    try:
        if settings.compute_dtype != torch.float32 and settings.cast_forward_inputs:
            cast = lambda t: t.to(settings.compute_dtype) if t.is_floating_point() else t
            args, kwargs = map_tensors(cast, args), map_tensors(cast, kwargs)
        listed = [] if in_backward else rt.listed_prefetch(backward=False)
        if settings.optimization_barrier_in_forward:
            rt.comms.optimization_barrier(rt.barrier_sources(listed))
        if in_backward:
            rt.unshard(backward=True)
        else:
            if rt.state.is_root:
                _root_pre_forward(rt)
            rt.pre_forward(listed)
    except BaseException:
        if not in_backward:  # (a refusal, a failed gather): idle and resharded again, as when the module raises
            rt.abandon_forward()
        raise
    versions = None if in_backward else [gather_group.installed_versions(g) for g in rt.groups]
    return args, kwargs, ForwardCall(in_backward, versions)


def _root_pre_forward(rt: UnitRuntime) -> None:
    """The root's forward begins a step: what the program changed since the last one refused or
    taken up, the hand-offs and the gradient plan begun."""
    root = rt.root
    _refuse_reassigned_parameters(rt)
    _refuse_parameters_added_after_wrapping(rt)
    # Parameters frozen or unfrozen since the last step: every rank must do the same.
    if any([unit.follow_requires_grad() for unit in root.units]):
        find_trainable_groups(rt)
    root.forward_starts()
    record = root.plans_gradients and torch.is_grad_enabled() and rt.state.require_backward_grad_sync
    for unit in root.units:
        for group in unit.groups:
            group.begin_forward(record)


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
    """The root's groups that train (see ``RootContext.find_trainable_groups``)."""
    rt.root.find_trainable_groups(rt.comms.world_size * rt.comms.num_replicas)


# ---------------------------------------------------------------------- forward raised
def forward_failed(rt: UnitRuntime, call: ForwardCall) -> None:
    """The module raised: this unit (the root: every unit) idle and resharded again."""
    if not call.in_backward:
        rt.abandon_forward()


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
        rt.root.forward_ends(rt.comms.compiles_step)
        end_gradient_plan(rt, outputs)
    if settings.output_dtype is not None:
        outputs = map_tensors(lambda t: t.to(settings.output_dtype) if t.is_floating_point() else t, outputs)
    if in_backward:  # a checkpoint recompute: parameters stay for this backward
        return outputs
    rt.post_forward(outputs)
    if torch.is_grad_enabled():
        outputs = register_pre_backward_hooks(rt, outputs)
    return outputs


def end_gradient_plan(rt: UnitRuntime, outputs: Any) -> None:
    """The root's forward has returned: find the groups its outputs reach and start summing
    that over ranks (the sum is waited for at the first gradient, or at the end of backward)."""
    root, schedule = rt.root, rt.root.schedule
    root.replace_plan(None)  # (the previous forward's, if it had no backward, is discarded)
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
        group.expect_gradient_in_later_pass(any(id(module) in later for ref in group.refs for module, _ in ref.slots))
    if not root.plans_gradients:
        return
    used = [used_members(g, edges, hidden, leaves) for unit in root.units for g in unit.groups if g.requires_grad]
    for group in root.trainable_groups:
        group.forward_edges.end()
    root.replace_plan(GradientPlan(root.trainable_groups, used, rt.comms.start_sum_over_ranks))


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
    if rt.state.is_root:
        rt.root.backward_begins(lambda: _finalize_backward(rt))
    rt.pre_backward(grad)


# ---------------------------------------------------------------------- end of the root's backward
def _finalize_backward(rt: UnitRuntime) -> None:
    """Runs once at the end of the root's backward: the reductions left finished, in the same order on
    every rank, and what backward left gathered freed."""
    root = rt.root
    for unit in root.units:
        unit.reduce_left_in_full()
    root.backward_ends()
    plan = root.take_plan()
    if plan is not None and plan.holds_gradients():  # (resolved also when no gradient arrived: every rank sums)
        _reduce_agreed(rt, plan)
    for unit in root.units:  # same order on every rank: collectives still pair up
        unit.reduce_pending()
    root.finish_reduces()
    for unit in root.units:
        unit.finalize_backward()
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
    present = [int(plan.has_held(g)) for g in plan.groups]
    counts = rt.comms.start_sum_over_ranks(present)() or present
    index = {id(g): i for i, g in enumerate(plan.groups)}
    for unit in rt.root.units:
        unit.reduce_agreed([g for g in unit.groups if g.requires_grad and counts[index[id(g)]] > 0], plan)
