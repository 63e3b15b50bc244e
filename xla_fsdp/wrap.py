"""Auto-wrap policies and the ``enable_wrap``/``wrap`` context, compatible with torch_xla's names.

A policy is ``policy(module, recurse, unwrapped_params) -> bool``: with ``recurse=True`` it says
whether to look inside ``module``; with ``recurse=False`` whether to wrap it as its own unit.
Policies written for PyTorch's FSDP are taken as they are (:func:`as_policy`): functions called
``policy(module, recurse, nonwrapped_numel)`` (``torch.distributed.fsdp.wrap``'s, ``_or_policy``,
PEFT's ``fsdp_auto_wrap_policy``) and ``ModuleWrapPolicy`` / ``CustomPolicy`` objects.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Generator, Iterable, List, Optional, Set, Tuple, Type

import torch.nn as nn

from .unit.base import is_unit


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule (and recurse into every one)."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                 transformer_layer_cls: Set[Type[nn.Module]]) -> bool:
    """Wrap every instance of the given layer classes (e.g. transformer blocks, ResNet blocks)."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
        module: nn.Module, recurse: bool, unwrapped_params: int, min_num_params: int = int(1e8),
        force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
        exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` parameters not yet wrapped.

    Containers (``exclude_wrap_modules``, ModuleList/ModuleDict by default) are never wrapped and
    ``force_leaf_modules`` (MultiheadAttention by default) are never looked into.
    """
    force_leaf_modules = (size_based_auto_wrap_policy.FORCE_LEAF_MODULES
                          if force_leaf_modules is None else force_leaf_modules)
    exclude_wrap_modules = (size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
                            if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def _wrapped_already(module: nn.Module) -> bool:
    return is_unit(module)


_DEFAULT_WRAPPER: List[Callable] = []  # the wrapper class registers itself (imports run one way)


def set_default_wrapper(wrapper_cls: Callable) -> None:
    """Called once by :mod:`xla_fsdp.fully_sharded_data_parallel`: what :func:`enable_wrap` wraps with by default."""
    _DEFAULT_WRAPPER[:] = [wrapper_cls]


def _count_unwrapped_params(module: nn.Module) -> int:
    seen: Set[int] = set()
    total = 0
    stack = [module]
    while stack:
        m = stack.pop()
        if _wrapped_already(m):
            continue
        for p in m._parameters.values():
            if p is not None and id(p) not in seen and not getattr(p, "_xla_fsdp_sharded", False):
                seen.add(id(p))
                total += p.numel()
        stack.extend(m._modules.values())
    return total


Policy = Callable[..., bool]


def as_policy(policy: Any, root: nn.Module, ignored_modules: Iterable[nn.Module] = ()
              ) -> Tuple[Policy, Dict[nn.Module, Dict[str, Any]]]:
    """``policy`` in any accepted form as ``policy(module=, recurse=, unwrapped_params=) -> bool``, and
    the constructor keywords it gives particular modules (a ``CustomPolicy``'s dicts).

    PyTorch's FSDP calls a policy function with ``nonwrapped_numel`` where torch_xla's passes
    ``unwrapped_params``: a function that names the first and not the second gets it under its name.
    A PyTorch ``_Policy`` object (``ModuleWrapPolicy``, ``CustomPolicy``) picks its modules from the
    root at once, as PyTorch's FSDP runs it."""
    if hasattr(policy, "_run_policy") and callable(policy._run_policy):
        targets = policy._run_policy(root, set(ignored_modules), {})
        chosen = {id(m) for m in targets}
        overrides = {m: dict(kw) for m, kw in targets.items() if kw}
        return (lambda module, recurse, unwrapped_params: recurse or id(module) in chosen), overrides
    if not callable(policy):
        raise TypeError(f"xla_fsdp: auto_wrap_policy must be a callable policy(module, recurse, unwrapped_params) "
                        f"or a torch.distributed.fsdp.wrap policy object, not {type(policy).__name__}")
    if _takes_nonwrapped_numel(policy):
        return (lambda module, recurse, unwrapped_params: policy(module=module, recurse=recurse,
                                                                 nonwrapped_numel=unwrapped_params)), {}
    return policy, {}


def _takes_nonwrapped_numel(policy: Callable) -> bool:
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):  # a builtin or C callable: called as torch_xla calls policies
        return False
    return "nonwrapped_numel" in params and "unwrapped_params" not in params


def recursive_wrap(module: nn.Module, auto_wrap_policy: Callable, wrapper_cls: Callable,
                   ignored_modules: Iterable[nn.Module] = (), ignored_params: Iterable[nn.Parameter] = (),
                   only_wrap_children: bool = False, **kwargs: Any) -> Tuple[nn.Module, int]:
    """Wrap ``module``'s subtree bottom-up where the policy says so; returns (module, params wrapped).

    ``kwargs`` go to every ``wrapper_cls`` call unchanged, so child units get exactly the root's
    constructor keywords (torch_xla's version forgot some); a ``CustomPolicy``'s dict for a module
    and ``_wrap_overrides`` (set by :func:`wrap`'s callers) override them for that module.
    """
    ignored_modules = set(ignored_modules)
    policy, overrides = as_policy(auto_wrap_policy, module, ignored_modules)
    return _recursive_wrap(module, policy, overrides, wrapper_cls, ignored_modules, only_wrap_children, kwargs)


def _recursive_wrap(module: nn.Module, policy: Policy, overrides: Dict[nn.Module, Dict[str, Any]],
                    wrapper_cls: Callable, ignored_modules: Set[nn.Module], only_wrap_children: bool,
                    kwargs: Dict[str, Any]) -> Tuple[nn.Module, int]:
    if module in ignored_modules or _wrapped_already(module):
        return module, 0
    unwrapped = _count_unwrapped_params(module)
    if not policy(module=module, recurse=True, unwrapped_params=unwrapped):
        return module, 0
    wrapped_total = 0
    for name, child in list(module.named_children()):
        new_child, n = _recursive_wrap(child, policy, overrides, wrapper_cls, ignored_modules, False, kwargs)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_total += n
    remaining = unwrapped - wrapped_total
    if not only_wrap_children and policy(module=module, recurse=False, unwrapped_params=remaining):
        own = {**overrides.get(module, {}), **getattr(module, "_wrap_overrides", {})}
        return wrapper_cls(module, **{**kwargs, **own}), unwrapped
    return module, wrapped_total


class _WrapContext:
    wrapper_cls: Optional[Callable] = None
    kwargs: Dict[str, Any] = {}
    active: bool = False


@contextlib.contextmanager
def enable_wrap(wrapper_cls: Optional[Callable] = None, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Inside this context :func:`wrap` wraps modules with ``wrapper_cls(**wrapper_kwargs)``."""
    if _WrapContext.active:
        raise RuntimeError("enable_wrap contexts cannot be nested")
    if wrapper_cls is None:
        wrapper_cls = _DEFAULT_WRAPPER[0]
    _WrapContext.wrapper_cls, _WrapContext.kwargs, _WrapContext.active = wrapper_cls, dict(wrapper_kwargs), True
    try:
        yield
    finally:
        _WrapContext.wrapper_cls, _WrapContext.kwargs, _WrapContext.active = None, {}, False


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` when called inside :func:`enable_wrap`; return it unchanged outside."""
    if not _WrapContext.active:
        return module
    assert _WrapContext.wrapper_cls is not None
    return _WrapContext.wrapper_cls(module, **{**_WrapContext.kwargs, **wrap_overrides})


__all__ = ["as_policy", "always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "recursive_wrap", "enable_wrap", "wrap"]
