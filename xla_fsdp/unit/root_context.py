"""What the units under one root share during a step (FSDP2's root state context): the order they
ran forward, which unit waits to be freed, the reduce-scatters on the wire, the gradient plan and the
root's backward pass. :class:`RootContext` is its only writer: the root's hooks (``step.py``) and the
units' runtimes call its methods, and read its fields. What a unit frees when is the rule of its
freeing policy (``freeing.py``); the hand-offs between units that the rule needs are done here."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import freeing


class Schedule:
    """The order in which the units under one root ran forward, for prefetching. Backward runs
    them in reverse, so a unit prefetches its forward successor in forward and its predecessor in
    backward. Every rank records the same order, so their collectives still pair up."""

    def __init__(self) -> None:
        self.recording: List[Any] = []
        self._position: Dict[int, int] = {}
        self._order: List[Any] = []

    def start(self) -> None:
        """The root's forward begins: record anew."""
        self.recording = []

    def record(self, unit: Any) -> None:
        self.recording.append(unit)

    def end_forward(self) -> None:
        """The root's forward has returned: what was recorded becomes the order."""
        self._order, self.recording = self.recording, []
        self._position = {}
        for index, unit in enumerate(self._order):
            self._position.setdefault(id(unit), index)

    def ran_forward(self, unit: Any) -> bool:
        """Whether ``unit`` ran in the last forward."""
        return id(unit) in self._position

    def neighbour(self, unit: Any, step: int) -> Optional[Any]:
        index = self._position.get(id(unit))
        if index is None or not 0 <= index + step < len(self._order):
            return None
        return self._order[index + step]


class RootContext:
    """What the units under one root share: made by the root at its first forward and handed to
    every unit under it (one object, not copies). Its fields are read by the units and written by
    its methods only."""

    def __init__(self, units: Sequence[Any] = (), prefixes: Sequence[str] = ()) -> None:
        #: the root's units (runtimes), itself first, in module order
        self.units: List[Any] = list(units)
        #: each unit's original-name prefix ("" for the root), for messages that name a parameter
        self.prefixes: List[str] = list(prefixes)
        #: the order the root's units ran forward, which prefetching follows
        self.schedule = Schedule()
        #: reduce-scatters started but not yet waited for, finished in the order they started on every rank
        self._reduces_in_flight: List[Any] = []
        #: the unit freed when the next one starts forward, and the one that ended forward last, kept
        #: gathered for backward
        self._waiting: Optional[Any] = None
        self._kept: Optional[Any] = None
        #: units gathered this forward by another's FSDP2 prefetch list (freed at its end if unused)
        self._prefetched: List[Any] = []
        #: which groups get gradients in this step, agreed by the ranks (``gradients.GradientPlan``)
        self.plan: Optional[Any] = None
        #: the autograd graph task of the root's backward (a nested one is a reentrant checkpoint's)
        self.backward_task: Optional[int] = None
        #: the root's gather groups that train, and whether each forward plans which get gradients
        self.trainable_groups: List[Any] = []
        self.plans_gradients = False

    @property
    def kept_for_backward(self) -> Optional[Any]:
        """The unit that ended the last forward, kept gathered for the backward that starts with it."""
        return self._kept

    # ------------------------------------------------------------------ which groups train
    def find_trainable_groups(self, data_parallel: int) -> None:
        """The groups that train, and whether each forward must plan which of them get gradients:
        where ranks could disagree (``data_parallel`` > 1), or a flat shard could be only partly
        used (see gradients.py)."""
        self.trainable_groups = [g for u in self.units for g in u.groups if g.requires_grad]
        self.plans_gradients = bool(self.trainable_groups) and (
            data_parallel > 1 or any(g.flat and len(g.refs) > 1 for g in self.trainable_groups))

    # ------------------------------------------------------------------ forward: who is freed when
    def forward_starts(self) -> None:
        """A new forward of the root: record the order anew; a unit kept for a backward that never
        ran is freed now."""
        self.schedule.start()
        self._prefetched = []
        unit, self._kept = self._kept, None
        if unit is not None:
            unit.reshard()

    def unit_forward_starts(self, unit: Any) -> None:
        """``unit`` starts forward: the unit waiting to be freed when the next one starts is freed (not
        ``unit`` itself, called again: it keeps what its first call gathered)."""
        if self._waiting is not unit:
            self._free_waiting()
        self.schedule.record(unit)

    def free_when_next_starts(self, unit: Any) -> None:
        """``unit`` has ended forward (:attr:`freeing.AfterForward.FREE_WHEN_NEXT_STARTS`): free the
        one before it, whose successor has now run, and let ``unit`` wait for its own."""
        if self._waiting is unit:  # the same unit ran twice in a row: it stays gathered
            return
        self._free_waiting()
        self._waiting = unit

    def gathered_by_prefetch(self, unit: Any) -> None:
        """``unit`` was gathered by another's FSDP2 prefetch list in this forward."""
        self._prefetched.append(unit)

    def forward_ends(self, compiles_step: bool) -> None:
        """The root's forward has returned: the order recorded, the last unit kept or freed, gathers
        started for units that did not run after all finished and freed, and units gathered by a
        prefetch list freed as their policy says."""
        self.schedule.end_forward()
        if freeing.keeps_last_unit(compiles_step):
            self._kept, self._waiting = self._waiting, None
        else:
            self._free_waiting()
        grad_enabled = torch.is_grad_enabled()
        for unit in self.units:
            if unit.unshard_pending:
                unit.finish_unshard()
                if freeing.after_unused_gather(unit.freeing, grad_enabled):
                    unit.reshard()
        prefetched, self._prefetched = self._prefetched, []
        for unit in prefetched:  # gathered by a prefetch list after their forward, or without one
            if unit is self._kept or not any(g.is_unsharded() for g in unit.groups):
                continue
            unit.free_after_forward(freeing.after_listed_prefetch(unit.freeing, grad_enabled,
                                                                  self.schedule.ran_forward(unit)))

    def forward_abandoned(self) -> None:
        """The root's forward raised (every unit was freed): nothing waits or is kept."""
        self.schedule.start()
        self._prefetched = []
        self._waiting = self._kept = None

    def _free_waiting(self) -> None:
        unit, self._waiting = self._waiting, None
        if unit is not None:
            unit.reshard_for_backward()

    # ------------------------------------------------------------------ the gradient plan
    def replace_plan(self, plan: Optional[Any]) -> None:
        """This forward's plan (None: none made); the previous forward's, if it had no backward, is discarded."""
        if self.plan is not None:
            self.plan.discard()
        self.plan = plan

    def take_plan(self) -> Optional[Any]:
        """The end of backward takes this step's plan."""
        plan, self.plan = self.plan, None
        return plan

    # ------------------------------------------------------------------ backward
    def backward_begins(self, finalize: Callable[[], None]) -> None:
        """The root's backward has reached it: note the pass, and run ``finalize`` at its end."""
        self.backward_task = torch._C._current_graph_task_id()
        torch.autograd.Variable._execution_engine.queue_callback(finalize)

    def backward_ends(self) -> None:
        self.backward_task = None

    def reduces_started(self, started: List[Any]) -> None:
        """Reduce-scatters now on the wire (finished by :meth:`finish_reduces`, oldest first)."""
        self._reduces_in_flight.extend(started)

    def finish_reduces(self) -> None:
        """Wait for the started reduce-scatters, oldest first, and accumulate their shard gradients."""
        while self._reduces_in_flight:
            self._reduces_in_flight.pop(0).finish()
