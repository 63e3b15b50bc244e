"""A gather group's values as the program sees them: every member's full data gathered into tensors of
their own (``summon_full_params``, ``full_tensor()``) and written back into the shard, the values
construction left to take (rank 0's with ``sync_module_states``; the program's init after ``to_empty``;
a load after ``storage_only``), the fingerprint of what each rank built, which the root compares across
ranks, and the program's own changes to the module's places (an in-place edit in forward, a tensor
assigned). The group itself (``gather_group.py``) holds the storage and moves it through a step."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..sharding import flatten_and_pad, pad_dim0, shard_of, unflatten, unpad_dim0
from . import freeing
from .gather_group import GatherGroup, ShardedState
from .member_slots import fingerprint, module_tensor


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
    """Make the shard rank 0's block where construction deferred it (see ``adoption.build_group``); a shard
    written since (a checkpoint loaded) keeps what was written."""
    if group.initial.rank_0_takes is None:
        return
    takes, group.initial.rank_0_takes = group.initial.rank_0_takes, None
    values = [take() for take in takes]  # every rank reads its round, whatever it keeps
    if group.shard._version != group.initial.version:
        return
    write_back(group, values)
    group.initial.fingerprint = fingerprint(values)
    group.initial.version = group.shard._version


def begin_late_init(group: GatherGroup, device: torch.device) -> None:
    """``to_empty`` after sharding (FSDP2's meta-init order): every place that refers to a member
    gets a full-size uninitialized Parameter on ``device`` (the unit's device, or the host with
    ``CPUOffloadPolicy``: the init then draws from the CPU generator, as unsharded), for the
    program's own init (``reset_parameters``, ``init_weights``) to fill; :func:`finish_late_init`
    shards it."""
    shapes = [group.full_shape] if not group.flat else group.layout.shapes
    group.set_module_values([nn.Parameter(torch.empty(shape, dtype=group.shard.dtype, device=device),
                                         requires_grad=group.shard.requires_grad) for shape in shapes])
    group.initial.late_init_version = group.shard._version


def in_late_init(group: GatherGroup) -> bool:
    """Between ``to_empty`` and :func:`finish_late_init`: the module holds full-size parameters
    of its own for the program's init."""
    return group.initial.late_init_version is not None


def finish_late_init(group: GatherGroup) -> None:
    """Make the shard this rank's block of what the program's init left in the module (not if
    a checkpoint was loaded into the shard since), and fingerprint it for the ranks' check."""
    version, group.initial.late_init_version = group.initial.late_init_version, None
    if version is None:
        return
    if group.shard._version == version:
        values = module_values(group)
        write_back(group, values)
        group.initial.fingerprint = fingerprint(values).to(group.comms.device)
        group.initial.version = group.shard._version
        group.initial.storage_only = False  # the program's init gave the values
    freeing.after_write_back(group)
    group.install()


def awaiting_values(group: GatherGroup) -> bool:
    """Given storage only at construction, and nothing written into the shard since."""
    return group.initial.storage_only and group.shard._version == group.initial.version


def current_fingerprint(group: GatherGroup) -> Optional[torch.Tensor]:
    """The construction fingerprint, or None if the shard was written since (a checkpoint loaded
    before the first forward: the values the ranks built no longer matter)."""
    return group.initial.fingerprint if group.shard._version == group.initial.version else None


def write_back(group: GatherGroup, values: List[torch.Tensor]) -> None:
    """Make this rank's shard the block of ``values`` (every member's full data) it owns."""
    with torch.no_grad():
        if group.dim0:
            padded = pad_dim0(values[0].detach(), group.layout)
        else:
            padded = flatten_and_pad([v.detach().reshape(s) for v, s in zip(values, group.layout.shapes)],
                                     group.layout)
        block = shard_of(padded, group.comms.rank, group.comms.world_size)
        group.shard.copy_(block.reshape(group.shard.shape).to(group.shard.device, group.shard.dtype))


def module_values(group: GatherGroup) -> List[torch.Tensor]:
    """What the module's first place of each member holds now (a program may have assigned a
    new tensor or Parameter there)."""
    return [module_tensor(*ref.slots[0]) for ref in group.refs]


def installed_versions(group: GatherGroup) -> List[int]:
    """The version counters of what the module holds now (each member, or the flat buffer its
    views share), to tell an in-place edit in forward."""
    return [v._version if isinstance(v, torch.Tensor) else -1 for v in group.slot_values]


def keep_edits(group: GatherGroup, versions: List[int]) -> bool:
    """A module that changed its own full parameters in place during forward (a clamp under
    ``no_grad``, ``nn.Embedding(max_norm=...)``'s renorm) changed them for good in unsharded
    training: its edit becomes this rank's shard, as ``summon_full_params`` writes back."""
    now = installed_versions(group)
    if group.state is not ShardedState.UNSHARDED or now == versions:
        return False
    if not group.comms.takes_in_place_edits:
        edited = [ref for ref, a, b in zip(group.refs, versions, now) if a != b] if group.flat else group.refs
        name = edited[0].fqn if edited else group.refs[0].fqn
        raise RuntimeError(
            f"xla_fsdp: '{name}' was changed in place during forward (a clamp_ or other in-place op "
            f"under torch.no_grad(), a renorm): on {group.comms.name} a unit's gathered parameters cannot "
            "keep an in-place edit, and this step would compute with other values than unsharded. Edit "
            "the weights outside forward (after optimizer.step(), inside "
            "`with XlaFullyShardedDataParallel.summon_full_params(model, writeback=True):`), or compute "
            "with an edited copy "
            "(`F.linear(x, self.fc.weight.clamp(-1, 1), self.fc.bias)`); docs/usage.md, exactness rules")
    write_back(group, module_values(group))
    return True


def reassigned_slot(group: GatherGroup) -> Optional[Tuple[str, torch.Tensor]]:
    """(name in the unit, value) of a member's attribute the program gave a tensor of its own since
    the last install (``module.weight = other.weight``, as ``tie_weights()`` does), if any: the
    next install would silently put the unit's own back."""
    for ref, installed in zip(group.refs, group.slot_values):
        for (module, attr), name in zip(ref.slots, [ref.fqn, *ref.aliases]):
            value = module_tensor(module, attr)
            if value is installed or value is group.shard or not isinstance(value, torch.Tensor):
                continue  # (a plain tensor there may be another member's FreedParameter)
            return name, value
    return None
