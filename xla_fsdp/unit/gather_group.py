"""A gather group: the parameters one all-gather fetches (not an optimizer's param group, not a group
of ranks), with the sharded fp32 master and the full compute-dtype copy.

A gather group is either several parameters flattened into one padded buffer (``flatten_parameters``) or
a single parameter (padded flat, or split on dim 0). The optimizer sees only ``shard``; the wrapped
module sees ``full`` (or views of it) through plain attributes that replace its original
``nn.Parameter`` registrations, so ``state_dict()`` and ``parameters()`` of the wrapper hold shards.

The group is storage with states (``ShardedState``): it gathers, frees and reduces its own data when
its unit's runtime says so (``runtime.py``, which asks ``freeing.py``). How its members sit in the
module is ``member_slots.py``; its values outside a step (``summon_full_params``, deferred init) are
``group_values.py``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn

from ..collectives import Collectives
from .gradient_usage import Edge, tensor_edge
from .freed import FreedParameter
from .member_slots import SplitFlat, fingerprint, hooks_kept_from, module_tensor, set_module_tensor
from .offload import HostOffload
from .optimizer_check import install_optimizer_check
from .shard_grad import as_shard_grad, run_post_accumulate_hooks, run_shard_hooks
from ..sharding import Dim0Layout, FlatLayout, flatten_and_pad, pad_dim0, shard_of


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
class ParamRef:
    """An original parameter and every (module, attribute) that refers to it (tied weights)."""

    param: nn.Parameter
    fqn: str                                     # first name, relative to the unit's module
    slots: List[Tuple[nn.Module, str]]
    aliases: List[str]                           # further names of the same parameter


class GatherGroup:
    """Owns one shard parameter and the matching full parameter for a unit (``unit.gather_groups``)."""

    # forward gather, backward gather, reduce-scatter, replica all-reduce, and the norms and overflow
    # checks the program takes of the shard gradient (see shard_grad.py)
    CHANNELS = 5

    def __init__(self, refs: List[ParamRef], comms: Collectives, *, flat: bool, dim0: bool,
                 pad_multiple: int, compute_dtype: torch.dtype, channel: int,
                 offload: Optional[HostOffload] = None, storage_dtype: torch.dtype = torch.float32,
                 sync_from_rank_0: bool = False, in_place: bool = False):
        if dim0 and (flat or len(refs) != 1):
            raise ValueError("dim-0 sharding applies to one unflattened parameter at a time")
        self.refs = refs
        self.comms = comms
        self.flat = flat
        self.dim0 = dim0
        self.compute_dtype = compute_dtype
        #: with host offload (see offload.py) ``shard`` lives on the host and is copied to the device to gather
        self.offload = offload
        self._staged: Optional[Tuple[int, torch.Tensor]] = None  # (shard version, device copy) for a barrier
        (self.channel_forward, self.channel_backward, self.channel_reduce,
         self.channel_replicas, self.channel_grad_norm) = range(channel, channel + self.CHANNELS)
        requires_grad = refs[0].param.requires_grad
        ws, rank = comms.world_size, comms.rank
        sources = [r.param.detach() for r in refs]
        # Rank 0's values (``sync_module_states``): where the ranks are threads of one process they are
        # taken at the root's first forward (take_rank_0_values), since a rank building under the
        # program's lock cannot wait here for a peer still waiting for that lock.
        self.rank_0_takes: Optional[List[Callable[[], torch.Tensor]]] = None
        self.late_init_version: Optional[int] = None  # the shard's version at to_empty (begin_late_init)
        if sync_from_rank_0:
            takes = [comms.start_broadcast_from_rank_0(s) for s in sources]
            if comms.ranks_share_a_process:
                self.rank_0_takes = takes
            else:
                sources = [take() for take in takes]

        #: given storage only (``storage_only``): no values yet, so nothing to copy or compare; a load
        #: must write the shard before the first forward (see forward.py)
        self.awaiting_values = not sync_from_rank_0 and all(
            getattr(r.param, "_xla_fsdp_storage_only", False) for r in refs)
        self.layout: Union[FlatLayout, Dim0Layout]
        if dim0:
            self.layout = Dim0Layout(tuple(sources[0].shape), ws)
            self.padded_shape: Tuple[int, ...] = (self.layout.padded_rows,) + self.layout.row_shape
            self.full_shape: Tuple[int, ...] = tuple(sources[0].shape)
        else:
            self.layout = FlatLayout(tuple(tuple(s.shape) for s in sources), ws, pad_multiple)
            self.padded_shape = (self.layout.padded_numel,)
            self.full_shape = self.padded_shape if flat else tuple(sources[0].shape)
        #: a fingerprint of the full values this rank built, compared across ranks at the first forward
        self.init_fingerprint = None if self.awaiting_values else fingerprint(sources)
        if self.awaiting_values:  # zeros (padding included) in the shard's place: no copy of the full data
            shard = torch.zeros((self.padded_shape[0] // ws,) + self.padded_shape[1:], dtype=storage_dtype)
        else:
            padded = pad_dim0(sources[0], self.layout) if dim0 else flatten_and_pad(sources, self.layout)
            shard = shard_of(padded, rank, ws).detach().clone()
        if offload is not None:
            shard = offload.host_shard(shard, storage_dtype)
        else:
            shard = shard.to(storage_dtype).to(comms.device)
        self.shard = nn.Parameter(shard, requires_grad=requires_grad)
        # Its gradient is reduced here: torch_xla's all-reduce of every gradient (xm.optimizer_step,
        # Accelerate's XLA path) must leave it out (see collectives/xla_gradients.py).
        self.shard._xla_fsdp_reduced = True
        self.shard._xla_fsdp_group = self  # the optimizer check reads the original names and shapes
        # whether an optimizer step over this shard ends the traced step (fully_shard: FSDP2 programs
        # have no step marker; see optimizer_check.sync_after_step)
        self.sync_after_optimizer_step = False
        self.fingerprint_version = self.shard._version  # a load before the first forward makes it stale
        # torch_xla's attributes, read by its clients (Lightning's XLAFSDPStrategy finds the optimizer's
        # shards by ``_is_sharded``): the size and name of what the shard is part of; ``_name`` is set
        # by the unit, which names the shard.
        self.shard._is_sharded = True
        self.shard._orig_size = torch.Size((self.layout.numel,) if flat else self.full_shape)
        self.full = nn.Parameter(comms.new_full(self.full_shape, self.layout.padded_numel, compute_dtype),
                                 requires_grad=requires_grad)
        self.full._sharded_param = self.shard  # torch_xla's handle, and whether the full data is there
        self.full._has_full_param = False
        #: whether the group trains, as last seen (see :meth:`follow_requires_grad`)
        self.requires_grad = requires_grad
        comms.free(self.full)
        self.state = ShardedState.SHARDED
        # The shard's version counter when ``full`` was last gathered from it: any in-place change
        # since (a load, an optimizer step) makes the full copy stale (see ``is_unsharded``).
        self._gathered_version = -1
        #: a backward pass left some flattened member without gradient (set by ``_SplitFlat``)
        self.grad_incomplete = False
        #: a reentrant checkpoint of the program's own uses a member in this step's forward: its
        #: gradient comes in a later backward pass than the root's (set by the gradient plan)
        self.gradient_in_later_pass = False
        #: FSDP2's int reshard_after_forward: cut at the end of forward, kept while SHARDED_POST_FORWARD
        self.post_forward_piece: Optional[PostForwardPiece] = None
        self.flat_name: Optional[str] = None  # set by the unit for flattened groups
        # Gradient edges of each member's installed tensors during a root's forward (flat groups),
        # for the root's plan of which groups get gradients (see gradient_usage.py); None when not recording.
        self.forward_edges: Optional[List[List[Edge]]] = None
        self._installed: Optional[List[torch.Tensor]] = None  # what the module sees now (flat)
        self.warned_unused: Set[str] = set()  # members already reported as partly unused
        self._members: Optional[List[torch.Tensor]] = None  # a flat group's parameters (lazy transports)
        # Every set of members handed out since the root's forward began: a unit called twice with
        # another unit in between gathers twice, and backward must refill what both calls saved.
        self._member_sets: List[List[torch.Tensor]] = []
        install_optimizer_check()
        #: per member, the gradient hooks the program registered on the original parameter
        self._member_hooks = [hooks_kept_from(ref) for ref in refs]
        if not flat:
            for hook in self._member_hooks[0]:
                self.full.register_hook(hook)  # ``full`` is the parameter the module computes with
        # The originals stop being registered parameters; the module reads full data through
        # plain attributes that ``install`` refreshes after every gather. ``in_place`` (fully_shard):
        # the shard is registered in the original's place (``named_parameters()``, ``state_dict()``
        # under the module's own names, as FSDP2's DTensor), and the plain attribute shadows it.
        self.in_place = in_place and not flat
        self._set_values: List[Optional[torch.Tensor]] = []  # what install last gave each member's places
        for ref in refs:
            for module, attr in ref.slots:
                module._parameters.pop(attr, None)
                if self.in_place:
                    module._parameters[attr] = self.shard
                set_module_tensor(module, attr, None)
            ref.param._xla_fsdp_sharded = True
            # The shard is the only copy now: drop the original's data so every rank does not keep
            # the whole model in host memory (the object stays, marked, to catch sharing across units).
            ref.param.data = ref.param.data.new_empty(0)
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

    # --- layout helpers -------------------------------------------------------------------
    def _unpad(self, padded: torch.Tensor) -> torch.Tensor:
        if self.dim0:
            if self.layout.padded_rows == self.layout.rows and tuple(padded.shape) == tuple(self.full_shape):
                return padded  # no slice op: in SPMD the full parameter is then the annotated shard itself
            return padded[:self.layout.rows].view(self.full_shape)
        if self.flat:
            return padded
        if self.layout.padding == 0:  # no slice op to trace
            return padded.view(self.full_shape)
        return padded[:self.layout.numel].view(self.full_shape)

    def _pad_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self.layout.padding == 0:  # nothing to pad (one rank, or sizes that divide evenly)
            if tuple(grad.shape) == tuple(self.padded_shape):
                return grad
            padded = grad.reshape(self.padded_shape)
            # Eager: a view, no copy. Lazy (XLA): at one rank the shard gradient would be that view, and a live
            # view keeps its base live, so both would be outputs of the step graph (one more
            # full-size write per parameter); a lazy clone costs nothing, and the base is dropped.
            return padded if self.comms.views_see_refills else padded.clone()
        if self.dim0:
            return pad_dim0(grad, self.layout)
        if self.flat:
            return grad
        return flatten_and_pad([grad], self.layout)

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
        """What the all-gather reads: the shard, or with offload a device copy of it (the one staged
        for a barrier if the shard has not changed since)."""
        if self.offload is None:
            return self.shard
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == self.shard._version:
            return staged[1]
        return self.offload.to_device(self.shard, self.compute_dtype)

    def stage_device_copy(self) -> torch.Tensor:
        """Offload: make the device copy the next gather reads now, so a barrier can cover it."""
        self._staged = (self.shard._version, self.offload.to_device(self.shard, self.compute_dtype))
        return self._staged[1]

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
        if self.state is not ShardedState.UNSHARDED or not self.dim0 or self._aliases_shard():
            return None
        padded = pad_dim0(self.full.detach(), self.layout)
        rows = padded.view(ranks.world_size, -1, *self.layout.row_shape)[ranks.rank].clone()
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
        for members in self._member_sets:
            for member in members:
                self.comms.free(member)
        self.state = ShardedState.SHARDED
        self.full._has_full_param = False
        # Drop the module's views too: a live view keeps the freed data alive (on XLA every
        # live tensor is an output of the step graph, so stale views cost a full-size write).
        self.install()

    def install(self, refill_saved: bool = False) -> None:
        """Point the module's attributes at the full data (the flat buffer's parameters if flattened)."""
        if self.state is not ShardedState.UNSHARDED and not self._aliases_shard():
            values = self._freed_values()
        elif self.flat:
            values = self._flat_values(refill_saved)
        else:
            values = [self.full]
        self.set_module_values(values)
        if self.flat:
            self._installed = values if self.state is ShardedState.UNSHARDED else None
            self._record_edges()

    def reassigned_slot(self) -> Optional[Tuple[str, torch.Tensor]]:
        """(name in the unit, value) of a member's attribute the program gave a tensor of its own since
        the last install (``module.weight = other.weight``, as ``tie_weights()`` does), if any: the
        next install would silently put the unit's own back."""
        for ref, installed in zip(self.refs, self._set_values):
            for (module, attr), name in zip(ref.slots, [ref.fqn, *ref.aliases]):
                value = module_tensor(module, attr)
                if value is installed or value is self.shard or not isinstance(value, torch.Tensor):
                    continue  # (a plain tensor there may be another member's FreedParameter)
                return name, value
        return None

    def _freed_values(self) -> List[torch.Tensor]:
        """Stand-ins that know each member's shape and refuse data access (see freed.py)."""
        shapes = [self.full_shape] if not self.flat else self.layout.shapes
        freed = [FreedParameter(shape, self.compute_dtype, self.full.device, ref.fqn, self.shard)
                 for ref, shape in zip(self.refs, shapes)]
        if self.in_place:
            # Where the shard is registered (fully_shard), the stand-in counts as a Parameter (as FSDP2's
            # DTensor does), so a program that ties ``head.weight = emb.weight`` between steps gets the
            # unit's refusal naming both at the next forward, not torch's "cannot assign ... as parameter".
            for f in freed:
                f._is_param = True
        return freed

    def refill_freed_members(self) -> None:
        """Backward of a gathered group: members an earlier call of this forward saved, freed
        since (the unit ran again after another unit), take the current data back."""
        if len(self._member_sets) > 1 and any(not self.comms.is_allocated(m[0]) for m in self._member_sets if m):
            self.install(refill_saved=True)

    def begin_forward(self, record_edges: bool) -> None:
        """A root's forward begins: members handed out before are no longer saved by any graph
        that will run backward. ``record_edges``: note which tensors the module is given (flat)."""
        self._member_sets = [self._members] if self._members is not None and self.is_unsharded() else []
        self.grad_incomplete = self.gradient_in_later_pass = False
        if self.flat and record_edges:
            self.forward_edges = [[] for _ in self.refs]
            self._record_edges()

    def gradient_edge(self) -> Edge:
        """Where ``full``'s gradient flows (its accumulator). Looked up each time, never kept: an
        accumulator records the parameter's shape when it is made, and ``full`` changes shape
        between gathered and freed, so a kept one made while ``full`` was freed sums every later
        gradient down to one element (FSDP1 and torch_xla's FSDP keep theirs: their parameters'
        shapes do not change)."""
        return tensor_edge(self.full)

    def end_edge_record(self) -> None:
        self.forward_edges = None

    def _record_edges(self) -> None:
        if self.forward_edges is not None and self._installed is not None and self.requires_grad:
            for edges, value in zip(self.forward_edges, self._installed):
                if value.requires_grad:  # made under no_grad (a reentrant checkpoint's forward): no edge
                    edges.append(tensor_edge(value))

    def _flat_values(self, refill_saved: bool) -> List[torch.Tensor]:
        """A flat group's parameters, cut from ``full``.

        Eager storage: views. Autograd's saved views read the same storage, which the backward
        re-gather refills. Lazy tensors (XLA) have no shared storage: a saved view would keep the
        forward's gather alive until backward, the full unit for the whole step. There each
        parameter is a tensor of its own; the backward re-gather refills the saved ones in place,
        as the unflattened layout does with its parameters."""
        sizes = list(self.layout.numels) + [self.layout.padded_numel - sum(self.layout.numels)]
        if self.comms.views_see_refills:
            # One split, not one slice per parameter: autograd then joins the gradients with a
            # single concatenation instead of a full-size zero-filled buffer per parameter.
            # Grad mode on even in backward's re-gather: a view made with it off has no grad_fn, so
            # an activation-checkpointing recompute that uses it directly (GPT-2's Conv1D: addmm
            # of the weight) saves fewer tensors than the forward did and torch's checkpoint fails.
            with torch.enable_grad():
                chunks = torch.split(self.full, sizes)
                return self._hooked([c.view(shape) for c, shape in zip(chunks, self.layout.shapes)])
        if refill_saved and self._members is not None:
            pieces = torch.split(self.full, sizes)
            for members in self._member_sets:
                for member, piece, shape in zip(members, pieces, self.layout.shapes):
                    self.comms.fill_full(member, piece, tuple(shape), lambda t: t)
        else:
            members = SplitFlat.apply(self.full, tuple(sizes), tuple(self.layout.shapes), self)
            self._members = self._hooked(list(members))
            self._member_sets.append(self._members)
        return self._members

    def _hooked(self, members: List[torch.Tensor]) -> List[torch.Tensor]:
        """Members handed to the module carry the hooks of the parameters they stand for."""
        for member, hooks in zip(members, self._member_hooks):
            if member.requires_grad:
                for hook in hooks:
                    member.register_hook(hook)
        return members

    def prepare_grad(self, grad: torch.Tensor, pre_divide: float, fp32_reduce_scatter: bool) -> torch.Tensor:
        """The padded, pre-divided full gradient, ready to reduce-scatter."""
        padded = self._pad_grad(grad)  # the unit owns this gradient now: divide in place
        if pre_divide != 1:
            padded.div_(pre_divide)
        if fp32_reduce_scatter and padded.dtype != torch.float32:
            padded = padded.to(torch.float32)
        return padded

    def finish_grad(self, reduced: torch.Tensor, post_divide: float) -> torch.Tensor:
        """This rank's reduced block as a shard gradient (divided in fp32, then in the shard's dtype)."""
        if reduced.dtype != torch.float32:
            reduced = reduced.to(torch.float32)
        if post_divide != 1:
            reduced.div_(post_divide)
        if reduced.dtype != self.shard.dtype:  # param_storage_dtype=bfloat16
            reduced = reduced.to(self.shard.dtype)
        if reduced.shape == self.shard.shape:
            return reduced  # not a view: on XLA a live view and its live base are two graph outputs
        return reduced.view(self.shard.shape)

    def accumulate_shard_grad(self, reduced: torch.Tensor) -> None:
        reduced = run_shard_hooks(self.shard, reduced)
        if self.offload is not None:  # to the host (at the end of backward on XLA)
            self.offload.add_grad(self.shard, reduced, self.as_shard_grad)
            return
        if self.shard.grad is None:
            self.shard.grad = self.as_shard_grad(reduced)
        else:
            self.shard.grad += reduced
            self.as_shard_grad(self.shard.grad)  # (left plain by an optimizer step that raised: see optimizer_check)
        run_post_accumulate_hooks(self.shard)

    def as_shard_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The shard's gradient as the program sees it: norms and overflow checks span the ranks."""
        return as_shard_grad(grad, self.comms, self.channel_grad_norm)

    # --- the full parameters outside forward (see summon.py) ------------------------------------
    def write_back(self, values: List[torch.Tensor]) -> None:
        """Make this rank's shard the block of ``values`` (every member's full data) it owns."""
        with torch.no_grad():
            if self.dim0:
                padded = pad_dim0(values[0].detach(), self.layout)
            else:
                padded = flatten_and_pad([v.detach().reshape(s) for v, s in zip(values, self.layout.shapes)],
                                         self.layout)
            block = shard_of(padded, self.comms.rank, self.comms.world_size)
            self.shard.copy_(block.reshape(self.shard.shape).to(self.shard.device, self.shard.dtype))

    def installed_versions(self) -> List[int]:
        """The version counters of what the module holds now (each member, or the flat buffer its
        views share), to tell an in-place edit in forward."""
        return [v._version if isinstance(v, torch.Tensor) else -1 for v in self._set_values]

    def keep_edits(self, versions: List[int]) -> bool:
        """A module that changed its own full parameters in place during forward (a clamp under
        ``no_grad``, ``nn.Embedding(max_norm=...)``'s renorm) changed them for good in unsharded
        training: its edit becomes this rank's shard, as ``summon_full_params`` writes back."""
        now = self.installed_versions()
        if self.state is not ShardedState.UNSHARDED or now == versions:
            return False
        if not self.comms.takes_in_place_edits:
            edited = [ref for ref, a, b in zip(self.refs, versions, now) if a != b] if self.flat else self.refs
            name = edited[0].fqn if edited else self.refs[0].fqn
            raise RuntimeError(
                f"xla_fsdp: '{name}' was changed in place during forward (a clamp_ or other in-place op "
                f"under torch.no_grad(), a renorm): on {self.comms.name} a unit's gathered parameters cannot "
                "keep an in-place edit, and this step would compute with other values than unsharded. Edit "
                "the weights outside forward (after optimizer.step(), inside "
                "`with XlaFullyShardedDataParallel.summon_full_params(model, writeback=True):`), or compute "
                "with an edited copy "
                "(`F.linear(x, self.fc.weight.clamp(-1, 1), self.fc.bias)`); docs/usage.md, exactness rules")
        self.write_back(self.module_values())
        return True

    def set_module_values(self, values: List[Optional[torch.Tensor]]) -> None:
        """Point every place that refers to a member at ``values`` (``install`` puts ``full`` back)."""
        for ref, value in zip(self.refs, values):
            for module, attr in ref.slots:
                set_module_tensor(module, attr, value)
        self._set_values = list(values)

    def module_values(self) -> List[torch.Tensor]:
        """What the module's first place of each member holds now (a program may have assigned a
        new tensor or Parameter there)."""
        return [module_tensor(*ref.slots[0]) for ref in self.refs]

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
