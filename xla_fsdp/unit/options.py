"""Every keyword a unit is built with, as one typed, frozen value: checked once, and handed whole
to the child units that auto-wrapping builds (torch_xla passes its keywords on the same way)."""
from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .offload import check_storage_dtype, offload_requested

#: a group whose full size reaches this many elements (4 MiB in fp32) gets collectives of its own:
#: coalescing costs a copy of the full data (rank-major columns), dearer than one more call
SOLO_NUMEL = 1 << 20

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


def keyword(default: Any, doc: str) -> Any:
    """A keyword's default and what it does: the constructor's docstring is made from these."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class UnitOptions:
    """The constructor's keywords, each declared once here with its default and its documentation (the
    wrapper's signature lists them again, in torch_xla's order, for positional calls and IDEs; a test keeps
    the two equal), less the module and the auto-wrap policy, which are not passed on to children."""

    reshard_after_forward: Optional[bool] = keyword(
        None, "free full parameters after forward and re-gather them in backward (ZeRO-3, least memory). "
        "``False`` keeps them until after backward (ZeRO-2, one all-gather less per step).")
    flatten_parameters: bool = keyword(
        False, "put this unit's parameters into a few flat shards whatever their number: matrices apart from "
        "vectors, each ``flatten_group_fn`` key apart, trainable apart from frozen (split the same way, so a "
        "frozen copy's shards pair with the trainable model's).")
    execute_sharding_on_init: bool = keyword(
        True, "run the sharding graph right away on XLA (avoids one huge first graph); ignored by eager "
        "transports and by units given storage only.")
    optimization_barrier_in_forward: bool = keyword(
        True, "on XLA, keep the compiler from fusing gathers across units in forward, which would keep full "
        "parameters alive. Only floating tensors get barriers (integer ones crash XLA:CPU).")
    optimization_barrier_in_backward: bool = keyword(True, "the same, in backward.")
    sync_on_finalization: bool = keyword(False, "run ``sync`` at the end of the root's backward (XLA).")
    disable_reshard_on_root: bool = keyword(
        True, "keep the root unit's parameters gathered after forward, since backward needs them first.")
    compute_dtype: Optional[torch.dtype] = keyword(
        None, "dtype of the gathered parameters and of floating inputs (float32 default, bfloat16 or float16 "
        "for mixed precision). Master shards stay float32.")
    buffer_dtype: Optional[torch.dtype] = keyword(
        None, "dtype for floating buffers (defaults to ``compute_dtype``); their original dtypes are recorded "
        "in the shard metadata so consolidation restores them.")
    fp32_reduce_scatter: bool = keyword(
        False, "reduce-scatter gradients in float32 even when computing in low precision.")
    sharding_groups: Optional[List[List[int]]] = keyword(
        None, "shard within these groups of ranks (global ranks), with ``sharding_rank`` and "
        "``sharding_world_size``, this rank's place in its group.")
    sharding_rank: Optional[int] = keyword(None, "this rank's place in its ``sharding_groups`` group.")
    sharding_world_size: Optional[int] = keyword(None, "the size of each ``sharding_groups`` group.")
    shard_param_on_dim_0: bool = keyword(
        False, "split each (unflattened) parameter along dim 0 instead of flattening.")
    pin_layout_in_collective_ops: bool = keyword(
        True, "pin collective layouts on XLA (never on XLA:CPU, whose channel-id collectives need no pinning).")
    reduce_scatter_bucket_size_mb: Optional[int] = keyword(
        0, "accepted for compatibility and passed to child units; with ``flatten_parameters=True`` a unit "
        "already issues one collective of each kind.")
    coalesce_all_gather_ops: bool = keyword(False, "as ``reduce_scatter_bucket_size_mb``.")
    param_init_fn: Optional[Callable[[nn.Module], None]] = keyword(
        None, "``fn(module)`` materializing meta-device parameters; default is ``to_empty`` plus each "
        "submodule's ``reset_parameters()``; ``xla_fsdp.storage_only`` when a load gives the values next "
        "(it draws nothing).")
    _shard_size_multiple: Optional[int] = keyword(
        None, "pad flat shards to a multiple of this many elements per rank (default 128 on TPU, for "
        "all-gather efficiency; 1 elsewhere, to waste no memory).")
    _solo_collective_numel: int = keyword(
        SOLO_NUMEL, "on torch.distributed (world size > 1), groups of at least this many elements (default "
        "1 Mi) get collectives of their own instead of sharing one.")
    _use_xla_patched_linear: bool = keyword(
        True, "on XLA, make ``nn.Linear`` save its weight (not a transposed copy) for backward, so ZeRO-3 can "
        "free full weights after forward.")
    _debug_msg: str = keyword("xla_fsdp", "the prefix of ``_debug_print``'s lines.")
    _debug_print: bool = keyword(False, "print each unit's gathers and frees.")
    transport: Optional[str] = keyword(None, "``'xla'`` or ``'torch'`` to override the automatic choice.")
    sharding_strategy: Optional[Any] = keyword(
        None, "``FULL_SHARD`` (ZeRO-3), ``SHARD_GRAD_OP`` (ZeRO-2), ``NO_SHARD`` (every rank keeps "
        "everything, gradients all-reduced, like DDP), ``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2`` (shard "
        "within groups of ``hybrid_shard_size`` ranks, replicate across groups and all-reduce gradient "
        "shards between them: less traffic across hosts). A :class:`~xla_fsdp.strategy.ShardingStrategy`, "
        "PyTorch's enum, a name or 1-5. Unset: ``reshard_after_forward`` and ``sharding_groups`` keep "
        "torch_xla's meaning.")
    hybrid_shard_size: Optional[int] = keyword(
        None, "ranks per shard group for hybrid strategies (default: ranks per host); ``sharding_groups`` may "
        "list the groups instead.")
    output_dtype: Optional[torch.dtype] = keyword(
        None, "cast floating outputs of this unit to this dtype (e.g. float32 logits for the loss while "
        "computing in bfloat16). Not passed on to auto-wrapped children.")
    flatten_group_fn: Optional[Callable[[str, nn.Parameter], Any]] = keyword(
        None, "``fn(name, param) -> key`` (name relative to this unit's module): with ``flatten_parameters`` "
        "trainable parameters with different keys go to different flat shards, so optimizer groups by name "
        "stay possible (see :meth:`optimizer_param_groups`). Vectors (norm scales, biases) and matrices are "
        "always flattened apart.")
    prefetch: bool = keyword(
        True, "on eager transports (gloo/NCCL), gather the next unit's parameters (backward: the previous "
        "one's) while this unit computes; costs one more unit's full parameters. No effect on XLA, which "
        "schedules collectives itself.")
    cpu_offload: Any = keyword(
        False, "``True``, PyTorch's ``CPUOffload(offload_params=True)`` or FSDP2's ``CPUOffloadPolicy()``: "
        "master shards, their gradients and so the optimizer state live in host memory (pinned on CUDA; "
        "``optimizer.step()`` runs on the host); gathers copy shards to the device, gradient shards come back "
        "after the reduce-scatter (see :mod:`xla_fsdp.unit.offload`).")
    param_storage_dtype: Optional[torch.dtype] = keyword(
        None, "master shard dtype: float32 (default) or bfloat16 (half the memory for parameters, gradients "
        "and optimizer state; the optimizer steps bf16 weights). Default of ``compute_dtype`` and "
        "``buffer_dtype``.")
    sync_module_states: Optional[bool] = keyword(
        None, "take global rank 0's parameters and floating buffers at construction (PyTorch FSDP's keyword), "
        "for ranks that build their model from different random states. Default off; under ``python -m "
        "xla_fsdp.compat`` on where the ranks are threads of one process sharing one CPU random generator "
        "(XLA:CPU devices). When off, the first forward checks that every rank built the same parameters (a "
        "fingerprint of each) and otherwise stops every rank with an error naming the first that differs.")

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


#: the keywords the wrapper reads itself (they are not kept in ``UnitOptions``), and what they do
WRAPPER_KEYWORDS = {
    "module": "the module to shard. Its float32 parameters become 1-D (or dim-0) shards owned by this wrapper; "
              "build the optimizer from the wrapper's ``parameters()`` after wrapping.",
    "auto_wrap_policy": "``policy(module, recurse, unwrapped_params) -> bool`` deciding which children become "
                        "their own units (see :mod:`xla_fsdp.wrap`); every keyword of this constructor but "
                        "``output_dtype`` is passed on to them.",
    "auto_wrapper_callable": "``fn(module, *args, **kwargs)`` used instead of this class for auto-wrapped "
                             "children, e.g. to apply ``checkpoint_module`` first.",
    "mark_step_on_finalization": "deprecated alias of ``sync_on_finalization``.",
    "process_group": "PyTorch FSDP's way to give the groups (torch.distributed): one group spanning every rank, "
                     "or ``(shard_group, replicate_group)`` with a hybrid strategy. Read as ``sharding_groups``.",
    "device_mesh": "as ``process_group``: a 1-D mesh, or a 2-D ``(replicate, shard)`` mesh with a hybrid "
                   "strategy.",
}


def args_section(names: List[str]) -> str:
    """The docstring's ``Args:`` for the constructor's parameters ``names`` (its signature's order), made
    from the declarations above; the ``_debug_dummy_*`` keywords are refused, so they are left out."""
    docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(UnitOptions)}
    docs.update(WRAPPER_KEYWORDS)
    lines = ["", "    Args:"]
    for name in names:
        if name in ("self",) or name.startswith("_debug_dummy"):
            continue
        lines += textwrap.wrap(f"{name}: {docs[name]}", width=100, initial_indent=" " * 8,
                               subsequent_indent=" " * 12, break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines) + "\n"
