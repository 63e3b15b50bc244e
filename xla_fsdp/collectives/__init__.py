"""Transports for the sharding algorithm, chosen automatically (see :func:`select_collectives`)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .base import Collectives
from .torch_dist import TorchDistCollectives


def _xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def select_collectives(transport: Optional[str] = None,
                       groups: Optional[Sequence[Sequence[int]]] = None,
                       rank: Optional[int] = None, world_size: Optional[int] = None,
                       pin_layout: bool = True) -> Collectives:
    """Pick the transport: ``'torch'`` when a non-XLA torch.distributed group is initialized,
    else ``'xla'`` when ``PJRT_DEVICE`` is set (TPU, XLA:CPU); ``transport`` forces one."""
    import torch.distributed as dist

    if transport is None:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() != "xla":
            transport = "torch"
        elif os.environ.get("PJRT_DEVICE") and _xla_available():
            transport = "xla"
        else:
            raise RuntimeError(
                "xla_fsdp: no collective backend is initialized. Either run under torch_xla.launch "
                "with PJRT_DEVICE=TPU or PJRT_DEVICE=CPU (CPU_NUM_DEVICES=N for N devices), or call "
                "torch.distributed.init_process_group('gloo') first (e.g. under torchrun).")
    if transport == "torch":
        if groups:
            return TorchDistCollectives(groups)
        return TorchDistCollectives()
    if transport == "xla":
        if not _xla_available():
            raise RuntimeError("xla_fsdp: transport 'xla' needs torch_xla (pip install torch_xla==2.9.0)")
        from .xla import XlaCollectives
        return XlaCollectives(groups, rank, world_size, pin_layout)
    raise ValueError(f"xla_fsdp: unknown transport {transport!r}; use 'xla' or 'torch'")


__all__ = ["Collectives", "TorchDistCollectives", "select_collectives"]
