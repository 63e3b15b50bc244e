"""Gradient-norm clipping over sharded gradients: each rank holds part of every gradient, so the
norm is reduced across the sharding group before any rank scales its shard."""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import torch


@torch.no_grad()
def clip_sharded_grad_norm_(root, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every shard gradient of ``root``'s tree so the global norm is at most ``max_norm``.

    Matches ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (padding holds zero
    gradients, so it adds nothing to the norm). Returns the global norm before clipping (on the
    transport's device). Host-offloaded gradients are summed on the host, and only that one
    number crosses to the device and the clip factor back.
    """
    comms = root.comms
    grads = [p.grad for p in root.parameters() if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        local = _local(grads, lambda g: g.abs().max().float(), torch.max, comms.device)
        total = root.gather_norms(local).max()
    else:
        local = _local(grads, lambda g: g.float().abs().pow(norm_type).sum(), torch.sum, comms.device)
        total = root.gather_norms(local).sum() ** (1.0 / norm_type)
    # No host sync: clamp on device, as torch's own clip does.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coefs: Dict[torch.device, torch.Tensor] = {comms.device: coef}
    for g in grads:
        if g.device not in coefs:  # host-offloaded gradients: the factor is read back once
            comms.sync()  # XLA: run the norm's all-gather before reading its result on the host
            coefs[g.device] = coef.to(g.device)
        g.mul_(coefs[g.device].to(g.dtype))
    return total


def _local(grads: List[torch.Tensor], measure: Callable, combine: Callable, device: torch.device) -> torch.Tensor:
    """This rank's ``combine`` of ``measure(g)`` over its gradients, on ``device``: combined on the
    device each gradient lives on first, so host gradients send one number, not one per tensor."""
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(measure(g))
    parts = [combine(torch.stack(values)).to(device) for values in by_device.values()]
    return combine(torch.stack(parts)) if parts else torch.zeros((), dtype=torch.float32, device=device)
