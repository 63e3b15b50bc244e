"""What a unit's shell (``XlaFullyShardedDataParallel``, ``fully_shard``'s unit) is made of besides its
runtime: its keywords read into ``UnitOptions``, torch_xla's attributes that read and replace the
frozen settings, and the small pieces its constructor wires up."""
from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict

import torch.nn as nn

from .options import UnitOptions

if TYPE_CHECKING:
    from .runtime import UnitRuntime

_DEBUG_DUMMIES = ("_debug_dummy_forward_pass", "_debug_dummy_all_gather_op", "_debug_dummy_all_reduce_op",
                  "_debug_dummy_reduce_scatter_op", "_debug_dummy_optimization_barrier_op")


def options_from_keywords(keywords: Dict[str, Any]) -> UnitOptions:
    """The constructor's keywords as :class:`UnitOptions`: deprecated and debug-only ones resolved."""
    keywords = dict(keywords)
    keywords.pop("auto_wrap_policy", None)
    keywords.pop("auto_wrapper_callable", None)
    mark_step = keywords.pop("mark_step_on_finalization", None)
    if mark_step is not None:
        warnings.warn("mark_step_on_finalization is deprecated; use sync_on_finalization",
                      DeprecationWarning, stacklevel=3)
        keywords["sync_on_finalization"] = mark_step
    if any(keywords.pop(name, False) for name in _DEBUG_DUMMIES):
        raise ValueError("xla_fsdp runs real collectives only; to test without a TPU use "
                         "PJRT_DEVICE=CPU with CPU_NUM_DEVICES=N, or transport='torch' with gloo.")
    return UnitOptions(**keywords)


def on_tpu(comms: Any) -> bool:
    if comms.name != "xla":
        return False
    import torch_xla.runtime as xr
    return xr.device_type() not in ("CPU",)


class Setting:
    """A unit attribute torch_xla has (``compute_dtype``, ``fp32_reduce_scatter``, ...): read from the
    unit's frozen settings. A step-time setting (read at every step) can be set: that replaces the
    settings, so the next step does what it shows. A construction-time one (``fixed=True``: the
    shards, groups and buffers were made for it) is read-only after construction: an assignment
    that would only change what the attribute says is an error naming the keyword to pass instead."""

    def __init__(self, fixed: bool = False):
        self.fixed = fixed

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, unit: Any, owner: type) -> Any:
        if unit is None:
            return self
        return getattr(unit._runtime.settings, self.name)

    def __set__(self, unit: Any, value: Any) -> None:
        if self.fixed:
            raise AttributeError(
                f"xla_fsdp: {self.name} is fixed when the unit is built (its shards, gather groups and buffers are "
                f"made for it), so setting it afterwards would change only what it reports: pass "
                f"{self.name}={value!r} to {type(unit).__name__}(...) instead")
        unit._runtime.replace_settings(**{self.name: value})


def setting_attributes(cls: type) -> type:
    """Give the unit class torch_xla's setting attributes: one :class:`Setting` per ``UnitSettings`` field
    declared ``fixed()`` or ``step()`` (the declaration is the one place that says which)."""
    import dataclasses

    from .settings import UnitSettings
    for field in dataclasses.fields(UnitSettings):
        kind = field.metadata.get("attribute")
        if kind is not None:
            descriptor = Setting(fixed=kind == "fixed")
            descriptor.__set_name__(cls, field.name)
            setattr(cls, field.name, descriptor)
    return cls


def take_before_state_dict(runtime: "weakref.ref[UnitRuntime]", module: nn.Module, prefix: str,
                            keep_vars: bool) -> None:
    alive = runtime()
    if alive is not None:
        alive.take_deferred_values()


class FlattenFlag(int):
    """The unit's ``flatten_parameters`` option (torch_xla's public attribute, true or false) that
    can also be called: a wrapped ``nn.LSTM`` / ``nn.GRU`` is still asked ``rnn.flatten_parameters()``
    by the code around it, which then reaches the layer's own method."""

    def __new__(cls, value: bool, unit: nn.Module) -> "FlattenFlag":
        flag = super().__new__(cls, bool(value))
        flag._unit = unit
        return flag

    def __repr__(self) -> str:
        return repr(bool(self))

    def __call__(self) -> None:
        method = getattr(self._unit._fsdp_wrapped_module, "flatten_parameters", None)
        if not callable(method):
            raise TypeError("xla_fsdp: flatten_parameters is this unit's option (a bool), not a method of the "
                            "wrapped module")
        method()


#: why a sharded model cannot be deep-copied, and what works instead
DEEPCOPY_REFUSED = (
    "xla_fsdp: a sharded model ({name}) cannot be deep-copied: its units hold this "
    "rank's shards, process group and gather state. Copy the model before wrapping and wrap the copy "
    "the same way (an EMA teacher: `teacher = FSDP(copy.deepcopy(net), **same_arguments)` before "
    "`student = FSDP(net, **same_arguments)`; its shards then pair with the student's), or take a "
    "full copy with xla_fsdp.checkpoints.full_state_dict(model)")
