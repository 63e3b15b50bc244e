"""PyTorch FSDP2's API (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``)
on XLA devices, so a program written for ``torch.distributed.fsdp`` runs on torch_xla with only
that import changed.

On the torch transport (a gloo/NCCL group is initialized) ``fully_shard`` *is* PyTorch's: the
program gets upstream FSDP2 exactly, DTensor parameters included. On XLA devices it shards the
module in place with xla_fsdp's unit (the default per-parameter layout, rows split on dim 0 as
FSDP2's ``Shard(0)``): the module stays the same object, keeps its class (``FSDP<Class>``, a
subclass of its class and of :class:`FSDPModule`) and stays where it is in its parent, so
``fully_shard`` on each block and then on the root nests as in FSDP2. What differs on XLA, and
why, is in docs/fsdp2.md; every setting this cannot honour is an error that names the way that
works, never a silent difference.
"""
from __future__ import annotations

import abc
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .collectives import resolve_transport
from .fully_sharded_data_parallel import XlaFullyShardedDataParallel
from .unit import construction, summon
from .unit.base import is_unit
from .unit.schedule import TrainingState

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle",
           "fully_shard"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_MP, _NO_OFFLOAD = MixedPrecisionPolicy(), OffloadPolicy()  # FSDP2's defaults (frozen dataclasses)


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns. On XLA the gather is part of the traced step and
    the compiler orders it, so there is nothing to wait for."""

    def wait(self) -> None:
        return None


class FSDPModule(metaclass=abc.ABCMeta):  # noqa: B024 - an ABC for register(), no abstract method
    """A module sharded by ``fully_shard``. PyTorch's ``FSDPModule`` is registered as a virtual
    subclass, so ``isinstance(m, xla_fsdp.FSDPModule)`` holds on either transport.

    On XLA the methods act on xla_fsdp's unit (the module itself); ``reshard()`` is the unit's."""

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's parameters now (not its children's); its next forward uses them
        without gathering again, then frees them as ``reshard_after_forward`` says."""
        self.take_deferred_values()  # what an init after to_empty wrote
        self._start_unshard(backward=False)
        self.finish_unshard()
        return UnshardHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates unsharded gradients locally, with no reduce-scatter
        (gradient accumulation); the first backward after ``True`` reduces the sum."""
        for unit in _units(self, recurse):
            unit.step_state.require_backward_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the full parameters (re-gathered in backward)."""
        _check_reshard_value(reshard_after_forward, self.world_size)
        for unit in _units(self, recurse):
            unit.reshard_after_forward = bool(reshard_after_forward)
            unit.post_forward_comms = None  # True reshards to every rank, as in FSDP2
            unit.disable_reshard_on_root = False  # an explicit value holds for the root too, as in FSDP2

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the full parameters after backward (FSDP2's way to save the next micro-batch's
        forward gathers in gradient accumulation); ``True`` frees them again. An optimizer step since
        (a changed shard) makes the next forward gather again, so kept parameters are never stale."""
        for unit in _units(self, recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Gather ``modules``' parameters in this module's forward, right after its own (FSDP2's
        explicit prefetch); each listed module's forward then gathers nothing. On XLA the gathers
        join this module's optimization barrier, so a compiler that keeps barriers (TPU's) does not
        hoist them earlier (XLA:CPU's removes barriers and schedules gathers itself)."""
        self._prefetch_forward = _check_prefetch_list(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """As :meth:`set_modules_to_forward_prefetch`, for backward: the gathers come at this
        module's backward (its barrier takes the incoming gradient), for modules whose backward is
        still to run. Without a list (or with an empty one), FSDP2's default: the module that ran
        forward before this one."""
        self._prefetch_backward = _check_prefetch_list(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the world size."""
        if not factor > 0:
            raise ValueError(f"xla_fsdp.fully_shard: the gradient divide factor must be positive, got {factor}")
        self.gradient_predivide_factor = 1.0
        self.gradient_postdivide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: on XLA the reduce-scatter always sums and the division is applied apart (gloo
        needs this call with a gradient divide factor; PyTorch's FSDP2 would use PREMUL_SUM)."""
        self._force_sum_reduction = bool(enable)

    def set_sync_after_optimizer_step(self, enabled: bool, *, recurse: bool = True) -> None:
        """xla_fsdp only (PyTorch's FSDP2 has no such method: leave the call out of programs that also
        run there). Whether an optimizer step over this module's shards ends the traced step on XLA
        with a graph cut, as ``torch_xla.sync()`` after the step would, where the program marks no
        steps itself (default: on; a program with its own syncs is left as it is). Off: the graph
        grows across steps until the program's own cut."""
        for unit in _units(self, recurse):
            for group in unit.gather_groups:
                group.sync_after_optimizer_step = bool(enabled)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted. xla_fsdp finishes every backward's reduction within that backward, so there is
        no deferred work for the last one to wait for."""
        self._is_last_backward = bool(is_last_backward)


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
                ignored_params: Optional[set] = None) -> nn.Module:
    """PyTorch's ``torch.distributed.fsdp.fully_shard``: same signature and meaning.

    Torch transport: PyTorch's own function. XLA: the module's parameters not owned by an inner
    ``fully_shard`` are sharded on dim 0; the module is converted in place and returned."""
    if resolve_transport(None) == "torch":
        from torch.distributed.fsdp import fully_shard as upstream
        return upstream(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                        offload_policy=offload_policy, ignored_params=ignored_params)
    if not isinstance(module, nn.Module):
        raise NotImplementedError("xla_fsdp.fully_shard on XLA takes one module; call it on each module "
                                  "(a list of modules sharing one group is not supported)")
    if module.__dict__.get("_xla_fsdp_contents"):
        # the contents of a module sharded in place, met by a loop such as ``for m in model.modules(): if
        # isinstance(m, Block): fully_shard(m)`` (they are a Block too): already sharded with it
        return module
    if is_unit(module):
        raise ValueError(f"xla_fsdp.fully_shard: {type(module).__name__} is already sharded; call "
                         "fully_shard once per module")
    options = _unit_options(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                            ignored_params)
    post_forward_size = options.pop("post_forward_size")
    on_meta = any(t.is_meta for _, m in construction.owned_modules(module)
                  for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None)
    if on_meta:  # as FSDP2: storage only; the program's to_empty + init give the values
        options["param_init_fn"] = _storage_only
    for p in ignored_params or ():
        p._xla_fsdp_ignored = True
    module = _shard_in_place(module, options, mp_policy.cast_forward_inputs)
    module._awaiting_to_empty = on_meta
    if post_forward_size is not None:
        module.post_forward_comms = module.comms.within_groups_of(post_forward_size)
    return module


def _storage_only(module: nn.Module) -> None:
    """Uninitialized host storage for the meta parameters and buffers this unit owns."""
    for _, m in construction.owned_modules(module):
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device="cpu")


# ----------------------------------------------------------------------------- the settings
def _unit_options(module: nn.Module, mesh: Any, reshard_after_forward: Any, shard_placement_fn: Any,
                  mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                  ignored_params: Any) -> Dict[str, Any]:
    """FSDP2's arguments as the unit's keywords, or an error naming what works instead."""
    _check_mesh(mesh)
    _check_ignored(module, ignored_params)
    if shard_placement_fn is not None:
        _check_placements(module, shard_placement_fn)
    post_forward_size = None
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = _int_reshard(reshard_after_forward, _world_size(mesh))
        if not isinstance(reshard_after_forward, bool):
            post_forward_size, reshard_after_forward = reshard_after_forward, True
    param_dtype = mp_policy.param_dtype or torch.float32
    reduce_dtype = mp_policy.reduce_dtype or param_dtype
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                        ("output_dtype", mp_policy.output_dtype or torch.float32)):
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"xla_fsdp.fully_shard: MixedPrecisionPolicy.{name} must be float32, bfloat16 or "
                             f"float16, got {dtype}")
    if reduce_dtype not in (param_dtype, torch.float32):
        raise NotImplementedError(
            f"xla_fsdp.fully_shard on XLA: reduce_dtype={reduce_dtype} with param_dtype={param_dtype} is not "
            "supported; reduce in param_dtype (reduce_dtype=None) or in float32")
    return dict(
        reshard_after_forward=None if reshard_after_forward is None else bool(reshard_after_forward),
        # FSDP2 keeps the root's parameters after forward only when reshard_after_forward is unset
        disable_reshard_on_root=reshard_after_forward is None,
        flatten_parameters=False, shard_param_on_dim_0=True,
        compute_dtype=param_dtype, fp32_reduce_scatter=reduce_dtype == torch.float32 != param_dtype,
        output_dtype=mp_policy.output_dtype,
        cpu_offload=offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else False,
        post_forward_size=post_forward_size,  # taken out again by fully_shard
    )


def _check_ignored(module: nn.Module, ignored_params: Any) -> None:
    """FSDP2's ``ignored_params`` are the module's parameters it leaves alone: not sharded, their
    gradients not reduced. fully_shard marks each so the unit does not take it (unit/construction.py)."""
    if not ignored_params:
        return
    own = {id(p) for p in module.parameters()}
    for p in ignored_params:
        if not isinstance(p, nn.Parameter) or id(p) not in own:
            raise ValueError("xla_fsdp.fully_shard: ignored_params must hold parameters of the module passed to "
                             f"fully_shard; got {type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}")


def _check_mesh(mesh: Any) -> None:
    if mesh is None:
        return
    if getattr(mesh, "ndim", 1) != 1:
        raise NotImplementedError(
            "xla_fsdp.fully_shard on XLA: a 2-D mesh (HSDP) is not supported; use "
            "XlaFullyShardedDataParallel(sharding_strategy='HYBRID_SHARD', hybrid_shard_size=N)")
    import torch_xla.runtime as xr
    if mesh.size() != xr.world_size():
        raise NotImplementedError(
            f"xla_fsdp.fully_shard on XLA: the mesh has {mesh.size()} devices, the job {xr.world_size()}; a 1-D "
            "mesh over every device (or mesh=None) is supported")


def _check_placements(module: nn.Module, fn: Callable[[nn.Parameter], Any]) -> None:
    from torch.distributed.tensor import Shard
    for name, param in module.named_parameters():
        placement = fn(param)
        if placement is not None and placement != Shard(0):
            raise NotImplementedError(
                f"xla_fsdp.fully_shard on XLA: shard_placement_fn gave {placement} for {name}; only Shard(0) "
                "(the default) is supported")


def _check_reshard_value(value: Any, world_size: Optional[int]) -> None:
    if isinstance(value, bool):
        return
    raise ValueError(
        f"xla_fsdp: set_reshard_after_forward takes True or False, as FSDP2's does, not {value!r}; an int (the "
        "size of the groups that keep the parameters' pieces from forward to backward) goes to "
        "fully_shard(module, reshard_after_forward=N)")


def _world_size(mesh: Any) -> int:
    if mesh is not None:
        return mesh.size()
    import torch_xla.runtime as xr
    return xr.world_size()


def _int_reshard(value: Any, world_size: int) -> Union[bool, int]:
    """FSDP2's int ``reshard_after_forward``, as FSDP2 reads it: the world size means True, 1 means
    False (with FSDP2's warning), and a factor in between is the size of the groups of consecutive
    ranks that keep the parameters' pieces from forward to backward (returned as the int)."""
    if not isinstance(value, int) or value < 1 or value > world_size or world_size % value:
        raise ValueError(f"xla_fsdp.fully_shard: reshard_after_forward as an int must be a factor of the world "
                         f"size {world_size}, not {value!r} (or pass True or False)")
    if value == world_size:
        return True
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                      "reshard_after_forward=True (bool)", stacklevel=4)
        return False
    return value


def _check_prefetch_list(modules: Iterable[Any], method: str) -> List[nn.Module]:
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"xla_fsdp: {method} takes modules that fully_shard converted; got "
                             f"{type(m).__name__}")
    return modules


def _units(module: nn.Module, recurse: bool) -> List[nn.Module]:
    return [m for m in module.modules() if is_unit(m)] if recurse else [module]


# ----------------------------------------------------------------------------- in place
_CLASSES: Dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``: the unit first (its forward, state dict and hooks), then FSDP2's methods,
    then the module's own class (``isinstance`` holds; its other methods and properties stay)."""
    if cls not in _CLASSES:
        # containers (nn.Sequential, nn.ModuleList) iterate and count their own contents
        namespace = {name: _delegate(name) for name in ("__iter__", "__len__") if hasattr(cls, name)}
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (_InPlaceUnit, FSDPModule, cls), namespace)
    return _CLASSES[cls]


