"""One unit's parameters through a step: :class:`UnitRuntime` (FSDP2's ``FSDPParamGroup`` with its
``FSDPState``, in xla_fsdp's words).

A unit's wrapper (``XlaFullyShardedDataParallel``, or the module ``fully_shard`` converted) is a shell:
it holds one runtime, built with what it needs (module, collectives, settings, gather groups), and
hands forward and its methods to it. The runtime owns the gather groups (storage: see
``gather_group.py``), the unit's per-step state (``StepState``), the root context the units of one
root share (``RootContext``), and the steps on its groups: unshard, free after forward, free after
backward. What to free when is asked of ``freeing.py``; the forward and backward steps that move a
unit through its states are functions of a runtime in ``forward.py`` and ``backward.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from . import construction, freeing, group_values
from .backward import on_full_grad_ready
from .coalesce import start_unshard
from .gather_group import GatherGroup
from .offload import HostOffload, barrier_sources
from .schedule import TrainingState
from .settings import UnitSettings
from .step_state import RootContext, StepState
from .tensor_tree import tensors_in

#: (module, buffer name, the buffer as built, its version then, rank 0's value to take)
Rank0Buffer = Tuple[nn.Module, str, torch.Tensor, int, Callable[[], torch.Tensor]]


class UnitRuntime:
    """What one unit does to its parameters during a step, and the state that tracks it."""

    def __init__(self, module: nn.Module, comms: Any, settings: UnitSettings, groups: List[GatherGroup],
                 offload: Optional[HostOffload], run_module: Callable[..., Any],
                 rank_0_buffers: List[Rank0Buffer]) -> None:
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

    @training_state.setter
    def training_state(self, state: TrainingState) -> None:
        self.state.training_state = state

    def assert_state(self, *states: Any) -> None:
        """Raise ValueError unless the unit is in one of ``states`` (this package's ``TrainingState`` or
        torch_xla's, compared by name), as torch_xla's method does: the one check, for the step and the
        wrapper's public ``assert_state``."""
        names = [getattr(s, "name", s) for s in states]
        if self.state.training_state.name not in names:
            raise ValueError(f"xla_fsdp: unit in state {self.state.training_state.name}, expected one of {names}")

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
                self.state.unshard_in_flight = start_unshard(pending, backward, refill_saved,
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
                self.root.prefetched.append(unit)

    def prefetch_target(self, step: int) -> Optional["UnitRuntime"]:
        """The unit that ran ``step`` places after this one in the last forward (if prefetching)."""
        return self.root.schedule.neighbour(self, step) if self.settings.prefetch else None

    def barrier_sources(self, listed: List["UnitRuntime"]) -> List[torch.Tensor]:
        """What this unit's optimization barrier covers: its own sources and the listed units'. Where
        the compiler keeps barriers (TPU) they place the gathers in the step (backward's takes the
        incoming gradient), so a listed unit's gather comes here, ahead of its use, not earlier."""
        sources = barrier_sources(self.offload, self.groups)
        for unit in listed:
            sources += barrier_sources(unit.offload, unit.groups)
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
            freeing.free_when_next_starts(self.root, self)

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
                group.full.register_post_accumulate_grad_hook(functools.partial(on_full_grad_ready, self, group))
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
            group_values.finish_late_init(group)
            group_values.take_rank_0_values(group)
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
            group_values.begin_late_init(group, device)
        for _, m in construction.owned_modules(self.module):
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = construction.empty_on(b, self.comms.device)
