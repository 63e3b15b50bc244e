"""The parameter ``fully_shard`` registers on XLA: :class:`ShardParam`, FSDP2's sharded parameter
without DTensor. It is what ``model.parameters()``, ``named_parameters()`` and the module's attribute
between steps give the program: the whole parameter's metadata (``shape``, ``numel()``, ``dim()``,
dtype, device), as a DTensor reports it, over this rank's rows of it (its gather group's ``shard``, the
tensor the unit gathers from and reduces into; the rows are padded to the same count on every rank).

What the program does with it keeps DTensor's meaning or is refused, never silently this rank's answer:

- operations that act element by element (those ATen tags ``pointwise``, the ``_foreach_*`` ops, fills,
  copies, casts, ``*_like``) run on the rows, at the speed of the plain tensor: an optimizer step, a
  clip's scaling, ``nn.init.zeros_``, ``p.mul_(0.5)`` under ``no_grad`` change the shard as they would
  change the whole parameter. In-place ones give the parameter back; the others give plain tensors of
  the rows (an optimizer's state, ``p.detach()``, and so ``state_dict()``'s values, as before);
- norms (``p.norm()``, ``torch.linalg.vector_norm``, ``_foreach_norm``) span every rank's rows, as a
  DTensor's: a collective every rank calls;
- everything else (indexing, reductions, views, matmul, random fills such as ``nn.init.normal_``) would
  see only this rank's rows: refused with an error naming the parameter and ``summon_full_params``.

The unit itself reads and writes the plain shard (``group.shard``); this class is only what the
program sees. Its gradient, ``requires_grad`` and hooks are the shard's.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .gradients import combine_norms, norm_order

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_AS_PLAIN = torch._C._disabled_torch_function_impl  # a call as if the subclass had no torch function


class NoDeviceMesh:
    """A shard's ``device_mesh``: XLA's per-device ranks have no DeviceMesh for DTensor, so any use
    (``distribute_tensor(full, p.device_mesh, p.placements)`` first asks ``bool(mesh)``) is one
    clear error naming the way to load full weights."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "xla_fsdp.fully_shard on XLA: parameters are shards, not DTensors, and have no device mesh "
            "(distribute_tensor and load_state_dict(assign=True) cannot place them); load full weights with "
            "xla_fsdp.checkpoints.state_dict_api.set_model_state_dict(model, full_state_dict, "
            "options=StateDictOptions(full_state_dict=True))")

    __bool__ = __len__ = __iter__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like look for optional dunders
            raise AttributeError(name)
        self._refuse()

    def __repr__(self) -> str:
        return "<no DeviceMesh: an xla_fsdp shard on XLA>"


NO_DEVICE_MESH = NoDeviceMesh()


