"""Collectives over PJRT/XLA (TPU, and XLA:CPU with one thread per device).

XLA:CPU pairs the ranks of a collective by an ``op_id``. Without a channel id that id is the
compiled module's unique id, which differs whenever two rank threads compile the same graph, so
the ranks never meet (docs/torch_xla_defects.md). Here every collective carries a channel id
that names the logical operation (the same integer on every rank) and global device ids, so
separately compiled executables rendezvous whatever the compile order. ``all_reduce`` has no
channel id in torch_xla, so sums are built from all-gathers.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import patches
from .base import Collectives
from .host_exchange import thread_exchange
from .xla_gradients import install_gradient_fetch
from .xla_user import is_threaded_cpu

_COMPILE_LOCK = threading.Lock()


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """Run pending XLA work; safe when several XLA:CPU devices are threads of one process.

    ``torch_xla.sync()`` drops the collective token while holding the GIL, which deadlocks when
    another rank thread still needs the GIL to reach its own collective. Here the launch and the wait
    for this device's execution happen with the GIL released, and the token is dropped only after.
    On TPU it behaves like ``torch_xla.sync(wait, reset_scope)``.

    ``reset_scope``: also clear the thread's profiler scopes (``xp.Trace``), as at the end of a
    user's step; torch_xla refuses that while a scope is open. A graph cut xla_fsdp makes inside a
    user's forward or backward (:meth:`XlaCollectives.sync`) passes False: the user's scopes stay.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    xlac = torch_xla._XLAC
    dev = xlac._xla_get_default_device()
    _LINKS.pop(str(dev), None)  # a new graph starts a new order (and the link is no output of this one)
    threaded = is_threaded_cpu()
    if threaded and os.environ.get("PJRT_CPU_ASYNC_CLIENT", "").lower() in ("false", "0"):
        # One rank thread compiles, the others find the executable in the shared cache: no rank
        # waits in a collective while a peer is still compiling (XLA:CPU aborts a rendezvous after
        # 10 s). With the synchronous client the launch returns before execution, so the lock is
        # never held across a collective.
        with _COMPILE_LOCK:
            xlac._xla_step_marker(dev, [], wait=False, reset_scope=reset_scope)
    else:
        xlac._xla_step_marker(dev, [], wait=wait, reset_scope=reset_scope)
    if threaded:
        xlac._xla_wait_device_ops(xlac._xla_real_devices([dev]))
    xm._run_step_closures()
    xlac._set_all_reduce_token(dev, None)


