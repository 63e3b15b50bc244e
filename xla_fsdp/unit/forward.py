"""The forward half of a unit: the root's lazy set-up at its first forward (the units in its tree,
the same-parameters check across ranks, which groups train), then each forward: gather (and prefetch
the next unit), run the module, free or keep the full parameters, and hook the outputs for backward
(the backward half is backward.py)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from . import freeing
from .coalesce import start_unshard
from .offload import barrier_sources
from .param_names import named_units
from .schedule import TrainingState
from .tensor_tree import map_tensors, tensors_in


def _job_size(comms: Any) -> int:
    """How many ranks ``start_sum_over_ranks`` sums over: every rank of the job."""
    if comms.name == "xla":
        import torch_xla.runtime as xr
        return xr.world_size()
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else 1



class ForwardPass:
    """Forward of :class:`~xla_fsdp.XlaFullyShardedDataParallel` (a mixin: it uses the unit's
    settings, groups, collectives and step state)."""

    # ------------------------------------------------------------------ lazy root set-up
    def _lazy_init(self) -> None:
        if self.step_state.is_root is not None:
            return
        self.step_state.is_root = True
        self.step_state.units_in_tree = [unit for _, unit in named_units(self)]
        for unit in self.step_state.units_in_tree:
            if unit is not self:
                if unit.step_state.is_root:
                    raise RuntimeError("xla_fsdp: a nested unit already ran as a root; call the "
                                       "outermost wrapper only")
                unit.step_state.is_root = False
            unit.step_state.reduces_in_flight = self.step_state.reduces_in_flight
            unit.step_state.schedule = self.step_state.schedule
        for unit in self.step_state.units_in_tree:
            if getattr(unit._fsdp_wrapped_module, "_xla_fsdp_checkpointed", False):
                unit._find_shared_groups(self.step_state.units_in_tree)
        self._find_trainable_groups()
        for unit in self.step_state.units_in_tree:  # the root rule, once (see unit/freeing.py)
            unit.freeing = freeing.effective(unit.freeing, unit is self)
        self.comms.check_construction()
        for unit in self.step_state.units_in_tree:
            unit.take_deferred_values()
        self._check_same_parameters_on_every_rank()

    def _check_same_parameters_on_every_rank(self) -> None:
        """Ranks that built different parameters (a model made before seeding, or from a random
        generator the ranks share, as XLA:CPU device threads do) would train a different model on
        each rank, and replicas (NO_SHARD, hybrid) would drift apart silently. Each group's
        fingerprint, taken at construction, is summed over every rank: equal only if all agree."""
        named = [(prefix + group.names[0], group) for prefix, unit in named_units(self)
                 for group in unit.gather_groups]
        if not named:
            return
        prints = [group.current_fingerprint() for _, group in named]
        zero = torch.zeros((), dtype=torch.float32)
        bits = torch.stack([(p if p is not None else zero).to(self.comms.device) for p in prints]).cpu()
        # small numbers (sums over ranks stay in int32); 0 for a group loaded since it was built
        own = [b & 0xFFFFF if p is not None else 0 for b, p in zip(bits.view(torch.int32).tolist(), prints)]
        totals = self.comms.start_sum_over_ranks(own)()
        if totals is None:  # no cheap host channel (XLA across processes): ranks are assumed alike
            return
        everyone = _job_size(self.comms)
        for (name, _), mine, total in zip(named, own, totals):
            if total != mine * everyone:
                raise RuntimeError(
                    f"xla_fsdp: the ranks built different values for parameter '{name}' (and maybe others): each "
                    "would train a different model. Build the model the same way on every rank "
                    "(torch.manual_seed(N) right before building it; XLA:CPU device threads share one CPU random "
                    "generator, so build under a lock), or wrap with sync_module_states=True to take rank 0's "
                    "parameters and buffers.")

    def _find_trainable_groups(self) -> None:
        """The root's list of groups that train, and whether each forward must plan which of them
        get gradients: where ranks could disagree, or a flat shard could be only partly used (see
        gradient_usage.py)."""
        state = self.step_state
        state.trainable_groups = [g for u in state.units_in_tree for g in u.gather_groups if g.requires_grad]
        data_parallel = self.comms.world_size * self.comms.num_replicas
        self.step_state.plans_gradients = bool(self.step_state.trainable_groups) and (
            data_parallel > 1 or any(g.flat and len(g.refs) > 1 for g in self.step_state.trainable_groups))

    @property
    def training_state(self) -> TrainingState:
        """Where the unit is in its step (torch_xla's attribute; held in ``step_state``)."""
        return self.step_state.training_state

    @training_state.setter
    def training_state(self, state: TrainingState) -> None:
        self.step_state.training_state = state

    def assert_state(self, state: Any) -> None:
        """Raise ValueError unless the unit is in ``state`` (one state or a list; this package's
        ``TrainingState`` or torch_xla's, compared by name), as torch_xla's method does."""
        states = state if isinstance(state, (list, tuple)) else [state]
        if self.training_state.name not in {getattr(s, "name", s) for s in states}:
            raise ValueError(f"xla_fsdp: unit in state {self.training_state.name}, expected one of "
                             f"{[getattr(s, 'name', s) for s in states]}")

    def _assert_state(self, *states: TrainingState) -> None:
        if self.training_state not in states:
            raise RuntimeError(f"xla_fsdp: unit in state {self.training_state.value}, expected one of "
                               f"{[s.value for s in states]}")

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        # Called from inside backward: a checkpoint recompute. Use the backward gather and keep
        # the parameters until their gradients are reduced.
        in_backward = torch._C._current_graph_task_id() != -1
        if not in_backward:
            self._assert_state(TrainingState.IDLE)
            self.training_state = TrainingState.FORWARD
        if self.compute_dtype != torch.float32 and self.cast_forward_inputs:
            cast = lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t
            args, kwargs = map_tensors(cast, args), map_tensors(cast, kwargs)
        listed = [] if in_backward else self._listed_prefetch(backward=False)
        if self.optimization_barrier_in_forward:
            self.comms.optimization_barrier(self._barrier_sources(listed))
        if in_backward:
            self._unshard(backward=True)
        else:
            if self.step_state.is_root:
                _refuse_reassigned_parameters(self)
                # Parameters frozen or unfrozen since the last step: every rank must do the same.
                if any([unit._follow_requires_grad() for unit in self.step_state.units_in_tree]):
                    self._find_trainable_groups()
                self.step_state.schedule.recording = []
                self.step_state.schedule.prefetched = []
                self.step_state.schedule.release_kept()
                self._begin_gradient_plan()
            if self.step_state.schedule.deferred is not self:  # called again: keep what the first call gathered
                self.step_state.schedule.release_deferred()
            self.step_state.schedule.recording.append(self)
            self._unshard(prefetch=self._prefetch_target(+1))
            self._gather_listed(listed, backward=False)
        versions = None if in_backward else [g.installed_versions() for g in self.gather_groups]
        try:
            outputs = self._run_module(args, kwargs)
            if versions is not None:  # parameters the module edited in place: the edit stays, as unsharded
                for group, before in zip(self.gather_groups, versions):
                    group.keep_edits(before)
        except BaseException:
            if not in_backward:
                self._abandon_forward()
            raise
        if self.step_state.is_root and not in_backward:
            self.step_state.schedule.end_forward(self.step_state.units_in_tree,
                                                 keep_last=not self.comms.compiles_step)
            self._end_gradient_plan(outputs)
        if self.output_dtype is not None:
            outputs = map_tensors(lambda t: t.to(self.output_dtype) if t.is_floating_point() else t, outputs)
        if in_backward:  # a checkpoint recompute: parameters stay for this backward
            return outputs
        if freeing.cuts_pieces(self.freeing, torch.is_grad_enabled()):
            self._cut_pieces(outputs)
        self.free_after_forward(freeing.after_forward(self.freeing, torch.is_grad_enabled(), self.step_state.is_root))
        self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            outputs = self._register_pre_backward_hooks(outputs)
        return outputs

    def _run_module(self, args: Any, kwargs: Any) -> Any:
        """The module's call, its own hooks included (``fully_shard``'s unit calls its module's class
        forward, since calling the converted module comes back here)."""
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _abandon_forward(self) -> None:
        """The module raised during forward: leave this unit (the root: every unit) idle and
        resharded, so the next forward starts clean instead of failing on a unit stuck in forward."""
        units = self.step_state.units_in_tree if self.step_state.is_root else [self]
        for unit in units:
            unit.finish_unshard()
            unit.reshard()
            unit.training_state = TrainingState.IDLE
        if self.step_state.is_root:
            self.step_state.schedule.recording, self.step_state.schedule.prefetched = [], []
            self.step_state.schedule.deferred = self.step_state.schedule.kept = None

    def _unshard(self, backward: bool = False, prefetch: Optional["ForwardPass"] = None,
                 refill_saved: bool = False) -> None:
        """Gather this unit's parameters; start ``prefetch``'s gather behind it before waiting.
        ``refill_saved``: for the backward of the last forward (see ``GatherGroup.install``)."""
        self._start_unshard(backward, refill_saved)
        if prefetch is not None:
            prefetch._start_unshard(backward, refill_saved)
        self.finish_unshard()

    def _start_unshard(self, backward: bool, refill_saved: bool = False) -> None:
        if self.step_state.unshard_in_flight is None:
            if refill_saved:
                for group in self.gather_groups:
                    if group.is_unsharded():
                        group.refill_freed_members()
            pending = [g for g in self.gather_groups if not g.is_unsharded()]
            if pending:
                self.step_state.unshard_in_flight = start_unshard(pending, backward, refill_saved, self._solo_numel)

    @property
    def unshard_pending(self) -> bool:
        """Whether a gather of this unit's parameters was started and not yet waited for."""
        return self.step_state.unshard_in_flight is not None

    def finish_unshard(self) -> None:
        """Wait for a started gather (nothing if none is pending)."""
        finish, self.step_state.unshard_in_flight = self.step_state.unshard_in_flight, None
        if finish is not None:
            finish()

    #: FSDP2's ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` lists (fsdp2.py)
    _prefetch_forward: Sequence["ForwardPass"] = ()
    _prefetch_backward: Sequence["ForwardPass"] = ()
    #: FSDP2's default without a backward list: the unit that ran forward before this one
    _prefetch_backward_by_default = False

    def _listed_prefetch(self, backward: bool) -> List["ForwardPass"]:
        """The listed units to gather right after this one's own gather. Backward skips those whose
        backward already ran or that did not run forward (no backward will use them)."""
        if not backward:
            return list(self._prefetch_forward)
        schedule = self.step_state.schedule
        units = list(self._prefetch_backward)
        if not units and self._prefetch_backward_by_default:
            units = [u for u in [schedule.neighbour(self, -1)] if u is not None]
        return [u for u in units if schedule.ran_forward(u) and not u.step_state.backward_began]

    def _barrier_sources(self, listed: List["ForwardPass"]) -> List[torch.Tensor]:
        """What this unit's optimization barrier covers: its own sources and the listed units'. Where
        the compiler keeps barriers (TPU) they place the gathers in the step (backward's takes the
        incoming gradient), so a listed unit's gather comes here, ahead of its use, not earlier."""
        sources = barrier_sources(self._offload, self.gather_groups)
        for unit in listed:
            sources += barrier_sources(unit._offload, unit.gather_groups)
        return sources

    def _gather_listed(self, listed: List["ForwardPass"], backward: bool) -> None:
        """Gather the listed units' parameters now, behind this unit's own gather (FSDP2's explicit
        prefetch); each one's forward or backward then finds them gathered."""
        for unit in listed:
            if unit is self:
                continue
            unit._start_unshard(backward, refill_saved=backward)
            unit.finish_unshard()
            if not backward:
                self.step_state.schedule.prefetched.append(unit)

    def _prefetch_target(self, step: int) -> Optional["ForwardPass"]:
        """The unit that ran ``step`` places after this one in the last forward (if prefetching)."""
        return self.step_state.schedule.neighbour(self, step) if self.prefetch else None

    def _cut_pieces(self, outputs: Any) -> None:
        """Cut the pieces kept for backward now, behind one barrier with the outputs: the rest of
        forward reads the outputs, so a compiler that keeps barriers (TPU's) computes the pieces here
        and frees the gathered parameters, rather than fusing the cut into backward and keeping them
        alive till then (XLA:CPU's compiler removes barriers, and does the latter)."""
        pieces = [p for p in (g.cut_piece(self.freeing.pieces_within) for g in self.gather_groups) if p is not None]
        self.comms.optimization_barrier(pieces + [t for t in tensors_in(outputs) if t.is_floating_point()])

    def free_after_forward(self, action: "freeing.AfterForward") -> None:
        """Do what :func:`freeing.after_forward` (or the schedule, for a prefetched unit) decided."""
        if action is freeing.AfterForward.FREE:
            self.reshard()
        elif action is freeing.AfterForward.FREE_FOR_BACKWARD:
            self.reshard_for_backward()
        elif action is freeing.AfterForward.FREE_WHEN_NEXT_STARTS:
            self.step_state.schedule.defer_reshard(self)

    def reshard_for_backward(self) -> None:
        """Free the full parameters after forward, keeping each one's piece within the policy's
        ``pieces_within`` ranks (if set), from which backward gathers over that smaller group."""
        if self.freeing.pieces_within is None:
            self.reshard()
            return
        for group in self.gather_groups:
            group.reshard_to(self.freeing.pieces_within)

    def reshard(self) -> None:
        """Free this unit's full parameters; the shards stay (FSDP2's ``reshard()``)."""
        for group in self.gather_groups:
            group.reshard()


def _refuse_reassigned_parameters(root: Any) -> None:
    """A parameter attribute assigned after wrapping (tying ``head.weight = emb.weight`` as Hugging
    Face's ``tie_weights()`` does, or a new ``nn.Parameter``) would be dropped at the next gather and
    training would go on with the unit's own shard: refused at the root's next forward instead."""
    for unit in root.step_state.units_in_tree:
        for group in unit.gather_groups:
            found = group.reassigned_slot()
            if found is None:
                continue
            prefix = next(p for p, u in named_units(root) if u is unit)
            name, value = found
            source = getattr(value, "_xla_fsdp_name", None)
            what = f"the parameter '{source}'" if source is not None else f"a {type(value).__name__} of its own"
            raise RuntimeError(
                f"xla_fsdp: '{prefix}{name}' was given {what} after wrapping, but the unit computes with its own "
                f"shard of '{prefix}{name}': training would ignore the assignment. To tie parameters (tie_weights(), "
                "post_init), tie them before wrapping: tied parameters then share one shard. To give a parameter "
                "new values, assign or copy them inside `with XlaFullyShardedDataParallel.summon_full_params(model):`.")
