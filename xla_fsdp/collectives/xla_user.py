"""torch_xla's user-level collectives, made to work when several XLA:CPU devices are threads of one
process (they abort there in torch_xla 2.9: XLA pairs collectives without a channel id by the
compiled module's id, which differs whenever two rank threads compile the same graph).

Installed by :func:`xla_fsdp.enable_xla_cpu_devices` (``XLA_FSDP_PATCH_TORCH_XLA=0`` keeps it out).
Each patched function delegates to torch_xla's own unless the process runs several XLA:CPU devices,
where the rank threads exchange host copies instead of meeting in a device rendezvous:

- ``xm.all_gather``, ``xm.reduce_scatter`` and ``xm.all_reduce`` (tensor and list forms, every
  reduce type, scale, groups; also behind ``xm.collective_broadcast`` and the ``xla``
  torch.distributed backend) run this rank's pending device work, then gather every group member's
  values on the host and reduce them there in rank order (every rank gets the same bits);
- ``xm.rendezvous`` exchanges its payloads on the host (behind ``xm.mesh_reduce``);
- ``xm.save`` writes each file under a temporary name and renames it, so a peer thread reading the
  folder never sees a partial file.

Why the host: XLA:CPU aborts a device rendezvous whose peers are 10 s late, and a rank can be that late
for reasons the program cannot see (a peer compiling a different graph under the compile lock, more
device work queued before the collective on one rank, a loaded machine). A host exchange waits as long
as it takes, and a rank that fails releases its peers with its error. On the device these collectives
are small (metrics, token counts, a loss), so the copy costs nothing that matters. xla_fsdp's own
collectives carry channel ids and stay in the compiled step.

As on TPU, every rank must issue the same collectives in the same order; ranks that do not get a
clear error on every rank.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import patches
from .host_exchange import thread_exchange


#: torch_xla's own functions, noted when the patches go in: looked up per collective, and a step
#: makes hundreds (the registry's lookup is a measurable part of tracing one)
_ORIGINALS: Dict[str, Callable[..., Any]] = {}


def _original(name: str) -> Callable[..., Any]:
    found = _ORIGINALS.get(name)
    if found is None:
        import torch_xla.core.xla_model as xm
        found = patches.original(xm, name)
    return found


def _stays_in_the_graph(channel_id: Any, groups: Any, pin_layout: bool, use_global_device_ids: Any) -> bool:
    """A call that already has the form a channel-id collective takes on rank threads (the form of
    xla_fsdp's own, which call torch_xla's bindings directly and never come here: every group named,
    layout not pinned, global device ids): torch_xla's function runs it as it is on rank threads and
    elsewhere alike, so the device check is not needed."""
    return channel_id is not None and bool(groups) and not pin_layout and use_global_device_ids is True


def is_threaded_cpu() -> bool:
    """Whether this process runs several XLA:CPU devices, one thread each (not SPMD, where one
    thread runs one program for all of them and torch_xla's collectives are its own)."""
    import torch_xla.runtime as xr
    return xr.device_type() == "CPU" and xr.addressable_runtime_device_count() > 1 and not xr.is_spmd()


def _my_group(groups: Optional[Sequence[Sequence[int]]]) -> List[int]:
    import torch_xla.runtime as xr
    rank = xr.global_ordinal()
    if not groups:
        return list(range(xr.world_size()))
    for group in groups:
        if rank in group:
            return [int(r) for r in group]
    raise ValueError(f"xla_fsdp: rank {rank} is in none of the collective's groups {groups}; "
                     "every calling rank must be in exactly one group")


def _exchange(kind: str, tensors: Sequence[torch.Tensor],
              groups: Optional[Sequence[Sequence[int]]]) -> Tuple[List[List[torch.Tensor]], int]:
    """Every group member's host copies of ``tensors`` (rows in group order) and this rank's index
    in its group. Pending device work runs first (as the collective would have waited for it); the
    members then meet on the host and check that they issued the same collective."""
    import torch_xla
    import torch_xla.runtime as xr
    torch_xla.sync()  # xla_fsdp's safe sync (patched with the collectives)
    group = _my_group(groups)
    me = group.index(xr.global_ordinal())
    host = [t.detach().cpu() for t in tensors]
    mine = (kind, tuple((tuple(t.shape), str(t.dtype)) for t in host))
    rows = thread_exchange(f"user collectives {tuple(group)}", len(group)).gather(me, (mine, host))
    if any(signature != mine for signature, _ in rows):
        issued = {group[i]: signature for i, (signature, _) in enumerate(rows)}
        raise RuntimeError("xla_fsdp: ranks issued different collectives at the same point (as on TPU, every rank "
                           f"must issue the same collectives in the same order): {issued}")
    return [values for _, values in rows], me


def _as_list(value: Any) -> Tuple[List[torch.Tensor], bool]:
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), True
    raise TypeError(f"xla_fsdp: a collective takes a tensor or a list of tensors, not {type(value).__name__}")


