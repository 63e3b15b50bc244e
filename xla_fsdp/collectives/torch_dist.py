"""Collectives over ``torch.distributed`` (gloo on CPU, NCCL on GPU, any backend a device registers,
e.g. through PrivateUse1): the eager transport."""
from __future__ import annotations

import math
import time
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import patches
from .base import Collectives


def _my_group(groups: Optional[Sequence[Sequence[int]]], what: str):
    """The process group of ``groups`` holding this rank; every rank creates every group, in the
    same order, as ``new_group`` requires."""
    if not groups:
        return None, [list(range(dist.get_world_size()))]
    me = dist.get_rank()
    mine = None
    for g in groups:
        pg = dist.new_group(ranks=list(g))
        if me in g:
            mine = pg
    if mine is None:
        raise ValueError(f"rank {me} is in none of the {what} {groups}")
    return mine, [list(g) for g in groups]


# torch 2.13 renamed the tensor collectives (the old names warn FutureWarning at every call); torch
# 2.9 to 2.12 have only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def transport_device(backend_config: str, accelerator: Optional[torch.device]) -> torch.device:
    """The device the process group moves tensors on: this process's accelerator where the group
    has a backend for it other than gloo (NCCL for CUDA, XCCL for XPU, a PrivateUse1 device's own),
    else the CPU. ``backend_config`` is ``dist.get_backend_config()`` (``"cpu:gloo,cuda:nccl"``);
    gloo also registers for CUDA, but a job that asked for gloo asked for host collectives."""
    served = {}
    for entry in backend_config.split(","):
        device_type, _, backend = entry.strip().partition(":")
        served[device_type] = backend
    if accelerator is not None and accelerator.type != "cpu" and served.get(accelerator.type, "gloo") != "gloo":
        return accelerator
    if "cpu" in served:
        return torch.device("cpu")
    raise RuntimeError(
        f"xla_fsdp: the default process group serves {backend_config!r}, with no CPU backend, but this process's "
        f"accelerator is {accelerator if accelerator is not None else 'none (none available)'}: run where "
        "that device is available, or give the group a backend for this process's device or the CPU, e.g. "
        "init_process_group('cpu:gloo,<device>:<backend>').")


def _current_accelerator() -> Optional[torch.device]:
    """This process's accelerator and its current index (None without one)."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:  # none built in, or none on this machine (a CUDA wheel with no GPU)
        return None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


# --- handing tensors to the backend's threads -------------------------------------------------------
# A gloo (or NCCL) Work holds the tensors of its collective, and the backend's worker thread drops its
# reference to the Work a moment after the collective completes. If the Python objects of those tensors
# are gone by then, that thread frees them, taking the GIL, and if the interpreter is exiting by then,
# Python ends the thread inside a noexcept destructor: "terminate called without an active exception",
# exit -6 after the program finished (pytorch/pytorch#190489). So a collective gets aliases of our own
# (``detach``: the same storage, a TensorImpl no one else holds), and they are kept until the backend
# has let go of them (use count back to 1), at the latest until the program's exit handlers run.
_HELD: List[Tuple[torch.Tensor, ...]] = []
def _aliases(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return tuple(t.detach() for t in tensors)


def _in_use(aliases: Tuple[torch.Tensor, ...]) -> bool:
    return any(t._use_count() > 1 for t in aliases)


def _let_go(aliases: Tuple[torch.Tensor, ...]) -> None:
    """After the collective's wait: keep ``aliases`` while the backend still holds them."""
    _HELD[:] = [a for a in _HELD if _in_use(a)]
    if _in_use(aliases):
        _HELD.append(aliases)


def _drain(timeout_s: float = 10.0) -> None:
    """At exit, while the interpreter still runs: give the backend's threads the GIL to let go."""
    deadline = time.monotonic() + timeout_s
    while _HELD and time.monotonic() < deadline:
        time.sleep(0.001)
        _HELD[:] = [a for a in _HELD if _in_use(a)]


class _Waiter:
    """The wait function of an async collective over ``aliases`` (see :func:`_aliases`). One dropped
    without a wait (a plan started in a forward that no backward followed) parks its aliases: the
    collective may still be running."""

    def __init__(self, work, result: torch.Tensor, aliases: Tuple[torch.Tensor, ...]):
        self._work, self._result, self._aliases = work, result, aliases

    def __call__(self) -> torch.Tensor:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
            del work  # our reference to the Work goes before the count is read
            _let_go(self._aliases)
        return self._result

    def __del__(self) -> None:
        if self._work is not None:
            self._work = None
            _HELD.append(self._aliases)


