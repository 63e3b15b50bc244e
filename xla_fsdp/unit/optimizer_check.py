"""The optimizer check every optimizer step runs once a unit exists: an optimizer built before wrapping
(it holds emptied originals) is refused, and one whose update depends on a parameter's shape is
warned about once (its steps on shards differ from unsharded training)."""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, List, Optional, Tuple

import torch

from ..advice import only_warns

#: set on every shard of a model whose groups the program built from original names (optimizer_param_groups,
#: shard_names_of): its groups are not taken for a no-decay recipe applied to shards, whatever split they make
GROUPED_BY_ORIGINAL_NAME = "_xla_fsdp_grouped_by_original_name"

#: optimizers whose update of a parameter depends on its shape or on its values as a whole, not element by element
_SHAPE_DEPENDENT = ("Adafactor", "LBFGS", "Lamb", "LAMB", "Lars", "LARS", "Shampoo", "Muon")


@only_warns
def _warn_if_shape_dependent(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that factors a matrix by its rows and columns (Adafactor), scales a whole
    parameter by its norm (LAMB, LARS) or works on whole matrices (Shampoo, Muon) sees 1-D (or dim-0)
    shards here, so its steps differ from unsharded training: said once, at its first step."""
    name = type(optimizer).__name__
    holds_shards = any(getattr(p, "_xla_fsdp_reduced", False) for g in optimizer.param_groups for p in g["params"])
    if holds_shards and any(n in name for n in _SHAPE_DEPENDENT):
        warnings.warn(
            f"xla_fsdp: {name} updates a parameter from its shape or its values as a whole, but it holds xla_fsdp's "
            "shards (1-D or dim-0 blocks of each parameter), so its steps differ from unsharded training. Use an "
            "element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...), which are exact; see docs/usage.md.",
            stacklevel=3)


# The usual no-decay recipes: by name (transformers' ["bias", "LayerNorm.weight"]) and by dimension
# (nanoGPT, timm: p.dim() >= 2 decays). Each is applied to what the program sees: the shards' names and
# dims, and to the original parameters the shards hold.
def _no_decay_by_name(names: List[str]) -> bool:
    return any("bias" in n or "LayerNorm.weight" in n or "layer_norm.weight" in n for n in names)


def _no_decay_by_dim(shapes: List[Tuple[int, ...]]) -> bool:
    return any(len(s) < 2 for s in shapes)


# The Hugging Face Trainer's rule (transformers 4.4x-4.5x get_decay_parameter_names): parameters of
# nn.LayerNorm modules, and names that match these patterns (lowercased), get no weight decay.
_TRAINER_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                             r"_norm(?:$|\.)")]


def _no_decay_by_trainer_name(name: str) -> bool:
    return any(p.search(name.lower()) for p in _TRAINER_PATTERNS)


def _no_decay_by_trainer(group: Any) -> List[bool]:
    return [isinstance(ref.slots[0][0], torch.nn.LayerNorm) or _no_decay_by_trainer_name(ref.fqn)
            for ref in group.refs]


#: (what the message calls it, its decision on a shard, its decisions on the originals a shard holds)
_RECIPES = (
    ("by name (['bias', 'LayerNorm.weight'])",
     lambda p: _no_decay_by_name([_shard_name(p)]),
     lambda grp: [_no_decay_by_name([n]) for n in grp.names]),
    ("by dimension (p.dim() < 2)",
     lambda p: _no_decay_by_dim([tuple(p.shape)]),
     lambda grp: [_no_decay_by_dim([tuple(s)]) for s in _member_shapes(grp)]),
    ("as the Hugging Face Trainer does (nn.LayerNorm modules; names with bias or norm)",
     lambda p: _no_decay_by_trainer_name(_shard_name(p)), lambda grp: _no_decay_by_trainer(grp)),
)


def _set_by_program(group: dict, defaults: dict, key: str) -> bool:
    """Whether the program put ``key`` in this parameter group itself, rather than the optimizer
    filling it from its defaults. ``add_param_group`` appends the defaults a group lacks after the
    program's own keys, in the defaults' order: a key followed by a default that comes before it in
    that order was the program's. (Keys that are not defaults say nothing: an LR scheduler adds
    ``initial_lr`` after construction.)"""
    if key not in defaults or group.get(key) != defaults[key]:
        return True
    order = list(defaults)
    keys = list(group)
    return any(k in defaults and order.index(k) < order.index(key) for k in keys[keys.index(key) + 1:])


def _refuse_recipes_applied_to_shards(optimizer: torch.optim.Optimizer) -> None:
    """Parameter groups that split weight decay the way a no-decay recipe splits the shards, where the
    same recipe splits the original parameters otherwise: the program applied its recipe to the
    shards' names or dims (1-D blocks, names the unit made), so the optimizer would decay the wrong
    parameters, silently. Also the recipe that drops its empty group (``[g for g in groups if
    g["params"]]``): one group left, whose weight decay the program set itself (not the optimizer's
    default), and which the recipe gives every shard but not every original parameter.
    Refused at the first step with the supported way."""
    holding = [g for g in optimizer.param_groups if any(hasattr(p, "_xla_fsdp_group") for p in g["params"])]
    decays = {float(g.get("weight_decay", 0.0) or 0.0) for g in optimizer.param_groups}
    if len(decays) < 2 and not (len(optimizer.param_groups) == 1 and holding and "weight_decay" in optimizer.defaults
                                and _set_by_program(holding[0], optimizer.defaults, "weight_decay")):
        return  # several groups of one weight decay (the HF Trainer's two at weight_decay=0) decay alike: as asked
    shards = [(p, g) for g in optimizer.param_groups for p in g["params"] if hasattr(p, "_xla_fsdp_group")]
    if not shards or all(getattr(p, GROUPED_BY_ORIGINAL_NAME, False) for p, _ in shards):
        return  # none, or groups the program built from original names: whatever split they make is its own
    no_decay_seen = [float(g.get("weight_decay", 0.0) or 0.0) == 0.0 for _, g in shards]
    # each known recipe that gives exactly this split on the shards, with where it splits the originals otherwise
    matching = [(rule, on_shard, _first_other_split(shards, on_shard, on_originals))
                for rule, on_shard, on_originals in _RECIPES if [on_shard(p) for p, _ in shards] == no_decay_seen]
    wrong = [(rule, on_shard, found) for rule, on_shard, found in matching if found is not None]
    if not wrong:
        return
    rule, on_shard, (shard, name) = wrong[0]
    # Recipes that split these shards alike cannot be told apart from the groups: one that is exact here does
    # not clear one that is not (the Trainer's rule and the name list agree on GPT-2's shards, not its originals)
    also = [r for r, _, found in matching if found is None]
    alike = (f"; the recipe {also[0]} gives the same split on these shards and would be exact, but the groups "
             "cannot tell which one built them" if also else "")
    if len(decays) > 1:
        what = f"groups split weight decay {rule} applied to the shards, which gives another split than on the " \
            f"original parameters{alike}"
    else:
        value = next(iter(decays))
        what = (f"groups set one weight decay ({value:g}) on every shard, which is what the no-decay "
                f"recipe {rule} gives every shard but not every original parameter (a recipe that drops "
                f"its empty group); to {'decay every parameter alike' if value else 'decay none'}, pass "
                f"weight_decay={value:g} to the optimizer, not in its groups")
    raise RuntimeError(
        f"xla_fsdp: this {type(optimizer).__name__}'s {what} (e.g. '{name}' would get "
        f"{'no ' if on_shard(shard) else ''}weight decay, unlike unsharded training): shards are 1-D blocks "
        "named by the unit. Build the groups from the original names with "
        "model.optimizer_param_groups(lambda name: {'weight_decay': 0.0} if <your rule on name> else {})"
        "; a Trainer: model.shard_names_of(<the names it decays on the unwrapped model>) "
        "(docs/usage.md, 'Optimizer groups by original name').")


def _first_other_split(shards: List[Tuple[torch.Tensor, dict]], on_shard: Any, on_originals: Any
                       ) -> Optional[Tuple[torch.Tensor, str]]:
    """The first shard, with an original name it holds, where the recipe decides otherwise on the original."""
    for p, _ in shards:
        group = p._xla_fsdp_group
        wanted = on_originals(group)
        if len(set(wanted)) > 1 or wanted[0] != on_shard(p):
            return p, next(n for n, w in zip(group.names, wanted) if w != on_shard(p))
    return None


def _shard_name(shard: torch.Tensor) -> str:
    """The name the program saw for a shard in named_parameters() (its last part): '_fsdp_shard...'
    with the original dots replaced, 'flat_param_N', or fully_shard's: the original's."""
    from ..shard_names import SHARD_PREFIX, SHARD_SEPARATOR
    group = shard._xla_fsdp_group
    if group.flat:
        return group.flat_name or "flat_param"
    if group.in_place:  # fully_shard: the shard is registered under the original's own name
        return group.names[0]
    return SHARD_PREFIX + group.names[0].replace(".", SHARD_SEPARATOR)


def _member_shapes(group: Any) -> List[Tuple[int, ...]]:
    return [tuple(s) for s in group.layout.shapes] if group.flat or not group.dim0 else [tuple(group.full_shape)]


def _shard_groups(optimizer: torch.optim.Optimizer) -> List[Any]:
    seen: dict = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            group = getattr(p, "_xla_fsdp_group", None)
            if group is not None:
                seen.setdefault(id(group), group)
    return list(seen.values())


@dataclasses.dataclass
class _Watch:
    """What the check keeps about one optimizer, in one attribute of it (``_xla_fsdp_watch``)."""

    #: the parameter count it was checked at (None: never checked; its post-hook not yet registered)
    checked: Optional[int] = None
    #: the gather groups whose shards it holds
    groups: List[Any] = dataclasses.field(default_factory=list)
    #: the XLA step mark after its last step (see :func:`sync_after_step`)
    step_mark: Any = None


def _watch(optimizer: torch.optim.Optimizer) -> _Watch:
    watch = optimizer.__dict__.get("_xla_fsdp_watch")
    if watch is None:
        watch = optimizer._xla_fsdp_watch = _Watch()
    return watch


def sync_after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer step over shards of a ``fully_shard`` module ends the traced step when the
    program marks no steps itself (FSDP2 programs do not): on XLA a graph cut right after it, as
    ``torch_xla.sync()`` there would do (the device seed advances as there), so each step compiles
    once and runs as one graph. Without it the graph of step k+1 grows from step k's and every step
    takes longer than the last. Whether the program marks steps is seen at its second step: if a
    cut ran since the first step's end, the program has its own and nothing is added (its graphs
    and random draws stay as they were). Off with ``model.set_sync_after_optimizer_step(False)``."""
    watch = _watch(optimizer)
    group = next((g for g in watch.groups if g.sync_after_optimizer_step), None)
    if group is None or not group.comms.compiles_step:
        return
    mark = watch.step_mark
    if mark is not None and not group.comms.marked_since(mark):
        group.comms.sync(keep_rng=False)
    watch.step_mark = group.comms.step_mark()