def _delegate(name: str) -> Callable[..., Any]:
    return lambda self, *args: getattr(self._fsdp_wrapped_module, name)(*args)


class _InPlaceUnit(XlaFullyShardedDataParallel):
    """The unit when it is the module itself: its original contents live in ``_fsdp_wrapped_module``
    (the same class, unconverted). A public attribute the program sets on the module afterwards
    goes there too (unless the unit has it), so the module's own forward sees it."""

    def _plan(self, options: Any) -> None:
        super()._plan(options)
        self.buffer_dtype = None  # FSDP2 leaves buffers as they are (the wrapper casts them to compute_dtype)
        self._prefetch_forward: List[nn.Module] = []
        self._prefetch_backward: List[nn.Module] = []
        self._prefetch_backward_by_default = True
        self._is_last_backward = True
        self._force_sum_reduction = False
        self._late_init_units: List[nn.Module] = []  # to_empty's units, until their init is sharded
        self._init_checked = False  # whether a first forward found every meta-built unit given values
        self._awaiting_to_empty = False  # built from the meta device, not yet to_empty'd

    def to_empty(self, *, device: Union[str, torch.device], recurse: bool = True) -> "_InPlaceUnit":
        """FSDP2's meta-device init: ``fully_shard`` on the meta module, then ``to_empty`` and the
        program's own init (``reset_parameters()``, ``init_weights()``). Here the module's parameter
        attributes become full-size uninitialized parameters on the device, so the init sees the
        shapes and draws the values the unsharded model would; the next forward (or a state dict,
        or ``summon_full_params``) keeps each rank's rows. ``model.parameters()`` stays the shards,
        for the optimizer. On XLA the full tensors are lazy: computed and cut in one graph."""
        device = torch.device(device)
        self._check_init_device(device)
        device = device if device.type == "cpu" else self.comms.device  # "xla" means this rank's device
        units = summon.units_under(self, recurse)
        for unit in units:
            if unit.training_state is not TrainingState.IDLE:
                raise RuntimeError("xla_fsdp.fully_shard: to_empty inside forward or backward; call it before "
                                   "training, as FSDP2's meta-device init does")
            unit.begin_late_init(device)
            unit._awaiting_to_empty = False
        self._late_init_units = units
        return self

    def _check_init_device(self, device: torch.device) -> None:
        ours = self.comms.device
        if device.type not in (ours.type, "cpu") or device.type == "cpu" and self._offload is None:
            raise ValueError(f"xla_fsdp.fully_shard: to_empty(device={str(device)!r}) but this module is sharded on "
                             f"{ours}; pass device=torch_xla.device() (the XLA device this rank trains on)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._init_checked:
            unset = [name or "the root" for name, m in self.named_modules() if getattr(m, "_awaiting_to_empty", False)]
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
            self.comms.sync()  # on XLA: the init and its cut run now, apart from the step
        return super().forward(*args, **kwargs)

    def apply(self, fn: Callable[[nn.Module], None]) -> "_InPlaceUnit":
        """``fn`` on every module once, on the full parameters (written back to the shards): the
        contents hold the module's own state and are an instance of its class, so ``fn`` runs on them
        and not again on this converted module, as FSDP2 runs it once on its one object. Between
        ``to_empty`` and the first forward the module already holds full parameters for the init (on
        the host with ``CPUOffloadPolicy``, so ``fn`` draws from the CPU generator, as unsharded)."""
        if any(group.in_late_init() for group in self.gather_groups):
            self._fsdp_wrapped_module.apply(fn)
            return self
        with summon.summon_full_params(self, recurse=False):
            self._fsdp_wrapped_module.apply(fn)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if (name.startswith("_") or name in self.__dict__ or not self.__dict__.get("_fsdp2_ready")
                or hasattr(XlaFullyShardedDataParallel, name) or hasattr(FSDPModule, name)):
            super().__setattr__(name, value)
        else:
            setattr(self._fsdp_wrapped_module, name, value)


def _shard_in_place(module: nn.Module, options: Dict[str, Any], cast_forward_inputs: bool) -> nn.Module:
    cls = type(module)
    inner = cls.__new__(cls)
    inner.__dict__ = module.__dict__  # the module's parameters, buffers, children, hooks, attributes
    module.__dict__ = {}
    object.__setattr__(inner, "_xla_fsdp_contents", True)
    module.__class__ = _fsdp_class(cls)
    XlaFullyShardedDataParallel.__init__(module, inner, **options)
    for group in module.gather_groups:
        _give_dtensor_calls(group)
        group.sync_after_optimizer_step = True
    module.cast_forward_inputs = cast_forward_inputs
    module._fsdp2_ready = True
    return module


class _NoDeviceMesh:
    """A shard's ``device_mesh``: XLA's per-device ranks have no DeviceMesh for DTensor, so any use
    (``distribute_tensor(full, p.device_mesh, p.placements)`` first asks ``bool(mesh)``) is one
    clear error naming the way to load full weights."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "xla_fsdp.fully_shard on XLA: parameters are shards, not DTensors, and have no device mesh "
            "(distribute_tensor and load_state_dict(assign=True) cannot place them); load full weights with "
            "xla_fsdp.checkpoints.state_dict_api.set_model_state_dict(model, full_state_dict, "
            "options=StateDictOptions(full_state_dict=True))")

    __bool__ = __len__ = __iter__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and the like look for optional dunders
            raise AttributeError(name)
        self._refuse()

    def __repr__(self) -> str:
        return "<no DeviceMesh: an xla_fsdp shard on XLA>"


_NO_DEVICE_MESH = _NoDeviceMesh()


def _give_dtensor_calls(group: Any) -> None:
    """The calls FSDP2 programs make on a sharded parameter (a DTensor there), on the shard:
    ``placements`` (``Shard(0)``), ``to_local()`` (this rank's rows, without the padding rows) and
    ``full_tensor()`` (a collective, as DTensor's: every rank gets the whole parameter);
    ``device_mesh`` is there and refuses every use, naming the supported way."""
    from torch.distributed.tensor import Shard
    shard, layout, rank = group.shard, group.layout, group.comms.rank
    rows_each = layout.shard_shape[0]
    own_rows = max(0, min(rows_each, layout.rows - rank * rows_each))
    unit_group, param = weakref.ref(group), weakref.ref(shard)  # no reference cycle through the shard
    shard.placements = (Shard(0),)
    shard.device_mesh = _NO_DEVICE_MESH
    shard.to_local = lambda: param()[:own_rows]
    shard.full_tensor = lambda: unit_group().gather_values()[0]
