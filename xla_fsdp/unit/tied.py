"""Parameters tied across auto-wrapped units (GPT-2's embedding and output head under a size-based
policy): the unit that is the closest common ancestor of every module using such a parameter owns
it; the units below it leave it alone.

While a root wrapper auto-wraps its module, :func:`tied_ownership` records which modules register
each parameter. A unit built inside that context leaves the parameters that are also registered
outside its module (:func:`escaping`), and hands their places up to the unit that wraps it, which
owns them or hands them further up. Without auto-wrapping (units nested by hand) nothing records
the whole tree, and a parameter shared with an existing unit stays an error.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Generator, List, Set

import torch.nn as nn

_local = threading.local()  # XLA:CPU ranks are threads that wrap their models at the same time


@dataclass
class LeftSlot:
    """A place inside a unit's module that refers to a parameter the unit does not own."""

    module: nn.Module
    attr: str
    param: nn.Parameter
    fqn: str  # relative to the module of the unit that holds the slot list


@contextlib.contextmanager
def tied_ownership(root: nn.Module) -> Generator[None, None, None]:
    """Record, for the wrapping of ``root``'s subtree, the modules that register each parameter."""
    registered: Dict[int, Set[int]] = {}
    alive: List[object] = []  # ids stay unique only while their objects live: meta-device
    for module in root.modules():  # materialization replaces parameters during wrapping
        alive.append(module)
        for p in module._parameters.values():
            if p is not None:
                alive.append(p)
                registered.setdefault(id(p), set()).add(id(module))
    stack: List[Dict[int, Set[int]]] = getattr(_local, "stack", [])
    _local.stack = stack + [registered]
    try:
        yield
    finally:
        _local.stack = stack
        del alive


def escaping(module: nn.Module) -> Set[int]:
    """Ids of the parameters registered in ``module``'s subtree and also outside it, while an
    auto-wrap of an enclosing module is under way (else none)."""
    stack = getattr(_local, "stack", [])
    if not stack:
        return set()
    registered = stack[-1]
    inside = {id(m) for m in module.modules()}
    out: Set[int] = set()
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and not registered.get(id(p), set()) <= inside:
                out.add(id(p))
    return out
