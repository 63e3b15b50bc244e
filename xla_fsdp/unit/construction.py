"""What a unit does once, at construction: validate the module, materialize meta parameters,
find the parameters it owns (tied ones once), and record buffer dtypes."""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..advice import only_warns
from .member_slots import ParamRef
from .shard_param import ShardParam
from .tied import LeftSlot
from .base import is_unit, unit_of


def validate_module(module: nn.Module) -> None:
    """Reject modules that cannot be a unit, with the fix in the message."""
    if is_unit(module):
        raise RuntimeError(
            "xla_fsdp: the module is already wrapped by XlaFullyShardedDataParallel; wrap it once "
            "(use auto_wrap_policy or nested wrapping of submodules instead of wrapping twice).")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or type(module).forward is nn.Module.forward:
        raise RuntimeError(
            f"xla_fsdp: {type(module).__name__} has no forward() and cannot be an FSDP unit; wrap "
            "its elements, or the module that calls them, instead.")


@only_warns
def warn_untied_embeddings(module: nn.Module) -> bool:
    """A Hugging Face model whose config ties the output embedding to the input embedding, but whose
    two weights are separate parameters: ``model.to(xla_device)`` gives each module a new parameter
    (torch cannot keep a shared one across that move), and the wrapped model would then train two
    matrices where the model before the move had one. Said once, at wrap time, with the fix;
    returns whether it was said."""
    config = getattr(module, "config", None)
    if getattr(config, "tie_word_embeddings", False) is not True:
        return False
    try:
        inputs, outputs = module.get_input_embeddings(), module.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    weight_in, weight_out = getattr(inputs, "weight", None), getattr(outputs, "weight", None)
    if not isinstance(weight_in, nn.Parameter) or not isinstance(weight_out, nn.Parameter) or weight_in is weight_out:
        return False
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    name_out = names.get(id(weight_out), "the output embedding")
    name_in = names.get(id(weight_in), "the input embedding")
    warnings.warn(
        f"xla_fsdp: {type(module).__name__}.config.tie_word_embeddings is True, but '{name_out}' is not '{name_in}' "
        "(model.to(xla_device) gives each module its own new parameter): they would train as two matrices. "
        "Call model.tie_weights() after moving it, or wrap the model on the CPU (xla_fsdp moves it and keeps "
        "the tie).", stacklevel=3)
    return True


@only_warns
def warn_embeddings_untied_by_a_move(module: nn.Module) -> None:
    """Any model (not only a Hugging Face one, which says it ties in its config): an embedding's
    weight and another embedding or linear weight of its shape that hold the same values but are two
    parameters, on an XLA device. ``model.to(xla_device)`` unties a tied pair that way (a new tensor
    per module), and a separate pair never starts equal unless it was copied. Said once, at wrap
    time, naming both, with the fix; a few equality checks on the device (one per such pair). Weights a
    nested unit already sharded (``fully_shard`` on the blocks first) hold rows only and are not compared."""
    params = {n: p for n, p in module.named_parameters() if not _sharded(p)}
    embeddings = [(f"{n}.weight" if n else "weight", m.weight) for n, m in module.named_modules()
                  if isinstance(m, nn.Embedding) and isinstance(m.weight, nn.Parameter)
                  and not _sharded(m.weight)]
    if not embeddings or embeddings[0][1].device.type != "xla":
        return
    weights = {id(m.weight) for m in module.modules()
               if isinstance(m, (nn.Linear, nn.Embedding)) and isinstance(getattr(m, "weight", None), nn.Parameter)}
    names = {id(p): n for n, p in params.items()}
    for name, weight in embeddings:
        if names.get(id(weight)) != name:  # shared with an earlier module: one parameter, tied
            continue
        for other_name, other in params.items():
            if (other_name == name or id(other) not in weights or other.shape != weight.shape
                    or other.dtype != weight.dtype or other.device != weight.device):
                continue
            if names[id(other)] != other_name or not torch.equal(other.detach(), weight.detach()):
                continue
            warnings.warn(
                f"xla_fsdp: '{other_name}' and '{name}' hold the same values but are two parameters: if the model "
                "ties them, model.to(xla_device) untied them (it gives each module a new tensor), and they would "
                "train as two matrices. Wrap the model on the CPU (xla_fsdp moves it to the device and keeps the "
                f"tie), or tie them again after moving it (model.{other_name} = model.{name}).", stacklevel=3)
            return


def _sharded(p: nn.Parameter) -> bool:
    """A nested unit's shard (the wrapper's) or a ``fully_shard`` block's sharded parameter."""
    return isinstance(p, ShardParam) or getattr(p, "_xla_fsdp_sharded", False)


def owned_modules(root: nn.Module):
    """(prefix, module) for ``root``'s subtree, not entering nested FSDP units."""
    stack = [("", root)]
    while stack:
        prefix, module = stack.pop(0)
        yield prefix, module
        for name, child in module._modules.items():
            if child is None or is_unit(child):
                continue
            stack.append((f"{prefix}{name}.", child))


