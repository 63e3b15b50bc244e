"""Accelerate's gradient clipping, routed to an xla_fsdp model's own global clipping."""
from __future__ import annotations

import functools
import os


def patch_accelerate_clipping() -> bool:
    """Accelerate's ``clip_grad_norm_`` on XLA (the HF Trainer's clipping) clips an XLA FSDP model's
    shards by each rank's own shard norm: it calls the model's ``clip_grad_norm_`` only under
    ``ACCELERATE_USE_FSDP``, which the Trainer does not set for XLA FSDP (huggingface/accelerate#3180),
    so ranks clip differently and the reported norm is one rank's. Here, parameters that are exactly
    a prepared xla_fsdp model's go to that model's global ``clip_grad_norm_``. Returns whether
    Accelerate is there to patch (idempotent; ``XLA_FSDP_PATCH_TORCH_XLA=0`` turns it off)."""
    if os.environ.get("XLA_FSDP_PATCH_TORCH_XLA", "1") == "0":
        return False
    try:
        from accelerate import Accelerator
    except ImportError:
        return False
    from .. import patches
    from ..fully_sharded_data_parallel import XlaFullyShardedDataParallel

    original = patches.original(Accelerator, "clip_grad_norm_")

    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for model in getattr(self, "_models", []):
            if isinstance(model, XlaFullyShardedDataParallel) and {id(p) for p in model.parameters()} == ids:
                self.unscale_gradients()
                return model.clip_grad_norm_(max_norm, norm_type)
        return original(self, parameters, max_norm, norm_type)

    patches.replace(Accelerator, "clip_grad_norm_", clip_grad_norm_,
                    "Accelerate's clipping of an xla_fsdp model uses the model's global clip_grad_norm_")
    return True