def install_optimizer_check() -> None:
    """Once per process: every optimizer step first makes sure the optimizer does not hold
    parameters that xla_fsdp replaced with shards. An optimizer built before wrapping holds the
    emptied originals: its steps would change nothing, and training would go on, silently wrong."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .. import patches

    patches.add_hook("hook: torch.optim optimizer step pre-hook (xla_fsdp optimizer check)",
                     lambda: register_optimizer_step_pre_hook(_check),
                       "an optimizer built before wrapping holds emptied originals: refuse its step")


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The pre-hook :func:`install_optimizer_check` registers (checked again when the parameter count changes)."""
    watch = _watch(optimizer)
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if watch.checked == count:
        return
    stale = sum(1 for g in optimizer.param_groups for p in g["params"] if getattr(p, "_xla_fsdp_sharded", False))
    if stale:
        raise RuntimeError(
            f"xla_fsdp: this {type(optimizer).__name__} was built before the model was wrapped: {stale} of its "
            f"{count} parameters are originals that XlaFullyShardedDataParallel replaced with shards, so step() "
            "would change nothing. Build the optimizer after wrapping, from the wrapped model: "
            "optimizer = torch.optim.AdamW(fsdp_model.parameters(), ...)")
    _warn_if_shape_dependent(optimizer)
    _refuse_recipes_applied_to_shards(optimizer)
    if watch.checked is None:
        optimizer.register_step_post_hook(sync_after_step)
    watch.groups = _shard_groups(optimizer)
    watch.checked = count
