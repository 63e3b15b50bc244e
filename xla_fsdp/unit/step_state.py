"""Where a unit is in the current training step, in one object (FSDP2 keeps the same apart from its
module, in ``FSDPState``): what forward, backward, the schedule and ``no_sync`` read and change.
The unit's settings and its gather groups live on the unit; nothing here outlives a step's logic."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from .coalesce import ReduceInFlight
from .gather_group import GatherGroup
from .schedule import Schedule, TrainingState


@dataclass(eq=False)
class StepState:
    """One unit's per-step state. The units under one root share ``schedule`` and
    ``reduces_in_flight`` (the root's, handed out at its first forward)."""

    #: IDLE / FORWARD / BACKWARD_PRE / BACKWARD_POST (``unit.training_state``, torch_xla's name)
    training_state: TrainingState = TrainingState.IDLE
    #: whether this unit is the root: None until its first forward decides
    is_root: Optional[bool] = None
    #: the root's units, itself included (set at the root's first forward)
    units_in_tree: List[Any] = field(default_factory=list)
    #: False inside ``no_sync()``: gradients accumulate unreduced
    require_backward_grad_sync: bool = True
    #: full gradients that are ready, waiting for the unit's other groups to reduce together
    pending_grads: List[Tuple[GatherGroup, torch.Tensor]] = field(default_factory=list)
    #: reduce-scatters started but not yet waited for, finished in the order they started on every rank
    reduces_in_flight: List[ReduceInFlight] = field(default_factory=list)
    #: the order the root's units ran forward, which prefetching and freeing follow
    schedule: Schedule = field(default_factory=Schedule)
    #: a started gather (a prefetch) to wait for
    unshard_in_flight: Optional[Callable[[], None]] = None
    #: the root's gather groups that train, and whether each forward plans which get gradients
    trainable_groups: List[GatherGroup] = field(default_factory=list)
    plans_gradients: bool = False

    @property
    def backward_began(self) -> bool:
        """Whether this step's backward reached the unit (its parameters were gathered for it)."""
        return self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