def materialize_meta(module: nn.Module, param_init_fn: Optional[Callable[[nn.Module], None]],
                     device: torch.device) -> None:
    """Give meta-device parameters and buffers real storage, then initialize them.

    With ``param_init_fn`` it is called on the module; otherwise the module is moved with
    ``to_empty`` and every owned submodule's ``reset_parameters()`` is called. Nested units were
    materialized when they were built, so they are left alone.
    """
    has_meta = any(t.is_meta for _, m in owned_modules(module)
                   for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None)
    if not has_meta:
        return
    if param_init_fn is not None:
        param_init_fn(module)
    else:
        for _, m in owned_modules(module):
            for name, p in list(m._parameters.items()):
                if p is not None and p.is_meta:
                    m._parameters[name] = materialized(p, device, lambda p=p: nn.Parameter(
                        empty_on(p, device), requires_grad=p.requires_grad))
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = materialized(b, device, lambda b=b: empty_on(b, device))
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                with torch.no_grad():
                    reset()
    still_meta = [f"{prefix}{n}" for prefix, m in owned_modules(module)
                  for n, p in m._parameters.items() if p is not None and p.is_meta]
    if still_meta:
        raise RuntimeError(f"xla_fsdp: parameters still on the meta device after initialization: "
                           f"{still_meta[:5]}; make param_init_fn materialize them (e.g. to_empty + init).")


def storage_only(module: nn.Module) -> None:
    """A ``param_init_fn`` that gives the meta parameters and buffers a unit owns uninitialized host storage
    and draws nothing: for a model whose values a load gives next (``load_pretrained``, a checkpoint), so
    the program's random draws are the ones it makes unwrapped. Buffers already real (Hugging Face's
    rotary tables under ``init_empty_weights``) are kept, and a tied weight stays tied."""
    host = torch.device("cpu")
    for _, m in owned_modules(module):
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                m._parameters[name] = materialized(p, host, lambda p=p: _storage_only_parameter(p, host))
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = materialized(b, host, lambda b=b: empty_on(b, host))


def _storage_only_parameter(meta: torch.Tensor, device: torch.device) -> nn.Parameter:
    """Marked: the unit that shards it makes its shard without copying the (uninitialized) full data."""
    p = nn.Parameter(empty_on(meta, device), requires_grad=meta.requires_grad)
    p._xla_fsdp_storage_only = True
    return p


