"""``model.module.module``: torch_xla's wrapper-of-wrapper path to the user's module, without a
wrapper in the module tree (see ``XlaFullyShardedDataParallel.module``)."""
from __future__ import annotations

import weakref
from typing import Dict

import torch.nn as nn

_VIEW_CLASSES: Dict[type, type] = {}
_VIEWED: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()  # view -> module


def torch_xla_view(module: nn.Module) -> nn.Module:
    """``module`` seen through a subclass whose ``.module`` is ``module`` itself: the object shares
    ``module``'s ``__dict__`` (parameters, submodules, hooks, config), so everything but that one
    attribute is the user's module; it is not registered anywhere, so state-dict names do not
    change. Modules that cannot be viewed so (slots, scripted) are returned as they are."""
    cls = type(module)
    try:
        view_cls = _VIEW_CLASSES.get(cls)
        if view_cls is None:
            view_cls = _VIEW_CLASSES[cls] = type(cls.__name__, (cls,), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "module": property(lambda self: _VIEWED[self])})
        view = object.__new__(view_cls)
        view.__dict__ = module.__dict__
    except TypeError:
        return module
    _VIEWED[view] = module  # kept outside the shared dict: the user's module stays unchanged
    return view
