"""Where a gather group's members live in the module: the original parameters and their places
(``ParamRef``), the plain attributes the unit sets in place of the originals (``set_module_tensor`` /
``module_tensor``), what those places hold between gathers (``freed_stand_ins``) and, for a flat group,
while gathered (``FlatMembers``: views of the full buffer, or tensors of their own split by
``SplitFlat``), the gradient hooks the program registered on the originals (moved to what the module
computes with), and the fingerprint of a group's values. Between gathers a member's place holds a
:class:`FreedParameter` (the last part of this file)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..collectives import Collectives
from ..sharding import FlatLayout


@dataclass
class ParamRef:
    """An original parameter and every (module, attribute) that refers to it (tied weights)."""

    param: nn.Parameter
    fqn: str                                     # first name, relative to the unit's module
    slots: List[Tuple[nn.Module, str]]
    aliases: List[str]                           # further names of the same parameter


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
        # end of backward before reducing and freeing (see ``UnitRuntime.post_backward``).
        if any(g is None for g in grads):
            ctx.group.gradient_incomplete()
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


class FlatMembers:
    """A flat group's parameters as its module sees them while gathered, cut from ``full``.

    Eager storage: views. Autograd's saved views read the same storage, which the backward
    re-gather refills. Lazy tensors (XLA) have no shared storage: a saved view would keep the
    forward's gather alive until backward, the full unit for the whole step. There each
    parameter is a tensor of its own; the backward re-gather refills the saved ones in place,
    as the unflattened layout does with its parameters."""

    def __init__(self, layout: FlatLayout, comms: Collectives, hooks: List[List[Callable]]):
        self.layout, self.comms, self.hooks = layout, comms, hooks
        self.sizes = list(layout.numels) + [layout.padded_numel - sum(layout.numels)]
        self.current: Optional[List[torch.Tensor]] = None  # the tensors of their own last cut (lazy)
        # Every set handed out since the root's forward began: a unit called twice with another unit
        # in between gathers twice, and backward must refill what both calls saved.
        self.handed_out: List[List[torch.Tensor]] = []

    def cut(self, full: torch.Tensor, group: Any, refill_saved: bool) -> List[torch.Tensor]:
        """The members of ``full`` (``refill_saved``: the backward re-gather refills the saved ones)."""
        if self.comms.views_see_refills:
            # One split, not one slice per parameter: autograd then joins the gradients with a
            # single concatenation instead of a full-size zero-filled buffer per parameter.
            # Grad mode on even in backward's re-gather: a view made with it off has no grad_fn, so
            # an activation-checkpointing recompute that uses it directly (GPT-2's Conv1D: addmm
            # of the weight) saves fewer tensors than the forward did and torch's checkpoint fails.
            with torch.enable_grad():
                chunks = torch.split(full, self.sizes)
                return self._hooked([c.view(shape) for c, shape in zip(chunks, self.layout.shapes)])
        if refill_saved and self.current is not None:
            pieces = torch.split(full, self.sizes)
            for members in self.handed_out:
                for member, piece, shape in zip(members, pieces, self.layout.shapes):
                    self.comms.fill_full(member, piece, tuple(shape), lambda t: t)
        else:
            members = SplitFlat.apply(full, tuple(self.sizes), tuple(self.layout.shapes), group)
            self.current = self._hooked(list(members))
            self.handed_out.append(self.current)
        return self.current

    def _hooked(self, members: List[torch.Tensor]) -> List[torch.Tensor]:
        """Members handed to the module carry the hooks of the parameters they stand for."""
        for member, hooks in zip(members, self.hooks):
            if member.requires_grad:
                for hook in hooks:
                    member.register_hook(hook)
        return members

    def begin_forward(self, gathered: bool) -> None:
        """A root's forward begins: members handed out before are no longer saved by any graph that
        will run backward (the current ones, if still ``gathered``, are)."""
        self.handed_out = [self.current] if self.current is not None and gathered else []

    def freed_since_saved(self) -> bool:
        """Members an earlier call of this forward saved were freed since (the unit ran again)."""
        return len(self.handed_out) > 1 and any(not self.comms.is_allocated(m[0]) for m in self.handed_out if m)

    def free(self) -> None:
        for members in self.handed_out:
            for member in members:
                self.comms.free(member)


def freed_stand_ins(refs: List[ParamRef], shapes: List[Tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                    shard: torch.Tensor) -> List[torch.Tensor]:
    """What the members' places hold between gathers: stand-ins that know each member's shape and refuse
    data access (see FreedParameter below). (fully_shard's places show its registered ShardParam instead.)"""
    return [FreedParameter(shape, dtype, device, ref.fqn, shard) for ref, shape in zip(refs, shapes)]


def set_module_tensor(module: nn.Module, attr: str, value: Optional[torch.Tensor]) -> None:
    """Give ``module`` a plain attribute ``attr`` (never a registered parameter: the unit's
    ``parameters()`` are the shards); fully_shard's registered ShardParam as ``value``: no plain attribute,
    so the registered one shows. Recurrent layers compute from their own list of weights,
    which their ``__setattr__`` keeps current: kept current here too."""
    registered = module._parameters.get(attr)
    if value is not None and value is registered:
        module.__dict__.pop(attr, None)
    else:
        if not getattr(getattr(registered, "_xla_fsdp_group", None), "in_place", False):
            module._parameters.pop(attr, None)  # (fully_shard's ShardParam stays registered, shadowed by ``value``)
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


# ===================================================================== the stand-in between gathers
# What a module's parameter attribute holds between steps, while only the shard exists.
#
# The full parameter's memory is released after use (on eager devices its storage is resized to
# zero), so a program that wrote into it there (``nn.init.zeros_(model.module.fc.weight)`` or a
# ``copy_`` under ``torch.no_grad()``) would write past the end of an empty storage and kill the
# process. :class:`FreedParameter` stands in for it instead: it has the parameter's shape, dtype,
# device and ``requires_grad`` (which it passes on to the shard), and any operation on its data
# raises one error that names the parameter and the way to reach the full data.


_PASS_THROUGH = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_SET_REQUIRES_GRAD = torch.Tensor.requires_grad.__set__


class FreedParameter(torch.Tensor):
    """A stand-in with no storage for a sharded parameter (see the module docstring)."""

    _xla_fsdp_name: str
    _xla_fsdp_shard: torch.Tensor

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device, name: str,
                shard: torch.Tensor) -> "FreedParameter":
        freed = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                    requires_grad=shard.requires_grad)
        freed._xla_fsdp_name = name
        freed._xla_fsdp_shard = shard
        return freed

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FreedParameter":
        """A deep copy of the module (an EMA teacher made from it) gets a stand-in too: copy the
        model inside ``summon_full_params`` to get its values."""
        return FreedParameter(self.shape, self.dtype, self.device, self._xla_fsdp_name, self._xla_fsdp_shard)

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"FreedParameter('{self._xla_fsdp_name}', shape={tuple(self.shape)}, dtype={self.dtype}: "
                "sharded between steps)")

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.requires_grad_ or func == _SET_REQUIRES_GRAD:
            # Freezing or unfreezing through the module's attribute acts on the shard (see
            # GatherGroup.follow_requires_grad); the stand-in itself is replaced at the next step.
            value = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
            args[0]._xla_fsdp_shard.requires_grad_(value)
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        freed = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, FreedParameter))
        if func in _PASS_THROUGH:  # .data, .detach(): still a stand-in
            return FreedParameter(freed.shape, freed.dtype, freed.device, freed._xla_fsdp_name, freed._xla_fsdp_shard)
        raise RuntimeError(
            f"xla_fsdp: parameter '{freed._xla_fsdp_name}' is sharded between forward passes, so it holds no data "
            f"here ({func}). Read or change it inside `with XlaFullyShardedDataParallel.summon_full_params(model):` "
            "(changes are written back to the shards; model.apply(fn) does this for you), or use the shards: "
            "model.parameters(), xla_fsdp.checkpoints.full_state_dict / load_full_state_dict.")
