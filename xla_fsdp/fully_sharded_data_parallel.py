"""``XlaFullyShardedDataParallel``: the public wrapper and the life cycle of one FSDP unit.

A unit owns the parameters of its module that no nested unit owns, split into
:class:`~xla_fsdp.unit.gather_group.GatherGroup` s. Per step it moves through explicit states:

    IDLE --forward--> FORWARD --(reshard if ZeRO-3)--> IDLE
         --first output grad--> BACKWARD_PRE (re-gather) --grads ready--> BACKWARD_POST
         (reduce-scatter, free) --root's end-of-backward callback--> IDLE

The wrapper is a shell with torch_xla's names: its constructor plans the transport and strategy,
resolves the settings (``unit/settings.py``), takes the module's parameters as gather groups
(``unit/adoption.py``) and builds the unit's runtime (``unit/runtime.py``), which holds the groups,
its step state and the root context. A step's hooks are ``unit/step.py``'s, which call the runtime's
step methods (the root's first forward sets up in ``unit/root_setup.py``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Any, Callable, Dict, Generator, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from .checkpoints.files import CheckpointError
from .collectives import resolve_transport, shared_collectives
from .strategy import plan_for_unit, resolve_torch_group_keywords
from .unit import construction, freeing, param_names, root_setup, step, summon, tied, tree_names
from .unit.adoption import adopt
from .unit.base import ShardedUnit
from .unit.options import SOLO_NUMEL
from .unit.gather_group import GatherGroup
from .unit.module_view import torch_xla_view
from .unit.offload import HostOffload, shards_held_back
from .unit.param_names import WRAPPED
from .unit.runtime import UnitRuntime
from .unit.runtime import TrainingState
from .unit.options import args_section
from .unit.shell import (DEEPCOPY_REFUSED, FlattenFlag, on_tpu, options_from_keywords, setting_attributes,
                          take_before_state_dict)
from .unit.settings import UnitSettings, resolve as resolve_settings
from .wrap import recursive_wrap, set_default_wrapper


@setting_attributes
class XlaFullyShardedDataParallel(ShardedUnit):
    """Shard a module's parameters, gradients and optimizer state across ranks (ZeRO-3/ZeRO-2).

    Drop-in for ``torch_xla.distributed.fsdp.XlaFullyShardedDataParallel``: same keywords and
    defaults, same public methods. Runs on XLA (TPU; XLA:CPU with several devices in one process)
    and on ``torch.distributed`` (gloo/NCCL), chosen automatically.

    The keywords (listed below) are declared, with their defaults and documentation, in
    ``xla_fsdp/unit/options.py``; the settings each resolves to, in ``xla_fsdp/unit/settings.py``.
    """

    def __init__(
        self,
        module: nn.Module,
        reshard_after_forward: Optional[bool] = None,
        flatten_parameters: bool = False,
        execute_sharding_on_init: bool = True,
        optimization_barrier_in_forward: bool = True,
        optimization_barrier_in_backward: bool = True,
        sync_on_finalization: bool = False,
        disable_reshard_on_root: bool = True,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        fp32_reduce_scatter: bool = False,
        sharding_groups: Optional[List[List[int]]] = None,
        sharding_rank: Optional[int] = None,
        sharding_world_size: Optional[int] = None,
        shard_param_on_dim_0: bool = False,
        pin_layout_in_collective_ops: bool = True,
        reduce_scatter_bucket_size_mb: Optional[int] = 0,
        coalesce_all_gather_ops: bool = False,
        auto_wrap_policy: Optional[Callable] = None,
        auto_wrapper_callable: Optional[Callable] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        _shard_size_multiple: Optional[int] = None,
        _use_xla_patched_linear: bool = True,
        _debug_dummy_forward_pass: bool = False,
        _debug_msg: str = "xla_fsdp",
        _debug_print: bool = False,
        _debug_dummy_all_gather_op: bool = False,
        _debug_dummy_all_reduce_op: bool = False,
        _debug_dummy_reduce_scatter_op: bool = False,
        _debug_dummy_optimization_barrier_op: bool = False,
        transport: Optional[str] = None,
        mark_step_on_finalization: Optional[bool] = None,
        sharding_strategy: Optional[Any] = None,
        hybrid_shard_size: Optional[int] = None,
        output_dtype: Optional[torch.dtype] = None,
        flatten_group_fn: Optional[Callable[[str, nn.Parameter], Any]] = None,
        prefetch: bool = True,
        _solo_collective_numel: int = SOLO_NUMEL,
        process_group: Optional[Any] = None,
        device_mesh: Optional[Any] = None,
        cpu_offload: Any = False,
        param_storage_dtype: Optional[torch.dtype] = None,
        sync_module_states: Optional[bool] = None,
    ):
        keywords = {k: v for k, v in locals().items() if k not in ("self", "module", "__class__")}
        resolve_torch_group_keywords(keywords)
        nn.Module.__init__(self)  # not super(): under fully_shard the module's own class follows in the MRO
        construction.validate_module(module)
        if not construction.warn_untied_embeddings(module):
            construction.warn_embeddings_untied_by_a_move(module)
        options = options_from_keywords(keywords)
        self._options = options
        transport = resolve_transport(options.transport)
        strategy, reshard_after_forward, groups, shard_rank, shard_size, replica_groups = plan_for_unit(
            options.sharding_strategy, options.reshard_after_forward, transport, options.sharding_groups,
            options.sharding_rank, options.sharding_world_size, options.hybrid_shard_size)
        comms = shared_collectives(transport, groups, shard_rank, shard_size,
                                   options.pin_layout_in_collective_ops, replica_groups)
        self.comms = comms
        if auto_wrap_policy is not None:
            with tied.tied_ownership(module):  # tied parameters go to their closest common unit
                recursive_wrap(module, auto_wrap_policy=auto_wrap_policy,
                               wrapper_cls=auto_wrapper_callable or XlaFullyShardedDataParallel,
                               only_wrap_children=True, **options.for_children())
        # (after the children took theirs: the dtype of what this unit holds)
        settings = self._settings(resolve_settings(options, comms, strategy, reshard_after_forward,
                                                   on_tpu(comms), construction.unit_dtype(module)))
        offload = HostOffload(comms.device, settings.pin_memory) if settings.cpu_offload else None
        adopted = adopt(self, module, options, settings, comms, offload, self.shards_in_place)
        self._fsdp_wrapped_module = module
        if not self.shards_in_place:  # (fully_shard's module holds its unit's parameters itself: fsdp2.py)
            summon.show_summoned_values(self, adopted.groups)
            module.register_load_state_dict_pre_hook(functools.partial(summon.load_full_values, weakref.ref(self)))
            self.register_load_state_dict_pre_hook(summon.route_into_module)
            self.register_load_state_dict_post_hook(summon.unwrapped_load_names)
        self._adopted = adopted
        self._module_view: Optional[nn.Module] = None
        self._channels = comms.allocate_channels(3)  # norms, control collectives, their replica sums
        self._runtime = UnitRuntime(module, comms, settings, adopted.groups, offload, self._module_call(),
                                    adopted.rank_0_buffers, adopted.param_attrs)
        self._runtime.follow_requires_grad()
        if settings.sync_module_states and not comms.ranks_share_a_process:
            self._runtime.take_deferred_values()
        if getattr(module, "_xla_fsdp_checkpointed", False):
            # Weakly: the module must not keep its unit alive (nor make a reference cycle nn.Module sees).
            runtime = weakref.ref(self._runtime)
            object.__setattr__(module, "_xla_fsdp_before_recompute", lambda: runtime().before_recompute())
        # a state_dict before the first forward holds the deferred values too (in place: the
        # program asks the module, whose unit is outside its tree)
        hooked = module if self.shards_in_place else self
        hooked.register_state_dict_pre_hook(functools.partial(take_before_state_dict, weakref.ref(self._runtime)))
        if options.execute_sharding_on_init and not all(g.initial.storage_only for g in adopted.groups):
            comms.sync()  # a storage-only unit's zeros stay lazy: the load's values replace them unmade

    # ------------------------------------------------------------------ construction steps
    #: register each shard in its original parameter's place, not as the unit's own (fully_shard)
    shards_in_place = False

    def _settings(self, settings: UnitSettings) -> UnitSettings:
        """The settings this kind of unit runs with (``fully_shard``'s differ in places)."""
        return settings

    def _module_call(self) -> Callable[..., Any]:
        """The module's call, its own hooks included (``fully_shard``'s unit calls its module's class
        forward, since calling the converted module comes back to the unit)."""
        return self._fsdp_wrapped_module

    def _lazy_init(self) -> None:
        """At the root's first forward (or ``no_sync``, ``clip_grad_norm_``): the root's units get its
        context and their effective settings."""
        if self._runtime.state.is_root is None:
            root_setup.lazy_init(self._runtime, [(p, u._runtime) for p, u in param_names.named_units(self)])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        return step.forward(self._runtime, args, kwargs)

    # ------------------------------------------------------------------ settings (torch_xla's attributes)
    # One attribute per setting UnitSettings declares fixed() or step() (``setting_attributes``): fixed ones
    # are read-only after construction, step-time ones take effect at the next step.
    @property
    def settings(self) -> UnitSettings:
        """The unit's effective settings, frozen (root rule included once the root ran forward)."""
        return self._runtime.settings

    @property
    def flatten_parameters(self) -> "FlattenFlag":
        return FlattenFlag(self._runtime.settings.flatten_parameters, self)

    @property
    def reshard_after_forward(self) -> bool:
        """Whether forward frees the full parameters (torch_xla's attribute; the root's after its first
        forward is False unless ``disable_reshard_on_root=False``). Setting it replaces the policy."""
        return self.freeing.after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        self.freeing = freeing.with_after_forward(self.freeing, bool(value))

    @property
    def disable_reshard_on_root(self) -> bool:
        """Whether the root keeps its parameters after forward (torch_xla's attribute)."""
        return self.freeing.keep_on_root

    @disable_reshard_on_root.setter
    def disable_reshard_on_root(self, value: bool) -> None:
        self.freeing = freeing.with_keep_on_root(self.freeing, bool(value))

    @property
    def _fsdp_kwargs(self) -> Dict[str, Any]:
        """Every keyword, as given (what auto-wrapped children are built with; torch_xla's attribute).
        What the unit runs with is :attr:`settings`."""
        return self._options.as_kwargs()

    # ------------------------------------------------------------------ the unit's state
    @property
    def rank(self) -> int:
        return self.comms.rank

    @property
    def world_size(self) -> int:
        return self.comms.world_size

    @property
    def gather_groups(self) -> List[GatherGroup]:
        return self._runtime.groups

    @property
    def step_state(self) -> Any:
        return self._runtime.state

    @property
    def tied_slots_left(self) -> List[Any]:
        return self._adopted.tied_slots_left

    @property
    def buffer_info(self) -> Dict[str, Dict[str, torch.dtype]]:
        return self._adopted.buffer_info

    @property
    def param_attrs(self) -> Dict[nn.Module, Tuple[str, ...]]:
        return self._adopted.param_attrs

    @property
    def training_state(self) -> TrainingState:
        """Where the unit is in its step (torch_xla's attribute)."""
        return self._runtime.state.training_state

    def assert_state(self, state: Any) -> None:
        """Raise ValueError unless the unit is in ``state`` (one state or a list; this package's
        ``TrainingState`` or torch_xla's, compared by name), as torch_xla's method does."""
        self._runtime.assert_state(*(state if isinstance(state, (list, tuple)) else [state]))

    @property
    def unshard_pending(self) -> bool:
        return self._runtime.unshard_pending

    def finish_unshard(self) -> None:
        self._runtime.finish_unshard()

    def reshard(self) -> None:
        """Free this unit's full parameters; the shards stay."""
        self._runtime.reshard()

    def take_deferred_values(self) -> None:
        self._runtime.take_deferred_values()

    @property
    def shard_size_multiple(self) -> int:
        """Flat shards are padded to a multiple of this many elements per rank (1; 128 on TPU)."""
        return self._runtime.settings.shard_size_multiple

    # ------------------------------------------------------------------ public properties
    @property
    def module(self) -> nn.Module:
        """The wrapped module, as torch_xla shows it: in torch_xla ``model.module`` is a flatten
        wrapper whose ``.module`` is the user's module, and programs written for it (the HF
        Trainer's save: ``model.module.module``) go one step further. Here ``model.module`` is the
        user's module itself (same attributes, state dict, hooks; ``isinstance`` holds) whose
        ``.module`` leads to it again, once (see :func:`torch_xla_view`)."""
        if self._module_view is None:  # a plain attribute: registered as a child, it would rename the state dict
            object.__setattr__(self, "_module_view", torch_xla_view(self._fsdp_wrapped_module))
        return self._module_view

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        return [p for p in self.parameters() if p.grad is not None]

    @property
    def sharded_params(self) -> List[nn.Parameter]:
        return [g.shard for g in self.gather_groups]

    @property
    def full_params(self) -> List[nn.Parameter]:
        return [g.full for g in self.gather_groups]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def state_dict(self, *args: Any, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:
        """torch_xla's state dict of shards; inside ``summon_full_params`` the full tensors the module shows,
        under the unwrapped model's names (``unit/summon.py``)."""
        if summon.is_summoned(self) and WRAPPED in self._modules and not args:  # (the module's hook adds them)
            return self._fsdp_wrapped_module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def named_modules(self, memo: Optional[set] = None, prefix: str = "", remove_duplicate: bool = True):
        """The unwrapped model's module names, each unit at its module's (``unit/tree_names.py``). Under
        ``fully_shard`` (no wrapped child) the module's own."""
        if WRAPPED not in self._modules:
            return super().named_modules(memo, prefix, remove_duplicate)
        return tree_names.unwrapped_named_modules(self, memo, prefix, remove_duplicate)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """torch_xla's names (``state_dict()``'s), whatever ``named_modules()`` answers."""
        return tree_names.named_members(self, lambda m: m._parameters.items(), prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return tree_names.named_members(self, lambda m: m._buffers.items(), prefix, recurse, remove_duplicate)

    def __getitem__(self, key: int) -> nn.Module:
        return self._fsdp_wrapped_module.__getitem__(key)

    def _fqn_modifiers(self) -> Dict[str, str]:
        """Called only by ``torch.distributed.checkpoint.state_dict``'s functions, which read sharded
        parameters as DTensors: given these shards they would save each rank's rows as the whole
        tensor, under shard names. One clear error on every rank instead."""
        raise CheckpointError(
            "torch.distributed.checkpoint.state_dict's functions need DTensor parameters, and xla_fsdp's are "
            "shards: import get_state_dict, set_state_dict, get_model_state_dict, set_model_state_dict, "
            "get_optimizer_state_dict and set_optimizer_state_dict from xla_fsdp.checkpoints.state_dict_api "
            "(same signatures; full state dicts keyed by the original names, DCP-ready)")

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, rank={self.rank}, transport={self.comms.name}, "
                f"flatten_parameters={self.flatten_parameters}, "
                f"reshard_after_forward={self.reshard_after_forward}, compute_dtype={self.compute_dtype}"
                + (", cpu_offload=True" if self.cpu_offload else ""))

    # ------------------------------------------------------------------ collectives outside a step
    def gather_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape everywhere), concatenated on dim 0 in rank order: the
        small control collectives of checkpoint code, on a channel of their own."""
        return self.comms.all_gather(tensor.to(self.comms.device), self._channels + 1)

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over this rank's replicas (hybrid strategies; nothing otherwise)."""
        self.comms.all_reduce_replicas(tensor, self._channels + 2)

    def gather_norms(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's one-element gradient norm term (``clip_grad_norm_``), in rank order."""
        return self.comms.all_gather(local.view(1), self._channels)

    def named_gather_groups(self) -> List[Tuple[str, GatherGroup]]:
        """(the shard parameter's name in this unit's state dict, its gather group)."""
        return list(zip(self._adopted.shard_names, self.gather_groups))

    def _apply(self, fn: Callable, recurse: bool = True) -> "XlaFullyShardedDataParallel":
        """``.to(device)``, ``.cuda()``, ``.float()``: buffers and nested units move; host-offloaded shards stay."""
        with self.shards_held_back():
            return super()._apply(fn, recurse)

    def shards_held_back(self) -> contextlib.AbstractContextManager:
        """Inside, ``nn.Module._apply`` skips this unit's host-offloaded shards (see offload.py)."""
        own = [(self, name) for g, name in zip(self.gather_groups, self._adopted.shard_names) if not g.in_place]
        return shards_held_back(self.gather_groups, self._runtime.offload, own)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "XlaFullyShardedDataParallel":
        """A copy would share this rank's process group and gather state with the original and
        hold only shards: refused, with the way an EMA teacher or a snapshot is made instead."""
        raise TypeError(DEEPCOPY_REFUSED.format(name=type(self).__name__))

    # ------------------------------------------------------------------ public methods
    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate full (unsharded) gradients locally, without reduce-scatter, inside this
        context; the first backward outside it reduces the accumulated sum. Uses full-size
        gradient memory on every rank while active."""
        self._lazy_init()
        if not self.step_state.is_root:
            raise RuntimeError("xla_fsdp: no_sync() must be called on the root unit")
        old = [(u, u.state.require_backward_grad_sync) for u in self._runtime.root.units]
        for unit, _ in old:
            unit.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for unit, value in old:
                unit.set_requires_gradient_sync(value)

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool = True) -> None:
        """Divide gradients by ``pre`` before and ``post`` after the reduce-scatter; the product
        should be the world size for an average. Splitting it avoids fp16/bf16 overflow."""
        units = [m for m in self.modules() if isinstance(m, XlaFullyShardedDataParallel)] if recursive else [self]
        for unit in units:
            unit.gradient_predivide_factor = pre
            unit.gradient_postdivide_factor = post

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        groups: Optional[List[List[int]]] = None) -> torch.Tensor:
        """Clip the gradient norm of the whole model, computed over all shards; returns the norm.
        ``groups`` (torch_xla's replica groups for the norm's all-reduce) is refused unless None: the
        norm already spans every rank that holds part of the model, as the unit's groups say."""
        from .unit.grad_norm import clip_sharded_grad_norm_
        if groups is not None:
            raise ValueError("xla_fsdp: clip_grad_norm_(groups=...) is not used: the norm spans every rank that "
                             "holds part of the model (its sharding and replica groups); leave out groups")
        self._lazy_init()
        if not self.step_state.is_root:
            raise RuntimeError("xla_fsdp: clip_grad_norm_() must be called on the root unit")
        return clip_sharded_grad_norm_(self, max_norm, norm_type)

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True
                           ) -> contextlib.AbstractContextManager:
        """``with XlaFullyShardedDataParallel.summon_full_params(model):`` the module's parameter
        attributes hold the full parameters (in the master dtype); with ``writeback`` what they
        hold at exit becomes the shards. PyTorch FSDP's signature; every rank must enter it."""
        return summon.summon_full_params(module, recurse, writeback)

    def apply(self, fn: Callable[[nn.Module], None]) -> "XlaFullyShardedDataParallel":
        """``nn.Module.apply`` on the full parameters (re-initialising a wrapped model, as
        Hugging Face's ``post_init`` does): written back to the shards. Every rank must call it."""
        with summon.summon_full_params(self, recurse=False):
            return super().apply(fn)

    def get_original_names_and_sharded_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """(original name relative to this wrapper, shard) for every shard in this unit's tree.
        For a flattened group the name is the first original parameter's."""
        return param_names.original_names_and_shards(self)

    def optimizer_param_groups(self, options_fn: Callable[[str], Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Optimizer parameter groups of shards, decided by original parameter names.

        ``options_fn(name)`` returns the group options for an original parameter (e.g.
        ``{"weight_decay": 0.0}`` for biases and norms, ``{}`` for the rest); shards whose
        parameters get the same options share a group, so the optimizer does exactly what it would
        do on the unsharded model. A flattened shard must not mix options: pass the same rule as
        ``flatten_group_fn`` when wrapping, so flattening keeps those parameters apart.
        """
        return param_names.optimizer_param_groups(self, options_fn)

    def shard_names_of(self, original_names: Iterable[str]) -> List[str]:
        """The names in ``named_parameters()`` of the shards holding the parameters named in
        ``original_names`` (unwrapped names): a set a recipe computed on the unwrapped model, such as
        the Hugging Face Trainer's ``get_decay_parameter_names``, carried over to the wrapped one
        (docs/usage.md, 'Optimizer groups by original name'). A flattened shard that holds named and
        unnamed parameters raises: pass the same rule as ``flatten_group_fn``."""
        return param_names.shard_names_of(self, original_names)

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What consolidation needs to rebuild full parameters from every rank's ``state_dict()``.

        A superset of torch_xla's five keys (``shard_info``, ``flatten_info``, ``buffer_info``,
        ``world_size``, ``rank``) plus the layout of every group.
        """
        from .checkpoints.metadata import shard_metadata
        for _, unit in param_names.named_units(self):  # a save before the first forward: rank 0's values
            unit.take_deferred_values()
        return shard_metadata(self)


if XlaFullyShardedDataParallel.__doc__ is not None:  # (python -OO drops docstrings)
    XlaFullyShardedDataParallel.__doc__ += args_section(list(inspect.signature(XlaFullyShardedDataParallel).parameters))
set_default_wrapper(XlaFullyShardedDataParallel)
