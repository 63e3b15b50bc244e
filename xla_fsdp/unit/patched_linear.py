"""``nn.Linear`` that saves its weight, not a transposed copy, for backward (XLA only).

On XLA ``F.linear`` saves ``weight.t()`` for the weight gradient, a value computed from the
forward-time gather; that keeps a ZeRO-3 unit's full weights alive until backward. Saving the
weight leaf itself lets backward read the re-gathered parameter instead (pytorch/xla#3811).
"""
from __future__ import annotations

import types
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import patches


class LinearSavingWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = flat_grad.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _patched_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):
        # autocast casts the weight to its dtype inside F.linear and saves that copy (what plain torch_xla
        # does): a Function here would get fp32 weights and a bf16 gradient, which XLA's verifier rejects
        return F.linear(x, self.weight, self.bias)
    return LinearSavingWeight.apply(x, self.weight, self.bias)


_PATCHED: "weakref.WeakSet[nn.Linear]" = weakref.WeakSet()


def _unpatch_all() -> None:
    for m in list(_PATCHED):
        if getattr(m.__dict__.get("forward"), "__func__", None) is _patched_forward:
            del m.forward
    _PATCHED.clear()


def patch_linear_layers(module: nn.Module) -> None:
    """Switch every plain ``nn.Linear`` in ``module`` to the weight-saving forward (listed in the
    patch registry, which can put the class's forward back)."""
    for m in module.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m.forward = types.MethodType(_patched_forward, m)
            _PATCHED.add(m)
            patches.record("instances: torch.nn.Linear.forward (xla_fsdp saves the weight, not its transpose)",
                           _unpatch_all, "on XLA, F.linear saves weight.t() for backward, which keeps a ZeRO-3 "
                           "unit's gathered weights alive until backward (pytorch/xla#3811)")
