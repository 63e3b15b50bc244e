"""The order in which a root's units run forward, which prefetching follows."""
from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional

import torch

from . import freeing
from .gradient_usage import GradientPlan

#: a unit's runtime (``runtime.UnitRuntime``; not imported: the runtime imports this module)
Unit = Any


class TrainingState(enum.Enum):
    """Where a unit is in its step. The unit branches on it: forward and ``summon_full_params`` refuse
    a unit that is not IDLE, a unit's later pre-backward hooks pass once it is BACKWARD_PRE, and
    backward prefetches skip units whose backward began (``StepState.backward_began``)."""
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD_PRE = "backward_pre"
    BACKWARD_POST = "backward_post"


class Schedule:
    """The order in which the units under one root ran forward, for prefetching. Backward runs
    them in reverse, so a unit prefetches its forward successor in forward and its predecessor in
    backward. Every rank records the same order, so their collectives still pair up."""

    def __init__(self) -> None:
        self.recording: List[Unit] = []
        self._position: Dict[int, int] = {}
        self._order: List[Unit] = []
        # ZeRO-3 units free their parameters when the next unit starts forward, not when they end
        # theirs: on eager transports the unit that ends forward last is the first in backward
        # and keeps them (one all-gather fewer, at no cost to the peak).
        self.deferred: Optional[Unit] = None
        self.kept: Optional[Unit] = None
        #: units gathered this forward by another's FSDP2 prefetch list (freed at its end if unused)
        self.prefetched: List[Unit] = []
        #: which groups get gradients in this step, agreed by the ranks (usage.GradientPlan)
        self.plan: Optional[GradientPlan] = None
        #: the autograd graph task of the root's backward (a nested one is a reentrant checkpoint's)
        self.backward_task: Optional[int] = None

    def ran_forward(self, unit: Unit) -> bool:
        """Whether ``unit`` ran in the last forward."""
        return id(unit) in self._position

    def defer_reshard(self, unit: Unit) -> None:
        """``unit`` has ended forward; free the one before it, whose successor has now run."""
        if self.deferred is unit:  # the same unit ran twice in a row: it stays gathered
            return
        self.release_deferred()
        self.deferred = unit

    def release_deferred(self) -> None:
        unit, self.deferred = self.deferred, None
        if unit is not None:
            unit.reshard_for_backward()

    def release_kept(self) -> None:
        """A new forward starts: a unit kept for a backward that never ran is freed now."""
        unit, self.kept = self.kept, None
        if unit is not None:
            unit.reshard()

    def end_forward(self, units: List[Unit], keep_last: bool) -> None:
        """The root's forward has returned: what was recorded becomes the order. ``keep_last``:
        the last unit keeps its parameters for backward; False where one compiled program runs
        the step (XLA), which gathers them again right before their use: kept, they stayed live
        from forward to backward, one unit's full parameters more at the peak (ResNet-18 on 4
        XLA:CPU devices: 87 MiB of buffers per device instead of 78)."""
        self._order, self.recording = self.recording, []
        if keep_last:
            self.kept, self.deferred = self.deferred, None
        else:
            self.release_deferred()
        self._position = {}
        for index, unit in enumerate(self._order):
            self._position.setdefault(id(unit), index)
        for unit in units:  # gathers started for units that did not run after all
            if unit.unshard_pending:
                unit.finish_unshard()
                if freeing.after_unused_gather(unit.freeing, torch.is_grad_enabled()):
                    unit.reshard()
        prefetched, self.prefetched = self.prefetched, []
        for unit in prefetched:  # gathered by a prefetch list after their forward, or without one
            if unit is self.kept or not any(g.is_unsharded() for g in unit.groups):
                continue
            unit.free_after_forward(freeing.after_listed_prefetch(unit.freeing, torch.is_grad_enabled(),
                                                                  self.ran_forward(unit)))

    def neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        index = self._position.get(id(unit))
        if index is None or not 0 <= index + step < len(self._order):
            return None
        return self._order[index + step]
