"""The collectives of a unit's gather groups (FSDP2's ``_fsdp_collectives``): a unit's all-gathers and
reduce-scatters started over several groups at once, small groups sharing one collective on
transports that coalesce (fewer, larger messages), and a gradient's way from the full parameter to
the shard (padded, divided, accumulated through the program's hooks). What is started here is
finished by the returned function (gathers) or :class:`ReduceInFlight` (reduce-scatters); when to
start them is the unit's runtime's (``runtime.py``)."""
from __future__ import annotations

import math
from typing import Any, Callable, List, Set, Tuple

import torch

from .gather_group import GatherGroup
from .gradients import as_shard_grad, run_post_accumulate_hooks, run_shard_hooks
from .options import SOLO_NUMEL


# ================================================================= several groups in one collective


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
    dtypes = {torch.float32 if fp32_reduce_scatter else grad.dtype for grad in grads}
    scale, pre_divide, post_divide = divisions_in_collective(comms, dtypes, pre_divide, post_divide)
    padded = [grad_to_reduce(g, grad, pre_divide, fp32_reduce_scatter) for g, grad in zip(groups, grads)]
    if len(groups) == 1:
        return ReduceInFlight(groups, [padded[0].numel() // comms.world_size],
                              comms.start_reduce_scatter(padded[0], groups[0].channel_reduce, scale), post_divide)
    blocks = [p.reshape(comms.world_size, -1) for p in padded]
    dtype = torch.float32 if any(b.dtype == torch.float32 for b in blocks) else blocks[0].dtype
    joined = torch.cat([b.to(dtype) for b in blocks], dim=1).reshape(-1)
    return ReduceInFlight(groups, [b.shape[1] for b in blocks],
                          comms.start_reduce_scatter(joined, groups[0].channel_reduce, scale), post_divide)


def divisions_in_collective(comms: Any, dtypes: Set[torch.dtype], pre_divide: float,
                            post_divide: float) -> Tuple[float, float, float]:
    """(the reduce-scatter's scale, the pre- and post-division left to do as ops). Where the transport
    scales in the collective itself (XLA), a division by a power of two moves into it: dividing by
    2**k before or after an exact sum of the same addends gives the same bits (short of the
    subnormal range), and each division moved is ops less per gradient. Not for float16, whose
    range is why the pre-division exists (a sum there may overflow before it is scaled)."""
    if not comms.scales_in_collective or comms.world_size == 1 or torch.float16 in dtypes:
        return 1.0, pre_divide, post_divide
    scale = 1.0
    if _power_of_two(pre_divide):
        scale, pre_divide = scale / pre_divide, 1.0
    if _power_of_two(post_divide):
        scale, post_divide = scale / post_divide, 1.0
    return scale, pre_divide, post_divide


def _power_of_two(factor: float) -> bool:
    mantissa, _ = math.frexp(factor)
    return factor > 0 and mantissa == 0.5


# =============================================================== a gradient on its way to the shard
# The full gradient padded to the group's layout and pre-divided, this rank's reduced block divided
# again and cast to the shard's dtype, then added to the shard's ``.grad`` (through the program's hooks,
# and to the host with offload).


def grad_to_reduce(group: GatherGroup, grad: torch.Tensor, pre_divide: float,
                   fp32_reduce_scatter: bool) -> torch.Tensor:
    """The padded, pre-divided full gradient, ready to reduce-scatter."""
    comms = group.comms  # the unit owns it: it may be divided in place. A view is kept but at one rank of a
    # lazy transport, where it would be the shard gradient itself (past a reduce-scatter, a new tensor)
    padded = group.kind.pad_grad(grad, comms.views_see_refills or comms.world_size > 1)
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
