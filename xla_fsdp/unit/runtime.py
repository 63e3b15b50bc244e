"""One unit's parameters through a step: :class:`UnitRuntime` (FSDP2's ``FSDPParamGroup`` with its
``FSDPState``, in xla_fsdp's words).

A unit's wrapper (``XlaFullyShardedDataParallel``, or the module ``fully_shard`` converted) is a shell:
it holds one runtime, built with what it needs (module, collectives, settings, gather groups), and
hands forward and its methods to it. This file holds, in order: where a unit is in its step
(``TrainingState``, ``Schedule``: the order a root's units ran forward, ``StepState``, ``RootContext``:
what the units under one root share); the runtime, which owns the gather groups (storage: see
``gather_group.py``) and does the steps on them: unshard (and prefetch), free after forward, free after
backward; then the collectives of several groups at once (small groups share one all-gather and one
reduce-scatter on transports that coalesce) and a gradient's way to the shard (padded, divided,
accumulated). What to free when is asked of ``freeing.py``; the hooks that move a unit through its
states are ``step.py``'s, functions of a runtime.
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
from ..sharding import flatten_and_pad, pad_dim0
from .gather_group import GatherGroup
from .gradients import GradientPlan, as_shard_grad, run_post_accumulate_hooks, run_shard_hooks, tensors_in
from .offload import HostOffload
from .options import SOLO_NUMEL
from .settings import UnitSettings


# ====================================================================== where a unit is in its step
# FSDP2 keeps the same apart from its module, in ``FSDPState`` and its root's state context: one
# ``StepState`` per unit, one ``RootContext`` per root; nothing here outlives a step's logic.


class TrainingState(enum.Enum):
    """Where a unit is in its step. The unit branches on it: forward and ``summon_full_params`` refuse
    a unit that is not IDLE, a unit's later pre-backward hooks pass once it is BACKWARD_PRE, and
    backward prefetches skip units whose backward began (``StepState.backward_began``)."""
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD_PRE = "backward_pre"
    BACKWARD_POST = "backward_post"


class Schedule:
    """The order in which the units under one root ran forward, for prefetching. Backward runs
    them in reverse, so a unit prefetches its forward successor in forward and its predecessor in
    backward. Every rank records the same order, so their collectives still pair up. (What is freed
    when is ``freeing.py``'s; the rest of a step's state is the root's ``RootContext``.)"""

    def __init__(self) -> None:
        self.recording: List["UnitRuntime"] = []
        self._position: Dict[int, int] = {}
        self._order: List["UnitRuntime"] = []

    def start(self) -> None:
        """The root's forward begins: record anew."""
        self.recording = []

    def record(self, unit: "UnitRuntime") -> None:
        self.recording.append(unit)

    def end_forward(self) -> None:
        """The root's forward has returned: what was recorded becomes the order."""
        self._order, self.recording = self.recording, []
        self._position = {}
        for index, unit in enumerate(self._order):
            self._position.setdefault(id(unit), index)

    def ran_forward(self, unit: "UnitRuntime") -> bool:
        """Whether ``unit`` ran in the last forward."""
        return id(unit) in self._position

    def neighbour(self, unit: "UnitRuntime", step: int) -> Optional["UnitRuntime"]:
        index = self._position.get(id(unit))
        if index is None or not 0 <= index + step < len(self._order):
            return None
        return self._order[index + step]


@dataclass(eq=False)
class StepState:
    """One unit's per-step state."""

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


@dataclass(eq=False)
class RootContext:
    """What the units under one root share: made by the root at its first forward and handed to
    every unit under it (one object, not copies kept in step)."""

    #: the root's units (runtimes), itself first, in module order
    units: List[Any] = field(default_factory=list)
    #: each unit's original-name prefix ("" for the root), for messages that name a parameter
    prefixes: List[str] = field(default_factory=list)
    #: reduce-scatters started but not yet waited for, finished in the order they started on every rank
    reduces_in_flight: List[ReduceInFlight] = field(default_factory=list)
    #: the order the root's units ran forward, which prefetching follows
    schedule: Schedule = field(default_factory=Schedule)
    #: the unit freed when the next one starts forward, and the one that ended forward last, kept
    #: gathered for backward (``freeing.py`` hands them on)
    free_when_next_starts: Optional[Any] = None
    kept_for_backward: Optional[Any] = None
    #: units gathered this forward by another's FSDP2 prefetch list (freed at its end if unused)
    prefetched: List[Any] = field(default_factory=list)
    #: which groups get gradients in this step, agreed by the ranks (``gradients.GradientPlan``)
    plan: Optional[GradientPlan] = None
    #: the autograd graph task of the root's backward (a nested one is a reentrant checkpoint's)
    backward_task: Optional[int] = None
    #: the root's gather groups that train, and whether each forward plans which get gradients
    trainable_groups: List[GatherGroup] = field(default_factory=list)
    plans_gradients: bool = False


# ====================================================================================== the runtime
#: (module, buffer name, the buffer as built, its version then, rank 0's value to take)
Rank0Buffer = Tuple[nn.Module, str, torch.Tensor, int, Callable[[], torch.Tensor]]


class UnitRuntime:
    """What one unit does to its parameters during a step, and the state that tracks it."""

    def __init__(self, module: nn.Module, comms: Any, settings: UnitSettings, groups: List[GatherGroup],
                 offload: Optional[HostOffload], run_module: Callable[..., Any],
                 rank_0_buffers: List[Rank0Buffer], param_attrs: Dict[nn.Module, Tuple[str, ...]],
                 on_grad_ready: Callable[["UnitRuntime", GatherGroup, torch.Tensor], None]) -> None:
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
        #: the step's post-accumulate-grad hook on a training group's full parameter (``step.on_full_grad_ready``)
        self._on_grad_ready = on_grad_ready
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
                self.root.prefetched.append(unit)

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
                group.full.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, self, group))
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


