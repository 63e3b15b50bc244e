"""The order in which a root's units run forward, which prefetching follows."""
from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional

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
    backward. Every rank records the same order, so their collectives still pair up. (What is freed
    when is ``freeing.py``'s; the rest of a step's state is the root's ``RootContext``.)"""

    def __init__(self) -> None:
        self.recording: List[Unit] = []
        self._position: Dict[int, int] = {}
        self._order: List[Unit] = []

    def start(self) -> None:
        """The root's forward begins: record anew."""
        self.recording = []

    def record(self, unit: Unit) -> None:
        self.recording.append(unit)

    def end_forward(self) -> None:
        """The root's forward has returned: what was recorded becomes the order."""
        self._order, self.recording = self.recording, []
        self._position = {}
        for index, unit in enumerate(self._order):
            self._position.setdefault(id(unit), index)

    def ran_forward(self, unit: Unit) -> bool:
        """Whether ``unit`` ran in the last forward."""
        return id(unit) in self._position

    def neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        index = self._position.get(id(unit))
        if index is None or not 0 <= index + step < len(self._order):
            return None
        return self._order[index + step]
