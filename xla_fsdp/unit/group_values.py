"""A gather group's values outside a step: every member's full data gathered into tensors of their
own (``summon_full_params``, ``full_tensor()``), the values construction left to take (rank 0's with
``sync_module_states``; the program's init after ``to_empty``), and the fingerprint of what each rank
built, which the root compares across ranks. The group itself (``gather_group.py``) holds the storage
and moves it through a step."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn

from ..sharding import unflatten, unpad_dim0
from .gather_group import GatherGroup
from .member_slots import fingerprint


def gather_values(group: GatherGroup) -> List[torch.Tensor]:
    """Every member's full data in the shard's dtype, in tensors of their own (not ``full``):
    a collective, which every rank of the group must call."""
    source = group.shard.detach()
    if group.offload is not None:
        source = group.offload.to_device(source, group.shard.dtype)
    padded = group.comms.all_gather(source.reshape(group.layout.shard_shape if group.dim0 else (-1,)),
                                   group.channel_forward)
    if group.dim0:
        return [unpad_dim0(padded.reshape(group.padded_shape), group.layout).clone()]
    return [t.clone() for t in unflatten(padded.reshape(-1), group.layout)]


def take_rank_0_values(group: GatherGroup) -> None:
    """Make the shard rank 0's block where construction deferred it (see ``GatherGroup.__init__``); a shard
    written since (a checkpoint loaded) keeps what was written."""
    if group.rank_0_takes is None:
        return
    takes, group.rank_0_takes = group.rank_0_takes, None
    values = [take() for take in takes]  # every rank reads its round, whatever it keeps
    if group.shard._version != group.fingerprint_version:
        return
    group.write_back(values)
    group.init_fingerprint = fingerprint(values)
    group.fingerprint_version = group.shard._version


def begin_late_init(group: GatherGroup, device: torch.device) -> None:
    """``to_empty`` after sharding (FSDP2's meta-init order): every place that refers to a member
    gets a full-size uninitialized Parameter on ``device`` (the unit's device, or the host with
    ``CPUOffloadPolicy``: the init then draws from the CPU generator, as unsharded), for the
    program's own init (``reset_parameters``, ``init_weights``) to fill; :func:`finish_late_init`
    shards it."""
    shapes = [group.full_shape] if not group.flat else group.layout.shapes
    group.set_module_values([nn.Parameter(torch.empty(shape, dtype=group.shard.dtype, device=device),
                                         requires_grad=group.shard.requires_grad) for shape in shapes])
    group.late_init_version = group.shard._version


def in_late_init(group: GatherGroup) -> bool:
    """Between ``to_empty`` and :func:`finish_late_init`: the module holds full-size parameters
    of its own for the program's init."""
    return group.late_init_version is not None


def finish_late_init(group: GatherGroup) -> None:
    """Make the shard this rank's block of what the program's init left in the module (not if
    a checkpoint was loaded into the shard since), and fingerprint it for the ranks' check."""
    version, group.late_init_version = group.late_init_version, None
    if version is None:
        return
    if group.shard._version == version:
        values = group.module_values()
        group.write_back(values)
        group.init_fingerprint = fingerprint(values).to(group.comms.device)
        group.fingerprint_version = group.shard._version
    group.reshard()  # a full copy kept gathered (ZeRO-2, the root) is stale now
    group.install()


def awaiting_values(group: GatherGroup) -> bool:
    """Given storage only at construction, and nothing written into the shard since."""
    return group.awaiting_values and group.shard._version == group.fingerprint_version


def current_fingerprint(group: GatherGroup) -> Optional[torch.Tensor]:
    """The construction fingerprint, or None if the shard was written since (a checkpoint loaded
    before the first forward: the values the ranks built no longer matter)."""
    return group.init_fingerprint if group.shard._version == group.fingerprint_version else None
