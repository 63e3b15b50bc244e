"""What a unit's steps read, resolved once from its keywords (:class:`~xla_fsdp.unit.options.UnitOptions`)
into one frozen value: defaults filled in, the transport's limits applied. The unit holds it, and
torch_xla's public attributes (``compute_dtype``, ``fp32_reduce_scatter``, ...) read it. Nothing edits
it: the root rule (``freeing.effective``), FSDP2's setters and ``set_gradient_divide_factors`` replace
it, so what the unit shows is what its next step does."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch

from . import freeing
from .freeing import FreeingPolicy
from .offload import offload_requested
from . import options as unit_options
from .options import UnitOptions


def fixed() -> Any:
    """A setting torch_xla shows as a unit attribute, fixed when the unit is built (its shards, groups and
    buffers were made for it): read-only after construction."""
    return dataclasses.field(metadata={"attribute": "fixed"})


def step() -> Any:
    """A setting torch_xla shows as a unit attribute, read at every step: setting it replaces the settings."""
    return dataclasses.field(metadata={"attribute": "step"})


@dataclasses.dataclass(frozen=True)
class UnitSettings:
    """A unit's effective settings (the keyword each comes from is in ``UnitOptions``). Each declared
    ``fixed()`` or ``step()`` is also the unit's attribute of that name (``shell.setting_attributes``)."""

    #: when the unit frees its gathered parameters (``unit/freeing.py``)
    freeing: FreeingPolicy = step()
    #: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or a hybrid (``xla_fsdp.strategy.ShardingStrategy``)
    sharding_strategy: Any = fixed()
    #: master shards, gathered parameters / floating inputs, floating buffers (None: left as they are),
    #: floating outputs (None: not cast). Storage and compute default to the parameters' own dtype (None
    #: where a unit's parameters differ: each group then keeps its own)
    param_storage_dtype: Optional[torch.dtype] = fixed()
    compute_dtype: Optional[torch.dtype] = fixed()
    buffer_dtype: Optional[torch.dtype] = fixed()
    output_dtype: Optional[torch.dtype] = step()
    #: cast floating forward inputs to ``compute_dtype`` (FSDP2's ``cast_forward_inputs``)
    cast_forward_inputs: bool = step()
    flatten_parameters: bool
    flatten_group_fn: Optional[Callable[[str, torch.nn.Parameter], Any]]
    shard_param_on_dim_0: bool = fixed()
    #: flat shards are padded to a multiple of this many elements per rank
    shard_size_multiple: int
    optimization_barrier_in_forward: bool = step()
    optimization_barrier_in_backward: bool = step()
    sync_on_finalization: bool = step()
    fp32_reduce_scatter: bool = step()
    #: gather the next unit while this one computes (eager transports only)
    prefetch: bool = fixed()
    #: take rank 0's parameters and buffers
    sync_module_states: bool
    cpu_offload: bool = fixed()
    pin_memory: bool
    #: groups of at least this many elements get collectives of their own (torch transport)
    solo_collective_numel: int
    #: gradients are divided by ``gradient_predivide_factor`` before the reduce-scatter and by
    #: ``gradient_postdivide_factor`` after it (their product: the ranks that computed one)
    gradient_predivide_factor: float = step()
    gradient_postdivide_factor: float = step()
    sharding_groups: Optional[List[List[int]]] = fixed()
    reduce_scatter_bucket_size_mb: Optional[int] = fixed()
    coalesce_all_gather_ops: bool = fixed()
    debug_print: bool
    debug_msg: str


def resolve(options: UnitOptions, comms: Any, strategy: Any, reshard_after_forward: bool,
            on_tpu: bool, param_dtype: Optional[torch.dtype] = torch.float32) -> UnitSettings:
    """The settings a unit built with ``options`` on ``comms`` runs with; ``param_dtype``: the one dtype
    of the parameters it takes (``construction.unit_dtype``), None where they differ. Without
    ``param_storage_dtype`` or ``compute_dtype`` the parameters are kept and computed in their own dtypes,
    as FSDP2 does, and inputs are not cast."""
    from ..sharding import default_predivide_factor
    storage = options.param_storage_dtype or param_dtype
    asked = options.compute_dtype is not None or options.param_storage_dtype is not None
    offload, pin_memory = offload_requested(options.cpu_offload)
    dim0 = options.shard_param_on_dim_0 and not options.flatten_parameters
    multiple = options._shard_size_multiple
    if multiple is None:
        multiple = 128 if on_tpu else 1
    sync = options.sync_module_states
    if sync is None:
        # read now: a launcher replaces the process defaults (patches.replace(options, 'defaults', ...))
        sync = unit_options.defaults.threads_take_rank_0 and comms.ranks_share_a_process
    # Gradients are averaged over every rank that computed one: the shard group and its replicas.
    data_parallel = comms.world_size * comms.num_replicas
    predivide = default_predivide_factor(data_parallel)
    return UnitSettings(
        freeing=freeing.policy(reshard_after_forward, options.disable_reshard_on_root),
        sharding_strategy=strategy,
        param_storage_dtype=storage,
        compute_dtype=options.compute_dtype or storage,
        buffer_dtype=options.buffer_dtype or options.compute_dtype or options.param_storage_dtype,
        output_dtype=options.output_dtype,
        cast_forward_inputs=asked,
        flatten_parameters=options.flatten_parameters,
        flatten_group_fn=options.flatten_group_fn,
        shard_param_on_dim_0=dim0,
        shard_size_multiple=1 if dim0 else multiple,
        optimization_barrier_in_forward=options.optimization_barrier_in_forward,
        optimization_barrier_in_backward=options.optimization_barrier_in_backward,
        sync_on_finalization=options.sync_on_finalization,
        fp32_reduce_scatter=options.fp32_reduce_scatter,
        prefetch=options.prefetch and comms.overlaps,
        sync_module_states=bool(sync),
        cpu_offload=offload,
        pin_memory=pin_memory,
        solo_collective_numel=options._solo_collective_numel,
        gradient_predivide_factor=predivide,
        gradient_postdivide_factor=data_parallel / predivide,
        sharding_groups=options.sharding_groups,
        reduce_scatter_bucket_size_mb=options.reduce_scatter_bucket_size_mb,
        coalesce_all_gather_ops=options.coalesce_all_gather_ops,
        debug_print=options._debug_print,
        debug_msg=options._debug_msg,
    )
