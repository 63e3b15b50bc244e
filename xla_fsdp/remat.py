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


def _tensors(args: Any, kwargs: Any):
    return [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]


def _xla_checkpoint(fn, args: tuple, kwargs: dict) -> Any:
    """torch_xla's checkpoint takes positional arguments only (it rejects keywords such as the
    attention masks HF models pass): keyword tensors travel as positional inputs, so their
    gradients still flow, and the rest is bound here."""
    import torch_xla.utils.checkpoint as xla_checkpoint

    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    others = {k: v for k, v in kwargs.items() if k not in tensor_keys}
    n = len(args)

    def positional(*inputs: Any) -> Any:
        return fn(*inputs[:n], **dict(zip(tensor_keys, inputs[n:])), **others)
    positional.recomputes_a_unit = True  # told apart from a program's own checkpoint (see unit/gradients.py)
    return xla_checkpoint.checkpoint(positional, *args, *(kwargs[k] for k in tensor_keys))


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Make ``module`` drop its activations after forward and recompute them in backward.

    Eager devices use PyTorch's non-reentrant checkpoint, which also works when no input requires
    grad. PyTorch's checkpoint cannot run on XLA devices, so there torch_xla's (reentrant,
    barrier-fenced, XLA-RNG-preserving) checkpoint is used; it needs an input that requires grad,
    and without one the module runs without rematerialization (correct gradients, no saving).
    """
    if getattr(module, "_xla_fsdp_checkpointed", False):
        return module
    original_forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original_forward(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        if any(t.device.type == "xla" for t in tensors):
            if not any(t.requires_grad for t in tensors):
                return original_forward(*args, **kwargs)
            return _xla_checkpoint(recompute_ready_forward, args, kwargs)
        return torch_checkpoint.checkpoint(original_forward, *args, use_reentrant=False, **kwargs)

    def recompute_ready_forward(*args: Any, **kwargs: Any) -> Any:
        # The reentrant checkpoint calls this again inside backward, bypassing the owning unit. A
        # module run twice in one forward is recomputed twice, in two separate backward passes, and
        # the first one's gradient frees the unit's parameters: the unit re-gathers them here.
        before = getattr(module, "_xla_fsdp_before_recompute", None)
        if before is not None and torch._C._current_graph_task_id() != -1:
            before()
        return original_forward(*args, **kwargs)

    module._xla_checkpointed_forward_original = original_forward  # name kept from torch_xla
    module.forward = checkpointed_forward
    module._xla_fsdp_checkpointed = True
    return module
