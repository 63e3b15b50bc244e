"""What a module's parameter attribute holds between steps, while only the shard exists.

The full parameter's memory is released after use (on eager devices its storage is resized to
zero), so a program that wrote into it there (``nn.init.zeros_(model.module.fc.weight)`` or a
``copy_`` under ``torch.no_grad()``) would write past the end of an empty storage and kill the
process. :class:`FreedParameter` stands in for it instead: it has the parameter's shape, dtype,
device and ``requires_grad`` (which it passes on to the shard), and any operation on its data
raises one error that names the parameter and the way to reach the full data.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch
from torch.utils._pytree import tree_flatten

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
