"""Activation rematerialization that composes with FSDP units.

Wrap the inner module (``FSDP(checkpoint_module(layer))``): the unit gathers its parameters once
before the checkpointed forward, and in backward the recompute runs against the parameters the
unit re-gathered for backward, so rematerialization adds no all-gather of its own.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint


def _on_xla(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "xla" for a in args)


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module`` drop its activations after forward and recompute them in backward.

    Uses PyTorch's non-reentrant checkpoint, so it also works when no input requires grad (the
    first layer of a model fed integer token ids), which the reentrant variant silently skips.
    """
    if getattr(module, "_xla_fsdp_checkpointed", False):
        return module
    original_forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original_forward(*args, **kwargs)
        # torch.utils.checkpoint cannot capture the RNG state of XLA devices.
        return torch_checkpoint.checkpoint(original_forward, *args, use_reentrant=False,
                                           preserve_rng_state=not _on_xla(args), **kwargs)

    module._xla_checkpointed_forward_original = original_forward  # name kept from torch_xla
    module.forward = checkpointed_forward
    module._xla_fsdp_checkpointed = True
    return module