# ================================================================= several groups in one collective
# Starting a unit's collectives over several gather groups at once: small groups share one
# all-gather and one reduce-scatter on transports that coalesce (fewer, larger messages); large ones get
# their own. What is started here is finished by the returned function (gathers) or
# :class:`ReduceInFlight` (reduce-scatters).


def split_for_coalescing(groups: List[GatherGroup], solo_numel: int = SOLO_NUMEL
                         ) -> Tuple[List[GatherGroup], List[GatherGroup]]:
    """(groups with collectives of their own, groups sharing one): only on coalescing transports
    and only groups under ``solo_numel`` elements share, since sharing copies the data once more."""
    if len(groups) == 1 or not groups[0].comms.coalesces:
        return list(groups), []
    shared = [g for g in groups if g.layout.padded_numel < solo_numel]
    if len(shared) < 2:
        return list(groups), []
    return [g for g in groups if g.layout.padded_numel >= solo_numel], shared


def start_groups_unshard(groups: List[GatherGroup], backward: bool = False, refill_saved: bool = False,
                  solo_numel: int = SOLO_NUMEL) -> Callable[[], None]:
    """Begin all-gathering a unit's groups; the returned function waits and installs them.

    Small groups on transports that coalesce share one collective: their shards are concatenated
    (cast to the compute dtype), gathered as ``(world_size, total)`` and each group's columns
    copied into its full parameter in rank order. The others gather straight into their own."""
    solo, shared = split_for_coalescing(groups, solo_numel)
    finishes = [g.start_unshard(backward, refill_saved) for g in solo]
    if shared:
        finishes.append(_start_shared_unshard(shared, backward, refill_saved))

    def finish_each() -> None:
        for finish in finishes:
            finish()
    return finish_each


def _start_shared_unshard(groups: List[GatherGroup], backward: bool, refill_saved: bool) -> Callable[[], None]:
    comms = groups[0].comms
    shards = [g.gather_source().detach().reshape(-1).to(g.compute_dtype) for g in groups]
    channel = groups[0].channel_backward if backward else groups[0].channel_forward
    versions = [g.shard._version for g in groups]
    wait = comms.start_all_gather(torch.cat(shards), channel)

    def finish() -> None:
        gathered = wait().view(comms.world_size, -1)
        offset = 0
        for group, shard, version in zip(groups, shards, versions):
            n = shard.numel()
            comms.fill_full(group.full, gathered[:, offset:offset + n], group.padded_shape, group._unpad)
            offset += n
            group.mark_unsharded(version)
            group.install(refill_saved)
    return finish


class ReduceInFlight:
    """A started reduce-scatter of one or more groups' gradients. :meth:`finish` waits for it,
    sums over replicas, divides and accumulates every group's block into its shard gradient."""

    def __init__(self, groups: List[GatherGroup], widths: List[int], wait: Callable[[], torch.Tensor],
                 post_divide: float):
        self.groups, self.widths, self.wait, self.post_divide = groups, widths, wait, post_divide

    def finish(self) -> None:
        group0 = self.groups[0]
        reduced = group0.comms.all_reduce_replicas(self.wait(), group0.channel_replicas)
        if len(self.groups) == 1:
            accumulate_shard_grad(group0, shard_grad_of(group0, reduced, self.post_divide))
            return
        reduced = reduced.reshape(-1)
        offset = 0
        for group, n in zip(self.groups, self.widths):
            accumulate_shard_grad(group, shard_grad_of(group, reduced[offset:offset + n], self.post_divide))
            offset += n


