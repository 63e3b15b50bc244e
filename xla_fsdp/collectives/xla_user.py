"""torch_xla's user-level collectives, made to work when several XLA:CPU devices are threads of one
process (they abort there in torch_xla 2.9: XLA pairs collectives without a channel id by the
compiled module's id, which differs whenever two rank threads compile the same graph).

Installed on ``import xla_fsdp`` with ``PJRT_DEVICE=CPU`` (``XLA_FSDP_PATCH_TORCH_XLA=0`` turns it
off). Each patched function delegates to torch_xla's own unless the process runs several XLA:CPU
devices, where:

- ``xm.all_gather`` / ``xm.reduce_scatter`` get a channel id and global device ids, so separately
  compiled graphs meet, and run at once through xla_fsdp's safe sync (see ``_run_now``); ids
  restart at every ``sync``, so the graphs stay the same from step to step;
- ``xm.all_reduce`` (tensor and in-place list forms, every reduce type, scale, groups) has no
  channel id in torch_xla: it is an all-gather plus the reduction (also behind
  ``xm.collective_broadcast`` and the ``xla`` torch.distributed backend);
- ``xm.rendezvous`` exchanges its payloads on the host (behind ``xm.mesh_reduce`` and ``xm.save``),
  after running pending device work, and checks that every rank named the same rendezvous.

As on TPU, every rank must issue the same collectives in the same order.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from .host_exchange import thread_exchange

USER_CHANNEL_BASE = 1 << 29  # above every id xla_fsdp's units take, below the construction check's
_local = threading.local()
_ORIGINALS: Dict[str, Callable[..., Any]] = {}
_INSTALL_LOCK = threading.Lock()


def reset_user_channels() -> None:
    """A graph has been launched: the next one numbers its user collectives from the start."""
    _local.next = 0


def _next_channel() -> int:
    n = getattr(_local, "next", 0)
    _local.next = n + 1
    return USER_CHANNEL_BASE + n


def is_threaded_cpu() -> bool:
    """Whether this process runs several XLA:CPU devices, one thread each (not SPMD, where one
    thread runs one program for all of them and torch_xla's collectives are its own)."""
    import torch_xla.runtime as xr
    return xr.device_type() == "CPU" and xr.addressable_runtime_device_count() > 1 and not xr.is_spmd()


_threaded = is_threaded_cpu


def _all_ranks() -> List[List[int]]:
    import torch_xla.runtime as xr
    return [list(range(xr.world_size()))]


def _meet(kind: str, value: Any, groups: Optional[List[List[int]]]) -> None:
    """Before a user collective, the rank threads meet on the host and compare what they issue.
    XLA:CPU aborts a device rendezvous after 10 s, and a rank may reach the same collective much
    later (model building, a Trainer's set-up); and ranks that issue different collectives get a
    clear error here instead of that abort."""
    import torch_xla.runtime as xr
    ws = xr.world_size()
    if groups and sorted(r for g in groups for r in g) != list(range(ws)):
        return  # not every rank takes part
    tensors = value if isinstance(value, (list, tuple)) else [value]
    mine = (kind, tuple((tuple(t.shape), str(t.dtype)) for t in tensors))
    rows = thread_exchange("user collectives", ws).gather(xr.global_ordinal(), mine)
    if any(row != mine for row in rows):
        raise RuntimeError("xla_fsdp: ranks issued different collectives at the same point (as on TPU, every rank "
                           f"must issue the same collectives in the same order): {dict(enumerate(rows))}")


def _run_now(result: Any) -> Any:
    """Execute a user collective at once, through xla_fsdp's safe sync. Left pending, the first
    ``.item()``/``.cpu()`` would run it from a rank thread that keeps the GIL while it waits in
    XLA's rendezvous, so the other ranks never arrive (seen at 4 devices: XLA aborts after 10 s)."""
    import torch_xla
    torch_xla.sync()
    return result


def all_gather(value: torch.Tensor, dim: int = 0, groups: Optional[List[List[int]]] = None,
               output: Optional[torch.Tensor] = None, pin_layout: bool = True, channel_id=None,
               use_global_device_ids=None) -> torch.Tensor:
    if not _threaded():
        return _ORIGINALS["all_gather"](value, dim, groups, output, pin_layout, channel_id, use_global_device_ids)
    if channel_id is not None:  # xla_fsdp's own, part of a training step: stays in the graph
        return _ORIGINALS["all_gather"](value, dim, groups or _all_ranks(), output, False, channel_id, True)
    _meet("all_gather", value, groups)
    return _run_now(_ORIGINALS["all_gather"](value, dim, groups or _all_ranks(), output, False, _next_channel(), True))


def reduce_scatter(reduce_type: str, input: Any, scale: float, scatter_dim: int, shard_count: int,
                   groups: Optional[List[List[int]]] = None, output: Any = None, pin_layout: bool = True,
                   channel_id=None, use_global_device_ids=None) -> Any:
    if not _threaded():
        return _ORIGINALS["reduce_scatter"](reduce_type, input, scale, scatter_dim, shard_count, groups, output,
                                            pin_layout, channel_id, use_global_device_ids)
    own = channel_id is not None
    if not own:
        _meet("reduce_scatter", input, groups)
    result = _ORIGINALS["reduce_scatter"](reduce_type, input, scale, scatter_dim, shard_count, groups or _all_ranks(),
                                          output, False, channel_id if own else _next_channel(), True)
    return result if own else _run_now(result)


_REDUCE = {"sum": torch.add, "mul": torch.mul, "min": torch.minimum, "max": torch.maximum,
           "and": torch.bitwise_and, "or": torch.bitwise_or}


def _reduced(reduce_type: str, tensor: torch.Tensor, scale: float, groups: List[List[int]]) -> torch.Tensor:
    if reduce_type not in _REDUCE:
        raise ValueError(f"xla_fsdp: unknown reduce type {reduce_type!r}; use one of {sorted(_REDUCE)}")
    rows = all_gather(tensor.reshape(1, -1), 0, groups)
    op = _REDUCE[reduce_type]
    if reduce_type in ("and", "or") and tensor.dtype == torch.bool:
        op = torch.logical_and if reduce_type == "and" else torch.logical_or
    out = rows[0]
    for i in range(1, rows.shape[0]):
        out = op(out, rows[i])
    out = out.reshape(tensor.shape)
    return out * scale if scale != 1.0 else out


def all_reduce(reduce_type: str, inputs: Any, scale: float = 1.0, groups: Optional[List[List[int]]] = None,
               pin_layout: bool = True) -> Any:
    import torch_xla.runtime as xr
    if not _threaded() or xr.world_size() == 1:
        return _ORIGINALS["all_reduce"](reduce_type, inputs, scale, groups, pin_layout)
    groups = groups or _all_ranks()
    if isinstance(inputs, torch.Tensor):
        return _reduced(reduce_type, inputs, scale, groups)
    with torch.no_grad():  # the list form reduces in place, as torch_xla's
        for tensor in inputs:
            tensor.copy_(_reduced(reduce_type, tensor, scale, groups))
    return inputs


def rendezvous(tag: str, payload: bytes = b"", replicas: List[int] = []) -> List[bytes]:  # noqa: B006 - torch_xla's
    import torch_xla.runtime as xr
    if not _threaded():
        return _ORIGINALS["rendezvous"](tag, payload, replicas)
    if replicas and sorted(replicas) != list(range(xr.world_size())):
        raise ValueError("xla_fsdp: only a rendezvous of every rank is supported (as in torch_xla on PJRT)")
    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    import torch_xla
    torch_xla.sync()  # as torch_xla's: pending device work runs before the ranks meet (xla_fsdp's safe sync)
    rows = thread_exchange("rendezvous", xr.world_size()).gather(xr.global_ordinal(), (tag, payload))
    tags = [t for t, _ in rows]
    if len(set(tags)) > 1:
        raise RuntimeError(f"xla_fsdp: ranks met at different rendezvous {dict(enumerate(tags))}: every rank "
                           "must call xm.rendezvous / xm.mesh_reduce / xm.save in the same order")
    return [p for _, p in rows]


def install_user_collectives() -> bool:
    """Patch torch_xla's user-level collectives (see the module docstring); idempotent. Returns
    whether they are installed (not when ``XLA_FSDP_PATCH_TORCH_XLA=0``)."""
    if os.environ.get("XLA_FSDP_PATCH_TORCH_XLA", "1") == "0":
        return False
    import torch_xla.core.xla_model as xm
    with _INSTALL_LOCK:
        if _ORIGINALS:
            return True
        for name, patched in (("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
                              ("all_reduce", all_reduce), ("rendezvous", rendezvous)):
            _ORIGINALS[name] = getattr(xm, name)
            setattr(xm, name, functools.wraps(_ORIGINALS[name])(patched))
    return True
