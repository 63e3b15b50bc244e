"""Original parameter names behind shards: how flat shards are grouped and named, name prefixes of
nested units, and optimizer groups chosen by original name."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch.nn as nn

from ..shard_names import SHARD_PREFIX, SHARD_SEPARATOR, WRAPPED, clean_name, readable_key  # noqa: F401
from .base import ShardedUnit, unit_of
from .optimizer_check import GROUPED_BY_ORIGINAL_NAME


def hashable(value: Any) -> Any:
    """A dict of options (or any value) as a hashable key."""
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    return value


def flat_parts(
    refs: list, flatten_group_fn: Optional[Callable[[str, nn.Parameter], Any]]
) -> Tuple[List[list], List[str]]:
    """Parameters split by ``flatten_group_fn`` (one flat shard per key, so optimizer groups can be
    formed by name), trainable ones first, frozen ones in shards of their own split the same way.
    Names as torch_xla: ``flat_param_0`` (trainable), ``flat_param_1`` (frozen), then 2, 3...
    Parameters of different dtypes (a bf16 base with fp32 LoRA weights) never share a flat shard.

    Vectors (norm scales, biases) never share a flat shard with matrices: on XLA the fused
    normalization that backward recomputes reads its scale straight from the gathered buffer, which
    kept a unit's whole gathered weights alive until its backward; and the usual "no weight decay on
    vectors" rule then needs no ``flatten_group_fn``. Frozen parameters are split by the same rule,
    so a frozen copy of a model (an EMA teacher, ``requires_grad_(False)`` before wrapping) has shards
    that pair one to one with the trainable model's in ``zip(student.parameters(), teacher.parameters())``."""
    keyed: Dict[Any, list] = {}
    frozen_keyed: Dict[Any, list] = {}
    for r in refs:
        key = flatten_group_fn(r.fqn, r.param) if flatten_group_fn else None
        into = keyed if r.param.requires_grad else frozen_keyed
        # one dtype per flat shard: parameters kept in their own dtypes (no param_storage_dtype) do not mix
        into.setdefault((r.param.dim() > 1, hashable(key), r.param.dtype), []).append(r)
    parts, names = [], []
    for index, part in enumerate(keyed.values()):
        parts.append(part)
        names.append(f"flat_param_{0 if index == 0 else index + 1}")
    next_index = max(len(keyed) + 1, 2)
    for index, part in enumerate(frozen_keyed.values()):
        parts.append(part)
        if index == 0:
            names.append("flat_param_1")
        else:
            names.append(f"flat_param_{next_index}")
            next_index += 1
    return parts, names


def wrapped_tree(module: nn.Module, prefix: str = "", remove_duplicate: bool = True
                 ) -> Iterator[Tuple[str, nn.Module]]:
    """(path, module) over ``module``'s tree as torch walks ``_modules``, every ``_fsdp_wrapped_module``
    step named (a unit's ``named_modules()`` leaves its own out: ``unit/tree_names.py``)."""
    memo: set = set()
    stack = [(prefix, module)]
    while stack:
        path, m = stack.pop()
        if m in memo:
            continue
        if remove_duplicate:
            memo.add(m)
        yield path, m
        children = [(path + ("." if path else "") + name, child) for name, child in m._modules.items()
                    if child is not None]
        stack.extend(reversed(children))


def unit_paths(root: nn.Module) -> Iterator[Tuple[str, ShardedUnit]]:
    """(path in ``root`` of the unit's module, unit) for every unit in ``root``'s tree, each once: a
    wrapper's module is its ``_fsdp_wrapped_module``; a module ``fully_shard`` converted holds its unit
    outside the tree (``unit_of``)."""
    seen = set()
    for name, m in wrapped_tree(root):
        unit = unit_of(m)
        if unit is None or id(unit) in seen:
            continue
        seen.add(id(unit))
        yield (name if unit is not m else (f"{name}.{WRAPPED}" if name else WRAPPED)), unit


