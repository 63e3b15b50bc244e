"""torch_xla's data-parallel gradient habits, made harmless for FSDP shards.

``xm.optimizer_step``, ``xm.reduce_gradients`` and Accelerate's XLA path (the HF Trainer's
``clip_grad_norm_`` and optimizer step) all-reduce every gradient an optimizer holds, found by
``xm._fetch_gradients``. An FSDP shard's gradient is already reduced over the ranks that share its
shard, and the shards of different ranks are different slices of the model, so that all-reduce
mixes them (parameters 0.41 off after 3 steps at 2 devices). ``xm._fetch_gradients`` is patched to
leave out the gradients of parameters xla_fsdp owns (marked ``_xla_fsdp_reduced``); the other
parameters an optimizer holds are still all-reduced as before. ``XLA_FSDP_PATCH_TORCH_XLA=0`` turns
it off.
"""
from __future__ import annotations

import functools
import os
from typing import List

import torch

from .. import patches


def _fetch_unreduced_gradients(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p.grad.data for group in optimizer.param_groups for p in group["params"]
            if isinstance(p, torch.Tensor) and p.grad is not None and not getattr(p, "_xla_fsdp_reduced", False)]


def install_gradient_fetch() -> bool:
    """Patch ``xm._fetch_gradients`` (idempotent; by the first XLA unit). Returns whether it is installed."""
    if os.environ.get("XLA_FSDP_PATCH_TORCH_XLA", "1") == "0":
        return False
    import torch_xla.core.xla_model as xm
    patches.replace(xm, "_fetch_gradients", functools.wraps(xm._fetch_gradients)(_fetch_unreduced_gradients),
                    "xm.optimizer_step / xm.reduce_gradients must not all-reduce FSDP shard gradients again")
    return True
