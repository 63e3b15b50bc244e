"""A gather group: the parameters one all-gather fetches (not an optimizer's param group, not a group
of ranks), with the sharded fp32 master and the full compute-dtype copy.

A gather group is either several parameters flattened into one padded buffer (``flatten_parameters``) or
a single parameter (padded flat, or split on dim 0). The optimizer sees only ``shard``; the wrapped
module sees ``full`` (or views of it) through plain attributes that replace its original
``nn.Parameter`` registrations, so ``state_dict()`` and ``parameters()`` of the wrapper hold shards.

The group is storage with states (``ShardedState``): it gathers and frees its data when its unit's
runtime says so (``runtime.py``, which asks ``freeing.py``). Around it: ``adoption.build_group`` makes
it (layout, shard, torch_xla's attributes); ``member_slots.py`` is how its members sit in the module;
``group_comms.py`` takes a gradient to the shard; ``gradients.py`` records which members a forward used.
After the class, this file holds the group's values as the program sees them (``summon_full_params``,
deferred init, rank 0's values, fingerprints, in-place edits in forward), as functions of a group.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn

from . import freeing
from ..collectives import Collectives
from ..sharding import Dim0Layout, FlatLayout, shard_of
from .gradients import ForwardEdges
from .group_layouts import GroupLayout, layout_of
from .member_slots import (FlatMembers, ParamRef, fingerprint, freed_stand_ins, hooks_kept_from, module_tensor,
                           set_module_tensor)
from .offload import HostOffload


class ShardedState(enum.Enum):
    """What a gather group holds besides its shard (FSDP2's states of the same names)."""
    SHARDED = "sharded"      # only the shard exists; full data freed
    #: full data freed, this rank's rows of it within a smaller group of ranks kept for backward's
    #: gather (FSDP2's int ``reshard_after_forward``; see :class:`PostForwardPiece`)
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDED = "unsharded"  # full data gathered and visible to the module


@dataclass
class PostForwardPiece:
    """This rank's rows of the padded full parameter within ``ranks``, a smaller group of consecutive
    ranks: backward gathers them over ``ranks`` instead of the shards over every rank."""

    ranks: Collectives
    rows: torch.Tensor
    shard_version: int  # the shard's version the rows are of (a changed shard makes them stale)


@dataclass
class InitialValues:
    """What construction left for the root's first forward (read and written by the value functions below)."""

    #: a fingerprint of the full values this rank built, compared across ranks (None: nothing built)
    fingerprint: Optional[torch.Tensor]
    #: the shard's version when the values were built: a write since (a load) makes them stale
    version: int
    #: given storage only (``storage_only``): a load must write the shard before the first forward
    storage_only: bool = False
    #: rank 0's values (``sync_module_states``) to take at the first forward, where the ranks are threads
    rank_0_takes: Optional[List[Callable[[], torch.Tensor]]] = None
    late_init_version: Optional[int] = None  # the shard's version at to_empty (begin_late_init)


class ShardOnTheShell:
    """The wrapper's face: the shard is what the program sees (registered on the unit's shell under
    torch_xla's names); between gathers the module's places hold stand-ins that refuse data access."""

    registered_in_place = False

    def program_param(self, group: "GatherGroup") -> torch.Tensor:
        return group.shard

    def freed_values(self, group: "GatherGroup") -> List[Optional[torch.Tensor]]:
        return freed_stand_ins(group.refs, group.kind.member_shapes, group.compute_dtype, group.full.device,
                               group.shard)


class ShardParamInPlace:
    """fully_shard's face: FSDP2's sharded parameter (a ``ShardParam`` over the shard) registered in the
    original's places (``named_parameters()``, ``state_dict()`` under the module's own names), showing
    through between gathers; while gathered a plain attribute shadows it."""

    registered_in_place = True

    def __init__(self, make: Callable[["GatherGroup"], torch.Tensor]):
        self.make = make

    def program_param(self, group: "GatherGroup") -> torch.Tensor:
        param = self.make(group)
        for module, attr in group.refs[0].slots:
            module._parameters[attr] = param
        return param

    def freed_values(self, group: "GatherGroup") -> List[Optional[torch.Tensor]]:
        return [group.param]


class GatherGroup:
    """Owns one shard parameter and the matching full parameter for a unit (``unit.gather_groups``)."""

    # forward gather, backward gather, reduce-scatter, replica all-reduce, and the norms and overflow
    # checks the program takes of the shard gradient (see gradients.ShardGrad)
    CHANNELS = 5

    def __init__(self, refs: List[ParamRef], comms: Collectives, layout: Union[FlatLayout, Dim0Layout],
                 shard: nn.Parameter, initial: InitialValues, *, flat: bool, compute_dtype: torch.dtype,
                 channel: int, offload: Optional[HostOffload] = None,
                 face: Union[ShardOnTheShell, ShardParamInPlace, None] = None, flat_name: Optional[str] = None):
        """``shard`` is this rank's block, made (and the originals taken out of the module) by
        ``adoption.build_group``. ``face``: what the program sees of the group (the wrapper's shard, or
        fully_shard's ShardParam in the original's places). ``flat_name``: a flattened group's name in the unit."""
        self.refs = refs
        self.comms = comms
        #: the index math (``sharding.py``), and what differs between layouts (``group_layouts.py``)
        self.layout = layout
        self.kind: GroupLayout = layout_of(layout, flat)
        self.compute_dtype = compute_dtype
        #: with host offload (see offload.py) ``shard`` lives on the host and is copied to the device to gather
        self.offload = offload
        (self.channel_forward, self.channel_backward, self.channel_reduce,
         self.channel_replicas, self.channel_grad_norm) = range(channel, channel + self.CHANNELS)
        self.shard = shard
        self.shard._xla_fsdp_group = self  # the optimizer check reads the original names and shapes
        self.initial = initial
        #: whether an optimizer step over this shard ends the traced step (fully_shard: FSDP2 programs
        #: have no step marker; see optimizer_check.sync_after_step)
        self.sync_after_optimizer_step = False
        #: whether the group trains, as last seen (see :meth:`follow_requires_grad`)
        self.requires_grad = shard.requires_grad
        self.full = nn.Parameter(comms.new_full(self.kind.full_shape, layout.padded_numel, compute_dtype),
                                 requires_grad=self.requires_grad)
        self.full._has_full_param = False  # torch_xla's flag, kept by this group's state changes
        comms.free(self.full)
        self.state = ShardedState.SHARDED
        # The shard's version counter when ``full`` was last gathered from it: any in-place change
        # since (a load, an optimizer step) makes the full copy stale (see ``is_unsharded``).
        self._gathered_version = -1
        #: a backward pass left some flattened member without gradient (``member_slots.SplitFlat``)
        self.grad_incomplete = False
        #: a reentrant checkpoint of the program's own uses a member in this step's forward: its
        #: gradient comes in a later backward pass than the root's (set by the gradient plan)
        self.gradient_in_later_pass = False
        #: FSDP2's int reshard_after_forward: cut at the end of forward, kept while SHARDED_POST_FORWARD
        self.post_forward_piece: Optional[PostForwardPiece] = None
        self.flat_name = flat_name
        #: flat groups: the gradient edges of what each member's places were given in a root's forward
        self.forward_edges = ForwardEdges()
        self._installed: Optional[List[torch.Tensor]] = None  # what the module sees now (flat)
        self._warned_unused: Set[str] = set()  # members already reported as partly unused
        # per member, the gradient hooks the program registered on the original parameter
        hooks = [hooks_kept_from(ref) for ref in refs]
        #: a flat group's members (the views the module is given, and their hooks); None for one parameter
        self.members: Optional[FlatMembers] = self.kind.members(comms, hooks, self.full)
        self.face = face or ShardOnTheShell()
        #: what the program sees of the shard (``parameters()``, the optimizer; see ``face``)
        self.param: torch.Tensor = self.face.program_param(self)
        self.slot_values: List[Optional[torch.Tensor]] = []  # what install last gave each member's places
        self.install()

    def follow_requires_grad(self) -> bool:
        """Take up a ``requires_grad`` the program set since the last forward, on the shard (what
        ``model.parameters()`` yields) or on the full parameter (what the module's attribute is);
        returns whether it changed. Tensors handed to the module before keep the old flag, so a
        gathered group is freed and gathered again, as PyTorch's FSDP2 reads its sharded
        parameter's flag at every all-gather."""
        wanted = self.shard.requires_grad
        if wanted == self.requires_grad:
            wanted = self.full.requires_grad
        if wanted == self.requires_grad:
            return False
        self.requires_grad = wanted
        self.shard.requires_grad_(wanted)
        self.full.requires_grad_(wanted)
        if self.state is ShardedState.UNSHARDED:
            if self._aliases_shard():
                self.install()
            else:
                self.reshard()
        return True

    @property
    def flat(self) -> bool:
        return self.kind.flat

    @property
    def dim0(self) -> bool:
        return self.kind.dim0

    @property
    def padded_shape(self) -> Tuple[int, ...]:
        return self.kind.padded_shape

    @property
    def full_shape(self) -> Tuple[int, ...]:
        return self.kind.full_shape

    @property
    def in_place(self) -> bool:
        """fully_shard: the module's places hold FSDP2's sharded parameter between steps."""
        return self.face.registered_in_place

    def set_sync_after_optimizer_step(self, enabled: bool) -> None:
        """fully_shard's ``set_sync_after_optimizer_step``."""
        self.sync_after_optimizer_step = bool(enabled)

    # --- gradients ------------------------------------------------------------------------
    def gradient_incomplete(self) -> None:
        """A backward pass left some flattened member without gradient (its split's backward)."""
        self.grad_incomplete = True

    def gradient_taken(self) -> None:
        """The full gradient was taken for reduction: what it lacked no longer waits."""
        self.grad_incomplete = False

    def expect_gradient_in_later_pass(self, later: bool) -> None:
        """The gradient plan: a reentrant checkpoint of the program's own uses a member in this step's
        forward, so the gradient comes in a later backward pass than the root's."""
        self.gradient_in_later_pass = later

    def first_unused_report(self, name: str) -> bool:
        """Whether member ``name`` is reported partly unused for the first time (each is reported once)."""
        first = name not in self._warned_unused
        self._warned_unused.add(name)
        return first

    # --- lifecycle ------------------------------------------------------------------------
    def unshard(self, backward: bool = False) -> None:
        """All-gather the shard into ``full`` (idempotent)."""
        if not self.is_unsharded():
            self.start_unshard(backward)()

    def start_unshard(self, backward: bool = False, refill_saved: bool = False) -> Callable[[], None]:
        """Begin the all-gather into ``full``; the returned function waits for it and hands the
        data to the module. ``refill_saved``: this is the re-gather for the backward of the last
        forward, whose parameter tensors autograd saved (see :meth:`install`)."""
        channel = self.channel_backward if backward else self.channel_forward
        version = self.shard._version
        kept, self.post_forward_piece = self.post_forward_piece, None
        if self.state is ShardedState.SHARDED_POST_FORWARD and kept.shard_version == version:
            # gather the pieces kept after forward, within their group of ranks
            wait = kept.ranks.start_gather_into(self.full, kept.rows, channel, self.padded_shape, self._unpad,
                                                alias_ok=False)
        else:
            wait = self.comms.start_gather_into(self.full, self.gather_source(), channel, self.padded_shape,
                                                self._unpad, alias_ok=self.offload is None)

        def finish() -> None:
            wait()
            self.mark_unsharded(version)
            self.install(refill_saved)
        return finish

    def gather_source(self) -> torch.Tensor:
        """What the all-gather reads: the shard, or with offload a device copy of it."""
        return self.shard if self.offload is None else self.offload.gather_source(self.shard, self.compute_dtype)

    def _unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return self.kind.unpad(padded)

    def mark_unsharded(self, shard_version: int) -> None:
        """``full`` now holds the data of the shard as it was at ``shard_version``."""
        self.state = ShardedState.UNSHARDED
        self.full._has_full_param = True
        self._gathered_version = shard_version

    def cut_piece(self, ranks: Collectives) -> Optional[torch.Tensor]:
        """This rank's rows of the gathered (padded) parameter within ``ranks``, a smaller group of
        consecutive ranks (FSDP2's int ``reshard_after_forward``), kept for the next gather, which
        reads those pieces over ``ranks`` instead of the shards over every rank. None where there
        is nothing to cut (not gathered, or not split by rows)."""
        if self.state is not ShardedState.UNSHARDED or self._aliases_shard():
            return None
        rows = self.kind.cut(self.full, ranks)
        if rows is None:
            return None
        self.post_forward_piece = PostForwardPiece(ranks, rows, self._gathered_version)
        return rows

    def reshard_to(self, ranks: Collectives) -> None:
        """Free the full data, keeping this rank's piece of it for ``ranks`` (cut now unless it was):
        SHARDED_POST_FORWARD. Where nothing can be cut, as :meth:`reshard`."""
        if self.post_forward_piece is None or self.post_forward_piece.ranks is not ranks:
            self.cut_piece(ranks)
        kept = self.post_forward_piece
        self.reshard()
        if kept is not None and self.state is ShardedState.SHARDED:
            self.post_forward_piece = kept
            self.state = ShardedState.SHARDED_POST_FORWARD

    def reshard(self) -> None:
        """Free the full data (and a post-forward piece); the shard stays."""
        self.post_forward_piece = None
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self.state = ShardedState.SHARDED  # the full data was freed already
            return
        if self.state is ShardedState.SHARDED or self._aliases_shard():
            return  # an alias owns no memory: it stays installed, and the next gather is free
        self.comms.free(self.full)
        if self.members is not None:
            self.members.free()
        self.state = ShardedState.SHARDED
        self.full._has_full_param = False
        # Drop the module's views too: a live view keeps the freed data alive (on XLA every
        # live tensor is an output of the step graph, so stale views cost a full-size write).
        self.install()

    def install(self, refill_saved: bool = False) -> None:
        """Point the module's attributes at the full data (the flat buffer's parameters if flattened)."""
        if self.state is ShardedState.UNSHARDED or self._aliases_shard():
            values = self.kind.gathered_values(self, refill_saved)
        else:
            values = self.face.freed_values(self)
        self.set_module_values(values)
        if self.members is not None:  # a flat group's views: which of them a forward gives the module
            self._installed = values if self.state is ShardedState.UNSHARDED else None
            self.forward_edges.record(self._installed, self.requires_grad)

    def refill_freed_members(self) -> None:
        """Backward of a gathered group: members an earlier call of this forward saved, freed
        since (the unit ran again after another unit), take the current data back."""
        if self.members is not None and self.members.freed_since_saved():
            self.install(refill_saved=True)

    def begin_forward(self, record_edges: bool) -> None:
        """A root's forward begins: members handed out before are no longer saved by any graph
        that will run backward. ``record_edges``: note which tensors the module is given (flat)."""
        if self.members is not None:
            self.members.begin_forward(self.is_unsharded())
        self.grad_incomplete = self.gradient_in_later_pass = False
        if self.members is not None and record_edges:
            self.forward_edges.begin(len(self.refs))
            self.forward_edges.record(self._installed, self.requires_grad)

    def set_module_values(self, values: List[Optional[torch.Tensor]]) -> None:
        """Point every place that refers to a member at ``values`` (``install`` puts ``full`` back)."""
        for ref, value in zip(self.refs, values):
            for module, attr in ref.slots:
                set_module_tensor(module, attr, value)
        self.slot_values = list(values)

    # --- introspection --------------------------------------------------------------------
    @property
    def names(self) -> List[str]:
        return [r.fqn for r in self.refs]

    def is_unsharded(self) -> bool:
        """Whether ``full`` holds the shard's current data, so a gather can be skipped.

        A unit left gathered by a forward that had no backward (an eval loop without
        ``torch.no_grad()``, a step skipped after a NaN loss) keeps its full copy; a load or an
        optimizer step since then changed the shard in place, which bumps its version counter, and
        the copy is stale. (Writes through ``shard.data`` bypass the counter: use the shard itself.)
        An alias is current only while it still points at the shard (``module.to`` may move it)."""
        if self.state is not ShardedState.UNSHARDED:
            return False
        if self.comms.aliases_shard(self.full):
            return self._aliases_shard()
        return self._gathered_version == self.shard._version

    def _aliases_shard(self) -> bool:
        """World size 1 without a cast: ``full`` is the shard's own storage (torch transport)."""
        return self.comms.aliases_shard(self.full) and self.full.data_ptr() == self.shard.data_ptr()


# ======================================================== a group's values as the program sees them
# A gather group's values as the program sees them: every member's full data gathered into tensors of
# their own (``summon_full_params``, ``full_tensor()``) and written back into the shard, the values
# construction left to take (rank 0's with ``sync_module_states``; the program's init after ``to_empty``;
# a load after ``storage_only``), the fingerprint of what each rank built, which the root compares across
# ranks, and the program's own changes to the module's places (an in-place edit in forward, a tensor
# assigned). The group itself (``gather_group.py``) holds the storage and moves it through a step.


def gather_values(group: GatherGroup, rows: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Every member's full data in the shard's dtype, in tensors of their own (not ``full``):
    a collective, which every rank of the group must call. ``rows``: each rank's rows of other values
    laid out as the shard (a ShardParam's ``full_tensor()``), in their own dtype."""
    source = (group.shard if rows is None else rows).detach()
    if group.offload is not None:
        source = group.offload.to_device(source, source.dtype)
    padded = group.comms.all_gather(source.reshape(group.kind.gather_shape), group.channel_forward)
    return group.kind.split(padded)


def take_rank_0_values(group: GatherGroup) -> None:
    """Make the shard rank 0's block where construction deferred it (see ``adoption.build_group``); a shard
    written since (a checkpoint loaded) keeps what was written."""
    if group.initial.rank_0_takes is None:
        return
    takes, group.initial.rank_0_takes = group.initial.rank_0_takes, None
    values = [take() for take in takes]  # every rank reads its round, whatever it keeps
    if group.shard._version != group.initial.version:
        return
    write_back(group, values)
    group.initial.fingerprint = fingerprint(values)
    group.initial.version = group.shard._version


def begin_late_init(group: GatherGroup, device: torch.device) -> None:
    """``to_empty`` after sharding (FSDP2's meta-init order): every place that refers to a member
    gets a full-size uninitialized Parameter on ``device`` (the unit's device, or the host with
    ``CPUOffloadPolicy``: the init then draws from the CPU generator, as unsharded), for the
    program's own init (``reset_parameters``, ``init_weights``) to fill; :func:`finish_late_init`
    shards it."""
    group.set_module_values([nn.Parameter(torch.empty(shape, dtype=group.shard.dtype, device=device),
                                         requires_grad=group.shard.requires_grad)
                             for shape in group.kind.member_shapes])
    group.initial.late_init_version = group.shard._version


def in_late_init(group: GatherGroup) -> bool:
    """Between ``to_empty`` and :func:`finish_late_init`: the module holds full-size parameters
    of its own for the program's init."""
    return group.initial.late_init_version is not None


def finish_late_init(group: GatherGroup) -> None:
    """Make the shard this rank's block of what the program's init left in the module (not if
    a checkpoint was loaded into the shard since), and fingerprint it for the ranks' check."""
    version, group.initial.late_init_version = group.initial.late_init_version, None
    if version is None:
        return
    if group.shard._version == version:
        values = module_values(group)
        write_back(group, values)
        group.initial.fingerprint = fingerprint(values)
        group.initial.version = group.shard._version
        group.initial.storage_only = False  # the program's init gave the values
    freeing.after_write_back(group)
    group.install()


def awaiting_values(group: GatherGroup) -> bool:
    """Given storage only at construction, and nothing written into the shard since."""
    return group.initial.storage_only and group.shard._version == group.initial.version


def current_fingerprint(group: GatherGroup) -> Optional[torch.Tensor]:
    """The construction fingerprint, or None if the shard was written since (a checkpoint loaded
    before the first forward: the values the ranks built no longer matter)."""
    return group.initial.fingerprint if group.shard._version == group.initial.version else None


def write_back(group: GatherGroup, values: List[torch.Tensor]) -> None:
    """Make this rank's shard the block of ``values`` (every member's full data) it owns."""
    with torch.no_grad():
        padded = group.kind.padded_of(values)
        block = shard_of(padded, group.comms.rank, group.comms.world_size)
        group.shard.copy_(block.reshape(group.shard.shape).to(group.shard.device, group.shard.dtype))


def module_values(group: GatherGroup) -> List[torch.Tensor]:
    """What the module's first place of each member holds now (a program may have assigned a
    new tensor or Parameter there)."""
    return [module_tensor(*ref.slots[0]) for ref in group.refs]


def installed_versions(group: GatherGroup) -> List[int]:
    """The version counters of what the module holds now (each member, or the flat buffer its
    views share), to tell an in-place edit in forward."""
    return [v._version if isinstance(v, torch.Tensor) else -1 for v in group.slot_values]


def keep_edits(group: GatherGroup, versions: List[int]) -> bool:
    """A module that changed its own full parameters in place during forward (a clamp under
    ``no_grad``, ``nn.Embedding(max_norm=...)``'s renorm) changed them for good in unsharded
    training: its edit becomes this rank's shard, as ``summon_full_params`` writes back."""
    now = installed_versions(group)
    if group.state is not ShardedState.UNSHARDED or now == versions:
        return False
    if not group.comms.takes_in_place_edits:
        edited = [ref for ref, a, b in zip(group.refs, versions, now) if a != b]
        name = edited[0].fqn if edited else group.refs[0].fqn
        raise RuntimeError(
            f"xla_fsdp: '{name}' was changed in place during forward (a clamp_ or other in-place op "
            f"under torch.no_grad(), a renorm): on {group.comms.name} a unit's gathered parameters cannot "
            "keep an in-place edit, and this step would compute with other values than unsharded. Edit "
            "the weights outside forward (after optimizer.step(), inside "
            "`with XlaFullyShardedDataParallel.summon_full_params(model, writeback=True):`), or compute "
            "with an edited copy "
            "(`F.linear(x, self.fc.weight.clamp(-1, 1), self.fc.bias)`); docs/usage.md, exactness rules")
    write_back(group, module_values(group))
    return True


def reassigned_slot(group: GatherGroup) -> Optional[Tuple[str, torch.Tensor]]:
    """(name in the unit, value) of a member's attribute the program gave a tensor of its own since
    the last install (``module.weight = other.weight``, as ``tie_weights()`` does), if any: the
    next install would silently put the unit's own back."""
    for ref, installed in zip(group.refs, group.slot_values):
        for (module, attr), name in zip(ref.slots, [ref.fqn, *ref.aliases]):
            value = module_tensor(module, attr)
            if value is installed or value is group.param or not isinstance(value, torch.Tensor):
                continue  # (a plain tensor there may be another member's FreedParameter)
            return name, value
    return None
