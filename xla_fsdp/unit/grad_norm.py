"""Gradient-norm clipping over sharded gradients: each rank holds part of every gradient, so the
norm is reduced across the sharding group before any rank scales its shard."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def clip_sharded_grad_norm_(root, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every shard gradient of ``root``'s tree so the global norm is at most ``max_norm``.

    Matches ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (padding holds zero
    gradients, so it adds nothing to the norm). Returns the global norm before clipping.
    """
    comms = root.comms
    grads = [p.grad for p in root.parameters() if p.grad is not None]
    norm_type = float(norm_type)
    zero = torch.zeros((), dtype=torch.float32, device=comms.device)
    if norm_type == math.inf:
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else zero
        total = comms.all_gather(local.view(1), root._norm_channel).max()
    else:
        local = (torch.stack([g.float().abs().pow(norm_type).sum() for g in grads]).sum()
                 if grads else zero)
        total = comms.all_gather(local.view(1), root._norm_channel).sum() ** (1.0 / norm_type)
    # No host sync: clamp on device, as torch's own clip does.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
