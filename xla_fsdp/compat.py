"""torch_xla's FSDP import paths, served by xla_fsdp, so programs written for torch_xla's FSDP run
unchanged.

``replace_torch_xla_fsdp()`` makes ``torch_xla.distributed.fsdp`` and its modules ``wrap``,
``utils``, ``state_dict_utils``, ``xla_fully_sharded_data_parallel`` and
``consolidate_sharded_ckpts`` resolve to xla_fsdp in this process (also where they were imported
before: the names are swapped in place). Without editing a program, run it as
``python -m xla_fsdp.compat SCRIPT [ARGS]``: that puts a ``sitecustomize`` on ``PYTHONPATH``
which does the same in every Python process the program starts (``torch_xla.launch`` spawns its
device processes afresh).

The ``utils`` names keep torch_xla's signatures: ``checkpoint_module``, ``XLAPatchedLinear`` and
``apply_xla_patch_to_nn_linear`` (the weight-saving ``nn.Linear``), ``BucketizedReduceScatter``,
and the debugging fakes ``dummy_all_gather``, ``dummy_all_reduce``, ``DummyReduceScatter`` (shapes
of the real collectives, no communication).
"""
from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from . import wrap as _wrap
from .checkpoint import checkpoint_module
from .checkpoints import consolidate_sharded_model_checkpoints
from .fully_sharded_data_parallel import XlaFullyShardedDataParallel
from .state_dict import consolidate_sharded_state_dicts
from .xla_patched_linear import LinearSavingWeight as XLAPatchedLinear, patch_linear_layers

ENV = "XLA_FSDP_REPLACE_TORCH_XLA_FSDP"
STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")


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
    (default: one that saves the weight itself for backward, see ``xla_patched_linear``)."""
    if patched_function is _weight_saving_forward:
        patch_linear_layers(module)
        return module
    for m in module.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m.forward = types.MethodType(patched_function, m)
    return module


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def torch_xla_modules() -> Dict[str, types.ModuleType]:
    """torch_xla's FSDP module names and the xla_fsdp modules that stand in for them."""
    from . import consolidate_sharded_ckpts
    base = "torch_xla.distributed.fsdp"
    utils = _module(f"{base}.utils", checkpoint_module=checkpoint_module, XLAPatchedLinear=XLAPatchedLinear,
                    apply_xla_patch_to_nn_linear=apply_xla_patch_to_nn_linear, dummy_all_gather=dummy_all_gather,
                    dummy_all_reduce=dummy_all_reduce, DummyReduceScatter=DummyReduceScatter,
                    BucketizedReduceScatter=BucketizedReduceScatter)
    state_dict_utils = _module(
        f"{base}.state_dict_utils",
        consolidate_sharded_state_dicts=consolidate_sharded_state_dicts,
        consolidate_sharded_model_checkpoints=consolidate_sharded_model_checkpoints,
    )
    fsdp_module = _module(
        f"{base}.xla_fully_sharded_data_parallel", XlaFullyShardedDataParallel=XlaFullyShardedDataParallel
    )
    package = _module(base, XlaFullyShardedDataParallel=XlaFullyShardedDataParallel,
                      consolidate_sharded_state_dicts=consolidate_sharded_state_dicts,
                      consolidate_sharded_model_checkpoints=consolidate_sharded_model_checkpoints,
                      checkpoint_module=checkpoint_module, wrap=_wrap, utils=utils, state_dict_utils=state_dict_utils,
                      xla_fully_sharded_data_parallel=fsdp_module, consolidate_sharded_ckpts=consolidate_sharded_ckpts,
                      __all__=["XlaFullyShardedDataParallel", "consolidate_sharded_state_dicts",
                               "consolidate_sharded_model_checkpoints", "checkpoint_module"])
    package.__path__ = []  # a package: its submodules are the entries below
    return {base: package, f"{base}.wrap": _wrap, f"{base}.utils": utils, f"{base}.state_dict_utils": state_dict_utils,
            f"{base}.xla_fully_sharded_data_parallel": fsdp_module,
            f"{base}.consolidate_sharded_ckpts": consolidate_sharded_ckpts}


def replace_torch_xla_fsdp() -> None:
    """Make ``torch_xla.distributed.fsdp`` (and its modules) resolve to xla_fsdp in this process,
    and route Accelerate's gradient clipping of an xla_fsdp model to the model's own (see
    :func:`patch_accelerate_clipping`)."""
    import torch_xla.distributed
    for name, module in torch_xla_modules().items():
        sys.modules[name] = module
    torch_xla.distributed.fsdp = sys.modules["torch_xla.distributed.fsdp"]
    patch_accelerate_clipping()


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
    original = Accelerator.clip_grad_norm_
    if getattr(original, "_xla_fsdp", False):
        return True

    @functools.wraps(original)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for model in getattr(self, "_models", []):
            if isinstance(model, XlaFullyShardedDataParallel) and {id(p) for p in model.parameters()} == ids:
                self.unscale_gradients()
                return model.clip_grad_norm_(max_norm, norm_type)
        return original(self, parameters, max_norm, norm_type)

    clip_grad_norm_._xla_fsdp = True
    Accelerator.clip_grad_norm_ = clip_grad_norm_
    return True


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m xla_fsdp.compat SCRIPT [ARGS]``: run a program written for torch_xla's FSDP
    with xla_fsdp, in it and in every Python process it starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m xla_fsdp.compat SCRIPT [ARGS]  (runs SCRIPT with torch_xla.distributed.fsdp "
              "served by xla_fsdp)", file=sys.stderr)
        return 2
    env = dict(os.environ, **{ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STARTUP_DIR, os.path.dirname(os.path.dirname(STARTUP_DIR)),
                                                   env.get("PYTHONPATH")) if p)
    os.execve(sys.executable, [sys.executable] + argv, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