def empty_on(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized storage shaped as a meta tensor. Not ``empty_like``: on a meta tensor that goes through
    torch._refs, whose first call imports sympy (0.9 s of a 1 s sharded load, measured)."""
    return torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device=device)


def materialized(meta: torch.Tensor, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The one real tensor for a meta tensor, however many modules hold it: a tied weight (Hugging Face's
    embeddings and head, tied before wrapping) stays tied, in this unit and in the units built after it."""
    made = getattr(meta, "_xla_fsdp_materialized", None)
    if made is None or made.device != device:
        made = make()
        meta._xla_fsdp_materialized = made
    return made


def param_attrs(module: nn.Module) -> Dict[nn.Module, Tuple[str, ...]]:
    """The parameter attributes of every module this unit owns, in registration order, taken
    before the unit removes them: with the module tree they give ``named_parameters()``'s order of
    the unwrapped model (``param_names.names_in_model_order``)."""
    return {m: tuple(n for n, p in m._parameters.items() if p is not None) for _, m in owned_modules(module)}


def collect_params(module: nn.Module, leave: Set[int] = frozenset(), storage_dtype: Optional[torch.dtype] = None
                   ) -> Tuple[List[ParamRef], List[LeftSlot]]:
    """The parameters this unit owns, each once, with all the places that refer to it; and the
    places of the parameters it leaves to an enclosing unit (ids in ``leave``: tied to modules
    outside, see tied.py). Places that nested units left are owned here unless they escape too.
    Parameters must be float32, bfloat16 or float16; with ``storage_dtype`` (``param_storage_dtype``),
    float32 or that dtype."""
    refs: "OrderedDict[int, ParamRef]" = OrderedDict()
    left: List[LeftSlot] = []

    def own(p: nn.Parameter, fqn: str, m: nn.Module, name: str) -> None:
        if id(p) in refs:
            refs[id(p)].slots.append((m, name))
            refs[id(p)].aliases.append(fqn)
            return
        _check_shardable(p, fqn, storage_dtype)
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None and name == "weight":
            raise TypeError(
                f"xla_fsdp: parameter '{fqn}' belongs to {type(m).__name__}(max_norm={m.max_norm}), which renormalises "
                "in place, in forward, the rows its batch looks up: each rank would edit other rows of the shared "
                "table. Build it with max_norm=None and renormalise the table after each optimizer step on every "
                "rank, inside `with XlaFullyShardedDataParallel.summon_full_params(model):`.")
        if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and p.requires_grad:
            raise TypeError(
                f"xla_fsdp: parameter '{fqn}' belongs to {type(m).__name__}(sparse=True), whose gradient is a "
                "sparse tensor; sharded gradients are dense. Build it with sparse=False (the same training, with "
                "a dense gradient of the table's size), or freeze it (requires_grad_(False)) before wrapping.")
        refs[id(p)] = ParamRef(p, fqn, [(m, name)], [])

    for prefix, m in owned_modules(module):
        for name, p in m._parameters.items():
            if p is None or getattr(p, "_xla_fsdp_ignored", False):  # fully_shard's ignored_params: left alone
                continue
            if id(p) in leave:
                left.append(LeftSlot(m, name, p, prefix + name))
            else:
                own(p, prefix + name, m, name)
    for prefix, unit in nested_units(module):
        for slot in unit.tied_slots_left:
            if id(slot.param) in leave:
                left.append(LeftSlot(slot.module, slot.attr, slot.param, prefix + slot.fqn))
            else:
                own(slot.param, prefix + slot.fqn, slot.module, slot.attr)
    _name_in_module_order(module, refs.values())
    return list(refs.values()), left


def _name_in_module_order(module: nn.Module, refs) -> None:
    """A parameter's name is the first one ``named_parameters()`` of the unwrapped model gives it
    (module order), also when a nested unit left it here: optimizer state is keyed by that name."""
    order = {id(m): i for i, m in enumerate(module.modules())}
    for ref in refs:
        if ref.aliases:
            ranked = sorted(
                zip(ref.slots, [ref.fqn] + ref.aliases), key=lambda pair: order.get(id(pair[0][0]), len(order))
            )
            ref.slots = [slot for slot, _ in ranked]
            ref.fqn, *ref.aliases = [name for _, name in ranked]


def nested_units(module: nn.Module):
    """(name prefix, unit) for the outermost units nested in ``module``."""
    for prefix, m in owned_modules(module):
        for name, child in m._modules.items():
            if child is not None and is_unit(child):
                yield f"{prefix}{name}.", unit_of(child)


#: the dtypes a parameter is sharded in as it is (FSDP2 shards any; gradients are divided in float32, which
#: would round a float64 one)
SHARDED_AS_THEY_ARE = (torch.float32, torch.bfloat16, torch.float16)


def unit_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The one dtype of the floating parameters a unit built on ``module`` takes (float32 when it takes
    none), or None where they differ (each parameter is then kept and computed in its own)."""
    dtypes = {p.dtype for _, m in owned_modules(module) for p in m._parameters.values()
              if p is not None and p.is_floating_point() and not getattr(p, "_xla_fsdp_ignored", False)
              and not _sharded(p)}
    if not dtypes:
        return torch.float32
    return dtypes.pop() if len(dtypes) == 1 else None


def _check_shardable(p: nn.Parameter, fqn: str, storage_dtype: Optional[torch.dtype] = None) -> None:
    if getattr(p, "_xla_fsdp_sharded", False):
        raise RuntimeError(
            f"xla_fsdp: parameter '{fqn}' is shared with another FSDP unit. Tied parameters must live "
            "in one unit: let auto_wrap_policy build the units (the closest unit enclosing every user of "
            "the parameter then owns it), or wrap the modules that share it together.")
    if p.layout != torch.strided:
        raise TypeError(f"xla_fsdp: parameter '{fqn}' is a {p.layout} tensor; only dense (strided) parameters can "
                        "be sharded: store it dense (p.to_dense()) before wrapping.")
    if p.is_complex():
        raise TypeError(
            f"xla_fsdp: parameter '{fqn}' is {p.dtype}; complex parameters cannot be sharded. Store it as a "
            "real float32 parameter with a trailing dimension of 2 (torch.view_as_real(p)) and view it as "
            "complex in forward (torch.view_as_complex).")
    if not p.is_floating_point():
        raise TypeError(
            f"xla_fsdp: parameter '{fqn}' has dtype {p.dtype}; only floating-point parameters (float32, bfloat16, "
            "float16) can be sharded. Register non-trainable integer tensors as buffers instead.")
    if p.dtype not in SHARDED_AS_THEY_ARE:
        raise TypeError(
            f"xla_fsdp: parameter '{fqn}' is {p.dtype}; parameters are sharded as float32, bfloat16 or float16. "
            "Cast it before wrapping (module.float(), module.bfloat16()).")
    if storage_dtype is not None and p.dtype not in (torch.float32, storage_dtype):
        raise TypeError(
            f"xla_fsdp: parameter '{fqn}' is {p.dtype}, and param_storage_dtype={storage_dtype} takes float32 "
            "parameters or parameters of that dtype. Leave param_storage_dtype unset (each parameter is then "
            "sharded in its own dtype) or cast the module to it before wrapping.")


def cast_buffers(module: nn.Module, buffer_dtype: Optional[torch.dtype], module_prefix: str) -> Dict[str, torch.dtype]:
    """Cast floating buffers to ``buffer_dtype``; return their original dtypes by state-dict key."""
    original: Dict[str, torch.dtype] = {}
    if buffer_dtype is None:
        return original
    for prefix, m in owned_modules(module):
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != buffer_dtype:
                original[module_prefix + prefix + name] = b.dtype
                m._buffers[name] = b.to(buffer_dtype)
    return original
