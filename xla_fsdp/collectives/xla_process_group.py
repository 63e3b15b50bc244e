"""The ``xla`` torch.distributed backend when several XLA:CPU devices are threads of one process.

torch.distributed keeps one default process group per process, so the device threads of a
``torch_xla.launch`` on XLA:CPU cannot each call ``dist.init_process_group("xla", init_method="xla://")``
as a TPU script does (one process per device there): the second thread gets "trying to initialize the
default process group twice!", or, when two threads pass torch's check together, one thread's group
replaces the other's. Here the first thread creates the group and the others join it (its collectives
are torch_xla's per-thread ones, so one group serves every thread); ``dist.get_rank()`` answers the
calling thread's ordinal, and ``destroy_process_group()`` frees the group when the last thread leaves.
Installed with the user-level collectives (:func:`xla_fsdp.enable_xla_cpu_devices`); outside threaded
XLA:CPU torch's functions run unchanged.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Set

from .. import patches
from .xla_user import is_threaded_cpu

_LOCK = threading.Lock()
_members: Set[int] = set()


def _original(name: str) -> Callable[..., Any]:
    import torch.distributed.distributed_c10d as c10d
    return patches.original(c10d, name)


def _asks_for_xla(backend: Any, init_method: Optional[str]) -> bool:
    return str(backend or "").lower() == "xla" or str(init_method or "").startswith("xla://")


def _shared_xla_group_in_use() -> bool:
    if not _members:  # checked first: no XLA runtime question in processes that never joined
        return False
    import torch.distributed as dist
    return dist.is_initialized() and dist.get_backend() == "xla"


def init_process_group(backend: Any = None, init_method: Optional[str] = None, *args: Any, **kwargs: Any) -> Any:
    if not (_asks_for_xla(backend, init_method) and is_threaded_cpu()):
        return _original("init_process_group")(backend, init_method, *args, **kwargs)
    import torch.distributed as dist
    import torch_xla.runtime as xr
    rank = xr.global_ordinal()
    with _LOCK:
        if rank in _members:
            raise ValueError(f"trying to initialize the default process group twice (device thread {rank})")
        if not dist.is_initialized():
            _original("init_process_group")(backend, init_method, *args, **kwargs)
        elif dist.get_backend() != "xla":
            raise ValueError(f"the default process group is already initialized with backend "
                             f"{dist.get_backend()!r}; the XLA:CPU device threads share one group, so "
                             "every thread must ask for 'xla'")
        _members.add(rank)


def get_rank(group: Any = None) -> int:
    import torch.distributed as dist
    if (group is None or group is dist.GroupMember.WORLD) and _shared_xla_group_in_use():
        import torch_xla.runtime as xr
        return xr.global_ordinal()
    return _original("get_rank")(group)


def _group_rank(group: Any) -> int:
    """``ProcessGroup.rank()``: the calling thread's ordinal on the shared group (torch's functions
    ask the group object, as DCP's ``gather_object`` does, and it answers its creator's rank)."""
    import torch.distributed as dist
    if _shared_xla_group_in_use() and group is dist.GroupMember.WORLD:
        import torch_xla.runtime as xr
        return xr.global_ordinal()
    return patches.original(dist.ProcessGroup, "rank")(group)


def _broadcast_host_tensors(group: Any, tensors: Any, opts: Any) -> Any:
    """``ProcessGroupXla.broadcast`` of host tensors (torch's ``scatter_object_list``, which DCP's
    collective save runs, broadcasts the size of the source's objects as a host tensor): through the
    device and back. torch_xla's own stops on them ('Check failed: device.type() == at::kXLA')."""
    from torch_xla.distributed.xla_backend import ProcessGroupXla
    broadcast = patches.original(ProcessGroupXla, "broadcast")
    if all(t.device.type == "xla" for t in tensors):
        return broadcast(group, tensors, opts)
    import torch_xla
    device = torch_xla.device()
    moved = [t.to(device) for t in tensors]
    work = broadcast(group, moved, opts)
    for t, m in zip(tensors, moved):
        t.copy_(m.cpu())
    return work


def destroy_process_group(group: Any = None) -> None:
    import torch.distributed as dist
    if group is not None and group is not dist.GroupMember.WORLD:
        return _original("destroy_process_group")(group)
    if not _members:
        return _original("destroy_process_group")(group)
    import torch_xla.runtime as xr
    with _LOCK:
        _members.discard(xr.global_ordinal())
        if not _members and dist.is_initialized():
            _original("destroy_process_group")(group)


def install_shared_xla_group() -> None:
    """Patch ``init_process_group``, ``get_rank`` and ``destroy_process_group`` (both the
    ``torch.distributed`` names and the ones torch's own functions call); idempotent."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    for name, patched in (("init_process_group", init_process_group), ("get_rank", get_rank),
                          ("destroy_process_group", destroy_process_group)):
        for owner in (c10d, dist):  # c10d first: its original is the one the patched functions call
            patches.replace(owner, name, patched, "one torch.distributed 'xla' group shared by XLA:CPU rank threads")
    from torch_xla.distributed.xla_backend import ProcessGroupXla
    patches.replace(ProcessGroupXla, "broadcast", _broadcast_host_tensors,
                    "torch's object collectives broadcast host tensors on the 'xla' group (DCP's collective save)")
    patches.replace(dist.ProcessGroup, "rank", _group_rank,
                    "one torch.distributed 'xla' group shared by XLA:CPU rank threads: each asks its own rank")