class ShardParam(torch.Tensor):
    """See the module docstring. ``value``: rows other than the group's shard (``p.data``'s detached
    rows, or rows a ``load_state_dict`` passes in); None for the registered parameter itself."""

    _xla_fsdp_group: Any
    _value: Optional[torch.Tensor]
    #: ``p.data``: the shard itself, operated on without gradient (so an in-place write counts as one)
    _detached: bool
    _is_param = True  # isinstance(p, nn.Parameter) holds, as for FSDP2's DTensor parameters

    @staticmethod
    def __new__(cls, group: Any, value: Optional[torch.Tensor] = None, detached: bool = False) -> "ShardParam":
        rows = group.shard if value is None else value
        param = torch.Tensor._make_wrapper_subclass(cls, group.full_shape, dtype=rows.dtype, device=rows.device)
        param._xla_fsdp_group = group
        param._value = value
        param._detached = detached
        return param

    def rows(self) -> torch.Tensor:
        """This rank's rows (padded): the plain tensor every operation runs on."""
        return self._xla_fsdp_group.shard if self._value is None else self._value

    def _is_the_parameter(self) -> bool:
        return self._value is None and not self._detached

    # --- what autograd and the optimizer read: the shard's
    @property
    def grad(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        """The shard's gradient: this rank's block of the reduced gradient (its norms span the ranks)."""
        return self._xla_fsdp_group.shard.grad if self._is_the_parameter() else None

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        if not self._is_the_parameter():
            raise RuntimeError("xla_fsdp: a gradient can be set on the parameter, not on a tensor made from it")
        self._xla_fsdp_group.shard.grad = value.rows() if isinstance(value, ShardParam) else value

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return self._is_the_parameter() and self._xla_fsdp_group.shard.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> "ShardParam":  # type: ignore[override]
        """Freezing or unfreezing the parameter freezes or unfreezes its shard (the unit follows it at
        the next gather)."""
        if not self._is_the_parameter():
            raise RuntimeError("xla_fsdp: set requires_grad on the parameter itself, not on a tensor made from it")
        self._xla_fsdp_group.shard.requires_grad_(requires_grad)
        return self

    @property
    def data(self) -> "ShardParam":  # type: ignore[override]
        """The parameter detached: the shard's rows, operated on without gradient (writes reach the shard,
        and count as writes: the unit gathers again after one)."""
        if self._is_the_parameter():
            return ShardParam(self._xla_fsdp_group, detached=True)
        return self

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        rows = value.rows() if isinstance(value, ShardParam) else value
        group = self._xla_fsdp_group
        if tuple(rows.shape) != tuple(group.shard.shape) or rows.dtype != group.shard.dtype:
            raise RuntimeError(
                f"xla_fsdp: .data of '{self._xla_fsdp_name}' (shape {tuple(self.shape)}, {self.dtype}, sharded on "
                f"dim 0) cannot be replaced with a tensor of shape {tuple(value.shape)} and {value.dtype}: it is this "
                "rank's rows of the parameter. Write full values inside `with XlaFullyShardedDataParallel."
                "summon_full_params(model):`, or load them with xla_fsdp.checkpoints.state_dict_api."
                "set_model_state_dict")
        group.shard.data = rows

    def register_hook(self, hook: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Any:  # type: ignore[override]
        """A hook on this rank's block of the reduced gradient, before it is added to ``.grad``."""
        return self._xla_fsdp_group.shard.register_hook(hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Any], None]) -> Any:  # type: ignore[override]
        """Run once the reduced block is in ``.grad`` (called with the shard)."""
        return self._xla_fsdp_group.shard.register_post_accumulate_grad_hook(hook)

    # --- FSDP2's DTensor calls
    @property
    def placements(self) -> Tuple[Any, ...]:
        from torch.distributed.tensor import Shard
        return (Shard(0),)

    device_mesh = NO_DEVICE_MESH

    def to_local(self) -> torch.Tensor:
        """This rank's rows without the padding rows (a view of the shard), as DTensor's ``to_local()``."""
        return self.rows()[:own_rows(self._xla_fsdp_group)]

    def full_tensor(self) -> torch.Tensor:
        """The whole parameter on every rank: a collective, as DTensor's ``full_tensor()``."""
        from .gather_group import gather_values
        return gather_values(self._xla_fsdp_group, self._value)[0].view(self.shape)

    # --- Python's own protocols: answered here, without a torch function call
    @property
    def _xla_fsdp_name(self) -> str:
        """The parameter's name within its unit's module (as a FreedParameter's, read by the unit's errors)."""
        return self._xla_fsdp_group.refs[0].fqn

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:  # type: ignore[override]
        group = self._xla_fsdp_group
        return (f"ShardParam('{self._xla_fsdp_name}', shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: rank {group.comms.rank}'s {own_rows(group)} of {group.layout.rows} rows)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (``torch.save``, pickling) as the rows it holds (a Parameter for the parameter itself),
        without the unit's attributes: readable with ``weights_only=True``."""
        rows = self.rows().detach()
        plain = torch.nn.Parameter(rows, requires_grad=self.requires_grad) if self._is_the_parameter() else rows
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShardParam":
        """A copy of the rows, sharded alike (as a DTensor's copy): no longer the parameter, so without
        gradient."""
        return ShardParam(self._xla_fsdp_group, self.rows().detach().clone())

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kind = _kind(func)
        if kind is _WHOLE:  # the whole parameter's metadata, answered in C (no Python context)
            return _AS_PLAIN(func, types, args, kwargs or {})
        if kind is _ON_ROWS and args and type(args[0]) is ShardParam and not args[0]._detached:
            done = _on_the_parameters_rows(func, args, kwargs)
            if done is not _NOT_FAST:
                return done
        if kind is _ON_ROWS or kind is _LIKE:
            rows_args, detached = _rows_in(args, func)
            with _DisableSubclass(), torch.no_grad() if detached else contextlib.nullcontext():
                out = func(*rows_args, **(_rows_in_kwargs(kwargs) if kwargs else {}))
            first = args[0] if args else None
            if isinstance(first, ShardParam) and out is first.rows():
                return first  # an in-place method gives its tensor back: the parameter, as on a DTensor
            if kind is _ON_ROWS and isinstance(out, torch.Tensor):
                group = _one_group(args, kwargs)
                if group is not None and out.shape == group.shard.shape:
                    return ShardParam(group, out)  # computed from the parameter alone: sharded alike
            return out
        if kind is _NORM:
            return _norm(func, args, kwargs or {})
        _refuse(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        """An ATen op that reached the parameter below the torch functions (another tensor subclass's
        ``__torch_function__`` ran it: a gradient's ``grad.add_(p)``), by the same rules."""
        name = func._overloadpacket.__name__
        if torch.Tag.pointwise in func.tags or name.startswith("_foreach_") or name in _DISPATCH_ROWS:
            rows_args, _ = _rows_in(args, func)
            out = func(*rows_args, **_rows_in_kwargs(kwargs or {}))
            first = args[0] if args else None
            return first if isinstance(first, ShardParam) and out is first.rows() else out
        _refuse(func, args, kwargs)


_NOT_FAST = object()


def _on_the_parameters_rows(func: Callable, args: Sequence[Any], kwargs: Any) -> Any:
    """The optimizer's fast path (``p.mul_(...)``, ``p.addcdiv_(m, v, value=...)``): an element-wise call on
    the parameter itself whose other tensors are its state (plain tensors of its rows' shape) or 0-d runs on
    the rows at once, with the answer the general path gives. Anything else: ``_NOT_FAST``."""
    first = args[0]
    rows = first.rows()
    plain_state = False
    for a in (*args[1:], *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            if type(a) is ShardParam or a.dim() and a.shape != rows.shape:
                return _NOT_FAST
            plain_state = plain_state or a.dim() > 0
        elif type(a) in (list, tuple):
            return _NOT_FAST
    with _DisableSubclass():
        out = func(rows, *args[1:], **(kwargs or {}))
    if out is rows:
        return first  # an in-place method gives its tensor back: the parameter, as on a DTensor
    if not plain_state and isinstance(out, torch.Tensor) and out.shape == first._xla_fsdp_group.shard.shape:
        return ShardParam(first._xla_fsdp_group, out)  # computed from the parameter alone: sharded alike
    return out


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor a parameter's data is in: a :class:`ShardParam`'s rows, or the tensor itself."""
    return tensor.rows() if isinstance(tensor, ShardParam) else tensor


def own_rows(group: Any) -> int:
    """How many of this rank's rows are the parameter's (the rest pad to equal rows on every rank)."""
    rows_each = group.layout.shard_shape[0]
    return max(0, min(rows_each, group.layout.rows - group.comms.rank * rows_each))


def _one_group(args: Sequence[Any], kwargs: Any) -> Any:
    """The gather group of the ShardParams among ``args`` if every tensor there is one of its ShardParams (or a
    0-d tensor); None if there is none, or the rows of a plain tensor join them (an optimizer's state: the
    result is state too)."""
    group = None
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, ShardParam):
            if group is not None and a._xla_fsdp_group is not group:
                return None
            group = a._xla_fsdp_group
        elif isinstance(a, torch.Tensor) and a.dim() > 0 or type(a) in (list, tuple):
            return None
    return group


def _rows_in(args: Sequence[Any], func: Callable) -> Tuple[List[Any], bool]:
    """``args`` with each ShardParam's rows in its place (in lists too), and whether one was a ``.data``.
    A ShardParam of another shape, or a plain tensor of the whole parameter's shape, beside one would
    broadcast against the rows, not the whole parameter: refused."""
    out, detached, shape = [], False, None
    for a in args:
        if isinstance(a, ShardParam):
            detached = detached or a._detached
            if shape is None:
                shape = a.shape
            elif a.shape != shape:
                _refuse(func, args, None, f"it is applied to sharded parameters of other shapes ({tuple(shape)}, "
                                          f"{tuple(a.shape)}), which would broadcast row block against row block")
            a = a.rows()
        elif type(a) in (list, tuple) and a and any(isinstance(t, ShardParam) for t in a):
            detached = detached or any(getattr(t, "_detached", False) for t in a)
            a = [rows_of(t) for t in a]
        out.append(a)
    if shape is not None:
        for a in args:
            if type(a) is not ShardParam and isinstance(a, torch.Tensor) and a.dim() and a.shape == shape:
                rows = next(t for t in args if isinstance(t, ShardParam)).rows()
                if a.shape != rows.shape:
                    _refuse(func, args, None, "a tensor of the whole parameter's shape beside it would meet this "
                                              "rank's rows, not the whole parameter")
    return out, detached


def _rows_in_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return {k: rows_of(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


# ----------------------------------------------------------------------------- what each call is
_ON_ROWS, _LIKE, _WHOLE, _NORM, _REFUSED = "rows", "like", "whole", "norm", "refused"

#: answered from the whole parameter's metadata (the wrapper's own)
_WHOLE_NAMES = frozenset((
    "dim", "ndimension", "size", "numel", "nelement", "__len__", "stride", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "is_signed", "get_device", "type", "is_inference", "is_pinned",
    "is_shared", "shape", "ndim", "dtype", "device", "layout", "is_leaf", "grad_fn", "is_cuda", "is_xla", "is_cpu",
    "is_meta", "is_mps", "is_xpu", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested", "names",
    "output_nr", "_version", "itemsize", "nbytes", "_is_view", "_base", "retains_grad", "is_conj", "is_neg",
    "__format__", "__dir__", "__setstate__"))
#: not tagged pointwise, but row by row all the same (fills, copies, casts, detached aliases)
_ROW_NAMES = frozenset((
    "zero_", "fill_", "copy_", "clone", "detach", "detach_", "to", "type_as", "float", "double", "half",
    "bfloat16", "cpu", "contiguous", "masked_fill_", "masked_fill", "where", "_to_copy", "conj",
    "resolve_conj", "resolve_neg"))
#: new tensors shaped as the rows (an optimizer's state): plain tensors of the rows' shape, as the state was
_LIKE_NAMES = frozenset(("zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                         "new_full"))
#: what the dispatch-level fallback runs on the rows besides pointwise and foreach ops (ATen names among these)
_DISPATCH_ROWS = _ROW_NAMES | _LIKE_NAMES | {"alias"}
_NORM_FUNCS = {torch.norm: "p", torch.Tensor.norm: "p", torch.linalg.vector_norm: "ord",
               torch.linalg.norm: "ord", torch._foreach_norm: "ord"}
_DUNDER = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
           "__radd__": "add", "__rsub__": "rsub", "__rmul__": "mul", "__rtruediv__": "div", "__truediv__": "div",
           "__rpow__": "pow", "__neg__": "neg", "__abs__": "abs", "__invert__": "bitwise_not"}
_RANDOM = ("normal", "uniform", "bernoulli", "random", "exponential", "geometric", "cauchy", "log_normal",
           "rand", "randn", "randint", "dropout")


@functools.lru_cache(maxsize=None)
def _kind(func: Callable) -> str:
    name = _name(func)
    if name in _WHOLE_NAMES:
        return _WHOLE
    if func in _NORM_FUNCS:
        return _NORM
    if any(name.strip("_").startswith(r) for r in _RANDOM):
        return _REFUSED  # a draw on the rows would not be the unsharded draw
    if name in _LIKE_NAMES:
        return _LIKE
    if name in _ROW_NAMES or name.startswith("_foreach_"):
        return _ON_ROWS
    aten = _DUNDER.get(name) or (name[2:-2] if name.startswith("__") and name.endswith("__") else name)
    packet = getattr(torch.ops.aten, aten, None)
    if packet is None:
        return _REFUSED
    overloads = [getattr(packet, o) for o in packet.overloads()]
    if any(torch.Tag.pointwise in o.tags for o in overloads):
        return _ON_ROWS
    return _REFUSED


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property of Tensor: named by the property
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _norm(func: Callable, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """A norm over every element of whole parameters: each rank's own rows' norm, combined over the ranks."""
    foreach = func is torch._foreach_norm
    tensors = list(args[0]) if foreach else [args[0]]
    dim = kwargs.get("dim", args[2] if len(args) > 2 and not foreach else None)
    if dim is not None and not (isinstance(dim, (tuple, list)) and len(dim) == args[0].dim()):
        _refuse(func, args, kwargs)
    given = kwargs.get(_NORM_FUNCS[func], args[1] if len(args) > 1 else None)
    matrix = func is torch.linalg.norm and args[0].dim() == 2 and given not in (None, "fro")
    if matrix or isinstance(given, str) and given != "fro":
        _refuse(func, args, kwargs, f"its order {given!r} is a matrix norm, which cannot be formed from row blocks")
    order = norm_order(given)
    locals_ = [_own_part(t) if isinstance(t, ShardParam) else t for t in tensors]
    rest = dict(kwargs)
    rest.pop("dim", None)
    with _DisableSubclass():
        if foreach:
            local = list(func(locals_, *args[1:], **kwargs))
        else:
            local = [func(locals_[0], *args[1:2], **rest)]
    sharding = [(t._xla_fsdp_group.comms, t._xla_fsdp_group.channel_grad_norm) if isinstance(t, ShardParam)
                and t._xla_fsdp_group.comms.world_size > 1 else None for t in tensors]
    combined = [as_whole_value(t) for t in combine_norms(local, [order] * len(local), sharding)]
    return tuple(combined) if foreach else combined[0]


class WholeValue(torch.Tensor):
    """A value over every rank's rows (a norm): the same on every rank, so DTensor's calls on a replicated
    result (``full_tensor()``, ``to_local()``) give it as it is. Operations on it are plain tensors'."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def placements(self) -> Tuple[Any, ...]:
        from torch.distributed.tensor import Replicate
        return (Replicate(),)

    def full_tensor(self) -> torch.Tensor:
        return self

    def to_local(self) -> torch.Tensor:
        return self


def as_whole_value(value: torch.Tensor) -> torch.Tensor:
    """``value`` itself, retyped (not ``as_subclass``: on XLA an alias is a view that keeps its graph)."""
    value.__class__ = WholeValue
    return value


def _own_part(param: ShardParam) -> torch.Tensor:
    """The rows with the padding rows zeroed (a fill may have written them), in one shape on every rank:
    the ranks' graphs around the norms' collective must be alike, so the padding is masked, not cut off.
    The mask is device data, not a constant, for the same reason."""
    group = param._xla_fsdp_group
    rows = param.rows()
    if own_rows(group) == group.layout.shard_shape[0] and group.layout.padded_rows == group.layout.rows:
        return rows  # no rank pads
    mask = group.param.__dict__.get("_xla_fsdp_row_mask")
    if mask is None:
        own = torch.zeros((rows.shape[0],) + (1,) * (rows.dim() - 1), dtype=rows.dtype)
        own[:own_rows(group)] = 1
        mask = group.param._xla_fsdp_row_mask = own.to(rows.device)
    with _DisableSubclass():
        return rows * mask.to(rows.dtype)


def _refuse(func: Callable, args: Sequence[Any], kwargs: Any, why: str = "") -> None:
    from torch.utils._pytree import tree_flatten
    param = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, ShardParam))
    why = why or "it would see this rank's rows only, not the whole parameter"
    raise RuntimeError(
        f"xla_fsdp.fully_shard: '{param._xla_fsdp_name}' is sharded (shape {tuple(param.shape)}, this rank holds "
        f"some of its rows), and {_name(func) or func} on it is refused: {why}. "
        "Operations that act element by element (an optimizer step, fills, copies, casts) and norms work on it; "
        "for anything else use the whole parameter: inside `with XlaFullyShardedDataParallel.summon_full_params("
        "model):` the module's attribute is the full tensor (changes are written back), p.full_tensor() gives a "
        "copy, and model.apply(fn) runs fn on full parameters (docs/fsdp2.md)")