def install_safe_sync() -> None:
    """Route ``torch_xla.sync`` and ``xm.mark_step`` (also used by ``xm.optimizer_step``) through
    :func:`sync`, so user loops written for TPU work unchanged with several XLA:CPU devices."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    for owner, name in ((torch_xla, "sync"), (xm, "mark_step")):
        patches.replace(owner, name, lambda wait=False, reset_scope=True: sync(wait, reset_scope),
                        "a sync that does not deadlock XLA:CPU rank threads")


def xla_cpu_devices_enabled() -> bool:
    """Whether :func:`xla_fsdp.enable_xla_cpu_devices` ran in this process."""
    import torch_xla
    return patches.is_installed(f"{torch_xla.__name__}.sync")


class _ChannelAllocator:
    """Hands out channel ids in construction order; each rank thread has its own counter, so the
    n-th unit built on every rank gets the same ids."""

    def __init__(self):
        self._local = threading.local()

    def peek(self) -> int:
        return getattr(self._local, "next", 1)

    def take(self, count: int) -> int:
        start = getattr(self._local, "next", 1)
        self._local.next = start + count
        return start


CHANNELS = _ChannelAllocator()
CHECK_CHANNEL = 1 << 30  # reserved: the construction check below, never handed out by CHANNELS


class XlaCollectives(Collectives):
    """Collectives on the current XLA device; full parameters are swapped in place with
    ``_replace_xla_tensor`` so the autograd leaf survives and its dtype stays the compute dtype."""

    name = "xla"
    views_see_refills = False
    compiles_step = True
    takes_in_place_edits = False

    def __init__(self, groups: Optional[Sequence[Sequence[int]]] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 pin_layout: bool = True, use_channel_ids: Optional[bool] = None,
                 replica_groups: Optional[Sequence[Sequence[int]]] = None):
        import torch_xla
        import torch_xla.runtime as xr

        install_gradient_fetch()  # xm.optimizer_step & co. must not all-reduce shard gradients again
        self._device = torch_xla.device()
        global_ws, global_rank = xr.world_size(), xr.global_ordinal()
        self.global_rank = global_rank
        if groups:
            if rank is None or world_size is None:
                raise ValueError("sharding_groups needs sharding_rank and sharding_world_size "
                                 "(this rank's position in its group and the group size)")
            self.groups = [list(g) for g in groups]
            self.rank, self.world_size = rank, world_size
            if any(len(g) != world_size for g in self.groups):
                raise ValueError(f"every sharding group must have {world_size} ranks: {self.groups}")
        else:
            self.groups = [list(range(global_ws))]
            self.rank, self.world_size = global_rank, global_ws
        self.replica_groups = [list(g) for g in replica_groups] if replica_groups else []
        if use_channel_ids is None:
            env = os.environ.get("XLA_FSDP_CHANNEL_IDS")
            use_channel_ids = (env == "1") if env in ("0", "1") else xr.device_type() == "CPU"
        self.use_channel_ids = use_channel_ids
        # A pinned all-gather is lowered per rank (pad by ordinal + all-reduce): never pin on the
        # channel-id path, whose point is identical, id-matched collectives.
        self.pin_layout = pin_layout and not use_channel_ids
        # Our collectives call torch_xla's bindings (torch_xla._XLAC) with the arguments xm.all_gather /
        # xm.reduce_scatter pass them, without xm's per-call Python (device context, token, checks): a
        # step traces hundreds. Not where xm's function is another: a pinned all-gather (xm builds it
        # from an all-reduce), or rank threads without channel ids (xla_user's host exchanges).
        self._direct = use_channel_ids or not is_threaded_cpu()
        self._direct_gather = self._direct and not self.pin_layout
        self._own_groups = self._xm_groups(self.groups)
        self._placeholders: Dict[torch.dtype, torch.Tensor] = {}
        #: set by the SPMD mode (world size 1): the compiler, not this object, gathers the shards
        self.gather_by_annotation = False
        if is_threaded_cpu() and not xla_cpu_devices_enabled():
            raise RuntimeError(
                f"xla_fsdp: this process runs {xr.addressable_runtime_device_count()} XLA:CPU devices as threads, "
                "which torch_xla alone cannot run collectives across: start the ranks with "
                "xla_fsdp.launch(fn, args) instead of torch_xla.launch, or call xla_fsdp.enable_xla_cpu_devices() "
                "before torch_xla.launch / xmp.spawn (docs/usage.md, 'Several XLA:CPU devices')")

    def within_groups_of(self, size: int) -> "XlaCollectives":
        """The collectives of this one's ranks in consecutive groups of ``size`` (FSDP2's post-forward
        mesh for an int ``reshard_after_forward``: rank ``r`` is ``r % size`` of group ``r // size``)."""
        if len(self.groups) != 1 or self.replica_groups or self.world_size % size:
            raise RuntimeError(f"xla_fsdp: an int reshard_after_forward needs one shard group over every device "
                               f"to split into groups of {size}; these collectives have groups {self.groups}")
        ranks = self.groups[0]
        return XlaCollectives([ranks[i:i + size] for i in range(0, len(ranks), size)], rank=self.rank % size,
                              world_size=size, pin_layout=self.pin_layout, use_channel_ids=self.use_channel_ids)

    @property
    def device(self) -> torch.device:
        return self._device

    def allocate_channels(self, count: int) -> int:
        return CHANNELS.take(count)

    def check_construction(self) -> None:
        """Fail fast, on every rank, when ranks built different FSDP units.

        Channel ids are handed out in construction order, so ranks that built different units would
        pair unrelated collectives (wrong data) or wait for each other until XLA aborts the process.
        Rank threads compare the counters on the host; across processes one small all-gather on a
        reserved channel does, before the first step.
        """
        everyone = sorted(r for g in self.groups for r in g)
        if not self.use_channel_ids or len(everyone) == 1:
            return
        values = self._compare_on_host(everyone) if is_threaded_cpu() else None
        if values is None:
            mine = torch.tensor([CHANNELS.peek()], dtype=torch.int32).to(self._device)
            counters = self._gather(mine, CHECK_CHANNEL, [everyone])
            self.sync()
            values = counters.cpu().tolist()
        if len(set(values)) > 1:
            raise RuntimeError(
                f"xla_fsdp: ranks built different FSDP units before this first forward (channel counters by "
                f"rank: {values}). Every rank must construct the same wrapped models, in the same order; "
                "otherwise their collectives cannot be matched.")

    def _compare_on_host(self, everyone: List[int]) -> Optional[List[int]]:
        """Rank threads of one process: the counters are compared on the host, where waiting is free
        and nothing compiles (the check is the first meeting after whatever each rank did on its own,
        so threads can reach it far apart; XLA:CPU aborts a device rendezvous whose peers are 10 s
        late). This rank's pending work runs first in a graph of its own, so that the first step's
        graph is the same on every rank (one compile, not one per rank). None: a subset of the
        process's devices, which the device all-gather checks (a host meeting would wait for ranks
        not in it)."""
        import torch_xla.runtime as xr

        self.sync()
        if everyone != list(range(xr.world_size())):
            return None
        return thread_exchange("construction check", len(everyone)).gather(self.global_rank, CHANNELS.peek())

    def _channel_kwargs(self, channel: int) -> dict:
        if not self.use_channel_ids:
            return {}
        return {"channel_id": int(channel), "use_global_device_ids": True}

    def _channel_ids(self, channel: int) -> Tuple[Optional[int], Optional[bool]]:
        """``channel_id`` and ``use_global_device_ids`` as the bindings take them."""
        return (int(channel), True) if self.use_channel_ids else (None, None)

    def _xm_groups(self, groups: List[List[int]]) -> Tuple[List[List[int]], int]:
        """The groups and shard count xm would pass the bindings: without channel ids one group is
        left implicit (every device), as it always was here."""
        import torch_xla.runtime as xr

        if self.use_channel_ids or len(groups) > 1:
            return groups, len(groups[0])
        return [], xr.world_size()

    def _gather(self, tensor: torch.Tensor, channel: int, groups: List[List[int]],
                gradients: bool = False) -> torch.Tensor:
        """``gradients``: values that may hold an inf, kept out of torch_xla's token (see _outside_token)."""
        import torch_xla

        xm_groups, shard_count = self._own_groups if groups is self.groups else self._xm_groups(groups)
        if self._direct_gather:
            # _XLAC looked up at each call: whatever is installed there (a counter) sees it. The
            # binding takes and advances the device's token itself (xm passes it none).
            ids = self._channel_ids(channel)
            if not gradients:
                return torch_xla._XLAC._xla_all_gather(_linked(tensor), 0, shard_count, xm_groups, False, *ids)
            return _outside_token(tensor, lambda t: torch_xla._XLAC._xla_all_gather(
                t, 0, shard_count, xm_groups, False, *ids))
        import torch_xla.core.xla_model as xm

        kwargs = dict(groups=xm_groups or None, pin_layout=self.pin_layout, **self._channel_kwargs(channel))
        if gradients:
            return _outside_token(tensor, lambda t: xm.all_gather(t, 0, **kwargs))
        return xm.all_gather(_linked(tensor), 0, **kwargs)

    def all_gather(self, shard: torch.Tensor, channel: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.world_size == 1:  # NO_SHARD, or the SPMD mode's one logical rank: nothing to exchange
            # SPMD: the shard is annotated as split over the mesh and the partitioner gathers it
            # where it is used; a copy here would only be one more full-size write per unit.
            result = shard if self.gather_by_annotation else shard.clone()
        else:
            result = self._gather(shard, channel, self.groups)
        if out is not None:
            out.copy_(result)
            return out
        return result

    #: the sum's scale is an operand of XLA's reduce-scatter (no op traced for it)
    scales_in_collective = True

    def reduce_scatter(self, full: torch.Tensor, channel: int, scale: float = 1.0) -> torch.Tensor:
        import torch_xla

        if self.world_size == 1:
            return full if scale == 1 else full * scale
        xm_groups, _ = self._own_groups
        if not self._direct:
            import torch_xla.core.xla_model as xm
            kwargs = dict(groups=xm_groups or None, pin_layout=self.pin_layout, **self._channel_kwargs(channel))
            return _outside_token(full, lambda t: xm.reduce_scatter(xm.REDUCE_SUM, t, scale, 0, self.world_size,
                                                                    **kwargs))
        # The device's token goes in (as xm's) and the new one is not kept (xm keeps it): the gradient
        # stays out of the token as _outside_token keeps it, its order kept by the link.
        xlac = torch_xla._XLAC
        linked = _linked(full)
        token = xlac._get_all_reduce_token(xlac._xla_get_default_device())  # the device xm takes the token of
        result = xlac._xla_reduce_scatter("sum", linked, token, scale, 0, self.world_size, xm_groups,  # xm.REDUCE_SUM
                                          self.pin_layout, *self._channel_ids(channel))[0]
        _link_after(result, full)
        return result

    def all_reduce_sum(self, tensor: torch.Tensor, channel: int) -> torch.Tensor:
        flat = tensor.reshape(1, -1)
        gathered = self.all_gather(flat, channel)
        return gathered.sum(dim=0).view(tensor.shape)

    def all_reduce_replicas(self, tensor: torch.Tensor, channel: int) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        if not self.replica_groups:
            return tensor
        if not self.use_channel_ids:
            return _outside_token(tensor, lambda t: xm.all_reduce(xm.REDUCE_SUM, t, groups=self.replica_groups,
                                                                  pin_layout=self.pin_layout))
        gathered = self._gather(tensor.reshape(1, -1), channel, self.replica_groups, gradients=True)
        return gathered.sum(dim=0).view(tensor.shape)

    @property
    def ranks_share_a_process(self) -> bool:  # type: ignore[override]
        import torch_xla.runtime as xr
        return xr.world_size() > xr.process_count()

    def broadcast_from_rank_0(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.start_broadcast_from_rank_0(tensor)()

    def start_broadcast_from_rank_0(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Rank threads of one process: rank 0 leaves its host copy now and every rank takes it later
        (no device collective, no rank waiting while it builds). Across processes: one all-reduce
        of rank 0's value and zeros, when taken."""
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xr.world_size() == 1:
            return lambda: tensor
        rank = xr.global_ordinal()
        if xr.process_count() == 1:
            host = tensor.detach().cpu().clone() if rank == 0 else None
            gather = thread_exchange("rank 0 values", xr.world_size()).start_gather(rank, host)
            return lambda: gather()[0]

        def take() -> torch.Tensor:
            value = tensor.detach().to(self.device)
            value = value if rank == 0 else torch.zeros_like(value)
            return xm.all_reduce(xm.REDUCE_SUM, value).to(tensor.device)
        return take

    def start_sum_over_ranks(self, values: Sequence[int]) -> Callable[[], Optional[List[int]]]:
        """Summed on the host, without a device round trip in the middle of tracing a step: where
        the ranks are threads of this process (XLA:CPU, one-process TPU hosts). Across processes
        there is no cheap host channel, so ranks are assumed alike (None)."""
        import torch_xla.runtime as xr

        if xr.world_size() == 1:
            return super().start_sum_over_ranks(values)
        if xr.process_count() > 1:
            return lambda: None
        gather = thread_exchange("gradient plan", xr.world_size()).start_gather(xr.global_ordinal(), list(values))

        def total() -> List[int]:
            rows = gather()
            if len({len(r) for r in rows}) > 1:
                raise RuntimeError("xla_fsdp: ranks disagree on the number of parameter groups "
                                   f"({sorted({len(r) for r in rows})}); every rank must wrap the same model")
            return [sum(column) for column in zip(*rows)]
        return total

    def new_full(self, shape: Tuple[int, ...], padded_numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Born reporting its real shape, from host data: a tensor born with the placeholder's shape keeps
        # reporting that shape to some ops (mm), and one born as a device-side constant
        # (torch.zeros(device=xla)) ignores later _replace_xla_tensor calls. It is a broadcast view
        # of one host element, not a real-shape buffer: the caller wraps it in nn.Parameter, whose
        # functional storage keeps its birth data for the parameter's life, past every
        # _replace_xla_tensor (a real-shape birth held one whole model per rank).
        return torch.zeros((), dtype=dtype).to(self._device).expand(shape)

    def gather_into(self, full: torch.Tensor, shard: torch.Tensor, channel: int,
                    padded_shape: Tuple[int, ...], unpad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # The direct binding records no autograd: the shard goes in as it is (a detach is an op to
        # trace per parameter); a cast, or xm's path, is kept out of autograd's graph.
        direct = self._direct_gather and self.world_size > 1 and shard.dtype == full.dtype
        source = shard if direct else shard.detach().to(full.dtype)
        self.fill_full(full, self.all_gather(source, channel), padded_shape, unpad)

    def fill_full(self, full: torch.Tensor, data: torch.Tensor, padded_shape: Tuple[int, ...],
                  unpad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        import torch_xla

        # a reshape to the same shape is still an op to trace; SPMD's data is the shard itself
        if self.gather_by_annotation or tuple(data.shape) != tuple(padded_shape):
            data = data.reshape(padded_shape)
        torch_xla._XLAC._replace_xla_tensor(full, unpad(data))
        full._xla_fsdp_freed = False
        _refresh_metadata(full)

    def free(self, full: torch.Tensor) -> None:
        import torch_xla

        # One 1-element placeholder per dtype, shared by every freed parameter: nothing reads it,
        # and building a fresh constant per free is a visible part of tracing a step.
        placeholder = self._placeholders.get(full.dtype)
        if placeholder is None:
            placeholder = self._placeholders[full.dtype] = torch.zeros(1, dtype=full.dtype, device=self._device)
        torch_xla._XLAC._replace_xla_tensor(full, placeholder)
        full._xla_fsdp_freed = True
        _refresh_metadata(full)

    def is_allocated(self, full: torch.Tensor) -> bool:
        # A freed parameter holds the 1-element placeholder (its reported shape follows the data).
        return tuple(full.shape) != (1,) or not getattr(full, "_xla_fsdp_freed", False)

    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> None:
        import torch_xla.core.xla_model as xm

        # Barriers on integer tensors abort XLA:CPU (seen with nn.Embedding ids); they are only
        # needed on floating tensors, whose liveness is what the barrier controls.
        floats = [t for t in tensors if t is not None and t.is_floating_point()]
        if floats:
            xm.optimization_barrier_(floats)

    def step_mark(self) -> torch.Tensor:
        """A 0-d tensor left pending in the trace: the next graph cut gives it device data (reading
        a value, ``loss.item()``, runs only the graph of that value and leaves it pending)."""
        return torch.zeros((), device=self.device) + 1

    def marked_since(self, mark: Any) -> bool:
        import torch_xla
        try:
            torch_xla._XLAC._get_tensors_handle([mark])
        except RuntimeError:  # "XlaTensor does not have data handle": still pending
            return False
        return True

    def to_host(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Host tensors as they are, XLA ones in one transfer: values a sync already made are copied
        without compiling anything (a ``torch.stack(...).cpu()`` compiled a graph of its own, on each
        rank thread); what is still pending compiles once, together."""
        import torch_xla

        out = list(tensors)
        lazy = [i for i, t in enumerate(out) if t.device.type == "xla"]
        if lazy:
            for i, value in zip(lazy, torch_xla._XLAC._xla_get_cpu_tensors([out[i].detach() for i in lazy])):
                out[i] = value
        return out

    def sync(self, keep_rng: bool = True, why: Optional[str] = None) -> None:
        if not keep_rng:
            sync(reset_scope=False)
            return
        import torch_xla.core.xla_model as xm
        before = xm.get_rng_state(self.device)
        sync(reset_scope=False)
        after = xm.get_rng_state(self.device)
        xm.set_rng_state(before, self.device)
        if _seed_before_step(after) != before:
            _warn_draws_before_cut(why)


# torch_xla advances a device's seed at every graph cut: seed' = 1012031 + seed * 7012063 (mod 2**64),
# from the seed of the last cut, whatever was drawn since (draws advance a running seed from it).
_SEED_ADD, _SEED_MUL, _SEED_MOD = 1012031, 7012063, 2 ** 64
_SEED_MUL_INVERSE = pow(_SEED_MUL, -1, _SEED_MOD)
_WARNED_DRAWS = threading.Event()


def _seed_before_step(seed: int) -> int:
    """The seed of the previous cut, given the seed a cut made from it."""
    return ((seed - _SEED_ADD) * _SEED_MUL_INVERSE) % _SEED_MOD


def _warn_draws_before_cut(why: Optional[str] = None) -> None:
    """Random numbers were drawn on the device before a cut xla_fsdp made: the rest of the step draws
    as the program would, but the seed of the program's next cut cannot be the one it would have
    been (torch_xla sets seed and running seed together). ``why``: the cut's cause and the way to
    avoid it, where the caller knows them."""
    if _WARNED_DRAWS.is_set():
        return
    _WARNED_DRAWS.set()
    import warnings
    cause = why or ("It is one xla_fsdp makes for itself where values must reach the host between the program's "
                    "own cuts (a state dict or checkpoint, host-offloaded gradients); a torch_xla.sync() of the "
                    "program's right after the draws keeps the draws as unwrapped")
    warnings.warn("xla_fsdp had to run the graph (a sync) after random numbers were drawn on the device since the "
                  "last one (dropout, torch.rand, an init): from here on the random numbers differ from the same "
                  f"program unwrapped (torch_xla advances its seed at every graph cut). {cause}; see docs/usage.md, "
                  "'Exactness rules'", stacklevel=3)


# --- gradient collectives outside torch_xla's collective token --------------------------------------
#: per XLA device: a bool scalar computed from the result of the last gradient collective of the
#: graph being traced; the next collective's input adds 0 times it, so it runs after that one
_LINKS: Dict[str, torch.Tensor] = {}


def _linked(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, made to depend on the device's last gradient collective if the graph being
    traced has one that no collective follows yet (see :func:`_outside_token`)."""
    import torch_xla

    link = _LINKS.pop(str(tensor.device), None)
    if link is None or not torch_xla._XLAC._check_tensor_need_materialization([link])[0]:
        return tensor  # none, or from a graph that has run since
    # + 0 * link: XLA keeps a float multiplication by 0 (it would turn an inf into NaN), and so does
    # add's alpha (one IR node). The link is a bool, converted to the tensor's dtype in the add: 0 or 1,
    # finite in every dtype (a float link in another dtype than the tensor's broke XLA's verifier in
    # a bf16 recompute). (An optimization barrier over the tensor and the link, with no
    # arithmetic, does not keep the order on XLA:CPU: ranks ran two reduce-scatters in different
    # orders and XLA aborted them.)
    return (tensor.detach() if tensor.requires_grad else tensor).add(link, alpha=0)


def _outside_token(tensor: torch.Tensor, collective: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``collective(tensor)`` for a collective of gradients, whose result may hold an inf.

    torch_xla orders the collectives of a graph with a numeric token (``TokenHandler`` in its
    ``token_handler.cpp``; all-gather, reduce-scatter and all-reduce alike): a collective's input
    gets ``+ token`` and the token becomes ``token * result[0]``. A reduced gradient whose first
    element is inf makes the token ``0 * inf = NaN``, and every later collective of the graph adds
    that NaN to its input: the other parameters' gradients arrive as NaN. So the token is put back
    as it was before this collective, and the order goes on through a link of our own: the next
    collective's input adds ``0 * isnan(result[0])``, the same dependency, always a finite 0.
    The order matters: XLA:CPU ranks that ran independent collectives in different orders waited
    for each other in two rendezvous until XLA aborted them. Keyed by the tensor's device, not the
    thread: backward hooks run in autograd's thread for the device."""
    import torch_xla

    xlac = torch_xla._XLAC
    device = xlac._xla_get_default_device()  # the device xm's collectives take the token of
    token = xlac._get_all_reduce_token(device)
    try:
        result = collective(_linked(tensor))
    finally:
        xlac._set_all_reduce_token(device, token)
    _link_after(result, tensor)
    return result


def _link_after(result: torch.Tensor, tensor: torch.Tensor) -> None:
    """The next collective on ``tensor``'s device follows this one (see :func:`_outside_token`)."""
    first = result.detach() if result.requires_grad else result  # (the bindings' results do not)
    # isnan: a bool computed from the result, finite whatever the result holds (nan_to_num of it
    # made the same dependency at 5x the tracing time)
    _LINKS[str(tensor.device)] = (first if first.dim() == 1 else first.reshape(-1))[0].isnan()


def _refresh_metadata(tensor: torch.Tensor) -> None:
    """Make the tensor's sizes and strides follow the data it was just given.

    After a replace, torch_xla refreshes a tensor's cached strides only when its sizes are read.
    Without this, a member that was read while freed (strides ``(1,)``) and then refilled reports
    2-D sizes with 1-D strides, and autograd's ``t()`` of it (``addmm``'s backward, as in GPT-2's
    ``Conv1D``) fails with "dimensionality of sizes (2) must match dimensionality of strides (1)"."""
    tensor.size()