def named_units(root: nn.Module) -> Iterator[Tuple[str, ShardedUnit]]:
    """(original-name prefix, unit) for ``root`` and the units nested in it."""
    for path, unit in unit_paths(root):
        clean = clean_name(path)
        yield (clean + "." if clean else ""), unit


def original_names_and_shards(root: ShardedUnit) -> List[Tuple[str, nn.Parameter]]:
    return [(prefix + (g.flat_name if g.flat else g.refs[0].fqn), g.shard)
            for prefix, unit in named_units(root) for g in unit.gather_groups]


def names_in_model_order(root: ShardedUnit) -> List[str]:
    """Every original parameter name (a tied parameter once, by its first name) in the order
    ``named_parameters()`` of the unwrapped model gives them: module by module in module order, a
    module's parameters in the order it registered them, whichever unit owns each. (The wrapped
    model's own ``parameters()`` lists the shards unit by unit, the root's first.)"""
    module_index = {id(m): i for i, m in enumerate(root.modules())}
    attrs: Dict[int, Tuple[str, ...]] = {}
    for _, unit in named_units(root):
        attrs.update((id(m), names) for m, names in unit.param_attrs.items())
    keyed = []
    for prefix, unit in named_units(root):
        for group in unit.gather_groups:
            for ref in group.refs:
                module, attr = ref.slots[0]  # the place of the first name (construction sorts them)
                names = attrs.get(id(module), ())
                keyed.append((module_index.get(id(module), len(module_index)),
                              names.index(attr) if attr in names else len(names), prefix + ref.fqn))
    keyed.sort(key=lambda k: k[:2])
    return [name for _, _, name in keyed]


def optimizer_param_groups(root: ShardedUnit,
                           options_fn: Callable[[str], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """See ``XlaFullyShardedDataParallel.optimizer_param_groups``."""
    groups: Dict[Any, Dict[str, Any]] = {}
    for prefix, unit in named_units(root):
        for group in unit.gather_groups:
            setattr(group.param, GROUPED_BY_ORIGINAL_NAME, True)
            names = [prefix + n for n in group.names]
            options = [options_fn(n) or {} for n in names]
            keys = [hashable(o) for o in options]
            # A frozen shard never gets a gradient, so no option can act on it: it joins the group
            # of its first parameter (flatten_group_fn does not split frozen parameters).
            if len(set(keys)) > 1 and group.requires_grad:
                pairs = sorted({(k, n) for k, n in zip(map(str, options), names)})[:4]
                raise ValueError(
                    f"xla_fsdp: one flattened shard holds parameters with different optimizer options "
                    f"({pairs}); wrap with flatten_group_fn=lambda name, p: <the same rule> so they are "
                    "flattened separately, or use flatten_parameters=False")
            entry = groups.setdefault(keys[0], dict(options[0], params=[]))
            entry["params"].append(group.param)
    return list(groups.values())


def shard_names_of(root: ShardedUnit, original_names: Iterable[str]) -> List[str]:
    """See ``XlaFullyShardedDataParallel.shard_names_of``."""
    wanted = set(original_names)
    shard_name = {id(p): n for n, p in root.named_parameters()}
    found = []
    for prefix, unit in named_units(root):
        for group in unit.gather_groups:
            setattr(group.param, GROUPED_BY_ORIGINAL_NAME, True)
            names = [prefix + n for n in group.names]
            picked = [n in wanted for n in names]
            if len(set(picked)) > 1 and group.requires_grad:
                inside = sorted(n for n, p in zip(names, picked) if p)[:2]
                outside = sorted(n for n, p in zip(names, picked) if not p)[:2]
                raise ValueError(
                    f"xla_fsdp: one flattened shard holds parameters named ({inside}) and others not ({outside}): "
                    "no shard name stands for the named ones alone. Wrap with flatten_group_fn=lambda name, p: "
                    "<the same rule> so they are flattened separately, or use flatten_parameters=False")
            if picked[0] and id(group.param) in shard_name:
                found.append(shard_name[id(group.param)])
    return found
