"""One all-gather unit of parameters: the sharded fp32 master and the full compute-dtype copy.

A group is either several parameters flattened into one padded buffer (``flatten_parameters``) or
a single parameter (padded flat, or split on dim 0). The optimizer sees only ``shard``; the wrapped
module sees ``full`` (or views of it) through plain attributes that replace its original
``nn.Parameter`` registrations, so ``state_dict()`` and ``parameters()`` of the wrapper hold shards.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn

from .collectives import Collectives
from .sharding import Dim0Layout, FlatLayout, flatten_and_pad, pad_dim0, shard_of


class ShardedState(enum.Enum):
    SHARDED = "sharded"      # only the shard exists; full data freed
    UNSHARDED = "unsharded"  # full data gathered and visible to the module


@dataclass
class ParamRef:
    """An original parameter and every (module, attribute) that refers to it (tied weights)."""

    param: nn.Parameter
    fqn: str                                     # first name, relative to the unit's module
    slots: List[Tuple[nn.Module, str]]
    aliases: List[str]                           # further names of the same parameter


class ParamGroup:
    """Owns one shard parameter and the matching full parameter for a unit."""

    CHANNELS = 4  # forward gather, backward gather, reduce-scatter, replica all-reduce

    def __init__(self, refs: List[ParamRef], comms: Collectives, *, flat: bool, dim0: bool,
                 pad_multiple: int, compute_dtype: torch.dtype, channel: int):
        if dim0 and (flat or len(refs) != 1):
            raise ValueError("dim-0 sharding applies to one unflattened parameter at a time")
        self.refs = refs
        self.comms = comms
        self.flat = flat
        self.dim0 = dim0
        self.compute_dtype = compute_dtype
        (self.channel_forward, self.channel_backward, self.channel_reduce,
         self.channel_replicas) = range(channel, channel + self.CHANNELS)
        self.requires_grad = refs[0].param.requires_grad
        ws, rank = comms.world_size, comms.rank
        sources = [r.param.detach() for r in refs]

        self.layout: Union[FlatLayout, Dim0Layout]
        if dim0:
            self.layout = Dim0Layout(tuple(sources[0].shape), ws)
            padded = pad_dim0(sources[0], self.layout)
            self.padded_shape: Tuple[int, ...] = (self.layout.padded_rows,) + self.layout.row_shape
            self.full_shape: Tuple[int, ...] = tuple(sources[0].shape)
        else:
            self.layout = FlatLayout(tuple(tuple(s.shape) for s in sources), ws, pad_multiple)
            padded = flatten_and_pad(sources, self.layout)
            self.padded_shape = (self.layout.padded_numel,)
            self.full_shape = self.padded_shape if flat else tuple(sources[0].shape)
        shard = shard_of(padded, rank, ws).detach().clone().to(torch.float32)
        self.shard = nn.Parameter(shard.to(comms.device), requires_grad=self.requires_grad)
        self.full = nn.Parameter(comms.new_full(self.full_shape, self.layout.padded_numel, compute_dtype),
                                 requires_grad=self.requires_grad)
        comms.free(self.full)
        self.state = ShardedState.SHARDED
        self.flat_name: Optional[str] = None  # set by the unit for flattened groups
        # The originals stop being registered parameters; the module reads full data through
        # plain attributes that ``install`` refreshes after every gather.
        for ref in refs:
            for module, attr in ref.slots:
                module._parameters.pop(attr, None)
                object.__setattr__(module, attr, None)
            ref.param._xla_fsdp_sharded = True
            # The shard is the only copy now: drop the original's data so every rank does not keep
            # the whole model in host memory (the object stays, marked, to catch sharing across units).
            ref.param.data = ref.param.data.new_empty(0)
        self.install()

    # --- layout helpers -------------------------------------------------------------------
    def _unpad(self, padded: torch.Tensor) -> torch.Tensor:
        if self.dim0:
            return padded[:self.layout.rows].view(self.full_shape)
        if self.flat:
            return padded
        return padded[:self.layout.numel].view(self.full_shape)

    def _pad_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self.dim0:
            return pad_dim0(grad, self.layout)
        if self.flat:
            return grad
        return flatten_and_pad([grad], self.layout)

    # --- lifecycle ------------------------------------------------------------------------
    def unshard(self, backward: bool = False) -> None:
        """All-gather the shard into ``full`` (idempotent)."""
        if self.state is ShardedState.UNSHARDED:
            return
        channel = self.channel_backward if backward else self.channel_forward
        self.comms.gather_into(self.full, self.shard, channel, self.padded_shape, self._unpad)
        self.state = ShardedState.UNSHARDED
        self.install()

    def reshard(self) -> None:
        """Free the full data; the shard stays."""
        if self.state is ShardedState.SHARDED:
            return
        self.comms.free(self.full)
        self.state = ShardedState.SHARDED

    def install(self) -> None:
        """Point the module's attributes at the full data (views of the flat buffer if flattened)."""
        if self.flat:
            if self.state is ShardedState.UNSHARDED:
                # One split, not one slice per parameter: autograd then joins the gradients with a
                # single concatenation instead of a full-size zero-filled buffer per parameter.
                sizes = list(self.layout.numels)
                padding = self.layout.padded_numel - sum(sizes)
                chunks = torch.split(self.full, sizes + ([padding] if padding else []))
                values = [c.view(shape) for c, shape in zip(chunks, self.layout.shapes)]
            else:
                values = [None] * len(self.refs)
        else:
            values = [self.full]
        for ref, value in zip(self.refs, values):
            for module, attr in ref.slots:
                object.__setattr__(module, attr, value)

    def prepare_grad(self, grad: torch.Tensor, pre_divide: float, fp32_reduce_scatter: bool) -> torch.Tensor:
        """The padded, pre-divided full gradient, ready to reduce-scatter."""
        padded = self._pad_grad(grad)  # the unit owns this gradient now: divide in place
        if pre_divide != 1:
            padded.div_(pre_divide)
        if fp32_reduce_scatter and padded.dtype != torch.float32:
            padded = padded.to(torch.float32)
        return padded

    def finish_grad(self, reduced: torch.Tensor, post_divide: float) -> torch.Tensor:
        """This rank's reduced block as an fp32 shard gradient."""
        if reduced.dtype != torch.float32:
            reduced = reduced.to(torch.float32)
        if post_divide != 1:
            reduced.div_(post_divide)
        return reduced.view(self.shard.shape)

    def reduce_grad(self, grad: torch.Tensor, pre_divide: float, post_divide: float,
                    fp32_reduce_scatter: bool) -> torch.Tensor:
        """Reduce-scatter a full gradient into this rank's fp32 shard gradient."""
        reduced = self.comms.reduce_scatter(self.prepare_grad(grad, pre_divide, fp32_reduce_scatter),
                                            self.channel_reduce)
        reduced = self.comms.all_reduce_replicas(reduced, self.channel_replicas)
        return self.finish_grad(reduced, post_divide)

    def accumulate_shard_grad(self, reduced: torch.Tensor) -> None:
        if self.shard.grad is None:
            self.shard.grad = reduced
        else:
            self.shard.grad += reduced

    # --- introspection --------------------------------------------------------------------
    @property
    def names(self) -> List[str]:
        return [r.fqn for r in self.refs]

    def is_unsharded(self) -> bool:
        return self.state is ShardedState.UNSHARDED


