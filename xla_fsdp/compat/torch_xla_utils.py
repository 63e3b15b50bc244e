"""The names of torch_xla's ``torch_xla.distributed.fsdp.utils``, with its signatures: the
weight-saving ``nn.Linear`` patch, ``BucketizedReduceScatter``, and the debugging fakes
``dummy_all_gather``, ``dummy_all_reduce``, ``DummyReduceScatter`` (the real collectives' shapes,
no communication)."""
from __future__ import annotations

import types
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn

from ..unit.patched_linear import LinearSavingWeight as XLAPatchedLinear, patch_linear_layers

__all__ = ["XLAPatchedLinear", "apply_xla_patch_to_nn_linear", "dummy_all_gather", "dummy_all_reduce",
           "DummyReduceScatter", "BucketizedReduceScatter"]


def _world_size() -> int:
    import torch_xla.runtime as xr
    return xr.world_size()


def _ordinal() -> int:
    import torch_xla.runtime as xr
    return xr.global_ordinal()


def dummy_all_gather(value: torch.Tensor, dim: int = 0, groups: Optional[List[List[int]]] = None) -> torch.Tensor:
    """All-gather's output shape without communicating: this rank's value, world-size times."""
    times = [1] * value.dim()
    times[dim] = _world_size()
    return value.repeat(*times)


def dummy_all_reduce(
    reduce_type: str, inputs: Any, scale: float = 1.0, groups: Optional[List[List[int]]] = None
) -> Any:
    """All-reduce's output without communicating: the input, scaled (lists in place)."""
    if isinstance(inputs, torch.Tensor):
        return inputs * scale
    return [t.mul_(scale) for t in inputs]


class DummyReduceScatter:
    """Reduce-scatter's output shape without communicating: this rank's dim-0 block of the input."""

    def __init__(self, shard_count: int):
        if shard_count != _world_size():
            raise ValueError(f"shard_count {shard_count} must equal the world size {_world_size()}")
        self.scale = 1.0

    def __call__(self, input: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
        block = input.shape[0] // _world_size()
        callback(input.narrow(0, block * _ordinal(), block))

    def flush(self) -> None:
        pass


class BucketizedReduceScatter:
    """Queue reduce-scatters of dim-0 tensors and issue them together once ``bucket_size_mb`` is
    exceeded (0: each at once); each result goes to its callback."""

    def __init__(self, bucket_size_mb: int, shard_count: int, groups: Optional[List[List[int]]],
                 pin_layout: bool) -> None:
        self.bucket_size_bytes = bucket_size_mb * 1024 * 1024
        self.shard_count, self.groups, self.pin_layout = shard_count, groups, pin_layout
        self.scale = 1.0
        self._pending: List[torch.Tensor] = []
        self._callbacks: List[Callable[[torch.Tensor], None]] = []
        self._bytes = 0

    def __call__(self, input: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
        self._pending.append(input)
        self._callbacks.append(callback)
        self._bytes += input.numel() * input.element_size()
        if self._bytes > self.bucket_size_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        import torch_xla.core.xla_model as xm
        pending = self._pending[0] if len(self._pending) == 1 else self._pending
        results = xm.reduce_scatter(xm.REDUCE_SUM, pending, scale=self.scale, scatter_dim=0,
                                    shard_count=self.shard_count, groups=self.groups, pin_layout=self.pin_layout)
        for callback, result in zip(self._callbacks, [results] if len(self._pending) == 1 else results):
            callback(result)
        self._pending, self._callbacks, self._bytes = [], [], 0


def _weight_saving_forward(m: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


def apply_xla_patch_to_nn_linear(module: nn.Module, patched_function: Callable = _weight_saving_forward) -> nn.Module:
    """Give every plain ``nn.Linear`` in ``module`` the forward ``patched_function(m, input)``
    (default: one that saves the weight itself for backward, see ``unit.patched_linear``)."""
    if patched_function is _weight_saving_forward:
        patch_linear_layers(module)
        return module
    for m in module.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m.forward = types.MethodType(patched_function, m)
    return module
