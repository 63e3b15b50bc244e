"""Every keyword a unit is built with, as one typed, frozen value: checked once, and handed whole
to the child units that auto-wrapping builds (torch_xla passes its keywords on the same way)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .offload import check_storage_dtype, offload_requested
from .coalesce import SOLO_NUMEL

_FLOAT_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class ProcessDefaults:
    """Defaults a launcher may set for its process (through :mod:`xla_fsdp.patches`, which replaces
    ``defaults`` and puts it back on ``uninstall``). ``threads_take_rank_0``: with
    ``sync_module_states`` unset, ranks that are threads of one process take rank 0's parameters
    (set by ``python -m xla_fsdp.compat``, whose unchanged torch_xla programs build their model
    in every device thread from the one CPU generator the threads share)."""

    threads_take_rank_0: bool = False


defaults = ProcessDefaults()


@dataclasses.dataclass(frozen=True)
class UnitOptions:
    """The constructor's keywords (see :class:`~xla_fsdp.XlaFullyShardedDataParallel` for each),
    less the module and the auto-wrap policy, which are not passed on to children."""

    reshard_after_forward: Optional[bool] = None
    flatten_parameters: bool = False
    execute_sharding_on_init: bool = True
    optimization_barrier_in_forward: bool = True
    optimization_barrier_in_backward: bool = True
    sync_on_finalization: bool = False
    disable_reshard_on_root: bool = True
    compute_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    fp32_reduce_scatter: bool = False
    sharding_groups: Optional[List[List[int]]] = None
    sharding_rank: Optional[int] = None
    sharding_world_size: Optional[int] = None
    shard_param_on_dim_0: bool = False
    pin_layout_in_collective_ops: bool = True
    reduce_scatter_bucket_size_mb: Optional[int] = 0
    coalesce_all_gather_ops: bool = False
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    _shard_size_multiple: Optional[int] = None
    _solo_collective_numel: int = SOLO_NUMEL
    _use_xla_patched_linear: bool = True
    _debug_msg: str = "xla_fsdp"
    _debug_print: bool = False
    transport: Optional[str] = None
    sharding_strategy: Optional[Any] = None
    hybrid_shard_size: Optional[int] = None
    output_dtype: Optional[torch.dtype] = None
    flatten_group_fn: Optional[Callable[[str, nn.Parameter], Any]] = None
    prefetch: bool = True
    cpu_offload: Any = False
    param_storage_dtype: Optional[torch.dtype] = None
    sync_module_states: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.compute_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"compute_dtype must be float32, float16 or bfloat16, got {self.compute_dtype}")
        if self.output_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"output_dtype must be float32, float16 or bfloat16, got {self.output_dtype}")
        offload_requested(self.cpu_offload)  # raises on a value of the wrong type
        check_storage_dtype(self.param_storage_dtype)
        given = [x is None for x in (self.sharding_groups, self.sharding_rank, self.sharding_world_size)]
        if self.sharding_strategy is None and len(set(given)) > 1:
            raise ValueError("sharding_groups, sharding_rank and sharding_world_size go together: "
                             "give all three or none")

    def as_kwargs(self) -> Dict[str, Any]:
        """The keywords, as given (no copies: callables and group lists are the caller's)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def for_children(self) -> Dict[str, Any]:
        """What auto-wrapped children are built with. ``output_dtype`` describes this unit's
        outputs only: inner units stay in the compute dtype so the layers around them agree."""
        kwargs = self.as_kwargs()
        del kwargs["output_dtype"]
        return kwargs
