"""The backward half of a unit: gather before its backward, reduce-scatter its gradients as
they become ready (one reduce-scatter left on the wire while the next unit computes), and free
what backward left gathered once the root's backward ends."""
from __future__ import annotations

from typing import Any, List, Optional, Set

import torch
from torch.autograd import Variable

from . import freeing
from .offload import land_gradients
from .coalesce import start_reduce
from .gather_group import GatherGroup
from .schedule import TrainingState
from .tensor_tree import tensors_in
from .gradient_usage import GradientPlan, modules_of, reachable_edges, used_members



def recomputes_in_a_backward_of_its_own(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``checkpoint_module`` made ``module`` recompute in a nested backward pass: torch_xla's
    checkpoint (XLA devices) is reentrant; PyTorch's non-reentrant one (eager devices) recomputes
    inside the pass that needs the activations. A nested pass on eager devices is the program's own
    reentrant checkpoint, which a later pass may follow."""
    return bool(getattr(module, "_xla_fsdp_checkpointed", False)) and device.type == "xla"

class GradientReduction:
    """Backward hooks of :class:`~xla_fsdp.XlaFullyShardedDataParallel` (a mixin: it uses the
    unit's groups, collectives, schedule and divide factors)."""

    _module_id_cache: Optional[Set[int]] = None
    _shared_groups: List[GatherGroup] = []

    # --- which groups get gradients this step (see gradient_usage.py) -----------------------------------
    def _begin_gradient_plan(self) -> None:
        """The root's forward begins."""
        state = self.step_state
        record = state.plans_gradients and torch.is_grad_enabled() and state.require_backward_grad_sync
        for unit in self.step_state.units_in_tree:
            for group in unit.gather_groups:
                group.begin_forward(record)

    def _end_gradient_plan(self, outputs: Any) -> None:
        """The root's forward has returned: find the groups its outputs reach and start summing
        that over ranks (the sum is waited for at the first gradient, or at the end of backward)."""
        if self.step_state.schedule.plan is not None:  # the previous forward had no backward
            self.step_state.schedule.plan.discard()
        self.step_state.schedule.plan = None
        state = self.step_state
        if not (torch.is_grad_enabled() and state.require_backward_grad_sync):
            return
        # Walked also where no plan is made (one rank): a program's own reentrant checkpoint must
        # keep the groups it uses gathered until its later backward pass.
        recomputed: List[Any] = []
        edges = reachable_edges(outputs, recomputed)
        # torch_xla's checkpoint is reentrant: what it recomputes is not in this graph. Every
        # parameter the modules of a unit that ran under it hold counts as used (its own, and a
        # tied one its parent owns). So do those of the program's own reentrant checkpoints: the
        # modules its function runs, or, for another function, every unit that ran.
        hidden: Set[int] = set()
        ran = [unit for unit in self.step_state.units_in_tree if self.step_state.schedule.ran_forward(unit)]
        for unit in ran:
            if recomputes_in_a_backward_of_its_own(unit._fsdp_wrapped_module, unit.comms.device):
                hidden |= unit._module_ids()
        later: Set[int] = set()
        for function in recomputed:
            modules = modules_of(function)
            later |= modules if modules is not None else set().union(*[unit._module_ids() for unit in ran])
        hidden |= later
        for group in self.step_state.trainable_groups:
            group.gradient_in_later_pass = any(id(module) in later for ref in group.refs for module, _ in ref.slots)
        if not state.plans_gradients:
            return
        used = [used_members(g, edges, hidden)
                for unit in self.step_state.units_in_tree for g in unit.gather_groups if g.requires_grad]
        for group in self.step_state.trainable_groups:
            group.end_edge_record()
        self.step_state.schedule.plan = GradientPlan(self.step_state.trainable_groups, used,
                                                     self.comms.start_sum_over_ranks)

    def _module_ids(self) -> Set[int]:
        """Ids of the modules under this unit (nested units' included); fixed once wrapped."""
        if self._module_id_cache is None:
            self._module_id_cache = {id(m) for m in self._fsdp_wrapped_module.modules()}
        return self._module_id_cache

    def _find_shared_groups(self, units: List[Any]) -> None:
        """Groups of units outside this one that this unit's modules hold: tied weights a parent owns."""
        inside = self._module_ids()
        self._shared_groups = [g for u in units if u is not self and id(u) not in inside for g in u.gather_groups
                               if any(id(m) in inside for ref in g.refs for m, _ in ref.slots)]

    def _before_recompute(self) -> None:
        """torch_xla's checkpoint recomputes this unit's module inside backward, bypassing the
        unit: gather its parameters again, and the tied ones a parent owns, which the parent may
        have reduced and freed already (a gradient from the parent's own use came first)."""
        self._unshard(backward=True)
        for group in self._shared_groups:
            group.unshard(backward=True)

    def _holds_gradients(self) -> bool:
        """Whether ranks used different groups this step, so gradients wait for the end of backward."""
        plan = self.step_state.schedule.plan
        if plan is None:
            return False
        plan.resolve()
        return not plan.uniform

    def _reduce_agreed(self, plan: GradientPlan) -> None:
        """Ranks used different groups: reduce, in tree order on every rank, each group some rank
        has a gradient for, with zeros where this rank has none. Which ranks have one is summed
        again here (the forward's graph walk decided only that gradients had to wait)."""
        held = plan.held
        present = [int(id(g) in held) for g in plan.groups]
        counts = self.comms.start_sum_over_ranks(present)() or present
        index = {id(g): i for i, g in enumerate(plan.groups)}
        for unit in self.step_state.units_in_tree:
            groups = [g for g in unit.gather_groups if g.requires_grad and counts[index[id(g)]] > 0]
            if not groups:
                continue
            grads = [held.pop(id(g), None) for g in groups]
            grads = [
                gr if gr is not None else torch.zeros(g.full_shape, dtype=g.compute_dtype, device=unit.comms.device)
                for g, gr in zip(groups, grads)
            ]
            started = start_reduce(groups, grads, unit.gradient_predivide_factor, unit.gradient_postdivide_factor,
                                   unit.fp32_reduce_scatter, unit._solo_numel)
            self._finish_reduces()
            self.step_state.reduces_in_flight.extend(started)

    def _register_pre_backward_hooks(self, outputs: Any) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._pre_backward(grad)

        for t in tensors_in(outputs):
            if t.requires_grad:
                t.register_hook(hook)
        return outputs

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.step_state.backward_began:  # the first of its outputs' gradients gathers; the rest pass
            return
        self.training_state = TrainingState.BACKWARD_PRE
        if self.step_state.is_root:
            self.step_state.schedule.backward_task = torch._C._current_graph_task_id()
            Variable._execution_engine.queue_callback(self._finalize_backward)
        listed = self._listed_prefetch(backward=True)
        if self.optimization_barrier_in_backward:
            # Make the re-gather depend on the incoming gradient, so XLA does not hoist every
            # unit's gather to the start of backward.
            self.comms.optimization_barrier(self._barrier_sources(listed) + [grad])
        previous = self._prefetch_target(-1)
        if previous is not None and previous.step_state.backward_began:
            previous = None  # its backward already ran (the root's, first): nothing left to gather for
        self._unshard(backward=True, prefetch=previous, refill_saved=True)
        self._gather_listed(listed, backward=True)

    def _more_gradient_may_come(self) -> bool:
        """This gradient arrived in a nested backward (a reentrant checkpoint running the backward
        of what it recomputed) that is not this unit's own recompute: the group is shared with a
        checkpointed unit (a tied weight its parent owns), or the program's own reentrant checkpoint
        ran inside the module (another call of it, or the outer backward, may still add to it).
        Reducing now would free ``full`` under that second gradient."""
        task = self.step_state.schedule.backward_task
        return (task is not None and torch._C._current_graph_task_id() != task
                and not recomputes_in_a_backward_of_its_own(self._fsdp_wrapped_module, self.comms.device))

    def _rest_may_come_in_a_later_pass(self, group: GatherGroup) -> bool:
        """A nested backward (a checkpoint's recompute) left some of ``group``'s flattened members
        without gradient: a reentrant checkpoint inside the module may still compute theirs in a pass of
        its own. Only in nested passes, which run alike on every rank; in the root's pass a member
        without gradient is one this rank's forward did not use, and its group reduces now, in the
        same order as on the ranks that used it."""
        return group.grad_incomplete and torch._C._current_graph_task_id() != self.step_state.schedule.backward_task

    @torch.no_grad()
    def _on_full_grad_ready(self, group: GatherGroup, full: torch.Tensor, final: bool = False) -> None:
        """All gradient for ``group`` has been accumulated into ``full.grad``: reduce-scatter it.
        ``final``: the end of backward, where nothing more can arrive."""
        if self.training_state is TrainingState.BACKWARD_PRE:
            # (a unit without a pre-backward, inside the program's reentrant checkpoint, stays IDLE)
            self.training_state = TrainingState.BACKWARD_POST
        grad = full.grad
        if grad is None:
            return
        if not self.step_state.require_backward_grad_sync:
            return  # no_sync: keep accumulating the full gradient
        if not final and (self._more_gradient_may_come() or self._rest_may_come_in_a_later_pass(group)
                          or group.gradient_in_later_pass):
            return  # stays in full.grad: the outer backward, or the end of backward, reduces it
        group.grad_incomplete = False
        full.grad = None
        if self.comms.world_size == 1 and self.comms.num_replicas == 1:
            # Nothing to reduce (one rank): straight into the shard gradient, no bookkeeping.
            padded = group.prepare_grad(grad, self.gradient_predivide_factor, self.fp32_reduce_scatter)
            group.accumulate_shard_grad(group.finish_grad(padded, self.gradient_postdivide_factor))
            self._reshard_after_backward(group)
            return
        if self._holds_gradients():
            held = self.step_state.schedule.plan.held  # twice for a module recomputed twice (reentrant checkpoint)
            held[id(group)] = held[id(group)] + grad if id(group) in held else grad
            self._reshard_after_backward(group)
            return
        if self.optimization_barrier_in_backward:
            self.comms.optimization_barrier([grad])
        self.step_state.pending_grads.append((group, grad))
        # Coalescing transports wait for the unit's other gradients and reduce them all in one collective.
        if not self.comms.coalesces or len(self.step_state.pending_grads) == self._num_grad_groups:
            self._reduce_pending()

    def _reduce_pending(self) -> None:
        """Start the reduce-scatter of the gradients waiting for their unit (all of them, or at the
        end of backward those of parameters that got gradients while others of the unit did not),
        free their full parameters, and finish the reduce-scatter started before it: one stays on
        the wire while the next unit's backward computes."""
        if not self.step_state.pending_grads:
            return
        groups, grads = zip(*self.step_state.pending_grads)
        self.step_state.pending_grads = []
        started = start_reduce(list(groups), list(grads), self.gradient_predivide_factor,
                               self.gradient_postdivide_factor, self.fp32_reduce_scatter, self._solo_numel)
        for group in groups:
            self._reshard_after_backward(group)
        self._finish_reduces()
        self.step_state.reduces_in_flight.extend(started)

    def _reshard_after_backward(self, group: GatherGroup) -> None:
        if freeing.after_gradient(self.freeing):
            group.reshard()

    def _finish_reduces(self) -> None:
        """Wait for the started reduce-scatters, oldest first, and accumulate their shard gradients."""
        while self.step_state.reduces_in_flight:
            self.step_state.reduces_in_flight.pop(0).finish()

    def _finalize_backward(self) -> None:
        """Runs once at the end of the root's backward: free what backward left gathered."""
        for unit in self.step_state.units_in_tree:  # gradients left in full.grad by nested backward passes
            if unit.step_state.require_backward_grad_sync:
                for group in unit.gather_groups:
                    if group.requires_grad and group.full.grad is not None:
                        unit._on_full_grad_ready(group, group.full, final=True)
        self.step_state.schedule.backward_task = None
        plan, self.step_state.schedule.plan = self.step_state.schedule.plan, None
        if plan is not None:
            plan.resolve()  # also when no gradient arrived: every rank takes part in the sum
            if not plan.uniform:
                self._reduce_agreed(plan)
        for unit in self.step_state.units_in_tree:  # same order on every rank: collectives still pair up
            unit._reduce_pending()
        self._finish_reduces()
        for unit in self.step_state.units_in_tree:
            unit.finish_unshard()  # a prefetch for a unit that did not run backward
            if freeing.at_backward_end(unit.freeing, unit.step_state.require_backward_grad_sync):
                unit.reshard()
            unit.training_state = TrainingState.IDLE
        # Host offload: gradient shards reach their host .grad (after the full parameters are freed:
        # on XLA this runs the step, and a live full parameter would be one more output of it).
        land_gradients([u._offload for u in self.step_state.units_in_tree if u._offload is not None], self.comms.sync)
        if self.sync_on_finalization:
            self.comms.sync(keep_rng=False)  # the program's step marker: the seed advances as at its own