def _deliver(results: List[torch.Tensor], like: List[torch.Tensor], output: Any, is_list: bool) -> Any:
    """Move host results to the callers' devices, into ``output`` when one is given (torch_xla's
    out= forms)."""
    on_device = [r.to(t.device) for r, t in zip(results, like)]
    if output is not None:
        outs, _ = _as_list(output)
        with torch.no_grad():
            for out, r in zip(outs, on_device):
                out.copy_(r)
        return output
    return on_device if is_list else on_device[0]


def all_gather(value: Any, dim: int = 0, groups: Optional[List[List[int]]] = None,
               output: Any = None, pin_layout: bool = True, channel_id=None,
               use_global_device_ids=None) -> Any:
    if _stays_in_the_graph(channel_id, groups, pin_layout, use_global_device_ids) or not is_threaded_cpu():
        return _original("all_gather")(value, dim, groups, output, pin_layout, channel_id, use_global_device_ids)
    if channel_id is not None:  # numbered as a step's collective (the benchmark's torch_xla FSDP): in the graph
        return _original("all_gather")(value, dim, groups or [list(range(_world_size()))], output, False,
                                        channel_id, True)
    tensors, is_list = _as_list(value)
    rows, _ = _exchange("all_gather", tensors, groups)
    gathered = []
    for i, t in enumerate(tensors):
        parts = [row[i] for row in rows]
        gathered.append(torch.stack(parts) if t.dim() == 0 else torch.cat(parts, dim=dim % t.dim()))
    return _deliver(gathered, tensors, output, is_list)


_REDUCE = {"sum": torch.add, "mul": torch.mul, "min": torch.minimum, "max": torch.maximum,
           "and": torch.bitwise_and, "or": torch.bitwise_or}


def _reduce(reduce_type: str, parts: List[torch.Tensor], scale: float) -> torch.Tensor:
    if reduce_type not in _REDUCE:
        raise ValueError(f"xla_fsdp: unknown reduce type {reduce_type!r}; use one of {sorted(_REDUCE)}")
    op = _REDUCE[reduce_type]
    if reduce_type in ("and", "or") and parts[0].dtype == torch.bool:
        op = torch.logical_and if reduce_type == "and" else torch.logical_or
    out = parts[0]
    for part in parts[1:]:  # rank order on every rank: the same bits everywhere
        out = op(out, part)
    return out * scale if scale != 1.0 else out


