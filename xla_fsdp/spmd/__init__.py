"""SPMD mode: one program for all the devices of a host, parameters sharded by annotation.

torch_xla's SPMD runtime runs one replica per process, so xla_fsdp builds its units as at world
size 1: every policy, auto-wrap, ``checkpoint_module``, mixed precision, meta-device init,
``clip_grad_norm_`` and the checkpoint format work unchanged. Each unit's master shards (and
with them the optimizer state, which takes its parameter's sharding) and their gradients are then
annotated as split over the mesh's ``fsdp`` axis; GSPMD inserts the all-gathers and
reduce-scatters. A checkpoint is a world-size-1 set of our rank files, so consolidate, reshard,
inspect and export read it, and ``load_sharded_checkpoint`` moves it to the per-device mode at any
world size and back.

    import xla_fsdp.spmd as spmd
    spmd.enable()                                   # before any XLA tensor exists
    model = spmd.SpmdFullyShardedDataParallel(model.to(torch_xla.device()), auto_wrap_policy=...)
    loss = model(spmd.shard_batch(x.to(device))).mean()
"""
from .mesh import enable, make_mesh, shard_batch
from .wrapper import SpmdFullyShardedDataParallel, shard_over_mesh

__all__ = ["SpmdFullyShardedDataParallel", "enable", "make_mesh", "shard_batch", "shard_over_mesh"]
