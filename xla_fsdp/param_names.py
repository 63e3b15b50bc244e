"""Original parameter names behind shards: how flat shards are grouped and named, name prefixes of
nested units, and optimizer groups chosen by original name."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch.nn as nn

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import XlaFullyShardedDataParallel

WRAPPED = "_fsdp_wrapped_module"  # attribute holding a unit's module, as in torch_xla
SHARD_SEPARATOR = "_FSDP_SHARD_SEPARATOR_"  # stands for "." in a shard's attribute name, as in torch_xla
SHARD_PREFIX = "_fsdp_shard" + SHARD_SEPARATOR


def clean_name(name: str) -> str:
    """A module path without the wrappers' ``_fsdp_wrapped_module`` steps."""
    return ".".join(p for p in name.split(".") if p and p != WRAPPED)


def readable_key(key: str) -> str:
    """A state-dict key as the user knows it: a shard's ``_fsdp_shard_FSDP_SHARD_SEPARATOR_...``
    attribute spelled with dots, without the wrappers' steps (for messages)."""
    parts = []
    for part in key.split("."):
        if part.startswith(SHARD_PREFIX):
            part = part[len(SHARD_PREFIX):].replace(SHARD_SEPARATOR, ".")
        parts.append(part)
    return clean_name(".".join(parts))


def hashable(value: Any) -> Any:
    """A dict of options (or any value) as a hashable key."""
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    return value


def flat_parts(refs: list, flatten_group_fn: Optional[Callable[[str, nn.Parameter], Any]]) -> Tuple[List[list], List[str]]:
    """Trainable parameters split by ``flatten_group_fn`` (one flat shard per key, so optimizer
    groups can be formed by name), frozen ones in a shard of their own.
    Names as torch_xla: ``flat_param_0`` (trainable), ``flat_param_1`` (frozen), then 2, 3...

    Vectors (norm scales, biases) never share a flat shard with matrices: on XLA the fused
    normalization that backward recomputes reads its scale straight from the gathered buffer, which
    kept a unit's whole gathered weights alive until its backward; and the usual "no weight decay on
    vectors" rule then needs no ``flatten_group_fn``."""
    keyed: Dict[Any, list] = {}
    for r in refs:
        if r.param.requires_grad:
            key = flatten_group_fn(r.fqn, r.param) if flatten_group_fn else None
            keyed.setdefault((r.param.dim() > 1, hashable(key)), []).append(r)
    parts, names = [], []
    for index, part in enumerate(keyed.values()):
        parts.append(part)
        names.append(f"flat_param_{0 if index == 0 else index + 1}")
    frozen = [r for r in refs if not r.param.requires_grad]
    if frozen:
        parts.append(frozen)
        names.append("flat_param_1")
    return parts, names


def named_units(root: "XlaFullyShardedDataParallel") -> Iterator[Tuple[str, "XlaFullyShardedDataParallel"]]:
    """(original-name prefix, unit) for ``root`` and the units nested in it."""
    from .fully_sharded_data_parallel import XlaFullyShardedDataParallel
    for name, m in root.named_modules():
        if isinstance(m, XlaFullyShardedDataParallel):
            clean = clean_name(name)
            yield (clean + "." if clean else ""), m


def original_names_and_shards(root: "XlaFullyShardedDataParallel") -> List[Tuple[str, nn.Parameter]]:
    return [(prefix + (g.flat_name if g.flat else g.refs[0].fqn), g.shard)
            for prefix, unit in named_units(root) for g in unit._groups]


def optimizer_param_groups(root: "XlaFullyShardedDataParallel",
                           options_fn: Callable[[str], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """See ``XlaFullyShardedDataParallel.optimizer_param_groups``."""
    groups: Dict[Any, Dict[str, Any]] = {}
    for prefix, unit in named_units(root):
        for group in unit._groups:
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
            entry["params"].append(group.shard)
    return list(groups.values())
