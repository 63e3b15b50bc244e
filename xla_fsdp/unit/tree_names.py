"""The names a wrapped model gives its modules.

``named_modules()`` answers as the unwrapped model does: each unit at its module's name, then the module
it wraps at that same name with its subtree under the names the full state dict and FSDP2 use
(``layers.0.self_attn.q_proj``, not ``layers.0._fsdp_wrapped_module.self_attn.q_proj``). Code that finds
modules by name and then looks their keys up in a full state dict needs that: PEFT derives an adapter's
keys so, and with torch_xla's and PyTorch FSDP1's nested ``_fsdp_wrapped_module`` steps its
``save_pretrained`` wrote an adapter with no tensors. ``named_parameters()``, ``named_buffers()`` and
``state_dict()`` keep torch_xla's names of the wrapped tree (:func:`named_members`)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Set, Tuple

import torch.nn as nn

from .param_names import WRAPPED, wrapped_tree


def unwrapped_named_modules(unit: nn.Module, memo: Optional[Set[nn.Module]], prefix: str,
                            remove_duplicate: bool) -> Iterator[Tuple[str, nn.Module]]:
    """``unit.named_modules(...)`` with its own ``_fsdp_wrapped_module`` step left out."""
    if memo is None:
        memo = set()
    if unit in memo:
        return
    if remove_duplicate:
        memo.add(unit)
    yield prefix, unit
    for name, child in unit._modules.items():
        if child is None:
            continue
        child_prefix = prefix if name == WRAPPED else prefix + ("." if prefix else "") + name
        yield from child.named_modules(memo, child_prefix, remove_duplicate)


def named_members(module: nn.Module, members: Callable[[nn.Module], Iterable[Tuple[str, Any]]], prefix: str,
                  recurse: bool, remove_duplicate: bool) -> Iterator[Tuple[str, Any]]:
    """torch's ``_named_members`` over the wrapped tree: the names ``state_dict()`` gives."""
    seen: Set[int] = set()
    modules = wrapped_tree(module, prefix, remove_duplicate) if recurse else [(prefix, module)]
    for module_prefix, m in modules:
        for key, value in members(m):
            if value is None or id(value) in seen:
                continue
            if remove_duplicate:
                seen.add(id(value))
            yield module_prefix + ("." if module_prefix else "") + key, value
