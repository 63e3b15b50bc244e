"""The tensors inside a module's inputs and outputs, wherever they sit: PyTorch's pytree
containers (tuples, lists, dicts, named tuples, Hugging Face ``ModelOutput`` s) and, beyond what
pytree knows, dataclass instances (a plain ``@dataclass`` output). A unit that missed an output
tensor would register no backward hook on it: its backward would run on freed parameters."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, List

import torch
from torch.utils._pytree import tree_flatten, tree_map


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn(t)`` for every tensor ``t`` (dataclasses copied, their class kept)."""
    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if _is_dataclass_instance(x):
            new = copy.copy(x)
            for field in dataclasses.fields(x):
                object.__setattr__(new, field.name, map_tensors(fn, getattr(x, field.name)))
            return new
        return x
    return tree_map(visit, tree, is_leaf=_is_dataclass_instance)


def tensors_in(tree: Any) -> List[torch.Tensor]:
    """Every tensor in ``tree``, in order."""
    found: List[torch.Tensor] = []
    for leaf in tree_flatten(tree, is_leaf=_is_dataclass_instance)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_dataclass_instance(leaf):
            found.extend(tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found
