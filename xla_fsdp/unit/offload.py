"""Host offload (``cpu_offload=True``): a unit's master shards (fp32, or ``param_storage_dtype``),
their gradients and so the optimizer state live in host memory; only the compute copy goes to the
device.

Per group and step: before its all-gather the host shard is copied to the device (in the compute
dtype) and gathered from there; the gathered parameters are used and freed as without offload;
the reduce-scattered gradient shard comes back to the host and is added to ``shard.grad``.

- Eager devices (CUDA, and CPU under gloo, where host and device are one memory but the same copies
  run): gradients come back as each reduce-scatter finishes. On CUDA host tensors are pinned, copies
  to the device and into a fresh gradient are ``non_blocking``, and the end of the root's backward
  waits for them (before any optimizer step); adding to an existing gradient copies synchronously.
- XLA: a gradient read back in the middle of backward would cut the step's graph once per unit.
  Gradient shards stay on the device until the root's backward ends; then one ``sync`` runs the
  graph and every shard is read back in one transfer. Host shards enter graphs as fresh device
  data of fixed shapes, so offload adds no compilation after the first step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from .gradients import run_post_accumulate_hooks

STORAGE_DTYPES = (None, torch.float32, torch.bfloat16)


def offload_requested(value: Any) -> Tuple[bool, bool]:
    """``(offload, pin_memory)`` from a ``cpu_offload`` keyword: ``True``/``False``, PyTorch FSDP's
    ``CPUOffload(offload_params=...)`` or FSDP2's ``CPUOffloadPolicy(pin_memory=...)`` (a plain
    ``OffloadPolicy()`` is no offload). Anything else is an error naming what is accepted."""
    if value is None or isinstance(value, bool):
        return bool(value), True
    kind = type(value).__name__
    if kind == "CPUOffload" and isinstance(getattr(value, "offload_params", None), bool):
        return value.offload_params, True
    if kind == "CPUOffloadPolicy" and isinstance(getattr(value, "pin_memory", None), bool):
        return True, value.pin_memory
    if kind == "OffloadPolicy":
        return False, True
    raise TypeError(
        f"xla_fsdp: cpu_offload must be True/False, torch.distributed.fsdp.CPUOffload(offload_params=...) or "
        f"CPUOffloadPolicy(); got {value!r} ({kind}). Pass cpu_offload=True to keep master parameters, "
        "gradients and optimizer state in host memory.")


def check_storage_dtype(dtype: Optional[torch.dtype]) -> None:
    if dtype not in STORAGE_DTYPES:
        raise ValueError(
            f"xla_fsdp: param_storage_dtype must be torch.float32 (default) or torch.bfloat16, got {dtype}. "
            "For low-precision compute with fp32 master parameters use compute_dtype= instead.")


class HostOffload:
    """Moves one unit's shards between host memory and ``device`` (the transport's)."""

    def __init__(self, device: torch.device, pin_memory: bool = True):
        self.device = device
        # pinned pages only help copies to an accelerator (CUDA, XPU, a PrivateUse1 device)
        self.pin = pin_memory and device.type not in ("cpu", "xla", "meta") and torch.accelerator.is_available()
        #: XLA: gradients wait on the device for the end of backward (see the module docstring)
        self.lazy = device.type == "xla"
        self._waiting: List[Tuple[torch.Tensor, torch.Tensor, Callable]] = []  # (host shard, device gradient, as_grad)
        self._copies_in_flight = False
        #: per host shard (id): (its version, the device copy) made for a barrier, read by the next gather
        self._staged: Dict[int, Tuple[int, torch.Tensor]] = {}

    # --- parameters ---------------------------------------------------------------------------
    def host_shard(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of its own holding ``shard`` in ``dtype`` (pinned for accelerators)."""
        host = torch.empty(shard.shape, dtype=dtype, device="cpu", pin_memory=self.pin)
        host.copy_(shard.detach())
        return host

    def gather_source(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What the all-gather of the host ``shard`` reads: a device copy (the one staged for a barrier
        if the shard has not changed since)."""
        staged = self._staged.pop(id(shard), None)
        if staged is not None and staged[0] == shard._version:
            return staged[1]
        return self.to_device(shard, dtype)

    def stage(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Make the device copy the next gather of ``shard`` reads now, so a barrier can cover it."""
        self._staged[id(shard)] = (shard._version, self.to_device(shard, dtype))
        return self._staged[id(shard)][1]

    def to_device(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A device copy of the host ``shard`` in the compute ``dtype``, to all-gather from."""
        shard = shard.detach()
        if self.lazy:  # cast before the transfer: fewer bytes to the device, and no cast in the graph
            return shard.to(dtype).to(self.device)
        # Always a copy, also where the device is the host: what is gathered is never the master.
        self._copies_in_flight |= self.pin  # the end of backward waits for it (before any optimizer step)
        return shard.to(self.device, dtype=dtype, non_blocking=self.pin, copy=True)

    # --- gradients ----------------------------------------------------------------------------
    def add_grad(self, shard: torch.Tensor, reduced: torch.Tensor,
                 as_grad: Callable[[torch.Tensor], torch.Tensor] = lambda g: g) -> None:
        """Add a reduced device gradient shard to the host shard's ``grad`` (a new ``grad`` is
        made ``as_grad(host tensor)``: the shard gradient type, see gradients.ShardGrad)."""
        if self.lazy:
            self._waiting.append((shard, reduced, as_grad))
        else:
            self._store(shard, reduced, as_grad)

    def _store(self, shard: torch.Tensor, reduced: torch.Tensor, as_grad: Callable[[torch.Tensor], torch.Tensor],
               owned: bool = False) -> None:
        """``owned``: ``reduced`` is a host tensor read back for this gradient alone, kept as it is."""
        reduced = reduced.reshape(shard.shape)
        if shard.grad is None and owned and reduced.dtype == shard.dtype:
            shard.grad = as_grad(reduced)
        elif shard.grad is None:
            grad = torch.empty(shard.shape, dtype=shard.dtype, device="cpu", pin_memory=self.pin)
            grad.copy_(reduced, non_blocking=self.pin)  # a fresh buffer: nothing reads it before backward ends
            self._copies_in_flight |= self.pin
            shard.grad = as_grad(grad)
        else:  # accumulating (no zero_grad between backwards): the sum needs the data now
            shard.grad.add_(reduced.to("cpu", dtype=shard.dtype))
        if shard._post_accumulate_grad_hooks:  # they read the host gradient: let the copy end first
            self._wait_for_copies()
            run_post_accumulate_hooks(shard)

    @property
    def waiting(self) -> bool:
        return bool(self._waiting) or self._copies_in_flight

    def land(self, host_values: Optional[List[torch.Tensor]] = None) -> None:
        """Finish this unit's gradient copies: store the waiting ones (their host values read
        already, in order, when given) and wait for non-blocking copies."""
        waiting, self._waiting = self._waiting, []
        values = host_values if host_values is not None else [r for _, r, _ in waiting]
        for (shard, _, as_grad), value in zip(waiting, values):
            self._store(shard, value, as_grad, owned=host_values is not None)
        self._wait_for_copies()

    def _wait_for_copies(self) -> None:
        if self._copies_in_flight:
            torch.accelerator.current_stream(self.device).synchronize()
            self._copies_in_flight = False

    def barrier_sources(self, groups: Iterable[Any]) -> List[torch.Tensor]:
        """What a unit's optimization barrier covers with offload: on XLA the device copies that the
        coming all-gathers will read (staged on the groups now; the unit gathers right after its barrier
        exactly the groups not gathered yet: XLA never prefetches). Without offload it is the shards."""
        if not self.lazy:
            return []  # eager devices have no barriers
        return [self.stage(g.shard, g.compute_dtype) for g in groups if not g.is_unsharded()]


def land_gradients(offloads: Iterable[HostOffload], sync: Callable[[], None]) -> None:
    """End of the root's backward: every gradient shard of these units reaches its host ``grad``.
    Lazy devices run the step (``sync``, once) and read all waiting shards in one transfer."""
    offloads = [o for o in offloads if o.waiting]
    lazy = [o for o in offloads if o.lazy and o._waiting]
    values: dict = {}
    if lazy:
        import torch_xla

        sync()
        device = [r for o in lazy for _, r, _ in o._waiting]
        host = torch_xla._XLAC._xla_get_cpu_tensors(device)
        position = 0
        for o in lazy:
            values[id(o)] = host[position:position + len(o._waiting)]
            position += len(o._waiting)
    for o in offloads:
        o.land(values.get(id(o)))


@contextlib.contextmanager
def shards_held_back(groups: List[Any], offload: Optional[HostOffload], own_places: List[Tuple[nn.Module, str]]
                     ) -> Iterator[None]:
    """Inside, ``nn.Module._apply`` (``to``, ``cuda``, ``float``...) skips fully_shard's registered
    ShardParams (``_apply`` would replace each with a Parameter of what the function gives it) and an
    offloading unit's own shards: they stay host tensors of their dtype (the slots keep their order:
    state-dict and optimizer order follow it). ``own_places``: (module, name) of the shards the unit
    registered as its own; in place, each original parameter's places hold them."""
    places = [(m, attr) for g in groups if g.in_place for r in g.refs for m, attr in r.slots]
    places += list(own_places) if offload is not None else []
    held = [(m, attr, m._parameters[attr]) for m, attr in places if m._parameters.get(attr) is not None]
    for m, attr, _ in held:
        m._parameters[attr] = None  # _apply skips empty slots
    try:
        yield
    finally:
        for m, attr, shard in held:
            m._parameters[attr] = shard