def _done() -> None:
    return None


#: how many times this process arrived at each call (``TorchDistCollectives.meet``)
_ARRIVALS: dict = {}
#: how long a rank waits in ``meet`` before it warns that another is late
LATE_WARNING_S = 20.0


class TorchDistCollectives(Collectives):
    """Eager collectives; full parameters are freed by shrinking their storage to zero bytes so
    every view autograd saved sees the data again once it is re-gathered into the same storage."""

    name = "torch"

    def __init__(self, groups: Optional[Sequence[Sequence[int]]] = None,
                 replica_groups: Optional[Sequence[Sequence[int]]] = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "xla_fsdp: torch.distributed is not initialized. Call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets the "
                "environment for it), or run under torch_xla.launch with PJRT_DEVICE set to use XLA.")
        self.group, self.groups = _my_group(groups, "sharding_groups")
        self.replica_group, self.replica_groups = (_my_group(replica_groups, "replica groups")
                                                   if replica_groups else (None, []))
        self.global_rank = dist.get_rank()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._device = transport_device(dist.get_backend_config(), _current_accelerator())
        patches.at_exit("atexit: xla_fsdp waits for torch.distributed's collectives", _drain,
                        "at exit, gloo/NCCL threads may still hold the tensors of collectives; freeing them under "
                        "those threads crashed the interpreter's shutdown")

    @property
    def device(self) -> torch.device:
        return self._device

    def all_gather(self, shard: torch.Tensor, channel: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._start_all_gather(shard, out)()

    def start_all_gather(self, shard: torch.Tensor, channel: int) -> Callable[[], torch.Tensor]:
        return self._start_all_gather(shard, None)

    def _start_all_gather(self, shard: torch.Tensor, out: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
        if self.world_size == 1:  # NO_SHARD: nothing to exchange
            result = out.copy_(shard) if out is not None else shard.clone()
            return lambda: result
        if out is None:
            out = shard.new_empty((shard.shape[0] * self.world_size,) + tuple(shard.shape[1:]))
        handed = _aliases(out, shard.contiguous())
        return _Waiter(_ALL_GATHER(*handed, group=self.group, async_op=True), out, handed)

    def reduce_scatter(self, full: torch.Tensor, channel: int, scale: float = 1.0) -> torch.Tensor:
        return self.start_reduce_scatter(full, channel, scale)()

    def start_reduce_scatter(self, full: torch.Tensor, channel: int, scale: float = 1.0) -> Callable[[], torch.Tensor]:
        if self.world_size == 1:
            return lambda: full if scale == 1 else full * scale
        out = full.new_empty((full.shape[0] // self.world_size,) + tuple(full.shape[1:]))
        handed = _aliases(out, full.contiguous())
        wait = _Waiter(_REDUCE_SCATTER(*handed, group=self.group, async_op=True), out, handed)
        return wait if scale == 1 else lambda: wait().mul_(scale)

    def all_reduce_sum(self, tensor: torch.Tensor, channel: int) -> torch.Tensor:
        tensor = tensor.clone()
        handed = _aliases(tensor)
        dist.all_reduce(handed[0], group=self.group)
        _let_go(handed)
        return tensor

    def all_reduce_replicas(self, tensor: torch.Tensor, channel: int) -> torch.Tensor:
        if not self.replica_groups:
            return tensor
        tensor = tensor.contiguous()
        handed = _aliases(tensor)
        dist.all_reduce(handed[0], group=self.replica_group)
        _let_go(handed)
        return tensor

    def broadcast_from_rank_0(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size() == 1:
            return tensor
        value = tensor.detach().to(self._device).contiguous().clone()
        handed = _aliases(value)
        dist.broadcast(handed[0], src=0)  # the default group: every rank of the job
        _let_go(handed)
        return value.to(tensor.device)

    def start_sum_over_ranks(self, values: Sequence[int]) -> Callable[[], Optional[List[int]]]:
        if dist.get_world_size() == 1:
            return super().start_sum_over_ranks(values)
        counts = torch.tensor(list(values), dtype=torch.int32, device=self._device)
        handed = _aliases(counts)
        work = dist.all_reduce(handed[0], async_op=True)  # every rank of the job trains this model
        wait = _Waiter(work, counts, handed)
        return lambda: wait().tolist()

    def meet(self, call: str) -> Tuple[List[int], float]:
        """Through the job's store (the one ``init_process_group`` made), not a collective: a rank
        that never comes leaves the others' gloo/NCCL sequence untouched. The job's timeout is the
        store's (``init_process_group(timeout=...)``)."""
        world = dist.get_world_size()
        if world == 1:
            return super().meet(call)
        store = dist.distributed_c10d._get_default_store()
        _ARRIVALS[call] = _ARRIVALS.get(call, 0) + 1  # the job's ranks make the same calls in the same order
        prefix = f"xla_fsdp/arrived/{call}/{_ARRIVALS[call]}/"
        store.set(prefix + str(dist.get_rank()), b"1")
        keys = [prefix + str(r) for r in range(world)]
        timeout = store.timeout.total_seconds()
        start, pause, warned = time.monotonic(), 0.001, False
        while not store.check(keys):
            waited = time.monotonic() - start
            late = [r for r, key in enumerate(keys) if not store.check([key])]
            if waited >= timeout:
                return late, timeout
            if not warned and waited >= LATE_WARNING_S:
                warnings.warn(f"xla_fsdp: rank {dist.get_rank()} has waited {waited:.0f} s in {call} for ranks {late}: "
                              f"every rank calls {call} (one under `if rank == 0:` is never met; this rank gives "
                              f"up after the job's timeout, {timeout:.0f} s)", stacklevel=4)
                warned = True
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return [], timeout

    def new_full(self, shape: Tuple[int, ...], padded_numel: int, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        full = torch.empty(padded_numel, dtype=dtype, device=self._device)[:numel].view(shape)
        full.untyped_storage().resize_(0)
        return full

    def gather_into(self, full: torch.Tensor, shard: torch.Tensor, channel: int,
                    padded_shape: Tuple[int, ...], unpad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.start_gather_into(full, shard, channel, padded_shape, unpad)()

    def start_gather_into(self, full: torch.Tensor, shard: torch.Tensor, channel: int,
                          padded_shape: Tuple[int, ...], unpad: Callable[[torch.Tensor], torch.Tensor],
                          alias_ok: bool = True) -> Callable[[], object]:
        if self.world_size == 1 and shard.dtype == full.dtype and alias_ok:
            # One rank, no cast (NO_SHARD, world size 1): the full parameter *is* the shard's storage,
            # so there is no copy and no second copy in memory; the optimizer's in-place updates
            # of the shard show through.
            if self.aliases_shard(full) and full.data_ptr() == shard.data_ptr():
                return _done  # aliased at the first gather (the unpadded data starts at the shard's)
            source = unpad(shard.detach().view(padded_shape))
            if not self.aliases_shard(full) or full.data_ptr() != source.data_ptr():
                with torch.no_grad():
                    full.set_(source.untyped_storage(), source.storage_offset(), source.shape, source.stride())
                full._xla_fsdp_alias = True
            return lambda: None
        # Gather straight into the parameter's re-grown storage: views autograd saved during forward
        # share this storage, so they see the data again, and no extra full-size copy is made.
        storage = full.untyped_storage()
        nbytes = math.prod(padded_shape) * full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        buffer = full.new_empty(0).set_(storage, 0, padded_shape)
        return self._start_all_gather(shard.detach().to(full.dtype), buffer)

    overlaps = True  # gloo/NCCL run collectives on their own threads/streams

    @property
    def coalesces(self) -> bool:  # type: ignore[override]
        # Every gloo/NCCL collective has a fixed latency: one per unit instead of one per parameter.
        return self.world_size > 1

    def fill_full(self, full: torch.Tensor, data: torch.Tensor, padded_shape: Tuple[int, ...],
                  unpad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        storage = full.untyped_storage()
        nbytes = math.prod(padded_shape) * full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        buffer = full.new_empty(0).set_(storage, 0, padded_shape)
        buffer.view(data.shape).copy_(data)  # columns of the gathered (world_size, n) block

    def free(self, full: torch.Tensor) -> None:
        if not self.aliases_shard(full):  # an alias owns nothing: resizing would free the shard
            full.untyped_storage().resize_(0)

    def is_allocated(self, full: torch.Tensor) -> bool:
        return not self.aliases_shard(full) and full.untyped_storage().size() > 0

    def aliases_shard(self, full: torch.Tensor) -> bool:
        return getattr(full, "_xla_fsdp_alias", False)
