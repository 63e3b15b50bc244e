"""Where a unit is in the current training step (``StepState``, one per unit), and what the units
under one root share (``RootContext``, one per root): FSDP2 keeps the same apart from its module, in
``FSDPState`` and its root's state context. A unit's runtime (``runtime.py``) holds both; its
settings and gather groups live there too. Nothing here outlives a step's logic."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from .coalesce import ReduceInFlight
from .gather_group import GatherGroup
from .gradient_usage import GradientPlan
from .schedule import Schedule, TrainingState


@dataclass(eq=False)
class StepState:
    """One unit's per-step state."""

    #: IDLE / FORWARD / BACKWARD_PRE / BACKWARD_POST (``unit.training_state``, torch_xla's name)
    training_state: TrainingState = TrainingState.IDLE
    #: whether this unit is the root: None until its first forward decides
    is_root: Optional[bool] = None
    #: False inside ``no_sync()``: gradients accumulate unreduced
    require_backward_grad_sync: bool = True
    #: full gradients that are ready, waiting for the unit's other groups to reduce together
    pending_grads: List[Tuple[GatherGroup, torch.Tensor]] = field(default_factory=list)
    #: a started gather (a prefetch) to wait for
    unshard_in_flight: Optional[Callable[[], None]] = None

    @property
    def backward_began(self) -> bool:
        """Whether this step's backward reached the unit (its parameters were gathered for it)."""
        return self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)


@dataclass(eq=False)
class RootContext:
    """What the units under one root share: made by the root at its first forward and handed to
    every unit under it (one object, not copies kept in step)."""

    #: the root's units (runtimes), itself first, in module order
    units: List[Any] = field(default_factory=list)
    #: each unit's original-name prefix ("" for the root), for messages that name a parameter
    prefixes: List[str] = field(default_factory=list)
    #: reduce-scatters started but not yet waited for, finished in the order they started on every rank
    reduces_in_flight: List[ReduceInFlight] = field(default_factory=list)
    #: the order the root's units ran forward, which prefetching follows
    schedule: Schedule = field(default_factory=Schedule)
    #: the unit freed when the next one starts forward, and the one that ended forward last, kept
    #: gathered for backward (``freeing.py`` hands them on)
    free_when_next_starts: Optional[Any] = None
    kept_for_backward: Optional[Any] = None
    #: units gathered this forward by another's FSDP2 prefetch list (freed at its end if unused)
    prefetched: List[Any] = field(default_factory=list)
    #: which groups get gradients in this step, agreed by the ranks (``gradient_usage.GradientPlan``)
    plan: Optional[GradientPlan] = None
    #: the autograd graph task of the root's backward (a nested one is a reentrant checkpoint's)
    backward_task: Optional[int] = None
    #: the root's gather groups that train, and whether each forward plans which get gradients
    trainable_groups: List[GatherGroup] = field(default_factory=list)
    plans_gradients: bool = False
