"""What every layer may know about a unit without importing the wrapper (imports run one way: the
public wrapper imports the layers below it, never the reverse). As PyTorch's FSDP2 keeps its state
apart from ``fully_shard``, "is this module a unit?", unit walks and what the schedule, the gradient
code and the checkpoint code may use of a unit are declared here; the wrapper implements them.
``test/test_structure.py`` checks that no other module reads a unit's private attributes as
``unit._name``; one reaches it by a string (``remat``'s recompute hook), listed in CONTRIBUTING.md."""
from __future__ import annotations

import abc
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from ..collectives.base import Collectives
    from .gather_group import GatherGroup


class ShardedUnit(nn.Module, metaclass=abc.ABCMeta):
    """Base of :class:`~xla_fsdp.XlaFullyShardedDataParallel`: a module whose parameters xla_fsdp
    shards. The attributes and methods below are the interface the other layers use; a class that
    leaves a method out cannot be instantiated."""

    #: the collectives of the unit's shard group (and replica groups)
    comms: "Collectives"
    #: this rank's position in the unit's shard group, and the group's size
    rank: int
    world_size: int
    #: whether forward frees the full parameters (ZeRO-3) or keeps them for backward (ZeRO-2)
    reshard_after_forward: bool
    #: when the unit frees its gathered parameters (``unit/freeing.py``'s ``FreeingPolicy``: the one
    #: place the rules live; replaced, never edited)
    freeing: Any
    #: whether each parameter is split by rows (dim 0) instead of flattened
    shard_param_on_dim_0: bool
    #: the unit's gather groups: what one all-gather fetches (one parameter, or a flat group of them)
    gather_groups: List["GatherGroup"]
    #: parameter slots of the wrapped module left to an enclosing unit (a parameter tied across units)
    tied_slots_left: List[Any]
    #: where the unit is in the current step (``runtime.StepState``: training state, root, ...)
    step_state: Any
    #: the parameter attributes of every module the unit owns, in registration order, as built
    param_attrs: Dict[nn.Module, Tuple[str, ...]]

    @property
    @abc.abstractmethod
    def shard_size_multiple(self) -> int:
        """Flat shards are padded to a multiple of this many elements per rank."""

    @property
    @abc.abstractmethod
    def unshard_pending(self) -> bool:
        """Whether a gather was started (a prefetch) and not yet waited for."""

    @abc.abstractmethod
    def finish_unshard(self) -> None:
        """Wait for a started gather."""

    @abc.abstractmethod
    def take_deferred_values(self) -> None:
        """Take the values left since construction: the program's init after ``to_empty``, rank 0's
        parameters and buffers (``sync_module_states``)."""

    @abc.abstractmethod
    def reshard(self) -> None:
        """Free the full parameters; the shards stay."""

    @abc.abstractmethod
    def named_gather_groups(self) -> List[Tuple[str, "GatherGroup"]]:
        """(the shard parameter's name in the unit's state dict, its gather group)."""

    @abc.abstractmethod
    def gather_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated on dim 0 in rank order (control collectives outside a step)."""

    @abc.abstractmethod
    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over this rank's replicas (hybrid strategies)."""

    @abc.abstractmethod
    def gather_norms(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's one-element gradient-norm term, in rank order."""


#: where ``fully_shard`` keeps a module's unit: a plain attribute of the module, outside its module tree
#: (so names, ``state_dict()`` keys and ``modules()`` stay the program's own, as in FSDP2)
UNIT_ATTR = "_xla_fsdp_unit"


def unit_of(module: nn.Module) -> Optional[ShardedUnit]:
    """The unit ``module`` is (a wrapper) or holds (a module ``fully_shard`` converted), else None."""
    if isinstance(module, ShardedUnit):
        return module
    return module.__dict__.get(UNIT_ATTR)


def root_unit(model: nn.Module) -> nn.Module:
    """The unit to act on for ``model``: a module ``fully_shard`` converted stands for its unit."""
    unit = unit_of(model)
    return unit if unit is not None else model


F = TypeVar("F", bound=Callable[..., Any])


def takes_root_unit(fn: F) -> F:
    """A function of a model (checkpoints) called with a converted module gets its unit."""
    @functools.wraps(fn)
    def call(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return fn(root_unit(model), *args, **kwargs)
    return call  # type: ignore[return-value]


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is sharded: a unit itself, or a module sharded in place."""
    return unit_of(module) is not None
