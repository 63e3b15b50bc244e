"""PyTorch FSDP2's API (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``)
on XLA devices, so a program written for ``torch.distributed.fsdp`` runs on torch_xla with only
that import changed.

On the torch transport (a gloo/NCCL group is initialized) ``fully_shard`` *is* PyTorch's: the
program gets upstream FSDP2 exactly, DTensor parameters included. On XLA devices it shards the
module in place with xla_fsdp's unit (the default per-parameter layout, rows split on dim 0 as
FSDP2's ``Shard(0)``): the module stays the same object, keeps its class (``FSDP<Class>``, a
subclass of its class and of :class:`FSDPModule`) and stays where it is in its parent, so
``fully_shard`` on each block and then on the root nests as in FSDP2. Its contents, parameter names,
state-dict keys and attributes stay its own: the unit is held beside the module tree (``unit_of``)
and each shard is registered in its parameter's place. What differs on XLA, and
why, is in docs/fsdp2.md; every setting this cannot honour is an error that names the way that
works, never a silent difference.
"""
from __future__ import annotations

import abc
import dataclasses
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
# PyTorch's own function, from the module that defines it: a program (or a client's one-line adapter)
# that binds ``torch.distributed.fsdp.fully_shard`` to ours must not make ours call itself
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _upstream_fully_shard

from . import fsdp2_keywords
from .collectives import resolve_transport
from .fully_sharded_data_parallel import XlaFullyShardedDataParallel
from .unit import construction, freeing, gather_group, param_names, step, summon
from .unit.base import UNIT_ATTR, is_unit
from .unit.runtime import TrainingState
from .unit.shard_param import ShardParam

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle",
           "fully_shard"]

