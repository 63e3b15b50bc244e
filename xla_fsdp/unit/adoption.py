"""How a unit takes its module (the construction step after planning): the parameters no nested
unit owns become sharded gather groups (:func:`build_group`: the layout, this rank's block, the values'
fingerprint, torch_xla's attributes, the originals taken out of the module), registered as shards;
buffers are cast; rank 0's buffers are asked for where the ranks take rank 0's values. :func:`adopt`
returns what it built."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..collectives import Collectives
from ..sharding import Dim0Layout, FlatLayout, flatten_and_pad, pad_dim0, shard_of
from . import construction, tied
from .gather_group import GatherGroup, InitialValues, ShardParamInPlace
from .member_slots import ParamRef, fingerprint
from .offload import HostOffload, shards_held_back
from .optimizer_check import install_optimizer_check
from .options import UnitOptions
from .param_names import SHARD_PREFIX, SHARD_SEPARATOR, WRAPPED, flat_parts
from .runtime import Rank0Buffer
from .settings import UnitSettings
from .shard_param import ShardParam


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
    install_optimizer_check()
    # Parameters tied outside the module, found before materializing replaces meta ones (a tied meta
    # weight's enclosing unit materializes its other places to the same tensor: construction.materialized)
    escaping = tied.escaping(module)
    tied_places = [(m, name) for m in module.modules() for name, p in m._parameters.items()
                   if p is not None and id(p) in escaping]
    construction.materialize_meta(module, options.param_init_fn, torch.device("cpu"))
    escaping = {id(m._parameters[name]) for m, name in tied_places if m._parameters.get(name) is not None}
    if options._use_xla_patched_linear and comms.name == "xla":
        from .patched_linear import patch_linear_layers
        patch_linear_layers(module)
    param_attrs = construction.param_attrs(module)
    refs, tied_slots_left = construction.collect_params(module, escaping, settings.param_storage_dtype)
    groups = _build_groups(refs, settings, comms, offload, in_place)
    names = []
    for group in groups:
        path = f"{WRAPPED}.{group.flat_name if group.flat else group.refs[0].fqn}"
        name = path if in_place else SHARD_PREFIX + path.replace(".", SHARD_SEPARATOR)
        if not in_place:  # (in place: registered where the original was, see GatherGroup)
            shell.register_parameter(name, group.shard)
        for shard in {id(t): t for t in (group.shard, group.param)}.values():
            shard._orig_name = path
            shard._name = name
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
        group = build_group(part, comms, flat=settings.flatten_parameters, dim0=settings.shard_param_on_dim_0,
                            pad_multiple=settings.shard_size_multiple, compute_dtype=settings.compute_dtype,
                            channel=channel + GatherGroup.CHANNELS * i, offload=offload,
                            storage_dtype=settings.param_storage_dtype, sync_from_rank_0=settings.sync_module_states,
                            in_place=in_place, flat_name=flat_name)
        groups.append(group)
    return groups


def build_group(refs: List[ParamRef], comms: Collectives, *, flat: bool, dim0: bool, pad_multiple: int,
                compute_dtype: Optional[torch.dtype], channel: int, offload: Optional[HostOffload] = None,
                storage_dtype: Optional[torch.dtype] = None, sync_from_rank_0: bool = False,
                in_place: bool = False, flat_name: Optional[str] = None) -> GatherGroup:
    """The gather group of ``refs``: this rank's block of their values as the shard, the originals
    taken out of the module (their data dropped: the shard is the only copy). ``storage_dtype`` and
    ``compute_dtype`` None: the parameters' own dtype (one per group, param_names.flat_parts)."""
    storage_dtype = storage_dtype or refs[0].param.dtype
    compute_dtype = compute_dtype or storage_dtype
    if dim0 and (flat or len(refs) != 1):
        raise ValueError("dim-0 sharding applies to one unflattened parameter at a time")
    ws = comms.world_size
    sources = [r.param.detach() for r in refs]
    # given storage only (``storage_only``): no values yet, so nothing to copy, compare or take from rank 0
    # (a load gives them; under xla_fsdp.compat sync_module_states is on for XLA:CPU threads)
    storage_only = all(getattr(r.param, "_xla_fsdp_storage_only", False) for r in refs)
    rank_0_takes = None
    if sync_from_rank_0 and not storage_only:
        # Rank 0's values (``sync_module_states``): where the ranks are threads of one process they are
        # taken at the root's first forward (gather_group.take_rank_0_values), since a rank building
        # under the program's lock cannot wait here for a peer still waiting for that lock.
        takes = [comms.start_broadcast_from_rank_0(s) for s in sources]
        if comms.ranks_share_a_process:
            rank_0_takes = takes
        else:
            sources = [take() for take in takes]
    layout: Union[FlatLayout, Dim0Layout]
    if dim0:
        layout = Dim0Layout(tuple(sources[0].shape), ws)
    else:
        layout = FlatLayout(tuple(tuple(s.shape) for s in sources), ws, pad_multiple)
    if storage_only:  # zeros (padding included) in the shard's place: no copy of the full data
        block = torch.zeros(layout.shard_shape if dim0 else (layout.shard_numel,), dtype=storage_dtype,
                            device="cpu" if offload is not None else comms.device)  # XLA: lazy, made by no one
    else:
        padded = pad_dim0(sources[0], layout) if dim0 else flatten_and_pad(sources, layout)
        block = shard_of(padded, comms.rank, ws).detach().clone()
    if offload is not None:
        block = offload.host_shard(block, storage_dtype)
    else:
        block = block.to(storage_dtype).to(comms.device)
    shard = nn.Parameter(block, requires_grad=refs[0].param.requires_grad)
    initial = InitialValues(None if storage_only else fingerprint(sources), shard._version, storage_only,
                            rank_0_takes)
    # The originals stop being registered parameters; the module reads full data through plain
    # attributes that the group's ``install`` sets (now) and refreshes after every gather. ``in_place`` (fully_shard):
    # the shard is registered in the original's place (``named_parameters()``, ``state_dict()`` under the
    # module's own names, as FSDP2's DTensor), and the plain attribute shadows it.
    for ref in refs:
        for module, attr in ref.slots:
            module._parameters.pop(attr, None)
        ref.param._xla_fsdp_sharded = True
        # The shard is the only copy now: drop the original's data so every rank does not keep
        # the whole model in host memory (the object stays, marked, to catch sharing across units).
        ref.param.data = ref.param.data.new_empty(0)
    group = GatherGroup(refs, comms, layout, shard, initial, flat=flat, compute_dtype=compute_dtype, channel=channel,
                        offload=offload, face=ShardParamInPlace(ShardParam) if in_place and not flat else None,
                        flat_name=flat_name)
    _torch_xla_attributes(group)
    return group


def _torch_xla_attributes(group: GatherGroup) -> None:
    """torch_xla's attributes, read by its clients (Lightning's XLAFSDPStrategy finds the optimizer's
    shards by ``_is_sharded``): the size of what the shard is part of, the full parameter's handle
    (its ``_has_full_param`` kept by the group); ``_name`` is set by the unit, which names the shard.
    ``_xla_fsdp_reduced``: the shard's gradient is reduced by its unit, so torch_xla's all-reduce of
    every gradient (xm.optimizer_step, Accelerate's XLA path) leaves it out (collectives/xla_gradients.py)."""
    for shard in {id(t): t for t in (group.shard, group.param)}.values():
        shard._xla_fsdp_reduced = True
        shard._is_sharded = True
        shard._orig_size = torch.Size((group.layout.numel,) if group.flat else group.full_shape)
    group.full._sharded_param = group.param
