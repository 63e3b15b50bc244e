"""One unit's parameters through a step: :class:`UnitRuntime`, FSDP2's ``FSDPParamGroup`` in xla_fsdp's
words, and the only writer of the unit's step state (:class:`StepState`).

A unit's wrapper (``XlaFullyShardedDataParallel``, or the module ``fully_shard`` converted) is a shell:
it holds one runtime, built with what it needs (module, collectives, settings, gather groups), and
hands forward and its methods to it. The hooks (``step.py``, FSDP2's ``FSDPState``) call the
runtime's step methods, in order: :meth:`~UnitRuntime.pre_forward`, :meth:`~UnitRuntime.post_forward`,
:meth:`~UnitRuntime.pre_backward`, :meth:`~UnitRuntime.post_backward` (a group's gradient is ready),
:meth:`~UnitRuntime.finalize_backward`; each gathers (:meth:`~UnitRuntime.unshard`) or frees
(:meth:`~UnitRuntime.reshard`) the unit's gather groups (storage: ``gather_group.py``) as its freeing
policy says (``freeing.py``), and moves the unit's state. What the units of one root share is the
root's context (``root_context.py``); the collectives are ``group_comms.py``'s.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from . import construction, freeing, gather_group
from .gather_group import GatherGroup
from .group_comms import accumulate_shard_grad, grad_to_reduce, shard_grad_of, start_groups_reduce, start_groups_unshard
from .gradients import GradientPlan, tensors_in
from .offload import HostOffload
from .root_context import RootContext
from .settings import UnitSettings


class TrainingState(enum.Enum):
    """Where a unit is in its step. The unit branches on it: forward and ``summon_full_params`` refuse
    a unit that is not IDLE, a unit's later pre-backward hooks pass once it is BACKWARD_PRE, and
    backward prefetches skip units whose backward began (``StepState.backward_began``)."""
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD_PRE = "backward_pre"
    BACKWARD_POST = "backward_post"


@dataclass(eq=False)
class StepState:
    """One unit's per-step state, written by its :class:`UnitRuntime`'s methods only."""

    #: IDLE / FORWARD / BACKWARD_PRE / BACKWARD_POST (``unit.training_state``, torch_xla's name)
    training_state: TrainingState = TrainingState.IDLE
    #: whether this unit is the root: None until its first forward decides
    is_root: Optional[bool] = None
    #: False inside ``no_sync()``: gradients accumulate unreduced
    require_backward_grad_sync: bool = True
    #: full gradients that are ready, waiting for the unit's other groups to reduce together
    pending_grads: List[Tuple[GatherGroup, torch.Tensor]] = field(default_factory=list)
    #: a started gather (a prefetch) to wait for
    unshard_in_flight: Optional[Callable[[], None]] = None

    @property
    def backward_began(self) -> bool:
        """Whether this step's backward reached the unit (its parameters were gathered for it)."""
        return self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)


