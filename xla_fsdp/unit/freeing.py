"""When a unit frees its gathered parameters (FSDP2's "reshard"): every rule in one place.

A unit's :class:`FreeingPolicy` is frozen and made here only: from the settings at construction
(:func:`policy`), and replaced, never edited, by the root rule (once, at the root's first forward:
:func:`effective`) and by the setters (:func:`with_after_forward` and the others), so what a unit shows
is what it does. The unit's forward and backward ask the functions below what to do at each point of
a step, and do what they answer; the hand-offs between units of one root (a unit freed when the next
starts, the last one kept for backward, what a prefetch list gathered) are the root context's
(``root_context.RootContext``), which asks the same rules.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class FreeingPolicy:
    """What a unit keeps gathered, and for how long."""

    #: free the full parameters after forward and gather them again in backward (ZeRO-3); False: keep
    #: them from forward to backward (ZeRO-2)
    after_forward: bool
    #: the root keeps its parameters after forward whatever ``after_forward`` says, since its backward
    #: comes first (torch_xla's ``disable_reshard_on_root``; FSDP2's rule for an unset value)
    keep_on_root: bool = False
    #: free them after backward (False: FSDP2's ``set_reshard_after_backward(False)``, which saves the
    #: next micro-batch's gathers)
    after_backward: bool = True
    #: FSDP2's int ``reshard_after_forward``: the smaller group of ranks within which each rank keeps
    #: its rows of the gathered parameters after forward, for backward to gather from (a Collectives)
    pieces_within: Optional[Any] = None


def policy(reshard_after_forward: bool, disable_reshard_on_root: bool) -> FreeingPolicy:
    """A unit's policy from its settings (torch_xla's keywords)."""
    return FreeingPolicy(after_forward=reshard_after_forward, keep_on_root=disable_reshard_on_root)


def with_after_forward(policy: FreeingPolicy, value: bool, explicit: bool = False) -> FreeingPolicy:
    """torch_xla's ``reshard_after_forward`` attribute set; ``explicit`` (FSDP2's
    ``set_reshard_after_forward``): the value holds for the root too, and frees to every rank."""
    if explicit:
        return dataclasses.replace(policy, after_forward=value, keep_on_root=False, pieces_within=None)
    return dataclasses.replace(policy, after_forward=value)


def with_keep_on_root(policy: FreeingPolicy, value: bool) -> FreeingPolicy:
    """torch_xla's ``disable_reshard_on_root`` attribute set."""
    return dataclasses.replace(policy, keep_on_root=value)


def with_after_backward(policy: FreeingPolicy, value: bool) -> FreeingPolicy:
    """FSDP2's ``set_reshard_after_backward``."""
    return dataclasses.replace(policy, after_backward=value)


def with_pieces_within(policy: FreeingPolicy, ranks: Any) -> FreeingPolicy:
    """FSDP2's int ``reshard_after_forward``: pieces kept within ``ranks`` (a Collectives)."""
    return dataclasses.replace(policy, pieces_within=ranks)


def effective(policy: FreeingPolicy, is_root: bool) -> FreeingPolicy:
    """A unit's policy once its place is known (the root's first forward decides it for every unit
    under the root): the root rule applied, so ``keep_on_root`` is False from then on."""
    if is_root and policy.keep_on_root:
        return dataclasses.replace(policy, after_forward=False, keep_on_root=False)
    return dataclasses.replace(policy, keep_on_root=False)


class AfterForward(enum.Enum):
    """What a unit does with its gathered parameters when its forward ends."""
    KEEP = "keep"                  # kept for backward (ZeRO-2, the root)
    FREE = "free"                  # freed: no backward follows (grad mode off)
    FREE_FOR_BACKWARD = "free_for_backward"  # freed now; kept pieces (``pieces_within``) stay for backward
    FREE_WHEN_NEXT_STARTS = "free_when_next_starts"  # freed when the next unit starts forward (schedule)


def after_forward(policy: FreeingPolicy, grad_enabled: bool, is_root: bool) -> AfterForward:
    """At the end of a unit's forward (not a recompute inside backward, which keeps them). A unit
    other than the root is freed when the next one starts: on eager transports the unit that ends
    forward last is the first in backward and keeps its parameters (see ``Schedule.end_forward``)."""
    if not grad_enabled:
        return AfterForward.FREE
    if not policy.after_forward:
        return AfterForward.KEEP
    return AfterForward.FREE_FOR_BACKWARD if is_root else AfterForward.FREE_WHEN_NEXT_STARTS


def cuts_pieces(policy: FreeingPolicy, grad_enabled: bool) -> bool:
    """Whether forward's end cuts the pieces kept for backward (with the outputs, behind one barrier)."""
    return policy.pieces_within is not None and policy.after_forward and grad_enabled


def after_unused_gather(policy: FreeingPolicy, grad_enabled: bool) -> bool:
    """A gather started for a unit (a prefetch) that did not run this forward: whether to free it."""
    return policy.after_forward or not grad_enabled


def after_listed_prefetch(policy: FreeingPolicy, grad_enabled: bool, ran_forward: bool) -> AfterForward:
    """A unit gathered by another's FSDP2 prefetch list, at the end of the root's forward."""
    if not grad_enabled or not ran_forward:
        return AfterForward.FREE
    return AfterForward.FREE_FOR_BACKWARD if policy.after_forward else AfterForward.KEEP


def after_gradient(policy: FreeingPolicy) -> bool:
    """A gather group's gradient has been taken for reduction: whether to free its full parameter."""
    return policy.after_backward


def at_backward_end(policy: FreeingPolicy, reduces_gradients: bool) -> bool:
    """The root's backward has ended: whether to free what is still gathered. Under ``no_sync`` a
    ZeRO-2 unit keeps its parameters for the next micro-batch."""
    return policy.after_backward and (reduces_gradients or policy.after_forward)


# ---------------------------------------------------------------- outside a step, and between a root's units
def after_write_back(group: Any) -> None:
    """The shard was written outside a step (``summon_full_params(writeback=True)``, the program's init
    after ``to_empty``): a full copy kept gathered (ZeRO-2, the root, ``after_backward=False``) holds the
    old values and is freed; the next forward gathers the new ones."""
    group.reshard()


def keeps_last_unit(compiles_step: bool) -> bool:
    """Whether the unit that ends forward last keeps its parameters for backward, which starts with it
    (one all-gather fewer, at no cost to the peak). Not where one compiled program runs the step (XLA),
    which gathers them again right before their use: kept, they stayed live from forward to backward,
    one unit's full parameters more at the peak (ResNet-18 on 4 XLA:CPU devices: 87 MiB of buffers per
    device instead of 78)."""
    return not compiles_step
