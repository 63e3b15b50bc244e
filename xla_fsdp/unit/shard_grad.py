"""Gradients of shards that answer norms and overflow checks for the whole parameter.

A shard's ``.grad`` holds this rank's block of the gradient. Programs written for unsharded
training (and for PyTorch FSDP2, whose DTensor gradients behave this way) reduce over
``model.parameters()`` themselves: ``torch.nn.utils.clip_grad_norm_`` takes the norm of every
gradient, and ``torch.amp.GradScaler`` looks for infs in them. On shards each rank would get its
own answer (its own clip factor; an inf seen by one rank only, so ranks disagree on skipping the
step). :class:`ShardGrad` is the shard gradient's type: those few reductions are summed (or maxed)
over the ranks that split the parameter, so every rank gets the answer unsharded training gets:
norms over all elements (``torch.linalg.vector_norm``, ``torch.norm``, ``Tensor.norm``,
``torch._foreach_norm``), ``max``/``min`` over all elements (torch_xla's own ``clip_grad_norm_``,
which replaces torch's, takes the inf norm so), and GradScaler's ``found_inf``. ``detach()``,
``.data`` and ``abs()`` give the same gradient, still of this type; every other operation runs on
the plain tensor and returns plain tensors.

A norm of a shard gradient is therefore a collective: every rank of the sharding group must ask
for it (as with FSDP2's DTensors), not rank 0 alone.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..collectives import Collectives


class ShardGrad(torch.Tensor):
    """A shard's gradient; ``_xla_fsdp_sharding`` is (collectives of its sharding group, channel)."""

    _xla_fsdp_sharding: Tuple[Collectives, int]

    def _plain(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.detach()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (``torch.save``, pickling) as the plain tensor it is: readable with ``weights_only=True``."""
        return self._plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        """A copy is a plain tensor: it is no longer this parameter's gradient."""
        return self._plain().clone()

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            handler = _GLOBAL.get(func)
            if handler is not None:
                result = handler(result, args, kwargs)
            elif (func in _SAME_GRADIENT and isinstance(args[0], ShardGrad) and isinstance(result, torch.Tensor)
                  and result is not args[0]):
                result = as_shard_grad(result, *args[0]._xla_fsdp_sharding)
        return result


def as_shard_grad(grad: torch.Tensor, comms: Collectives, channel: int) -> torch.Tensor:
    """``grad`` itself, a tensor the unit just made, retyped as a :class:`ShardGrad` of a group
    sharded over ``comms``. Not ``as_subclass``: that makes an alias, and on XLA an alias is a view
    whose graph still holds the reduce-scatter, so reading it on one rank ran the collective again
    (an XLA rendezvous abort). Without sharding (one rank: NO_SHARD, the SPMD mode's logical rank)
    it stays plain."""
    if comms.world_size == 1 or isinstance(grad, ShardGrad):
        return grad
    grad.__class__ = ShardGrad
    grad._xla_fsdp_sharding = (comms, channel)
    return grad


def run_shard_hooks(shard: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """Hooks the program registered on the shard (``register_hook``) see its gradient block
    before it is added to ``.grad`` and may replace it, as autograd does for a leaf. The shard is
    never in the autograd graph, so without this they would never run."""
    for hook in list((shard._backward_hooks or {}).values()):
        replaced = hook(reduced)
        if replaced is not None:
            reduced = replaced
    return reduced


def run_post_accumulate_hooks(shard: torch.Tensor) -> None:
    """``register_post_accumulate_grad_hook`` hooks on the shard (an optimizer step in backward):
    run once the reduced block is in ``shard.grad``, as autograd would."""
    for hook in list((shard._post_accumulate_grad_hooks or {}).values()):
        hook(shard)


# ----------------------------------------------------------------------------- norms
def _order(args: Sequence[Any], kwargs: Dict[str, Any], position: int, names: Sequence[str], default: Any) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else default


def _whole(args: Sequence[Any], kwargs: Dict[str, Any], position: int) -> bool:
    """Whether the norm runs over every element (no ``dim``)."""
    dim = kwargs.get("dim", args[position] if len(args) > position else None)
    return dim is None or (isinstance(dim, (tuple, list)) and len(dim) == args[0].dim())


def _combine(local: List[torch.Tensor], ords: List[float], sharding: List[Optional[Tuple[Collectives, int]]]
             ) -> List[torch.Tensor]:
    """Whole-parameter norms from per-rank shard norms: ``(sum |x|^p)^(1/p)`` over the ranks
    (max for inf, min for -inf, a sum of counts for 0), one all-gather per sharding group."""
    out = list(local)
    by_group: Dict[int, List[int]] = {}
    for i, s in enumerate(sharding):
        if s is not None:
            by_group.setdefault(id(s[0]), []).append(i)
    for indices in by_group.values():
        comms, channel = sharding[indices[0]]
        values = []
        for i in indices:
            v, p = local[i].detach().float().reshape(()), ords[i]
            values.append(v.pow(p) if p not in (0.0, math.inf, -math.inf) else v)
        gathered = comms.all_gather(torch.stack(values).to(comms.device), channel).view(comms.world_size, len(indices))
        for column, i in enumerate(indices):
            column_values, p = gathered[:, column], ords[i]
            if p == math.inf:
                total = column_values.max()
            elif p == -math.inf:
                total = column_values.min()
            elif p == 0.0:
                total = column_values.sum()
            else:
                total = column_values.sum().pow(1.0 / p)
            out[i] = total.to(local[i].device, local[i].dtype).reshape(local[i].shape)
    return out


def _ord_value(ord_: Any) -> float:
    if ord_ is None or ord_ == "fro":
        return 2.0
    if isinstance(ord_, str):
        raise RuntimeError(f"xla_fsdp: the '{ord_}' norm of a shard gradient cannot be formed from its "
                           "shards; gather the full gradient first (xla_fsdp.checkpoints / summon) or use a "
                           "vector norm")
    return float(ord_)


def _refuse_partial(func_name: str) -> None:
    raise RuntimeError(f"xla_fsdp: {func_name} over some dimensions of a shard gradient would be this rank's "
                       "block only; take the norm over all elements (no dim), which xla_fsdp sums over the "
                       "ranks, or gather the full gradient first")


def _vector_norm(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    tensor = args[0]
    if not isinstance(tensor, ShardGrad):
        return result
    if not _whole(args, kwargs, 2):
        _refuse_partial("torch.linalg.vector_norm")
    p = _ord_value(_order(args, kwargs, 1, ("ord",), 2))
    return _combine([result], [p], [tensor._xla_fsdp_sharding])[0]


def _norm(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``torch.norm`` and ``Tensor.norm``: a vector norm over all elements unless ``dim`` is given."""
    tensor = args[0]
    if not isinstance(tensor, ShardGrad):
        return result
    if not _whole(args, kwargs, 2):
        _refuse_partial("a norm")
    p = _ord_value(_order(args, kwargs, 1, ("p",), 2))
    return _combine([result], [p], [tensor._xla_fsdp_sharding])[0]


def _linalg_norm(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``torch.linalg.norm``: the vector norm of a 1-D shard, or the Frobenius norm; a matrix
    norm (spectral, nuclear, ...) of a dim-0 shard cannot be formed from shards."""
    tensor = args[0]
    if not isinstance(tensor, ShardGrad):
        return result
    if not _whole(args, kwargs, 2):
        _refuse_partial("torch.linalg.norm")
    ord_ = _order(args, kwargs, 1, ("ord",), None)
    if tensor.dim() == 2 and ord_ not in (None, "fro"):
        _ord_value(str(ord_))
    return _combine([result], [_ord_value(ord_)], [tensor._xla_fsdp_sharding])[0]


def _foreach_norm(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    tensors = args[0]
    p = _ord_value(_order(args, kwargs, 1, ("ord",), 2))
    sharding = [t._xla_fsdp_sharding if isinstance(t, ShardGrad) else None for t in tensors]
    return tuple(_combine(list(result), [p] * len(result), sharding))


def _non_finite_check(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``GradScaler.unscale_``: an inf in any rank's block is an inf for every rank of its group."""
    grads = args[0]
    found_inf = _order(args, kwargs, 1, ("found_inf",), None)
    seen = set()
    for g in grads:
        if isinstance(g, ShardGrad) and id(g._xla_fsdp_sharding[0]) not in seen:
            comms, channel = g._xla_fsdp_sharding
            seen.add(id(comms))
            gathered = comms.all_gather(found_inf.detach().float().reshape(1).to(comms.device), channel)
            found_inf.copy_(gathered.max().to(found_inf.device, found_inf.dtype).reshape(found_inf.shape))
    return result


def _extreme(largest: bool) -> Callable[[Any, Sequence[Any], Dict[str, Any]], Any]:
    """``max``/``amax`` (``largest``) or ``min``/``amin`` over every element: torch_xla's own
    ``clip_grad_norm_`` takes the inf norm so."""
    def handler(result: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        tensor = args[0]
        if not isinstance(tensor, ShardGrad) or len(args) > 1 or kwargs or not isinstance(result, torch.Tensor):
            return result
        comms, channel = tensor._xla_fsdp_sharding
        gathered = comms.all_gather(result.detach().reshape(1).to(comms.device), channel)
        total = gathered.max() if largest else gathered.min()
        return total.to(result.device, result.dtype).reshape(result.shape)
    return handler


_GLOBAL: Dict[Callable, Callable[[Any, Sequence[Any], Dict[str, Any]], Any]] = {
    torch.linalg.vector_norm: _vector_norm,
    torch.linalg.norm: _linalg_norm,
    torch.norm: _norm,
    torch.Tensor.norm: _norm,
    torch._foreach_norm: _foreach_norm,
    torch._amp_foreach_non_finite_check_and_unscale_: _non_finite_check,
    torch.Tensor.max: _extreme(True), torch.max: _extreme(True), torch.Tensor.amax: _extreme(True),
    torch.amax: _extreme(True), torch.Tensor.min: _extreme(False), torch.min: _extreme(False),
    torch.Tensor.amin: _extreme(False), torch.amin: _extreme(False),
}
#: operations whose result is the same gradient (a detached alias, its magnitudes): still a ShardGrad
_SAME_GRADIENT = {torch.Tensor.detach, torch.Tensor.data.__get__, torch.Tensor.abs, torch.abs}
