"""The device mesh of the SPMD mode: a ``fsdp`` axis parameters are split over, and for hybrid
strategies a ``replica`` axis they are copied along."""
from __future__ import annotations

from typing import Any, Optional

import torch

FSDP_AXIS = "fsdp"
REPLICA_AXIS = "replica"


def enable() -> None:
    """Switch torch_xla to SPMD: call before any XLA tensor exists (torch_xla refuses it later)."""
    import torch_xla.runtime as xr
    xr.use_spmd()


def require_spmd() -> None:
    import torch_xla.runtime as xr
    if not xr.is_spmd():
        raise RuntimeError("xla_fsdp: the SPMD mode needs torch_xla's SPMD runtime: call xla_fsdp.spmd.enable() "
                           "(torch_xla.runtime.use_spmd()) at the start of the program, before any XLA tensor "
                           "exists, and run one process per host (no torch_xla.launch)")


def make_mesh(replicas: int = 1) -> Any:
    """Every device of the job in a ``(fsdp,)`` mesh, or ``(replica, fsdp)`` with ``replicas`` rows
    (hybrid strategies: shard within a row, replicate across rows)."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    require_spmd()
    devices = xr.global_runtime_device_count()
    if replicas < 1 or devices % replicas:
        raise ValueError(f"xla_fsdp: {devices} devices do not split into {replicas} replicas; give a divisor of "
                         f"{devices}")
    if replicas == 1:
        return xs.Mesh(np.arange(devices), (devices,), (FSDP_AXIS,))
    return xs.Mesh(np.arange(devices), (replicas, devices // replicas), (REPLICA_AXIS, FSDP_AXIS))


def check_mesh(mesh: Any) -> None:
    """The SPMD mode splits over ``fsdp`` and copies along ``replica``; any other axis must have
    one device (the Hugging Face Trainer's ``("fsdp", "tensor")`` mesh of shape ``(N, 1)``)."""
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    sizes = dict(zip(names, getattr(mesh, "mesh_shape", ())))
    others = [n for n in names if n not in (FSDP_AXIS, REPLICA_AXIS) and sizes.get(n, 1) != 1]
    if FSDP_AXIS not in names or others:
        raise ValueError(f"xla_fsdp: the mesh's axes must be ('{FSDP_AXIS}',) or ('{REPLICA_AXIS}', '{FSDP_AXIS}') "
                         f"(others of size 1 allowed), got {names} of shape {tuple(sizes.values())}; build it "
                         "with xla_fsdp.spmd.make_mesh(replicas=...)")


def default_mesh() -> Any:
    """torch_xla's global mesh when the program set one (``xs.set_global_mesh``, as the Hugging Face
    Trainer does), else every device on the ``fsdp`` axis."""
    import torch_xla.distributed.spmd as xs
    mesh = xs.get_global_mesh()
    return make_mesh() if mesh is None else mesh


def batch_spec(mesh: Any, dims: int) -> tuple:
    """Split dimension 0 over every device of the mesh (data parallel over all of them)."""
    names = tuple(n for n in mesh.axis_names if n in (REPLICA_AXIS, FSDP_AXIS))
    first = names if len(names) > 1 else names[0]
    return (first,) + (None,) * (dims - 1)


def shard_batch(tensor: torch.Tensor, mesh: Optional[Any] = None) -> torch.Tensor:
    """Annotate an input batch (on the XLA device) as split along dimension 0 over every device."""
    import torch_xla.distributed.spmd as xs
    mesh = mesh if mesh is not None else default_mesh()
    xs.mark_sharding(tensor, mesh, batch_spec(mesh, tensor.dim()))
    return tensor
