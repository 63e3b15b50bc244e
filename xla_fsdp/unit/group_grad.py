"""A gather group's gradient on its way to the shard: the full gradient padded to the group's layout
and pre-divided, this rank's reduced block divided again and cast to the shard's dtype, then added to
the shard's ``.grad`` (through the program's hooks, and to the host with offload). The reduction
itself is ``backward.py``'s (one group) or ``coalesce.py``'s (several groups in one collective)."""
from __future__ import annotations

import torch

from ..sharding import flatten_and_pad, pad_dim0
from .gather_group import GatherGroup
from .shard_grad import as_shard_grad, run_post_accumulate_hooks, run_shard_hooks


def prepare(group: GatherGroup, grad: torch.Tensor, pre_divide: float, fp32_reduce_scatter: bool) -> torch.Tensor:
    """The padded, pre-divided full gradient, ready to reduce-scatter."""
    padded = _pad(group, grad)  # the unit owns this gradient now: divide in place
    if pre_divide != 1:
        padded.div_(pre_divide)
    if fp32_reduce_scatter and padded.dtype != torch.float32:
        padded = padded.to(torch.float32)
    return padded


def finish(group: GatherGroup, reduced: torch.Tensor, post_divide: float) -> torch.Tensor:
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


def accumulate(group: GatherGroup, reduced: torch.Tensor) -> None:
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