def recomputes_in_a_backward_of_its_own(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether ``checkpoint_module`` made ``module`` recompute in a nested backward pass: torch_xla's
    checkpoint (XLA devices) is reentrant; PyTorch's non-reentrant one (eager devices) recomputes
    inside the pass that needs the activations. A nested pass on eager devices is the program's own
    reentrant checkpoint, which a later pass may follow."""
    return bool(getattr(module, "_xla_fsdp_checkpointed", False)) and device.type == "xla"


# ====================================================================================== the runtime
#: (module, buffer name, the buffer as built, its version then, rank 0's value to take)
Rank0Buffer = Tuple[nn.Module, str, torch.Tensor, int, Callable[[], torch.Tensor]]


class UnitRuntime:
    """What one unit does to its parameters during a step, and the state that tracks it."""

    def __init__(self, module: nn.Module, comms: Any, settings: UnitSettings, groups: List[GatherGroup],
                 offload: Optional[HostOffload], run_module: Callable[..., Any],
                 rank_0_buffers: List[Rank0Buffer], param_attrs: Dict[nn.Module, Tuple[str, ...]]) -> None:
        #: the wrapped module (its call, ``run_module``, is the unit's forward with parameters gathered)
        self.module = module
        self.comms = comms
        #: frozen; replaced, never edited (see settings.py)
        self.settings = settings
        self.groups = groups
        self.offload = offload
        self.run_module = run_module
        self.state = StepState()
        #: what the units under this unit's root share; its own until a root's first forward hands out its own
        self.root = RootContext()
        #: FSDP2's ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` lists (runtimes)
        self.prefetch_forward: Sequence["UnitRuntime"] = ()
        self.prefetch_backward: Sequence["UnitRuntime"] = ()
        #: FSDP2's default without a backward list: the unit that ran forward before this one
        self.prefetch_backward_by_default = False
        #: groups of units outside this one that its modules hold (tied weights a parent owns), for a
        #: reentrant checkpoint's recompute
        self.shared_groups: List[GatherGroup] = []
        #: groups that train, which a coalescing transport reduces together
        self.num_grad_groups = 0
        self._rank_0_buffers = rank_0_buffers
        #: the parameter attributes each module the unit owns held at wrapping (a later one is no unit's)
        self.param_attrs = param_attrs
        self._watched: Set[int] = set()  # ids of groups whose full parameter has the gradient hook
        self._module_ids: Optional[Set[int]] = None

    # ------------------------------------------------------------------ states
    @property
    def freeing(self) -> freeing.FreeingPolicy:
        return self.settings.freeing

    def replace_settings(self, **changes: Any) -> None:
        self.settings = dataclasses.replace(self.settings, **changes)

    @property
    def training_state(self) -> TrainingState:
        return self.state.training_state

    def assert_state(self, *states: Any) -> None:
        """Raise ValueError unless the unit is in one of ``states`` (this package's ``TrainingState`` or
        torch_xla's, compared by name), as torch_xla's method does: the one check, for the step and the
        wrapper's public ``assert_state``."""
        names = [getattr(s, "name", s) for s in states]
        if self.state.training_state.name not in names:
            raise ValueError(f"xla_fsdp: unit in state {self.state.training_state.name}, expected one of {names}")

    def join_root(self, root: RootContext, is_root: bool) -> None:
        """The root's first forward hands this unit the root's context (``root_setup.lazy_init``)."""
        if not is_root and self.state.is_root:
            raise RuntimeError("xla_fsdp: a nested unit already ran as a root; call the outermost wrapper only")
        self.state.is_root = is_root
        self.root = root

    def set_requires_gradient_sync(self, value: bool) -> None:
        """False (``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``): gradients accumulate unreduced."""
        self.state.require_backward_grad_sync = bool(value)

    # ------------------------------------------------------------------ the step, in order
    def pre_forward(self, listed: List["UnitRuntime"]) -> None:
        """The unit's forward begins (not a checkpoint's recompute): gathered, its forward successor's
        gather started behind its own, and the ``listed`` prefetch gathered."""
        self.state.training_state = TrainingState.FORWARD
        self.root.unit_forward_starts(self)
        self.unshard(prefetch=self.prefetch_target(+1))
        self.gather_listed(listed, backward=False)

    def post_forward(self, outputs: Any) -> None:
        """The unit's forward has returned: the full parameters freed or kept, as the policy says."""
        grad_enabled = torch.is_grad_enabled()
        if freeing.cuts_pieces(self.freeing, grad_enabled):
            self.cut_pieces(outputs)
        self.free_after_forward(freeing.after_forward(self.freeing, grad_enabled, self.state.is_root))
        self.state.training_state = TrainingState.IDLE

    def abandon_forward(self) -> None:
        """The module raised during forward (or a refusal before it): this unit (the root: every
        unit) idle and resharded, so the next forward starts clean instead of failing on a unit stuck
        in forward."""
        for unit in self.root.units if self.state.is_root else [self]:
            unit.finish_unshard()
            unit.reshard()
            unit.state.training_state = TrainingState.IDLE
        if self.state.is_root:
            self.root.forward_abandoned()

    def pre_backward(self, grad: torch.Tensor) -> None:
        """The first gradient of the unit's outputs arrived: gather again (the forward predecessor's
        gather started behind it), and the listed prefetch."""
        self.state.training_state = TrainingState.BACKWARD_PRE
        listed = self.listed_prefetch(backward=True)
        if self.settings.optimization_barrier_in_backward:
            # Make the re-gather depend on the incoming gradient, so XLA does not hoist every
            # unit's gather to the start of backward.
            self.comms.optimization_barrier(self.barrier_sources(listed) + [grad])
        previous = self.prefetch_target(-1)
        if previous is not None and previous.state.backward_began:
            previous = None  # its backward already ran (the root's, first): nothing left to gather for
        self.unshard(backward=True, prefetch=previous, refill_saved=True)
        self.gather_listed(listed, backward=True)

    @torch.no_grad()
    def post_backward(self, group: GatherGroup, full: torch.Tensor, final: bool = False) -> None:
        """All gradient for ``group`` has been accumulated into ``full.grad`` (its post-accumulate-grad
        hook): reduce-scatter it. ``final``: the end of backward, where nothing more can arrive."""
        if self.state.training_state is TrainingState.BACKWARD_PRE:
            # (a unit without a pre-backward, inside the program's reentrant checkpoint, stays IDLE)
            self.state.training_state = TrainingState.BACKWARD_POST
        grad = full.grad
        if grad is None:
            return
        if not self.state.require_backward_grad_sync:
            return  # no_sync: keep accumulating the full gradient
        if not final and (self._more_gradient_may_come() or self._rest_may_come_in_a_later_pass(group)
                          or group.gradient_in_later_pass):
            return  # stays in full.grad: the outer backward, or the end of backward, reduces it
        group.gradient_taken()
        full.grad = None
        s = self.settings
        if self.comms.world_size == 1 and self.comms.num_replicas == 1:
            # Nothing to reduce (one rank): straight into the shard gradient, no bookkeeping.
            padded = grad_to_reduce(group, grad, s.gradient_predivide_factor, s.fp32_reduce_scatter)
            accumulate_shard_grad(group, shard_grad_of(group, padded, s.gradient_postdivide_factor))
            self.reshard_after_gradient(group)
            return
        plan = self.root.plan
        if plan is not None and plan.holds_gradients():
            plan.hold(group, grad)
            self.reshard_after_gradient(group)
            return
        if s.optimization_barrier_in_backward:
            self.comms.optimization_barrier([grad])
        self.state.pending_grads.append((group, grad))
        # Coalescing transports wait for the unit's other gradients and reduce them all in one collective.
        if not self.comms.coalesces or len(self.state.pending_grads) == self.num_grad_groups:
            self.reduce_pending()

    def _more_gradient_may_come(self) -> bool:
        """This gradient arrived in a nested backward (a reentrant checkpoint running the backward
        of what it recomputed) that is not this unit's own recompute: the group is shared with a
        checkpointed unit (a tied weight its parent owns), or the program's own reentrant checkpoint
        ran inside the module (another call of it, or the outer backward, may still add to it).
        Reducing now would free ``full`` under that second gradient."""
        task = self.root.backward_task
        return (task is not None and torch._C._current_graph_task_id() != task
                and not recomputes_in_a_backward_of_its_own(self.module, self.comms.device))

    def _rest_may_come_in_a_later_pass(self, group: GatherGroup) -> bool:
        """A nested backward (a checkpoint's recompute) left some of ``group``'s flattened members
        without gradient: a reentrant checkpoint inside the module may still compute theirs in a pass of
        its own. Only in nested passes, which run alike on every rank; in the root's pass a member
        without gradient is one this rank's forward did not use, and its group reduces now, in the
        same order as on the ranks that used it."""
        return group.grad_incomplete and torch._C._current_graph_task_id() != self.root.backward_task

    def reduce_pending(self) -> None:
        """Start the reduce-scatter of the gradients waiting for their unit (all of them, or at the
        end of backward those of parameters that got gradients while others of the unit did not),
        free their full parameters, and finish the reduce-scatter started before it: one stays on
        the wire while the next unit's backward computes."""
        if not self.state.pending_grads:
            return
        groups, grads = zip(*self.state.pending_grads)
        self.state.pending_grads = []
        started = self._start_reduce(list(groups), list(grads))
        for group in groups:
            self.reshard_after_gradient(group)
        self.root.finish_reduces()
        self.root.reduces_started(started)

    def reduce_left_in_full(self) -> None:
        """The end of the root's backward: gradients nested backward passes left in ``full.grad``."""
        if self.state.require_backward_grad_sync:
            for group in self.groups:
                if group.requires_grad and group.full.grad is not None:
                    self.post_backward(group, group.full, final=True)

    def reduce_agreed(self, groups: List[GatherGroup], plan: GradientPlan) -> None:
        """Ranks used different groups: reduce ``groups`` (those of this unit some rank has a gradient
        for), with the gradients ``plan`` held and zeros where this rank has none."""
        if not groups:
            return
        grads = [plan.take_held(g) for g in groups]
        grads = [gr if gr is not None else torch.zeros(g.full_shape, dtype=g.compute_dtype, device=self.comms.device)
                 for g, gr in zip(groups, grads)]
        started = self._start_reduce(groups, grads)
        self.root.finish_reduces()
        self.root.reduces_started(started)

    def _start_reduce(self, groups: List[GatherGroup], grads: List[torch.Tensor]) -> List[Any]:
        s = self.settings
        return start_groups_reduce(groups, grads, s.gradient_predivide_factor, s.gradient_postdivide_factor,
                                   s.fp32_reduce_scatter, s.solo_collective_numel)

    def finalize_backward(self) -> None:
        """The root's backward has ended (its reductions finished): free what the policy frees, idle."""
        self.finish_unshard()  # a prefetch for a unit that did not run backward
        if freeing.at_backward_end(self.freeing, self.state.require_backward_grad_sync):
            self.reshard()
        self.state.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------ unshard
    def unshard(self, backward: bool = False, prefetch: Optional["UnitRuntime"] = None,
                refill_saved: bool = False) -> None:
        """Gather this unit's parameters; start ``prefetch``'s gather behind it before waiting.
        ``refill_saved``: for the backward of the last forward (see ``GatherGroup.install``)."""
        self.start_unshard(backward, refill_saved)
        if prefetch is not None:
            prefetch.start_unshard(backward, refill_saved)
        self.finish_unshard()

    def start_unshard(self, backward: bool, refill_saved: bool = False) -> None:
        if self.state.unshard_in_flight is None:
            if refill_saved:
                for group in self.groups:
                    if group.is_unsharded():
                        group.refill_freed_members()
            pending = [g for g in self.groups if not g.is_unsharded()]
            if pending:
                self.state.unshard_in_flight = start_groups_unshard(pending, backward, refill_saved,
                                                             self.settings.solo_collective_numel)

    @property
    def unshard_pending(self) -> bool:
        """Whether a gather was started (a prefetch) and not yet waited for."""
        return self.state.unshard_in_flight is not None

    def finish_unshard(self) -> None:
        """Wait for a started gather (nothing if none is pending)."""
        finish, self.state.unshard_in_flight = self.state.unshard_in_flight, None
        if finish is not None:
            finish()

    def listed_prefetch(self, backward: bool) -> List["UnitRuntime"]:
        """The listed units to gather right after this one's own gather. Backward skips those whose
        backward already ran or that did not run forward (no backward will use them)."""
        if not backward:
            return list(self.prefetch_forward)
        schedule = self.root.schedule
        units = list(self.prefetch_backward)
        if not units and self.prefetch_backward_by_default:
            units = [u for u in [schedule.neighbour(self, -1)] if u is not None]
        return [u for u in units if schedule.ran_forward(u) and not u.state.backward_began]

    def gather_listed(self, listed: List["UnitRuntime"], backward: bool) -> None:
        """Gather the listed units' parameters now, behind this unit's own gather (FSDP2's explicit
        prefetch); each one's forward or backward then finds them gathered."""
        for unit in listed:
            if unit is self:
                continue
            unit.start_unshard(backward, refill_saved=backward)
            unit.finish_unshard()
            if not backward:
                self.root.gathered_by_prefetch(unit)

    def prefetch_target(self, step: int) -> Optional["UnitRuntime"]:
        """The unit that ran ``step`` places after this one in the last forward (if prefetching)."""
        return self.root.schedule.neighbour(self, step) if self.settings.prefetch else None

    def barrier_sources(self, listed: List["UnitRuntime"]) -> List[torch.Tensor]:
        """What this unit's optimization barrier covers: its own sources and the listed units'. Where
        the compiler keeps barriers (TPU) they place the gathers in the step (backward's takes the
        incoming gradient), so a listed unit's gather comes here, ahead of its use, not earlier."""
        sources: List[torch.Tensor] = []
        for unit in [self, *listed]:
            offload = unit.offload
            sources += [g.shard for g in unit.groups] if offload is None else offload.barrier_sources(unit.groups)
        return sources

    # ------------------------------------------------------------------ free
    def cut_pieces(self, outputs: Any) -> None:
        """Cut the pieces kept for backward now, behind one barrier with the outputs: the rest of
        forward reads the outputs, so a compiler that keeps barriers (TPU's) computes the pieces here
        and frees the gathered parameters, rather than fusing the cut into backward and keeping them
        alive till then (XLA:CPU's compiler removes barriers, and does the latter)."""
        pieces = [p for p in (g.cut_piece(self.freeing.pieces_within) for g in self.groups) if p is not None]
        self.comms.optimization_barrier(pieces + [t for t in tensors_in(outputs) if t.is_floating_point()])

    def free_after_forward(self, action: freeing.AfterForward) -> None:
        """Do what :func:`freeing.after_forward` (or the schedule, for a prefetched unit) decided."""
        if action is freeing.AfterForward.FREE:
            self.reshard()
        elif action is freeing.AfterForward.FREE_FOR_BACKWARD:
            self.reshard_for_backward()
        elif action is freeing.AfterForward.FREE_WHEN_NEXT_STARTS:
            self.root.free_when_next_starts(self)

    def reshard_for_backward(self) -> None:
        """Free the full parameters after forward, keeping each one's piece within the policy's
        ``pieces_within`` ranks (if set), from which backward gathers over that smaller group."""
        if self.freeing.pieces_within is None:
            self.reshard()
            return
        for group in self.groups:
            group.reshard_to(self.freeing.pieces_within)

    def reshard(self) -> None:
        """Free this unit's full parameters; the shards stay."""
        for group in self.groups:
            group.reshard()

    def reshard_after_gradient(self, group: GatherGroup) -> None:
        if freeing.after_gradient(self.freeing):
            group.reshard()

    # ------------------------------------------------------------------ which groups train
    def follow_requires_grad(self) -> bool:
        """Take up ``requires_grad`` changes the program made since the last forward (freezing or
        unfreezing after wrapping); a group that trains gets its gradient hook once. Returns
        whether any group changed."""
        changed = False
        for group in self.groups:
            changed |= group.follow_requires_grad()
            if group.requires_grad and id(group) not in self._watched:
                group.full.register_post_accumulate_grad_hook(functools.partial(self.post_backward, group))
                self._watched.add(id(group))
        self.num_grad_groups = sum(g.requires_grad for g in self.groups)
        return changed

    def module_ids(self) -> Set[int]:
        """Ids of the modules under this unit (nested units' included); fixed once wrapped."""
        if self._module_ids is None:
            self._module_ids = {id(m) for m in self.module.modules()}
        return self._module_ids

    def find_shared_groups(self, units: List["UnitRuntime"]) -> None:
        """Groups of units outside this one that this unit's modules hold: tied weights a parent owns."""
        inside = self.module_ids()
        self.shared_groups = [g for u in units if u is not self and id(u.module) not in inside for g in u.groups
                              if any(id(m) in inside for ref in g.refs for m, _ in ref.slots)]

    def before_recompute(self) -> None:
        """torch_xla's checkpoint recomputes this unit's module inside backward, bypassing the
        unit: gather its parameters again, and the tied ones a parent owns, which the parent may
        have reduced and freed already (a gradient from the parent's own use came first)."""
        self.unshard(backward=True)
        for group in self.shared_groups:
            group.unshard(backward=True)

    # ------------------------------------------------------------------ values left since construction
    def take_deferred_values(self) -> None:
        """The values left to take since construction: what the program's own init wrote after
        ``to_empty`` (FSDP2's meta-init order, :meth:`begin_late_init`), and rank 0's parameters and
        buffers (``sync_module_states`` with rank threads). What was written since (a checkpoint
        loaded into the shards) is kept. Called before anything reads the shards: the root's first
        forward, ``summon_full_params``, ``state_dict``."""
        for group in self.groups:
            gather_group.finish_late_init(group)
            gather_group.take_rank_0_values(group)
        buffers, self._rank_0_buffers = self._rank_0_buffers, []
        with torch.no_grad():
            for m, name, built, version, take in buffers:
                value, now = take(), m._buffers.get(name)
                if now is not None and not (now is built and now._version != version):
                    now.copy_(value)

    def begin_late_init(self, device: torch.device) -> None:
        """``to_empty`` on a sharded module (FSDP2's meta-init order: shard on the meta device, then
        ``to_empty`` and the program's init): the module's parameter attributes become full-size
        uninitialized parameters on ``device`` until :meth:`take_deferred_values` shards what the
        init wrote; its buffers get uninitialized storage there, as ``nn.Module.to_empty`` gives.
        On XLA the full tensors are lazy: the device computes each one where its shard is cut."""
        for group in self.groups:
            gather_group.begin_late_init(group, device)
        for _, m in construction.owned_modules(self.module):
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = construction.empty_on(b, self.comms.device)


