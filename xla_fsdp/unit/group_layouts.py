"""How a gather group's members lie in the buffer its ranks gather: one class per layout, each owning
what differs between them, so the group (``gather_group.py``) holds storage and states and never asks
which layout it has.

- :class:`PerParameter`: one parameter, flattened and padded to a multiple of the ranks (torch_xla's
  ``flatten_parameters=False``, the wrapper's default);
- :class:`Flat`: several parameters flattened into one padded buffer (``flatten_parameters=True``), the
  module given views of it (``member_slots.FlatMembers``);
- :class:`DimZero`: one parameter split by rows (``shard_param_on_dim_0``, ``fully_shard``'s), whose
  rows can also be cut for a smaller group of ranks (FSDP2's int ``reshard_after_forward``).

Each says: its members (a flat group's views, and where the program's gradient hooks go), the padded
buffer's shape and the full parameter's (``padded_shape``, ``full_shape``), the members' shapes, the
gathered buffer as the full parameter (``unpad``), a full gradient as the buffer to reduce
(``pad_grad``), a rank's rows for a smaller group (``cut``), what the module's places get when gathered
(``gathered_values``), and a group's values between the padded buffer and its members (``split``,
``padded_of``). The index math itself is ``sharding.py``'s.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

from ..sharding import Dim0Layout, FlatLayout, flatten_and_pad, pad_dim0, unflatten, unpad_dim0
from .member_slots import FlatMembers

Shape = Tuple[int, ...]


class PerParameter:
    """One parameter, flattened and padded: rank ``r`` holds elements ``r*n .. r*n+n-1``."""

    flat = False
    dim0 = False

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        self.padded_shape: Shape = (layout.padded_numel,)
        self.full_shape: Shape = tuple(layout.shapes[0])
        #: the shape of each member's place in the module
        self.member_shapes: List[Shape] = [tuple(s) for s in layout.shapes]
        #: the shard's shape for an all-gather of values (``gather_group.gather_values``)
        self.gather_shape: Shape = (-1,)

    def members(self, comms: Any, hooks: List[List[Any]], full: torch.Tensor) -> Optional[FlatMembers]:
        """A flat group's members; one parameter has none: the program's gradient hooks on the original
        (``hooks[0]``) go on ``full``, the parameter the module computes with."""
        for hook in hooks[0]:
            full.register_hook(hook)
        return None

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """A gathered padded buffer as the full parameter; no slice op where there is no padding."""
        if self.layout.padding == 0:
            return padded.view(self.full_shape)
        return padded[:self.layout.numel].view(self.full_shape)

    def pad_grad(self, grad: torch.Tensor, may_view: bool) -> torch.Tensor:
        """The full gradient as the padded buffer to reduce-scatter (the unit owns it: it may be
        divided in place). ``may_view``: a view of ``grad`` may be returned (see below)."""
        if self.layout.padding == 0:  # nothing to pad (one rank, or sizes that divide evenly)
            if tuple(grad.shape) == self.padded_shape:
                return grad
            padded = grad.reshape(self.padded_shape)
            # Eager: a view, no copy. Lazy (XLA): at one rank the shard gradient would be that view, and a live
            # view keeps its base live, so both would be outputs of the step graph (one more full-size write per
            # parameter); a lazy clone costs nothing, and the base is dropped.
            return padded if may_view else padded.clone()
        return self._pad(grad)

    def _pad(self, grad: torch.Tensor) -> torch.Tensor:
        return flatten_and_pad([grad], self.layout)

    def cut(self, full: torch.Tensor, ranks: Any) -> Optional[torch.Tensor]:
        """This rank's rows of the gathered parameter within ``ranks``: only a row layout has them."""
        return None

    def gathered_values(self, group: Any, refill_saved: bool) -> List[Optional[torch.Tensor]]:
        """What each member's places get while the group is gathered: the full parameter itself."""
        return [group.full]

    def split(self, padded: torch.Tensor) -> List[torch.Tensor]:
        """Each member's values, in tensors of their own, from the whole padded buffer."""
        return [t.clone() for t in unflatten(padded.reshape(-1), self.layout)]

    def padded_of(self, values: List[torch.Tensor]) -> torch.Tensor:
        """The padded buffer of the members' ``values`` (each of its member's shape, or reshapable to it)."""
        return flatten_and_pad([v.detach().reshape(s) for v, s in zip(values, self.layout.shapes)], self.layout)


class Flat(PerParameter):
    """Several parameters in one flattened, padded buffer; the module is given views of its members."""

    flat = True

    def __init__(self, layout: FlatLayout) -> None:
        super().__init__(layout)
        self.full_shape = self.padded_shape  # the full parameter is the whole buffer

    def members(self, comms: Any, hooks: List[List[Any]], full: torch.Tensor) -> Optional[FlatMembers]:
        return FlatMembers(self.layout, comms, hooks)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded

    def _pad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad  # the gradient of the whole buffer, padding included

    def gathered_values(self, group: Any, refill_saved: bool) -> List[Optional[torch.Tensor]]:
        return group.members.cut(group.full, group, refill_saved)


class DimZero(PerParameter):
    """One parameter split by rows (dim 0), padded with zero rows to a multiple of the ranks."""

    dim0 = True

    def __init__(self, layout: Dim0Layout) -> None:  # (not PerParameter's: another layout)
        self.layout = layout  # type: ignore[assignment]
        self.padded_shape = (layout.padded_rows,) + tuple(layout.row_shape)
        self.full_shape = tuple(layout.shape)
        self.member_shapes = [self.full_shape]
        self.gather_shape = tuple(layout.shard_shape)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if layout.padded_rows == layout.rows and tuple(padded.shape) == self.full_shape:
            return padded  # (in SPMD the full parameter is then the annotated shard itself)
        return padded[:layout.rows].view(self.full_shape)

    def _pad(self, grad: torch.Tensor) -> torch.Tensor:
        return pad_dim0(grad, self.layout)

    def cut(self, full: torch.Tensor, ranks: Any) -> Optional[torch.Tensor]:
        padded = pad_dim0(full.detach(), self.layout)
        return padded.view(ranks.world_size, -1, *self.layout.row_shape)[ranks.rank].clone()

    def split(self, padded: torch.Tensor) -> List[torch.Tensor]:
        return [unpad_dim0(padded.reshape(self.padded_shape), self.layout).clone()]

    def padded_of(self, values: List[torch.Tensor]) -> torch.Tensor:
        return pad_dim0(values[0].detach(), self.layout)


GroupLayout = Union[PerParameter, Flat, DimZero]


def layout_of(layout: Union[FlatLayout, Dim0Layout], flat: bool) -> GroupLayout:
    """The group layout for the index math ``layout`` (a flat group's or one parameter's)."""
    if isinstance(layout, Dim0Layout):
        return DimZero(layout)
    return Flat(layout) if flat else PerParameter(layout)
