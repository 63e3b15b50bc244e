"""SPMD mode: one program for all the devices of a host, parameters sharded by annotation.

torch_xla's SPMD runtime runs one replica per process, so xla_fsdp builds its units as at world
size 1: every policy, auto-wrap, ``checkpoint_module``, mixed precision, meta-device init,
``clip_grad_norm_`` and the checkpoint format work unchanged. Each parameter keeps its shape; it
(and with it its optimizer state) and its gradient are annotated as split over the mesh's ``fsdp``
axis on their largest dimension, and every unit's output as split by the batch, so GSPMD runs the
program data parallel and inserts the gathers and reductions. A checkpoint is a world-size-1 set of
our rank files, so consolidate, resize, inspect and export read it, and ``load_sharded_checkpoint``
moves it to the per-device mode at any world size and back.

    import xla_fsdp.spmd as spmd
    spmd.enable()                                   # before any XLA tensor exists
    model = spmd.SpmdFullyShardedDataParallel(model, auto_wrap_policy=...)  # built on the CPU: it moves it
    loss = model(spmd.shard_batch(x.to(device))).mean()
"""
from .mesh import enable, make_mesh, shard_batch
from .wrapper import SpmdFullyShardedDataParallel, shard_over_mesh, split_by_batch

__all__ = ["SpmdFullyShardedDataParallel", "enable", "make_mesh", "shard_batch", "shard_over_mesh", "split_by_batch"]