def start_groups_reduce(groups: List[GatherGroup], grads: List[torch.Tensor], pre_divide: float,
                 post_divide: float, fp32_reduce_scatter: bool,
                 solo_numel: int = SOLO_NUMEL) -> List[ReduceInFlight]:
    """Start the reduce-scatters of a unit's full gradients: one per large group, one for the small
    groups together (see :func:`split_for_coalescing`)."""
    solo, shared = split_for_coalescing(groups, solo_numel)
    grad_of = dict(zip(map(id, groups), grads))
    started = [_start_reduce([g], [grad_of[id(g)]], pre_divide, post_divide, fp32_reduce_scatter) for g in solo]
    if shared:
        started.append(_start_reduce(shared, [grad_of[id(g)] for g in shared], pre_divide, post_divide,
                                     fp32_reduce_scatter))
    return started


def _start_reduce(groups: List[GatherGroup], grads: List[torch.Tensor], pre_divide: float,
                  post_divide: float, fp32_reduce_scatter: bool) -> ReduceInFlight:
    """One reduce-scatter for the full gradients of ``groups`` (several groups' padded gradients
    side by side, as ``(world_size, total)`` columns, so each rank's block holds its block of every
    group)."""
    comms = groups[0].comms
    padded = [grad_to_reduce(g, grad, pre_divide, fp32_reduce_scatter) for g, grad in zip(groups, grads)]
    if len(groups) == 1:
        return ReduceInFlight(groups, [padded[0].numel() // comms.world_size],
                              comms.start_reduce_scatter(padded[0], groups[0].channel_reduce), post_divide)
    blocks = [p.reshape(comms.world_size, -1) for p in padded]
    dtype = torch.float32 if any(b.dtype == torch.float32 for b in blocks) else blocks[0].dtype
    joined = torch.cat([b.to(dtype) for b in blocks], dim=1).reshape(-1)
    return ReduceInFlight(groups, [b.shape[1] for b in blocks],
                          comms.start_reduce_scatter(joined, groups[0].channel_reduce), post_divide)


# =============================================================== a gradient on its way to the shard
# A gather group's gradient on its way to the shard: the full gradient padded to the group's layout
# and pre-divided, this rank's reduced block divided again and cast to the shard's dtype, then added to
# the shard's ``.grad`` (through the program's hooks, and to the host with offload). The reduction
# itself is ``backward.py``'s (one group) or ``coalesce.py``'s (several groups in one collective).


def grad_to_reduce(group: GatherGroup, grad: torch.Tensor, pre_divide: float,
                   fp32_reduce_scatter: bool) -> torch.Tensor:
    """The padded, pre-divided full gradient, ready to reduce-scatter."""
    padded = _pad(group, grad)  # the unit owns this gradient now: divide in place
    if pre_divide != 1:
        padded.div_(pre_divide)
    if fp32_reduce_scatter and padded.dtype != torch.float32:
        padded = padded.to(torch.float32)
    return padded


def shard_grad_of(group: GatherGroup, reduced: torch.Tensor, post_divide: float) -> torch.Tensor:
    """This rank's reduced block as a shard gradient (divided in fp32, then in the shard's dtype)."""
    if reduced.dtype != torch.float32:
        reduced = reduced.to(torch.float32)
    if post_divide != 1:
        reduced.div_(post_divide)
    if reduced.dtype != group.shard.dtype:  # param_storage_dtype=bfloat16
        reduced = reduced.to(group.shard.dtype)
    if reduced.shape == group.shard.shape:
        return reduced  # not a view: on XLA a live view and its live base are two graph outputs
    return reduced.view(group.shard.shape)


def accumulate_shard_grad(group: GatherGroup, reduced: torch.Tensor) -> None:
    """Add this rank's block to the shard's ``.grad`` (as the program's hooks change it)."""
    shard = group.shard
    reduced = run_shard_hooks(shard, reduced)
    of_shard = lambda grad: as_shard_grad(grad, group.comms, group.channel_grad_norm)
    if group.offload is not None:  # to the host (at the end of backward on XLA)
        group.offload.add_grad(shard, reduced, of_shard)
        return
    if shard.grad is None:
        shard.grad = of_shard(reduced)
    else:
        shard.grad += reduced
        of_shard(shard.grad)  # (left plain by an optimizer step that raised: see optimizer_check)
    run_post_accumulate_hooks(shard)


def _pad(group: GatherGroup, grad: torch.Tensor) -> torch.Tensor:
    layout = group.layout
    if layout.padding == 0:  # nothing to pad (one rank, or sizes that divide evenly)
        if tuple(grad.shape) == tuple(group.padded_shape):
            return grad
        padded = grad.reshape(group.padded_shape)
        # Eager: a view, no copy. Lazy (XLA): at one rank the shard gradient would be that view, and a live
        # view keeps its base live, so both would be outputs of the step graph (one more
        # full-size write per parameter); a lazy clone costs nothing, and the base is dropped.
        return padded if group.comms.views_see_refills else padded.clone()
    if group.dim0:
        return pad_dim0(grad, layout)
    if group.flat:
        return grad
    return flatten_and_pad([grad], layout)
