"""Where a gather group's members live in the module: the plain attributes the unit sets in place of
the original parameters (``set_module_tensor`` / ``module_tensor``), the gradient hooks the program
registered on the originals (moved to what the module computes with), a flat buffer split into
members of their own (``SplitFlat``), and the fingerprint of a group's values."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn as nn


class SplitFlat(torch.autograd.Function):
    """A padded flat buffer cut into parameters that are tensors of their own, not views (so
    they can be refilled in place); their gradients join back with one concatenation."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, sizes: Tuple[int, ...], shapes: Tuple[Tuple[int, ...], ...],
                group: Any):
        ctx.padding, ctx.group = sizes[-1], group
        ctx.set_materialize_grads(False)  # a member this backward pass did not reach is told apart
        pieces = torch.split(full, list(sizes))
        return tuple(piece.view(shape).clone() for piece, shape in zip(pieces, shapes))

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        # A member without gradient in this pass may get it in a later one (a reentrant checkpoint
        # inside the module recomputes it in a backward of its own): the unit then waits for the
        # end of backward before reducing and freeing (see ``backward.on_full_grad_ready``).
        ctx.group.grad_incomplete = ctx.group.grad_incomplete or any(g is None for g in grads)
        some = next((g for g in grads if g is not None), None)
        if some is None:
            return None, None, None, None
        flat = [g.reshape(-1) if g is not None else some.new_zeros(n)
                for g, n in zip(grads, ctx.group.layout.numels)]
        if ctx.padding:
            flat.append(some.new_zeros(ctx.padding))
        return torch.cat(flat), None, None, None


def fingerprint(tensors: List[torch.Tensor], samples: int = 1024) -> torch.Tensor:
    """A 0-d float32 summary of ``tensors``: up to ``samples`` evenly strided elements of each,
    weighted by position (so a permutation changes it). Identical values give identical bits on
    every rank; values drawn from different random states differ with near certainty. Left on the
    device: read back once for the whole model (see the wrapper's check)."""
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        picked = flat[::max(1, flat.numel() // samples)][:samples].float()
        weights = torch.arange(1, picked.numel() + 1, dtype=torch.float32, device=picked.device)
        total = total + (picked * weights).sum()
    return total


def set_module_tensor(module: nn.Module, attr: str, value: Optional[torch.Tensor]) -> None:
    """Give ``module`` a plain attribute ``attr`` (never a registered parameter: the unit's
    ``parameters()`` are the shards). Recurrent layers compute from their own list of weights,
    which their ``__setattr__`` keeps current: kept current here too."""
    if not getattr(getattr(module._parameters.get(attr), "_xla_fsdp_group", None), "in_place", False):
        module._parameters.pop(attr, None)  # (fully_shard's shard stays registered, shadowed by ``value``)
    object.__setattr__(module, attr, value)
    names = getattr(module, "_flat_weights_names", None)
    if isinstance(module, nn.RNNBase) and names is not None and attr in names:
        module._flat_weights[names.index(attr)] = value


def module_tensor(module: nn.Module, attr: str) -> torch.Tensor:
    """``module.attr`` as the program left it: a Parameter assigned to it is registered by
    ``nn.Module.__setattr__``, and read from there."""
    value = module.__dict__.get(attr)  # nn.Module.__setattr__ of a Parameter removes the plain attribute
    return value if value is not None else module._parameters.get(attr)


def hooks_kept_from(ref: Any) -> List[Callable]:
    """Gradient hooks registered on an original parameter before wrapping: they move to the
    tensor the module computes with, so they see (and may change) the full gradient as before.
    A post-accumulate hook would read ``param.grad`` of a parameter that no longer gets one."""
    if ref.param._post_accumulate_grad_hooks:
        raise RuntimeError(
            f"xla_fsdp: parameter '{ref.fqn}' has a post-accumulate-grad hook registered before wrapping; "
            "the original parameter gets no gradient once sharded. Register it after wrapping on the shard "
            "(a parameter of model.parameters()): it then runs once the reduced gradient block is in shard.grad.")
    return [_only_with_gradient(hook) for hook in (ref.param._backward_hooks or {}).values()]


def _only_with_gradient(hook: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Callable[..., Any]:
    """A flat member's hook runs in every backward pass that reaches the unit's split, also one
    (a reentrant checkpoint's own) that gives this member no gradient: autograd then calls it with
    None, where the original parameter's hook would not have run at all."""
    def run(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if grad is None else hook(grad)
    return run