def reduce_scatter(reduce_type: str, input: Any, scale: float, scatter_dim: int, shard_count: int,
                   groups: Optional[List[List[int]]] = None, output: Any = None, pin_layout: bool = True,
                   channel_id=None, use_global_device_ids=None) -> Any:
    if _stays_in_the_graph(channel_id, groups, pin_layout, use_global_device_ids) or not is_threaded_cpu():
        return _original("reduce_scatter")(reduce_type, input, scale, scatter_dim, shard_count, groups, output,
                                            pin_layout, channel_id, use_global_device_ids)
    if channel_id is not None:  # numbered as a step's collective: stays in the graph
        return _original("reduce_scatter")(reduce_type, input, scale, scatter_dim, shard_count,
                                            groups or [list(range(_world_size()))], output, False, channel_id, True)
    tensors, is_list = _as_list(input)
    rows, me = _exchange("reduce_scatter", tensors, groups)
    pieces = []
    for i in range(len(tensors)):
        full = _reduce(reduce_type, [row[i] for row in rows], scale)
        dim = scatter_dim % full.dim()
        if full.shape[dim] % shard_count:
            raise ValueError(f"xla_fsdp: reduce_scatter of shape {tuple(full.shape)} along dim {scatter_dim} into "
                             f"{shard_count} shards: the size must divide evenly")
        pieces.append(full.chunk(shard_count, dim=dim)[me])
    return _deliver(pieces, tensors, output, is_list)


def all_reduce(reduce_type: str, inputs: Any, scale: float = 1.0, groups: Optional[List[List[int]]] = None,
               pin_layout: bool = True) -> Any:
    if not is_threaded_cpu() or _world_size() == 1:
        return _original("all_reduce")(reduce_type, inputs, scale, groups, pin_layout)
    tensors, is_list = _as_list(inputs)
    rows, _ = _exchange(f"all_reduce {reduce_type}", tensors, groups)
    reduced = [_reduce(reduce_type, [row[i] for row in rows], scale) for i in range(len(tensors))]
    if is_list:  # the list form reduces in place, as torch_xla's
        return _deliver(reduced, tensors, tensors, True)
    return _deliver(reduced, tensors, None, False)


def _world_size() -> int:
    import torch_xla.runtime as xr
    return xr.world_size()


def rendezvous(tag: str, payload: bytes = b"", replicas: List[int] = []) -> List[bytes]:  # noqa: B006 - torch_xla's
    import torch_xla.runtime as xr
    if not is_threaded_cpu():
        return _original("rendezvous")(tag, payload, replicas)
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


def save(data: Any, file_or_path: Any, master_only: bool = True, global_master: bool = False) -> None:
    """torch_xla's ``xm.save``, written atomically where rank threads share a process: under a
    temporary name, then renamed, so a peer reading the folder (torch_xla's MNIST FSDP test
    consolidates on rank 0 right after its own save) sees each rank file whole or not at all. Who
    writes, and that no rank waits for another, is torch_xla's (2.9 meets no peer after the write)."""
    original = _original("save")
    if not is_threaded_cpu() or not isinstance(file_or_path, (str, os.PathLike)):
        return original(data, file_or_path, master_only, global_master)
    import threading
    path = os.fspath(file_or_path)
    partial = f"{path}.xla_fsdp-partial-{os.getpid()}-{threading.get_ident()}"
    try:
        original(data, partial, master_only, global_master)
        if os.path.exists(partial):  # this rank wrote (master_only: the master alone)
            os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def install_user_collectives() -> bool:
    """Patch torch_xla's user-level collectives (see the module docstring); idempotent. Returns
    whether they are installed (not when ``XLA_FSDP_PATCH_TORCH_XLA=0``)."""
    if os.environ.get("XLA_FSDP_PATCH_TORCH_XLA", "1") == "0":
        return False
    import torch_xla.core.xla_model as xm
    for name, patched in (("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
                          ("all_reduce", all_reduce), ("rendezvous", rendezvous)):
        patches.replace(xm, name, functools.wraps(getattr(xm, name))(patched),
                        "torch_xla's user collectives across XLA:CPU rank threads (host exchanges)")
        _ORIGINALS[name] = patches.original(xm, name)
    patches.replace(xm, "save", functools.wraps(xm.save)(save),
                    "xm.save's rank files written whole or not at all, for peers that read them (XLA:CPU rank threads)")
    _ORIGINALS["save"] = patches.original(xm, "save")
    return True
