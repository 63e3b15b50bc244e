"""Transports for the sharding algorithm, chosen automatically (see :func:`select_collectives`)."""
from __future__ import annotations

import os
import weakref
from typing import Dict, Optional, Sequence, Tuple

from .base import Collectives
from .torch_dist import TorchDistCollectives


#: how to get torch_xla, for every error that needs it
NEEDS_XLA = ("pip install 'xla_fsdp[xla]' (XLA:CPU, with torch 2.9.0) or 'xla_fsdp[tpu]' (TPU VM); "
             "torch_xla's wheels are for Linux x86_64 only")


def _xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_transport(transport: Optional[str] = None) -> str:
    """``'torch'`` when a non-XLA torch.distributed group is initialized, else ``'xla'`` when
    ``PJRT_DEVICE`` is set (TPU, XLA:CPU); ``transport`` forces one."""
    import torch.distributed as dist

    if transport is None:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() != "xla":
            transport = "torch"
        elif os.environ.get("PJRT_DEVICE") and _xla_available():
            transport = "xla"
        elif os.environ.get("PJRT_DEVICE"):
            raise RuntimeError(f"xla_fsdp: PJRT_DEVICE={os.environ['PJRT_DEVICE']} asks for XLA devices, but torch_xla "
                               f"is not installed: {NEEDS_XLA}; or unset PJRT_DEVICE and call "
                               "torch.distributed.init_process_group first for the torch transport.")
        else:
            raise RuntimeError(
                "xla_fsdp: no collective backend is initialized. Either run under torch_xla.launch "
                "with PJRT_DEVICE=TPU or PJRT_DEVICE=CPU (CPU_NUM_DEVICES=N for N devices), or call "
                "torch.distributed.init_process_group('gloo') first (e.g. under torchrun).")
    if transport not in ("torch", "xla"):
        raise ValueError(f"xla_fsdp: unknown transport {transport!r}; use 'xla' or 'torch'")
    if transport == "xla" and not _xla_available():
        raise RuntimeError(f"xla_fsdp: transport 'xla' needs torch_xla, which is not installed: {NEEDS_XLA}")
    return transport


def global_rank_and_size(transport: str) -> Tuple[int, int]:
    """This process's (or XLA device thread's) global rank and the number of ranks."""
    if transport == "torch":
        import torch.distributed as dist
        return dist.get_rank(), dist.get_world_size()
    import torch_xla.runtime as xr
    return xr.global_ordinal(), xr.world_size()


def ranks_per_host(transport: str) -> int:
    """Ranks on this host: the default shard group size of hybrid strategies."""
    if transport == "torch":
        return int(os.environ.get("LOCAL_WORLD_SIZE", global_rank_and_size("torch")[1]))
    import torch_xla.runtime as xr
    return xr.addressable_runtime_device_count() * xr.local_process_count()


def select_collectives(transport: Optional[str] = None,
                       groups: Optional[Sequence[Sequence[int]]] = None,
                       rank: Optional[int] = None, world_size: Optional[int] = None,
                       pin_layout: bool = True,
                       replica_groups: Optional[Sequence[Sequence[int]]] = None) -> Collectives:
    """Collectives over the shard group ``groups`` (all ranks when None) on the chosen transport;
    ``replica_groups`` (hybrid strategies) are the groups gradient shards are all-reduced in."""
    transport = resolve_transport(transport)
    if transport == "torch":
        return TorchDistCollectives(groups, replica_groups)
    from .xla import XlaCollectives
    return XlaCollectives(groups, rank, world_size, pin_layout, replica_groups=replica_groups)


__all__ = ["Collectives", "TorchDistCollectives", "global_rank_and_size", "ranks_per_host",
           "resolve_transport", "select_collectives"]


#: the torch.distributed default group (a stand-in on XLA) -> {(thread, transport, grouping): collectives}.
#: Weak: the cache must not keep a destroyed group alive. A gloo group that outlives
#: ``destroy_process_group`` keeps its worker threads, and one of them still releasing a finished
#: collective's tensors while Python exits aborts the process ("terminate called without an active
#: exception": it needs the GIL during finalization; pytorch/pytorch#190489).
_SHARED: "weakref.WeakKeyDictionary[object, Dict[Tuple, Collectives]]" = weakref.WeakKeyDictionary()


class _NoDefaultGroup:
    """The key of collectives built outside torch.distributed (XLA), kept for the process."""


_XLA_KEY = _NoDefaultGroup()


def _default_group(transport: str) -> object:
    """The torch.distributed default group: after ``destroy_process_group`` and a new
    ``init_process_group`` it is another object, and collectives built in the old one must not be
    reused, since they hold its destroyed subgroups, whose connections lead to peers that may be gone."""
    if transport != "torch":
        return _XLA_KEY
    import torch.distributed as dist
    return dist.group.WORLD


def shared_collectives(transport: str, groups, rank, world_size, pin_layout: bool, replica_groups) -> Collectives:
    """One collectives object per (thread, transport, grouping) in the current process group, shared
    by the units of a model (XLA:CPU ranks are threads of one process, so the thread is part of the key)."""
    import threading
    key = (threading.get_ident(), transport, tuple(map(tuple, groups or [])), rank, world_size, pin_layout,
           tuple(map(tuple, replica_groups or [])))
    built = _SHARED.setdefault(_default_group(transport), {})
    if key not in built:
        built[key] = select_collectives(transport, groups, rank, world_size, pin_layout, replica_groups)
    return built[key]