# --- several groups of one unit in one collective (fewer, larger messages) -------------------------
def unshard_together(groups: List[ParamGroup], backward: bool = False) -> None:
    """All-gather every group's shard with one collective: the shards are concatenated (cast to the
    compute dtype), gathered as ``(world_size, total)`` and each group's columns copied into its full
    parameter in rank order."""
    comms = groups[0].comms
    shards = [g.shard.detach().reshape(-1).to(g.compute_dtype) for g in groups]
    gathered = comms.all_gather(torch.cat(shards), groups[0].channel_backward if backward else groups[0].channel_forward)
    gathered = gathered.view(comms.world_size, -1)
    offset = 0
    for group, shard in zip(groups, shards):
        n = shard.numel()
        comms.fill_full(group.full, gathered[:, offset:offset + n], group.padded_shape, group._unpad)
        offset += n
        group.state = ShardedState.UNSHARDED
        group.install()


def reduce_together(groups: List[ParamGroup], grads: List[torch.Tensor], pre_divide: float,
                    post_divide: float, fp32_reduce_scatter: bool) -> List[torch.Tensor]:
    """Reduce-scatter the full gradients of several groups with one collective; returns each
    group's fp32 shard gradient."""
    comms = groups[0].comms
    ws = comms.world_size
    blocks = [g.prepare_grad(grad, pre_divide, fp32_reduce_scatter).reshape(ws, -1) for g, grad in zip(groups, grads)]
    dtype = torch.float32 if any(b.dtype == torch.float32 for b in blocks) else blocks[0].dtype
    reduced = comms.reduce_scatter(torch.cat([b.to(dtype) for b in blocks], dim=1).reshape(-1), groups[0].channel_reduce)
    reduced = comms.all_reduce_replicas(reduced, groups[0].channel_replicas)
    out, offset = [], 0
    for group, block in zip(groups, blocks):
        n = block.shape[1]
        out.append(group.finish_grad(reduced[offset:offset + n], post_divide))
        offset += n
    return out
