"""How a unit takes its module (the construction step after planning): the parameters no nested
unit owns become sharded gather groups, registered as shards; buffers are cast; rank 0's buffers
are asked for where the ranks take rank 0's values. :func:`adopt` returns what it built."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from . import construction, tied
from .gather_group import GatherGroup
from .offload import HostOffload, shards_held_back
from .options import UnitOptions
from .param_names import SHARD_PREFIX, SHARD_SEPARATOR, WRAPPED, flat_parts
from .runtime import Rank0Buffer
from .settings import UnitSettings


@dataclasses.dataclass
class Adopted:
    """What a unit built from its module."""

    groups: List[GatherGroup]
    #: each group's shard name in the unit's ``state_dict()`` (in place: the original parameter's)
    shard_names: List[str]
    #: parameter slots of the module left to an enclosing unit (a parameter tied across units)
    tied_slots_left: List[Any]
    #: the original dtype of each floating buffer the unit cast (``buffer_info`` of torch_xla's metadata)
    buffer_info: Dict[str, Dict[str, torch.dtype]]
    rank_0_buffers: List[Rank0Buffer]
    #: the parameter attributes of every module the unit owns, in registration order, taken before the
    #: unit removed them (``param_names.names_in_model_order``)
    param_attrs: Dict[nn.Module, Tuple[str, ...]]


def adopt(shell: nn.Module, module: nn.Module, options: UnitOptions, settings: UnitSettings, comms: Any,
          offload: Optional[HostOffload], in_place: bool) -> Adopted:
    """Take the parameters no nested unit owns: materialize meta ones, shard them into groups,
    register the shards (on ``shell``, or ``in_place`` where the originals were), cast buffers,
    move the module to the device."""
    construction.materialize_meta(module, options.param_init_fn, torch.device("cpu"))
    if options._use_xla_patched_linear and comms.name == "xla":
        from .patched_linear import patch_linear_layers
        patch_linear_layers(module)
    param_attrs = construction.param_attrs(module)
    refs, tied_slots_left = construction.collect_params(module, tied.escaping(module), settings.param_storage_dtype)
    groups = _build_groups(refs, settings, comms, offload, in_place)
    names = []
    for group in groups:
        path = f"{WRAPPED}.{group.flat_name if group.flat else group.refs[0].fqn}"
        name = path if in_place else SHARD_PREFIX + path.replace(".", SHARD_SEPARATOR)
        if not in_place:  # (in place: registered where the original was, see GatherGroup)
            shell.register_parameter(name, group.shard)
        group.shard._orig_name = path
        group.shard._name = name
        names.append(name)
    cast = construction.cast_buffers(module, settings.buffer_dtype, "")
    buffer_info = {k: {"_orig_dtype": v} for k, v in cast.items()}
    with shards_held_back(groups, offload, [(shell, n) for g, n in zip(groups, names) if not g.in_place]):
        module.to(comms.device)  # in place, offloaded shards sit in the module and stay on the host
    # Floating buffers this unit owns (integer counters are alike anyway), taken from rank 0 now, or at
    # the first forward where the ranks are threads of one process, as the groups' parameters are.
    rank_0_buffers: List[Rank0Buffer] = []
    if settings.sync_module_states:
        for _, m in construction.owned_modules(module):
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point():
                    rank_0_buffers.append((m, name, b, b._version, comms.start_broadcast_from_rank_0(b)))
    return Adopted(groups, names, tied_slots_left, buffer_info, rank_0_buffers, param_attrs)


def _build_groups(refs: List[Any], settings: UnitSettings, comms: Any, offload: Optional[HostOffload],
                  in_place: bool) -> List[GatherGroup]:
    names: List[Optional[str]]
    if settings.flatten_parameters:
        parts, names = flat_parts(refs, settings.flatten_group_fn)
    else:
        parts, names = [[r] for r in refs], [None] * len(refs)
    channel = comms.allocate_channels(GatherGroup.CHANNELS * len(parts))
    groups = []
    for i, (part, flat_name) in enumerate(zip(parts, names)):
        group = GatherGroup(part, comms, flat=settings.flatten_parameters, dim0=settings.shard_param_on_dim_0,
                            pad_multiple=settings.shard_size_multiple, compute_dtype=settings.compute_dtype,
                            channel=channel + GatherGroup.CHANNELS * i, offload=offload,
                            storage_dtype=settings.param_storage_dtype, sync_from_rank_0=settings.sync_module_states,
                            in_place=in_place)
        group.flat_name = flat_name
        groups.append(group)
    return groups
