"""``SpmdFullyShardedDataParallel``: xla_fsdp's units at world size 1, their shards annotated."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ..fully_sharded_data_parallel import XlaFullyShardedDataParallel
from ..strategy import ShardingStrategy, parse_strategy
from ..unit.base import ShardedUnit
from .mesh import FSDP_AXIS, REPLICA_AXIS, check_mesh, make_mesh, require_spmd

# In SPMD the strategy is the annotation: what stays in a unit between forward and backward is
# the reshard flag, and hybrid's replication is the mesh's replica axis.
_AS_PER_UNIT = {ShardingStrategy.FULL_SHARD: ShardingStrategy.FULL_SHARD,
                ShardingStrategy.SHARD_GRAD_OP: ShardingStrategy.SHARD_GRAD_OP,
                ShardingStrategy.HYBRID_SHARD: ShardingStrategy.FULL_SHARD,
                ShardingStrategy.HYBRID_SHARD_ZERO2: ShardingStrategy.SHARD_GRAD_OP}


def _spec(tensor: torch.Tensor) -> tuple:
    return (FSDP_AXIS,) + (None,) * (tensor.dim() - 1)


def shard_over_mesh(root: nn.Module, mesh: Any) -> nn.Module:
    """Annotate every unit's master shards under ``root`` as split over the mesh's ``fsdp`` axis
    (replicated along ``replica``), and each shard's gradient as it is accumulated (without it
    GSPMD leaves gradients replicated: every device would hold them whole). Idempotent."""
    import torch_xla.distributed.spmd as xs

    check_mesh(mesh)
    for unit in root.modules():
        if not isinstance(unit, ShardedUnit):
            continue
        for shard in unit.parameters(recurse=False):
            if getattr(shard, "_xla_fsdp_spmd_mesh", None) is not None:
                continue
            xs.mark_sharding(shard, mesh, _spec(shard))
            shard._xla_fsdp_spmd_mesh = mesh
            if shard.requires_grad:
                shard.register_post_accumulate_grad_hook(
                    lambda p: xs.mark_sharding(p.grad, p._xla_fsdp_spmd_mesh, _spec(p.grad)))
    return root


class SpmdFullyShardedDataParallel(XlaFullyShardedDataParallel):
    """``XlaFullyShardedDataParallel`` in SPMD: the same keywords (auto-wrap, ``checkpoint_module``
    through ``auto_wrapper_callable``, mixed precision, ``param_init_fn``, strategies) plus the
    ``mesh`` (default: every device on the ``fsdp`` axis). FULL_SHARD and SHARD_GRAD_OP shard over
    the ``fsdp`` axis; HYBRID_SHARD / HYBRID_SHARD_ZERO2 need a mesh with a ``replica`` axis
    (``make_mesh(replicas=R)``). Feed it batches split over the devices (``shard_batch``)."""

    def __init__(self, module: nn.Module, *args: Any, mesh: Optional[Any] = None,
                 sharding_strategy: Optional[Any] = None, **kwargs: Any):
        require_spmd()
        if mesh is None:
            mesh = make_mesh()
        check_mesh(mesh)
        strategy = parse_strategy(sharding_strategy) if sharding_strategy is not None else None
        if strategy is ShardingStrategy.NO_SHARD:
            raise ValueError("xla_fsdp: NO_SHARD in SPMD mode is plain data parallel: mark the batch with "
                             "xla_fsdp.spmd.shard_batch and do not wrap the model")
        hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)
        if hybrid != (REPLICA_AXIS in mesh.axis_names):
            raise ValueError(f"xla_fsdp: {strategy.name if strategy else 'FULL_SHARD'} needs a mesh "
                             f"{'with' if hybrid else 'without'} a '{REPLICA_AXIS}' axis, got {mesh.axis_names}; "
                             f"use xla_fsdp.spmd.make_mesh(replicas={'R' if hybrid else 1})")
        for key in ("sharding_groups", "sharding_rank", "sharding_world_size", "process_group", "device_mesh"):
            if kwargs.get(key) is not None:
                raise ValueError(f"xla_fsdp: {key}= is for the per-device mode; in SPMD mode the mesh= decides "
                                 "where shards live")
        super().__init__(module, *args, sharding_strategy=_AS_PER_UNIT.get(strategy), transport="xla", **kwargs)
        self.mesh = mesh
        shard_over_mesh(self, mesh)