_DEFAULT_MP, _NO_OFFLOAD = MixedPrecisionPolicy(), OffloadPolicy()  # FSDP2's defaults (frozen dataclasses)


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns. On XLA the gather is part of the traced step and
    the compiler orders it, so there is nothing to wait for."""

    def wait(self) -> None:
        return None


class FSDPModule(metaclass=abc.ABCMeta):  # noqa: B024 - an ABC for register(), no abstract method
    """A module sharded by ``fully_shard``. PyTorch's ``FSDPModule`` is registered as a virtual
    subclass, so ``isinstance(m, xla_fsdp.FSDPModule)`` holds on either transport.

    On XLA the methods act on the module's xla_fsdp unit, kept beside its module tree."""

    def reshard(self) -> None:
        """Free this module's gathered parameters; the shards stay."""
        _state(self).reshard()

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's parameters now (not its children's); its next forward uses them
        without gathering again, then frees them as ``reshard_after_forward`` says."""
        unit = _state(self)
        unit.take_deferred_values()  # what an init after to_empty wrote
        unit._runtime.unshard()
        return UnshardHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates unsharded gradients locally, with no reduce-scatter
        (gradient accumulation); the first backward after ``True`` reduces the sum."""
        for unit in _units(self, recurse):
            unit._runtime.set_requires_gradient_sync(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the full parameters (re-gathered in backward)."""
        fsdp2_keywords.check_reshard_value(reshard_after_forward)
        for unit in _units(self, recurse):
            # True reshards to every rank; an explicit value holds for the root too (as in FSDP2)
            unit.freeing = freeing.with_after_forward(unit.freeing, bool(reshard_after_forward), explicit=True)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the full parameters after backward (FSDP2's way to save the next micro-batch's
        forward gathers in gradient accumulation); ``True`` frees them again. An optimizer step since
        (a changed shard) makes the next forward gather again, so kept parameters are never stale."""
        for unit in _units(self, recurse):
            unit.freeing = freeing.with_after_backward(unit.freeing, bool(reshard_after_backward))

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Gather ``modules``' parameters in this module's forward, right after its own (FSDP2's
        explicit prefetch); each listed module's forward then gathers nothing. On XLA the gathers
        join this module's optimization barrier, so a compiler that keeps barriers (TPU's) does not
        hoist them earlier (XLA:CPU's removes barriers and schedules gathers itself)."""
        _state(self)._runtime.prefetch_forward = _check_prefetch_list(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """As :meth:`set_modules_to_forward_prefetch`, for backward: the gathers come at this
        module's backward (its barrier takes the incoming gradient), for modules whose backward is
        still to run. Without a list (or with an empty one), FSDP2's default: the module that ran
        forward before this one."""
        _state(self)._runtime.prefetch_backward = _check_prefetch_list(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the world size."""
        if not factor > 0:
            raise ValueError(f"xla_fsdp.fully_shard: the gradient divide factor must be positive, got {factor}")
        _state(self)._runtime.replace_settings(gradient_predivide_factor=1.0, gradient_postdivide_factor=float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: on XLA the reduce-scatter always sums and the division is applied apart (gloo
        needs this call with a gradient divide factor; PyTorch's FSDP2 would use PREMUL_SUM)."""
        bool(enable)  # nothing to change

    def set_sync_after_optimizer_step(self, enabled: bool, *, recurse: bool = True) -> None:
        """xla_fsdp only (PyTorch's FSDP2 has no such method: leave the call out of programs that also
        run there). Whether an optimizer step over this module's shards ends the traced step on XLA
        with a graph cut, as ``torch_xla.sync()`` after the step would, where the program marks no
        steps itself (default: on; a program with its own syncs is left as it is). Off: the graph
        grows across steps until the program's own cut."""
        for unit in _units(self, recurse):
            for group in unit.gather_groups:
                group.set_sync_after_optimizer_step(enabled)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted. xla_fsdp finishes every backward's reduction within that backward, so there is
        no deferred work for the last one to wait for."""
        bool(is_last_backward)  # nothing to change


def _not_on_xla(name: str) -> Callable[..., None]:
    def method(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"xla_fsdp.fully_shard on XLA: FSDPModule.{name} is not supported (it tunes "
                                  "PyTorch's own collectives and streams, which XLA's compiled step replaces)")
    method.__name__ = name
    return method


for _name in ("set_all_reduce_hook", "set_allocate_memory_from_process_group_for_comm", "set_custom_all_gather",
              "set_custom_reduce_scatter", "set_post_optim_event", "set_reduce_scatter_divide_factor",
              "set_requires_all_reduce", "set_unshard_in_backward"):
    setattr(FSDPModule, _name, _not_on_xla(_name))

FSDPModule.register(torch.distributed.fsdp.FSDPModule)


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh: Optional[Any] = None,
                reshard_after_forward: Optional[Union[bool, int]] = None,
                shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
                mp_policy: MixedPrecisionPolicy = _DEFAULT_MP,
                offload_policy: OffloadPolicy = _NO_OFFLOAD,
                ignored_params: Optional[set] = None, dp_mesh_dims: Optional[Any] = None) -> nn.Module:
    """PyTorch's ``torch.distributed.fsdp.fully_shard``: same signature and meaning (``dp_mesh_dims``
    as PyTorch 2.13 and newer take it; with an older PyTorch, passing one is the TypeError PyTorch's
    own function would raise).

    Torch transport: PyTorch's own function. XLA: the module's parameters not owned by an inner
    ``fully_shard`` are sharded on dim 0; the module is converted in place and returned."""
    newer = {} if dp_mesh_dims is None else {"dp_mesh_dims": dp_mesh_dims}
    if resolve_transport(None) == "torch":
        return _upstream_fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                                     shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                                     offload_policy=offload_policy, ignored_params=ignored_params, **newer)
    if newer:
        fsdp2_keywords.check_upstream_takes(newer, _upstream_fully_shard)
        raise NotImplementedError(
            "xla_fsdp.fully_shard on XLA: dp_mesh_dims (a full SPMD mesh whose parameters are DTensors) is not "
            "supported; pass mesh=None (every XLA device) or a 1-D mesh, and leave dp_mesh_dims unset")
    if not isinstance(module, nn.Module):
        # FSDP2 gathers a list's parameters as one group; here each module is a unit of its own, which
        # trains alike (one gather per module instead of one for the list) and returns the list as FSDP2 does
        modules = list(module)
        fsdp2_keywords.check_list(modules)
        for m in modules:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
                        ignored_params=ignored_params)
        return module
    if is_unit(module):
        raise ValueError(f"xla_fsdp.fully_shard: {type(module).__name__} is already sharded; call "
                         "fully_shard once per module")
    options = fsdp2_keywords.unit_options(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                                          offload_policy, ignored_params)
    post_forward_size = options.pop("post_forward_size")
    on_meta = any(t.is_meta for _, m in construction.owned_modules(module)
                  for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None)
    if on_meta:  # as FSDP2: storage only; the program's to_empty + init give the values
        options["param_init_fn"] = construction.storage_only
    for p in ignored_params or ():
        p._xla_fsdp_ignored = True
    # FSDP2 casts floating inputs to param_dtype only where one is set
    module = _shard_in_place(module, options, mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None)
    unit = _state(module)
    unit.awaiting_to_empty = on_meta
    if post_forward_size is not None:
        unit.freeing = freeing.with_pieces_within(unit.freeing, unit.comms.within_groups_of(post_forward_size))
    return module


def _check_prefetch_list(modules: Iterable[Any], method: str) -> List[nn.Module]:
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"xla_fsdp: {method} takes modules that fully_shard converted; got "
                             f"{type(m).__name__}")
    return [_state(m)._runtime for m in modules]


def _units(module: nn.Module, recurse: bool) -> List[XlaFullyShardedDataParallel]:
    return summon.units_under(module, recurse)


# ----------------------------------------------------------------------------- in place
_CLASSES: Dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``: FSDP2's methods, then the module's own class (``isinstance`` holds; its
    methods, properties and attributes stay the module's own). The unit is held beside the tree."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (_InPlaceModule, FSDPModule, cls), {})
    return _CLASSES[cls]


def _state(module: nn.Module) -> "_FullyShardUnit":
    """The unit ``fully_shard`` made for ``module`` (FSDP2's ``_get_fsdp_state()``)."""
    return module.__dict__[UNIT_ATTR]


class _InPlaceModule(nn.Module):
    """What a converted module does differently from its class: the module-wide operations that would
    otherwise act on the shards as if they were whole parameters. Its forward is its class's, with the
    unit's forward pre- and post-hooks around it (``_pre_forward``, ``_post_forward``), as FSDP2's."""

    def to_empty(self, *, device: Union[str, torch.device], recurse: bool = True) -> nn.Module:
        """FSDP2's meta-device init: ``fully_shard`` on the meta module, then ``to_empty`` and the
        program's own init (``reset_parameters()``, ``init_weights()``). Here the module's parameter
        attributes become full-size uninitialized parameters on the device, so the init sees the
        shapes and draws the values the unsharded model would; the next forward (or a state dict,
        or ``summon_full_params``) keeps each rank's rows. ``model.parameters()`` stays the shards,
        for the optimizer. On XLA the full tensors are lazy: computed and cut in one graph."""
        _state(self).begin_to_empty(torch.device(device), summon.units_under(self, recurse))
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> nn.Module:
        """``fn`` on every module once, on the full parameters (written back to the shards). Between
        ``to_empty`` and the first forward the module already holds full parameters for the init (on
        the host with ``CPUOffloadPolicy``, so ``fn`` draws from the CPU generator, as unsharded)."""
        unit = _state(self)
        if any(gather_group.in_late_init(group) for group in unit.gather_groups):
            return nn.Module.apply(self, fn)
        with summon.summon_full_params(self, recurse=False):
            return nn.Module.apply(self, fn)  # nested converted modules summon their own

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        """``.to(device)``, ``.float()``: the buffers and the parameters of modules not sharded; the shards
        stay where and what they are (host-offloaded ones on the host). A cast or a move of a shard
        itself is refused: its ShardParam's dtype and device are the sharded parameter's for good."""
        unit = _state(self)
        for group in unit.gather_groups if unit._runtime.offload is None else ():
            moved = fn(group.shard)  # (before anything changes: a refused call leaves the module as it was)
            if (moved.dtype, moved.device) != (group.shard.dtype, group.shard.device):
                raise NotImplementedError(
                    f"xla_fsdp.fully_shard on XLA: '{group.refs[0].fqn}' is sharded as {group.shard.dtype} on "
                    f"{group.shard.device}; it cannot become {moved.dtype} on {moved.device} after fully_shard. "
                    "Move or cast the model before fully_shard, or compute in another dtype with "
                    "MixedPrecisionPolicy(param_dtype=...)")
        with unit.shards_held_back():
            return super()._apply(fn, recurse)

    def _fqn_modifiers(self) -> Dict[str, str]:
        return _state(self)._fqn_modifiers()  # PyTorch's state_dict functions: the unit's error naming ours

    def __deepcopy__(self, memo: Dict[int, Any]) -> nn.Module:
        return _state(self).__deepcopy__(memo)  # the unit's refusal, naming what works


class _FullyShardUnit(XlaFullyShardedDataParallel):
    """The unit of a module ``fully_shard`` converted: held in the module's ``_xla_fsdp_unit``
    attribute, outside its module tree, with the module as its ``_fsdp_wrapped_module``. Its shards
    are registered in the original parameters' places (see GatherGroup's ``in_place``)."""

    shards_in_place = True

    def __init__(self, module: nn.Module, **options: Any) -> None:
        super().__init__(module, **options)
        self._runtime.prefetch_backward_by_default = True
        self._late_init_units: List[nn.Module] = []  # to_empty's units, until their init is sharded
        self._init_checked = False  # whether a first forward found every meta-built unit given values
        self.awaiting_to_empty = False  # built from the meta device, not yet to_empty'd
        #: forwards begun: the call, the exception then in flight, and the frame running the module's call
        self.calls: List[Tuple[step.ForwardCall, Any, Any]] = []

    def _settings(self, settings: Any) -> Any:
        return dataclasses.replace(settings, buffer_dtype=None)  # FSDP2 leaves buffers as they are

    def _module_call(self) -> Callable[..., Any]:
        return self._fsdp_wrapped_module  # (its call runs the unit's hooks: the wrapper's forward is not used)

    def begin_to_empty(self, device: torch.device, units: List["_FullyShardUnit"]) -> None:
        self._check_init_device(device)
        device = device if device.type == "cpu" else self.comms.device  # "xla" means this rank's device
        for unit in units:
            if unit.training_state is not TrainingState.IDLE:
                raise RuntimeError("xla_fsdp.fully_shard: to_empty inside forward or backward; call it before "
                                   "training, as FSDP2's meta-device init does")
            unit._runtime.begin_late_init(device)
            unit.awaiting_to_empty = False
        self._late_init_units = units

    def _check_init_device(self, device: torch.device) -> None:
        ours = self.comms.device
        if device.type not in (ours.type, "cpu") or device.type == "cpu" and self._runtime.offload is None:
            raise ValueError(f"xla_fsdp.fully_shard: to_empty(device={str(device)!r}) but this module is sharded on "
                             f"{ours}; pass device=torch_xla.device() (the XLA device this rank trains on)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The unit called as a module: its module's call (hooks and all)."""
        return self._fsdp_wrapped_module(*args, **kwargs)

    def before_first_forwards(self) -> None:
        """A forward's checks and work before the unit's own: a meta-built unit given no values yet is an
        error; what the program's init wrote after to_empty becomes the shards."""
        if not self._init_checked:
            unset = [prefix.rstrip(".") or "the root" for prefix, unit in param_names.named_units(self)
                     if getattr(unit, "awaiting_to_empty", False)]
            if unset:
                raise RuntimeError(
                    f"xla_fsdp.fully_shard: {unset[0]} was sharded on the meta device and has no values yet; call "
                    "model.to_empty(device=torch_xla.device()) and then the model's init (reset_parameters(), "
                    "init_weights()) before the first forward, as with FSDP2")
            self._init_checked = True
        if self._late_init_units:  # what the program's init wrote after to_empty becomes the shards
            units, self._late_init_units = self._late_init_units, []
            for unit in units:
                unit.take_deferred_values()
            # on XLA: the init and its cut run now, apart from the step
            self.comms.sync(why="Here: the cut before the first forward that runs the meta-device init (to_empty "
                                "and the program's init, which drew them); call torch_xla.sync() right after the "
                                "init, and the unwrapped program cuts there too")


def _pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Tuple[Any, Any]:
    """FSDP2's pre-forward hook (registered first): gather, cast the inputs; the root's set-up."""
    unit = _state(module)
    if unit.calls:
        _end_interrupted_calls(unit)
    unit.before_first_forwards()
    unit._lazy_init()
    args, kwargs, call = step.before_forward(unit._runtime, args, kwargs)
    unit.calls.append((call, sys.exc_info()[1], sys._getframe(1)))
    return args, kwargs


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    """FSDP2's post-forward hook: free or keep, hook the outputs for backward. Called also when the
    module raised (``always_call``): then the unit is left idle and resharded, and torch re-raises."""
    unit = _state(module)
    if not unit.calls:
        return None  # the pre-hook raised: nothing began
    call, outer, _ = unit.calls.pop()
    if sys.exc_info()[1] is not outer:  # raised since the pre-hook (not one an outer except is handling)
        step.forward_failed(unit._runtime, call)
        return None
    return step.after_forward(unit._runtime, call, output)


def _end_interrupted_calls(unit: "_FullyShardUnit") -> None:
    """Forwards begun whose module call is no longer running: a ``KeyboardInterrupt`` (any exception
    not derived from ``Exception``) skips ``always_call`` post-hooks, so the unit (the root: every unit)
    would stay in FORWARD. They end as a forward that raised does, before this forward begins."""
    running = set()
    frame = sys._getframe(1)
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    while unit.calls and id(unit.calls[-1][2]) not in running:
        call, _, _ = unit.calls.pop()
        if unit.training_state is TrainingState.FORWARD:  # (not already ended by its root's)
            step.forward_failed(unit._runtime, call)


def _shard_in_place(module: nn.Module, options: Dict[str, Any], cast_forward_inputs: bool) -> nn.Module:
    unit = _FullyShardUnit(module, **options)
    for group in unit.gather_groups:
        group.set_sync_after_optimizer_step(True)
    unit.cast_forward_inputs = cast_forward_inputs
    object.__setattr__(module, UNIT_ATTR, unit)  # a plain attribute: not a child, so not in the tree
    module.__class__ = _fsdp_class(type(module))
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, always_call=True)
    module.register_state_dict_post_hook(_rows_in_state_dict)
    module.register_load_state_dict_pre_hook(_rows_to_load)
    return module


def _sharded_keys(module: nn.Module, prefix: str) -> Iterator[Tuple[str, Any]]:
    """Each state-dict key of a ShardParam the module's unit registered (tied names included), with its group."""
    for group in _state(module).gather_groups:
        if group.in_place:
            for ref in group.refs:
                for name in [ref.fqn, *ref.aliases]:
                    yield prefix + name, group


def _rows_in_state_dict(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict()`` holds each rank's rows of its parameters (plain tensors, padded to equal rows), as the
    checkpoint functions and ``torch.save`` take them (FSDP2's holds DTensors); ``keep_vars=True``: the
    parameters themselves (saved as their rows). Inside ``summon_full_params``: the whole tensors the module
    shows (what a save made there, PEFT's ``save_pretrained``, must hold)."""
    if summon.is_summoned(_state(module)):
        for key, group in _sharded_keys(module, prefix):
            if key in state_dict:
                state_dict[key] = gather_group.module_values(group)[0].detach()
        return
    for key, group in _sharded_keys(module, prefix):
        value = state_dict.get(key)
        if isinstance(value, ShardParam) and value is not group.param:
            state_dict[key] = value.rows()


def _rows_to_load(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                  *args: Any) -> None:
    """``load_state_dict`` of what ``state_dict()`` gave (each rank's rows): each entry is taken as the rows of its
    ShardParam, whose shape is the whole parameter's, so ``nn.Module`` compares and copies them as such. Inside
    ``summon_full_params``: the whole tensors (what ``state_dict()`` gives there), copied into the ones the module
    shows, which become the rows at exit; between steps a whole tensor beside this rank's rows is refused."""
    unit = _state(module)
    for key, group in _sharded_keys(module, prefix):
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, ShardParam):
            continue
        if summon.is_summoned(unit):
            if summon.copy_into_shown(unit, key, value, gather_group.module_values(group)[0]):
                state_dict[key] = group.param  # (its own rows: nn.Module's copy changes nothing)
            continue
        if tuple(value.shape) == tuple(group.full_shape) != tuple(group.shard.shape):
            raise summon.full_load_refused(f"the whole tensor '{key}'")
        if local_metadata.get("assign_to_params_buffers"):
            raise NotImplementedError(
                f"xla_fsdp.fully_shard on XLA: load_state_dict(assign=True) would replace '{key}', a sharded "
                "parameter, with a plain tensor; load without assign=True (the values are copied into the shards)")
        if tuple(value.shape) == tuple(group.shard.shape) != tuple(group.full_shape):
            state_dict[key] = ShardParam(group, value)
